//! Attaching to one target again and again: the ring and the trampolines an earlier
//! pyprobe left mapped (they must stay after detaching) are found again and used,
//! so the target holds one ring and one trampoline region however often it is
//! attached, and its resident memory stays flat; a forked child, which inherits
//! them, gets a ring of its own.

use std::time::Duration;

use crate::support::*;

/// What pyprobe keeps mapped in a process, and the process's resident memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Footprint {
    /// Mappings of one of pyprobe's ring memfds.
    pub rings: usize,
    /// Pages of private anonymous code mappings starting with a marker.
    pub regions: usize,
    pub rss_kib: u64,
}

/// Resident memory `now` is at most one ring (8 MiB) above `base`, counted from a
/// first session that already had the ring: pyprobe's share is one ring, which
/// holds at most that however its records fall, whatever the interpreter's own
/// allocator does with its few pages.
pub(crate) fn assert_rss_flat(tag: &str, base: Footprint, now: Footprint) {
    assert!(
        now.rss_kib <= base.rss_kib + 8 * 1024,
        "{tag}: resident memory grew from {} KiB to {} KiB",
        base.rss_kib,
        now.rss_kib
    );
}

fn footprint(pid: i32) -> Footprint {
    footprint_of(pid, "/memfd:pyprobe-ring", b"PYPRTRMP")
}

/// The [`Footprint`] of `pid`, counting mappings of the memfd `ring` and code
/// pages starting with `marker` (anonymous mappings of one protection merge, so
/// every page of one is looked at).
pub(crate) fn footprint_of(pid: i32, ring: &str, marker: &[u8; 8]) -> Footprint {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let (mut rings, mut regions) = (0, 0);
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if line.contains(ring) {
            rings += 1;
        } else if fields.len() == 5 && fields[1] == "r-xp" && fields[4] == "0" {
            let (start, end) = fields[0].split_once('-').unwrap();
            let start = u64::from_str_radix(start, 16).unwrap();
            let end = u64::from_str_radix(end, 16).unwrap();
            for page in (start..end).step_by(4096) {
                let mut bytes = [0u8; 8];
                if mem.read_exact_at(&mut bytes, page).is_ok() && &bytes == marker {
                    regions += 1;
                }
            }
        }
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    Footprint {
        rings,
        regions,
        rss_kib,
    }
}

/// One session of `pyprobe record -p PID --mode trace -v` on `pid`, during which
/// `order` is sent to the target (whose reply starts with `reply`); ends it with
/// SIGINT. Returns the target's reply, the calls of `f` recorded (in
/// fork_on_demand.py for a `fork` tag, else calls_on_demand.py), the lost events
/// and pyprobe's stderr.
fn session(
    target: &mut Target,
    pid: i32,
    order: &str,
    reply: &str,
    tag: &str,
) -> (String, u64, u64, String) {
    session_in(target, pid, "trace", order, reply, tag)
}

/// [`session`] in `--mode MODE`.
fn session_in(
    target: &mut Target,
    pid: i32,
    mode: &str,
    order: &str,
    reply: &str,
    tag: &str,
) -> (String, u64, u64, String) {
    let (_, sems) = sites_and_semaphores(pid);
    let out = TempFile::new(&format!("reattach-{tag}.pyprobe"));
    let pid_arg = pid.to_string();
    let mut tracer = Tracer::record(out.path(), &["-p", &pid_arg, "--mode", mode, "-v"]);
    // Semaphores are raised while every thread is stopped, and the ring is set up
    // before the target runs again: what it does from now on is traced.
    tracer.wait_until_traced(pid, &sems);
    target.send_line(order);
    let said = target.wait_for_line(reply);
    tracer.signal(libc::SIGINT);
    let (status, stderr) = tracer.wait(Duration::from_secs(20));
    assert!(status.success(), "{tag}: {stderr}");
    let report = report_json(out.path());
    let file = if tag.starts_with("fork") {
        "fork_on_demand.py"
    } else {
        "calls_on_demand.py"
    };
    let calls = entries_in_file(&report, file)
        .get("f")
        .copied()
        .unwrap_or(0);
    let lost = report["lost_events"].as_u64().unwrap_or(u64::MAX);
    (said, calls, lost, stderr)
}

/// `cycles` attach/detach cycles on one calls_on_demand.py target, each with 2000
/// calls through the ring (the 4000+ records touch about 1 MiB of the ring).
fn reattach_cycles(version: &'static str, cycles: usize) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("calls_on_demand.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let mut first = None;
    for cycle in 0..cycles {
        let tag = format!("{version}-{cycle}");
        let (said, calls, lost, stderr) = session(&mut target, pid, "2000", "calls", &tag);
        assert_eq!(said, "calls 2000", "{tag}: the target's own count");
        assert!(
            stderr.contains("probe sites write to a ring")
                && !stderr.contains(" 0 probe sites write"),
            "{tag}: the ring served the sites:\n{stderr}"
        );
        if cycle > 0 {
            assert!(
                stderr.contains("of an earlier pyprobe is used again")
                    && stderr.contains("of an earlier pyprobe are used again"),
                "{tag}: the earlier ring and trampolines are used again:\n{stderr}"
            );
        }
        let now = footprint(pid);
        // One ring, and one region (every probe site of these interpreters lies in
        // one code segment), however many times the target was attached.
        assert_eq!((now.rings, now.regions), (1, 1), "{tag}: {now:?}");
        // Before re-attaching reused them, each cycle added a ring and a region, and
        // the ring pages its 4000+ records touched: about 1 MiB of resident memory per
        // cycle.
        assert_rss_flat(&tag, *first.get_or_insert(now), now);
        if cycle + 1 == cycles {
            // The last session is exact: every call recorded, nothing lost.
            assert_eq!((calls, lost), (2000, 0), "{tag}:\n{stderr}");
        }
    }
    let (rest, status) = target.finish();
    assert_eq!(
        rest.trim(),
        "done True",
        "{version}: the target's own check"
    );
    assert!(status.success());
}

