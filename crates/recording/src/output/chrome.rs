//! `pyprobe flame --format chrome`: Chrome trace event JSON, which Perfetto UI
//! and chrome://tracing open.
//!
//! One track per thread. A Python call is a complete slice (`"ph":"X"`) written
//! when the shared replay pops it (X slices need no ordering); the replay keeps
//! each thread's clock monotonic, so a child always nests within its parent.
//! Frames running when tracing began start then, frames still open end with the
//! recording, and returns without entry have no slice. GC pauses and imports are slices of their own on the
//! thread they ran on (category `gc`, `import`); audit events and lost events are
//! instants. Samples become slices too, on a track of their own beside their
//! thread's (tid [`SAMPLED_TRACK`]` | tid`, named "thread N (sampled)"): a
//! function's slice lasts from the first sample that shows it at its depth to
//! the first sample that does not (so two calls with no sample between them
//! show as one). Kept apart from the exact GC and import slices, whose times
//! sampled slices only approximate, every track nests properly. The recording is read once and the output streamed: memory is
//! bounded by the distinct functions and the stack depth, not the events.

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Seek, Write};

use crate::analyze::recording::replay_planned;
use crate::analyze::{EndKind, Exit, SampleFilter, SampleTally, SliceFilter, Step};
use crate::output::flame::{ViewError, ViewInfo};
use crate::output::names::{short_command, FrameNames};
use crate::output::speedscope::json_str;
use crate::output::{plan_export, Census, Planned};
use crate::recording::{EventKind, FrameRef, RecordingReader, StrId, ThinLevel};

/// Sampled stacks of thread `tid` go on the track `SAMPLED_TRACK | tid` (Linux
/// thread ids stay below 2^22).
pub(crate) const SAMPLED_TRACK: u32 = 1 << 30;

/// Imports open at once per thread, beyond which the oldest are forgotten.
const MAX_OPEN_IMPORTS: usize = 256;

/// Options of the Chrome trace export.
#[derive(Debug, Clone, Default)]
pub struct ChromeOptions {
    /// Keep full file paths in slice names.
    pub full_paths: bool,
    /// Which samples are drawn; a sample left out ends its thread's sampled slices.
    pub samples: SampleFilter,
    /// Which functions (by file) and which slices (by duration) to keep.
    pub filter: SliceFilter,
    /// The first pass, done before (a large recording's views keep it).
    pub planned: Option<Planned>,
}

/// `ns` as microseconds with three decimals, exactly.
fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

#[derive(Default)]
struct ThreadState {
    gc: Option<(i32, u64)>,
    imports: Vec<(StrId, u64)>,
    /// Frames of the last sample, outermost first, and when each was first seen.
    sampled: Vec<(FrameRef, u64)>,
    last_sample: u64,
}

struct Writer<W: Write> {
    out: W,
    /// The recording's own process, and the process of each thread seen (under
    /// `--subprocesses`, its children have theirs).
    root: u32,
    pids: HashMap<u32, u32>,
    start: u64,
    first: bool,
    /// Slice name and args per frame, JSON-ready.
    names: HashMap<FrameRef, (String, String)>,
    /// The same for sampled functions, by (file, function).
    sampled_names: HashMap<(StrId, StrId), (String, String)>,
    filter: SliceFilter,
    /// Whether the filter keeps each file.
    kept_files: HashMap<StrId, bool>,
}

impl<W: Write> Writer<W> {
    fn event(&mut self, body: std::fmt::Arguments<'_>) -> std::io::Result<()> {
        if !self.first {
            self.out.write_all(b",\n")?;
        }
        self.first = false;
        self.out.write_fmt(body)
    }

    fn rel(&self, ts: u64) -> u64 {
        ts.saturating_sub(self.start)
    }

    /// The process of thread `tid`.
    fn pid(&self, tid: u32) -> u32 {
        self.pids.get(&tid).copied().unwrap_or(self.root)
    }

    /// Whether the filter keeps the functions of `file`.
    fn keeps(&mut self, names: &FrameNames<'_>, file: StrId) -> bool {
        if self.filter.files.is_empty() {
            return true;
        }
        let filter = &self.filter;
        *self
            .kept_files
            .entry(file)
            .or_insert_with(|| filter.files.matches(&names.string(file)))
    }

