//! Folded stacks: every stack a recording shows, merged into one tree, with the
//! exclusive time, the calls and the samples of each stack.
//!
//! Trace mode: each thread's stack comes from the shared [`Replay`], the one the
//! report uses, so per function the flame graph's own time is the report's
//! exclusive time and its calls the report's calls. A frame's exclusive time
//! goes to the stack it ran on. A GC pause becomes a `[gc]` frame on top of the stack that
//! triggered it, its time taken out of that frame's own time; Python code run by
//! the collector (finalizers) goes under the `[gc]` frame.
//!
//! Sample mode: each sample adds one to the stack it shows.
//!
//! Memory is bounded by the number of distinct stacks (plus the per-thread depth
//! cap), never by the number of events: a stack is a node of a tree, interned by
//! (parent, frame).

use rustc_hash::FxHashMap;

use super::replay::{Pairing, Replay, ReplayCounters, Step};
use super::states::{SampleFilter, SampleTally};
use crate::record::{Event, EventKind, FrameRef, Header, StrId};

/// One frame of a folded stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FoldFrame {
    /// A Python function: file, name, first line.
    Python(FrameRef),
    /// A garbage collection of this generation.
    Gc {
        /// GC generation (0 youngest).
        generation: i32,
    },
    /// The process the stacks above ran in, at the root of every stack when the
    /// recording holds several (`--subprocesses`).
    Process {
        pid: u32,
        /// Its command line then; `None`: the recording's (the header's).
        command: Option<StrId>,
    },
}

/// What a stack's value counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Exclusive time in ns (trace mode).
    Time,
    /// Finished calls (trace mode).
    Calls,
    /// Samples whose stack this is (sample mode).
    Samples,
}

/// Id of a stack: a node of the tree. [`StackTree::ROOT`] is the empty stack.
pub type NodeId = u32;

#[derive(Debug, Clone, Copy)]
struct Node {
    parent: NodeId,
    frame: Option<FoldFrame>,
}

/// Stacks interned as a tree: a node is a frame and its parent's stack.
#[derive(Debug, Clone)]
pub struct StackTree {
    nodes: Vec<Node>,
    // Fx: the keys are the recording's own small ids, one lookup per call.
    index: FxHashMap<(NodeId, FoldFrame), NodeId>,
}

impl Default for StackTree {
    fn default() -> Self {
        StackTree {
            nodes: vec![Node {
                parent: Self::ROOT,
                frame: None,
            }],
            index: FxHashMap::default(),
        }
    }
}

impl StackTree {
    /// The empty stack.
    pub const ROOT: NodeId = 0;

    /// The stack `parent` with `frame` on top.
    pub fn child(&mut self, parent: NodeId, frame: FoldFrame) -> NodeId {
        let next = self.nodes.len() as NodeId;
        *self.index.entry((parent, frame)).or_insert_with(|| {
            self.nodes.push(Node {
                parent,
                frame: Some(frame),
            });
            next
        })
    }

    /// Number of nodes, the root included.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the tree holds only the root.
    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    /// The frames of stack `node`, outermost first, into `out` (cleared first).
    pub fn path(&self, node: NodeId, out: &mut Vec<FoldFrame>) {
        out.clear();
        let mut n = node;
        while n != Self::ROOT {
            let node = self.nodes[n as usize];
            if let Some(f) = node.frame {
                out.push(f);
            }
            n = node.parent;
        }
        out.reverse();
    }
}

/// Event counts seen while folding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FoldCounts {
    /// Events read.
    pub events: u64,
    /// `call` events.
    pub calls: u64,
    /// `return` events.
    pub returns: u64,
    /// `sample` events.
    pub samples: u64,
    /// Finished GC collections.
    pub gcs: u64,
    /// Sum of the `lost` events' counts.
    pub lost: u64,
    /// Earliest timestamp.
    pub first_ts: Option<u64>,
    /// Latest timestamp.
    pub last_ts: Option<u64>,
    /// The function events are returns only (CPython 3.11): no stacks from them.
    pub returns_only: bool,
}

#[derive(Default)]
struct ThreadFold {
    /// The node of each frame on the replay's stack, bottom first.
    nodes: Vec<NodeId>,
    gc: Option<OpenGc>,
}

