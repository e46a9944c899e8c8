//! Folds an event stream into a [`Report`].
//!
//! Feed events with [`Aggregator::push`] while reading, then resolve strings in
//! [`Aggregator::finish`] (the string table is complete only at the end).

use std::collections::{BTreeMap, HashMap};

use super::gc::GcTracker;
use super::imports::ImportTracker;
use super::model::{RaisingStack, Trigger, MAX_TRIGGERS};
use super::samples::SampleTracker;
use super::stacks::{code, EndKind, Ended, StackTracker};
use super::{
    Anomalies, AuditCount, ExactWindows, FunctionSource, FunctionStats, ImportStats, Report,
    Target, ThreadStats,
};
use crate::record::{Event, EventKind, FrameRef, Header, StrId};

#[derive(Default, Clone, Copy)]
struct FuncAcc {
    calls: u64,
    inclusive_ns: u64,
    exclusive_ns: u64,
}

/// Accumulates events into report data, in memory bounded by the number of
/// distinct functions, modules, threads and the stack depth cap.
pub struct Aggregator {
    target: Target,
    mode: String,
    start_ns: u64,
    sample_interval_ns: u64,
    stacks: StackTracker,
    ended: Vec<Ended>,
    functions: HashMap<FrameRef, FuncAcc>,
    /// First entry frame seen per code (file, function), for returns without entry.
    entry_frames: HashMap<(StrId, StrId), FrameRef>,
    orphan_frames: HashMap<(StrId, StrId), FrameRef>,
    samples: SampleTracker,
    gc: GcTracker,
    imports: ImportTracker,
    audit: HashMap<StrId, u64>,
    /// Per thread: the stack recorded just before its next GC/import/audit event.
    pending_stack: HashMap<u32, Vec<FrameRef>>,
    /// (generation, innermost function) → (a line it was at, collections started in it).
    gc_triggers: HashMap<(i32, (StrId, StrId)), (u32, u64)>,
    /// (audit event, innermost frames) → times raised there.
    audit_stacks: HashMap<(StrId, Vec<FrameRef>), u64>,
    threads: BTreeMap<u32, u64>,
    events: u64,
    lost: u64,
    call_events: u64,
    return_events: u64,
    first_ts: Option<u64>,
    last_ts: Option<u64>,
    windows: WindowTracker,
}

/// Exact windows of a budget-limited recording: when function tracing was on.
#[derive(Default, Clone, Copy)]
struct WindowTracker {
    /// Window events seen at all (else the recording had no budget).
    seen: bool,
    open_since: Option<u64>,
    exact_ns: u64,
    windows: u64,
}

impl WindowTracker {
    fn toggle(&mut self, exact: bool, ts: u64) {
        self.seen = true;
        match (exact, self.open_since) {
            (true, None) => {
                self.open_since = Some(ts);
                self.windows += 1;
            }
            (false, Some(since)) => {
                self.exact_ns += ts.saturating_sub(since);
                self.open_since = None;
            }
            _ => {}
        }
    }

    fn finish(self, end: u64) -> Option<ExactWindows> {
        self.seen.then(|| ExactWindows {
            exact_ns: self.exact_ns + self.open_since.map_or(0, |s| end.saturating_sub(s)),
            windows: self.windows,
        })
    }
}

impl Aggregator {
    /// Starts aggregating a recording described by `header`.
    pub fn new(header: &Header) -> Self {
        Aggregator {
            target: Target {
                pid: header.pid,
                python: header.python_version.clone(),
                executable: header.executable.clone(),
            },
            mode: header.mode.clone(),
            start_ns: header.start_ns,
            sample_interval_ns: header.sample_interval_ns,
            stacks: StackTracker::new(),
            ended: Vec::new(),
            functions: HashMap::new(),
            entry_frames: HashMap::new(),
            orphan_frames: HashMap::new(),
            samples: SampleTracker::default(),
            gc: GcTracker::default(),
            imports: ImportTracker::default(),
            audit: HashMap::new(),
            pending_stack: HashMap::new(),
            gc_triggers: HashMap::new(),
            audit_stacks: HashMap::new(),
            threads: BTreeMap::new(),
            events: 0,
            lost: 0,
            call_events: 0,
            return_events: 0,
            first_ts: None,
            last_ts: None,
            windows: WindowTracker::default(),
        }
    }

