//! `pyprobe calls`: the call flow, one line per call and return, indented by
//! stack depth, with the time from the start (µs), the thread and
//! `file:function:line` — what DTrace and SystemTap flow scripts print — and on
//! each return the call's duration, and its own time when callees took part.
//!
//! Depth comes from the same replay as the report, so unpaired streams stay
//! readable: a return without entry is marked, a return that pops frames whose
//! return never came says how many, frames running when tracing began are shown
//! at the start, and CPython 3.15's entry at a generator's creation is marked.
//! The recording is streamed; memory is bounded by the threads and stack depth.

use std::collections::HashMap;
use std::io::{Read, Seek, Write};

use rustc_hash::FxHashMap;

use crate::analyze::checkpoints::{entered, replay_wanted, Checkpoints};
use crate::analyze::recording::replay_with_plan;
use crate::analyze::{EndKind, Plan, Replay, Step};
use crate::output::flame::ViewError;
use crate::output::names::FrameNames;
use crate::output::speedscope::json_str;
use crate::output::terminal::escaped;
use crate::output::units::format_ns;
use crate::recording::{Event, EventKind, FrameRef, Qualnames, RecordingReader};

/// Indentation stops growing past this depth (the depth is still printed in JSON).
const MAX_INDENT: usize = 100;

/// Options of the call flow.
#[derive(Debug, Clone, Default)]
pub struct CallsOptions {
    /// Only what happens inside calls of this function (per thread): a function
    /// name, or `file:function` where the file is a suffix of the path.
    pub start_at: Option<String>,
    /// Only this thread.
    pub thread: Option<u32>,
    /// Only lines less than this deep (relative to `start_at`'s call, if any).
    pub max_depth: Option<usize>,
    /// JSON (an array of objects) instead of text.
    pub json: bool,
    /// Keep full file paths in the text (JSON always has them).
    pub full_paths: bool,
}

/// What the call flow held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallsSummary {
    /// Lines (or JSON objects) written.
    pub(crate) lines: u64,
    /// Call and resume events in the recording.
    pub entries: u64,
    /// Return events in the recording.
    pub returns: u64,
    /// Sample events in the recording (a sampled recording has no call flow).
    pub samples: u64,
    /// Calls of the `start_at` function seen.
    pub start_at_calls: u64,
}

/// What an earlier reading of a large recording kept with its views, so the
/// flow starts at once and, after one function's calls, reads only the parts
/// of the file that hold them.
#[derive(Debug, Clone)]
pub struct KeptReplay {
    /// The replay's plan (its first pass).
    pub plan: Plan,
    /// Where the replay can be taken up.
    pub checkpoints: Checkpoints,
    /// The recording's whole string table and qualified names.
    pub strings: Vec<String>,
    pub qualnames: Qualnames,
}

struct Matcher {
    function: String,
    file_suffix: Option<String>,
}

impl Matcher {
    fn new(spec: &str) -> Self {
        match spec.rsplit_once(':') {
            Some((file, function)) if !file.is_empty() && !function.is_empty() => Matcher {
                function: function.to_string(),
                file_suffix: Some(file.to_string()),
            },
            _ => Matcher {
                function: spec.to_string(),
                file_suffix: None,
            },
        }
    }

    fn matches(&self, names: &FrameNames<'_>, f: &FrameRef) -> bool {
        (names.string(f.function) == self.function || names.function(f) == self.function)
            && self
                .file_suffix
                .as_ref()
                .is_none_or(|s| names.string(f.file).ends_with(s.as_str()))
    }
}

enum Note {
    None,
    NoEntry,
    Popped(usize),
    Running,
    Creation,
    /// A generator or coroutine entered again.
    Resume,
}

/// One line of the flow.
struct Line {
    tid: u32,
    ts: u64,
    frame: FrameRef,
    is_call: bool,
    depth: usize,
    note: Note,
    /// On a return: the call's inclusive and exclusive time (from its entry, or
    /// from when tracing began if it was already running).
    took: Option<(u64, u64)>,
}

