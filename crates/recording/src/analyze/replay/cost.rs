//! What tracing costs a thread at each call or return, measured from the
//! recording itself, so that traced times can leave it out.
//!
//! Between two call or return events of one thread lies the work of the code
//! that ran, and one event's worth of tracing: the interpreter firing its hook
//! or probe, pyprobe's code writing the record. Code that makes many calls for
//! little work (`fib`) is mostly that cost, and traced it looks far heavier
//! beside code that calls little (a `compile`, a C loop) than it is. cProfile
//! keeps the same bias; its pure-Python sibling subtracts a constant it
//! measures beforehand. pyprobe cannot run code in the target to measure it, so
//! it takes it from the gaps themselves: the shortest gaps are the cost with
//! almost no work beside it. The first percentile of a process's gaps is the
//! cost per event subtracted from each frame's own time (never below zero), and
//! the report says how much it took away. Only where the gaps vary (that
//! percentile at most three quarters of the median): gaps mostly as short as the
//! shortest are work of one size, and then nothing is subtracted.
//!
//! The percentile is taken over a process's first [`SETTLED_GAPS`] gaps: many
//! more than it needs, and then it is known early, so a recording can be
//! replayed as it is written (the replay needs the cost from the first event),
//! and a view of part of a long recording times its events as a view of the
//! whole does.
//!
//! The true cost is often higher (the hook's cache misses, the interpreter's
//! own dispatch slowed by them), so this is a floor: what is left in the times
//! is tracing's cost beyond it.

use rustc_hash::FxHashMap;

/// Gaps are counted to the nanosecond up to this; longer ones only counted.
const BUCKETS: usize = 4096;
/// Fewer gaps than this, and the cost is not estimated (0): a floor needs many.
pub(super) const MIN_GAPS: u64 = 1000;
/// The share of a process's gaps at or below its cost per event.
const FLOOR_PER_MILLE: u64 = 10;
/// The gaps of a process its cost is measured on: its first.
pub(super) const SETTLED_GAPS: u64 = 1 << 21;

/// Gaps of one process, by length in nanoseconds.
#[derive(Clone)]
struct Gaps {
    counts: Vec<u64>,
    longer: u64,
    total: u64,
}

impl Gaps {
    fn new() -> Gaps {
        Gaps {
            counts: vec![0; BUCKETS],
            longer: 0,
            total: 0,
        }
    }

    fn add(&mut self, gap_ns: u64) {
        if self.total >= SETTLED_GAPS {
            return;
        }
        self.total += 1;
        match self.counts.get_mut(gap_ns as usize) {
            Some(n) => *n += 1,
            None => self.longer += 1,
        }
    }

    /// The gap at [`FLOOR_PER_MILLE`] of all, if there are enough, it is under
    /// the counted range, and the gaps vary: at most three quarters of the
    /// median. Where most gaps are as short as the shortest, they are not
    /// tracing's cost beside almost no work but work of one size (or a
    /// recording made by hand), and nothing is subtracted.
    fn floor(&self) -> Option<u64> {
        let total = self.total;
        if total < MIN_GAPS {
            return None;
        }
        let (floor, median) = (
            self.rank(total * FLOOR_PER_MILLE / 1000)?,
            self.rank(total / 2),
        );
        match median {
            Some(m) if floor * 4 > m * 3 => None,
            _ => Some(floor),
        }
    }

    /// The gap with `rank` shorter ones, if in the counted range.
    fn rank(&self, rank: u64) -> Option<u64> {
        let mut seen = 0;
        for (gap, n) in self.counts.iter().enumerate() {
            seen += n;
            if seen > rank {
                return Some(gap as u64);
            }
        }
        None
    }
}

/// Follows each thread's call and return events through the first pass.
#[derive(Default, Clone)]
pub(super) struct CostMeter {
    /// Per thread: its last call or return in this segment.
    last: FxHashMap<u32, u64>,
    /// Per process.
    gaps: FxHashMap<u32, Gaps>,
}

