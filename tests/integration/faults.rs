//! Faults in the target while pyprobe traces it, against real Debian CPythons: the
//! target exits, is killed, execs, forks (with and without `--subprocesses`), runs
//! 200 short threads, handles signals with its own handlers, is stopped and
//! continued; 1,000 attach/record/detach cycles; the disk fills up. In each case the
//! target behaves exactly as untraced (the same output, the same exit status),
//! pyprobe ends cleanly, and the recording reads back.

use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// What one run of the interactive fixture gave: the lines the steps collected, the
/// rest of its output, and its exit status.
#[derive(Debug, PartialEq)]
struct Behaviour {
    transcript: Vec<String>,
    rest: String,
    code: Option<i32>,
    signal: Option<i32>,
}

fn behaviour(transcript: Vec<String>, rest: String, status: ExitStatus) -> Behaviour {
    use std::os::unix::process::ExitStatusExt;
    Behaviour {
        transcript,
        rest,
        code: status.code(),
        signal: status.signal(),
    }
}

/// How a traced run ends.
#[derive(Clone, Copy, PartialEq)]
enum End {
    /// The steps end the target (exit, kill, exec that exits): pyprobe must notice
    /// and end by itself.
    TargetEnds,
    /// After the steps pyprobe is sent SIGINT and detaches; the sites must be
    /// restored; then the target is told to stop.
    Detach,
}

struct Traced {
    behaviour: Behaviour,
    stderr: String,
    recording: TempFile,
}

/// Runs `steps` against `faults.py` untraced, then against a fresh `faults.py` while
/// `pyprobe record -p PID EXTRA...` records it, and checks the two behave the same.
fn untraced_vs_traced(
    py: &Python,
    name: &str,
    extra: &[&str],
    end: End,
    steps: impl Fn(&mut Target) -> Vec<String>,
) -> Traced {
    let script = fixture_script("faults.py");
    let untraced = {
        let mut t = Target::spawn(&py.launcher, &[&script]);
        t.wait_for_line("ready");
        let transcript = steps(&mut t);
        if end == End::Detach {
            t.send_line("stop");
        }
        let (rest, status) = t.finish();
        behaviour(transcript, rest, status)
    };

    let mut t = Target::spawn(&py.launcher, &[&script]);
    t.wait_for_line("ready");
    let pid = t.pid();
    let (sites, sems) = sites_and_semaphores(pid);
    let recording = TempFile::new(&format!("{name}-{}.pyprobe", py.version));
    let mut args = vec![
        "-p".to_string(),
        pid.to_string(),
        "--mode".into(),
        "trace".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let tracer = Tracer::record(recording.path(), &args);
    wait_until_traced(pid, &sems);
    let transcript = steps(&mut t);
    let (tracer_status, stderr) = match end {
        End::TargetEnds => tracer.wait(LIMIT),
        End::Detach => {
            tracer.signal(libc::SIGINT);
            let result = tracer.wait(LIMIT);
            assert_restored(pid, &sites, &sems);
            t.send_line("stop");
            result
        }
    };
    let (rest, status) = t.finish();
    let traced = behaviour(transcript, rest, status);
    assert_eq!(
        traced, untraced,
        "{name} on {}: the target behaves as untraced",
        py.version
    );
    assert!(
        tracer_status.success(),
        "{name} on {}: pyprobe ends cleanly: {stderr}",
        py.version
    );
    Traced {
        behaviour: traced,
        stderr,
        recording,
    }
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2).
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// Sends a command and returns the answer line starting with `prefix`.
fn ask(t: &mut Target, command: &str, prefix: &str) -> String {
    t.send_line(command);
    t.wait_for_line(prefix)
}

fn fib_calls(report: &serde_json::Value) -> u64 {
    entries_in_file(report, "faults.py")
        .get("fib")
        .copied()
        .unwrap_or(0)
}

#[test]
fn target_exits_while_traced() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let run = untraced_vs_traced(&py, "exit", &[], End::TargetEnds, |t| {
            vec![ask(t, "ping", "pong"), {
                t.send_line("exit 3");
                t.wait_for_line("result")
            }]
        });
        assert_eq!(run.behaviour.code, Some(3));
        assert!(
            run.stderr.contains("target exited with status 3"),
            "{}",
            run.stderr
        );
        assert!(fib_calls(&report_json(run.recording.path())) > 0);
    }
}

