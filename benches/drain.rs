//! The consumer's drain rate: a ring filled with call and return records, as the
//! trampolines of CPython's function probes write them, drained through the real
//! reader, the records turned into hits as the engine does (`drain_hits`), the
//! hits into events by the recorder's `EventBuilder` (names interned, filters),
//! and written to a recording file by its writer. As in a trace, most records
//! repeat an earlier one's probe, names and line: those are recognised in the
//! ring and written as the event named the first time (`TraceEvent::Repeat`).
//!
//! Beside it, `ring_reader` times the ring's side alone (records copied out, their
//! strings measured, handed on: what frees the ring for the target), and
//! `memcpy_floor` the same bytes moved by `memcpy`.
//!
//! `cargo bench --bench drain` runs it. Throughput is in records; only the drain
//! is timed, not the filling of the ring, and in the draining thread's CPU time
//! (the recording is written by a thread of its own): on a shared machine, time
//! given to other processes does not count.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pyprobe::session::record::EventBuilder;
use pyprobe_cpython::python::probe_catalog::{PythonProbe, PROBES};
use pyprobe_recording::analyze::FileFilter;
use pyprobe_recording::output::file::Existing;
use pyprobe_recording::recording::Header;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::format::*;
use pyprobe_sdt::ring::{KnownRecords, RingReader};
use pyprobe_sdt::tracer::decode::HitBuffers;
use pyprobe_sdt::tracer::ring_engine::records::{drain_hits, RecordSource};
use pyprobe_sdt::tracer::ring_engine::tsc::TscClock;
use pyprobe_sdt::tracer::ring_engine::writers::ThreadNames;
use pyprobe_sdt::tracer::{Probe, TraceEvent};

/// Records per drain run: a full ring of the engine's size.
const RECORDS: u64 = pyprobe_sdt::tracer::ring_engine::CAPACITY;
/// Records taken per drain, as the engine does.
const BATCH: usize = 1024;
/// The `%fs` base of the one writing thread.
const FS_BASE: u64 = 0x7f3a_2c00_0740;
const TID: i32 = 4242;
const FILE: &[u8] = b"/home/user/project/benches/workloads/fib.py";

/// A heap ring, 8-aligned, standing in for the shared mapping.
struct Ring {
    words: Vec<u64>,
}

impl Ring {
    fn new(capacity: u64) -> Ring {
        let len = ring_bytes(capacity, Slots::Records).expect("ring size");
        let mut ring = Ring {
            words: vec![0; len / 8],
        };
        init_ring(ring.bytes(), capacity, Slots::Records).expect("ring header");
        ring
    }

    fn bytes(&mut self) -> &mut [u8] {
        let len = self.words.len() * 8;
        // SAFETY: a u64 buffer viewed as bytes, the same length in bytes.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }

    fn reader(&mut self) -> RingReader {
        let len = self.words.len() * 8;
        // SAFETY: the buffer outlives the reader (both live for the whole bench).
        unsafe { RingReader::new(self.words.as_mut_ptr().cast(), len) }.expect("reader")
    }

    /// Writes the record at `head` as a trampoline does (single producer): probe,
    /// thread, time, three arguments (file, function, line), the two names'
    /// prefixes, `seq` last.
    fn produce(&mut self, head: u64, probe: u32, tsc: u64, function: (u64, &[u8]), line: u64) {
        let bytes = self.bytes();
        let capacity = u64::from_le_bytes(bytes[H_CAPACITY..H_CAPACITY + 8].try_into().unwrap());
        let s = HEADER_SIZE + ((head & (capacity - 1)) as usize) * SLOT_SIZE;
        let slot = &mut bytes[s..s + SLOT_SIZE];
        slot.fill(0);
        slot[S_TSC..S_TSC + 8].copy_from_slice(&tsc.to_le_bytes());
        slot[S_PROBE..S_PROBE + 4].copy_from_slice(&probe.to_le_bytes());
        slot[S_THREAD..S_THREAD + 8].copy_from_slice(&FS_BASE.to_le_bytes());
        slot[S_NARGS] = 3;
        let args = [0x5555_7777_0000u64, function.0, line];
        for (i, a) in args.iter().enumerate() {
            slot[S_ARGS + 8 * i..S_ARGS + 8 * i + 8].copy_from_slice(&a.to_le_bytes());
        }
        for (k, text) in [FILE, function.1].into_iter().enumerate() {
            let (off, _) = string_area(k, 2).expect("string area");
            slot[off..off + text.len()].copy_from_slice(text);
        }
        slot[S_STRING_MASK] = 0b11;
        slot[S_SEQ..S_SEQ + 8].copy_from_slice(&(head + 1).to_le_bytes());
        let head_word = &mut bytes[H_HEAD..H_HEAD + 8];
        head_word.copy_from_slice(&(head + 1).to_le_bytes());
    }
}

/// Fills the ring from `first` on with a fib-like run: calls and returns of
/// `fib`, now and then of two other functions, about 300 TSC ticks apart.
fn fill(ring: &mut Ring, first: u64, tsc: &mut u64) {
    let functions: [(u64, &[u8], u64); 3] = [
        (0x5555_7777_1000, b"fib", 5),
        (0x5555_7777_2000, b"<module>", 1),
        (0x5555_7777_3000, b"helper", 9),
    ];
    for i in 0..RECORDS {
        let (ptr, name, line) = functions[usize::from(i % 97 == 0) + usize::from(i % 89 == 0)];
        *tsc += 300;
        ring.produce(first + i, (i % 2) as u32, *tsc, (ptr, name), line);
    }
}

/// CPU time of the calling thread.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a constant.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn meaning(name: &str) -> &'static PythonProbe {
    PROBES
        .iter()
        .find(|p| p.name == name)
        .expect("catalog probe")
}

