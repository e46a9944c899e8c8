//! Hand-made event sequences with known answers.

use proptest::prelude::*;

use super::*;
use crate::recording::{Event, EventKind, FrameRef, Header, SampleState, StrId, WalkedFrame};

/// Builds events against a little string table.
#[derive(Default)]
struct Script {
    strings: Vec<String>,
    events: Vec<Event>,
    tid: u32,
}

impl Script {
    fn new() -> Self {
        Script {
            tid: 1,
            ..Script::default()
        }
    }

    fn id(&mut self, s: &str) -> StrId {
        match self.strings.iter().position(|x| x == s) {
            Some(i) => StrId(i as u32),
            None => {
                self.strings.push(s.to_string());
                StrId(self.strings.len() as u32 - 1)
            }
        }
    }

    fn frame(&mut self, name: &str, line: u32) -> FrameRef {
        FrameRef {
            file: self.id("/app/main.py"),
            function: self.id(name),
            line,
        }
    }

    fn push(&mut self, ts_ns: u64, kind: EventKind) -> &mut Self {
        self.events.push(Event {
            tid: self.tid,
            ts_ns,
            kind,
        });
        self
    }

    fn call(&mut self, ts: u64, name: &str, line: u32) -> &mut Self {
        let frame = self.frame(name, line);
        self.push(ts, EventKind::Call { frame })
    }

    fn ret(&mut self, ts: u64, name: &str, line: u32) -> &mut Self {
        self.ret_from(ts, name, line, 0)
    }

    /// A generator or coroutine entered again (the hook engine's, or an entry
    /// whose `f_lasti` says so).
    fn resume(&mut self, ts: u64, name: &str, line: u32) -> &mut Self {
        let frame = self.frame(name, line);
        self.push(ts, EventKind::Resume { frame })
    }

    /// A return naming its function's first line (CPython 3.11+, read from the
    /// code object).
    fn ret_from(&mut self, ts: u64, name: &str, line: u32, first_line: u32) -> &mut Self {
        let frame = self.frame(name, line);
        self.push(ts, EventKind::Return { frame, first_line })
    }

    /// A sampled stack of (function, first line, current line), outermost first.
    fn sample(&mut self, ts: u64, stack: &[(&str, u32, u32)]) -> &mut Self {
        let frames = self.walked(stack);
        self.push(
            ts,
            EventKind::Sample {
                frames,
                state: SampleState::default(),
            },
        )
    }

    fn walked(&mut self, stack: &[(&str, u32, u32)]) -> Vec<WalkedFrame> {
        stack
            .iter()
            .map(|&(n, first, line)| WalkedFrame {
                code: self.frame(n, first),
                line,
            })
            .collect()
    }

    fn report_with(&self, header: &Header, end: Option<u64>) -> Report {
        let plan = plan_events(header, &self.strings, &self.events);
        let mut replay = Replay::new(header, plan);
        let mut agg = Aggregator::new(header);
        let mut steps = Vec::new();
        for e in &self.events {
            steps.clear();
            let ts = replay.push(e, &mut steps);
            agg.push(e, ts, &steps, &replay);
        }
        agg.finish(replay, end, |id| {
            self.strings
                .get(id.0 as usize)
                .cloned()
                .unwrap_or_else(|| format!("<unknown #{}>", id.0))
        })
    }

    fn report(&self) -> Report {
        self.report_with(&Header::default(), None)
    }
}

fn header_of(python: &str) -> Header {
    Header {
        python_version: python.into(),
        ..Header::default()
    }
}

fn func<'a>(r: &'a Report, name: &str) -> &'a FunctionStats {
    r.functions
        .iter()
        .find(|f| f.function == name)
        .unwrap_or_else(|| panic!("no {name} in {:#?}", r.functions))
}

#[test]
fn tracing_cost_per_event_leaves_the_times_and_totals_still_add_up() {
    // main calls leaf 2000 times: 100 ns from a call to leaf to its return, 300
    // ns from that return to the next call; leaf's 20 first gaps are 40 ns.
    let mut s = Script::new();
    s.call(0, "main", 1);
    let mut ts = 300;
    for i in 0..2000 {
        let inside = if i < 20 { 40 } else { 100 };
        s.call(ts, "leaf", 10).ret(ts + inside, "leaf", 10);
        ts += inside + 300;
    }
    s.ret(ts, "main", 1);
    let r = s.report();
    // 4001 gaps, 20 of them 40 ns: the gap 1 % of them are shorter than is 100.
    let p = &r.processes[0];
    assert_eq!(p.event_cost_ns, 100);
    let (main, leaf) = (func(&r, "main"), func(&r, "leaf"));
    // Each leaf call ended one gap: 100 ns left out of each (all of the 40 ns ones).
    assert_eq!(leaf.exclusive_ns, 0);
    // main was on top for 2001 gaps of 300 ns: 100 ns of each left out.
    assert_eq!(main.exclusive_ns, 2001 * 200);
    assert_eq!(main.inclusive_ns, main.exclusive_ns + leaf.inclusive_ns);
    let raw = ts;
    assert_eq!(p.tracing_cost_ns, 20 * 40 + 1980 * 100 + 2001 * 100);
    assert_eq!(main.inclusive_ns + p.tracing_cost_ns, raw);
    assert_eq!(p.own_ns, main.exclusive_ns + leaf.exclusive_ns);
    assert_eq!(r.threads[0].exclusive_ns, p.own_ns);
    assert_eq!(r.threads[0].tracing_cost_ns, p.tracing_cost_ns);
    assert_eq!(
        r.threads[0].exclusive_ns + r.threads[0].tracing_cost_ns,
        raw
    );
}

#[test]
fn too_few_gaps_leave_traced_times_as_they_are() {
    let mut s = Script::new();
    s.call(0, "main", 1);
    for i in 0..100 {
        s.call(1000 * i + 300, "leaf", 10)
            .ret(1000 * i + 400, "leaf", 10);
    }
    s.ret(100_000, "main", 1);
    let r = s.report();
    assert_eq!(r.processes[0].event_cost_ns, 0);
    assert_eq!(r.processes[0].tracing_cost_ns, 0);
    assert_eq!(func(&r, "leaf").exclusive_ns, 100 * 100);
    assert_eq!(func(&r, "main").inclusive_ns, 100_000);
}

