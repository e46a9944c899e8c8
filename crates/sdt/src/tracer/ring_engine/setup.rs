//! Putting the ring engine into a stopped process: a shared ring (a memfd the
//! target maps and pyprobe maps too), trampolines next to the probe object's code,
//! and each qualifying site rewritten into a jump to its trampoline.
//!
//! Everything here runs with every thread of the process stopped, through system
//! calls injected in one of them (`inject`) and writes to `/proc/PID/mem`.
//! Nothing is unmapped when tracing ends: a thread interrupted by a signal inside
//! a trampoline returns into it later, and ptrace cannot see that (see `ring`).
//! What an earlier pyprobe left is used again where that is safe (see `reuse`).

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io;

use anyhow::{anyhow, bail, Context, Result};
use memmap2::MmapMut;

use super::heartbeat::{keep_beating, BeatTicket};

use crate::process::maps::{read_maps, MapEntry};
use crate::process::memory::ProcessMemory;
use crate::ring::region::{self, RegionHeader, RegionSite};
use crate::ring::{
    build_trampoline, init_zeroed_ring, plans_overlap, qualify_site, ring_bytes, BranchTargets,
    CodegenError, FlagSave, RingReader, SitePlan, ThreadIdSource, Trampoline, TrampolineParams,
};

use crate::tracer::guardian::{Guardian, Op};
use crate::tracer::inject::Injector;
use crate::tracer::near_map::{map_near, NearMap};
use crate::tracer::patch::{Patches, INT3};

use super::reuse;

pub use super::CAPACITY;
/// Bytes of trampoline space per site (200-500 bytes; a stack probe's, which walks
/// the frame chain, up to about 1200).
const STRIDE: u64 = 2048;
pub(super) use crate::process::PAGE_SIZE as PAGE;

const PROT_RW: i32 = libc::PROT_READ | libc::PROT_WRITE;
const PROT_RX: i32 = libc::PROT_READ | libc::PROT_EXEC;
const MAP_PRIVATE_ANON: i32 = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;

/// One site served by the ring.
#[derive(Debug, Clone)]
pub struct RingSite {
    pub probe: usize,
    pub site: usize,
    pub original: Vec<u8>,
    pub patch: Vec<u8>,
}

/// The ring engine's state in one process image.
pub struct RingProc {
    pub reader: RingReader,
    /// The ring's heartbeat, beaten while the ring lives (before `_mapping`: see
    /// [`BeatTicket`]).
    _beat: BeatTicket,
    /// pyprobe's own mapping of the ring; `reader` points into it.
    _mapping: MmapMut,
    /// Site address → what was patched there.
    pub sites: HashMap<u64, RingSite>,
    /// The per-process tag word the trampolines write into each record.
    pub tag_addr: u64,
    /// Address of the ring in the target.
    pub ring_addr: u64,
    /// Which thread wrote each record (see [`super::writers`]).
    pub threads: super::writers::ThreadNames,
    /// Per probe id, the events counted instead of recorded already reported.
    pub counted_reported: HashMap<u32, u64>,
    /// The ring's `waited` cycles already charged to the overhead budget.
    pub waited_charged: u64,
    /// Records kept to tell repeats of them.
    pub known: crate::ring::KnownRecords,
    /// The producers' losses reported so far.
    pub lost: crate::ring::LostCounter,
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
    pub said: Vec<String>,
}

/// Sets up the ring in `pid` (every thread stopped; `tid` at a clean stop) for the
/// `int3` sites of `patches`, and hands the sites it patched over from `patches`.
/// `rips` are the threads' instruction pointers.
pub fn setup(
    pid: i32,
    tid: i32,
    mem: &mut ProcessMemory,
    patches: &mut Patches,
    rips: &[(i32, u64)],
    fs_bases: &[(i32, u64)],
    mut guard: Option<&mut Guardian>,
) -> Result<Setup> {
    let inj = Injector::find(pid, tid, mem)?.guarded(guard.as_deref(), mem);
    let bytes = ring_bytes(CAPACITY).map_err(|e| anyhow!("{e}"))? as u64;
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
    let (ring_addr, mapping) = map_ring(inj, pid, scratch + reuse::NAME_AT, None, CAPACITY)?;
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
    )?;
    mem.write(tag_addr, &(pid as u32).to_le_bytes())?;
    Ok(mapping)
}

