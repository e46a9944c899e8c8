//! Following the CPU of the threads that hit `int3` sites: pyprobe's tracing
//! thread is pinned beside a thread that hits often, and yields that CPU to it
//! (`SCHED_IDLE`, see [`super::yielding`]). On by default where pyprobe may
//! yield; `PYPROBE_FOLLOW_CPU=0` turns it off, `PYPROBE_FOLLOW_CPU=1` follows
//! even where it may not (pinned only, which measured does not help: below).
//!
//! Each `int3` hit is two wake-ups: the target's thread stops and wakes pyprobe, and
//! pyprobe's `PTRACE_CONT` wakes the thread. On one CPU that is a context switch
//! each way (the same-CPU floor, 7-13 µs per hit on a 2-CPU VM); across CPUs
//! each is an inter-processor interrupt to a CPU that has gone idle, which on a VM
//! whose idle vCPUs halt at once (`haltpoll` with `guest_halt_poll_ns` 0) is several
//! times dearer (20-100 µs).
//!
//! Following pins pyprobe's tracing thread (the one that makes every ptrace
//! request; `sched_setaffinity(0)` only ever moves it) to the CPU the hitting
//! thread last ran on (`/proc/PID/task/TID/stat`, field 39, read every
//! [`LOOK_EVERY`] hits: reading it on every hit costs about what it could save),
//! while hits come often and no ring is polled; the target is never pinned. The
//! stopped thread wakes pyprobe on its own CPU (a synchronous wake-up, which the
//! scheduler already places there), but `PTRACE_CONT` wakes the thread while
//! pyprobe runs on that CPU, and the scheduler's wake-up placement
//! (`select_idle_sibling`) then sends it to any idle CPU sharing the cache: pinned
//! alone, pyprobe shared a CPU with the target 32% of the time, and hits cost the
//! same as unpinned within noise. Yielding is what keeps the thread on pyprobe's
//! CPU: a CPU running only `SCHED_IDLE` threads counts as idle to that placement.
//!
//! pyprobe's own CPU mask and policy as they were are put back when hits become
//! rare, when a ring or a hook's buffer serves the process (its consumer should
//! run beside the target, not take turns with it), and when tracing ends.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

use super::yielding::Yielding;
use crate::process::status::KeptTaskFile;
use crate::tracer::clock::monotonic_ns;

/// Hits between two looks at the hitting thread's CPU.
pub(super) const LOOK_EVERY: u32 = 16;
/// Below this rate of `int3` hits (per second) pyprobe does not follow: a wake-up
/// across CPUs then costs less than 10% of one CPU.
const MIN_HITS_PER_S: u64 = 2_000;

/// Whether and where pyprobe's tracing thread is pinned.
#[derive(Debug)]
pub(in crate::tracer) struct CpuFollow {
    enabled: bool,
    /// Follows even where pyprobe cannot yield (`PYPROBE_FOLLOW_CPU=1`).
    forced: bool,
    /// The thread's CPU mask before it was first pinned.
    original: Option<CpuSet>,
    /// The CPU it is pinned to now.
    pinned: Option<usize>,
    /// Hits since the last look, and when that was.
    hits: u32,
    since_ns: u64,
    /// `SCHED_IDLE` while pinned (see [`super::yielding`]): tried at the first pin.
    yielding: Option<Option<Yielding>>,
    stat: StatFile,
}

impl Default for CpuFollow {
    fn default() -> Self {
        CpuFollow {
            enabled: std::env::var_os("PYPROBE_FOLLOW_CPU").is_none_or(|v| v != "0"),
            forced: std::env::var_os("PYPROBE_FOLLOW_CPU").is_some_and(|v| v == "1"),
            original: None,
            pinned: None,
            hits: 0,
            since_ns: monotonic_ns(),
            yielding: None,
            stat: StatFile::default(),
        }
    }
}

