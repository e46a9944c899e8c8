//! Pairs `gc_start`/`gc_done` per thread into per-generation pause statistics.

use std::collections::{BTreeMap, HashMap};

use super::histogram::Histogram;
use super::model::GcStats;

#[derive(Default)]
pub(crate) struct GcTracker {
    /// Collection in progress per thread: (generation, start).
    pending: HashMap<u32, (i32, u64)>,
    generations: BTreeMap<i32, GcStats>,
    pub(crate) unpaired: u64,
}

impl GcTracker {
    pub(crate) fn start(&mut self, tid: u32, generation: i32, ts: u64) {
        if self.pending.insert(tid, (generation, ts)).is_some() {
            self.unpaired += 1;
        }
    }

    pub(crate) fn done(&mut self, tid: u32, collected: i64, ts: u64) {
        let Some((generation, start)) = self.pending.remove(&tid) else {
            // Attached mid-collection: the generation is unknown.
            self.unpaired += 1;
            return;
        };
        let ns = ts.saturating_sub(start);
        let g = self
            .generations
            .entry(generation)
            .or_insert_with(|| GcStats {
                generation,
                histogram: Histogram::default(),
                ..GcStats::default()
            });
        g.collections += 1;
        g.collected = g.collected.saturating_add(collected);
        g.total_ns = g.total_ns.saturating_add(ns);
        g.max_ns = g.max_ns.max(ns);
        g.histogram.record(ns);
    }

    pub(crate) fn thread_exit(&mut self, tid: u32) {
        if self.pending.remove(&tid).is_some() {
            self.unpaired += 1;
        }
    }

    /// Per-generation stats, by generation; collections still open count as unpaired.
    pub fn finish(self) -> (Vec<GcStats>, u64) {
        let unpaired = self.unpaired + self.pending.len() as u64;
        (self.generations.into_values().collect(), unpaired)
    }
}
