//! What the default and the first runs tell a user is the program's, not pyprobe's:
//! no GC pause made of pyprobe's own set-up or stack reads.

use crate::support::*;

/// The longest pause of each generation in a report.
fn max_pauses(report: &serde_json::Value) -> Vec<(i64, u64)> {
    report["gc"]
        .as_array()
        .expect("gc section")
        .iter()
        .map(|g| {
            (
                g["generation"].as_i64().unwrap(),
                g["max_ns"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn an_empty_program_has_no_phantom_gc_pause() {
    // `python -c pass` makes about ten young collections of a few hundred objects
    // at start-up, 50-300 µs each. pyprobe used to stamp the first one before
    // setting itself up (the ring, the walker) and showed a 34-117 ms pause that
    // never happened. The bound is 100 times a real one: a pause that long is
    // pyprobe's, not the interpreter's.
    const BOUND_NS: u64 = 30_000_000;
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        for mode in ["auto", "trace"] {
            let out = TempFile::new(&format!("pass-{version}-{mode}.pyprobe"));
            let run = pyprobe()
                .args(["record", "-o", out.path(), "--mode", mode, "--"])
                .arg(&py.launcher)
                .args(["-c", "pass"])
                .output()
                .unwrap();
            assert!(
                run.status.success(),
                "{}",
                String::from_utf8_lossy(&run.stderr)
            );
            let report = report_json(out.path());
            let pauses = max_pauses(&report);
            assert!(
                pauses.iter().any(|&(g, _)| g == 0),
                "{version} {mode}: young collections recorded: {pauses:?}"
            );
            for (generation, max) in pauses {
                assert!(
                    max < BOUND_NS,
                    "{version} {mode}: generation {generation} paused {max} ns at most"
                );
            }
        }
    }
}