    /// Adds one event.
    pub fn push(&mut self, event: &Event) {
        let (tid, ts) = (event.tid, event.ts_ns);
        self.events += 1;
        *self.threads.entry(tid).or_insert(0) += 1;
        self.first_ts = Some(self.first_ts.map_or(ts, |t| t.min(ts)));
        self.last_ts = Some(self.last_ts.map_or(ts, |t| t.max(ts)));
        match &event.kind {
            EventKind::Call { frame } => {
                self.call_events += 1;
                self.entry_frames.entry(code(frame)).or_insert(*frame);
                self.samples.note_function(frame);
                self.stacks.call(tid, *frame, ts);
            }
            EventKind::Return { frame } => {
                self.return_events += 1;
                self.samples.note_return(frame);
                self.stacks.ret(tid, *frame, ts, &mut self.ended);
                self.apply_ended();
            }
            EventKind::Line { .. } | EventKind::ThreadStart => {}
            EventKind::GcStart { generation } => {
                if let Some(leaf) = self.trigger_stack(tid).last() {
                    let entry = self
                        .gc_triggers
                        .entry((*generation, code(leaf)))
                        .or_insert((leaf.line, 0));
                    entry.1 += 1;
                }
                self.gc.start(tid, *generation, ts)
            }
            EventKind::Stack { frames } => {
                self.pending_stack.insert(tid, frames.clone());
            }
            EventKind::GcDone { collected } => self.gc.done(tid, *collected, ts),
            EventKind::ImportStart { module } => {
                self.pending_stack.remove(&tid);
                self.imports.start(tid, *module, ts)
            }
            EventKind::ImportDone { module, found } => self.imports.done(tid, *module, *found, ts),
            EventKind::Audit { event } => {
                *self.audit.entry(*event).or_insert(0) += 1;
                let stack = self.trigger_stack(tid);
                if !stack.is_empty() {
                    let kept = stack[stack.len().saturating_sub(8)..].to_vec();
                    *self.audit_stacks.entry((*event, kept)).or_insert(0) += 1;
                }
            }
            EventKind::Sample { frames } => self.samples.record(frames),
            EventKind::ThreadExit => {
                self.stacks.close_thread(tid, ts, &mut self.ended);
                self.apply_ended();
                self.gc.thread_exit(tid);
                self.imports.thread_exit(tid);
            }
            EventKind::Lost { count } => {
                self.lost = self.lost.saturating_add(*count);
                // Which calls and returns were dropped is unknown: stacks start over.
                self.cut_stacks(ts);
            }
            EventKind::Window { exact } => {
                self.windows.toggle(*exact, ts);
                if !*exact {
                    // The returns of these frames will not be seen: they end here.
                    self.cut_stacks(ts);
                }
            }
        }
    }

    /// Every open frame ends at `ts`, timed but not counted as a call.
    fn cut_stacks(&mut self, ts: u64) {
        for tid in self.stacks.thread_ids() {
            self.stacks.cut_thread(tid, ts, &mut self.ended);
        }
        self.apply_ended();
    }

    /// The Python stack of `tid` at the event being handled: the stack the frame
    /// walker recorded for it (a `Stack` event just before), else the stack rebuilt
    /// from call/return events (trace mode), else nothing.
    fn trigger_stack(&mut self, tid: u32) -> Vec<FrameRef> {
        match self.pending_stack.remove(&tid) {
            Some(frames) => frames,
            None => self.stacks.frames(tid).collect(),
        }
    }

