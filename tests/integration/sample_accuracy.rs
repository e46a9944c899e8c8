//! Sampling accuracy against the target's own measurement. In a test binary of its
//! own: cargo runs test binaries one at a time, so no other test competes for the CPUs
//! while the target measures wall-clock time.

use crate::support::*;
use serde_json::Value;

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
        let (stdout, report) = record_script(
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
