//! Trace mode loses nothing while pyprobe lives: when pyprobe falls behind, a
//! producer waits for room in its ring rather than drop an event, whatever makes
//! pyprobe slow (CPUs busy with other work, pyprobe stopped by a signal) and
//! whatever the program does (fork around its calls, threads starting and
//! exiting). Each test compares pyprobe's counts with the program's own. The
//! SDT ring engine's trampolines and the injected hook's callbacks (CPython 3.12
//! and 3.13 without function probes) wait the same way.
//! `scripts/test.sh` runs these tests alone: their subject is pyprobe keeping up.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::support::*;

const FIXTURE: &str = "exact_under_load.py";

/// `pyprobe record --mode trace --engine ring` of the fixture's `shape`, started
/// in the background with stdout (the fixture's counts) and stderr piped.
fn spawn_trace(py: &Python, out: &TempFile, shape: &str, amount: &str) -> std::process::Child {
    spawn_engine(&py.launcher, "ring", out, shape, amount)
}

/// The same with `--engine engine` and the interpreter `launcher`.
fn spawn_engine(
    launcher: &Path,
    engine: &str,
    out: &TempFile,
    shape: &str,
    amount: &str,
) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_pyprobe"))
        .args(["record", "-v", "--mode", "trace", "--engine", engine, "-o"])
        .arg(out.path())
        .arg("--")
        .arg(launcher)
        .args([&fixture_script(FIXTURE), shape, amount])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pyprobe")
}

/// Waits for pyprobe; returns the fixture's own counts and pyprobe's stderr.
fn finish(mut child: std::process::Child) -> (Value, String) {
    let mut stdout = String::new();
    let mut stderr = String::new();
    let _ = child
        .stdout
        .take()
        .map(|mut o| o.read_to_string(&mut stdout));
    let _ = child
        .stderr
        .take()
        .map(|mut e| e.read_to_string(&mut stderr));
    let status = child.wait().expect("wait for pyprobe");
    assert_no_panic("record", stderr.as_bytes());
    assert!(status.success(), "pyprobe record: {status:?}\n{stderr}");
    let counts = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("the fixture's counts in {stdout:?}: {e}\n{stderr}"));
    (counts, stderr)
}

/// Every count the fixture printed equals pyprobe's for that function, and the
/// recording says nothing was lost.
fn assert_exact(what: &str, out: &TempFile, counts: &Value, stderr: &str) {
    let report = report_json(out.path());
    let calls = entries_in_file(&report, FIXTURE);
    for (function, want) in counts.as_object().expect("counts") {
        assert_eq!(
            calls.get(function).copied(),
            want.as_u64(),
            "{what}: calls of {function}()\n{stderr}"
        );
    }
    assert_eq!(report["lost_events"], 0, "{what}: lost events\n{stderr}");
}

/// fib(15) in a loop while every CPU is busy with other work: pyprobe gets a
/// share of a CPU at best, far less than the target's event rate needs.
#[test]
fn under_cpu_contention_every_call_is_recorded() {
    let _serial = serial();
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let out = TempFile::new(&format!("contention-{version}.pyprobe"));
        let busy = Contention::start(&py);
        let child = spawn_trace(&py, &out, "calls", "1.5");
        let (counts, stderr) = finish(child);
        drop(busy);
        assert_exact(
            &format!("{version} under contention"),
            &out,
            &counts,
            &stderr,
        );
    }
}

/// `int3` hits while every CPU is held by a busy loop pinned to it: where pyprobe
/// yields the CPU it follows (`SCHED_IDLE`), a busy loop there would starve it
/// while the target waits at its stops; its guard must take the normal policy
/// back, and every call is recorded.
#[test]
fn int3_under_pinned_contention_pyprobe_takes_its_cpu_back() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    let out = TempFile::new("int3-pinned-contention.pyprobe");
    let busy = Contention::pinned(&py);
    let child = spawn_engine(&py.launcher, "int3", &out, "calls", "1.0");
    let (counts, stderr) = finish(child);
    drop(busy);
    assert_exact("int3 under pinned contention", &out, &counts, &stderr);
    // Said with -v when pyprobe yielded at all (it may not: no CAP_SYS_NICE).
    if let Some(line) = stderr.lines().find(|l| l.contains("SCHED_IDLE")) {
        let taken: u64 = line
            .split("back ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("how often the guard took it back, in {line:?}"));
        assert!(
            taken >= 1,
            "yielded beside pinned busy loops, never taken back:\n{stderr}"
        );
    }
}

