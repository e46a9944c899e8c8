//! Putting the ring engine into a stopped process: a shared ring (a memfd the
//! target maps and pyprobe maps too), trampolines next to the probe object's code,
//! and each qualifying site rewritten into a jump to its trampoline.
//!
//! Everything here runs with every thread of the process stopped, through system
//! calls injected in one of them (`inject`) and writes to `/proc/PID/mem`.
//! Nothing is unmapped when tracing ends: a thread interrupted by a signal inside
//! a trampoline returns into it later, and ptrace cannot see that (see `ring`).
//! What an earlier pyprobe left is used again where that is safe (see `reuse`).
//!
//! Here: the ring engine's state in a process, the setup's outline, and taking the
//! sites out again. Beside it: `memfd` (making and mapping a ring) and
//! `trampolines` (building, placing and jumping to the trampolines).

use std::collections::HashMap;
use std::io;

use anyhow::{anyhow, Result};
use memmap2::MmapMut;

use super::heartbeat::{keep_beating, BeatTicket};

use crate::process::maps::read_maps;
use crate::process::memory::ProcessMemory;
use crate::ring::{ring_bytes, RingReader, Slots};

use crate::tracer::guardian::{Guardian, Op};
use crate::tracer::inject::Injector;
use crate::tracer::patch::{Patches, INT3};

use super::reuse;

mod memfd;
mod trampolines;

pub use memfd::map_ring;
pub(in crate::tracer) use trampolines::ScannedCode;
use trampolines::{patch_segment, Placed};

pub use super::CAPACITY;
pub(super) use crate::process::PAGE_SIZE as PAGE;

const PROT_RW: i32 = libc::PROT_READ | libc::PROT_WRITE;
const MAP_PRIVATE_ANON: i32 = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;

/// One site served by the ring.
#[derive(Debug, Clone)]
pub struct RingSite {
    pub probe: usize,
    pub(crate) site: usize,
    pub(crate) original: Vec<u8>,
    pub patch: Vec<u8>,
}

/// The ring engine's state in one process image.
pub struct RingProc {
    pub(crate) reader: RingReader,
    /// The ring's heartbeat, beaten while the ring lives (before `_mapping`: see
    /// [`BeatTicket`]).
    _beat: BeatTicket,
    /// pyprobe's own mapping of the ring; `reader` points into it.
    _mapping: MmapMut,
    /// Site address → what was patched there.
    pub sites: HashMap<u64, RingSite>,
    /// The per-process tag word the trampolines write into each record.
    pub(crate) tag_addr: u64,
    /// Address of the ring in the target.
    pub(crate) ring_addr: u64,
    /// Which thread wrote each record (see [`super::writers`]).
    pub threads: super::writers::ThreadNames,
    /// Per probe id, the events counted instead of recorded already reported.
    pub(crate) counted_reported: HashMap<u32, u64>,
    /// The ring's `waited` cycles already charged to the overhead budget.
    pub(crate) waited_charged: u64,
    /// Records kept to tell repeats of them.
    pub(crate) known: crate::ring::KnownRecords,
    /// The producers' losses reported so far.
    pub lost: crate::ring::LostCounter,
    /// The ring's `let_go` count last seen (producers lowering pyprobe's
    /// semaphores, having found it silent).
    pub(crate) let_go_seen: u64,
}

impl RingProc {
    /// The code of its sites' trampolines (each in its own stride of the region).
    pub(in crate::tracer) fn trampolines(&self) -> Vec<std::ops::Range<u64>> {
        self.sites
            .iter()
            .filter_map(|(&site, s)| crate::ring::region::jump_target(site, &s.patch))
            .map(|start| start..start.saturating_add(trampolines::STRIDE))
            .collect()
    }
}

impl std::fmt::Debug for RingProc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingProc")
            .field("sites", &self.sites.len())
            .field("tag_addr", &self.tag_addr)
            .finish_non_exhaustive()
    }
}

/// What setting up the ring did.
pub struct Setup {
    pub ring: RingProc,
    /// Sites left to `int3`, with why.
    pub refused: Vec<(u64, String)>,
    /// Whether what an earlier pyprobe left was used again, and why not (for `-v`).
    pub(crate) said: Vec<String>,
}

