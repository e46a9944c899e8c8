//! pyprobe killed with SIGKILL while tracing a hot call loop: the guardian and the
//! SIGTRAP safety net must keep the target alive and correct, every time.

use std::process::Command;
use std::time::Duration;

use crate::support::*;

fn random_ms(seed: &mut u64, lo: u64, hi: u64) -> u64 {
    // xorshift: a random moment per run without a dependency.
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    lo + *seed % (hi - lo)
}

/// One run: pyprobe tracing `script` is killed at a random moment; whether the
/// target then finished its own check, and whether the guardian said it restored it.
fn killed_once(py: &Python, script: &std::path::Path, seed: &mut u64, run: &str) -> (bool, bool) {
    let target = Command::new(&py.launcher)
        .arg(script)
        .arg("1.2")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = target.id() as i32;
    std::thread::sleep(Duration::from_millis(150));
    // Killed, pyprobe leaves what it recorded in OUT.partial: removed with it.
    let recording = TempFile::new(&format!("sigkill-{run}.pyprobe"));
    let tracer = Tracer::record(
        recording.path(),
        &["-p", &pid.to_string(), "--mode", "trace"],
    );
    std::thread::sleep(Duration::from_millis(random_ms(seed, 100, 800)));
    tracer.signal(libc::SIGKILL);
    let (_, stderr) = tracer.wait(Duration::from_secs(30));
    let out = target.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ok = out.status.success() && stdout.trim() == "done True";
    if !ok {
        eprintln!("run {run}: target {:?}, output {stdout:?}", out.status);
    }
    let restored = stderr.contains("pyprobe guardian: pyprobe died; restored");
    (ok, restored)
}

/// 50 runs, in two streams side by side (the kills land on a busy machine too,
/// and the test takes half the time).
#[test]
fn the_target_survives_pyprobe_being_killed_50_times_of_50() {
    let Some(py) = python("3.9") else { return };
    let script = repo().join("fixtures/python/hot_loop.py");
    let (streams, per_stream) = (2, 25);
    let results: Vec<(bool, bool)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..streams)
            .map(|stream| {
                let (py, script) = (&py, &script);
                scope.spawn(move || {
                    let mut seed = (std::process::id() as u64 * 2 + stream) | 1;
                    (0..per_stream)
                        .map(|run| killed_once(py, script, &mut seed, &format!("{stream}-{run}")))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a stream of kills"))
            .collect()
    });
    let runs = results.len();
    let survived = results.iter().filter(|r| r.0).count();
    let restored_lines = results.iter().filter(|r| r.1).count();
    eprintln!(
        "survived {survived}/{runs}; the guardian reported restoring in {restored_lines} runs"
    );
    assert_eq!(runs, 50);
    assert_eq!(
        survived, runs,
        "the target must survive every SIGKILL of pyprobe"
    );
}

/// The program's entry point, from its auxiliary vector.
fn entry_point(pid: i32) -> u64 {
    let auxv = std::fs::read(format!("/proc/{pid}/auxv")).expect("read auxv");
    auxv.chunks_exact(16)
        .map(|p| {
            (
                u64::from_le_bytes(p[..8].try_into().unwrap()),
                u64::from_le_bytes(p[8..].try_into().unwrap()),
            )
        })
        .find(|&(kind, _)| kind == 9)
        .expect("AT_ENTRY")
        .1
}

/// pyprobe killed at the worst moment: while one of the system calls it injects
/// (the ring's set-up, the SIGTRAP net) has the thread's registers replaced. The
/// kernel lets the thread go with pyprobe's registers; before the guardian took
/// such a thread over, it ran the program's code with them and the program died of
/// SIGSEGV (8 of 8 calls tried). Each injected call in turn, on 3.9 and 3.15: the
/// target finishes its own check, and its entry point, borrowed during each call,
/// has its bytes back.
#[test]
#[cfg_attr(
    not(feature = "test-switches"),
    ignore = "pyprobe must be built with --features test-switches"
)]
fn the_target_survives_pyprobe_killed_inside_each_injected_call() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let script = repo().join("fixtures/python/hot_loop.py");
        let mut killed_in_a_call = 0;
        for n in 1..=12 {
            let target = Command::new(&py.launcher)
                .arg(&script)
                .arg("1.5")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let pid = target.id() as i32;
            std::thread::sleep(Duration::from_millis(300));
            let entry = entry_point(pid);
            let entry_bytes = read_target_memory(pid, entry, 4);
            let out = TempFile::new(&format!("die-in-call-{version}-{n}.pyprobe"));
            let tracer = pyprobe()
                .args([
                    "record",
                    "-p",
                    &pid.to_string(),
                    "-d",
                    "0.5",
                    "-o",
                    out.path(),
                ])
                .env("PYPROBE_TEST_DIE_IN_INJECTED_CALL", n.to_string())
                .stderr(std::process::Stdio::piped())
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&tracer.stderr);
            use std::os::unix::process::ExitStatusExt;
            if tracer.status.signal() == Some(libc::SIGKILL) {
                killed_in_a_call += 1;
                // The guardian has put the bytes back by the time it said so.
                assert!(
                    wait_for(Duration::from_secs(3), || read_target_memory(pid, entry, 4)
                        == entry_bytes),
                    "{version}, call {n}: the entry point's bytes back:\n{stderr}"
                );
            }
            let done = target.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&done.stdout);
            assert!(
                done.status.success() && stdout.trim() == "done True",
                "{version}: pyprobe killed in injected call {n}: the target {:?}, {stdout:?}:\n\
                 {stderr}",
                done.status
            );
        }
        // The ring's set-up and the net take more than a handful of calls.
        assert!(
            killed_in_a_call >= 5,
            "{version}: pyprobe died in only {killed_in_a_call} injected calls"
        );
    }
}

