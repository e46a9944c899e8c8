//! The per-record half of draining a ring: each record becomes a [`Hit`] of its
//! process, named by its thread and stamped on CLOCK_MONOTONIC. The driver does the
//! per-drain half (lost and counted events, a stuck slot, the budget); the drain
//! benchmark runs this half as the driver does.

use crate::process::memory::ProcessMemory;
use crate::ring::{Drained, Drawn, KnownRecords, RingReader};
use crate::tracer::decode::HitBuffers;
use crate::tracer::engine::{Hit, RepeatSlot, TraceEvent};
use crate::tracer::Probe;

use super::tsc::TscClock;
use super::writers::{ThreadNames, TidSpan};

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
    pub(crate) last_ts_ns: Option<u64>,
    /// Frames of the stacks the records carried.
    pub frames: u64,
    /// Records that carried a stack.
    pub(crate) stacks: u64,
}

/// Reads up to `max` records of `reader` (see [`RingReader::drain_known`]),
/// handing each to `on_record` as a hit (decoded into `buffers`), or as a
/// [`TraceEvent::Repeat`] when `known` keeps a record equal to it. A hit the sink
/// names with a token ([`Hit::repeats_as`]) is kept in `known`. A record of an
/// unknown probe is read and dropped.
pub fn drain_hits(
    reader: &mut RingReader,
    max: usize,
    source: &RecordSource<'_>,
    buffers: &mut HitBuffers,
    known: &mut KnownRecords,
    mut on_record: impl FnMut(TraceEvent<'_>),
) -> DrainedHits {
    let mut last_ts_ns = None;
    let mut frames = 0u64;
    let mut stacks = 0u64;
    let mut span: Option<TidSpan> = None;
    // Ring indices only grow within a drain: the span found last holds while
    // the base is the same and the index below its end.
    let mut tid_of = |thread: u64, index: u64| match span {
        Some(s) if s.base == thread && index < s.until => s.tid,
        _ => {
            span = source.threads.span_of(thread, index);
            span.map_or(source.pid, |s| s.tid)
        }
    };
    let pid_of = |tag: u32| if tag == 0 { source.pid } else { tag as i32 };
    let drained = reader.drain_known(max, known, |drawn| {
        let record = match drawn {
            Drawn::Known(k) => {
                let ts_ns = source.tsc.to_ns(k.tsc);
                last_ts_ns = Some(ts_ns);
                on_record(TraceEvent::Repeat {
                    pid: pid_of(k.tag),
                    tid: tid_of(k.thread, k.index),
                    ts_ns,
                    token: k.token,
                });
                return None;
            }
            Drawn::Record(record) => record,
        };
        if let Some(stack) = &record.stack {
            frames += stack.depth as u64;
            stacks += 1;
        }
        let ts_ns = source.tsc.to_ns(record.tsc);
        last_ts_ns = Some(ts_ns);
        let probe = source.probes.get(record.probe as usize)?;
        let tid = tid_of(record.thread, record.index);
        buffers.fill_from_ring(probe, record, source.mem);
        let slot = RepeatSlot::default();
        on_record(TraceEvent::Hit(Hit {
            pid: pid_of(record.tag),
            tid,
            ts_ns,
            probe: record.probe as usize,
            probe_name: &probe.name,
            args: &buffers.args,
            buffers,
            stack: record.stack.as_ref(),
            stopped: false,
            repeat: KnownRecords::keepable(record).then_some(&slot),
        }));
        slot.kept()
    });
    DrainedHits {
        drained,
        last_ts_ns,
        frames,
        stacks,
    }
}
