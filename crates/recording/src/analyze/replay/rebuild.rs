//! The second pass: each thread's stack rebuilt with the plan, as [`Step`]s
//! with inclusive and exclusive time.

use rustc_hash::FxHashMap;

use super::answers::AskedPlan;
use super::plan::Plan;
use super::steps::{
    EndKind, Exit, Name, Pairing, ReplayCounters, Step, ThreadTime, MAX_DEPTH, NO_LINE,
    OUT_OF_ORDER_NS,
};
use crate::analyze::processes::ProcessMap;
use crate::recording::{Event, EventKind, FrameRef, Header, WalkedFrame};

#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct OpenFrame {
    code: FrameRef,
    name: Name,
    start: u64,
    /// The inclusive times of its callees, as the clock counts them.
    child: u64,
    /// Calls and returns that ended a gap while it was on top: each cost its
    /// thread one event of tracing (see [`cost`](super::cost)).
    own_events: u64,
    /// The tracing cost left out of its callees' times.
    child_cost: u64,
    entered: Entered,
}

/// How a frame came onto the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Entered {
    /// Its entry: a call.
    Called,
    /// Its entry: a generator or coroutine entered again.
    Resumed,
    /// Running when tracing began: its entry was not seen.
    Seeded,
}

#[derive(Default, Clone, serde::Serialize, serde::Deserialize)]
struct ReplayThread {
    frames: Vec<OpenFrame>,
    /// Activations of each function (code object) on the stack.
    active: FxHashMap<FrameRef, u32>,
    overflow: u64,
    calls: u64,
    creation_cursor: usize,
    first_cursor: usize,
    /// The segment whose seeds are on the stack.
    seeded: Option<u32>,
    /// When its thread-start event came: nothing of it ran before.
    started: Option<u64>,
    /// Its monotonic clock.
    clock: u64,
    /// What tracing cost it per call or return (its process's), once known.
    event_cost: Option<u64>,
    time: ThreadTime,
}

/// The second pass; see the module documentation. What it has replayed so far
/// can be kept (serialized without its plan) and taken up again with
/// [`Replay::take_up`].
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct Replay {
    #[serde(skip)]
    plan: AskedPlan,
    threads: FxHashMap<u32, ReplayThread>,
    segment: u32,
    header_start: u64,
    counters: ReplayCounters,
    /// The processes as the events so far say.
    processes: ProcessMap,
    /// Generators and coroutines created (CPython 3.15's entries at creation),
    /// by process and function name.
    creations: FxHashMap<(u32, Name), u64>,
    /// Whether the last event pushed was such a creation.
    #[serde(skip)]
    created: bool,
}

impl Replay {
    /// Replays a recording described by `header` with the first pass's `plan`.
    pub fn new(header: &Header, plan: Plan) -> Self {
        Self::asking(header, AskedPlan::whole(plan))
    }

    fn asking(header: &Header, plan: AskedPlan) -> Self {
        Replay {
            plan,
            threads: FxHashMap::default(),
            segment: 0,
            header_start: header.start_ns,
            counters: ReplayCounters::default(),
            processes: ProcessMap::new(header),
            creations: FxHashMap::default(),
            created: false,
        }
    }

    /// Goes on from `kept`, a replay of the same recording serialized at some
    /// event (its plan is not kept): this replay's plan goes to it.
    pub(crate) fn take_up(&mut self, kept: Replay) {
        let plan = std::mem::take(&mut self.plan);
        *self = kept;
        self.plan = plan;
        self.created = false;
    }

    /// Replays a recording still being written with `plan`, made from its
    /// events so far: every answer the plan gives is kept, to be checked by
    /// [`settle`](Self::settle).
    pub(crate) fn provisional(header: &Header, plan: Plan) -> Self {
        Self::asking(header, AskedPlan::provisional(plan))
    }

    /// Goes on with `plan`, a provisional plan made from more events, keeping
    /// the answers given so far. Returns `false` when a question has already been
    /// answered two ways: the replay can no longer be the recording's.
    pub(crate) fn replan(&mut self, plan: Plan) -> bool {
        self.plan.replan(plan)
    }

    /// Whether a question was answered two ways by the provisional plans.
    pub(crate) fn contradicted(&self) -> bool {
        self.plan.contradicted()
    }

    /// Goes on with `plan`, the plan of the whole recording, if every answer the
    /// provisional plans gave is its answer: then this replay is exactly the one
    /// `plan` would have made. Returns `false` (and changes nothing) otherwise.
    pub(crate) fn settle(&mut self, plan: Plan) -> bool {
        self.plan.settle(plan)
    }

