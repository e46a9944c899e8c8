//! A stopped pyprobe never freezes the program it watches: a Python server under
//! load (`fixtures/python/load_server.py`, driven by the untraced
//! `fixtures/python/load_client.py`) keeps answering every request within a bound
//! while the pyprobe attached to it (`record -p PID`) is stopped with SIGSTOP or
//! SIGTSTP for 5 s, or stopped and then killed; signals sent to the server meanwhile
//! reach it (SIGUSR1's handler runs, SIGTERM ends it). Once continued, pyprobe
//! finishes as usual and its recording is readable.
//!
//! Each engine and mode is covered (`--mode trace` through the ring on 3.9 and the
//! hook on 3.13, the default mode and `--mode sample` on 3.11), with both servers
//! (a thread per request, a pool of 8 threads) and each of the three ways of
//! stopping pyprobe somewhere. The control test runs the same timeline with no
//! pyprobe at all. The tests are timing-sensitive: the test command runs them in a
//! stage of their own, two at a time and nothing else beside them (the bounds'
//! slack is what such a loaded 2-CPU machine adds; mostly they wait, for the
//! client's timeline).

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::*;

/// The longest a request may take, and the longest a signal may take to reach the
/// server, while pyprobe is stopped...
const BOUND: Duration = Duration::from_secs(1);
/// ...plus what a loaded 2-CPU machine may add.
const SLACK: Duration = Duration::from_millis(1500);
/// How long the client runs, from just after pyprobe has attached.
const CLIENT_SECS: u64 = 12;
/// Client threads, each with one request at a time.
const CONCURRENCY: u32 = 4;
/// When pyprobe is stopped, counted from the client's start.
const STOP_AT: Duration = Duration::from_secs(3);
/// How long pyprobe stays stopped before SIGCONT (cases a and b).
const STOPPED_FOR: Duration = Duration::from_secs(5);
/// How long pyprobe stays stopped before SIGKILL (case c).
const STOPPED_BEFORE_KILL: Duration = Duration::from_secs(3);
/// When SIGUSR1 goes to the server, after pyprobe was stopped.
const USR1_AFTER_STOP: Duration = Duration::from_secs(1);
/// Limits of the waits that must not hang the test whatever goes wrong.
const START_LIMIT: Duration = Duration::from_secs(20);
const PYPROBE_END_LIMIT: Duration = Duration::from_secs(60);
const SERVER_END_LIMIT: Duration = Duration::from_secs(10);

/// What is done to pyprobe's process while the client runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Action {
    /// (a) SIGSTOP, 5 s, SIGCONT.
    StopCont,
    /// (b) SIGTSTP, 5 s, SIGCONT.
    TstpCont,
    /// (c) SIGSTOP, 3 s, SIGKILL.
    StopKill,
}

/// CLOCK_MONOTONIC in seconds: Python's `time.monotonic()`.
fn monotonic() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a child of this test.
    unsafe { libc::kill(pid, sig) };
}

/// Collects a pipe's lines in the background; `Arc` so a message can show them.
fn collect_lines(pipe: impl Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = text.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            let mut t = sink.lock().unwrap_or_else(|e| e.into_inner());
            t.push_str(&line);
            t.push('\n');
        }
    });
    text
}

