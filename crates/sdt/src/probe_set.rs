//! What the engine is asked to trace: probe sites at runtime addresses, with their
//! parsed argument specs. Built by the caller (who knows what the probes mean, e.g.
//! `python::tracing`) and handed to the engine, so it sits below both: it uses
//! only the ELF notes, the loaded objects, the SDT specs and the ring's stack
//! capture, never the engine.

use crate::elf::{SdtProbe, SdtSite};
use crate::process::objects::LoadedObject;
use crate::sdt::ArgSpec;

/// One probe site at its runtime address.
#[derive(Debug, Clone)]
pub struct Site {
    pub address: u64,
    pub args: Vec<ArgSpec>,
    /// Arguments the caller added that read memory through a register, safe to
    /// read in the target only as the site's code proves it (see
    /// [`crate::elf::FirstArgProof`]); `None` when every argument is the note's.
    pub guarded: Option<GuardedArgs>,
}

impl Site {
    /// A site with the note's arguments only.
    pub fn new(address: u64, args: Vec<ArgSpec>) -> Site {
        Site {
            address,
            args,
            guarded: None,
        }
    }

    /// The arguments an engine that evaluates them inside the target (the ring's
    /// trampolines) may use, given the direct branch targets of the code around
    /// the site (`lands_inside(lo, hi)`: whether some branch lands strictly between):
    /// the guarded ones only when no branch lands in `(function start, site]`.
    pub(crate) fn args_in_target(&self, lands_inside: impl Fn(u64, u64) -> bool) -> &[ArgSpec] {
        match &self.guarded {
            Some(g) if lands_inside(g.function_start, self.address.saturating_add(1)) => {
                &self.args[..g.from.min(self.args.len())]
            }
            _ => &self.args,
        }
    }
}

/// Arguments `from..` of a site, which dereference a register its function keeps
/// its first argument in: readable at the site on every way from
/// `function_start` (runtime address) that the function's own code takes,
/// so only where nothing else jumps in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardedArgs {
    pub from: usize,
    pub function_start: u64,
}

/// One probe to trace: all its sites, its semaphore, and which of its arguments are
/// pointers to C strings the engine should read at each hit.
#[derive(Debug, Clone)]
pub struct Probe {
    pub name: String,
    /// Runtime address of the 2-byte semaphore counter, if the probe has one.
    pub semaphore: Option<u64>,
    pub sites: Vec<Site>,
    /// `string_args[i]`: argument `i` is a `const char *` to read (bounded).
    pub string_args: Vec<bool>,
}

/// Every probe to trace in one process image, with a symbol resolver for
/// `sym(%rip)` operands (runtime addresses).
#[derive(Debug, Clone, Default)]
pub struct ProbeSet {
    pub probes: Vec<Probe>,
    pub symbols: Vec<(String, u64)>,
    /// Indices of the probes an overhead budget may turn off for a while (the
    /// frequent ones: function entry and return, line).
    pub budgeted: Vec<usize>,
    /// Indices of the probes whose hits need the target stopped (the caller reads
    /// its state at each, e.g. the Python stack): never served by the ring.
    pub needs_stop: Vec<usize>,
    /// Sites and semaphores left out while the set was built: never written.
    pub refused: Vec<Refusal>,
    /// Indices of the probes whose ring records carry the thread's stack, captured
    /// by the trampoline with `stack_capture` (sites that cannot stay on int3).
    pub stack_probes: Vec<usize>,
    pub stack_capture: Option<crate::ring::StackCapture>,
    /// Stack probes that an overhead budget thins to a count (no record at all)
    /// rather than to a record without its stack: events that come in storms and
    /// open nothing another probe closes (an audit event per `id()` call). When
    /// even counting them, or on `int3` their stops, cost more than the budget,
    /// their semaphores go down for a while.
    pub count_when_thin: Vec<usize>,
    /// Function calls and returns come from an event source (pyprobe's injected
    /// hook engine), not from probes.
    pub hook: bool,
    /// Runtime addresses of the sites of the object's other probes, those not
    /// asked for (their ELF checks passed): never armed, but a jump that a killed
    /// pyprobe left at one is put back to the original code.
    pub unarmed_sites: Vec<u64>,
    /// Runtime addresses of those probes' semaphores: never raised, but a raise
    /// that a pyprobe killed with its guardian left listed in its ring is undone.
    pub unarmed_semaphores: Vec<u64>,
}

