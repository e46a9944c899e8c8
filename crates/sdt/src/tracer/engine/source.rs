//! Events from code put in the target beside the SDT probes (pyprobe's CPython
//! hook engine), which the engine drives through [`EventSource`] and never by name.
//!
//! A source never calls back into the engine: what needs every thread stopped it
//! asks for (the pids [`EventSource::watch`] and [`EventSource::sweep`] return) and
//! is called again with them stopped. So a thread started or gone while the engine
//! stops threads for a source reaches the source as it would at any other time.

use std::time::Instant;

use anyhow::Result;
use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::tracer::guardian::Guardian;
use crate::tracer::ring_engine::tsc::TscClock;

use super::threads::at_syscall_entry;
use super::{Engine, NotTraceable, TraceEvent};

/// What [`EventSource::before_ring`] tells the SDT ring's drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingBound {
    /// The SDT ring is read up to records stamped this (TSC ticks; `u64::MAX`:
    /// no bound): what the source has read reaches that far.
    pub tsc: u64,
    /// Records of its own the source read meanwhile. While it reads on, its bound
    /// moves on: a drain held back by the bound has more to read.
    pub read: usize,
}

impl RingBound {
    /// No source beside the ring: read it all.
    pub const NONE: RingBound = RingBound {
        tsc: u64::MAX,
        read: 0,
    };
}

/// A thread of a process, stopped, as a source sees it when it goes in.
#[derive(Debug, Clone, Copy)]
pub struct StoppedThread {
    pub tid: i32,
    pub rip: u64,
    /// Its `%fs` base (its thread-local storage, which names its records).
    pub fs_base: u64,
}

/// What a source is given to go into process `pid`, every thread of it stopped.
pub struct Placement<'a> {
    pub pid: i32,
    /// A thread held at a stop where system calls can be injected.
    pub tid: i32,
    pub threads: &'a [StoppedThread],
    pub guardian: Option<&'a mut Guardian>,
    pub tsc: &'a TscClock,
    /// Under an overhead budget: a full ring is waited on only briefly.
    pub budgeted: bool,
}

/// What a due sweep of the profile route needs (see [`EventSource::sweep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepNeed {
    /// Every thread stopped, then [`EventSource::sweep_stopped`].
    Stop,
    /// Only the threads held for the sweep released.
    Release,
}

