//! The injected hook engine's side in the tracer: installing the hook (see
//! [`crate::hook`] for what runs in the target and why its safe point is safe),
//! watching it get installed, draining its ring into the same function entry and
//! return hits the SDT probes give, and leaving.
//!
//! * **Install** (`setup`): with every thread stopped, the state page, the ring, the
//!   hook page and the detour are put in; `_Py_HandlePending`'s entry jumps to the
//!   detour and the eval breaker is raised. The next thread to check the breaker
//!   runs the installer there, with the GIL held. `sys.monitoring` events are
//!   interpreter-wide, so threads started later are covered with no more work.
//! * **The profile route** (3.7 to 3.11, `profile`): no safe point is needed; with
//!   every thread stopped the hook is written as each thread state's profile
//!   function, and the status set at once. New threads are held at their first stop
//!   until their thread state has it; every 100 ms the thread states are read for one
//!   without it (the target's own profiler let it go, a thread made in C).
//! * **A launched program** (`launched`): the hook goes in at the first system-call
//!   stop after the interpreter has a thread state, before the script runs.
//! * **Watching**: each turn of the event loop reads the state page's `status`.
//!   Installed (or failed): every thread is stopped, the entry's bytes put back.
//!   Still waiting: the breaker is raised again every [`RAISE_EVERY`] (threads
//!   stopped: the interpreter recomputes that word with its own atomics); after
//!   [`SLOW_AFTER`] pyprobe says once that no thread has run Python code since, and
//!   keeps waiting: a main thread blocked in C (a `sleep`, a lock) installs it when
//!   it returns to Python.
//! * **Naming**: records carry code-object and type pointers. A start or resume is
//!   named by the frame walker the first time its parts (below) are met; parts met
//!   again take that name, after one read per drain for all of them together checks
//!   that each code object's `co_qualname` pointer is unchanged, so an address freed
//!   and reused by another code object is named afresh. A return or unwind takes the name of the
//!   entry it closes (a per-thread shadow stack of code pointers): the code object
//!   may be gone by the time pyprobe reads the record (a module body is freed as soon
//!   as it has run), and its memory reused. Types are named by `tp_name`, once each
//!   (re-checked once per drain), and counted per function (`returns`): the changed
//!   counts go to the recording every second and at the end. Each record also carries the code object's `co_name` and `co_filename`
//!   pointers and first line, read by the hook when it ran: a start whose code
//!   object no longer holds them when pyprobe reads the record (freed, its address
//!   reused) is named from them instead (interned names are immortal on 3.12+), or
//!   from the name these parts had when last read (the target exited with records
//!   still in its ring: its memory is gone); one named in none of these ways is
//!   named [`GONE_CODE`](crate::python::walker::GONE_CODE), and still counted. The target runs while pyprobe reads:
//!   the code object is read afresh (a code object and its strings can be made
//!   again at the very addresses a cache knows), and a name stands only if its
//!   `str` still has the identity the hook saw after its text was read.
//! * **Leaving**: `on` is cleared (the next callback, in any thread, unregisters the
//!   hook from inside, with the GIL: `set_events(4, 0)`, callbacks set to `None`,
//!   `free_tool_id(4)`); the entry's bytes go back if still patched; the ring is
//!   drained. Nothing is unmapped: the next attach finds the page, its state page
//!   and its ring again and uses them (`reuse`), so a target attached any number of
//!   times holds one set.
//! * **pyprobe killed**: the guardian was told the `on` word as a ring site whose
//!   original is 0, and the entry's jump: it clears `on` and restores the entry (with
//!   the threads stopped). A target that never calls Python again keeps a registered
//!   hook that costs nothing; its first call unregisters it.
//! * **fork**: the state page is `MADV_WIPEONFORK` and the ring `MADV_DONTFORK`: a
//!   child's callbacks find `on` clear and unregister without touching any ring.
//!
//! This file holds a hooked process's state (`HookProc`) and the engine's face
//! to the tracer ([`HookBook`], its [`EventSource`]); the work is in `place`
//! (installing), `watch` (the installer's progress, the profile route's thread
//! states), `drain` (records into hits) and `leave` (detaching, an image gone).

