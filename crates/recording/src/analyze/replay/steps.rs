//! What both passes share: the depth cap, how calls pair with returns, and the
//! steps, exits and counters the replay emits.

use crate::recording::{FrameRef, StrId};

/// Deepest stack tracked per thread; calls beyond it are counted, not timed.
pub const MAX_DEPTH: usize = 2048;

/// A function's file and name: what an entry and its return have in common.
pub(super) type Name = (StrId, StrId);

/// The line a CPython 3.12+ probe passes for an instruction without location
/// (the first instruction of a function with cells, or of a class body): -1.
pub(super) const NO_LINE: u32 = u32::MAX;

/// Longest chain of resume lines followed to a function's first line.
pub(super) const MAX_CHAIN: usize = 64;

/// How a recording's function events pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Pairing {
    /// Every entry has its return (CPython 3.6 – 3.10).
    #[default]
    Paired,
    /// Entries also fire at generator creation, without return (CPython 3.15).
    Creations,
    /// Returns only (CPython 3.11): no stacks, counts from returns.
    ReturnsOnly,
}

/// How a frame left the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndKind {
    /// Its return arrived.
    Returned,
    /// Popped by a later return of a frame below it: an entry that never
    /// returned, in a stream where every entry should. Counted as a call.
    Unpaired,
    /// Still on the stack when its thread or the recording ended: its time so
    /// far counts, the call does not.
    Open,
    /// Exact tracing stopped (overhead budget) or events were lost: its time so
    /// far counts, the call does not, and it is no anomaly.
    Cut,
}

/// A frame that left the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub tid: u32,
    /// When it left (the thread's monotonic time).
    pub(crate) ts: u64,
    /// When it entered, or tracing began if `seeded` (the same clock). Its
    /// inclusive time is less when tracing's cost was left out of it.
    pub(crate) start: u64,
    /// The function: file, name, first line.
    pub code: FrameRef,
    /// Its position on the stack, 0 outermost.
    pub(crate) depth: usize,
    /// From its entry (or from when tracing began, if `seeded`) to `ts`, less
    /// tracing's cost per call and return within (see `cost`).
    pub inclusive_ns: u64,
    /// `inclusive_ns` minus the time of its callees, less tracing's cost per
    /// call and return that ended a gap while it was on top (never below 0).
    pub exclusive_ns: u64,
    /// No other activation of the same function is below it: add `inclusive_ns`
    /// to the function's total only for these.
    pub(crate) outermost: bool,
    pub kind: EndKind,
    /// It was running when tracing began: its entry was not seen.
    pub(crate) seeded: bool,
    /// Its entry was a resume (a generator or coroutine entered again), not a
    /// call.
    pub resumed: bool,
}

impl Exit {
    /// When it entered (or tracing began).
    pub fn start_ns(&self) -> u64 {
        self.start
    }

    /// Whether it counts as an entry: a call, or a resume when `resumed`.
    pub(crate) fn is_call(&self) -> bool {
        matches!(self.kind, EndKind::Returned | EndKind::Unpaired)
    }
}

/// What the replay made of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A frame was pushed at `depth` (0 outermost).
    Enter {
        tid: u32,
        ts: u64,
        code: FrameRef,
        depth: usize,
        /// Running when tracing began (from the frame walker or a return that
        /// found an empty stack): `ts` is when tracing began.
        seeded: bool,
    },
    Exit(Exit),
    /// A finished call without a frame: its entry was not seen (a return
    /// without entry, a call beyond the depth cap, CPython 3.11). Counted, not
    /// timed.
    Untimed {
        tid: u32,
        ts: u64,
        code: FrameRef,
    },
}

/// Irregularities met while pairing events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplayCounters {
    /// Returns that matched a frame below the top: the frames above were popped.
    pub(crate) resyncs: u64,
    /// Frames popped by a resync (entries without return).
    pub(crate) unpaired_entries: u64,
    /// Returns without an entry that no seed explains (CPython 3.15's
    /// `generator.throw()` resumes a frame without entry; events lost).
    pub(crate) orphan_returns: u64,
    /// Calls not tracked because the stack was [`MAX_DEPTH`] deep.
    pub(crate) depth_overflows: u64,
    /// Frames still open when their thread or the recording ended.
    pub(crate) open_at_end: u64,
    /// Frames running when tracing began, seeded onto the stacks.
    pub(crate) open_at_start: u64,
    /// Entries at a generator's or coroutine's creation (CPython 3.15), left out.
    pub(crate) generator_creations: u64,
    /// Returns of the interpreter's own shim frames (CPython 3.15's `__init__`
    /// cleanup after `CALL_ALLOC_AND_ENTER_INIT`), left out.
    pub(crate) shim_returns: u64,
    /// Calls and returns stamped more than [`OUT_OF_ORDER_NS`] before an earlier
    /// event of their thread: their time was held at the thread's clock. The
    /// counter's conversion and the CPUs' counters differ by well under that;
    /// more means events reached the recording out of order (a bug this makes
    /// visible).
    pub(crate) out_of_order: u64,
}

/// How far back an event's stamp may lie behind its thread's clock before it
/// counts as out of order.
pub(crate) const OUT_OF_ORDER_NS: u64 = 5_000;

/// Per-thread totals of the replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ThreadTime {
    /// When its first frame started and its last frame ended (monotonic time):
    /// the traced wall time is `last - first`.
    pub(crate) first_ns: Option<u64>,
    pub(crate) last_ns: u64,
    /// Sum of the exclusive times of its frames.
    pub exclusive_ns: u64,
    /// Tracing's cost left out of them.
    pub cost_ns: u64,
}

impl ThreadTime {
    /// From its first frame's start to its last frame's end.
    pub(crate) fn wall_ns(&self) -> u64 {
        self.first_ns.map_or(0, |f| self.last_ns.saturating_sub(f))
    }
}