#[test]
fn target_killed_while_traced() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let run = untraced_vs_traced(&py, "sigkill", &[], End::TargetEnds, |t| {
            let pong = ask(t, "ping", "pong");
            std::thread::sleep(Duration::from_millis(200));
            kill(t.pid(), libc::SIGKILL);
            vec![pong]
        });
        assert_eq!(run.behaviour.signal, Some(libc::SIGKILL));
        assert!(
            run.stderr.contains("target killed by SIGKILL"),
            "{}",
            run.stderr
        );
        assert!(fib_calls(&report_json(run.recording.path())) > 0);
    }
}

#[test]
fn launched_target_killed_gives_its_status() {
    let Some(py) = python("3.9") else { return };
    let recording = TempFile::new("launch-kill.pyprobe");
    let mut tracer = pyprobe()
        .args(["record", "--mode", "trace", "-o", recording.path(), "--"])
        .arg(&py.launcher)
        .arg(fixture_script("faults.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(tracer.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    // pyprobe's children: the command, and maybe a helper of pyprobe's own.
    let children = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        tracer.id(),
        tracer.id()
    ))
    .unwrap();
    let child: i32 = children
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .find(|c: &i32| {
            std::fs::read_link(format!("/proc/{c}/exe"))
                .is_ok_and(|exe| exe.to_string_lossy().contains("python3.9"))
        })
        .expect("the launched command among pyprobe's children");
    let mut stdin = tracer.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, b"ping\n").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "pong 1");
    kill(child, libc::SIGKILL);
    let output = tracer.wait_with_output().unwrap();
    assert_no_panic("record -- (killed)", &output.stderr);
    assert_eq!(
        output.status.code(),
        Some(128 + libc::SIGKILL),
        "record -- CMD exits 128+9 when the command is killed"
    );
    assert!(fib_calls(&report_json(recording.path())) > 0);
}

#[test]
fn target_execs_another_python_while_traced() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        // -v: the sites armed in each image are said.
        let run = untraced_vs_traced(&py, "exec", &["-v"], End::TargetEnds, |t| {
            vec![ask(t, "ping", "pong"), ask(t, "exec 4", "exec-child")]
        });
        assert_eq!(run.behaviour.code, Some(4));
        assert_eq!(
            run.stderr.matches("probe sites armed").count(),
            2,
            "{version}: armed at attach and again in the new image: {}",
            run.stderr
        );
        let report = report_json(run.recording.path());
        let calls = entries_in_file(&report, "faults.py");
        assert_eq!(
            calls.get("exec_child"),
            Some(&1),
            "{version}: the exec'd program is traced from its start: {calls:?}"
        );
        assert!(
            fib_calls(&report) >= 753,
            "{version}: fib(13) after exec: {calls:?}"
        );
    }
}

#[test]
fn target_forks_while_traced_with_and_without_subprocesses() {
    let Some(py) = python("3.9") else { return };
    for extra in [&[][..], &["--subprocesses"][..]] {
        let run = untraced_vs_traced(&py, "fork", extra, End::Detach, |t| {
            (0..3).map(|_| ask(t, "fork", "child")).collect()
        });
        assert_eq!(run.behaviour.transcript, ["child 0", "child 0", "child 0"]);
        report_json(run.recording.path());
    }
}

