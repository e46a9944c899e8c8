//! The event model: what happened in the target, independent of how it was seen.
//!
//! Every event carries the native thread id it happened on and a monotonic
//! timestamp in nanoseconds (CLOCK_MONOTONIC of the machine). Strings are interned
//! per recording: events refer to them by [`StrId`].

use serde::Serialize;

/// Index into a recording's string table.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub struct StrId(pub u32);

/// One Python frame: where a call is (used by `call`/`return`/`line`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub struct FrameRef {
    pub file: StrId,
    pub function: StrId,
    /// The line the probe passed: for `call`, the line the frame is at when it
    /// starts or resumes (CPython 3.9: the first line, or the line a generator
    /// resumes at); for `return`, the line it returns from; for `line`, the line.
    /// Rows and stacks key a function by its code object instead (see
    /// `analyze::replay`). As the key of a function, the first line.
    pub line: u32,
}

/// A frame as the frame walker read it: the code object it runs and the line it
/// is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct WalkedFrame {
    /// File, name (`co_name`) and first line (`co_firstlineno`; 0 when unknown,
    /// in recordings of format 1).
    pub code: FrameRef,
    /// The line being executed (the call, in an outer frame).
    pub line: u32,
}

/// What a sampled thread was doing when its stack was read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
pub struct SampleState {
    /// On a CPU (`Some(true)`: running or runnable, the kernel's `R`), waiting
    /// (`Some(false)`: sleeping in a system call, on a lock or on I/O); `None` when not
    /// recorded (recordings before format 3) or not readable.
    pub on_cpu: Option<bool>,
    /// Whether it held the GIL; `None` when that cannot be told (see the walker).
    pub holds_gil: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    /// A Python function was entered (`function__entry`): a call, or, where the
    /// recording cannot tell them apart, a call or a resume.
    Call {
        frame: FrameRef,
    },
    /// A generator or coroutine that had run before was entered again (resumed
    /// after a `yield` or an `await`, or thrown into), format 10: its frame is
    /// pushed as at a call, and the report counts it apart from calls. `frame` as
    /// for `call`.
    Resume {
        frame: FrameRef,
    },
    /// A Python function returned or unwound (`function__return`).
    Return {
        frame: FrameRef,
        /// The first line (`co_firstlineno`) of the function that returned, read
        /// from its code object through the frame the probe's site holds (CPython
        /// 3.11+); 0 when not known. With it a return names its function exactly,
        /// where the line it returns from and its name may not (two functions of
        /// one name in one file, an entry passing no line).
        first_line: u32,
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
    /// A whole stack, outermost first, taken by the frame walker, and what its
    /// thread was doing then.
    Sample {
        frames: Vec<WalkedFrame>,
        state: SampleState,
    },
    /// The thread's Python stack, outermost first, when the event that follows it on
    /// the same thread happened (a GC start, an import start, an audit event): what
    /// code triggered it. Taken by the frame walker at that probe hit.
    Stack {
        frames: Vec<WalkedFrame>,
    },
    /// The thread's Python stack, outermost first, when exact tracing began (read
    /// by the frame walker at attach, the thread stopped): frames that are running
    /// and whose entries the recording therefore lacks.
    Running {
        frames: Vec<WalkedFrame>,
    },
    /// A thread started in process `pid` (0 in recordings of format 1 and 2,
    /// which did not say: the recording's process).
    ThreadStart {
        pid: u32,
    },
    ThreadExit,
    /// A child process of `parent`, traced with it (`--subprocesses`), on its
    /// first thread (whose id is the process id): its own stacks from here on.
    ProcessStart {
        parent: u32,
        /// Its command line (arguments joined by spaces), as forked: its parent's.
        command: StrId,
    },
    /// The process of this thread (its leader) ran `execve`: a new program, the
    /// other threads gone.
    Exec {
        /// The new command line (arguments joined by spaces).
        command: StrId,
    },
    /// From here on, function calls of the whole process are traced exactly
    /// (`exact`), or only sampled because the overhead budget was reached.
    Window {
        exact: bool,
    },
    /// From here on, GC, import and audit events of the process are recorded as
    /// `level` says, to stay within the overhead budget.
    Thinned {
        level: ThinLevel,
    },
    /// `count` audit events were counted in the target but not recorded (no
    /// name, no stack), to stay within the overhead budget.
    AuditsCounted {
        count: u64,
    },
    /// `count` events were dropped (e.g. filtered out while budget-limited, ring full).
    Lost {
        count: u64,
    },
    /// pyprobe let go of every traced process at this time, for `ns` (it was
    /// stopped: Ctrl-Z, SIGSTOP), then attached again: what the processes did
    /// meanwhile is not recorded, and the stacks after it were read anew.
    Paused {
        ns: u64,
    },
    /// The recording of this thread's process (the event's `tid` is the process
    /// id) is incomplete from here on, or its counts cannot be trusted, for the
    /// reason `text` says (a subinterpreter pyprobe cannot trace, a hook the
    /// program took off ...). Views show every caveat (format 9).
    Caveat {
        text: StrId,
    },
    /// How often a function of this thread's process (the event's `tid` is the
    /// process id) returned an object of one type so far: `returned` names the
    /// type, `None` counts frames left by an exception. A running total, written
    /// now and then and at the end: each replaces the previous one of its
    /// process, function and type (format 6; the hook engine records them).
    ReturnType {
        /// File, name and first line of the function.
        function: FrameRef,
        returned: Option<StrId>,
        total: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub tid: u32,
    pub ts_ns: u64,
    #[serde(flatten)]
    pub kind: EventKind,
}

/// How GC, import and audit events are recorded under an overhead budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ThinLevel {
    /// Each with the Python stack that raised it.
    Full = 0,
    /// Without their stacks; audit events only counted, without their names.
    Stackless = 1,
    /// As `Stackless`, and audit events not even counted (their probe is off).
    Uncounted = 2,
}

impl ThinLevel {
    pub(crate) fn from_u8(v: u8) -> Option<ThinLevel> {
        [ThinLevel::Full, ThinLevel::Stackless, ThinLevel::Uncounted]
            .get(usize::from(v))
            .copied()
    }
}