    fn frame_slice(&mut self, names: &FrameNames<'_>, e: &Exit) -> std::io::Result<()> {
        let frame = e.code;
        if !self.keeps(names, frame.file) {
            return Ok(());
        }
        let (name, args) = self.names.entry(frame).or_insert_with(|| {
            (
                json_str(&names.python(&frame)),
                format!(
                    "\"function\":{},\"file\":{},\"line\":{}",
                    json_str(&names.function(&frame)),
                    json_str(&names.string(frame.file)),
                    frame.line
                ),
            )
        });
        let (name, args) = (name.clone(), args.clone());
        // Clipped at the trace's start like every other time: slices still nest.
        let begin = self.rel(e.start_ns());
        let dur = self.rel(e.ts).saturating_sub(begin);
        if !self.filter.long_enough(dur) {
            return Ok(());
        }
        let end = match e.kind {
            EndKind::Returned => "",
            EndKind::Unpaired => ",\"end\":\"no return (popped by a later return)\"",
            EndKind::Open => ",\"end\":\"still running at the end\"",
            EndKind::Cut => ",\"end\":\"exact tracing stopped\"",
        };
        let start = if e.seeded {
            ",\"start\":\"running when tracing began\""
        } else {
            ""
        };
        let (pid, tid) = (self.pid(e.tid), e.tid);
        self.event(format_args!(
            "{{\"name\":{name},\"cat\":\"python\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{tid},\"args\":{{{args}{start}{end}}}}}",
            us(begin),
            us(dur),
        ))
    }

    fn slices(&mut self, names: &FrameNames<'_>, steps: &[Step]) -> std::io::Result<()> {
        for step in steps {
            if let Step::Exit(e) = step {
                self.frame_slice(names, e)?;
            }
        }
        Ok(())
    }
}

impl<W: Write> Writer<W> {
    /// Closes the sampled frames of `state` above `keep`, innermost first, at `end_ts`.
    fn close_sampled(
        &mut self,
        names: &FrameNames<'_>,
        tid: u32,
        state: &mut ThreadState,
        keep: usize,
        end_ts: u64,
    ) -> std::io::Result<()> {
        while state.sampled.len() > keep {
            let Some((frame, start)) = state.sampled.pop() else {
                break;
            };
            let (begin, dur) = (self.rel(start), end_ts.saturating_sub(start));
            if !self.filter.long_enough(dur) || !self.keeps(names, frame.file) {
                continue;
            }
            let (name, args) = self
                .sampled_names
                .entry((frame.file, frame.function))
                .or_insert_with(|| {
                    let function = names.function(&frame);
                    (
                        json_str(&format!("{function} ({})", names.file(frame.file))),
                        format!(
                            "\"function\":{},\"file\":{},\"line\":{}",
                            json_str(&function),
                            json_str(&names.string(frame.file)),
                            frame.line
                        ),
                    )
                })
                .clone();
            let pid = self.pid(tid);
            let track = SAMPLED_TRACK | tid;
            self.event(format_args!(
                "{{\"name\":{name},\"cat\":\"sampled\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{track},\"args\":{{{args}}}}}",
                us(begin),
                us(dur),
            ))?;
        }
        Ok(())
    }
}

