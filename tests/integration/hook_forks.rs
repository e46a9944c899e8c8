//! The hook engine follows a fork under `--subprocesses`: the child keeps the
//! hook (its `sys.monitoring` registration, or before 3.12 its thread's profile
//! function) and gets a ring of its own at its first stop, so every call it makes
//! counts, in its own process; a child the hook cannot go on in (the program took
//! the hook's place before forking) is said untraced, and nothing is counted for
//! it. The fixture counts its own calls and prints who holds the hook in each
//! process.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::hook::{pyenv, MINORS};
use crate::support::*;

/// The report's calls of function `name` per pid.
fn calls_per_process(report: &Value, name: &str) -> BTreeMap<u64, u64> {
    let mut out = BTreeMap::new();
    for p in report["processes"].as_array().expect("processes") {
        let pid = p["pid"].as_u64().unwrap();
        let calls = p["functions"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["function"] == name)
            .map(entries)
            .sum::<u64>();
        out.insert(pid, calls);
    }
    out
}

/// The caveats said of process `pid`.
fn caveats_of(report: &Value, pid: u64) -> Vec<String> {
    report["caveats"]
        .as_array()
        .expect("caveats")
        .iter()
        .filter(|c| c["pid"] == pid)
        .map(|c| c["text"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Runs `hook_fork.py` (or `-c script`, which prints the same lines) under
/// `python`, attaches `pyprobe record --mode trace --subprocesses` (and
/// `extra`), lets it fork; returns the child's and the parent's lines, the
/// child's pid and the report.
fn fork_traced(
    what: &str,
    python: &Path,
    script: Option<&str>,
    extra: &[&str],
) -> (String, String, u64, Value, String) {
    let fixture = fixture_script("hook_fork.py");
    let args: Vec<&str> = match script {
        Some(s) => vec!["-c", s],
        None => vec![&fixture],
    };
    let mut target = Target::spawn(python, &args);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let out = TempFile::new("hook-forks.pyprobe");
    let mut args = vec!["--mode", "trace", "--subprocesses", "-p", &pid];
    args.extend_from_slice(extra);
    let tracer = Tracer::record(out.path(), &args);
    // The hook goes in at the target's next Python code; its read waits in C.
    std::thread::sleep(Duration::from_millis(1500));
    target.send_line("");
    let child_line = target.wait_for_line("child");
    let parent_line = target.wait_for_line("parent");
    tracer.signal(libc::SIGINT);
    let (status, stderr) = tracer.wait(Duration::from_secs(30));
    assert!(status.success(), "{what}: {stderr}");
    assert_no_panic("record", stderr.as_bytes());
    let (_, status) = target.finish();
    assert!(status.success(), "{what}: the target failed");
    let report = report_json(out.path());
    let child: u64 = report["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pid"].as_u64() != Some(pid.parse().unwrap()))
        .map(|p| p["pid"].as_u64().unwrap())
        .next()
        .unwrap_or_else(|| panic!("{what}: no child in the recording\n{stderr}"));
    (child_line, parent_line, child, report, stderr)
}

#[test]
fn a_forked_child_keeps_the_hook_and_every_call_it_makes_counts() {
    let mut pythons: Vec<(String, std::path::PathBuf, Vec<&str>)> = MINORS
        .iter()
        .filter_map(|&m| pyenv(m).map(|p| (format!("pyenv 3.{m}"), p, vec![])))
        .collect();
    // Debian's 3.14 (no function probes) and 3.15 (probes: the hook asked for).
    for (version, extra) in [("3.14", vec![]), ("3.15", vec!["--engine", "hook"])] {
        if let Some(py) = python(version) {
            pythons.push((format!("Debian {version}"), py.launcher, extra));
        }
    }
    for (what, py, extra) in &pythons {
        let (child_line, parent_line, child, report, stderr) = fork_traced(what, py, None, extra);
        // The program itself sees the hook held in both processes.
        assert_eq!(child_line, "child 100000 pyprobe", "{what}\n{stderr}");
        assert_eq!(parent_line, "parent 1000 pyprobe", "{what}\n{stderr}");
        let calls = calls_per_process(&report, "f");
        assert_eq!(calls.get(&child), Some(&100_000), "{what}: {calls:?}");
        assert_eq!(
            calls.values().sum::<u64>(),
            101_000,
            "{what}: the parent's 1,000: {calls:?}"
        );
        assert!(
            caveats_of(&report, child).is_empty(),
            "{what}: {:?}",
            caveats_of(&report, child)
        );
    }
}

/// The program puts its own profiler in the hook's place (3.11: its thread's
/// profile function) or frees pyprobe's tool (3.13), then forks: the child has
/// no hook to go on with.
#[test]
fn a_forked_child_the_hook_cannot_go_on_in_is_said_untraced() {
    let body = "def f(x):\n    return x + 1\n\
                print('ready', flush=True)\n\
                sys.stdin.readline()\n\
                TAKE\n\
                pid = os.fork()\n\
                if pid == 0:\n    acc = 0\n    for i in range(100000):\n        acc = f(acc)\n    \
                print('child', acc, flush=True)\n    os._exit(0)\n\
                os.waitpid(pid, 0)\n\
                print('parent', flush=True)\n";
    for (minor, take) in [
        (11, "sys.setprofile(lambda *a: None)"),
        (13, "sys.monitoring.free_tool_id(4)"),
    ] {
        let Some(py) = pyenv(minor) else { continue };
        let what = format!("pyenv 3.{minor}");
        let script = format!("import os, sys\n{}", body.replace("TAKE", take));
        let (child_line, _, child, report, stderr) = fork_traced(&what, &py, Some(&script), &[]);
        assert_eq!(child_line, "child 100000", "{what}");
        // Said once, with why.
        let caveats = caveats_of(&report, child);
        let why = match minor {
            11 => "none of its thread states has the hook as its profile function",
            _ => "the program freed sys.monitoring tool 4",
        };
        assert!(
            caveats.len() == 1
                && caveats[0].contains("its Python calls are not traced")
                && caveats[0].contains(why),
            "{what}: {caveats:?}\n{stderr}"
        );
        let calls = calls_per_process(&report, "f");
        assert_eq!(
            calls.get(&child).copied().unwrap_or(0),
            0,
            "{what}: {calls:?}"
        );
    }
}

/// pyprobe SIGKILLed while a child it followed runs: the guardian clears the
/// child's `on` word too, so the hook unregisters itself there at the child's
/// next call (the child sees the hook gone), and the child runs on, correct.
#[test]
fn a_followed_child_outlives_a_killed_pyprobe_unhooked() {
    for minor in [11, 13] {
        let Some(py) = pyenv(minor) else { continue };
        let what = format!("pyenv 3.{minor}");
        let mut target = Target::spawn(&py, &[&fixture_script("hook_fork_kill.py")]);
        target.wait_for_line("ready");
        let pid = target.pid().to_string();
        let out = TempFile::new("hook-fork-kill.pyprobe");
        let tracer = Tracer::record(
            out.path(),
            &["--mode", "trace", "--subprocesses", "-p", &pid],
        );
        std::thread::sleep(Duration::from_millis(1500));
        target.send_line("");
        target.wait_for_line("child up");
        target.send_line("1000");
        assert_eq!(
            target.wait_for_line("child"),
            "child 1000 pyprobe",
            "{what}"
        );
        tracer.signal(libc::SIGKILL);
        let (status, _) = tracer.wait(Duration::from_secs(10));
        assert!(!status.success(), "{what}: pyprobe was killed");
        // Each line is a few calls: the first after the guardian acted unhooks.
        let mut total = 1000;
        let unhooked = wait_for(Duration::from_secs(10), || {
            target.send_line("10");
            total += 10;
            let line = target.wait_for_line("child");
            assert!(
                line.starts_with(&format!("child {total} ")),
                "{what}: {line}"
            );
            line.ends_with(" None")
        });
        assert!(unhooked, "{what}: the child still holds the hook");
        target.send_line("100000");
        total += 100_000;
        assert_eq!(
            target.wait_for_line("child"),
            format!("child {total} None"),
            "{what}"
        );
        target.send_line("");
        assert_eq!(target.wait_for_line("parent"), "parent done", "{what}");
        let (_, status) = target.finish();
        assert!(
            status.success(),
            "{what}: the target exited with {status:?}"
        );
    }
}
