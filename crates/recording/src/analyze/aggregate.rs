//! Folds an event stream into a [`Report`].
//!
//! Feed events with [`Aggregator::push`] while reading, then resolve strings in
//! [`Aggregator::finish`] (the string table is complete only at the end).

use std::collections::{BTreeMap, HashMap, HashSet};

use rustc_hash::FxHashMap;

use super::budget::{ThinningTracker, WindowTracker};
use super::gc::GcTracker;
use super::imports::ImportTracker;
use super::model::{
    Anomalies, AuditCount, Caveat, FunctionSource, FunctionStats, ImportStats, Pause, ProcessStats,
    Report, Target, ThreadStats,
};
use super::model::{RaisingStack, Trigger, MAX_TRIGGERS};
use super::replay::{Pairing, Replay, Step};
use super::return_types::ReturnTypeTracker;
use super::samples::{SampleAcc, SampleTracker};
use super::states::{SampleFilter, SampleTally};
use crate::recording::{Event, EventKind, FrameRef, Header, Qualnames, StrId, WalkedFrame};

#[derive(Default, Clone, Copy)]
struct FuncAcc {
    calls: u64,
    resumes: u64,
    inclusive_ns: u64,
    exclusive_ns: u64,
}

/// What one process's threads did.
#[derive(Default)]
struct ProcAcc {
    functions: FxHashMap<FrameRef, FuncAcc>,
    samples: SampleTracker,
    first_ts: Option<u64>,
    last_ts: u64,
}

impl ProcAcc {
    fn book(&mut self, step: &Step) {
        book(&mut self.functions, step);
    }
}

/// Books one step of the replay into `functions`.
fn book(functions: &mut FxHashMap<FrameRef, FuncAcc>, step: &Step) {
    match *step {
        Step::Exit(e) => {
            let acc = functions.entry(e.code).or_default();
            match (e.is_call(), e.resumed) {
                (true, false) => acc.calls += 1,
                (true, true) => acc.resumes += 1,
                _ => {}
            }
            acc.exclusive_ns = acc.exclusive_ns.saturating_add(e.exclusive_ns);
            if e.outermost {
                acc.inclusive_ns = acc.inclusive_ns.saturating_add(e.inclusive_ns);
            }
        }
        Step::Untimed { code, .. } => functions.entry(code).or_default().calls += 1,
        Step::Enter { .. } => {}
    }
}

/// `functions` with the entries of generator functions whose creations the
/// recording saw (CPython 3.15 fires its entry probe at a creation, and at the
/// first run and every resume alike) split into first runs, counted as calls,
/// and resumes: each creation makes one entry of its function's a call, the rest
/// are resumes. The rows of one name take them in order of first line.
fn with_creations(
    functions: &FxHashMap<FrameRef, FuncAcc>,
    creations: &HashMap<(StrId, StrId), u64>,
) -> Vec<(FrameRef, FuncAcc)> {
    let mut rows: Vec<(FrameRef, FuncAcc)> = functions.iter().map(|(f, t)| (*f, *t)).collect();
    if creations.is_empty() {
        return rows;
    }
    rows.sort_by_key(|(f, _)| (f.file, f.function, f.line));
    let mut left = creations.clone();
    for (frame, t) in &mut rows {
        let Some(n) = left.get_mut(&(frame.file, frame.function)) else {
            continue;
        };
        let first_runs = t.calls.min(*n);
        *n -= first_runs;
        t.resumes += t.calls - first_runs;
        t.calls = first_runs;
    }
    rows
}

/// How function rows are made from exact and sampled times.
#[derive(Clone, Copy)]
struct RowRules {
    source: FunctionSource,
    /// A budget-limited recording: samples add to the exact times.
    windowed: bool,
    has_calls: bool,
    interval: u64,
}

