//! Places in a recording where its replay can be taken up again, and where each
//! function is entered: kept with a large recording's views, so a view after
//! the calls of one function (`calls --start-at`) reads only the parts of the
//! file that hold them instead of every event.
//!
//! A checkpoint is the replay as it stood at a chunk boundary, serialized
//! without its plan, with the file offset and the number of events before it.
//! The stretch of events between two checkpoints is an *interval*; the index
//! says, for each function, the intervals in which it is entered (a call, a
//! resume, or a frame found running when tracing began). Checkpoints are at
//! least [`EVERY_BYTES`] of the file apart, and further when the replay's state
//! is large (many threads), so that they take at most an eighth of the file.

use std::io::{Read, Seek};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use super::replay::{Plan, Replay, Step};
use crate::recording::{Event, EventKind, FrameRef, RecordError, RecordingReader};

/// Least file bytes between two checkpoints: the writer's chunk, so that a
/// function entered here and there costs a chunk's reading per entry.
const EVERY_BYTES: u64 = 256 << 10;
/// Checkpoints take at most 1/`SPACING` of the file.
const SPACING: u64 = 8;

/// The replay kept at one chunk boundary.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Checkpoint {
    /// File offset of the chunk that follows.
    offset: u64,
    /// Events before it.
    events: u64,
    /// The replay there, without its plan (postcard).
    state: Vec<u8>,
}

/// See the module documentation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Checkpoints {
    /// The replayed time of the recording's first event.
    first_ts: Option<u64>,
    /// Checkpoint `k` starts interval `k + 1`; interval 0 starts at the first event.
    checkpoints: Vec<Checkpoint>,
    /// Per function entered: the intervals holding an entry, as inclusive ranges
    /// in order.
    entries: FxHashMap<FrameRef, Vec<(u32, u32)>>,
}

impl Checkpoints {
    /// Intervals of the recording.
    pub(crate) fn intervals(&self) -> usize {
        self.checkpoints.len() + 1
    }

    /// The replayed time of the recording's first event.
    pub(crate) fn first_ts(&self) -> Option<u64> {
        self.first_ts
    }

    /// Per interval: whether a function `wanted` picks is entered in it.
    pub(crate) fn intervals_entering(
        &self,
        mut wanted: impl FnMut(&FrameRef) -> bool,
    ) -> Vec<bool> {
        let mut out = vec![false; self.intervals()];
        for (frame, ranges) in &self.entries {
            if !wanted(frame) {
                continue;
            }
            for &(first, last) in ranges {
                let last = (last as usize).min(out.len().saturating_sub(1));
                for slot in out.iter_mut().take(last + 1).skip(first as usize) {
                    *slot = true;
                }
            }
        }
        out
    }
}

/// The place after the last event of an events chunk: where a reader can be
/// put to read on ([`RecordingReader::seek_to_chunk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkEnd {
    /// File offset of the next chunk.
    pub(crate) offset: u64,
    /// Events before it.
    pub(crate) events: u64,
}

impl ChunkEnd {
    /// Where `reader` is, if at the end of a chunk.
    pub(crate) fn of<R: Read>(reader: &RecordingReader<R>) -> Option<ChunkEnd> {
        reader.at_chunk_end().then(|| ChunkEnd {
            offset: reader.bytes_read(),
            events: reader.events_read(),
        })
    }
}

/// Builds [`Checkpoints`] as the replay goes, one event at a time.
#[derive(Debug)]
pub(crate) struct CheckpointBuilder {
    /// Least file bytes between two checkpoints.
    every: u64,
    built: Checkpoints,
    /// Where the last checkpoint (or the first event) is.
    last_offset: Option<u64>,
    /// Bytes the last checkpoint's state took.
    last_state: u64,
}

impl Default for CheckpointBuilder {
    fn default() -> Self {
        Self::every(EVERY_BYTES)
    }
}

impl CheckpointBuilder {
    /// Checkpoints at least `every` file bytes apart (and [`SPACING`] times
    /// their size).
    pub(crate) fn every(every: u64) -> Self {
        CheckpointBuilder {
            every,
            built: Checkpoints::default(),
            last_offset: None,
            last_state: 0,
        }
    }

    /// Notes `event`, just replayed into `replay` with `steps`; `chunk_end`: the
    /// place after it, when it was the last of its chunk.
    pub(crate) fn push(
        &mut self,
        chunk_end: Option<ChunkEnd>,
        event: &Event,
        ts: u64,
        steps: &[Step],
        replay: &Replay,
    ) {
        self.built.first_ts.get_or_insert(ts);
        let interval = self.built.checkpoints.len() as u32;
        for frame in entered(event, steps) {
            self.entered(frame, interval);
        }
        let last = *self.last_offset.get_or_insert(0);
        let gap = self.every.max(self.last_state.saturating_mul(SPACING));
        let Some(end) = chunk_end else { return };
        if end.offset >= last.saturating_add(gap) {
            // A state that cannot be encoded is not kept: the intervals merge.
            if let Ok(state) = postcard::to_stdvec(replay) {
                self.last_state = state.len() as u64;
                self.last_offset = Some(end.offset);
                self.built.checkpoints.push(Checkpoint {
                    offset: end.offset,
                    events: end.events,
                    state,
                });
            }
        }
    }