    /// Whether the event just pushed was an entry at a generator's or
    /// coroutine's creation (CPython 3.15), left out of the stacks.
    pub(crate) fn just_created(&self) -> bool {
        self.created
    }

    /// Generators and coroutines created, by process and function name, as far as
    /// the recording says (CPython 3.15's creation entries; none elsewhere).
    pub(crate) fn creations(&self) -> &FxHashMap<(u32, Name), u64> {
        &self.creations
    }

    /// The process of thread `tid` at the event being replayed.
    pub(crate) fn process_of(&self, tid: u32) -> u32 {
        self.processes.pid_of(tid)
    }

    /// The processes as the events so far say (commands as of now).
    pub fn processes(&self) -> &ProcessMap {
        &self.processes
    }

    /// Whether the recording holds more than its own process (known from the
    /// first pass, so from the first event on).
    pub(crate) fn several_processes(&self) -> bool {
        self.plan.plan().several_processes()
    }

    /// The plan it replays.
    pub(crate) fn plan(&self) -> &Plan {
        self.plan.plan()
    }

    /// The time one sample of thread `tid` stands for (see
    /// [`Plan::sample_weight`]).
    pub(crate) fn sample_weight(&self, tid: u32, nominal: u64) -> u64 {
        self.plan.sample_weight(tid, nominal)
    }

    /// Pairing irregularities so far.
    pub fn counters(&self) -> ReplayCounters {
        self.counters
    }

    /// The function of a frame the walker read.
    pub(crate) fn walked_code(&self, w: &WalkedFrame) -> FrameRef {
        self.plan.walked_code(w)
    }

    /// Per-thread totals, by thread id.
    pub(crate) fn thread_times(&self) -> Vec<(u32, ThreadTime)> {
        let mut v: Vec<(u32, ThreadTime)> =
            self.threads.iter().map(|(&t, r)| (t, r.time)).collect();
        v.sort_unstable_by_key(|(t, _)| *t);
        v
    }