struct OpenGc {
    start_ns: u64,
    node: NodeId,
    /// Stack depth when the collection started: frames entered at this depth
    /// run inside the collection (finalizers).
    depth: usize,
    /// Inclusive time of those frames.
    inner_ns: u64,
}

/// Folds a replayed recording into stacks: feed it each event with
/// [`push`](Self::push), then [`finish`](Self::finish).
#[derive(Default)]
pub struct Folder {
    tree: StackTree,
    /// Exclusive ns per node, wrapping: a GC pause is taken off its frame before
    /// that frame's own time is added.
    time: Vec<u64>,
    calls: Vec<u64>,
    samples: Vec<u64>,
    threads: FxHashMap<u32, ThreadFold>,
    counts: FoldCounts,
    /// What one sample stands for in time: samples between exact windows of a
    /// budget-limited trace add to the time measure.
    sample_interval_ns: u64,
    /// A window event was seen: the recording is budget-limited.
    windowed: bool,
    /// Which samples count (see `states`); without a recording's header, all do.
    tally: SampleTally,
}

impl Folder {
    /// An empty folder.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty folder for a recording sampled every `ns`, counting every sample.
    pub fn with_sample_interval(ns: u64) -> Self {
        Folder {
            sample_interval_ns: ns,
            ..Self::default()
        }
    }

    /// An empty folder for the recording `header` describes, counting the samples
    /// `filter` keeps.
    pub fn for_recording(header: &Header, filter: SampleFilter) -> Self {
        Folder {
            sample_interval_ns: header.sample_interval_ns,
            tally: SampleTally::new(filter, header),
            ..Self::default()
        }
    }

    fn grow(&mut self) {
        let n = self.tree.len();
        if self.time.len() < n {
            self.time.resize(n, 0);
            self.calls.resize(n, 0);
            self.samples.resize(n, 0);
        }
    }

    fn child(&mut self, parent: NodeId, frame: FoldFrame) -> NodeId {
        let node = self.tree.child(parent, frame);
        self.grow();
        node
    }

    /// Where the stacks of thread `tid` start: its process's node when the
    /// recording holds several processes, else the root.
    fn base(&mut self, tid: u32, replay: &Replay) -> NodeId {
        if !replay.several_processes() {
            return StackTree::ROOT;
        }
        let pid = replay.process_of(tid);
        let command = replay.processes().get(pid).and_then(|p| p.command);
        self.child(StackTree::ROOT, FoldFrame::Process { pid, command })
    }

    /// Adds one event, at its thread's time `ts`, with the steps the replay made
    /// of it.
    pub fn push(&mut self, event: &Event, ts: u64, steps: &[Step], replay: &Replay) {
        let tid = event.tid;
        let c = &mut self.counts;
        c.events += 1;
        c.first_ts = Some(c.first_ts.map_or(ts, |t| t.min(ts)));
        c.last_ts = Some(c.last_ts.map_or(ts, |t| t.max(ts)));
        match &event.kind {
            EventKind::Call { .. } => self.counts.calls += 1,
            EventKind::Return { .. } => self.counts.returns += 1,
            _ => {}
        }
        self.apply(steps, replay);
        match &event.kind {
            EventKind::GcStart { generation } => {
                let depth = replay.depth(tid);
                let top = match self.threads.get(&tid).and_then(|t| t.nodes.last().copied()) {
                    Some(node) => node,
                    None => self.base(tid, replay),
                };
                let node = self.child(
                    top,
                    FoldFrame::Gc {
                        generation: *generation,
                    },
                );
                self.threads.entry(tid).or_default().gc = Some(OpenGc {
                    start_ns: ts,
                    node,
                    depth,
                    inner_ns: 0,
                });
            }
            EventKind::GcDone { .. } => {
                let Some(t) = self.threads.get_mut(&tid) else {
                    return;
                };
                let Some(gc) = t.gc.take() else {
                    return;
                };
                self.counts.gcs += 1;
                let own = ts.saturating_sub(gc.start_ns).saturating_sub(gc.inner_ns);
                let n = gc.node as usize;
                self.time[n] = self.time[n].wrapping_add(own);
                // The frame the collection ran in gets its exclusive time (which
                // includes the pause) when it ends: take the pause off now.
                if gc.depth > 0 && gc.depth <= t.nodes.len() {
                    let p = t.nodes[gc.depth - 1] as usize;
                    self.time[p] = self.time[p].wrapping_sub(own);
                }
            }
            EventKind::Sample { frames, state } => {
                self.counts.samples += 1;
                if !self.tally.admit(*state) || frames.is_empty() {
                    return;
                }
                let mut node = self.base(tid, replay);
                for w in frames {
                    node = self.child(node, FoldFrame::Python(replay.walked_code(w)));
                }
                self.samples[node as usize] += 1;
                if self.windowed {
                    let n = node as usize;
                    self.time[n] = self.time[n].wrapping_add(self.sample_interval_ns);
                }
            }
            EventKind::Lost { count } => {
                self.counts.lost = self.counts.lost.saturating_add(*count);
            }
            EventKind::Window { .. } => self.windowed = true,
            EventKind::ThreadExit => {
                self.threads.remove(&tid);
            }
            _ => {}
        }
    }

