//! What `pyprobe record` is asked to do.

use std::path::PathBuf;

use pyprobe_recording::analyze::SampleFilter;
use pyprobe_sdt::tracer::RingUse;

use super::resolver::Mode;

/// What to record or watch: a running process, or a command pyprobe starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `-p PID`.
    Attach(i32),
    /// `-- CMD ARGS`.
    Launch(Vec<String>),
}

/// Whether function calls may come from the injected hook engine (`--engine`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HookUse {
    /// `--engine auto`: in `--mode trace`, where the interpreter has no function probes.
    #[default]
    Auto,
    /// `--engine hook`: always, in `--mode trace`.
    Always,
    /// `--engine ring` or `int3`: never.
    Never,
}

/// What `pyprobe record` was asked to do (the CLI maps its flags onto this).
#[derive(Debug, Clone, Default)]
pub struct RecordRequest {
    /// `None`: nothing given, refused once the rest is checked.
    pub target: Option<Target>,
    pub output: Option<PathBuf>,
    /// Replace existing outputs (`--force`).
    pub force: bool,
    /// Say the site-level details at start (`-v`).
    pub verbose: bool,
    pub duration: Option<f64>,
    pub mode: Mode,
    pub probes: Vec<String>,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    pub start_at: Option<String>,
    pub subprocesses: bool,
    /// Sampling rate in Hz (modes auto and sample).
    pub rate: u32,
    /// Sample without stopping the threads.
    pub nonblocking: bool,
    /// Join each sample's native frames (C, C++, Rust) with its Python frames.
    pub native: bool,
    /// Draw a thread running an asyncio task as the task's logical stack.
    pub async_tasks: bool,
    /// Also sample every asyncio task that waits (`--async=all`).
    pub async_waiting: bool,
    /// `--max-overhead` as given, in percent (`None`: the default for the mode).
    pub max_overhead: Option<f64>,
    /// `--engine`: whether probe sites move to the ring (no stop per hit).
    pub ring: RingUse,
    /// `--engine`: whether function calls may come from the injected hook.
    pub hook: HookUse,
    /// Which samples a view written directly (`-o x.svg`) counts.
    pub samples: SampleFilter,
    /// `--format pprof`: a pprof profile, at the end (`-o FILE.pb.gz`) or per period.
    pub pprof: bool,
    /// `--every SECONDS`: one pprof profile per period, into the directory `-o` names.
    pub every: Option<f64>,
}
