//! The engine's threads: the stop each one is in, stopping and resuming them (one at
//! a time or every one), finding one where system calls may be injected, and a
//! thread's end.

use anyhow::{bail, Result};
use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use rustc_hash::FxHashMap;

use crate::process::status::sigtrap_pending;

use crate::tracer::clock::monotonic_ns;
use crate::tracer::guardian::Op;

use super::{Engine, Outcome, TraceEvent};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::tracer) enum ThreadState {
    /// Seized, its first stop not seen yet.
    New,
    Running,
    /// In a ptrace-stop that pyprobe holds; `pending` is a signal to deliver on resume.
    Stopped {
        pending: Option<Signal>,
        kind: StopKind,
    },
    /// In group-stop, parked with PTRACE_LISTEN.
    Listening,
    /// Exited, not reaped yet: an exited thread-group leader stays a zombie until
    /// its other threads are gone. Nothing to stop, nothing to resume.
    Zombie,
}

/// Where in the kernel a held thread is stopped, which decides what pyprobe may do
/// with it (see `inject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::tracer) enum StopKind {
    /// pyprobe's interrupt, or a new thread's first stop: in the signal path.
    Interrupt,
    /// A signal-delivery stop: a hit pyprobe swallows, or a signal for the program.
    Signal,
    /// The program is stopped (SIGSTOP, Ctrl-Z): resumed with PTRACE_LISTEN, so it
    /// stays stopped as it would without pyprobe.
    Group,
    /// Inside a system call (clone, fork, exec events; system call stops): its result
    /// is not written yet, so nothing may be injected here.
    InSyscall,
    /// A vfork parent: resumed, it waits in the kernel until its child execs.
    Vfork,
    /// On its way out (PTRACE_EVENT_EXIT): nothing may be injected, it will not
    /// return to the program.
    Exiting,
}

#[derive(Debug)]
pub(in crate::tracer) struct Thread {
    pub(in crate::tracer) tgid: i32,
    pub(in crate::tracer) state: ThreadState,
}

pub(super) fn is_stop_signal(sig: Signal) -> bool {
    matches!(
        sig,
        Signal::SIGSTOP | Signal::SIGTSTP | Signal::SIGTTIN | Signal::SIGTTOU
    )
}

/// Whether `tid` is stopped at the entry of a system call (PTRACE_GET_SYSCALL_INFO).
pub(in crate::tracer) fn at_syscall_entry(tid: i32) -> bool {
    const PTRACE_GET_SYSCALL_INFO: libc::c_uint = 0x420e;
    const PTRACE_SYSCALL_INFO_ENTRY: u8 = 1;
    let mut info = [0u8; 88];
    // SAFETY: the kernel writes at most `info.len()` bytes into the buffer.
    let n = unsafe { libc::ptrace(PTRACE_GET_SYSCALL_INFO, tid, info.len(), info.as_mut_ptr()) };
    n > 0 && info[0] == PTRACE_SYSCALL_INFO_ENTRY
}

