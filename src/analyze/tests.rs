//! Hand-made event sequences with known answers.

use proptest::prelude::*;

use super::*;
use crate::record::{Event, EventKind, FrameRef, Header, StrId};

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
        let frame = self.frame(name, line);
        self.push(ts, EventKind::Return { frame })
    }

    fn sample(&mut self, ts: u64, stack: &[(&str, u32)]) -> &mut Self {
        let frames = stack.iter().map(|&(n, l)| self.frame(n, l)).collect();
        self.push(ts, EventKind::Sample { frames })
    }

    fn report_with(&self, header: &Header, end: Option<u64>) -> Report {
        let mut agg = Aggregator::new(header);
        for e in &self.events {
            agg.push(e);
        }
        agg.finish(end, |id| {
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

fn func<'a>(r: &'a Report, name: &str) -> &'a FunctionStats {
    r.functions
        .iter()
        .find(|f| f.function == name)
        .unwrap_or_else(|| panic!("no {name} in {:#?}", r.functions))
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
fn generator_resumes_are_calls() {
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
    assert_eq!(r.anomalies.resyncs, 0);
}

#[test]
fn attach_mid_call_counts_orphan_returns() {
    let mut s = Script::new();
    // Attached inside outer -> inner: their returns come with an empty stack.
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
    for name in ["inner", "outer"] {
        let f = func(&r, name);
        assert_eq!((f.calls, f.inclusive_ns, f.exclusive_ns), (Some(1), 0, 0));
    }
    assert_eq!(r.anomalies.orphan_returns, 2);
    assert_eq!(r.duration_ns, 45);
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
fn unpaired_entries_resync_like_cpython_315() {
    let mut s = Script::new();
    // main creates a generator (entry without return), calls work, and a
    // specialised call returns without entry.
    s.call(0, "main", 1)
        .call(10, "gen", 5)
        .call(20, "work", 8)
        .ret(30, "work", 8)
        .ret(35, "special", 12)
        .ret(50, "main", 1);
    let r = s.report();
    let gen = func(&r, "gen");
    assert_eq!(gen.calls, Some(1));
    assert_eq!(gen.inclusive_ns, 40, "ended at main's return");
    assert_eq!(gen.exclusive_ns, 30);
    assert_eq!(func(&r, "main").inclusive_ns, 50);
    assert_eq!(func(&r, "main").exclusive_ns, 10);
    assert_eq!(func(&r, "special").calls, Some(1));
    assert_eq!(r.anomalies.resyncs, 1);
    assert_eq!(r.anomalies.unpaired_entries, 1);
    assert_eq!(r.anomalies.orphan_returns, 1);
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
    s.sample(5, &[("main", 2), ("tick", 4)]);
    s.sample(15, &[("main", 2), ("tick", 5)]);
    s.sample(25, &[("main", 2)]);
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
}

#[test]
fn sample_mode_estimates_from_samples() {
    let mut s = Script::new();
    s.sample(0, &[("main", 10), ("fib", 4), ("fib", 5), ("fib", 4)])
        .sample(1, &[("main", 10), ("fib", 6)])
        .sample(2, &[("main", 11)])
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
    assert_eq!(fib.line, 4, "smallest sampled line");
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
    s.push(1_000, EventKind::ThreadStart)
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
            ThreadStats { tid: 1, events: 4 },
            ThreadStats { tid: 9, events: 2 }
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
    assert_eq!(r.anomalies.open_at_end, 2);
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
        .sample(150, &[("main", 3), ("work", 7)])
        .sample(250, &[("main", 3), ("work", 7)])
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
    // Four exact calls ended (two, the orphan return, one more); 60 ns exact
    // (20 + 20 + 20) plus two samples of 100 ns.
    assert_eq!(work.calls, Some(4));
    assert_eq!(work.exclusive_ns, 60 + 200);
    assert_eq!(work.samples, 2);
    assert_eq!(work.line, 5, "sampled time lands on the traced row");
    let main = func(&r, "main");
    // main was cut at 100 (open, not a call): 100 ns exact, 40 of it in work; the
    // samples (leaf work) add 200 inclusive.
    assert_eq!(main.calls, Some(0));
    assert_eq!((main.inclusive_ns, main.exclusive_ns), (100 + 200, 60));
    assert_eq!(r.anomalies.open_at_end, 0, "a window cut is not an anomaly");
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
        .sample(50, &[("main", 2)])
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
    assert_eq!(r.anomalies.depth_overflows, 100);
    assert_eq!(r.anomalies.orphan_returns, 0);
}

#[test]
fn unknown_strings_resolve_to_placeholders() {
    let mut s = Script::new();
    let bogus = FrameRef {
        file: StrId(999),
        function: StrId(998),
        line: 1,
    };
    s.push(0, EventKind::Call { frame: bogus })
        .push(1, EventKind::Return { frame: bogus });
    let r = s.report();
    assert_eq!(r.functions[0].function, "<unknown #998>");
}

#[test]
fn stack_tracker_reports_each_end() {
    let f = |n: u32| FrameRef {
        file: StrId(0),
        function: StrId(n),
        line: n,
    };
    let mut t = StackTracker::new();
    let mut out = Vec::new();
    t.call(1, f(1), 0);
    t.call(1, f(2), 5);
    assert_eq!(t.depth(1), 2);
    assert_eq!(t.frames(1).collect::<Vec<_>>(), vec![f(1), f(2)]);
    t.ret(1, f(1), 9, &mut out);
    assert_eq!(
        out,
        vec![
            Ended::Timed {
                frame: f(2),
                inclusive_ns: 4,
                exclusive_ns: 4,
                outermost: true,
                kind: EndKind::Unpaired
            },
            Ended::Timed {
                frame: f(1),
                inclusive_ns: 9,
                exclusive_ns: 5,
                outermost: true,
                kind: EndKind::Returned
            },
        ]
    );
    out.clear();
    // Timestamps going backwards never make negative (wrapped) times.
    t.call(2, f(3), 100);
    t.ret(2, f(3), 50, &mut out);
    assert!(matches!(
        out[0],
        Ended::Timed {
            inclusive_ns: 0,
            ..
        }
    ));
    assert_eq!(t.counters().resyncs, 1);
}

fn arb_event() -> impl Strategy<Value = Event> {
    let frame = (0u32..4, 0u32..4, 0u32..4).prop_map(|(a, b, l)| FrameRef {
        file: StrId(a),
        function: StrId(b),
        line: l,
    });
    let kind = prop_oneof![
        frame.clone().prop_map(|frame| EventKind::Call { frame }),
        frame.clone().prop_map(|frame| EventKind::Return { frame }),
        (0i32..3).prop_map(|generation| EventKind::GcStart { generation }),
        any::<i64>().prop_map(|collected| EventKind::GcDone { collected }),
        (0u32..3).prop_map(|m| EventKind::ImportStart { module: StrId(m) }),
        (0u32..3, any::<bool>()).prop_map(|(m, found)| EventKind::ImportDone {
            module: StrId(m),
            found
        }),
        proptest::collection::vec(frame, 0..6).prop_map(|frames| EventKind::Sample { frames }),
        Just(EventKind::ThreadExit),
        any::<u64>().prop_map(|count| EventKind::Lost { count }),
    ];
    (0u32..3, any::<u64>(), kind).prop_map(|(tid, ts_ns, kind)| Event { tid, ts_ns, kind })
}

proptest! {
    #[test]
    fn arbitrary_streams_never_panic(events in proptest::collection::vec(arb_event(), 0..200),
                                     end in proptest::option::of(any::<u64>())) {
        let header = Header { sample_interval_ns: u64::MAX / 3, ..Header::default() };
        let mut agg = Aggregator::new(&header);
        for e in &events {
            agg.push(e);
        }
        let r = agg.finish(end, |id| id.0.to_string());
        prop_assert_eq!(r.events, events.len() as u64);
    }
}
