//! Yielding the CPU pyprobe follows to the thread it traces: while pinned beside a
//! thread that hits `int3` sites often, pyprobe's tracing thread runs under
//! `SCHED_IDLE`, so that its `PTRACE_CONT` wakes the thread on this CPU.
//!
//! The scheduler places a woken thread on an idle CPU near its last one, and a
//! CPU that runs only `SCHED_IDLE` threads counts as idle. Pinned with the normal
//! policy, pyprobe keeps its CPU busy as it resumes the thread, which is then
//! sent to the other CPU: an inter-processor wake-up per hit, each way. Under
//! `SCHED_IDLE` the thread comes back to pyprobe's CPU and preempts it there, and
//! the hit costs what the same-CPU floor costs (measured: fib(18) under `int3`,
//! 1.8 s following with the normal policy, 0.15-0.18 s yielding; the floor with
//! both pinned to one CPU, 0.11 s).
//!
//! A `SCHED_IDLE` thread is starved by any normal thread on its CPU, and a
//! traced thread held at a stop waits for it: so pyprobe yields only where it
//! may take the normal policy back (`CAP_SYS_NICE`, or `RLIMIT_NICE` allowing
//! nice 0; without either, leaving `SCHED_IDLE` is refused), and a guard thread
//! of the normal policy watches it: when the tracing thread was runnable at
//! four looks in a row and hardly ran between them while the thread it last
//! served was held at its stop, the guard gives it the normal policy and its
//! whole CPU mask back at once, and yielding pauses ([`BACKOFF_NS`], longer at
//! each take-back in a row).
//!
//! Runnable and not running is not enough: a thread resumed by `PTRACE_CONT`
//! preempts pyprobe on its CPU (that is the point of yielding), and pyprobe
//! stays runnable there, harmlessly, for as long as the thread runs without
//! hitting a site (a collection, a stretch of C). Taken back then, pyprobe lost
//! its place beside the thread for a growing pause, and a fib run under `int3`
//! took 2-4× its time instead of 1.4×.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

use crate::process::status::KeptTaskFile;
use crate::tracer::clock::monotonic_ns;

/// How often the guard looks at the tracing thread.
const GUARD_PERIOD: Duration = Duration::from_millis(2);
/// The tracing thread starves when it is runnable at two looks and ran for
/// less than this share of the time between them (1/32: a thread serving hits
/// runs for far more).
const STARVED_RUN_SHARE: u64 = 32;
/// Comparisons of looks in a row that must find it starving: pyprobe's own
/// threads, waking, take its CPU for a moment (a CPU running only `SCHED_IDLE`
/// threads counts as free for them too), and the kernel credits run time in lumps.
const STARVED_LOOKS: u32 = 3;
/// How long yielding pauses after the guard took the thread back, doubled at
/// each take-back in a row (up to [`MAX_BACKOFF_SHIFT`] times): a CPU busy with
/// other work for a moment costs one short pause, one busy for good seldom
/// costs a look.
const BACKOFF_NS: u64 = 20_000_000;
const MAX_BACKOFF_SHIFT: u32 = 8;
/// Yielding this long without a take-back ends a run of them.
const STREAK_ENDS_NS: u64 = 10_000_000_000;

/// What the tracing thread and its guard share.
#[derive(Debug, Default)]
struct Shared {
    /// The tracing thread runs under `SCHED_IDLE` now.
    idle: AtomicBool,
    /// Take-backs so far.
    taken: AtomicU64,
    /// Set by the guard when it took the thread back; the tracing thread clears it.
    taken_back: AtomicBool,
    /// No yielding before this time (`monotonic_ns`).
    paused_until: AtomicU64,
    /// Take-backs in a row, and when the last one was.
    streak: AtomicU64,
    /// The thread served last: process id in the high half, thread id in the low.
    served: AtomicU64,
    last_taken_ns: AtomicU64,
    stop: AtomicBool,
}

/// Yielding for one tracing thread (the one that makes every ptrace request).
#[derive(Debug)]
pub(super) struct Yielding {
    shared: Arc<Shared>,
    guard: Option<JoinHandle<()>>,
    /// The tracing thread's kernel tid.
    tid: i32,
}