mod drain;
mod fork;
mod launched;
mod leave;
mod parts;
mod place;
mod profile;
mod returns;
mod reuse;
mod setup;
mod tool;
mod watch;

use std::collections::HashMap;
use std::rc::Rc;

use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use memmap2::MmapMut;
use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::hook::{Detour, HookCode};
use crate::python::walker::{PyFrame, Walker};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::RingReader;
use pyprobe_sdt::tracer::decode::HitBuffers;
use pyprobe_sdt::tracer::engine::source::{EventSource, Placement, RingBound, SweepNeed};
use pyprobe_sdt::tracer::engine::TraceEvent;
use pyprobe_sdt::tracer::guardian::Guardian;
use pyprobe_sdt::tracer::ring_engine::tsc::TscClock;

use launched::Awaiting;
use parts::CodeParts;
use profile::ProfileTarget;
use returns::{ReturnTable, TypeNames};
pub use setup::refusal;
use setup::Breaker;

/// While waiting for the installer, the eval breaker is raised again this often
/// (the interpreter may recompute it meanwhile), and after [`SLOW_AFTER`] every
/// [`RAISE_SLOWLY`] (each raise stops the threads for a moment).
const RAISE_EVERY: Duration = Duration::from_millis(10);
const RAISE_SLOWLY: Duration = Duration::from_secs(1);
/// Said once when the installer has not run after this long.
const SLOW_AFTER: Duration = Duration::from_secs(2);
/// The profile route looks for thread states without the hook this often (reads
/// only; the threads are stopped only when one needs it).
const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// Records taken per drain.
const BATCH: usize = 1024;
/// Code objects' names kept across drains (see `HookProc::named`) at most.
const MAX_NAMED: usize = 1 << 16;
/// Frames whose entry or return tokens are kept (see `HookProc::repeats`) at most.
const MAX_REPEATS: usize = 1 << 16;
/// Deepest shadow stack kept per thread.
const MAX_SHADOW: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Installed,
    Failed,
}

