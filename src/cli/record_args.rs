//! `record`'s arguments: the most numerous by far, and the only ones that choose
//! how a target is traced.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use pyprobe::session::record::{self, RecordRequest};
use pyprobe_sdt::tracer::RingUse;

use super::{SampleArgs, TargetArgs};

/// Which asyncio tasks `--async` samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AsyncTasks {
    /// The tasks threads run.
    Running,
    /// Those, and every task that waits.
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Sample function stacks; GC, import and audit exact through their probes.
    Auto,
    /// Every call and return exact, through the function probes or the injected
    /// hook (CPython 3.7 to 3.15).
    Trace,
    /// Function stacks by sampling only.
    Sample,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Engine {
    Auto,
    Ring,
    Int3,
    Hook,
}

#[derive(Debug, Args)]
pub struct RecordArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Output: a recording (`.pyprobe`), or a view chosen by extension
    /// (`.svg` flame graph, `.json` speedscope, `.txt` collapsed stacks, `.pb.gz`
    /// pprof, `.prof` pstats, `.html` report page; the recording is kept beside it,
    /// x.svg → x.pyprobe). Any other name is refused
    /// before the target is touched (a FIFO takes the recording). An existing
    /// file is refused unless --force is given. Default: the flame graph
    /// pyprobe-PID.svg with the recording beside it (pyprobe-PID.pyprobe), or
    /// pyprobe-PID.1.svg, .2, ... when either exists (nothing is replaced).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Replace existing output files (-o FILE, the recording beside a view, or the
    /// default name).
    #[arg(long)]
    pub force: bool,
    /// Say more at start: each probe site armed, which go through the ring and
    /// which stay on int3 and why, each site refused and why, the frame walker's
    /// layout. By default, one line says what is traced and how, and only
    /// warnings that change what is recorded are added.
    #[arg(short, long)]
    pub verbose: bool,
    /// Stop after this many seconds (default: until the target exits or Ctrl-C).
    #[arg(short, long, value_name = "SECONDS")]
    pub duration: Option<f64>,
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// Sampling rate in Hz. At 100 a stopped sample (tens of µs) costs the target
    /// well under 1 %, so stacks stay whole within any budget; 1000 gives ten times
    /// the detail for short runs at several % (in `--mode auto` the budget may then
    /// sample without stopping); rates above are reached only without stopping the
    /// threads, at the machine's pace (about 5,000 a second on 2 CPUs).
    /// docs/benchmarks.md compares each rate with py-spy and CPython 3.15's own
    /// sampler.
    #[arg(short, long, value_name = "HZ", default_value_t = 100)]
    pub rate: u32,
    /// Probe groups to enable (comma-separated): function, gc, import, audit, line.
    /// Default: every group the interpreter supports correctly, except line.
    #[arg(long, value_delimiter = ',', value_name = "GROUPS")]
    pub probes: Vec<String>,
    /// Keep only events of files matching this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Drop events of files matching this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Record only while inside a call of this function (per thread).
    #[arg(long, value_name = "FUNCTION")]
    pub start_at: Option<String>,
    /// Also trace the target's child processes: the children it forks while
    /// traced and, with -p, those that exist when pyprobe attaches (a pool's
    /// workers), each a process of its own in the recording.
    #[arg(long)]
    pub subprocesses: bool,
    /// How probe hits are caught. `auto`: each site that qualifies is rewritten
    /// into a jump to a trampoline injected in the target, which appends the event
    /// to a ring shared with pyprobe (about 100 ns per hit, no stop); the rest use
    /// `int3`. `ring`: as auto, but fail if the ring cannot be set up. `int3`: a
    /// breakpoint and a ptrace stop per hit (tens of µs), nothing injected but the
    /// SIGTRAP safety net. After tracing, the ring (8 MiB), the trampolines, a
    /// bookkeeping page and the SIGTRAP handler's page stay mapped in the target,
    /// unused: a signal handler could still return into one. Attaching again with
    /// the same pyprobe uses them again rather than mapping more.
    /// `hook` (with `--mode trace`): calls and returns come from a hook pyprobe
    /// injects and the interpreter calls (CPython 3.7 to 3.15): registered with
    /// `sys.monitoring` at a safe point on 3.12+, each thread's C profile function
    /// before; no probes needed. `auto` uses it in `--mode trace` where the
    /// interpreter's entry and return probes do not both fire, and on 3.12+ even
    /// where they do (it costs less per call than their trampolines), unless
    /// `--max-overhead`, `--subprocesses` or the `line` probe asks for the probes.
    #[arg(long, value_enum, default_value_t = Engine::Auto)]
    pub engine: Engine,
    /// Slow the target by at most this much: when the time it spends stopped for
    /// pyprobe exceeds PERCENT of the time it runs (over about the last second),
    /// the function and line probes go off and its stacks are sampled instead
    /// (at -r HZ); they come back on for short exact windows as the budget allows.
    /// In `--mode auto` the budget also governs GC, import and audit events: over
    /// it they go without their stacks, then are only counted, then (a storm that
    /// even counting cannot afford) not at all for a while; the report says so.
    /// The report says what share of the time was traced exactly. Default: 5 in
    /// `--mode auto`, none in `--mode trace`. 0 turns the budget off. Not with the
    /// hook engine's calls (CPython 3.7 to 3.15 without function probes), which
    /// cannot be paused: there `--mode trace` with a budget is refused.
    #[arg(long, value_name = "PERCENT")]
    pub max_overhead: Option<f64>,
    /// Sample without stopping the threads: cheaper for the target, but a stack
    /// that changes while it is read (often, in call-heavy code) is recorded as
    /// the single frame `[torn: read while the thread ran]`, counted on the
    /// closing line.
    #[arg(long)]
    pub nonblocking: bool,
    /// Put native frames (C, C++ and Rust extensions, the libraries they call) in
    /// the sampled stacks, between the Python frames that called them and those
    /// they call back, as `function (object file)` (in a stripped library, by
    /// where its unwind entry starts: `libz.so.1+0x60c0`). The interpreter's own C
    /// functions are left out. Each sample reads the stopped threads' registers and
    /// unwinds their stacks with the mapped objects' `.eh_frame` tables. Complete on
    /// CPython 3.7 – 3.15. An unwind that cannot pass a frame (libffi 3.5's, AVX-512 code that realigns the
    /// stack) is marked `[native unwind stopped]` where it ends, the C frames
    /// found hanging after the marker under the innermost Python frame; and a thread not
    /// stopped cannot be unwound (in `--mode auto` the overhead budget
    /// may sample without stopping; `--mode sample` always stops). The closing line
    /// counts the samples that kept their Python stack alone and says why.
    #[arg(long, conflicts_with = "nonblocking")]
    pub native: bool,
    /// Show asyncio programs as they see themselves: a sample of a thread running
    /// a task is drawn as the task's logical stack, the tasks that await it above
    /// it (outermost first), each marked by a frame `[task NAME]` (`[task]` when
    /// the program gave it no name) and its coroutine, then its own marker and the
    /// coroutines it runs; the event loop's frames leave the stack. A task awaited by several (a shared future) hangs
    /// under the one at the lowest address, its marker saying how many await it.
    /// CPython 3.7+ (3.14+ publish asyncio's task layout; before, the running task
    /// is found from the event loop's frame or asyncio's current tasks, its
    /// awaiters from its done-callbacks, and every task from asyncio's registry).
    /// Sampled stacks only: not with --mode trace. `--async=all`
    /// also samples every task that waits, as its logical stack ending in what it awaits (`[awaiting Future]`),
    /// marked off-CPU: views show them with --idle (the wall-clock view, which the
    /// view record writes itself uses). A tick reads at most 1,000 of them within
    /// 1 ms (the rest at the next ticks, in turn).
    #[arg(
        long = "async",
        value_name = "WHICH",
        value_enum,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "running"
    )]
    pub async_tasks: Option<AsyncTasks>,
    /// For a view written directly (-o x.svg, .json, .txt, .pb.gz) and the
    /// profiles of --every; the recording keeps every sample and its thread's
    /// state.
    #[command(flatten)]
    pub samples: SampleArgs,
    /// `pprof`: a gzipped pprof profile (as `flame --format pprof` writes), when
    /// the recording ends to -o FILE.pb.gz, or with --every one per period.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub format: Option<RecordFormat>,
    /// With --format pprof: one profile per period of SECONDS (1 to 86400), each
    /// written whole into the directory -o names (made if missing) as
    /// pyprobe-PID-YYYYMMDDTHHMMSSZ.pb.gz (the period's start, UTC; by way of a
    /// hidden temporary file and a rename, mode 0600), for an agent to ship to a
    /// profile collector. The recording is kept there too, as pyprobe-PID.pyprobe,
    /// for report, flame and top --from; it grows with the run.
    #[arg(long, value_name = "SECONDS", requires = "format")]
    pub every: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RecordFormat {
    /// Gzipped pprof profile.proto.
    Pprof,
}