impl Yielding {
    /// For the calling thread, if it may leave `SCHED_IDLE` again (else `None`).
    pub(super) fn for_this_thread() -> Option<Yielding> {
        if !may_leave_idle() {
            return None;
        }
        Some(Yielding {
            shared: Arc::default(),
            guard: None,
            tid: nix::unistd::gettid().as_raw(),
        })
    }

    /// What yielding did, for `-v` (`None`: it never started).
    pub(super) fn summary(&self) -> Option<String> {
        self.guard.as_ref()?;
        let taken = self.shared.taken.load(Ordering::Relaxed);
        Some(format!(
            "pyprobe ran under SCHED_IDLE while following threads that hit int3 sites often \
             (a hit then resumes the thread on pyprobe's CPU); its guard took the normal policy \
             back {taken} time{} when other work held that CPU",
            if taken == 1 { "" } else { "s" }
        ))
    }

    /// Whether the guard took the thread back since the last call (its CPU mask
    /// is then the whole one again).
    pub(super) fn taken_back(&self) -> bool {
        self.shared.taken_back.swap(false, Ordering::AcqRel)
    }

    /// Thread `tid` of process `pid` hit a site: the one whose wait tells the
    /// guard whether pyprobe's starving does harm.
    pub(super) fn serving(&self, pid: i32, tid: i32) {
        let both = (u64::from(pid as u32) << 32) | u64::from(tid as u32);
        if self.shared.served.load(Ordering::Relaxed) != both {
            self.shared.served.store(both, Ordering::Relaxed);
        }
    }

    /// Pinned beside a busy thread: yields, unless paused. `original` is the CPU
    /// mask the guard gives back.
    pub(super) fn start(&mut self, original: &CpuSet) {
        if self.shared.idle.load(Ordering::Acquire)
            || monotonic_ns() < self.shared.paused_until.load(Ordering::Acquire)
        {
            return;
        }
        if self.guard.is_none() {
            // Started before the policy changes: a thread inherits its creator's.
            let shared = Arc::clone(&self.shared);
            let (tid, mask) = (self.tid, *original);
            let spawned = crate::tracer::signals::spawn_helper("pyprobe-yield-guard", move || {
                guard(&shared, tid, &mask)
            });
            match spawned {
                Ok(handle) => self.guard = Some(handle),
                Err(_) => return,
            }
        }
        if set_policy(0, libc::SCHED_IDLE) {
            self.shared.idle.store(true, Ordering::Release);
        }
    }

    /// Back to the normal policy (no longer pinned).
    pub(super) fn stop(&mut self) {
        if self.shared.idle.swap(false, Ordering::AcqRel) {
            set_policy(0, libc::SCHED_OTHER);
        }
    }
}

impl Drop for Yielding {
    fn drop(&mut self) {
        self.stop();
        self.shared.stop.store(true, Ordering::Release);
        if let Some(handle) = self.guard.take() {
            handle.thread().unpark();
            let _ = handle.join();
        }
    }
}

/// The guard's loop: takes the tracing thread `tid` back (normal policy, CPU
/// mask `original`) when it starves.
fn guard(shared: &Shared, tid: i32, original: &CpuSet) {
    // Started by the pinned tracing thread, whose mask it inherits: it belongs
    // anywhere but beside the thread pyprobe serves.
    let _ = sched_setaffinity(Pid::from_raw(0), original);
    let mut eyes = Eyes::default();
    let mut last: Option<Looked> = None;
    let mut starved = 0;
    while !shared.stop.load(Ordering::Acquire) {
        std::thread::park_timeout(GUARD_PERIOD);
        if !shared.idle.load(Ordering::Acquire) {
            (last, starved) = (None, 0);
            continue;
        }
        let Some(now) = eyes.look(tid, shared.served.load(Ordering::Relaxed)) else {
            (last, starved) = (None, 0);
            continue;
        };
        if last
            .as_ref()
            .is_some_and(|before| now.starved_since(before))
        {
            starved += 1;
        } else {
            starved = 0;
        }
        if starved >= STARVED_LOOKS {
            take_back(shared, tid, original);
            (last, starved) = (None, 0);
            continue;
        }
        last = Some(now);
    }
}

/// The files the guard reads at each look, kept open (a look every
/// [`GUARD_PERIOD`] is then three `pread`s).
#[derive(Debug, Default)]
struct Eyes {
    own_stat: KeptTaskFile,
    own_schedstat: KeptTaskFile,
    served_stat: KeptTaskFile,
}