/// pyprobe stopped with SIGSTOP for 2 s while the target calls as fast as it can:
/// the target does not wait for it (the guardian has pyprobe let go), pyprobe takes
/// the recording up again after SIGCONT, and says how long it was paused.
#[test]
fn pyprobe_stopped_for_two_seconds_lets_go_and_says_so() {
    let _serial = serial();
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let out = TempFile::new(&format!("stopped-{version}.pyprobe"));
        let child = spawn_trace(&py, &out, "calls", "3");
        let pyprobe = child.id() as i32;
        std::thread::sleep(Duration::from_millis(800));
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pyprobe, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_secs(2));
        // SAFETY: as above.
        unsafe { libc::kill(pyprobe, libc::SIGCONT) };
        let (counts, stderr) = finish(child);
        assert_paused(
            &format!("{version}, pyprobe stopped 2 s"),
            &out,
            &counts,
            &stderr,
        );
    }
}

/// The recording of a run during which pyprobe was stopped about 2 s: one pause of
/// about that length, said on the closing line; calls counted before and after it,
/// never more than the program made. (Events of the few tens of milliseconds between
/// the stop and the guardian's answer may be counted lost: the full ring stops
/// waiting then.)
fn assert_paused(what: &str, out: &TempFile, counts: &Value, stderr: &str) {
    assert!(
        stderr.contains("paused by SIGSTOP") && stderr.contains("paused 1 time"),
        "{what}: pyprobe did not say it let go:\n{stderr}"
    );
    let report = report_json(out.path());
    let paused = report["paused"].as_array().expect("paused");
    assert_eq!(paused.len(), 1, "{what}: pauses {paused:?}\n{stderr}");
    let ns = paused[0]["ns"].as_u64().unwrap_or(0);
    assert!(
        (1_500_000_000..3_000_000_000).contains(&ns),
        "{what}: a pause of {ns} ns for a stop of 2 s\n{stderr}"
    );
    let calls = entries_in_file(&report, FIXTURE);
    for (function, want) in counts.as_object().expect("counts") {
        let got = calls.get(function).copied().unwrap_or(0);
        let want = want.as_u64().unwrap_or(0);
        assert!(
            got <= want && (want == 0 || got > 0),
            "{what}: {got} calls of {function}() recorded, the program made {want}\n{stderr}"
        );
    }
}

/// pyprobe stopped while the target waits in a full ring, then killed: its
/// guardian ends the wait and puts the code back; the program finishes its own
/// work and exits 0.
#[test]
fn pyprobe_killed_while_the_target_waits_leaves_it_unharmed() {
    let _serial = serial();
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let mut target = Target::spawn(&py.launcher, &[&fixture_script(FIXTURE), "calls", "3"]);
        let pid = target.pid();
        let (_, sems) = sites_and_semaphores(pid);
        let out = TempFile::new(&format!("killed-waiting-{version}.pyprobe"));
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
        std::thread::sleep(Duration::from_millis(300));
        tracer.signal(libc::SIGSTOP);
        std::thread::sleep(Duration::from_millis(500));
        tracer.signal(libc::SIGKILL);
        let _ = tracer.wait(Duration::from_secs(10));
        let line = target.wait_for_line("{");
        let counts: Value = serde_json::from_str(&line).expect("the fixture's counts");
        assert!(counts["fib"].as_u64().unwrap_or(0) > 0, "{version}: {line}");
        let (_, status) = target.finish();
        assert!(
            status.success(),
            "{version}: the target's own exit: {status:?}"
        );
    }
}

/// A parent that forks around each of its calls: the children's copies of the
/// ring's jumps must not cost the parent an event.
#[test]
fn a_forking_program_loses_none_of_its_calls() {
    let _serial = serial();
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        for run in 0..3 {
            let out = TempFile::new(&format!("forks-{version}-{run}.pyprobe"));
            let (counts, stderr) = finish(spawn_trace(&py, &out, "forks", "400"));
            assert_exact(
                &format!("{version} forks, run {run}"),
                &out,
                &counts,
                &stderr,
            );
        }
    }
}

/// Threads start and exit all the time, and a new thread often gets a dead one's
/// `%fs` base: every call is the right thread's, so no return comes without its
/// entry.
#[test]
fn thread_churn_gives_every_return_its_entry() {
    let _serial = serial();
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let out = TempFile::new(&format!("churn-{version}.pyprobe"));
        let (counts, stderr) = finish(spawn_trace(&py, &out, "churn", "1.5"));
        assert_exact(&format!("{version} thread churn"), &out, &counts, &stderr);
        let report = report_json(out.path());
        let anomalies = &report["anomalies"];
        assert_eq!(
            anomalies["orphan_returns"], 0,
            "{version}: returns without their entry: {anomalies}\n{stderr}"
        );
    }
}

