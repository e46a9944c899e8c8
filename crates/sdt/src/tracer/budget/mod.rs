//! The overhead budget (`--max-overhead`): how much the target may be slowed by the
//! time it spends stopped for pyprobe, and when the costly probes must go off.
//!
//! Slowdown is measured as time stopped over time run, in a decaying window (time
//! constant [`HORIZON_NS`]), so a burst of calls cannot be paid for with an idle
//! hour before it. Above the budget the budgeted probes (function entry/return,
//! line) go off and the target is sampled; once the slowdown has decayed below
//! [`RESUME_AT`] of the budget they go on again, for an exact window. On a
//! call-heavy target this settles into short exact windows (tens of ms) between
//! longer sampled stretches, averaging no more than the budget.
//!
//! The cost of one probe hit is what pyprobe sees (waitpid return to PTRACE_CONT)
//! plus the kernel's part (trap, wake-up of pyprobe, resume), which pyprobe cannot
//! time on the target: [`KernelCost`] takes it from a calibration (a child of
//! pyprobe hitting breakpoints, see `calibrate`) or, when the machine is busier
//! than then, from the shortest gap between resuming a thread and its next stop.

//!
//! `driver` is the engine's side (charging stopped time, turning the budgeted
//! probes off and on, thinning the ring's stack probes); `calibrate` measures the
//! kernel's share of a stop.

pub mod calibrate;
pub(crate) mod stop_cost;
mod switching;

use stop_cost::StopCosts;
pub(in crate::tracer) use switching::BudgetBook;
pub use switching::BudgetSummary;

/// Time constant of the decaying window.
pub(crate) const HORIZON_NS: f64 = 0.5e9;
/// Probes come back on when the slowdown is below this share of the budget.
pub(crate) const RESUME_AT: f64 = 0.8;
/// At most this often the controller re-evaluates (it runs on the hot path).
const POLL_NS: u64 = 1_000_000;
/// After a window cut short, the next waits this long, doubled for each window
/// cut short in a row, at most [`MAX_BACK_OFFS`] times (6.4 s).
pub(crate) const BACK_OFF_NS: u64 = 50_000_000;
const MAX_BACK_OFFS: u32 = 7;
/// A window open this long before it is cut short resets the waits.
const LASTED_NS: u64 = 1_000_000_000;

/// What the controller wants done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Toggle {
    /// Lower the budgeted probes' semaphores: sample instead.
    Off,
    /// Raise them again: an exact window starts.
    On,
}

/// Decides when the budgeted probes are on, from the stopped time it is told about.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    /// Allowed slowdown (0.05 for 5 %).
    max: f64,
    exact: bool,
    /// Decayed sums of stopped time and of elapsed time.
    stopped_acc: f64,
    elapsed_acc: f64,
    /// Stopped time told since the last poll.
    new_stopped: u64,
    /// Blocking samples taken and the time they stopped the target, for the summary.
    samples: u64,
    sampled_total: u64,
    last_poll: u64,
    /// Totals for the report: time with the probes on, and all time.
    exact_since: Option<u64>,
    exact_total: u64,
    start: u64,
    windows: u64,
    /// Stopped time charged over the whole run (clamped as in `poll`).
    stopped_total: u64,
    /// The recent blocking samples' costs, for their steady cost.
    stop_costs: StopCosts,
    /// After [`Budget::back_off`], no window opens before this time.
    hold_until: u64,
    /// Windows cut short in a row, each holding the next one off twice as long.
    cut_short: u32,
}

impl Budget {
    /// A budget of `max` slowdown (fraction), starting at `now` with probes on.
    pub fn new(max: f64, now: u64) -> Budget {
        Budget {
            max: max.max(1e-6),
            exact: true,
            stopped_acc: 0.0,
            // As if the target had run one horizon untouched before: the first
            // exact window is not cut short by an empty history.
            elapsed_acc: HORIZON_NS,
            new_stopped: 0,
            samples: 0,
            sampled_total: 0,
            last_poll: now,
            exact_since: Some(now),
            exact_total: 0,
            start: now,
            windows: 1,
            stopped_total: 0,
            stop_costs: StopCosts::default(),
            hold_until: 0,
            cut_short: 0,
        }
    }

    /// Goes off without waiting for the slowdown to show it (the caller knows
    /// better: a backlog it cannot keep up with), or takes back an `On` just given
    /// (the caller came down one step of its own ladder instead): the slowdown
    /// must recover before the next `On`.
    pub(crate) fn stay_off(&mut self) {
        if self.exact {
            self.exact = false;
            self.exact_since = None;
            self.windows = self.windows.saturating_sub(1);
        }
    }

