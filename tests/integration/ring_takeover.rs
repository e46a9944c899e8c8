//! pyprobe killed (SIGKILL) while the ring engine serves a target: the jumps it
//! wrote at the probe sites must not make the target untraceable. The guardian
//! puts the original code back; where it could not (it was killed too), the
//! next pyprobe recognises the jumps as its own and takes them over; a jump it
//! cannot vouch for is refused, and it says so.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::support::*;

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

    /// Ends a pyprobe attached to a target that made 5000 calls meanwhile (asked
    /// through `target`), as Ctrl-C does: it must end well; returns what it said.
    fn after_calls_and_ctrl_c(&mut self, target: &mut Target, what: &str) -> String {
        target.send_line("5000");
        assert_eq!(target.wait_for_line("calls"), "calls 5000");
        self.signal(libc::SIGINT);
        let status = self.wait();
        let said = self.rest().to_owned();
        assert_no_panic(what, said.as_bytes());
        assert!(status.success(), "{what}: {said}");
        said
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Processes whose parent is `pid` (pyprobe's guardian is a forked child of it).
fn children(pid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(pid) {
            found.push(child);
        }
    }
    found
}

/// How the first pyprobe ends.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Death {
    /// SIGKILL; its guardian acts.
    Alone,
    /// SIGKILL, its guardian killed first: nothing undoes the jumps.
    WithGuardian,
}

/// What a killed pyprobe left: the target, its probe sites, how many of them the
/// ring served, and what pyprobe and its guardian said.
struct Left {
    target: Target,
    sites: Vec<u64>,
    served: usize,
    said: String,
}

/// A calls_on_demand.py target served by the ring engine of a pyprobe that is then
/// killed in the middle of a million calls.
fn target_after_killed_ring(py: &Python, death: Death, tag: &str) -> Left {
    target_after_killed_ring_in(py, death, tag, 1_000_000)
}

