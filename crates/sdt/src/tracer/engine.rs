//! The ptrace engine: seize a process (or start one), install probes, catch every hit,
//! follow threads, forks and execs, and leave the target as it found it.
//!
//! All ptrace requests and waits happen on the thread that created the engine:
//! ptrace belongs to a thread, not a process.
//!
//! Here: attaching, launching, the event loop and leaving. Beside it: `threads`
//! (thread states, stopping and resuming), `children` (clone, fork, vfork, exec),
//! `hits` (installing probes, catching `int3` hits), `sampling` (ticks) and
//! `interface` (what the caller sees); the ring's and the budget's sides of the
//! engine are in `tracer::ring_engine` and `tracer::budget`.

use std::ffi::CString;

use anyhow::{anyhow, bail, Context, Result};
use nix::errno::Errno;
use nix::sys::ptrace::{self, Event, Options};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use rustc_hash::FxHashMap;

use crate::process::memory::ProcessMemory;
use crate::process::status::{tgid_of, thread_ids};

use super::budget::BudgetBook;
use super::clock::monotonic_ns;
use super::decode::HitBuffers;
use super::guardian::Guardian;
use super::patch::Patches;
use super::ring_engine::setup::RingProc;
use super::ring_engine::RingBook;
use super::safety_net::{self, SafetyNet};
use super::signals::{
    arm_tick, disarm_tick, jitter, stop_requested, take_tick, until_deadline_ns, StopReason,
};

mod affinity;
mod children;
mod hits;
mod interface;
mod pausing;
mod sampling;
pub mod source;
mod threads;
mod yielding;

pub use super::budget::BudgetSummary;
pub use super::ring_engine::RingUse;
use children::PendingChild;
pub use interface::{
    EngineOptions, Hit, NotTraceable, Outcome, RepeatSlot, Resolver, ReturnRow, ThinLevel,
    TraceEvent,
};
pub use pausing::PauseCause;
use source::EventSource;
use threads::is_stop_signal;
pub(in crate::tracer) use threads::{StopKind, Thread, ThreadState};

#[derive(Debug)]
pub(super) struct Proc {
    pub(super) mem: ProcessMemory,
    pub(super) patches: Patches,
    /// The object with the probes is not mapped yet: resume with PTRACE_SYSCALL and
    /// look again after each `mmap`.
    pub(super) awaiting_object: bool,
    pub(super) last_maps_len: usize,
    /// The SIGTRAP safety net installed in this image (see `safety_net`).
    pub(super) net: Option<SafetyNet>,
    /// Probes were installed at a stop where injecting is unsafe (a system call
    /// stop): install the net at the next hit, a clean stop.
    pub(super) net_pending: bool,
    /// The ring engine serving some of this image's sites.
    pub(super) ring: Option<RingProc>,
    /// Its sites move to the ring at the next turn of the event loop.
    pub(super) ring_pending: bool,
    /// A vfork child before its exec: the memory is its parent's, and so are the
    /// patches in it (never written, budgeted or undone through this process).
    pub(super) shares_parent_memory: bool,
}

impl Proc {
    pub(super) fn new(pid: i32) -> Proc {
        Proc {
            mem: ProcessMemory::new(pid),
            patches: Patches::default(),
            awaiting_object: false,
            last_maps_len: 0,
            net: None,
            net_pending: false,
            ring: None,
            ring_pending: false,
            shares_parent_memory: false,
        }
    }
}

pub struct Engine {
    pub(super) root: i32,
    /// pyprobe started the root process itself (`record -- CMD`).
    pub(super) launched: bool,
    /// Undoes the patches if pyprobe dies without detaching (see `guardian`).
    pub(super) guardian: Option<Guardian>,
    /// Keyed by kernel ids (never by bytes from a target): a fast hash, looked up
    /// several times per `int3` hit.
    pub(super) threads: FxHashMap<i32, Thread>,
    pub(super) procs: FxHashMap<i32, Proc>,
    pub(super) resolver: Box<dyn Resolver>,
    pub(super) options: EngineOptions,
    pub(super) pending_children: FxHashMap<i32, PendingChild>,
    pub(super) early_children: Vec<i32>,
    /// Children traced since attach (`--subprocesses -p`), said when the run
    /// begins: the recording is opened only once `attach` has returned.
    pub(super) children_to_announce: Vec<(i32, i32, u64)>,
    pub(super) exit: Option<Outcome>,
    pub(super) detached: bool,
    pub(super) hits: u64,
    pub(super) hit_buffers: HitBuffers,
    /// The overhead budget and what it turned off.
    pub(super) budget: BudgetBook,
    pub(super) ring_book: RingBook,
    /// pyprobe's tracing thread following the CPU of the threads that hit `int3`.
    pub(super) cpu: affinity::CpuFollow,
    /// Events beside the probes (the injected hook engine), if the resolver
    /// gave a source.
    pub(super) source: Option<Box<dyn EventSource>>,
    /// An error met while handling an event that must end the run.
    pub(super) fatal: Option<anyhow::Error>,
    /// When the last sampling tick was due (0 before the first).
    next_tick_ns: u64,
    /// A pause asked for, made as soon as the target can be attached to again.
    pub(super) pause_pending: Option<PauseCause>,
}

