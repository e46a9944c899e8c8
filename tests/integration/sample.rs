//! Sampling through the frame walker in `pyprobe record`: accuracy against the
//! target's own measurement, and `--mode auto` (samples plus exact GC events).

use crate::support::*;
use serde_json::Value;

#[test]
fn auto_mode_samples_functions_and_keeps_gc_exact() {
    let Some(py) = python("3.9") else { return };
    let (stdout, report) = record_script(&py, &[], "gc_import_audit.py", &[]);
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
        // The budget off: what is checked is whom a GC's stack names. Over budget
        // (a loaded machine) auto mode records GCs without their stacks, which
        // the budget's own tests check.
        let (stdout, report) = record_script(
            &py,
            &["--mode", mode, "--max-overhead", "0"],
            "gc_triggers.py",
            &[],
        );
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