/// pyprobe and everything in its process group killed at once (`kill -9 -PGID`, as a
/// supervisor or `timeout -s KILL` does): the guardian, in a session of its own,
/// survives and restores every site and semaphore of the target within a second.
fn group_killed_restores(engine: &str, wrap_in_timeout: bool) {
    let Some(py) = python("3.9") else { return };
    let script = repo().join("fixtures/python/hot_loop.py");
    let mut target = Target::spawn(&py.launcher, &[script.to_str().unwrap(), "8", "ready"]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let (sites, sems) = sites_and_semaphores(pid);
    let out = TempFile::new("group-killed.pyprobe");
    let pid_arg = pid.to_string();
    let args = [
        "record",
        "-p",
        &pid_arg,
        "--mode",
        "trace",
        "--engine",
        engine,
        "-o",
        out.path(),
    ];
    let mut cmd = if wrap_in_timeout {
        // timeout kills its own process group, pyprobe with it.
        let mut c = Command::new("timeout");
        c.args(["-s", "KILL", "1.5"])
            .arg(env!("CARGO_BIN_EXE_pyprobe"));
        c.args(args);
        c
    } else {
        let mut c = pyprobe();
        c.args(args);
        c
    };
    use std::os::unix::process::CommandExt;
    cmd.process_group(0).stderr(std::process::Stdio::piped());
    let tracer = cmd.spawn().unwrap();
    let pgid = tracer.id() as i32;
    wait_until_traced(pid, &sems);
    if !wrap_in_timeout {
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: plain kill(2) of the process group pyprobe leads.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    let killed_at = std::time::Instant::now();
    let restored = wait_for(Duration::from_secs(5), || {
        sems.iter()
            .all(|&s| read_target_memory(pid, s, 2) == [0, 0])
            && sites
                .iter()
                .all(|&s| read_target_memory(pid, s, 1) == [0x90])
    });
    let took = killed_at.elapsed();
    let tracer_out = tracer.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&tracer_out.stderr);
    assert!(
        restored,
        "engine {engine}: sites and semaphores of {pid} not restored after pyprobe's process \
         group was killed; pyprobe said:\n{stderr}"
    );
    if !wrap_in_timeout {
        assert!(
            took < Duration::from_secs(1),
            "engine {engine}: restored only after {took:?}"
        );
    }
    assert!(
        stderr.contains("pyprobe guardian: pyprobe died; restored"),
        "engine {engine}: the guardian said nothing:\n{stderr}"
    );
    let (stdout, status) = target.finish();
    assert!(
        status.success() && stdout.contains("done True"),
        "engine {engine}: target {status:?}, output {stdout:?}"
    );
}

#[test]
fn the_guardian_outlives_a_killed_process_group_ring_engine() {
    group_killed_restores("ring", false);
}

#[test]
fn the_guardian_outlives_a_killed_process_group_int3_engine() {
    group_killed_restores("int3", false);
}

#[test]
fn the_guardian_outlives_timeout_s_kill() {
    group_killed_restores("ring", true);
}