/// What [`Engine::wait_one`] found.
#[derive(Debug, PartialEq, Eq)]
enum Waited {
    /// A status, handled.
    Handled,
    /// Nothing to wait for now (polling only).
    Nothing,
    /// A signal to pyprobe cut the wait short.
    Interrupted,
    /// No traced thread is left.
    NoChildren,
}

/// How long the event loop sleeps when the rings and the waits are both empty.
const RING_POLL_US: u64 = 200;

/// The timer's beat when nothing is sampled: the longest a stop request that
/// raced the loop's `waitpid` waits to be seen.
const IDLE_BEAT_NS: u64 = 100_000_000;

fn trace_options() -> Options {
    Options::PTRACE_O_TRACECLONE
        | Options::PTRACE_O_TRACEFORK
        | Options::PTRACE_O_TRACEVFORK
        | Options::PTRACE_O_TRACEEXEC
        | Options::PTRACE_O_TRACEEXIT
        | Options::PTRACE_O_TRACESYSGOOD
}

impl Engine {
    pub(super) fn new(
        root: i32,
        mut resolver: Box<dyn Resolver>,
        options: EngineOptions,
    ) -> Engine {
        let source = resolver.event_source();
        Engine {
            root,
            launched: false,
            guardian: None,
            threads: FxHashMap::default(),
            procs: FxHashMap::default(),
            resolver,
            options,
            pending_children: FxHashMap::default(),
            early_children: Vec::new(),
            children_to_announce: Vec::new(),
            exit: None,
            detached: false,
            hits: 0,
            hit_buffers: HitBuffers::default(),
            budget: BudgetBook::new(options.max_overhead),
            ring_book: RingBook::default(),
            cpu: affinity::CpuFollow::default(),
            source,
            fatal: None,
            next_tick_ns: 0,
            pause_pending: None,
        }
    }

    /// Forgets every thread and process after [`Engine::release_target`], keeping
    /// the guardian, the options and the clocks, to attach again.
    pub(super) fn reset_for_attach(&mut self) {
        self.detached = false;
        self.threads.clear();
        self.procs.clear();
        self.pending_children.clear();
        self.early_children.clear();
        self.exit = None;
        self.fatal = None;
        let tsc = self.ring_book.tsc.take();
        self.ring_book = RingBook::default();
        self.ring_book.tsc = tsc;
        if let Some(source) = self.source.as_mut() {
            source.reset();
        }
    }

