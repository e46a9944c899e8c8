//! Following a fork: a forked child of a hooked process keeps the hook's page
//! and, on 3.12+, its `sys.monitoring` registration (on 3.7 to 3.11, the forking
//! thread's profile function), but its state page is all zero
//! (`MADV_WIPEONFORK`) and it has no ring (`MADV_DONTFORK`), so its callbacks
//! would unregister at its first event. At the child's first stop, before it has
//! run anything, pyprobe gives it a ring of its own where its parent's stood (the
//! hook's code names that address) and the state words its parent had when it
//! forked: its callbacks then record into its own ring from its first event.
//!
//! The parent's words are read at its fork-event stop ([`HookBook::parent_forked`]): the
//! forking thread holds the GIL across `fork()`, and the callbacks, which change
//! those words, run only with the GIL held, so what is read there is what the
//! child got. The child's own memory must agree before anything is written: its
//! interpreter still holds pyprobe's callbacks (the monitoring route) or a thread
//! state with the hook as profile function (the profile route), and an exit
//! callback the words name is a function object of the hook's in its memory. A
//! child that does not agree is left to unregister, and said untraced.
//!
//! The order keeps a child that pyprobe leaves half-way safe: the ring is mapped
//! first (the callbacks write where the hook's code says), the words next, `on`
//! last, after the guardian was told to clear it should pyprobe die.

use anyhow::{anyhow, bail, Context, Result};
use rustc_hash::FxHashMap;

use crate::hook::{
    STATE_LEN, STATUS_OK, ST_AT_EXIT, ST_CALLBACKS, ST_GONE, ST_ON, ST_STATUS, ST_TABLES,
};
use crate::python::walker::Walker;
use pyprobe_sdt::process::maps::read_maps;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::RingReader;
use pyprobe_sdt::tracer::engine::source::Placement;
use pyprobe_sdt::tracer::engine::TraceEvent;
use pyprobe_sdt::tracer::inject::Injector;

use super::place::{serve_ring, Parts};
use super::profile::Slot;
use super::reuse::{NAME_AT, RING_NAME};
use super::setup::{hook_ring, tell_guardian};
use super::tool::{monitoring_events, FirstLook, ToolSlots};
use super::{HookBook, HookProc, Phase};

/// Forked children whose parent's words are kept, waiting for their first stop,
/// at most (a child that dies before it stops never asks for its own).
const MAX_PENDING: usize = 256;
/// `offsetof(PyCFunctionObject, m_ml)`, the same on 3.7 to 3.15 (default builds:
/// the hook refuses free-threaded ones), and the most references a live function
/// object of the hook's holds (3.12+ immortal objects hold about 2^32).
const CFUNCTION_ML: u64 = 16;
const MOST_REFS: u64 = 1 << 40;

/// The state words (before the sent tables) of a parent when it forked.
pub(super) struct ForkedWords {
    parent: i32,
    words: Vec<u8>,
}

impl ForkedWords {
    fn word(&self, at: usize) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&self.words[at..at + 8]);
        u64::from_le_bytes(w)
    }
}

impl HookBook {
    /// `parent` forked `child` and stands at its fork-event stop: its state words
    /// are what the child got.
    pub(super) fn parent_forked(&mut self, parent: i32, child: i32) {
        let Some(h) = self.procs.get(&parent) else {
            return;
        };
        // Whether the hook was in (the installer may have run just before the
        // fork, unseen by pyprobe yet) is for the words to say.
        if h.image_gone {
            return;
        }
        let mut words = vec![0u8; ST_TABLES];
        if h.mem.read(h.state_addr, &mut words).is_err() {
            return;
        }
        if self.forked.len() >= MAX_PENDING {
            self.forked.clear();
        }
        self.forked.insert(child, ForkedWords { parent, words });
    }

