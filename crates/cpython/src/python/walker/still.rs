//! Stacks kept from one sampling tick to the next. A thread that has not run since
//! a tick's look (the engine tells, from the kernel's count of its run time and of
//! its switches onto a CPU) has the stack read at that tick or at any later one:
//! it is not walked again. A server's threads mostly wait; with 2,000 of them,
//! walking each at every tick left most ticks untaken.

use rustc_hash::FxHashMap;

use super::stacks::RawThread;
use super::ThreadStack;

/// A sampling tick as the walker sees it: its number (counted up), and the
/// threads (tid, since) that have not run since the look of tick `since`, sorted
/// by tid.
#[derive(Debug, Clone, Copy)]
pub struct TickStill<'a> {
    pub tick: u64,
    pub still: &'a [(i32, u64)],
}

impl TickStill<'_> {
    /// The tick since which thread `tid` has not run, if it has not.
    fn since(&self, tid: i32) -> Option<u64> {
        let at = self.still.binary_search_by_key(&tid, |&(t, _)| t).ok()?;
        Some(self.still[at].1)
    }
}

/// A thread's stack as it was at tick `tick`.
#[derive(Debug)]
struct Kept {
    tick: u64,
    native_tid: i32,
    raw: RawThread,
}

/// The stacks kept at the last tick, by thread state.
#[derive(Debug, Default)]
pub(super) struct KeptStacks {
    by_state: FxHashMap<u64, Kept>,
}

impl KeptStacks {
    /// The stack kept for thread state `tstate`, whose thread id its bytes give
    /// as `thread_id`, when its thread has not run since a tick at or before the
    /// one the stack was read at. The thread id guards against a thread state
    /// freed and made again at the same address, for another thread.
    pub fn still(&self, tstate: u64, thread_id: u64, at: &TickStill) -> Option<RawThread> {
        let kept = self.by_state.get(&tstate)?;
        let since = at.since(kept.native_tid)?;
        (kept.raw.thread_id == thread_id && since <= kept.tick).then(|| kept.raw.clone())
    }

    /// Keeps, as of tick `tick`, each stack of `stacks` read whole (or kept) with
    /// its thread known, and forgets every other.
    pub fn keep(&mut self, tick: u64, stacks: &[ThreadStack]) {
        self.by_state = stacks
            .iter()
            .filter(|s| !s.torn && !s.truncated)
            .filter_map(|s| {
                let kept = Kept {
                    tick,
                    native_tid: s.native_tid?,
                    raw: RawThread {
                        thread_state: s.thread_state,
                        thread_id: s.thread_id,
                        native_id: None,
                        frames: s.frames.clone(),
                        truncated: false,
                        eval_calls: s.eval_calls.clone(),
                        torn: false,
                        kept: true,
                    },
                };
                Some((s.thread_state, kept))
            })
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(tstate: u64, thread_id: u64, tid: i32) -> ThreadStack {
        ThreadStack {
            native_tid: Some(tid),
            thread_id,
            thread_state: tstate,
            frames: vec![super::super::PyFrame::gone()],
            truncated: false,
            torn: false,
            eval_calls: None,
            holds_gil: None,
            kept: false,
        }
    }

    #[test]
    fn a_stack_is_kept_only_for_a_thread_still_since_it_was_read() {
        let mut kept = KeptStacks::default();
        let torn = ThreadStack {
            torn: true,
            ..stack(0x3000, 3, 103)
        };
        kept.keep(5, &[stack(0x1000, 1, 101), stack(0x2000, 2, 102), torn]);
        let still = [(101, 5), (102, 6), (103, 1)];
        let at = TickStill {
            tick: 7,
            still: &still,
        };
        // Still since tick 5, read at 5.
        assert!(kept.still(0x1000, 1, &at).is_some_and(|raw| raw.kept));
        // Still only since 6: it may have run between tick 5's read and then.
        assert!(kept.still(0x2000, 2, &at).is_none());
        // Torn reads are not kept.
        assert!(kept.still(0x3000, 3, &at).is_none());
        // Another thread's state at the same address.
        assert!(kept.still(0x1000, 9, &at).is_none());
        // A thread not still.
        let none = TickStill {
            tick: 7,
            still: &[],
        };
        assert!(kept.still(0x1000, 1, &none).is_none());
        // A later keep forgets what it does not list.
        kept.keep(7, &[stack(0x2000, 2, 102)]);
        assert!(kept.still(0x1000, 1, &at).is_none());
        assert!(kept.still(0x2000, 2, &at).is_some());
    }
}
