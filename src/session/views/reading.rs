//! Reading a recording for a view, and the notes said beside the view.

use std::fs::File;
use std::io;
use std::path::Path;

use anyhow::{Context, Result};

use pyprobe_recording::analyze::{SampleFilter, SampleTally};
use pyprobe_recording::output::flame::ViewError;
use pyprobe_recording::recording::{Completion, RecordingReader};

pub(crate) fn open(file: &Path) -> Result<RecordingReader<io::BufReader<File>>> {
    RecordingReader::open(file).with_context(|| format!("cannot read {}", file.display()))
}

pub(crate) fn note_cut_short<R: io::Read>(reader: &RecordingReader<R>, file: &Path) {
    if let Completion::Truncated { offset } = reader.completion() {
        eprintln!(
            "pyprobe: note: {} was cut short (no end marker): read every whole chunk before offset {offset}",
            file.display()
        );
    }
}

/// Whether an error is the reader of our output going away (`| head`).
pub(crate) fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
            || c.downcast_ref::<ViewError>().is_some_and(
                |v| matches!(v, ViewError::Io(e) if e.kind() == io::ErrorKind::BrokenPipe),
            )
    })
}

/// Says which samples a view counted and what it left out, unless it was all of them.
pub(crate) fn note_samples(tally: &SampleTally) {
    if tally.left_out() > 0 || tally.cpu_unknown > 0 || tally.filter != SampleFilter::default() {
        for line in tally.notes() {
            eprintln!("pyprobe: {line}");
        }
    }
}
