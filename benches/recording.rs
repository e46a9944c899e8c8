//! Recording benchmarks: writing a 1-million-event trace stream to a file and
//! reading it back.
//!
//! `cargo bench --bench recording` runs them. Throughput is in events; the
//! size of the recording (bytes per event) is printed once before the runs.

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use pyprobe_recording::recording::{
    Event, EventKind, FrameRef, RecordingReader, RecordingWriter, StrId,
};

#[path = "common/mod.rs"]
mod common;

use common::Trace;

const EVENTS: usize = 1_000_000;

/// Interns `id`'s string through the writer, as the recorder does per hit: the
/// tracer hands it strings, not ids.
fn reintern(w: &mut RecordingWriter<impl std::io::Write>, strings: &[String], id: StrId) -> StrId {
    w.intern(&strings[id.0 as usize])
}

fn reintern_frame(
    w: &mut RecordingWriter<impl std::io::Write>,
    strings: &[String],
    f: &FrameRef,
) -> FrameRef {
    FrameRef {
        file: reintern(w, strings, f.file),
        function: reintern(w, strings, f.function),
        line: f.line,
    }
}

/// Writes the trace interning every string of every event on the way, which is
/// what `pyprobe record` does: a hash lookup per string, then the encoding.
fn write_interning(path: &Path, trace: &Trace) -> u64 {
    let mut w = RecordingWriter::create(path, &trace.header).unwrap();
    let s = &trace.strings;
    for e in &trace.events {
        let kind = match &e.kind {
            EventKind::Call { frame } => EventKind::Call {
                frame: reintern_frame(&mut w, s, frame),
            },
            EventKind::Return { frame, first_line } => EventKind::Return {
                first_line: *first_line,
                frame: reintern_frame(&mut w, s, frame),
            },
            EventKind::ImportStart { module } => EventKind::ImportStart {
                module: reintern(&mut w, s, *module),
            },
            EventKind::ImportDone { module, found } => EventKind::ImportDone {
                module: reintern(&mut w, s, *module),
                found: *found,
            },
            EventKind::Audit { event } => EventKind::Audit {
                event: reintern(&mut w, s, *event),
            },
            other => other.clone(),
        };
        w.write(&Event {
            tid: e.tid,
            ts_ns: e.ts_ns,
            kind,
        })
        .unwrap();
    }
    w.finish(trace.end_ns).unwrap().bytes
}

fn read_all(path: &Path) -> u64 {
    let mut reader = RecordingReader::open(path).unwrap();
    let mut n = 0u64;
    for e in reader.events() {
        black_box(e.unwrap());
        n += 1;
    }
    n
}

fn bench_recording(c: &mut Criterion) {
    let trace = common::generate(EVENTS);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench-1m.pyprobe");
    let summary = common::write_recording(&path, &trace).unwrap();
    let file_len = std::fs::metadata(&path).unwrap().len();
    // Events chunks are stored compressed where that is smaller.
    assert!(file_len <= summary.bytes, "{file_len} > {}", summary.bytes);
    assert_eq!(read_all(&path), EVENTS as u64);
    let (calls, returns, other) = trace.mix();
    eprintln!(
        "recording: {EVENTS} events ({calls} calls, {returns} returns, {other} other), \
         {} strings, {file_len} bytes, {:.2} bytes/event",
        trace.strings.len(),
        file_len as f64 / EVENTS as f64,
    );

    let mut group = c.benchmark_group("recording_1m_events");
    // An iteration takes 50-500 ms: flat sampling of 10 samples keeps the run
    // near the measurement time instead of ramping iteration counts up.
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.throughput(Throughput::Elements(EVENTS as u64));
    let out = dir.path().join("out.pyprobe");
    // Strings interned once up front: the encoder, the chunking and the file.
    group.bench_function("write", |b| {
        b.iter(|| common::write_recording(&out, &trace).unwrap().bytes)
    });
    // Every event's strings interned through the writer, as the recorder does.
    group.bench_function("write_interning", |b| {
        b.iter(|| write_interning(&out, &trace))
    });
    group.bench_function("read", |b| b.iter(|| read_all(&path)));
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::short_runs();
    targets = bench_recording
}
criterion_main!(benches);
