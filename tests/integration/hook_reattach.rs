//! Attaching to one target again and again through the hook engine: the hook page,
//! state page and ring an earlier pyprobe left (they stay after detaching) are used
//! again, whether the earlier hook is still in (the target made no call since) or
//! has unhooked itself, so the target holds one hook page and one ring however often
//! it is attached, its resident memory stays flat, and every session counts exactly.

use std::time::Duration;

use crate::hook::{pyenv, wait_tool};
use crate::ring_reattach::{assert_rss_flat, footprint_of};
use crate::support::*;

/// `cycles` attach/detach cycles of `pyprobe record --mode trace -p PID -v` on one
/// hook_calls.py target under `py`, each with 200 calls of f and one thread making
/// 200 calls of g. After every other detach the target is asked a question (a call:
/// its hook unhooks itself), so both an earlier hook still in and one gone out are
/// met again.
fn reattach_cycles(label: &str, py: &std::path::Path, cycles: usize) {
    let mut target = Target::spawn(py, &[&fixture_script("hook_calls.py")]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let pid_arg = pid.to_string();
    let mut first = None;
    let (mut resumed, mut afresh) = (0, 0);
    let mut ring = None;
    for cycle in 0..cycles {
        let tag = format!("{label} cycle {cycle}");
        let out = TempFile::new("hook-reattach.pyprobe");
        let tracer = Tracer::record(out.path(), &["--mode", "trace", "-p", &pid_arg, "-v"]);
        // Nothing is asked of the target before pyprobe is in: a call would let an
        // earlier hook still in unhook itself.
        ring = wait_for_new_ring(pid, ring, &tag);
        wait_tool(&mut target, "pyprobe", Duration::from_secs(20));
        target.send_line("200 1");
        assert_eq!(
            target.wait_for_line("calls"),
            "calls f=200 g=200 worker=1",
            "{tag}"
        );
        tracer.signal(libc::SIGINT);
        let (status, stderr) = tracer.wait(Duration::from_secs(30));
        assert!(status.success(), "{tag}: {stderr}");
        let calls = entries_in_file(&report_json(out.path()), "hook_calls.py");
        assert_eq!(
            (calls.get("f"), calls.get("g"), calls.get("worker")),
            (Some(&200), Some(&200), Some(&1)),
            "{tag}: every call counted:\n{stderr}"
        );
        if cycle > 0 {
            assert!(
                stderr.contains("of an earlier pyprobe are used again"),
                "{tag}: the earlier hook is used again:\n{stderr}"
            );
        }
        resumed += usize::from(stderr.contains("its hook still in, resumed"));
        afresh += usize::from(stderr.contains("its hook out, put in afresh"));
        let now = footprint_of(pid, "/memfd:pyprobe-hook", b"PYPRHOOK");
        assert_eq!((now.rings, now.regions), (1, 1), "{tag}: {now:?}");
        // Each attach used to map an 8 MiB ring and a hook page, and the ring pages
        // its records touched.
        assert_rss_flat(&tag, *first.get_or_insert(now), now);
        if cycle % 2 == 1 {
            // A call: the hook, told to go, unhooks itself.
            wait_tool(&mut target, "None", Duration::from_secs(5));
        }
    }
    assert!(
        resumed > 0 && afresh > 0,
        "{label}: both kinds of earlier hook were met ({resumed} resumed, {afresh} afresh)"
    );
    assert_eq!(
        wait_tool(&mut target, "None", Duration::from_secs(5)),
        1,
        "{label}"
    );
    let (rest, status) = target.finish();
    assert!(rest.contains("done True"), "{label}: {rest}");
    assert!(status.success(), "{label}: {status:?}");
}

/// Waits until `pid` maps a hook ring other than the memfd of inode `before` (each
/// attach makes a new one), and returns its inode.
fn wait_for_new_ring(pid: i32, before: Option<u64>, tag: &str) -> Option<u64> {
    let mut now = None;
    let found = wait_for(Duration::from_secs(20), || {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        now = maps
            .lines()
            .filter(|l| l.contains("/memfd:pyprobe-hook"))
            .find_map(|l| l.split_whitespace().nth(4)?.parse::<u64>().ok());
        now.is_some() && now != before
    });
    assert!(found, "{tag}: no new hook ring in process {pid} after 20 s");
    now
}

/// The profile route (CPython 3.7 to 3.11): each thread's profile function.
#[test]
fn thirty_hook_reattaches_leave_one_hook_and_one_ring_profile_route() {
    let _serial = serial();
    let Some(py) = pyenv(11) else { return };
    reattach_cycles("3.11", &py, 30);
}

/// The monitoring route (CPython 3.12+): the detour, the installer and
/// `sys.monitoring`'s registration.
#[test]
fn thirty_hook_reattaches_leave_one_hook_and_one_ring_monitoring_route() {
    let _serial = serial();
    let Some(py) = pyenv(13) else { return };
    reattach_cycles("3.13", &py, 30);
}
