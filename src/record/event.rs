//! The event model: what happened in the target, independent of how it was seen.
//!
//! Every event carries the native thread id it happened on and a monotonic
//! timestamp in nanoseconds (CLOCK_MONOTONIC of the machine). Strings are interned
//! per recording: events refer to them by [`StrId`].

use serde::Serialize;

/// Index into a recording's string table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct StrId(pub u32);

/// One Python frame: where a call is (used by `call`/`return`/`line` and samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct FrameRef {
    pub file: StrId,
    pub function: StrId,
    /// First line of the function for `call`/`return`; the current line for `line`
    /// events and sampled frames.
    pub line: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    /// A Python function was entered (`function__entry`).
    Call {
        frame: FrameRef,
    },
    /// A Python function returned or unwound (`function__return`).
    Return {
        frame: FrameRef,
    },
    /// A line is about to run (`line`).
    Line {
        frame: FrameRef,
    },
    /// A collection of `generation` started (`gc__start`).
    GcStart {
        generation: i32,
    },
    /// The collection finished, freeing `collected` objects (`gc__done`).
    GcDone {
        collected: i64,
    },
    /// `import_find_load__start`.
    ImportStart {
        module: StrId,
    },
    /// `import_find_load__done`; `found` is false when the module was not found.
    ImportDone {
        module: StrId,
        found: bool,
    },
    /// `audit`: a PEP 578 audit event was raised.
    Audit {
        event: StrId,
    },
    /// A whole stack, outermost first, taken by the frame walker.
    Sample {
        frames: Vec<FrameRef>,
    },
    /// The thread's Python stack, outermost first, when the event that follows it on
    /// the same thread happened (a GC start, an import start, an audit event): what
    /// code triggered it. Taken by the frame walker at that probe hit.
    Stack {
        frames: Vec<FrameRef>,
    },
    ThreadStart,
    ThreadExit,
    /// From here on, function calls of the whole process are traced exactly
    /// (`exact`), or only sampled because the overhead budget was reached.
    Window {
        exact: bool,
    },
    /// `count` events were dropped (e.g. filtered out while budget-limited, ring full).
    Lost {
        count: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub tid: u32,
    pub ts_ns: u64,
    #[serde(flatten)]
    pub kind: EventKind,
}
