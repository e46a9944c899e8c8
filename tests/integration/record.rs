//! `pyprobe record` through the int3 engine against real CPython processes: exact
//! call counts against the fixtures' own counts, GC/import/audit events, attaching to
//! a running process, and the target's safety (bytes restored, output unchanged).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::*;
use serde_json::Value;

/// A fresh path for each call: tests running at once record the same fixture.
fn tmp_recording(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "pyprobe-test-{}-{n}-{name}.pyprobe",
        std::process::id()
    ))
}

/// Records `python script args` under pyprobe; returns the script's stdout, the exit
/// status and the report JSON.
fn record_launch(py: &Python, script: &str, args: &[&str], extra: &[&str]) -> (String, i32, Value) {
    let out_path = tmp_recording(&format!(
        "{}-{}",
        py.version,
        Path::new(script).file_stem().unwrap().to_str().unwrap()
    ));
    let mut cmd = pyprobe();
    cmd.args([
        "record",
        "--mode",
        "trace",
        "-o",
        out_path.to_str().unwrap(),
    ])
    .args(extra)
    .arg("--")
    .arg(&py.launcher)
    .arg(script)
    .args(args);
    let out = cmd.output().expect("run pyprobe record");
    eprintln!("record stderr: {}", String::from_utf8_lossy(&out.stderr));
    let report = json_of(&run_pyprobe(&[
        "report",
        out_path.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let _ = std::fs::remove_file(&out_path);
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.code().unwrap_or(-1),
        report,
    )
}

fn check_exact_counts(version: &'static str) {
    let Some(py) = python(version) else { return };
    let script = fixture_script("count_calls.py");
    let untraced = Command::new(&py.launcher).arg(&script).output().unwrap();
    let (stdout, code, report) = record_launch(&py, &script, &[], &[]);
    assert_eq!(code, 0, "{version}: exit status passes through");
    assert_eq!(
        stdout,
        String::from_utf8_lossy(&untraced.stdout),
        "{version}: output identical to untraced"
    );
    let truth: BTreeMap<String, u64> = serde_json::from_str(stdout.trim()).unwrap();
    let got = entries_in_file(&report, "count_calls.py");
    for (function, &expected) in &truth {
        let counted = got.get(function).copied().unwrap_or(0);
        assert_eq!(
            counted, expected,
            "{version}: calls of {function} (report {got:?})"
        );
    }
    assert_eq!(report["lost_events"], 0);
    assert!(
        report["threads"].as_array().unwrap().len() >= 3,
        "{version}: main and two worker threads"
    );
    // One row per function (the generator too), and times that add up.
    let mut rows: BTreeMap<&str, u32> = BTreeMap::new();
    for f in report["functions"].as_array().unwrap() {
        if f["file"].as_str().unwrap().ends_with("count_calls.py") {
            *rows.entry(f["function"].as_str().unwrap()).or_default() += 1;
        }
        assert!(
            f["inclusive_ns"].as_u64() >= f["exclusive_ns"].as_u64(),
            "{version}: {f}"
        );
    }
    assert!(rows.values().all(|&n| n == 1), "{version}: rows {rows:?}");
    if version != "3.11" {
        assert_eq!(report["anomalies"]["resyncs"], 0, "{version}");
        assert_eq!(report["anomalies"]["unpaired_entries"], 0, "{version}");
    }
}

#[test]
fn exact_call_counts_on_3_9() {
    check_exact_counts("3.9");
}

#[test]
fn exact_call_counts_on_3_15() {
    check_exact_counts("3.15");
}

#[test]
fn exact_call_counts_from_returns_on_3_11() {
    check_exact_counts("3.11");
}

#[test]
fn gc_imports_and_audit_events() {
    for version in ["3.9", "3.13", "3.15"] {
        let Some(py) = python(version) else { continue };
        let (stdout, code, report) = record_launch(
            &py,
            &fixture_script("gc_import_audit.py"),
            &[],
            &["--probes", "gc,import,audit"],
        );
        assert_eq!(code, 0);
        let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
        let gc: BTreeMap<i64, u64> = report["gc"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["generation"].as_i64().unwrap(),
                    g["collections"].as_u64().unwrap(),
                )
            })
            .collect();
        for (generation, times) in truth["collects"].as_object().unwrap() {
            let generation: i64 = generation.parse().unwrap();
            // Interpreter start-up and shutdown may collect too; ours are all there.
            assert!(
                gc.get(&generation).copied().unwrap_or(0) >= times.as_u64().unwrap(),
                "{version}: gen {generation}: {gc:?}"
            );
        }
        let modules: Vec<&str> = report["imports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["module"].as_str().unwrap())
            .collect();
        for m in truth["imports"].as_array().unwrap() {
            assert!(
                modules.contains(&m.as_str().unwrap()),
                "{version}: import {m} in {modules:?}"
            );
        }
        let audit: Vec<&str> = report["audit"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["event"].as_str().unwrap())
            .collect();
        assert!(
            audit.contains(&"open"),
            "{version}: audit open in {audit:?}"
        );
        assert!(
            report["functions"].as_array().unwrap().is_empty(),
            "{version}: no function probes asked"
        );
    }
}

/// Waits (bounded) until pyprobe has raised the target's semaphores: attached.
fn wait_until_traced(pid: i32, sems: &[u64]) {
    let traced = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(25));
        sems.iter()
            .any(|&s| read_target_memory(pid, s, 2) != [0, 0])
    });
    assert!(traced, "pyprobe attached within 5 s");
}

