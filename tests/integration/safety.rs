//! pyprobe never changes what the program it watches does, tried as a hostile
//! tester would: attaching over and over to a program that starts threads or forks
//! all the time (injected system calls must never land inside its clone or fork),
//! programs that ignore, handle or raise SIGTRAP themselves (before, during and after
//! tracing, and after pyprobe is SIGKILLed), and a program that is stopped.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::support::*;

const LIMIT: Duration = Duration::from_secs(60);

fn harm(py: &Python, mode: &str) -> Target {
    let mut t = Target::spawn(&py.launcher, &[&fixture_script("harm.py"), mode]);
    t.wait_for_line("ready");
    t
}

fn ask(t: &mut Target, command: &str, answer: &str) {
    t.send_line(command);
    assert_eq!(t.wait_for_line(answer), answer, "{command}");
}

/// Ends the fixture's loop; it must report its rounds, all checked, and exit 0.
fn stop_ok(mut t: Target, what: &str) -> u64 {
    assert!(
        matches!(t.child.try_wait(), Ok(None)),
        "{what}: the target died: {:?}",
        t.child.try_wait()
    );
    t.send_line("stop");
    let line = t.wait_for_line("ok ");
    let (_, status) = t.finish();
    assert!(status.success(), "{what}: target exit status {status:?}");
    line[3..].parse().expect("round count")
}

/// Words in pyprobe's output that mean an injected system call went wrong.
fn assert_no_injection_failure(stderr: &str) {
    for bad in [
        "os error 38",
        "Function not implemented",
        "safety net",
        "cannot give SIGTRAP back",
        "injected system call",
    ] {
        assert!(!stderr.contains(bad), "pyprobe said {bad:?}:\n{stderr}");
    }
}

/// The ways of attaching that inject system calls (the SIGTRAP net, the ring) or
/// only stop threads (sampling), taken in turn.
const ATTACH_MODES: [&[&str]; 4] = [
    &[],
    &["--mode", "trace"],
    &["--mode", "trace", "--engine", "int3"],
    &["--mode", "sample"],
];

/// Attaches `cycles` times to the running fixture in `mode`; the target must live
/// through every one and end with every round checked.
fn attach_cycles(version: &'static str, mode: &str, cycles: usize) {
    let Some(py) = python(version) else { return };
    let mut t = harm(&py, mode);
    let pid = t.pid().to_string();
    // Signals keep arriving meanwhile: one that comes during an injected system
    // call is held back and must still reach the program's handler.
    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flood = {
        let flooding = flooding.clone();
        let target = t.pid();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: kill(2) on the test's own child.
                unsafe { libc::kill(target, libc::SIGUSR1) };
                sent += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            sent
        })
    };
    let out = TempFile::new(&format!("harm-{mode}-{version}.pyprobe"));
    for i in 0..cycles {
        let extra = ATTACH_MODES[i % ATTACH_MODES.len()];
        // The same file each cycle.
        let mut args = vec![
            "record",
            "-p",
            &pid,
            "-d",
            "0.2",
            "--force",
            "-o",
            out.path(),
        ];
        args.extend_from_slice(extra);
        let run = run_pyprobe(&args);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_no_panic("record", &run.stderr);
        assert!(
            run.status.success(),
            "{version} {mode}, attach {i} ({extra:?}): pyprobe failed:\n{stderr}"
        );
        assert_no_injection_failure(&stderr);
        // SAFETY: signal 0 only checks that the process exists.
        let alive = unsafe { libc::kill(t.pid(), 0) } == 0 && proc_state(t.pid()) != Some('Z');
        assert!(
            alive,
            "{version} {mode}: the target died at attach {i} ({extra:?})"
        );
    }
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    let sent = flood.join().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    t.send_line("usr1");
    let seen: u64 = t.wait_for_line("usr1 ")[5..].parse().unwrap();
    // Signals of one kind coalesce while pending, so fewer may be seen; none lost
    // for good (the last one always arrives) and the handler keeps working.
    assert!(
        seen > 0 && seen <= sent,
        "{version} {mode}: {seen} SIGUSR1 seen of {sent}"
    );
    let rounds = stop_ok(t, &format!("{version} {mode}"));
    assert!(rounds > 0, "{version} {mode}: no round ran");
}

#[test]
fn twenty_attaches_to_a_thread_churning_program_never_harm_it() {
    for version in ["3.9", "3.11", "3.15"] {
        attach_cycles(version, "churn", 20);
    }
}