/// Reads the whole recording and writes it as a Chrome trace to `out`. `before`
/// gets the recording's [`Census`] (under the options' filter) once it is read
/// and before anything is written: what the trace will hold; it returns the
/// shortest call to keep when it chose one (else the options' filter holds).
pub fn write_chrome<R: Read + Seek, W: Write>(
    reader: &mut RecordingReader<R>,
    options: &ChromeOptions,
    before: impl FnOnce(&Census) -> Option<u64>,
    out: W,
) -> Result<SampleTally, ViewError> {
    let header = reader.header().clone();
    let mut tally = SampleTally::new(options.samples, &header);
    let (plan, census) = plan_export(reader, &options.filter, options.planned.as_ref())?;
    let chosen_min = before(&census);
    let mut w = Writer {
        out,
        root: header.pid,
        pids: HashMap::new(),
        start: header.start_ns,
        first: true,
        names: HashMap::new(),
        sampled_names: HashMap::new(),
        filter: SliceFilter {
            min_duration_ns: chosen_min.unwrap_or(options.filter.min_duration_ns),
            ..options.filter.clone()
        },
        kept_files: HashMap::new(),
    };
    // A sampled frame lasts at least one interval after the last sample showing it.
    let tail = header.sample_interval_ns;
    w.out.write_all(b"{\"traceEvents\":[\n")?;
    let process = crate::output::flame::default_title(&header);
    let process = process.strip_prefix("pyprobe: ").unwrap_or(&process);
    w.event(format_args!(
        "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{0},\"tid\":{0},\"args\":{{\"name\":{1}}}}}",
        header.pid,
        json_str(&format!("{process} (pid {})", header.pid))
    ))?;
    let mut threads: HashMap<u32, ThreadState> = HashMap::new();
    let mut processes: BTreeSet<u32> = BTreeSet::from([header.pid]);
    let mut seen: BTreeSet<u32> = BTreeSet::new();
    let mut sampled_seen: BTreeSet<u32> = BTreeSet::new();
    let mut base_set = header.start_ns != 0;
    let mut last_ts = 0u64;

    let mut replay = replay_planned(reader, plan, |reader, event, ts, steps, replay| {
        let tid = event.tid;
        if !base_set {
            w.start = ts;
            base_set = true;
        }
        // A child traced with --subprocesses is a process of its own.
        let pid = replay.process_of(tid);
        w.pids.insert(tid, pid);
        if processes.insert(pid) {
            // Named by its last command line (a spawned worker's, after its exec).
            let command = replay.plan().processes.get(pid).and_then(|p| p.command);
            let command = command
                .map(|c| reader.string(c).into_owned())
                .unwrap_or_default();
            w.event(format_args!(
                "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{pid},\"args\":{{\"name\":{}}}}}",
                json_str(&format!("{} (pid {pid})", short_command(&command)))
            ))?;
        }
        last_ts = last_ts.max(ts);
        // A thread's own track is named once something goes on it (samples
        // have their own track).
        let sample = matches!(event.kind, EventKind::Sample { .. });
        if !sample && seen.insert(tid) {
            let name = if tid == pid {
                format!("main thread ({tid})")
            } else {
                format!("thread {tid}")
            };
            w.event(format_args!(
                "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"name\":{}}}}}",
                json_str(&name)
            ))?;
            w.event(format_args!(
                "{{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"sort_index\":{}}}}}",
                u32::from(tid != pid)
            ))?;
        }
        let names = FrameNames::new(reader.strings(), options.full_paths)
            .with_qualnames(reader.qualnames());
        w.slices(&names, steps)?;
        match &event.kind {
            EventKind::Call { .. }
            | EventKind::Resume { .. }
            | EventKind::Return { .. }
            | EventKind::Running { .. }
            | EventKind::ReturnType { .. } => {}
            EventKind::ThreadExit => {
                if let Some(mut t) = threads.remove(&tid) {
                    w.close_sampled(&names, tid, &mut t, 0, ts)?;
                }
            }
            EventKind::Sample { frames, state } => {
                if sampled_seen.insert(tid) {
                    let name = if tid == pid {
                        format!("main thread ({tid}), sampled")
                    } else {
                        format!("thread {tid}, sampled")
                    };
                    let track = SAMPLED_TRACK | tid;
                    w.event(format_args!(
                        "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{track},\"args\":{{\"name\":{}}}}}",
                        json_str(&name)
                    ))?;
                    w.event(format_args!(
                        "{{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{track},\"args\":{{\"sort_index\":{}}}}}",
                        u32::from(tid != pid)
                    ))?;
                }
                let t = threads.entry(tid).or_default();
                // A sample left out (a waiting thread, by default) ends what was open.
                let codes: Vec<FrameRef> = if tally.admit(*state) {
                    frames.iter().map(|f| replay.walked_code(f)).collect()
                } else {
                    Vec::new()
                };
                let same = t
                    .sampled
                    .iter()
                    .zip(&codes)
                    .take_while(|((open, _), f)| open == *f)
                    .count();
                w.close_sampled(&names, tid, t, same, ts)?;
                t.sampled.extend(codes[same..].iter().map(|f| (*f, ts)));
                t.last_sample = ts;
            }
            EventKind::GcStart { generation } => {
                threads.entry(tid).or_default().gc = Some((*generation, ts));
            }
            EventKind::GcDone { collected } => {
                let gc = threads.get_mut(&tid).and_then(|t| t.gc.take());
                let gc = gc.filter(|&(_, start)| w.filter.long_enough(ts.saturating_sub(start)));
                if let Some((generation, start)) = gc {
                    let (begin, dur) = (w.rel(start), ts.saturating_sub(start));
                    w.event(format_args!(
                        "{{\"name\":\"gc (generation {generation})\",\"cat\":\"gc\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{},\"tid\":{tid},\"args\":{{\"generation\":{generation},\"collected\":{collected}}}}}",
                        us(begin),
                        us(dur),
                        pid
                    ))?;
                }
            }
            EventKind::ImportStart { module } => {
                let t = threads.entry(tid).or_default();
                if t.imports.len() >= MAX_OPEN_IMPORTS {
                    t.imports.remove(0);
                }
                t.imports.push((*module, ts));
            }
            EventKind::ImportDone { module, found } => {
                let t = threads.entry(tid).or_default();
                if let Some(i) = t.imports.iter().rposition(|(m, _)| m == module) {
                    let start = t.imports[i].1;
                    t.imports.truncate(i);
                    let (begin, dur) = (w.rel(start), ts.saturating_sub(start));
                    if !w.filter.long_enough(dur) {
                        return Ok(());
                    }
                    let m = names.string(*module);
                    w.event(format_args!(
                        "{{\"name\":{},\"cat\":\"import\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{},\"tid\":{tid},\"args\":{{\"module\":{},\"found\":{found}}}}}",
                        json_str(&format!("import {m}")),
                        us(begin),
                        us(dur),
                        pid,
                        json_str(&m)
                    ))?;
                }
            }
            EventKind::Audit { event: name } => {
                let name = names.string(*name);
                w.event(format_args!(
                    "{{\"name\":{},\"cat\":\"audit\",\"ph\":\"i\",\"s\":\"t\",\"ts\":{},\"pid\":{},\"tid\":{tid}}}",
                    json_str(&format!("audit {name}")),
                    us(w.rel(ts)),
                    pid
                ))?;
            }
            EventKind::Caveat { text } => {
                let text = names.string(*text);
                w.event(format_args!(
                    "{{\"name\":{},\"cat\":\"pyprobe\",\"ph\":\"i\",\"s\":\"p\",\"ts\":{},\"pid\":{},\"tid\":{tid}}}",
                    json_str(&format!("caveat: {text}")),
                    us(w.rel(ts)),
                    pid
                ))?;
            }
            EventKind::AuditsCounted { count } => {
                w.event(format_args!(
                    "{{\"name\":\"{count} audit events counted (overhead budget)\",\"cat\":\"pyprobe\",\"ph\":\"i\",\"s\":\"p\",\"ts\":{},\"pid\":{},\"tid\":{tid}}}",
                    us(w.rel(ts)),
                    pid
                ))?;
            }
            EventKind::Lost { count } => {
                w.event(format_args!(
                    "{{\"name\":\"{count} events lost\",\"cat\":\"pyprobe\",\"ph\":\"i\",\"s\":\"p\",\"ts\":{},\"pid\":{},\"tid\":{tid}}}",
                    us(w.rel(ts)),
                    pid
                ))?;
            }
            EventKind::Paused { ns } => {
                w.event(format_args!(
                    "{{\"name\":\"pyprobe paused (not traced)\",\"cat\":\"pyprobe\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{},\"tid\":{tid}}}",
                    us(w.rel(ts)),
                    us(*ns),
                    pid
                ))?;
            }
            EventKind::Thinned { level } => {
                let name = match level {
                    ThinLevel::Full => "stacks of GC, import and audit events on",
                    ThinLevel::Stackless => {
                        "stacks of GC, import and audit events off (overhead budget)"
                    }
                    ThinLevel::Uncounted => "audit events off (overhead budget)",
                };
                w.event(format_args!(
                    "{{\"name\":\"{name}\",\"cat\":\"pyprobe\",\"ph\":\"i\",\"s\":\"p\",\"ts\":{},\"pid\":{},\"tid\":{tid}}}",
                    us(w.rel(ts)),
                    pid
                ))?;
            }
            EventKind::Window { exact } => {
                let name = if *exact {
                    "exact tracing on"
                } else {
                    "exact tracing off (overhead budget): sampled"
                };
                w.event(format_args!(
                    "{{\"name\":\"{name}\",\"cat\":\"pyprobe\",\"ph\":\"i\",\"s\":\"p\",\"ts\":{},\"pid\":{},\"tid\":{tid}}}",
                    us(w.rel(ts)),
                    pid
                ))?;
            }
            EventKind::Line { .. }
            | EventKind::Stack { .. }
            | EventKind::ThreadStart { .. }
            | EventKind::ProcessStart { .. }
            | EventKind::Exec { .. } => {}
        }
        Ok::<(), ViewError>(())
    })?;
    let info = ViewInfo::of(reader);
    let end = info.end_ns.unwrap_or(0).max(last_ts);
    let names =
        FrameNames::new(reader.strings(), options.full_paths).with_qualnames(reader.qualnames());
    let mut steps = Vec::new();
    replay.finish(end, &mut steps);
    w.slices(&names, &steps)?;
    let mut left: Vec<(u32, ThreadState)> = threads.into_iter().collect();
    left.sort_unstable_by_key(|(tid, _)| *tid);
    for (tid, mut t) in left {
        let until = t
            .last_sample
            .saturating_add(tail)
            .min(end.max(t.last_sample));
        w.close_sampled(&names, tid, &mut t, 0, until)?;
    }
    write!(
        w.out,
        "\n],\"displayTimeUnit\":\"ns\",\"otherData\":{{\"exporter\":\"pyprobe {}\",\"pid\":{},\"python\":{},\"mode\":{},\"truncated\":{}}}}}\n",
        env!("CARGO_PKG_VERSION"),
        header.pid,
        json_str(&header.python_version),
        json_str(&header.mode),
        info.truncated_at.is_some()
    )?;
    w.out.flush()?;
    Ok(tally)
}

#[cfg(test)]
mod tests {
    use super::us;

    #[test]
    fn microseconds_are_exact() {
        assert_eq!(us(0), "0.000");
        assert_eq!(us(1), "0.001");
        assert_eq!(us(1_234_567), "1234.567");
    }
}