impl RowRules {
    fn row(
        &self,
        (function, qualname): (String, String),
        file: String,
        frame: FrameRef,
        t: FuncAcc,
        s: SampleAcc,
    ) -> FunctionStats {
        let (leaf, incl, interval) = (s.leaf, s.inclusive, self.interval);
        let (inclusive_ns, exclusive_ns) = match self.source {
            // Samples come only from outside exact windows (budget-limited
            // recordings): their estimate adds to the exact time.
            FunctionSource::Traced if self.windowed => (
                t.inclusive_ns.saturating_add(incl.saturating_mul(interval)),
                t.exclusive_ns.saturating_add(leaf.saturating_mul(interval)),
            ),
            FunctionSource::Traced => (t.inclusive_ns, t.exclusive_ns),
            // Sampled alongside a busy trace: each sample stands for its
            // thread's time between samples.
            FunctionSource::ReturnsOnly => (s.inclusive_ns, s.leaf_ns),
            FunctionSource::Sampled => {
                (incl.saturating_mul(interval), leaf.saturating_mul(interval))
            }
        };
        FunctionStats {
            function,
            qualname,
            file,
            line: frame.line,
            calls: self.has_calls.then_some(t.calls),
            resumes: self.has_calls.then_some(t.resumes),
            inclusive_ns,
            exclusive_ns,
            samples: leaf,
        }
    }

    /// Rows of every function with exact or sampled time, sorted by inclusive
    /// time, then name.
    fn rows<F: Fn(StrId) -> String>(
        &self,
        names: &mut Names<'_, F>,
        functions: &FxHashMap<FrameRef, FuncAcc>,
        mut samples: FxHashMap<FrameRef, SampleAcc>,
        creations: &HashMap<(StrId, StrId), u64>,
    ) -> Vec<FunctionStats> {
        let mut rows = Vec::new();
        for (frame, t) in with_creations(functions, creations) {
            let s = samples.remove(&frame).unwrap_or_default();
            rows.push(self.row(
                (names.get(frame.function), names.shown(&frame)),
                names.get(frame.file),
                frame,
                t,
                s,
            ));
        }
        for (frame, s) in samples {
            rows.push(self.row(
                (names.get(frame.function), names.shown(&frame)),
                names.get(frame.file),
                frame,
                FuncAcc::default(),
                s,
            ));
        }
        rows.sort_by(|a, b| {
            b.inclusive_ns
                .cmp(&a.inclusive_ns)
                .then(b.exclusive_ns.cmp(&a.exclusive_ns))
                .then_with(|| a.qualname.cmp(&b.qualname))
                .then_with(|| a.file.cmp(&b.file))
                .then(a.line.cmp(&b.line))
        });
        rows
    }
}

/// Accumulates events into report data, in memory bounded by the number of
/// distinct functions, modules, threads and the stack depth cap. Stacks and
/// times come from the shared [`Replay`]: feed [`push`](Self::push) each event
/// with the replay's time and steps for it.
pub struct Aggregator {
    target: Target,
    mode: String,
    /// The recording's command line (the header's), its own process's name.
    command: String,
    start_ns: u64,
    sample_interval_ns: u64,
    functions: FxHashMap<FrameRef, FuncAcc>,
    samples: SampleTracker,
    gc: GcTracker,
    imports: ImportTracker,
    audit: HashMap<StrId, u64>,
    /// Per thread: the stack recorded just before its next GC/import/audit event,
    /// as (function, line shown).
    pending_stack: HashMap<u32, Vec<(FrameRef, u32)>>,
    /// (generation, innermost function) → (a line it was at, collections started in it).
    gc_triggers: HashMap<(i32, FrameRef), (u32, u64)>,
    /// (audit event, innermost frames as (function, line)) → times raised there.
    audit_stacks: HashMap<(StrId, Vec<(FrameRef, u32)>), u64>,
    threads: BTreeMap<u32, u64>,
    /// The process of each thread (as of its last event).
    thread_pids: FxHashMap<u32, u32>,
    processes: BTreeMap<u32, ProcAcc>,
    events: u64,
    lost: u64,
    /// (time, length) of each pause.
    paused: Vec<(u64, u64)>,
    /// (time, process, text) of each caveat.
    caveats: Vec<(u64, u32, StrId)>,
    first_ts: Option<u64>,
    last_ts: Option<u64>,
    windows: WindowTracker,
    thinning: ThinningTracker,
    tally: SampleTally,
    return_types: ReturnTypeTracker,
    /// Functions and samples of this thread alone (GC, imports and audit events are
    /// the process's); `None`: every thread's.
    only_thread: Option<u32>,
    /// Samples in the recording, whether counted or not.
    samples_seen: u64,
}

