//! Leaving the target: stopping every thread, taking the rings, the safety net and
//! the patches out, and detaching. Apart because it is the engine's one way out,
//! shared by a clean end, a failed attach, a pause and `Drop`.

use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::tracer::safety_net;

use super::threads::wait_for_thread;
use super::{Engine, Thread, ThreadState, TraceEvent};

impl Engine {
    /// Stops every thread, restores every byte and semaphore, and detaches, delivering
    /// any signal a thread was stopped with; then lets the guardian go.
    pub(crate) fn detach_all(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        self.release_target(sink);
        if let Some(g) = self.guardian.take() {
            g.finish();
        }
    }

    /// Everything [`Engine::detach_all`] does but letting the guardian go: a pause
    /// keeps it.
    pub(super) fn release_target(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        if self.detached {
            return;
        }
        self.detached = true;
        self.cpu.release();
        if let Some(said) = self.cpu.yield_summary() {
            sink(TraceEvent::Detail(said));
        }
        self.note_busy_threads();
        if let Err(e) = self.stop_all(sink) {
            sink(TraceEvent::Notice(format!(
                "while stopping the target to detach: {e:#}"
            )));
        }
        self.take_pending_traps(sink);
        let mut unhooked: Vec<i32> = self
            .procs
            .iter()
            .filter(|(_, p)| p.unhooked.is_some())
            .map(|(&pid, _)| pid)
            .collect();
        unhooked.sort_unstable();
        for pid in unhooked {
            self.say_unhooked(pid, sink);
        }
        self.ring_detach(sink);
        self.source_detach(sink);
        let with_net: Vec<i32> = self
            .procs
            .iter()
            .filter(|(_, p)| p.net.is_some())
            .map(|(&pid, _)| pid)
            .collect();
        for pid in with_net {
            let tid = self.clean_thread(pid, sink);
            let Some(proc) = self.procs.get_mut(&pid) else {
                continue;
            };
            let Some(net) = proc.net.take() else {
                continue;
            };
            let result = match tid {
                Some(tid) => {
                    safety_net::uninstall(tid, &mut proc.mem, &net, self.guardian.as_ref())
                }
                None => Err(std::io::Error::other(
                    "no thread of it is at a stop where a system call can be injected",
                )),
            };
            if let Err(e) = result {
                sink(TraceEvent::Notice(format!(
                    "process {pid}: cannot give SIGTRAP back its own disposition: {e}; \
                     pyprobe's handler stays and passes the program's own SIGTRAPs on as it set them"
                )));
            }
        }
        for (pid, proc) in &mut self.procs {
            if proc.shares_parent_memory {
                // The parent's patches, undone with the parent's.
                proc.patches.forget();
                continue;
            }
            if let Err(e) = proc.patches.remove(&mut proc.mem, self.guardian.as_mut()) {
                sink(TraceEvent::Notice(format!(
                    "process {pid}: restoring probe sites failed: {e}"
                )));
            }
        }
        let mut threads: Vec<(i32, Thread)> = self.threads.drain().collect();
        // The busy threads first (see `note_busy_threads`).
        threads.sort_unstable_by_key(|(tid, _)| (!self.busy.contains(tid), *tid));
        for (tid, thread) in threads {
            let pending = match thread.state {
                ThreadState::Stopped { pending, .. } => pending,
                _ => None,
            };
            if ptrace::detach(Pid::from_raw(tid), pending).is_err() {
                let_go_late(tid, thread.tgid, sink);
            }
        }
        self.busy.clear();
    }
}

/// A thread whose detach failed: not in a ptrace-stop. One that exited while
/// pyprobe held the others (a zombie found by a look at `/proc` between two waits)
/// is reaped: only its tracer may reap it, and until then its process cannot be
/// reaped either (pyprobe, waiting for a command it started, would wait for ever).
/// One still running is stopped and let go.
fn let_go_late(tid: i32, tgid: i32, sink: &mut dyn FnMut(TraceEvent)) {
    if tid == tgid {
        // An exited leader is reaped with its process, by its parent.
        return;
    }
    if !crate::process::status::task_gone_or_zombie(tgid, tid) {
        let _ = ptrace::interrupt(Pid::from_raw(tid));
    }
    let pending = match wait_for_thread(tgid, tid) {
        Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) => return,
        Ok(WaitStatus::Stopped(_, sig)) if sig != Signal::SIGTRAP => Some(sig),
        Ok(_) => None,
        // Gone without a status, or a zombie the kernel has yet to report.
        Err(_) => return reap_zombie(tid),
    };
    if let Err(e) = ptrace::detach(Pid::from_raw(tid), pending) {
        sink(TraceEvent::Notice(format!(
            "process {tgid}: thread {tid} could not be let go ({e}); it stays traced until \
             pyprobe exits"
        )));
    }
}

/// Reaps zombie thread `tid`, waiting a little for its exit to be reported.
fn reap_zombie(tid: i32) {
    for _ in 0..100 {
        match waitpid(
            Pid::from_raw(tid),
            Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG),
        ) {
            Ok(WaitStatus::StillAlive) => std::thread::sleep(std::time::Duration::from_millis(1)),
            _ => return,
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The last line of defence (a panic unwinding through the session): never
        // leave an int3 behind in a target that outlives pyprobe.
        self.detach_all(&mut |_| {});
    }
}
