//! Placing the hook in a process (every thread stopped): the install itself is
//! `setup`'s; here the ring is served, what was done is said, and the process's
//! [`HookProc`] starts. Apart from the engine's face: the longest of its steps.

use std::collections::HashSet;
use std::rc::Rc;
use std::time::Instant;

use anyhow::Result;
use memmap2::MmapMut;
use rustc_hash::FxHashMap;

use crate::hook::{Detour, HookCode};
use crate::python::walker::{PyFrame, Walker};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::RingReader;
use pyprobe_sdt::tracer::clock::monotonic_ns;
use pyprobe_sdt::tracer::decode::HitBuffers;
use pyprobe_sdt::tracer::engine::source::Placement;
use pyprobe_sdt::tracer::engine::TraceEvent;
use pyprobe_sdt::tracer::ring_engine::{BUDGETED_PATIENCE_NS, CONSUMER_STALE_NS};

use super::profile::ProfileTarget;
use super::returns::{ReturnTable, TypeNames};
use super::setup::Breaker;
use super::watch::say_taken;
use super::{drain, setup, HookBook, HookProc, Phase, SWEEP_EVERY};

impl HookBook {
    /// Installs the hook (with the walker that saw a launched interpreter ready,
    /// if any).
    pub(super) fn install_hook(
        &mut self,
        mut at: Placement<'_>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        let pid = at.pid;
        let walker = self.awaiting.remove(&pid).and_then(|a| a.walker);
        let rips: Vec<u64> = at.threads.iter().map(|t| t.rip).collect();
        let fs_tids: FxHashMap<u64, i32> = at.threads.iter().map(|t| (t.fs_base, t.tid)).collect();
        let mut mem = ProcessMemory::new(pid);
        let installed = setup::install(
            pid,
            at.tid,
            &mut mem,
            &rips,
            walker,
            at.guardian.as_deref_mut(),
        )?;
        serve_ring(&installed.reader, &at, sink);
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
        let mut said_taken = HashSet::new();
        say_taken(pid, &installed.taken, &mut said_taken, sink);
        let h = HookProc::new(Parts {
            mem,
            reader: installed.reader,
            mapping: installed.mapping,
            ring_addr: installed.ring_addr,
            state_addr: installed.state_addr,
            hook: installed.hook,
            detour: installed.detour,
            breaker: installed.breaker,
            profile: installed.profile,
            walker: installed.walker,
            fs_tids,
            said_taken,
            phase: Phase::Waiting,
        });
        self.procs.insert(pid, h);
        Ok(())
    }
}

/// Serves the hook's ring of process `at.pid` as the SDT rings are (every thread
/// still stopped, so before any callback runs): a full ring is waited on while
/// pyprobe lives, except that under a budget an event waits a little, then is
/// counted lost; with one thread, its records reserve without `lock`.
pub(super) fn serve_ring(
    reader: &RingReader,
    at: &Placement<'_>,
    sink: &mut dyn FnMut(TraceEvent),
) {
    let patience = match at.budgeted {
        true => at.tsc.ns_to_ticks(BUDGETED_PATIENCE_NS),
        false => u64::MAX,
    };
    reader.serve(at.tsc.ns_to_ticks(CONSUMER_STALE_NS), patience);
    pyprobe_sdt::tracer::ring_engine::set_solo_if_alone(
        reader,
        "hook",
        at.pid,
        at.threads.len(),
        sink,
    );
}

/// What a [`HookProc`] starts from: the hook put in ([`setup::install`]) or
/// kept by a forked child (`fork`).
pub(super) struct Parts {
    pub(super) mem: ProcessMemory,
    pub(super) reader: RingReader,
    pub(super) mapping: MmapMut,
    pub(super) ring_addr: u64,
    pub(super) state_addr: u64,
    pub(super) hook: HookCode,
    pub(super) detour: Option<Detour>,
    pub(super) breaker: Option<Breaker>,
    pub(super) profile: Option<ProfileTarget>,
    pub(super) walker: Walker,
    pub(super) fs_tids: FxHashMap<u64, i32>,
    pub(super) said_taken: HashSet<u64>,
    pub(super) phase: Phase,
}

impl HookProc {
    /// A hooked process's state, its ring served (its heartbeat beaten), nothing
    /// read or named yet.
    pub(super) fn new(parts: Parts) -> HookProc {
        let now = Instant::now();
        let lost = pyprobe_sdt::ring::LostCounter::new(parts.reader.lost(), monotonic_ns());
        HookProc {
            mem: parts.mem,
            _beat: pyprobe_sdt::tracer::ring_engine::heartbeat::keep_beating(&parts.reader),
            reader: parts.reader,
            mapping: parts.mapping,
            ring_addr: parts.ring_addr,
            state_addr: parts.state_addr,
            hook: parts.hook,
            detour: parts.detour,
            breaker: parts.breaker,
            profile: parts.profile,
            next_sweep: now + SWEEP_EVERY,
            sweep_now: false,
            said_taken: parts.said_taken,
            phase: parts.phase,
            since: now,
            last_raise: now,
            said_slow: false,
            next_look: parts.profile.is_none().then_some(now),
            said_subinterpreters: false,
            tool: None,
            tool_looked: false,
            silenced: None,
            walker: parts.walker,
            fs_tids: parts.fs_tids,
            buffers: HitBuffers::default(),
            names: FxHashMap::default(),
            named: FxHashMap::default(),
            copied: FxHashMap::default(),
            recheck: drain::Recheck::default(),
            types: TypeNames::default(),
            shadow: FxHashMap::default(),
            last_named: None,
            last_repeats: [(0, 0); 4],
            repeats: FxHashMap::default(),
            unknown: Rc::new(PyFrame::gone()),
            returns: ReturnTable::default(),
            lost,
            pending: std::collections::VecDeque::new(),
            raw: Default::default(),
            units: Default::default(),
            read_to: 0,
            image_gone: false,
        }
    }
}
