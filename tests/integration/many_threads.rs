//! A process with 10,000 threads: attaching works in every mode (stopping them all
//! once cost pyprobe N² system calls, past its 10 s limit: "the target's threads did
//! not stop within 10 s"), pyprobe leaves when asked, the program runs to its
//! end with its own output, and its one working thread is in the recording.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::support::*;

const THREADS: &str = "10000";

/// Attaches to a process with `THREADS` threads in `mode`; returns pyprobe's stderr.
fn attach_to_many_threads(version: &'static str, mode: &str) -> String {
    attach_to_threads(version, mode, THREADS)
}

/// Attaches to a process with `threads` threads in `mode` for 2 s: pyprobe leaves
/// when the duration is reached, the program runs to its end; returns pyprobe's
/// stderr (empty when the interpreter is missing).
fn attach_to_threads(version: &'static str, mode: &str, threads: &str) -> String {
    let Some(py) = python(version) else {
        return String::new();
    };
    attach_to_threads_of(&py, mode, threads)
}

/// [`attach_to_threads`] with the interpreter `py`.
fn attach_to_threads_of(py: &Python, mode: &str, threads: &str) -> String {
    let version = py.version;
    let mut target = Command::new(&py.launcher)
        .arg(repo().join("fixtures/python/many_threads.py"))
        .args([threads, "6"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the target");
    let mut lines = BufReader::new(target.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().and_then(Result::ok).as_deref(), Some("ready"));
    let path = tmp_path(&format!("many-threads-{version}-{mode}.pyprobe"));
    let pid = target.id().to_string();
    let out = pyprobe()
        .args([
            "record",
            "-p",
            &pid,
            "--mode",
            mode,
            "--duration",
            "2",
            "--force",
            "-o",
        ])
        .arg(&path)
        .output()
        .expect("run pyprobe");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_no_panic(mode, &out.stderr);
    assert!(
        out.status.success() && stderr.contains("duration reached, detached"),
        "{version} --mode {mode} with {threads} threads: {stderr}"
    );
    let last = lines.next().and_then(Result::ok).unwrap_or_default();
    let status = target.wait().expect("wait for the target");
    assert!(
        status.success(),
        "{version} {mode}: the target ended {status:?}"
    );
    let turns: u64 = last
        .split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    assert!(
        turns > 0,
        "{version} {mode}: the target's last line: {last:?}"
    );
    let report = report_json(path.to_str().unwrap());
    assert!(
        report["events"].as_u64().unwrap_or(0) > 0,
        "{version} {mode}"
    );
    // The one thread that works is the main thread, the oldest: it is last in
    // the interpreter's thread list, which the walker once cut at 4,096 threads.
    let seen_working = report["functions"].as_array().is_some_and(|rows| {
        rows.iter().any(|row| {
            row["file"]
                .as_str()
                .is_some_and(|f| f.ends_with("many_threads.py"))
                && (row["samples"].as_u64().unwrap_or(0) > 0
                    || row["calls"].as_u64().unwrap_or(0) > 0)
        })
    });
    assert!(
        seen_working,
        "{version} {mode} with {threads} threads: no sample or call of the main thread's work \
         in {report}"
    );
    let _ = std::fs::remove_file(&path);
    stderr.into_owned()
}

#[test]
fn ten_thousand_threads_traced_through_the_ring_3_9() {
    attach_to_many_threads("3.9", "trace");
}

/// Stopping 2,000 threads for a sample holds the target about 50 ms: the three
/// stops that measured it broke the default mode's 5 % budget (8 % of a 2 s run).
/// The thread count predicts it before any stop; the closing line says the
/// budget held.
#[test]
fn two_thousand_threads_in_the_default_mode_keep_its_budget_3_15() {
    let stderr = attach_to_threads("3.15", "auto", "2000");
    if stderr.is_empty() {
        return;
    }
    assert!(
        stderr.contains("stopping 2001 threads for a sample would hold the target"),
        "{stderr}"
    );
    assert!(!stderr.contains("exceeded"), "{stderr}");
}

/// The same where the interpreter has no probes (pyenv's builds, as Docker's and
/// python.org's): the budget holds the sample stops alone. It once started only
/// with probes, and every tick stopped the 2,000 threads whatever it cost.
#[test]
fn two_thousand_threads_in_the_default_mode_keep_its_budget_without_probes() {
    let Some((version, exe)) = pyenv_builds().into_iter().find(|(v, _)| v == "3.12") else {
        eprintln!("NOTICE: skipped: no pyenv build of 3.12 on this machine");
        return;
    };
    let stderr = attach_to_threads_of(&pyenv_python(&version, exe), "auto", "2000");
    assert!(stderr.contains("has no SDT probes"), "{stderr}");
    assert!(
        stderr.contains("stopping 2001 threads for a sample would hold the target"),
        "{stderr}"
    );
    let budget = stderr
        .lines()
        .find(|l| l.starts_with("pyprobe: overhead budget 5% held"))
        .unwrap_or_else(|| panic!("no closing line of the budget: {stderr}"));
    assert!(!budget.contains("GC, import and audit"), "{budget}");
}

#[test]
fn ten_thousand_threads_traced_through_the_hook_3_13() {
    attach_to_many_threads("3.13", "trace");
}

#[test]
fn ten_thousand_threads_sampled_3_11() {
    attach_to_many_threads("3.11", "sample");
}

#[test]
fn ten_thousand_threads_in_the_default_mode_3_15() {
    let stderr = attach_to_many_threads("3.15", "auto");
    assert!(!stderr.contains("exceeded"), "{stderr}");
}
