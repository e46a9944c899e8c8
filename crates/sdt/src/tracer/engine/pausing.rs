//! Pausing: pyprobe lets go of the target before it stops, and takes it up again
//! when it is continued.
//!
//! While pyprobe is attached, every thread of the target that starts a thread,
//! takes a signal, exits or hits an `int3` waits for pyprobe, and a full ring waits
//! for its reader: a pyprobe that is stopped must not be attached. So on Ctrl-Z
//! (SIGTSTP, or SIGTTIN/SIGTTOU from a background terminal job) pyprobe detaches
//! as it does at the end (sites restored, semaphores lowered, hook removed, every
//! thread let go), keeps its guardian, and only then stops itself. SIGSTOP cannot
//! be caught: the guardian finds pyprobe stopped, continues it and asks it to let
//! go (see `guardian::watch`), and pyprobe does the same, then stops itself again
//! as it was asked to. On SIGCONT pyprobe attaches again to the processes it traced
//! (the stacks running then are read again, as at any attach) and the recording
//! goes on; what the target did meanwhile is not in it, and it says so.

use anyhow::Result;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::{Engine, Outcome, Proc, TraceEvent};
use crate::tracer::clock::monotonic_ns;
use crate::tracer::signals::{stop_requested, take_pause_request};

/// Why pyprobe let go of the target for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseCause {
    /// Ctrl-Z (SIGTSTP), or SIGTTIN/SIGTTOU.
    JobControl(Signal),
    /// Stopped by a signal pyprobe cannot catch (SIGSTOP); its guardian continued
    /// it after `stopped_ms` so that it lets go.
    Stopped { stopped_ms: u64 },
}

impl PauseCause {
    pub(crate) fn describe(&self) -> String {
        match self {
            PauseCause::JobControl(Signal::SIGTSTP) => "Ctrl-Z (SIGTSTP)".into(),
            PauseCause::JobControl(sig) => format!("{sig}"),
            PauseCause::Stopped { stopped_ms } => {
                format!("SIGSTOP (found stopped after {stopped_ms} ms by its guardian)")
            }
        }
    }
}

impl Engine {
    /// A pause asked for and not yet made (it waits while a launched program is
    /// still being loaded: pyprobe could not attach to it again as it was).
    pub(super) fn pause_wanted(&mut self) -> Option<PauseCause> {
        if let Some(sig) = take_pause_request() {
            self.pause_pending = Some(PauseCause::JobControl(sig));
        }
        if let Some(stopped_ms) = self.guardian.as_ref().and_then(|g| g.take_release()) {
            self.pause_pending = Some(PauseCause::Stopped { stopped_ms });
        }
        self.pause_pending?;
        let loading = self
            .procs
            .values()
            .any(|p| p.awaiting_object || p.shares_parent_memory);
        if loading || self.source_awaits_any() {
            return None;
        }
        self.pause_pending.take()
    }

    /// Lets go of every traced process, stops pyprobe, and attaches again once it
    /// is continued.
    pub(super) fn pause(
        &mut self,
        cause: PauseCause,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        let pids: Vec<i32> = self.procs.keys().copied().collect();
        let paused_at = monotonic_ns();
        self.release_target(sink);
        sink(TraceEvent::Paused {
            ts_ns: paused_at,
            cause,
        });
        let pid_list = pids
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        sink(TraceEvent::Notice(format!(
            "paused by {}: process {pid_list} let go, it runs on untraced; pyprobe takes up \
             the recording when it is continued (fg, or SIGCONT)",
            cause.describe()
        )));
        if let Some(g) = self.guardian.as_ref() {
            g.set_paused(true);
        }
        // SIGSTOP whatever stopped it: a stop asked for by job control is one too
        // (and SIGTSTP would be discarded in an orphaned process group).
        let _ = nix::sys::signal::raise(Signal::SIGSTOP);
        if let Some(g) = self.guardian.as_ref() {
            g.set_paused(false);
            // A request made while pyprobe was letting go is answered already.
            let _ = g.take_release();
        }
        let _ = take_pause_request();
        let resumed_at = monotonic_ns();
        // Ticks start afresh: those of the pause were not missed, nothing was traced.
        self.next_tick_ns = 0;
        if let Some(reason) = stop_requested() {
            // Asked to end while paused: nothing to take up again.
            self.exit = Some(self.launched_exit().unwrap_or(Outcome::Detached(reason)));
            return Ok(());
        }
        self.attach_again(&pids, sink)?;
        sink(TraceEvent::Resumed {
            ts_ns: resumed_at,
            paused_ns: resumed_at.saturating_sub(paused_at),
        });
        Ok(())
    }

    /// The launched program's end, if it ended while pyprobe let go of it (it is
    /// pyprobe's child: its status waits to be taken).
    fn launched_exit(&self) -> Option<Outcome> {
        if !self.launched {
            return None;
        }
        match waitpid(Pid::from_raw(self.root), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => Some(Outcome::Exited(code)),
            Ok(WaitStatus::Signaled(_, sig, _)) => Some(Outcome::Killed(sig)),
            _ => None,
        }
    }

    /// Attaches again to the processes of `pids` that still run, as at the start.
    fn attach_again(&mut self, pids: &[i32], sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        self.reset_for_attach();
        for &pid in pids {
            if crate::process::status::process_is_ending(pid) {
                sink(TraceEvent::Notice(format!(
                    "process {pid} ended while pyprobe was paused"
                )));
                continue;
            }
            self.procs.insert(pid, Proc::new(pid));
            if let Err(e) = self.seize_process(pid) {
                self.procs.remove(&pid);
                self.threads.retain(|_, t| t.tgid != pid);
                sink(TraceEvent::Notice(format!(
                    "process {pid} is not traced again after the pause: {e:#}"
                )));
            }
        }
        if self.threads.is_empty() {
            // Every process ended meanwhile.
            self.exit = self.launched_exit();
            return Ok(());
        }
        self.stop_all(sink)?;
        let live: Vec<i32> = self.procs.keys().copied().collect();
        for pid in live {
            match self.install(pid, false, sink) {
                Ok(true) => {}
                Ok(false) => sink(TraceEvent::Notice(format!(
                    "process {pid}: its probes were not found again after the pause"
                ))),
                Err(e) => sink(TraceEvent::Notice(format!(
                    "process {pid}: probes not installed again after the pause: {e:#}"
                ))),
            }
        }
        self.resume_all();
        Ok(())
    }
}