    /// Forked `child` at its first stop (`at`: its one thread): the hook goes on
    /// in it, or why not. `Ok(false)`: pyprobe's hook was not in its parent.
    pub(super) fn adopt_child(
        &mut self,
        parent: i32,
        at: Placement<'_>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<bool> {
        let child = at.pid;
        let Some(forked) = self.forked.remove(&child).filter(|f| f.parent == parent) else {
            return Ok(false);
        };
        let Some(p) = self.procs.get(&parent) else {
            return Ok(false);
        };
        if forked.word(ST_ON) != 1
            || forked.word(ST_GONE) != 0
            || forked.word(ST_STATUS) != STATUS_OK
        {
            bail!("the hook was not in its parent when it forked (being installed, or removed)");
        }
        let mut mem = ProcessMemory::new(child);
        let mut walker = Walker::attach(child).context("reading the child's interpreter")?;
        let tool = check_child_holds_hook(p, &forked, &mem, &mut walker)?;
        let maps = read_maps(child)?;
        let ring_addr = p.ring_addr;
        let ring_end = ring_addr + p.mapping.len() as u64;
        if let Some(m) = maps
            .iter()
            .find(|m| m.start < ring_end && ring_addr < m.end)
        {
            bail!(
                "its parent's ring range {ring_addr:#x}..{ring_end:#x} holds a mapping in it \
                 ({:#x}..{:#x})",
                m.start,
                m.end
            );
        }
        // A detour the parent still had when it forked: the child never installs,
        // so its entry gets its bytes back now (it stands at its fork's return).
        if let Some(d) = &p.detour {
            let mut now = vec![0u8; d.patch.len()];
            mem.read(d.site, &mut now)?;
            if now == d.patch {
                mem.write(d.site, &d.original)?;
            }
        }
        let state_addr = p.state_addr;
        // The memfd's name is read from the state page.
        mem.write(state_addr + NAME_AT, RING_NAME)?;
        let inj = Injector::find(child, at.tid, &mem)?.guarded(at.guardian.as_deref(), &mem);
        let (got, mut mapping) = hook_ring(child, &inj, state_addr, Some(ring_addr))?;
        if got != ring_addr {
            bail!("its ring was mapped at {got:#x}, not at {ring_addr:#x}");
        }
        // SAFETY: the mapping lives as long as the reader (both in the HookProc).
        let reader = unsafe { RingReader::new(mapping.as_mut_ptr(), mapping.len()) }
            .map_err(|e| anyhow!("{e}"))?;
        serve_ring(&reader, &at, sink);
        // Every word but `on`; the tables empty, as the reader's are.
        mem.write(state_addr + 8, &forked.words[8..])?;
        mem.write(
            state_addr + ST_TABLES as u64,
            &vec![0u8; STATE_LEN - ST_TABLES],
        )?;
        if let Some(g) = at.guardian {
            tell_guardian(g, child, ring_addr, state_addr)?;
        }
        mem.write(state_addr + ST_ON as u64, &1u64.to_le_bytes())?;
        let fs_tids: FxHashMap<u64, i32> = at.threads.iter().map(|t| (t.fs_base, t.tid)).collect();
        let mut h = HookProc::new(Parts {
            mem,
            reader,
            mapping,
            ring_addr,
            state_addr,
            hook: p.hook.clone(),
            detour: None,
            breaker: p.breaker,
            profile: p.profile,
            walker,
            fs_tids,
            said_taken: Default::default(),
            phase: Phase::Installed,
        });
        h.tool_looked = tool.is_some();
        h.tool = tool;
        sink(TraceEvent::Detail(format!(
            "hook engine in process {child}: forked from {parent}, whose hook it kept; given a \
             ring of its own at {ring_addr:#x}"
        )));
        self.procs.insert(child, h);
        Ok(true)
    }
}

/// Whether the child's memory holds the hook as its parent had it when it forked;
/// on the monitoring route, the slots of pyprobe's tool there.
fn check_child_holds_hook(
    p: &HookProc,
    forked: &ForkedWords,
    mem: &ProcessMemory,
    walker: &mut Walker,
) -> Result<Option<ToolSlots>> {
    let mut tool = None;
    match &p.profile {
        Some(target) => {
            let cb = p.hook.callbacks[0];
            let tstates = walker.thread_state_addrs()?;
            let hooked = tstates
                .iter()
                .any(|&t| matches!(target.slot(mem, t, cb), Ok(Slot::Hooked)));
            if !hooked {
                bail!("none of its thread states has the hook as its profile function");
            }
        }
        None => {
            let events = monitoring_events(walker);
            let functions: Vec<u64> = (0..events.len())
                .map(|k| forked.word(ST_CALLBACKS + 8 * k))
                .collect();
            let interp = walker
                .main_interpreter()
                .ok_or_else(|| anyhow!("its main interpreter cannot be read"))?;
            match ToolSlots::look_for(mem, walker, interp, &functions, &events) {
                FirstLook::Held(slots) => match slots.lost(mem, walker) {
                    None => tool = Some(slots),
                    Some(lost) => bail!("{}", lost.caveat()),
                },
                FirstLook::Lost(lost) => bail!("{}", lost.caveat()),
                FirstLook::Unknown => bail!(
                    "pyprobe's sys.monitoring callbacks were not found in its main interpreter"
                ),
            }
        }
    }
    // The exit callback the words name must be the hook's function object there
    // (the uninstaller passes it to `atexit.unregister`).
    let at_exit = forked.word(ST_AT_EXIT);
    if at_exit != 0 {
        let refs = mem.read_u64(at_exit)?;
        let ml = mem.read_u64(at_exit + CFUNCTION_ML)?;
        let page = p.hook.addr..p.hook.addr + p.hook.bytes.len() as u64;
        if !page.contains(&ml) || refs == 0 || refs > MOST_REFS {
            bail!("its exit callback at {at_exit:#x} is not the hook's");
        }
    }
    Ok(tool)
}
