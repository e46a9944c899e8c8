//! Rebuilds each thread's Python stack from call and return events.
//!
//! Real streams are not always well paired, so the tracker resynchronises:
//! * a return with an empty stack (attached mid-call) or for a frame that is not
//!   on the stack (CPython 3.15 fires some returns without entry) is an *orphan*:
//!   the call is counted, its time is unknown;
//! * a return for a frame deeper in the stack pops the frames above it as ended
//!   at that time (3.15 fires an entry without return when a generator is
//!   created): a *resync*;
//! * depth is capped at [`MAX_DEPTH`]; calls beyond it are counted, not timed.
//!
//! Recursion, generators (one entry/return per resume/yield) and exceptions
//! (one return per unwound frame) need nothing special.

use std::collections::HashMap;

use crate::record::{FrameRef, StrId};

/// Deepest stack tracked per thread.
pub const MAX_DEPTH: usize = 2048;

/// How a timed frame ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndKind {
    /// Its return arrived.
    Returned,
    /// Popped by a resync: an entry without a return. Counted as a call.
    Unpaired,
    /// Still on the stack at the end of the thread or recording: its time so far
    /// counts, the call does not.
    Open,
}

/// A frame leaving the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// A frame whose entry was seen.
    Timed {
        /// The function.
        frame: FrameRef,
        /// Entry to end.
        inclusive_ns: u64,
        /// Entry to end, minus the timed callees.
        exclusive_ns: u64,
        /// No other activation of the same function is below it on the stack:
        /// add `inclusive_ns` only for these so recursion is not double-counted.
        outermost: bool,
        /// How it ended.
        kind: EndKind,
    },
    /// A finished call whose entry was not seen: count only.
    Untimed {
        /// The function.
        frame: FrameRef,
    },
}

/// Resynchronisation counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StackCounters {
    /// Returns that matched a frame below the top: the frames above were popped.
    pub resyncs: u64,
    /// Frames popped by a resync (entries without return).
    pub unpaired_entries: u64,
    /// Returns without a matching entry.
    pub orphan_returns: u64,
    /// Calls not tracked because the stack was [`MAX_DEPTH`] deep.
    pub depth_overflows: u64,
    /// Frames closed by a thread exit or the end of the recording.
    pub open_at_end: u64,
}

/// What identifies a function between its entry and its return: file and name.
pub fn code(frame: &FrameRef) -> (StrId, StrId) {
    (frame.file, frame.function)
}

struct OpenFrame {
    frame: FrameRef,
    start_ns: u64,
    child_ns: u64,
}

#[derive(Default)]
struct ThreadStack {
    frames: Vec<OpenFrame>,
    /// Activations of each function on the stack (recursion, resync lookup), by
    /// code (file, function): a return carries the line it returns from, not the
    /// function's first line, so the line cannot be part of the match.
    active: HashMap<(StrId, StrId), u32>,
    /// Calls dropped beyond the depth cap still waiting for their return.
    overflow: u64,
}

impl ThreadStack {
    fn pop(&mut self, ts: u64, kind: EndKind, out: &mut Vec<Ended>) {
        let Some(open) = self.frames.pop() else {
            return;
        };
        let inclusive_ns = ts.saturating_sub(open.start_ns);
        let exclusive_ns = inclusive_ns.saturating_sub(open.child_ns);
        let outermost = match self.active.get_mut(&code(&open.frame)) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                self.active.remove(&code(&open.frame));
                true
            }
        };
        if let Some(parent) = self.frames.last_mut() {
            parent.child_ns = parent.child_ns.saturating_add(inclusive_ns);
        }
        out.push(Ended::Timed {
            frame: open.frame,
            inclusive_ns,
            exclusive_ns,
            outermost,
            kind,
        });
    }
}

/// Per-thread stacks.
#[derive(Default)]
pub struct StackTracker {
    threads: HashMap<u32, ThreadStack>,
    counters: StackCounters,
}

impl StackTracker {
    /// No threads, no frames.
    pub fn new() -> Self {
        Self::default()
    }

    /// A function was entered on `tid` at `ts`.
    pub fn call(&mut self, tid: u32, frame: FrameRef, ts: u64) {
        let t = self.threads.entry(tid).or_default();
        if t.frames.len() >= MAX_DEPTH {
            t.overflow += 1;
            self.counters.depth_overflows += 1;
            return;
        }
        t.frames.push(OpenFrame {
            frame,
            start_ns: ts,
            child_ns: 0,
        });
        *t.active.entry(code(&frame)).or_insert(0) += 1;
    }

    /// A function returned on `tid` at `ts`; appends the frames that ended to `out`.
    pub fn ret(&mut self, tid: u32, frame: FrameRef, ts: u64, out: &mut Vec<Ended>) {
        let t = self.threads.entry(tid).or_default();
        if t.overflow > 0 {
            // The innermost calls were dropped at the cap: this return is one of them.
            t.overflow -= 1;
            out.push(Ended::Untimed { frame });
            return;
        }
        let key = code(&frame);
        if t.frames.last().is_some_and(|top| code(&top.frame) == key) {
            t.pop(ts, EndKind::Returned, out);
        } else if t.active.contains_key(&key) {
            self.counters.resyncs += 1;
            while t.frames.last().is_some_and(|top| code(&top.frame) != key) {
                t.pop(ts, EndKind::Unpaired, out);
                self.counters.unpaired_entries += 1;
            }
            t.pop(ts, EndKind::Returned, out);
        } else {
            self.counters.orphan_returns += 1;
            out.push(Ended::Untimed { frame });
        }
    }

    /// The thread ended (or the recording did): its open frames end at `ts`.
    pub fn close_thread(&mut self, tid: u32, ts: u64, out: &mut Vec<Ended>) {
        if let Some(mut t) = self.threads.remove(&tid) {
            while !t.frames.is_empty() {
                t.pop(ts, EndKind::Open, out);
                self.counters.open_at_end += 1;
            }
        }
    }

    /// Exact tracing paused at `ts` (overhead budget): `tid`'s open frames end
    /// there, their time counted but not as calls, and not as an anomaly.
    pub fn cut_thread(&mut self, tid: u32, ts: u64, out: &mut Vec<Ended>) {
        if let Some(mut t) = self.threads.remove(&tid) {
            while !t.frames.is_empty() {
                t.pop(ts, EndKind::Open, out);
            }
        }
    }

    /// Threads with a stack, in id order.
    pub fn thread_ids(&self) -> Vec<u32> {
        let mut tids: Vec<u32> = self.threads.keys().copied().collect();
        tids.sort_unstable();
        tids
    }

    /// Closes every thread at `ts`, in thread-id order for determinism.
    pub fn close_all(&mut self, ts: u64, out: &mut Vec<Ended>) {
        let mut tids: Vec<u32> = self.threads.keys().copied().collect();
        tids.sort_unstable();
        for tid in tids {
            self.close_thread(tid, ts, out);
        }
    }

    /// Current depth of `tid`'s stack (tracked frames only).
    pub fn depth(&self, tid: u32) -> usize {
        self.threads.get(&tid).map_or(0, |t| t.frames.len())
    }

    /// The frames on `tid`'s stack, outermost first.
    pub fn frames(&self, tid: u32) -> impl Iterator<Item = FrameRef> + '_ {
        self.threads
            .get(&tid)
            .into_iter()
            .flat_map(|t| t.frames.iter().map(|f| f.frame))
    }

    /// Resynchronisation counters so far.
    pub fn counters(&self) -> StackCounters {
        self.counters
    }
}
