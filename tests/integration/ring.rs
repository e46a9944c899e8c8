//! The ring engine (`--engine ring`): probe sites rewritten into jumps to
//! trampolines that append each event to a ring shared with pyprobe, with no stop.
//! Its events must be the int3 engine's, and the target must survive pyprobe's
//! death with the patches still in place.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::support::*;

/// `pyprobe record -o OUT -v --mode trace --engine ENGINE -- PYTHON ARGS`, to its
/// end (`-v`: the start says how many sites each engine got).
fn trace_launched<A: AsRef<std::ffi::OsStr>>(
    out: &TempFile,
    engine: &str,
    py: &Python,
    args: &[A],
) -> std::process::Output {
    pyprobe()
        .args([
            "record",
            "-o",
            out.path(),
            "-v",
            "--mode",
            "trace",
            "--engine",
            engine,
            "--",
        ])
        .arg(&py.launcher)
        .args(args)
        .output()
        .unwrap()
}

/// Records count_calls.py under `engine`; returns the fixture's own counts, the
/// report and pyprobe's stderr.
fn record_with(py: &Python, engine: &str) -> (serde_json::Value, serde_json::Value, String) {
    let out = TempFile::new(&format!("ring-{}-{engine}.pyprobe", py.version));
    let run = trace_launched(&out, engine, py, &[fixture_script("count_calls.py")]);
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert_no_panic(engine, &run.stderr);
    assert!(run.status.success(), "{engine}: {stderr}");
    let truth = serde_json::from_str(String::from_utf8_lossy(&run.stdout).trim()).unwrap();
    (truth, report_json(out.path()), stderr)
}

/// Every function row of the fixture's file: name, first line, calls.
fn rows(report: &serde_json::Value) -> BTreeSet<(String, u64, u64)> {
    report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["file"].as_str().unwrap().ends_with("count_calls.py"))
        .map(|f| {
            (
                f["function"].as_str().unwrap().to_owned(),
                f["line"].as_u64().unwrap(),
                f["calls"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

fn same_events_as_int3(version: &'static str) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let (truth, ring, stderr) = record_with(&py, "ring");
    assert!(
        stderr.contains("probe sites write to a ring") && !stderr.contains(" 0 probe sites write"),
        "{version}: the ring served the sites:\n{stderr}"
    );
    let (_, int3, _) = record_with(&py, "int3");
    assert_eq!(ring["lost_events"], 0, "{version}: nothing lost");
    // File, function name and first line come from the string and integer
    // arguments the trampolines captured: the rows must be the int3 engine's.
    // On 3.11+ a return also names its function's first line through the frame
    // the site holds, read from the code object: at an int3 stop always, from a
    // ring record only when the frame was not reused meanwhile (else the row is
    // keyed as before, at a line of the same function after its first).
    let (ring_rows, int3_rows) = (rows(&ring), rows(&int3));
    if version == "3.9" {
        assert_eq!(ring_rows, int3_rows, "{version}: ring vs int3");
    } else {
        assert_eq!(
            ring_rows.len(),
            int3_rows.len(),
            "{version}: ring {ring_rows:?}, int3 {int3_rows:?}"
        );
        for ((rf, rl, rc), (f, l, c)) in ring_rows.iter().zip(&int3_rows) {
            assert!(
                rf == f && rc == c && rl >= l,
                "{version}: ring {ring_rows:?}, int3 {int3_rows:?}"
            );
        }
    }
    let got = entries_in_file(&ring, "count_calls.py");
    for (function, expected) in truth.as_object().unwrap() {
        let expected = expected.as_u64().unwrap();
        let counted = got.get(function).copied().unwrap_or(0);
        if function == "squares" && version == "3.15" {
            // 3.15 fires an entry without return when a generator is created.
            assert!(counted >= expected && counted <= expected + 3);
            continue;
        }
        assert_eq!(counted, expected, "{version}: calls of {function}");
    }
    // Threads created while tracing are named by their own ids.
    assert!(ring["threads"].as_array().unwrap().len() >= 3, "{ring}");
    // GC and import events too.
    for key in ["gc", "imports"] {
        let count = |r: &serde_json::Value| -> u64 {
            r[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| {
                    x["count"]
                        .as_u64()
                        .or(x["collections"].as_u64())
                        .unwrap_or(0)
                })
                .sum()
        };
        assert_eq!(count(&ring), count(&int3), "{version}: {key}");
    }
}

#[test]
fn ring_gives_the_int3_engines_events_on_3_9() {
    same_events_as_int3("3.9");
}

#[test]
fn ring_gives_the_int3_engines_events_on_3_15() {
    same_events_as_int3("3.15");
}

#[test]
fn the_target_survives_pyprobe_killed_while_the_ring_serves_it() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    for run in 0..8u64 {
        let mut target = Target::spawn(&py.launcher, &[&fixture_script("hot_loop.py"), "2"]);
        let pid = target.pid();
        std::thread::sleep(Duration::from_millis(200));
        let (_, sems) = sites_and_semaphores(pid);
        let out = TempFile::new(&format!("ring-kill-{run}.pyprobe"));
        let mut tracer = Tracer::record(
            out.path(),
            &[
                "-p",
                &pid.to_string(),
                "--mode",
                "trace",
                "--engine",
                "ring",
            ],
        );
        tracer.wait_until_traced(pid, &sems);
        std::thread::sleep(Duration::from_millis(100 + run * 90));
        tracer.signal(libc::SIGKILL);
        let _ = tracer.wait(Duration::from_secs(10));
        // The guardian lowers the semaphores at once (the jumps, still valid, are no
        // longer reached), then puts the original code back with the threads stopped.
        let lowered = wait_for(Duration::from_secs(2), || {
            sems.iter()
                .all(|&s| read_target_memory(pid, s, 2) == [0, 0])
        });
        assert!(lowered, "run {run}: semaphores lowered after SIGKILL");
        let line = target.wait_for_line("done");
        assert_eq!(
            line.trim(),
            "done True",
            "run {run}: the target's own check"
        );
    }
}

#[test]
fn asking_for_the_ring_where_no_probe_is_traced_is_not_an_error() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    // Sampling arms no probe: `--engine ring` has nothing to serve, and says nothing.
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("paced_calls.py"), "0.5"]);
    target.wait_for_line("ready");
    let out = TempFile::new("ring-sample.pyprobe");
    let pid = target.pid().to_string();
    let args = [
        "-p", &pid, "--mode", "sample", "--engine", "ring", "-d", "0.3",
    ];
    let (status, stderr) = Tracer::record(out.path(), &args).wait(Duration::from_secs(20));
    assert!(status.success(), "{stderr}");
    assert!(!stderr.contains("ring engine"), "{stderr}");
    target.send_line("go");
    assert!(target.wait_for_line("{").contains("tick"));
}