fn snapshot(text: &Arc<Mutex<String>>) -> String {
    text.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Waits (at most `limit`) for `child` to end, polling every 5 ms; returns its
/// status and when it was seen ended.
fn wait_child(child: &mut Child, limit: Duration) -> Option<(ExitStatus, Instant)> {
    let end = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some((status, Instant::now()));
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `fixtures/python/load_server.py KIND` under a test interpreter; killed on drop.
struct Server {
    child: Child,
    port: u16,
    /// Its stdout lines after `port N`.
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    fn start(py: &Python, kind: &str) -> Server {
        let mut child = Command::new(&py.launcher)
            .arg(fixture_script("load_server.py"))
            .arg(kind)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", py.launcher.display()));
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = collect_lines(child.stderr.take().expect("piped stderr"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server {
            child,
            port: 0,
            lines,
            stderr,
        };
        let first = server.lines.recv_timeout(START_LIMIT);
        server.port = match first.as_deref().ok().and_then(|l| l.strip_prefix("port ")) {
            Some(port) => port.parse().expect("port number"),
            None => panic!(
                "the {kind} server under {} printed {first:?}, not `port N`; stderr:\n{}",
                py.version,
                snapshot(&server.stderr)
            ),
        };
        server
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The handler times of the `usr1 T` lines printed so far, waiting at most
    /// `limit` for the first.
    fn usr1_times(&self, limit: Duration) -> Vec<f64> {
        let mut times = Vec::new();
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let line = if times.is_empty() {
                self.lines.recv_timeout(left).ok()
            } else {
                self.lines.try_recv().ok()
            };
            let Some(line) = line else { return times };
            if let Some(t) = line.strip_prefix("usr1 ") {
                times.push(t.trim().parse().expect("usr1 time"));
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `pyprobe record -p PID -o OUT MODE...` in a process group of its own (so that
/// SIGTSTP stops it as in a shell, whatever group the test runner is in), its
/// stderr collected; killed on drop.
struct Probe {
    child: Child,
    stderr: Arc<Mutex<String>>,
}

impl Probe {
    fn start(pid: i32, mode: &[&str], out: &str) -> Probe {
        let mut child = pyprobe()
            .args(["record", "-p", &pid.to_string(), "-o", out])
            .args(mode)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start pyprobe");
        let stderr = collect_lines(child.stderr.take().expect("piped stderr"));
        Probe { child, stderr }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn stderr(&self) -> String {
        snapshot(&self.stderr)
    }

    /// Waits until pyprobe has attached: it prints its start line once it has.
    fn wait_attached(&mut self) {
        let attached = wait_for(START_LIMIT, || {
            self.stderr().contains("pyprobe: process ")
                || matches!(self.child.try_wait(), Ok(Some(_)))
        });
        let running = matches!(self.child.try_wait(), Ok(None));
        assert!(
            attached && running,
            "pyprobe did not attach within {START_LIMIT:?} (running: {running}); it said:\n{}",
            self.stderr()
        );
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `python3 fixtures/python/load_client.py PORT SECS CONCURRENCY`, untraced;
/// killed on drop.
struct Client {
    child: Child,
    secs: u64,
}

impl Client {
    fn start(port: u16, secs: u64) -> Client {
        let child = Command::new("python3")
            .arg(fixture_script("load_client.py"))
            .arg(port.to_string())
            .arg(secs.to_string())
            .arg(CONCURRENCY.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start python3 fixtures/python/load_client.py");
        Client { child, secs }
    }

    /// Waits for the client's end (its duration and its 20 s timeout, bounded);
    /// returns its JSON, or a description of what went wrong instead.
    fn finish(&mut self) -> Result<Value, String> {
        let limit = Duration::from_secs(self.secs + 40);
        let Some((status, _)) = wait_child(&mut self.child, limit) else {
            return Err(format!("the client did not end within {limit:?}"));
        };
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut o) = self.child.stdout.take() {
            let _ = o.read_to_string(&mut stdout);
        }
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        let line = stdout.lines().last().unwrap_or("");
        match serde_json::from_str(line) {
            Ok(json) if status.success() => Ok(json),
            _ => Err(format!(
                "the client ended with {status:?}, stdout {stdout:?}, stderr:\n{stderr}"
            )),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What is wrong with the client's run: a failed request, a request longer than
/// the bound, a whole second (but the last) in which no request was answered.
fn service_problems(client: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let failures = client["failures"].as_u64();
    if failures != Some(0) {
        problems.push(format!("{failures:?} requests failed"));
    }
    if client["requests"].as_u64().unwrap_or(0) == 0 {
        problems.push("no request was answered".to_owned());
    }
    let max = client["max_latency_s"].as_f64().unwrap_or(f64::INFINITY);
    if max > (BOUND + SLACK).as_secs_f64() {
        problems.push(format!(
            "the longest request took {max:.3} s (bound {BOUND:?} + slack {SLACK:?})"
        ));
    }
    let per_second: Vec<u64> = client["per_second"]
        .as_array()
        .map(|a| a.iter().map(|n| n.as_u64().unwrap_or(0)).collect())
        .unwrap_or_default();
    if per_second.is_empty() {
        problems.push("no per_second counts".to_owned());
    }
    let idle: Vec<usize> = per_second
        .iter()
        .enumerate()
        .take(per_second.len().saturating_sub(1))
        .filter(|&(_, &n)| n == 0)
        .map(|(s, _)| s)
        .collect();
    if !idle.is_empty() {
        problems.push(format!("no request was answered in seconds {idle:?}"));
    }
    problems
}

/// SIGUSR1 sent to the server at `sent` (CLOCK_MONOTONIC): its handler must have
/// run within the bound.
fn usr1_problems(server: &Server, sent: f64) -> (Vec<String>, String) {
    let times = server.usr1_times(Duration::from_secs(5));
    let Some(&ran) = times.first() else {
        return (
            vec!["the server's SIGUSR1 handler never ran".to_owned()],
            "never".to_owned(),
        );
    };
    let latency = ran - sent;
    let shown = format!("{latency:.3} s");
    if latency > (BOUND + SLACK).as_secs_f64() {
        (
            vec![format!(
                "SIGUSR1 reached the server's handler after {shown} (bound {BOUND:?} + slack \
                 {SLACK:?})"
            )],
            shown,
        )
    } else {
        (Vec::new(), shown)
    }
}

/// SIGTERM to the server: it must exit 0; returns how long it took, or the problem.
fn terminate(server: &mut Server) -> Result<Duration, String> {
    let sent = Instant::now();
    kill(server.pid(), libc::SIGTERM);
    match wait_child(&mut server.child, SERVER_END_LIMIT) {
        None => Err(format!(
            "the server did not exit within {SERVER_END_LIMIT:?} of SIGTERM"
        )),
        Some((status, at)) if status.success() => Ok(at - sent),
        Some((status, at)) => Err(format!(
            "the server exited with {status:?} ({:?} after SIGTERM); stderr:\n{}",
            at - sent,
            snapshot(&server.stderr)
        )),
    }
}

/// Sleeps until `at` after `start`.
fn sleep_until(start: Instant, at: Duration) {
    let target = start + at;
    let now = Instant::now();
    if target > now {
        std::thread::sleep(target - now);
    }
}

/// Waits (at most `limit`) until pyprobe's main thread is stopped.
fn wait_stopped(pid: i32, limit: Duration) -> bool {
    wait_for(limit, || proc_state(pid) == Some('T'))
}

/// The server `kind` under `version`, pyprobe attached with `mode` (or no pyprobe
/// at all: the control), the client running 12 s; 3 s in, `action` on pyprobe.
fn stopped_case(version: &'static str, mode: Option<&[&str]>, kind: &str, action: Action) {
    let Some(py) = python(version) else { return };
    let what = format!("{version} {kind} server, pyprobe {mode:?}, {action:?}");
    let mut server = Server::start(&py, kind);
    let out = TempFile::new(&format!("stopped-{version}-{kind}.pyprobe"));
    let mut probe = mode.map(|m| Probe::start(server.pid(), m, out.path()));
    if let Some(p) = probe.as_mut() {
        p.wait_attached();
        // Its engine under way (the hook engine's installs at a safe point).
        std::thread::sleep(Duration::from_secs(1));
    }

    let mut client = Client::start(server.port, CLIENT_SECS);
    let start = Instant::now();
    let mut problems = Vec::new();

    sleep_until(start, STOP_AT);
    let stop_signal = match action {
        Action::TstpCont => libc::SIGTSTP,
        Action::StopCont | Action::StopKill => libc::SIGSTOP,
    };
    if let Some(p) = probe.as_ref() {
        p.signal_stop(stop_signal, &mut problems);
    }
    sleep_until(start, STOP_AT + USR1_AFTER_STOP);
    let usr1_sent = monotonic();
    kill(server.pid(), libc::SIGUSR1);
    let mut killed = false;
    match action {
        Action::StopCont | Action::TstpCont => {
            sleep_until(start, STOP_AT + STOPPED_FOR);
            if let Some(p) = probe.as_ref() {
                kill(p.pid(), libc::SIGCONT);
            }
        }
        Action::StopKill => {
            sleep_until(start, STOP_AT + STOPPED_BEFORE_KILL);
            if let Some(p) = probe.as_ref() {
                kill(p.pid(), libc::SIGKILL);
                killed = true;
            }
        }
    }

    let client_json = client.finish();
    let client_text = match &client_json {
        Ok(json) => {
            problems.extend(service_problems(json));
            json.to_string()
        }
        Err(e) => {
            problems.push(e.clone());
            "(none)".to_owned()
        }
    };
    let (usr1, usr1_latency) = usr1_problems(&server, usr1_sent);
    problems.extend(usr1);

    // pyprobe ends: with SIGINT where it still runs, and must then succeed with a
    // readable recording.
    let mut pyprobe_status = None;
    if let Some(p) = probe.as_mut() {
        if !killed {
            kill(p.pid(), libc::SIGINT);
        }
        match wait_child(&mut p.child, PYPROBE_END_LIMIT) {
            None => problems.push(format!(
                "pyprobe did not end within {PYPROBE_END_LIMIT:?} of SIGINT"
            )),
            Some((status, _)) => {
                pyprobe_status = Some(status);
                if killed {
                    if status.signal() != Some(libc::SIGKILL) {
                        problems.push(format!("pyprobe, killed, ended with {status:?}"));
                    }
                } else if !status.success() {
                    problems.push(format!("pyprobe ended with {status:?}, not 0"));
                }
            }
        }
    }
    // Its last lines, written as it ended.
    std::thread::sleep(Duration::from_millis(200));
    let pyprobe_stderr = probe.as_ref().map(Probe::stderr).unwrap_or_default();
    if probe.is_some() {
        assert_no_panic(&what, pyprobe_stderr.as_bytes());
    }
    let server_end = terminate(&mut server);
    if let Err(e) = &server_end {
        problems.push(e.clone());
    }
    eprintln!(
        "{what}: client {client_text}; SIGUSR1 latency {usr1_latency}; pyprobe {pyprobe_status:?}; \
         server exit after SIGTERM {server_end:?}"
    );
    assert!(
        problems.is_empty(),
        "{what}:\n  {}\nclient: {client_text}\npyprobe's stderr:\n{pyprobe_stderr}\nthe server's \
         stderr:\n{}",
        problems.join("\n  "),
        snapshot(&server.stderr)
    );
    if probe.is_some() && !killed {
        let report = report_json(out.path());
        assert!(
            report["functions"].as_array().is_some(),
            "{what}: the report of the recording lists functions: {report}"
        );
        // Where pyprobe did not let go (nothing of the target waited for it), the
        // ticks of the stop were lost: said as such, not blamed on a rate too
        // high for the machine.
        if let Some(line) = pyprobe_stderr.lines().find(|l| l.contains("fell behind")) {
            assert!(
                line.contains("while pyprobe itself was stopped") && !line.contains("-r"),
                "{what}: {line}"
            );
        }
        if mode == Some(TRACE) {
            let calls = entries_in_file(&report, "load_server.py");
            assert!(
                calls.get("step").copied().unwrap_or(0) > 0,
                "{what}: the traced recording counts the server's calls of step: {calls:?}"
            );
        }
    }
}

impl Probe {
    /// Sends `sig` (SIGSTOP or SIGTSTP); pyprobe must be stopped within the time it
    /// is to stay stopped, or the case would test nothing.
    fn signal_stop(&self, sig: i32, problems: &mut Vec<String>) {
        kill(self.pid(), sig);
        if !wait_stopped(self.pid(), USR1_AFTER_STOP) {
            problems.push(format!(
                "pyprobe was not stopped {USR1_AFTER_STOP:?} after signal {sig} (state {:?})",
                proc_state(self.pid())
            ));
        }
    }
}

/// While pyprobe is stopped (SIGSTOP), SIGTERM ends the server under load within
/// the bound, with status 0.
fn sigterm_case(version: &'static str, mode: &[&str], kind: &str) {
    let Some(py) = python(version) else { return };
    let what = format!("{version} {kind} server, pyprobe {mode:?}, SIGTERM while stopped");
    let mut server = Server::start(&py, kind);
    let out = TempFile::new(&format!("sigterm-{version}-{kind}.pyprobe"));
    let mut probe = Probe::start(server.pid(), mode, out.path());
    probe.wait_attached();
    std::thread::sleep(Duration::from_secs(1));
    let _client = Client::start(server.port, 6);
    let start = Instant::now();
    let mut problems = Vec::new();
    sleep_until(start, Duration::from_millis(1500));
    probe.signal_stop(libc::SIGSTOP, &mut problems);
    sleep_until(start, Duration::from_millis(2500));
    let ended = terminate(&mut server);
    match &ended {
        Ok(took) if *took > BOUND + SLACK => problems.push(format!(
            "the server exited {took:?} after SIGTERM (bound {BOUND:?} + slack {SLACK:?})"
        )),
        Ok(_) => {}
        Err(e) => problems.push(e.clone()),
    }
    // pyprobe, continued, sees its target gone and ends.
    kill(probe.pid(), libc::SIGCONT);
    kill(probe.pid(), libc::SIGINT);
    let pyprobe_status = wait_child(&mut probe.child, PYPROBE_END_LIMIT).map(|(s, _)| s);
    if pyprobe_status.is_none() {
        problems.push(format!(
            "pyprobe did not end within {PYPROBE_END_LIMIT:?} of SIGCONT and SIGINT"
        ));
    }
    std::thread::sleep(Duration::from_millis(200));
    let stderr = probe.stderr();
    eprintln!("{what}: server exit after SIGTERM {ended:?}; pyprobe {pyprobe_status:?}");
    assert_no_panic(&what, stderr.as_bytes());
    assert!(
        problems.is_empty(),
        "{what}:\n  {}\npyprobe's stderr:\n{stderr}\nthe server's stderr:\n{}",
        problems.join("\n  "),
        snapshot(&server.stderr)
    );
}

const TRACE: &[&str] = &["--mode", "trace"];
const SAMPLE: &[&str] = &["--mode", "sample"];
const DEFAULT: &[&str] = &[];

/// The harness itself: with no pyprobe at all, both servers answer every request
/// within the bound, every second, and take their signals at once.
#[test]
fn control_without_pyprobe_both_servers_serve_steadily() {
    stopped_case("3.11", None, "threads", Action::StopCont);
    stopped_case("3.11", None, "pool", Action::StopCont);
}

#[test]
fn ring_trace_3_9_threads_server_serves_while_pyprobe_is_sigstopped() {
    stopped_case("3.9", Some(TRACE), "threads", Action::StopCont);
}

#[test]
fn ring_trace_3_9_pool_server_serves_while_pyprobe_is_stopped_then_killed() {
    stopped_case("3.9", Some(TRACE), "pool", Action::StopKill);
}

#[test]
fn hook_trace_3_13_pool_server_serves_while_pyprobe_is_sigtstpped() {
    stopped_case("3.13", Some(TRACE), "pool", Action::TstpCont);
}

#[test]
fn hook_trace_3_13_threads_server_serves_while_pyprobe_is_stopped_then_killed() {
    stopped_case("3.13", Some(TRACE), "threads", Action::StopKill);
}

#[test]
fn default_mode_3_11_threads_server_serves_while_pyprobe_is_sigtstpped() {
    stopped_case("3.11", Some(DEFAULT), "threads", Action::TstpCont);
}

#[test]
fn sample_3_11_pool_server_serves_while_pyprobe_is_sigstopped() {
    stopped_case("3.11", Some(SAMPLE), "pool", Action::StopCont);
}

#[test]
fn sigterm_ends_the_server_while_a_ring_tracing_pyprobe_is_stopped() {
    sigterm_case("3.9", TRACE, "threads");
}

#[test]
fn sigterm_ends_the_server_while_a_hook_tracing_pyprobe_is_stopped() {
    sigterm_case("3.13", TRACE, "pool");
}

#[test]
fn sigterm_ends_the_server_while_a_default_mode_pyprobe_is_stopped() {
    sigterm_case("3.11", DEFAULT, "pool");
}

#[test]
fn sigterm_ends_the_server_while_a_sampling_pyprobe_is_stopped() {
    sigterm_case("3.11", SAMPLE, "threads");
}
