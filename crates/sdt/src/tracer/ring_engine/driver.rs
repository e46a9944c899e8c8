//! The engine's side of the ring engine (its driver): upgrading `int3` sites to
//! trampolines once every thread is stopped, draining the rings into hits, following new
//! threads and forks, and taking the patches out when leaving.

use anyhow::{bail, Result};
use nix::sys::ptrace;
use nix::unistd::Pid;

use super::records::{drain_hits, DrainedHits, RecordSource};
use super::setup as ring_setup;
use super::setup::RingProc;
use super::tsc::{read_tsc, TscClock};
use super::{
    RingUse, BUDGETED_PATIENCE_NS, BUSY_NS, CALM_BELOW, CONSUMER_STALE_NS, DRAIN_BATCH, HIGH_WATER,
    RING_COUNT_NS, RING_EVENT_NS, RING_FRAME_NS, RING_STACK_NS, STOPPED_LATELY_NS, STUCK_NS,
};
use crate::process::memory::ProcessMemory;
use crate::ring::format::H_ALIVE;
use crate::ring::DrainStop;
use crate::tracer::clock::monotonic_ns;
use crate::tracer::engine::source::RingBound;
use crate::tracer::engine::ThinLevel;
use crate::tracer::engine::{Engine, Proc, TraceEvent};
use crate::tracer::guardian::Op;

/// Ring state the engine keeps besides each process's [`RingProc`].
#[derive(Default)]
pub(in crate::tracer) struct RingBook {
    pub(in crate::tracer) tsc: Option<TscClock>,
    /// The slot the drain waits for, and since when.
    pub(in crate::tracer) stuck: std::collections::HashMap<i32, (u64, u64)>,
    /// Until when a ring counts as busy (see [`BUSY_NS`]).
    busy_until_ns: u64,
    /// When the event loop last handled a tracee stop (see [`STOPPED_LATELY_NS`]).
    stopped_at_ns: u64,
    /// Sites said to stay on `int3`, with why.
    said: std::collections::HashSet<(u64, String)>,
    /// The code holding the probe sites, scanned before the target was stopped.
    pub(in crate::tracer) prescanned: Vec<ring_setup::ScannedCode>,
}

/// [`Engine::rings_calm`] at time `now`.
fn calm(drained: usize, now: u64, book: &RingBook) -> bool {
    drained < CALM_BELOW
        && now >= book.busy_until_ns
        && now.saturating_sub(book.stopped_at_ns) > STOPPED_LATELY_NS
}

impl Engine {
    /// Scans the code holding the sites of the probes prepared for `pid`, while
    /// its threads still run (see `ScannedCode`). Nothing when it cannot: the
    /// setup scans it then.
    pub(in crate::tracer) fn prescan_ring_code(&mut self, pid: i32) {
        let Some((prepared_for, Ok(Some(set)))) = &self.prepared else {
            return;
        };
        if *prepared_for != pid || self.options.ring == RingUse::Off {
            return;
        }
        let Ok(maps) = crate::process::maps::read_maps(pid) else {
            return;
        };
        let mem = crate::process::memory::ProcessMemory::new(pid);
        let sites: Vec<u64> = set
            .probes
            .iter()
            .flat_map(|p| p.sites.iter().map(|s| s.address))
            .collect();
        self.ring_book.prescanned = maps
            .iter()
            .filter(|m| m.executable && sites.iter().any(|a| (m.start..m.end).contains(a)))
            .filter_map(|m| ring_setup::ScannedCode::read(&mem, m).ok())
            .collect();
    }

    /// Whether any process is served by a ring (the event loop then polls).
    pub(in crate::tracer) fn ring_active(&self) -> bool {
        self.procs.values().any(|p| p.ring.is_some())
    }