/// Walked frames as (function, line shown).
fn walked(replay: &Replay, frames: &[WalkedFrame]) -> Vec<(FrameRef, u32)> {
    frames
        .iter()
        .map(|w| (replay.walked_code(w), w.line))
        .collect()
}

impl Aggregator {
    /// Starts aggregating a recording described by `header`, counting the samples of
    /// threads on a CPU (the default [`SampleFilter`]).
    pub fn new(header: &Header) -> Self {
        Self::with_filter(header, SampleFilter::default())
    }

    /// Starts aggregating a recording described by `header`, counting the samples
    /// `filter` keeps.
    pub(crate) fn with_filter(header: &Header, filter: SampleFilter) -> Self {
        Aggregator {
            target: Target {
                pid: header.pid,
                python: header.python_version.clone(),
                executable: header.executable.clone(),
            },
            mode: header.mode.clone(),
            command: header.command_line.join(" "),
            start_ns: header.start_ns,
            sample_interval_ns: header.sample_interval_ns,
            functions: FxHashMap::default(),
            samples: SampleTracker::default(),
            gc: GcTracker::default(),
            imports: ImportTracker::default(),
            audit: HashMap::new(),
            pending_stack: HashMap::new(),
            gc_triggers: HashMap::new(),
            audit_stacks: HashMap::new(),
            threads: BTreeMap::new(),
            thread_pids: FxHashMap::default(),
            processes: BTreeMap::new(),
            events: 0,
            lost: 0,
            paused: Vec::new(),
            caveats: Vec::new(),
            first_ts: None,
            last_ts: None,
            windows: WindowTracker::default(),
            thinning: ThinningTracker::default(),
            tally: SampleTally::new(filter, header),
            return_types: ReturnTypeTracker::default(),
            only_thread: None,
            samples_seen: 0,
        }
    }

    /// Counts the functions and samples of thread `tid` alone (`None`: of every
    /// thread); the thread list still names every thread.
    pub(crate) fn only_thread(mut self, tid: Option<u32>) -> Self {
        self.only_thread = tid;
        self
    }

    /// Whether what thread `tid` did counts.
    fn counts_thread(&self, tid: u32) -> bool {
        self.only_thread.is_none_or(|only| only == tid)
    }