/// A launched program forks 3 children that each call `child_work` once (fib(14):
/// 1,219 calls of fib); the parent calls neither. Without `--subprocesses` the
/// children are cleaned and run untraced; with it, every one of their calls counts.
#[test]
fn forked_children_are_cleaned_or_traced_exactly() {
    let Some(py) = python("3.9") else { return };
    let script = fixture_script("faults.py");
    let untraced = Command::new(&py.launcher)
        .args([&script, "forks", "3"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&untraced.stdout),
        "children 0 0 0\n"
    );
    for (extra, expected_work, expected_fib) in
        [(&[][..], 0, 0), (&["--subprocesses"][..], 3, 3 * 1219)]
    {
        let recording = TempFile::new(&format!("forks{}.pyprobe", extra.len()));
        let out = pyprobe()
            .args(["record", "--mode", "trace", "-o", recording.path()])
            .args(extra)
            .arg("--")
            .arg(&py.launcher)
            .args([&script, "forks", "3"])
            .output()
            .unwrap();
        assert_no_panic("record forks", &out.stderr);
        assert_eq!(out.stdout, untraced.stdout, "{extra:?}: output as untraced");
        assert_eq!(out.status.code(), Some(0));
        let report = report_json(recording.path());
        let calls = entries_in_file(&report, "faults.py");
        assert_eq!(
            (
                calls.get("child_work").copied().unwrap_or(0),
                calls.get("fib").copied().unwrap_or(0)
            ),
            (expected_work, expected_fib),
            "{extra:?}: the children's calls (report: {calls:?})"
        );
    }
}

#[test]
fn two_hundred_short_threads_while_traced() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let run = untraced_vs_traced(&py, "threads", &[], End::Detach, |t| {
            vec![ask(t, "threads 200", "threads"), ask(t, "ping", "pong")]
        });
        assert_eq!(run.behaviour.transcript[0], "threads 200");
        let report = report_json(run.recording.path());
        let threads = report["threads"].as_array().unwrap().len();
        assert!(
            threads > 200,
            "{version}: every short thread seen: {threads}"
        );
        let calls = entries_in_file(&report, "faults.py");
        assert_eq!(
            calls.get("short_thread"),
            Some(&200),
            "{version}: every thread's call counted: {calls:?}"
        );
    }
}

/// Asks for the signal counts until they differ from `before` (a signal is
/// delivered asynchronously); bounded.
fn signals_after(t: &mut Target, before: &str) -> String {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let now = ask(t, "signals", "signals");
        if now != before || Instant::now() > end {
            return now;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn signals_reach_the_targets_own_handlers() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let run = untraced_vs_traced(&py, "signals", &[], End::Detach, |t| {
            let mut lines = vec![ask(t, "signals", "signals")];
            for sig in [
                libc::SIGUSR1,
                libc::SIGINT,
                libc::SIGTERM,
                libc::SIGUSR1,
                libc::SIGINT,
                libc::SIGTERM,
            ] {
                let before = lines.last().unwrap().clone();
                kill(t.pid(), sig);
                lines.push(signals_after(t, &before));
            }
            lines
        });
        assert_eq!(
            run.behaviour.transcript.last().unwrap(),
            "signals SIGINT=2 SIGTERM=2 SIGUSR1=2"
        );
    }
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Stopped: every thread stopped and no CPU time used for 300 ms (the fixture
/// otherwise computes all the time). A traced target is also briefly stopped at
/// each probe hit, so only a quiet window counts; the stop itself may come after
/// pyprobe served a backlog of hits.
fn assert_stays_stopped(pid: i32, what: &str) {
    let quiet = wait_for(Duration::from_secs(10), || {
        let before = cpu_ticks(pid);
        std::thread::sleep(Duration::from_millis(300));
        all_threads_stopped(pid) && cpu_ticks(pid) == before
    });
    assert!(
        quiet,
        "{what}: the target stops and uses no CPU while stopped"
    );
}

fn assert_runs(pid: i32, what: &str) {
    let before = cpu_ticks(pid);
    assert!(
        wait_for(Duration::from_secs(10), || cpu_ticks(pid) > before),
        "{what}: runs again"
    );
}

#[test]
fn target_stopped_and_continued_while_traced() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        untraced_vs_traced(&py, "stop", &[], End::Detach, |t| {
            let pid = t.pid();
            let mut lines = Vec::new();
            for stop in [libc::SIGSTOP, libc::SIGTSTP, libc::SIGSTOP] {
                kill(pid, stop);
                assert_stays_stopped(pid, &format!("signal {stop}"));
                kill(pid, libc::SIGCONT);
                assert_runs(pid, "after SIGCONT");
                lines.push(ask(t, "ping", "pong"));
            }
            lines
        });
    }
}