impl From<Mode> for record::Mode {
    fn from(mode: Mode) -> record::Mode {
        match mode {
            Mode::Auto => record::Mode::Auto,
            Mode::Trace => record::Mode::Trace,
            Mode::Sample => record::Mode::Sample,
        }
    }
}

impl From<Engine> for RingUse {
    fn from(engine: Engine) -> RingUse {
        match engine {
            Engine::Auto => RingUse::Auto,
            Engine::Ring => RingUse::Required,
            Engine::Int3 => RingUse::Off,
            Engine::Hook => RingUse::Auto,
        }
    }
}

impl RecordArgs {
    pub fn request(self) -> RecordRequest {
        RecordRequest {
            target: self.target.into_target(),
            output: self.output,
            force: self.force,
            verbose: self.verbose,
            duration: self.duration,
            mode: self.mode.into(),
            probes: self.probes,
            include: self.include,
            exclude: self.exclude,
            start_at: self.start_at,
            subprocesses: self.subprocesses,
            rate: self.rate,
            nonblocking: self.nonblocking,
            native: self.native,
            async_tasks: self.async_tasks.is_some(),
            async_waiting: self.async_tasks == Some(AsyncTasks::All),
            max_overhead: self.max_overhead,
            ring: self.engine.into(),
            hook: match self.engine {
                Engine::Auto => record::HookUse::Auto,
                Engine::Hook => record::HookUse::Always,
                Engine::Ring | Engine::Int3 => record::HookUse::Never,
            },
            samples: self.samples.into(),
            pprof: self.format == Some(RecordFormat::Pprof),
            every: self.every,
        }
    }
}
