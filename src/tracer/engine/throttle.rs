//! The engine's side of the overhead budget: charging stopped time, and turning the
//! budgeted probes off and on in every traced process.

use super::{Engine, TraceEvent};
use crate::tracer::budget::{Budget, Toggle};
use crate::tracer::signals::monotonic_ns;

impl Engine {
    /// Probes were installed in `pid`: start the budget at the first budgeted
    /// probes, and keep a process installed while probes are off in step.
    pub(super) fn budget_installed(&mut self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let Some(max) = self.options.max_overhead else {
            return;
        };
        let has_budgeted = self
            .procs
            .get(&pid)
            .is_some_and(|p| !p.patches.set.budgeted.is_empty());
        if !has_budgeted {
            return;
        }
        match &self.budget {
            None => {
                let now = monotonic_ns();
                self.budget = Some(Budget::new(max, now));
                sink(TraceEvent::Window {
                    pid: self.root,
                    ts_ns: now,
                    exact: true,
                });
            }
            Some(b) if !b.exact() => {
                if let Some(proc) = self.procs.get_mut(&pid).filter(|p| !p.shares_parent_memory) {
                    if let Err(e) = proc
                        .patches
                        .pause_budgeted(&mut proc.mem, self.guardian.as_mut())
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
    pub(super) fn charge(&mut self, ns: u64) {
        if let Some(b) = self.budget.as_mut() {
            b.stopped(ns);
        }
    }

    /// Resumes `tid` after a hit, charging the stop: what pyprobe spent since the
    /// wait returned, plus the kernel's estimated share.
    pub(super) fn resume_after_budgeted_hit(&mut self, tid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let stopped_seen = self.last_wait_ns;
        if let Some(&resumed) = self.resumed_ns.get(&tid) {
            self.kernel_cost.gap(resumed, stopped_seen);
        }
        self.resume(tid, None);
        let now = monotonic_ns();
        self.resumed_ns.insert(tid, now);
        let kernel = self.kernel_cost.estimate();
        self.charge(now.saturating_sub(stopped_seen).saturating_add(kernel));
        self.poll_budget(sink);
    }

    /// Lets the budget decide, and applies its decision to every process.
    pub(super) fn poll_budget(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let now = monotonic_ns();
        let Some(toggle) = self.budget.as_mut().and_then(|b| b.poll(now)) else {
            return;
        };
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
            let result = match toggle {
                Toggle::Off => proc.patches.pause_budgeted(&mut proc.mem, guard),
                Toggle::On => proc.patches.resume_budgeted(&mut proc.mem, guard),
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
            self.resumed_ns.clear();
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

    /// Blocking samples alone would hold the target above the budget's resume line:
    /// from now on samples are taken without stopping it (as `--nonblocking`), so
    /// their cost leaves the budget and exact windows can open again.
    pub(super) fn unblock_costly_samples(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let Some(b) = self.budget.as_ref() else {
            return;
        };
        if !b.samples_too_costly() {
            return;
        }
        self.samples_unblocked = true;
        let (_, mean_ns) = b.sample_cost();
        let interval = self.options.sample_interval_ns.unwrap_or(1).max(1);
        sink(TraceEvent::Notice(format!(
            "overhead budget: stopping the target for a sample costs it {} µs, {:.1}% of its \
             time at this rate, more than the budget leaves for exact windows; sampling on \
             without stopping it (as --nonblocking)",
            mean_ns / 1000,
            mean_ns as f64 * 100.0 / interval as f64
        )));
    }

    /// The overhead budget's outcome, if one was in force.
    pub fn budget_summary(&self) -> Option<BudgetSummary> {
        self.budget.as_ref().map(|b| {
            let (blocking_samples, sample_mean_ns) = b.sample_cost();
            BudgetSummary {
                exact_fraction: b.exact_fraction(monotonic_ns()),
                windows: b.windows(),
                blocking_samples,
                sample_mean_ns,
                samples_unblocked: self.samples_unblocked,
            }
        })
    }
}

/// What the overhead budget did in a run, for its closing line.
#[derive(Debug, Clone, Copy)]
pub struct BudgetSummary {
    /// Share of the run with the budgeted probes on.
    pub exact_fraction: f64,
    /// Exact windows opened (the first one included).
    pub windows: u64,
    /// Samples that stopped the target between windows, and their mean cost.
    pub blocking_samples: u64,
    pub sample_mean_ns: u64,
    /// Whether sampling went on without stopping the target (too costly).
    pub samples_unblocked: bool,
}