    pub fn root(&self) -> i32 {
        self.root
    }

    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Seizes every thread of `pid`, stops them, installs the probes and lets them run.
    pub fn attach(
        pid: i32,
        resolver: Box<dyn Resolver>,
        options: EngineOptions,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<Engine> {
        let mut engine = Engine::new(pid, resolver, options);
        if options.guardian {
            engine.guardian = Some(Guardian::spawn()?);
        }
        engine.procs.insert(pid, Proc::new(pid));
        engine.seize_process(pid)?;
        if engine.threads.is_empty() {
            bail!("process {pid} exited while pyprobe was attaching");
        }
        let children = if options.subprocesses {
            engine.seize_existing_children(pid, sink)
        } else {
            Vec::new()
        };
        engine.stop_all(sink)?;
        if engine.threads.values().all(|t| {
            matches!(
                t.state,
                ThreadState::Stopped {
                    kind: StopKind::Group,
                    ..
                }
            )
        }) {
            sink(TraceEvent::Notice(format!(
                "process {pid} is stopped (SIGSTOP or Ctrl-Z): it stays stopped, and events come \
                 once it is continued (SIGCONT)"
            )));
        }
        let installed = engine.install(pid, false, sink);
        if let Err(e) = installed.and_then(|found| {
            if found {
                Ok(())
            } else {
                Err(anyhow!("no probes found"))
            }
        }) {
            engine.detach_all(sink);
            // Its probes vanish with it: an exit is what to say, not the missing probes.
            if crate::process::status::process_is_ending(pid) {
                bail!("process {pid} exited while pyprobe was attaching");
            }
            return Err(e.context(format!("cannot install probes in process {pid}")));
        }
        engine.install_existing_children(children, sink);
        engine.resume_all();
        Ok(engine)
    }

    /// Seizes every thread of process `pid` (left running), until its thread list
    /// is stable: a thread created by a not yet seized thread would otherwise escape.
    pub(super) fn seize_process(&mut self, pid: i32) -> Result<()> {
        let mut ending = Vec::new();
        loop {
            let tids = thread_ids(pid)
                .with_context(|| format!("process {pid} vanished while attaching"))?;
            let new: Vec<i32> = tids
                .into_iter()
                .filter(|t| !self.threads.contains_key(t) && !ending.contains(t))
                .collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                match ptrace::seize(Pid::from_raw(tid), trace_options()) {
                    Ok(()) => {
                        self.threads.insert(
                            tid,
                            Thread {
                                tgid: pid,
                                state: ThreadState::Running,
                            },
                        );
                    }
                    Err(Errno::ESRCH) => continue, // ended meanwhile
                    // Any thread but the leader: the task list is in tid order, and
                    // after pid wrap-around a new thread may sort before the leader.
                    Err(Errno::EPERM) if tid != pid => {
                        if crate::process::status::traced_by_us(tid) {
                            // Created by a thread seized already: traced from birth
                            // (PTRACE_O_TRACECLONE); its first stop is on its way.
                            self.threads.insert(
                                tid,
                                Thread {
                                    tgid: pid,
                                    state: ThreadState::New,
                                },
                            );
                        } else if crate::process::status::thread_is_ending(tid) {
                            ending.push(tid); // nothing left of it to trace
                        } else {
                            bail!("cannot seize thread {tid} of process {pid}: EPERM");
                        }
                    }
                    Err(e) if self.threads.is_empty() => {
                        return Err(crate::process::access::seize_error(pid, e))
                    }
                    Err(e) => bail!("cannot seize thread {tid} of process {pid}: {e}"),
                }
            }
        }
        Ok(())
    }

