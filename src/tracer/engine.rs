//! The ptrace engine: seize a process (or start one), install probes, catch every hit,
//! follow threads, forks and execs, and leave the target as it found it.
//!
//! All ptrace requests and waits happen on the thread that created the engine:
//! ptrace belongs to a thread, not a process.

use std::collections::HashMap;
use std::ffi::CString;

use anyhow::{anyhow, bail, Context, Result};
use nix::errno::Errno;
use nix::sys::ptrace::{self, Event, Options};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::process::memory::ProcessMemory;
use crate::process::status::{sigtrap_pending, tgid_of, thread_ids};

use super::budget::calibrate;
use super::budget::{Budget, KernelCost};
use super::decode::HitBuffers;
use super::guardian::{Guardian, Op};
use super::patch::{clean_copy, Patches};
use super::probes::ProbeSet;
use super::regs::Registers;
use super::ring::setup::RingProc;
use super::ring::RingBook;
use super::safety_net::{self, SafetyNet};
use super::signals::{
    arm_tick, jitter, monotonic_ns, stop_requested, take_tick, until_deadline_ns, StopReason,
};
use crate::record::ThinLevel;

pub use super::budget::BudgetSummary;
pub use super::ring::RingUse;

/// Finds the probes to trace in a process image, once the object carrying them is
/// fully mapped. `Ok(None)`: not (yet) there.
pub trait Resolver {
    fn resolve(&mut self, pid: i32) -> Result<Option<ProbeSet>>;
}

/// One probe hit, decoded.
#[derive(Debug)]
pub struct Hit<'a> {
    pub pid: i32,
    pub tid: i32,
    pub ts_ns: u64,
    pub probe: usize,
    pub probe_name: &'a str,
    pub args: &'a [u64],
    pub(super) buffers: &'a HitBuffers,
    /// The thread's stack as the ring trampoline captured it (stack probes served
    /// by the ring); `None` at an `int3` stop, where the caller can read it itself.
    pub stack: Option<&'a crate::ring::consumer::RingStack>,
    /// The thread is held at an `int3` stop for this hit (else the hit came
    /// through a ring, and the thread has gone on).
    pub stopped: bool,
}

impl<'a> Hit<'a> {
    /// The same hit, stamped at `ts_ns`.
    pub fn at(&self, ts_ns: u64) -> Hit<'a> {
        Hit {
            pid: self.pid,
            tid: self.tid,
            ts_ns,
            probe: self.probe,
            probe_name: self.probe_name,
            args: self.args,
            buffers: self.buffers,
            stack: self.stack,
            stopped: self.stopped,
        }
    }

    /// String argument `i`: the text read at its pointer (bounded), if it is a
    /// string argument and could be read.
    pub fn string(&self, i: usize) -> Option<&str> {
        self.buffers.string(i)
    }
}

/// A resolver's "this process cannot be traced as asked", found when the object
/// with its probes is mapped: a launched command ends there, before it runs.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotTraceable(pub String);

/// What the engine reports, in order.
#[derive(Debug)]
pub enum TraceEvent<'a> {
    Hit(Hit<'a>),
    /// Probes were installed in `pid` (at attach, after start-up or after an exec).
    Installed {
        pid: i32,
        sites: usize,
    },
    ThreadStart {
        pid: i32,
        tid: i32,
        ts_ns: u64,
    },
    ThreadExit {
        pid: i32,
        tid: i32,
        ts_ns: u64,
    },
    /// A forked child of traced process `parent` is traced (`--subprocesses`): a
    /// process of its own, its leader `pid` its first thread.
    ProcessStart {
        pid: i32,
        parent: i32,
        ts_ns: u64,
    },
    /// Process `pid` ran `execve`: a new program (its command line is new), the old
    /// image and every thread but the leader gone.
    Exec {
        pid: i32,
        ts_ns: u64,
    },
    /// Something the user should know (a child cleaned, a signal, a fallback ...).
    Notice(String),
    /// Over the overhead budget, GC, import and audit events go as `level` says
    /// until further notice: thinned, the sink must not read stacks at stops.
    Thinning {
        pid: i32,
        ts_ns: u64,
        level: ThinLevel,
    },
    /// `count` hits of probe `probe` of `pid` were counted in the target instead of
    /// recorded (thinned to stay within the overhead budget): no arguments, no stack.
    Counted {
        pid: i32,
        probe: usize,
        probe_name: &'a str,
        count: u64,
        ts_ns: u64,
    },
    /// One drain of `pid`'s ring is over: the hits it gave came before.
    RingDrained {
        pid: i32,
    },
    /// A site-level fact for whoever asks for details (`record -v`): how many
    /// sites went to the ring, which stay on int3 and why.
    Detail(String),
    /// A notice in two lengths: `short` says what changes for the user (e.g. how
    /// many sites are not traced), `full` also names each site and why (`-v`).
    Summarised {
        short: String,
        full: String,
    },
    /// `count` probe hits of `pid` were dropped (its ring was full).
    Lost {
        pid: i32,
        count: u64,
        ts_ns: u64,
    },
    /// Time to take a sample of process `pid`; `stopped`: every thread is held in a
    /// ptrace-stop until the sink returns. `on_cpu`: whether each of its threads was on
    /// a CPU, read from the kernel before anything was stopped (a thread missing was
    /// not readable).
    Tick {
        pid: i32,
        ts_ns: u64,
        stopped: bool,
        on_cpu: Vec<(i32, bool)>,
    },
    /// The overhead budget turned the budgeted probes on (`exact`) or off, in every
    /// traced process.
    Window {
        pid: i32,
        ts_ns: u64,
        exact: bool,
    },
}