#[test]
fn recursion_counts_inclusive_once() {
    // fib(3) -> fib(2) -> {fib(1), fib(0)}; fib(1), all under main.
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "fib", 3)
        .call(20, "fib", 3)
        .call(30, "fib", 3)
        .ret(40, "fib", 3)
        .call(50, "fib", 3)
        .ret(60, "fib", 3)
        .ret(70, "fib", 3)
        .call(80, "fib", 3)
        .ret(100, "fib", 3)
        .ret(110, "fib", 3)
        .ret(120, "main", 1);
    let r = s.report();
    let fib = func(&r, "fib");
    assert_eq!(fib.calls, Some(5));
    assert_eq!(fib.inclusive_ns, 100, "outermost activation only");
    assert_eq!(fib.exclusive_ns, 100);
    let main = func(&r, "main");
    assert_eq!(
        (main.calls, main.inclusive_ns, main.exclusive_ns),
        (Some(1), 120, 20)
    );
    assert_eq!(r.functions[0].function, "main", "sorted by inclusive");
    assert_eq!(r.source, FunctionSource::Traced);
    assert_eq!(r.anomalies, Anomalies::default());
    assert_eq!(r.duration_ns, 120);
}

#[test]
fn generator_entries_that_do_not_say_they_resume_are_calls() {
    let mut s = Script::new();
    s.call(0, "main", 1);
    for i in 0..3u64 {
        let t = 10 + i * 100;
        s.call(t, "gen", 5)
            .call(t + 10, "helper", 9)
            .ret(t + 20, "helper", 9)
            .ret(t + 30, "gen", 5);
    }
    s.ret(400, "main", 1);
    let r = s.report();
    let gen = func(&r, "gen");
    assert_eq!(
        (gen.calls, gen.inclusive_ns, gen.exclusive_ns),
        (Some(3), 90, 60)
    );
    assert_eq!(func(&r, "helper").calls, Some(3));
    assert_eq!(func(&r, "main").exclusive_ns, 400 - 90);
}

#[test]
fn exception_unwinding_returns_each_frame() {
    let mut s = Script::new();
    s.call(0, "a", 1)
        .call(10, "b", 2)
        .call(20, "c", 3)
        .ret(50, "c", 3)
        .ret(50, "b", 2)
        .ret(60, "a", 1);
    let r = s.report();
    assert_eq!(func(&r, "c").inclusive_ns, 30);
    assert_eq!(func(&r, "b").inclusive_ns, 40);
    assert_eq!(func(&r, "b").exclusive_ns, 10);
    assert_eq!(func(&r, "a").exclusive_ns, 20);
    assert_eq!(r.anomalies.replay.resyncs, 0);
}

#[test]
fn attach_mid_call_seeds_the_frames_running() {
    let mut s = Script::new();
    // Attached inside outer -> inner: their returns come with an empty stack,
    // innermost first. They count from when tracing began, the first call (10),
    // not from the recording's start (5): the engine was being installed
    // meanwhile, its target often stopped.
    s.call(10, "leaf", 7)
        .ret(20, "leaf", 7)
        .ret(30, "inner", 4)
        .ret(40, "outer", 2);
    let r = s.report_with(
        &Header {
            start_ns: 5,
            ..Header::default()
        },
        Some(50),
    );
    assert_eq!(func(&r, "leaf").inclusive_ns, 10);
    let inner = func(&r, "inner");
    assert_eq!(
        (inner.calls, inner.inclusive_ns, inner.exclusive_ns),
        (Some(1), 20, 10)
    );
    let outer = func(&r, "outer");
    assert_eq!(
        (outer.calls, outer.inclusive_ns, outer.exclusive_ns),
        (Some(1), 30, 10)
    );
    assert_eq!(r.anomalies.replay.orphan_returns, 0);
    assert_eq!(r.anomalies.replay.open_at_start, 2);
    assert_eq!(r.duration_ns, 45);
}

#[test]
fn frames_running_at_attach_come_from_the_walker() {
    let mut s = Script::new();
    // The walker saw serve -> handle at attach (4); handle returns, serve never does.
    let frames = s.walked(&[("serve", 10, 14), ("handle", 20, 23)]);
    s.push(4, EventKind::Running { frames })
        .call(10, "parse", 30)
        .ret(15, "parse", 31)
        .ret(20, "handle", 25)
        .call(30, "handle", 20)
        .ret(40, "handle", 25);
    let r = s.report_with(
        &Header {
            start_ns: 5,
            ..Header::default()
        },
        Some(50),
    );
    let handle = func(&r, "handle");
    assert_eq!(handle.line, 20);
    assert_eq!(
        (handle.calls, handle.inclusive_ns, handle.exclusive_ns),
        (Some(2), 16 + 10, 11 + 10)
    );
    let serve = func(&r, "serve");
    assert_eq!(
        (
            serve.line,
            serve.calls,
            serve.inclusive_ns,
            serve.exclusive_ns
        ),
        (10, Some(0), 46, 20)
    );
    assert_eq!(r.anomalies.replay.open_at_start, 2);
    assert_eq!(r.anomalies.replay.open_at_end, 1);
    assert_eq!(r.anomalies.replay.orphan_returns, 0);
}

#[test]
fn a_return_before_the_first_entry_joins_the_function_row() {
    // Attached while work ran: its first return (from line 9) comes before any entry
    // shows its first line (5). One row for work, with every call.
    let mut s = Script::new();
    s.ret(10, "work", 9)
        .call(20, "work", 5)
        .ret(30, "work", 9)
        .call(40, "work", 5)
        .ret(50, "work", 9);
    let r = s.report();
    let rows: Vec<_> = r
        .functions
        .iter()
        .filter(|f| f.function == "work")
        .collect();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!((rows[0].line, rows[0].calls), (5, Some(3)));
    assert_eq!(rows[0].inclusive_ns, 20);
}