#[test]
fn twenty_attaches_to_a_forking_program_never_harm_it() {
    for version in ["3.9", "3.11", "3.15"] {
        attach_cycles(version, "forks", 20);
    }
}

#[test]
fn a_launched_program_keeps_the_ignored_sigtrap_it_inherits() {
    // The shell ignores SIGTRAP and execs Python, which inherits that; pyprobe's
    // first hit must not reset it (the kernel does so for a forced, ignored signal),
    // in the program and in the child it forks (released by pyprobe).
    let code = "import os, signal\n\
                def f(n): return n + 1\n\
                for i in range(2000): f(i)\n\
                os.kill(os.getpid(), signal.SIGTRAP)\n\
                pid = os.fork()\n\
                if pid == 0:\n    os.kill(os.getpid(), signal.SIGTRAP)\n    os._exit(0)\n\
                print('alive', os.waitpid(pid, 0)[1], flush=True)\n";
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let launcher = py.launcher.display().to_string();
        let shell = "trap '' TRAP; exec \"$0\" -c \"$1\"";
        let untraced = std::process::Command::new("sh")
            .args(["-c", shell, &launcher, code])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&untraced.stdout), "alive 0\n");
        for engine in ["int3", "auto"] {
            let out = TempFile::new(&format!("inherit-{version}-{engine}.pyprobe"));
            let traced = pyprobe()
                .args([
                    "record",
                    "-o",
                    out.path(),
                    "--mode",
                    "trace",
                    "--engine",
                    engine,
                ])
                .args(["--", "sh", "-c", shell, &launcher, code])
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&traced.stderr);
            assert_eq!(
                String::from_utf8_lossy(&traced.stdout),
                "alive 0\n",
                "{version} {engine}: {stderr}"
            );
            assert!(traced.status.success(), "{version} {engine}: {stderr}");
            assert_no_injection_failure(&stderr);
        }
    }
}

/// `pyprobe record -p PID --mode trace --engine int3` in the background: every
/// function call of the fixture is an `int3` hit.
fn trace_int3(pid: i32, out: &TempFile) -> Tracer {
    let tracer = Tracer::record(
        out.path(),
        &[
            "-p",
            &pid.to_string(),
            "--mode",
            "trace",
            "--engine",
            "int3",
        ],
    );
    let (_, sems) = sites_and_semaphores(pid);
    wait_until_traced(pid, &sems);
    // Let hits happen.
    std::thread::sleep(Duration::from_millis(150));
    tracer
}

fn detach(tracer: Tracer) -> String {
    tracer.signal(libc::SIGINT);
    let (status, stderr) = tracer.wait(LIMIT);
    assert!(status.success(), "pyprobe ended with {status:?}");
    assert_no_injection_failure(&stderr);
    stderr
}

#[test]
fn an_ignored_sigtrap_stays_ignored_during_and_after_tracing() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let mut t = harm(&py, "traps");
        ask(&mut t, "ignore", "ignoring");
        let out = TempFile::new(&format!("ignored-{version}.pyprobe"));
        let tracer = trace_int3(t.pid(), &out);
        ask(&mut t, "raise", "raised");
        detach(tracer);
        // The kernel resets an ignored SIGTRAP to its default when it forces one
        // (each int3 hit): it must still be ignored.
        ask(&mut t, "raise", "raised");
        stop_ok(t, version);
    }
}

#[test]
fn a_handler_set_while_traced_stays_after_detach() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let mut t = harm(&py, "traps");
        let out = TempFile::new(&format!("handler-{version}.pyprobe"));
        let tracer = trace_int3(t.pid(), &out);
        ask(&mut t, "handle", "handling");
        ask(&mut t, "raise", "raised");
        detach(tracer);
        ask(&mut t, "raise", "raised");
        // Both of its own, none of pyprobe's thousands of hits.
        ask(&mut t, "count", "count 2");
        stop_ok(t, version);
    }
}

#[test]
fn its_own_sigtrap_at_the_default_ends_it_while_traced_as_untraced() {
    use std::os::unix::process::ExitStatusExt;
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let mut untraced = harm(&py, "traps");
        untraced.send_line("raise");
        let (_, alone) = untraced.finish();
        assert_eq!(alone.signal(), Some(libc::SIGTRAP), "untraced");

        let mut t = harm(&py, "traps");
        let out = TempFile::new(&format!("default-{version}.pyprobe"));
        let tracer = trace_int3(t.pid(), &out);
        t.send_line("raise");
        let (_, status) = t.finish();
        assert_eq!(
            status.signal(),
            Some(libc::SIGTRAP),
            "{version}: traced, the program dies of its own SIGTRAP too"
        );
        let (pyprobe_status, stderr) = tracer.wait(LIMIT);
        assert!(pyprobe_status.success(), "{stderr}");
    }
}

