//! One mapped ELF object as the native unwinder needs it: its unwind tables
//! (`.eh_frame_hdr`, `.eh_frame`), its code (for prologue and epilogue analysis),
//! its function names and its load bias.

use std::ops::{Deref, Range};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use framehop::ExplicitModuleSectionInfo;
use goblin::elf::Elf;

use pyprobe_sdt::elf::LoadSegment;
use pyprobe_sdt::process::maps::MapEntry;
use pyprobe_sdt::process::objects::load_bias;

use super::symbols::FunctionSymbols;

/// Largest object file read: a bigger one is left without native frames (its
/// frames are unwound by frame pointer, named by address).
const MAX_OBJECT_BYTES: u64 = 1 << 30;

/// A slice of an object file's bytes, shared with the file's other sections.
#[derive(Clone, Default)]
pub(crate) struct Section {
    file: Arc<Vec<u8>>,
    range: Range<usize>,
}

impl Deref for Section {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.file[self.range.clone()]
    }
}

/// What an object's unwind tables and names are, once read.
pub(crate) struct ObjectFile {
    pub(crate) symbols: FunctionSymbols,
    pub(crate) sections: ExplicitModuleSectionInfo<Section>,
    pub(crate) segments: Vec<LoadSegment>,
}

impl ObjectFile {
    /// Reads the object behind `entries` (the mappings of one file in `pid`),
    /// through `/proc/PID/map_files` (any mount namespace, deleted files), else
    /// through the target's root.
    pub(crate) fn open(pid: i32, entries: &[&MapEntry]) -> Result<ObjectFile> {
        let first = entries[0];
        let mut last_error = None;
        for path in [first.map_files_path(pid), first.root_path(pid)] {
            match read_capped(&path) {
                Ok(bytes) => {
                    return Self::parse(bytes).with_context(|| {
                        format!("pid {pid}: cannot read the unwind tables of {}", first.path)
                    })
                }
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow::anyhow!("no path"))).with_context(|| {
            format!(
                "pid {pid}: cannot open {} (mapped at {:#x})",
                first.path, first.start
            )
        })
    }

    /// Parses an object file's bytes; nothing in them is trusted (goblin bounds
    /// every table by the file's length, sections outside it are left out).
    pub fn parse(bytes: Vec<u8>) -> Result<ObjectFile> {
        let file = Arc::new(bytes);
        let elf = Elf::parse(&file).context("not an ELF file goblin can parse")?;
        if !elf.is_64 || elf.header.e_machine != goblin::elf::header::EM_X86_64 {
            bail!("not an x86-64 ELF object");
        }
        let segments = pyprobe_sdt::elf::load_segments(&elf);
        let symbols = FunctionSymbols::from_elf(&elf);
        let mut sections = ExplicitModuleSectionInfo::<Section> {
            base_svma: 0,
            ..Default::default()
        };
        for sh in &elf.section_headers {
            let Some(name) = elf.shdr_strtab.get_at(sh.sh_name) else {
                continue;
            };
            let svma = sh.sh_addr..sh.sh_addr.saturating_add(sh.sh_size);
            let data = || {
                let start = usize::try_from(sh.sh_offset).ok()?;
                let end = start.checked_add(usize::try_from(sh.sh_size).ok()?)?;
                (sh.sh_type != goblin::elf::section_header::SHT_NOBITS && end <= file.len()).then(
                    || Section {
                        file: file.clone(),
                        range: start..end,
                    },
                )
            };
            match name {
                ".text" => {
                    sections.text_svma = Some(svma);
                    sections.text = data();
                }
                ".eh_frame" => {
                    sections.eh_frame_svma = Some(svma);
                    sections.eh_frame = data();
                }
                ".eh_frame_hdr" => {
                    sections.eh_frame_hdr_svma = Some(svma);
                    sections.eh_frame_hdr = data();
                }
                ".got" => sections.got_svma = Some(svma),
                _ => {}
            }
        }
        Ok(ObjectFile {
            symbols,
            sections,
            segments,
        })
    }

    /// The start (link-time address) of the function whose `.eh_frame` entry
    /// covers `svma`, found through `.eh_frame_hdr`'s sorted table: the name of a
    /// stripped object's frames, the same for every address of one function.
    /// `None` where the object has no such table or no entry covers `svma`.
    pub(crate) fn function_start(&self, svma: u64) -> Option<u64> {
        use gimli::{BaseAddresses, EhFrame, EhFrameHdr, LittleEndian, UnwindSection};
        let s = &self.sections;
        let bases = BaseAddresses::default()
            .set_eh_frame_hdr(s.eh_frame_hdr_svma.as_ref()?.start)
            .set_eh_frame(s.eh_frame_svma.as_ref()?.start)
            .set_text(s.text_svma.as_ref().map_or(0, |r| r.start));
        let header = EhFrameHdr::new(s.eh_frame_hdr.as_deref()?, LittleEndian)
            .parse(&bases, 8)
            .ok()?;
        let eh_frame = EhFrame::new(s.eh_frame.as_deref()?, LittleEndian);
        let fde = header
            .table()?
            .fde_for_address(&eh_frame, &bases, svma, EhFrame::cie_from_offset)
            .ok()?;
        Some(fde.initial_address())
    }

    /// Runtime address = link-time address + bias, from the object's mappings.
    pub(crate) fn bias(&self, entries: &[&MapEntry]) -> Option<u64> {
        load_bias(&self.segments, entries)
    }
}

/// The whole file, refused past [`MAX_OBJECT_BYTES`] (read, not mapped: a file
/// truncated under a mapping would fault pyprobe).
fn read_capped(path: &std::path::Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_OBJECT_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.len() as u64 > MAX_OBJECT_BYTES {
        bail!(
            "{} is larger than {} MiB",
            path.display(),
            MAX_OBJECT_BYTES >> 20
        );
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test binary: its functions' unwind entries name every address inside
    /// them by their start, and a corrupt `.eh_frame_hdr` names nothing, quietly.
    #[test]
    fn an_address_is_named_by_its_unwind_entry_start() {
        let bytes = std::fs::read("/proc/self/exe").unwrap();
        let object = ObjectFile::parse(bytes.clone()).unwrap();
        let main = object.symbols.range_of("main").expect("a main symbol");
        assert!(main.end - main.start > 2);
        assert_eq!(object.function_start(main.start + 1), Some(main.start));
        assert_eq!(object.function_start(main.end - 1), Some(main.start));
        assert_eq!(object.function_start(u64::MAX - 8), None);

        let mut corrupt = bytes;
        let header = object.sections.eh_frame_hdr.as_ref().unwrap().range.clone();
        corrupt[header].fill(0xff);
        let object = ObjectFile::parse(corrupt).unwrap();
        assert_eq!(object.function_start(main.start + 1), None);
    }
}