    /// Ends the window at `now` because the caller cannot keep up with it (a ring
    /// backlog), whatever the slowdown says: a cost the slowdown has not seen yet.
    /// The next window waits [`BACK_OFF_NS`], twice as long for each window cut
    /// short in a row, so that a storm no window can afford costs less and less.
    pub(crate) fn back_off(&mut self, now: u64) {
        if self.exact {
            self.exact = false;
            if let Some(since) = self.exact_since.take() {
                self.exact_total += now.saturating_sub(since);
                // A window that lasted was not cut short by the same storm: a
                // new one starts its waits afresh.
                if now.saturating_sub(since) >= LASTED_NS {
                    self.cut_short = 0;
                }
            }
        }
        self.hold_until = now.saturating_add(BACK_OFF_NS << self.cut_short.min(MAX_BACK_OFFS));
        self.cut_short = self.cut_short.saturating_add(1);
    }

    /// The slowdown allowed (0.05 for 5 %).
    pub(crate) fn max(&self) -> f64 {
        self.max
    }

    /// Whether the budgeted probes are on now.
    pub(crate) fn exact(&self) -> bool {
        self.exact
    }

    /// The target was stopped `ns` for pyprobe (a hit, a sample).
    pub fn stopped(&mut self, ns: u64) {
        self.new_stopped = self.new_stopped.saturating_add(ns);
    }

    /// A blocking sample stopped the target `ns`.
    pub(crate) fn sampled(&mut self, ns: u64) {
        self.stopped(ns);
        self.samples += 1;
        self.sampled_total = self.sampled_total.saturating_add(ns);
        self.stop_costs.push(ns);
    }

    /// The slowdown over the decaying window: stopped time over time run.
    pub fn slowdown(&self) -> f64 {
        self.share(self.stopped_acc)
    }

    fn share(&self, stopped: f64) -> f64 {
        let run = (self.elapsed_acc - self.stopped_acc).max(1.0);
        stopped / run
    }

    /// Whether blocking samples every `interval_ns` would alone take more than
    /// the share of the budget below which the probes come back: exact windows
    /// would seldom open, and the samples themselves may break the budget. Judged
    /// on their steady cost (see [`stop_cost`]), never on the warm-up's.
    pub fn samples_too_costly(&self, interval_ns: u64) -> bool {
        self.steady_sample_ns()
            .is_some_and(|ns| ns as f64 >= interval_ns.max(1) as f64 * self.max * RESUME_AT)
    }

    /// Whether a blocking sample predicted to cost `ns` would be too costly at
    /// every `interval_ns`, as [`samples_too_costly`](Self::samples_too_costly)
    /// judges a measured cost.
    pub(crate) fn stop_too_costly(&self, ns: u64, interval_ns: u64) -> bool {
        ns as f64 >= interval_ns.max(1) as f64 * self.max * RESUME_AT
    }

    /// The steady cost of a blocking sample, once past the warm-up.
    pub(crate) fn steady_sample_ns(&self) -> Option<u64> {
        self.stop_costs.steady_ns()
    }

    /// `(count, mean ns)` of the blocking samples charged so far.
    pub(crate) fn sample_cost(&self) -> (u64, u64) {
        (
            self.samples,
            self.sampled_total.checked_div(self.samples).unwrap_or(0),
        )
    }

    /// Re-evaluates at `now` (cheap when called more often than every ms).
    pub(crate) fn poll(&mut self, now: u64) -> Option<Toggle> {
        let dt = now.saturating_sub(self.last_poll);
        if dt < POLL_NS {
            return None;
        }
        self.last_poll = now;
        let decay = (-(dt as f64) / HORIZON_NS).exp();
        // Stopped time cannot exceed elapsed time (a stop counted twice, a clock
        // step): clamp so the ratio stays meaningful.
        let stopped = (self.new_stopped as f64).min(dt as f64);
        self.new_stopped = 0;
        self.stopped_total = self.stopped_total.saturating_add(stopped as u64);
        self.stopped_acc = self.stopped_acc * decay + stopped;
        self.elapsed_acc = self.elapsed_acc * decay + dt as f64;
        let slowdown = self.slowdown();
        if self.exact && slowdown > self.max {
            self.exact = false;
            // It ran its course: the next one need not wait longer than the slowdown says.
            self.cut_short = 0;
            if let Some(since) = self.exact_since.take() {
                self.exact_total += now.saturating_sub(since);
            }
            return Some(Toggle::Off);
        }
        if !self.exact && slowdown < self.max * RESUME_AT && now >= self.hold_until {
            self.exact = true;
            self.exact_since = Some(now);
            self.windows += 1;
            return Some(Toggle::On);
        }
        None
    }

