//! The ptrace engine: seize a process (or start one), install probes, catch every hit,
//! follow threads, forks and execs, and leave the target as it found it.
//!
//! All ptrace requests and waits happen on the thread that created the engine:
//! ptrace belongs to a thread, not a process.
//!
//! Here: the engine's state and the event loop. Beside it: `attaching`
//! (attaching and launching), `dispatch` (waits and what each status means),
//! `leaving` (detaching), `threads` (thread states, stopping and resuming),
//! `children` (clone, fork, vfork, exec), `hits` (installing probes, catching
//! `int3` hits), `sampling` (ticks) and `interface` (what the caller sees); the
//! ring's and the budget's sides of the engine are in `tracer::ring_engine` and
//! `tracer::budget`.

use anyhow::Result;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rustc_hash::FxHashMap;

use crate::probe_set::ProbeSet;
use crate::process::memory::ProcessMemory;

use super::budget::BudgetBook;
use super::clock::monotonic_ns;
use super::decode::HitBuffers;
use super::guardian::Guardian;
use super::patch::Patches;
use super::ring_engine::setup::RingProc;
use super::ring_engine::RingBook;
use super::safety_net::SafetyNet;
use super::signals::{
    arm_tick, disarm_tick, jitter, stop_requested, take_tick, until_deadline_ns, StopReason,
};

mod affinity;
mod attaching;
mod children;
mod dispatch;
mod hits;
mod interface;
mod leaving;
mod pausing;
mod sampling;
pub mod source;
mod step_out;
mod threads;
mod yielding;

pub use super::budget::BudgetSummary;
pub use super::ring_engine::RingUse;
use children::PendingChild;
use dispatch::Waited;
pub use interface::{
    EngineOptions, Hit, NotTraceable, Outcome, RepeatSlot, Resolver, ReturnRow, ThinLevel,
    TraceEvent,
};
pub use pausing::PauseCause;
use source::EventSource;
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
    /// A forked child of a hooked process (`--subprocesses`) the hook could not go
    /// on in (its state is wiped there), so its calls go untraced from this time
    /// (CLOCK_MONOTONIC ns) until it runs a new program; said, with why, if it
    /// never does.
    pub(super) unhooked: Option<(u64, String)>,
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
            unhooked: None,
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
    /// When the last sampling tick was due (0 before the first, and after a pause).
    pub(super) next_tick_ns: u64,
    /// Sampling ticks taken, and ticks skipped because pyprobe was too late for them.
    ticks: TickCount,
    /// A pause asked for, made as soon as the target can be attached to again.
    pub(super) pause_pending: Option<PauseCause>,
    /// Processes whose threads blocking SIGTRAP are yet to be said (see
    /// `say_sigtrap_blockers`).
    pub(super) sigtrap_blockers_due: Vec<i32>,
    /// Threads seen running just before all were stopped: interrupted last and
    /// resumed first (see `note_busy_threads`).
    pub(super) busy: rustc_hash::FxHashSet<i32>,
    /// The probes of a process resolved before its threads were stopped: reading
    /// its maps and ELF files took 50 ms of a 10,000-thread attach, all of it held.
    /// The object carrying them stays mapped for the process's life.
    pub(super) prepared: Option<(i32, Result<Option<ProbeSet>>)>,
    /// The threads' `stat` and `schedstat` files, read at every sample.
    pub(super) task_states: crate::process::task_looks::KeptTaskStates,
    /// Sampling ticks begun, counted from 1: the number of the last.
    pub(super) tick_number: u64,
}

/// Sampling ticks over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickCount {
    /// Ticks taken (each sampled every process, or fell in an exact window).
    pub taken: u64,
    /// Ticks skipped: pyprobe came to them more than an interval late.
    pub missed: u64,
    /// Of those, the ticks skipped in gaps of [`STALL_NS`] or more: pyprobe was
    /// stopped (Ctrl-Z, SIGSTOP) or starved of CPU that long, not merely slow.
    pub stalled: u64,
}

/// A gap between ticks this long is a stall of pyprobe's, not a slow sample.
pub const STALL_NS: u64 = 300_000_000;

/// How long the event loop sleeps when the rings and the waits are both empty.
const RING_POLL_US: u64 = 200;

/// The timer's beat when nothing is sampled: the longest a stop request that
/// raced the loop's `waitpid` waits to be seen.
const IDLE_BEAT_NS: u64 = 100_000_000;

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
            ticks: TickCount::default(),
            pause_pending: None,
            sigtrap_blockers_due: Vec::new(),
            busy: Default::default(),
            prepared: None,
            task_states: Default::default(),
            tick_number: 0,
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

    /// The sampling ticks taken and those missed, pyprobe having been too late for
    /// them (not given a CPU in time, or a sample longer than two intervals).
    pub fn ticks(&self) -> TickCount {
        self.ticks
    }

    /// Runs until the target exits or pyprobe is asked to stop; then leaves cleanly.
    pub fn run(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<Outcome> {
        for (pid, parent, ts_ns) in std::mem::take(&mut self.children_to_announce) {
            sink(TraceEvent::ProcessStart { pid, parent, ts_ns });
            // Its other threads, running at attach: a thread the recording does not
            // name belongs to the recording's own process.
            let mut others: Vec<i32> = self
                .threads
                .iter()
                .filter(|&(&tid, t)| t.tgid == pid && tid != pid)
                .map(|(&tid, _)| tid)
                .collect();
            others.sort_unstable();
            for tid in others {
                sink(TraceEvent::ThreadStart { pid, tid, ts_ns });
            }
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
            if !self.sigtrap_blockers_due.is_empty() {
                self.say_sigtrap_blockers(sink);
            }
            if take_tick() {
                self.ticks.taken += 1;
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
                        // A thread stopped lately stops again soon (sites left on
                        // `int3`): a nap would hold each of its stops that long.
                        if self.rings_calm(0) {
                            super::signals::nap(RING_POLL_US);
                        } else {
                            std::thread::yield_now();
                        }
                    }
                    // A few records: let a batch gather (see `CALM_BELOW`).
                    Waited::Nothing if self.rings_calm(drained) => {
                        super::signals::nap(RING_POLL_US)
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
                if self.next_tick_ns != 0 {
                    let missed = (now - due) / interval;
                    self.ticks.missed += missed;
                    if now - due >= STALL_NS {
                        self.ticks.stalled += missed;
                    }
                }
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
}
