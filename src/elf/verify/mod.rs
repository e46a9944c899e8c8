//! Checks that an SDT note's addresses point where `<sys/sdt.h>` puts things,
//! before pyprobe writes anything there: a corrupt or forged note must not steer
//! a write into the target's data or into the middle of an instruction.
//!
//! * A semaphore is a 2-byte counter in the object's `.probes` section.
//! * A probe site is a one-byte `nop` at an instruction boundary of executable
//!   code: decoding its function from the start (a symbol covering it, else the
//!   nearest function start before it in `.eh_frame_hdr`) must reach it exactly.

use goblin::elf::program_header::PT_GNU_EH_FRAME;
use goblin::elf::sym::{STT_FUNC, STT_GNU_IFUNC};
use goblin::elf::Elf;
use iced_x86::{Decoder, DecoderOptions, Instruction};

use super::layout::{file_offset, LoadSegment};
use super::notes::SdtProbe;

/// Most bytes decoded from a function's start to reach one of its sites (the
/// largest CPython function, the eval loop, is a few hundred KiB).
const MAX_DECODE_BYTES: u64 = 4 << 20;

/// Longest x86 instruction.
const MAX_INSN_LEN: u64 = 15;

/// `DW_EH_PE_datarel | DW_EH_PE_sdata4`: the search table encoding every linker emits.
const TABLE_DATAREL_SDATA4: u8 = 0x3b;
const DW_EH_PE_OMIT: u8 = 0xff;

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
    /// that must not be written. Sites of one function are checked in one decoding
    /// pass.
    pub(super) fn check_sites(&self, pcs: &[u64]) -> Vec<Result<(), String>> {
        let mut verdicts: Vec<Result<(), String>> = vec![Ok(()); pcs.len()];
        // (function start, site, index in pcs) of the sites worth decoding.
        let mut todo = Vec::new();
        for (i, &pc) in pcs.iter().enumerate() {
            match self.locate(pc) {
                Ok((start, from, end)) => todo.push((start, pc, i, from, end)),
                Err(why) => verdicts[i] = Err(why),
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
    fn decode(&self, start: u64, from: &str, end: u64, sites: &[u64]) -> Vec<Result<(), String>> {
        let last = sites.last().copied().unwrap_or(start);
        let stop = last.saturating_add(MAX_INSN_LEN).min(end);
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
                    Err(format!(
                        "site {pc:#x} refused: the file does not hold its code"
                    ))
                })
                .collect();
        };
        let mut decoder = Decoder::with_ip(64, bytes, start, DecoderOptions::NONE);
        let mut instr = Instruction::default();
        let mut undecodable = None;
        sites
            .iter()
            .map(|&pc| {
                while undecodable.is_none() && decoder.ip() < pc {
                    decoder.decode_out(&mut instr);
                    if instr.is_invalid() {
                        undecodable = Some(instr.ip());
                    }
                }
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
            })
            .collect()
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
        for (site, verdict) in probe.sites.iter_mut().zip(v.check_sites(&pcs)) {
            site.refused = verdict.err();
        }
    }
}

/// Reads an encoded `.eh_frame_hdr` value's size in bytes (0: variable, unknown).
fn encoded_size(encoding: u8) -> Option<usize> {
    match encoding & 0x0f {
        0x00 | 0x04 | 0x0c => Some(8),
        0x02 | 0x0a => Some(2),
        0x03 | 0x0b => Some(4),
        _ => None,
    }
}

