//! Sampling accuracy against the target's own measurement. `scripts/test.sh` runs
//! these tests alone, so that no other test competes for the CPUs while the target
//! measures wall-clock time.

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

/// The share of `plain()` among the samples of `plain()` and `audited()`.
fn plain_share(report: &Value) -> f64 {
    let of = |name: &str| -> u64 {
        report["functions"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| {
                f["function"] == name && f["file"].as_str().unwrap().ends_with("audited_shares.py")
            })
            .map(|f| f["inclusive_ns"].as_u64().unwrap())
            .sum()
    };
    let (plain, audited) = (of("plain"), of("audited"));
    assert!(plain + audited > 0, "no samples of plain() or audited()");
    plain as f64 / (plain + audited) as f64
}

/// While audit events fire by millions a second in one function, the default mode
/// keeps them within its budget, so the samples still show the program as it runs
/// untraced. Two truths are checked: the samples' share of a function raising an
/// audit event per step against one raising none stays within 3 points of what the
/// traced program measured itself in the same run or of the untraced program's
/// (sampling is not skewed by the stops), and that self-measured share stays within
/// 10 points of the untraced program's (counting the events in the ring moves it
/// by 3-6). Fails when an audit site falls back to int3 (each event a stop: the
/// share goes to nearly 0).
#[test]
fn sampled_shares_hold_while_audit_events_storm() {
    for version in ["3.9", "3.11", "3.15"] {
        let Some(py) = python(version) else { continue };
        let script = repo().join("fixtures/python/audited_shares.py");
        // The untraced share moves by up to 5 points from one run to the next
        // (frequency scaling, caches): its median of three is the truth.
        let mut untraced_shares: Vec<f64> = (0..3)
            .map(|_| {
                let untraced = std::process::Command::new(&py.launcher)
                    .arg(&script)
                    .arg("400")
                    .output()
                    .expect("run the fixture");
                assert!(untraced.status.success());
                let truth: Value = serde_json::from_slice(&untraced.stdout).unwrap();
                truth["plain"].as_f64().unwrap()
            })
            .collect();
        untraced_shares.sort_by(f64::total_cmp);
        let expected = untraced_shares[1];

        let out = std::env::temp_dir().join(format!(
            "pyprobe-audited-shares-{}-{version}.pyprobe",
            std::process::id()
        ));
        let run = pyprobe()
            .args(["record", "-v", "--force", "-r", "1000", "-o"])
            .arg(&out)
            .arg("--")
            .arg(&py.launcher)
            .arg(&script)
            .arg("400")
            .output()
            .expect("run pyprobe");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{version}: record failed:\n{stderr}");
        let traced: Value = serde_json::from_slice(&run.stdout).unwrap_or_else(|e| {
            panic!("{version}: the traced fixture's own measurement: {e}\n{stderr}")
        });
        let measured = traced["plain"].as_f64().unwrap();
        assert!(
            !stderr.contains("stays on int3"),
            "{version}: every audit site through the ring:\n{stderr}"
        );
        let report = json_of(&run_pyprobe(&[
            "report",
            out.to_str().unwrap(),
            "--format",
            "json",
        ]));
        let _ = std::fs::remove_file(&out);
        let share = plain_share(&report);
        eprintln!(
            "{version}: plain()'s share sampled {share:.3}, measured by the traced \
             program {measured:.3}, untraced {untraced_shares:.3?}; {}",
            stderr.lines().last().unwrap_or("")
        );
        // The program's own measurement in the run includes its waits for a busy
        // consumer (in audited()), which samples of a waiting thread may not
        // show; the untraced share excludes them. Samples must lie within 3 points
        // of the span of those two truths.
        let (low, high) = (measured.min(expected), measured.max(expected));
        assert!(
            share >= low - 0.03 && share <= high + 0.03,
            "{version}: sampled {share:.3} vs measured in the same run {measured:.3} \
             (untraced {untraced_shares:.3?}):\n{stderr}"
        );
        // Counting the audit events in the ring (a locked add on a line the
        // consumer reads) slows audited() by 14-28 % on the machines measured,
        // more than the 30 ns per event the budget charges for it: the program's
        // own share moves by 3-6 points. 10 points still fails an audit site on
        // int3 (the share then goes to nearly 0).
        assert!(
            (measured - expected).abs() <= 0.10,
            "{version}: traced program's own share {measured:.3} vs untraced {untraced_shares:.3?}: \
             the audit storm slowed audited() beyond the budget:\n{stderr}"
        );
    }
}

/// The rate asked for is the rate taken, so that samples × interval, the time every
/// view shows, is the time the program ran: a CPU-bound `main()` of 3 s shows
/// 3 s within 10 %, at 1 kHz in the default mode (the event loop polls its rings
/// between samples: its naps delayed each tick, and each tick was timed from the
/// end of the last sample, 773 samples a second for 1,000 asked) and in
/// `--mode sample`.
#[test]
fn sampled_time_is_the_time_the_program_ran() {
    for (version, mode) in [("3.15", "auto"), ("3.9", "auto"), ("3.13", "sample")] {
        let Some(py) = python(version) else { continue };
        let (stdout, report) =
            record_script(&py, &["--mode", mode, "-r", "1000"], "shares.py", &["3"]);
        assert!(serde_json::from_str::<Value>(stdout.trim()).is_ok());
        let main_ns: u64 = report["functions"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| {
                f["function"] == "main" && f["file"].as_str().unwrap().ends_with("shares.py")
            })
            .map(|f| f["inclusive_ns"].as_u64().unwrap())
            .sum();
        let shown = main_ns as f64 / 1e9;
        // Ticks pyprobe says it missed for want of a CPU (a loaded machine) are
        // time it could not see; its own scheduling must lose nothing else.
        let missed = missed_ticks(&report) as f64 / 1000.0;
        eprintln!("{version} {mode}: main() shown as {shown:.2} s of 3, {missed:.2} s missed");
        assert!(
            (2.7..=3.3).contains(&(shown + missed)) && shown >= 2.0,
            "{version} {mode}: main() ran 3 s, shown as {shown:.2} s, {missed:.2} s said missed"
        );
    }
}

/// The ticks a report's caveat says were not taken ("fell behind: N of the M
/// samples due ..."), 0 without one.
fn missed_ticks(report: &Value) -> u64 {
    report["caveats"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["text"].as_str()?.strip_prefix("fell behind: "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}