fn untraced_result(py: &Python) -> String {
    let mut t = Target::spawn(&py.launcher, &[&fixture_script("forever.py")]);
    t.wait_for_line("ready");
    t.send_line("stop");
    t.wait_for_line("result")
}

#[test]
fn attach_record_detach_leaves_the_target_as_it_was() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let expected = untraced_result(&py);
        let mut target = Target::spawn(&py.launcher, &[&fixture_script("forever.py")]);
        target.wait_for_line("ready");
        let pid = target.pid();
        let (sites, sems) = sites_and_semaphores(pid);
        let out_path = tmp_recording(&format!("attach-{version}"));
        let out = run_pyprobe(&[
            "record",
            "-p",
            &pid.to_string(),
            "-d",
            "2",
            "--mode",
            "trace",
            "-o",
            out_path.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{version}: record -p");
        assert_restored(pid, &sites, &sems);
        let report = json_of(&run_pyprobe(&[
            "report",
            out_path.to_str().unwrap(),
            "--format",
            "json",
        ]));
        let fib = entries_in_file(&report, "forever.py")
            .get("fib")
            .copied()
            .unwrap_or(0);
        assert!(
            fib > 100,
            "{version}: fib calls recorded while attached: {fib}"
        );
        target.send_line("stop");
        assert_eq!(
            target.wait_for_line("result"),
            expected,
            "{version}: the target's result is unchanged"
        );
        let (_, status) = target.finish();
        assert!(status.success());
        let _ = std::fs::remove_file(out_path);
    }
}

#[test]
fn leaves_cleanly_on_sigint_and_sigterm() {
    let Some(py) = python("3.9") else { return };
    let expected = untraced_result(&py);
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let mut target = Target::spawn(&py.launcher, &[&fixture_script("forever.py")]);
        target.wait_for_line("ready");
        let pid = target.pid();
        let (sites, sems) = sites_and_semaphores(pid);
        let out_path = tmp_recording(&format!("signal-{signal}"));
        let mut tracer = pyprobe()
            .args([
                "record",
                "-p",
                &pid.to_string(),
                "--mode",
                "trace",
                "-o",
                out_path.to_str().unwrap(),
            ])
            .spawn()
            .unwrap();
        wait_until_traced(pid, &sems);
        std::thread::sleep(Duration::from_millis(500));
        unsafe { libc::kill(tracer.id() as i32, signal) };
        let status = tracer.wait().unwrap();
        assert!(
            status.success(),
            "pyprobe leaves cleanly on signal {signal}: {status:?}"
        );
        assert_restored(pid, &sites, &sems);
        let report = json_of(&run_pyprobe(&[
            "report",
            out_path.to_str().unwrap(),
            "--format",
            "json",
        ]));
        assert!(!report["functions"].as_array().unwrap().is_empty());
        target.send_line("stop");
        assert_eq!(target.wait_for_line("result"), expected);
        let (_, st) = target.finish();
        assert!(st.success());
        let _ = std::fs::remove_file(out_path);
    }
}