/// A memfd made in the target (named by the string at `name_addr`), sized for
/// `capacity` slots and sealed at that size, mapped and formatted by pyprobe, then
/// mapped `MAP_SHARED` in the target (at `over`, over what is there, or where the
/// kernel chooses), its descriptor closed: the target never sees an unformatted
/// ring, and keeps no descriptor of pyprobe's. Returns the ring's address in the
/// target and pyprobe's mapping of it.
///
/// The seals are pyprobe's own safety: a target that reopens the memfd (through
/// `/proc/self/map_files`, as root can) and truncates it would otherwise make
/// pyprobe's next read of the ring a SIGBUS, which kills pyprobe.
pub fn map_ring(
    inj: &Injector,
    pid: i32,
    name_addr: u64,
    over: Option<u64>,
    capacity: u64,
) -> Result<(u64, MmapMut)> {
    let bytes = ring_bytes(capacity).map_err(|e| anyhow!("{e}"))? as u64;
    let fd = inj.call(
        "memfd_create",
        libc::SYS_memfd_create,
        [
            name_addr,
            (libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) as u64,
            0,
            0,
            0,
            0,
        ],
    )?;
    let mapped = (|| {
        inj.call("ftruncate", libc::SYS_ftruncate, [fd, bytes, 0, 0, 0, 0])?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/fd/{fd}"))
            .with_context(|| format!("opening the ring of process {pid} (its fd {fd})"))?;
        seal_size(&file).with_context(|| format!("sealing the ring of process {pid}"))?;
        // SAFETY: a shared mapping of a memfd only pyprobe and the target use; the
        // reader accesses it with atomic and volatile operations.
        let mut mapping = unsafe { MmapMut::map_mut(&file) }.context("mapping the ring")?;
        if mapping.len() as u64 != bytes {
            bail!(
                "the ring of process {pid} is {} bytes, not {bytes}",
                mapping.len()
            );
        }
        // A new memfd, zero-filled by the kernel: the header is all there is to write.
        init_zeroed_ring(&mut mapping, capacity).map_err(|e| anyhow!("{e}"))?;
        let ring_addr = match over {
            Some(addr) => {
                let flags = libc::MAP_SHARED | libc::MAP_FIXED;
                let got = inj.mmap(addr, bytes, PROT_RW, flags, fd as i64)?;
                if got != addr {
                    bail!("the new ring was mapped at {got:#x}, not over the old one at {addr:#x}");
                }
                got
            }
            None => inj.mmap(0, bytes, PROT_RW, libc::MAP_SHARED, fd as i64)?,
        };
        Ok::<_, anyhow::Error>((ring_addr, mapping))
    })();
    // The mappings keep the memory; the target keeps no descriptor of ours.
    let _ = inj.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0]);
    mapped
}

/// Seals the memfd behind `file` at its size, and its seals with it: it can never
/// shrink (what SIGBUS needs), grow, or take other seals (`F_SEAL_FUTURE_WRITE`
/// would stop a later pyprobe mapping it).
fn seal_size(file: &std::fs::File) -> Result<()> {
    use std::os::fd::AsRawFd;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor pyprobe owns.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("fcntl(F_ADD_SEALS)");
    }
    Ok(())
}

/// Where the trampolines of one segment went.
enum Placed {
    /// No site of the segment qualified.
    Nothing,
    /// Into the earlier pyprobe's region at this address, unchanged.
    Again(u64),
    /// Into a new region at this address.
    New(u64),
}

