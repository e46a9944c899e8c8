//! The command line (clap derive), and the typed request of the session layer
//! each subcommand's arguments make. `main.rs` dispatches.
//!
//! Here: the command tree and the arguments several subcommands share; each
//! subcommand's own arguments are in `record_args`, `view_args` (reading a
//! recording) and `inspect_args` (showing a process, writing nothing).

use clap::{Args, Parser, Subcommand, ValueEnum};

use pyprobe::session::record::Target;
use pyprobe_recording::analyze::SampleFilter;

mod inspect_args;
mod record_args;
mod shell_args;
mod view_args;

use inspect_args::{DumpArgs, ProbesArgs, TopArgs};
use record_args::RecordArgs;
use shell_args::{CompletionsArgs, ManArgs};
pub use view_args::ReportAction;
use view_args::{CallsArgs, FlameArgs, ReportArgs};

#[derive(Debug, Parser)]
#[command(
    name = "pyprobe",
    version,
    about = "Profile and trace a live CPython process from outside, with nothing but ptrace",
    long_about = "Profile and trace a live CPython process from outside, with nothing but ptrace.\n\n\
        pyprobe needs no root, no eBPF, uprobes or perf_events, and nothing changed in the \
        target's code or command. It samples Python stacks with a frame walker, catches \
        CPython's SystemTap (SDT) probes where the build has them (through injected \
        trampolines, else breakpoints), and traces every call on CPython 3.7 to 3.15 of any \
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
    ///
    /// A recording of 16 MB or more is read once for every view: what the views need is
    /// kept beside it (RUN.pyprobe.views), and later views (report, flame, top --from) open at
    /// once.
    Flame(FlameArgs),
    /// Summarise a recording: functions, GC pauses, imports, audit events, threads, and
    /// (traced by the hook engine) the types functions returned.
    ///
    /// A recording of 16 MB or more is read once for every view: what the views need is
    /// kept beside it (RUN.pyprobe.views), and later views (report, flame, top --from) open at
    /// once.
    Report(ReportArgs),
    /// Show the call flow of a recording, one line per call and return.
    Calls(CallsArgs),
    /// A live view of the hottest Python functions.
    Top(TopArgs),
    /// List the SDT probes of a binary or of a running process.
    Probes(ProbesArgs),
    /// Print the Python stack of every thread of a process, once.
    Dump(DumpArgs),
    /// Print shell completions for bash, zsh, fish, elvish or PowerShell.
    Completions(CompletionsArgs),
    /// Print the man page, or write every page into a directory.
    Man(ManArgs),
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
pub enum TextFormat {
    Text,
    Json,
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

#[cfg(test)]
mod documented_commands;