#[test]
fn a_forked_child_is_cleaned_and_runs_python_fine() {
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("forever.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let (_, sems) = sites_and_semaphores(pid);
    let out_path = tmp_recording("fork");
    let mut tracer = pyprobe()
        .args([
            "record",
            "-p",
            &pid.to_string(),
            "--mode",
            "trace",
            "-o",
            out_path.to_str().unwrap(),
        ])
        .spawn()
        .unwrap();
    wait_until_traced(pid, &sems);
    target.send_line("fork");
    assert_eq!(target.wait_for_line("child"), "child 0");
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    assert!(tracer.wait().unwrap().success());
    target.send_line("stop");
    target.wait_for_line("result");
    let (_, st) = target.finish();
    assert!(st.success());
    let _ = std::fs::remove_file(out_path);
}

#[test]
fn target_stopped_and_continued_while_traced() {
    let Some(py) = python("3.9") else { return };
    let expected = untraced_result(&py);
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("forever.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let out_path = tmp_recording("stopcont");
    let mut tracer = pyprobe()
        .args([
            "record",
            "-p",
            &pid.to_string(),
            "--mode",
            "trace",
            "-o",
            out_path.to_str().unwrap(),
        ])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    // The tracer may have a backlog of hits to serve first: wait (bounded) for the stop.
    let stopped = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        matches!(
            stat.rsplit(')').next().unwrap().trim().chars().next(),
            Some('t' | 'T')
        )
    });
    assert!(stopped, "the target stops on SIGSTOP while traced");
    unsafe { libc::kill(pid, libc::SIGCONT) };
    std::thread::sleep(Duration::from_millis(300));
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    assert!(tracer.wait().unwrap().success());
    target.send_line("stop");
    assert_eq!(target.wait_for_line("result"), expected);
    let (_, st) = target.finish();
    assert!(st.success());
    let _ = std::fs::remove_file(out_path);
}

#[test]
fn launched_command_exit_status_passes_through() {
    let Some(py) = python("3.9") else { return };
    let out_path = tmp_recording("exit");
    let status = pyprobe()
        .args(["record", "-o", out_path.to_str().unwrap(), "--"])
        .arg(&py.launcher)
        .args(["-c", "import sys; sys.exit(7)"])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    let _ = std::fs::remove_file(out_path);
}