fn bench_drain(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let header = Header {
        pid: TID as u32,
        command_line: vec!["python3.9".into(), "fib.py".into()],
        mode: "trace".into(),
        python_version: "3.9.2".into(),
        ..Header::default()
    };
    let mut builder = EventBuilder::new(
        header,
        dir.path().join("drain.pyprobe"),
        Existing::Replace,
        FileFilter::default(),
        None,
    );
    builder.open_as_is();
    let probes: Vec<Probe> = ["function__entry", "function__return"]
        .iter()
        .map(|name| Probe {
            name: (*name).into(),
            semaphore: None,
            sites: Vec::new(),
            string_args: vec![true, true, false],
        })
        .collect();
    let meanings = [meaning("function__entry"), meaning("function__return")];
    let threads: ThreadNames = [(FS_BASE, TID)].into_iter().collect();
    let tsc = TscClock::calibrate();
    let mem = ProcessMemory::new(std::process::id() as i32);
    let mut buffers = HitBuffers::default();
    let mut known = KnownRecords::default();
    let mut ring = Ring::new(RECORDS);
    let mut reader = ring.reader();
    let (mut next, mut clock) = (0u64, 1_000_000u64);

    let mut group = c.benchmark_group("drain");
    group.throughput(Throughput::Elements(RECORDS));
    group.bench_function("call_return_records", |b| {
        b.iter_custom(|runs| {
            let mut spent = Duration::ZERO;
            for _ in 0..runs {
                fill(&mut ring, next, &mut clock);
                next += RECORDS;
                let source = RecordSource {
                    pid: TID,
                    probes: &probes,
                    threads: &threads,
                    mem: &mem,
                    tsc: &tsc,
                };
                let began = thread_cpu_time();
                let mut read = 0;
                while read < RECORDS as usize {
                    let drained = drain_hits(
                        &mut reader,
                        BATCH,
                        &source,
                        &mut buffers,
                        &mut known,
                        |event| match event {
                            TraceEvent::Hit(hit) => {
                                builder.hit(meanings[hit.probe], &hit, &mut |_| 0)
                            }
                            TraceEvent::Repeat {
                                tid, ts_ns, token, ..
                            } => builder.repeat(tid, ts_ns, token),
                            _ => {}
                        },
                    );
                    read += drained.drained.records;
                }
                spent += thread_cpu_time().saturating_sub(began);
                assert_eq!(reader.tail(), next, "every record read");
            }
            spent
        })
    });
    // The ring's side alone: records copied out, their strings measured, handed
    // on as records (what frees the ring for the target), and nothing else.
    group.bench_function("ring_reader", |b| {
        b.iter_custom(|runs| {
            let mut spent = Duration::ZERO;
            for _ in 0..runs {
                fill(&mut ring, next, &mut clock);
                next += RECORDS;
                let began = thread_cpu_time();
                let mut read = 0;
                while read < RECORDS as usize {
                    read += reader
                        .drain(BATCH, |r| {
                            black_box((r.tsc, r.string(1)));
                        })
                        .records;
                }
                spent += thread_cpu_time().saturating_sub(began);
                assert_eq!(reader.tail(), next, "every record read");
            }
            spent
        })
    });
    // The floor: the whole ring's bytes moved by `memcpy`.
    group.bench_function("memcpy_floor", |b| {
        let mut copy = vec![0u64; ring.words.len()];
        b.iter_custom(|runs| {
            let mut spent = Duration::ZERO;
            for _ in 0..runs {
                fill(&mut ring, next, &mut clock);
                let began = thread_cpu_time();
                copy.copy_from_slice(&ring.words);
                black_box(&copy);
                spent += thread_cpu_time().saturating_sub(began);
            }
            spent
        })
    });
    group.finish();
    builder.flush_if_due(u64::MAX);
    black_box(builder.events());
    eprintln!(
        "drain: {} events written, {:.2} bytes per event",
        builder.events(),
        builder.bytes() as f64 / builder.events().max(1) as f64
    );
}

criterion_group!(benches, bench_drain);
criterion_main!(benches);
