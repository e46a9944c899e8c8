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
pub mod speedscope_stacks;
pub mod terminal;
pub mod top;
pub(crate) mod units;

use std::io::{Read, Seek};

use rustc_hash::FxHashMap;

use crate::analyze::{Plan, Planner, SliceFilter};
use crate::recording::{Event, EventKind, RecordError, RecordingReader, StrId};

/// A recording's first pass done before: the replay's plan and the census of
/// every call (no filter), as its views file keeps them.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Planned {
    pub plan: Plan,
    pub census: Census,
}

/// What a recording holds, counted while its replay is planned, with the trace
/// exports' filter applied: enough to estimate an export's size before a byte of
/// it is written, and to choose the shortest call it keeps so that it fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    /// The calls the file filter keeps, by duration: bucket `b` holds those of
    /// 2^b ns up to 2^(b+1) (the last also the calls never seen to end), as
    /// (calls, bytes of their names).
    #[serde(with = "duration_buckets")]
    pub(crate) durations: [(u64, u64); DURATION_BUCKETS],
}

/// The census's buckets stored as a list (serde stores arrays of up to 32).
mod duration_buckets {
    use super::DURATION_BUCKETS;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(
        buckets: &[(u64, u64); DURATION_BUCKETS],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        buckets.to_vec().serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<[(u64, u64); DURATION_BUCKETS], D::Error> {
        let list = Vec::<(u64, u64)>::deserialize(d)?;
        let n = list.len();
        list.try_into().map_err(|_| {
            serde::de::Error::custom(format!("a census has {DURATION_BUCKETS} buckets, not {n}"))
        })
    }
}

const DURATION_BUCKETS: usize = 64;

impl Default for Census {
    fn default() -> Self {
        Census {
            events: 0,
            calls: 0,
            call_name_bytes: 0,
            samples: 0,
            sample_frames: 0,
            others: 0,
            durations: [(0, 0); DURATION_BUCKETS],
        }
    }
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

/// The trace exports whose size follows the calls they keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceExport {
    Chrome,
    Speedscope,
}

impl Census {
    /// About how large the Chrome trace of the recording is: a slice per call
    /// kept, at most one per sample (a sampled slice ends when its frame leaves
    /// the sampled stack), one per GC pause, import or instant.
    pub fn chrome_bytes(&self) -> u64 {
        self.bytes(TraceExport::Chrome, self.calls, self.call_name_bytes)
    }

    /// About how large the speedscope file is: an open and a close event per call
    /// kept, and each sample's frame indices.
    pub fn speedscope_bytes(&self) -> u64 {
        self.bytes(TraceExport::Speedscope, self.calls, self.call_name_bytes)
    }

    /// About how large `export` is with `calls` calls whose names take
    /// `name_bytes`.
    fn bytes(&self, export: TraceExport, calls: u64, name_bytes: u64) -> u64 {
        match export {
            TraceExport::Chrome => {
                calls * CHROME_SLICE_BYTES
                    + name_bytes
                    + self.samples * (CHROME_SLICE_BYTES + CHROME_SAMPLED_NAME_BYTES)
                    + self.others * CHROME_SLICE_BYTES
            }
            TraceExport::Speedscope => {
                calls * 2 * SPEEDSCOPE_EVENT_BYTES
                    + self.samples * SPEEDSCOPE_SAMPLE_BYTES
                    + self.sample_frames * SPEEDSCOPE_FRAME_BYTES
            }
        }
    }

    /// The calls of `min_ns` or longer (the file filter applied), and the bytes
    /// of their names: counted by whole buckets, so exact at a power of two.
    fn calls_from(&self, min_ns: u64) -> (u64, u64) {
        let first = if min_ns == 0 {
            0
        } else {
            (63 - min_ns.leading_zeros()) as usize
        };
        self.durations[first..]
            .iter()
            .fold((0, 0), |(c, b), &(n, bytes)| (c + n, b + bytes))
    }

    /// The shortest call `export` should keep to stay within `max_bytes` (a
    /// power of two of nanoseconds), with the calls and bytes that leaves; `None`
    /// when every call fits, or when no cut makes it fit (samples and other
    /// events alone are larger).
    pub fn min_duration_within(
        &self,
        export: TraceExport,
        max_bytes: u64,
    ) -> Option<(u64, u64, u64)> {
        let (all, all_names) = self.calls_from(0);
        if self.bytes(export, all, all_names) <= max_bytes {
            return None;
        }
        (1..DURATION_BUCKETS as u32).find_map(|b| {
            let min = 1u64 << b;
            let (calls, names) = self.calls_from(min);
            let bytes = self.bytes(export, calls, names);
            (bytes <= max_bytes && calls > 0).then_some((min, calls, bytes))
        })
    }
}

/// Counts a recording for its [`Census`]. Calls are paired with returns per
/// thread (by function) to know their durations.
struct Counter<'a> {
    filter: &'a SliceFilter,
    census: Census,
    /// Whether each file passes the filter, by string id.
    files: FxHashMap<StrId, bool>,
    /// Per thread: the open calls (function, entry time, name bytes if kept).
    open: FxHashMap<u32, Vec<(StrId, u64, Option<u64>)>>,
}