#[test]
fn record_refuses_bad_targets_clearly() {
    let out = run_pyprobe(&["record", "-p", "999999999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no process with pid 999999999"));
    let sleeper = Target::spawn(Path::new("/bin/sleep"), &["30"]);
    let pid = sleeper.pid().to_string();
    let out = run_pyprobe(&["record", "-p", &pid, "--mode", "trace"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no mapped object defining _PyRuntime")
    );
    // Sampling needs only the interpreter, and says it is not there.
    let out = run_pyprobe(&["record", "-p", &pid]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no mapped object defining _PyRuntime"));
}

#[test]
fn launch_finds_probes_in_libpython_mapped_after_exec() {
    // The probes live in libpython3.11.so, mapped by the dynamic loader after exec:
    // the engine must wait until it is fully mapped before arming it.
    let embed = fixture_binary("embed_python3.11");
    let out_path = tmp_recording("embed");
    let out = pyprobe()
        .args([
            "record",
            "--mode",
            "trace",
            "-o",
            out_path.to_str().unwrap(),
            "--",
        ])
        .arg(&embed)
        .arg(fixture_script("count_calls.py"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let truth: BTreeMap<String, u64> = serde_json::from_str(stdout.trim()).unwrap();
    let report = json_of(&run_pyprobe(&[
        "report",
        out_path.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let got = entries_in_file(&report, "count_calls.py");
    for (function, expected) in &truth {
        assert_eq!(
            got.get(function),
            Some(expected),
            "calls of {function} (from returns, 3.11)"
        );
    }
    let _ = std::fs::remove_file(out_path);
}

#[test]
fn start_at_keeps_only_what_runs_inside_that_function() {
    let Some(py) = python("3.9") else { return };
    let (_, code, report) = record_launch(
        &py,
        &fixture_script("count_calls.py"),
        &[],
        &["--start-at", "catcher"],
    );
    assert_eq!(code, 0);
    let functions: std::collections::BTreeSet<String> = report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["function"].as_str().unwrap().to_owned())
        .collect();
    let expected: std::collections::BTreeSet<String> = ["catcher", "thrower"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(functions, expected);
    assert_eq!(entries_in_file(&report, "count_calls.py")["thrower"], 15);
}

#[test]
fn subprocesses_are_traced_when_asked() {
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("forever.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let (sites, sems) = sites_and_semaphores(pid);
    let out_path = tmp_recording("subprocesses");
    let mut tracer = pyprobe()
        .args([
            "record",
            "-p",
            &pid.to_string(),
            "--mode",
            "trace",
            "--subprocesses",
            "-o",
            out_path.to_str().unwrap(),
        ])
        .spawn()
        .unwrap();
    wait_until_traced(pid, &sems);
    target.send_line("fork");
    assert_eq!(
        target.wait_for_line("child"),
        "child 0",
        "the traced child ran Python and exited 0"
    );
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    assert!(tracer.wait().unwrap().success());
    assert_restored(pid, &sites, &sems);
    let report = json_of(&run_pyprobe(&[
        "report",
        out_path.to_str().unwrap(),
        "--format",
        "json",
    ]));
    // The child computed fib(12): 465 calls, each an entry and a return, on its own tid.
    let child_events = report["threads"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["tid"].as_i64() != Some(pid as i64))
        .map(|t| t["events"].as_u64().unwrap())
        .max()
        .unwrap_or(0);
    assert!(
        child_events >= 930,
        "the child's calls were recorded: {child_events} events"
    );
    target.send_line("stop");
    target.wait_for_line("result");
    let _ = std::fs::remove_file(out_path);
}

#[test]
fn include_and_exclude_filter_by_file() {
    let Some(py) = python("3.9") else { return };
    let script = fixture_script("count_calls.py");
    let (_, _, only_fixture) = record_launch(&py, &script, &[], &["--include", "*count_calls.py"]);
    let files: std::collections::BTreeSet<String> = only_fixture["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["file"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(files.len(), 1, "only the fixture's file: {files:?}");
    assert!(files.iter().all(|f| f.ends_with("count_calls.py")));
    let (_, _, no_fixture) = record_launch(&py, &script, &[], &["--exclude", "*count_calls.py"]);
    let functions = no_fixture["functions"].as_array().unwrap();
    assert!(!functions.is_empty(), "the rest is still recorded");
    assert!(functions
        .iter()
        .all(|f| !f["file"].as_str().unwrap().ends_with("count_calls.py")));
}

#[test]
fn a_thread_blocked_in_a_system_call_is_not_disturbed() {
    // Attaching interrupts the blocked read and pyprobe injects system calls through
    // that thread (the SIGTRAP safety net): the read must resume as if nothing happened.
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let script = "import sys\nprint('ready', flush=True)\nline = sys.stdin.readline()\nprint('got', line.strip(), flush=True)\n";
        let mut target = Target::spawn(&py.launcher, &["-c", script]);
        target.wait_for_line("ready");
        let pid = target.pid();
        let (sites, sems) = sites_and_semaphores(pid);
        let out_path = tmp_recording(&format!("blocked-{version}"));
        let out = run_pyprobe(&[
            "record",
            "-p",
            &pid.to_string(),
            "-d",
            "0.5",
            "-o",
            out_path.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{version}");
        assert_restored(pid, &sites, &sems);
        target.send_line("hello");
        assert_eq!(target.wait_for_line("got"), "got hello", "{version}");
        let (_, status) = target.finish();
        assert!(status.success(), "{version}");
        let _ = std::fs::remove_file(out_path);
    }
}
