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
//!   named [`UNKNOWN`], and still counted.
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

mod drain;
mod launched;
mod profile;
mod returns;
mod reuse;
mod setup;

use std::collections::HashMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use memmap2::MmapMut;
use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::hook::{failed_step, Detour, HookCode};
use crate::hook::{
    STATUS_OK, STATUS_REMOVED, STATUS_RUNNING, ST_ARMED, ST_AT_EXIT, ST_ON, ST_STATUS,
};
use crate::python::walker::{PyFrame, Walker};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::RingReader;
use pyprobe_sdt::tracer::clock::monotonic_ns;
use pyprobe_sdt::tracer::decode::HitBuffers;
use pyprobe_sdt::tracer::engine::source::{EventSource, Placement, SweepNeed};
use pyprobe_sdt::tracer::engine::TraceEvent;
use pyprobe_sdt::tracer::guardian::{Guardian, Op};
use pyprobe_sdt::tracer::ring_engine::tsc::TscClock;
use pyprobe_sdt::tracer::ring_engine::{BUDGETED_PATIENCE_NS, CONSUMER_STALE_NS};

use launched::Awaiting;
use profile::{ProfileTarget, Slot};
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
/// The name of a code object freed before pyprobe could read it.
pub const UNKNOWN: &str = "<code object gone before pyprobe read it>";
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

/// The hook in one process.
struct HookProc {
    mem: ProcessMemory,
    reader: RingReader,
    /// The ring's heartbeat, beaten while the hook lives (before `_mapping`).
    _beat: pyprobe_sdt::tracer::ring_engine::heartbeat::BeatTicket,
    _mapping: MmapMut,
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
    walker: Walker,
    /// `%fs` base → tid.
    fs_tids: FxHashMap<u64, i32>,
    buffers: HitBuffers,
    /// Per drain: (code object, `co_name`, `co_filename`, first line) → its frame
    /// (or `None`: not readable).
    names: FxHashMap<[u64; 5], Option<Arc<PyFrame>>>,
    /// The same parts once named, kept across drains, with the `co_qualname`
    /// pointer the code object had then (3.11+; 0 before): parts met again are
    /// named from here, not read again, once [`HookProc::recheck_named`] found
    /// the pointer unchanged in this drain. The parts are what the hook read from
    /// the code object when it ran, so a code object freed and another put at its
    /// address has other parts (its own name and file pointers, first line, the
    /// strings' identity) unless it is the same function again, or one made from
    /// a copy of its source with another qualified name (a class made from a
    /// template): the pointer tells those apart. The records still in the ring
    /// when the target exits are named from here after its memory is gone.
    named: FxHashMap<[u64; 5], (Arc<PyFrame>, u64)>,
    /// [`HookProc::recheck_named`]'s reused room.
    recheck: drain::Recheck,
    /// Type objects' names.
    types: TypeNames,
    /// Per thread: the code objects entered and not yet left, with their names.
    shadow: FxHashMap<u64, Vec<(u64, Arc<PyFrame>)>>,
    /// The token the sink gave the entry (`true`) or return of a frame, by the
    /// frame's address (its `Arc` kept here, so the address is not reused):
    /// later ones pass as `TraceEvent::Repeat`.
    repeats: FxHashMap<(bool, usize), (u32, Arc<PyFrame>)>,
    /// The frame of every code object that could not be named: one, so its
    /// records repeat like any other frame's.
    unknown: Arc<PyFrame>,
    /// What functions returned, by type.
    returns: ReturnTable,
    /// The producers' losses reported so far.
    lost: pyprobe_sdt::ring::LostCounter,
    /// Records read from the ring, not yet named and passed on (see `drain`).
    pending: std::collections::VecDeque<drain::HookRecord>,
    /// The buffer records are read into, kept across drains.
    raw: Vec<drain::RawRecord>,
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

