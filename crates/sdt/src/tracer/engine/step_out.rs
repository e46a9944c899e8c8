//! Letting threads held inside pyprobe's trampolines finish them before pyprobe
//! leaves. A thread stopped halfway through one has reserved its record's slots
//! but not published them: once the ring is left, nobody reads that record (a
//! stack-capturing audit trampoline is long enough that an audit storm lost one
//! at nearly every short detach). Stepped one instruction at a time, the thread
//! publishes its record and jumps back into the program's code, where it stays
//! held like the others.

use std::ops::Range;

use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::WaitStatus;
use nix::unistd::Pid;

use super::threads::wait_for_thread;
use super::{Engine, StopKind, ThreadState, TraceEvent};

/// Most instructions stepped in one go, over all threads: a trampoline runs a few
/// hundred (one capturing a stack, a few thousand). A thread still inside after
/// that (waiting for room in a full ring) is left there: its record is counted lost.
const MAX_STEPS: u32 = 50_000;

impl Engine {
    /// Steps each held thread of `pid` that stands inside `code` out of it.
    pub(in crate::tracer) fn step_out_of(
        &mut self,
        pid: i32,
        code: &[Range<u64>],
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let inside = |rip: u64| code.iter().any(|r| r.contains(&rip));
        let held: Vec<i32> = self
            .threads
            .iter()
            .filter(|(_, t)| {
                t.tgid == pid
                    && matches!(
                        t.state,
                        ThreadState::Stopped {
                            pending: None,
                            kind: StopKind::Interrupt | StopKind::Signal
                        }
                    )
            })
            .map(|(&tid, _)| tid)
            .collect();
        let mut steps_left = MAX_STEPS;
        for tid in held {
            let thread = Pid::from_raw(tid);
            if !ptrace::getregs(thread).is_ok_and(|regs| inside(regs.rip)) {
                continue;
            }
            while steps_left > 0 {
                steps_left -= 1;
                if ptrace::step(thread, None).is_err() {
                    break;
                }
                match wait_for_thread(pid, tid) {
                    // The step's trap: never delivered (the thread is resumed or
                    // let go without a signal).
                    Ok(WaitStatus::Stopped(_, Signal::SIGTRAP)) => self.set_state(
                        tid,
                        ThreadState::Stopped {
                            pending: None,
                            kind: StopKind::Signal,
                        },
                    ),
                    // A signal of the program's came first, or the thread ended:
                    // handled as any stop while holding (the signal is delivered
                    // when the thread is let go).
                    Ok(status) => {
                        let _ = self.handle(status, true, sink);
                        break;
                    }
                    Err(_) => break,
                }
                if !ptrace::getregs(thread).is_ok_and(|regs| inside(regs.rip)) {
                    break;
                }
            }
        }
    }
}
