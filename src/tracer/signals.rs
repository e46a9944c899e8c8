//! pyprobe's own signals: Ctrl-C, SIGTERM, SIGHUP and the `--duration` timer all ask
//! the engine to leave cleanly. The handlers only set a flag; they are installed
//! without SA_RESTART so a blocking `waitpid` returns EINTR and the loop sees it.

use std::sync::atomic::{AtomicI32, Ordering};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Installs the handlers for SIGINT, SIGTERM, SIGHUP and SIGALRM.
pub fn install() -> nix::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGALRM,
    ] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(sig, &action) }?;
    }
    Ok(())
}

/// Why pyprobe is leaving before the target ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The `--duration` timer ran out.
    Duration,
    /// Ctrl-C, SIGTERM or SIGHUP.
    Signal(Signal),
    /// pyprobe itself cannot go on (e.g. the disk is full).
    Internal,
}

const INTERNAL: i32 = -1;

/// What asked pyprobe to stop, if anything.
pub fn stop_requested() -> Option<StopReason> {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        INTERNAL => Some(StopReason::Internal),
        n if n == libc::SIGALRM => Some(StopReason::Duration),
        n => Signal::try_from(n).ok().map(StopReason::Signal),
    }
}

/// Asks the engine to leave at its next turn (from pyprobe's own code).
pub fn request_stop() {
    STOP_SIGNAL.store(INTERNAL, Ordering::SeqCst);
}

/// Asks for SIGALRM after `seconds` (the `--duration` timer).
pub fn arm_timer(seconds: f64) {
    let secs = seconds.max(0.001);
    let value = libc::timeval {
        tv_sec: secs.trunc() as libc::time_t,
        tv_usec: (secs.fract() * 1e6) as libc::suseconds_t,
    };
    let timer = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: value,
    };
    // SAFETY: plain syscall with a valid struct.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &timer, std::ptr::null_mut()) };
}

/// Nanoseconds of CLOCK_MONOTONIC.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
