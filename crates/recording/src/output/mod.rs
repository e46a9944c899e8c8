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

use crate::analyze::first_pass::DURATION_BUCKETS;
pub(crate) use crate::analyze::first_pass::{plan_recording_reporting, PROGRESS_EVENTS};
pub use crate::analyze::first_pass::{Census, Planned};
use crate::analyze::{Plan, SliceFilter};
use crate::recording::{RecordError, RecordingReader};

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
