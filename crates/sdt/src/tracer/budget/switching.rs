//! The engine's side of the overhead budget: charging stopped time, and turning the
//! budgeted probes off and on in every traced process.

use std::collections::HashMap;

use super::calibrate;
use super::stop_cost::{predicted_stop_ns, OwnSchedule};
use super::{Budget, KernelCost, StormMeter, Toggle};
use crate::tracer::clock::monotonic_ns;
use crate::tracer::engine::ThinLevel;
use crate::tracer::engine::{Engine, TraceEvent};
use crate::tracer::ring_engine::{set_thin, RING_COUNT_NS};

/// How long thinned recording is measured before its cost decides whether the
/// audit probe must go off.
const UNCOUNT_AFTER_NS: u64 = 2_000_000;
/// The audit probe stays off at least this long (doubling each time counting
/// proves too costly again).
const UNCOUNTED_FOR_NS: u64 = 100_000_000;

/// The engine's side of the overhead budget, in one place: the budget, the kernel's
/// share of a stop, the timing of stops, and how the ring's stack probes are thinned.
pub(in crate::tracer) struct BudgetBook {
    /// The budget itself, once budgeted probes are installed, or at the first
    /// tick where no traced process has probes at all (`samples_only`).
    pub(in crate::tracer) meter: Option<Budget>,
    /// The meter holds only the sample stops: no traced process has probes (a
    /// CPython built without them). Probes installed later start it afresh.
    pub(in crate::tracer) samples_only: bool,
    /// Ring set-up done during the current stop (not charged to the budget), and
    /// over the whole run.
    pub(in crate::tracer) setup_in_stop_ns: u64,
    pub(in crate::tracer) setup_total_ns: u64,
    /// Times counting thinned audit events proved too costly since stacks were
    /// last on.
    pub(in crate::tracer) uncount_strikes: u32,
    /// Events counted in the target since thinning last changed.
    pub(in crate::tracer) counted_since_thin: u64,
    /// Thinned to counts, counting has been measured to fit in the budget: the
    /// stacks may come back.
    pub(in crate::tracer) counting_fits: bool,
    /// Over budget: how stack probes record, and since when.
    pub(in crate::tracer) thin: ThinLevel,
    pub(in crate::tracer) thinned_at: u64,
    pub(in crate::tracer) kernel_cost: KernelCost,
    /// When the current wait status was collected (budget accounting).
    pub(in crate::tracer) last_wait_ns: u64,
    /// When each thread was last resumed after a hit (budget accounting).
    pub(in crate::tracer) resumed_ns: HashMap<i32, u64>,
    /// Blocking samples cost more than the budget leaves: sample without stopping.
    pub(in crate::tracer) samples_unblocked: bool,
    /// Times pyprobe's holds on the target as the target pays for them.
    pub(in crate::tracer) own_schedule: OwnSchedule,
    /// The ring events' cost over the last short span.
    pub(in crate::tracer) storm: StormMeter,
    /// Function (or line) probes were put under the budget in some process, which
    /// may have ended since: what the closing line speaks of.
    pub(in crate::tracer) traced_functions: bool,
}

impl BudgetBook {
    pub(in crate::tracer) fn new(max_overhead: Option<f64>) -> BudgetBook {
        BudgetBook {
            meter: None,
            samples_only: false,
            thin: ThinLevel::Full,
            thinned_at: 0,
            setup_in_stop_ns: 0,
            setup_total_ns: 0,
            uncount_strikes: 0,
            counted_since_thin: 0,
            counting_fits: false,
            // Measured before touching the target, so it pays nothing for it.
            kernel_cost: match max_overhead {
                Some(_) => calibrate::stop_cycle_ns()
                    .map(KernelCost::calibrated)
                    .unwrap_or_default(),
                None => KernelCost::default(),
            },
            last_wait_ns: 0,
            resumed_ns: HashMap::new(),
            samples_unblocked: false,
            own_schedule: OwnSchedule::default(),
            storm: StormMeter::default(),
            traced_functions: false,
        }
    }
}

