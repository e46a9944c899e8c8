//! The command line (clap derive), and the typed request of the session layer
//! each subcommand's arguments make. `main.rs` dispatches.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use pyprobe::session::dump::DumpRequest;
use pyprobe::session::probes::ProbesRequest;
use pyprobe::session::record::{self, RecordRequest, Target};
use pyprobe::session::report::ReportRequest;
use pyprobe::session::top::TopRequest;
use pyprobe::session::views::{self, CallsRequest, FlameRequest};
use pyprobe_recording::analyze::{parse_duration, FileFilter, SampleFilter, SliceFilter};
use pyprobe_recording::output::flame::{By, FrameGrain};
use pyprobe_recording::output::report::SortKey as ReportSort;
use pyprobe_sdt::tracer::RingUse;

#[derive(Debug, Parser)]
#[command(
    name = "pyprobe",
    version,
    about = "Profile and trace a live CPython process from outside, with nothing but ptrace",
    long_about = "Profile and trace a live CPython process from outside, with nothing but ptrace.\n\n\
        pyprobe needs no root, no eBPF, uprobes or perf_events, and nothing changed in the \
        target's code or command. It samples Python stacks with a frame walker, catches \
        CPython's SystemTap (SDT) probes where the build has them (through injected \
        trampolines, else breakpoints), and traces every call on CPython 3.7 to 3.14 of any \
        build through a hook it injects.",
    after_help = "Examples:\n  \
        pyprobe record -p 1234 -d 30 -o flame.svg     profile a running service for 30 s\n  \
        pyprobe record -o run.pyprobe -- python3 app.py\n  \
        pyprobe report run.pyprobe                    functions, GC pauses, imports, audit events\n  \
        pyprobe probes /usr/bin/python3.11            what probes a binary has"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Record a live process or a command into a recording or a view.
    Record(RecordArgs),
    /// Render a recording as a flame graph or an export for other tools.
    Flame(FlameArgs),
    /// Summarise a recording: functions, GC pauses, imports, audit events, threads, and
    /// (traced by the hook engine) the types functions returned.
    Report(ReportArgs),
    /// Show the call flow of a recording, one line per call and return.
    Calls(CallsArgs),
    /// A live view of the hottest Python functions.
    Top(TopArgs),
    /// List the SDT probes of a binary or of a running process.
    Probes(ProbesArgs),
    /// Print the Python stack of every thread of a process, once.
    Dump(DumpArgs),
}

/// Which process to look at: a running one, or a command to start.
#[derive(Debug, Args)]
pub struct TargetArgs {
    /// Attach to this running process.
    #[arg(short, long, value_name = "PID", conflicts_with = "command")]
    pub pid: Option<i32>,
    /// Start this command under pyprobe (after `--`).
    #[arg(last = true, value_name = "CMD ARGS")]
    pub command: Vec<String>,
}