/// The function start addresses of the `.eh_frame_hdr` binary search table
/// (section by name, else the PT_GNU_EH_FRAME segment). Empty when absent or in
/// an encoding other than the one linkers emit.
fn eh_frame_hdr_starts(elf: &Elf, data: &[u8]) -> Vec<u64> {
    let located = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".eh_frame_hdr"))
        .map(|sh| (sh.sh_addr, sh.sh_offset, sh.sh_size))
        .or_else(|| {
            elf.program_headers
                .iter()
                .find(|ph| ph.p_type == PT_GNU_EH_FRAME)
                .map(|ph| (ph.p_vaddr, ph.p_offset, ph.p_filesz))
        });
    let Some((addr, offset, size)) = located else {
        return Vec::new();
    };
    let hdr = usize::try_from(offset)
        .ok()
        .zip(usize::try_from(size).ok())
        .and_then(|(o, n)| data.get(o..o.checked_add(n)?));
    let Some(hdr) = hdr else {
        return Vec::new();
    };
    let (Some(&1), Some(&ptr_enc), Some(&count_enc), Some(&table_enc)) =
        (hdr.first(), hdr.get(1), hdr.get(2), hdr.get(3))
    else {
        return Vec::new();
    };
    if count_enc == DW_EH_PE_OMIT || table_enc != TABLE_DATAREL_SDATA4 {
        return Vec::new();
    }
    let (Some(ptr_len), Some(count_len)) = (encoded_size(ptr_enc), encoded_size(count_enc)) else {
        return Vec::new();
    };
    let count_at = 4 + ptr_len;
    let Some(count) = hdr.get(count_at..count_at + count_len).map(|b| {
        let mut v = [0u8; 8];
        v[..b.len()].copy_from_slice(b);
        u64::from_le_bytes(v)
    }) else {
        return Vec::new();
    };
    let table = &hdr[count_at + count_len..];
    // Each entry: initial location and FDE address, 4 bytes each; a count past
    // the section's end is cut to what it holds.
    let entries = table
        .chunks_exact(8)
        .take(usize::try_from(count).unwrap_or(usize::MAX));
    let mut starts: Vec<u64> = entries
        .map(|e| {
            let rel = i32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            addr.wrapping_add_signed(i64::from(rel))
        })
        .collect();
    starts.sort_unstable();
    starts.dedup();
    starts
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::elf::ElfInfo;

    fn repo() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn a_segment_ending_past_the_address_space_is_no_panic() {
        // Found by the elf_notes fuzzer (debug builds check the overflow; the
        // fuzzer replays this seed): an executable segment whose address plus size
        // passes u64::MAX, with probe sites in it, none of them usable.
        let data = std::fs::read(repo().join("fuzz/seeds/elf_notes/segment-end-overflow")).unwrap();
        if let Ok(info) = ElfInfo::parse(Path::new("fuzz.elf"), &data) {
            for probe in &info.probes {
                for site in &probe.sites {
                    assert!(site.refused.is_some(), "{:#x} accepted", site.address);
                }
            }
        }
    }

    /// A file the tests need, or `None` with a notice (a failure under
    /// `PYPROBE_REQUIRE_PYTHONS=1`, as in CI).
    fn needed(path: PathBuf, how: &str) -> Option<PathBuf> {
        if path.exists() {
            return Some(path);
        }
        let msg = format!("{} is missing: {how}", path.display());
        if std::env::var_os("PYPROBE_REQUIRE_PYTHONS").is_some() {
            panic!("{msg}");
        }
        eprintln!("NOTICE: skipping: {msg}");
        None
    }

    fn python(version: &str) -> Option<PathBuf> {
        let path = repo().join(format!(".pythons/{version}/usr/bin/python{version}"));
        needed(path, &format!("run scripts/fetch-pythons.sh {version}"))
    }

    fn fixture(name: &str) -> Option<PathBuf> {
        needed(
            repo().join("fixtures/build").join(name),
            "run scripts/build-fixtures.sh",
        )
    }

    /// Every site and semaphore of `path` passes; returns how many sites, and how
    /// many of them were decoded from an `.eh_frame_hdr` function start.
    fn all_pass(path: &Path) -> (usize, usize) {
        let data = std::fs::read(path).unwrap();
        let info = ElfInfo::parse(path, &data).unwrap();
        let elf = Elf::parse(&data).unwrap();
        let v = Verifier::new(&elf, &data, &info.segments);
        let mut sites = 0;
        let mut from_eh_frame = 0;
        for p in &info.probes {
            assert_eq!(p.semaphore_refused, None, "{}: {}", path.display(), p.name);
            for s in &p.sites {
                assert_eq!(s.refused, None, "{}: {}", path.display(), p.name);
                sites += 1;
                if v.function_start(s.address).map(|f| f.1) == Some(".eh_frame_hdr entry") {
                    from_eh_frame += 1;
                }
            }
        }
        (sites, from_eh_frame)
    }

    #[test]
    fn every_site_of_the_real_pythons_and_the_fixtures_passes() {
        for version in ["3.9", "3.13", "3.14", "3.15"] {
            let Some(path) = python(version) else {
                continue;
            };
            let (sites, from_eh_frame) = all_pass(&path);
            assert!(sites >= 5, "{}: {sites} sites", path.display());
            // Debian strips .symtab: static functions are found through .eh_frame_hdr.
            assert!(from_eh_frame > 0, "{}", path.display());
        }
        for name in [
            "sdt_fixture_pie",
            "sdt_fixture_nopie",
            "sdt_fixture_lib",
            "libsdt_fixture.so",
        ] {
            let Some(path) = fixture(name) else { continue };
            let (sites, _) = all_pass(&path);
            let expected = if name == "sdt_fixture_lib" { 0 } else { 8 };
            assert_eq!(sites, expected, "{}", path.display());
        }
        // Other objects with SDT notes on this machine (libc, the system CPython).
        for other in ["/usr/bin/python3.11", "/lib/x86_64-linux-gnu/libc.so.6"] {
            if Path::new(other).exists() {
                all_pass(Path::new(other));
            }
        }
    }

    /// The file offsets of the descriptors of `provider:name`'s notes.
    fn descs(data: &[u8], name: &str) -> Vec<usize> {
        let elf = Elf::parse(data).unwrap();
        let sh = elf
            .section_headers
            .iter()
            .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".note.stapsdt"))
            .unwrap();
        let (mut at, end) = (sh.sh_offset as usize, (sh.sh_offset + sh.sh_size) as usize);
        let word = |a: usize| u32::from_le_bytes(data[a..a + 4].try_into().unwrap()) as usize;
        let mut found = Vec::new();
        while at + 12 <= end {
            let (namesz, descsz) = (word(at), word(at + 4));
            let desc = at + 12 + namesz.next_multiple_of(4);
            let strings = &data[desc + 24..desc + descsz];
            let mut parts = strings.split(|&b| b == 0);
            let _provider = parts.next();
            if parts.next() == Some(name.as_bytes()) {
                found.push(desc);
            }
            at = desc + descsz.next_multiple_of(4);
        }
        assert!(!found.is_empty(), "no note for {name}");
        found
    }

    fn get(data: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(data[at..at + 8].try_into().unwrap())
    }

    fn put(data: &mut [u8], at: usize, value: u64) {
        data[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }

    fn parse(data: &[u8]) -> ElfInfo {
        ElfInfo::parse(Path::new("forged"), data).unwrap()
    }

    fn probe<'a>(info: &'a ElfInfo, name: &str) -> &'a SdtProbe {
        info.probes.iter().find(|p| p.name == name).unwrap()
    }

    #[test]
    fn forged_semaphores_are_refused() {
        let Some(path) = fixture("sdt_fixture_pie") else {
            return;
        };
        let good = std::fs::read(path).unwrap();
        let info = parse(&good);
        let g32 = info.symbols.address("g32").unwrap();
        let sem = probe(&info, "gated").semaphore.unwrap();
        let gated = descs(&good, "gated")[0];
        assert_eq!(get(&good, gated + 16), sem);
        let verdict = |value: u64| {
            let mut data = good.clone();
            put(&mut data, gated + 16, value);
            let info = parse(&data);
            let p = probe(&info, "gated");
            assert_eq!(p.semaphore, Some(value));
            p.semaphore_refused.clone().unwrap_or_default()
        };
        assert!(
            verdict(g32).contains("outside the .probes section"),
            "{}",
            verdict(g32)
        );
        assert!(verdict(sem + 2).contains("outside the .probes section"));
        assert!(
            verdict(sem + 1).contains("2-byte aligned"),
            "{}",
            verdict(sem + 1)
        );
        assert_eq!(verdict(sem), "");

        // Two notes of one probe naming different semaphores.
        let mut data = good.clone();
        let twosite = descs(&good, "twosite");
        assert_eq!(twosite.len(), 2);
        put(&mut data, twosite[0] + 16, sem);
        put(&mut data, twosite[1] + 16, g32);
        let info = parse(&data);
        let why = probe(&info, "twosite").semaphore_refused.clone().unwrap();
        assert!(why.contains("another note of the same probe"), "{why}");

        // No .probes section at all.
        let mut data = good.clone();
        let name = data.windows(8).position(|w| w == b".probes\0").unwrap();
        data[name + 6] = b'z';
        let info = parse(&data);
        let why = probe(&info, "gated").semaphore_refused.clone().unwrap();
        assert!(why.contains("no .probes section"), "{why}");
    }

    #[test]
    fn forged_sites_are_refused() {
        let Some(path) = fixture("sdt_fixture_pie") else {
            return;
        };
        let good = std::fs::read(path).unwrap();
        let info = parse(&good);
        let site = probe(&info, "str").sites[0].address;
        let at = descs(&good, "str")[0];
        let verdict = |pc: u64| {
            let mut data = good.clone();
            put(&mut data, at, pc);
            let info = parse(&data);
            probe(&info, "str").sites[0]
                .refused
                .clone()
                .unwrap_or_default()
        };
        assert_eq!(verdict(site), "");
        // The instruction before the nop: the nop is the last byte of the asm block,
        // so one byte back is the end of whatever came before it.
        let inside = (1..16)
            .map(|back| site - back)
            .find(|&pc| verdict(pc).contains("inside the"))
            .expect("a byte inside an instruction before the site");
        assert!(verdict(inside).contains("not at an instruction boundary"));
        let g32 = info.symbols.address("g32").unwrap();
        assert!(
            verdict(g32).contains("not in executable code"),
            "{}",
            verdict(g32)
        );
        // An instruction boundary without a nop: the function's first instruction.
        let elf = Elf::parse(&good).unwrap();
        let v = Verifier::new(&elf, &good, &info.segments);
        let (start, _) = v.function_start(site).unwrap();
        assert!(
            verdict(start).contains("not a one-byte nop"),
            "{}",
            verdict(start)
        );
        assert!(verdict(0).contains("not in executable code"));
        assert!(verdict(u64::MAX).contains("not in executable code"));
    }

    /// Without symbols covering a site and without `.eh_frame_hdr`, nothing says
    /// where its function starts: refused.
    #[test]
    fn a_site_without_a_known_function_start_is_refused() {
        let Some(path) = python("3.9") else { return };
        let good = std::fs::read(path).unwrap();
        let mut data = good.clone();
        let elf = Elf::parse(&good).unwrap();
        // Hide the section (by name) and the segment (by type).
        let name = data
            .windows(14)
            .position(|w| w == b".eh_frame_hdr\0")
            .unwrap();
        data[name + 12] = b'X';
        let phoff = elf.header.e_phoff as usize;
        let phentsize = usize::from(elf.header.e_phentsize);
        for (i, ph) in elf.program_headers.iter().enumerate() {
            if ph.p_type == PT_GNU_EH_FRAME {
                data[phoff + i * phentsize..][..4].copy_from_slice(&0u32.to_le_bytes());
            }
        }
        let info = parse(&data);
        let refused: Vec<&String> = info
            .probes
            .iter()
            .flat_map(|p| &p.sites)
            .filter_map(|s| s.refused.as_ref())
            .collect();
        assert!(!refused.is_empty());
        assert!(
            refused
                .iter()
                .all(|r| r.contains("no function start is known")),
            "{refused:?}"
        );
    }

    /// A search table claiming more entries than its section holds is read as far
    /// as it goes; one of another version gives no function starts.
    #[test]
    fn a_corrupt_eh_frame_hdr_is_read_within_bounds() {
        let Some(path) = python("3.9") else { return };
        let good = std::fs::read(path).unwrap();
        let elf = Elf::parse(&good).unwrap();
        let hdr = elf
            .section_headers
            .iter()
            .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".eh_frame_hdr"))
            .unwrap()
            .sh_offset as usize;
        assert_eq!(
            good[hdr..hdr + 4],
            [1, 0x1b, 0x03, 0x3b],
            "the usual encodings"
        );
        let mut data = good.clone();
        data[hdr + 8..hdr + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        let info = parse(&data);
        assert!(info
            .probes
            .iter()
            .flat_map(|p| &p.sites)
            .all(|s| s.refused.is_none()));
        data[hdr] = 2;
        let info = parse(&data);
        assert!(info.probes.iter().flat_map(|p| &p.sites).any(|s| s
            .refused
            .as_ref()
            .is_some_and(|r| r.contains("no function start"))));
    }
}