#[test]
fn unpaired_entries_resync_where_every_entry_should_return() {
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "lost", 5)
        .call(20, "work", 8)
        .ret(30, "work", 8)
        .ret(50, "main", 1);
    let r = s.report();
    let lost = func(&r, "lost");
    assert_eq!(lost.calls, Some(1));
    assert_eq!((lost.inclusive_ns, lost.exclusive_ns), (40, 30));
    assert_eq!(func(&r, "main").exclusive_ns, 10);
    assert_eq!(r.anomalies.replay.resyncs, 1);
    assert_eq!(r.anomalies.replay.unpaired_entries, 1);
}

/// Rows of `name`: (first line, calls, inclusive, exclusive), by line.
fn rows_of(r: &Report, name: &str) -> Vec<(u32, Option<u64>, u64, u64)> {
    let mut v: Vec<_> = r
        .functions
        .iter()
        .filter(|f| f.function == name)
        .map(|f| (f.line, f.calls, f.inclusive_ns, f.exclusive_ns))
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn cpython_315_entries_without_line_take_the_first_line_their_return_names() {
    // Two `__init__`s with cells (first lines 10 and 20) entered without line
    // (-1), one inside the other (super().__init__ of a same-named base), and a
    // decorated `handler` entered at its `def` line 31 (first line 30).
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "__init__", u32::MAX)
        .call(20, "__init__", u32::MAX)
        .ret_from(30, "__init__", 22, 20)
        .ret_from(40, "__init__", 12, 10)
        .call(50, "__init__", u32::MAX)
        .ret_from(55, "__init__", 22, 20)
        .call(60, "handler", 31)
        .ret_from(70, "handler", 32, 30)
        .ret(100, "main", 1);
    let r = s.report_with(&header_of("3.15.2"), None);
    assert_eq!(
        rows_of(&r, "__init__"),
        vec![(10, Some(1), 30, 20), (20, Some(2), 15, 15)]
    );
    assert_eq!(rows_of(&r, "handler"), vec![(30, Some(1), 10, 10)]);
    assert_eq!(r.anomalies.replay.resyncs, 0);
}

#[test]
fn cpython_311_returns_naming_their_first_line_keep_same_named_functions_apart() {
    // Returns only; `work` at line 5 was sampled, the `work` at line 40 never:
    // without its first line, its returns (line 42) would go to line 5's row.
    let mut s = Script::new();
    s.sample(0, &[("main", 1, 2), ("work", 5, 7)])
        .ret_from(10, "work", 7, 5)
        .ret_from(20, "work", 42, 40)
        .ret_from(30, "work", 42, 40)
        .ret(40, "work", 42)
        .ret_from(50, "main", 3, 1);
    let r = s.report_with(&header_of("3.11.2"), None);
    let lines: Vec<(u32, Option<u64>)> = rows_of(&r, "work")
        .into_iter()
        .map(|(l, c, _, _)| (l, c))
        .collect();
    // The return without first line goes where the known first lines say.
    assert_eq!(lines, vec![(5, Some(1)), (40, Some(3))]);
}

#[test]
fn resumes_are_timed_as_calls_and_counted_apart() {
    // main runs a coroutine `co` (first line 5) three times: a call, two resumes.
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "co", 5)
        .ret(20, "co", 6)
        .resume(30, "co", 6)
        .ret(45, "co", 7)
        .resume(50, "co", 7)
        .ret(80, "co", 8)
        .ret(100, "main", 2);
    let r = s.report_with(&header_of("3.13.1"), None);
    let co = func(&r, "co");
    assert_eq!((co.line, co.calls, co.resumes), (5, Some(1), Some(2)));
    assert_eq!((co.inclusive_ns, co.exclusive_ns), (55, 55));
    let main = func(&r, "main");
    assert_eq!((main.calls, main.resumes), (Some(1), Some(0)));
    assert_eq!((main.inclusive_ns, main.exclusive_ns), (100, 45));
}

#[test]
fn cpython_315_creations_make_calls_of_first_runs_only() {
    // Two generators created, one run three times, one never: two calls counted
    // (the creations), one resume; calls and resumes still add up to the runs.
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "gen", u32::MAX)
        .call(12, "gen", u32::MAX)
        .call(20, "gen", 5)
        .ret(25, "gen", 6)
        .call(30, "gen", 6)
        .ret(35, "gen", 6)
        .call(40, "gen", 6)
        .ret(45, "gen", 7)
        .ret(100, "main", 2);
    let r = s.report_with(&header_of("3.15.2"), None);
    let gen = func(&r, "gen");
    assert_eq!((gen.calls, gen.resumes), (Some(2), Some(1)));
    assert_eq!(gen.inclusive_ns, 15);
}

#[test]
fn cpython_315_generator_creations_are_left_out() {
    let mut s = Script::new();
    // main creates gen (an entry without return), calls work, consumes gen (an
    // entry at its first line, a yield, a resume at the yield's line, a return),
    // and an `__init__` shim returns without entry.
    s.call(0, "main", 1)
        .call(10, "gen", 5)
        .call(20, "work", 8)
        .ret(30, "work", 8)
        .call(40, "gen", 5)
        .ret(45, "gen", 6)
        .call(50, "gen", 6)
        .ret(60, "gen", 7);
    let shim = FrameRef {
        file: s.id("__init__"),
        function: s.id("__init__"),
        line: u32::MAX,
    };
    s.push(
        65,
        EventKind::Return {
            frame: shim,
            first_line: 0,
        },
    )
    .ret(100, "main", 1);
    let r = s.report_with(&header_of("3.15.2"), None);
    let gen = func(&r, "gen");
    // The creation makes the first run the call, the second a resume.
    assert_eq!((gen.line, gen.calls, gen.resumes), (5, Some(1), Some(1)));
    assert_eq!((gen.inclusive_ns, gen.exclusive_ns), (15, 15));
    assert_eq!(
        r.functions.iter().filter(|f| f.function == "gen").count(),
        1
    );
    let work = func(&r, "work");
    assert_eq!(work.inclusive_ns, 10);
    let main = func(&r, "main");
    assert_eq!((main.inclusive_ns, main.exclusive_ns), (100, 75));
    assert!(r.functions.iter().all(|f| f.function != "__init__"));
    assert_eq!(r.anomalies.replay.generator_creations, 1);
    assert_eq!(r.anomalies.replay.shim_returns, 1);
    assert_eq!(r.anomalies.replay.resyncs, 0);
    assert_eq!(r.anomalies.replay.unpaired_entries, 0);
    assert_eq!(r.anomalies.replay.orphan_returns, 0);
    // The same stream from a CPython whose entries all return resyncs instead.
    let r = s.report();
    assert_eq!(r.anomalies.replay.resyncs, 1);
}

