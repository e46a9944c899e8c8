//! The stack tree and what it holds per stack: [`Folded`].

use crate::analyze::replay::ReplayCounters;
use crate::analyze::states::SampleTally;
use crate::recording::{FrameRef, StrId};
use rustc_hash::FxHashMap;

/// One frame of a folded stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum FoldFrame {
    /// A Python function: file, name, first line.
    Python(FrameRef),
    /// A Python function at the line it was running when sampled (`flame
    /// --lines`): the same function at two lines is two frames.
    PythonLine {
        /// The function: file, name, first line.
        code: FrameRef,
        /// The line it was running (the call, in an outer frame).
        line: u32,
    },
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
    /// The thread the stacks above ran on, under its process, when the folder
    /// was asked to keep threads apart ([`Folder::by_thread`](super::Folder::by_thread)).
    Thread {
        tid: u32,
        /// Its process (the recording's, or a child traced with it).
        pid: u32,
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

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Node {
    parent: NodeId,
    frame: Option<FoldFrame>,
}

/// Stacks interned as a tree: a node is a frame and its parent's stack.
/// Stored as its nodes alone; the index is rebuilt, and the nodes checked, on
/// reading.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(into = "Vec<Node>", try_from = "Vec<Node>")]
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

impl From<StackTree> for Vec<Node> {
    fn from(tree: StackTree) -> Self {
        tree.nodes
    }
}

impl TryFrom<Vec<Node>> for StackTree {
    type Error = String;

    /// The tree of `nodes`, which must be one: the root first, then each node
    /// after its parent, no frame twice under one parent.
    fn try_from(nodes: Vec<Node>) -> Result<Self, Self::Error> {
        match nodes.first() {
            Some(root) if root.frame.is_none() && root.parent == Self::ROOT => {}
            _ => return Err("a stack tree starts with its root".into()),
        }
        let mut index = FxHashMap::default();
        index.reserve(nodes.len() - 1);
        for (i, node) in nodes.iter().enumerate().skip(1) {
            let (Some(frame), true) = (node.frame, (node.parent as usize) < i) else {
                return Err(format!("stack {i} is not above an earlier stack"));
            };
            if index.insert((node.parent, frame), i as NodeId).is_some() {
                return Err(format!("stack {i} is another's twin"));
            }
        }
        Ok(StackTree { nodes, index })
    }
}

impl StackTree {
    /// The empty stack.
    pub(crate) const ROOT: NodeId = 0;

    /// The stack `parent` with `frame` on top.
    pub(crate) fn child(&mut self, parent: NodeId, frame: FoldFrame) -> NodeId {
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

    /// The stack `node` is on top of (the root's is the root); a parent always has
    /// a lower id than its children.
    pub(crate) fn parent(&self, node: NodeId) -> NodeId {
        self.nodes
            .get(node as usize)
            .map_or(Self::ROOT, |n| n.parent)
    }

    /// The frame on top of stack `node` (`None` for the root).
    pub(crate) fn frame(&self, node: NodeId) -> Option<FoldFrame> {
        self.nodes.get(node as usize).and_then(|n| n.frame)
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

/// The folded stacks of a whole recording.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Folded {
    /// The stacks.
    pub tree: StackTree,
    pub(super) time: Vec<u64>,
    pub(super) calls: Vec<u64>,
    pub(super) samples: Vec<u64>,
    /// Event counts.
    pub counts: FoldCounts,
    /// How well call and return events paired.
    pub counters: ReplayCounters,
    /// Which samples were counted (by their thread's state), and how many were not.
    pub tally: SampleTally,
}

impl Folded {
    /// The value of stack `node` for `measure` (its own, not its children's).
    pub(crate) fn value(&self, node: NodeId, measure: Measure) -> u64 {
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
    pub(crate) fn total(&self, measure: Measure) -> u64 {
        (0..self.tree.len() as NodeId)
            .map(|n| self.value(n, measure))
            .fold(0u64, u64::saturating_add)
    }

    /// Each stack's value plus its descendants'.
    pub(crate) fn subtree_totals(&self, measure: Measure) -> Vec<u64> {
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
    pub(crate) fn walk_named(
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

    /// The same stacks with the threads' frames taken out, the stacks of every
    /// thread merged: what a fold without [`by_thread`](super::Folder::by_thread)
    /// gives, node for node (a stack's first sight is in whichever thread ran
    /// it first, and nodes are visited in that order).
    pub fn without_threads(&self) -> Folded {
        let mut tree = StackTree::default();
        let n = self.tree.len();
        let mut map: Vec<NodeId> = Vec::with_capacity(n);
        map.push(StackTree::ROOT);
        for node in &self.tree.nodes[1..] {
            let parent = map[node.parent as usize];
            map.push(match node.frame {
                Some(FoldFrame::Thread { .. }) | None => parent,
                Some(frame) => tree.child(parent, frame),
            });
        }
        let m = tree.len();
        let mut values = [vec![0u64; m], vec![0u64; m], vec![0u64; m]];
        for (old, &new) in map.iter().enumerate() {
            let new = new as usize;
            for (to, from) in values
                .iter_mut()
                .zip([&self.time, &self.calls, &self.samples])
            {
                let v = from.get(old).copied().unwrap_or(0);
                to[new] = to[new].wrapping_add(v);
            }
        }
        let [time, calls, samples] = values;
        Folded {
            tree,
            time,
            calls,
            samples,
            counts: self.counts,
            counters: self.counters,
            tally: self.tally,
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

/// Event counts seen while folding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    pub(crate) gcs: u64,
    /// Sum of the `lost` events' counts.
    pub lost: u64,
    /// Earliest timestamp.
    pub(crate) first_ts: Option<u64>,
    /// Latest timestamp.
    pub(crate) last_ts: Option<u64>,
    /// The function events are returns only (CPython 3.11): no stacks from them.
    pub(crate) returns_only: bool,
}