    /// Installs the hook (with the walker that saw a launched interpreter ready,
    /// if any).
    fn place(&mut self, at: Placement<'_>, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        let pid = at.pid;
        let walker = self.awaiting.remove(&pid).and_then(|a| a.walker);
        let rips: Vec<u64> = at.threads.iter().map(|t| t.rip).collect();
        let fs_tids: FxHashMap<u64, i32> = at.threads.iter().map(|t| (t.fs_base, t.tid)).collect();
        let mut mem = ProcessMemory::new(pid);
        let installed = setup::install(pid, at.tid, &mut mem, &rips, walker, at.guardian)?;
        let tsc = at.tsc;
        // Served as the SDT rings are (every thread still stopped, so before any
        // callback runs): a full ring is waited on while pyprobe lives, except that
        // under a budget an event waits a little, then is counted lost.
        let patience = match at.budgeted {
            true => tsc.ns_to_ticks(BUDGETED_PATIENCE_NS),
            false => u64::MAX,
        };
        installed
            .reader
            .serve(tsc.ns_to_ticks(CONSUMER_STALE_NS), patience);
        pyprobe_sdt::tracer::ring_engine::set_solo_if_alone(
            &installed.reader,
            "hook",
            pid,
            rips.len(),
            sink,
        );
        match &installed.detour {
            Some(d) => sink(TraceEvent::Detail(format!(
                "hook engine in process {pid}: hook at {:#x}, detour at _Py_HandlePending ({:#x}); \
                 waiting for a thread to run Python code",
                installed.hook.addr, d.site
            ))),
            None => sink(TraceEvent::Detail(format!(
                "hook engine in process {pid}: hook at {:#x}, set as the profile function of its \
                 threads",
                installed.hook.addr
            ))),
        }
        for note in &installed.notes {
            sink(TraceEvent::Detail(format!(
                "hook engine in process {pid}: {note}"
            )));
        }
        let mut said_taken = std::collections::HashSet::new();
        say_taken(pid, &installed.taken, &mut said_taken, sink);
        let now = Instant::now();
        let lost = pyprobe_sdt::ring::LostCounter::new(installed.reader.lost(), monotonic_ns());
        self.procs.insert(
            pid,
            HookProc {
                mem,
                _beat: pyprobe_sdt::tracer::ring_engine::heartbeat::keep_beating(&installed.reader),
                reader: installed.reader,
                _mapping: installed.mapping,
                state_addr: installed.state_addr,
                hook: installed.hook,
                detour: installed.detour,
                breaker: installed.breaker,
                profile: installed.profile,
                next_sweep: now + SWEEP_EVERY,
                sweep_now: false,
                said_taken,
                phase: Phase::Waiting,
                since: now,
                last_raise: now,
                said_slow: false,
                walker: installed.walker,
                fs_tids,
                buffers: HitBuffers::default(),
                names: FxHashMap::default(),
                named: FxHashMap::default(),
                recheck: drain::Recheck::default(),
                types: TypeNames::default(),
                shadow: FxHashMap::default(),
                repeats: FxHashMap::default(),
                unknown: Arc::new(PyFrame {
                    file: UNKNOWN.into(),
                    function: UNKNOWN.into(),
                    name: UNKNOWN.into(),
                    first_line: 0,
                    line: 0,
                }),
                returns: ReturnTable::default(),
                lost,
                pending: std::collections::VecDeque::new(),
                raw: Vec::with_capacity(BATCH),
                read_to: 0,
                image_gone: false,
            },
        );
        Ok(())
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

    /// Hooks waiting for their installer: done, failed, or due to raise the
    /// breaker again (the pids returned, whose threads must be stopped to put the
    /// entry back or raise the breaker).
    fn watch(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Vec<i32> {
        for (&pid, h) in self.procs.iter_mut() {
            if h.phase != Phase::Installed {
                continue;
            }
            let status = h.mem.read_u64(h.state_addr + ST_STATUS as u64).unwrap_or(0);
            if status == STATUS_REMOVED {
                h.phase = Phase::Failed;
                sink(TraceEvent::Notice(format!(
                    "process {pid}: the hook unregistered itself: pyprobe had not read its ring \
                     for 10 s (stopped?), so calls after that are not traced"
                )));
            }
        }
        let mut stop_for = Vec::new();
        for (&pid, h) in self.procs.iter_mut() {
            if h.phase != Phase::Waiting {
                continue;
            }
            let status = h.mem.read_u64(h.state_addr + ST_STATUS as u64).unwrap_or(0);
            if status == STATUS_OK {
                h.phase = Phase::Installed;
                let exit_in = h
                    .mem
                    .read_u64(h.state_addr + ST_AT_EXIT as u64)
                    .unwrap_or(0)
                    != 0;
                sink(TraceEvent::Detail(format!(
                    "hook engine in process {pid}: installed after {} ms ({}); its exit callback {}",
                    h.since.elapsed().as_millis(),
                    if h.profile.is_some() {
                        "each thread's profile function"
                    } else {
                        "sys.monitoring tool 4"
                    },
                    if exit_in {
                        "registered with atexit"
                    } else {
                        "not taken by atexit yet (the interpreter is starting): tried again as \
                         calls come"
                    }
                )));
            } else if status != 0 && status != STATUS_RUNNING {
                h.phase = Phase::Failed;
                sink(TraceEvent::Notice(format!(
                    "process {pid}: the hook could not register with sys.monitoring ({}), so no calls \
                     are traced",
                    failed_step(status).unwrap_or("unknown step")
                )));
            } else {
                if h.since.elapsed() >= SLOW_AFTER && !h.said_slow {
                    h.said_slow = true;
                    sink(TraceEvent::Notice(format!(
                        "process {pid}: no thread has run Python code in the {} s since the hook was \
                         armed (blocked in C or idle?); calls are traced from when one does",
                        SLOW_AFTER.as_secs()
                    )));
                }
                let every = if h.said_slow {
                    RAISE_SLOWLY
                } else {
                    RAISE_EVERY
                };
                if h.last_raise.elapsed() < every {
                    continue;
                }
            }
            if h.detour.is_none() && h.phase != Phase::Waiting {
                continue;
            }
            stop_for.push(pid);
        }
        stop_for
    }

    /// Threads stopped: the entry put back, or the breaker raised again.
    fn watch_stopped(
        &mut self,
        pid: i32,
        guardian: Option<&mut Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(h) = self.procs.get_mut(&pid) else {
            return;
        };
        if h.phase == Phase::Waiting {
            h.last_raise = Instant::now();
            let tstates = h.walker.thread_state_addrs().unwrap_or_default();
            if let Some(breaker) = h.breaker {
                let _ = setup::raise(&mut h.mem, &tstates, breaker);
            }
        } else if let Err(e) = unpatch(pid, h, guardian) {
            sink(TraceEvent::Notice(format!("process {pid}: {e:#}")));
        }
    }

    /// The profile route: the thread states read for ones without the hook (reads
    /// only); those that have one get it with every thread stopped, and a new
    /// thread held for this goes on.
    fn sweep(&mut self, now: Instant, sink: &mut dyn FnMut(TraceEvent)) -> Vec<(i32, SweepNeed)> {
        let mut due = Vec::new();
        for (&pid, h) in self.procs.iter_mut() {
            if h.profile.is_none() || h.phase != Phase::Installed {
                continue;
            }
            if !h.sweep_now && now < h.next_sweep {
                continue;
            }
            let held = std::mem::take(&mut h.sweep_now);
            h.next_sweep = now + SWEEP_EVERY;
            let Some(target) = h.profile else { continue };
            let cb = h.hook.callbacks[0];
            let tstates = h.walker.thread_state_addrs().unwrap_or_default();
            let mut free = false;
            let mut taken = Vec::new();
            for &t in &tstates {
                match target.slot(&h.mem, t, cb) {
                    Ok(Slot::Free) => free = true,
                    Ok(Slot::Taken) => taken.push(t),
                    _ => {}
                }
            }
            say_taken(pid, &taken, &mut h.said_taken, sink);
            if free {
                due.push((pid, SweepNeed::Stop));
            } else if held {
                due.push((pid, SweepNeed::Release));
            }
        }
        due
    }

    fn sweep_stopped(&mut self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let Some(h) = self.procs.get_mut(&pid) else {
            return;
        };
        let Some(target) = h.profile else { return };
        let cb = h.hook.callbacks[0];
        // Read again, every thread stopped: the list may have changed.
        let tstates = h.walker.thread_state_addrs().unwrap_or_default();
        match setup::set_profiles(&mut h.mem, &target, &tstates, cb) {
            Ok(taken) => say_taken(pid, &taken, &mut h.said_taken, sink),
            Err(e) => sink(TraceEvent::Notice(format!(
                "process {pid}: a thread could not be given the hook: {e:#}"
            ))),
        }
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
    ) -> u64 {
        match self.procs.get_mut(&pid) {
            Some(h) => {
                self.read_with_rings += h.collect(pid, tsc, sink);
                h.read_to
            }
            None => u64::MAX,
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

    /// Leaving (every thread stopped): the hook told to unregister, the entry put
    /// back, the ring drained, what the functions returned said.
    fn detach(
        &mut self,
        alive: &dyn Fn(i32) -> bool,
        mut guardian: Option<&mut Guardian>,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let pids: Vec<i32> = self.procs.keys().copied().collect();
        for pid in pids {
            if let Some(h) = self.procs.get_mut(&pid).filter(|_| alive(pid)) {
                let _ = h
                    .mem
                    .write(h.state_addr + ST_ARMED as u64, &0u64.to_le_bytes());
                let _ = h
                    .mem
                    .write(h.state_addr + ST_ON as u64, &0u64.to_le_bytes());
                if let Err(e) = unpatch(pid, h, guardian.as_deref_mut()) {
                    sink(TraceEvent::Notice(format!("process {pid}: {e:#}")));
                }
                if let Some(g) = guardian.as_deref_mut() {
                    let _ = g.tell(Op::SiteRestored, pid, h.state_addr + ST_ON as u64);
                }
            }
            while self.drain_of(pid, tsc, hits, sink) > 0 {}
            if let Some(h) = self.procs.remove(&pid) {
                say_waited(pid, &h, tsc, sink);
                // Callbacks stop waiting for room: nobody reads the ring any more,
                // nor follows the process's threads.
                h.reader.set_solo(false);
                h.reader.leave();
                if h.phase == Phase::Installed {
                    sink(TraceEvent::Detail(format!(
                        "hook engine in process {pid}: told to unregister; it does at the target's \
                         next Python call; its page ({:#x}, {} bytes) and its ring stay mapped for the next \
                         attach to use again",
                        h.hook.addr,
                        h.hook.bytes.len()
                    )));
                }
                flush_return_types(pid, h, sink);
            }
        }
        self.awaiting.clear();
    }

    /// The image of `pid` is gone (it exec'd, or its leader exited): what its ring
    /// still holds is read (named from what was named before: the memory is no
    /// longer the image the records point into), its last return-type totals go
    /// out, and its ring mapping is dropped. A new image is hooked afresh.
    fn image_gone(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.awaiting.remove(&pid);
        let Some(h) = self.procs.get_mut(&pid) else {
            return;
        };
        h.image_gone = true;
        while self.drain_of(pid, tsc, hits, sink) > 0 {}
        if let Some(h) = self.procs.remove(&pid) {
            say_waited(pid, &h, tsc, sink);
            flush_return_types(pid, h, sink);
        }
    }

    fn reset(&mut self) {
        *self = HookBook::default();
    }
}

/// Says once per thread state that the target's own profiler holds its profile
/// function (profile route): its calls are not traced while it does.
fn say_taken(
    pid: i32,
    taken: &[u64],
    said: &mut std::collections::HashSet<u64>,
    sink: &mut dyn FnMut(TraceEvent),
) {
    let new = taken.iter().filter(|&&t| said.insert(t)).count();
    if new > 0 {
        sink(TraceEvent::Notice(format!(
            "process {pid}: {new} thread(s) run a profile function of the target's own (cProfile, \
             sys.setprofile); before CPython 3.12 a thread has one, so their calls are not traced \
             until the target lets it go"
        )));
    }
}

/// For `-v`: how long the target's callbacks waited for room in the hook's ring,
/// i.e. held the target because pyprobe read more slowly than it wrote.
fn say_waited(pid: i32, h: &HookProc, tsc: Option<&TscClock>, sink: &mut dyn FnMut(TraceEvent)) {
    let Some(tsc) = tsc else {
        return;
    };
    let waited_ns = tsc.ticks_to_ns(h.reader.waited_cycles());
    sink(TraceEvent::Detail(format!(
        "hook engine in process {pid}: the target waited {:.1} ms in all for room in the ring \
         (pyprobe reading more slowly than it wrote)",
        waited_ns as f64 / 1e6
    )));
}

/// The last return-type totals of a hook that is done with.
fn flush_return_types(pid: i32, h: HookProc, sink: &mut dyn FnMut(TraceEvent)) {
    let mut returns = h.returns;
    let rows = returns.take_changed();
    if !rows.is_empty() {
        sink(TraceEvent::ReturnTypes {
            pid,
            ts_ns: monotonic_ns(),
            rows: &rows,
        });
    }
}

/// Puts the safe point's bytes back (every thread stopped).
fn unpatch(pid: i32, h: &mut HookProc, guardian: Option<&mut Guardian>) -> Result<()> {
    let Some(d) = h.detour.take() else {
        return Ok(());
    };
    let mut now = vec![0u8; d.patch.len()];
    h.mem.read(d.site, &mut now)?;
    if now == d.patch {
        h.mem.write(d.site, &d.original)?;
    }
    if let Some(g) = guardian {
        let _ = g.tell(Op::SiteRestored, pid, d.site);
    }
    Ok(())
}
