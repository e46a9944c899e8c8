//! Leaving the target: stopping every thread, taking the rings, the safety net and
//! the patches out, and detaching. Apart because it is the engine's one way out,
//! shared by a clean end, a failed attach, a pause and `Drop`.

use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::tracer::safety_net;

use super::{Engine, ThreadState, TraceEvent};

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
        if let Err(e) = self.stop_all(sink) {
            sink(TraceEvent::Notice(format!(
                "while stopping the target to detach: {e:#}"
            )));
        }
        self.take_pending_traps(sink);
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
        for (&tid, thread) in &self.threads {
            let pending = match thread.state {
                ThreadState::Stopped { pending, .. } => pending,
                _ => None,
            };
            let _ = ptrace::detach(Pid::from_raw(tid), pending);
        }
        self.threads.clear();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The last line of defence (a panic unwinding through the session): never
        // leave an int3 behind in a target that outlives pyprobe.
        self.detach_all(&mut |_| {});
    }
}