impl<'a> Counter<'a> {
    fn new(filter: &'a SliceFilter) -> Self {
        Counter {
            filter,
            census: Census::default(),
            files: FxHashMap::default(),
            open: FxHashMap::default(),
        }
    }

    /// A call the file filter kept, `ns` long (`None`: never seen to end).
    fn kept_call(&mut self, ns: Option<u64>, name_bytes: u64) {
        count_kept_call(&mut self.census, self.filter, ns, name_bytes);
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
                let stack = self.open.entry(event.tid).or_default();
                if stack.len() < crate::analyze::MAX_DEPTH {
                    stack.push((frame.function, event.ts_ns, names));
                } else if let Some(bytes) = names {
                    self.kept_call(None, bytes);
                }
            }
            EventKind::Return { frame, .. } => {
                let Some(stack) = self.open.get_mut(&event.tid) else {
                    return;
                };
                let Some(i) = stack.iter().rposition(|(f, ..)| *f == frame.function) else {
                    return;
                };
                // Frames above it never returned: they end with it.
                for (_, start, names) in stack.drain(i..) {
                    if let Some(bytes) = names {
                        let ns = Some(event.ts_ns.saturating_sub(start));
                        count_kept_call(&mut self.census, self.filter, ns, bytes);
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
        let open: Vec<u64> = self
            .open
            .values()
            .flatten()
            .filter_map(|&(_, _, names)| names)
            .collect();
        for bytes in open {
            self.kept_call(None, bytes);
        }
        self.census
    }
}

/// Counts into `census` a call `filter`'s files kept, `ns` long (`None`: never
/// seen to end), its names `name_bytes` long.
fn count_kept_call(census: &mut Census, filter: &SliceFilter, ns: Option<u64>, name_bytes: u64) {
    let bucket = match ns {
        Some(0) => 0,
        Some(ns) => (63 - ns.leading_zeros()) as usize,
        None => DURATION_BUCKETS - 1,
    };
    let d = &mut census.durations[bucket];
    d.0 += 1;
    d.1 += name_bytes;
    if ns.is_none_or(|ns| filter.long_enough(ns)) {
        census.calls += 1;
        census.call_name_bytes += name_bytes;
    }
}

/// The first pass over `reader` for an export under `filter`: `planned` when
/// it was done before and the filter keeps every call, else done now.
pub(crate) fn plan_export<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: &SliceFilter,
    planned: Option<&Planned>,
) -> Result<(Plan, Census), RecordError> {
    match planned {
        Some(p) if filter.is_empty() => Ok((p.plan.clone(), p.census)),
        _ => plan_recording(reader, filter),
    }
}

/// The first pass over `reader`: the replay's plan, and the recording's
/// [`Census`] under `filter`. Leaves the reader at the first event again.
pub(crate) fn plan_recording<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: &SliceFilter,
) -> Result<(Plan, Census), RecordError> {
    plan_recording_reporting(reader, filter, &mut |_| {})
}

/// Events between two calls of a pass's progress callback.
pub(crate) const PROGRESS_EVENTS: u64 = 1 << 20;

/// As [`plan_recording`], calling `progress` with the bytes read now and then.
pub(crate) fn plan_recording_reporting<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: &SliceFilter,
    progress: &mut dyn FnMut(u64),
) -> Result<(Plan, Census), RecordError> {
    let header = reader.header().clone();
    let mut planner = Planner::new(&header);
    let mut counter = Counter::new(filter);
    let mut events = 0u64;
    while let Some(event) = reader.next_event() {
        let event = event?;
        planner.push(&event, reader.strings());
        counter.push(&event, reader.strings());
        events += 1;
        if events % PROGRESS_EVENTS == 0 {
            progress(reader.bytes_read());
        }
    }
    reader.rewind()?;
    Ok((planner.finish(), counter.finish()))
}

#[cfg(test)]
mod census_tests {
    use super::*;

    #[test]
    fn the_cut_is_the_shortest_power_of_two_that_fits() {
        let mut census = Census::default();
        // 1,000 calls of about 1 µs (bucket 9: 512 to 1023 ns), 10 of 1 ms, 1 open.
        census.durations[9] = (1000, 10_000);
        census.durations[19] = (10, 100);
        census.durations[63] = (1, 10);
        census.calls = 1011;
        census.call_name_bytes = 10_110;
        let all = census.chrome_bytes();
        assert_eq!(all, 1011 * CHROME_SLICE_BYTES + 10_110);
        assert_eq!(census.min_duration_within(TraceExport::Chrome, all), None);
        // Room for the 11 long ones only: cut at 2^10 ns, the first bucket past 9.
        let room = 11 * CHROME_SLICE_BYTES + 110;
        assert_eq!(
            census.min_duration_within(TraceExport::Chrome, room),
            Some((1 << 10, 11, room))
        );
        // Room for the open call alone: cut past the 1 ms calls.
        let (min, calls, _) = census
            .min_duration_within(TraceExport::Chrome, CHROME_SLICE_BYTES + 10)
            .unwrap();
        assert_eq!((min, calls), (1 << 20, 1));
        // Samples alone larger than the room: no cut helps.
        census.samples = 1000;
        assert_eq!(census.min_duration_within(TraceExport::Chrome, room), None);
    }
}