#[test]
fn a_hundred_reattaches_leave_one_ring_and_one_trampoline_region_3_9() {
    reattach_cycles("3.9", 100);
}

/// Fewer cycles: the same code path as on 3.9, with another probe layout
/// (libpython's probes); each cycle takes about a third of a second.
#[test]
fn thirty_reattaches_leave_one_ring_and_one_trampoline_region_3_15() {
    reattach_cycles("3.15", 30);
}

/// Sessions that arm other probes (`--mode auto` arms GC, import and audit probes,
/// not the function probes) cannot use trampolines built for another probe set:
/// each set gets a region once, and alternating between them maps nothing more.
#[test]
fn alternating_probe_sets_leave_one_region_per_set() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("calls_on_demand.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    for (cycle, mode) in ["trace", "auto"].iter().cycle().take(6).enumerate() {
        let tag = format!("modes-{cycle}-{mode}");
        let (said, _, _, stderr) = session_in(&mut target, pid, mode, "500", "calls", &tag);
        assert_eq!(said, "calls 500", "{tag}");
        let now = footprint(pid);
        let regions = if cycle == 0 { 1 } else { 2 };
        assert_eq!(
            (now.rings, now.regions),
            (1, regions),
            "{tag}: {now:?}\n{stderr}"
        );
        if cycle >= 2 {
            assert!(
                stderr.contains("of an earlier pyprobe are used again"),
                "{tag}: {stderr}"
            );
        }
    }
    let (rest, status) = target.finish();
    assert_eq!(rest.trim(), "done True");
    assert!(status.success());
}

/// A child forked after a session inherits the ring mapping (a shared mapping of the
/// parent's memfd), the trampolines and the tag word. Attached while its parent is
/// attached too, each must get only its own calls: the child's ring is replaced by
/// one of its own, and its tag word names it.
#[test]
fn a_forked_child_gets_a_ring_of_its_own_when_both_are_attached() {
    let _serial = serial();
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("fork_on_demand.py")]);
    target.wait_for_line("ready");
    let parent = target.pid();
    let (said, calls, _, stderr) = session(&mut target, parent, "1000", "calls", "fork-first");
    assert_eq!((said.as_str(), calls), ("calls 1000", 1000), "{stderr}");
    target.send_line("fork");
    let child: i32 = target
        .wait_for_line("child")
        .strip_prefix("child ")
        .and_then(|p| p.parse().ok())
        .expect("the child's pid");
    assert_eq!(
        (footprint(child).rings, footprint(child).regions),
        (1, 1),
        "the child inherits the parent's ring and region"
    );
    // The parent attached, then the child, both served at once.
    let (_, sems) = sites_and_semaphores(parent);
    let out_parent = TempFile::new("reattach-fork-parent.pyprobe");
    let parent_arg = parent.to_string();
    let args = ["-p", &parent_arg, "--mode", "trace", "-v"];
    let parent_tracer = Tracer::record(out_parent.path(), &args);
    wait_until_traced(parent, &sems);
    let (_, child_sems) = sites_and_semaphores(child);
    let out_child = TempFile::new("reattach-fork-child.pyprobe");
    let child_arg = child.to_string();
    let args = ["-p", &child_arg, "--mode", "trace", "-v"];
    let child_tracer = Tracer::record(out_child.path(), &args);
    wait_until_traced(child, &child_sems);
    target.send_line("3000");
    assert_eq!(target.wait_for_line("calls"), "calls 3000");
    target.send_line("child 2000");
    assert_eq!(target.wait_for_line("child calls"), "child calls 2000");
    child_tracer.signal(libc::SIGINT);
    let (status, child_said) = child_tracer.wait(Duration::from_secs(20));
    assert!(status.success(), "{child_said}");
    parent_tracer.signal(libc::SIGINT);
    let (status, parent_said) = parent_tracer.wait(Duration::from_secs(20));
    assert!(status.success(), "{parent_said}");
    for (said, who) in [(&child_said, "child"), (&parent_said, "parent")] {
        assert!(
            said.contains("of an earlier pyprobe is used again")
                && said.contains("of an earlier pyprobe are used again"),
            "{who}: {said}"
        );
    }
    let calls = |out: &TempFile| {
        let report = report_json(out.path());
        assert_eq!(report["lost_events"], 0);
        entries_in_file(&report, "fork_on_demand.py")
            .get("f")
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(calls(&out_parent), 3000, "the parent's own calls only");
    assert_eq!(calls(&out_child), 2000, "the child's own calls only");
    for pid in [parent, child] {
        let now = footprint(pid);
        assert_eq!((now.rings, now.regions), (1, 1), "{pid}: {now:?}");
    }
    let (rest, status) = target.finish();
    assert!(rest.contains("child done True"), "{rest}");
    assert!(rest.trim_end().ends_with("done True"), "{rest}");
    assert!(status.success());
}
