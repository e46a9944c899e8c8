//! Synthetic trace streams shared by the `recording` and `stacks` benchmarks.
//!
//! The stream imitates a trace-mode recording of a threaded program: four
//! threads (the main one busiest) walking a fixed call graph that mostly takes
//! its hot paths, so a million events show some 40,000 distinct stacks rather
//! than one per call; a recursive function under a few callers, GC pauses,
//! imports and audit events. Returns carry the line they return from, not the
//! function's first line, as CPython's do.

// Each bench target compiles its own copy and uses only part of it.
#![allow(dead_code)]

use std::io;
use std::path::Path;

use pyprobe_recording::recording::{
    Event, EventKind, FrameRef, Header, RecordingWriter, StrId, Summary,
};

/// Source files of the synthetic program.
const FILES: u32 = 24;
/// Functions of the synthetic program, spread over the files.
const FUNCTIONS: u32 = 400;
/// Each function calls one of this many others.
const FAN_OUT: u32 = 4;
/// Ordinary calls nest at most this deep (recursion comes on top).
const MAX_DEPTH: usize = 12;
const THREADS: [u32; 4] = [7001, 7002, 7003, 7004];
const START_NS: u64 = 5_000_000_000;

/// Deterministic xorshift64: the same stream on every run, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // xorshift must not start from zero.
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform-enough in `0..n` for a workload shape.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A generated stream and the string table its ids refer to.
pub struct Trace {
    pub header: Header,
    /// `strings[i]` is `StrId(i)`: a fresh writer interning them in this order
    /// gives the same ids.
    pub strings: Vec<String>,
    pub events: Vec<Event>,
    /// Monotonic end of the recording (the trailer's `end_ns`).
    pub end_ns: u64,
}

impl Trace {
    /// Counts of call, return and other events, for the bench output.
    pub fn mix(&self) -> (usize, usize, usize) {
        let calls = self
            .events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Call { .. }))
            .count();
        let returns = self
            .events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Return { .. }))
            .count();
        (calls, returns, self.events.len() - calls - returns)
    }
}

fn function_frame(j: u32) -> FrameRef {
    FrameRef {
        file: StrId(j % FILES),
        function: StrId(FILES + j),
        line: 1 + (j / FILES) * 23,
    }
}

/// The `k`-th callee of function `j`: a fixed graph, so stacks repeat.
fn callee(j: u32, k: u32) -> u32 {
    (j.wrapping_mul(31) + k * 97 + 11) % FUNCTIONS
}

/// Which of a function's callees a call goes to: mostly the hot one (80%,
/// 12%, 6%, 2%). Uniform choices would make almost every deep stack new.
fn hot_callee(rng: &mut Rng) -> u32 {
    match rng.below(100) {
        0..=79 => 0,
        80..=91 => 1,
        92..=97 => 2,
        _ => FAN_OUT - 1,
    }
}