    fn entered(&mut self, frame: FrameRef, interval: u32) {
        let ranges = self.built.entries.entry(frame).or_default();
        match ranges.last_mut() {
            Some((_, last)) if *last >= interval => {}
            Some((_, last)) if *last + 1 == interval => *last = interval,
            _ => ranges.push((interval, interval)),
        }
    }

    pub(crate) fn finish(self) -> Checkpoints {
        self.built
    }
}

/// The functions `event` enters: its own (a call or resume), and those of the
/// frames found running when tracing began, seeded before it (`steps`).
pub(crate) fn entered<'a>(
    event: &'a Event,
    steps: &'a [Step],
) -> impl Iterator<Item = FrameRef> + 'a {
    let own = match event.kind {
        EventKind::Call { frame } | EventKind::Resume { frame } => Some(frame),
        _ => None,
    };
    let seeded = steps.iter().filter_map(|s| match *s {
        Step::Enter {
            code, seeded: true, ..
        } => Some(code),
        _ => None,
    });
    own.into_iter().chain(seeded)
}

/// Replays the events of `reader` (at its first event, the recording's names
/// known: [`RecordingReader::know_names`]) with `plan`, reading only the
/// intervals that `wanted` marks (see [`Checkpoints::intervals_entering`]) and
/// those `f` asks for. `f` gets what [`super::recording::replay_planned`]'s
/// does, and says whether something it follows is still open: at an interval's
/// end, while it is, the next interval is read too; else the reader goes on at
/// the next wanted interval's checkpoint, or stops if there is none.
pub(crate) fn replay_wanted<R: Read + Seek, E: From<RecordError>>(
    reader: &mut RecordingReader<R>,
    plan: Plan,
    checkpoints: &Checkpoints,
    wanted: &[bool],
    mut f: impl FnMut(&RecordingReader<R>, &Event, u64, &[Step], &Replay) -> Result<bool, E>,
) -> Result<(), E> {
    let header = reader.header().clone();
    let mut replay = Replay::new(&header, plan);
    let kept = &checkpoints.checkpoints;
    let mut interval = 0usize;
    if !wanted.first().copied().unwrap_or(false) {
        match go_to_next_wanted(reader, &mut replay, checkpoints, wanted, 0)? {
            Some(next) => interval = next,
            None => return Ok(()),
        }
    }
    let mut steps = Vec::new();
    while let Some(event) = reader.next_event() {
        let event = event?;
        steps.clear();
        let ts = replay.push(&event, &mut steps);
        let busy = f(reader, &event, ts, &steps, &replay)?;
        let boundary = kept
            .get(interval)
            .is_some_and(|c| reader.at_chunk_end() && reader.bytes_read() == c.offset);
        if !boundary {
            continue;
        }
        interval += 1;
        if wanted.get(interval).copied().unwrap_or(false) || busy {
            continue;
        }
        match go_to_next_wanted(reader, &mut replay, checkpoints, wanted, interval)? {
            Some(next) => interval = next,
            None => break,
        }
    }
    Ok(())
}

/// Puts `reader` and `replay` at the start of the first wanted interval after
/// `interval` (never 0: it has no checkpoint), and returns it; `None` if no
/// interval after it is wanted.
fn go_to_next_wanted<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    replay: &mut Replay,
    checkpoints: &Checkpoints,
    wanted: &[bool],
    interval: usize,
) -> Result<Option<usize>, RecordError> {
    let Some(next) = (interval + 1..wanted.len()).find(|&i| wanted[i]) else {
        return Ok(None);
    };
    let Some(checkpoint) = checkpoints.checkpoints.get(next - 1) else {
        return Ok(None);
    };
    take_up(reader, replay, checkpoint)?;
    Ok(Some(next))
}

/// Puts `reader` and `replay` where `checkpoint` was kept.
fn take_up<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    replay: &mut Replay,
    checkpoint: &Checkpoint,
) -> Result<(), RecordError> {
    let kept: Replay =
        postcard::from_bytes(&checkpoint.state).map_err(|e| RecordError::Corrupt {
            offset: checkpoint.offset,
            what: format!("the replay kept for this place in the views file is unreadable: {e}"),
        })?;
    replay.take_up(kept);
    reader.seek_to_chunk(checkpoint.offset, checkpoint.events)
}