/// Qualifies, builds and patches the sites of one executable segment.
#[allow(clippy::too_many_arguments)]
fn patch_segment(
    inj: &Injector,
    (ring_addr, ring_len): (u64, u64),
    segment: &MapEntry,
    maps: &[MapEntry],
    sites: &[u64],
    mem: &mut ProcessMemory,
    patches: &mut Patches,
    rips: &[(i32, u64)],
    ring: &mut RingProc,
    refused: &mut Vec<(u64, String)>,
    earlier: &[(u64, RegionHeader)],
    mut guard: Option<&mut Guardian>,
) -> Result<Placed> {
    let len = (segment.end - segment.start) as usize;
    if len > 256 << 20 {
        bail!(
            "executable segment of {} MiB is too large to scan",
            len >> 20
        );
    }
    let mut text = vec![0u8; len];
    mem.read(segment.start, &mut text)
        .with_context(|| format!("reading code at {:#x}", segment.start))?;
    // Our own int3s read as the nops they replace.
    for &addr in patches.sites.keys() {
        if (segment.start..segment.end).contains(&addr) {
            text[(addr - segment.start) as usize] = 0x90;
        }
    }
    let targets = BranchTargets::scan(&text, segment.start);
    let mut plans: Vec<SitePlan> = Vec::new();
    for &addr in sites {
        match qualify_site(&text, segment.start, addr, &targets) {
            Ok(plan) if plans.iter().any(|p| plans_overlap(p, &plan)) => {
                refused.push((addr, "overlaps another patched site".into()))
            }
            Ok(_) if plans.len() == region::MAX_SITES => refused.push((
                addr,
                format!("one region serves at most {} sites", region::MAX_SITES),
            )),
            Ok(plan) => plans.push(plan),
            Err(why) => refused.push((addr, why.to_string())),
        }
    }
    if plans.is_empty() {
        return Ok(Placed::Nothing);
    }
    let symbols = |name: &str| patches.set.symbol(name);
    // The trampoline for `plan` at `tramp_addr`, with its probe and site indices.
    let build = |plan: &SitePlan, tramp_addr: u64| {
        let &(pi, si) = patches.sites.get(&plan.site())?;
        let probe = &patches.set.probes[pi];
        let params = TrampolineParams {
            flags: FlagSave::for_this_cpu(),
            probe_id: pi as u32,
            // Arguments read through a register only where no branch lands
            // between the site's function start and the site.
            args: probe.sites[si]
                .args_in_target(|lo, hi| targets.strictly_inside(lo, hi).is_some()),
            string_args: &probe.string_args,
            ring_addr,
            capacity: CAPACITY,
            tramp_addr,
            tag_addr: ring.tag_addr,
            thread_id: ThreadIdSource::FsSelfPointer,
            symbols: &symbols,
            stack: patches
                .set
                .stack_capture
                .as_ref()
                .filter(|_| patches.set.stack_probes.contains(&pi)),
        };
        Some((pi, si, build_trampoline(plan, &params)))
    };
    // An earlier pyprobe's region holding every trampoline needed, byte for byte
    // (see `reuse`): nothing is written into it.
    let reused = earlier.iter().find_map(|(at, header)| {
        identical_region(mem, *at, header, &plans, &build).map(|built| (*at, built))
    });
    let (placed, built) = match reused {
        Some((at, built)) => (Placed::Again(at), built),
        None => {
            let mut built = Vec::new();
            // The header first (see `ring::region`), then the trampolines.
            let span = region::encoded_len(plans.len()).next_multiple_of(64) as u64;
            let size = (span + plans.len() as u64 * STRIDE).div_ceil(PAGE) * PAGE;
            let region = map_near(
                inj,
                maps,
                &NearMap {
                    code: segment.start..segment.end,
                    size,
                    prot: PROT_RW,
                    code_name: "the code",
                    what: "the trampolines",
                },
            )?;
            for (k, plan) in plans.iter().enumerate() {
                let Some((pi, si, t)) = build(plan, region + span + k as u64 * STRIDE) else {
                    continue;
                };
                match t {
                    Ok(t) if t.len() as u64 <= STRIDE => {
                        mem.write(t.addr, &t.code)?;
                        built.push((plan, t, pi, si));
                    }
                    Ok(t) => {
                        refused.push((plan.site(), format!("trampoline of {} bytes", t.len())))
                    }
                    Err(e) => refused.push((plan.site(), e.to_string())),
                }
            }
            // Every trampoline written is listed, before any site jumps to one: a later
            // pyprobe then recognises each jump left behind (one not patched in the end is
            // listed harmlessly: only a site holding the exact jump is ever taken over).
            let header = RegionHeader {
                region_len: size,
                ring_addr,
                ring_len,
                tag_addr: ring.tag_addr,
                sites: built
                    .iter()
                    .map(|(plan, t, _, _)| RegionSite {
                        site: plan.site(),
                        tramp: t.addr,
                        original: plan.original().to_vec(),
                    })
                    .collect(),
            };
            let header = header
                .encode()
                .map_err(|e| anyhow!("trampoline region header: {e}"))?;
            mem.write(region, &header)?;
            inj.call(
                "mprotect",
                libc::SYS_mprotect,
                [region, size, PROT_RX as u64, 0, 0, 0],
            )?;
            (Placed::New(region), built)
        }
    };
    for (plan, t, pi, si) in built {
        // The site holds our int3 and, after it, the bytes the plan displaces.
        let mut now = vec![0u8; plan.len()];
        mem.read(plan.site(), &mut now)?;
        if now[0] != INT3 || now[1..] != plan.original()[1..] {
            refused.push((plan.site(), "code changed since it was read".into()));
            continue;
        }
        let inside: Vec<&(i32, u64)> = rips
            .iter()
            .filter(|(_, rip)| *rip > plan.site() && *rip < plan.end())
            .collect();
        // Right after the int3 is where a thread stands that hit it: it goes on in
        // the trampoline's copy of the displaced code. Anywhere else inside: refuse.
        if inside.iter().any(|(_, rip)| *rip != plan.site() + 1) {
            refused.push((plan.site(), "a thread is inside the displaced bytes".into()));
            continue;
        }
        // The guardian learns the jump and the bytes under it before it is written:
        // if pyprobe dies now, it puts back the original bytes (never a lone nop
        // into the middle of the jump), whichever of int3 or jump it finds.
        if let Some(g) = guard.as_deref_mut() {
            g.tell_ring_site(mem.pid(), plan.site(), plan.original(), &t.patch)?;
        }
        // A thread stopped right after the int3 goes on in the trampoline's copy
        // of the displaced code; moved before the jump is written, so that if
        // pyprobe dies in between it never resumes inside the jump's bytes.
        for &&(tid, _) in &inside {
            let thread = nix::unistd::Pid::from_raw(tid);
            let mut regs = nix::sys::ptrace::getregs(thread)
                .with_context(|| format!("thread {tid} of process {} is not stopped", mem.pid()))?;
            regs.rip = t.resume;
            nix::sys::ptrace::setregs(thread, regs)
                .with_context(|| format!("moving thread {tid} into its trampoline"))?;
        }
        patches.take_site(plan.site());
        mem.write(plan.site(), &t.patch)?;
        ring.sites.insert(
            plan.site(),
            RingSite {
                probe: pi,
                site: si,
                original: plan.original().to_vec(),
                patch: t.patch.clone(),
            },
        );
    }
    Ok(placed)
}

