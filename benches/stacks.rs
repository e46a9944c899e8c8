//! Stack rebuilding and aggregation benchmarks over a generated 1-million-event
//! trace recording.
//!
//! The recording is written and read back once; the benches then run the pure
//! analysis over the decoded events in memory, so reading (measured by the
//! `recording` bench) is not counted again. `cargo bench --bench stacks` runs
//! them. Throughput is in events.

use std::hint::black_box;
use std::io;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use pyprobe_recording::analyze::folded::{fold_events, Measure};
use pyprobe_recording::analyze::{plan_events, Aggregator, Replay};
use pyprobe_recording::output::flame::{write_collapsed, FrameNames};
use pyprobe_recording::recording::{Completion, Event, Header, RecordingReader};

#[path = "common/mod.rs"]
mod common;

const EVENTS: usize = 1_000_000;

/// What the analysis needs from a recording.
struct Loaded {
    header: Header,
    strings: Vec<String>,
    events: Vec<Event>,
    end_ns: Option<u64>,
}

fn load() -> Loaded {
    let trace = common::generate(EVENTS);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench-1m.pyprobe");
    common::write_recording(&path, &trace).unwrap();
    let mut reader = RecordingReader::open(&path).unwrap();
    let events: Vec<Event> = reader.events().map(Result::unwrap).collect();
    assert!(
        events == trace.events,
        "the recording reads back as written"
    );
    let end_ns = match reader.completion() {
        Completion::Complete(t) => Some(t.end_ns),
        _ => None,
    };
    Loaded {
        header: reader.header().clone(),
        strings: reader.strings().to_vec(),
        events,
        end_ns,
    }
}

/// Only the replay (plan and per-thread stacks), which both views below run inside.
fn rebuild_stacks(l: &Loaded) -> usize {
    let plan = plan_events(&l.header, &l.strings, &l.events);
    let mut replay = Replay::new(&l.header, plan);
    let mut steps = Vec::new();
    let mut total = 0;
    for e in &l.events {
        steps.clear();
        replay.push(e, &mut steps);
        total += steps.len();
    }
    steps.clear();
    let end = l.events.last().map_or(0, |e| e.ts_ns);
    replay.finish(end, &mut steps);
    total + steps.len()
}

/// The data behind `pyprobe report` (functions table, GC, imports, threads).
fn aggregate(l: &Loaded) -> usize {
    let plan = plan_events(&l.header, &l.strings, &l.events);
    let mut replay = Replay::new(&l.header, plan);
    let mut agg = Aggregator::new(&l.header);
    let mut steps = Vec::new();
    for e in &l.events {
        steps.clear();
        let ts = replay.push(e, &mut steps);
        agg.push(e, ts, &steps, &replay);
    }
    let report = agg.finish(replay, l.end_ns, |id| l.strings[id.0 as usize].clone());
    report.functions.len()
}

/// Folded stacks: the tree behind `pyprobe flame` and `pyprobe folded`.
fn fold(l: &Loaded) -> usize {
    fold_events(&l.header, &l.strings, &l.events, l.end_ns)
        .tree
        .len()
}

/// Folded stacks written out as collapsed `a;b;c 123` lines.
fn fold_collapsed(l: &Loaded) -> usize {
    let folded = fold_events(&l.header, &l.strings, &l.events, l.end_ns);
    let names = FrameNames::new(&l.strings, false);
    write_collapsed(&folded, Measure::Time, &names, io::sink()).unwrap();
    folded.tree.len()
}

fn bench_stacks(c: &mut Criterion) {
    let loaded = load();
    let functions = aggregate(&loaded);
    let stacks = fold(&loaded);
    eprintln!(
        "stacks: {} events, {functions} functions in the report, {stacks} distinct stacks",
        loaded.events.len()
    );

    let mut group = c.benchmark_group("stacks_1m_events");
    // An iteration takes 50-500 ms: flat sampling of 10 samples keeps the run
    // near the measurement time instead of ramping iteration counts up.
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.throughput(Throughput::Elements(loaded.events.len() as u64));
    group.bench_function("rebuild_stacks", |b| {
        b.iter(|| rebuild_stacks(black_box(&loaded)))
    });
    group.bench_function("report_aggregate", |b| {
        b.iter(|| aggregate(black_box(&loaded)))
    });
    group.bench_function("fold", |b| b.iter(|| fold(black_box(&loaded))));
    group.bench_function("fold_collapsed", |b| {
        b.iter(|| fold_collapsed(black_box(&loaded)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::short_runs();
    targets = bench_stacks
}
criterion_main!(benches);