impl Engine {
    /// Probes were installed in `pid`: start the budget at the first budgeted
    /// probes, and keep a process installed while probes are off in step.
    pub(in crate::tracer) fn budget_installed(
        &mut self,
        pid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(max) = self.options.max_overhead else {
            return;
        };
        // Function and line probes go off over budget; stacks of GC, import and
        // audit events are left out.
        let Some(set) = self.procs.get(&pid).map(|p| &p.patches.set) else {
            return;
        };
        let budgeted = !set.budgeted.is_empty();
        if !budgeted && set.stack_probes.is_empty() && set.needs_stop.is_empty() {
            return;
        }
        self.budget.traced_functions |= budgeted;
        if std::mem::take(&mut self.budget.samples_only) {
            self.budget.meter = None;
        }
        match &self.budget.meter {
            None => {
                let now = monotonic_ns();
                self.budget.meter = Some(Budget::new(max, now));
                if budgeted {
                    sink(TraceEvent::Window {
                        pid: self.root,
                        ts_ns: now,
                        exact: true,
                    });
                }
            }
            Some(b) if !b.exact() => {
                if let Some(proc) = self.procs.get_mut(&pid).filter(|p| !p.shares_parent_memory) {
                    let ring = proc.ring.as_ref().map(|r| &r.reader);
                    if let Err(e) =
                        proc.patches
                            .pause_budgeted(&mut proc.mem, self.guardian.as_mut(), ring)
                    {
                        sink(TraceEvent::Notice(format!(
                            "process {pid}: cannot turn the function probes off for the overhead \
                             budget ({e})"
                        )));
                    }
                }
            }
            Some(_) => {}
        }
    }

    /// The target was stopped `ns` for pyprobe.
    pub(in crate::tracer) fn charge(&mut self, ns: u64) {
        if let Some(b) = self.budget.meter.as_mut() {
            b.stopped(ns);
        }
    }

    /// The ring events just read cost the target `ns`: charged, and where the
    /// stacks are all the budget governs, a storm of them (see [`StormMeter`])
    /// thins the stacks at once.
    pub(in crate::tracer) fn charge_ring_events(
        &mut self,
        ns: u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.charge(ns);
        let Some(max) = self.budget.meter.as_ref().map(Budget::max) else {
            return;
        };
        // Which processes have budgeted probes is asked of a storm only: this
        // runs at every drain.
        if self.budget.storm.charge(ns, monotonic_ns(), max)
            && !self
                .procs
                .values()
                .any(|p| !p.patches.set.budgeted.is_empty())
        {
            self.thin_when_behind(sink);
        }
    }

    /// Resumes `tid` after a hit, charging the stop: what pyprobe spent since the
    /// wait returned, plus the kernel's estimated share.
    pub(in crate::tracer) fn resume_after_budgeted_hit(
        &mut self,
        tid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let stopped_seen = self.budget.last_wait_ns;
        if let Some(&resumed) = self.budget.resumed_ns.get(&tid) {
            self.budget.kernel_cost.gap(resumed, stopped_seen);
        }
        self.resume(tid, None);
        let now = monotonic_ns();
        self.budget.resumed_ns.insert(tid, now);
        let kernel = self.budget.kernel_cost.estimate();
        let setup = std::mem::take(&mut self.budget.setup_in_stop_ns);
        self.budget.setup_total_ns += setup;
        let stopped = now.saturating_sub(stopped_seen).saturating_sub(setup);
        self.charge(stopped.saturating_add(kernel));
        self.poll_budget(sink);
    }

    /// Lets the budget decide, and applies its decision to every process.
    pub(in crate::tracer) fn poll_budget(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let now = monotonic_ns();
        let Some(toggle) = self.budget.meter.as_mut().and_then(|b| b.poll(now)) else {
            self.uncount_if_still_over(now, sink);
            return;
        };
        let sets = || self.procs.values().map(|p| &p.patches.set);
        let budgeted = sets().any(|s| !s.budgeted.is_empty());
        let stacked = sets().any(|s| !s.stack_probes.is_empty() || !s.needs_stop.is_empty());
        if stacked {
            let level = match toggle {
                Toggle::Off => ThinLevel::Stackless,
                // Down one step at a time: counting again first, stacks only once
                // counting has shown to fit.
                Toggle::On if self.budget.thin == ThinLevel::Uncounted && !budgeted => {
                    if let Some(b) = self.budget.meter.as_mut() {
                        b.stay_off();
                    }
                    // Counting did not fit the last times: try it again later and
                    // later (100 ms, doubling), so that its trials stay a small
                    // share of the run.
                    let wait = UNCOUNTED_FOR_NS << self.budget.uncount_strikes.min(6);
                    if now.saturating_sub(self.budget.thinned_at) < wait {
                        return;
                    }
                    ThinLevel::Stackless
                }
                Toggle::On
                    if self.budget.thin == ThinLevel::Stackless
                        && !self.budget.counting_fits
                        && !budgeted =>
                {
                    // Not yet shown to fit: the count decides first.
                    if let Some(b) = self.budget.meter.as_mut() {
                        b.stay_off();
                    }
                    self.uncount_if_still_over(now, sink);
                    return;
                }
                Toggle::On => ThinLevel::Full,
            };
            self.thin_stacks(level, now, sink);
        }
        if budgeted {
            self.toggle_budgeted(toggle, now, sink);
        }
    }

