//! Rendering benchmarks: a flame graph SVG, folded stacks and the report from a
//! generated 1-million-event trace recording.
//!
//! `cargo bench --bench render` runs them. To make a bigger recording for a
//! one-off measurement (time and peak memory of `pyprobe flame`):
//!
//! ```sh
//! PYPROBE_BENCH_GENERATE=/tmp/big.pyprobe:10000000 cargo bench --bench render
//! /usr/bin/time -v target/release/pyprobe flame /tmp/big.pyprobe -o /tmp/big.svg
//! ```

use std::io::{self, BufWriter};
use std::path::Path;

use criterion::{criterion_group, Criterion, Throughput};
use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::output::flame::{
    choose_measure, read_folded, read_folded_by_thread, write_svg, By, FrameGrain, FrameNames,
    SvgOptions,
};
use pyprobe_recording::output::html::{write_html, HtmlPage};
use pyprobe_recording::output::report::{build_report, render_json, render_table};
use pyprobe_recording::recording::{
    Event, EventKind, FrameRef, Header, RecordingReader, RecordingWriter,
};

/// Functions of the synthetic program, spread over a few files.
const FUNCTIONS: u32 = 300;
/// Calls nest at most this deep (besides the recursive tower).
const MAX_DEPTH: usize = 10;

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Writes a trace-mode recording of about `events` events: two threads walking
/// a fixed call graph (each function calls one of three others), a recursive
/// function now and then, GC pauses, imports and audit events. Its distinct
/// stacks are bounded by the call graph, as in a real program.
pub fn generate(path: &Path, events: u64) -> io::Result<()> {
    let start = 1_000_000_000u64;
    let header = Header {
        pid: 4242,
        command_line: vec!["python3".into(), "bench_app.py".into()],
        executable: "/usr/bin/python3.11".into(),
        python_version: "3.11.2".into(),
        mode: "trace".into(),
        start_ns: start,
        probes: vec!["function".into(), "gc".into(), "import".into()],
        ..Header::default()
    };
    let mut w = RecordingWriter::create(path, &header)?;
    let frames: Vec<FrameRef> = (0..FUNCTIONS)
        .map(|i| FrameRef {
            file: w.intern(&format!("/srv/app/pkg{}/module_{}.py", i % 4, i % 23)),
            function: w.intern(&format!("function_{i}")),
            line: 10 + i * 7,
        })
        .collect();
    let fib = FrameRef {
        file: w.intern("/srv/app/pkg0/maths.py"),
        function: w.intern("fib"),
        line: 3,
    };
    let module = w.intern("json");
    let audit = w.intern("open");
    let children = |f: u32, k: u64| -> u32 {
        let k = k as u32;
        (f.wrapping_mul(7 + 6 * k) + 1 + k) % FUNCTIONS
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut ts = start;
    let mut stacks: [Vec<FrameRef>; 2] = [Vec::new(), Vec::new()];
    let tids = [4242u32, 4243];
    let emit = |w: &mut RecordingWriter<_>, tid: u32, ts: u64, kind: EventKind| {
        w.write(&Event {
            tid,
            ts_ns: ts,
            kind,
        })
    };
    while w.summary().events < events {
        let t = rng.below(2) as usize;
        let tid = tids[t];
        ts += 50 + rng.below(450);
        let stack = &mut stacks[t];
        let roll = rng.below(10_000);
        if roll < 2 {
            emit(
                &mut w,
                tid,
                ts,
                EventKind::GcStart {
                    generation: (roll % 3) as i32,
                },
            )?;
            ts += 20_000 + rng.below(200_000);
            emit(&mut w, tid, ts, EventKind::GcDone { collected: 17 })?;
        } else if roll < 3 {
            emit(&mut w, tid, ts, EventKind::ImportStart { module })?;
            ts += 100_000;
            emit(
                &mut w,
                tid,
                ts,
                EventKind::ImportDone {
                    module,
                    found: true,
                },
            )?;
        } else if roll < 5 {
            emit(&mut w, tid, ts, EventKind::Audit { event: audit })?;
        } else if roll < 15 && stack.len() < MAX_DEPTH {
            // A recursive tower, called and unwound at once.
            let depth = 5 + rng.below(20);
            for _ in 0..depth {
                emit(&mut w, tid, ts, EventKind::Call { frame: fib })?;
                ts += 40;
            }
            for _ in 0..depth {
                emit(
                    &mut w,
                    tid,
                    ts,
                    EventKind::Return {
                        frame: fib,
                        first_line: 0,
                    },
                )?;
                ts += 40;
            }
        } else if stack.is_empty() || (stack.len() < MAX_DEPTH && rng.below(2) == 0) {
            let frame = match stack.last() {
                None => frames[rng.below(3) as usize],
                Some(top) => {
                    let parent = frames
                        .iter()
                        .position(|f| f.function == top.function)
                        .unwrap_or(0) as u32;
                    frames[children(parent, rng.below(3)) as usize]
                }
            };
            stack.push(frame);
            emit(&mut w, tid, ts, EventKind::Call { frame })?;
        } else if let Some(frame) = stack.pop() {
            let ret = FrameRef {
                line: frame.line + 1 + (rng.below(5) as u32),
                ..frame
            };
            emit(
                &mut w,
                tid,
                ts,
                EventKind::Return {
                    frame: ret,
                    first_line: 0,
                },
            )?;
        }
    }
    w.finish(ts + 1)?;
    Ok(())
}

fn render_svg(path: &Path) {
    let mut reader = RecordingReader::open(path).unwrap();
    let (folded, info) = read_folded(&mut reader).unwrap();
    let (measure, _) = choose_measure(&folded, &info.header, By::Time);
    let names = FrameNames::new(reader.strings(), false);
    write_svg(
        &folded,
        &info,
        measure,
        &names,
        &SvgOptions { title: None },
        BufWriter::new(io::sink()),
    )
    .unwrap();
}

fn render_report(path: &Path) {
    let mut reader = RecordingReader::open(path).unwrap();
    let report = build_report(&mut reader).unwrap();
    let text = render_table(&report, 120);
    assert!(!text.is_empty());
}

/// The HTML page without its source heatmap: the report, the stacks by thread,
/// the page.
fn render_html(path: &Path) {
    let mut reader = RecordingReader::open(path).unwrap();
    let report = render_json(&build_report(&mut reader).unwrap());
    let mut reader = RecordingReader::open(path).unwrap();
    let (folded, info) =
        read_folded_by_thread(&mut reader, SampleFilter::default(), FrameGrain::Functions).unwrap();
    let (measure, _) = choose_measure(&folded, &info.header, By::Time);
    let names = FrameNames::new(reader.strings(), true);
    let page = HtmlPage {
        title: "bench",
        subtitle: "",
        report_json: &report,
        sample_interval_ns: info.header.sample_interval_ns,
        sources: &[],
    };
    write_html(&folded, measure, &names, &page, BufWriter::new(io::sink())).unwrap();
}

fn bench_render(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench-1m.pyprobe");
    let events = 1_000_000;
    generate(&path, events).unwrap();
    let mut group = c.benchmark_group("render_1m_events");
    group.sample_size(10);
    group.throughput(Throughput::Elements(events));
    group.bench_function("flame_svg", |b| b.iter(|| render_svg(&path)));
    group.bench_function("report_table", |b| b.iter(|| render_report(&path)));
    group.bench_function("html_page", |b| b.iter(|| render_html(&path)));
    group.finish();
}

criterion_group!(benches, bench_render);

fn main() {
    if let Ok(spec) = std::env::var("PYPROBE_BENCH_GENERATE") {
        let (path, events) = spec
            .rsplit_once(':')
            .expect("PYPROBE_BENCH_GENERATE=PATH:EVENTS");
        let events: u64 = events.parse().expect("a number of events");
        generate(Path::new(path), events).expect("writing the recording");
        eprintln!("wrote {events} events to {path}");
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
