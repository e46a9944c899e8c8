//! [`Folder`]: events and replay steps folded into the stack tree, per thread.

use rustc_hash::FxHashMap;

use super::tree::{FoldCounts, FoldFrame, Folded, NodeId, StackTree};
use crate::analyze::replay::{plan_events, Pairing, Replay, Step};
use crate::analyze::states::{SampleFilter, SampleTally};
use crate::recording::{Event, EventKind, FrameRef, Header};

#[derive(Default)]
struct ThreadFold {
    /// The node of each frame on the replay's stack, bottom first.
    nodes: Vec<NodeId>,
    gc: Option<OpenGc>,
    /// Per depth, the last call entered there: its parent node, function and
    /// node. A loop calls the same function from the same frame again and again,
    /// and finds its node here without a lookup in the tree.
    last_entered: Vec<(NodeId, FrameRef, NodeId)>,
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
    /// Each stack starts with its thread's frame (for exports that label
    /// samples by thread).
    by_thread: bool,
    /// Sampled frames are split by the line they ran ([`FoldFrame::PythonLine`]).
    by_line: bool,
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
    pub(crate) fn for_recording(header: &Header, filter: SampleFilter) -> Self {
        Folder {
            sample_interval_ns: header.sample_interval_ns,
            tally: SampleTally::new(filter, header),
            ..Self::default()
        }
    }

    /// Keeps threads apart: every stack starts with a [`FoldFrame::Thread`]
    /// frame (under its process's, when there are several).
    pub(crate) fn by_thread(mut self) -> Self {
        self.by_thread = true;
        self
    }

    /// Splits each sampled Python frame by the line it was running: a
    /// [`FoldFrame::PythonLine`] per (function, line). Traced calls carry no line
    /// per frame and stay functions; so do frames without a line (native ones).
    pub(crate) fn by_line(mut self) -> Self {
        self.by_line = true;
        self
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
    /// recording holds several processes, else the root; then its thread's node
    /// when threads are kept apart.
    fn base(&mut self, tid: u32, replay: &Replay) -> NodeId {
        let pid = replay.process_of(tid);
        let process = if replay.several_processes() {
            let command = replay.processes().get(pid).and_then(|p| p.command);
            self.child(StackTree::ROOT, FoldFrame::Process { pid, command })
        } else {
            StackTree::ROOT
        };
        if self.by_thread {
            self.child(process, FoldFrame::Thread { tid, pid })
        } else {
            process
        }
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
            EventKind::Call { .. } | EventKind::Resume { .. } => self.counts.calls += 1,
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
                    let code = replay.walked_code(w);
                    let frame = if self.by_line && w.line != 0 {
                        FoldFrame::PythonLine { code, line: w.line }
                    } else {
                        FoldFrame::Python(code)
                    };
                    node = self.child(node, frame);
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
                    let t = self.threads.entry(tid).or_default();
                    t.nodes.truncate(depth);
                    let known = match &t.gc {
                        Some(gc) if gc.depth == depth => Some(gc.node),
                        _ => t.nodes.last().copied(),
                    };
                    // The thread's base only under its outermost frame: a lookup less a call.
                    let (parent, t) = match known {
                        Some(node) => (node, t),
                        None => {
                            let base = self.base(tid, replay);
                            (base, self.threads.entry(tid).or_default())
                        }
                    };
                    let node = match t.last_entered.get(depth) {
                        Some(&(p, c, node)) if p == parent && c == code => node,
                        _ => {
                            let node = self.tree.child(parent, FoldFrame::Python(code));
                            if t.last_entered.len() <= depth {
                                t.last_entered.resize(depth + 1, (NodeId::MAX, code, 0));
                            }
                            t.last_entered[depth] = (parent, code, node);
                            node
                        }
                    };
                    t.nodes.push(node);
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
    let plan = plan_events(header, strings, events);
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