/// Which sampled stacks a view counts, by what their thread was doing.
#[derive(Debug, Clone, Copy, Args)]
pub struct SampleArgs {
    /// Count the samples of waiting threads too (asleep, blocked on I/O, a lock or
    /// the GIL). By default only threads on a CPU count: a thread sleeping in
    /// `select` no longer takes the profile over. Exact (traced) calls are never
    /// filtered.
    #[arg(long)]
    pub idle: bool,
    /// Count only the samples of the thread holding the GIL (with --idle, even
    /// while it waits). Where the GIL cannot be read, samples are kept and the
    /// view says so.
    #[arg(long)]
    pub gil: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Sample function stacks; GC, import and audit exact through their probes.
    Auto,
    /// Every call and return exact, through the function probes or the injected
    /// hook (CPython 3.7 to 3.14).
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
    /// pprof; the recording is kept beside it, x.svg → x.pyprobe). Any other name is refused
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
    /// injects and the interpreter calls (CPython 3.7 to 3.14): registered with
    /// `sys.monitoring` at a safe point on 3.12+, each thread's C profile function
    /// before; no probes needed. `auto` uses it in `--mode trace` where the
    /// interpreter's entry and return probes do not both fire.
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
    /// hook engine's calls (CPython 3.7 to 3.14 without function probes), which
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FlameFormat {
    Svg,
    Collapsed,
    Speedscope,
    Chrome,
    /// Gzipped pprof profile.proto, for `go tool pprof` and continuous profilers
    /// (Pyroscope, Grafana, Parca): samples/count and cpu/nanoseconds for a sampled
    /// recording, calls/count and wall/nanoseconds (exclusive) for a traced one,
    /// each stack labelled with its thread and pid.
    Pprof,
}

#[derive(Debug, Args)]
pub struct FlameArgs {
    /// A recording made by `pyprobe record`.
    pub file: PathBuf,
    /// Where to write (`-` for standard output). Its extension must fit the
    /// format (.svg; .txt or .folded for collapsed; .json for speedscope and
    /// chrome; .pb.gz or .pprof for pprof), else pyprobe refuses; without
    /// --format, it chooses the format (.json: speedscope). An existing file is
    /// refused unless --force is given. Default: beside the recording (FILE.svg,
    /// .folded.txt, .speedscope.json, .trace.json, .pb.gz), or FILE.1.svg, .2, ...
    /// when that exists.
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// What to write (default: from OUT's extension, else svg).
    #[arg(long, value_enum)]
    pub format: Option<FlameFormat>,
    /// Replace an existing output file (OUT, or the default name).
    #[arg(long)]
    pub force: bool,
    /// Chrome trace and speedscope only: drop calls (and GC pauses, imports,
    /// sampled slices) shorter than this, e.g. 50us, 1ms. A call dropped takes
    /// its callees with it (they are shorter still). An export estimated above
    /// 200 MB is announced on stderr, with these filters, before it is written.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub min_duration: Option<u64>,
    /// Chrome trace and speedscope only: keep only functions whose file matches
    /// this glob (repeatable); GC, import and audit events stay.
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Chrome trace and speedscope only: drop functions whose file matches this
    /// glob (repeatable); their callees stay, under their caller.
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Title of the SVG (default: the target's command line).
    #[arg(long, value_name = "T")]
    pub title: Option<String>,
    /// Keep full file paths in frame names (default: shortened).
    #[arg(long)]
    pub full_paths: bool,
    /// What a frame's width stands for: time (trace: own time, sample: samples)
    /// or calls (trace mode).
    #[arg(long, value_enum, default_value_t = FlameBy::Time)]
    pub by: FlameBy,
    /// Split each sampled frame by the line it was running: `work (app.py:8)
    /// line 11` and `work (app.py:8) line 14` are two boxes, an outer frame's
    /// line being its call. SVG, collapsed and pprof (whose locations then carry
    /// the lines, for `go tool pprof -lines`); traced calls have no line per
    /// frame and stay functions. `report --lines FILE` gives the same per line of
    /// one file, as annotated source.
    #[arg(long)]
    pub lines: bool,
    #[command(flatten)]
    pub samples: SampleArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FlameBy {
    Time,
    Calls,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    Table,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SortKey {
    Inclusive,
    Exclusive,
    Calls,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A recording made by `pyprobe record`.
    pub file: PathBuf,
    #[arg(long, value_enum, default_value_t = ReportFormat::Table)]
    pub format: ReportFormat,
    /// Order of the functions (default: inclusive time; calls when the recording
    /// has exact counts but no times, as on CPython 3.11 traced through its
    /// probes with --engine ring or int3).
    #[arg(long, value_enum)]
    pub sort: Option<SortKey>,
    /// Show at most N functions (table only; JSON lists all).
    #[arg(long, value_name = "N", default_value_t = 30)]
    pub limit: usize,
    /// Keep only functions whose file matches this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Hide functions whose file matches this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    #[command(flatten)]
    pub samples: SampleArgs,
    /// Instead of the report: the source of FILE (read from disk now), each line
    /// with the samples whose innermost frame ran it (own, and its time: own ×
    /// the sampling interval), the samples with it anywhere on their stack
    /// (total), and the `line` probe's hits on it (`record --probes line`). FILE
    /// is the path the recording names, or its end (`app/main.py`).
    #[arg(long, value_name = "FILE")]
    pub lines: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TextFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct CallsArgs {
    /// A recording made by `pyprobe record --mode trace`.
    pub file: PathBuf,
    /// Show only what happens inside calls of this function.
    #[arg(long, value_name = "FUNCTION")]
    pub start_at: Option<String>,
    #[arg(long, value_enum, default_value_t = TextFormat::Text)]
    pub format: TextFormat,
    /// Only this thread.
    #[arg(long, value_name = "TID")]
    pub thread: Option<u32>,
    /// Only calls less than N deep (below --start-at's call, if given).
    #[arg(long, value_name = "N")]
    pub max_depth: Option<usize>,
    /// Keep full file paths in the text (JSON always has them).
    #[arg(long)]
    pub full_paths: bool,
}

#[derive(Debug, Args)]
pub struct TopArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Every Python process this user may trace.
    #[arg(long, conflicts_with_all = ["pid", "command"])]
    pub all: bool,
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
    pub interval: f64,
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub limit: usize,
    /// Print one snapshot as text and exit: of one interval of a running process
    /// (-p), or of a command's whole run (-- CMD, whose exit status `top` returns).
    #[arg(long)]
    pub once: bool,
    /// Watch a recording (possibly still being written) instead of a process.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["pid", "command", "all"])]
    pub from: Option<PathBuf>,
    #[command(flatten)]
    pub samples: SampleArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TableFormat {
    Table,
    Json,
}

#[derive(Debug, Args)]
pub struct ProbesArgs {
    /// A running process to inspect (the object carrying the probes is found in its maps).
    #[arg(short, long, value_name = "PID", conflicts_with = "path")]
    pub pid: Option<i32>,
    /// An ELF file: a python binary, libpython*.so, or any program with SDT notes.
    #[arg(value_name = "PATH", required_unless_present = "pid")]
    pub path: Option<PathBuf>,
    /// Only this provider (default: every provider in PATH; for -p, `python` when
    /// the process has it, else every object with SDT notes).
    #[arg(long, value_name = "NAME")]
    pub provider: Option<String>,
    #[arg(long, value_enum, default_value_t = TableFormat::Table)]
    pub format: TableFormat,
}

#[derive(Debug, Args)]
pub struct DumpArgs {
    #[arg(short, long, value_name = "PID")]
    pub pid: i32,
    #[arg(long, value_enum, default_value_t = TextFormat::Text)]
    pub format: TextFormat,
    /// Keep full file paths in the text (JSON always has them).
    #[arg(long)]
    pub full_paths: bool,
    /// Also say which interpreter was found and where its layout came from.
    #[arg(short, long)]
    pub verbose: bool,
}

impl TargetArgs {
    /// `-p PID` or `-- CMD` (clap lets through one at most).
    fn into_target(self) -> Option<Target> {
        match self.pid {
            Some(pid) => Some(Target::Attach(pid)),
            None if !self.command.is_empty() => Some(Target::Launch(self.command)),
            None => None,
        }
    }
}

impl From<SampleArgs> for SampleFilter {
    fn from(args: SampleArgs) -> SampleFilter {
        SampleFilter {
            idle: args.idle,
            gil: args.gil,
        }
    }
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

impl From<FlameFormat> for views::FlameFormat {
    fn from(format: FlameFormat) -> views::FlameFormat {
        match format {
            FlameFormat::Svg => views::FlameFormat::Svg,
            FlameFormat::Collapsed => views::FlameFormat::Collapsed,
            FlameFormat::Speedscope => views::FlameFormat::Speedscope,
            FlameFormat::Chrome => views::FlameFormat::Chrome,
            FlameFormat::Pprof => views::FlameFormat::Pprof,
        }
    }
}

impl From<FlameBy> for By {
    fn from(by: FlameBy) -> By {
        match by {
            FlameBy::Time => By::Time,
            FlameBy::Calls => By::Calls,
        }
    }
}

impl From<SortKey> for ReportSort {
    fn from(key: SortKey) -> ReportSort {
        match key {
            SortKey::Inclusive => ReportSort::Inclusive,
            SortKey::Exclusive => ReportSort::Exclusive,
            SortKey::Calls => ReportSort::Calls,
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

impl FlameArgs {
    /// Refuses a bad `--include`/`--exclude` glob.
    pub fn request(self) -> anyhow::Result<FlameRequest> {
        let files =
            FileFilter::new(&self.include, &self.exclude).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(FlameRequest {
            file: self.file,
            output: self.output,
            format: self.format.map(Into::into),
            title: self.title,
            full_paths: self.full_paths,
            by: self.by.into(),
            force: self.force,
            samples: self.samples.into(),
            idle_if_all_waiting: false,
            grain: if self.lines {
                FrameGrain::Lines
            } else {
                FrameGrain::Functions
            },
            filter: SliceFilter {
                files,
                min_duration_ns: self.min_duration.unwrap_or(0),
            },
        })
    }
}

impl ReportArgs {
    pub fn request(self) -> ReportRequest {
        let table = self.format == ReportFormat::Table;
        ReportRequest {
            file: self.file,
            json: !table,
            sort: self.sort.map(Into::into),
            // The JSON document lists every function.
            limit: table.then_some(self.limit),
            include: self.include,
            exclude: self.exclude,
            samples: self.samples.into(),
            lines: self.lines,
        }
    }
}

impl CallsArgs {
    pub fn request(self) -> CallsRequest {
        CallsRequest {
            file: self.file,
            start_at: self.start_at,
            thread: self.thread,
            max_depth: self.max_depth,
            json: self.format == TextFormat::Json,
            full_paths: self.full_paths,
        }
    }
}

impl TopArgs {
    pub fn request(self) -> TopRequest {
        TopRequest {
            target: self.target.into_target(),
            all: self.all,
            from: self.from,
            interval: self.interval,
            limit: self.limit,
            once: self.once,
            samples: self.samples.into(),
        }
    }
}

impl ProbesArgs {
    pub fn request(self) -> ProbesRequest {
        ProbesRequest {
            pid: self.pid,
            path: self.path,
            provider: self.provider,
            json: self.format == TableFormat::Json,
        }
    }
}

impl DumpArgs {
    pub fn request(self) -> DumpRequest {
        DumpRequest {
            pid: self.pid,
            json: self.format == TextFormat::Json,
            full_paths: self.full_paths,
            verbose: self.verbose,
        }
    }
}