impl Engine {
    pub(in crate::tracer) fn set_state(&mut self, tid: i32, state: ThreadState) {
        if let Some(t) = self.threads.get_mut(&tid) {
            t.state = state;
        }
    }
    /// Records the stop `tid` is in, and resumes it unless `holding`.
    pub(in crate::tracer) fn resume_or_hold(
        &mut self,
        tid: i32,
        signal: Option<Signal>,
        kind: StopKind,
        holding: bool,
    ) {
        self.set_state(
            tid,
            ThreadState::Stopped {
                pending: signal,
                kind,
            },
        );
        if !holding {
            self.resume(tid, signal);
        }
    }
    pub(in crate::tracer) fn resume(&mut self, tid: i32, signal: Option<Signal>) {
        let group_stopped = self.threads.get(&tid).is_some_and(|t| {
            matches!(
                t.state,
                ThreadState::Stopped {
                    kind: StopKind::Group,
                    ..
                }
            )
        });
        if group_stopped {
            // Still stopped as the program's job control wants; events keep coming.
            // SAFETY: PTRACE_LISTEN takes no pointers. Only for a thread held at a
            // group-stop (StopKind::Group): the one resume that leaves it stopped as
            // job control wants, while its events still reach pyprobe. The kernel
            // accepts it only at a PTRACE_EVENT_STOP; if it refuses, the thread is
            // resumed below.
            if unsafe { libc::ptrace(libc::PTRACE_LISTEN, tid, 0, 0) } == 0 {
                self.set_state(tid, ThreadState::Listening);
                return;
            }
        }
        // Stops at system calls: the interpreter's object, or its thread state for
        // the hook, is looked for at each.
        let at_syscalls = self.threads.get(&tid).is_some_and(|t| {
            self.procs.get(&t.tgid).is_some_and(|p| p.awaiting_object) || self.source_awaits(t.tgid)
        });
        let pid = Pid::from_raw(tid);
        let _ = if at_syscalls {
            ptrace::syscall(pid, signal)
        } else {
            ptrace::cont(pid, signal)
        };
        self.set_state(tid, ThreadState::Running);
    }
    pub(in crate::tracer) fn thread_gone(
        &mut self,
        tid: i32,
        how: Outcome,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        if !self.threads.contains_key(&tid) {
            return;
        }
        // What the thread (or its process, whose ring goes with it) published
        // before it went is recorded before its end.
        let tgid = self.threads.get(&tid).map_or(tid, |t| t.tgid);
        self.drain_ring_of(tgid, sink);
        self.drain_source_of(tgid, sink);
        let Some(thread) = self.threads.remove(&tid) else {
            return;
        };
        self.budget.resumed_ns.remove(&tid);
        if tid == thread.tgid {
            self.say_unhooked(tid, sink);
        }
        sink(TraceEvent::ThreadExit {
            pid: thread.tgid,
            tid,
            ts_ns: monotonic_ns(),
        });
        if tid == thread.tgid {
            if tid == self.root {
                self.exit = Some(how);
            } else if let Outcome::Killed(sig) = how {
                // A crash is said (a pool's workers ended with SIGTERM are not).
                if matches!(
                    sig,
                    Signal::SIGSEGV
                        | Signal::SIGBUS
                        | Signal::SIGILL
                        | Signal::SIGTRAP
                        | Signal::SIGABRT
                        | Signal::SIGFPE
                        | Signal::SIGSYS
                ) {
                    sink(TraceEvent::Notice(format!(
                        "process {tid} was killed by {sig}"
                    )));
                }
            }
            self.say_ring_waited(tid, sink);
            self.procs.remove(&tid);
            self.source_image_gone(tid, sink);
            if let Some(g) = self.guardian.as_mut() {
                let _ = g.tell(Op::Forget, tid, 0);
            }
            // Exited leader: the rest of its threads are gone with it.
            self.threads.retain(|_, t| t.tgid != tid);
        }
    }
    /// Whether pyprobe holds every thread of process `pid` stopped.
    pub(in crate::tracer) fn all_threads_held(&self, pid: i32) -> bool {
        self.threads
            .values()
            .filter(|t| t.tgid == pid)
            .all(|t| matches!(t.state, ThreadState::Stopped { .. }))
    }
    /// A thread of `pid` held at a stop where a system call can be injected (see
    /// `inject`): one already there, else one brought there from a stop inside a
    /// system call (it finishes the call and stops again before running any code of
    /// its own). `None` when no thread of it gets there.
    pub(in crate::tracer) fn clean_thread(
        &mut self,
        pid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Option<i32> {
        let rank = |state: ThreadState| match state {
            ThreadState::Stopped {
                pending: None,
                kind,
            } => match kind {
                StopKind::Interrupt => Some(0),
                StopKind::Signal => Some(1),
                StopKind::Group => Some(2),
                StopKind::InSyscall | StopKind::Vfork | StopKind::Exiting => None,
            },
            _ => None,
        };
        let ready = self
            .threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .filter_map(|(&tid, t)| rank(t.state).map(|r| (r, tid)))
            .min();
        if let Some((_, tid)) = ready {
            return Some(tid);
        }
        let mut candidates: Vec<(u8, i32)> = self
            .threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .filter_map(|(&tid, t)| match t.state {
                ThreadState::Stopped {
                    kind: StopKind::InSyscall,
                    ..
                } => Some((0, tid)),
                ThreadState::Stopped {
                    pending: Some(_),
                    kind: StopKind::Signal,
                } => Some((1, tid)),
                _ => None,
            })
            .collect();
        candidates.sort_unstable();
        candidates
            .into_iter()
            .take(4)
            .find_map(|(_, tid)| self.bring_to_clean_stop(tid, sink))
    }
    /// Lets held thread `tid` leave its stop and stop again at once on its way out
    /// of the kernel (an interrupt queued before resuming is taken before any code
    /// of the program runs).
    pub(in crate::tracer) fn bring_to_clean_stop(
        &mut self,
        tid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Option<i32> {
        for _ in 0..8 {
            let pending = match self.threads.get(&tid)?.state {
                ThreadState::Stopped {
                    pending: None,
                    kind: StopKind::Interrupt | StopKind::Signal | StopKind::Group,
                } => return Some(tid),
                ThreadState::Stopped {
                    kind: StopKind::Vfork,
                    ..
                } => return None,
                ThreadState::Stopped { pending, .. } => pending,
                _ => None,
            };
            if !matches!(self.threads.get(&tid)?.state, ThreadState::Running) {
                let thread = Pid::from_raw(tid);
                ptrace::interrupt(thread).ok()?;
                ptrace::cont(thread, pending).ok()?;
                self.set_state(tid, ThreadState::Running);
            }
            match wait_for_thread(tgid_of_thread(&self.threads, tid), tid) {
                Ok(status) => self.handle(status, true, sink).ok()?,
                Err(Errno::EINTR) => {}
                Err(_) => return None,
            }
        }
        None
    }
    /// Interrupts every running thread and waits until all are in a ptrace-stop.
    pub(in crate::tracer) fn stop_all(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        self.stop_threads(true, sink)
    }
    /// Like `stop_all`, but threads parked in group-stop stay parked.
    pub(in crate::tracer) fn stop_all_running(
        &mut self,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        self.stop_threads(false, sink)
    }
    /// Marks the threads `awaited` says are to stop that have exited (a zombie, or
    /// gone) as [`ThreadState::Zombie`]; returns how many.
    pub(in crate::tracer) fn mark_zombies(&mut self, awaited: impl Fn(&Thread) -> bool) -> usize {
        let mut marked = 0;
        for (&tid, thread) in self.threads.iter_mut() {
            if awaited(thread) && crate::process::status::task_gone_or_zombie(thread.tgid, tid) {
                thread.state = ThreadState::Zombie;
                marked += 1;
            }
        }
        marked
    }

    /// Resumes the threads of process `pid` that pyprobe holds.
    pub(in crate::tracer) fn resume_process(&mut self, pid: i32) {
        let stopped: Vec<(i32, Option<Signal>)> = self
            .threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .filter_map(|(&tid, t)| match t.state {
                ThreadState::Stopped { pending, .. } => Some((tid, pending)),
                _ => None,
            })
            .collect();
        for (tid, pending) in stopped {
            self.resume(tid, pending);
        }
    }
    pub(in crate::tracer) fn stop_threads(
        &mut self,
        include_listening: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        let wanted = |state: ThreadState| match state {
            ThreadState::Listening => include_listening,
            ThreadState::Stopped { .. } | ThreadState::Zombie => false,
            _ => true,
        };
        // Each thread is interrupted once: interrupting every thread still running
        // after each stop collected made stopping N threads cost N² system calls
        // (10,000 threads took longer than the 10 s allowed).
        let mut interrupted = std::collections::HashSet::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut waiting = WaitingForStops::new();
        loop {
            // Threads seen since (new ones start stopped too) are interrupted now,
            // the busy ones last (see `busy`).
            let mut due: Vec<(bool, i32)> = self
                .threads
                .iter()
                .filter(|(_, thread)| wanted(thread.state))
                .map(|(&tid, _)| (self.busy.contains(&tid), tid))
                .collect();
            if due.is_empty() {
                return Ok(());
            }
            due.sort_unstable();
            for (_, tid) in due {
                if interrupted.insert(tid) {
                    let _ = ptrace::interrupt(Pid::from_raw(tid));
                }
            }
            // Every stop reported by now, then a look at who is left.
            let awaited = |t: &Thread| wanted(t.state);
            let alive =
                self.collect_stops(&mut waiting, &awaited, deadline, |engine, status| {
                    engine.handle(status, true, sink)
                })?;
            if !alive {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!("the target's threads did not stop within 10 s");
            }
        }
    }
    /// Handles (through `on_stop`) every wait status reported by now, one poll
    /// after another, until none is left, the wait is interrupted or `deadline`
    /// passes: looking at the threads after each status instead made stopping N
    /// threads cost N² steps. `false` when no traced thread is left.
    pub(in crate::tracer) fn collect_stops(
        &mut self,
        waiting: &mut WaitingForStops,
        awaited: &dyn Fn(&Thread) -> bool,
        deadline: std::time::Instant,
        mut on_stop: impl FnMut(&mut Self, WaitStatus) -> Result<()>,
    ) -> Result<bool> {
        loop {
            match waiting.next(self, awaited) {
                Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => return Ok(true),
                Ok(status) => on_stop(self, status)?,
                Err(Errno::ECHILD) => {
                    self.threads.clear();
                    return Ok(false);
                }
                Err(e) => bail!("waitpid failed while stopping the target: {e}"),
            }
            if std::time::Instant::now() > deadline {
                return Ok(true);
            }
        }
    }

    /// A thread interrupted just as it executed an `int3` reports the interrupt
    /// first and keeps the SIGTRAP pending: after a detach nobody would catch it and
    /// it would kill the target. Let each such thread take its SIGTRAP now (a hit).
    /// A thread may first report a second, stale interrupt (`stop_all` interrupts a
    /// thread again while its first stop is not yet collected): resume it until the
    /// SIGTRAP is gone, a few rounds at most.
    pub(in crate::tracer) fn take_pending_traps(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let sites: rustc_hash::FxHashSet<u64> = self
            .procs
            .values()
            .flat_map(|p| p.patches.sites.keys().copied())
            .collect();
        // Only a thread standing just past one of pyprobe's int3s can owe it a
        // SIGTRAP: its registers are read first, as reading every thread's status
        // held a 10,000-thread target for 180 ms at detach.
        let past_a_site = |tid: i32| {
            ptrace::getregs(Pid::from_raw(tid))
                .map_or(true, |regs| sites.contains(&regs.rip.wrapping_sub(1)))
        };
        let pending: Vec<i32> = self
            .threads
            .iter()
            .filter(|(_, t)| {
                matches!(
                    t.state,
                    ThreadState::Stopped {
                        pending: None,
                        kind: StopKind::Interrupt | StopKind::Signal
                    }
                )
            })
            .map(|(&tid, _)| tid)
            .filter(|&tid| past_a_site(tid) && sigtrap_pending(tid))
            .collect();
        for tid in pending {
            for _ in 0..4 {
                let held = self.threads.get(&tid).map(|t| t.state);
                let clean = matches!(
                    held,
                    Some(ThreadState::Stopped {
                        pending: None,
                        kind: StopKind::Interrupt | StopKind::Signal
                    })
                );
                if !clean || !sigtrap_pending(tid) {
                    break;
                }
                if ptrace::cont(Pid::from_raw(tid), None).is_err() {
                    break;
                }
                self.set_state(tid, ThreadState::Running);
                while self
                    .threads
                    .get(&tid)
                    .is_some_and(|t| t.state == ThreadState::Running)
                {
                    match wait_for_thread(tgid_of_thread(&self.threads, tid), tid) {
                        Ok(status) => {
                            if self.handle(status, true, sink).is_err() {
                                break;
                            }
                        }
                        Err(Errno::EINTR) => {}
                        Err(_) => break,
                    }
                }
            }
        }
    }
    pub(in crate::tracer) fn resume_all(&mut self) {
        let mut stopped: Vec<(bool, i32, Option<Signal>)> = self
            .threads
            .iter()
            .filter_map(|(&tid, t)| match t.state {
                ThreadState::Stopped { pending, .. } => {
                    Some((!self.busy.contains(&tid), tid, pending))
                }
                _ => None,
            })
            .collect();
        // The busy threads first (see `busy`).
        stopped.sort_unstable_by_key(|&(idle, tid, _)| (idle, tid));
        for (_, tid, pending) in stopped {
            self.resume(tid, pending);
        }
    }
    /// Notes which threads the kernel shows running or runnable, read
    /// before all are stopped: stopping and resuming 10,000 threads takes 100 ms,
    /// and a busy thread stopped last and resumed first is held only for the work
    /// done while all are stopped. Idle threads stopped meanwhile were waiting anyway.
    pub(in crate::tracer) fn note_busy_threads(&mut self) {
        let threads = &self.threads;
        self.task_states.keep_only(|tid| threads.contains_key(&tid));
        let states = &mut self.task_states;
        self.busy = threads
            .iter()
            .filter(|(&tid, t)| states.state(t.tgid, tid) == Some('R'))
            .map(|(&tid, _)| tid)
            .collect();
    }
}

/// The process of thread `tid` as the engine knows it (else `tid` itself).
fn tgid_of_thread(threads: &FxHashMap<i32, Thread>, tid: i32) -> i32 {
    threads.get(&tid).map_or(tid, |t| t.tgid)
}

/// The next wait status of thread `tid` of process `pid`, never waiting for
/// ever: a thread-group leader that exits reports nothing until its other
/// threads are gone, which pyprobe may be holding. `Err(ESRCH)` once it has
/// exited without a status to report.
pub(super) fn wait_for_thread(pid: i32, tid: i32) -> nix::Result<WaitStatus> {
    let mut waiting = WaitingForStops::new();
    loop {
        let status = waitpid(
            Pid::from_raw(tid),
            Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG),
        )?;
        if status != WaitStatus::StillAlive {
            return Ok(status);
        }
        if waiting.look_due() && crate::process::status::task_gone_or_zombie(pid, tid) {
            return Err(Errno::ESRCH);
        }
        waiting.pause();
    }
}

/// Waiting for interrupted threads to stop, never for ever: the wait polls, and
/// a thread that exited instead of stopping is marked [`ThreadState::Zombie`]
/// (an exited thread-group leader reports nothing until its other threads are
/// gone, and pyprobe may be holding one of them: a blocking wait would never
/// return, and the process could never finish exiting).
pub(in crate::tracer) struct WaitingForStops {
    began: std::time::Instant,
    next_look: std::time::Instant,
    /// The threads awaited this round, polled one by one (`waitpid(TID)`, which
    /// the kernel answers at once): `waitpid(-1)` looks at every traced thread, so
    /// collecting N stops with it alone cost N² (2.5 s with 10,000 threads).
    round: Vec<i32>,
    /// The next of `round` to poll.
    at: usize,
}

/// Spun (yielding) this long before the wait sleeps between polls: a thread
/// interrupted on a CPU stops within microseconds.
const SPIN_FOR: std::time::Duration = std::time::Duration::from_micros(200);
const POLL_EVERY: std::time::Duration = std::time::Duration::from_micros(20);
/// How often threads that have not stopped are looked at for an exit (at most).
const LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(2);

impl WaitingForStops {
    pub(in crate::tracer) fn new() -> WaitingForStops {
        let now = std::time::Instant::now();
        WaitingForStops {
            began: now,
            next_look: now + LOOK_EVERY,
            round: Vec::new(),
            at: 0,
        }
    }