#[test]
fn pyprobes_traps_never_reach_the_programs_handler_after_a_sigkill() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let mut t = harm(&py, "traps");
        ask(&mut t, "handle", "handling");
        let pid = t.pid();
        let (sites, sems) = sites_and_semaphores(pid);
        for round in 0..10 {
            let out = TempFile::new(&format!("killed-{version}-{round}.pyprobe"));
            let tracer = trace_int3(pid, &out);
            tracer.signal(libc::SIGKILL);
            let _ = tracer.wait(LIMIT);
            // The guardian puts the bytes back; meanwhile the program runs into sites.
            assert!(
                wait_for(Duration::from_secs(5), || {
                    sites
                        .iter()
                        .all(|&s| read_target_memory(pid, s, 1) == [0x90])
                }),
                "{version}: sites restored after pyprobe's death"
            );
            ask(&mut t, "count", "count 0");
        }
        for &s in &sems {
            assert_eq!(read_target_memory(pid, s, 2), [0, 0], "semaphore lowered");
        }
        // Its own SIGTRAPs still reach its handler.
        ask(&mut t, "raise", "raised");
        ask(&mut t, "count", "count 1");
        stop_ok(t, version);
    }
}

/// Bytes the stopped program wrote to its stdout since the last call.
fn drain_nonblocking(t: &mut Target) -> usize {
    let fd = t.stdout.get_ref().as_raw_fd();
    // SAFETY: fcntl on a pipe this test owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    let mut total = t.stdout.buffer().len();
    t.stdout.consume_all();
    let mut buf = [0u8; 4096];
    loop {
        match t.stdout.get_mut().read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
    // SAFETY: as above.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
    }
    total
}

trait ConsumeAll {
    fn consume_all(&mut self);
}

impl<R: Read> ConsumeAll for std::io::BufReader<R> {
    fn consume_all(&mut self) {
        let n = self.buffer().len();
        std::io::BufRead::consume(self, n);
    }
}

#[test]
fn a_stopped_program_stays_stopped_while_pyprobe_watches_it() {
    for version in ["3.9", "3.15"] {
        let Some(py) = python(version) else { continue };
        let mut t = harm(&py, "ticks");
        t.wait_for_line("tick 3");
        let pid = t.pid();
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        assert!(wait_for(Duration::from_secs(5), || proc_state(pid) == Some('T')));
        std::thread::sleep(Duration::from_millis(100));
        drain_nonblocking(&mut t);
        let out = TempFile::new(&format!("stopped-{version}.pyprobe"));
        let pid_s = pid.to_string();
        for args in [
            vec!["record", "-p", &pid_s, "-d", "0.5", "-o", out.path()],
            vec![
                "record",
                "-p",
                &pid_s,
                "-d",
                "0.5",
                "-o",
                out.path(),
                // The file the first run wrote.
                "--force",
                "--mode",
                "trace",
            ],
            vec!["top", "-p", &pid_s, "--once"],
        ] {
            let run = run_pyprobe(&args);
            let stderr = String::from_utf8_lossy(&run.stderr);
            assert!(run.status.success(), "{args:?}: {stderr}");
            // A thread let go by ptrace while its group is stopped is woken to stop
            // again: /proc may say R for that moment, under load a long one. A
            // program truly continued would stay running and print its ticks.
            let stopped = wait_for(Duration::from_secs(2), || proc_state(pid) == Some('T'));
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(
                drain_nonblocking(&mut t),
                0,
                "{version} {args:?}: the stopped program wrote output while pyprobe watched"
            );
            assert!(stopped, "{version} {args:?}: still stopped");
            assert_eq!(
                proc_state(pid),
                Some('T'),
                "{version} {args:?}: still stopped"
            );
            if args[0] == "record" {
                assert!(
                    stderr.contains("is stopped"),
                    "{args:?}: pyprobe says the process is stopped:\n{stderr}"
                );
            }
        }
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        let tick = t.wait_for_line("tick ");
        assert!(!tick.is_empty());
        stop_ok(t, version);
    }
}
