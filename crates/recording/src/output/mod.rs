//! Views of a recording: each reads only the event model and the analysis.
//! [`file`] is how every output named by the user is written.

pub mod calls;
pub mod chrome;
pub mod file;
pub mod flame;
pub mod html;
pub mod names;
pub mod pprof;
pub mod probes;
pub mod pstats;
pub mod report;
pub mod speedscope;
pub mod terminal;
pub mod top;
pub(crate) mod units;

use std::collections::HashMap;
use std::io::{Read, Seek};

use crate::analyze::{Plan, Planner, SliceFilter};
use crate::recording::{Event, EventKind, RecordError, RecordingReader, StrId};

/// What a recording holds, counted while its replay is planned, with the trace
/// exports' filter applied: enough to estimate an export's size before a byte of
/// it is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Census {
    /// Every event of the recording.
    pub events: u64,
    /// Calls the filter keeps: a slice each in a Chrome trace, an open and a
    /// close event in speedscope.
    pub calls: u64,
    /// Bytes of the names of those calls (function and file).
    pub(crate) call_name_bytes: u64,
    /// Stack samples, and the frames they hold together.
    pub samples: u64,
    pub(crate) sample_frames: u64,
    /// GC, import, audit, lost-event and window events.
    pub(crate) others: u64,
}

/// Bytes of a Chrome trace slice besides its names (JSON keys, times, ids).
const CHROME_SLICE_BYTES: u64 = 150;
/// Bytes of the names of a sampled slice, on average.
const CHROME_SAMPLED_NAME_BYTES: u64 = 60;
/// Bytes of a speedscope open or close event.
const SPEEDSCOPE_EVENT_BYTES: u64 = 40;
/// Bytes per frame of a speedscope sample (an index and a comma), and per sample.
const SPEEDSCOPE_FRAME_BYTES: u64 = 5;
const SPEEDSCOPE_SAMPLE_BYTES: u64 = 16;

impl Census {
    /// About how large the Chrome trace of the recording is: a slice per call
    /// kept, at most one per sample (a sampled slice ends when its frame leaves
    /// the sampled stack), one per GC pause, import or instant.
    pub fn chrome_bytes(&self) -> u64 {
        self.calls * CHROME_SLICE_BYTES
            + self.call_name_bytes
            + self.samples * (CHROME_SLICE_BYTES + CHROME_SAMPLED_NAME_BYTES)
            + self.others * CHROME_SLICE_BYTES
    }

    /// About how large the speedscope file is: an open and a close event per call
    /// kept, and each sample's frame indices.
    pub fn speedscope_bytes(&self) -> u64 {
        self.calls * 2 * SPEEDSCOPE_EVENT_BYTES
            + self.samples * SPEEDSCOPE_SAMPLE_BYTES
            + self.sample_frames * SPEEDSCOPE_FRAME_BYTES
    }
}

/// Counts a recording for its [`Census`]. Calls are paired with returns per
/// thread (by function) only when a minimum duration is asked for.
struct Counter<'a> {
    filter: &'a SliceFilter,
    census: Census,
    /// Whether each file passes the filter, by string id.
    files: HashMap<StrId, bool>,
    /// Per thread: the open calls (function, entry time, name bytes if kept).
    open: HashMap<u32, Vec<(StrId, u64, Option<u64>)>>,
}

impl<'a> Counter<'a> {
    fn new(filter: &'a SliceFilter) -> Self {
        Counter {
            filter,
            census: Census::default(),
            files: HashMap::new(),
            open: HashMap::new(),
        }
    }

    fn push(&mut self, event: &Event, strings: &[String]) {
        self.census.events += 1;
        let len = |id: StrId| strings.get(id.0 as usize).map_or(0, |s| s.len() as u64);
        match &event.kind {
            EventKind::Call { frame } | EventKind::Resume { frame } => {
                let filter = self.filter;
                let kept = *self.files.entry(frame.file).or_insert_with(|| {
                    let file = strings
                        .get(frame.file.0 as usize)
                        .map_or("", String::as_str);
                    filter.files.matches(file)
                });
                let names = kept.then(|| 2 * len(frame.function) + 2 * len(frame.file));
                if self.filter.min_duration_ns == 0 {
                    if let Some(bytes) = names {
                        self.census.calls += 1;
                        self.census.call_name_bytes += bytes;
                    }
                } else {
                    let stack = self.open.entry(event.tid).or_default();
                    if stack.len() < crate::analyze::MAX_DEPTH {
                        stack.push((frame.function, event.ts_ns, names));
                    }
                }
            }
            EventKind::Return { frame, .. } if self.filter.min_duration_ns > 0 => {
                let Some(stack) = self.open.get_mut(&event.tid) else {
                    return;
                };
                let Some(i) = stack.iter().rposition(|(f, ..)| *f == frame.function) else {
                    return;
                };
                let ended = stack.drain(i..).next();
                if let Some((_, start, Some(bytes))) = ended {
                    if self.filter.long_enough(event.ts_ns.saturating_sub(start)) {
                        self.census.calls += 1;
                        self.census.call_name_bytes += bytes;
                    }
                }
            }
            EventKind::Sample { frames, .. } => {
                self.census.samples += 1;
                self.census.sample_frames += frames.len() as u64;
            }
            EventKind::GcStart { .. }
            | EventKind::ImportStart { .. }
            | EventKind::Audit { .. }
            | EventKind::Lost { .. }
            | EventKind::Window { .. } => self.census.others += 1,
            _ => {}
        }
    }

    /// Calls still open at the end last until then: counted.
    fn finish(mut self) -> Census {
        for stack in self.open.values() {
            for (_, _, names) in stack {
                if let Some(bytes) = names {
                    self.census.calls += 1;
                    self.census.call_name_bytes += bytes;
                }
            }
        }
        self.census
    }
}

/// The first pass over `reader`: the replay's plan, and the recording's
/// [`Census`] under `filter`. Leaves the reader at the first event again.
pub(crate) fn plan_recording<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: &SliceFilter,
) -> Result<(Plan, Census), RecordError> {
    let header = reader.header().clone();
    let mut planner = Planner::new(&header);
    let mut counter = Counter::new(filter);
    while let Some(event) = reader.next_event() {
        let event = event?;
        planner.push(&event, reader.strings());
        counter.push(&event, reader.strings());
    }
    reader.rewind()?;
    Ok((planner.finish(), counter.finish()))
}
