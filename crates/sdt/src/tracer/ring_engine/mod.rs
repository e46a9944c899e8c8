//! The ring engine's driver in the tracer: setting the ring up in a stopped process
//! (`setup`), undoing jumps left by a pyprobe that died (`leftovers`) and the
//! semaphore raises it left listed in its ring (`dead_raises`), mapping the
//! trampolines' `rdtsc` stamps to CLOCK_MONOTONIC (`tsc`), and the engine's side of
//! it (`driver`: upgrading sites, draining, holding the target, forks, leaving).
//! The pure core (formats, code generation, the consumer) is [`crate::ring`].

pub(crate) mod dead_raises;
mod driver;
pub mod heartbeat;
pub(crate) mod leftovers;
pub mod records;
pub mod reuse;
pub mod setup;
pub mod tsc;
pub mod writers;

pub(in crate::tracer) use driver::RingBook;

use crate::ring::format::{THIN_COUNT, THIN_OFF, THIN_STACKLESS};
use crate::ring::RingReader;
use crate::tracer::{ProbeSet, TraceEvent};
use setup::RingProc;

/// How the engine uses the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RingUse {
    /// Breakpoints only.
    #[default]
    Off,
    /// The ring for every site that qualifies, `int3` for the rest.
    Auto,
    /// As `Auto`, but a process where the ring cannot be set up at all is an error.
    Required,
}

/// Slots in a ring: 8 MiB of 256-byte records (they stay mapped after detaching):
/// about 5 ms of the busiest target, should pyprobe lose its CPU meanwhile.
pub const CAPACITY: u64 = 1 << 15;
/// Records taken from a ring per drain: about 100 µs of work, so the backlog, the
/// stops and the ticks are still looked at often, and enough that the loop's own
/// cost (a `waitpid` per round) is shared by many records.
pub(in crate::tracer) const DRAIN_BATCH: usize = 1024;
/// A backlog this large means pyprobe is falling behind: the target is held
/// until the ring is empty, rather than let it overflow and lose events.
pub(in crate::tracer) const HIGH_WATER: u64 = CAPACITY / 8;
/// After a full batch or a hold, the event loop polls without sleeping for this
/// long: a sleep of 200 µs may last milliseconds on a VM (the idle vCPU is
/// descheduled), long enough for a busy target to fill the ring.
pub(in crate::tracer) const BUSY_NS: u64 = 2_000_000;
/// A drain that reads fewer records than this (every ring and the hook's) finds the
/// target calm: the event loop naps before the next one, so that a drain reads a
/// batch worth its fixed costs (the `waitpid`, a read of the hook's state word, one
/// read to check the names and types of its records) rather than chase the target
/// a few dozen records at a time. Chasing docutils on CPython 3.13, pyprobe spent
/// 500 ns of CPU per event, four times what it spends on a full batch.
pub(in crate::tracer) const CALM_BELOW: usize = 256;
/// A tracee stop handled this recently keeps the loop from napping: an `int3` hit
/// or a signal for the target waits for the loop's next `waitpid`.
pub(in crate::tracer) const STOPPED_LATELY_NS: u64 = BUSY_NS;
/// What one ring event costs the target, charged to the overhead budget (which
/// cannot time code running inside the target). Not the trampoline alone (55–65 ns
/// for two string arguments, measured in-process): by the workload's own clock, a
/// function event of fib costs the target 190–230 ns on a 2-core VM (the
/// side-by-side's `own ns/event`), the interpreter's own probe arguments (17–58
/// ns), the trampoline with its cache lines read by pyprobe's CPU, and the CPU
/// pyprobe's reading takes from a machine with few. Charging less let a 5 %
/// budget cost fib 41 % (said as 9.6 %); the budget errs on the side of the target.
pub(in crate::tracer) const RING_EVENT_NS: u64 = 200;
/// What one event counted but not recorded costs the target (the flags kept, a
/// `lock inc` and the jumps): 20–50 ns per `id()` call on a 2-core VM.
pub(in crate::tracer) const RING_COUNT_NS: u64 = 30;
/// What a record with a stack (GC, import, audit under `--mode auto`) adds to
/// [`RING_EVENT_NS`]: by the workload's own clock, an `id()` loop whose every
/// audit event is recorded with its stack, budget off, pays 400 ns per event on
/// 3.9, 420 on 3.13, 460–500 on 3.11 and 540–630 on 3.15 (2-core VM): the stack
/// walk, the event's name copied, and the CPU the consumer takes from the target.
pub(in crate::tracer) const RING_STACK_NS: u64 = 300;
/// What each frame a trampoline walks for a stack record adds (two dependent
/// loads from memory the interpreter touched recently, two stores).
pub(in crate::tracer) const RING_FRAME_NS: u64 = 10;
/// A slot reserved but not published for this long is given up (its producer
/// was killed or is stuck), counted as lost.
pub(in crate::tracer) const STUCK_NS: u64 = 1_000_000_000;
/// A heartbeat this old means pyprobe is stopped (SIGSTOP, a debugger) or dead:
/// producers waiting for room in its full ring give up and count their events
/// lost. Its own thread beats it every 10 ms ([`heartbeat`]), however busy or
/// starved the draining thread is, so a pyprobe that is only slow never looks
/// stopped; this is the longest a stopped pyprobe can hold a producer.
pub const CONSUMER_STALE_NS: u64 = 300_000_000;
/// Under an overhead budget, how long an event waits for room in a full ring
/// before it is counted lost: time for a descheduled pyprobe to drain, short
/// enough that the budget, which charges the wait, can react.
pub const BUDGETED_PATIENCE_NS: u64 = 10_000_000;