    /// Books the frames the replay pushed and ended.
    fn apply(&mut self, steps: &[Step], replay: &Replay) {
        for step in steps {
            match *step {
                Step::Enter {
                    tid, code, depth, ..
                } => {
                    let base = self.base(tid, replay);
                    let t = self.threads.entry(tid).or_default();
                    t.nodes.truncate(depth);
                    let parent = match &t.gc {
                        Some(gc) if gc.depth == depth => gc.node,
                        _ => t.nodes.last().copied().unwrap_or(base),
                    };
                    let node = self.tree.child(parent, FoldFrame::Python(code));
                    self.threads.entry(tid).or_default().nodes.push(node);
                    self.grow();
                }
                Step::Exit(e) => {
                    let Some(t) = self.threads.get_mut(&e.tid) else {
                        continue;
                    };
                    let Some(&node) = t.nodes.get(e.depth) else {
                        continue;
                    };
                    if let Some(gc) = &mut t.gc {
                        if e.depth == gc.depth {
                            gc.inner_ns = gc.inner_ns.saturating_add(e.inclusive_ns);
                        }
                    }
                    t.nodes.truncate(e.depth);
                    let n = node as usize;
                    self.time[n] = self.time[n].wrapping_add(e.exclusive_ns);
                    if e.is_call() {
                        self.calls[n] += 1;
                    }
                }
                Step::Untimed { tid, code, .. } => {
                    // A call whose entry was not seen: counted on top of the stack.
                    let top = match self.threads.get(&tid).and_then(|t| t.nodes.last().copied()) {
                        Some(node) => node,
                        None => self.base(tid, replay),
                    };
                    let node = self.child(top, FoldFrame::Python(code));
                    self.calls[node as usize] += 1;
                }
            }
        }
    }

    /// Counts so far.
    pub fn counts(&self) -> FoldCounts {
        self.counts
    }

    /// Ends the recording at `end_ns` (`None`: the last event): open frames end
    /// there, their time counted, their calls not.
    pub fn finish(mut self, mut replay: Replay, end_ns: Option<u64>) -> Folded {
        let last = self.counts.last_ts.unwrap_or(0);
        let close_at = end_ns.unwrap_or(last).max(last);
        let mut steps = Vec::new();
        replay.finish(close_at, &mut steps);
        self.apply(&steps, &replay);
        self.grow();
        self.counts.returns_only = replay.plan().pairing() == Pairing::ReturnsOnly;
        Folded {
            counters: replay.counters(),
            tree: self.tree,
            time: self.time,
            calls: self.calls,
            samples: self.samples,
            counts: self.counts,
            tally: self.tally,
        }
    }
}

/// Folds events held in memory (tests, benchmarks): plans, replays and folds them.
pub fn fold_events(
    header: &Header,
    strings: &[String],
    events: &[Event],
    end_ns: Option<u64>,
) -> Folded {
    let plan = super::replay::plan_events(header, strings, events);
    let mut replay = Replay::new(header, plan);
    let mut folder = Folder::for_recording(header, SampleFilter::default());
    let mut steps = Vec::new();
    for e in events {
        steps.clear();
        let ts = replay.push(e, &mut steps);
        folder.push(e, ts, &steps, &replay);
    }
    folder.finish(replay, end_ns)
}