    /// Probes were installed in `pid`. With every thread stopped and `clean_stop`
    /// a thread where system calls can be injected (attaching), its sites move to
    /// the ring now; else at its first hit, if it has one thread then.
    pub(in crate::tracer) fn ring_installed(
        &mut self,
        pid: i32,
        clean_stop: Option<i32>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        self.report_leftovers(pid, sink);
        let has_sites = self
            .procs
            .get(&pid)
            .is_some_and(|p| p.patches.installed_sites() > 0);
        if self.options.ring == RingUse::Off || !has_sites {
            return Ok(());
        }
        match clean_stop {
            Some(tid) if self.all_threads_held(pid) => self.ring_upgrade(pid, tid, sink),
            _ => {
                if let Some(proc) = self.procs.get_mut(&pid) {
                    proc.ring_pending = true;
                }
                Ok(())
            }
        }
    }

    /// Says which probe sites the installation took over from a pyprobe that died,
    /// and which it refused and why: never a silent "0 probe sites armed".
    fn report_leftovers(&self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let Some(patches) = self.procs.get(&pid).map(|p| &p.patches) else {
            return;
        };
        if !patches.taken_over.is_empty() {
            sink(TraceEvent::Notice(format!(
                "process {pid}: {} probe sites held the ring jumps of a pyprobe that was killed; \
                 their original code is back and they are armed again",
                patches.taken_over.len()
            )));
        }
        if !patches.put_back.is_empty() {
            sink(TraceEvent::Notice(format!(
                "process {pid}: {} sites of probes not traced now held the ring jumps of a \
                 pyprobe that was killed; their original code is back",
                patches.put_back.len()
            )));
        }
        let dead = &patches.dead_raises;
        if !dead.lowered.is_empty() {
            sink(TraceEvent::Notice(format!(
                "process {pid}: {} probe semaphores were still raised by a pyprobe killed \
                 together with its guardian; lowered back",
                dead.lowered.len()
            )));
        }
        for why in &dead.failed {
            sink(TraceEvent::Notice(format!("process {pid}: {why}")));
        }
        let refused = &patches.jump_refusals;
        if refused.is_empty() {
            return;
        }
        let head = format!(
            "process {pid}: {} of {} probe sites refused, not traced",
            refused.len(),
            patches.set.site_count()
        );
        let mut full = format!("{head}:");
        for (addr, why) in refused.iter().take(4) {
            full.push_str(&format!(" site {addr:#x} {why}."));
        }
        if refused.len() > 4 {
            full.push_str(&format!(" ({} more)", refused.len() - 4));
        }
        sink(TraceEvent::Summarised {
            short: format!("{head} (-v says which and why)"),
            full,
        });
    }

    /// A hit of `tid` in `pid` (a clean stop): the ring set up at start-up is due.
    /// Patching needs every thread stopped; at start-up there is usually one.
    pub(in crate::tracer) fn ring_at_hit(
        &mut self,
        pid: i32,
        tid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(proc) = self.procs.get_mut(&pid) else {
            return;
        };
        if !proc.ring_pending {
            return;
        }
        proc.ring_pending = false;
        let threads = self.threads.values().filter(|t| t.tgid == pid).count();
        let result = if threads == 1 {
            self.ring_upgrade(pid, tid, sink)
        } else {
            Err(anyhow::anyhow!(
                "it had {threads} threads at its first probe hit; sites stay on int3"
            ))
        };
        if let Err(e) = result {
            self.ring_failed(pid, e, sink);
        }
    }

    fn ring_failed(&mut self, pid: i32, e: anyhow::Error, sink: &mut dyn FnMut(TraceEvent)) {
        if self.options.ring == RingUse::Required {
            self.fatal
                .get_or_insert(e.context(format!("`--engine ring` cannot serve process {pid}")));
        } else {
            sink(TraceEvent::Notice(format!(
                "ring engine in process {pid}: unavailable, probe sites stay on int3: {e:#}"
            )));
        }
    }