#[test]
fn return_only_stream_gives_exact_counts_and_sampled_times() {
    let mut s = Script::new();
    // A tracing hook was briefly set: one entry fired.
    s.call(0, "tick", 3);
    for i in 0..10u64 {
        s.ret(i * 10, "tick", 3);
    }
    s.ret(100, "main", 1);
    s.sample(1_000, &[("main", 1, 2), ("tick", 3, 4)]);
    s.sample(2_000, &[("main", 1, 2), ("tick", 3, 5)]);
    s.sample(3_000, &[("main", 1, 2)]);
    let header = Header {
        python_version: "3.11.2".into(),
        sample_interval_ns: 1_000,
        ..Header::default()
    };
    let r = s.report_with(&header, None);
    assert_eq!(r.source, FunctionSource::ReturnsOnly);
    let tick = func(&r, "tick");
    assert_eq!(tick.calls, Some(10));
    assert_eq!(tick.line, 3, "samples matched to the traced first line");
    assert_eq!(
        (tick.samples, tick.inclusive_ns, tick.exclusive_ns),
        (2, 2_000, 2_000)
    );
    let main = func(&r, "main");
    assert_eq!(main.calls, Some(1));
    assert_eq!(
        (main.samples, main.inclusive_ns, main.exclusive_ns),
        (1, 3_000, 1_000)
    );
    // Samples taken late (every 1 µs where 0.5 µs was asked): each stands for
    // the time that really passed between them.
    let header = Header {
        sample_interval_ns: 500,
        ..header
    };
    let r = s.report_with(&header, None);
    assert_eq!(func(&r, "tick").inclusive_ns, 2_000);
}

#[test]
fn sample_mode_estimates_from_samples() {
    let mut s = Script::new();
    s.sample(
        0,
        &[("main", 9, 10), ("fib", 3, 4), ("fib", 3, 5), ("fib", 3, 4)],
    )
    .sample(1, &[("main", 9, 10), ("fib", 3, 6)])
    .sample(2, &[("main", 9, 11)])
    .sample(3, &[]);
    let header = Header {
        mode: "sample".into(),
        sample_interval_ns: 1_000_000,
        ..Header::default()
    };
    let r = s.report_with(&header, None);
    assert_eq!(r.source, FunctionSource::Sampled);
    let fib = func(&r, "fib");
    assert_eq!(fib.calls, None);
    assert_eq!(fib.samples, 2);
    assert_eq!(
        fib.inclusive_ns, 2_000_000,
        "once per sample despite recursion"
    );
    assert_eq!(fib.exclusive_ns, 2_000_000);
    assert_eq!(fib.line, 3, "the first line the walker read");
    let main = func(&r, "main");
    assert_eq!(
        (main.samples, main.inclusive_ns, main.exclusive_ns),
        (1, 3_000_000, 1_000_000)
    );
}

#[test]
fn gc_pairs_per_thread() {
    let mut s = Script::new();
    s.push(100, EventKind::GcStart { generation: 0 });
    s.tid = 2;
    s.push(110, EventKind::GcStart { generation: 2 });
    s.tid = 1;
    s.push(150, EventKind::GcDone { collected: 30 });
    s.tid = 2;
    s.push(1_110, EventKind::GcDone { collected: 500 });
    s.tid = 1;
    s.push(2_000, EventKind::GcStart { generation: 0 })
        .push(2_010, EventKind::GcDone { collected: 4 })
        // Done without start: attached mid-collection.
        .push(3_000, EventKind::GcDone { collected: 1 });
    let r = s.report();
    assert_eq!(r.gc.len(), 2);
    let g0 = &r.gc[0];
    assert_eq!(
        (
            g0.generation,
            g0.collections,
            g0.collected,
            g0.total_ns,
            g0.max_ns
        ),
        (0, 2, 34, 60, 50)
    );
    assert_eq!(
        g0.histogram.buckets().collect::<Vec<_>>(),
        vec![(8, 16, 1), (32, 64, 1)]
    );
    let g2 = &r.gc[1];
    assert_eq!(
        (g2.generation, g2.collections, g2.total_ns, g2.max_ns),
        (2, 1, 1_000, 1_000)
    );
    assert_eq!(r.anomalies.unpaired_gc, 1);
}

#[test]
fn nested_imports_know_their_importer() {
    let mut s = Script::new();
    let (app, json, dec, missing) = (
        s.id("app"),
        s.id("json"),
        s.id("json.decoder"),
        s.id("ujson"),
    );
    s.push(0, EventKind::ImportStart { module: app })
        .push(10, EventKind::ImportStart { module: json })
        .push(20, EventKind::ImportStart { module: dec })
        .push(
            50,
            EventKind::ImportDone {
                module: dec,
                found: true,
            },
        )
        .push(
            60,
            EventKind::ImportDone {
                module: json,
                found: true,
            },
        )
        .push(70, EventKind::ImportStart { module: missing })
        .push(
            75,
            EventKind::ImportDone {
                module: missing,
                found: false,
            },
        )
        .push(
            100,
            EventKind::ImportDone {
                module: app,
                found: true,
            },
        );
    let r = s.report();
    let names: Vec<&str> = r.imports.iter().map(|i| i.module.as_str()).collect();
    assert_eq!(
        names,
        ["app", "json", "json.decoder", "ujson"],
        "slowest first"
    );
    let get = |m: &str| r.imports.iter().find(|i| i.module == m).unwrap();
    assert_eq!(get("app").importer, None);
    assert_eq!((get("app").total_ns, get("app").self_ns), (100, 45));
    assert_eq!(get("json").importer.as_deref(), Some("app"));
    assert_eq!((get("json").total_ns, get("json").self_ns), (50, 20));
    assert_eq!(get("json.decoder").importer.as_deref(), Some("json"));
    assert!(!get("ujson").found);
    assert_eq!(get("ujson").count, 1);
    assert_eq!(r.anomalies.unpaired_imports, 0);
}