    /// Share of the time since the start with the budgeted probes on.
    pub fn exact_fraction(&self, now: u64) -> f64 {
        let total = now.saturating_sub(self.start);
        if total == 0 {
            return 1.0;
        }
        let open = self.exact_since.map_or(0, |s| now.saturating_sub(s));
        ((self.exact_total + open) as f64 / total as f64).min(1.0)
    }

    /// Slowdown over the whole run so far: time stopped for pyprobe over time run.
    pub(crate) fn overall_slowdown(&self, now: u64) -> f64 {
        let total = now.saturating_sub(self.start);
        let run = total.saturating_sub(self.stopped_total).max(1);
        self.stopped_total as f64 / run as f64
    }

    /// Exact windows opened so far (the first one included).
    pub fn windows(&self) -> u64 {
        self.windows
    }
}

/// Catches a storm of ring events as it begins. The budget's slowdown is a
/// decaying average that starts as if the target had run one horizon untouched, so
/// a storm that starts with the recording (or after a quiet while) would be
/// recorded in full for tens of ms before the average showed it: a program
/// calling `id()` a million times would run half again as long. Here the cost of
/// the ring events over each short span is compared with the budget directly.
#[derive(Debug, Clone, Default)]
pub(crate) struct StormMeter {
    since: u64,
    charged: u64,
}

/// The span over which a storm is judged.
pub(crate) const STORM_SPAN_NS: u64 = 1_000_000;
/// Ring events costing this many times the budget over a span are a storm.
const STORM_FACTOR: f64 = 4.0;

impl StormMeter {
    /// Ring events costing `ns` were charged at `now`; returns whether those of the
    /// span just ended cost more than [`STORM_FACTOR`] times the budget `max`.
    pub(crate) fn charge(&mut self, ns: u64, now: u64, max: f64) -> bool {
        if self.since == 0 || now < self.since {
            self.since = now;
        }
        self.charged = self.charged.saturating_add(ns);
        let span = now - self.since;
        if span < STORM_SPAN_NS {
            return false;
        }
        let storm = self.charged as f64 > span as f64 * max * STORM_FACTOR;
        self.since = now;
        self.charged = 0;
        storm
    }
}

/// Estimates the kernel's share of one ptrace stop: the calibrated cycle, or the
/// shortest gap within an epoch between resuming a thread and seeing it stop
/// again, whichever is larger. With back-to-back hits that gap is nearly all
/// kernel (and follows the machine's load); with sparse hits it is larger than
/// the kernel's share, which errs towards less overhead.
#[derive(Debug, Clone)]
pub(crate) struct KernelCost {
    epoch_start: u64,
    epoch_min: u64,
    epoch_samples: u64,
    gap_estimate: u64,
    calibrated: u64,
}

/// One epoch of gap measurements.
const EPOCH_NS: u64 = 1_000_000_000;
/// An epoch with fewer gaps than this keeps the previous estimate.
const MIN_SAMPLES: u64 = 100;
/// Before any measurement: a typical stop on a small VM.
const DEFAULT_KERNEL_NS: u64 = 20_000;
/// A gap longer than this is the target running, not the kernel.
const MAX_KERNEL_NS: u64 = 500_000;

impl Default for KernelCost {
    fn default() -> Self {
        KernelCost {
            epoch_start: 0,
            epoch_min: u64::MAX,
            epoch_samples: 0,
            gap_estimate: 0,
            calibrated: DEFAULT_KERNEL_NS,
        }
    }
}

impl KernelCost {
    /// Starts from a measured stop/resume cycle of `ns`.
    pub(crate) fn calibrated(ns: u64) -> KernelCost {
        KernelCost {
            calibrated: ns.min(MAX_KERNEL_NS),
            ..KernelCost::default()
        }
    }