/// The interpreters the hook engine serves, one per hook shape: the profile
/// route with the tracing flag in the thread state (pyenv 3.8) and in the frame's
/// `CFrame` with the code object one frame away (Debian 3.11); sys.monitoring on
/// pyenv 3.12 and 3.13 and Debian 3.14 (Debian's 3.13 runs the same hook as pyenv's).
fn hook_pythons() -> Vec<(String, std::path::PathBuf)> {
    let mut all = crate::hook::hook_interpreters();
    all.retain(|(label, _)| {
        ["3.8", "Debian 3.11", "3.12", "3.13", "Debian 3.14"].contains(&label.as_str())
    });
    all
}

/// The hook engine's callbacks, pyprobe stopped for 2 s: pyprobe lets go (the hook
/// is removed), takes the recording up again after SIGCONT, and says so.
#[test]
fn hook_pyprobe_stopped_for_two_seconds_lets_go_and_says_so() {
    let _serial = serial();
    for (minor, py) in hook_pythons() {
        let out = TempFile::new(&format!("hook-stopped-{minor}.pyprobe"));
        let child = spawn_engine(&py, "hook", &out, "calls", "3");
        let pyprobe = child.id() as i32;
        std::thread::sleep(Duration::from_millis(800));
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pyprobe, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_secs(2));
        // SAFETY: as above.
        unsafe { libc::kill(pyprobe, libc::SIGCONT) };
        let (counts, stderr) = finish(child);
        assert!(stderr.contains("engine hook"), "{minor}: {stderr}");
        assert_paused(
            &format!("hook {minor}, pyprobe stopped 2 s"),
            &out,
            &counts,
            &stderr,
        );
    }
}

/// pyprobe stopped while a hook callback waits in its full ring, then killed: the
/// guardian has the stopped pyprobe let go (the target finishes its calls while
/// pyprobe is still stopped), the hook is gone (the target sees tool id 4 free), and
/// the program's own counts come out right.
#[test]
fn hook_pyprobe_killed_while_the_target_waits_leaves_it_unharmed_and_unhooked() {
    let _serial = serial();
    for (minor, py) in hook_pythons() {
        let out = TempFile::new(&format!("hook-killed-waiting-{minor}.pyprobe"));
        let (mut target, tracer) = crate::hook::attach_hooked(&py, &out);
        target.send_line("3000000 1");
        std::thread::sleep(Duration::from_millis(300));
        tracer.signal(libc::SIGSTOP);
        let stopped_at = std::time::Instant::now();
        // Should the target wait for the stopped pyprobe, its line would never come:
        // pyprobe is killed after 10 s so that the test ends, and says so below.
        let stopped_pid = tracer.pid();
        let watchdog = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(10));
            // SAFETY: kill(2); harmless if pyprobe is gone already.
            unsafe { libc::kill(stopped_pid, libc::SIGKILL) };
        });
        assert_eq!(
            target.wait_for_line("calls"),
            "calls f=3000000 g=3000000 worker=1",
            "{minor}"
        );
        let took = stopped_at.elapsed();
        assert!(
            took < Duration::from_secs(8),
            "{minor}: the target finished its calls {took:?} after pyprobe was stopped: it \
             waited for a stopped pyprobe"
        );
        tracer.signal(libc::SIGKILL);
        let _ = tracer.wait(Duration::from_secs(10));
        drop(watchdog);
        crate::hook::wait_tool(&mut target, "None", Duration::from_secs(10));
        let (rest, status) = target.finish();
        assert!(rest.contains("done True"), "{minor}: {rest}");
        assert!(status.success(), "{minor}: {status:?}");
    }
}

/// Thread churn under the hook engine: every call counted, no return without
/// its entry.
#[test]
fn hook_thread_churn_gives_every_return_its_entry() {
    let _serial = serial();
    for (minor, py) in hook_pythons() {
        let out = TempFile::new(&format!("hook-churn-{minor}.pyprobe"));
        let (counts, stderr) = finish(spawn_engine(&py, "hook", &out, "churn", "1.5"));
        assert_exact(&format!("hook {minor} churn"), &out, &counts, &stderr);
        // Launched, the hook goes in with one thread: its ring starts without
        // `lock`, and the churn tests the switch to locked reservations.
        assert!(
            stderr.contains("without a locked instruction"),
            "{minor}: the ring did not start solo:\n{stderr}"
        );
        let anomalies = &report_json(out.path())["anomalies"];
        assert_eq!(
            anomalies["orphan_returns"], 0,
            "{minor}: returns without their entry: {anomalies}\n{stderr}"
        );
    }
}