    fn apply_ended(&mut self) {
        for ended in self.ended.drain(..) {
            match ended {
                Ended::Timed {
                    frame,
                    inclusive_ns,
                    exclusive_ns,
                    outermost,
                    kind,
                } => {
                    let acc = self.functions.entry(frame).or_default();
                    if kind != EndKind::Open {
                        acc.calls += 1;
                    }
                    acc.exclusive_ns = acc.exclusive_ns.saturating_add(exclusive_ns);
                    if outermost {
                        acc.inclusive_ns = acc.inclusive_ns.saturating_add(inclusive_ns);
                    }
                }
                Ended::Untimed { frame } => {
                    // A return without its entry carries the line it returned from:
                    // count it on the function's row as first seen by an entry, else
                    // on the first such return's row, so one function is one row.
                    let key = code(&frame);
                    let row = match self.entry_frames.get(&key) {
                        Some(entry) => *entry,
                        None => *self.orphan_frames.entry(key).or_insert(frame),
                    };
                    self.functions.entry(row).or_default().calls += 1;
                }
            }
        }
    }

    /// A return seen before any entry of its function (attached, or an exact window
    /// opened, mid-call) got a row of its own, keyed by the line it returned from;
    /// once an entry has shown the function's first line, that row joins it.
    fn merge_early_orphans(&mut self) {
        for (key, orphan) in std::mem::take(&mut self.orphan_frames) {
            let Some(&entry) = self.entry_frames.get(&key) else {
                continue;
            };
            if entry == orphan {
                continue;
            }
            if let Some(acc) = self.functions.remove(&orphan) {
                let row = self.functions.entry(entry).or_default();
                row.calls += acc.calls;
                row.inclusive_ns = row.inclusive_ns.saturating_add(acc.inclusive_ns);
                row.exclusive_ns = row.exclusive_ns.saturating_add(acc.exclusive_ns);
            }
        }
    }

    /// Where function numbers come from, judged from the stream: returns without
    /// entries is CPython 3.11's return-only stream (its entry probe fires only
    /// while a tracing hook is set, so a few entries may still show up there).
    fn source(&self) -> FunctionSource {
        let is_311 = self.target.python == "3.11" || self.target.python.starts_with("3.11.");
        match (self.call_events, self.return_events) {
            (0, 0) if self.samples.samples > 0 => FunctionSource::Sampled,
            (0, 0) => FunctionSource::Traced,
            (0, _) => FunctionSource::ReturnsOnly,
            (c, r) if is_311 && c.saturating_mul(2) < r => FunctionSource::ReturnsOnly,
            _ => FunctionSource::Traced,
        }
    }

