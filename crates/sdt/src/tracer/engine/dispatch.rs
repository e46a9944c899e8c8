//! Waiting for the traced threads and handling what a wait returns: exits, signal
//! stops, system-call stops and ptrace events. Apart from the event loop, which
//! decides when to wait; this is what each status means.

use anyhow::{bail, Result};
use nix::errno::Errno;
use nix::sys::ptrace::Event;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};

use crate::process::status::tgid_of;
use crate::tracer::clock::monotonic_ns;

use super::threads::is_stop_signal;
use super::{Engine, Outcome, StopKind, Thread, ThreadState, TraceEvent};

/// What [`Engine::wait_one`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Waited {
    /// A status, handled.
    Handled,
    /// Nothing to wait for now (polling only).
    Nothing,
    /// A signal to pyprobe cut the wait short.
    Interrupted,
    /// No traced thread is left.
    NoChildren,
}

impl Engine {
    /// Takes one wait status of any traced thread (`poll`: without blocking) and
    /// handles it.
    pub(super) fn wait_one(
        &mut self,
        poll: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<Waited> {
        let flags = if poll {
            WaitPidFlag::__WALL | WaitPidFlag::WNOHANG
        } else {
            WaitPidFlag::__WALL
        };
        match waitpid(None, Some(flags)) {
            Ok(WaitStatus::StillAlive) if poll => Ok(Waited::Nothing),
            Ok(status) => {
                self.note_stop();
                if self.budget.meter.is_some() {
                    self.budget.last_wait_ns = monotonic_ns();
                }
                self.handle(status, false, sink)?;
                Ok(Waited::Handled)
            }
            Err(Errno::EINTR) => Ok(Waited::Interrupted),
            Err(Errno::ECHILD) => Ok(Waited::NoChildren),
            Err(e) => bail!("waitpid failed: {e}"),
        }
    }

    /// Handles one wait status. While `holding` (stopping everyone), stopped threads
    /// are kept stopped instead of resumed.
    pub(super) fn handle(
        &mut self,
        status: WaitStatus,
        holding: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        match status {
            WaitStatus::Exited(pid, code) => {
                self.thread_gone(pid.as_raw(), Outcome::Exited(code), sink)
            }
            WaitStatus::Signaled(pid, sig, _) => {
                self.thread_gone(pid.as_raw(), Outcome::Killed(sig), sink)
            }
            WaitStatus::Stopped(pid, Signal::SIGTRAP) => {
                let tid = pid.as_raw();
                if self.try_hit(tid, sink) {
                    if holding || self.budget.meter.is_none() {
                        self.resume_or_hold(tid, None, StopKind::Signal, holding);
                    } else {
                        self.resume_after_budgeted_hit(tid, sink);
                    }
                } else {
                    // A SIGTRAP that is not ours belongs to the target.
                    self.resume_or_hold(tid, Some(Signal::SIGTRAP), StopKind::Signal, holding);
                }
            }
            WaitStatus::Stopped(pid, sig) => {
                self.resume_or_hold(pid.as_raw(), Some(sig), StopKind::Signal, holding)
            }
            WaitStatus::PtraceSyscall(pid) => {
                let tid = pid.as_raw();
                self.set_state(
                    tid,
                    ThreadState::Stopped {
                        pending: None,
                        kind: StopKind::InSyscall,
                    },
                );
                self.check_awaited_object(tid, sink);
                self.source_at_syscall(tid, holding, sink);
                self.resume_or_hold(tid, None, StopKind::InSyscall, holding);
            }
            WaitStatus::PtraceEvent(pid, sig, event) => {
                self.handle_event(pid.as_raw(), sig, event, holding, sink)?
            }
            WaitStatus::Continued(_) | WaitStatus::StillAlive => {}
        }
        Ok(())
    }

    pub(super) fn handle_event(
        &mut self,
        tid: i32,
        sig: Signal,
        event: i32,
        holding: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        const CLONE: i32 = Event::PTRACE_EVENT_CLONE as i32;
        const FORK: i32 = Event::PTRACE_EVENT_FORK as i32;
        const VFORK: i32 = Event::PTRACE_EVENT_VFORK as i32;
        const EXEC: i32 = Event::PTRACE_EVENT_EXEC as i32;
        const STOP: i32 = Event::PTRACE_EVENT_STOP as i32;
        const EXIT: i32 = Event::PTRACE_EVENT_EXIT as i32;
        match event {
            CLONE | FORK | VFORK => self.on_new_task(tid, event, holding, sink),
            EXEC => self.on_exec(tid, holding, sink),
            STOP => self.handle_stop_event(tid, sig, holding, sink),
            EXIT => {
                // The process's memory is still there: what its ring holds is read
                // and named now, not after the process is gone (stacks captured in
                // the target are named by reading their code objects).
                crate::tracer::test_switches::release_rings();
                while self.drain_rings(sink) > 0 {}
                let tgid = self.threads.get(&tid).map_or(tid, |t| t.tgid);
                while self.drain_source_of(tgid, sink) > 0 {}
                self.resume_or_hold(tid, None, StopKind::Exiting, holding);
            }
            _ => self.resume_or_hold(tid, None, StopKind::InSyscall, holding),
        }
        Ok(())
    }

    pub(super) fn handle_stop_event(
        &mut self,
        tid: i32,
        sig: Signal,
        holding: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(thread) = self.threads.get(&tid) else {
            // A new task whose creator's event has not been seen yet.
            match tgid_of(tid) {
                Some(g) if self.procs.contains_key(&g) && g != tid => {
                    self.threads.insert(
                        tid,
                        Thread {
                            tgid: g,
                            state: ThreadState::Running,
                        },
                    );
                    sink(TraceEvent::ThreadStart {
                        pid: g,
                        tid,
                        ts_ns: monotonic_ns(),
                    });
                    self.ring_thread_started(tid);
                    let hold = self.source_thread_started(tid);
                    self.resume_or_hold(tid, None, StopKind::Interrupt, holding || hold);
                }
                _ => match self.pending_children.get(&tid).copied() {
                    Some(pending) => self.adopt_child(tid, pending, sink),
                    None => self.early_children.push(tid),
                },
            }
            return;
        };
        if thread.state == ThreadState::New {
            self.ring_thread_started(tid);
            let hold = self.source_thread_started(tid);
            self.set_state(tid, ThreadState::Running);
            self.resume_or_hold(tid, None, StopKind::Interrupt, holding || hold);
            return;
        }
        // Under PTRACE_SEIZE a group-stop is a PTRACE_EVENT_STOP carrying the stop
        // signal (interrupts and new threads carry SIGTRAP); its siginfo is readable
        // (si_code = signal | PTRACE_EVENT_STOP << 8), so no EINVAL test here.
        if is_stop_signal(sig) {
            // Group-stop (the target was stopped, e.g. Ctrl-Z): stay stopped like an
            // untraced process would, but keep receiving events.
            self.resume_or_hold(tid, None, StopKind::Group, holding);
            return;
        }
        // Our own PTRACE_INTERRUPT (or a stop pyprobe need not act on).
        self.resume_or_hold(tid, None, StopKind::Interrupt, holding);
    }
}