#[test]
fn audit_threads_lost_and_duration() {
    let mut s = Script::new();
    let open = s.id("open");
    let connect = s.id("socket.connect");
    s.push(1_000, EventKind::ThreadStart { pid: 0 })
        .push(1_100, EventKind::Audit { event: open })
        .push(1_200, EventKind::Audit { event: open })
        .push(1_300, EventKind::Lost { count: 5 });
    s.tid = 9;
    s.push(1_400, EventKind::Audit { event: connect })
        .push(1_500, EventKind::ThreadExit);
    let header = Header {
        start_ns: 900,
        ..Header::default()
    };
    let r = s.report_with(&header, Some(2_000));
    assert_eq!(
        r.audit[0],
        AuditCount {
            event: "open".into(),
            count: 2,
            stacks: vec![]
        }
    );
    assert_eq!(r.audit[1].event, "socket.connect");
    assert_eq!(
        r.threads,
        vec![
            ThreadStats {
                tid: 1,
                events: 4,
                ..ThreadStats::default()
            },
            ThreadStats {
                tid: 9,
                events: 2,
                ..ThreadStats::default()
            }
        ]
    );
    assert_eq!(r.lost_events, 5);
    assert_eq!(r.events, 6);
    assert_eq!(r.duration_ns, 1_100);
    // Without a trailer, the last event ends the recording.
    assert_eq!(s.report_with(&header, None).duration_ns, 600);
}

#[test]
fn open_frames_count_time_not_calls() {
    let mut s = Script::new();
    s.call(0, "serve", 1)
        .call(10, "handle", 5)
        .ret(30, "handle", 5);
    s.tid = 2;
    s.call(5, "worker", 20).push(25, EventKind::ThreadExit);
    let r = s.report_with(&Header::default(), Some(100));
    let serve = func(&r, "serve");
    assert_eq!(
        (serve.calls, serve.inclusive_ns, serve.exclusive_ns),
        (Some(0), 100, 80)
    );
    let worker = func(&r, "worker");
    assert_eq!((worker.calls, worker.inclusive_ns), (Some(0), 20));
    assert_eq!(r.anomalies.replay.open_at_end, 2);
}

#[test]
fn budget_windows_cut_frames_and_samples_fill_the_gaps() {
    // Exact window 0..100: main calls work twice; the window closes with main open.
    // Sampled 100..300 (two samples of 100 ns each), then a second window in which
    // a call entered before it returns (a return without entry).
    let mut s = Script::new();
    s.push(0, EventKind::Window { exact: true })
        .call(0, "main", 1)
        .call(10, "work", 5)
        .ret(30, "work", 6)
        .call(40, "work", 5)
        .ret(60, "work", 6)
        .push(100, EventKind::Window { exact: false })
        .sample(150, &[("main", 1, 3), ("work", 5, 7)])
        .sample(250, &[("main", 1, 3), ("work", 5, 7)])
        .push(300, EventKind::Window { exact: true })
        .ret(320, "work", 6)
        .call(330, "work", 5)
        .ret(350, "work", 6);
    let header = Header {
        sample_interval_ns: 100,
        ..Header::default()
    };
    let r = s.report_with(&header, Some(400));
    let work = func(&r, "work");
    // Four exact calls ended (two, one running when the window opened, one
    // more); 80 ns exact (20 + 20 + 20 from the window's start + 20) plus two
    // samples of 100 ns.
    assert_eq!(work.calls, Some(4));
    assert_eq!(work.exclusive_ns, 80 + 200);
    assert_eq!(work.samples, 2);
    assert_eq!(work.line, 5, "sampled time lands on the traced row");
    let main = func(&r, "main");
    // main was cut at 100 (open, not a call): 100 ns exact, 40 of it in work; the
    // samples (leaf work) add 200 inclusive.
    assert_eq!(main.calls, Some(0));
    assert_eq!((main.inclusive_ns, main.exclusive_ns), (100 + 200, 60));
    assert_eq!(
        r.anomalies.replay.open_at_end, 0,
        "a window cut is not an anomaly"
    );
    let w = r.exact_windows.expect("windows seen");
    assert_eq!((w.windows, w.exact_ns), (2, 100 + 100));
    assert_eq!(
        r.functions.iter().filter(|f| f.function == "work").count(),
        1
    );
}

#[test]
fn without_windows_there_is_no_budget_and_samples_add_no_time() {
    let mut s = Script::new();
    s.call(0, "main", 1)
        .sample(50, &[("main", 1, 2)])
        .ret(100, "main", 3);
    let header = Header {
        sample_interval_ns: 1000,
        ..Header::default()
    };
    let r = s.report_with(&header, Some(100));
    assert_eq!(r.exact_windows, None);
    assert_eq!(func(&r, "main").inclusive_ns, 100);
}

#[test]
fn depth_is_capped() {
    let mut s = Script::new();
    let n = MAX_DEPTH as u64 + 100;
    for i in 0..n {
        s.call(i, "deep", 1);
    }
    for i in 0..n {
        s.ret(n + i, "deep", 1);
    }
    let r = s.report();
    let deep = func(&r, "deep");
    assert_eq!(deep.calls, Some(n));
    assert_eq!(deep.inclusive_ns, 2 * n - 1);
    assert_eq!(r.anomalies.replay.depth_overflows, 100);
    assert_eq!(r.anomalies.replay.orphan_returns, 0);
}

#[test]
fn unknown_strings_resolve_to_placeholders() {
    let mut s = Script::new();
    let bogus = FrameRef {
        file: StrId(999),
        function: StrId(998),
        line: 1,
    };
    s.push(0, EventKind::Call { frame: bogus }).push(
        1,
        EventKind::Return {
            frame: bogus,
            first_line: 0,
        },
    );
    let r = s.report();
    assert_eq!(r.functions[0].function, "<unknown #998>");
}