/// Sets up the ring in `pid` (every thread stopped; `tid` at a clean stop) for the
/// `int3` sites of `patches`, and hands the sites it patched over from `patches`.
/// `rips` are the threads' instruction pointers; `prescanned`, code scanned before
/// the threads were stopped.
#[allow(clippy::too_many_arguments)]
pub(in crate::tracer) fn setup(
    pid: i32,
    tid: i32,
    mem: &mut ProcessMemory,
    patches: &mut Patches,
    rips: &[(i32, u64)],
    fs_bases: &[(i32, u64)],
    prescanned: &[ScannedCode],
    mut guard: Option<&mut Guardian>,
) -> Result<Setup> {
    let inj = Injector::find(pid, tid, mem)?.guarded(guard.as_deref(), mem);
    let bytes = ring_bytes(CAPACITY, Slots::Records).map_err(|e| anyhow!("{e}"))? as u64;
    // What an earlier pyprobe left, used again where it can be (see `reuse`).
    let mut said = Vec::new();
    let earlier = match reuse::find(mem, &read_maps(pid)?, rips, patches.jump_refusals.len()) {
        Ok(found) => found,
        Err(why) => {
            said.push(format!(
                "an earlier pyprobe's ring and trampolines are not used again: {why}"
            ));
            None
        }
    };
    let again = earlier.and_then(
        |e| match replace_ring(&inj, mem, pid, e.tag_addr, e.ring_addr) {
            Ok(mapping) => {
                said.push(format!(
                    "the ring at {:#x} of an earlier pyprobe is used again",
                    e.ring_addr
                ));
                Some((e.tag_addr, e.ring_addr, mapping, e.regions))
            }
            Err(err) => {
                said.push(format!(
                    "an earlier pyprobe's ring is not used again: {err:#}"
                ));
                None
            }
        },
    );
    let (scratch, ring_addr, mut mapping, earlier_regions) = match again {
        Some(again) => again,
        None => {
            let (scratch, ring_addr, mapping) = new_ring(&inj, mem, pid)?;
            (scratch, ring_addr, mapping, Vec::new())
        }
    };
    // SAFETY: the mapping lives as long as the reader (both in RingProc).
    let reader = unsafe { RingReader::new(mapping.as_mut_ptr(), mapping.len()) }
        .map_err(|e| anyhow!("{e}"))?;

    // Before any site jumps to the ring: what its producers lower should pyprobe
    // and its guardian both die.
    let (raised, paused) = patches.semaphores();
    reader.hold_semaphores(pid as u32, raised, paused);
    let maps = read_maps(pid)?;
    let reader_lost = reader.lost();
    let mut ring = RingProc {
        _beat: keep_beating(&reader),
        reader,
        _mapping: mapping,
        sites: HashMap::new(),
        tag_addr: scratch,
        ring_addr,
        threads: fs_bases.iter().map(|&(t, fs)| (fs, t)).collect(),
        counted_reported: HashMap::new(),
        waited_charged: 0,
        known: Default::default(),
        lost: crate::ring::LostCounter::new(reader_lost, crate::tracer::clock::monotonic_ns()),
        let_go_seen: 0,
    };
    let mut refused = Vec::new();
    // Sites grouped by the executable mapping holding them.
    let mut by_segment: HashMap<usize, Vec<u64>> = HashMap::new();
    let mut addrs: Vec<u64> = patches.sites.keys().copied().collect();
    addrs.sort_unstable();
    addrs.retain(|addr| {
        let stop = patches
            .sites
            .get(addr)
            .is_some_and(|&(pi, _)| patches.set.needs_stop.contains(&pi));
        if stop {
            refused.push((
                *addr,
                "its hits need the target stopped (its stack is read there)".into(),
            ));
        }
        !stop
    });
    for addr in addrs {
        match maps
            .iter()
            .position(|m| m.executable && m.start <= addr && addr < m.end)
        {
            Some(i) => by_segment.entry(i).or_default().push(addr),
            None => refused.push((addr, "not in an executable mapping".into())),
        }
    }
    let mut segments: Vec<_> = by_segment.into_iter().collect();
    segments.sort_unstable();
    for (index, sites) in segments {
        let segment = &maps[index];
        let result = patch_segment(
            &inj,
            (ring_addr, bytes),
            segment,
            prescanned,
            &maps,
            &sites,
            mem,
            patches,
            rips,
            &mut ring,
            &mut refused,
            &earlier_regions,
            guard.as_deref_mut(),
        );
        match result {
            Ok(Placed::Again(at)) => said.push(format!(
                "the trampolines at {at:#x} of an earlier pyprobe are used again"
            )),
            Ok(Placed::New(at)) if !earlier_regions.is_empty() => said.push(format!(
                "new trampolines at {at:#x}: those of an earlier pyprobe are not the ones \
                 needed (other probes, or another pyprobe)"
            )),
            Ok(_) => {}
            Err(e) => {
                for &addr in &sites {
                    if !ring.sites.contains_key(&addr) {
                        refused.push((addr, format!("{e:#}")));
                    }
                }
            }
        }
    }
    Ok(Setup {
        ring,
        refused,
        said,
    })
}