/// Stops pyprobe (SIGSTOP) at a moment when it does not hold the target: right
/// after the hook is installed pyprobe stops every thread once more to put the
/// safe point's bytes back, and a SIGSTOP landing then would leave the target
/// waiting for it. Let go and tried again until the target runs.
fn stop_with_the_target_running(tracer: &Tracer, target: i32) {
    for _ in 0..100 {
        tracer.signal(libc::SIGSTOP);
        wait_for(Duration::from_secs(5), || {
            proc_state(tracer.pid()) == Some('T')
        });
        std::thread::sleep(Duration::from_millis(50));
        if proc_state(target) != Some('t') {
            return;
        }
        tracer.signal(libc::SIGCONT);
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("pyprobe held the target each time it was stopped");
}

/// A program that ends while pyprobe is stopped. Its calls were made while it
/// was traced, some still in the ring when pyprobe stops; the guardian has
/// pyprobe let go, which reads the ring first, while the code objects are
/// alive. Every call is counted under its own function, and pyprobe says the
/// program ended during the pause.
#[test]
fn hook_a_program_ending_while_pyprobe_is_stopped_keeps_its_names() {
    let _serial = serial();
    for (minor, py) in hook_pythons() {
        let out = TempFile::new(&format!("hook-ends-stopped-{minor}.pyprobe"));
        let (mut target, tracer) = crate::hook::attach_hooked(&py, &out);
        // No new thread: a thread's start stops for its tracer.
        target.send_line("2000 0");
        assert_eq!(
            target.wait_for_line("calls"),
            "calls f=2000 g=0 worker=0",
            "{minor}"
        );
        stop_with_the_target_running(&tracer, target.pid());
        // End of input: the program ends, pyprobe still stopped.
        drop(target.stdin.take());
        std::thread::sleep(Duration::from_millis(1000));
        tracer.signal(libc::SIGCONT);
        let (rest, status) = target.finish();
        assert!(rest.contains("done True"), "{minor}: {rest}");
        assert!(status.success(), "{minor}: {status:?}");
        let (_, stderr) = tracer.wait(Duration::from_secs(30));
        assert!(
            stderr.contains("ended while pyprobe was paused"),
            "{minor}: {stderr}"
        );
        let report = report_json(out.path());
        let calls = entries_in_file(&report, "hook_calls.py");
        assert_eq!(calls.get("f"), Some(&2000), "{minor}: {calls:?}\n{stderr}");
    }
}

/// Short sessions on a program that feeds both rings (calls through the hook,
/// audit events through the SDT ring): at each detach the SDT ring is read up to
/// the hook records read, a batch at a time, until both are empty. Reading stopped
/// at the first batch of the hook's backlog, so the SDT records newer than it were
/// counted lost ("N more lost: the ring was full") in most short detaches. Then
/// the record a thread was writing when stopped for the detach (inside a
/// trampoline capturing the audit event's stack) was lost at nearly every one on
/// 3.13 and 3.14: that thread now finishes the trampoline first.
#[test]
fn short_detaches_where_the_hook_and_the_ring_both_serve_lose_nothing() {
    for minor in ["3.11", "3.13", "3.14"] {
        let Some(py) = python(minor) else { continue };
        // id() raises an audit event after every 20 steps of a loop, for a minute.
        let script = fixture_script("audit_storm.py");
        let mut target = Target::spawn(&py.launcher, &[&script, "60", "20", "ready"]);
        target.wait_for_line("ready");
        let pid = target.pid().to_string();
        for session in 0..6 {
            let out = TempFile::new("short-detach.pyprobe");
            let tag = format!("{minor} session {session}");
            let run = pyprobe()
                .args([
                    "record", "--mode", "trace", "--force", "-d", "0.4", "-p", &pid,
                ])
                .arg("-o")
                .arg(out.path())
                .output()
                .expect("run pyprobe");
            let stderr = String::from_utf8_lossy(&run.stderr);
            assert!(run.status.success(), "{tag}: {stderr}");
            let report = report_json(out.path());
            let audits = audit_count(&report, "builtins.id");
            assert!(audits > 0, "{tag}: audit events recorded:\n{stderr}");
            assert_eq!(report["lost_events"].as_u64(), Some(0), "{tag}: {stderr}");
        }
    }
}
