//! `pyprobe calls`: the call flow, one line per call and return, indented by
//! stack depth, with the time from the start (µs), the thread and
//! `file:function:line` — what DTrace and SystemTap flow scripts print.
//!
//! Depth comes from the same stack tracker as the report, so unpaired streams
//! stay readable: a return without entry is marked, and a return that pops
//! frames whose return never came (an entry without return) says how many.
//! The recording is streamed; memory is bounded by the threads and stack depth.

use std::collections::HashMap;
use std::io::{Read, Write};

use crate::analyze::stacks::{Ended, StackTracker};
use crate::output::flame::{FrameNames, ViewError};
use crate::output::speedscope::json_str;
use crate::record::{EventKind, FrameRef, RecordingReader};

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
    pub lines: u64,
    /// Call events in the recording.
    pub calls: u64,
    /// Return events in the recording.
    pub returns: u64,
    /// Sample events in the recording (a sampled recording has no call flow).
    pub samples: u64,
    /// Calls of the `start_at` function seen.
    pub start_at_calls: u64,
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
        names.string(f.function) == self.function
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
}

/// Reads the whole recording and writes its call flow to `out`.
pub fn write_calls<R: Read, W: Write>(
    reader: &mut RecordingReader<R>,
    options: &CallsOptions,
    mut out: W,
) -> Result<CallsSummary, ViewError> {
    let header = reader.header().clone();
    let matcher = options.start_at.as_deref().map(Matcher::new);
    let mut summary = CallsSummary::default();
    let mut tracker = StackTracker::new();
    let mut ended: Vec<Ended> = Vec::new();
    // Per thread inside a `start_at` window: the depth of that call.
    let mut windows: HashMap<u32, usize> = HashMap::new();
    let mut base: Option<u64> = (header.start_ns != 0).then_some(header.start_ns);
    let mut line = String::with_capacity(256);

    if options.json {
        out.write_all(b"[")?;
    } else {
        writeln!(out, "{:>14} {:>8}  FLOW", "TIME(µs)", "TID")?;
    }
    while let Some(event) = reader.next_event() {
        let event = event?;
        let (tid, ts) = (event.tid, event.ts_ns);
        let start = *base.get_or_insert(ts);
        let names = FrameNames::new(reader.strings(), options.full_paths);
        let (frame, is_call, level, note) = match &event.kind {
            EventKind::Call { frame } => {
                summary.calls += 1;
                let before = tracker.depth(tid);
                tracker.call(tid, *frame, ts);
                if let Some(m) = &matcher {
                    if m.matches(&names, frame) {
                        summary.start_at_calls += 1;
                        windows.entry(tid).or_insert(before);
                    }
                }
                let level = match (&matcher, windows.get(&tid)) {
                    (None, _) => Some(before),
                    (Some(_), Some(&b)) => Some(before.saturating_sub(b)),
                    (Some(_), None) => None,
                };
                (*frame, true, level, Note::None)
            }
            EventKind::Return { frame } => {
                summary.returns += 1;
                let before = tracker.depth(tid);
                tracker.ret(tid, *frame, ts, &mut ended);
                let after = tracker.depth(tid);
                let timed = ended
                    .iter()
                    .filter(|e| matches!(e, Ended::Timed { .. }))
                    .count();
                ended.clear();
                let (depth, note) = match timed {
                    0 => (before, Note::NoEntry),
                    1 => (after, Note::None),
                    n => (after, Note::Popped(n - 1)),
                };
                let level = match (&matcher, windows.get(&tid).copied()) {
                    (None, _) => Some(depth),
                    (Some(_), Some(b)) => {
                        if timed > 0 && after <= b {
                            windows.remove(&tid);
                        }
                        Some(depth.saturating_sub(b))
                    }
                    (Some(_), None) => None,
                };
                (*frame, false, level, note)
            }
            EventKind::ThreadExit => {
                tracker.close_thread(tid, ts, &mut ended);
                ended.clear();
                windows.remove(&tid);
                continue;
            }
            EventKind::Sample { .. } => {
                summary.samples += 1;
                continue;
            }
            _ => continue,
        };
        let Some(level) = level else {
            continue;
        };
        if options.thread.is_some_and(|t| t != tid) {
            continue;
        }
        if options.max_depth.is_some_and(|m| level >= m) {
            continue;
        }
        let rel = ts.saturating_sub(start);
        line.clear();
        if options.json {
            use std::fmt::Write as _;
            let full = FrameNames::new(reader.strings(), true);
            let _ = write!(
                line,
                "{}{{\"ts_us\":{}.{:03},\"tid\":{tid},\"event\":\"{}\",\"depth\":{level},\"function\":{},\"file\":{},\"line\":{}",
                if summary.lines == 0 { "\n" } else { ",\n" },
                rel / 1000,
                rel % 1000,
                if is_call { "call" } else { "return" },
                json_str(&full.string(frame.function)),
                json_str(&full.string(frame.file)),
                frame.line
            );
            match note {
                Note::None => {}
                Note::NoEntry => line.push_str(",\"entry_seen\":false"),
                Note::Popped(n) => {
                    let _ = write!(line, ",\"popped_without_return\":{n}");
                }
            }
            line.push('}');
        } else {
            use std::fmt::Write as _;
            let indent = level.min(MAX_INDENT) * 2;
            let _ = write!(
                line,
                "{:>10}.{:03} {tid:>8}  {:indent$}{} {}:{}:{}",
                rel / 1000,
                rel % 1000,
                "",
                if is_call { "->" } else { "<-" },
                names.file(frame.file),
                names.string(frame.function),
                frame.line,
            );
            match note {
                Note::None => {}
                Note::NoEntry => line.push_str("  (entry not seen)"),
                Note::Popped(n) => {
                    let _ = write!(line, "  (also ends {n} frame(s) whose return never came)");
                }
            }
            line.push('\n');
        }
        out.write_all(line.as_bytes())?;
        summary.lines += 1;
    }
    if options.json {
        out.write_all(if summary.lines == 0 { b"]\n" } else { b"\n]\n" })?;
    }
    out.flush()?;
    Ok(summary)
}