    /// Ends the recording at `end_ns` (the trailer's end; `None` uses the last
    /// event) and resolves string ids with `resolve`.
    pub fn finish(mut self, end_ns: Option<u64>, resolve: impl Fn(StrId) -> String) -> Report {
        let end = end_ns.or(self.last_ts).unwrap_or(self.start_ns);
        // Open frames end no earlier than the last event, so no time is negative.
        let close_at = end.max(self.last_ts.unwrap_or(0));
        self.stacks.close_all(close_at, &mut self.ended);
        self.apply_ended();
        let start = if self.start_ns != 0 {
            self.start_ns
        } else {
            self.first_ts.unwrap_or(end)
        };
        let source = self.source();
        let has_calls = self.call_events + self.return_events > 0;
        let interval = self.sample_interval_ns;
        let windowed = self.windows.seen;

        self.merge_early_orphans();
        let mut names = Names::new(resolve);
        let mut samples = self.samples.finish();
        let mut functions: Vec<FunctionStats> = Vec::new();
        let mut add = |names: &mut Names<_>, frame: FrameRef, t: FuncAcc, leaf: u64, incl: u64| {
            let (inclusive_ns, exclusive_ns) = match source {
                // Samples come only from outside exact windows (budget-limited
                // recordings): their estimate adds to the exact time.
                FunctionSource::Traced if windowed => (
                    t.inclusive_ns.saturating_add(incl.saturating_mul(interval)),
                    t.exclusive_ns.saturating_add(leaf.saturating_mul(interval)),
                ),
                FunctionSource::Traced => (t.inclusive_ns, t.exclusive_ns),
                _ => (incl.saturating_mul(interval), leaf.saturating_mul(interval)),
            };
            functions.push(FunctionStats {
                function: names.get(frame.function),
                file: names.get(frame.file),
                line: frame.line,
                calls: has_calls.then_some(t.calls),
                inclusive_ns,
                exclusive_ns,
                samples: leaf,
            });
        };
        for (frame, t) in &self.functions {
            let s = samples.remove(frame).unwrap_or_default();
            add(&mut names, *frame, *t, s.leaf, s.inclusive);
        }
        for (frame, s) in samples {
            add(&mut names, frame, FuncAcc::default(), s.leaf, s.inclusive);
        }
        functions.sort_by(|a, b| {
            b.inclusive_ns
                .cmp(&a.inclusive_ns)
                .then(b.exclusive_ns.cmp(&a.exclusive_ns))
                .then_with(|| a.function.cmp(&b.function))
                .then_with(|| a.file.cmp(&b.file))
                .then(a.line.cmp(&b.line))
        });

        let (mut gc, unpaired_gc) = self.gc.finish();
        for stats in &mut gc {
            let mut triggers: Vec<Trigger> = self
                .gc_triggers
                .iter()
                .filter(|((g, _), _)| *g == stats.generation)
                .map(|((_, (file, function)), &(line, count))| Trigger {
                    function: names.get(*function),
                    file: names.get(*file),
                    line,
                    count,
                })
                .collect();
            triggers.sort_by(|a, b| {
                b.count
                    .cmp(&a.count)
                    .then_with(|| a.function.cmp(&b.function))
            });
            triggers.truncate(MAX_TRIGGERS);
            stats.triggers = triggers;
        }
        let (modules, unpaired_imports) = self.imports.finish();
        let mut imports: Vec<ImportStats> = modules
            .into_iter()
            .filter(|(_, m)| m.count > 0)
            .map(|(id, m)| ImportStats {
                module: names.get(id),
                found: m.found,
                total_ns: m.total_ns,
                self_ns: m.self_ns,
                count: m.count,
                importer: m.importer.map(|i| names.get(i)),
            })
            .collect();
        imports.sort_by(|a, b| {
            b.total_ns
                .cmp(&a.total_ns)
                .then_with(|| a.module.cmp(&b.module))
        });

        let mut audit: Vec<AuditCount> = Vec::new();
        for (&id, &count) in &self.audit {
            let mut stacks: Vec<RaisingStack> = self
                .audit_stacks
                .iter()
                .filter(|((event, _), _)| *event == id)
                .map(|((_, frames), &count)| RaisingStack {
                    frames: frames
                        .iter()
                        .map(|f| {
                            format!(
                                "{} ({}:{})",
                                names.get(f.function),
                                names.get(f.file),
                                f.line
                            )
                        })
                        .collect(),
                    count,
                })
                .collect();
            stacks.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.frames.cmp(&b.frames)));
            stacks.truncate(MAX_TRIGGERS);
            audit.push(AuditCount {
                event: names.get(id),
                count,
                stacks,
            });
        }
        audit.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.event.cmp(&b.event)));

        let c = self.stacks.counters();
        Report {
            target: self.target,
            mode: self.mode,
            sample_interval_ns: interval,
            duration_ns: end.saturating_sub(start),
            events: self.events,
            lost_events: self.lost,
            source,
            functions,
            gc,
            imports,
            audit,
            threads: self
                .threads
                .into_iter()
                .map(|(tid, events)| ThreadStats { tid, events })
                .collect(),
            anomalies: Anomalies {
                resyncs: c.resyncs,
                unpaired_entries: c.unpaired_entries,
                orphan_returns: c.orphan_returns,
                depth_overflows: c.depth_overflows,
                open_at_end: c.open_at_end,
                unpaired_gc,
                unpaired_imports,
            },
            truncated_at: None,
            exact_windows: self.windows.finish(close_at),
        }
    }
}

/// Resolves each string id once.
struct Names<F> {
    resolve: F,
    cache: HashMap<StrId, String>,
}

impl<F: Fn(StrId) -> String> Names<F> {
    fn new(resolve: F) -> Self {
        Names {
            resolve,
            cache: HashMap::new(),
        }
    }

    fn get(&mut self, id: StrId) -> String {
        let resolve = &self.resolve;
        self.cache.entry(id).or_insert_with(|| resolve(id)).clone()
    }
}
