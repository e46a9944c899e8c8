//! The folded stacks of a recording for a flame graph: read, measured, and
//! written collapsed (`a;b;c 123`).

use crate::analyze::folded::{Folded, Folder, Measure};
use crate::analyze::recording::replay_recording;
use crate::analyze::SampleFilter;
use crate::output::names::FrameNames;
use crate::recording::{Completion, Header, Qualnames, RecordError, RecordingReader};
use std::io::{self, Read, Seek, Write};

/// An error while writing a view: reading the recording or writing the output.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The recording could not be read.
    #[error(transparent)]
    Record(#[from] crate::recording::RecordError),
    /// The output (or the temporary file) could not be written.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// What the width of a frame stands for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum By {
    /// Time: exclusive time in trace mode, samples in sample mode.
    #[default]
    Time,
    /// Finished calls (trace mode).
    Calls,
}

/// What a view needs to know about the recording besides its events.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ViewInfo {
    /// The recording's header.
    pub header: Header,
    /// End time from the trailer, when the recording was finished properly.
    pub end_ns: Option<u64>,
    /// Lost events according to the trailer.
    pub(crate) trailer_lost: u64,
    /// Where the recording was cut short, if it was.
    pub truncated_at: Option<u64>,
    /// The qualified names of its functions.
    pub qualnames: Qualnames,
}

impl ViewInfo {
    /// Reads what `reader` knows once its events have been read.
    pub(crate) fn of<R: Read>(reader: &RecordingReader<R>) -> Self {
        let (end_ns, trailer_lost, truncated_at) = match reader.completion() {
            Completion::Complete(t) => (Some(t.end_ns), t.lost_events, None),
            Completion::Truncated { offset } => (None, 0, Some(offset)),
            Completion::Reading | Completion::Failed { .. } => (None, 0, None),
        };
        ViewInfo {
            header: reader.header().clone(),
            end_ns,
            trailer_lost,
            truncated_at,
            qualnames: reader.qualnames().clone(),
        }
    }

    /// Where timestamps count from: the header's start, else the first event.
    pub fn start_ns(&self, first_ts: Option<u64>) -> u64 {
        match (self.header.start_ns, first_ts) {
            (0, Some(t)) => t,
            (s, Some(t)) => s.min(t),
            (s, None) => s,
        }
    }

    /// From the start to the trailer's end or the last event.
    pub fn duration_ns(&self, first_ts: Option<u64>, last_ts: Option<u64>) -> u64 {
        let start = self.start_ns(first_ts);
        let end = self.end_ns.unwrap_or(0).max(last_ts.unwrap_or(start));
        end.saturating_sub(start)
    }
}

/// Reads every event of `reader` into folded stacks, with the samples of threads on
/// a CPU (the default [`SampleFilter`]).
pub fn read_folded<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
) -> Result<(Folded, ViewInfo), RecordError> {
    read_folded_filtered(reader, SampleFilter::default(), FrameGrain::Functions)
}

/// What a Python frame of a flame graph is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FrameGrain {
    /// A function (file, name, first line).
    #[default]
    Functions,
    /// A sampled frame is a function at the line it ran (`--lines`).
    Lines,
}

impl FrameGrain {
    fn shape(self, folder: Folder) -> Folder {
        match self {
            FrameGrain::Functions => folder,
            FrameGrain::Lines => folder.by_line(),
        }
    }
}

/// Reads every event of `reader` into folded stacks, with the samples `filter`
/// keeps, their frames as `grain` says.
pub fn read_folded_filtered<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: SampleFilter,
    grain: FrameGrain,
) -> Result<(Folded, ViewInfo), RecordError> {
    let folder = grain.shape(Folder::for_recording(reader.header(), filter));
    fold_with(reader, folder)
}

/// As [`read_folded_filtered`], with each stack under its thread's frame
/// ([`Folder::by_thread`]): for exports that label samples by thread.
pub fn read_folded_by_thread<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: SampleFilter,
    grain: FrameGrain,
) -> Result<(Folded, ViewInfo), RecordError> {
    let folder = grain.shape(Folder::for_recording(reader.header(), filter).by_thread());
    fold_with(reader, folder)
}

fn fold_with<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    mut folder: Folder,
) -> Result<(Folded, ViewInfo), RecordError> {
    let replay = replay_recording(reader, |_, event, ts, steps, replay| {
        folder.push(event, ts, steps, replay);
        Ok::<(), RecordError>(())
    })?;
    let info = ViewInfo::of(reader);
    Ok((folder.finish(replay, info.end_ns), info))
}

/// Whether the recording holds samples rather than calls.
pub fn is_sampled(folded: &Folded, header: &Header) -> bool {
    let c = folded.counts;
    c.samples > 0 && (header.mode == "sample" || c.calls + c.returns == 0)
}

/// The measure `by` means for this recording, and a note when it could not be
/// honoured as asked.
pub fn choose_measure(folded: &Folded, header: &Header, by: By) -> (Measure, Option<String>) {
    let sampled = is_sampled(folded, header);
    let c = folded.counts;
    match by {
        By::Calls if sampled => (
            Measure::Samples,
            Some("a sampled recording has no call counts: width is samples".into()),
        ),
        By::Calls => (Measure::Calls, None),
        By::Time if sampled => (Measure::Samples, None),
        By::Time if c.returns_only || (c.calls == 0 && c.returns > 0) => {
            if c.samples > 0 {
                (Measure::Samples, None)
            } else {
                (
                    Measure::Calls,
                    Some(
                        "return events only (CPython 3.11): no times, width is call counts".into(),
                    ),
                )
            }
        }
        By::Time => (Measure::Time, None),
    }
}

/// Folded stack lines (`a;b;c 123`): depth first, siblings in name order, so
/// stacks sharing a prefix are together and the output is stable.
pub fn collapsed_lines(folded: &Folded, measure: Measure, names: &FrameNames<'_>) -> Vec<String> {
    let mut lines = Vec::new();
    folded.walk_named(
        measure,
        1,
        |f| names.fold_frame(f),
        |path, value| lines.push(format!("{} {value}", path.join(";"))),
    );
    lines
}

/// Writes folded stacks, one line per stack, as [`collapsed_lines`] orders them,
/// without holding them all in memory.
pub fn write_collapsed<W: Write>(
    folded: &Folded,
    measure: Measure,
    names: &FrameNames<'_>,
    mut out: W,
) -> io::Result<()> {
    let mut result = Ok(());
    let mut line = String::new();
    folded.walk_named(
        measure,
        1,
        |f| names.fold_frame(f),
        |path, value| {
            if result.is_err() {
                return;
            }
            line.clear();
            for (i, name) in path.iter().enumerate() {
                if i > 0 {
                    line.push(';');
                }
                line.push_str(name);
            }
            line.push(' ');
            line.push_str(&value.to_string());
            line.push('\n');
            result = out.write_all(line.as_bytes());
        },
    );
    result?;
    out.flush()
}
