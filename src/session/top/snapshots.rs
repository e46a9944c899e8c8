//! Where top's snapshots come from, a recording re-read at each refresh, and
//! where a single one goes, standard output.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use pyprobe_recording::analyze::Report;
use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::output::file::partial_path;
use pyprobe_recording::output::report::build_thread_report;
use pyprobe_recording::output::top::{render_text, snapshot_between, Snapshot, TopSort};
use pyprobe_recording::recording::RecordingReader;

use crate::session::views::{usable_views, Notes};

/// Opens a recording that may still be written: its `.partial` while the recorder
/// runs, the recording itself once it has ended.
pub(super) fn open_live(
    file: &Path,
) -> Result<RecordingReader<io::BufReader<File>>, pyprobe_recording::recording::RecordError> {
    match RecordingReader::open(&partial_path(file)) {
        Err(pyprobe_recording::recording::RecordError::Io { error, .. })
            if error.kind() == io::ErrorKind::NotFound =>
        {
            RecordingReader::open(file)
        }
        other => other,
    }
}

/// The report of `file` (possibly still being written), of thread `thread`
/// (`None`: every thread): a finished recording's report of every thread is
/// its stored views'.
pub(super) fn report_of(
    file: &Path,
    samples: SampleFilter,
    thread: Option<u32>,
    notes: Notes,
) -> Result<Report> {
    if thread.is_none() && !partial_path(file).exists() {
        if let Some(views) = usable_views(file, samples, false, notes)? {
            return Ok(views.report);
        }
    }
    let mut reader = open_live(file).with_context(|| format!("cannot read {}", file.display()))?;
    build_thread_report(&mut reader, samples, thread)
        .with_context(|| format!("cannot read {}", file.display()))
}

/// A data source reading a recording again at each refresh: the numbers cover
/// what was added since the previous one, of every thread or of the one asked for.
pub(super) fn recording_source(
    file: PathBuf,
    samples: SampleFilter,
) -> impl FnMut(Option<u32>) -> Snapshot {
    let mut previous: Option<(Option<u32>, Report)> = None;
    move |thread| {
        let report = report_of(&file, samples, thread, Notes::Quiet);
        let report = match report {
            Ok(report) => report,
            Err(e) => {
                return Snapshot {
                    status: Some(format!("cannot read {}: {e:#}", file.display())),
                    thread,
                    ..Snapshot::default()
                }
            }
        };
        // A report of another thread is no base for this one's window.
        let base = previous
            .as_ref()
            .filter(|(t, _)| *t == thread)
            .map(|(_, r)| r);
        let mut s = snapshot_between(base, &report);
        let grown = base.is_none_or(|p| p.events != report.events);
        if base.is_none() && previous.is_some() {
            s.status = Some(format!(
                "{}: the whole recording shown for this choice of thread",
                file.display()
            ));
        } else if !grown {
            // Nothing new (the recording is finished): show the whole of it.
            s = snapshot_between(None, &report);
            s.status = Some(format!(
                "{}: no new events; whole recording shown",
                file.display()
            ));
        } else {
            s.status = Some(format!("from {}", file.display()));
        }
        s.thread = thread;
        previous = Some((thread, report));
        s
    }
}

/// Samples per second of `top` unless `-r` says otherwise: twice `record`'s, for
/// a one-second window to show enough.
pub const TOP_SAMPLE_RATE: u32 = 200;

pub(super) fn print_snapshot(snapshot: &Snapshot, limit: usize) -> Result<()> {
    let text = render_text(snapshot, TopSort::Hot, limit);
    match io::stdout().write_all(text.as_bytes()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("cannot write to standard output"),
    }
}