impl CpuFollow {
    /// An `int3` hit of thread `tid` of `pid` (stopped). `polling`: a ring or a
    /// hook's buffer serves some process, and pyprobe polls it.
    pub(in crate::tracer) fn hit(&mut self, pid: i32, tid: i32, polling: bool) {
        if !self.enabled {
            return;
        }
        if polling {
            self.release();
            return;
        }
        if let Some(Some(y)) = &self.yielding {
            y.serving(pid, tid);
            if y.taken_back() {
                // The guard gave the thread its whole mask back.
                self.pinned = None;
            }
        }
        self.hits += 1;
        if self.hits < LOOK_EVERY {
            return;
        }
        let now = monotonic_ns();
        let elapsed = now.saturating_sub(self.since_ns).max(1);
        let rate = u64::from(self.hits) * 1_000_000_000 / elapsed;
        self.hits = 0;
        self.since_ns = now;
        if rate < MIN_HITS_PER_S {
            self.release();
            return;
        }
        let Some(cpu) = self.stat.last_cpu(pid, tid) else {
            return;
        };
        if self.pinned != Some(cpu) {
            self.pin(cpu);
        }
    }

    /// What yielding did, for `-v` (`None`: it never started).
    pub(in crate::tracer) fn yield_summary(&self) -> Option<String> {
        self.yielding.as_ref()?.as_ref()?.summary()
    }

    /// pyprobe's CPU mask as it was, if it was changed.
    pub(in crate::tracer) fn release(&mut self) {
        if let Some(Some(y)) = &mut self.yielding {
            y.stop();
        }
        if self.pinned.take().is_none() {
            return;
        }
        if let Some(original) = &self.original {
            let _ = sched_setaffinity(Pid::from_raw(0), original);
        }
    }

    fn pin(&mut self, cpu: usize) {
        if self.original.is_none() {
            match sched_getaffinity(Pid::from_raw(0)) {
                Ok(mask) => self.original = Some(mask),
                Err(_) => {
                    self.enabled = false;
                    return;
                }
            }
        }
        // Only to a CPU pyprobe was allowed on in the first place.
        let allowed = self
            .original
            .as_ref()
            .is_some_and(|mask| mask.is_set(cpu).unwrap_or(false));
        let mut one = CpuSet::new();
        if !allowed || one.set(cpu).is_err() {
            return;
        }
        let yielding = self.yielding.get_or_insert_with(Yielding::for_this_thread);
        if yielding.is_none() && !self.forced {
            // Pinned without yielding, hits cost the same or more (see above).
            self.enabled = false;
            return;
        }
        if sched_setaffinity(Pid::from_raw(0), &one).is_ok() {
            self.pinned = Some(cpu);
            if let (Some(y), Some(original)) = (yielding, &self.original) {
                y.start(original);
            }
        }
    }
}

impl Drop for CpuFollow {
    fn drop(&mut self) {
        self.release();
    }
}

/// The `stat` file of the thread last looked at, kept open.
#[derive(Debug, Default)]
struct StatFile(KeptTaskFile);

impl StatFile {
    /// The CPU thread `tid` of `pid` last ran on: field 39 of its `stat`.
    fn last_cpu(&mut self, pid: i32, tid: i32) -> Option<usize> {
        parse_processor(std::str::from_utf8(self.0.read(pid, tid, "stat")?).ok()?)
    }
}

/// Field 39 (`processor`) of a `stat` line; the command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its last `)`.
pub(super) fn parse_processor(stat: &str) -> Option<usize> {
    let (_, rest) = stat.rsplit_once(')')?;
    // Field 3 is the first after the name: field 39 is the 37th.
    rest.split_whitespace().nth(36)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_processor_field_is_found_after_the_name() {
        let fields: Vec<String> = (3..=52).map(|n| n.to_string()).collect();
        let line = format!("1234 (a) b (c) {}", fields.join(" "));
        assert_eq!(parse_processor(&line), Some(39));
        assert_eq!(parse_processor("1234 (x) S 1 2"), None);
        assert_eq!(parse_processor("no name"), None);
        // Our own thread's line parses to a CPU that exists.
        let own = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let cpu = parse_processor(&own).expect("a processor field");
        assert!(cpu < CpuSet::count());
    }

    #[test]
    fn a_kept_stat_file_reads_the_thread_afresh_each_time() {
        let mut stat = StatFile::default();
        let pid = std::process::id() as i32;
        let tid = nix::unistd::gettid().as_raw();
        for _ in 0..3 {
            let cpu = stat.last_cpu(pid, tid).expect("our own CPU");
            assert!(cpu < CpuSet::count());
        }
        // No such thread: nothing, and no panic.
        assert_eq!(stat.last_cpu(pid, i32::MAX), None);
    }
}