/// As [`target_after_killed_ring`], the target asked for `calls` calls (none: it
/// waits, idle, while pyprobe is killed).
fn target_after_killed_ring_in(py: &Python, death: Death, tag: &str, calls: u32) -> Left {
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("calls_on_demand.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let (sites, _) = sites_and_semaphores(pid);
    let out = TempFile::new(&format!("takeover-first-{tag}.pyprobe"));
    let pid_arg = pid.to_string();
    // `-v`: the start says how many sites the ring serves.
    let args = ["-p", &pid_arg, "--mode", "trace", "--engine", "ring", "-v"];
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
    if calls > 0 {
        target.send_line(&calls.to_string());
    }
    std::thread::sleep(Duration::from_millis(100));
    if death == Death::WithGuardian {
        let guardians = children(first.pid());
        assert_eq!(guardians.len(), 1, "one guardian: {guardians:?}");
        // SAFETY: kill(2) on pyprobe's own child.
        unsafe { libc::kill(guardians[0], libc::SIGKILL) };
        // Dead (a zombie: pyprobe does not reap it) before pyprobe dies.
        assert!(wait_for(Duration::from_secs(5), || matches!(
            proc_state(guardians[0]),
            None | Some('Z')
        )));
    }
    first.signal(libc::SIGKILL);
    first.wait();
    let said = first.rest().to_owned();
    assert_no_panic("first pyprobe", said.as_bytes());
    if calls > 0 {
        assert_eq!(
            target.wait_for_line("calls"),
            format!("calls {calls}"),
            "{}: the target's own count",
            py.version
        );
    }
    Left {
        target,
        sites,
        served,
        said,
    }
}

/// Attaches `pyprobe record -p --engine ring` to `target`, which makes 5000 calls
/// meanwhile; returns the calls recorded and what pyprobe said. The target then
/// ends, and must end well.
fn record_again(py: &Python, mut target: Target, tag: &str) -> (u64, String) {
    let out = TempFile::new(&format!("takeover-second-{tag}.pyprobe"));
    let pid_arg = target.pid().to_string();
    // `-v`: each site refused, and why.
    let mut second = Live::record(
        &out,
        &["-p", &pid_arg, "--mode", "trace", "--engine", "ring", "-v"],
    );
    // The start line comes once attaching is over: every site is armed by then.
    second.wait_line("mode trace");
    let said =
        second.after_calls_and_ctrl_c(&mut target, &format!("{}: second pyprobe", py.version));
    ends_well(target, py.version);
    let calls = entries_in_file(&report_json(out.path()), "calls_on_demand.py");
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
        ..
    } = target_after_killed_ring(&py, Death::Alone, version);
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

fn takes_over_leftover_jumps(version: &'static str) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let tag = format!("{version}-leftover");
    let Left {
        mut target,
        sites,
        served,
        said,
    } = target_after_killed_ring(&py, Death::WithGuardian, &tag);
    // Nothing undid the jumps (sites of probes not asked for hold their nop).
    let bytes = site_bytes(target.pid(), &sites);
    let jumps = bytes.iter().filter(|&&b| b == 0xe9).count();
    assert!(
        jumps == served && bytes.iter().all(|&b| b == 0xe9 || b == 0x90),
        "{version}: {served} jumps left: {bytes:02x?}\n{said}"
    );
    // pyprobe silent for good: the next calls find its ring full and its heartbeat
    // stale, and the target lowers pyprobe's semaphores itself, so that CPython
    // stops reaching the sites instead of paying for every probe hit from now on.
    let (_, sems) = sites_and_semaphores(target.pid());
    std::thread::sleep(Duration::from_millis(400));
    target.send_line("100000");
    assert_eq!(target.wait_for_line("calls"), "calls 100000");
    let held: Vec<[u8; 2]> = sems
        .iter()
        .map(|&s| {
            let b = read_target_memory(target.pid(), s, 2);
            [b[0], b[1]]
        })
        .collect();
    assert!(
        held.iter().all(|b| *b == [0, 0]),
        "{version}: semaphores after pyprobe and its guardian died: {held:02x?}\n{said}"
    );
    let (calls, again) = record_again(&py, target, &tag);
    assert!(
        again.contains(&format!(
            "{served} probe sites held the ring jumps of a pyprobe that was killed"
        )),
        "{version}: {again}"
    );
    assert!(!again.contains("refused"), "{again}");
    assert_eq!(
        calls, 5000,
        "{version}: calls recorded after taking over\n{again}"
    );
}

#[test]
fn a_reattach_takes_over_the_jumps_of_a_pyprobe_killed_with_its_guardian_3_9() {
    takes_over_leftover_jumps("3.9");
}

#[test]
fn a_reattach_takes_over_the_jumps_of_a_pyprobe_killed_with_its_guardian_3_15() {
    takes_over_leftover_jumps("3.15");
}

/// A second pyprobe attached to `target` in `mode` (`-v`) while it makes 5000
/// calls, then ended as by Ctrl-C; what it said.
fn attach_in_mode(target: &mut Target, version: &str, mode: &str, tag: &str) -> String {
    let out = TempFile::new(&format!("takeover-{tag}.pyprobe"));
    let pid_arg = target.pid().to_string();
    let mut second = Live::record(&out, &["-p", &pid_arg, "--mode", mode, "-v"]);
    second.wait_line(&format!("mode {mode}"));
    second.after_calls_and_ctrl_c(target, &format!("{version}: second pyprobe"))
}

/// The target, asked to end, ends well: its own check passes.
fn ends_well(target: Target, version: &str) {
    let (rest, status) = target.finish();
    assert_eq!(
        rest.trim(),
        "done True",
        "{version}: the target's own check"
    );
    assert!(status.success(), "{version}: target {status:?}");
}

/// A pyprobe that arms fewer probes than the killed one did (the default mode: GC,
/// import and audit probes; trace mode through the hook) still puts back the jumps
/// left at the sites it does not arm: once it has left, no site jumps anywhere.
/// `mode`: its `--mode`.
fn a_lesser_attach_puts_back_every_leftover_jump(version: &'static str, mode: &str) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let tag = format!("{version}-{mode}");
    let Left {
        mut target, sites, ..
    } = target_after_killed_ring(&py, Death::WithGuardian, &tag);
    let said = attach_in_mode(&mut target, version, mode, &format!("lesser-{tag}"));
    assert!(
        said.contains("sites of probes not traced now held the ring jumps"),
        "{version}: {said}"
    );
    let bytes = site_bytes(target.pid(), &sites);
    assert!(
        bytes.iter().all(|&b| b == 0x90),
        "{version}: every site holds its nop again: {bytes:02x?}\n{said}"
    );
    ends_well(target, version);
}

#[test]
fn a_default_mode_attach_puts_back_the_jumps_of_a_killed_trace_3_9() {
    a_lesser_attach_puts_back_every_leftover_jump("3.9", "auto");
}

#[test]
fn a_hooked_trace_puts_back_the_jumps_of_a_killed_ring_trace_3_15() {
    a_lesser_attach_puts_back_every_leftover_jump("3.15", "trace");
}

/// The page where the trampoline region holding `target_addr` starts: the
/// nearest page at or below it beginning with pyprobe's marker.
fn region_start(pid: i32, target_addr: u64) -> u64 {
    let mut page = target_addr & !4095;
    for _ in 0..512 {
        if read_target_memory(pid, page, 8) == b"PYPRTRMP" {
            return page;
        }
        page -= 4096;
    }
    panic!("no trampoline header below {target_addr:#x}");
}

#[test]
fn a_jump_whose_header_is_damaged_is_refused_and_said_why() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    let Left {
        target,
        sites,
        served,
        said,
    } = target_after_killed_ring(&py, Death::WithGuardian, "damaged");
    let pid = target.pid();
    // Every site jumps into the same region (one per code segment): spoil its marker.
    let site = *sites
        .iter()
        .find(|&&s| read_target_memory(pid, s, 1) == [0xe9])
        .unwrap_or_else(|| panic!("no jump left:\n{said}"));
    let jump = read_target_memory(pid, site, 5);
    let rel = i32::from_le_bytes([jump[1], jump[2], jump[3], jump[4]]) as i64;
    let region = region_start(pid, (site as i64 + 5 + rel) as u64);
    {
        use std::os::unix::fs::FileExt;
        let mem = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .unwrap();
        mem.write_all_at(b"X", region).unwrap();
    }
    // The jumps are not taken over, and pyprobe says how many sites it refused and
    // why; the target, still running its old trampolines, is unharmed.
    let (calls, again) = record_again(&py, target, "damaged");
    let line = again
        .lines()
        .find(|l| l.contains("probe sites refused"))
        .unwrap_or_else(|| panic!("no refusal said:\n{again}"));
    assert!(
        line.contains(&format!("{served} of {served} probe sites refused"))
            && line.contains("without pyprobe's trampoline marker"),
        "{line}"
    );
    assert_eq!(calls, 0, "{again}");
}