/// Events beside the probes, from code a source put in the target. The engine
/// tells it of processes and threads and reads it in the event loop; a probe set
/// asks for it with [`ProbeSet::hook`](crate::probe_set::ProbeSet).
pub trait EventSource {
    /// Whether the event loop must poll it.
    fn active(&self) -> bool;
    /// Whether it waits for launched process `pid` to start (`None`: any), whose
    /// threads then stop at system calls.
    fn awaits(&self, pid: Option<i32>) -> bool;
    /// Whether it is in process `pid` already.
    fn serves(&self, pid: i32) -> bool;
    /// Launched process `pid` is not started far enough: wait for it.
    fn await_start(&mut self, pid: i32);
    /// Whether awaited process `pid` can now be gone into.
    fn ready(&mut self, pid: i32) -> bool;
    /// The awaited processes whose time to look has come and that can now be gone
    /// into.
    fn due_ready(&mut self, now: Instant) -> Vec<i32>;
    /// No longer waits for `pid` (going in failed).
    fn stop_awaiting(&mut self, pid: i32);
    /// Goes into a process, every thread of it stopped.
    fn place(&mut self, at: Placement<'_>, sink: &mut dyn FnMut(TraceEvent)) -> Result<()>;
    /// Process `parent` forked `child` and stands at its fork-event stop, the fork
    /// done: what the source must know of the parent as the child got it is read
    /// now.
    fn forked(&mut self, _parent: i32, _child: i32) {}
    /// Forked child `at.pid` of `parent` at its first stop, having run nothing:
    /// the source goes on in it if it can. `Ok(false)`: nothing of the source's
    /// was in the parent when it forked.
    fn adopt(
        &mut self,
        _parent: i32,
        _at: Placement<'_>,
        _sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<bool> {
        Ok(false)
    }
    /// A new thread of `pid` at its first stop. Returns true to hold it until a
    /// sweep ([`EventSource::sweep`]) has run.
    fn thread_started(&mut self, pid: i32, tid: i32) -> bool;
    /// Process `pid` has more than one task from now on.
    fn many_producers(&self, pid: i32);
    /// Reads what it needs while the target runs: the pids whose threads must be
    /// stopped for [`EventSource::watch_stopped`]. What it finds the guardian must
    /// undo should pyprobe die, it tells `guardian`.
    fn watch(
        &mut self,
        guardian: Option<&mut Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Vec<i32>;
    fn watch_stopped(
        &mut self,
        pid: i32,
        guardian: Option<&mut Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    );
    /// The processes due for a sweep, and what each needs.
    fn sweep(&mut self, now: Instant, sink: &mut dyn FnMut(TraceEvent)) -> Vec<(i32, SweepNeed)>;
    fn sweep_stopped(&mut self, pid: i32, sink: &mut dyn FnMut(TraceEvent));
    /// Drains every process for which `alone(pid)` (no SDT ring read beside it),
    /// plus what was read by [`EventSource::before_ring`] since; returns how many.
    fn drain(
        &mut self,
        alone: &dyn Fn(i32) -> bool,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize;
    /// Drains process `pid`, one batch; returns the records read and passed on.
    fn drain_of(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize;
    /// Before the SDT ring of `pid` is read: a batch of its own records read, and
    /// the bound the SDT ring is read up to.
    fn before_ring(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> RingBound;
    /// Passes on the records of `pid` stamped no later than `upto_ns`.
    fn emit_upto(
        &mut self,
        pid: i32,
        upto_ns: u64,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize;
    /// Leaves every process (every thread stopped); `alive(pid)`: the process is
    /// still there to restore.
    fn detach(
        &mut self,
        alive: &dyn Fn(i32) -> bool,
        guardian: Option<&mut Guardian>,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    );
    /// The image of `pid` is gone (exec or exit): its last records read.
    fn image_gone(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    );
    /// Forgets everything, to attach again.
    fn reset(&mut self);
}

impl Engine {
    /// Whether a launched process waits for the source.
    pub(in crate::tracer) fn source_awaits_any(&self) -> bool {
        self.source.as_ref().is_some_and(|s| s.awaits(None))
    }

    pub(in crate::tracer) fn source_awaits(&self, pid: i32) -> bool {
        self.source.as_ref().is_some_and(|s| s.awaits(Some(pid)))
    }

    /// Whether the event loop must poll the source.
    pub(in crate::tracer) fn source_active(&self) -> bool {
        self.source.as_ref().is_some_and(|s| s.active())
    }

    /// After the probes of `pid` were installed: the source too, if its probe set
    /// asks. `starting`: the interpreter is not initialised yet; the source waits.
    pub(in crate::tracer) fn source_installed(
        &mut self,
        pid: i32,
        starting: bool,
        clean: Option<i32>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        if !self.procs.get(&pid).is_some_and(|p| p.patches.set.hook) {
            return Ok(());
        }
        let Some(source) = self.source.as_mut() else {
            return Ok(());
        };
        if source.serves(pid) {
            return Ok(());
        }
        if starting {
            source.await_start(pid);
            return Ok(());
        }
        let tid = match clean {
            Some(t) => Some(t),
            None => self.clean_thread(pid, sink),
        };
        let Some(tid) = tid else {
            anyhow::bail!(
                "process {pid}: no thread is at a stop where the hook can be put in (all are inside \
                 system calls)"
            );
        };
        self.source_place(pid, tid, sink)
    }

    /// Puts the source into `pid` through thread `tid` (every thread held).
    fn source_place(&mut self, pid: i32, tid: i32, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        let threads = self
            .threads
            .iter()
            .filter(|(_, thread)| thread.tgid == pid)
            .map(|(&t, _)| stopped_thread(t))
            .collect::<Result<Vec<_>>>()?;
        self.with_placement(pid, tid, &threads, |source, at| source.place(at, sink))
            .map(|_| ())
    }

    /// Calls `f` with the source (if any) and what it is given to go into process
    /// `pid` through thread `tid`, `threads` stopped: `None` without a source.
    fn with_placement<R>(
        &mut self,
        pid: i32,
        tid: i32,
        threads: &[StoppedThread],
        f: impl FnOnce(&mut dyn EventSource, Placement<'_>) -> Result<R>,
    ) -> Result<Option<R>> {
        let Some(source) = self.source.as_mut() else {
            return Ok(None);
        };
        let tsc = self.ring_book.tsc.get_or_insert_with(TscClock::calibrate);
        let at = Placement {
            pid,
            tid,
            threads,
            guardian: self.guardian.as_mut(),
            tsc,
            budgeted: self.budget.meter.is_some(),
        };
        f(source.as_mut(), at).map(Some)
    }

    /// `parent`, at its fork-event stop, forked `child`.
    pub(in crate::tracer) fn source_forked(&mut self, parent: i32, child: i32) {
        if let Some(source) = self.source.as_mut() {
            source.forked(parent, child);
        }
    }

    /// Forked `child` of `parent` at its first stop: the source goes on in it if
    /// it was in the parent when it forked (see [`EventSource::adopt`]).
    pub(in crate::tracer) fn source_adopt(
        &mut self,
        parent: i32,
        child: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<bool> {
        let threads = [stopped_thread(child)?];
        self.with_placement(child, child, &threads, |source, at| {
            source.adopt(parent, at, sink)
        })
        .map(|adopted| adopted.unwrap_or(false))
    }

    /// Puts the source into `pid` (every thread of it held) through a thread at a
    /// stop where system calls can be injected.
    fn source_place_at_clean_thread(
        &mut self,
        pid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        match self.clean_thread(pid, sink) {
            Some(tid) => self.source_place(pid, tid, sink),
            None => anyhow::bail!("no thread of it is at a stop where the hook can be put in"),
        }
    }

    fn source_failed(&mut self, pid: i32, e: anyhow::Error, sink: &mut dyn FnMut(TraceEvent)) {
        if let Some(source) = self.source.as_mut() {
            source.stop_awaiting(pid);
        }
        if e.downcast_ref::<NotTraceable>().is_some() {
            self.fatal.get_or_insert(e);
        } else {
            sink(TraceEvent::Notice(format!(
                "process {pid}: the hook engine could not be installed, so no calls are traced: {e:#}"
            )));
        }
    }

    /// `tid` is held at a system-call stop (`holding`: while every thread is being
    /// stopped, which going in would nest in; the next stop does it). At an exit
    /// stop of a process the source awaits, now started, with every thread of it
    /// held: the source goes in now.
    pub(in crate::tracer) fn source_at_syscall(
        &mut self,
        tid: i32,
        holding: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(pid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return;
        };
        if holding || !self.source_awaits(pid) || at_syscall_entry(tid) {
            return;
        }
        // Other threads running (an embedding program's own): the look while the
        // target runs stops them all first.
        if !self.all_threads_held(pid) {
            return;
        }
        if !self.source.as_mut().is_some_and(|s| s.ready(pid)) {
            return;
        }
        if let Err(e) = self.source_place_at_clean_thread(pid, sink) {
            self.source_failed(pid, e, sink);
        }
    }

    /// A new thread at its first stop; returns whether to hold it.
    pub(in crate::tracer) fn source_thread_started(&mut self, tid: i32) -> bool {
        let Some(pid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return false;
        };
        // Before it runs: its creator's event may not have been seen yet.
        self.source_many_producers(pid);
        self.source
            .as_mut()
            .is_some_and(|s| s.thread_started(pid, tid))
    }

    pub(in crate::tracer) fn source_many_producers(&self, pid: i32) {
        if let Some(source) = self.source.as_ref() {
            source.many_producers(pid);
        }
    }

    /// One turn of the event loop: awaited processes looked at, the source's
    /// stopped-thread work done, and what it holds drained. Returns the records
    /// drained.
    pub(in crate::tracer) fn drain_source(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> usize {
        if self.source.is_none() {
            return 0;
        }
        self.source_await(sink);
        self.source_watch(sink);
        self.source_sweep(sink);
        let Engine {
            source,
            procs,
            ring_book,
            hits,
            ..
        } = self;
        let Some(source) = source.as_mut() else {
            return 0;
        };
        // A process with an SDT ring too has both read in time order by
        // `drain_rings`.
        let alone = |pid: i32| procs.get(&pid).is_none_or(|p| p.ring.is_none());
        source.drain(&alone, ring_book.tsc.as_ref(), hits, sink)
    }

    /// Launched processes, while they run: once started, every thread is stopped
    /// and the source goes in.
    fn source_await(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let due = match self.source.as_mut() {
            Some(s) if s.awaits(None) => s.due_ready(Instant::now()),
            _ => return,
        };
        for pid in due {
            let result = self
                .stop_all_running(sink)
                .and_then(|()| self.source_place_at_clean_thread(pid, sink));
            self.resume_all();
            if let Err(e) = result {
                self.source_failed(pid, e, sink);
            }
        }
    }

    fn source_watch(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let due = self
            .source
            .as_mut()
            .map(|s| s.watch(self.guardian.as_mut(), sink))
            .unwrap_or_default();
        for pid in due {
            if let Err(e) = self.stop_all_running(sink) {
                sink(TraceEvent::Notice(format!("process {pid}: {e:#}")));
                self.resume_all();
                continue;
            }
            if let Some(source) = self.source.as_mut() {
                source.watch_stopped(pid, self.guardian.as_mut(), sink);
            }
            self.resume_all();
        }
    }

    fn source_sweep(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let due = self
            .source
            .as_mut()
            .map(|s| s.sweep(Instant::now(), sink))
            .unwrap_or_default();
        for (pid, need) in due {
            if need == SweepNeed::Stop {
                if let Err(e) = self.stop_all_running(sink) {
                    sink(TraceEvent::Notice(format!("process {pid}: {e:#}")));
                    self.resume_all();
                    continue;
                }
                if let Some(source) = self.source.as_mut() {
                    source.sweep_stopped(pid, sink);
                }
            }
            self.resume_all();
        }
    }

    /// Drains what the source holds of `pid`, one batch; returns how much.
    pub(in crate::tracer) fn drain_source_of(
        &mut self,
        pid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize {
        match self.source.as_mut() {
            Some(s) => s.drain_of(pid, self.ring_book.tsc.as_ref(), &mut self.hits, sink),
            None => 0,
        }
    }

    /// Leaving (every thread stopped).
    pub(in crate::tracer) fn source_detach(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let Engine {
            source,
            threads,
            guardian,
            ring_book,
            hits,
            ..
        } = self;
        if let Some(source) = source.as_mut() {
            // A process that is gone has nothing left to restore.
            let alive = |pid: i32| threads.values().any(|t| t.tgid == pid);
            source.detach(
                &alive,
                guardian.as_mut(),
                ring_book.tsc.as_ref(),
                hits,
                sink,
            );
        }
    }

    /// The image of `pid` is gone (it exec'd, or its leader exited).
    pub(in crate::tracer) fn source_image_gone(
        &mut self,
        pid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        if let Some(source) = self.source.as_mut() {
            source.image_gone(pid, self.ring_book.tsc.as_ref(), &mut self.hits, sink);
        }
    }
}

/// Thread `tid`, stopped: where it stands and its `%fs` base.
fn stopped_thread(tid: i32) -> Result<StoppedThread> {
    let regs = ptrace::getregs(Pid::from_raw(tid))
        .map_err(|e| anyhow::anyhow!("thread {tid} is not stopped: {e}"))?;
    Ok(StoppedThread {
        tid,
        rip: regs.rip,
        fs_base: regs.fs_base,
    })
}
