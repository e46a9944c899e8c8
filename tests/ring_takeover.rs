//! pyprobe killed (SIGKILL) while the ring engine serves a target: the jumps it
//! wrote at the probe sites must not make the target untraceable. The guardian
//! puts the original code back.

mod common;
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use support::*;

/// A `pyprobe record` in the background whose stderr is read line by line as it comes.
struct Live {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: String,
}

impl Live {
    fn record(out: &TempFile, args: &[&str]) -> Live {
        let mut child = pyprobe()
            .args(["record", "-o", out.path()])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start pyprobe");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        // Ends at EOF: when pyprobe and its guardian (which shares the pipe) are gone.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                if tx.send(line.unwrap_or_default()).is_err() {
                    break;
                }
            }
        });
        Live {
            child,
            lines,
            seen: String::new(),
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits (at most 20 s) for a stderr line containing `needle`.
    fn wait_line(&mut self, needle: &str) -> String {
        let end = Instant::now() + Duration::from_secs(20);
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => break,
            }
        }
        panic!("pyprobe never said {needle:?}; it said:\n{}", self.seen);
    }

    /// Everything said until stderr closes (at most 20 s).
    fn rest(&mut self) -> &str {
        let end = Instant::now() + Duration::from_secs(20);
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return &self.seen,
                Err(mpsc::RecvTimeoutError::Timeout) => break,
            }
        }
        panic!("pyprobe's stderr did not close; it said:\n{}", self.seen);
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// pyprobe's exit status, once it ended (at most 20 s).
    fn wait(&mut self) -> std::process::ExitStatus {
        let ended = wait_for(Duration::from_secs(20), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        });
        if !ended {
            let _ = self.child.kill();
        }
        let status = self.child.wait().expect("waiting for pyprobe");
        assert!(ended, "pyprobe did not end; it said:\n{}", self.seen);
        status
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a killed pyprobe left: the target, its probe sites, and what pyprobe and
/// its guardian said.
struct Left {
    target: Target,
    sites: Vec<u64>,
    said: String,
}

/// A calls_on_demand.py target served by the ring engine of a pyprobe that is then
/// killed in the middle of a million calls.
fn target_after_killed_ring(py: &Python, tag: &str) -> Left {
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("calls_on_demand.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let (sites, _) = sites_and_semaphores(pid);
    let out = TempFile::new(&format!("takeover-first-{tag}.pyprobe"));
    let pid_arg = pid.to_string();
    let args = ["-p", &pid_arg, "--mode", "trace", "--engine", "ring"];
    let mut first = Live::record(&out, &args);
    let serving = first.wait_line("probe sites write to a ring");
    // "ring engine in process P: N probe sites write to a ring (...), 0 stay on int3"
    let served: usize = serving
        .split(": ")
        .nth(2)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        served > 0 && serving.contains(", 0 stay on int3"),
        "{}: every armed site on the ring: {serving}",
        py.version
    );
    target.send_line("1000000");
    std::thread::sleep(Duration::from_millis(100));
    first.signal(libc::SIGKILL);
    first.wait();
    let said = first.rest().to_owned();
    assert_no_panic("first pyprobe", said.as_bytes());
    assert_eq!(
        target.wait_for_line("calls"),
        "calls 1000000",
        "{}: the target's own count",
        py.version
    );
    Left {
        target,
        sites,
        said,
    }
}

/// Attaches a normal `pyprobe record -p` to `target`, which makes 5000 calls
/// meanwhile; returns the calls recorded and what pyprobe said. The target then
/// ends, and must end well.
fn record_again(py: &Python, mut target: Target, tag: &str) -> (u64, String) {
    let out = TempFile::new(&format!("takeover-second-{tag}.pyprobe"));
    let pid_arg = target.pid().to_string();
    let mut second = Live::record(&out, &["-p", &pid_arg, "--mode", "trace"]);
    // The start line comes once attaching is over: every site is armed by then.
    second.wait_line("mode trace");
    target.send_line("5000");
    assert_eq!(target.wait_for_line("calls"), "calls 5000");
    second.signal(libc::SIGINT);
    let status = second.wait();
    let said = second.rest().to_owned();
    assert_no_panic("second pyprobe", said.as_bytes());
    assert!(status.success(), "{}: second pyprobe: {said}", py.version);
    let (rest, status) = target.finish();
    assert_eq!(
        rest.trim(),
        "done True",
        "{}: the target's own check",
        py.version
    );
    assert!(status.success(), "{}: target {status:?}", py.version);
    let calls = calls_in_file(&report_json(out.path()), "calls_on_demand.py");
    (calls.get("f").copied().unwrap_or(0), said)
}

fn site_bytes(pid: i32, sites: &[u64]) -> Vec<u8> {
    sites
        .iter()
        .map(|&s| read_target_memory(pid, s, 1)[0])
        .collect()
}

fn guardian_restores_ring_sites(version: &'static str) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let Left {
        target,
        sites,
        said,
    } = target_after_killed_ring(&py, version);
    // The guardian's stderr closed: it is done. Every site is its nop again.
    let bytes = site_bytes(target.pid(), &sites);
    assert!(
        bytes.iter().all(|&b| b == 0x90),
        "{version}: sites after the guardian: {bytes:02x?}\n{said}"
    );
    assert!(said.contains("ring jumps"), "{said}");
    let (calls, again) = record_again(&py, target, version);
    assert!(!again.contains("refused"), "{again}");
    assert_eq!(
        calls, 5000,
        "{version}: calls recorded after re-attaching\n{again}"
    );
}

#[test]
fn the_guardian_restores_ring_sites_and_a_reattach_records_3_9() {
    guardian_restores_ring_sites("3.9");
}

#[test]
fn the_guardian_restores_ring_sites_and_a_reattach_records_3_15() {
    guardian_restores_ring_sites("3.15");
}