/// Builds the trampoline for a plan at an address: with its probe and site indices.
type Builder<'a> =
    dyn Fn(&SitePlan, u64) -> Option<(usize, usize, Result<Trampoline, CodegenError>)> + 'a;

/// The trampolines for `plans` in the earlier region at `at` (its `header` read and
/// checked), if every one of them is already there byte for byte, at the address
/// the header lists for its site, for the same original bytes and the same jump:
/// then nothing needs writing, and no thread that may be inside one of them sees a
/// byte change (see `reuse`). `None` if any differs, is missing or cannot be read.
fn identical_region<'p>(
    mem: &ProcessMemory,
    at: u64,
    header: &RegionHeader,
    plans: &'p [SitePlan],
    build: &Builder,
) -> Option<Vec<(&'p SitePlan, Trampoline, usize, usize)>> {
    let end = at.checked_add(header.region_len)?;
    let mut built = Vec::with_capacity(plans.len());
    for plan in plans {
        let entry = header.find(plan.site())?;
        if entry.original != plan.original() {
            return None;
        }
        let (pi, si, t) = build(plan, entry.tramp)?;
        let t = t.ok()?;
        let t_end = t.addr.checked_add(t.len() as u64)?;
        if t.len() as u64 > STRIDE || t_end > end || entry.patch().as_ref() != Some(&t.patch) {
            return None;
        }
        let mut now = vec![0u8; t.len()];
        mem.read(t.addr, &mut now).ok()?;
        if now != t.code {
            return None;
        }
        built.push((plan, t, pi, si));
    }
    Some(built)
}

/// Takes the ring's sites out of `pid` (every thread stopped, none inside a
/// trampoline): the original bytes go back where the patch still stands.
pub fn restore(
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
pub fn back_to_int3(
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
pub fn clean_child(mem: &mut ProcessMemory, ring: &RingProc) -> io::Result<()> {
    for (&addr, site) in &ring.sites {
        mem.write(addr, &site.original)?;
    }
    Ok(())
}

pub use super::leftovers::Leftovers;
