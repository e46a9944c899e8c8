//! `docs/report.schema.json` describes `pyprobe report --format json` exactly:
//! a report with every section filled conforms, and one with a field missing, of
//! the wrong type, or unknown to the schema does not (so the check every test
//! makes of the reports it reads can fail).

use crate::support::{assert_report_schema, report_schema_errors};
use pyprobe_recording::analyze::{
    AuditCount, ExactWindows, FunctionStats, GcStats, Histogram, ImportStats, ProcessStats,
    RaisingStack, Report, ReturnTypes, Target, Thinned, ThreadStats, Trigger, TypeCount,
};
use pyprobe_recording::output::report::render_json;
use serde_json::{json, Value};

/// A report with every list non-empty and every nullable field set.
fn full_report() -> Report {
    let mut histogram = Histogram::default();
    histogram.record(1_500);
    let mut r = Report {
        target: Target {
            pid: 4242,
            python: "3.13.1".into(),
            executable: "/usr/bin/python3.13".into(),
        },
        mode: "auto".into(),
        sample_interval_ns: 1_000_000,
        duration_ns: 2_000_000_000,
        events: 100,
        lost_events: 3,
        functions: vec![FunctionStats {
            function: "fib".into(),
            qualname: "fib".into(),
            file: "fib.py".into(),
            line: 1,
            calls: Some(10),
            resumes: Some(4),
            inclusive_ns: 500,
            exclusive_ns: 400,
            samples: 2,
        }],
        gc: vec![GcStats {
            generation: 0,
            collections: 1,
            collected: 7,
            total_ns: 1_500,
            max_ns: 1_500,
            histogram,
            triggers: vec![Trigger {
                function: "fib".into(),
                file: "fib.py".into(),
                line: 3,
                count: 1,
            }],
        }],
        imports: vec![ImportStats {
            module: "json.decoder".into(),
            found: true,
            total_ns: 900,
            self_ns: 800,
            count: 1,
            importer: Some("json".into()),
        }],
        audit: vec![AuditCount {
            event: "open".into(),
            count: 2,
            stacks: vec![RaisingStack {
                frames: vec!["main (app.py:9)".into(), "load (app.py:4)".into()],
                count: 2,
            }],
        }],
        threads: vec![ThreadStats {
            tid: 4242,
            pid: 4242,
            events: 100,
            traced_ns: 1_000,
            exclusive_ns: 900,
            tracing_cost_ns: 50,
        }],
        processes: vec![
            ProcessStats {
                pid: 4242,
                command: "python3.13 app.py".into(),
                threads: 1,
                samples: 2,
                duration_ns: 2_000,
                own_ns: 400,
                ..ProcessStats::default()
            },
            ProcessStats {
                pid: 4250,
                parent: Some(4242),
                command: "python3.13 app.py".into(),
                threads: 1,
                samples: 2,
                duration_ns: 1_000,
                own_ns: 400,
                event_cost_ns: 50,
                tracing_cost_ns: 150,
                functions: vec![FunctionStats {
                    function: "work".into(),
                    qualname: "Job.work".into(),
                    file: "app.py".into(),
                    line: 5,
                    calls: None,
                    resumes: None,
                    inclusive_ns: 400,
                    exclusive_ns: 400,
                    samples: 2,
                }],
            },
        ],
        truncated_at: Some(4096),
        exact_windows: Some(ExactWindows {
            exact_ns: 1_000_000_000,
            windows: 4,
        }),
        thinned: Some(Thinned {
            events: 5,
            thinned_ns: 10_000,
            audits_counted: 6,
            uncounted_ns: 0,
        }),
        return_types: vec![ReturnTypes {
            function: "fib".into(),
            file: "fib.py".into(),
            line: 1,
            returned: vec![TypeCount {
                type_name: "int".into(),
                count: 9,
            }],
            raised: 1,
        }],
        ..Report::default()
    };
    r.samples.samples = 2;
    r.samples.kept = 2;
    r
}

fn doc(report: &Report) -> Value {
    serde_json::from_str(&render_json(report)).expect("the report is JSON")
}

/// Fails unless the schema rejects `doc`, naming `what` was wrong.
fn assert_rejected(doc: &Value, what: &str) {
    assert!(
        !report_schema_errors(doc).is_empty(),
        "the schema accepts a report with {what}"
    );
}

#[test]
fn full_and_empty_reports_conform() {
    let full = doc(&full_report());
    // Every section is filled, so every nested object was checked.
    for key in [
        "functions",
        "gc",
        "imports",
        "audit",
        "threads",
        "processes",
        "return_types",
    ] {
        assert!(!full[key].as_array().unwrap().is_empty(), "{key} filled");
    }
    assert!(full["thinned"].is_object() && full["truncated_at"].is_u64());
    assert_report_schema(&full);
    assert_report_schema(&doc(&Report::default()));
}

#[test]
fn a_missing_field_fails() {
    let full = doc(&full_report());
    let mut top = full.clone();
    top.as_object_mut().unwrap().remove("duration_ns");
    assert_rejected(&top, "no duration_ns");
    let mut nested = full.clone();
    nested["functions"][0]
        .as_object_mut()
        .unwrap()
        .remove("calls");
    assert_rejected(&nested, "a function without calls");
    let mut deep = full;
    deep["gc"][0]["histogram"][0]
        .as_object_mut()
        .unwrap()
        .remove("to_ns");
    assert_rejected(&deep, "a histogram bucket without to_ns");
}

#[test]
fn a_wrong_type_fails() {
    let full = doc(&full_report());
    for (pointer, bad) in [
        ("/duration_ns", json!("2 s")),
        ("/duration_ns", json!(-1)),
        ("/target/pid", json!(null)),
        ("/functions/0/line", json!(1.5)),
        ("/imports/0/found", json!(1)),
        ("/audit/0/stacks/0/frames", json!("main")),
        ("/sample_filter/gil", json!("no")),
        ("/source", json!("guessed")),
        ("/exact_fraction", json!(1.5)),
        ("/thinned", json!(5)),
        ("/return_types/0/raised", json!("1")),
        ("/return_types/0/returned/0/type", json!(null)),
    ] {
        let mut d = full.clone();
        *d.pointer_mut(pointer).unwrap() = bad.clone();
        assert_rejected(&d, &format!("{pointer} = {bad}"));
    }
}

#[test]
fn a_field_unknown_to_the_schema_fails() {
    let full = doc(&full_report());
    for pointer in [
        "",
        "/target",
        "/functions/0",
        "/gc/0",
        "/gc/0/histogram/0",
        "/gc/0/triggers/0",
        "/imports/0",
        "/audit/0",
        "/audit/0/stacks/0",
        "/threads/0",
        "/anomalies",
        "/thinned",
        "/sample_filter",
        "/return_types/0",
        "/return_types/0/returned/0",
    ] {
        let mut d = full.clone();
        d.pointer_mut(pointer)
            .unwrap()
            .as_object_mut()
            .unwrap()
            .insert("new_field".into(), json!(0));
        assert_rejected(&d, &format!("a new field in `{pointer}`"));
    }
}