/// Reads the whole recording and writes its call flow to `out`.
pub fn write_calls<R: Read + Seek, W: Write>(
    reader: &mut RecordingReader<R>,
    options: &CallsOptions,
    out: W,
) -> Result<CallsSummary, ViewError> {
    write_calls_with_plan(reader, None, options, out)
}

/// As [`write_calls`], with what an earlier reading kept when there is some:
/// the first pass, reading every event before the first line, is then
/// skipped, and with `start_at` only the parts of the file entering that
/// function (and those its calls last into) are read.
pub fn write_calls_with_plan<R: Read + Seek, W: Write>(
    reader: &mut RecordingReader<R>,
    kept: Option<KeptReplay>,
    options: &CallsOptions,
    mut out: W,
) -> Result<CallsSummary, ViewError> {
    let header = reader.header().clone();
    let mut flow = Flow {
        matcher: options.start_at.as_deref().map(Matcher::new),
        options,
        summary: CallsSummary::default(),
        windows: HashMap::new(),
        matching: FxHashMap::default(),
        base: (header.start_ns != 0).then_some(header.start_ns),
        text: String::with_capacity(256),
        lines: Vec::new(),
    };
    if options.json {
        out.write_all(b"[")?;
    } else {
        writeln!(out, "{:>14} {:>8}  FLOW", "TIME(µs)", "TID")?;
    }
    match kept {
        Some(kept) if flow.matcher.is_some() => {
            let KeptReplay {
                plan,
                checkpoints,
                strings,
                qualnames,
            } = kept;
            // Only part of the events are read: the counts come from the plan.
            let counted = CallsSummary {
                entries: plan.calls,
                returns: plan.returns,
                samples: plan.samples,
                ..CallsSummary::default()
            };
            reader.know_names(strings, qualnames);
            let wanted = {
                let names =
                    FrameNames::new(reader.strings(), true).with_qualnames(reader.qualnames());
                let matcher = flow.matcher.as_ref();
                let matching = &mut flow.matching;
                // Each function entered is matched once, here, for the flow too.
                checkpoints.intervals_entering(|f| {
                    let hit = matcher.is_some_and(|m| m.matches(&names, f));
                    matching.insert(*f, hit);
                    hit
                })
            };
            if flow.base.is_none() {
                flow.base = checkpoints.first_ts();
            }
            replay_wanted(
                reader,
                plan,
                &checkpoints,
                &wanted,
                |reader, event, ts, steps, replay| {
                    flow.push(reader, event, ts, steps, replay, &mut out)?;
                    Ok::<bool, ViewError>(!flow.windows.is_empty())
                },
            )?;
            flow.summary = CallsSummary {
                lines: flow.summary.lines,
                start_at_calls: flow.summary.start_at_calls,
                ..counted
            };
        }
        kept => {
            let plan = kept.map(|k| {
                reader.know_names(k.strings, k.qualnames);
                k.plan
            });
            replay_with_plan(reader, plan, |reader, event, ts, steps, replay| {
                flow.count(event);
                flow.push(reader, event, ts, steps, replay, &mut out)
            })?;
        }
    }
    if options.json {
        out.write_all(if flow.summary.lines == 0 {
            b"]\n"
        } else {
            b"\n]\n"
        })?;
    }
    out.flush()?;
    Ok(flow.summary)
}

/// The call flow being written, one event at a time.
struct Flow<'o> {
    matcher: Option<Matcher>,
    options: &'o CallsOptions,
    summary: CallsSummary,
    /// Per thread inside a `start_at` window: the depth of that call.
    windows: HashMap<u32, usize>,
    /// Whether each function met is the `start_at` one.
    matching: FxHashMap<FrameRef, bool>,
    /// Time 0 of the lines.
    base: Option<u64>,
    text: String,
    lines: Vec<Line>,
}

