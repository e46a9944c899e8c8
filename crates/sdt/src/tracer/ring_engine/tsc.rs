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
    /// Where the rate is measured from (the longer the baseline, the better).
    origin: Pair,
    /// ns per tick, as measured.
    ns_per_tick: f64,
    /// The map in use: `at.ns + (tsc - at.tsc) * slope`. Refining never steps
    /// it: it is re-anchored where the old map stood, and its slope set to absorb
    /// the offset from the monotonic clock over [`SLEW_NS`]. A step back of even
    /// a few µs would put a thread's later records before its earlier ones.
    map: Line,
    /// The map before the last re-anchoring, for stamps before `map.at` (records
    /// still in a ring then): it meets the current one there, so the map is one
    /// continuous line in pieces, whatever the order records are read in.
    before: Line,
}

/// One piece of the map: from `at`, a slope in ns per tick.
#[derive(Debug, Clone, Copy)]
struct Line {
    at: Pair,
    /// The slope in fixed point ([`FRACTION_BITS`] bits after the point): a record's
    /// time is an integer multiply, not a float conversion and back (which cost a
    /// twentieth of draining a record).
    fixed: u64,
}

/// Fraction bits of [`Line::fixed`]: a record a second (2^32 ticks) from the
/// anchor is off by well under a nanosecond.
const FRACTION_BITS: u32 = 40;

impl Line {
    fn new(at: Pair, slope: f64) -> Line {
        // A slope is a few ns per tick at most (clamped to twice a measured
        // rate): far inside u64 with 40 fraction bits; `as` saturates anyway.
        let fixed = (slope * (1u64 << FRACTION_BITS) as f64).round() as u64;
        Line { at, fixed }
    }

    /// The time of `tsc` on this line, rounded to the nearest nanosecond.
    #[inline]
    fn ns(&self, tsc: u64) -> u64 {
        let delta = i128::from(tsc.wrapping_sub(self.at.tsc) as i64);
        let half = 1i128 << (FRACTION_BITS - 1);
        let ns = (delta * i128::from(self.fixed) + half) >> FRACTION_BITS;
        let ns = ns.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        self.at.ns.saturating_add_signed(ns)
    }
}

/// Re-measure the rate only over baselines at least this long.
const MIN_BASELINE_NS: u64 = 200_000_000;
/// Re-anchor the map at most this often.
const REANCHOR_NS: u64 = 10_000_000;
/// The map's offset from the monotonic clock is absorbed over this long.
const SLEW_NS: f64 = 100_000_000.0;

impl TscClock {
    /// Measures the counter's rate over a few milliseconds.
    pub fn calibrate() -> TscClock {
        let origin = read_pair();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let now = read_pair();
        let ticks = now.tsc.saturating_sub(origin.tsc);
        let ns = now.ns.saturating_sub(origin.ns);
        let rate = if ticks > 0 && ns > 0 {
            ns as f64 / ticks as f64
        } else {
            1.0
        };
        TscClock {
            origin,
            ns_per_tick: rate,
            map: Line::new(origin, rate),
            before: Line::new(origin, rate),
        }
    }

    /// Refines the rate against the clock now, once the baseline is long enough.
    pub(crate) fn refine(&mut self) {
        let now = read_pair();
        if now.ns.saturating_sub(self.origin.ns) >= MIN_BASELINE_NS
            && now.ns.saturating_sub(self.map.at.ns) >= REANCHOR_NS
        {
            self.refine_with(now);
        }
    }

    fn refine_with(&mut self, now: Pair) {
        let ticks = now.tsc.saturating_sub(self.origin.tsc);
        let ns = now.ns.saturating_sub(self.origin.ns);
        if ticks == 0 || ns == 0 || now.tsc <= self.map.at.tsc {
            return;
        }
        self.ns_per_tick = ns as f64 / ticks as f64;
        // Where the map stands now, and how far that is from the monotonic clock.
        let here = self.to_ns(now.tsc);
        let offset = now.ns as f64 - here as f64;
        let slew_ticks = SLEW_NS / self.ns_per_tick;
        // Bounded so that the map always runs forward, at half to twice the rate.
        let slope = (self.ns_per_tick + offset / slew_ticks)
            .clamp(self.ns_per_tick / 2.0, self.ns_per_tick * 2.0);
        self.before = self.map;
        self.map = Line::new(
            Pair {
                tsc: now.tsc,
                ns: here,
            },
            slope,
        );
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
    #[inline]
    pub fn to_ns(&self, tsc: u64) -> u64 {
        if tsc >= self.map.at.tsc {
            self.map.ns(tsc)
        } else {
            self.before.ns(tsc)
        }
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

    /// The fixed-point line agrees with the float map it stands for, to the
    /// nanosecond, on both sides of its anchor and far from it.
    #[test]
    fn fixed_point_line_matches_the_float_map() {
        let at = Pair {
            tsc: 1 << 40,
            ns: 1 << 50,
        };
        for slope in [0.25, 0.408_163_265_3, 0.5, 1.0, 3.333_333_3] {
            let line = Line::new(at, slope);
            for delta in [
                0i64,
                1,
                -1,
                999,
                -1_000_000,
                123_456_789,
                -(1 << 32),
                1 << 34,
            ] {
                let tsc = at.tsc.wrapping_add_signed(delta);
                let float = at.ns as f64 + delta as f64 * slope;
                let got = line.ns(tsc) as f64;
                assert!(
                    (got - float).abs() <= 1.0,
                    "slope {slope}, delta {delta}: {got} vs {float}"
                );
            }
        }
    }

    /// A clock whose first rate was 1 % off: refining neither steps its map (a
    /// record converted just before and just after keeps its time) nor leaves it
    /// off the monotonic clock once the offset has been absorbed.
    #[test]
    fn refining_never_steps_the_map_and_absorbs_its_offset() {
        let origin = Pair {
            tsc: 1_000_000_000,
            ns: 5_000_000_000,
        };
        // True rate: 0.5 ns per tick; measured at calibration: 1 % fast.
        let mut clock = TscClock {
            origin,
            ns_per_tick: 0.505,
            map: Line::new(origin, 0.505),
            before: Line::new(origin, 0.505),
        };
        let truth = |tsc: u64| origin.ns + ((tsc - origin.tsc) / 2);
        let at = origin.tsc + 1_000_000_000; // 500 ms later
        let before = clock.to_ns(at);
        let earlier = clock.to_ns(at - 1_000);
        clock.refine_with(Pair {
            tsc: at,
            ns: truth(at),
        });
        assert_eq!(clock.to_ns(at), before, "no step at the refinement");
        assert!(clock.to_ns(at - 1_000).abs_diff(earlier) <= 1);
        assert!(clock.to_ns(at + 1) >= clock.to_ns(at));
        assert!(
            (clock.ns_per_tick - 0.5).abs() < 1e-9,
            "{}",
            clock.ns_per_tick
        );
        // 5 ms ahead before: absorbed over the slew time (and refined again meanwhile).
        assert_eq!(before - truth(at), 5_000_000);
        let mut tsc = at;
        for _ in 0..40 {
            tsc += 20_000_000; // 10 ms
            clock.refine_with(Pair {
                tsc,
                ns: truth(tsc),
            });
        }
        let off = clock.to_ns(tsc).abs_diff(truth(tsc));
        assert!(off < 200_000, "still {off} ns off the monotonic clock");
        let mut last = 0;
        for k in 0..1000 {
            let t = clock.to_ns(tsc + k * 1_000);
            assert!(t >= last);
            last = t;
        }
    }
}