    /// A thread resumed at `resumed` was seen stopped again at `stopped`.
    pub(crate) fn gap(&mut self, resumed: u64, stopped: u64) {
        if resumed == 0 || stopped < resumed {
            return;
        }
        if stopped.saturating_sub(self.epoch_start) > EPOCH_NS {
            if self.epoch_samples >= MIN_SAMPLES {
                self.gap_estimate = self.epoch_min;
            }
            self.epoch_start = stopped;
            self.epoch_min = u64::MAX;
            self.epoch_samples = 0;
        }
        let gap = (stopped - resumed).min(MAX_KERNEL_NS);
        self.epoch_min = self.epoch_min.min(gap);
        self.epoch_samples += 1;
        // Until a full epoch has been seen, the running minimum is the best guess.
        if self.epoch_samples >= MIN_SAMPLES
            && (self.gap_estimate == 0 || self.epoch_min < self.gap_estimate)
        {
            self.gap_estimate = self.epoch_min;
        }
    }

    /// The current estimate, in ns.
    pub(crate) fn estimate(&self) -> u64 {
        self.calibrated.max(self.gap_estimate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Simulates a target that, while traced, is stopped `stopped_share` of the
    /// time; returns the slowdown it suffered overall and the exact fraction.
    fn simulate(max: f64, stopped_share: f64, seconds: u64) -> (f64, f64, u64) {
        let mut b = Budget::new(max, 0);
        let (mut stopped_total, mut run_total) = (0u64, 0u64);
        let step = MS / 4;
        let end = seconds * 1000 * MS;
        let mut now = 0;
        while now < end {
            now += step;
            let stopped = if b.exact() {
                (step as f64 * stopped_share) as u64
            } else {
                0
            };
            stopped_total += stopped;
            run_total += step - stopped;
            b.stopped(stopped);
            b.poll(now);
        }
        (
            stopped_total as f64 / run_total as f64,
            b.exact_fraction(now),
            b.windows(),
        )
    }

    #[test]
    fn call_heavy_target_stays_within_budget() {
        // fib under int3: stopped 98 % of the time while traced.
        let (slowdown, exact, windows) = simulate(0.05, 0.98, 30);
        assert!(slowdown <= 0.05, "slowdown {slowdown}");
        assert!(slowdown >= 0.02, "budget wasted: slowdown {slowdown}");
        assert!(exact > 0.01 && exact < 0.06, "exact fraction {exact}");
        // Short windows, many of them, not one long one.
        assert!(windows > 30, "{windows} windows");
    }

    /// Probes off, blocking samples costing `cost` every 10 ms: whether the budget
    /// finds them too costly, and whether a window opens, within `ms`.
    fn sampling_only(cost: u64, ms: u64) -> (bool, bool) {
        let mut b = Budget::new(0.05, 0);
        // A burst of hits sends the probes off.
        let mut now = 0;
        while b.exact() {
            now += MS;
            b.stopped(MS);
            b.poll(now);
        }
        let (mut too_costly, mut reopened) = (false, false);
        let end = now + ms * MS;
        while now < end {
            now += 10 * MS;
            b.sampled(cost);
            reopened |= b.poll(now) == Some(Toggle::On);
            too_costly |= b.samples_too_costly(10 * MS);
            if reopened {
                break;
            }
        }
        (too_costly, reopened)
    }

    #[test]
    fn cheap_samples_let_windows_open_again() {
        assert_eq!(sampling_only(50_000, 2_000), (false, true));
    }

    #[test]
    fn samples_that_alone_hold_the_slowdown_up_are_found_too_costly() {
        // 450 µs every 10 ms is 4.7 %: above the 4 % where probes come back.
        assert_eq!(sampling_only(450_000, 2_000), (true, false));
        let mut b = Budget::new(0.05, 0);
        b.sampled(300_000);
        b.sampled(500_000);
        assert_eq!(b.sample_cost(), (2, 400_000));
        // Two samples are the warm-up: their cost decides nothing yet.
        assert!(!b.samples_too_costly(10 * MS));
    }

    #[test]
    fn a_slow_warm_up_does_not_make_samples_too_costly() {
        let mut b = Budget::new(0.05, 0);
        // The walker's attach and first reads, then steady 150 µs stops.
        for cost in [24 * MS, 8 * MS, 5 * MS, 2 * MS, 1_300_000] {
            b.sampled(cost);
        }
        for _ in 0..100 {
            b.sampled(150_000);
        }
        assert!(!b.samples_too_costly(10 * MS));
        assert_eq!(b.steady_sample_ns(), Some(150_000));
        // At 1 kHz the same stops are 15 % of the target's time.
        assert!(b.samples_too_costly(MS));
    }

    #[test]
    fn light_target_is_traced_all_the_time() {
        let (slowdown, exact, windows) = simulate(0.05, 0.01, 10);
        assert!(slowdown < 0.011);
        assert_eq!(exact, 1.0);
        assert_eq!(windows, 1);
    }

    #[test]
    fn a_storm_is_caught_within_a_span_and_a_burst_is_not() {
        let mut m = StormMeter::default();
        // 200 ns events at 5 per µs: the target slowed 100 %, at once.
        let mut now = 1_000 * MS;
        let mut caught_at = None;
        for step in 1..=10 {
            now += MS / 4;
            if m.charge(250_000, now, 0.05) {
                caught_at.get_or_insert(step);
            }
        }
        // The span starts at the first charge (step 1): judged once it has ended.
        let first_judged = 1 + STORM_SPAN_NS / (MS / 4);
        assert_eq!(
            caught_at,
            Some(first_judged),
            "judged once the first span ended"
        );
        // An import's few hundred events at once, then quiet: 3 % of a span.
        let mut m = StormMeter::default();
        let mut caught = m.charge(60_000, now, 0.05);
        for _ in 0..20 {
            now += MS / 2;
            caught |= m.charge(0, now, 0.05);
        }
        assert!(!caught);
        // Time going backwards restarts the span rather than underflowing.
        assert!(!m.charge(1, now - 10 * MS, 0.05));
    }

    #[test]
    fn a_window_cut_short_holds_the_next_off_longer_each_time() {
        let mut b = Budget::new(0.05, 0);
        let mut now = 10 * MS;
        let mut waits = Vec::new();
        for _ in 0..3 {
            b.back_off(now);
            assert!(!b.exact());
            let off = now;
            while b.poll(now) != Some(Toggle::On) {
                now += MS;
            }
            waits.push((now - off) / MS);
        }
        // 50 ms, then 100, then 200 (within a poll).
        assert!(waits[0] >= 50 && waits[0] <= 52, "{waits:?}");
        assert!(waits[1] >= 100 && waits[1] <= 102, "{waits:?}");
        assert!(waits[2] >= 200 && waits[2] <= 202, "{waits:?}");
        // A window that lasted a second before a storm cut it short waits 50 ms.
        now += MS;
        assert_eq!(b.poll(now), None);
        now += LASTED_NS;
        b.back_off(now);
        assert_eq!(b.cut_short, 1);
        while b.poll(now) != Some(Toggle::On) {
            now += MS;
        }
        // A window that runs its course and ends over budget resets the wait.
        while b.exact() {
            now += MS;
            b.stopped(MS);
            b.poll(now);
        }
        assert_eq!(b.cut_short, 0);
    }

    #[test]
    fn stopped_time_beyond_elapsed_is_clamped() {
        let mut b = Budget::new(0.05, 0);
        let mut toggles = Vec::new();
        for i in 1..=200 {
            b.stopped(u64::MAX);
            toggles.extend(b.poll(i * MS));
        }
        assert_eq!(toggles, vec![Toggle::Off]);
        assert!(b.slowdown().is_finite());
        // A long pause decays it: probes come back.
        assert_eq!(b.poll(10_000 * MS), Some(Toggle::On));
    }

    #[test]
    fn polls_closer_than_a_millisecond_do_nothing() {
        let mut b = Budget::new(0.05, 0);
        for i in 1..=20 {
            b.stopped(MS);
            b.poll(i * MS);
        }
        assert!(b.exact());
        b.stopped(MS);
        assert_eq!(b.poll(20 * MS + MS / 2), None);
        let mut now = 20 * MS;
        while b.exact() {
            now += MS;
            b.stopped(MS);
            b.poll(now);
        }
        assert!(now < 200 * MS, "went off only at {now}");
    }

    #[test]
    fn kernel_cost_takes_the_shortest_gap_of_an_epoch() {
        let mut k = KernelCost::calibrated(9_000);
        assert_eq!(k.estimate(), 9_000);
        let mut t = 1_000;
        for i in 0..200u64 {
            let resumed = t;
            t += 15_000 + (i % 7) * 1_000;
            k.gap(resumed, t);
            t += 1_000;
        }
        assert_eq!(k.estimate(), 15_000);
        // Sparse hits in the next epoch do not replace it.
        k.gap(t + 2 * EPOCH_NS, t + 2 * EPOCH_NS + 400_000);
        assert_eq!(k.estimate(), 15_000);
        // Nonsense input is ignored.
        k.gap(0, 5);
        k.gap(10, 5);
        assert_eq!(k.estimate(), 15_000);
        // Never below the calibration.
        let mut quick = KernelCost::calibrated(30_000);
        for i in 0..200u64 {
            quick.gap(i * 20_000, i * 20_000 + 5_000);
        }
        assert_eq!(quick.estimate(), 30_000);
    }
}