    /// Sets up the ring in `pid`, every thread of it stopped, `tid` at a clean stop.
    fn ring_upgrade(&mut self, pid: i32, tid: i32, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        let began = monotonic_ns();
        let result = self.ring_upgrade_process(pid, tid, sink);
        // Once per process: said apart in the budget's closing line, not charged
        // against the run (it would weigh on a short program's average for good).
        self.budget.setup_in_stop_ns += monotonic_ns().saturating_sub(began);
        if let Err(e) = result {
            if self.options.ring == RingUse::Required {
                return Err(e.context("`--engine ring` cannot be used"));
            }
            self.ring_failed(pid, e, sink);
        }
        Ok(())
    }

    fn ring_upgrade_process(
        &mut self,
        pid: i32,
        tid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        let Some(proc) = self.procs.get_mut(&pid) else {
            return Ok(());
        };
        proc.ring_pending = false;
        // Every thread of the process, stopped: where it is and its %fs base.
        let mut rips = Vec::new();
        let mut fs_bases = Vec::new();
        for (&t, thread) in &self.threads {
            if thread.tgid != pid {
                continue;
            }
            let regs = ptrace::getregs(Pid::from_raw(t))
                .map_err(|e| anyhow::anyhow!("thread {t} is not stopped: {e}"))?;
            rips.push((t, regs.rip));
            fs_bases.push((t, regs.fs_base));
        }
        let setup = ring_setup::setup(
            pid,
            tid,
            &mut proc.mem,
            &mut proc.patches,
            &rips,
            &fs_bases,
            &std::mem::take(&mut self.ring_book.prescanned),
            self.guardian.as_mut(),
        )?;
        let ring_sites = setup.ring.sites.len();
        let int3_sites = proc.patches.installed_sites();
        if ring_sites == 0 && self.options.ring == RingUse::Required {
            bail!("no probe site qualifies for the ring");
        }
        sink(TraceEvent::Detail(format!(
            "ring engine in process {pid}: {ring_sites} probe sites write to a ring (no stop per hit), \
             {int3_sites} stay on int3"
        )));
        for said in &setup.said {
            sink(TraceEvent::Detail(format!(
                "ring engine in process {pid}: {said}"
            )));
        }
        // Said once per site and reason: the workers of a pool share their
        // parent's sites, and their reasons.
        let new: Vec<&(u64, String)> = setup
            .refused
            .iter()
            .filter(|r| self.ring_book.said.insert((*r).clone()))
            .collect();
        for (addr, why) in new.into_iter().take(8) {
            sink(TraceEvent::Detail(format!(
                "ring engine in process {pid}: site {addr:#x} stays on int3: {why}"
            )));
        }
        if ring_sites == 0 {
            // Nothing writes to it: not polled, so that each `int3` stop is
            // waited for as without a ring.
            return Ok(());
        }
        let tsc = self.ring_book.tsc.get_or_insert_with(TscClock::calibrate);
        // From now on the target waits for room rather than lose an event. The
        // guardian learns first, so that a pyprobe dying next ends the waits.
        if let Some(g) = self.guardian.as_mut() {
            g.tell(Op::RingServed, pid, setup.ring.ring_addr + H_ALIVE as u64)
                .map_err(|e| anyhow::anyhow!("telling the guardian about the ring: {e}"))?;
        }
        // Under a budget, a rare event waits a little, then is counted lost: the
        // budget, not the ring, decides how long the target may wait for pyprobe.
        let patience = match self.budget.meter {
            Some(_) => tsc.ns_to_ticks(BUDGETED_PATIENCE_NS),
            None => u64::MAX,
        };
        setup
            .ring
            .reader
            .serve(tsc.ns_to_ticks(CONSUMER_STALE_NS), patience);
        super::set_solo_if_alone(&setup.ring.reader, "ring", pid, rips.len(), sink);
        // A ring set up over budget starts thin, as the others are.
        let thin = self.budget.thin != ThinLevel::Full;
        super::set_thin(&setup.ring, &proc.patches.set, thin);
        proc.ring = Some(setup.ring);
        Ok(())
    }

