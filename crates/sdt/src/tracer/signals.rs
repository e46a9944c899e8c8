//! pyprobe's own signals and timer (its clock is `tracer::clock`). Ctrl-C, SIGTERM
//! and SIGHUP ask the engine to leave cleanly; SIGALRM is the tick of a timer
//! that repeats until re-armed (sampling, and checking the `--duration` deadline); Ctrl-Z (SIGTSTP) and
//! SIGTTIN/SIGTTOU ask it to let go of the target before pyprobe stops (see
//! `engine::pausing`); SIGCONT only wakes the loop (the guardian continues a
//! pyprobe stopped by SIGSTOP so that it lets go). The handlers only set flags, and
//! are installed without SA_RESTART so a blocking `waitpid` returns EINTR and the
//! loop sees them.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, SigmaskHow, Signal};

static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);
static PAUSE_SIGNAL: AtomicI32 = AtomicI32::new(0);
static TICK: AtomicBool = AtomicBool::new(false);
static DEADLINE_NS: AtomicU64 = AtomicU64::new(0);
/// [`install`] ran: SIGALRM has a handler (its default action ends the process).
static INSTALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    match sig {
        libc::SIGALRM => TICK.store(true, Ordering::SeqCst),
        libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU => PAUSE_SIGNAL.store(sig, Ordering::SeqCst),
        // Waking the loop is all (its EINTR).
        libc::SIGCONT => {}
        _ => STOP_SIGNAL.store(sig, Ordering::SeqCst),
    }
}

const HANDLED: [Signal; 8] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGALRM,
    Signal::SIGTSTP,
    Signal::SIGTTIN,
    Signal::SIGTTOU,
    Signal::SIGCONT,
];

/// Installs the handlers for SIGINT, SIGTERM, SIGHUP, SIGALRM, the job-control
/// stops (SIGTSTP, SIGTTIN, SIGTTOU) and SIGCONT.
pub fn install() -> nix::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in HANDLED {
        // SAFETY: the handler only stores to atomics, which is async-signal-safe.
        unsafe { sigaction(sig, &action) }?;
    }
    INSTALLED.store(true, Ordering::SeqCst);
    Ok(())
}

/// Whether [`install`] ran in this process (a program using the engine as a
/// library may not have).
pub(crate) fn installed() -> bool {
    INSTALLED.load(Ordering::SeqCst)
}

/// Why pyprobe is leaving before the target ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The `--duration` deadline passed.
    Duration,
    /// Ctrl-C, SIGTERM or SIGHUP.
    Signal(Signal),
    /// pyprobe itself cannot go on (e.g. the disk is full).
    Internal,
}

const INTERNAL: i32 = -1;

/// What asked pyprobe to stop, if anything.
pub(crate) fn stop_requested() -> Option<StopReason> {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => {}
        INTERNAL => return Some(StopReason::Internal),
        n => return Signal::try_from(n).ok().map(StopReason::Signal),
    }
    let deadline = DEADLINE_NS.load(Ordering::SeqCst);
    (deadline != 0 && monotonic_ns() >= deadline).then_some(StopReason::Duration)
}

/// The job-control stop (Ctrl-Z's SIGTSTP, SIGTTIN, SIGTTOU) received since the
/// last call, if any: pyprobe must let go of the target, then stop.
pub(crate) fn take_pause_request() -> Option<Signal> {
    // A plain load first: asked once per turn of the event loop.
    if PAUSE_SIGNAL.load(Ordering::Relaxed) == 0 {
        return None;
    }
    match PAUSE_SIGNAL.swap(0, Ordering::SeqCst) {
        0 => None,
        n => Signal::try_from(n).ok(),
    }
}

/// Asks the engine to leave at its next turn (from pyprobe's own code).
pub fn request_stop() {
    STOP_SIGNAL.store(INTERNAL, Ordering::SeqCst);
}

/// Stop after `seconds` from now (`--duration`). The timer must tick for a blocked
/// loop to notice: see [`arm_tick`].
pub fn set_deadline(seconds: f64) {
    let ns = (seconds.max(0.0) * 1e9) as u64;
    DEADLINE_NS.store(monotonic_ns().saturating_add(ns.max(1)), Ordering::SeqCst);
}

