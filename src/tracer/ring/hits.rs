//! The per-record half of draining a ring: each record becomes a [`Hit`] of its
//! process, named by its thread and stamped on CLOCK_MONOTONIC. The driver does the
//! per-drain half (lost and counted events, a stuck slot, the budget); the drain
//! benchmark runs this half as the driver does.

use crate::process::memory::ProcessMemory;
use crate::ring::{Drained, RingReader};
use crate::tracer::decode::HitBuffers;
use crate::tracer::engine::Hit;
use crate::tracer::Probe;

use super::threads::{ThreadNames, TidSpan};
use super::tsc::TscClock;

/// What a ring's records are read against: the process that writes it.
pub struct RecordSource<'a> {
    pub pid: i32,
    /// The process's probes, by the id records carry.
    pub probes: &'a [Probe],
    pub threads: &'a ThreadNames,
    /// Where a string longer than its record's prefix is read in full.
    pub mem: &'a ProcessMemory,
    pub tsc: &'a TscClock,
}

/// What one drain read besides its hits.
#[derive(Debug, Clone, Copy)]
pub struct DrainedHits {
    pub drained: Drained,
    /// The time of the last record read.
    pub last_ts_ns: Option<u64>,
    /// Frames of the stacks the records carried.
    pub frames: u64,
}

/// Reads up to `max` records of `reader` (see [`RingReader::drain`]), handing each
/// to `on_hit` as a hit (decoded into `buffers`). A record of an unknown probe is
/// read and dropped.
pub fn drain_hits(
    reader: &mut RingReader,
    max: usize,
    source: &RecordSource<'_>,
    buffers: &mut HitBuffers,
    mut on_hit: impl FnMut(Hit<'_>),
) -> DrainedHits {
    let mut last_ts_ns = None;
    let mut frames = 0u64;
    let mut span: Option<TidSpan> = None;
    let drained = reader.drain(max, |record| {
        if let Some(stack) = &record.stack {
            frames += stack.depth as u64;
        }
        let ts_ns = source.tsc.to_ns(record.tsc);
        last_ts_ns = Some(ts_ns);
        let Some(probe) = source.probes.get(record.probe as usize) else {
            return;
        };
        // Ring indices only grow within a drain: the span found last holds
        // while the base is the same and the index below its end.
        let tid = match span {
            Some(s) if s.base == record.thread && record.index < s.until => s.tid,
            _ => {
                span = source.threads.span_of(record.thread, record.index);
                span.map_or(source.pid, |s| s.tid)
            }
        };
        buffers.fill_from_ring(probe, record, source.mem);
        on_hit(Hit {
            pid: if record.tag == 0 {
                source.pid
            } else {
                record.tag as i32
            },
            tid,
            ts_ns,
            probe: record.probe as usize,
            probe_name: &probe.name,
            args: &buffers.args,
            buffers,
            stack: record.stack.as_ref(),
            stopped: false,
        });
    });
    DrainedHits {
        drained,
        last_ts_ns,
        frames,
    }
}