#[test]
fn detaching_from_a_stopped_target_leaves_it_stopped() {
    let Some(py) = python("3.9") else { return };
    let mut t = Target::spawn(&py.launcher, &[&fixture_script("faults.py")]);
    t.wait_for_line("ready");
    let pid = t.pid();
    let (sites, sems) = sites_and_semaphores(pid);
    let recording = TempFile::new("stopped-detach.pyprobe");
    let tracer = Tracer::record(
        recording.path(),
        &["-p", &pid.to_string(), "--mode", "trace"],
    );
    wait_until_traced(pid, &sems);
    kill(pid, libc::SIGSTOP);
    assert_stays_stopped(pid, "SIGSTOP while traced");
    tracer.signal(libc::SIGINT);
    let (status, _) = tracer.wait(LIMIT);
    assert!(status.success());
    assert_restored(pid, &sites, &sems);
    assert_eq!(
        proc_state(pid),
        Some('T'),
        "after pyprobe left, the target is still in its stop (not traced)"
    );
    assert_stays_stopped(pid, "after detach");
    kill(pid, libc::SIGCONT);
    assert_runs(pid, "SIGCONT after detach");
    assert_eq!(ask(&mut t, "stop", "result"), "result 144");
    let (_, status) = t.finish();
    assert!(status.success());
    report_json(recording.path());
}

fn check_launched_script(version: &'static str, extra: &[&str]) {
    let Some(py) = python(version) else { return };
    let script = fixture_script("faults.py");
    let untraced = Command::new(&py.launcher)
        .args([&script, "script", "5"])
        .output()
        .unwrap();
    assert_eq!(untraced.status.code(), Some(5));
    let recording = TempFile::new(&format!("script-{version}-{}.pyprobe", extra.len()));
    let out = pyprobe()
        .args(["record", "--mode", "trace", "-o", recording.path()])
        .args(extra)
        .arg("--")
        .arg(&py.launcher)
        .args([&script, "script", "5"])
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert_no_panic("record script", &out.stderr);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&untraced.stdout),
        "{version} {extra:?}: output as untraced"
    );
    assert_eq!(out.status.code(), Some(5), "{version}: exit status passes");
    let report = report_json(recording.path());
    let calls = entries_in_file(&report, "faults.py");
    assert_eq!(calls.get("short_thread"), Some(&200), "{calls:?}");
    assert_eq!(calls.get("exec_child"), Some(&1), "{calls:?}");
    assert_eq!(calls.get("on_signal"), Some(&4), "{calls:?}");
}

/// One launched program does it all in a row: 200 threads, a fork, four signals to
/// itself through its handlers, then an exec with exit status 5.
#[test]
fn launched_script_with_threads_fork_signals_and_exec() {
    check_launched_script("3.9", &[]);
    check_launched_script("3.9", &["--subprocesses"]);
    check_launched_script("3.15", &[]);
}

