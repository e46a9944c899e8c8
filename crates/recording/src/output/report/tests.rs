use serde_json::Value;

use super::*;
use crate::analyze::{
    AuditCount, FunctionSource, FunctionStats, GcStats, Histogram, ImportStats, ProcessStats,
    Report, SampleFilter, Target, ThreadStats,
};
use crate::recording::{
    Event, EventKind, FrameRef, Header, RecordingReader, RecordingWriter, SampleState, WalkedFrame,
};

fn function(name: &str, file: &str, calls: Option<u64>, incl: u64, excl: u64) -> FunctionStats {
    FunctionStats {
        function: name.into(),
        qualname: name.into(),
        file: file.into(),
        line: 3,
        calls,
        resumes: calls.map(|_| 0),
        inclusive_ns: incl,
        exclusive_ns: excl,
        samples: 0,
    }
}

fn sample_report() -> Report {
    let mut histogram = Histogram::default();
    histogram.record(40_000);
    histogram.record(90_000);
    let import = |module: &str, importer: Option<&str>, total_ns: u64, found: bool| ImportStats {
        module: module.into(),
        found,
        total_ns,
        self_ns: total_ns / 2,
        count: 1,
        importer: importer.map(str::to_string),
    };
    Report {
        target: Target {
            pid: 1234,
            python: "3.9.2".into(),
            executable: "/usr/bin/python3.9".into(),
        },
        mode: "trace".into(),
        duration_ns: 2_000_000_000,
        events: 999,
        functions: vec![
            function("main", "/app/main.py", Some(1), 1_900_000_000, 100_000),
            function(
                "fib",
                "/app/fib.py",
                Some(196_418),
                1_500_000_000,
                1_500_000_000,
            ),
            function(
                "loads",
                "/usr/lib/python3.9/json/__init__.py",
                Some(7),
                300_000,
                2_000,
            ),
        ],
        gc: vec![GcStats {
            generation: 0,
            collections: 2,
            collected: 3400,
            total_ns: 130_000,
            max_ns: 90_000,
            histogram,
            triggers: vec![],
        }],
        imports: vec![
            import("app", None, 800_000, true),
            import("json", Some("app"), 500_000, true),
            import("ujson", Some("app"), 1_000, false),
            import("json.decoder", Some("json"), 200_000, true),
        ],
        audit: vec![AuditCount {
            event: "open".into(),
            count: 3,
            stacks: vec![],
        }],
        threads: vec![ThreadStats {
            tid: 1234,
            events: 999,
            ..ThreadStats::default()
        }],
        ..Report::default()
    }
}

/// The object's keys, sorted (`serde_json::Value` sorts them).
fn keys(v: &Value) -> Vec<&str> {
    v.as_object().unwrap().keys().map(String::as_str).collect()
}

/// Whether `v` has all of `expected` (and perhaps more).
fn has_keys(v: &Value, expected: &[&str]) -> bool {
    let have = keys(v);
    expected.iter().all(|k| have.contains(k))
}