#[test]
fn a_call_heavy_program_loses_nothing_the_target_waits_instead() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    // fib(22): 57,313 calls, 114,626 events in a few tens of ms, faster than pyprobe
    // can record them: the target is held while pyprobe catches up.
    let out = TempFile::new("ring-fib.pyprobe");
    let fib = repo().join("benches/workloads/fib.py");
    let run = trace_launched(&out, "ring", &py, &[fib.to_str().unwrap(), "22"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "17711");
    let report = report_json(out.path());
    assert_eq!(report["lost_events"], 0, "{stderr}");
    assert_eq!(
        entries_in_file(&report, "fib.py")["fib"],
        57_313,
        "{stderr}"
    );
}

/// A target that dies of SIGKILL right after its calls: what it published to the
/// ring but pyprobe had not read yet is still recorded (the ring is mapped in
/// pyprobe too and outlives the target).
#[test]
fn a_killed_target_loses_none_of_its_last_events() {
    let _serial = serial();
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        for run in 0..5 {
            let out = TempFile::new(&format!("ring-killed-{version}-{run}.pyprobe"));
            let script = fixture_script("killed_after_calls.py");
            let result = trace_launched(&out, "ring", &py, &[script]);
            assert_no_panic("killed target", &result.stderr);
            assert_eq!(result.status.code(), Some(128 + libc::SIGKILL));
            assert_eq!(String::from_utf8_lossy(&result.stdout).trim(), "calls 8361");
            let calls = entries_in_file(&report_json(out.path()), "killed_after_calls.py");
            assert_eq!(calls.get("fib"), Some(&8361), "{version} run {run}");
        }
    }
}