    /// The functions on `tid`'s stack, outermost first.
    pub(crate) fn stack(&self, tid: u32) -> impl Iterator<Item = FrameRef> + '_ {
        self.threads
            .get(&tid)
            .into_iter()
            .flat_map(|t| t.frames.iter().map(|f| f.code))
    }

    /// Depth of `tid`'s stack.
    pub(crate) fn depth(&self, tid: u32) -> usize {
        self.threads.get(&tid).map_or(0, |t| t.frames.len())
    }

    /// Threads with a stack, in id order.
    pub(crate) fn thread_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.threads.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Adds one event; the steps it causes go to `out`. Returns the event's time
    /// on its thread's monotonic clock.
    pub fn push(&mut self, event: &Event, out: &mut Vec<Step>) -> u64 {
        let tid = event.tid;
        self.created = false;
        self.processes.push(event);
        let returns_only = self.plan.plan().pairing() == Pairing::ReturnsOnly;
        let t = self.threads.entry(tid).or_default();
        if matches!(
            event.kind,
            EventKind::Sample { .. }
                | EventKind::Thinned { .. }
                | EventKind::AuditsCounted { .. }
                | EventKind::ReturnType { .. }
                | EventKind::GcStart { .. }
                | EventKind::GcDone { .. }
                | EventKind::ImportStart { .. }
                | EventKind::ImportDone { .. }
                | EventKind::Audit { .. }
                | EventKind::Stack { .. }
        ) {
            // Written when pyprobe looks (a sample) or decides (markers, on whichever
            // thread): what the thread did before, read from a ring afterwards (a
            // record still being written when the sample was taken), keeps its
            // own time. GC, import and audit events move no call's clock either:
            // with the hook engine they come from another ring than the calls, read
            // at another moment, so they may be written before older calls.
            return t.clock.max(event.ts_ns);
        }
        if event.ts_ns.saturating_add(OUT_OF_ORDER_NS) < t.clock {
            self.counters.out_of_order += 1;
        }
        t.clock = t.clock.max(event.ts_ns);
        let ts = t.clock;
        if matches!(
            event.kind,
            EventKind::Call { .. } | EventKind::Resume { .. } | EventKind::Return { .. }
        ) {
            if t.event_cost.is_none() {
                t.event_cost = Some(self.plan.event_cost(self.processes.pid_of(tid)));
            }
            // The gap this event ends was the top frame's.
            if let Some(top) = t.frames.last_mut() {
                top.own_events += 1;
            }
        }
        match &event.kind {
            EventKind::Call { frame } | EventKind::Resume { frame } => {
                let entered = match event.kind {
                    EventKind::Resume { .. } => Entered::Resumed,
                    _ => Entered::Called,
                };
                let index = t.calls;
                t.calls += 1;
                if returns_only {
                    return ts;
                }
                if self.plan.is_creation(tid, index, &mut t.creation_cursor) {
                    self.created = true;
                    self.counters.generator_creations += 1;
                    let pid = self.processes.pid_of(tid);
                    *self
                        .creations
                        .entry((pid, (frame.file, frame.function)))
                        .or_insert(0) += 1;
                    return ts;
                }
                self.seed(tid, ts, out);
                let t = self.threads.entry(tid).or_default();
                if t.frames.len() >= MAX_DEPTH {
                    t.overflow += 1;
                    self.counters.depth_overflows += 1;
                    return ts;
                }
                let named = if frame.line == NO_LINE {
                    self.plan.entry_first(tid, index, &mut t.first_cursor)
                } else {
                    None
                };
                let code = match named {
                    Some(line) => FrameRef { line, ..*frame },
                    None => self.plan.entry_code(frame),
                };
                push_frame(t, tid, code, (frame.file, frame.function), ts, entered, out);
            }
            EventKind::Return { frame, first_line } => {
                if self.plan.is_shim(frame) {
                    self.counters.shim_returns += 1;
                    return ts;
                }
                if returns_only {
                    out.push(Step::Untimed {
                        tid,
                        ts,
                        code: self.plan.return_code(frame, *first_line),
                    });
                    return ts;
                }
                self.seed(tid, ts, out);
                let t = self.threads.entry(tid).or_default();
                if t.overflow > 0 {
                    // The innermost calls were dropped at the cap: this is one.
                    t.overflow -= 1;
                    out.push(Step::Untimed {
                        tid,
                        ts,
                        code: self.plan.return_code(frame, *first_line),
                    });
                    return ts;
                }
                let name = (frame.file, frame.function);
                match t.frames.iter().rposition(|f| f.name == name) {
                    Some(i) => {
                        if i + 1 < t.frames.len() {
                            self.counters.resyncs += 1;
                            while t.frames.len() > i + 1 {
                                self.counters.unpaired_entries += 1;
                                pop_frame(t, tid, ts, EndKind::Unpaired, out);
                            }
                        }
                        pop_frame(t, tid, ts, EndKind::Returned, out);
                    }
                    None => {
                        self.counters.orphan_returns += 1;
                        out.push(Step::Untimed {
                            tid,
                            ts,
                            code: self.plan.return_code(frame, *first_line),
                        });
                    }
                }
            }
            EventKind::ThreadExit => {
                self.close(tid, ts, EndKind::Open, out);
            }
            EventKind::ThreadStart { .. } => t.started = Some(ts),
            EventKind::Exec { .. } => {
                // The old program's frames ended with its image: times counted.
                let pid = self.processes.pid_of(tid);
                for id in self.thread_ids() {
                    if self.processes.pid_of(id) == pid {
                        let at = self.threads.get(&id).map_or(ts, |t| t.clock.max(ts));
                        self.close(id, at, EndKind::Cut, out);
                    }
                }
            }
            EventKind::Running { frames } if !returns_only => {
                // Tracing begins on this thread: what the walker saw is running.
                self.close(tid, ts, EndKind::Cut, out);
                self.seed(tid, ts, out);
                let t = self.threads.entry(tid).or_default();
                for w in frames {
                    if t.frames.len() >= MAX_DEPTH {
                        break;
                    }
                    self.counters.open_at_start += 1;
                    let code = self.plan.walked_code(w);
                    push_frame(
                        t,
                        tid,
                        code,
                        (w.code.file, w.code.function),
                        ts,
                        Entered::Seeded,
                        out,
                    );
                }
            }
            EventKind::Lost { .. } | EventKind::Window { .. } | EventKind::Paused { .. } => {
                for id in self.thread_ids() {
                    let at = self.threads.get(&id).map_or(ts, |t| t.clock.max(ts));
                    self.close(id, at, EndKind::Cut, out);
                }
                self.segment += 1;
            }
            _ => {}
        }
        ts
    }

    /// Pushes the frames that were running on `tid` when the current segment
    /// began, once per segment.
    fn seed(&mut self, tid: u32, ts: u64, out: &mut Vec<Step>) {
        let segment = self.segment;
        let t = self.threads.entry(tid).or_default();
        if t.seeded == Some(segment) {
            return;
        }
        t.seeded = Some(segment);
        let Some(seeds) = self.plan.seeds_of(tid, segment) else {
            return;
        };
        // Frames running when tracing began count from then: the thread's start
        // if it began later, else its process's first traced call or return (the
        // recording begins before the engine is installed, its target often
        // stopped meanwhile).
        let traced_from = self.plan.traced_from(self.processes.pid_of(tid));
        let start = match segment {
            0 => match (t.started, traced_from) {
                (Some(started), _) => started.min(ts),
                (None, Some(from)) => from.max(self.header_start).min(ts),
                (None, None) if self.header_start != 0 => self.header_start.min(ts),
                (None, None) => ts,
            },
            s => self
                .plan
                .segment_start(s as usize - 1)
                .unwrap_or(ts)
                .min(ts),
        };
        for (f, first_line) in seeds {
            if t.frames.len() >= MAX_DEPTH {
                break;
            }
            self.counters.open_at_start += 1;
            let code = self.plan.return_code(f, *first_line);
            push_frame(
                t,
                tid,
                code,
                (f.file, f.function),
                start,
                Entered::Seeded,
                out,
            );
        }
    }

    fn close(&mut self, tid: u32, ts: u64, kind: EndKind, out: &mut Vec<Step>) {
        let Some(t) = self.threads.get_mut(&tid) else {
            return;
        };
        while !t.frames.is_empty() {
            if kind == EndKind::Open {
                self.counters.open_at_end += 1;
            }
            pop_frame(t, tid, ts, kind, out);
        }
        t.overflow = 0;
    }

    /// The recording ended at `end_ns`: every open frame ends there (or at its
    /// thread's last event, if later), in thread-id order.
    pub fn finish(&mut self, end_ns: u64, out: &mut Vec<Step>) {
        for tid in self.thread_ids() {
            let at = self
                .threads
                .get(&tid)
                .map_or(end_ns, |t| t.clock.max(end_ns));
            self.close(tid, at, EndKind::Open, out);
        }
    }
}

