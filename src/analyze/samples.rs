//! Counts sampled stacks per function (code object: file, name, first line).

use std::collections::{HashMap, HashSet};

use crate::record::FrameRef;

/// Sample counts of one function.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SampleAcc {
    /// Samples with this function as the leaf.
    pub(crate) leaf: u64,
    /// Samples with this function anywhere on the stack (once per sample).
    pub(crate) inclusive: u64,
}

#[derive(Default)]
pub(crate) struct SampleTracker {
    acc: HashMap<FrameRef, SampleAcc>,
    seen: HashSet<FrameRef>,
    pub(crate) samples: u64,
}

impl SampleTracker {
    /// Counts one sampled stack of functions, outermost first.
    pub(crate) fn record(&mut self, codes: &[FrameRef]) {
        self.samples += 1;
        self.seen.clear();
        for code in codes {
            if self.seen.insert(*code) {
                self.acc.entry(*code).or_default().inclusive += 1;
            }
        }
        if let Some(leaf) = codes.last() {
            self.acc.entry(*leaf).or_default().leaf += 1;
        }
    }

    /// Per-function counts.
    pub(crate) fn finish(self) -> HashMap<FrameRef, SampleAcc> {
        self.acc
    }
}