/// A pyprobe killed with its guardian while the target was idle: no call found
/// its ring full, so the target let go of nothing and the semaphores stay
/// raised. The next pyprobe (of another mode: it raises fewer of them) lowers
/// what the dead one left, says so, and when it leaves every semaphore is 0.
fn a_later_pyprobe_lowers_what_a_dead_one_left_raised(version: &'static str, mode: &str) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let tag = format!("{version}-idle-{mode}");
    let Left {
        mut target, said, ..
    } = target_after_killed_ring_in(&py, Death::WithGuardian, &tag, 0);
    let (_, sems) = sites_and_semaphores(target.pid());
    let left = semaphore_values(target.pid(), &sems);
    let raised = left.iter().filter(|&&v| v == 1).count();
    assert!(
        raised >= 2 && left.iter().all(|&v| v <= 1),
        "{version}: the dead pyprobe's raises: {left:?}\n{said}"
    );
    // Past the producers' patience: the ring's consumer is silent, as a dead one.
    std::thread::sleep(Duration::from_millis(400));
    let said = attach_in_mode(&mut target, version, mode, &format!("raises-{tag}"));
    let after = semaphore_values(target.pid(), &sems);
    assert!(
        after.iter().all(|&v| v == 0),
        "{version} --mode {mode}: semaphores after the second pyprobe left: {after:?}\n{said}"
    );
    assert!(
        said.contains(&format!(
            "{raised} probe semaphores were still raised by a pyprobe killed together with its \
             guardian; lowered back"
        )),
        "{version}: {said}"
    );
    ends_well(target, version);
}

