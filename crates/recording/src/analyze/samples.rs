//! Counts sampled stacks per function (code object: file, name, first line).

use rustc_hash::{FxHashMap, FxHashSet};

use crate::recording::FrameRef;

/// Sample counts of one function.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SampleAcc {
    /// Samples with this function as the leaf.
    pub(crate) leaf: u64,
    /// Samples with this function anywhere on the stack (once per sample).
    pub(crate) inclusive: u64,
    /// The time those samples stand for, as leaf and anywhere on the stack.
    pub(crate) leaf_ns: u64,
    pub inclusive_ns: u64,
}

#[derive(Default)]
pub(crate) struct SampleTracker {
    acc: FxHashMap<FrameRef, SampleAcc>,
    seen: FxHashSet<FrameRef>,
    pub samples: u64,
}

impl SampleTracker {
    /// Counts one sampled stack of functions, outermost first, standing for
    /// `weight_ns` of time.
    pub fn record(&mut self, codes: &[FrameRef], weight_ns: u64) {
        self.samples += 1;
        self.seen.clear();
        for code in codes {
            if self.seen.insert(*code) {
                let a = self.acc.entry(*code).or_default();
                a.inclusive += 1;
                a.inclusive_ns = a.inclusive_ns.saturating_add(weight_ns);
            }
        }
        if let Some(leaf) = codes.last() {
            let a = self.acc.entry(*leaf).or_default();
            a.leaf += 1;
            a.leaf_ns = a.leaf_ns.saturating_add(weight_ns);
        }
    }

    /// Per-function counts.
    pub fn finish(self) -> FxHashMap<FrameRef, SampleAcc> {
        self.acc
    }
}