    /// Adds one event, at its thread's time `ts`, with the steps the replay made
    /// of it.
    pub fn push(&mut self, event: &Event, ts: u64, steps: &[Step], replay: &Replay) {
        let tid = event.tid;
        self.events += 1;
        *self.threads.entry(tid).or_insert(0) += 1;
        self.first_ts = Some(self.first_ts.map_or(ts, |t| t.min(ts)));
        self.last_ts = Some(self.last_ts.map_or(ts, |t| t.max(ts)));
        let pid = replay.process_of(tid);
        self.thread_pids.insert(tid, pid);
        let p = self.processes.entry(pid).or_default();
        p.first_ts = Some(p.first_ts.map_or(ts, |t| t.min(ts)));
        p.last_ts = p.last_ts.max(ts);
        self.apply(steps, replay);
        match &event.kind {
            EventKind::GcStart { generation } => {
                self.thinning.event();
                if let Some(&(leaf, line)) = self.trigger_stack(tid, replay).last() {
                    let entry = self
                        .gc_triggers
                        .entry((*generation, leaf))
                        .or_insert((line, 0));
                    entry.1 += 1;
                }
                self.gc.start(tid, *generation, ts)
            }
            EventKind::Stack { frames } => {
                self.pending_stack.insert(tid, walked(replay, frames));
            }
            EventKind::GcDone { collected } => self.gc.done(tid, *collected, ts),
            EventKind::ImportStart { module } => {
                self.thinning.event();
                self.pending_stack.remove(&tid);
                self.imports.start(tid, *module, ts)
            }
            EventKind::ImportDone { module, found } => self.imports.done(tid, *module, *found, ts),
            EventKind::Audit { event } => {
                self.thinning.event();
                *self.audit.entry(*event).or_insert(0) += 1;
                let stack = self.trigger_stack(tid, replay);
                if !stack.is_empty() {
                    let kept = stack[stack.len().saturating_sub(8)..].to_vec();
                    *self.audit_stacks.entry((*event, kept)).or_insert(0) += 1;
                }
            }
            EventKind::Sample { frames, state } => {
                self.samples_seen += 1;
                if !self.counts_thread(tid) || !self.tally.admit(*state) {
                    return;
                }
                let codes: Vec<FrameRef> = frames.iter().map(|w| replay.walked_code(w)).collect();
                let weight = replay.sample_weight(tid, self.sample_interval_ns);
                self.samples.record(&codes, weight);
                if let Some(p) = self.processes.get_mut(&pid) {
                    p.samples.record(&codes, weight);
                }
            }
            EventKind::ThreadExit => {
                self.gc.thread_exit(tid);
                self.imports.thread_exit(tid);
            }
            EventKind::Lost { count } => {
                self.lost = self.lost.saturating_add(*count);
            }
            EventKind::Paused { ns } => self.paused.push((ts, *ns)),
            EventKind::Caveat { text } => self.caveats.push((ts, pid, *text)),
            EventKind::Window { exact } => self.windows.toggle(*exact, ts),
            EventKind::Thinned { level } => self.thinning.set(*level, ts),
            EventKind::AuditsCounted { count } => {
                self.thinning.audits_counted = self.thinning.audits_counted.saturating_add(*count)
            }
            EventKind::ReturnType {
                function,
                returned,
                total,
            } => self.return_types.record(tid, *function, *returned, *total),
            EventKind::Call { .. }
            | EventKind::Resume { .. }
            | EventKind::Return { .. }
            | EventKind::Line { .. }
            | EventKind::Running { .. }
            | EventKind::ThreadStart { .. }
            | EventKind::ProcessStart { .. }
            | EventKind::Exec { .. } => {}
        }
    }

    /// The Python stack of `tid` at the event being handled: the stack the frame
    /// walker recorded for it (a `Stack` event just before), else the replayed
    /// stack (trace mode), else nothing.
    fn trigger_stack(&mut self, tid: u32, replay: &Replay) -> Vec<(FrameRef, u32)> {
        match self.pending_stack.remove(&tid) {
            Some(frames) => frames,
            None => replay.stack(tid).map(|c| (c, c.line)).collect(),
        }
    }

    /// Books the frames and calls the replay ended, to the functions of the
    /// whole recording and of their process.
    pub fn apply(&mut self, steps: &[Step], replay: &Replay) {
        for step in steps {
            let tid = match *step {
                Step::Exit(e) => e.tid,
                Step::Untimed { tid, .. } => tid,
                Step::Enter { .. } => continue,
            };
            if !self.counts_thread(tid) {
                continue;
            }
            book(&mut self.functions, step);
            let pid = replay.process_of(tid);
            self.processes.entry(pid).or_default().book(step);
        }
    }