    /// Starts `command` as a traced child, stopped before it runs a single
    /// instruction of the new program; the probes are installed as soon as the object
    /// carrying them is mapped.
    pub fn launch(
        command: &[String],
        resolver: Box<dyn Resolver>,
        options: EngineOptions,
        _sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<Engine> {
        let program = command
            .first()
            .ok_or_else(|| anyhow!("no command given after `--`"))?;
        let resolved = super::launch::find_program(program)?;
        let argv: Vec<CString> = command
            .iter()
            .map(|a| CString::new(a.as_bytes()))
            .collect::<Result<_, _>>()
            .context("a command argument contains a NUL byte")?;
        let path = CString::new(resolved.as_os_str().as_encoded_bytes())
            .context("program path has a NUL byte")?;
        let guardian = if options.guardian {
            Some(Guardian::spawn()?)
        } else {
            None
        };
        let child = super::launch::spawn_stopped(&path, &argv)?;
        let pid = child.as_raw();
        if let Err(e) = ptrace::seize(child, trace_options()) {
            let error = crate::process::access::seize_error(pid, e);
            // Never leave the forked command stopped before its exec: it would stay
            // stopped for ever, holding pyprobe's pipes.
            let _ = kill(child, Signal::SIGKILL);
            let _ = waitpid(child, None);
            return Err(error);
        }
        let mut engine = Engine::new(pid, resolver, options);
        engine.launched = true;
        engine.guardian = guardian;
        engine.procs.insert(pid, Proc::new(pid));
        engine.threads.insert(
            pid,
            Thread {
                tgid: pid,
                state: ThreadState::Running,
            },
        );
        // It stopped itself with SIGSTOP before exec; let it go on to exec.
        kill(child, Signal::SIGCONT).context("cannot continue the started command")?;
        Ok(engine)
    }

    /// Runs until the target exits or pyprobe is asked to stop; then leaves cleanly.
    pub fn run(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<Outcome> {
        for (pid, parent, ts_ns) in std::mem::take(&mut self.children_to_announce) {
            sink(TraceEvent::ProcessStart { pid, parent, ts_ns });
        }
        let result = self.event_loop(sink);
        // What follows (detaching, then the views) needs no tick.
        if super::signals::installed() {
            disarm_tick();
        }
        if let Err(e) = &result {
            if self.launched && e.downcast_ref::<NotTraceable>().is_some() {
                // The command pyprobe started was refused before it ran any code of
                // its own: it does not run untraced behind the user's back.
                let _ = kill(Pid::from_raw(self.root), Signal::SIGKILL);
            }
        }
        self.detach_all(sink);
        result?;
        Ok(self.exit.unwrap_or(Outcome::Detached(StopReason::Internal)))
    }

    pub(super) fn event_loop(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        self.arm_next_tick();
        loop {
            super::ring_engine::heartbeat::note_progress();
            if let Some(reason) = stop_requested() {
                self.exit = Some(Outcome::Detached(reason));
                return Ok(());
            }
            if let Some(cause) = self.pause_wanted() {
                self.pause(cause, sink)?;
                if self.exit.is_some() {
                    return Ok(());
                }
                continue;
            }
            if self.threads.is_empty() {
                return Ok(());
            }
            if take_tick() {
                self.on_tick(sink)?;
                self.arm_next_tick();
                continue;
            }
            if let Some(e) = self.fatal.take() {
                return Err(e);
            }
            if self.ring_active() || self.source_active() {
                // Hits arrive in the rings without a stop: poll them and the waits.
                let drained = self.drain_rings(sink) + self.drain_source(sink);
                self.ring_backlog(sink);
                // Also with nothing drained: events counted in the ring, not
                // recorded, are what a storm's budget is judged on.
                self.poll_budget(sink);
                match self.wait_one(true, sink)? {
                    Waited::Nothing if drained == 0 => {
                        if self.ring_busy() {
                            std::thread::yield_now();
                        } else {
                            super::signals::nap(RING_POLL_US);
                        }
                    }
                    Waited::NoChildren => return Ok(()),
                    Waited::Nothing | Waited::Handled | Waited::Interrupted => {}
                }
                continue;
            }
            if self.wait_one(false, sink)? == Waited::NoChildren {
                return Ok(());
            }
        }
    }

    /// Takes one wait status of any traced thread (`poll`: without blocking) and
    /// handles it.
    fn wait_one(&mut self, poll: bool, sink: &mut dyn FnMut(TraceEvent)) -> Result<Waited> {
        let flags = if poll {
            WaitPidFlag::__WALL | WaitPidFlag::WNOHANG
        } else {
            WaitPidFlag::__WALL
        };
        match waitpid(None, Some(flags)) {
            Ok(WaitStatus::StillAlive) if poll => Ok(Waited::Nothing),
            Ok(status) => {
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

    /// Arms the timer: the next sample, the `--duration` deadline, or else a slow
    /// beat that bounds how long a signal landing just before a blocking `waitpid`
    /// (Ctrl-C, SIGTERM, Ctrl-Z) can go unseen while the target makes no stop.
    pub(super) fn arm_next_tick(&mut self) {
        if let Some(interval) = self.options.sample_interval_ns {
            // Ticks keep to their schedule, not to the end of the last sample: the
            // rate asked for is the rate taken, and samples × interval the time a
            // view shows (timed from each sample's end, 10 kHz gave 5 kHz). A
            // sample longer than the interval is followed by the next at once; one
            // more behind than that skips the ticks missed rather than burst.
            // (The first tick, after 0, is so far behind that it starts afresh.)
            let now = monotonic_ns();
            let mut due = self.next_tick_ns + jitter(interval, 50);
            if due.saturating_add(interval) < now {
                due = now + jitter(interval, 50);
            }
            self.next_tick_ns = due;
            arm_tick(due.saturating_sub(now), interval);
        } else if let Some(left) = until_deadline_ns() {
            // Wake up for the deadline even when the target is idle.
            arm_tick(left.min(IDLE_BEAT_NS), IDLE_BEAT_NS);
        } else if super::signals::installed() {
            // Without pyprobe's handlers there is no signal to wait for, and an
            // alarm would end the process.
            arm_tick(IDLE_BEAT_NS, IDLE_BEAT_NS);
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

    /// Stops every thread, restores every byte and semaphore, and detaches, delivering
    /// any signal a thread was stopped with; then lets the guardian go.
    pub fn detach_all(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
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