/// The hook in one process. Its frames are `Rc`s: the engine runs on one thread,
/// and every record clones or drops a few (an atomic count cost more than the
/// rest of naming a record).
struct HookProc {
    mem: ProcessMemory,
    reader: RingReader,
    /// The ring's heartbeat, beaten while the hook lives (before `mapping`).
    _beat: pyprobe_sdt::tracer::ring_engine::heartbeat::BeatTicket,
    mapping: MmapMut,
    /// Where the ring is mapped in the target (the hook's code names it).
    ring_addr: u64,
    state_addr: u64,
    hook: HookCode,
    /// The jump at the safe point, while it is there (monitoring route).
    detour: Option<Detour>,
    breaker: Option<Breaker>,
    /// The profile route: its layout, when the thread states are next looked at,
    /// whether a new thread is held for that, and the thread states already said to
    /// run the target's own profiler.
    profile: Option<ProfileTarget>,
    next_sweep: Instant,
    sweep_now: bool,
    said_taken: std::collections::HashSet<u64>,
    phase: Phase,
    since: Instant,
    last_raise: Instant,
    said_slow: bool,
    /// The monitoring route: when the interpreters and pyprobe's tool are next
    /// looked at (`None`: the profile route, or nothing left to say).
    next_look: Option<Instant>,
    said_subinterpreters: bool,
    /// The slots of pyprobe's tool in the main interpreter, while they hold
    /// pyprobe's (`tool_looked`: searched for already).
    tool: Option<tool::ToolSlots>,
    tool_looked: bool,
    /// The slots of a tool whose events the program turned off: pyprobe still
    /// holds it, and gives it back from outside when it leaves.
    silenced: Option<tool::ToolSlots>,
    walker: Walker,
    /// `%fs` base → tid.
    fs_tids: FxHashMap<u64, i32>,
    buffers: HitBuffers,
    /// Per drain: (code object, `co_name`, `co_filename`, first line) → its frame
    /// (or `None`: not readable).
    names: FxHashMap<CodeParts, Option<Rc<PyFrame>>>,
    /// The parts named last in this drain and their frame: a loop or a recursion
    /// enters one code object run after run, named with no hashing.
    last_named: Option<(CodeParts, Rc<PyFrame>)>,
    /// The same parts once named, kept across drains, with the `co_qualname`
    /// pointer the code object had then (3.11+; 0 before): parts met again are
    /// named from here, not read again, once [`HookProc::recheck`] found
    /// the pointer unchanged in this drain. The parts are what the hook read from
    /// the code object when it ran, so a code object freed and another put at its
    /// address has other parts (its own name and file pointers, first line, the
    /// strings' identity) unless it is the same function again, or one made from
    /// a copy of its source with another qualified name (a class made from a
    /// template): the pointer tells those apart. The records still in the ring
    /// when the target exits are named from here after its memory is gone.
    named: FxHashMap<CodeParts, (Rc<PyFrame>, u64)>,
    /// The names calls carried as text, by their parts (the hook sends them once
    /// per parts; the same parts mean the same name and file texts). Used where
    /// the target's memory no longer names them.
    copied: FxHashMap<CodeParts, Rc<PyFrame>>,
    /// [`HookProc::recheck`]'s reused room.
    recheck: drain::Recheck,
    /// Type objects' names.
    types: TypeNames,
    /// Per thread: the code objects entered and not yet left, with their names.
    shadow: FxHashMap<u64, Vec<(u64, Rc<PyFrame>)>>,
    /// The token the sink gave each kind of record (call, resume, return, raise)
    /// of a frame, by the kind and the frame's address (its `Rc` kept here, so
    /// the address is not reused): later ones pass as `TraceEvent::Repeat`.
    repeats: FxHashMap<(u32, usize), (u32, Rc<PyFrame>)>,
    /// Per kind, the frame address and token last found in `repeats` (0: none):
    /// a loop or a recursion repeats one frame run after run, found with no
    /// hashing. Emptied with `repeats`, whose entries keep the addresses taken.
    last_repeats: [(usize, u32); 4],
    /// The frame of every code object that could not be named: one, so its
    /// records repeat like any other frame's.
    unknown: Rc<PyFrame>,
    /// What functions returned, by type.
    returns: ReturnTable,
    /// The producers' losses reported so far.
    lost: pyprobe_sdt::ring::LostCounter,
    /// Records read from the ring, not yet named and passed on (see `drain`).
    pending: std::collections::VecDeque<drain::HookRecord>,
    /// The buffer records are read into, kept across drains (few carry texts:
    /// a batch of records stays small in the cache).
    raw: Vec<crate::hook::units::Decoded>,
    /// The ring's units turned back into records: the tables the hook keeps,
    /// as it has sent them.
    units: crate::hook::units::UnitDecoder,
    /// Every record stamped before this counter value has been read.
    read_to: u64,
    /// The process's memory is no longer the image its records point into (it
    /// exec'd or exited): records are named from `named` only.
    image_gone: bool,
}

/// The hook engine: its processes, and those that wait to be hooked. The engine
/// drives it as its [`EventSource`].
#[derive(Default)]
pub struct HookBook {
    procs: HashMap<i32, HookProc>,
    /// Launched processes whose interpreter has no thread state yet.
    awaiting: HashMap<i32, Awaiting>,
    /// Hook records read by `drain_rings` since `drain_hooks` last said how many
    /// it drained (the event loop idles when a turn drains nothing).
    read_with_rings: usize,
    /// Forked children not yet at their first stop: their parent's state words
    /// when it forked.
    forked: HashMap<i32, fork::ForkedWords>,
}

impl EventSource for HookBook {
    fn active(&self) -> bool {
        !self.procs.is_empty() || !self.awaiting.is_empty()
    }

    fn awaits(&self, pid: Option<i32>) -> bool {
        match pid {
            Some(pid) => self.awaiting.contains_key(&pid),
            None => !self.awaiting.is_empty(),
        }
    }

    fn serves(&self, pid: i32) -> bool {
        self.procs.contains_key(&pid)
    }

    fn await_start(&mut self, pid: i32) {
        self.awaiting.insert(pid, Awaiting::new());
    }

    fn ready(&mut self, pid: i32) -> bool {
        self.awaiting.get_mut(&pid).is_some_and(|a| a.started(pid))
    }

