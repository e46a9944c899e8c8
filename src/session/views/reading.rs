//! Reading a recording for a view, and the notes said beside the view.

use std::fs::File;
use std::io;
use std::path::Path;

use anyhow::{Context, Result};

use pyprobe_recording::analyze::folded::Folded;
use pyprobe_recording::analyze::line_counts::LineCounts;
use pyprobe_recording::analyze::Report;
use pyprobe_recording::analyze::{SampleFilter, SampleTally};
use pyprobe_recording::output::flame::{
    read_folded_by_thread, read_folded_filtered, FrameGrain, ViewError, ViewInfo,
};
use pyprobe_recording::recording::{Completion, RecordError, RecordingReader};
use pyprobe_recording::stored::StoredViews;

use super::stored::{usable_views, Notes};

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

/// A recording read into folded stacks, with the samples `samples` keeps (see
/// [`fold_counting_waiting`]).
pub(crate) struct FoldedRecording {
    pub folded: Folded,
    pub info: ViewInfo,
    /// The recording's string table, read to the end: it names the frames.
    pub strings: Vec<String>,
    /// The samples counted: `samples`, or every one when all were waiting.
    pub samples: SampleFilter,
}

impl FoldedRecording {
    /// The stacks `views` keep: by thread, or merged.
    pub(crate) fn stored(views: StoredViews, by_thread: bool) -> (Self, Report, LineCounts) {
        let folded = if by_thread {
            views.stacks
        } else {
            views.stacks.without_threads()
        };
        let recording = FoldedRecording {
            samples: folded.tally.filter,
            folded,
            info: views.info,
            strings: views.strings,
        };
        (recording, views.report, views.lines)
    }
}

/// Whether a view's stacks keep their threads apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Threads {
    /// Each stack under its thread's frame (pprof, the HTML page).
    Apart,
    /// The threads' stacks merged (the flame graph, pstats).
    Merged,
}

/// The stacks of `file` for a view counting the samples `samples` keeps, its
/// frames as `grain` says: from its kept views when they can serve it (see
/// [`usable_views`]), else folded from its events as
/// [`fold_counting_waiting`] does (`view` names the view in its note, said
/// only with `idle_if_all_waiting`).
pub(crate) fn stacks_of(
    file: &Path,
    samples: SampleFilter,
    idle_if_all_waiting: bool,
    grain: FrameGrain,
    threads: Threads,
    view: &str,
) -> Result<FoldedRecording> {
    let stored = usable_views(file, samples, idle_if_all_waiting, Notes::Say)?
        .filter(|_| grain == FrameGrain::Functions);
    match stored {
        Some(views) => Ok(FoldedRecording::stored(views, threads == Threads::Apart).0),
        None => fold_counting_waiting(
            file,
            samples,
            idle_if_all_waiting,
            view,
            |reader, samples| match threads {
                Threads::Apart => read_folded_by_thread(reader, samples, grain),
                Threads::Merged => read_folded_filtered(reader, samples, grain),
            },
        ),
    }
}

/// Folds `file` with `fold` and the samples `samples` keeps. With
/// `idle_if_all_waiting`, a run too short to catch its thread on a CPU (every
/// sample found it waiting, none kept) is folded again with them all, as
/// `--idle` does, and `view` says so.
pub(crate) fn fold_counting_waiting(
    file: &Path,
    mut samples: SampleFilter,
    idle_if_all_waiting: bool,
    view: &str,
    fold: impl Fn(
        &mut RecordingReader<io::BufReader<File>>,
        SampleFilter,
    ) -> Result<(Folded, ViewInfo), RecordError>,
) -> Result<FoldedRecording> {
    let mut reader = open(file)?;
    let (mut folded, mut info) =
        fold(&mut reader, samples).with_context(|| format!("cannot read {}", file.display()))?;
    let t = folded.tally;
    if idle_if_all_waiting && !samples.idle && t.kept == 0 && t.left_out() > 0 {
        eprintln!(
            "pyprobe: note: every one of the {} samples found its thread waiting (asleep, \
             blocked on I/O, a lock or the GIL): the {view} counts them, as --idle does",
            t.samples
        );
        samples.idle = true;
        reader = open(file)?;
        (folded, info) = fold(&mut reader, samples)
            .with_context(|| format!("cannot read {}", file.display()))?;
    }
    note_cut_short(&reader, file);
    Ok(FoldedRecording {
        folded,
        info,
        strings: reader.into_strings(),
        samples,
    })
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
