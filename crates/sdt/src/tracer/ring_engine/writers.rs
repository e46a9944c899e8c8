//! Which thread wrote a ring record. A trampoline stamps its thread's `%fs` base,
//! and a thread started after another has exited can get the same one (glibc
//! reuses a dead thread's cached stack, and its thread control block with it).
//! pyprobe reads the ring behind the target, so the records of the thread that
//! exited may still be unread when its successor starts: naming by `%fs` base
//! alone would give them to the new thread.
//!
//! Each thread is therefore known from a ring index on: the ring's `head` at the
//! thread's first stop, before it has run any code. Every record it writes is
//! reserved at that index or later, and every record of an earlier thread with
//! the same base was reserved before it (that thread had exited).

use rustc_hash::FxHashMap;

/// The thread of the records with `base` at ring indices below `until` (from the
/// index it was looked up for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TidSpan {
    pub(crate) base: u64,
    pub tid: i32,
    pub(crate) until: u64,
}

/// `%fs` base and ring index → thread id.
#[derive(Debug, Default)]
pub struct ThreadNames {
    /// Per base, (first ring index, tid), in ascending index order.
    by_base: FxHashMap<u64, Vec<(u64, i32)>>,
    /// The bases known for more than one thread: the only ones with something to
    /// forget (looking at every base at every drain cost a process with 10,000
    /// threads a few percent of its reader).
    shared: rustc_hash::FxHashSet<u64>,
}

impl ThreadNames {
    /// Thread `tid`, with `%fs` base `base`, writes records from ring index `from` on.
    pub(crate) fn started(&mut self, base: u64, tid: i32, from: u64) {
        let known = self.by_base.entry(base).or_default();
        match known.last() {
            Some(&(_, last)) if last == tid => {}
            // Out of order (never expected): keep the list sorted.
            Some(&(at, _)) if at > from => {
                known.push((from, tid));
                known.sort_unstable_by_key(|&(at, _)| at);
            }
            _ => known.push((from, tid)),
        }
        if known.len() > 1 {
            self.shared.insert(base);
        }
    }

    /// The thread that wrote the record at ring `index` stamped with `base`.
    pub fn tid_of(&self, base: u64, index: u64) -> Option<i32> {
        self.span_of(base, index).map(|span| span.tid)
    }

    /// The thread that wrote the record at ring `index` stamped with `base`, and
    /// the ring indices before which every record with that base is its too (the
    /// next thread known by the base starts there): records of one thread come in
    /// runs, and a run needs one look-up.
    pub(crate) fn span_of(&self, base: u64, index: u64) -> Option<TidSpan> {
        let known = self.by_base.get(&base)?;
        let later = known.partition_point(|&(at, _)| at <= index);
        // A record older than every thread known by this base was written by one
        // of them before pyprobe saw it start: the first is the best guess.
        let (_, tid) = *known.get(later.saturating_sub(1))?;
        let until = known.get(later).map_or(u64::MAX, |&(at, _)| at);
        Some(TidSpan { base, tid, until })
    }

    /// Every record before ring index `tail` has been read: forgets the threads
    /// that can write no more of the records still to come.
    pub(crate) fn forget_before(&mut self, tail: u64) {
        let by_base = &mut self.by_base;
        self.shared.retain(|base| {
            let Some(known) = by_base.get_mut(base) else {
                return false;
            };
            let current = known.partition_point(|&(at, _)| at <= tail);
            if current > 1 {
                known.drain(..current - 1);
            }
            known.len() > 1
        });
    }
}

impl FromIterator<(u64, i32)> for ThreadNames {
    /// Threads already running when the ring was made: known from index 0.
    fn from_iter<I: IntoIterator<Item = (u64, i32)>>(iter: I) -> Self {
        let mut names = ThreadNames::default();
        for (base, tid) in iter {
            names.started(base, tid, 0);
        }
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_base_names_each_record_by_when_it_was_written() {
        let mut names: ThreadNames = [(0x7000, 10), (0x8000, 11)].into_iter().collect();
        // Thread 10 exits; thread 12 starts with its base when the ring's head is 50.
        names.started(0x7000, 12, 50);
        assert_eq!(names.tid_of(0x7000, 0), Some(10));
        assert_eq!(names.tid_of(0x7000, 49), Some(10));
        assert_eq!(names.tid_of(0x7000, 50), Some(12));
        assert_eq!(names.tid_of(0x8000, 70), Some(11));
        assert_eq!(names.tid_of(0x9000, 70), None);
        // Thread 10's records run up to 50; thread 12's have no end.
        assert_eq!(
            names.span_of(0x7000, 3).map(|s| (s.tid, s.until)),
            Some((10, 50))
        );
        assert_eq!(
            names.span_of(0x7000, 50).map(|s| (s.tid, s.until)),
            Some((12, u64::MAX))
        );
        // Once the reader is past 50, thread 10 is forgotten; 12 stays.
        names.forget_before(49);
        assert_eq!(names.tid_of(0x7000, 10), Some(10));
        names.forget_before(60);
        assert_eq!(names.tid_of(0x7000, 60), Some(12));
        assert_eq!(names.by_base[&0x7000].len(), 1);
        // The same thread said twice is one entry.
        names.started(0x7000, 12, 80);
        assert_eq!(names.by_base[&0x7000].len(), 1);
        // Reused again once forgotten: forgotten again.
        names.started(0x7000, 13, 90);
        names.forget_before(100);
        assert_eq!(names.by_base[&0x7000], vec![(90, 13)]);
        assert!(names.shared.is_empty());
    }
}