/// For `-v`: how long the target waited in all for room in a ring of `engine`
/// ("ring" or "hook") in process `pid`, i.e. was held because pyprobe read more
/// slowly than it wrote.
pub fn waited_detail(engine: &str, pid: i32, waited_ns: u64) -> TraceEvent<'static> {
    TraceEvent::Detail(format!(
        "{engine} engine in process {pid}: the target waited {:.1} ms in all for room in the \
         ring (pyprobe reading more slowly than it wrote)",
        waited_ns as f64 / 1e6
    ))
}

/// Says what a new reading `value` of a ring's `lost` counter (the ring of
/// `engine`, "ring" or "hook", of process `pid`) tells: new losses, or once, that
/// the counter cannot be trusted.
pub fn report_lost(
    counter: &mut crate::ring::LostCounter,
    value: u64,
    now_ns: u64,
    engine: &str,
    pid: i32,
    sink: &mut dyn FnMut(TraceEvent),
) {
    match counter.read(value, now_ns) {
        crate::ring::LostReading::Nothing => {}
        crate::ring::LostReading::New(count) => sink(TraceEvent::Lost {
            pid,
            count,
            ts_ns: now_ns,
        }),
        crate::ring::LostReading::Corrupt(value) => sink(TraceEvent::Notice(format!(
            "{engine} engine in process {pid}: the ring's count of lost events reads {value}, \
             which cannot be true (the program wrote over pyprobe's ring): losses of this \
             process are not counted from here, and the recording may miss events it does not \
             say it lost"
        ))),
    }
}

/// Lets the producers of `reader` (the ring of `engine`, "ring" or "hook", in
/// process `pid`) reserve slots without `lock` if the process has one thread:
/// the one stopped thread pyprobe holds (`stopped` says how many it holds), and
/// no other task. Cleared before the process's next task runs (see
/// `ring_many_producers`, `hook_many_producers`); `-v` says it is set.
pub fn set_solo_if_alone(
    reader: &RingReader,
    engine: &str,
    pid: i32,
    stopped: usize,
    sink: &mut dyn FnMut(TraceEvent),
) {
    let alone =
        stopped == 1 && crate::process::status::thread_ids(pid).is_ok_and(|tids| tids.len() == 1);
    reader.set_solo(alone);
    if alone {
        sink(TraceEvent::Detail(format!(
            "{engine} engine in process {pid}: one thread: its records reserve their slots \
             without a locked instruction until it starts another task"
        )));
    }
}

/// Thins (or not) every stack probe of `set` served by `ring`: the `thin` byte the
/// trampolines read (see the budget's thinning).
pub(in crate::tracer) fn set_thin(ring: &RingProc, set: &ProbeSet, thin: bool) {
    for &probe in &set.stack_probes {
        let mode = match thin {
            false => THIN_OFF,
            true if set.count_when_thin.contains(&probe) => THIN_COUNT,
            true => THIN_STACKLESS,
        };
        ring.reader.set_thin(probe as u32, mode);
    }
}