    fn due_ready(&mut self, now: Instant) -> Vec<i32> {
        launched::due_ready(&mut self.awaiting, now)
    }

    fn stop_awaiting(&mut self, pid: i32) {
        self.awaiting.remove(&pid);
    }

    fn place(&mut self, at: Placement<'_>, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        self.install_hook(at, sink)
    }

    fn forked(&mut self, parent: i32, child: i32) {
        self.parent_forked(parent, child);
    }

    fn adopt(
        &mut self,
        parent: i32,
        at: Placement<'_>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<bool> {
        self.adopt_child(parent, at, sink)
    }

    /// A new thread at its first stop: its `%fs` base names its records. On the
    /// profile route, returns true: hold it until its thread state has the hook
    /// (made by its creator before the thread started), so its first call counts.
    fn thread_started(&mut self, pid: i32, tid: i32) -> bool {
        let Some(h) = self.procs.get_mut(&pid) else {
            return false;
        };
        if let Ok(regs) = ptrace::getregs(Pid::from_raw(tid)) {
            h.fs_tids.insert(regs.fs_base, tid);
        }
        if h.profile.is_some() && h.phase == Phase::Installed {
            h.sweep_now = true;
            return true;
        }
        false
    }

    /// A task of process `pid` made a new one (its creator stopped at the event,
    /// or the new task at its first stop, neither run since): the hook's ring has
    /// more than one producer from now on, which reserve with `lock`. As
    /// `ring_many_producers` does for the SDT ring, and for the same reason safe.
    fn many_producers(&self, pid: i32) {
        if let Some(h) = self.procs.get(&pid) {
            h.reader.set_solo(false);
        }
    }

    fn watch(
        &mut self,
        guardian: Option<&mut Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Vec<i32> {
        self.watch_status(guardian, sink)
    }

    fn watch_stopped(
        &mut self,
        pid: i32,
        guardian: Option<&mut Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.status_stopped(pid, guardian, sink)
    }

    fn sweep(&mut self, now: Instant, sink: &mut dyn FnMut(TraceEvent)) -> Vec<(i32, SweepNeed)> {
        self.sweep_profiles(now, sink)
    }

    fn sweep_stopped(&mut self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        self.sweep_profiles_stopped(pid, sink)
    }

    fn drain(
        &mut self,
        alone: &dyn Fn(i32) -> bool,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize {
        let pids: Vec<i32> = self.procs.keys().copied().filter(|&p| alone(p)).collect();
        let mut drained = std::mem::take(&mut self.read_with_rings);
        for pid in pids {
            drained += self.drain_of(pid, tsc, hits, sink);
        }
        drained
    }

    /// Drains the hook ring of `pid` into hits, one batch: read, then named and
    /// passed on whatever the SDT ring holds. Returns the records read and passed on.
    fn drain_of(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize {
        let Some(h) = self.procs.get_mut(&pid) else {
            return 0;
        };
        let read = h.collect(pid, tsc, sink);
        let passed = h.emit(pid, u64::MAX, hits, sink);
        read + passed
    }

    /// Before the SDT ring of `pid` is read: its hook ring is read (and named), and
    /// the SDT ring bounded to what is older than the hook records read.
    fn before_ring(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> RingBound {
        match self.procs.get_mut(&pid) {
            Some(h) => {
                let read = h.collect(pid, tsc, sink);
                self.read_with_rings += read;
                RingBound {
                    tsc: h.read_to,
                    read,
                }
            }
            None => RingBound::NONE,
        }
    }

    fn emit_upto(
        &mut self,
        pid: i32,
        upto_ns: u64,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize {
        self.procs
            .get_mut(&pid)
            .map_or(0, |h| h.emit(pid, upto_ns, hits, sink))
    }

    fn detach(
        &mut self,
        alive: &dyn Fn(i32) -> bool,
        guardian: Option<&mut Guardian>,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.leave_all(alive, guardian, tsc, hits, sink)
    }

    fn image_gone(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.leave_image(pid, tsc, hits, sink)
    }

    fn reset(&mut self) {
        *self = HookBook::default();
    }
}