/// A site or semaphore pyprobe leaves alone, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Runtime address of the site or semaphore.
    pub address: u64,
    pub probe: String,
    /// A sentence naming the address and the reason.
    pub reason: String,
}

/// The sites of `probe` (an SDT probe of `object`) that may be armed; what its
/// ELF checks refused goes to `refused`. None at all when its semaphore is
/// refused: raising nothing, it must not be armed either.
pub fn usable_sites<'a>(
    object: &LoadedObject,
    probe: &'a SdtProbe,
    refused: &mut Vec<Refusal>,
) -> Vec<&'a SdtSite> {
    if let (Some(sem), Some(why)) = (probe.semaphore, &probe.semaphore_refused) {
        refused.push(Refusal {
            address: object.runtime(sem),
            probe: probe.name.clone(),
            reason: format!("{why}; probe {} not armed", probe.name),
        });
        return Vec::new();
    }
    let mut usable = Vec::new();
    for site in &probe.sites {
        match &site.refused {
            Some(why) => refused.push(Refusal {
                address: object.runtime(site.address),
                probe: probe.name.clone(),
                reason: why.clone(),
            }),
            None => usable.push(site),
        }
    }
    usable
}

impl ProbeSet {
    pub fn symbol(&self, name: &str) -> Option<u64> {
        self.symbols
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| *a)
    }

    /// The bytes the probes' semaphores (2 bytes each) span: what a producer
    /// letting go of pyprobe's probes may lower (see the ring format's `held`).
    pub(crate) fn semaphore_span(&self) -> Option<std::ops::Range<u64>> {
        let sems = self.probes.iter().filter_map(|p| p.semaphore);
        let lo = sems.clone().min()?;
        let hi = sems.max()?;
        Some(lo..hi.saturating_add(2))
    }

    /// The semaphores of every probe of the object, armed or not.
    pub(crate) fn all_semaphores(&self) -> Vec<u64> {
        let mut sems: Vec<u64> = self.probes.iter().filter_map(|p| p.semaphore).collect();
        sems.extend(&self.unarmed_semaphores);
        sems.sort_unstable();
        sems.dedup();
        sems
    }

    pub(crate) fn site_count(&self) -> usize {
        self.probes.iter().map(|p| p.sites.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_arguments_go_into_the_target_only_where_no_branch_lands_before_the_site() {
        let args = crate::sdt::parse_args("8@%rbx 8@%r12 -4@%eax 8@%r13 8@0(%r13)").unwrap();
        let mut site = Site::new(0x1080, args);
        site.guarded = Some(GuardedArgs {
            from: 4,
            function_start: 0x1000,
        });
        let branches = |targets: &'static [u64]| {
            move |lo: u64, hi: u64| targets.iter().any(|&t| lo < t && t < hi)
        };
        assert_eq!(site.args_in_target(branches(&[])).len(), 5);
        // At the function's start, or past the site: the way to the site is intact.
        assert_eq!(site.args_in_target(branches(&[0x1000, 0x1081])).len(), 5);
        // Into the way, or onto the site itself: the guarded argument is left out.
        assert_eq!(site.args_in_target(branches(&[0x1040])).len(), 4);
        assert_eq!(site.args_in_target(branches(&[0x1080])).len(), 4);
        // Arguments that are all the note's are never left out.
        site.guarded = None;
        assert_eq!(site.args_in_target(branches(&[0x1040])).len(), 5);
    }
}