impl CostMeter {
    /// A call or return of thread `tid` of process `pid` at `ts`.
    pub(super) fn event(&mut self, pid: u32, tid: u32, ts: u64) {
        if let Some(last) = self.last.insert(tid, ts) {
            if ts >= last {
                self.gaps
                    .entry(pid)
                    .or_insert_with(Gaps::new)
                    .add(ts - last);
            }
        }
    }

    /// Whether process `pid`'s cost is known for good: its gaps measured.
    pub(super) fn settled(&self, pid: u32) -> bool {
        self.gaps.get(&pid).is_some_and(|g| g.total >= SETTLED_GAPS)
    }

    /// Events were lost or not traced here: no gap spans it.
    pub(super) fn cut(&mut self) {
        self.last.clear();
    }

    /// Each process's cost per event, where its gaps tell one.
    pub(super) fn finish(self) -> FxHashMap<u32, u64> {
        self.gaps
            .into_iter()
            .filter_map(|(pid, g)| g.floor().filter(|&c| c > 0).map(|c| (pid, c)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread of process `pid` with 1000 gaps: `short` of 40 ns, a third of
    /// the others of 150 ns, the rest of 300 ns (the median).
    fn meter_with(m: &mut CostMeter, pid: u32, short: u64) {
        let mut ts = 0;
        for i in 0..=1000 {
            m.event(pid, pid, ts);
            ts += match i {
                i if i < short => 40,
                i if i % 3 == 0 => 150,
                _ => 300,
            };
        }
    }

    #[test]
    fn the_cost_is_the_gap_that_one_percent_of_a_process_gaps_are_shorter_than() {
        let mut m = CostMeter::default();
        meter_with(&mut m, 1, 11);
        meter_with(&mut m, 2, 10);
        // Process 3: too few gaps to tell.
        for i in 0..100 {
            m.event(3, 3, i * 50);
        }
        let costs = m.finish();
        assert_eq!(costs.get(&1), Some(&40));
        assert_eq!(costs.get(&2), Some(&150));
        assert_eq!(costs.get(&3), None);
    }

    #[test]
    fn no_gap_spans_a_cut() {
        let mut m = CostMeter::default();
        meter_with(&mut m, 1, 0);
        // Across a cut, 11 gaps of 5 ns would set the cost: they are not gaps.
        for i in 0..11 {
            m.cut();
            m.event(1, 1, 1_000_000 + i * 5);
        }
        assert_eq!(m.finish().get(&1), Some(&150));
    }

    #[test]
    fn gaps_of_one_size_are_work_not_tracing_cost() {
        // 1000 gaps: 600 of 100 ns, 400 of 130: the shortest are the common size.
        let mut m = CostMeter::default();
        let mut ts = 0;
        for i in 0..=1000 {
            m.event(1, 1, ts);
            ts += if i < 600 { 100 } else { 130 };
        }
        assert_eq!(m.finish().get(&1), None);
        // 400 of 100 ns, 600 of 140: the median is 140, the floor 100 (0.71).
        let mut m = CostMeter::default();
        let mut ts = 0;
        for i in 0..=1000 {
            m.event(1, 1, ts);
            ts += if i < 400 { 100 } else { 140 };
        }
        assert_eq!(m.finish().get(&1), Some(&100));
    }

    #[test]
    fn the_cost_is_measured_on_a_process_first_gaps() {
        let mut m = CostMeter::default();
        let mut ts = 0;
        // The first gaps: one in a hundred of 40 ns, the others of 300.
        for i in 0..SETTLED_GAPS {
            m.event(1, 1, ts);
            ts += if i % 100 == 0 { 40 } else { 300 };
        }
        assert!(!m.settled(1));
        m.event(1, 1, ts);
        assert!(m.settled(1) && !m.settled(2));
        // Later gaps, however short, change nothing.
        for _ in 0..100_000 {
            ts += 5;
            m.event(1, 1, ts);
        }
        assert_eq!(m.finish().get(&1), Some(&40));
    }

    #[test]
    fn gaps_beyond_the_counted_range_count_but_never_set_the_cost() {
        let mut m = CostMeter::default();
        for i in 0..2000u64 {
            m.event(1, 1, i * 10_000);
        }
        assert_eq!(m.finish().get(&1), None);
    }
}
