//! The one replay of a recording's calls and returns that every view shares
//! (report, flame graph, Chrome trace, speedscope, call flow), so that they agree
//! by construction.
//!
//! A recording is read twice. The first pass ([`Planner`]) sees the whole stream
//! and decides what one pass cannot:
//! * which entries never return. CPython 3.15 fires its entry probe whenever a
//!   frame is pushed: at each call and resume, but also when a generator or
//!   coroutine is created, whose frame `RETURN_GENERATOR` hands to the new object
//!   without a return. A return pairs with the innermost frame of its function;
//!   on 3.15 the frames above it are such creations: they ran no code, so the
//!   replay leaves them out of the stacks (counted in the anomalies) and the
//!   calls they seemed to make belong to their caller;
//! * which frames were running when tracing began (attach, an exact window
//!   opening, events lost): the frame walker's stack at attach (`running`
//!   event), and the returns that find an empty stack, innermost first. They
//!   seed each thread's stack, timed from that moment;
//! * which function (code object: file, name, first line) each event belongs
//!   to. A row is one function. An entry passes the line the frame is at, which
//!   for a resuming generator is the line it yielded at, and a return passes the
//!   line it returns from: every paired return teaches that its line belongs to
//!   the function of its entry, so later resumes there go to the same row.
//!   Returns without entry (and CPython 3.11's returns-only stream) go to the
//!   function of the same file and name with the greatest known first line not
//!   after the return's line; first lines come from entries and from the frame
//!   walker (samples, stacks).
//!
//! The second pass ([`Replay`]) rebuilds each thread's stack with that plan and
//! emits [`Step`]s: frames entering and leaving, with inclusive and exclusive
//! time, and calls counted without a frame. Recursion is recognised by code
//! object on the stack, never by name: a row's inclusive time counts each
//! outermost activation once, so it is never less than its exclusive time. Each
//! thread's clock is kept monotonic (timestamps converted from the TSC can step
//! back by a few ns), so a child always nests within its parent.
//!
//! Memory is bounded by the distinct functions and lines, the threads, the stack
//! depth cap, and the generator creations (one integer each).

use crate::record::{FrameRef, StrId};

mod plan;
mod stacks;

pub use plan::{plan_events, Plan, Planner};
pub use stacks::Replay;

/// Deepest stack tracked per thread; calls beyond it are counted, not timed.
pub const MAX_DEPTH: usize = 2048;

/// A function's file and name: what an entry and its return have in common.
type Name = (StrId, StrId);

/// The line a CPython 3.12+ probe passes for an instruction without location
/// (the first instruction of a function with cells, or of a class body): -1.
const NO_LINE: u32 = u32::MAX;

/// Longest chain of resume lines followed to a function's first line.
const MAX_CHAIN: usize = 64;

/// How a recording's function events pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
    pub ts: u64,
    /// The function: file, name, first line.
    pub code: FrameRef,
    /// Its position on the stack, 0 outermost.
    pub depth: usize,
    /// From its entry (or from when tracing began, if `seeded`) to `ts`.
    pub inclusive_ns: u64,
    /// `inclusive_ns` minus the time of its callees.
    pub exclusive_ns: u64,
    /// No other activation of the same function is below it: add `inclusive_ns`
    /// to the function's total only for these.
    pub outermost: bool,
    pub kind: EndKind,
    /// It was running when tracing began: its entry was not seen.
    pub seeded: bool,
}

impl Exit {
    /// When it entered (or tracing began).
    pub fn start_ns(&self) -> u64 {
        self.ts.saturating_sub(self.inclusive_ns)
    }

    /// Whether it counts as a call.
    pub fn is_call(&self) -> bool {
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayCounters {
    /// Returns that matched a frame below the top: the frames above were popped.
    pub resyncs: u64,
    /// Frames popped by a resync (entries without return).
    pub unpaired_entries: u64,
    /// Returns without an entry that no seed explains (CPython 3.15's
    /// `generator.throw()` resumes a frame without entry; events lost).
    pub orphan_returns: u64,
    /// Calls not tracked because the stack was [`MAX_DEPTH`] deep.
    pub depth_overflows: u64,
    /// Frames still open when their thread or the recording ended.
    pub open_at_end: u64,
    /// Frames running when tracing began, seeded onto the stacks.
    pub open_at_start: u64,
    /// Entries at a generator's or coroutine's creation (CPython 3.15), left out.
    pub generator_creations: u64,
    /// Returns of the interpreter's own shim frames (CPython 3.15's `__init__`
    /// cleanup after `CALL_ALLOC_AND_ENTER_INIT`), left out.
    pub shim_returns: u64,
}

/// Per-thread totals of the replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThreadTime {
    /// When its first frame started and its last frame ended (monotonic time):
    /// the traced wall time is `last - first`.
    pub first_ns: Option<u64>,
    pub last_ns: u64,
    /// Sum of the exclusive times of its frames.
    pub exclusive_ns: u64,
}

impl ThreadTime {
    /// From its first frame's start to its last frame's end.
    pub fn wall_ns(&self) -> u64 {
        self.first_ns.map_or(0, |f| self.last_ns.saturating_sub(f))
    }
}