/// Nanoseconds left until the deadline, if one is set.
pub(crate) fn until_deadline_ns() -> Option<u64> {
    match DEADLINE_NS.load(Ordering::SeqCst) {
        0 => None,
        d => Some(d.saturating_sub(monotonic_ns())),
    }
}

/// Sleeps `us` microseconds or until a signal lands, whichever is first: a
/// sampling tick or a Ctrl-C that arrives during the event loop's short naps is
/// taken at once, not after the nap (`std::thread::sleep` sleeps on through
/// signals: at 10 kHz its 200 µs naps, longer on a VM, held the rate to 2 kHz). A
/// signal that lands just before the nap waits for its end, `us` at most.
pub(crate) fn nap(us: u64) {
    let ts = libc::timespec {
        tv_sec: (us / 1_000_000) as libc::time_t,
        tv_nsec: ((us % 1_000_000) * 1000) as libc::c_long,
    };
    // SAFETY: plain syscall with a valid struct; EINTR is the point.
    unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
}

/// Whether the timer ticked since the last call (clears the flag).
pub fn take_tick() -> bool {
    TICK.swap(false, Ordering::SeqCst)
}

/// Arms SIGALRM in `ns` nanoseconds (at least 1 µs), then every `again_ns` until
/// armed anew, and forgets a tick not taken yet.
///
/// The repeat is what makes a tick certain: the handler can only set a flag, and a
/// tick that lands after the loop looked at it but before it blocks in `waitpid` is
/// not seen by that `waitpid`. Without a second alarm the loop would sleep until the
/// target next stops, which for a sampled program that makes no system call pyprobe
/// watches is its end. With it, such a tick is late by at most `again_ns`.
pub fn arm_tick(ns: u64, again_ns: u64) {
    let timeval = |ns: u64| {
        let ns = ns.max(1000);
        libc::timeval {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_usec: ((ns % 1_000_000_000) / 1000) as libc::suseconds_t,
        }
    };
    set_timer(timeval(ns), timeval(again_ns));
}

/// Stops the timer (a run that no longer needs it, or a test).
pub fn disarm_tick() {
    let zero = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    set_timer(zero, zero);
}

/// `ITIMER_REAL` set to fire after `value`, then every `interval` (zero: never).
fn set_timer(value: libc::timeval, interval: libc::timeval) {
    let timer = libc::itimerval {
        it_interval: interval,
        it_value: value,
    };
    // SAFETY: plain syscall with a valid struct.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &timer, std::ptr::null_mut()) };
    // A repeat that fired while the last tick was handled is not a new tick.
    TICK.store(false, Ordering::SeqCst);
}

/// The signals [`install`] handles: blocked in pyprobe's helper threads, so that
/// the kernel delivers every one of them to the thread whose `waitpid` they must
/// interrupt.
fn handled() -> SigSet {
    let mut set = SigSet::empty();
    for sig in HANDLED {
        set.add(sig);
    }
    set
}

/// Starts a helper thread named `name` that never takes pyprobe's signals (it
/// inherits its creator's mask, so they are blocked around the spawn).
pub fn spawn_helper<F, T>(name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let mut old = SigSet::empty();
    let blocked =
        nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&handled()), Some(&mut old));
    let spawned = std::thread::Builder::new().name(name.into()).spawn(f);
    if blocked.is_ok() {
        let _ = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
    }
    spawned
}

pub use super::clock::monotonic_ns;

/// A cheap pseudo-random jitter in [-spread, +spread] ns (xorshift on the clock), so
/// sampling does not fall into lock-step with periodic work in the target.
pub(crate) fn jitter(interval_ns: u64, spread_percent: u64) -> u64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.load(Ordering::Relaxed) ^ monotonic_ns() | 1;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    STATE.store(x, Ordering::Relaxed);
    let spread = interval_ns * spread_percent / 100;
    if spread == 0 {
        return interval_ns;
    }
    interval_ns - spread + x % (2 * spread + 1)
}