impl Eyes {
    /// A look at tracing thread `tid`; `served` as kept in [`Shared::served`].
    fn look(&mut self, tid: i32, served: u64) -> Option<Looked> {
        let me = std::process::id() as i32;
        let state = self.own_stat.state(me, tid)?;
        let ran =
            parse_ran(std::str::from_utf8(self.own_schedstat.read(me, tid, "schedstat")?).ok()?)?;
        let (pid, served_tid) = ((served >> 32) as i32, served as u32 as i32);
        // `t`: a tracing stop, where the thread waits for pyprobe.
        let served_held = served != 0 && self.served_stat.state(pid, served_tid) == Some('t');
        Some(Looked {
            at_ns: monotonic_ns(),
            ran_ns: ran,
            runnable: state == 'R',
            served_held,
        })
    }
}

/// One look of the guard at the tracing thread: the guard's clock, the thread's
/// run time, whether it is runnable, and whether the thread it served last is
/// held at a stop.
#[derive(Debug, Clone, Copy)]
struct Looked {
    at_ns: u64,
    ran_ns: u64,
    runnable: bool,
    served_held: bool,
}

impl Looked {
    /// Whether the thread wanted its CPU at both looks and hardly ran between
    /// them while the thread it serves waited at its stop: a thread of the
    /// normal policy holds the CPU, and under `SCHED_IDLE` pyprobe gets almost
    /// none of it while the threads it traces wait. (The kernel counts a
    /// thread's wait on its run queue only once it runs, so the wait itself says
    /// nothing while it starves.)
    fn starved_since(&self, before: &Looked) -> bool {
        let span = self.at_ns.saturating_sub(before.at_ns).max(1);
        let ran = self.ran_ns.saturating_sub(before.ran_ns);
        before.runnable
            && self.runnable
            && before.served_held
            && self.served_held
            && ran < span / STARVED_RUN_SHARE
    }
}

/// Gives the tracing thread `tid` the normal policy and its CPU mask back, and
/// pauses yielding.
fn take_back(shared: &Shared, tid: i32, original: &CpuSet) {
    // The order matters little: each alone lets the thread run.
    set_policy(tid, libc::SCHED_OTHER);
    let _ = sched_setaffinity(Pid::from_raw(tid), original);
    let now = monotonic_ns();
    let since = now.saturating_sub(shared.last_taken_ns.swap(now, Ordering::AcqRel));
    let streak = if since > STREAK_ENDS_NS {
        0
    } else {
        shared.streak.load(Ordering::Acquire) + 1
    };
    shared.streak.store(streak, Ordering::Release);
    let pause = BACKOFF_NS << streak.min(u64::from(MAX_BACKOFF_SHIFT));
    shared.paused_until.store(now + pause, Ordering::Release);
    shared.taken.fetch_add(1, Ordering::Relaxed);
    shared.idle.store(false, Ordering::Release);
    shared.taken_back.store(true, Ordering::Release);
}

/// The run time (ns) in a `schedstat` file: its first field.
fn parse_ran(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().next()?.parse().ok()
}

/// Sets the scheduling policy of thread `tid` (0: the caller), priority 0. With
/// reset-on-fork: a child pyprobe forks while it yields starts with the normal
/// policy (and the flag, once set, may be cleared only with `CAP_SYS_NICE`).
fn set_policy(tid: i32, policy: i32) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call to read; the call
    // changes only the thread's scheduling.
    unsafe { libc::sched_setscheduler(tid, policy | libc::SCHED_RESET_ON_FORK, &param) == 0 }
}