/// The folded stacks of a whole recording.
#[derive(Debug, Clone)]
pub struct Folded {
    /// The stacks.
    pub tree: StackTree,
    time: Vec<u64>,
    calls: Vec<u64>,
    samples: Vec<u64>,
    /// Event counts.
    pub counts: FoldCounts,
    /// How well call and return events paired.
    pub counters: ReplayCounters,
    /// Which samples were counted (by their thread's state), and how many were not.
    pub tally: SampleTally,
}

impl Folded {
    /// The value of stack `node` for `measure` (its own, not its children's).
    pub fn value(&self, node: NodeId, measure: Measure) -> u64 {
        let i = node as usize;
        match measure {
            // A negative balance (clock oddities) counts as nothing.
            Measure::Time => {
                let v = self.time.get(i).copied().unwrap_or(0);
                if v > i64::MAX as u64 {
                    0
                } else {
                    v
                }
            }
            Measure::Calls => self.calls.get(i).copied().unwrap_or(0),
            Measure::Samples => self.samples.get(i).copied().unwrap_or(0),
        }
    }

    /// Sum of every stack's value.
    pub fn total(&self, measure: Measure) -> u64 {
        (0..self.tree.len() as NodeId)
            .map(|n| self.value(n, measure))
            .fold(0u64, u64::saturating_add)
    }

    /// Each stack's value plus its descendants'.
    pub fn subtree_totals(&self, measure: Measure) -> Vec<u64> {
        let n = self.tree.len();
        let mut totals: Vec<u64> = (0..n as NodeId).map(|i| self.value(i, measure)).collect();
        // A child is always created after its parent: one backward pass adds up.
        for i in (1..n).rev() {
            let parent = self.tree.nodes[i].parent as usize;
            totals[parent] = totals[parent].saturating_add(totals[i]);
        }
        totals
    }

    /// Walks the stacks depth first, siblings in order of their names (as given
    /// by `name`), and calls `emit` with the names of each stack (outermost
    /// first) whose value is not zero, and that value. Memory beyond the tree is
    /// bounded by the depth times the widest fan-out: no stack list is built.
    ///
    /// A stack whose total (its value and its descendants') is below
    /// `min_total`, under another stack, is not visited: its total counts as its
    /// parent's own value, so the totals of the stacks visited are unchanged.
    /// Outermost frames are always visited, so the grand total is too.
    pub fn walk_named(
        &self,
        measure: Measure,
        min_total: u64,
        mut name: impl FnMut(&FoldFrame) -> String,
        mut emit: impl FnMut(&[String], u64),
    ) {
        let n = self.tree.len();
        let totals = self.subtree_totals(measure);
        // Children lists, compressed: `start[p]..start[p + 1]` in `kids`.
        let mut start = vec![0u32; n + 1];
        for node in &self.tree.nodes[1..] {
            start[node.parent as usize + 1] += 1;
        }
        for i in 0..n {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut kids = vec![0 as NodeId; n.saturating_sub(1)];
        for (i, node) in self.tree.nodes.iter().enumerate().skip(1) {
            let p = node.parent as usize;
            kids[fill[p] as usize] = i as NodeId;
            fill[p] += 1;
        }
        drop(fill);

        // The children of `node` worth visiting, sorted by name (reversed, to
        // pop), and the total of those left out.
        let mut children = |node: NodeId| -> (Vec<(String, NodeId)>, u64) {
            let (a, b) = (start[node as usize], start[node as usize + 1]);
            let mut kept = Vec::new();
            let mut pruned = 0u64;
            for &c in &kids[a as usize..b as usize] {
                let t = totals[c as usize];
                if t == 0 {
                    continue;
                }
                if node != StackTree::ROOT && t < min_total {
                    pruned = pruned.saturating_add(t);
                } else if let Some(f) = &self.tree.nodes[c as usize].frame {
                    kept.push((name(f), c));
                }
            }
            kept.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(y.1.cmp(&x.1)));
            (kept, pruned)
        };

        let mut path: Vec<String> = Vec::new();
        let (roots, _) = children(StackTree::ROOT);
        let mut pending: Vec<Vec<(String, NodeId)>> = vec![roots];
        while let Some(level) = pending.last_mut() {
            let Some((frame_name, node)) = level.pop() else {
                pending.pop();
                path.pop();
                continue;
            };
            path.push(frame_name);
            let (kept, pruned) = children(node);
            let own = self.value(node, measure).saturating_add(pruned);
            if own > 0 {
                emit(&path, own);
            }
            pending.push(kept);
        }
    }