    /// A task of process `pid` made a new one (its creator is stopped at the
    /// event, or the new task at its first stop, and neither has run since):
    /// the ring's producers reserve with `lock` from now on. Cleared here while
    /// the ring still has one producer thread, stopped or not inside a
    /// trampoline (it is the one creating the task), so no reservation without
    /// `lock` can race one with it. Never set again for this ring.
    pub(in crate::tracer) fn ring_many_producers(&self, pid: i32) {
        if let Some(ring) = self.procs.get(&pid).and_then(|p| p.ring.as_ref()) {
            ring.reader.set_solo(false);
        }
    }

    /// A new thread of `tid`'s process, at its first stop: note its %fs base so
    /// its ring records name it.
    pub(in crate::tracer) fn ring_thread_started(&mut self, tid: i32) {
        let Some(pid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return;
        };
        // Before it runs: its creator's event may not have been seen yet.
        self.ring_many_producers(pid);
        let Some(ring) = self.procs.get_mut(&pid).and_then(|p| p.ring.as_mut()) else {
            return;
        };
        if let Ok(regs) = ptrace::getregs(Pid::from_raw(tid)) {
            // It has run no code yet: all its records come from the head on.
            let from = ring.reader.head();
            ring.threads.started(regs.fs_base, tid, from);
        }
    }

    /// When a ring's backlog passes the high-water mark, pyprobe is falling behind:
    /// over budget, stack probes are thinned; either way the event loop polls
    /// without sleeping for a while. The target is not held: a producer that finds
    /// its ring full waits for room by itself (see the ring's producer protocol),
    /// and the time it waits is charged to the budget.
    pub(in crate::tracer) fn ring_backlog(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let backlog = self
            .procs
            .values()
            .filter_map(|p| p.ring.as_ref())
            .map(|r| r.reader.head().saturating_sub(r.reader.tail()))
            .max()
            .unwrap_or(0);
        if backlog <= HIGH_WATER {
            return;
        }
        self.thin_when_behind(sink);
        self.ring_book.busy_until_ns = monotonic_ns() + BUSY_NS;
    }

    /// A tracee stop was handled just now.
    pub(in crate::tracer) fn note_stop(&mut self) {
        self.ring_book.stopped_at_ns = monotonic_ns();
    }

    /// Whether the event loop may nap after a drain that read `drained` records
    /// (see [`CALM_BELOW`]): few were waiting, no ring was busy a moment ago, and
    /// no tracee stopped lately (its next stop would wait out the nap).
    pub(in crate::tracer) fn rings_calm(&self, drained: usize) -> bool {
        calm(drained, monotonic_ns(), &self.ring_book)
    }