fn push_frame(
    t: &mut ReplayThread,
    tid: u32,
    code: FrameRef,
    name: Name,
    ts: u64,
    entered: Entered,
    out: &mut Vec<Step>,
) {
    let depth = t.frames.len();
    let seeded = entered == Entered::Seeded;
    t.frames.push(OpenFrame {
        code,
        name,
        start: ts,
        child: 0,
        own_events: 0,
        child_cost: 0,
        entered,
    });
    *t.active.entry(code).or_insert(0) += 1;
    if t.time.first_ns.is_none() {
        t.time.first_ns = Some(ts);
    }
    out.push(Step::Enter {
        tid,
        ts,
        code,
        depth,
        seeded,
    });
}

fn pop_frame(t: &mut ReplayThread, tid: u32, ts: u64, kind: EndKind, out: &mut Vec<Step>) {
    let Some(f) = t.frames.pop() else {
        return;
    };
    let elapsed = ts.saturating_sub(f.start);
    // Tracing's cost per event leaves its own time (never below zero), and its
    // callees' costs its inclusive time with theirs.
    let own_elapsed = elapsed.saturating_sub(f.child);
    let own_cost = own_elapsed.min(f.own_events.saturating_mul(t.event_cost.unwrap_or(0)));
    let exclusive_ns = own_elapsed - own_cost;
    let cost = own_cost.saturating_add(f.child_cost);
    let inclusive_ns = elapsed.saturating_sub(cost);
    let outermost = match t.active.get_mut(&f.code) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        _ => {
            t.active.remove(&f.code);
            true
        }
    };
    if let Some(parent) = t.frames.last_mut() {
        parent.child = parent.child.saturating_add(elapsed);
        parent.child_cost = parent.child_cost.saturating_add(cost);
    }
    t.time.exclusive_ns = t.time.exclusive_ns.saturating_add(exclusive_ns);
    t.time.cost_ns = t.time.cost_ns.saturating_add(own_cost);
    t.time.last_ns = t.time.last_ns.max(ts);
    out.push(Step::Exit(Exit {
        tid,
        ts,
        start: f.start,
        code: f.code,
        depth: t.frames.len(),
        inclusive_ns,
        exclusive_ns,
        outermost,
        kind,
        seeded: f.entered == Entered::Seeded,
        resumed: f.entered == Entered::Resumed,
    }));
}
