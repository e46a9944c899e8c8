//! Counts sampled stacks per function.
//!
//! A sampled frame carries the *current* line, not the function's first line,
//! so it is matched to a traced function of the same file and name whose first
//! line is the greatest one not after the sampled line. Without any traced
//! function to match (pure sampling), frames group by file and name.

use std::collections::{HashMap, HashSet};

use crate::record::{FrameRef, StrId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SampleKey {
    Known(FrameRef),
    Unknown { file: StrId, function: StrId },
}

/// Sample counts of one function.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SampleAcc {
    /// Samples with this function as the leaf.
    pub(crate) leaf: u64,
    /// Samples with this function anywhere on the stack (once per sample).
    pub(crate) inclusive: u64,
    /// Smallest sampled line.
    pub(crate) min_line: u32,
}

#[derive(Default)]
pub(crate) struct SampleTracker {
    /// Known first lines per (file, function), sorted.
    first_lines: HashMap<(StrId, StrId), Vec<u32>>,
    /// Lines returned from, per (file, function), sorted: stand-ins for first lines
    /// where no entry is seen (CPython 3.11's return-only stream).
    return_lines: HashMap<(StrId, StrId), Vec<u32>>,
    acc: HashMap<SampleKey, SampleAcc>,
    seen: HashSet<SampleKey>,
    pub(crate) samples: u64,
}

impl SampleTracker {
    /// Learns a traced function's first line (from an entry).
    pub(crate) fn note_function(&mut self, f: &FrameRef) {
        insert_sorted(
            self.first_lines.entry((f.file, f.function)).or_default(),
            f.line,
        );
    }

    /// Learns a line a traced function returned from. It stands for the first
    /// line only while no entry of that function is known: a return from a call
    /// entered before an exact window carries its last line, which must not split
    /// the function's samples off its row.
    pub(crate) fn note_return(&mut self, f: &FrameRef) {
        insert_sorted(
            self.return_lines.entry((f.file, f.function)).or_default(),
            f.line,
        );
    }

    fn lines(&self, file: StrId, function: StrId) -> Option<&Vec<u32>> {
        self.first_lines
            .get(&(file, function))
            .or_else(|| self.return_lines.get(&(file, function)))
    }

    fn key(&self, f: &FrameRef) -> SampleKey {
        let first = self
            .lines(f.file, f.function)
            .and_then(|lines| enclosing(lines, f.line));
        match first {
            Some(line) => SampleKey::Known(FrameRef { line, ..*f }),
            None => SampleKey::Unknown {
                file: f.file,
                function: f.function,
            },
        }
    }

    /// Counts one sampled stack, outermost first.
    pub(crate) fn record(&mut self, frames: &[FrameRef]) {
        self.samples += 1;
        self.seen.clear();
        for f in frames {
            let key = self.key(f);
            let fresh = self.seen.insert(key);
            let acc = self.acc.entry(key).or_insert(SampleAcc {
                min_line: f.line,
                ..SampleAcc::default()
            });
            acc.min_line = acc.min_line.min(f.line);
            if fresh {
                acc.inclusive += 1;
            }
        }
        if let Some(leaf) = frames.last() {
            let key = self.key(leaf);
            if let Some(acc) = self.acc.get_mut(&key) {
                acc.leaf += 1;
            }
        }
    }

    /// Per-function counts keyed by the frame the report shows.
    pub(crate) fn finish(mut self) -> HashMap<FrameRef, SampleAcc> {
        let mut out: HashMap<FrameRef, SampleAcc> = HashMap::new();
        for (key, acc) in std::mem::take(&mut self.acc) {
            let frame = match key {
                SampleKey::Known(f) => f,
                SampleKey::Unknown { file, function } => {
                    let line = self
                        .lines(file, function)
                        .and_then(|lines| enclosing(lines, acc.min_line).or(lines.first().copied()))
                        .unwrap_or(acc.min_line);
                    FrameRef {
                        file,
                        function,
                        line,
                    }
                }
            };
            let e = out.entry(frame).or_insert(SampleAcc {
                min_line: acc.min_line,
                ..SampleAcc::default()
            });
            e.leaf += acc.leaf;
            // Never more than one per sample, even after merging.
            e.inclusive = (e.inclusive + acc.inclusive).min(self.samples);
            e.min_line = e.min_line.min(acc.min_line);
        }
        out
    }
}

fn insert_sorted(lines: &mut Vec<u32>, line: u32) {
    if let Err(i) = lines.binary_search(&line) {
        lines.insert(i, line);
    }
}

/// The greatest first line not after `line`.
fn enclosing(sorted_first_lines: &[u32], line: u32) -> Option<u32> {
    let i = sorted_first_lines.partition_point(|&l| l <= line);
    i.checked_sub(1).map(|i| sorted_first_lines[i])
}
