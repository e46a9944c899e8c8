//! What one ptrace stop costs on this machine now: a child of pyprobe runs `int3`
//! in a loop and pyprobe resumes it each time, like the floor benchmark. The cycle
//! time is the kernel's share of each probe hit (trap, wake-up of the tracer,
//! resume), which pyprobe cannot time on the target itself.

use nix::sys::ptrace;
use nix::sys::signal::{raise, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};

use crate::tracer::clock::monotonic_ns;

/// Breakpoints the child hits; the first few warm caches and are not timed.
const ROUNDS: u32 = 200;
const WARMUP: u32 = 20;

/// The mean time of one stop/resume cycle in ns, or `None` if
/// the measurement could not run (ptrace refused, fork failed).
pub(crate) fn stop_cycle_ns() -> Option<u64> {
    // SAFETY: the child only calls async-signal-safe functions (ptrace, raise,
    // _exit) and executes int3; it never returns into Rust code that allocates.
    match unsafe { fork() }.ok()? {
        ForkResult::Child => {
            if ptrace::traceme().is_err() {
                // SAFETY: leaves the forked child at once, running nothing of the parent's.
                unsafe { libc::_exit(1) };
            }
            let _ = raise(Signal::SIGSTOP);
            for _ in 0..ROUNDS {
                // SAFETY: a breakpoint; the tracing parent resumes past it.
                unsafe { std::arch::asm!("int3") };
            }
            // SAFETY: as above.
            unsafe { libc::_exit(0) }
        }
        ForkResult::Parent { child } => {
            let result = measure(child);
            if result.is_none() {
                let _ = nix::sys::signal::kill(child, Signal::SIGKILL);
            }
            // Reap it whatever happened.
            while let Ok(status) = waitpid(child, None) {
                if matches!(status, WaitStatus::Exited(..) | WaitStatus::Signaled(..)) {
                    break;
                }
                let _ = ptrace::cont(child, None);
            }
            result
        }
    }
}

fn measure(child: nix::unistd::Pid) -> Option<u64> {
    match waitpid(child, None).ok()? {
        WaitStatus::Stopped(_, Signal::SIGSTOP) => {}
        _ => return None,
    }
    let mut start = 0;
    for round in 0..ROUNDS {
        if round == WARMUP {
            start = monotonic_ns();
        }
        ptrace::cont(child, None).ok()?;
        match waitpid(child, None).ok()? {
            WaitStatus::Stopped(_, Signal::SIGTRAP) => {}
            _ => return None,
        }
    }
    let elapsed = monotonic_ns().saturating_sub(start);
    ptrace::cont(child, None).ok()?;
    Some(elapsed / u64::from(ROUNDS - WARMUP))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stop_cycle_takes_microseconds() {
        let ns = super::stop_cycle_ns().expect("ptrace of our own child works");
        // Wide bounds: only that it measured something real.
        assert!(ns > 100 && ns < 100_000_000, "{ns} ns");
    }
}
