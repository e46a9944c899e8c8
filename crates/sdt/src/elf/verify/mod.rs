//! Checks that an SDT note's addresses point where `<sys/sdt.h>` puts things,
//! before pyprobe writes anything there: a corrupt or forged note must not steer
//! a write into the target's data or into the middle of an instruction.
//!
//! * A semaphore is a 2-byte counter in the object's `.probes` section.
//! * A probe site is a one-byte `nop` at an instruction boundary of executable
//!   code: decoding its function from the start (a symbol covering it, else the
//!   nearest function start before it in `.eh_frame_hdr`) must reach it exactly.

use goblin::elf::sym::{STT_FUNC, STT_GNU_IFUNC};
use goblin::elf::Elf;
use iced_x86::{Decoder, DecoderOptions, Instruction};

use crate::elf::notes::{FirstArgProof, SdtProbe};
use crate::elf::segments::{file_offset, LoadSegment};

mod eh_frame;
mod first_arg;

use eh_frame::eh_frame_hdr_starts;
use first_arg::{straight_to_ret, FirstArg};

/// What the checks say of one site.
#[derive(Clone)]
pub(super) struct SiteVerdict {
    /// `Err(why)` when it must not be written.
    verdict: Result<(), String>,
    /// The register its function keeps its first argument in there, if one surely
    /// does, with what its code proves of it (see [`first_arg`]).
    first_arg: Option<&'static str>,
    proof: Option<FirstArgProof>,
    /// The instructions just before it (see [`crate::elf::SdtSite::lead_in`]).
    lead_in: Vec<Instruction>,
}

impl SiteVerdict {
    fn refused(why: String) -> SiteVerdict {
        SiteVerdict {
            verdict: Err(why),
            first_arg: None,
            proof: None,
            lead_in: Vec::new(),
        }
    }
}

/// Instructions kept before each site (see [`crate::elf::SdtSite::lead_in`]).
const LEAD_IN: usize = 24;

/// Bytes decoded past a site to find its function's `ret`.
const SUFFIX_BYTES: u64 = 512;

/// Most bytes decoded from a function's start to reach one of its sites (the
/// largest CPython function, the eval loop, is a few hundred KiB).
const MAX_DECODE_BYTES: u64 = 4 << 20;

/// Longest x86 instruction.
const MAX_INSN_LEN: u64 = 15;

/// What the checks need from one object, gathered once.
pub(super) struct Verifier<'a> {
    data: &'a [u8],
    segments: &'a [LoadSegment],
    /// (start, end) of every sized function symbol in an executable segment, by start.
    functions: Vec<(u64, u64)>,
    /// Initial locations of the `.eh_frame_hdr` search table, sorted.
    fde_starts: Vec<u64>,
    /// Address and size of `.probes`.
    probes_section: Option<(u64, u64)>,
}