#[test]
fn json_follows_the_schema() {
    let text = render_json(&sample_report());
    let doc: Value = serde_json::from_str(&text).unwrap();
    let schema = [
        "pyprobe_version",
        "format",
        "target",
        "mode",
        "duration_ns",
        "lost_events",
        "functions",
        "gc",
        "imports",
        "audit",
        "threads",
    ];
    // Top-level keys of the pretty output are indented by two spaces; the
    // schema's come first, in its order.
    let top: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("  \""))
        .filter_map(|l| l.split('"').next())
        .collect();
    assert_eq!(top[..schema.len()], schema, "schema keys first, in order");
    assert_eq!(doc["pyprobe_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(doc["format"], 1);
    assert!(has_keys(&doc["target"], &["pid", "python", "executable"]));
    assert_eq!(doc["target"]["pid"], 1234);
    assert_eq!(doc["mode"], "trace");
    assert_eq!(doc["duration_ns"], 2_000_000_000u64);
    let f = &doc["functions"][1];
    let function_keys = [
        "function",
        "file",
        "line",
        "calls",
        "inclusive_ns",
        "exclusive_ns",
        "samples",
    ];
    assert!(has_keys(f, &function_keys));
    assert_eq!(f["function"], "fib");
    assert_eq!(f["calls"], 196_418);
    let gc = &doc["gc"][0];
    assert!(has_keys(
        gc,
        &[
            "generation",
            "collections",
            "collected",
            "total_ns",
            "max_ns"
        ]
    ));
    assert_eq!(gc["histogram"].as_array().unwrap().len(), 2);
    let imp = &doc["imports"][1];
    assert!(has_keys(imp, &["module", "found", "total_ns", "count"]));
    assert_eq!(imp["importer"], "app");
    assert!(has_keys(&doc["audit"][0], &["event", "count"]));
    assert!(has_keys(&doc["threads"][0], &["tid", "events"]));
    assert!(doc["truncated_at"].is_null());
}

#[test]
fn several_processes_have_sections_of_their_own() {
    let mut r = sample_report();
    r.processes = vec![
        ProcessStats {
            pid: 1234,
            command: "/usr/bin/python3 pool.py".into(),
            threads: 1,
            own_ns: 2_000_000_000,
            functions: vec![function(
                "main",
                "/app/main.py",
                None,
                2_000_000_000,
                2_000_000_000,
            )],
            ..ProcessStats::default()
        },
        ProcessStats {
            pid: 1240,
            parent: Some(1234),
            command: "/usr/bin/python3 -c spawn_main".into(),
            threads: 1,
            own_ns: 400_000_000,
            functions: vec![
                function(
                    "worker_burn",
                    "/app/pool.py",
                    None,
                    400_000_000,
                    300_000_000,
                ),
                function(
                    "recv",
                    "/usr/lib/python3.9/x.py",
                    None,
                    100_000_000,
                    100_000_000,
                ),
            ],
            ..ProcessStats::default()
        },
    ];
    r.threads.push(ThreadStats {
        tid: 1240,
        pid: 1240,
        events: 5,
        ..ThreadStats::default()
    });
    let t = render_table(&r, 100);
    assert!(t.contains("\nProcesses (2): "), "{t}");
    assert!(
        t.lines().any(|l| l.trim_start().starts_with("1240")
            && l.contains("1234")
            && l.ends_with("python3 -c spawn_main")),
        "{t}"
    );
    let section = t
        .split("\nFunctions of process 1240 (python3 -c spawn_main)")
        .nth(1)
        .unwrap_or_else(|| panic!("{t}"));
    let burn = section.lines().find(|l| l.contains("worker_burn")).unwrap();
    assert!(
        burn.contains("75.0%"),
        "a share of the worker's own time: {burn}"
    );
    assert!(t.contains("       tid         pid      events"), "{t}");
    let doc: Value = serde_json::from_str(&render_json(&r)).unwrap();
    let worker = &doc["processes"][1];
    assert_eq!(worker["parent"], 1234);
    assert_eq!(worker["functions"][0]["function"], "worker_burn");
    assert_eq!(worker["functions"][0]["share"], 0.75);
    assert_eq!(doc["processes"][0]["parent"], Value::Null);
    assert_eq!(doc["threads"][1]["pid"], 1240);
    // The options shape each process's rows too.
    let limited = ReportOptions {
        limit: Some(1),
        sort: SortKey::Exclusive,
        ..ReportOptions::default()
    }
    .apply(&r)
    .unwrap();
    assert_eq!(limited.processes[1].functions.len(), 1);
}

#[test]
fn json_calls_are_null_when_sampled() {
    let mut r = sample_report();
    r.mode = "auto".into();
    r.source = FunctionSource::Sampled;
    for f in &mut r.functions {
        f.calls = None;
    }
    let doc: Value = serde_json::from_str(&render_json(&r)).unwrap();
    assert!(doc["functions"][0]["calls"].is_null());
    assert_eq!(doc["mode"], "sample");
    assert_eq!(doc["source"], "sampled");
}

#[test]
fn units() {
    assert_eq!(format_ns(0), "0 ns");
    assert_eq!(format_ns(999), "999 ns");
    assert_eq!(format_ns(1_000), "1.00 µs");
    assert_eq!(format_ns(12_345), "12.3 µs");
    assert_eq!(format_ns(456_000_000), "456 ms");
    assert_eq!(format_ns(1_200_000_000), "1.20 s");
    assert_eq!(format_ns(u64::MAX), "18446744074 s");
}

#[test]
fn table_has_every_section() {
    let t = render_table(&sample_report(), 100);
    assert!(
        t.starts_with("pid 1234, python 3.9.2, mode trace, duration 2.00 s, 999 events, 0 lost\n"),
        "{t}"
    );
    let fib = t.lines().find(|l| l.contains("fib ")).unwrap();
    assert!(
        fib.contains("196418") && fib.contains("1.50 s") && fib.contains("75.0%"),
        "{fib}"
    );
    // Paths from their package's root, unless asked whole.
    assert!(fib.ends_with("  app/fib.py:3"), "{fib}");
    let whole = render_table_paths(&sample_report(), 100, true);
    let fib = whole.lines().find(|l| l.contains("fib ")).unwrap();
    assert!(fib.ends_with("  /app/fib.py:3"), "{fib}");
    assert!(t.contains("\nGC\n"));
    assert!(t.contains("90.0 µs"));
    assert!(
        t.lines()
            .any(|l| l.trim_start().starts_with("≥ 32.8 µs") && l.contains("# 1")),
        "{t}"
    );
    // json.decoder nests under json, which nests under app; slowest first.
    let lines: Vec<&str> = t.lines().collect();
    let at = |m: &str| {
        lines
            .iter()
            .position(|l| l.ends_with(m))
            .unwrap_or_else(|| panic!("{m}: {t}"))
    };
    assert!(at("  app") < at("    json") && at("    json") < at("      json.decoder"));
    assert!(at("      json.decoder") < at("    ujson (not found)"));
    assert!(t.contains("\nAudit events\n") && t.contains("        3  open"));
    assert!(t.contains("\nThreads\n") && t.contains("      1234         999"));
    for line in t.lines() {
        assert!(line.chars().count() <= 100, "too wide: {line}");
    }
}

#[test]
fn table_fits_narrow_widths_and_survives_import_cycles() {
    let mut r = sample_report();
    r.functions[0].function = "a_very_long_function_name_".repeat(10);
    r.functions[0].file = "/deep/".repeat(40) + "x.py";
    r.imports[0].importer = Some("json.decoder".into());
    r.truncated_at = Some(4096);
    let t = render_table_paths(&r, 80, true);
    assert!(t.contains("cut short at offset 4096"));
    assert!(t.contains("…"));
    assert_eq!(t.matches("json.decoder").count(), 1);
    assert!(t.lines().any(|l| l.ends_with(" app")));
}

#[test]
fn options_sort_limit_and_filter() {
    let r = sample_report();
    let names = |o: ReportOptions| -> Vec<String> {
        o.apply(&r)
            .unwrap()
            .functions
            .into_iter()
            .map(|f| f.function)
            .collect()
    };
    assert_eq!(names(ReportOptions::default()), ["main", "fib", "loads"]);
    let by = |sort: &str| ReportOptions {
        sort: sort.parse().unwrap(),
        ..ReportOptions::default()
    };
    assert_eq!(names(by("exclusive")), ["fib", "main", "loads"]);
    assert_eq!(names(by("calls")), ["fib", "loads", "main"]);
    assert!("bogus".parse::<SortKey>().is_err());
    let limited = ReportOptions {
        limit: Some(1),
        ..by("calls")
    };
    assert_eq!(names(limited), ["fib"]);
    let only_app = ReportOptions {
        include: vec!["/app/*".into()],
        exclude: vec!["main.py".into()],
        ..ReportOptions::default()
    };
    assert_eq!(names(only_app), ["fib"]);
    let bad = ReportOptions {
        include: vec!["[".into()],
        ..ReportOptions::default()
    };
    assert!(bad.apply(&r).is_err());
}

fn record(cut: Option<usize>) -> Report {
    let mut buf = Vec::new();
    let header = Header {
        pid: 77,
        python_version: "3.9.2".into(),
        start_ns: 1_000,
        ..Header::default()
    };
    let mut w = RecordingWriter::new(&mut buf, &header).unwrap();
    let file = w.intern("/app/fib.py");
    let fib = w.intern("fib");
    let frame = FrameRef {
        file,
        function: fib,
        line: 3,
    };
    for i in 0..100u64 {
        let kind = if i % 2 == 0 {
            EventKind::Call { frame }
        } else {
            EventKind::Return {
                frame,
                first_line: 0,
            }
        };
        w.write(&Event {
            tid: 77,
            ts_ns: 1_000 + i * 10,
            kind,
        })
        .unwrap();
    }
    w.write(&Event {
        tid: 77,
        ts_ns: 2_000,
        kind: EventKind::Lost { count: 2 },
    })
    .unwrap();
    w.finish(3_000).unwrap();
    let bytes = std::io::Cursor::new(&buf[..cut.unwrap_or(buf.len())]);
    let mut reader = RecordingReader::from_reader(bytes).unwrap();
    build_report(&mut reader).unwrap()
}

/// A sampled recording: thread 1 in `burn` on a CPU holding the GIL (6 samples),
/// thread 2 in `nap` waiting (3), thread 3 in `hash` on a CPU without the GIL (1).
fn sampled_with_states() -> Vec<u8> {
    let mut buf = Vec::new();
    let header = Header {
        pid: 1,
        mode: "sample".into(),
        sample_interval_ns: 10_000_000,
        ..Header::default()
    };
    let mut w = RecordingWriter::new(&mut buf, &header).unwrap();
    let file = w.intern("/app/x.py");
    let mut sample = |tid: u32, ts: u64, name: &str, on_cpu: bool, gil: bool| {
        let function = w.intern(name);
        let code = FrameRef {
            file,
            function,
            line: 1,
        };
        w.write(&Event {
            tid,
            ts_ns: ts,
            kind: EventKind::Sample {
                frames: vec![WalkedFrame { code, line: 2 }],
                state: SampleState {
                    on_cpu: Some(on_cpu),
                    holds_gil: Some(gil),
                },
            },
        })
        .unwrap();
    };
    for i in 0..6 {
        sample(1, 1_000 + i * 10_000_000, "burn", true, true);
    }
    for i in 0..3 {
        sample(2, 2_000 + i * 10_000_000, "nap", false, false);
    }
    sample(3, 3_000, "hash", true, false);
    w.finish(60_000_000).unwrap();
    buf
}

#[test]
fn samples_are_filtered_by_thread_state_and_the_report_says_so() {
    let buf = sampled_with_states();
    let report = |filter: SampleFilter| {
        let mut reader = RecordingReader::from_reader(std::io::Cursor::new(&buf[..])).unwrap();
        build_report_filtered(&mut reader, filter).unwrap()
    };
    let samples = |r: &Report| -> Vec<(String, u64)> {
        r.functions
            .iter()
            .map(|f| (f.function.clone(), f.samples))
            .collect()
    };
    let on_cpu = report(SampleFilter::default());
    assert_eq!(
        samples(&on_cpu),
        [("burn".to_string(), 6), ("hash".to_string(), 1)]
    );
    let t = render_table(&on_cpu, 120);
    assert!(
        t.contains("idle samples left out: 3 of 10; --idle includes them"),
        "{t}"
    );
    // Percentages are of the samples kept: 6 of 7.
    assert!(
        t.lines().any(|l| l.contains("burn") && l.contains("85.7%")),
        "{t}"
    );
    let doc: Value = serde_json::from_str(&render_json(&on_cpu)).unwrap();
    let f = &doc["sample_filter"];
    assert_eq!(
        (f["idle"].as_bool(), f["gil"].as_bool()),
        (Some(false), Some(false))
    );
    assert_eq!(
        (
            f["samples"].as_u64(),
            f["kept"].as_u64(),
            f["idle_left_out"].as_u64()
        ),
        (Some(10), Some(7), Some(3))
    );

    let idle = report(SampleFilter {
        idle: true,
        gil: false,
    });
    assert_eq!(samples(&idle).len(), 3);
    assert!(render_table(&idle, 120).contains("--idle); 10 counted"));

    let gil = report(SampleFilter {
        idle: false,
        gil: true,
    });
    assert_eq!(samples(&gil), [("burn".to_string(), 6)]);
    let t = render_table(&gil, 120);
    assert!(t.contains("not holding the GIL left out: 1 of 10"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.contains("burn") && l.contains("100.0%")),
        "{t}"
    );
}

#[test]
fn report_from_a_recording() {
    let r = record(None);
    assert_eq!(r.target.pid, 77);
    assert_eq!(r.duration_ns, 2_000);
    assert_eq!(r.lost_events, 2);
    assert_eq!(r.truncated_at, None);
    let fib = &r.functions[0];
    assert_eq!(
        (fib.function.as_str(), fib.calls, fib.inclusive_ns),
        ("fib", Some(50), 500)
    );
    // Cut before the trailer: still a report, flagged as cut short.
    let cut = record(Some(60));
    assert!(cut.truncated_at.is_some());
}

#[test]
fn a_thread_report_counts_that_threads_samples_alone_and_names_every_thread() {
    let buf = sampled_with_states();
    let of = |thread| {
        let mut reader = RecordingReader::from_reader(std::io::Cursor::new(&buf[..])).unwrap();
        crate::analyze::report::build_thread_report(&mut reader, SampleFilter::default(), thread)
            .unwrap()
    };
    let samples = |r: &Report| -> Vec<(String, u64)> {
        r.functions
            .iter()
            .map(|f| (f.function.clone(), f.samples))
            .collect()
    };
    assert_eq!(
        samples(&of(None)),
        [("burn".to_string(), 6), ("hash".to_string(), 1)]
    );
    let third = of(Some(3));
    assert_eq!(samples(&third), [("hash".to_string(), 1)]);
    assert_eq!(third.samples.kept, 1);
    let tids: Vec<u32> = third.threads.iter().map(|t| t.tid).collect();
    assert_eq!(tids, [1, 2, 3]);
    let top = crate::output::top::snapshot_between(None, &third);
    assert_eq!(top.threads, [1, 2, 3]);
    assert_eq!(top.samples, 1);
    // A thread without samples on a CPU: nothing counted, nothing made up, and the
    // recording still a sampled one.
    let waiting = of(Some(2));
    assert!(samples(&waiting).is_empty());
    assert_eq!(waiting.source, FunctionSource::Sampled);
}

#[test]
fn a_thread_report_counts_that_threads_exact_calls_alone() {
    let mut buf = Vec::new();
    let header = Header {
        pid: 5,
        mode: "trace".into(),
        ..Header::default()
    };
    let mut w = RecordingWriter::new(&mut buf, &header).unwrap();
    let file = w.intern("/app/calls.py");
    let mut ts = 1_000;
    // Thread 5 calls `a` 3 times, thread 6 calls `b` 2 times, interleaved.
    for (tid, name, times) in [(5, "a", 3), (6, "b", 2), (5, "a", 0)] {
        let frame = FrameRef {
            file,
            function: w.intern(name),
            line: 1,
        };
        for _ in 0..times {
            for kind in [
                EventKind::Call { frame },
                EventKind::Return {
                    frame,
                    first_line: 1,
                },
            ] {
                ts += 100;
                w.write(&Event {
                    tid,
                    ts_ns: ts,
                    kind,
                })
                .unwrap();
            }
        }
    }
    w.finish(ts + 100).unwrap();
    let of = |thread| {
        let mut reader = RecordingReader::from_reader(std::io::Cursor::new(&buf[..])).unwrap();
        crate::analyze::report::build_thread_report(&mut reader, SampleFilter::default(), thread)
            .unwrap()
    };
    let calls = |r: &Report| -> Vec<(String, Option<u64>)> {
        let mut rows: Vec<_> = r
            .functions
            .iter()
            .map(|f| (f.function.clone(), f.calls))
            .collect();
        rows.sort();
        rows
    };
    assert_eq!(
        calls(&of(None)),
        [("a".to_string(), Some(3)), ("b".to_string(), Some(2))]
    );
    assert_eq!(calls(&of(Some(6))), [("b".to_string(), Some(2))]);
    assert_eq!(calls(&of(Some(5))), [("a".to_string(), Some(3))]);
}

#[test]
fn long_sections_are_cut_with_what_was_left_out_counted() {
    let mut r = sample_report();
    r.return_types = vec![crate::analyze::ReturnTypes {
        file: "/usr/lib/python3/dist-packages/sympy/core/sympify.py".into(),
        function: "sympify".into(),
        line: 124,
        returned: (0..8)
            .map(|i| crate::analyze::TypeCount {
                type_name: format!("T{i}"),
                count: 100 - i,
            })
            .collect(),
        raised: 3,
    }];
    let base = r.imports[0].clone();
    r.imports = (0..25)
        .map(|i| crate::analyze::ImportStats {
            module: format!("m{i:02}"),
            importer: None,
            ..base.clone()
        })
        .collect();
    let t = render_table(&r, 120);
    let line = t
        .lines()
        .find(|l| l.starts_with("Return types for 'sympify'"))
        .unwrap_or_else(|| panic!("{t}"));
    assert_eq!(
        line,
        "Return types for 'sympify' (sympy/core/sympify.py:124): T0 100, T1 99, T2 98, T3 97, \
         T4 96, … 3 more types (282 returns), raised 3"
    );
    assert!(t.contains("m19") && !t.contains("m20"), "{t}");
    assert!(
        t.contains("… 5 more modules (--format json lists every one)"),
        "{t}"
    );
}

#[test]
fn audit_call_sites_raising_from_one_line_are_one_row() {
    let mut r = sample_report();
    let stack = |outer: &str, leaf: &str, count| crate::analyze::RaisingStack {
        frames: vec![outer.into(), leaf.into()],
        count,
    };
    let site = |n: u32| format!("read (/srv/app/lib/python3.11/site-packages/pkg/io.py:{n})");
    r.audit[0].stacks = vec![
        stack("a (/srv/app/main.py:1)", &site(10), 5),
        stack("b (/srv/app/main.py:2)", &site(10), 4),
        stack("c (/srv/app/main.py:3)", &site(20), 6),
        stack("d (/srv/app/main.py:4)", &site(30), 2),
        stack("e (/srv/app/main.py:5)", &site(40), 1),
        stack("f (/srv/app/main.py:6)", &site(50), 1),
    ];
    let t = render_table(&r, 120);
    let rows: Vec<&str> = t
        .lines()
        .skip_while(|l| !l.ends_with("open"))
        .skip(1)
        .take(4)
        .collect();
    assert_eq!(
        rows,
        [
            "       ×9  from read (pkg/io.py:10)",
            "       ×6  from read (pkg/io.py:20)",
            "       ×2  from read (pkg/io.py:30)",
            "       ×2  … 2 more call sites",
        ],
        "{t}"
    );
}
