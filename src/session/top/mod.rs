//! `pyprobe top`: the hottest Python functions of a recording (possibly still
//! being written), of a process or of every Python process, as one snapshot or
//! as a live terminal view.

use std::io::{self, IsTerminal};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::session::record::{self, RecordRequest, Target};
use crate::session::views::open;
use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::output::report::build_report_filtered;
use pyprobe_recording::output::top::{snapshot_between, ViewState};
use pyprobe_sdt::tracer::RingUse;

use live::{all_top, live_top};
pub use snapshots::TOP_SAMPLE_RATE;
use snapshots::{print_snapshot, recording_source, report_of};

use crate::session::views::Notes;
use terminal::run_tui;

mod live;
mod snapshots;
mod terminal;

/// What `pyprobe top` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct TopRequest {
    pub target: Option<Target>,
    /// Every Python process this user may trace.
    pub all: bool,
    /// Watch a recording (possibly being written) instead of a process.
    pub from: Option<PathBuf>,
    pub interval: f64,
    pub limit: usize,
    pub once: bool,
    /// Which samples count (`--idle`, `--gil`).
    pub samples: SampleFilter,
    /// Samples per second (`-r`).
    pub rate: u32,
}

/// `pyprobe top`.
pub fn top(request: &TopRequest) -> Result<ExitCode> {
    if !(request.interval > 0.0 && request.interval.is_finite()) {
        bail!("--interval must be a positive number of seconds");
    }
    if request.rate == 0 {
        bail!("-r/--rate must be at least 1 sample per second");
    }
    let interval = Duration::from_secs_f64(request.interval);
    let once = request.once || !io::stdout().is_terminal();
    let limit = request.limit.max(1);
    if let Some(file) = &request.from {
        if once {
            let report = report_of(file, request.samples, None, Notes::Say)?;
            let snapshot = snapshot_between(None, &report);
            print_snapshot(&snapshot, limit)?;
            return Ok(ExitCode::SUCCESS);
        }
        let state = ViewState::new(interval, limit);
        run_tui(recording_source(file.clone(), request.samples), state)
            .context("the terminal view failed")?;
        return Ok(ExitCode::SUCCESS);
    }
    if request.all {
        return all_top(interval, limit, once, request.samples, request.rate);
    }
    let (target, duration, what) = match &request.target {
        // One snapshot of a live process: one interval of it.
        Some(Target::Attach(pid)) if once => (
            Target::Attach(*pid),
            Some(request.interval),
            format!("process {pid}"),
        ),
        // One snapshot of a command: its whole run.
        Some(Target::Launch(cmd)) if once => (
            Target::Launch(cmd.clone()),
            None,
            format!("`{}`", cmd.join(" ")),
        ),
        Some(target) => return live_top(target, interval, limit, request.samples, request.rate),
        None => {
            eprintln!(
                "pyprobe: top: nothing to watch: give -p PID, --from RECORDING (or -- CMD, --all)"
            );
            return Ok(ExitCode::from(2));
        }
    };
    // Recorded as `record` would, sampling stacks (GC and imports exact where the
    // build has their probes), then shown as one snapshot.
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let recording = dir.path().join("top.pyprobe");
    let one_interval = RecordRequest {
        target: Some(target),
        output: Some(recording.clone()),
        duration,
        mode: record::Mode::Auto,
        rate: request.rate,
        // As `record`'s default: rare probes through the ring where they qualify.
        ring: RingUse::Auto,
        ..Default::default()
    };
    let code = record::run(&one_interval)?;
    if !recording.exists() {
        bail!("nothing was recorded from {what}");
    }
    let mut reader = open(&recording)?;
    let report = build_report_filtered(&mut reader, request.samples)
        .context("cannot read the snapshot's recording")?;
    print_snapshot(&snapshot_between(None, &report), limit)?;
    // A command's own exit status is `top`'s, as it is `record`'s.
    Ok(code)
}