/// Generates exactly `n` events.
pub fn generate(n: usize) -> Trace {
    const VERBS: [&str; 8] = [
        "handle", "parse", "load", "render", "compute", "validate", "encode", "dispatch",
    ];
    let mut strings: Vec<String> = (0..FILES)
        .map(|i| format!("/srv/app/src/app/pkg{}/module_{i}.py", i % 5))
        .collect();
    strings.extend((0..FUNCTIONS).map(|j| format!("{}_{j}", VERBS[j as usize % VERBS.len()])));
    let mut add = |s: &str| {
        strings.push(s.to_string());
        StrId(strings.len() as u32 - 1)
    };
    let tree_file = add("/srv/app/src/app/tree.py");
    let visit = FrameRef {
        file: tree_file,
        function: add("visit_node"),
        line: 40,
    };
    let modules = [add("json.decoder"), add("email.utils"), add("app.plugins")];
    let audit = add("open");

    let mut rng = Rng::new(0x5eed_cafe_f00d_beef);
    let mut events = Vec::with_capacity(n + 128);
    let mut stacks: Vec<Vec<u32>> = vec![Vec::new(); THREADS.len()];
    let mut ts = START_NS;
    let push = |events: &mut Vec<Event>, tid: u32, ts: u64, kind: EventKind| {
        events.push(Event {
            tid,
            ts_ns: ts,
            kind,
        })
    };
    while events.len() < n {
        // The main thread does half the work.
        let t = match rng.below(10) {
            0..=4 => 0,
            5..=7 => 1,
            8 => 2,
            _ => 3,
        };
        let tid = THREADS[t];
        ts += 40 + rng.below(360);
        let roll = rng.below(100_000);
        let stack = &mut stacks[t];
        if roll < 20 {
            let generation = (roll % 3) as i32;
            push(&mut events, tid, ts, EventKind::GcStart { generation });
            ts += 30_000 + rng.below(270_000);
            let collected = rng.below(500) as i64;
            push(&mut events, tid, ts, EventKind::GcDone { collected });
        } else if roll < 25 {
            let module = modules[(roll % 3) as usize];
            push(&mut events, tid, ts, EventKind::ImportStart { module });
            ts += 50_000 + rng.below(500_000);
            let found = roll % 5 != 0;
            push(
                &mut events,
                tid,
                ts,
                EventKind::ImportDone { module, found },
            );
        } else if roll < 60 {
            push(&mut events, tid, ts, EventKind::Audit { event: audit });
        } else if roll < 600
            && stack.len() < MAX_DEPTH
            && stack.last().is_some_and(|&j| j % 40 == 5)
        {
            // A recursive walk from one of its few callers, entered and unwound in one go.
            let depth = 4 + rng.below(36);
            for _ in 0..depth {
                push(&mut events, tid, ts, EventKind::Call { frame: visit });
                ts += 30 + rng.below(60);
            }
            for _ in 0..depth {
                let frame = FrameRef {
                    line: visit.line + 6,
                    ..visit
                };
                push(
                    &mut events,
                    tid,
                    ts,
                    EventKind::Return {
                        frame,
                        first_line: 0,
                    },
                );
                ts += 30 + rng.below(60);
            }
        } else if stack.is_empty() || (stack.len() < MAX_DEPTH && rng.below(100) < 52) {
            let j = match stack.last() {
                None => rng.below(u64::from(FAN_OUT)) as u32,
                Some(&parent) => callee(parent, hot_callee(&mut rng)),
            };
            stack.push(j);
            let frame = function_frame(j);
            push(&mut events, tid, ts, EventKind::Call { frame });
        } else if let Some(j) = stack.pop() {
            let entry = function_frame(j);
            let frame = FrameRef {
                line: entry.line + 1 + rng.below(20) as u32,
                ..entry
            };
            push(
                &mut events,
                tid,
                ts,
                EventKind::Return {
                    frame,
                    first_line: 0,
                },
            );
        }
    }
    // A cut-off recursive walk leaves frames open, as a recording stopped mid-run does.
    events.truncate(n);
    let end_ns = events.last().map_or(START_NS, |e| e.ts_ns) + 1;
    let header = Header {
        pid: THREADS[0],
        command_line: vec!["python3".into(), "-m".into(), "app.server".into()],
        executable: "/usr/bin/python3.12".into(),
        python_version: "3.12.3".into(),
        mode: "trace".into(),
        probes: vec![
            "function".into(),
            "gc".into(),
            "import".into(),
            "audit".into(),
        ],
        start_ns: START_NS,
        ..Header::default()
    };
    Trace {
        header,
        strings,
        events,
        end_ns,
    }
}

/// Writes `trace` as a recording at `path`, its strings interned up front.
pub fn write_recording(path: &Path, trace: &Trace) -> io::Result<Summary> {
    let mut w = RecordingWriter::create(path, &trace.header)?;
    for (i, s) in trace.strings.iter().enumerate() {
        let id = w.intern(s);
        debug_assert_eq!(id, StrId(i as u32));
    }
    for e in &trace.events {
        w.write(e)?;
    }
    w.finish(trace.end_ns)
}

/// Criterion settings for short runs: the machine has two cores and several bench
/// targets to get through.
pub fn short_runs() -> criterion::Criterion {
    criterion::Criterion::default()
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3))
        .sample_size(20)
}