#[test]
fn a_default_mode_attach_lowers_the_semaphores_a_killed_trace_left_3_9() {
    a_later_pyprobe_lowers_what_a_dead_one_left_raised("3.9", "auto");
}

#[test]
fn a_trace_lowers_the_semaphores_a_killed_trace_left_3_9() {
    a_later_pyprobe_lowers_what_a_dead_one_left_raised("3.9", "trace");
}

/// The semaphores of `sems` in `pid`, as the target holds them now.
fn semaphore_values(pid: i32, sems: &[u64]) -> Vec<u16> {
    sems.iter()
        .map(|&s| {
            let b = read_target_memory(pid, s, 2);
            u16::from_le_bytes([b[0], b[1]])
        })
        .collect()
}

/// pyprobe silent past the producers' patience for a dead consumer (stopped with
/// its guardian, so that nothing let go of the target for it): the target lowers
/// pyprobe's semaphores itself; pyprobe, continued, raises them again, records
/// the calls after, and keeps the gap as a caveat.
#[test]
fn a_pyprobe_silent_too_long_raises_again_what_the_target_let_go_3_9() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("calls_on_demand.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let (_, sems) = sites_and_semaphores(pid);
    let out = TempFile::new("silent-too-long.pyprobe");
    let pid_arg = pid.to_string();
    let args = ["-p", &pid_arg, "--mode", "trace", "--engine", "ring", "-v"];
    let mut live = Live::record(&out, &args);
    live.wait_line("probe sites write to a ring");
    target.send_line("1000");
    assert_eq!(target.wait_for_line("calls"), "calls 1000");
    let raised = semaphore_values(pid, &sems);
    assert!(raised.iter().any(|&v| v > 0), "{raised:?}");
    let guardians = children(live.pid());
    assert_eq!(guardians.len(), 1, "one guardian: {guardians:?}");
    // SAFETY: kill(2) on pyprobe's own child, then on pyprobe.
    unsafe { libc::kill(guardians[0], libc::SIGSTOP) };
    live.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(500));
    target.send_line("200000");
    assert_eq!(target.wait_for_line("calls"), "calls 200000");
    let let_go = semaphore_values(pid, &sems);
    assert!(let_go.iter().all(|&v| v == 0), "let go: {let_go:?}");
    live.signal(libc::SIGCONT);
    // SAFETY: as above.
    unsafe { libc::kill(guardians[0], libc::SIGCONT) };
    assert!(
        wait_for(Duration::from_secs(5), || semaphore_values(pid, &sems)
            == raised),
        "not raised again: {:?}",
        semaphore_values(pid, &sems)
    );
    let said = live.after_calls_and_ctrl_c(&mut target, "pyprobe continued");
    let (rest, status) = target.finish();
    assert_eq!(rest.trim(), "done True");
    assert!(status.success());
    let report = report_json(out.path());
    let caveats = report["caveats"].as_array().expect("caveats");
    assert!(
        caveats.iter().any(|c| c["text"]
            .as_str()
            .is_some_and(|t| t.contains("lowered pyprobe's probe semaphores itself"))),
        "caveats: {caveats:?}\n{said}"
    );
    let calls = entries_in_file(&report, "calls_on_demand.py");
    let f = calls.get("f").copied().unwrap_or(0);
    assert!(
        (6000..206_000).contains(&f),
        "f counted {f} times: the 1000 and 5000 calls traced, not every one of the 200000\n{said}"
    );
}
