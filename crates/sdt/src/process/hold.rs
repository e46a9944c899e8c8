//! Holding a process's threads: seized and interrupted, no signal sent, once any
//! earlier tracer's link is gone. The guardian holds a target whose tracer died to
//! undo what it left; `dump --locals` holds one while it reads values that must
//! belong together. Nothing is held past the holder's life: the kernel lets a
//! tracer's threads go when it exits.

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::process::status::task_gone_or_zombie;

/// Every thread of a process held in a ptrace stop. Dropping it lets them go, each
/// with the signal that stopped it, if one did (delivered as it would have been
/// without the hold); a thread in group-stop stays stopped.
#[derive(Default)]
pub struct Held {
    pub threads: Vec<(i32, Option<Signal>)>,
}

impl Drop for Held {
    fn drop(&mut self) {
        for &(tid, sig) in &self.threads {
            let _ = ptrace::detach(Pid::from_raw(tid), sig);
        }
    }
}

/// Stops every thread of `pid` with `PTRACE_SEIZE` and `PTRACE_INTERRUPT` (no
/// signal is sent: neither the target nor its parent sees the stop), within
/// `deadline`. A thread it seized but that did not stop in time is let go when
/// the holder exits.
pub fn hold(pid: i32, deadline: Instant) -> Result<Held, String> {
    // The dead tracer's link goes a moment after its pipe closes.
    loop {
        match crate::process::status::tracer_of(pid) {
            None => return Err("it exited".into()),
            Some(0) => break,
            Some(t) if Instant::now() > deadline => {
                return Err(format!("it is still traced by process {t}"))
            }
            Some(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    let mut held = Held::default();
    let mut tried = std::collections::HashSet::new();
    // Seized threads cannot create more; one more round sees any a running one made.
    for _ in 0..64 {
        let tids = crate::process::status::thread_ids(pid).map_err(|_| "it exited")?;
        let new: Vec<i32> = tids.into_iter().filter(|&t| tried.insert(t)).collect();
        if new.is_empty() {
            return Ok(held);
        }
        // All interrupted first, then each waited for: they stop together, not one
        // after the other (2,000 threads: about a second one by one).
        let mut interrupted = Vec::with_capacity(new.len());
        for tid in new {
            if seize_and_interrupt(pid, tid, deadline)? {
                interrupted.push(tid);
            }
        }
        // Past the deadline each wait is one look: every thread that did stop is
        // held, and so let go with the others when the error drops them.
        let mut late = None;
        for tid in interrupted {
            match wait_stop(Pid::from_raw(tid), deadline) {
                Ok(Some(sig)) => held.threads.push((tid, sig)),
                Ok(None) => {}
                Err(why) => {
                    late.get_or_insert(why);
                }
            }
        }
        if let Some(why) = late {
            return Err(why);
        }
    }
    Err("its threads kept multiplying".into())
}

/// Seizes thread `tid` of `pid` once the dead tracer's link is gone and stops it
/// with `PTRACE_INTERRUPT`, within `deadline`: `Some(signal)` as [`wait_stop`]
/// says, `None` if it ended or is ending (it needs no stop).
pub fn seize_and_stop(
    pid: i32,
    tid: i32,
    deadline: Instant,
) -> Result<Option<Option<Signal>>, String> {
    if !seize_and_interrupt(pid, tid, deadline)? {
        return Ok(None);
    }
    wait_stop(Pid::from_raw(tid), deadline)
}

/// Seizes thread `tid` of `pid` once the dead tracer's link is gone and sends it
/// `PTRACE_INTERRUPT`, without waiting for the stop: `false` if it ended or is
/// ending (it needs no stop).
pub fn seize_and_interrupt(pid: i32, tid: i32, deadline: Instant) -> Result<bool, String> {
    let thread = Pid::from_raw(tid);
    let seized = loop {
        match ptrace::seize(thread, ptrace::Options::empty()) {
            // Still the dead tracer's a moment longer.
            Err(Errno::EPERM) if !task_gone_or_zombie(pid, tid) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1))
            }
            other => break other,
        }
    };
    match seized {
        Ok(()) => {}
        Err(Errno::ESRCH) => return Ok(false),
        // A thread that is exiting cannot be seized, and needs no stop.
        Err(Errno::EPERM) if task_gone_or_zombie(pid, tid) => return Ok(false),
        Err(e) => return Err(format!("cannot seize its thread {tid}: {e}")),
    }
    if let Err(e) = ptrace::interrupt(thread) {
        if e != Errno::ESRCH {
            return Err(format!("cannot stop its thread {tid}: {e}"));
        }
    }
    // Seized: its end, if it is ending, is seen by the wait.
    Ok(true)
}

/// Waits for a seized, interrupted thread to stop: `Some(signal)` with the signal
/// that stopped it instead of the interrupt, if any; `None` if it ended.
pub fn wait_stop(thread: Pid, deadline: Instant) -> Result<Option<Option<Signal>>, String> {
    loop {
        match waitpid(thread, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => {
                if Instant::now() > deadline {
                    return Err(format!("its thread {thread} did not stop"));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            // The interrupt, or a group-stop (which resumes as one at release).
            Ok(WaitStatus::PtraceEvent(..)) => return Ok(Some(None)),
            Ok(WaitStatus::Stopped(_, sig)) => return Ok(Some(Some(sig))),
            Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) | Err(Errno::ECHILD) => {
                return Ok(None)
            }
            Ok(_) => {}
            Err(e) => return Err(format!("waiting for its thread {thread}: {e}")),
        }
    }
}
