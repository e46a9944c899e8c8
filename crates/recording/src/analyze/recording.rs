//! The two passes over a recording every view of calls shares: a plan of the
//! replay, then the replay of every event with it.

use std::io::{Read, Seek};

use super::replay::{Plan, Planner, Replay, Step};
use crate::recording::{Event, RecordError, RecordingReader};

/// The second pass: replays every event of `reader` (at its first event) with
/// `plan`; `f` gets the reader (for its strings), each event, its thread's
/// monotonic time, the steps it caused and the replay. The replay is returned
/// unfinished: call [`Replay::finish`] with the recording's end.
pub(crate) fn replay_planned<R: Read + Seek, E: From<RecordError>>(
    reader: &mut RecordingReader<R>,
    plan: Plan,
    mut f: impl FnMut(&RecordingReader<R>, &Event, u64, &[Step], &Replay) -> Result<(), E>,
) -> Result<Replay, E> {
    let header = reader.header().clone();
    let mut replay = Replay::new(&header, plan);
    let mut steps = Vec::new();
    while let Some(event) = reader.next_event() {
        let event = event?;
        steps.clear();
        let ts = replay.push(&event, &mut steps);
        f(reader, &event, ts, &steps, &replay)?;
    }
    Ok(replay)
}

/// Replays every event of `reader` with `plan` when one is known (kept beside
/// the recording), else plans it first as [`replay_recording`] does.
pub(crate) fn replay_with_plan<R: Read + Seek, E: From<RecordError>>(
    reader: &mut RecordingReader<R>,
    plan: Option<Plan>,
    f: impl FnMut(&RecordingReader<R>, &Event, u64, &[Step], &Replay) -> Result<(), E>,
) -> Result<Replay, E> {
    match plan {
        Some(plan) => replay_planned(reader, plan, f),
        None => replay_recording(reader, f),
    }
}

/// The first pass alone: the plan of `reader`'s replay (made before, when it
/// was: see `planned_ahead`). Leaves the reader at the first event again.
pub(crate) fn plan_recording<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
) -> Result<Plan, RecordError> {
    if let Some(known) = super::planned_ahead::known(reader) {
        return Ok(known.plan);
    }
    let header = reader.header().clone();
    let mut planner = Planner::new(&header);
    while let Some(event) = reader.next_event() {
        planner.push(&event?, reader.strings());
    }
    reader.rewind()?;
    Ok(planner.finish())
}

/// Reads every event of `reader` to plan the replay, then goes back to the first
/// event and replays them: `f` gets the reader (for its strings), each event, its
/// thread's monotonic time, the steps it caused and the replay. The replay is
/// returned unfinished: call [`Replay::finish`] with the recording's end.
pub(crate) fn replay_recording<R: Read + Seek, E: From<RecordError>>(
    reader: &mut RecordingReader<R>,
    f: impl FnMut(&RecordingReader<R>, &Event, u64, &[Step], &Replay) -> Result<(), E>,
) -> Result<Replay, E> {
    let plan = plan_recording(reader)?;
    replay_planned(reader, plan, f)
}