    /// Ends the recording at `end_ns` (the trailer's end; `None` uses the last
    /// event) and resolves string ids with `resolve`.
    pub fn finish(
        self,
        replay: Replay,
        end_ns: Option<u64>,
        resolve: impl Fn(StrId) -> String,
    ) -> Report {
        self.finish_named(replay, end_ns, resolve, &Qualnames::default())
    }

    /// As [`finish`](Self::finish), functions shown by their qualified names
    /// (`qualnames`: the recording's, read to the end).
    pub(crate) fn finish_named(
        mut self,
        mut replay: Replay,
        end_ns: Option<u64>,
        resolve: impl Fn(StrId) -> String,
        qualnames: &Qualnames,
    ) -> Report {
        let end = end_ns.or(self.last_ts).unwrap_or(self.start_ns);
        // Open frames end no earlier than the last event, so no time is negative.
        let close_at = end.max(self.last_ts.unwrap_or(0));
        let mut steps = Vec::new();
        replay.finish(close_at, &mut steps);
        self.apply(&steps, &replay);
        let start = if self.start_ns != 0 {
            self.start_ns
        } else {
            self.first_ts.unwrap_or(end)
        };
        let plan = replay.plan();
        let source = match plan.pairing() {
            // Samples of any thread in any state: a view of one thread, or of busy
            // threads when all waited, is of a sampled recording still.
            _ if plan.calls + plan.returns == 0 && self.samples_seen > 0 => FunctionSource::Sampled,
            Pairing::ReturnsOnly => FunctionSource::ReturnsOnly,
            _ => FunctionSource::Traced,
        };
        let has_calls = plan.calls + plan.returns > 0;
        let interval = self.sample_interval_ns;
        let windowed = self.windows.seen;
        let times: HashMap<u32, super::replay::ThreadTime> =
            replay.thread_times().into_iter().collect();

        let mut names = Names::new(resolve, qualnames);
        let rules = RowRules {
            source,
            windowed,
            has_calls,
            interval,
        };
        let mut all_creations: HashMap<(StrId, StrId), u64> = HashMap::new();
        for (&(_, name), &n) in replay.creations() {
            *all_creations.entry(name).or_insert(0) += n;
        }
        let functions = rules.rows(
            &mut names,
            &self.functions,
            self.samples.finish(),
            &all_creations,
        );
        let mut processes = Vec::new();
        let root = self.target.pid;
        let map = &replay.plan().processes;
        // The recording's own process first, then in order of appearance; one
        // with no event of its own is still listed.
        let mut order: Vec<u32> = map.all().iter().map(|p| p.pid).collect();
        order.extend(self.processes.keys().filter(|pid| map.get(**pid).is_none()));
        for pid in order {
            let acc = self.processes.remove(&pid).unwrap_or_default();
            let samples = acc.samples.samples;
            let creations: HashMap<(StrId, StrId), u64> = replay
                .creations()
                .iter()
                .filter(|((p, _), _)| *p == pid)
                .map(|(&(_, name), &n)| (name, n))
                .collect();
            let rows = rules.rows(&mut names, &acc.functions, acc.samples.finish(), &creations);
            let info = map.get(pid);
            processes.push(ProcessStats {
                pid,
                parent: info.and_then(|p| p.parent),
                command: match info.and_then(|p| p.command) {
                    Some(id) => names.get(id),
                    None => self.command.clone(),
                },
                threads: self.thread_pids.values().filter(|&&p| p == pid).count() as u64,
                samples,
                duration_ns: acc.first_ts.map_or(0, |f| acc.last_ts.saturating_sub(f)),
                own_ns: rows
                    .iter()
                    .map(|f| f.exclusive_ns)
                    .fold(0u64, u64::saturating_add),
                event_cost_ns: plan.event_cost(pid),
                tracing_cost_ns: times
                    .iter()
                    .filter(|(tid, _)| self.thread_pids.get(tid).copied().unwrap_or(root) == pid)
                    .map(|(_, t)| t.cost_ns)
                    .fold(0u64, u64::saturating_add),
                functions: rows,
            });
        }

        let (mut gc, unpaired_gc) = self.gc.finish();
        for stats in &mut gc {
            let mut triggers: Vec<Trigger> = self
                .gc_triggers
                .iter()
                .filter(|((g, _), _)| *g == stats.generation)
                .map(|((_, code), &(line, count))| Trigger {
                    function: names.shown(code),
                    file: names.get(code.file),
                    line,
                    count,
                })
                .collect();
            triggers.sort_by(|a, b| {
                b.count
                    .cmp(&a.count)
                    .then_with(|| a.function.cmp(&b.function))
                    .then_with(|| a.file.cmp(&b.file))
                    .then(a.line.cmp(&b.line))
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
                        .map(|(f, line)| {
                            format!("{} ({}:{})", names.shown(f), names.get(f.file), line)
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
        let return_types = self.return_types.finish(|id| names.get(id));

        Report {
            target: self.target,
            mode: self.mode,
            sample_interval_ns: interval,
            duration_ns: end.saturating_sub(start),
            events: self.events,
            lost_events: self.lost,
            paused: self
                .paused
                .iter()
                .map(|&(at, ns)| Pause {
                    at_ns: at.saturating_sub(start),
                    ns,
                })
                .collect(),
            caveats: caveats_of(&self.caveats, start, |id| names.get(id)),
            source,
            functions,
            gc,
            imports,
            audit,
            threads: self
                .threads
                .into_iter()
                .map(|(tid, events)| {
                    let t = times.get(&tid).copied().unwrap_or_default();
                    ThreadStats {
                        tid,
                        pid: self.thread_pids.get(&tid).copied().unwrap_or(root),
                        events,
                        traced_ns: t.wall_ns(),
                        exclusive_ns: t.exclusive_ns,
                        tracing_cost_ns: t.cost_ns,
                    }
                })
                .collect(),
            anomalies: Anomalies {
                replay: replay.counters(),
                unpaired_gc,
                unpaired_imports,
            },
            processes,
            truncated_at: None,
            exact_windows: self.windows.finish(close_at),
            thinned: self.thinning.finish(close_at),
            samples: self.tally,
            return_types,
        }
    }
}

/// Resolves each string id once.
struct Names<'q, F> {
    resolve: F,
    cache: HashMap<StrId, String>,
    qualnames: &'q Qualnames,
}

impl<'q, F: Fn(StrId) -> String> Names<'q, F> {
    fn new(resolve: F, qualnames: &'q Qualnames) -> Self {
        Names {
            resolve,
            cache: HashMap::new(),
            qualnames,
        }
    }

    fn get(&mut self, id: StrId) -> String {
        let resolve = &self.resolve;
        self.cache.entry(id).or_insert_with(|| resolve(id)).clone()
    }

    /// The function `code` names as views show it: its qualified name when the
    /// recording has one, [`UNNAMED`](crate::recording::UNNAMED) when empty.
    fn shown(&mut self, code: &FrameRef) -> String {
        let name = self.get(self.qualnames.shown(code));
        crate::recording::or_unnamed(&name).to_owned()
    }
}

/// The caveats of a recording, each text once per process (at its first time).
/// A set, not a scan of those kept: a hostile file may hold millions.
fn caveats_of(
    seen: &[(u64, u32, StrId)],
    start: u64,
    mut text: impl FnMut(StrId) -> String,
) -> Vec<Caveat> {
    let mut said: HashSet<(u32, String)> = HashSet::new();
    let mut out: Vec<Caveat> = Vec::new();
    for &(at, pid, id) in seen {
        let text = text(id);
        if said.insert((pid, text.clone())) {
            out.push(Caveat {
                at_ns: at.saturating_sub(start),
                pid,
                text,
            });
        }
    }
    out
}
