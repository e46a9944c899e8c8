//! `.note.stapsdt` (SystemTap SDT probes) and the GNU build id.
//!
//! An SDT note's descriptor holds three addresses (probe site, `.stapsdt.base` at link
//! time, semaphore) followed by three NUL-terminated strings: provider, probe name and
//! argument spec. If the object was moved after linking (prelink), the actual address of
//! `.stapsdt.base` differs from the one in the note and every address shifts by the same
//! amount.

use std::path::Path;

use goblin::elf::Elf;
use serde::Serialize;

use super::ElfError;

const NT_STAPSDT: u32 = 3;
const NT_GNU_BUILD_ID: u32 = 3;

/// One note as stored, with addresses already corrected for `.stapsdt.base`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SdtNote {
    pub provider: String,
    pub name: String,
    pub address: u64,
    /// 0 when the probe has no semaphore.
    pub semaphore: u64,
    pub args: String,
}

/// One place in the code where a probe fires. Inlined copies of a probe have their
/// own sites, each with its own argument spec (the registers differ).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SdtSite {
    /// Link-time address of the site (a one-byte `nop`).
    pub address: u64,
    pub args: String,
    /// Why this site must not be written, if so (see [`super::verify`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The register (AT&T name) that holds, at the site, the first argument of the
    /// function the site is in, as its code shows (`None` when it does not show it
    /// surely). Not a note's argument: what the register holds must be checked
    /// before it is relied on.
    #[serde(skip)]
    pub first_arg: Option<&'static str>,
    /// Where [`Self::first_arg`] is known, what the function's code proves of it:
    /// which words through it were read (so exist) on every way to the site.
    #[serde(skip)]
    pub first_arg_proof: Option<FirstArgProof>,
    /// The instructions just before the site (at most 24, link-time addresses),
    /// as decoded from its function's start on the way to it: exact boundaries,
    /// for a caller that reads what the code computed the probe's arguments from.
    /// Empty for a refused site.
    #[serde(skip)]
    pub lead_in: Vec<iced_x86::Instruction>,
}

/// What a site's function proves, in its own code, of its first argument: from
/// `function_start` to the site the code runs straight (no branch out, no jump in
/// from within itself), and on from the site straight to its `ret`; on that way it
/// read the 8-byte words at `loaded` displacements from the argument, so each is
/// readable at the site whenever the function runs. A branch from elsewhere into
/// `function_start..=site` would break this; that the caller checks against the
/// code it maps (the branch targets of the whole segment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstArgProof {
    /// Link-time address of the function's start.
    pub function_start: u64,
    /// Displacements `d` of the loads `[argument + d]` of 8 bytes made before the site.
    pub loaded: Vec<i64>,
    /// `(w, end)`: through the word at displacement `w` from the argument (a
    /// pointer, low tag bits cleared), the code read before the site as far as
    /// `end` bytes into what it points to.
    pub read_through: Vec<(i64, i64)>,
}

/// A probe: all sites of one (provider, name). Sites share one semaphore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SdtProbe {
    pub provider: String,
    pub name: String,
    /// Link-time address of the 2-byte semaphore counter, if the probe has one.
    pub semaphore: Option<u64>,
    /// Why the semaphore must not be written, if so: then no site of the probe is
    /// armed either.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub semaphore_refused: Option<String>,
    pub sites: Vec<SdtSite>,
}

pub(super) fn read_probes(path: &Path, elf: &Elf, data: &[u8]) -> Result<Vec<SdtProbe>, ElfError> {
    let base_section = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".stapsdt.base"))
        .map(|sh| sh.sh_addr);
    let note_offset = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".note.stapsdt"))
        .map(|sh| sh.sh_offset)
        .unwrap_or(0);

    let mut probes: Vec<SdtProbe> = Vec::new();
    let Some(notes) = elf.iter_note_sections(data, Some(".note.stapsdt")) else {
        return Ok(probes);
    };
    for note in notes {
        let note = note.map_err(|e| ElfError::BadNote {
            path: path.to_owned(),
            offset: note_offset,
            reason: e.to_string(),
        })?;
        if note.n_type != NT_STAPSDT || note.name != "stapsdt" {
            continue;
        }
        let parsed = parse_desc(note.desc, base_section).map_err(|reason| ElfError::BadNote {
            path: path.to_owned(),
            offset: note_offset,
            reason,
        })?;
        add_site(&mut probes, parsed);
    }
    Ok(probes)
}

fn add_site(probes: &mut Vec<SdtProbe>, note: SdtNote) {
    let site = SdtSite {
        address: note.address,
        args: note.args,
        refused: None,
        first_arg: None,
        first_arg_proof: None,
        lead_in: Vec::new(),
    };
    let semaphore = (note.semaphore != 0).then_some(note.semaphore);
    match probes
        .iter_mut()
        .find(|p| p.provider == note.provider && p.name == note.name)
    {
        Some(probe) => {
            probe.sites.push(site);
            match (probe.semaphore, semaphore) {
                (None, _) => probe.semaphore = semaphore,
                // One probe has one semaphore: notes that disagree are not to be trusted.
                (Some(a), Some(b)) if a != b && probe.semaphore_refused.is_none() => {
                    probe.semaphore_refused = Some(format!(
                        "semaphore {a:#x} refused: another note of the same probe names {b:#x}"
                    ));
                }
                _ => {}
            }
        }
        None => probes.push(SdtProbe {
            provider: note.provider,
            name: note.name,
            semaphore,
            semaphore_refused: None,
            sites: vec![site],
        }),
    }
}

