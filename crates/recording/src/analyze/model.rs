//! The aggregated data behind `pyprobe report`, with strings resolved.

use super::histogram::Histogram;
use super::replay::ReplayCounters;
use super::states::SampleTally;

/// The traced process.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Target {
    /// Process id.
    pub pid: u32,
    /// CPython version string.
    pub python: String,
    /// Path of the executable (or of the object carrying the probes).
    pub executable: String,
}

/// Where function counts and times come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FunctionSource {
    /// Entry and return probes: exact counts and times.
    #[default]
    Traced,
    /// Return probes only (CPython 3.11): exact counts; times estimated from the
    /// samples taken alongside, zero without samples.
    ReturnsOnly,
    /// Samples only: no counts; times estimated as samples × interval.
    Sampled,
}

/// One Python function.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FunctionStats {
    /// Function name (`co_name`).
    pub function: String,
    /// Qualified name (`Class.method`, `outer.<locals>.inner`) when the recording
    /// knows it, else the name: what views show.
    pub qualname: String,
    /// Source file.
    pub file: String,
    /// First line of the function (smallest sampled line when only sampled).
    pub line: u32,
    /// Finished calls: first entries (a generator's or coroutine's first run);
    /// `None` when only sampled.
    pub calls: Option<u64>,
    /// Finished resumes of a generator or coroutine entered again (after a
    /// `yield`, an `await`, or a `throw()`); `calls + resumes` is cProfile's
    /// count. 0 where the recording cannot tell a resume from a call (see the
    /// caveats); `None` when only sampled.
    pub resumes: Option<u64>,
    /// Time on the stack; a recursive function counts once per outermost activation.
    pub inclusive_ns: u64,
    /// Time in the function itself, callees excluded.
    pub exclusive_ns: u64,
    /// Samples whose leaf is this function.
    pub samples: u64,
}

/// One GC generation.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GcStats {
    /// GC generation (0 youngest).
    pub generation: i32,
    /// Collections that finished.
    pub collections: u64,
    /// Objects collected, summed.
    pub collected: i64,
    /// Time in collections.
    pub total_ns: u64,
    /// Longest pause.
    pub max_ns: u64,
    /// Pause latencies.
    pub histogram: Histogram,
    /// The Python functions running when collections started (the innermost frame
    /// of the thread), most frequent first, at most [`MAX_TRIGGERS`].
    pub triggers: Vec<Trigger>,
}

/// Most triggers / stacks kept per GC generation or audit event.
pub(crate) const MAX_TRIGGERS: usize = 5;

/// A function that was running when an event happened, and how often.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Trigger {
    pub function: String,
    pub file: String,
    pub line: u32,
    pub count: u64,
}

/// One imported module.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImportStats {
    /// Module name.
    pub module: String,
    /// Whether any attempt found it.
    pub found: bool,
    /// Time in the import, nested imports included.
    pub total_ns: u64,
    /// Time in the import, nested imports excluded.
    pub self_ns: u64,
    /// Finished imports (timed or not).
    pub count: u64,
    /// The import this one first ran inside, if any.
    pub importer: Option<String>,
}

/// Occurrences of one audit event name.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AuditCount {
    /// Audit event name.
    pub event: String,
    /// Times raised.
    pub count: u64,
    /// The Python stacks that raised it (innermost frame last, at most 8 frames),
    /// most frequent first, where known; at most [`MAX_TRIGGERS`].
    pub stacks: Vec<RaisingStack>,
}

/// One Python stack and how often it raised an event.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RaisingStack {
    /// `function (file:line)`, outermost first.
    pub frames: Vec<String>,
    pub count: u64,
}

/// Events seen on one thread.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ThreadStats {
    /// Native thread id.
    pub tid: u32,
    /// The process it ran in.
    pub pid: u32,
    /// Events recorded on it.
    pub events: u64,
    /// From the start of its first traced frame to the end of its last: the
    /// wall time its frames cover (0 without traced frames).
    pub traced_ns: u64,
    /// Sum of the exclusive times of its traced frames: `traced_ns` less the
    /// moments it ran outside any Python frame and `tracing_cost_ns`.
    pub exclusive_ns: u64,
    /// Tracing's cost per event, left out of its frames' times.
    pub tracing_cost_ns: u64,
}

/// One process of the recording: its own, or a child traced with it
/// (`--subprocesses`), with its functions on their own.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessStats {
    pub pid: u32,
    /// The traced process it was forked from; `None` for the recording's own.
    pub parent: Option<u32>,
    /// Its command line (after its last `exec`).
    pub command: String,
    /// Its threads that have events.
    pub threads: u64,
    /// Samples of its threads.
    pub samples: u64,
    /// From its first event to its last.
    pub duration_ns: u64,
    /// Its own time, which the shares of its functions are of: the sum of their
    /// exclusive times (each sample standing for its thread's time between
    /// samples, when sampled).
    pub own_ns: u64,
    /// What tracing cost its threads per call or return event, measured from the
    /// gaps between them (0: not measured; sampled, too few events).
    pub event_cost_ns: u64,
    /// That cost, left out of its functions' traced times.
    pub tracing_cost_ns: u64,
    /// Its functions, as [`Report::functions`] (sorted the same way).
    pub functions: Vec<FunctionStats>,
}