#[test]
fn replay_reports_each_end_and_keeps_time_monotonic() {
    let f = |n: u32| FrameRef {
        file: StrId(0),
        function: StrId(n),
        line: n,
    };
    let ev = |tid, ts_ns, kind| Event { tid, ts_ns, kind };
    let events = vec![
        ev(1, 0, EventKind::Call { frame: f(1) }),
        ev(1, 5, EventKind::Call { frame: f(2) }),
        ev(
            1,
            9,
            EventKind::Return {
                frame: f(1),
                first_line: 0,
            },
        ),
        // Timestamps going backwards (TSC conversion): the clock holds still.
        ev(2, 100, EventKind::Call { frame: f(3) }),
        ev(2, 50, EventKind::Call { frame: f(4) }),
        ev(
            2,
            120,
            EventKind::Return {
                frame: f(4),
                first_line: 0,
            },
        ),
        ev(
            2,
            110,
            EventKind::Return {
                frame: f(3),
                first_line: 0,
            },
        ),
    ];
    let header = Header::default();
    let mut replay = Replay::new(&header, plan_events(&header, &[], &events));
    let mut steps = Vec::new();
    let mut exits = Vec::new();
    for e in &events {
        steps.clear();
        replay.push(e, &mut steps);
        exits.extend(steps.iter().filter_map(|s| match s {
            Step::Exit(x) => Some((x.code.function.0, x.start_ns(), x.ts, x.kind)),
            _ => None,
        }));
    }
    assert_eq!(
        exits,
        vec![
            (2, 5, 9, EndKind::Unpaired),
            (1, 0, 9, EndKind::Returned),
            (4, 100, 120, EndKind::Returned),
            (3, 100, 120, EndKind::Returned),
        ],
        "the child ends within its parent"
    );
    assert_eq!(replay.counters().resyncs, 1);
}

#[test]
fn same_named_nesting_is_not_recursion() {
    // Derived.__init__ (line 10) calls super().__init__ (Base.__init__, line 5);
    // a visitor's visit_default calls another class's visit_default.
    let mut s = Script::new();
    s.call(0, "__init__", 10)
        .call(10, "__init__", 5)
        .ret(80, "__init__", 6)
        .ret(100, "__init__", 12)
        .call(200, "__init__", 5)
        .ret(230, "__init__", 6);
    let r = s.report();
    let rows: Vec<_> = r
        .functions
        .iter()
        .filter(|f| f.function == "__init__")
        .collect();
    assert_eq!(rows.len(), 2, "{rows:#?}");
    let base = rows.iter().find(|f| f.line == 5).unwrap();
    assert_eq!(
        (base.calls, base.inclusive_ns, base.exclusive_ns),
        (Some(2), 100, 100)
    );
    let derived = rows.iter().find(|f| f.line == 10).unwrap();
    assert_eq!(
        (derived.calls, derived.inclusive_ns, derived.exclusive_ns),
        (Some(1), 100, 30)
    );
    // A true recursion still counts its inclusive time once.
    let mut s = Script::new();
    s.call(0, "visit", 3)
        .call(10, "visit", 3)
        .ret(20, "visit", 4)
        .ret(30, "visit", 4);
    let r = s.report();
    let visit = func(&r, "visit");
    assert_eq!((visit.inclusive_ns, visit.exclusive_ns), (30, 30));
}

#[test]
fn a_generator_is_one_row_whatever_line_it_resumes_at() {
    // CPython 3.9: a resume enters at the line it yielded from (25, then 28);
    // returns come from 25, 28 and 29 (the end).
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "numbers", 23)
        .ret(12, "numbers", 25)
        .call(20, "numbers", 25)
        .ret(22, "numbers", 28)
        .call(30, "numbers", 28)
        .ret(33, "numbers", 29)
        .ret(40, "main", 2);
    let r = s.report_with(&header_of("3.9.2"), None);
    let rows: Vec<_> = r
        .functions
        .iter()
        .filter(|f| f.function == "numbers")
        .collect();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(
        (
            rows[0].line,
            rows[0].calls,
            rows[0].inclusive_ns,
            rows[0].exclusive_ns
        ),
        (23, Some(3), 7, 7)
    );
    // Resumes seen before the first entry (attached mid-generator) still join it.
    let mut s = Script::new();
    s.call(0, "numbers", 28)
        .ret(1, "numbers", 29)
        .call(10, "numbers", 23)
        .ret(12, "numbers", 28);
    let r = s.report_with(&header_of("3.9.2"), None);
    let rows: Vec<_> = r
        .functions
        .iter()
        .filter(|f| f.function == "numbers")
        .collect();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!((rows[0].line, rows[0].calls), (23, Some(2)));
}

#[test]
fn flame_graph_and_report_agree_per_function() {
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "a", 5)
        .call(20, "a", 9)
        .ret(30, "a", 10)
        .push(35, EventKind::GcStart { generation: 0 })
        .push(38, EventKind::GcDone { collected: 1 })
        .ret(40, "a", 6)
        .ret(45, "b", 20)
        .call(50, "c", 30);
    let header = header_of("3.15.0");
    let r = s.report_with(&header, Some(100));
    let folded = crate::analyze::folded::fold_events(&header, &s.strings, &s.events, Some(100));
    let mut time: std::collections::HashMap<(String, u32), (u64, u64)> = Default::default();
    let mut path = Vec::new();
    for node in 1..folded.tree.len() as u32 {
        folded.tree.path(node, &mut path);
        if let Some(crate::analyze::folded::FoldFrame::Python(f)) = path.last() {
            let e = time
                .entry((s.strings[f.function.0 as usize].clone(), f.line))
                .or_default();
            e.0 += folded.value(node, crate::analyze::folded::Measure::Time);
            e.1 += folded.value(node, crate::analyze::folded::Measure::Calls);
        }
    }
    for f in &r.functions {
        let (t, c) = time
            .get(&(f.function.clone(), f.line))
            .copied()
            .unwrap_or_default();
        // The flame graph takes GC pauses off their frame into a [gc] frame.
        let gc = if f.function == "a" && f.line == 5 {
            3
        } else {
            0
        };
        assert_eq!(t + gc, f.exclusive_ns, "{}: time", f.function);
        assert_eq!(Some(c), f.calls, "{}: calls", f.function);
        assert!(f.inclusive_ns >= f.exclusive_ns, "{f:?}");
    }
}

