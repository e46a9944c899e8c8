//! What a stopped sample costs the target in steady state.
//!
//! A stop is charged for the time pyprobe holds the target minus the time
//! pyprobe's own thread waited for a CPU meanwhile: on a loaded machine the
//! programs that take the CPU from pyprobe would take it from the target as
//! well, so that wait is the machine's, not pyprobe's. Blocked time (a page
//! fault, a write) is charged: the CPU was free and the target could not use it.
//!
//! Whether stopping is affordable is judged on the median of the recent stops,
//! once past a warm-up: the first samples pay one-off work (the walker's
//! attach and first reads, unwind tables, name caches), and a stop now and then
//! is stretched by an interrupt or a page fault.

use crate::process::status::KeptTaskFile;
use crate::tracer::clock::monotonic_ns;

/// Stops seen before their cost may decide anything.
pub(crate) const WARM_UP_STOPS: u64 = 20;
/// The recent stops whose median is the steady cost.
const WINDOW: usize = 32;
/// Stops after which a cost no warm-up explains decides at once: when every one
/// of them took at least [`EARLY_FLOOR_NS`] (a process with hundreds of threads
/// takes 7 ms to stop per 300), waiting for [`WARM_UP_STOPS`] would hold the
/// target for a tenth of a second or more. A first reads' one-off work costs a
/// few ms, and not three times.
const EARLY_STOPS: u64 = 3;
const EARLY_FLOOR_NS: u64 = 5_000_000;
/// What stopping a process costs per thread, at the least: each thread is
/// interrupted, woken and waited for (14 to 25 µs measured, 2,000 to 10,000 idle
/// threads). Below it no prediction is made from the thread count.
pub(crate) const STOP_NS_PER_THREAD_FLOOR: u64 = 10_000;

/// Least predicted cost that decides before any stop (500 threads): well above
/// what a few threads' stop and reads cost (about 0.2 ms), so only the thread
/// count, never a program's stacks, makes the prediction.
const PREDICTED_FLOOR_NS: u64 = 5_000_000;

/// What a stop of a process with `threads` threads costs at the least, when that
/// is [`PREDICTED_FLOOR_NS`] or more: then the warm-up stops that would measure it
/// (see [`WARM_UP_STOPS`], [`EARLY_STOPS`]) would alone break a budget, and need
/// not be tried.
pub(crate) fn predicted_stop_ns(threads: usize) -> Option<u64> {
    let ns = (threads as u64).saturating_mul(STOP_NS_PER_THREAD_FLOOR);
    (ns >= PREDICTED_FLOOR_NS).then_some(ns)
}

/// The costs of the recent stops.
#[derive(Debug, Clone)]
pub(crate) struct StopCosts {
    recent: [u64; WINDOW],
    seen: u64,
}

impl Default for StopCosts {
    fn default() -> Self {
        StopCosts {
            recent: [0; WINDOW],
            seen: 0,
        }
    }
}

impl StopCosts {
    pub(crate) fn push(&mut self, ns: u64) {
        self.recent[(self.seen % WINDOW as u64) as usize] = ns;
        self.seen += 1;
    }

    /// The median of the recent stops, once [`WARM_UP_STOPS`] were seen; before,
    /// the cheapest stop so far once [`EARLY_STOPS`] all cost [`EARLY_FLOOR_NS`]
    /// or more.
    pub(crate) fn steady_ns(&self) -> Option<u64> {
        if self.seen < WARM_UP_STOPS {
            let seen = &self.recent[..self.seen as usize];
            let cheapest = seen.iter().copied().min()?;
            return (self.seen >= EARLY_STOPS && cheapest >= EARLY_FLOOR_NS).then_some(cheapest);
        }
        let n = (self.seen as usize).min(WINDOW);
        // A copy on the stack: asked at every tick, it need not allocate.
        let mut recent = self.recent;
        recent[..n].sort_unstable();
        Some(recent[n / 2])
    }
}

/// The scheduler's account of pyprobe's tracing thread (`schedstat`: time run,
/// time waited on a run queue), kept open for a read at each stop.
#[derive(Debug, Default)]
pub(crate) struct OwnSchedule {
    file: KeptTaskFile,
    /// The file could not be read once: stops are charged their whole length.
    unreadable: bool,
}

/// A hold on the target in progress: when it began, and the run-queue wait
/// pyprobe's thread had accumulated then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hold {
    began_ns: u64,
    waited_ns: Option<u64>,
}

