//! The sampling timer cannot be lost: a tick that fires after the event loop looked
//! for it but before it blocks in `waitpid` must still wake that `waitpid` soon
//! (a one-shot alarm left it asleep until the target's next stop, which for a
//! sampled program making no watched system call was its exit: no samples at all).
//! And pyprobe's helper threads never take its signals, which would leave the loop
//! asleep the same way.
//!
//! No harness: the check needs this process's only thread to be the one waiting.

use std::process::Command;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::waitpid;
use nix::unistd::Pid;
use pyprobe_sdt::tracer::signals::{arm_tick, disarm_tick, install, spawn_helper, take_tick};

fn main() {
    install().expect("installing pyprobe's signal handlers");
    a_tick_before_the_wait_still_wakes_it();
    arming_again_forgets_a_tick_not_taken();
    helper_threads_block_pyprobes_signals();
    println!("tick: 3 checks passed");
}

fn a_tick_before_the_wait_still_wakes_it() {
    let mut child = Command::new("sleep")
        .arg("5")
        .spawn()
        .expect("starting sleep");
    arm_tick(1_000_000, 20_000_000);
    // The first alarm fires while the "loop" is busy, as when it is preempted
    // between looking at the flag and calling waitpid.
    let busy = Instant::now();
    while busy.elapsed() < Duration::from_millis(5) {
        std::hint::spin_loop();
    }
    let waited = Instant::now();
    let status = waitpid(Pid::from_raw(child.id() as i32), None);
    let slept = waited.elapsed();
    disarm_tick();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        status,
        Err(Errno::EINTR),
        "the wait was not interrupted by the repeated tick (slept {slept:?})"
    );
    assert!(
        slept < Duration::from_secs(2),
        "the repeated tick came after {slept:?}"
    );
}

fn arming_again_forgets_a_tick_not_taken() {
    arm_tick(1_000_000, 1_000_000);
    std::thread::sleep(Duration::from_millis(10));
    // Armed anew (far away): the tick that fired meanwhile is not a new one.
    arm_tick(10_000_000_000, 10_000_000_000);
    assert!(!take_tick(), "a tick survived arming the timer again");
    disarm_tick();
}

fn helper_threads_block_pyprobes_signals() {
    let (tx, rx) = std::sync::mpsc::channel();
    let helper = spawn_helper("tick-check", move || {
        // SAFETY: gettid cannot fail.
        let tid = unsafe { libc::gettid() };
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        tx.send(status).unwrap();
    })
    .expect("spawning a helper thread");
    let status = rx.recv().unwrap();
    helper.join().unwrap();
    let blocked = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .expect("SigBlk in the thread's status");
    for sig in [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGALRM,
        libc::SIGTSTP,
        libc::SIGCONT,
    ] {
        assert!(
            blocked & (1 << (sig - 1)) != 0,
            "signal {sig} is not blocked in a helper thread (SigBlk {blocked:#x})"
        );
    }
    // The spawning thread's own mask is as it was.
    let own = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let own_blocked = own
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(
        own_blocked & (1 << (libc::SIGALRM - 1)),
        0,
        "spawning a helper left SIGALRM blocked in its creator"
    );
}
