//! `pyprobe top`: the hottest Python functions of a recording (possibly still
//! being written), of a process or of every Python process, as one snapshot or
//! as a live terminal view.

use std::fs::File;
use std::io::{self, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::analyze::SampleFilter;
use crate::output::file::partial_path;
use crate::output::report::build_report_filtered;
use crate::output::top::{render_text, snapshot_between, Snapshot, TopSort, ViewState};
use crate::record::RecordingReader;
use crate::session::record::{self, RecordRequest, Target};
use crate::session::views::open;

use live::{all_top, live_top};
use terminal::run_tui;

mod live;
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
}

/// Opens a recording that may still be written: its `.partial` while the recorder
/// runs, the recording itself once it has ended.
pub(crate) fn open_live(
    file: &Path,
) -> Result<RecordingReader<io::BufReader<File>>, crate::record::RecordError> {
    match RecordingReader::open(&partial_path(file)) {
        Err(crate::record::RecordError::Io { source, .. })
            if source.kind() == io::ErrorKind::NotFound =>
        {
            RecordingReader::open(file)
        }
        other => other,
    }
}

/// A data source reading a recording again at each refresh: the numbers cover
/// what was added since the previous one.
pub(crate) fn recording_source(file: PathBuf, samples: SampleFilter) -> impl FnMut() -> Snapshot {
    let mut previous = None;
    move || {
        let report = open_live(&file)
            .map_err(anyhow::Error::from)
            .and_then(|mut r| build_report_filtered(&mut r, samples).map_err(anyhow::Error::from));
        match report {
            Ok(report) => {
                let mut s = snapshot_between(previous.as_ref(), &report);
                let grown = previous
                    .as_ref()
                    .is_none_or(|p: &crate::analyze::Report| p.events != report.events);
                if !grown {
                    // Nothing new (the recording is finished): show the whole of it.
                    s = snapshot_between(None, &report);
                    s.status = Some(format!(
                        "{}: no new events; whole recording shown",
                        file.display()
                    ));
                } else {
                    s.status = Some(format!("from {}", file.display()));
                }
                previous = Some(report);
                s
            }
            Err(e) => Snapshot {
                status: Some(format!("cannot read {}: {e:#}", file.display())),
                ..Snapshot::default()
            },
        }
    }
}

/// Samples per second for `top --once -p PID`.
pub(crate) const TOP_SAMPLE_RATE: u32 = 200;

/// `pyprobe top`.
pub fn top(request: &TopRequest) -> Result<ExitCode> {
    if !(request.interval > 0.0 && request.interval.is_finite()) {
        bail!("--interval must be a positive number of seconds");
    }
    let interval = Duration::from_secs_f64(request.interval);
    let once = request.once || !io::stdout().is_terminal();
    let limit = request.limit.max(1);
    if let Some(file) = &request.from {
        if once {
            let mut reader =
                open_live(file).with_context(|| format!("cannot read {}", file.display()))?;
            let report = build_report_filtered(&mut reader, request.samples)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let snapshot = snapshot_between(None, &report);
            print_snapshot(&snapshot, limit)?;
            return Ok(ExitCode::SUCCESS);
        }
        let state = ViewState {
            sort: TopSort::Hot,
            paused: false,
            interval,
            limit,
        };
        run_tui(recording_source(file.clone(), request.samples), state)
            .context("the terminal view failed")?;
        return Ok(ExitCode::SUCCESS);
    }
    if request.all {
        return all_top(interval, limit, once, request.samples);
    }
    let pid = match &request.target {
        Some(Target::Launch(_)) if once => {
            bail!("`top --once -- CMD` is not supported: record it (`pyprobe record -- CMD`) and use `top --from`");
        }
        Some(Target::Attach(pid)) if once => *pid,
        Some(target) => return live_top(target, interval, limit, request.samples),
        None => {
            eprintln!(
                "pyprobe: top: nothing to watch: give -p PID, --from RECORDING (or -- CMD, --all)"
            );
            return Ok(ExitCode::from(2));
        }
    };
    // One snapshot of a live process: record it for one interval, sampling
    // stacks (GC and imports exact where the build has their probes).
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let recording = dir.path().join("top.pyprobe");
    let one_interval = RecordRequest {
        target: Some(Target::Attach(pid)),
        output: Some(recording.clone()),
        duration: Some(request.interval),
        mode: record::Mode::Auto,
        rate: TOP_SAMPLE_RATE,
        ..Default::default()
    };
    let code = record::run(&one_interval)?;
    if !recording.exists() {
        bail!("nothing was recorded from process {pid}");
    }
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    let mut reader = open(&recording)?;
    let report = build_report_filtered(&mut reader, request.samples)
        .context("cannot read the snapshot's recording")?;
    print_snapshot(&snapshot_between(None, &report), limit)?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn print_snapshot(snapshot: &Snapshot, limit: usize) -> Result<()> {
    let text = render_text(snapshot, TopSort::Hot, limit);
    match io::stdout().write_all(text.as_bytes()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("cannot write to standard output"),
    }
}