impl OwnSchedule {
    fn waited_ns(&mut self) -> Option<u64> {
        if self.unreadable {
            return None;
        }
        // SAFETY: getpid and gettid take no arguments and cannot fail.
        let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
        let waited = self.file.read(pid, tid, "schedstat").and_then(parse_waited);
        self.unreadable = waited.is_none();
        waited
    }

    /// Starts timing a hold on the target.
    pub(crate) fn begin(&mut self) -> Hold {
        Hold {
            began_ns: monotonic_ns(),
            waited_ns: self.waited_ns(),
        }
    }

    /// The cost to the target of `hold`, ending now.
    pub fn end(&mut self, hold: Hold) -> u64 {
        let now = monotonic_ns();
        let wall = now.saturating_sub(hold.began_ns);
        let waited = match (hold.waited_ns, self.waited_ns()) {
            (Some(before), Some(after)) => after.saturating_sub(before),
            _ => 0,
        };
        wall.saturating_sub(waited)
    }
}

/// The run-queue wait (ns) of a `schedstat` line: its second field.
fn parse_waited(schedstat: &[u8]) -> Option<u64> {
    std::str::from_utf8(schedstat)
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_steady_cost_during_the_warm_up() {
        let mut costs = StopCosts::default();
        for _ in 0..WARM_UP_STOPS - 1 {
            costs.push(100_000);
        }
        assert_eq!(costs.steady_ns(), None);
        costs.push(100_000);
        assert_eq!(costs.steady_ns(), Some(100_000));
    }

    #[test]
    fn stops_no_warm_up_explains_decide_after_three() {
        let mut costs = StopCosts::default();
        for _ in 0..EARLY_STOPS - 1 {
            costs.push(125_000_000);
        }
        assert_eq!(costs.steady_ns(), None);
        costs.push(60_000_000);
        assert_eq!(costs.steady_ns(), Some(60_000_000));
        // One cheap stop among them: warm-up it may be, the full count decides.
        let mut costs = StopCosts::default();
        for cost in [125_000_000, 1_000_000, 125_000_000, 125_000_000] {
            costs.push(cost);
        }
        assert_eq!(costs.steady_ns(), None);
    }

    #[test]
    fn hundreds_of_threads_decide_before_any_stop_and_a_few_never() {
        assert_eq!(predicted_stop_ns(4), None);
        assert_eq!(predicted_stop_ns(499), None);
        assert_eq!(predicted_stop_ns(500), Some(5_000_000));
        assert_eq!(predicted_stop_ns(10_000), Some(100_000_000));
    }

    #[test]
    fn one_off_work_and_stretched_stops_do_not_make_the_steady_cost() {
        let mut costs = StopCosts::default();
        // The first samples attach the walker and fill caches; every fifth stop
        // is stretched.
        for cost in [24_000_000, 8_000_000, 1_300_000] {
            costs.push(cost);
        }
        for i in 0..40 {
            costs.push(if i % 5 == 0 { 3_000_000 } else { 150_000 });
        }
        assert_eq!(costs.steady_ns(), Some(150_000));
        // A target that really became costly to stop is seen as such.
        for _ in 0..WINDOW {
            costs.push(900_000);
        }
        assert_eq!(costs.steady_ns(), Some(900_000));
    }

    #[test]
    fn schedstat_wait_is_its_second_field() {
        assert_eq!(parse_waited(b"123456 7890 12\n"), Some(7890));
        assert_eq!(parse_waited(b"123456\n"), None);
        assert_eq!(parse_waited(b"\xff 1 2"), None);
    }

    #[test]
    fn a_hold_spent_blocked_is_charged() {
        let mut own = OwnSchedule::default();
        let hold = own.begin();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let charged = own.end(hold);
        // Asleep, not waiting for a CPU: the whole hold.
        assert!(charged >= 20_000_000, "{charged}");
    }

    #[test]
    fn a_hold_spent_waiting_for_a_cpu_is_not_charged() {
        use nix::sched::{sched_setaffinity, CpuSet};
        use nix::unistd::Pid;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let mut one = CpuSet::new();
        one.set(0).unwrap();
        sched_setaffinity(Pid::from_raw(0), &one).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        // A busy thread on the same CPU takes about half of it.
        let hog = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                sched_setaffinity(Pid::from_raw(0), &one).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(5));
        let mut own = OwnSchedule::default();
        let hold = own.begin();
        let began = monotonic_ns();
        while monotonic_ns() - began < 100_000_000 {
            std::hint::spin_loop();
        }
        let charged = own.end(hold);
        stop.store(true, Ordering::Relaxed);
        hog.join().unwrap();
        assert!(
            charged < 80_000_000 && charged > 10_000_000,
            "charged {charged} ns of a 100 ms hold shared with a busy thread"
        );
    }
}