    /// Sets how GC, import and audit events are recorded in every process: with
    /// their stacks, or without (rings are told so, and hits on `int3` are not
    /// walked); audit probes paused by [`Self::uncount_if_still_over`] come back
    /// with the stacks.
    fn thin_stacks(&mut self, level: ThinLevel, now: u64, sink: &mut dyn FnMut(TraceEvent)) {
        if level < ThinLevel::Uncounted && self.budget.thin == ThinLevel::Uncounted {
            for (&pid, proc) in self.procs.iter_mut() {
                if proc.shares_parent_memory {
                    continue; // switched with its parent's
                }
                let guard = self.guardian.as_mut();
                let ring = proc.ring.as_ref().map(|r| &r.reader);
                if let Err(e) = proc.patches.resume_budgeted(&mut proc.mem, guard, ring) {
                    sink(TraceEvent::Notice(format!(
                        "process {pid}: cannot turn the audit probe back on ({e})"
                    )));
                }
            }
        }
        self.budget.thin = level;
        self.budget.counting_fits = false;
        self.budget.thinned_at = now;
        self.budget.counted_since_thin = 0;
        for proc in self.procs.values() {
            if let Some(ring) = &proc.ring {
                set_thin(ring, &proc.patches.set, level != ThinLevel::Full);
            }
        }
        sink(TraceEvent::Thinning {
            pid: self.root,
            ts_ns: now,
            level,
        });
    }

