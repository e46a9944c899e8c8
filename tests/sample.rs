//! Sampling through the frame walker in `pyprobe record`: accuracy against the
//! target's own measurement, and `--mode auto` (samples plus exact GC events).

mod common;

use common::*;
use serde_json::Value;

fn record(py: &Python, extra: &[&str], script: &str, args: &[&str]) -> (String, Value) {
    let out_path = std::env::temp_dir().join(format!(
        "pyprobe-sample-{}-{}-{script}.pyprobe",
        std::process::id(),
        py.version
    ));
    let out = pyprobe()
        .args(["record", "-o", out_path.to_str().unwrap()])
        .args(extra)
        .arg("--")
        .arg(&py.launcher)
        .arg(repo().join("fixtures/python").join(script))
        .args(args)
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "record failed");
    let report = json_of(&run_pyprobe(&[
        "report",
        out_path.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let _ = std::fs::remove_file(out_path);
    (String::from_utf8_lossy(&out.stdout).into_owned(), report)
}

/// Estimated inclusive time of a function (samples with it anywhere on the stack ×
/// interval): a() and b() are never leaves, spin() under them is.
fn inclusive_of(report: &Value, function: &str) -> u64 {
    report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["function"] == function && f["file"].as_str().unwrap().ends_with("shares.py"))
        .map(|f| f["inclusive_ns"].as_u64().unwrap())
        .sum()
}

#[test]
fn sampled_shares_match_the_targets_own_measurement() {
    for version in ["3.9", "3.13", "3.15"] {
        let Some(py) = python(version) else { continue };
        let (stdout, report) = record(
            &py,
            &["--mode", "sample", "-r", "1000"],
            "shares.py",
            &["5"],
        );
        let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(report["mode"], "sample");
        assert!(report["functions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["calls"].is_null()));
        let (a, b) = (inclusive_of(&report, "a"), inclusive_of(&report, "b"));
        // At 1 ms per sample, at least 2 s of the 5 s were sampled.
        assert!(
            a + b > 2_000_000_000,
            "{version}: enough samples at 1000 Hz over 5 s: {a} + {b} ns"
        );
        let share = a as f64 / (a + b) as f64;
        let expected = truth["a"].as_f64().unwrap();
        eprintln!("{version}: a's share sampled {share:.3}, measured by the target {expected:.3}");
        assert!(
            (share - expected).abs() <= 0.03,
            "{version}: sampled {share:.3} vs measured {expected:.3}"
        );
    }
}

#[test]
fn auto_mode_samples_functions_and_keeps_gc_exact() {
    let Some(py) = python("3.9") else { return };
    let (stdout, report) = record(&py, &[], "gc_import_audit.py", &[]);
    let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
    let gen2 = report["gc"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["generation"] == 2)
        .unwrap();
    assert!(gen2["collections"].as_u64().unwrap() >= truth["collects"]["2"].as_u64().unwrap());
    assert!(report["audit"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["event"] == "open"));
    // Functions come from samples, not from probes.
    assert!(report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["calls"].is_null()));
}

#[test]
fn gc_collections_are_attributed_to_the_function_that_triggered_them() {
    // Auto mode on 3.9 and 3.15 (the walker's stack at each gc__start hit), and trace
    // mode on 3.9 (the stack rebuilt from calls and returns).
    for (version, mode) in [("3.9", "auto"), ("3.15", "auto"), ("3.9", "trace")] {
        let Some(py) = python(version) else { continue };
        let (stdout, report) = record(&py, &["--mode", mode], "gc_triggers.py", &[]);
        let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
        for function in ["alloc_a", "alloc_b"] {
            let attributed: u64 = report["gc"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|g| g["triggers"].as_array().unwrap())
                .filter(|t| t["function"] == function)
                .map(|t| t["count"].as_u64().unwrap())
                .sum();
            assert_eq!(
                attributed,
                truth[function].as_u64().unwrap(),
                "{version} {mode}: collections started in {function}"
            );
        }
    }
}