    /// One poll of the wait statuses: `StillAlive` when none came (after a
    /// short pause, or after marking exited threads among those `awaited`).
    /// The awaited threads are polled one by one; after each round, one
    /// `waitpid(-1)` takes whatever else was reported (a new thread, a thread not
    /// awaited), and the next round is the threads awaited then.
    pub(in crate::tracer) fn next(
        &mut self,
        engine: &mut Engine,
        awaited: impl Fn(&Thread) -> bool,
    ) -> nix::Result<WaitStatus> {
        let flags = Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG);
        while let Some(&tid) = self.round.get(self.at) {
            self.at += 1;
            if !engine.threads.get(&tid).is_some_and(&awaited) {
                continue;
            }
            match waitpid(Pid::from_raw(tid), flags) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(status) => return Ok(status),
                // Not a tracee of pyprobe's any more (gone): the look below marks it.
                Err(Errno::ECHILD) => {}
                Err(e) => return Err(e),
            }
        }
        let status = waitpid(None, flags)?;
        self.round.clear();
        self.round.extend(
            engine
                .threads
                .iter()
                .filter(|(_, t)| awaited(t))
                .map(|(&tid, _)| tid),
        );
        self.at = 0;
        if status != WaitStatus::StillAlive {
            return Ok(status);
        }
        let now = std::time::Instant::now();
        if now >= self.next_look {
            let marked = engine.mark_zombies(awaited);
            // A look reads a /proc file per awaited thread: with thousands of
            // threads it is no longer cheap, so it takes at most a tenth of the wait.
            let took = now.elapsed();
            self.next_look = std::time::Instant::now() + LOOK_EVERY.max(took * 9);
            if marked > 0 {
                return Ok(status);
            }
        }
        self.pause();
        Ok(status)
    }

    /// Whether it is time to look at one thread not stopped yet for an exit
    /// (every [`LOOK_EVERY`]).
    fn look_due(&mut self) -> bool {
        let now = std::time::Instant::now();
        if now < self.next_look {
            return false;
        }
        self.next_look = now + LOOK_EVERY;
        true
    }

    /// Between two polls: a yield while a stop is still due any moment, a short
    /// sleep after.
    fn pause(&self) {
        if self.began.elapsed() < SPIN_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep(POLL_EVERY);
        }
    }
}