fn arb_event() -> impl Strategy<Value = Event> {
    let frame =
        (0u32..4, 0u32..4, prop_oneof![0u32..4, Just(u32::MAX)]).prop_map(|(a, b, l)| FrameRef {
            file: StrId(a),
            function: StrId(b),
            line: l,
        });
    let kind = prop_oneof![
        frame.clone().prop_map(|frame| EventKind::Call { frame }),
        frame.clone().prop_map(|frame| EventKind::Return {
            frame,
            first_line: 0
        }),
        (0i32..3).prop_map(|generation| EventKind::GcStart { generation }),
        any::<i64>().prop_map(|collected| EventKind::GcDone { collected }),
        (0u32..3).prop_map(|m| EventKind::ImportStart { module: StrId(m) }),
        (0u32..3, any::<bool>()).prop_map(|(m, found)| EventKind::ImportDone {
            module: StrId(m),
            found
        }),
        proptest::collection::vec((frame.clone(), 0u32..8), 0..6).prop_map(|frames| {
            EventKind::Sample {
                frames: frames
                    .into_iter()
                    .map(|(code, line)| WalkedFrame { code, line })
                    .collect(),
                state: SampleState::default(),
            }
        }),
        proptest::collection::vec((frame.clone(), 0u32..8), 0..6).prop_map(|frames| {
            EventKind::Running {
                frames: frames
                    .into_iter()
                    .map(|(code, line)| WalkedFrame { code, line })
                    .collect(),
            }
        }),
        any::<bool>().prop_map(|exact| EventKind::Window { exact }),
        Just(EventKind::ThreadExit),
        any::<u64>().prop_map(|count| EventKind::Lost { count }),
    ];
    (0u32..3, any::<u64>(), kind).prop_map(|(tid, ts_ns, kind)| Event { tid, ts_ns, kind })
}

proptest! {
    #[test]
    fn arbitrary_streams_never_panic(events in proptest::collection::vec(arb_event(), 0..200),
                                     end in proptest::option::of(any::<u64>()),
                                     python in prop_oneof![Just("3.9.2"), Just("3.11.2"), Just("3.15.0")]) {
        let header = Header {
            sample_interval_ns: u64::MAX / 3,
            python_version: python.into(),
            ..Header::default()
        };
        let strings: Vec<String> = ["__init__", "<module>", "a", "b"].iter().map(|s| s.to_string()).collect();
        let plan = plan_events(&header, &strings, &events);
        let mut replay = Replay::new(&header, plan);
        let mut agg = Aggregator::new(&header);
        let mut steps = Vec::new();
        for e in &events {
            steps.clear();
            let ts = replay.push(e, &mut steps);
            agg.push(e, ts, &steps, &replay);
        }
        let r = agg.finish(replay, end, |id| id.0.to_string());
        prop_assert_eq!(r.events, events.len() as u64);
        for f in &r.functions {
            prop_assert!(f.inclusive_ns >= f.exclusive_ns, "{:?}", f);
        }
    }
}

#[test]
fn cpython_311_returns_are_rows_of_functions_not_lines() {
    // Returns only: an unsampled generator returns from three lines, and an
    // exception thrown into it fires its entry at a yield line (31); two
    // same-named methods are told apart by the walker's first lines.
    let mut s = Script::new();
    for (ts, line) in [(10, 29), (20, 33), (30, 35)] {
        s.ret(ts, "walk", line);
    }
    s.call(40, "walk", 31).ret(41, "walk", 35);
    s.sample(50, &[("main", 1, 2), ("__init__", 10, 12)])
        .sample(60, &[("main", 1, 2), ("__init__", 20, 22)]);
    s.ret(51, "__init__", 12)
        .ret(61, "__init__", 23)
        .ret(62, "__init__", 23);
    let r = s.report_with(&header_of("3.11.2"), None);
    assert_eq!(r.source, FunctionSource::ReturnsOnly);
    let walk: Vec<_> = r
        .functions
        .iter()
        .filter(|f| f.function == "walk")
        .collect();
    assert_eq!(walk.len(), 1, "{walk:#?}");
    assert_eq!(walk[0].calls, Some(4));
    let init: Vec<(u32, Option<u64>)> = r
        .functions
        .iter()
        .filter(|f| f.function == "__init__")
        .map(|f| (f.line, f.calls))
        .collect();
    assert_eq!(init.len(), 2, "{init:?}");
    assert!(
        init.contains(&(10, Some(1))) && init.contains(&(20, Some(2))),
        "{init:?}"
    );
}

#[test]
fn returns_alone_from_a_paired_cpython_are_frames_that_were_running() {
    // Attached to 3.9 while handle -> work ran; they returned, nothing else ran:
    // no entry at all, yet not a returns-only (3.11) stream.
    let mut s = Script::new();
    let frames = s.walked(&[("serve", 10, 14), ("handle", 20, 23), ("work", 30, 31)]);
    s.push(5, EventKind::Running { frames })
        .ret(40, "work", 33)
        .ret(41, "handle", 25);
    let r = s.report_with(&header_of("3.9.2"), Some(100));
    assert_eq!(r.source, FunctionSource::Traced);
    let work = func(&r, "work");
    assert_eq!(
        (work.line, work.calls, work.inclusive_ns),
        (30, Some(1), 35)
    );
    let serve = func(&r, "serve");
    assert_eq!((serve.calls, serve.inclusive_ns), (Some(0), 95));
}