/// Irregularities met while rebuilding stacks and pairing events; the report
/// mentions the non-zero ones so a reader knows how far to trust the numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Anomalies {
    /// What the replay met while pairing calls and returns.
    pub(crate) replay: ReplayCounters,
    /// GC starts without done, or done without start.
    pub(crate) unpaired_gc: u64,
    /// Import starts without done, or done without start.
    pub(crate) unpaired_imports: u64,
}

/// Everything `pyprobe report` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Report {
    /// The traced process.
    pub target: Target,
    /// The recording's mode (`trace`, `sample`, `auto`).
    pub mode: String,
    /// Sampling interval, 0 when not sampling.
    pub sample_interval_ns: u64,
    /// From the recording's start to its end (trailer) or last event.
    pub duration_ns: u64,
    /// Events read.
    pub events: u64,
    /// Sum of the `Lost` events' counts (or the trailer's, if larger).
    pub lost_events: u64,
    /// Where function counts and times come from.
    pub source: FunctionSource,
    /// Sorted by inclusive time, then name.
    pub functions: Vec<FunctionStats>,
    /// By generation.
    pub gc: Vec<GcStats>,
    /// Slowest first.
    pub imports: Vec<ImportStats>,
    /// Most frequent first.
    pub audit: Vec<AuditCount>,
    /// By thread id.
    pub threads: Vec<ThreadStats>,
    /// The recording's own process first, then its traced children in order of
    /// appearance.
    pub processes: Vec<ProcessStats>,
    /// How far to trust the numbers.
    pub anomalies: Anomalies,
    /// Set when the recording was cut short at this file offset.
    pub truncated_at: Option<u64>,
    /// Set when an overhead budget limited exact tracing to windows.
    pub exact_windows: Option<ExactWindows>,
    /// Set when an overhead budget recorded GC, import and audit events without
    /// their stacks for a while.
    pub thinned: Option<Thinned>,
    /// Which samples were counted (by their thread's state), and how many were not.
    pub samples: SampleTally,
    /// What functions returned, by type (recorded by the hook engine), most
    /// returns first; empty when the recording has none.
    pub return_types: Vec<ReturnTypes>,
    /// The times pyprobe let go of the target, in order: nothing of them is in the
    /// recording.
    pub paused: Vec<Pause>,
    /// Why the recording is incomplete or its counts cannot be trusted, in order
    /// (each text once per process).
    pub caveats: Vec<Caveat>,
}

/// Something that makes a recording incomplete, as pyprobe said it while recording.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Caveat {
    /// When it was said, from the recording's start.
    pub at_ns: u64,
    /// The process it is about.
    pub pid: u32,
    pub text: String,
}

/// What one function returned: each type's count, and the frames left by an
/// exception apart.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReturnTypes {
    pub file: String,
    pub function: String,
    /// Its first line.
    pub line: u32,
    /// Most frequent first (a generator's yields count as returns of what they yield).
    pub returned: Vec<TypeCount>,
    /// Frames left by an exception.
    pub raised: u64,
}

impl ReturnTypes {
    /// Returns and raises.
    pub(crate) fn total(&self) -> u64 {
        self.returned
            .iter()
            .map(|t| t.count)
            .fold(self.raised, u64::saturating_add)
    }
}

/// How often a function returned objects of one type.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TypeCount {
    /// The type's name (`tp_name`; for types defined in C, its last dotted part).
    pub type_name: String,
    pub count: u64,
}

/// GC, import and audit events recorded without their stacks (counted exactly,
/// but not attributed to the code that raised them), to stay within the budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Thinned {
    /// Events recorded without their stack.
    pub events: u64,
    /// Time spent thinned.
    pub thinned_ns: u64,
    /// Audit events counted in the target but not recorded (names unknown).
    pub audits_counted: u64,
    /// Time with the audit probe off because even counting cost too much: audit
    /// events of that time are neither recorded nor counted.
    pub uncounted_ns: u64,
}

/// A time pyprobe let go of the target (it was stopped: Ctrl-Z, SIGSTOP).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Pause {
    /// When it began, from the recording's start.
    pub(crate) at_ns: u64,
    /// How long it lasted.
    pub(crate) ns: u64,
}

/// How much of a budget-limited recording was traced exactly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExactWindows {
    /// Total time with function tracing on.
    pub exact_ns: u64,
    /// Windows of exact tracing.
    pub windows: u64,
}
