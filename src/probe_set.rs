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
    /// Function calls and returns come from the injected hook engine (`tracer::hook`),
    /// not from probes.
    pub hook: bool,
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

    pub fn site_count(&self) -> usize {
        self.probes.iter().map(|p| p.sites.len()).sum()
    }
}