/// A parent (pid 10) and a worker it forked (pid 20, thread 21 started in it):
/// each process has its own rows, with shares of its own time; threads name their
/// process; the folded stacks start at their process.
#[test]
fn processes_have_their_own_rows_and_roots() {
    let header = Header {
        pid: 10,
        command_line: vec!["python3".into(), "pool.py".into()],
        mode: "sample".into(),
        sample_interval_ns: 10,
        ..Header::default()
    };
    let mut s = Script::new();
    s.tid = 10;
    for i in 0..4 {
        s.sample(i * 10, &[("main", 1, 2), ("parent_spin", 5, 6)]);
    }
    let command = s.id("python3 -c spawn_main");
    s.tid = 20;
    s.push(
        5,
        EventKind::ProcessStart {
            parent: 10,
            command,
        },
    );
    for i in 0..3 {
        s.sample(10 + i * 10, &[("worker_burn", 8, 9)]);
    }
    s.sample(40, &[("worker_burn", 8, 9), ("helper", 12, 13)]);
    s.tid = 21;
    s.push(41, EventKind::ThreadStart { pid: 20 });
    s.sample(45, &[("side", 15, 16)]);
    let r = s.report_with(&header, Some(50));
    let pids: Vec<(u32, Option<u32>)> = r.processes.iter().map(|p| (p.pid, p.parent)).collect();
    assert_eq!(pids, [(10, None), (20, Some(10))]);
    let (parent, worker) = (&r.processes[0], &r.processes[1]);
    assert_eq!(parent.command, "python3 pool.py");
    assert_eq!(worker.command, "python3 -c spawn_main");
    assert_eq!((parent.samples, worker.samples), (4, 5));
    assert_eq!((parent.threads, worker.threads), (1, 2));
    let names = |p: &ProcessStats| -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = p
            .functions
            .iter()
            .filter(|f| f.exclusive_ns > 0)
            .map(|f| (f.function.clone(), f.exclusive_ns))
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(parent), [("parent_spin".to_string(), 40)]);
    assert_eq!(
        names(worker),
        [
            ("helper".to_string(), 10),
            ("side".to_string(), 10),
            ("worker_burn".to_string(), 30)
        ]
    );
    assert_eq!((parent.own_ns, worker.own_ns), (40, 50));
    // The whole recording's rows are both processes' together.
    assert_eq!(func(&r, "worker_burn").inclusive_ns, 40);
    let pid_of = |tid: u32| r.threads.iter().find(|t| t.tid == tid).unwrap().pid;
    assert_eq!((pid_of(10), pid_of(20), pid_of(21)), (10, 20, 20));

    let folded = crate::analyze::folded::fold_events(&header, &s.strings, &s.events, Some(50));
    let mut roots = std::collections::BTreeMap::new();
    folded.for_each_stack(crate::analyze::folded::Measure::Samples, |path, v| {
        let root = match path[0] {
            crate::analyze::folded::FoldFrame::Process { pid, command } => (pid, command),
            other => panic!("a stack starting at {other:?}"),
        };
        *roots.entry(root).or_insert(0) += v;
    });
    assert_eq!(
        roots.into_iter().collect::<Vec<_>>(),
        [((10, None), 4), ((20, Some(command)), 5)]
    );
}

/// One process alone: no process frame at the root, as before processes were
/// recorded.
#[test]
fn a_single_process_has_no_process_root() {
    let mut s = Script::new();
    s.sample(0, &[("main", 1, 2)]);
    let header = Header {
        pid: 1,
        ..Header::default()
    };
    let folded = crate::analyze::folded::fold_events(&header, &s.strings, &s.events, None);
    folded.for_each_stack(crate::analyze::folded::Measure::Samples, |path, _| {
        assert!(matches!(
            path[0],
            crate::analyze::folded::FoldFrame::Python(_)
        ));
    });
    let r = s.report_with(&header, None);
    assert_eq!(r.processes.len(), 1);
    assert_eq!(r.processes[0].functions.len(), 1);
}

/// An exec ends the frames of the program it replaces: timed to there, not
/// counted as calls, and the new program's calls start afresh.
#[test]
fn exec_ends_the_old_programs_frames() {
    let mut s = Script::new();
    let command = s.id("python3 other.py");
    s.call(0, "main", 1).call(10, "old_work", 5);
    s.push(30, EventKind::Exec { command });
    s.call(40, "new_main", 1).ret(60, "new_main", 3);
    let r = s.report_with(&Header::default(), Some(70));
    assert_eq!(func(&r, "old_work").inclusive_ns, 20);
    assert_eq!(func(&r, "old_work").calls, Some(0));
    assert_eq!(func(&r, "main").inclusive_ns, 30);
    assert_eq!(func(&r, "new_main").calls, Some(1));
    assert_eq!(r.anomalies.replay.open_at_end, 0);
    assert_eq!(r.processes[0].command, "python3 other.py");
}

#[test]
fn a_function_without_a_name_is_named_alike_in_the_report_and_the_flame_graph() {
    let mut s = Script::new();
    s.call(0, "main", 1)
        .call(10, "", 3)
        .ret(20, "", 4)
        .ret(30, "main", 2);
    let r = s.report();
    let row = r.functions.iter().find(|f| f.line == 3).expect("row");
    assert_eq!(row.qualname, crate::recording::UNNAMED);
    let frame = s.frame("", 3);
    let names = crate::output::names::FrameNames::new(&s.strings, true);
    assert_eq!(
        names.python(&frame),
        format!("{} (/app/main.py:3)", row.qualname)
    );
}

/// A replay made while the recording is written needs the cost per event from
/// its first call: the costs are settled only once calls were traced, and each
/// process that made them has its gaps measured.
#[test]
fn the_costs_are_settled_only_once_calls_were_traced_and_measured() {
    use super::replay::Planner;
    let mut planner = Planner::new(&header_of("3.13.5"));
    // Nothing traced yet: not "every process of none".
    assert!(!planner.costs_settled());
    planner.push(
        &Event {
            tid: 1,
            ts_ns: 10,
            kind: EventKind::ThreadStart { pid: 0 },
        },
        &[],
    );
    assert!(!planner.costs_settled());
    let frame = FrameRef {
        file: StrId(0),
        function: StrId(0),
        line: 1,
    };
    let mut ts = 100;
    for i in 0..(1u64 << 21) + 2 {
        let kind = if i % 2 == 0 {
            EventKind::Call { frame }
        } else {
            EventKind::Return {
                frame,
                first_line: 1,
            }
        };
        planner.push(
            &Event {
                tid: 1,
                ts_ns: ts,
                kind,
            },
            &["f".to_owned()],
        );
        ts += if i % 50 == 0 { 30 } else { 90 };
        if i == 10 {
            assert!(!planner.costs_settled(), "settled after a few gaps");
        }
    }
    assert!(planner.costs_settled());
}