#[derive(Debug, Clone, Copy, Default)]
pub struct EngineOptions {
    /// Trace forked children too (else they are cleaned and released).
    pub subprocesses: bool,
    /// Emit a [`TraceEvent::Tick`] about every this many ns, uniformly jittered by
    /// ±50 % so that a periodic target cannot fall into lock-step with sampling.
    pub sample_interval_ns: Option<u64>,
    /// Stop every thread during a tick (consistent stacks) instead of reading them
    /// while they run.
    pub blocking_samples: bool,
    /// Start a guardian process that undoes the patches if pyprobe is killed.
    pub guardian: bool,
    /// Slowdown allowed (0.05 for 5 %): above it the budgeted probes go off for a
    /// while (see `budget`). Ticks should be on to sample meanwhile.
    pub max_overhead: Option<f64>,
    /// Whether qualifying sites move to the ring engine (trampolines, no stop).
    pub ring: RingUse,
}

/// How the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The target process exited with this code.
    Exited(i32),
    /// The target was killed by this signal.
    Killed(Signal),
    /// pyprobe left before the target ended; the target runs on.
    Detached(StopReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ThreadState {
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
}

/// Where in the kernel a held thread is stopped, which decides what pyprobe may do
/// with it (see `inject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StopKind {
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
pub(super) struct Thread {
    pub(super) tgid: i32,
    pub(super) state: ThreadState,
}

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

/// A forked child seen by its parent's event, not yet by its own first stop, or
/// the other way round.
#[derive(Debug, Clone, Copy)]
pub(super) struct PendingChild {
    pub(super) parent: i32,
    pub(super) vfork: bool,
}

pub struct Engine {
    pub(super) root: i32,
    /// pyprobe started the root process itself (`record -- CMD`).
    pub(super) launched: bool,
    /// Undoes the patches if pyprobe dies without detaching (see `guardian`).
    pub(super) guardian: Option<Guardian>,
    pub(super) threads: HashMap<i32, Thread>,
    pub(super) procs: HashMap<i32, Proc>,
    pub(super) resolver: Box<dyn Resolver>,
    pub(super) options: EngineOptions,
    pub(super) pending_children: HashMap<i32, PendingChild>,
    pub(super) early_children: Vec<i32>,
    pub(super) exit: Option<Outcome>,
    pub(super) detached: bool,
    pub(super) hits: u64,
    pub(super) hit_buffers: HitBuffers,
    /// The overhead budget, once budgeted probes are installed.
    pub(super) budget: Option<Budget>,
    /// Ring set-up done during the current stop (not charged to the budget), and
    /// over the whole run.
    pub(super) setup_in_stop_ns: u64,
    pub(super) setup_total_ns: u64,
    /// Times counting thinned audit events proved too costly since stacks were
    /// last on.
    pub(super) uncount_strikes: u32,
    /// Events counted in the target since thinning last changed.
    pub(super) counted_since_thin: u64,
    /// Over budget: how stack probes record, and since when.
    pub(super) thin: ThinLevel,
    pub(super) thinned_at: u64,
    pub(super) kernel_cost: KernelCost,
    /// When the current wait status was collected (budget accounting).
    pub(super) last_wait_ns: u64,
    /// When each thread was last resumed after a hit (budget accounting).
    pub(super) resumed_ns: HashMap<i32, u64>,
    /// Blocking samples cost more than the budget leaves: sample without stopping.
    pub(super) samples_unblocked: bool,
    pub(super) ring_book: RingBook,
    /// An error met while handling an event that must end the run.
    pub(super) fatal: Option<anyhow::Error>,
}

/// How long the event loop sleeps when the rings and the waits are both empty.
const RING_POLL_US: u64 = 200;
/// `si_code` of a SIGTRAP raised by an `int3`.
const SI_KERNEL: i32 = 0x80;

fn trace_options() -> Options {
    Options::PTRACE_O_TRACECLONE
        | Options::PTRACE_O_TRACEFORK
        | Options::PTRACE_O_TRACEVFORK
        | Options::PTRACE_O_TRACEEXEC
        | Options::PTRACE_O_TRACEEXIT
        | Options::PTRACE_O_TRACESYSGOOD
}

fn is_stop_signal(sig: Signal) -> bool {
    matches!(
        sig,
        Signal::SIGSTOP | Signal::SIGTSTP | Signal::SIGTTIN | Signal::SIGTTOU
    )
}

/// Whether `tid` is stopped at the entry of a system call (PTRACE_GET_SYSCALL_INFO).
fn at_syscall_entry(tid: i32) -> bool {
    const PTRACE_GET_SYSCALL_INFO: libc::c_uint = 0x420e;
    const PTRACE_SYSCALL_INFO_ENTRY: u8 = 1;
    let mut info = [0u8; 88];
    // SAFETY: the kernel writes at most `info.len()` bytes into the buffer.
    let n = unsafe { libc::ptrace(PTRACE_GET_SYSCALL_INFO, tid, info.len(), info.as_mut_ptr()) };
    n > 0 && info[0] == PTRACE_SYSCALL_INFO_ENTRY
}

impl Engine {
    pub(super) fn new(root: i32, resolver: Box<dyn Resolver>, options: EngineOptions) -> Engine {
        Engine {
            root,
            launched: false,
            guardian: None,
            threads: HashMap::new(),
            procs: HashMap::new(),
            resolver,
            options,
            pending_children: HashMap::new(),
            early_children: Vec::new(),
            exit: None,
            detached: false,
            hits: 0,
            hit_buffers: HitBuffers::default(),
            budget: None,
            thin: ThinLevel::Full,
            thinned_at: 0,
            setup_in_stop_ns: 0,
            setup_total_ns: 0,
            uncount_strikes: 0,
            counted_since_thin: 0,
            // Measured before touching the target, so it pays nothing for it.
            kernel_cost: match options.max_overhead {
                Some(_) => calibrate::stop_cycle_ns()
                    .map(KernelCost::calibrated)
                    .unwrap_or_default(),
                None => KernelCost::default(),
            },
            last_wait_ns: 0,
            resumed_ns: HashMap::new(),
            samples_unblocked: false,
            ring_book: RingBook::default(),
            fatal: None,
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
        // Seize until the thread list is stable: a thread created by a not yet seized
        // thread would otherwise escape.
        let mut ending = Vec::new();
        loop {
            let tids = thread_ids(pid)
                .with_context(|| format!("process {pid} vanished while attaching"))?;
            let new: Vec<i32> = tids
                .into_iter()
                .filter(|t| !engine.threads.contains_key(t) && !ending.contains(t))
                .collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                match ptrace::seize(Pid::from_raw(tid), trace_options()) {
                    Ok(()) => {
                        engine.threads.insert(
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
                            engine.threads.insert(
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
                    Err(e) if engine.threads.is_empty() => {
                        return Err(crate::process::access::seize_error(pid, e))
                    }
                    Err(e) => bail!("cannot seize thread {tid} of process {pid}: {e}"),
                }
            }
        }
        if engine.threads.is_empty() {
            bail!("process {pid} exited while pyprobe was attaching");
        }
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
            return Err(e.context(format!("cannot install probes in process {pid}")));
        }
        engine.resume_all();
        Ok(engine)
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
        let result = self.event_loop(sink);
        if let Err(e) = &result {
            if self.launched && e.downcast_ref::<NotTraceable>().is_some() {
                // The command pyprobe started was refused before it ran any code of
                // its own: it does not run untraced behind the user's back.
                let _ = kill(Pid::from_raw(self.root), Signal::SIGKILL);
            }
        }
        if !self.detached {
            self.detach_all(sink);
        }
        result?;
        Ok(self.exit.unwrap_or(Outcome::Detached(StopReason::Internal)))
    }

    pub(super) fn event_loop(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        self.arm_next_tick();
        loop {
            if let Some(reason) = stop_requested() {
                self.exit = Some(Outcome::Detached(reason));
                return Ok(());
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
            if self.ring_active() {
                // Hits arrive in the rings without a stop: poll them and the waits.
                let drained = self.drain_rings(sink);
                let held = self.ring_backpressure(sink)?;
                if drained > 0 || held {
                    self.poll_budget(sink);
                }
                if held {
                    continue;
                }
                match waitpid(None, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) => {
                        if drained == 0 {
                            if self.ring_busy() {
                                std::thread::yield_now();
                            } else {
                                std::thread::sleep(std::time::Duration::from_micros(RING_POLL_US));
                            }
                        }
                    }
                    Ok(status) => {
                        if self.budget.is_some() {
                            self.last_wait_ns = monotonic_ns();
                        }
                        self.handle(status, false, sink)?
                    }
                    Err(Errno::EINTR) => {}
                    Err(Errno::ECHILD) => return Ok(()),
                    Err(e) => bail!("waitpid failed: {e}"),
                }
                continue;
            }
            match waitpid(None, Some(WaitPidFlag::__WALL)) {
                Ok(status) => {
                    if self.budget.is_some() {
                        self.last_wait_ns = monotonic_ns();
                    }
                    self.handle(status, false, sink)?
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::ECHILD) => return Ok(()),
                Err(e) => bail!("waitpid failed: {e}"),
            }
        }
    }

    /// Arms the timer: the next sample, or the `--duration` deadline.
    pub(super) fn arm_next_tick(&self) {
        if let Some(interval) = self.options.sample_interval_ns {
            arm_tick(jitter(interval, 50));
        } else if let Some(left) = until_deadline_ns() {
            // Wake up for the deadline even when the target is idle.
            arm_tick(left.min(100_000_000));
        }
    }

    /// A sampling tick: with `blocking`, every thread is stopped while the sink reads
    /// the stacks, for a consistent picture; threads the target itself has stopped
    /// (group-stop) stay as they are.
    pub(super) fn on_tick(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        if self.options.sample_interval_ns.is_none() {
            return Ok(());
        }
        let functions_traced = self
            .procs
            .values()
            .any(|p| !p.patches.set.budgeted.is_empty());
        if functions_traced && self.budget.as_ref().is_some_and(|b| b.exact()) {
            // An exact window: the probes say it all, a sample would be thrown away.
            self.poll_budget(sink);
            return Ok(());
        }
        let blocking = self.options.blocking_samples && !self.samples_unblocked;
        // Each process is sampled on its own: stopped only while its own stacks are
        // read, never while another process's are. One still starting (its
        // interpreter not mapped yet) has nothing to read.
        let mut pids: Vec<i32> = self
            .procs
            .iter()
            .filter(|(_, p)| !p.awaiting_object)
            .map(|(&pid, _)| pid)
            .collect();
        pids.sort_unstable();
        if blocking {
            self.sample_stopped(pids, sink)?;
        } else {
            // Running on: what each published before its read is recorded first
            // (up to what was there then; it may publish faster than it is read).
            for pid in pids {
                self.drain_ring_of(pid, sink);
                let on_cpu = self.cpu_states(pid);
                sink(TraceEvent::Tick {
                    pid,
                    ts_ns: monotonic_ns(),
                    stopped: false,
                    on_cpu,
                });
            }
        }
        self.poll_budget(sink);
        if blocking {
            self.unblock_costly_samples(sink);
        }
        Ok(())
    }

    /// Samples each process of `pids` with every thread of it stopped: all are
    /// interrupted at once, and each is read and let go as soon as its own threads
    /// are all held, so none waits for another's threads or stack reads.
    pub(super) fn sample_stopped(
        &mut self,
        mut left: Vec<i32>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        // Threads seized but not seen yet stop by themselves; threads parked in
        // group-stop stay parked (their stacks do not move).
        let running = |t: &Thread| matches!(t.state, ThreadState::Running | ThreadState::New);
        let mut interrupted = std::collections::HashSet::new();
        // Before the stop, which would show every thread as stopped.
        let mut on_cpu: HashMap<i32, Vec<(i32, bool)>> = left
            .iter()
            .map(|&pid| (pid, self.cpu_states(pid)))
            .collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            for (&tid, thread) in &self.threads {
                if left.contains(&thread.tgid) && running(thread) && interrupted.insert(tid) {
                    let _ = ptrace::interrupt(Pid::from_raw(tid));
                }
            }
            let mut i = 0;
            while i < left.len() {
                let pid = left[i];
                let mut threads = self.threads.values().filter(|t| t.tgid == pid);
                let (mut any, mut held) = (false, true);
                for t in &mut threads {
                    any = true;
                    held &= !running(t);
                }
                if any && !held {
                    i += 1;
                    continue;
                }
                left.swap_remove(i);
                if !any {
                    continue; // gone meanwhile
                }
                // Charged from the moment all are stopped: until then they ran (or
                // waited for a CPU, which is not pyprobe's doing).
                let began = monotonic_ns();
                self.drain_ring_of(pid, sink);
                sink(TraceEvent::Tick {
                    pid,
                    ts_ns: monotonic_ns(),
                    stopped: true,
                    on_cpu: on_cpu.remove(&pid).unwrap_or_default(),
                });
                self.resume_process(pid);
                if let Some(b) = self.budget.as_mut() {
                    b.sampled(monotonic_ns().saturating_sub(began));
                }
            }
            if left.is_empty() {
                return Ok(());
            }
            // The rings of the processes still running fill meanwhile: drained
            // while waiting, so that a slow stop does not make them overflow.
            let flags = if self.ring_active() {
                WaitPidFlag::__WALL | WaitPidFlag::WNOHANG
            } else {
                WaitPidFlag::__WALL
            };
            match waitpid(None, Some(flags)) {
                Ok(WaitStatus::StillAlive) => {
                    if self.drain_rings(sink) == 0 {
                        std::thread::yield_now();
                    }
                }
                Ok(status) => {
                    // The processes not sampled yet are held; the others' stops are
                    // handled and resumed as in the event loop.
                    let holding = status.pid().is_some_and(|tid| {
                        let tid = tid.as_raw();
                        self.threads
                            .get(&tid)
                            .map(|t| t.tgid)
                            .or_else(|| tgid_of(tid))
                            .is_some_and(|pid| left.contains(&pid))
                    });
                    self.handle(status, holding, sink)?
                }
                Err(Errno::EINTR) => {}
                Err(Errno::ECHILD) => {
                    self.threads.clear();
                    return Ok(());
                }
                Err(e) => bail!("waitpid failed while stopping the target: {e}"),
            }
            if std::time::Instant::now() > deadline {
                bail!("the target's threads did not stop within 10 s");
            }
        }
    }

    /// Whether each thread of process `pid` is on a CPU (running or runnable), from
    /// the kernel's scheduler state. A thread in a ptrace-stop of pyprobe's own (a
    /// probe hit, an interrupt) was caught running; one in a group-stop (SIGSTOP) or a
    /// vfork wait was not.
    pub(super) fn cpu_states(&self, pid: i32) -> Vec<(i32, bool)> {
        self.threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .filter_map(|(&tid, t)| {
                let on_cpu = match crate::process::status::task_state(pid, tid)? {
                    'R' => true,
                    't' => !matches!(
                        t.state,
                        ThreadState::Listening
                            | ThreadState::Stopped {
                                kind: StopKind::Group | StopKind::Vfork,
                                ..
                            }
                    ),
                    _ => false,
                };
                Some((tid, on_cpu))
            })
            .collect()
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
                    if holding || self.budget.is_none() {
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
            CLONE | FORK | VFORK => {
                let new = ptrace::getevent(Pid::from_raw(tid)).unwrap_or(0) as i32;
                let parent_tgid = self.threads.get(&tid).map_or(tid, |t| t.tgid);
                if new > 0 {
                    if event == CLONE && tgid_of(new).is_none_or(|g| g == parent_tgid) {
                        self.threads.entry(new).or_insert(Thread {
                            tgid: parent_tgid,
                            state: ThreadState::New,
                        });
                        sink(TraceEvent::ThreadStart {
                            pid: parent_tgid,
                            tid: new,
                            ts_ns: monotonic_ns(),
                        });
                    } else {
                        let pending = PendingChild {
                            parent: parent_tgid,
                            vfork: event == VFORK,
                        };
                        self.pending_children.insert(new, pending);
                        if let Some(i) = self.early_children.iter().position(|&c| c == new) {
                            self.early_children.remove(i);
                            self.adopt_child(new, pending, sink);
                        }
                    }
                }
                let kind = if event == VFORK {
                    StopKind::Vfork
                } else {
                    StopKind::InSyscall
                };
                self.resume_or_hold(tid, None, kind, holding);
            }
            EXEC => {
                // After exec the thread group is the leader alone; the old image and its
                // patches are gone.
                let tgid = self.threads.get(&tid).map_or(tid, |t| t.tgid);
                self.threads.retain(|&t, th| th.tgid != tgid || t == tgid);
                self.threads.insert(
                    tgid,
                    Thread {
                        tgid,
                        state: ThreadState::Running,
                    },
                );
                let mut proc = Proc::new(tgid);
                if let Some(old) = self.procs.get_mut(&tgid) {
                    old.patches.forget();
                }
                if let Some(g) = self.guardian.as_mut() {
                    let _ = g.tell(Op::Forget, tgid, 0);
                }
                proc.awaiting_object = true;
                self.procs.insert(tgid, proc);
                sink(TraceEvent::Exec {
                    pid: tgid,
                    ts_ns: monotonic_ns(),
                });
                self.set_state(
                    tgid,
                    ThreadState::Stopped {
                        pending: None,
                        kind: StopKind::InSyscall,
                    },
                );
                self.check_awaited_object(tgid, sink);
                self.resume_or_hold(tgid, None, StopKind::InSyscall, holding);
            }
            STOP => self.handle_stop_event(tid, sig, holding, sink),
            EXIT => {
                // The process's memory is still there: what its ring holds is read
                // and named now, not after the process is gone (stacks captured in
                // the target are named by reading their code objects).
                while self.drain_rings(sink) > 0 {}
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
                    self.resume_or_hold(tid, None, StopKind::Interrupt, holding);
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
            self.set_state(tid, ThreadState::Running);
            self.resume_or_hold(tid, None, StopKind::Interrupt, holding);
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

    /// A forked child: trace it (`--subprocesses`) or clean its copy of the patches
    /// and release it, before it runs on.
    pub(super) fn adopt_child(
        &mut self,
        child: i32,
        pending: PendingChild,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.pending_children.remove(&child);
        let parent_patches = self
            .procs
            .get(&pending.parent)
            .map(|p| p.patches.clone())
            .unwrap_or_default();
        let parent_net = self.procs.get(&pending.parent).and_then(|p| p.net);
        if self.options.subprocesses {
            let mut proc = Proc::new(child);
            proc.patches = parent_patches;
            if pending.vfork {
                // It runs in its parent's memory until it execs: what is written
                // there is the parent's, undone with the parent's. Its copy of the
                // patches only names the hits it might take meanwhile.
                proc.shares_parent_memory = true;
            } else {
                if let Err(e) = Self::ring_fork(self.procs.get(&pending.parent), &mut proc) {
                    sink(TraceEvent::Notice(format!(
                        "forked child {child}: cannot turn its ring sites back into int3s: {e:#}"
                    )));
                }
                // Its sites move to a ring of its own at its first hit, as after an
                // exec: a hit is a clean stop to set it up from.
                proc.ring_pending =
                    self.options.ring != RingUse::Off && proc.patches.installed_sites() > 0;
                if let Some(g) = self.guardian.as_mut() {
                    let (written, raised) = proc.patches.undo_list();
                    for &sem in raised {
                        let _ = g.tell(Op::SemaphoreRaised, child, sem);
                    }
                    for &site in written {
                        let _ = g.tell(Op::SiteArmed, child, site);
                    }
                }
            }
            proc.net = parent_net;
            self.procs.insert(child, proc);
            self.threads.insert(
                child,
                Thread {
                    tgid: child,
                    state: ThreadState::Running,
                },
            );
            sink(TraceEvent::ProcessStart {
                pid: child,
                parent: pending.parent,
                ts_ns: monotonic_ns(),
            });
            let _ = ptrace::cont(Pid::from_raw(child), None);
            return;
        }
        if !pending.vfork {
            // The child has its own copy of the parent's memory, int3s included.
            let (written, raised) = parent_patches.undo_list();
            let mut mem = ProcessMemory::new(child);
            if let Err(e) = clean_copy(written, raised, &mut mem) {
                sink(TraceEvent::Notice(format!(
                    "cannot clean forked child {child}: {e}"
                )));
            }
            if let Err(e) = Self::ring_clean_released(self.procs.get(&pending.parent), child) {
                sink(TraceEvent::Notice(format!(
                    "cannot clean the ring sites of forked child {child}: {e:#}"
                )));
            }
            // And its copy of the SIGTRAP safety net (it is at its first, clean stop).
            if let Some(net) = parent_net {
                if let Err(e) = safety_net::uninstall(child, &mut mem, &net) {
                    sink(TraceEvent::Notice(format!(
                        "forked child {child}: cannot remove the SIGTRAP safety net: {e}"
                    )));
                }
            }
        }
        // A vfork child shares the parent's memory until it execs: nothing to clean.
        let _ = ptrace::detach(Pid::from_raw(child), None);
    }

    pub(super) fn set_state(&mut self, tid: i32, state: ThreadState) {
        if let Some(t) = self.threads.get_mut(&tid) {
            t.state = state;
        }
    }

    /// Records the stop `tid` is in, and resumes it unless `holding`.
    pub(super) fn resume_or_hold(
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

    pub(super) fn resume(&mut self, tid: i32, signal: Option<Signal>) {
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
            // SAFETY: PTRACE_LISTEN takes no pointers.
            if unsafe { libc::ptrace(libc::PTRACE_LISTEN, tid, 0, 0) } == 0 {
                self.set_state(tid, ThreadState::Listening);
                return;
            }
        }
        let awaiting = self
            .threads
            .get(&tid)
            .and_then(|t| self.procs.get(&t.tgid))
            .is_some_and(|p| p.awaiting_object);
        let pid = Pid::from_raw(tid);
        let _ = if awaiting {
            ptrace::syscall(pid, signal)
        } else {
            ptrace::cont(pid, signal)
        };
        self.set_state(tid, ThreadState::Running);
    }

    pub(super) fn thread_gone(&mut self, tid: i32, how: Outcome, sink: &mut dyn FnMut(TraceEvent)) {
        if !self.threads.contains_key(&tid) {
            return;
        }
        // What the thread (or its process, whose ring goes with it) published
        // before it went is recorded before its end.
        let tgid = self.threads.get(&tid).map_or(tid, |t| t.tgid);
        self.drain_ring_of(tgid, sink);
        let Some(thread) = self.threads.remove(&tid) else {
            return;
        };
        self.resumed_ns.remove(&tid);
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
            self.procs.remove(&tid);
            if let Some(g) = self.guardian.as_mut() {
                let _ = g.tell(Op::Forget, tid, 0);
            }
            // Exited leader: the rest of its threads are gone with it.
            self.threads.retain(|_, t| t.tgid != tid);
        }
    }

    /// Decodes a breakpoint hit if `tid` stopped at one of our sites.
    pub(super) fn try_hit(&mut self, tid: i32, sink: &mut dyn FnMut(TraceEvent)) -> bool {
        let Some(tgid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return false;
        };
        // Ring records this thread published before reaching this int3 come first:
        // all of them (a GC's end before the next GC's start), not one batch.
        self.drain_ring_of(tgid, sink);
        let Some(proc) = self.procs.get(&tgid) else {
            return false;
        };
        let Ok(raw) = ptrace::getregs(Pid::from_raw(tid)) else {
            return false;
        };
        let regs = Registers(raw);
        let site_addr = regs.0.rip.wrapping_sub(1);
        let Some(&(pi, si)) = proc.patches.sites.get(&site_addr) else {
            return false;
        };
        // An `int3` reports SI_KERNEL; the program's own kill/raise/tgkill reports
        // SI_USER or SI_TKILL even when it lands just after a site.
        match ptrace::getsiginfo(Pid::from_raw(tid)) {
            Ok(info) if info.si_code == SI_KERNEL => {}
            _ => return false,
        }
        if self.budget.as_ref().is_some_and(|b| !b.exact())
            && proc.patches.set.budgeted.contains(&pi)
        {
            // It passed the semaphore check just before the probe went off: the
            // window is closed, so this hit is not recorded.
            return true;
        }
        // What was deferred to the first hit (the SIGTRAP net, the ring) is set up
        // before the hit is stamped: pyprobe's own time is in no call or pause.
        if proc.net_pending {
            if let Some(proc) = self.procs.get_mut(&tgid) {
                Self::install_net(proc, tgid, tid, sink);
            }
        }
        self.ring_at_hit(tgid, tid, sink);
        let Some(proc) = self.procs.get(&tgid) else {
            return true;
        };
        let ts_ns = monotonic_ns();
        let probe = &proc.patches.set.probes[pi];
        let site = &probe.sites[si];
        let symbols = |name: &str| proc.patches.set.symbol(name);
        self.hit_buffers
            .decode(probe, site, &regs, &proc.mem, &symbols);
        self.hits += 1;
        sink(TraceEvent::Hit(Hit {
            pid: tgid,
            tid,
            ts_ns,
            probe: pi,
            probe_name: &probe.name,
            args: &self.hit_buffers.args,
            buffers: &self.hit_buffers,
            stack: None,
            stopped: true,
        }));
        true
    }

    /// Resolves and installs the probes of `pid`, every thread of it stopped.
    /// `starting`: the process is still being loaded (launch, exec); its sites move
    /// to the ring only at their first hit, once the loader has finished mapping
    /// (a trampoline region placed now could be mapped over). `Ok(false)`: not
    /// mapped yet.
    pub(super) fn install(
        &mut self,
        pid: i32,
        starting: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<bool> {
        let Some(set) = self.resolver.resolve(pid)? else {
            return Ok(false);
        };
        // A thread where system calls can be injected, found before any `int3` is
        // written (finding one may let a thread finish the system call it is in).
        let clean = if set.probes.is_empty() {
            None
        } else {
            self.clean_thread(pid, sink)
        };
        let proc = self.procs.entry(pid).or_insert_with(|| Proc::new(pid));
        let patches = Patches::install(set, &mut proc.mem, self.guardian.as_mut())
            .with_context(|| format!("patching process {pid}"))?;
        sink(TraceEvent::Installed {
            pid,
            sites: patches.installed_sites(),
        });
        proc.patches = patches;
        proc.awaiting_object = false;
        if proc.net.is_none() && proc.patches.installed_sites() > 0 {
            match clean {
                Some(tid) => Self::install_net(proc, pid, tid, sink),
                None => proc.net_pending = true,
            }
        }
        self.budget_installed(pid, sink);
        self.ring_installed(pid, if starting { None } else { clean }, sink)?;
        Ok(true)
    }

    pub(super) fn install_net(
        proc: &mut Proc,
        pid: i32,
        tid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        proc.net_pending = false;
        let mut sites: Vec<u64> = proc.patches.sites.keys().copied().collect();
        sites.sort_unstable();
        match safety_net::install(tid, &mut proc.mem, &sites) {
            Ok(net) => proc.net = Some(net),
            Err(e) => sink(TraceEvent::Notice(format!(
                "process {pid}: no SIGTRAP safety net ({e}); if pyprobe is killed, a thread reaching a \
                 probe site before the guardian restores it would die"
            ))),
        }
        let blocking = safety_net::threads_blocking_sigtrap(pid);
        if !blocking.is_empty() {
            sink(TraceEvent::Notice(format!(
                "process {pid}: threads {blocking:?} block SIGTRAP; a probe hit there makes the kernel \
                 unblock it and reset it to its default"
            )));
        }
    }

    /// A thread of `pid` held at a stop where a system call can be injected (see
    /// `inject`): one already there, else one brought there from a stop inside a
    /// system call (it finishes the call and stops again before running any code of
    /// its own). `None` when no thread of it gets there.
    pub(super) fn clean_thread(
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
    pub(super) fn bring_to_clean_stop(
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
            match waitpid(Pid::from_raw(tid), Some(WaitPidFlag::__WALL)) {
                Ok(status) => self.handle(status, true, sink).ok()?,
                Err(Errno::EINTR) => {}
                Err(_) => return None,
            }
        }
        None
    }

    /// In a process that is starting up: once its maps changed, look for the probes.
    pub(super) fn check_awaited_object(&mut self, tid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let Some(tgid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return;
        };
        let Some(proc) = self.procs.get_mut(&tgid) else {
            return;
        };
        if !proc.awaiting_object {
            return;
        }
        let maps_len = crate::process::maps::maps_len(tgid);
        if maps_len == proc.last_maps_len {
            return;
        }
        proc.last_maps_len = maps_len;
        // At a syscall-entry stop the kernel is about to run the pending call: no
        // injection there; the exit stop follows at once.
        if at_syscall_entry(tid) {
            proc.last_maps_len = 0;
            return;
        }
        if let Err(e) = self.install(tgid, true, sink) {
            if e.downcast_ref::<NotTraceable>().is_some() {
                // Refused before the process ran any code of its own: the run ends.
                self.fatal.get_or_insert(e);
                return;
            }
            sink(TraceEvent::Notice(format!("{e:#}")));
            if let Some(p) = self.procs.get_mut(&tgid) {
                p.awaiting_object = false;
            }
        }
    }

    /// Interrupts every running thread and waits until all are in a ptrace-stop.
    pub(super) fn stop_all(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        self.stop_threads(true, sink)
    }

    /// Like `stop_all`, but threads parked in group-stop stay parked.
    pub(super) fn stop_all_running(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        self.stop_threads(false, sink)
    }

    /// Resumes the threads of process `pid` that pyprobe holds.
    pub(super) fn resume_process(&mut self, pid: i32) {
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

    pub(super) fn stop_threads(
        &mut self,
        include_listening: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        let wanted = |state: ThreadState| match state {
            ThreadState::Listening => include_listening,
            ThreadState::Stopped { .. } => false,
            _ => true,
        };
        for (&tid, thread) in &self.threads {
            if wanted(thread.state) {
                let _ = ptrace::interrupt(Pid::from_raw(tid));
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.threads.values().any(|t| wanted(t.state)) {
            match waitpid(None, Some(WaitPidFlag::__WALL)) {
                Ok(status) => self.handle(status, true, sink)?,
                Err(Errno::EINTR) => {}
                Err(Errno::ECHILD) => {
                    self.threads.clear();
                    break;
                }
                Err(e) => bail!("waitpid failed while stopping the target: {e}"),
            }
            if std::time::Instant::now() > deadline {
                bail!("the target's threads did not stop within 10 s");
            }
            // New threads seen while holding start stopped too.
            for (&tid, thread) in &self.threads {
                if thread.state == ThreadState::Running {
                    let _ = ptrace::interrupt(Pid::from_raw(tid));
                }
            }
        }
        Ok(())
    }

    /// A thread interrupted just as it executed an `int3` reports the interrupt
    /// first and keeps the SIGTRAP pending: after a detach nobody would catch it and
    /// it would kill the target. Let each such thread take its SIGTRAP now (a hit).
    /// A thread may first report a second, stale interrupt (`stop_all` interrupts a
    /// thread again while its first stop is not yet collected): resume it until the
    /// SIGTRAP is gone, a few rounds at most.
    pub(super) fn take_pending_traps(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
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
            .filter(|&tid| sigtrap_pending(tid))
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
                    match waitpid(Pid::from_raw(tid), Some(WaitPidFlag::__WALL)) {
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

    pub(super) fn resume_all(&mut self) {
        let stopped: Vec<(i32, Option<Signal>)> = self
            .threads
            .iter()
            .filter_map(|(&tid, t)| match t.state {
                ThreadState::Stopped { pending, .. } => Some((tid, pending)),
                _ => None,
            })
            .collect();
        for (tid, pending) in stopped {
            self.resume(tid, pending);
        }
    }

    /// Stops every thread, restores every byte and semaphore, and detaches, delivering
    /// any signal a thread was stopped with.
    pub fn detach_all(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        if self.detached {
            return;
        }
        self.detached = true;
        if let Err(e) = self.stop_all(sink) {
            sink(TraceEvent::Notice(format!(
                "while stopping the target to detach: {e:#}"
            )));
        }
        self.take_pending_traps(sink);
        self.ring_detach(sink);
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
                Some(tid) => safety_net::uninstall(tid, &mut proc.mem, &net),
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
        if let Some(g) = self.guardian.take() {
            g.finish();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The last line of defence (a panic unwinding through the session): never
        // leave an int3 behind in a target that outlives pyprobe.
        if !self.detached {
            self.detach_all(&mut |_| {});
        }
    }
}