    /// A ring's backlog is high, or its events are a storm. Under a budget whose
    /// stacks are still on, the stack records are what pyprobe cannot keep up with
    /// or the target afford: thin them now rather than let the target wait for
    /// room while the backlog is named (tens of ms for a ring of stacks), and
    /// hold the next window off (see [`Budget::back_off`]). Returns whether it did.
    pub(in crate::tracer) fn thin_when_behind(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> bool {
        let stacked = self
            .procs
            .values()
            .any(|p| !p.patches.set.stack_probes.is_empty());
        let Some(budget) = self.budget.meter.as_mut() else {
            return false;
        };
        if self.budget.thin != ThinLevel::Full || !stacked {
            return false;
        }
        let now = monotonic_ns();
        budget.back_off(now);
        self.thin_stacks(ThinLevel::Stackless, now, sink);
        true
    }

    /// Thinned, and still over budget a while later: counting the audit storm
    /// alone costs more than the budget (a `lock inc` per event is a good
    /// share of an `id()` call). Its probe goes off until the budget recovers.
    fn uncount_if_still_over(&mut self, now: u64, sink: &mut dyn FnMut(TraceEvent)) {
        let since = now.saturating_sub(self.budget.thinned_at);
        if self.budget.thin != ThinLevel::Stackless || since < UNCOUNT_AFTER_NS {
            return;
        }
        // What counting costs, from the events counted since thinning began (the
        // budget's stopped time still carries the backlog of stack records), is
        // allowed half the budget: samples and the other probes need the rest.
        let counting = self.budget.counted_since_thin as f64 * RING_COUNT_NS as f64 / since as f64;
        // Storm probes left on int3 stop the target at every event, stack or not:
        // their cost is what the budget measured.
        let stopping = self.procs.values().any(|p| {
            let set = &p.patches.set;
            set.count_when_thin
                .iter()
                .any(|i| set.needs_stop.contains(i))
        });
        if !self
            .budget
            .meter
            .as_ref()
            .is_some_and(|b| counting > b.max() / 2.0 || (stopping && b.slowdown() > b.max()))
        {
            // Counting fits: stacks may come back, and a later storm starts its
            // waits afresh.
            self.budget.counting_fits = true;
            self.budget.uncount_strikes = 0;
            return;
        }
        let mut paused = 0;
        for (&pid, proc) in self.procs.iter_mut() {
            if proc.shares_parent_memory {
                continue; // switched with its parent's
            }
            let guard = self.guardian.as_mut();
            let ring = proc.ring.as_ref().map(|r| &r.reader);
            match proc.patches.pause_counted(&mut proc.mem, guard, ring) {
                Ok(n) => paused += n,
                Err(e) => sink(TraceEvent::Notice(format!(
                    "process {pid}: cannot turn the audit probe off for the overhead budget ({e})"
                ))),
            }
        }
        if paused > 0 {
            self.budget.uncount_strikes += 1;
            self.budget.thin = ThinLevel::Uncounted;
            sink(TraceEvent::Thinning {
                pid: self.root,
                ts_ns: now,
                level: ThinLevel::Uncounted,
            });
        }
    }

    /// Turns the budgeted (function, line) probes off or on in every process.
    fn toggle_budgeted(&mut self, toggle: Toggle, now: u64, sink: &mut dyn FnMut(TraceEvent)) {
        // Turning the entry and return semaphores one after the other would let the
        // target run calls with only one of them on: returns without entry at every
        // window's start (hundreds through the ring, which never stops it). Stopped,
        // it sees them switch together.
        if let Err(e) = self.stop_all_running(sink) {
            self.fatal = Some(e);
            return;
        }
        let mut pids: Vec<i32> = self.procs.keys().copied().collect();
        pids.sort_unstable();
        for pid in pids {
            let Some(proc) = self.procs.get_mut(&pid) else {
                continue;
            };
            if proc.shares_parent_memory {
                continue; // switched with its parent's
            }
            let guard = self.guardian.as_mut();
            let ring = proc.ring.as_ref().map(|r| &r.reader);
            let result = match toggle {
                Toggle::Off => proc.patches.pause_budgeted(&mut proc.mem, guard, ring),
                Toggle::On => proc.patches.resume_budgeted(&mut proc.mem, guard, ring),
            };
            if let Err(e) = result {
                sink(TraceEvent::Notice(format!(
                    "process {pid}: cannot turn the function probes {} ({e})",
                    if toggle == Toggle::On { "on" } else { "off" }
                )));
            }
        }
        if toggle == Toggle::Off {
            // Gaps measured across an off stretch are not kernel time.
            self.budget.resumed_ns.clear();
            // What the rings hold was published inside the window: record it
            // before the window's end.
            while self.drain_rings(sink) > 0 {}
        }
        self.resume_all();
        self.charge(monotonic_ns().saturating_sub(now));
        sink(TraceEvent::Window {
            pid: self.root,
            ts_ns: now,
            exact: toggle == Toggle::On,
        });
    }

    /// The budget holds the sample stops too where no process has probes for it
    /// (a CPython built without them, as most are): started at the first tick at
    /// which every traced process was found to have none. Without it, stopping
    /// 300 threads at every tick held a server 8 ms a time, whatever it cost.
    pub(in crate::tracer) fn budget_sample_stops(&mut self) {
        let Some(max) = self.options.max_overhead else {
            return;
        };
        if self.budget.meter.is_some() || !self.options.blocking_samples {
            return;
        }
        let probeless = |p: &crate::tracer::engine::Proc| {
            let set = &p.patches.set;
            !p.awaiting_object
                && set.budgeted.is_empty()
                && set.stack_probes.is_empty()
                && set.needs_stop.is_empty()
        };
        if !self.procs.is_empty() && self.procs.values().all(probeless) {
            self.budget.meter = Some(Budget::new(max, monotonic_ns()));
            self.budget.samples_only = true;
        }
    }

    /// Before the first blocking sample: a process with thousands of threads takes
    /// tens of ms to stop, so the three stops that would measure it would alone break
    /// the budget (2,000 idle threads: 50 ms each, 8 % of a 2 s run). Predicted from
    /// the largest process's thread count (see [`predicted_stop_ns`]): samples go
    /// on without stopping it from the start, as [`Self::unblock_costly_samples`]
    /// decides later on measured stops.
    pub(in crate::tracer) fn unblock_samples_of_many_threads(
        &mut self,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let interval = self.options.sample_interval_ns.unwrap_or(1).max(1);
        let Some(b) = self.budget.meter.as_ref() else {
            return;
        };
        if self.options.keep_sample_stops || b.sample_cost().0 > 0 {
            return;
        }
        let mut per_process: HashMap<i32, usize> = HashMap::new();
        for t in self.threads.values() {
            *per_process.entry(t.tgid).or_insert(0) += 1;
        }
        let threads = per_process.values().copied().max().unwrap_or(0);
        let Some(ns) = predicted_stop_ns(threads) else {
            return;
        };
        if !b.stop_too_costly(ns, interval) {
            return;
        }
        self.budget.samples_unblocked = true;
        sink(TraceEvent::Notice(format!(
            "overhead budget: stopping {threads} threads for a sample would hold the \
             target at least {} ms each time, more than the budget allows at this rate; \
             sampling without stopping it (as --nonblocking; stacks may mix moments)",
            ns / 1_000_000
        )));
    }

    /// Blocking samples alone would hold the target above the budget's resume line:
    /// from now on samples are taken without stopping it (as `--nonblocking`), so
    /// their cost leaves the budget and exact windows can open again.
    pub(in crate::tracer) fn unblock_costly_samples(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let interval = self.options.sample_interval_ns.unwrap_or(1).max(1);
        let Some(b) = self.budget.meter.as_ref() else {
            return;
        };
        // Native frames are read from stopped threads only: with `--native` the
        // stops stay, and the closing line says what they cost.
        if self.options.keep_sample_stops || !b.samples_too_costly(interval) {
            return;
        }
        self.budget.samples_unblocked = true;
        let steady_ns = b.steady_sample_ns().unwrap_or(0);
        let leaves = match self.budget.samples_only {
            true => "allows",
            false => "leaves for exact windows",
        };
        sink(TraceEvent::Notice(format!(
            "overhead budget: stopping the target for a sample costs it {} µs in steady \
             state, {:.1}% of its time at this rate, more than the budget {leaves}; sampling \
             on without stopping it (as --nonblocking; lower -r to keep the stops)",
            steady_ns / 1000,
            steady_ns as f64 * 100.0 / interval as f64
        )));
    }

    /// The overhead budget's outcome, if one was in force.
    pub fn budget_summary(&self) -> Option<BudgetSummary> {
        self.budget.meter.as_ref().map(|b| {
            let (blocking_samples, sample_mean_ns) = b.sample_cost();
            let interval = self.options.sample_interval_ns.unwrap_or(1).max(1);
            let now = monotonic_ns();
            BudgetSummary {
                exact_fraction: b.exact_fraction(now),
                slowdown: b.overall_slowdown(now),
                setup_ns: self.budget.setup_total_ns + self.budget.setup_in_stop_ns,
                traced_functions: self.budget.traced_functions,
                samples_only: self.budget.samples_only,
                windows: b.windows(),
                blocking_samples,
                sample_mean_ns,
                sample_steady_ns: b.steady_sample_ns(),
                samples_too_costly: b.samples_too_costly(interval),
                samples_unblocked: self.budget.samples_unblocked,
            }
        })
    }
}

/// What the overhead budget did in a run, for its closing line.
#[derive(Debug, Clone, Copy)]
pub struct BudgetSummary {
    /// Share of the run with the budgeted probes on (or, without function
    /// probes, with the stacks of GC, import and audit events recorded).
    pub exact_fraction: f64,
    /// Time the target was stopped for pyprobe over the time it ran, whole run.
    pub slowdown: f64,
    /// Stopped once per process to set up the ring (not in `slowdown`).
    pub setup_ns: u64,
    /// Function (or line) probes were under the budget, not only stacks.
    pub traced_functions: bool,
    /// No probes were: the budget held the sample stops alone.
    pub samples_only: bool,
    /// Exact windows opened (the first one included).
    pub windows: u64,
    /// Samples that stopped the target between windows, and their mean cost.
    pub blocking_samples: u64,
    pub sample_mean_ns: u64,
    /// Their steady cost (the median of the recent ones, past the warm-up).
    pub sample_steady_ns: Option<u64>,
    /// Whether that cost alone takes most of the budget at the sampling rate.
    pub samples_too_costly: bool,
    /// Whether sampling went on without stopping the target (too costly).
    pub samples_unblocked: bool,
}