    /// Turns every published ring record into a hit; returns how many, plus the
    /// records the source beside the rings read meanwhile (both zero: nothing
    /// more can be read now, which loops draining to the end wait for).
    pub(in crate::tracer) fn drain_rings(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> usize {
        self.drain_rings_of(None, sink)
    }

    /// Turns what process `pid` has published so far into hits: what a thread of
    /// it did before it stopped is recorded before what is read of it now (a
    /// sample, an `int3` hit), whose time is later.
    pub(in crate::tracer) fn drain_ring_of(&mut self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        // Up to what was published now: its other threads may run on meanwhile.
        let head = |e: &Engine| {
            e.procs
                .get(&pid)
                .and_then(|p| p.ring.as_ref())
                .map(|r| (r.reader.head(), r.reader.tail()))
        };
        let Some((target, _)) = head(self) else {
            return;
        };
        while head(self).is_some_and(|(_, tail)| tail < target) {
            if self.drain_rings_of(Some(pid), sink) == 0 {
                break; // a slot reserved, not yet published
            }
        }
    }

    /// [`drain_rings`](Self::drain_rings), for one process only (`Some`).
    fn drain_rings_of(&mut self, only: Option<i32>, sink: &mut dyn FnMut(TraceEvent)) -> usize {
        if !self.ring_active() || crate::tracer::test_switches::rings_held() {
            return 0;
        }
        let Engine {
            procs,
            hit_buffers,
            ring_book,
            source: events_beside,
            hits,
            ..
        } = self;
        let Some(tsc) = ring_book.tsc.as_mut() else {
            return 0;
        };
        tsc.refine();
        let tsc: &TscClock = tsc;
        let mut total = 0;
        let mut progress = 0;
        let mut counted_total = 0;
        let mut frames_walked = 0u64;
        let mut stacks_taken = 0u64;
        let mut waited_ns = 0u64;
        for (&pid, proc) in procs.iter_mut() {
            if only.is_some_and(|only| only != pid) {
                continue;
            }
            let Some(mut ring) = proc.ring.take() else {
                continue;
            };
            // The time of the last record read: what is counted is stamped no later,
            // so that the records still in the ring (older than now) do not come
            // after it on their thread's clock.
            let source = RecordSource {
                pid,
                probes: &proc.patches.set.probes,
                threads: &ring.threads,
                mem: &proc.mem,
                tsc,
            };
            // With the hook engine's ring too, the two are read in time order: the
            // hook's records first, this ring up to the last of them, each of this
            // ring's hits after the hook records older than it.
            let RingBound {
                tsc: bound,
                read: read_beside,
            } = events_beside
                .as_mut()
                .map_or(RingBound::NONE, |s| s.before_ring(pid, Some(tsc), sink));
            // The source moving its bound on is progress too: the records this
            // drain left as later than it may be read next time.
            progress += read_beside;
            ring.reader.set_tsc_bound(bound);
            let start = read_tsc();
            let DrainedHits {
                drained,
                last_ts_ns: last_ts,
                frames,
                stacks,
            } = drain_hits(
                &mut ring.reader,
                DRAIN_BATCH,
                &source,
                hit_buffers,
                &mut ring.known,
                |event| {
                    if bound != u64::MAX {
                        let ts_ns = match &event {
                            TraceEvent::Hit(hit) => hit.ts_ns,
                            TraceEvent::Repeat { ts_ns, .. } => *ts_ns,
                            _ => 0,
                        };
                        if let Some(s) = events_beside.as_mut() {
                            s.emit_upto(pid, ts_ns, hits, sink);
                        }
                    }
                    sink(event)
                },
            );
            ring.reader.set_tsc_bound(u64::MAX);
            if bound != u64::MAX {
                // What of this ring is older than the hook records still held has
                // been read: they follow it.
                let read_to = match drained.stop {
                    DrainStop::Empty => tsc.to_ns(start),
                    DrainStop::Later => tsc.to_ns(bound),
                    _ => last_ts.unwrap_or(0),
                };
                if let Some(s) = events_beside.as_mut() {
                    s.emit_upto(pid, read_to, hits, sink);
                }
            }
            frames_walked += frames;
            stacks_taken += stacks;
            if drained.records > 0 {
                ring.threads.forget_before(ring.reader.tail());
                sink(TraceEvent::RingDrained { pid });
            }
            for &probe in &proc.patches.set.count_when_thin {
                let counted = ring.reader.counted(probe as u32);
                let reported = ring.counted_reported.entry(probe as u32).or_insert(0);
                if counted > *reported {
                    counted_total += counted - *reported;
                    sink(TraceEvent::Counted {
                        pid,
                        probe,
                        probe_name: &proc.patches.set.probes[probe].name,
                        count: counted - *reported,
                        ts_ns: last_ts.unwrap_or_else(monotonic_ns),
                    });
                    *reported = counted;
                }
            }
            *hits += drained.records as u64;
            total += drained.records;
            if drained.records == DRAIN_BATCH {
                ring_book.busy_until_ns = monotonic_ns() + BUSY_NS;
            }
            if let DrainStop::Pending { index } = drained.stop {
                let now = monotonic_ns();
                let since = match ring_book.stuck.get(&pid) {
                    Some(&(i, t)) if i == index => t,
                    _ => {
                        ring_book.stuck.insert(pid, (index, now));
                        now
                    }
                };
                if now.saturating_sub(since) > STUCK_NS {
                    ring.reader.skip_pending();
                    ring_book.stuck.remove(&pid);
                }
            }
            // Time its stack records spent spinning for room in a full ring: the
            // target was held for pyprobe as surely as by a stop.
            let waited = ring.reader.waited_cycles();
            if waited > ring.waited_charged {
                waited_ns += tsc.ticks_to_ns(waited - ring.waited_charged);
                ring.waited_charged = waited;
            }
            let now = monotonic_ns();
            super::report_lost(&mut ring.lost, ring.reader.lost(), now, "ring", pid, sink);
            raise_let_go(pid, proc, &mut ring, now, sink);
            proc.ring = Some(ring);
        }
        self.budget.counted_since_thin += counted_total;
        self.charge_ring_events(
            total as u64 * RING_EVENT_NS
                + stacks_taken * RING_STACK_NS
                + frames_walked * RING_FRAME_NS
                + counted_total * RING_COUNT_NS
                + waited_ns,
            sink,
        );
        total + progress
    }

    /// For `-v`: how long process `pid` waited for room in its ring (said as it
    /// leaves: detached or gone).
    pub(in crate::tracer) fn say_ring_waited(&self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let ring = self.procs.get(&pid).and_then(|p| p.ring.as_ref());
        if let (Some(ring), Some(tsc)) = (ring, self.ring_book.tsc.as_ref()) {
            let waited_ns = tsc.ticks_to_ns(ring.reader.waited_cycles());
            sink(super::waited_detail("ring", pid, waited_ns));
        }
    }

    /// Leaving (every thread stopped, semaphores not yet lowered): the original
    /// bytes go back at every ring site, and the last records are read.
    pub(in crate::tracer) fn ring_detach(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let pids: Vec<i32> = self
            .procs
            .iter()
            .filter(|(_, p)| p.ring.is_some())
            .map(|(&pid, _)| pid)
            .collect();
        for &pid in &pids {
            let Some(proc) = self.procs.get_mut(&pid) else {
                continue;
            };
            if let Some(ring) = proc.ring.as_mut() {
                // Nobody follows its threads from now on (see `ring_many_producers`).
                ring.reader.set_solo(false);
                // The semaphores are pyprobe's to lower from here, but for those a
                // producer lowered already. Every letting go so far is settled
                // here: the drains below must not raise again what is taken back.
                ring.let_go_seen = ring.reader.let_go_count();
                let let_go = proc
                    .patches
                    .take_back(&ring.reader, pid, self.guardian.as_mut());
                if let_go > 0 {
                    sink(TraceEvent::Caveat {
                        pid,
                        ts_ns: monotonic_ns(),
                        text: format!(
                            "pyprobe was silent for more than {} ms (stopped, or starved of \
                             CPU), and the target lowered {let_go} of pyprobe's probe \
                             semaphores itself, as it does when pyprobe dies: the events since \
                             then are missing, not even counted as lost",
                            CONSUMER_STALE_NS / 1_000_000
                        ),
                    });
                }
                // A thread inside a trampoline finishes it and jumps back to an
                // instruction boundary of the original code: restoring is safe
                // under it.
                if let Err(e) = ring_setup::restore(&mut proc.mem, ring, self.guardian.as_mut()) {
                    sink(TraceEvent::Notice(format!(
                        "ring engine in process {pid}: restoring probe sites: {e}"
                    )));
                }
            }
        }
        while self.drain_rings(sink) > 0 {}
        // With room in the rings now, the threads held inside a trampoline finish
        // it: their records are published, not lost.
        for &pid in &pids {
            let code = self
                .procs
                .get(&pid)
                .and_then(|p| p.ring.as_ref())
                .map(|r| r.trampolines())
                .unwrap_or_default();
            self.step_out_of(pid, &code, sink);
        }
        while self.drain_rings(sink) > 0 {}
        for &pid in &pids {
            self.say_ring_waited(pid, sink);
        }
        for (&pid, proc) in self.procs.iter_mut() {
            if let Some(ring) = proc.ring.take() {
                // Producers stop waiting for room: nobody reads the ring any more.
                ring.reader.leave();
                // Slots reserved, not published: records of threads the steps
                // could not bring out of a trampoline (a signal came first), one
                // each at most (a record with its stack takes several slots).
                // Bounded: `head` is the target's to write.
                let pending_slots = ring
                    .reader
                    .head()
                    .saturating_sub(ring.reader.tail())
                    .min(ring.reader.capacity());
                let threads = self.threads.values().filter(|t| t.tgid == pid).count() as u64;
                let in_flight = pending_slots.min(threads.max(1));
                if in_flight > 0 {
                    sink(TraceEvent::Lost {
                        pid,
                        count: in_flight,
                        ts_ns: monotonic_ns(),
                    });
                }
            }
        }
    }

    /// A forked child at its first stop has copies of the parent's ring patches,
    /// which write into the parent's ring: traced on its own, its sites become
    /// `int3`s again (see [`Engine::ring_clean_released`] for a released one).
    pub(in crate::tracer) fn ring_fork(parent: Option<&Proc>, child: &mut Proc) -> Result<()> {
        let Some(ring) = parent.and_then(|p| p.ring.as_ref()) else {
            return Ok(());
        };
        ring_setup::back_to_int3(&mut child.mem, ring, &mut child.patches)?;
        Ok(())
    }

    /// A released forked child gets the original bytes back at every ring site.
    pub(in crate::tracer) fn ring_clean_released(parent: Option<&Proc>, child: i32) -> Result<()> {
        let Some(ring) = parent.and_then(|p| p.ring.as_ref()) else {
            return Ok(());
        };
        ring_setup::clean_child(&mut ProcessMemory::new(child), ring)?;
        Ok(())
    }
}

/// Producers of `proc`'s ring lowered pyprobe's semaphores, having found it
/// silent past [`CONSUMER_STALE_NS`] (stopped or starved of CPU, its guardian
/// not acting): they are raised again and the gap is kept as a caveat, since
/// the events CPython made meanwhile reached no site and were not even counted.
fn raise_let_go(
    pid: i32,
    proc: &mut Proc,
    ring: &mut RingProc,
    now: u64,
    sink: &mut dyn FnMut(TraceEvent),
) {
    let let_go = ring.reader.let_go_count();
    if let_go == ring.let_go_seen {
        return;
    }
    ring.let_go_seen = let_go;
    let silent = CONSUMER_STALE_NS / 1_000_000;
    let again = match proc.patches.raise_let_go(&ring.reader, &mut proc.mem) {
        Ok(n) => format!("{n} raised again"),
        Err(e) => format!("they could not be raised again ({e}): the recording ends there"),
    };
    sink(TraceEvent::Caveat {
        pid,
        ts_ns: now,
        text: format!(
            "pyprobe was silent for more than {silent} ms (stopped, or starved of CPU), and the \
             target lowered pyprobe's probe semaphores itself, as it does when pyprobe dies; \
             {again}: the events in between are missing, not even counted as lost"
        ),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loop_naps_only_after_a_small_drain_with_no_ring_busy_and_no_stop_lately() {
        let now = 10 * STOPPED_LATELY_NS;
        let quiet = RingBook::default();
        assert!(calm(0, now, &quiet));
        assert!(calm(CALM_BELOW - 1, now, &quiet));
        // A batch worth its costs: drain again at once.
        assert!(!calm(CALM_BELOW, now, &quiet));
        // A ring was busy a moment ago (a full batch, a backlog): keep up.
        let busy = RingBook {
            busy_until_ns: now + 1,
            ..RingBook::default()
        };
        assert!(!calm(1, now, &busy));
        // A tracee stopped lately: its next stop must not wait out a nap.
        let stopped = RingBook {
            stopped_at_ns: now - STOPPED_LATELY_NS,
            ..RingBook::default()
        };
        assert!(!calm(1, now, &stopped));
        let long_ago = RingBook {
            stopped_at_ns: now - STOPPED_LATELY_NS - 1,
            ..RingBook::default()
        };
        assert!(calm(1, now, &long_ago));
    }
}