    /// Calls `f` with each stack (outermost first) whose value is not zero, in
    /// node order (first seen first).
    pub fn for_each_stack(&self, measure: Measure, mut f: impl FnMut(&[FoldFrame], u64)) {
        let mut path = Vec::new();
        for node in 1..self.tree.len() as NodeId {
            let v = self.value(node, measure);
            if v > 0 {
                self.tree.path(node, &mut path);
                f(&path, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{SampleState, StrId};

    fn fr(function: u32, line: u32) -> FrameRef {
        FrameRef {
            file: StrId(0),
            function: StrId(function),
            line,
        }
    }

    fn ev(tid: u32, ts_ns: u64, kind: EventKind) -> Event {
        Event { tid, ts_ns, kind }
    }

    fn walked(function: u32, line: u32) -> crate::record::WalkedFrame {
        crate::record::WalkedFrame {
            code: fr(function, 1),
            line,
        }
    }

    fn fold(events: &[Event], end: Option<u64>) -> Folded {
        let header = Header::default();
        let plan = crate::analyze::replay::plan_events(&header, &[], events);
        let mut replay = Replay::new(&header, plan);
        let mut folder = Folder::new();
        let mut steps = Vec::new();
        for e in events {
            steps.clear();
            let ts = replay.push(e, &mut steps);
            folder.push(e, ts, &steps, &replay);
        }
        folder.finish(replay, end)
    }

    fn stacks(f: &Folded, m: Measure) -> Vec<(Vec<u32>, u64)> {
        let mut out = Vec::new();
        f.for_each_stack(m, |path, v| {
            let names = path
                .iter()
                .map(|p| match p {
                    FoldFrame::Python(fr) => fr.function.0,
                    FoldFrame::Gc { .. } => 99,
                    FoldFrame::Process { pid, .. } => 1000 + pid,
                })
                .collect();
            out.push((names, v));
        });
        out.sort();
        out
    }

    #[test]
    fn exclusive_time_and_calls_per_stack() {
        let folded = fold(
            &[
                ev(1, 0, EventKind::Call { frame: fr(1, 1) }),
                ev(1, 10, EventKind::Call { frame: fr(2, 5) }),
                ev(1, 30, EventKind::Return { frame: fr(2, 7) }),
                ev(1, 35, EventKind::Call { frame: fr(2, 5) }),
                ev(1, 40, EventKind::Return { frame: fr(2, 6) }),
                ev(1, 50, EventKind::Return { frame: fr(1, 3) }),
            ],
            None,
        );
        assert_eq!(
            stacks(&folded, Measure::Time),
            vec![(vec![1], 25), (vec![1, 2], 25)]
        );
        assert_eq!(
            stacks(&folded, Measure::Calls),
            vec![(vec![1], 1), (vec![1, 2], 2)]
        );
        assert_eq!(folded.total(Measure::Time), 50);
    }

    #[test]
    fn unpaired_streams() {
        let folded = fold(
            &[
                // Attached mid-call: a return on an empty stack, a frame running
                // when tracing began.
                ev(1, 0, EventKind::Return { frame: fr(7, 9) }),
                // An entry without return (3.15 generator creation), popped by a resync.
                ev(1, 10, EventKind::Call { frame: fr(1, 1) }),
                ev(1, 20, EventKind::Call { frame: fr(2, 2) }),
                ev(1, 30, EventKind::Return { frame: fr(1, 1) }),
                // Open at the end.
                ev(2, 40, EventKind::Call { frame: fr(3, 3) }),
            ],
            Some(100),
        );
        assert_eq!(
            stacks(&folded, Measure::Calls),
            vec![(vec![1], 1), (vec![1, 2], 1), (vec![7], 1)]
        );
        assert_eq!(
            stacks(&folded, Measure::Time),
            vec![(vec![1], 10), (vec![1, 2], 10), (vec![3], 60)]
        );
        assert_eq!(folded.counters.open_at_start, 1);
        assert_eq!(folded.counters.orphan_returns, 0);
        assert_eq!(folded.counters.unpaired_entries, 1);
    }

    #[test]
    fn gc_pause_goes_on_top_of_its_stack() {
        let folded = fold(
            &[
                ev(1, 0, EventKind::Call { frame: fr(1, 1) }),
                ev(1, 10, EventKind::GcStart { generation: 0 }),
                // A finalizer run by the collector.
                ev(1, 12, EventKind::Call { frame: fr(2, 2) }),
                ev(1, 16, EventKind::Return { frame: fr(2, 2) }),
                ev(1, 20, EventKind::GcDone { collected: 3 }),
                ev(1, 50, EventKind::Return { frame: fr(1, 1) }),
            ],
            None,
        );
        assert_eq!(
            stacks(&folded, Measure::Time),
            vec![(vec![1], 40), (vec![1, 99], 6), (vec![1, 99, 2], 4)]
        );
        assert_eq!(folded.total(Measure::Time), 50);
        assert_eq!(folded.counts.gcs, 1);
    }

    #[test]
    fn walk_in_name_order_and_prune_narrow_stacks() {
        let folded = fold(
            &[
                ev(1, 0, EventKind::Call { frame: fr(3, 1) }),
                ev(1, 10, EventKind::Call { frame: fr(2, 1) }),
                ev(1, 11, EventKind::Return { frame: fr(2, 1) }),
                ev(1, 20, EventKind::Call { frame: fr(1, 1) }),
                ev(1, 60, EventKind::Call { frame: fr(4, 1) }),
                ev(1, 62, EventKind::Return { frame: fr(4, 1) }),
                ev(1, 70, EventKind::Return { frame: fr(1, 1) }),
                ev(1, 100, EventKind::Return { frame: fr(3, 1) }),
                ev(2, 100, EventKind::Call { frame: fr(5, 1) }),
                ev(2, 101, EventKind::Return { frame: fr(5, 1) }),
            ],
            None,
        );
        let name = |f: &FoldFrame| match f {
            FoldFrame::Python(p) => format!("f{}", p.function.0),
            FoldFrame::Gc { .. } => "gc".into(),
            FoldFrame::Process { pid, .. } => format!("p{pid}"),
        };
        let walk = |min_total| {
            let mut out = Vec::new();
            folded.walk_named(Measure::Time, min_total, name, |path, v| {
                out.push(format!("{} {v}", path.join(";")));
            });
            out
        };
        assert_eq!(
            walk(1),
            vec!["f3 49", "f3;f1 48", "f3;f1;f4 2", "f3;f2 1", "f5 1"]
        );
        // Stacks under 5 fold into their parent; outermost ones stay.
        assert_eq!(walk(5), vec!["f3 50", "f3;f1 50", "f5 1"]);
        let total: u64 = walk(5)
            .iter()
            .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
            .sum();
        assert_eq!(total, folded.total(Measure::Time));
    }

    #[test]
    fn samples_count_per_stack() {
        let folded = fold(
            &[
                ev(
                    1,
                    0,
                    EventKind::Sample {
                        frames: vec![walked(1, 4), walked(2, 8)],
                        state: SampleState::default(),
                    },
                ),
                ev(
                    1,
                    1,
                    EventKind::Sample {
                        frames: vec![walked(1, 4), walked(2, 8)],
                        state: SampleState::default(),
                    },
                ),
                ev(
                    1,
                    2,
                    EventKind::Sample {
                        frames: vec![walked(1, 4)],
                        state: SampleState::default(),
                    },
                ),
                ev(
                    1,
                    3,
                    EventKind::Sample {
                        frames: vec![],
                        state: SampleState::default(),
                    },
                ),
            ],
            None,
        );
        assert_eq!(
            stacks(&folded, Measure::Samples),
            vec![(vec![1], 1), (vec![1, 2], 2)]
        );
        assert_eq!(folded.counts.samples, 4);
    }
}
