//! Views of a recording: each reads only the event model and the analysis.
//! [`file`] is how every output named by the user is written.

pub mod calls;
pub mod chrome;
pub mod file;
pub mod flame;
pub mod probes;
pub mod report;
pub mod speedscope;
pub mod top;

use std::io::{Read, Seek};

use crate::analyze::{Planner, Replay, Step};
use crate::record::{Event, RecordError, RecordingReader};

/// Reads every event of `reader` to plan the replay, then goes back to the first
/// event and replays them: `f` gets the reader (for its strings), each event, its
/// thread's monotonic time, the steps it caused and the replay. The replay is
/// returned unfinished: call [`Replay::finish`] with the recording's end.
pub fn replay_recording<R: Read + Seek, E: From<RecordError>>(
    reader: &mut RecordingReader<R>,
    mut f: impl FnMut(&RecordingReader<R>, &Event, u64, &[Step], &Replay) -> Result<(), E>,
) -> Result<Replay, E> {
    let header = reader.header().clone();
    let mut planner = Planner::new(&header);
    while let Some(event) = reader.next_event() {
        planner.push(&event?, reader.strings());
    }
    reader.rewind()?;
    let mut replay = Replay::new(&header, planner.finish());
    let mut steps = Vec::new();
    while let Some(event) = reader.next_event() {
        let event = event?;
        steps.clear();
        let ts = replay.push(&event, &mut steps);
        f(reader, &event, ts, &steps, &replay)?;
    }
    Ok(replay)
}