impl<'a> Verifier<'a> {
    pub(super) fn new(elf: &Elf, data: &'a [u8], segments: &'a [LoadSegment]) -> Verifier<'a> {
        let executable = |a: u64| segments.iter().any(|s| s.executable && s.contains_vaddr(a));
        let mut functions: Vec<(u64, u64)> = elf
            .syms
            .iter()
            .chain(elf.dynsyms.iter())
            .filter(|s| {
                matches!(s.st_type(), STT_FUNC | STT_GNU_IFUNC)
                    && s.st_shndx != 0
                    && s.st_size > 0
                    && executable(s.st_value)
            })
            .filter_map(|s| Some((s.st_value, s.st_value.checked_add(s.st_size)?)))
            .collect();
        functions.sort_unstable();
        functions.dedup();
        let probes_section = elf
            .section_headers
            .iter()
            .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".probes"))
            .map(|sh| (sh.sh_addr, sh.sh_size));
        Verifier {
            data,
            segments,
            functions,
            fde_starts: eh_frame_hdr_starts(elf, data),
            probes_section,
        }
    }

    /// Why the semaphore at link-time address `addr` must not be written, if so.
    pub(super) fn check_semaphore(&self, addr: u64) -> Result<(), String> {
        if addr % 2 != 0 {
            return Err(format!(
                "semaphore {addr:#x} refused: a 2-byte counter is 2-byte aligned"
            ));
        }
        let Some((start, size)) = self.probes_section else {
            return Err(format!(
                "semaphore {addr:#x} refused: the object has no .probes section, where \
                 <sys/sdt.h> puts semaphores"
            ));
        };
        let end = start.saturating_add(size);
        let in_data = self
            .segments
            .iter()
            .any(|s| s.writable && s.contains_vaddr(start) && end - s.vaddr <= s.memsz && size > 0);
        if !in_data {
            return Err(format!(
                "semaphore {addr:#x} refused: the .probes section ({start:#x}, {size} bytes) is \
                 not in a writable segment"
            ));
        }
        if addr < start || addr.saturating_add(2) > end {
            return Err(format!(
                "semaphore {addr:#x} refused: it is outside the .probes section \
                 ({start:#x}..{end:#x}), where <sys/sdt.h> puts semaphores"
            ));
        }
        Ok(())
    }

    /// Where decoding toward `pc` starts: the function symbol covering it, else
    /// the last `.eh_frame_hdr` function start at or before it.
    fn function_start(&self, pc: u64) -> Option<(u64, &'static str)> {
        let covering = self
            .functions
            .iter()
            .filter(|&&(start, end)| start <= pc && pc < end)
            .map(|&(start, _)| start)
            .max();
        if let Some(start) = covering {
            return Some((start, "symbol"));
        }
        let i = self.fde_starts.partition_point(|&s| s <= pc);
        i.checked_sub(1)
            .map(|i| (self.fde_starts[i], ".eh_frame_hdr entry"))
    }

    /// One verdict per site of `pcs` (link-time addresses): `Err(why)` for a site
    /// that must not be written, and where its function's first argument is. Sites
    /// of one function are checked in one decoding pass.
    pub(super) fn check_sites(&self, pcs: &[u64]) -> Vec<SiteVerdict> {
        let fine = SiteVerdict {
            verdict: Ok(()),
            first_arg: None,
            proof: None,
            lead_in: Vec::new(),
        };
        let mut verdicts: Vec<SiteVerdict> = vec![fine; pcs.len()];
        // (function start, site, index in pcs) of the sites worth decoding.
        let mut todo = Vec::new();
        for (i, &pc) in pcs.iter().enumerate() {
            match self.locate(pc) {
                Ok((start, from, end)) => todo.push((start, pc, i, from, end)),
                Err(why) => verdicts[i] = SiteVerdict::refused(why),
            }
        }
        todo.sort_unstable();
        for group in todo.chunk_by(|a, b| a.0 == b.0) {
            let (start, _, _, from, end) = group[0];
            let sites: Vec<u64> = group.iter().map(|g| g.1).collect();
            for (g, verdict) in group.iter().zip(self.decode(start, from, end, &sites)) {
                verdicts[g.2] = verdict;
            }
        }
        verdicts
    }

    /// The function start to decode `pc` from, how it was found, and the end of
    /// the file bytes of its executable segment.
    fn locate(&self, pc: u64) -> Result<(u64, &'static str, u64), String> {
        let segment = self
            .segments
            .iter()
            .find(|s| s.executable && s.contains_vaddr(pc) && pc - s.vaddr < s.filesz)
            .ok_or_else(|| format!("site {pc:#x} refused: it is not in executable code"))?;
        let (start, from) = self.function_start(pc).ok_or_else(|| {
            format!(
                "site {pc:#x} refused: no function start is known for it (no symbol covers it, \
                 no .eh_frame_hdr entry precedes it), so it cannot be checked"
            )
        })?;
        if start < segment.vaddr {
            return Err(format!(
                "site {pc:#x} refused: its function start {start:#x} ({from}) is outside its \
                 executable segment"
            ));
        }
        if pc - start > MAX_DECODE_BYTES {
            return Err(format!(
                "site {pc:#x} refused: it is {} bytes past its function start {start:#x} \
                 ({from}), more than the {MAX_DECODE_BYTES} decoded to check it",
                pc - start
            ));
        }
        // A hostile header may put the segment's end past u64::MAX.
        Ok((start, from, segment.vaddr.saturating_add(segment.filesz)))
    }

    /// Decodes from `start` through the sorted `sites` (all in `start..end`):
    /// each must be an instruction boundary holding a one-byte `nop`.
    fn decode(&self, start: u64, from: &str, end: u64, sites: &[u64]) -> Vec<SiteVerdict> {
        let last = sites.last().copied().unwrap_or(start);
        let stop = last.saturating_add(MAX_INSN_LEN.max(SUFFIX_BYTES)).min(end);
        let bytes = file_offset(self.segments, start)
            .zip(file_offset(self.segments, stop - 1))
            .and_then(|(a, b)| {
                self.data
                    .get(usize::try_from(a).ok()?..=usize::try_from(b).ok()?)
            });
        let Some(bytes) = bytes else {
            return sites
                .iter()
                .map(|pc| {
                    SiteVerdict::refused(format!(
                        "site {pc:#x} refused: the file does not hold its code"
                    ))
                })
                .collect();
        };
        let mut decoder = Decoder::with_ip(64, bytes, start, DecoderOptions::NONE);
        let mut instr = Instruction::default();
        let mut undecodable = None;
        let mut first_arg = FirstArg::new();
        let mut recent: std::collections::VecDeque<Instruction> =
            std::collections::VecDeque::with_capacity(LEAD_IN);
        sites
            .iter()
            .map(|&pc| {
                while undecodable.is_none() && decoder.ip() < pc {
                    decoder.decode_out(&mut instr);
                    first_arg.step(&instr);
                    if instr.is_invalid() {
                        undecodable = Some(instr.ip());
                    }
                    if recent.len() == LEAD_IN {
                        recent.pop_front();
                    }
                    recent.push_back(instr);
                }
                let verdict =
                    self.site_verdict(&decoder, &instr, undecodable, bytes, start, from, pc);
                let holder = verdict.is_ok().then(|| first_arg.holder()).flatten();
                let proof = holder
                    .filter(|_| {
                        let from_site = bytes.get((pc - start) as usize..).unwrap_or_default();
                        let mut rest = Decoder::with_ip(64, from_site, pc, DecoderOptions::NONE);
                        straight_to_ret(&mut rest)
                    })
                    .map(|_| FirstArgProof {
                        function_start: start,
                        loaded: first_arg.loaded().to_vec(),
                        read_through: first_arg.read_through().to_vec(),
                    });
                let lead_in = if verdict.is_ok() {
                    recent.iter().copied().collect()
                } else {
                    Vec::new()
                };
                SiteVerdict {
                    verdict,
                    first_arg: holder,
                    proof,
                    lead_in,
                }
            })
            .collect()
    }

    /// Whether `pc`, reached by `decoder` (`instr` its last instruction), is a
    /// one-byte `nop` at an instruction boundary of the function at `start` (whose
    /// code is `bytes`).
    #[allow(clippy::too_many_arguments)]
    fn site_verdict(
        &self,
        decoder: &Decoder<'_>,
        instr: &Instruction,
        undecodable: Option<u64>,
        bytes: &[u8],
        start: u64,
        from: &str,
        pc: u64,
    ) -> Result<(), String> {
        if let Some(at) = undecodable {
            return Err(format!(
                "site {pc:#x} refused: the instruction at {at:#x} cannot be decoded \
                 (decoding from the function start {start:#x}, {from})"
            ));
        }
        if decoder.ip() != pc {
            return Err(format!(
                "site {pc:#x} refused: it is inside the {}-byte instruction at {:#x}, not \
                 at an instruction boundary (decoded from the function start {start:#x}, \
                 {from})",
                instr.len(),
                instr.ip()
            ));
        }
        match bytes.get((pc - start) as usize) {
            Some(0x90) => Ok(()),
            Some(b) => Err(format!(
                "site {pc:#x} refused: the byte there is {b:#04x}, not a one-byte nop (0x90)"
            )),
            None => Err(format!(
                "site {pc:#x} refused: the file does not hold its code"
            )),
        }
    }
}

/// Records on each probe and site why it must not be written, if so.
pub(super) fn verify_probes(
    elf: &Elf,
    data: &[u8],
    segments: &[LoadSegment],
    probes: &mut [SdtProbe],
) {
    if probes.is_empty() {
        return;
    }
    let v = Verifier::new(elf, data, segments);
    for probe in probes.iter_mut() {
        if probe.semaphore_refused.is_none() {
            if let Some(sem) = probe.semaphore {
                probe.semaphore_refused = v.check_semaphore(sem).err();
            }
        }
        let pcs: Vec<u64> = probe.sites.iter().map(|s| s.address).collect();
        for (site, v) in probe.sites.iter_mut().zip(v.check_sites(&pcs)) {
            site.refused = v.verdict.err();
            site.first_arg = v.first_arg;
            site.first_arg_proof = v.proof;
            site.lead_in = v.lead_in;
        }
    }
}

#[cfg(test)]
mod tests;
