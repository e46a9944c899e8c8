//! Helpers of the tests that record and fault live targets: temporary files, probe
//! sites of a live target, waiting for pyprobe to attach, a pyprobe running in the
//! background, and checks that nothing panicked.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::run::*;

pub fn fixture_script(name: &str) -> String {
    repo()
        .join("fixtures/python")
        .join(name)
        .display()
        .to_string()
}

/// A path in the temporary directory, unique to this test process.
pub fn tmp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pyprobe-{}-{name}", std::process::id()))
}

/// A file name in a temporary directory of its own, removed when dropped with
/// whatever is beside the file (the `.partial` a killed recorder leaves).
pub struct TempFile {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl TempFile {
    pub fn new(name: &str) -> TempFile {
        let dir = tempfile::Builder::new()
            .prefix("pyprobe-")
            .tempdir()
            .expect("temporary directory");
        TempFile {
            path: dir.path().join(name),
            _dir: dir,
        }
    }

    pub fn path(&self) -> &str {
        self.path.to_str().expect("utf-8 temp path")
    }

    pub fn as_path(&self) -> &Path {
        &self.path
    }
}

/// Fails when pyprobe panicked (whatever its exit status).
pub fn assert_no_panic(what: &str, stderr: &[u8]) {
    let text = String::from_utf8_lossy(stderr);
    assert!(
        !text.contains("panicked") && !text.contains("RUST_BACKTRACE"),
        "{what}: pyprobe panicked:\n{text}"
    );
}

/// The python probe sites and semaphores of a live process, from `probes -p`;
/// waits up to 10 s for a process still starting (its interpreter not mapped
/// yet lists no object).
pub fn sites_and_semaphores(pid: i32) -> (Vec<u64>, Vec<u64>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let out = run_pyprobe(&["probes", "-p", &pid.to_string(), "--format", "json"]);
        let listing: Option<Value> = out
            .status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten();
        if let Some(probes) = listing
            .as_ref()
            .and_then(|l| l["objects"][0]["probes"].as_array())
        {
            let mut sites = Vec::new();
            let mut sems = Vec::new();
            // Before the interpreter is mapped, the listing shows every provider's
            // probes (the loader's own `rtld` probes have sites and no semaphores).
            for p in probes.iter().filter(|p| p["provider"] == "python") {
                sems.extend(p["semaphore"].as_u64());
                sites.extend(
                    p["sites"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|s| s["address"].as_u64().unwrap()),
                );
            }
            // Launched through the loader, the interpreter may not be mapped yet:
            // the listing then has no sites.
            if !sites.is_empty() {
                return (sites, sems);
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no python probes listed for process {pid} within 10 s: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Every probe site holds its `nop` again and every semaphore is down.
pub fn assert_restored(pid: i32, sites: &[u64], sems: &[u64]) {
    // The SIGTRAP safety net is gone: the target's disposition is its own again.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let caught = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .unwrap()
        .trim();
    let caught = u64::from_str_radix(caught, 16).unwrap();
    assert_eq!(
        caught & (1 << (libc::SIGTRAP - 1)),
        0,
        "SIGTRAP handler of {pid} removed"
    );
    for &s in sites {
        assert_eq!(
            read_target_memory(pid, s, 1),
            [0x90],
            "site {s:#x} of {pid} restored to nop"
        );
    }
    for &s in sems {
        assert_eq!(
            read_target_memory(pid, s, 2),
            [0, 0],
            "semaphore {s:#x} of {pid} lowered"
        );
    }
}

/// Waits (bounded) until pyprobe has raised one of the target's semaphores.
pub fn wait_until_traced(pid: i32, sems: &[u64]) {
    let traced = wait_for(Duration::from_secs(10), || {
        sems.iter()
            .any(|&s| read_target_memory(pid, s, 2) != [0, 0])
    });
    assert!(traced, "pyprobe attached to {pid} within 10 s");
}

/// Polls `done` every 20 ms until it holds or `limit` passes.
pub fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The one-letter state of a process (`/proc/PID/stat`), `None` once it is gone.
pub fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim().chars().next()
}

/// Whether every thread of `pid` is stopped (group-stop, `T`, or traced stop, `t`).
pub fn all_threads_stopped(pid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    dir.filter_map(|e| e.ok()).all(|e| {
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        matches!(
            stat.rsplit(')').next().unwrap_or("").trim().chars().next(),
            Some('T' | 't')
        )
    })
}

/// `pyprobe report FILE --format json`, which must succeed without panicking.
pub fn report_json(path: &str) -> Value {
    let out = run_pyprobe(&["report", path, "--format", "json"]);
    assert_no_panic("report", &out.stderr);
    json_of(&out)
}

/// How many `event` audit events a JSON report recorded with their name (0 when
/// it has no row for it).
pub fn audit_count(report: &Value, event: &str) -> u64 {
    report["audit"]
        .as_array()
        .expect("the report's audit list")
        .iter()
        .find(|a| a["event"] == event)
        .map_or(0, |a| a["count"].as_u64().expect("an audit row's count"))
}

/// A report row's entries: its calls and its resumes (a generator's or
/// coroutine's later runs), which is what cProfile and the flame graph count.
pub fn entries(row: &Value) -> u64 {
    row["calls"].as_u64().unwrap_or(0) + row["resumes"].as_u64().unwrap_or(0)
}

/// Entries ([`entries`]) per function name of files ending in `file_suffix`,
/// summed over rows.
pub fn entries_in_file(
    report: &Value,
    file_suffix: &str,
) -> std::collections::BTreeMap<String, u64> {
    let mut calls = std::collections::BTreeMap::new();
    for f in report["functions"].as_array().unwrap() {
        if f["file"].as_str().unwrap().ends_with(file_suffix) {
            *calls
                .entry(f["function"].as_str().unwrap().to_owned())
                .or_insert(0) += entries(f);
        }
    }
    calls
}

/// A `pyprobe record` running in the background, its stderr collected; killed on
/// drop if still running.
pub struct Tracer {
    pub child: Child,
}

impl Tracer {
    /// Starts `pyprobe record -o OUTPUT ARGS...` with stdout and stderr piped.
    pub fn record(output: &str, args: &[&str]) -> Tracer {
        Tracer::command(Command::new(env!("CARGO_BIN_EXE_pyprobe")), output, args)
    }

    /// Same, with `cmd` as the program (e.g. pyprobe run through setpriv).
    pub fn command(mut cmd: Command, output: &str, args: &[&str]) -> Tracer {
        let child = cmd
            .args(["record", "-o", output])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start pyprobe");
        Tracer { child }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits (bounded) until this pyprobe has raised one of the semaphores of
    /// `pid`; if it has not, the test fails with what pyprobe said meanwhile.
    pub fn wait_until_traced(&mut self, pid: i32, sems: &[u64]) {
        let traced = wait_for(Duration::from_secs(10), || {
            sems.iter()
                .any(|&s| read_target_memory(pid, s, 2) != [0, 0])
        });
        if traced {
            return;
        }
        self.signal(libc::SIGINT);
        wait_for(Duration::from_secs(5), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        });
        let _ = self.child.kill();
        let status = self.child.wait();
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        panic!(
            "pyprobe did not raise any of the {} semaphores of process {pid} within 10 s \
             (state {:?}); pyprobe ({status:?}) said:\n{stderr}",
            sems.len(),
            proc_state(pid)
        );
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Waits (at most `limit`) for pyprobe to end; returns its status and stderr.
    /// A pyprobe still running then is killed and the test fails.
    pub fn wait(mut self, limit: Duration) -> (ExitStatus, String) {
        let ended = wait_for(limit, || matches!(self.child.try_wait(), Ok(Some(_))));
        if !ended {
            let _ = self.child.kill();
        }
        let status = self.child.wait().expect("waiting for pyprobe");
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        eprintln!("pyprobe record: {status:?}\n{stderr}");
        assert!(ended, "pyprobe did not end within {limit:?}:\n{stderr}");
        assert_no_panic("record", stderr.as_bytes());
        (status, stderr)
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs pyprobe with `args` and checks it failed with one clear sentence: exit
/// status 1, no panic, and an error line that mentions every one of `words`.
pub fn assert_refused(args: &[&str], words: &[&str]) -> String {
    let out: Output = run_pyprobe(args);
    assert_refused_output(&out, args, words)
}

pub fn assert_refused_output(out: &Output, args: &[&str], words: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_no_panic(&args.join(" "), &out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "pyprobe {}: exit status 1, stderr: {stderr}",
        args.join(" ")
    );
    let error = stderr
        .lines()
        .find(|l| l.starts_with("pyprobe: error:"))
        .unwrap_or_else(|| panic!("no `pyprobe: error:` line in: {stderr}"));
    for w in words {
        assert!(
            error.contains(w),
            "pyprobe {}: error should mention {w:?}: {error}",
            args.join(" ")
        );
    }
    error.to_owned()
}

/// One test of the binary at a time, for tests whose subject is timing-sensitive
/// (the overhead budget's windows, pyprobe keeping up with the ring) and which a
/// machine crowded by the binary's other tests would distort.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether the calling test is to run its body here. Outside, it runs the test
/// binary again for that one test (`module_path!()` and the test's name), with its
/// output, fails when that run fails, and says no; in that run it says yes. For
/// tests that run pyprobe's engine in-process: the engine waits for any child, and
/// would reap those of the tests running beside it in this process.
pub fn in_own_process(module: &str, test: &str) -> bool {
    const VAR: &str = "PYPROBE_TEST_IN_OWN_PROCESS";
    let path = match module.split_once("::") {
        Some((_crate, module)) => format!("{module}::{test}"),
        None => test.to_owned(),
    };
    if std::env::var(VAR).is_ok_and(|v| v == path) {
        return true;
    }
    // Its output through print!, so that the harness shows it only on failure.
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args([path.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(VAR, &path)
        .output()
        .expect("running the test binary");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "{path}, in a process of its own: {}",
        out.status
    );
    false
}

/// A busy loop on each CPU for as long as it lives.
pub struct Contention(Vec<std::process::Child>);

impl Contention {
    pub fn start(py: &Python) -> Contention {
        Contention::running(py, |_| "while True: pass".to_owned())
    }

    /// A busy loop pinned to each CPU: whichever CPU pyprobe's tracing thread
    /// follows a thread to, a thread of the normal policy holds it too.
    pub fn pinned(py: &Python) -> Contention {
        Contention::running(py, |cpu| {
            format!("import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass")
        })
    }

    /// One busy loop per CPU, the `n`-th running `script(n)`.
    pub fn running(py: &Python, script: impl Fn(usize) -> String) -> Contention {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        Contention(
            (0..cpus)
                .map(|cpu| {
                    Command::new(&py.launcher)
                        .args(["-c", &script(cpu)])
                        .spawn()
                        .expect("start a busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for Contention {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The collapsed stacks of a recording (`pyprobe flame --format collapsed`):
/// each line's frames, outermost first, and its count.
pub fn collapsed_stacks(recording: &str) -> Vec<(Vec<String>, u64)> {
    let folded = run_pyprobe(&["flame", recording, "--format", "collapsed", "-o", "-"]);
    assert!(folded.status.success(), "pyprobe flame {recording} failed");
    String::from_utf8_lossy(&folded.stdout)
        .lines()
        .filter_map(|line| {
            let (stack, count) = line.rsplit_once(' ')?;
            let frames = stack.split(';').map(str::to_owned).collect();
            Some((frames, count.parse().ok()?))
        })
        .collect()
}
