//! Converting the ring's `rdtsc` timestamps to CLOCK_MONOTONIC nanoseconds, the
//! clock of every other event: a linear map measured by pyprobe itself (same
//! machine, same counter), refined as the baseline grows.

use crate::tracer::clock::monotonic_ns;

/// One moment read on both clocks.
#[derive(Debug, Clone, Copy)]
struct Pair {
    tsc: u64,
    ns: u64,
}

/// The counter now (the ring's stamps are this counter, read in the target).
pub fn read_tsc() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86-64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

fn read_pair() -> Pair {
    // SAFETY: rdtsc has no preconditions on x86-64.
    let before = unsafe { core::arch::x86_64::_rdtsc() };
    let ns = monotonic_ns();
    // SAFETY: as above.
    let after = unsafe { core::arch::x86_64::_rdtsc() };
    Pair {
        tsc: before / 2 + after / 2,
        ns,
    }
}

#[derive(Debug, Clone)]
pub struct TscClock {
    origin: Pair,
    ns_per_tick: f64,
}

/// Re-measure the rate only over baselines at least this long.
const MIN_BASELINE_NS: u64 = 200_000_000;

impl TscClock {
    /// Measures the counter's rate over a few milliseconds.
    pub fn calibrate() -> TscClock {
        let origin = read_pair();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let mut clock = TscClock {
            origin,
            ns_per_tick: 1.0,
        };
        clock.refine_with(read_pair());
        clock
    }

    /// Refines the rate against the clock now, once the baseline is long enough.
    pub fn refine(&mut self) {
        let now = read_pair();
        if now.ns.saturating_sub(self.origin.ns) >= MIN_BASELINE_NS {
            self.refine_with(now);
        }
    }

    fn refine_with(&mut self, now: Pair) {
        let ticks = now.tsc.saturating_sub(self.origin.tsc);
        let ns = now.ns.saturating_sub(self.origin.ns);
        if ticks > 0 && ns > 0 {
            self.ns_per_tick = ns as f64 / ticks as f64;
        }
    }

    /// The length in ns of `ticks` counter ticks.
    pub fn ticks_to_ns(&self, ticks: u64) -> u64 {
        (ticks as f64 * self.ns_per_tick) as u64
    }

    /// Counter ticks in `ns` nanoseconds.
    pub fn ns_to_ticks(&self, ns: u64) -> u64 {
        (ns as f64 / self.ns_per_tick) as u64
    }

    /// The monotonic time of counter value `tsc`.
    pub fn to_ns(&self, tsc: u64) -> u64 {
        // Integer and float work only on the offset from the origin (`as` saturates).
        let delta = tsc.wrapping_sub(self.origin.tsc) as i64 as f64;
        self.origin
            .ns
            .saturating_add_signed((delta * self.ns_per_tick) as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_times_match_the_monotonic_clock() {
        let clock = TscClock::calibrate();
        let now = read_pair();
        let err = clock.to_ns(now.tsc).abs_diff(now.ns);
        // Within 1 % of the time since calibration, plus a little.
        let since = now.ns - clock.origin.ns;
        assert!(
            err < since / 100 + 50_000,
            "off by {err} ns after {since} ns"
        );
        assert!(clock.to_ns(now.tsc + 1_000_000) > clock.to_ns(now.tsc));
    }
}