/// Decodes one stapsdt descriptor. `base_section` is the actual address of
/// `.stapsdt.base` in this file, if it has that section.
pub fn parse_desc(desc: &[u8], base_section: Option<u64>) -> Result<SdtNote, String> {
    let word = |i: usize| -> Result<u64, String> {
        desc.get(i * 8..i * 8 + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| {
                format!(
                    "descriptor of {} bytes is too short for its addresses",
                    desc.len()
                )
            })
    };
    let (mut address, link_base, mut semaphore) = (word(0)?, word(1)?, word(2)?);
    if let Some(actual_base) = base_section {
        if link_base != 0 {
            let shift = actual_base.wrapping_sub(link_base);
            address = address.wrapping_add(shift);
            if semaphore != 0 {
                semaphore = semaphore.wrapping_add(shift);
            }
        }
    }
    let mut strings = desc.get(24..).unwrap_or_default().split(|&b| b == 0);
    let mut next = |what: &str| -> Result<String, String> {
        strings
            .next()
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .ok_or_else(|| format!("missing {what} string"))
    };
    let provider = next("provider")?;
    let name = next("probe name")?;
    let args = next("argument").unwrap_or_default();
    if provider.is_empty() || name.is_empty() {
        return Err("empty provider or probe name".into());
    }
    Ok(SdtNote {
        provider,
        name,
        address,
        semaphore,
        args,
    })
}

pub(super) fn build_id(elf: &Elf, data: &[u8]) -> Option<String> {
    let notes = elf
        .iter_note_headers(data)
        .or_else(|| elf.iter_note_sections(data, Some(".note.gnu.build-id")))?;
    // Stop at the first malformed note: goblin's iterator does not advance past one
    // and would return the same error forever (found by fuzzing).
    notes
        .map_while(Result::ok)
        .find(|n| n.n_type == NT_GNU_BUILD_ID && n.name == "GNU")
        .map(|n| n.desc.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(pc: u64, base: u64, sem: u64, strings: &[&str]) -> Vec<u8> {
        let mut d = Vec::new();
        for w in [pc, base, sem] {
            d.extend_from_slice(&w.to_le_bytes());
        }
        for s in strings {
            d.extend_from_slice(s.as_bytes());
            d.push(0);
        }
        d
    }

    #[test]
    fn decodes_fields_and_applies_base_shift() {
        let d = desc(
            0x1000,
            0x2000,
            0x3000,
            &["python", "function__entry", "8@%rbp 8@%r12 -4@%eax"],
        );
        let n = parse_desc(&d, Some(0x2000)).unwrap();
        assert_eq!((n.address, n.semaphore), (0x1000, 0x3000));
        assert_eq!(n.args, "8@%rbp 8@%r12 -4@%eax");
        let moved = parse_desc(&d, Some(0x2100)).unwrap();
        assert_eq!((moved.address, moved.semaphore), (0x1100, 0x3100));
    }

    #[test]
    fn probe_without_semaphore_or_args() {
        let d = desc(0x10, 0, 0, &["python", "gc__done", ""]);
        let n = parse_desc(&d, None).unwrap();
        assert_eq!((n.semaphore, n.args.as_str()), (0, ""));
    }

    /// A PT_NOTE segment holding one note whose name size runs past the file: goblin
    /// returns the same error for ever, and the build-id scan must not loop on it.
    #[test]
    fn malformed_note_segment_does_not_hang() {
        let mut elf = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0];
        elf.resize(16, 0);
        for (v, n) in [
            (3u64, 2), // e_type: ET_DYN
            (62, 2),   // e_machine: x86-64
            (1, 4),    // e_version
            (0, 8),    // e_entry
            (64, 8),   // e_phoff
            (0, 8),    // e_shoff
            (0, 4),    // e_flags
            (64, 2),   // e_ehsize
            (56, 2),   // e_phentsize
            (1, 2),    // e_phnum
            (64, 2),   // e_shentsize
            (0, 2),    // e_shnum
            (0, 2),    // e_shstrndx
            // The program header: PT_NOTE, flags, offset, vaddr, paddr, filesz, memsz, align.
            (4, 4),
            (4, 4),
            (120, 8),
            (120, 8),
            (120, 8),
            (24, 8),
            (24, 8),
            (4, 8),
            // The note: an absurd name size, no descriptor, type 3.
            (0xffff_ff00, 4),
            (0, 4),
            (3, 4),
        ] {
            elf.extend_from_slice(&v.to_le_bytes()[..n]);
        }
        elf.resize(144, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(crate::elf::ElfInfo::parse(Path::new("bad.elf"), &elf).is_ok());
        });
        let parsed = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("ElfInfo::parse returns on a malformed note segment");
        assert!(parsed, "a bad note costs the build id, not the whole file");
    }

    #[test]
    fn short_or_garbage_descriptors_are_errors_not_panics() {
        assert!(parse_desc(&[0; 7], None).is_err());
        assert!(parse_desc(&[0; 24], None).is_err());
        for len in 0..64 {
            let _ = parse_desc(&vec![0xff; len], Some(5));
        }
    }

    #[test]
    fn sites_of_one_probe_are_grouped() {
        let mut probes = Vec::new();
        for (pc, args) in [(1, "-4@%eax"), (2, "-4@%ebx")] {
            add_site(
                &mut probes,
                SdtNote {
                    provider: "p".into(),
                    name: "n".into(),
                    address: pc,
                    semaphore: 9,
                    args: args.into(),
                },
            );
        }
        assert_eq!(probes.len(), 1);
        assert_eq!(probes[0].sites.len(), 2);
        assert_eq!(probes[0].semaphore, Some(9));
    }
}