impl Flow<'_> {
    /// Counts what the recording holds.
    fn count(&mut self, event: &Event) {
        match event.kind {
            EventKind::Call { .. } | EventKind::Resume { .. } => self.summary.entries += 1,
            EventKind::Return { .. } => self.summary.returns += 1,
            EventKind::Sample { .. } => self.summary.samples += 1,
            _ => {}
        }
    }

    /// Whether `event` (or a frame seeded before it) enters the `start_at`
    /// function.
    fn may_open<R: Read>(
        &mut self,
        reader: &RecordingReader<R>,
        event: &Event,
        steps: &[Step],
    ) -> bool {
        let Some(matcher) = &self.matcher else {
            return true;
        };
        let names = FrameNames::new(reader.strings(), true).with_qualnames(reader.qualnames());
        entered(event, steps).any(|f| {
            *self
                .matching
                .entry(f)
                .or_insert_with(|| matcher.matches(&names, &f))
        })
    }

    /// Writes the lines of one replayed event.
    fn push<R: Read, W: Write>(
        &mut self,
        reader: &RecordingReader<R>,
        event: &Event,
        ts: u64,
        steps: &[Step],
        replay: &Replay,
        out: &mut W,
    ) -> Result<(), ViewError> {
        let tid = event.tid;
        let start = *self.base.get_or_insert(ts);
        if self.matcher.is_some()
            && !self.windows.contains_key(&tid)
            && !self.may_open(reader, event, steps)
        {
            // Outside `start_at`'s calls nothing is written.
            return Ok(());
        }
        let lines = &mut self.lines;
        lines.clear();
        // Frames running when tracing began, seeded before this event.
        for step in steps {
            if let Step::Enter {
                code,
                depth,
                seeded: true,
                ..
            } = *step
            {
                lines.push(Line {
                    tid,
                    ts,
                    frame: code,
                    is_call: true,
                    depth,
                    note: Note::Running,
                    took: None,
                });
            }
        }
        match &event.kind {
            EventKind::Call { frame } | EventKind::Resume { frame } => {
                let resume = matches!(event.kind, EventKind::Resume { .. });
                let entered = steps.iter().find_map(|s| match *s {
                    Step::Enter {
                        depth,
                        seeded: false,
                        ..
                    } => Some(depth),
                    _ => None,
                });
                let (depth, note) = match entered {
                    Some(d) if resume => (d, Note::Resume),
                    Some(d) => (d, Note::None),
                    None if replay.just_created() => (replay.depth(tid), Note::Creation),
                    None if resume => (replay.depth(tid), Note::Resume),
                    None => (replay.depth(tid), Note::None),
                };
                lines.push(Line {
                    tid,
                    ts,
                    frame: *frame,
                    is_call: true,
                    depth,
                    note,
                    took: None,
                });
            }
            EventKind::Return { frame, .. } => {
                let mut popped = 0usize;
                let mut returned = None;
                let mut took = None;
                let mut untimed = false;
                for step in steps {
                    match *step {
                        Step::Exit(e) if e.kind == EndKind::Returned => {
                            returned = Some(e.depth);
                            took = Some((e.inclusive_ns, e.exclusive_ns));
                        }
                        Step::Exit(_) => popped += 1,
                        Step::Untimed { .. } => untimed = true,
                        Step::Enter { .. } => {}
                    }
                }
                let (depth, note) = match (returned, untimed) {
                    (Some(d), _) if popped > 0 => (d, Note::Popped(popped)),
                    (Some(d), _) => (d, Note::None),
                    (None, true) => (replay.depth(tid), Note::NoEntry),
                    // The interpreter's own shim frames: not a call.
                    (None, false) => return Ok(()),
                };
                lines.push(Line {
                    tid,
                    ts,
                    frame: *frame,
                    is_call: false,
                    depth,
                    note,
                    took,
                });
            }
            EventKind::ThreadExit => {
                self.windows.remove(&tid);
            }
            _ => {}
        }
        if self.lines.is_empty() {
            return Ok(());
        }
        let options = self.options;
        let names = FrameNames::new(reader.strings(), options.full_paths)
            .with_qualnames(reader.qualnames());
        let full = FrameNames::new(reader.strings(), true).with_qualnames(reader.qualnames());
        for l in self.lines.drain(..) {
            // The `start_at` window: from that function's call to its return.
            if let Some(m) = &self.matcher {
                if l.is_call && m.matches(&names, &l.frame) && !matches!(l.note, Note::Creation) {
                    self.summary.start_at_calls += 1;
                    self.windows.entry(l.tid).or_insert(l.depth);
                }
            }
            let level = match (&self.matcher, self.windows.get(&l.tid).copied()) {
                (None, _) => l.depth,
                (Some(_), Some(b)) => {
                    if !l.is_call && l.depth <= b && !matches!(l.note, Note::NoEntry) {
                        self.windows.remove(&l.tid);
                    }
                    l.depth.saturating_sub(b)
                }
                (Some(_), None) => continue,
            };
            if options.thread.is_some_and(|t| t != l.tid) {
                continue;
            }
            if options.max_depth.is_some_and(|m| level >= m) {
                continue;
            }
            write_line(
                &mut self.text,
                &l,
                level,
                start,
                &names,
                &full,
                options,
                &self.summary,
            );
            out.write_all(self.text.as_bytes())?;
            self.summary.lines += 1;
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn write_line(
    text: &mut String,
    l: &Line,
    level: usize,
    start: u64,
    names: &FrameNames<'_>,
    full: &FrameNames<'_>,
    options: &CallsOptions,
    summary: &CallsSummary,
) {
    use std::fmt::Write as _;
    let rel = l.ts.saturating_sub(start);
    let tid = l.tid;
    let frame = l.frame;
    text.clear();
    if options.json {
        let _ = write!(
            text,
            "{}{{\"ts_us\":{}.{:03},\"tid\":{tid},\"event\":\"{}\",\"depth\":{level},\"function\":{},\"qualname\":{},\"file\":{},\"line\":{}",
            if summary.lines == 0 { "\n" } else { ",\n" },
            rel / 1000,
            rel % 1000,
            if l.is_call { "call" } else { "return" },
            json_str(&full.string(frame.function)),
            json_str(&full.function(&frame)),
            json_str(&full.string(frame.file)),
            frame.line
        );
        match l.note {
            Note::None => {}
            Note::NoEntry => text.push_str(",\"entry_seen\":false"),
            Note::Popped(n) => {
                let _ = write!(text, ",\"popped_without_return\":{n}");
            }
            Note::Running => text.push_str(",\"running_when_tracing_began\":true"),
            Note::Creation => text.push_str(",\"generator_creation\":true"),
            Note::Resume => text.push_str(",\"resume\":true"),
        }
        if let Some((inclusive, exclusive)) = l.took {
            let _ = write!(
                text,
                ",\"inclusive_ns\":{inclusive},\"exclusive_ns\":{exclusive}"
            );
        }
        text.push('}');
    } else {
        let indent = level.min(MAX_INDENT) * 2;
        let _ = write!(
            text,
            "{:>10}.{:03} {tid:>8}  {:indent$}{} {}:{}:{}",
            rel / 1000,
            rel % 1000,
            "",
            if l.is_call { "->" } else { "<-" },
            escaped(&names.file(frame.file)),
            escaped(&names.function(&frame)),
            frame.line,
        );
        if let Some((inclusive, exclusive)) = l.took {
            let _ = write!(text, "  {}", format_took(inclusive, exclusive));
        }
        match l.note {
            Note::None => {}
            Note::NoEntry => text.push_str("  (entry not seen)"),
            Note::Popped(n) => {
                let _ = write!(text, "  (also ends {n} frame(s) whose return never came)");
            }
            Note::Running => text.push_str("  (running when tracing began)"),
            Note::Creation => text.push_str("  (creates a generator: runs nothing yet)"),
            Note::Resume => text.push_str("  (resumes)"),
        }
        text.push('\n');
    }
}

/// A return line's times: `[12.3 µs]`, or `[12.3 µs, own 4.1 µs]` when callees
/// took part of it.
fn format_took(inclusive: u64, exclusive: u64) -> String {
    let total = format_ns(inclusive);
    if exclusive < inclusive {
        format!("[{total}, own {}]", format_ns(exclusive))
    } else {
        format!("[{total}]")
    }
}
