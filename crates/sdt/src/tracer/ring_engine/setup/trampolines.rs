//! The trampolines of one executable segment: qualifying its sites, building a
//! trampoline for each, placing them in a region near the code (or finding an
//! earlier pyprobe's identical region), and writing each site's jump. Apart from
//! the setup's outline, which only groups sites by segment and reports.

use anyhow::{anyhow, bail, Context, Result};

use crate::process::maps::MapEntry;
use crate::process::memory::ProcessMemory;
use crate::ring::region::{self, RegionHeader, RegionSite};
use crate::ring::{
    build_trampoline, plans_overlap, qualify_site, BranchTargets, CodegenError, FlagSave, SitePlan,
    ThreadIdSource, Trampoline, TrampolineParams,
};
use crate::tracer::guardian::Guardian;
use crate::tracer::near_map::{map_near, NearMap};
use crate::tracer::patch::{Patches, INT3};

use crate::tracer::inject::Injector;

use super::{RingProc, RingSite, CAPACITY, PAGE, PROT_RW};

/// Bytes of trampoline space per site (300-600 bytes; a stack probe's, which walks
/// the frame chain, about 2,150 on CPython 3.9 to 3.15).
pub(super) const STRIDE: u64 = 4096;
const PROT_RX: i32 = libc::PROT_READ | libc::PROT_EXEC;

/// Where the trampolines of one segment went.
pub(super) enum Placed {
    /// No site of the segment qualified.
    Nothing,
    /// Into the earlier pyprobe's region at this address, unchanged.
    Again(u64),
    /// Into a new region at this address.
    New(u64),
}

/// An executable segment's code, each of pyprobe's int3s read as the nop it
/// replaces, and the branch targets in it. Decoding a 4.5 MB libpython takes
/// 25 ms: where it can, pyprobe does it before the target is stopped, and the
/// setup uses it if the code is still the same, byte for byte.
pub(in crate::tracer) struct ScannedCode {
    start: u64,
    text: Vec<u8>,
    targets: BranchTargets,
}

impl ScannedCode {
    pub(in crate::tracer) fn read(mem: &ProcessMemory, segment: &MapEntry) -> Result<ScannedCode> {
        let text = read_code(mem, segment, std::iter::empty())?;
        Ok(ScannedCode {
            start: segment.start,
            targets: BranchTargets::scan(&text, segment.start),
            text,
        })
    }
}

/// The code of `segment`, with pyprobe's `int3s` read as the nops they replace.
fn read_code(
    mem: &ProcessMemory,
    segment: &MapEntry,
    int3s: impl Iterator<Item = u64>,
) -> Result<Vec<u8>> {
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
    for addr in int3s {
        if (segment.start..segment.end).contains(&addr) {
            text[(addr - segment.start) as usize] = 0x90;
        }
    }
    Ok(text)
}

/// Qualifies, builds and patches the sites of one executable segment.
#[allow(clippy::too_many_arguments)]
pub(super) fn patch_segment(
    inj: &Injector,
    (ring_addr, ring_len): (u64, u64),
    segment: &MapEntry,
    prescanned: &[ScannedCode],
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
    let text = read_code(mem, segment, patches.sites.keys().copied())?;
    let fresh;
    let targets = match prescanned
        .iter()
        .find(|p| p.start == segment.start && p.text == text)
    {
        Some(p) => &p.targets,
        None => {
            fresh = BranchTargets::scan(&text, segment.start);
            &fresh
        }
    };
    let mut plans: Vec<SitePlan> = Vec::new();
    for &addr in sites {
        match qualify_site(&text, segment.start, addr, targets) {
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
            let_go: patches.set.semaphore_span(),
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