/// 1,000 attach/record/detach cycles against one target with four busy threads (set
/// `PYPROBE_CYCLES` to change the count): every cycle exits 0, leaves every site
/// and semaphore restored, and the target's result is that of an untraced run.
/// Busy threads make pyprobe's detach interrupt threads just as they hit a site.
#[test]
fn a_thousand_attach_detach_cycles() {
    let Some(py) = python("3.9") else { return };
    let cycles: usize = std::env::var("PYPROBE_CYCLES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(1000);
    let mut t = Target::spawn(&py.launcher, &[&fixture_script("faults.py")]);
    t.wait_for_line("ready");
    assert_eq!(ask(&mut t, "spin 3", "spinning"), "spinning 3");
    let pid = t.pid();
    let (sites, sems) = sites_and_semaphores(pid);
    let recording = TempFile::new("cycles.pyprobe");
    let started = Instant::now();
    let mut with_calls = 0;
    for i in 0..cycles {
        let out = pyprobe()
            .args([
                "record",
                "--mode",
                "trace",
                "-p",
                &pid.to_string(),
                "-d",
                "0.02",
                // The same file each cycle.
                "--force",
                "-o",
            ])
            .arg(recording.path())
            .output()
            .unwrap();
        assert_no_panic(&format!("cycle {i}"), &out.stderr);
        assert!(
            out.status.success(),
            "cycle {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // A target dying now (e.g. of a SIGTRAP left pending at detach) may still be
        // on its way out: give its exit status a moment to show.
        if std::fs::File::open(format!("/proc/{pid}/mem")).is_err()
            || matches!(proc_state(pid), Some('Z' | 'X'))
        {
            wait_for(Duration::from_secs(2), || {
                matches!(t.child.try_wait(), Ok(Some(_)))
            });
        }
        if let Some(status) = t.child.try_wait().unwrap() {
            panic!("cycle {i}: the target died: {status:?}");
        }
        assert_restored(pid, &sites, &sems);
        if i % 100 == 99 {
            assert_eq!(ask(&mut t, "ping", "pong"), "pong 1", "cycle {i}");
            let report = report_json(recording.path());
            with_calls += usize::from(fib_calls(&report) > 0);
        }
    }
    eprintln!(
        "{cycles} attach/record/detach cycles in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        with_calls * 100 >= cycles / 2,
        "recordings hold calls ({with_calls} of the sampled ones)"
    );
    assert_eq!(proc_state(pid).map(|s| s != 'Z'), Some(true));
    assert_eq!(ask(&mut t, "stop", "result"), "result 144");
    let (_, status) = t.finish();
    assert!(status.success(), "the target survived {cycles} cycles");
}

/// Mounts a tmpfs of `size` at a fresh directory; `None` (with a notice) when this
/// is not allowed here.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tmp_path("tmpfs");
        std::fs::create_dir_all(&dir).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("NOTICE: skipping: cannot mount a tmpfs here (needs root)");
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn disk_full_while_recording() {
    let Some(py) = python("3.9") else { return };
    let Some(fs) = Tmpfs::mount("1m") else { return };
    let mut t = Target::spawn(&py.launcher, &[&fixture_script("faults.py")]);
    t.wait_for_line("ready");
    let pid = t.pid();
    let (sites, sems) = sites_and_semaphores(pid);
    let recording = fs.0.join("full.pyprobe");
    let recording = recording.to_str().unwrap();
    let tracer = Tracer::record(recording, &["-p", &pid.to_string(), "--mode", "trace"]);
    // It stops by itself once the 1 MiB are full; the limit is for a tracer that
    // never does.
    let (status, stderr) = tracer.wait(Duration::from_secs(120));
    assert_eq!(status.code(), Some(1), "disk full is an error: {stderr}");
    assert!(
        stderr.contains("No space left on device") && stderr.contains("detached"),
        "pyprobe says the disk is full and that it detached: {stderr}"
    );
    assert_restored(pid, &sites, &sems);
    assert_eq!(ask(&mut t, "ping", "pong"), "pong 1", "the target runs on");
    // What was written reads back, with a note that it was cut short.
    let out = run_pyprobe(&["report", recording, "--format", "json"]);
    assert_no_panic("report of a cut recording", &out.stderr);
    let report = json_of(&out);
    assert!(fib_calls(&report) > 0, "the whole chunks read back");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cut short"),
        "report notes the truncation"
    );
    assert_eq!(ask(&mut t, "stop", "result"), "result 144");
    let (_, status) = t.finish();
    assert!(status.success());
}

/// A traced process that starts commands with vfork (subprocess on CPython
/// 3.11+): the child runs in its parent's memory until it execs, so nothing may
/// be written there on its behalf; after detaching, every probe site and
/// semaphore of the parent is as it was. Before, the child's copy of the ring
/// sites was turned back into int3s in the shared memory: the parent was left
/// with an int3 where its ring jump had been.
#[test]
fn vfork_children_leave_their_parents_memory_alone() {
    for version in ["3.11", "3.13"] {
        let Some(py) = python(version) else { continue };
        let code = "import subprocess, sys\n\
                    print('ready', flush=True)\n\
                    for line in sys.stdin:\n\
                    \x20   if line.strip() == 'spawn':\n\
                    \x20       for _ in range(5): subprocess.run(['true'])\n\
                    \x20       print('spawned', flush=True)\n\
                    \x20   else:\n\
                    \x20       import gc, json, csv; gc.collect(); print('done', flush=True)\n";
        let mut target = Target::spawn(&py.launcher, &["-c", code]);
        target.wait_for_line("ready");
        let pid = target.pid();
        let (sites, sems) = sites_and_semaphores(pid);
        let recording = TempFile::new(&format!("vfork-{version}.pyprobe"));
        let tracer = Tracer::record(
            recording.path(),
            &["-p", &pid.to_string(), "--subprocesses"],
        );
        wait_until_traced(pid, &sems);
        target.send_line("spawn");
        target.wait_for_line("spawned");
        tracer.signal(libc::SIGINT);
        let (status, stderr) = tracer.wait(Duration::from_secs(30));
        assert!(status.success(), "{version}: {stderr}");
        assert!(
            !stderr.contains("no longer holds pyprobe's jump"),
            "{version}: every ring site held its jump at the end: {stderr}"
        );
        assert_restored(pid, &sites, &sems);
        // And it runs on: GC, imports, its own probes' sites all as before.
        target.send_line("go");
        assert_eq!(target.wait_for_line("done"), "done");
    }
}

/// The main thread ends on its own (the `exit` system call, not `exit_group`)
/// while another thread runs on: the process's leader is a zombie that never
/// stops and reports nothing until the last thread is gone. Every sample stops
/// the threads; waiting for the leader to stop too would hold the other thread
/// for ever, and the program could never end. pyprobe takes the samples of the
/// thread that runs, and the program ends as it would untraced.
#[test]
fn the_main_thread_exiting_alone_does_not_hold_the_others() {
    let code = "import ctypes, os, threading, time\n\
                def work():\n\
                \x20   end = time.monotonic() + 1.5\n\
                \x20   n = 0\n\
                \x20   while time.monotonic() < end:\n\
                \x20       n += 1\n\
                \x20   print('worker done', n > 0, flush=True)\n\
                \x20   os._exit(0)\n\
                threading.Thread(target=work).start()\n\
                time.sleep(0.3)\n\
                ctypes.CDLL(None).syscall(60, 0)\n";
    for (version, mode) in [("3.9", "sample"), ("3.13", "auto"), ("3.15", "sample")] {
        let Some(py) = python(version) else { continue };
        let recording = TempFile::new(&format!("leader-exits-{version}.pyprobe"));
        let mut child = pyprobe()
            .args([
                "record",
                "--mode",
                mode,
                "-r",
                "500",
                "-o",
                recording.path(),
            ])
            .arg("--")
            .arg(&py.launcher)
            .args(["-c", code])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let ended = wait_for(LIMIT, || matches!(child.try_wait(), Ok(Some(_))));
        if !ended {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            ended,
            "{version}: pyprobe still running after {LIMIT:?}: {stderr}"
        );
        assert_no_panic("record", &out.stderr);
        assert!(out.status.success(), "{version}: {stderr}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("worker done True"),
            "{version}: {stderr}"
        );
        // Sampled on after the main thread was gone (it sleeps until then, and
        // idle samples are left out): how many depends on the machine's load.
        let work: u64 = collapsed_stacks(recording.path())
            .iter()
            .filter(|(frames, _)| frames.iter().any(|f| f.starts_with("work (")))
            .map(|(_, n)| n)
            .sum();
        assert!(work >= 10, "{version}: {work} samples in work: {stderr}");
    }
}