/// A new ring and tag word in `pid`: a private page (the tag word, the pid, at 0;
/// the memfd's name at [`reuse::NAME_AT`]) and a ring wherever the kernel puts it. Returns the tag word's address, the ring's, and pyprobe's view.
fn new_ring(inj: &Injector, mem: &mut ProcessMemory, pid: i32) -> Result<(u64, u64, MmapMut)> {
    let scratch = inj.mmap(0, PAGE, PROT_RW, MAP_PRIVATE_ANON, -1)?;
    mem.write(scratch, &(pid as u32).to_le_bytes())?;
    mem.write(scratch + reuse::NAME_AT, reuse::RING_NAME)?;
    let (ring_addr, mapping) = map_ring(
        inj,
        pid,
        scratch + reuse::NAME_AT,
        None,
        CAPACITY,
        Slots::Records,
    )?;
    Ok((scratch, ring_addr, mapping))
}

/// The ring of an earlier pyprobe at `ring_addr` (checked by `reuse::find`) replaced
/// by a new one at the same address, of the same length; the current pid written
/// into the tag word at `tag_addr` (a forked child's own copy names the child).
fn replace_ring(
    inj: &Injector,
    mem: &mut ProcessMemory,
    pid: i32,
    tag_addr: u64,
    ring_addr: u64,
) -> Result<MmapMut> {
    let (_, mapping) = map_ring(
        inj,
        pid,
        tag_addr + reuse::NAME_AT,
        Some(ring_addr),
        CAPACITY,
        Slots::Records,
    )?;
    mem.write(tag_addr, &(pid as u32).to_le_bytes())?;
    Ok(mapping)
}

/// Takes the ring's sites out of `pid` (every thread stopped, none inside a
/// trampoline): the original bytes go back where the patch still stands.
pub(crate) fn restore(
    mem: &mut ProcessMemory,
    ring: &RingProc,
    mut guard: Option<&mut Guardian>,
) -> io::Result<usize> {
    let mut restored = 0;
    let mut first_error = None;
    for (&addr, site) in &ring.sites {
        let mut now = vec![0u8; site.patch.len()];
        let result = mem.read(addr, &mut now).and_then(|()| {
            if now == site.patch {
                mem.write(addr, &site.original)
            } else {
                Err(io::Error::other(format!(
                    "site {addr:#x} no longer holds pyprobe's jump; left as it is"
                )))
            }
        });
        match result {
            Ok(()) => {
                restored += 1;
                if let Some(g) = guard.as_deref_mut() {
                    let _ = g.tell(Op::SiteRestored, mem.pid(), addr);
                }
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    first_error.map_or(Ok(restored), Err)
}

/// In a forked child that is traced on its own: each ring site becomes an `int3`
/// site again (the child would otherwise write into its parent's ring).
pub(crate) fn back_to_int3(
    mem: &mut ProcessMemory,
    ring: &RingProc,
    patches: &mut Patches,
) -> io::Result<()> {
    for (&addr, site) in &ring.sites {
        let mut bytes = site.original.clone();
        bytes[0] = INT3;
        mem.write(addr, &bytes)?;
        patches.give_site(addr, (site.probe, site.site));
    }
    Ok(())
}

/// In a forked child that is not traced: the original bytes back at every ring site.
pub(crate) fn clean_child(mem: &mut ProcessMemory, ring: &RingProc) -> io::Result<()> {
    for (&addr, site) in &ring.sites {
        mem.write(addr, &site.original)?;
    }
    Ok(())
}

pub use super::leftovers::Leftovers;
