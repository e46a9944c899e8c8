//! A target that turns on pyprobe: what it does to pyprobe's own memory must not
//! end pyprobe. Here a target running as root reopens the memfd of a ring pyprobe
//! reads (through `/proc/self/map_files`) and truncates it: the kernel refuses
//! (pyprobe seals the memfd at its size), pyprobe records to the end, and the
//! program's output is as untraced.

use crate::support::*;

const CALLS: &str = "20000";

fn truncate(version: &'static str, which: &str, extra: &[&str]) {
    let Some(py) = python(version) else { return };
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: only root may open /proc/self/map_files, as the hostile target does");
        return;
    }
    let path = tmp_path(&format!("truncate-{version}-{which}.pyprobe"));
    let out = pyprobe()
        .args(["record", "--force", "-o", path.to_str().unwrap()])
        .args(extra)
        .arg("--")
        .arg(&py.launcher)
        .arg(repo().join("fixtures/python/truncate_ring.py"))
        .args([CALLS, which])
        .output()
        .expect("run pyprobe");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_no_panic(version, &out.stderr);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("EPERM {CALLS}"),
        "{version} {which}: the target's truncation is refused: {stderr}"
    );
    assert!(
        out.status.success() && stderr.contains("target exited with status 0"),
        "{version} {which}: pyprobe records to the end ({:?}): {stderr}",
        out.status
    );
    let report = report_json(path.to_str().unwrap());
    let calls = entries_in_file(&report, "truncate_ring.py");
    assert!(
        report["events"].as_u64().unwrap_or(0) > 0,
        "{version} {which}: the recording reads back"
    );
    if extra.contains(&"trace") {
        assert_eq!(
            calls.get("work"),
            Some(&20000),
            "{version} {which}: {calls:?}"
        );
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_target_truncating_the_probes_ring_cannot_end_pyprobe_3_9() {
    truncate("3.9", "ring", &[]);
}

#[test]
fn a_target_truncating_the_probes_ring_cannot_end_pyprobe_3_15() {
    truncate("3.15", "ring", &[]);
}

#[test]
fn a_target_truncating_the_hooks_ring_cannot_end_pyprobe_3_13() {
    truncate("3.13", "hook", &["--mode", "trace"]);
}

#[test]
fn a_target_truncating_the_hooks_ring_cannot_end_pyprobe_3_11() {
    truncate("3.11", "hook", &["--mode", "trace"]);
}
