//! The arguments of the subcommands that show what a process does or holds,
//! writing nothing: `top` (of a process, or of a recording being written),
//! `probes` and `dump`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use pyprobe::session::dump::DumpRequest;
use pyprobe::session::probes::ProbesRequest;
use pyprobe::session::top::TopRequest;

use super::{SampleArgs, TargetArgs, TextFormat};

#[derive(Debug, Args)]
#[command(
    after_help = "Keys of the live view: / filter by name, file or file:line (Enter keeps, \
    Esc clears)  t one thread at a time, then all  c calls/hot  o own  T total  n name  f file \
    (sort)  p pause  + - refresh  q quit"
)]
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
    /// Samples per second. The default is twice `record`'s, so that a one-second
    /// window shows enough; each sample stops the threads for tens of µs while the
    /// overhead budget allows (see `record --rate`).
    #[arg(short, long, value_name = "HZ", default_value_t = pyprobe::session::top::TOP_SAMPLE_RATE)]
    pub rate: u32,
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
    /// Each frame's local variables too, read from memory without running any code
    /// in the target: ints, floats, str, bytes, None and bools by value (long ones
    /// cut), containers by type and length, other objects by type and address. The
    /// target's threads are held while they are read (about a millisecond).
    #[arg(long)]
    pub locals: bool,
    /// asyncio as the program sees it (CPython 3.7+): a thread running a task
    /// shown as the task's logical stack (as `record --async` draws it), then every
    /// task as a tree, each under the task that awaits it, running (on which
    /// thread) or waiting, and where its coroutine stands.
    #[arg(long = "async", conflicts_with = "locals")]
    pub async_tasks: bool,
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
            rate: self.rate,
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
            locals: self.locals,
            async_tasks: self.async_tasks,
        }
    }
}