/// Whether a thread of this process may take the normal policy back after
/// `SCHED_IDLE`: tried on a thread of its own, which ends at once.
fn may_leave_idle() -> bool {
    crate::tracer::signals::spawn_helper("pyprobe-policy-check", || {
        set_policy(0, libc::SCHED_IDLE) && set_policy(0, libc::SCHED_OTHER)
    })
    .ok()
    .and_then(|h| h.join().ok())
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_time_is_the_first_field() {
        assert_eq!(parse_ran("123 456 7\n"), Some(123));
        assert_eq!(parse_ran("x"), None);
        let own = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
        assert!(parse_ran(&own).is_some());
    }

    /// The calling thread's policy, without the reset-on-fork flag.
    fn policy() -> i32 {
        // SAFETY: reads the calling thread's policy; no pointer is passed.
        unsafe { libc::sched_getscheduler(0) & !libc::SCHED_RESET_ON_FORK }
    }

    fn looked(at_ns: u64, ran_ns: u64, runnable: bool) -> Looked {
        Looked {
            at_ns,
            ran_ns,
            runnable,
            served_held: true,
        }
    }

    #[test]
    fn a_runnable_thread_that_does_not_run_is_starving() {
        let before = looked(0, 0, true);
        assert!(looked(2_000_000, 10_000, true).starved_since(&before));
        // It ran: served hits, however long it waited besides.
        assert!(!looked(2_000_000, 300_000, true).starved_since(&before));
        // Asleep at either look (waiting for a hit): not starving.
        assert!(!looked(2_000_000, 0, false).starved_since(&before));
        assert!(!looked(2_000_000, 0, true).starved_since(&looked(0, 0, false)));
        // The thread it serves runs on (it preempted pyprobe): no harm done.
        let running = Looked {
            served_held: false,
            ..looked(2_000_000, 10_000, true)
        };
        assert!(!running.starved_since(&before));
        assert!(!looked(2_000_000, 10_000, true).starved_since(&Looked {
            served_held: false,
            ..before
        }));
    }

    #[test]
    fn a_thread_that_yields_takes_the_normal_policy_back() {
        let Some(mut y) = Yielding::for_this_thread() else {
            // Not allowed here (no CAP_SYS_NICE, RLIMIT_NICE below 20): nothing yields.
            return;
        };
        let mask = nix::sched::sched_getaffinity(Pid::from_raw(0)).unwrap();
        y.start(&mask);
        assert_eq!(policy(), libc::SCHED_IDLE);
        y.stop();
        assert_eq!(policy(), libc::SCHED_OTHER);
        drop(y);
    }

    #[test]
    fn the_guard_takes_a_starved_thread_back() {
        // A thread that yields, pinned to one CPU, and a normal thread spinning on
        // that CPU: the yielding one starves until the guard takes it back.
        let Some(cpu) = nix::sched::sched_getaffinity(Pid::from_raw(0))
            .ok()
            .and_then(|m| (0..CpuSet::count()).find(|&c| m.is_set(c).unwrap_or(false)))
        else {
            return;
        };
        let mut one = CpuSet::new();
        one.set(cpu).unwrap();
        let spin = Arc::new(AtomicBool::new(true));
        let spinner = {
            let spin = Arc::clone(&spin);
            std::thread::spawn(move || {
                let _ = sched_setaffinity(Pid::from_raw(0), &one);
                while spin.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        // The thread it serves, held at a tracing stop: a child that asked to be
        // traced stops at its exec and waits there.
        let mut held = {
            use std::os::unix::process::CommandExt;
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("60");
            // SAFETY: the hook only makes the ptrace request, which is safe between
            // fork and exec.
            unsafe {
                cmd.pre_exec(|| nix::sys::ptrace::traceme().map_err(std::io::Error::from));
            }
            cmd.spawn().unwrap()
        };
        let held_pid = held.id() as i32;
        let starved = std::thread::spawn(move || {
            let mut y = Yielding::for_this_thread()?;
            let whole = nix::sched::sched_getaffinity(Pid::from_raw(0)).unwrap();
            sched_setaffinity(Pid::from_raw(0), &one).unwrap();
            y.serving(held_pid, held_pid);
            y.start(&whole);
            // Asks for the CPU now and then, as a tracing thread does; no hit served.
            let began = monotonic_ns();
            while !y.taken_back() {
                std::thread::sleep(Duration::from_micros(100));
                assert!(
                    monotonic_ns() - began < 20_000_000_000,
                    "the guard never took the starved thread back"
                );
            }
            Some(policy())
        });
        let policy = starved.join().unwrap();
        spin.store(false, Ordering::Relaxed);
        spinner.join().unwrap();
        let _ = held.kill();
        let _ = held.wait();
        if let Some(policy) = policy {
            assert_eq!(policy, libc::SCHED_OTHER);
        }
    }
}
