//! ELF reading: SDT notes, symbols, sections, segments and the build id.
//!
//! Everything here works on link-time (virtual) addresses of one object file.
//! Turning them into runtime addresses of a process is `process::objects`' job.

mod notes;
mod segments;
mod symbols;
mod verify;

pub use notes::{parse_desc, FirstArgProof, SdtNote, SdtProbe, SdtSite};
pub use segments::{load_segments, LoadSegment};

use std::fs::File;
use std::path::{Path, PathBuf};

use goblin::elf::Elf;
use memmap2::Mmap;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ElfError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not an ELF file this tool can read: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error(
        "{path} is a {class} ELF file; pyprobe reads x86-64 (64-bit little-endian) objects only"
    )]
    Unsupported { path: PathBuf, class: String },
    #[error("{path}: SDT note at file offset {offset:#x} is malformed: {reason}")]
    BadNote {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
}

/// What pyprobe needs from one ELF object, extracted once and owned.
#[derive(Debug, Clone)]
pub struct ElfInfo {
    pub path: PathBuf,
    /// `ET_DYN` (PIE executable or shared library) vs `ET_EXEC` (fixed address).
    pub position_independent: bool,
    pub segments: Vec<LoadSegment>,
    /// SDT probes grouped by (provider, name), in note order.
    pub probes: Vec<SdtProbe>,
    pub build_id: Option<String>,
    /// Link-time address of `_PyRuntime`, from `.dynsym` or `.symtab`.
    pub py_runtime: Option<u64>,
    /// Link-time address and size of the `.PyRuntime` section (3.12+ builds).
    pub py_runtime_section: Option<(u64, u64)>,
    /// Link-time address and size of the `.AsyncioDebug` section: the layout of
    /// asyncio's C tasks, in the object that defines them (3.14+: the interpreter,
    /// or the `_asyncio` extension module).
    pub asyncio_debug_section: Option<(u64, u64)>,
    /// Link-time address of the `Py_Version` symbol (3.11+).
    pub py_version_symbol: Option<u64>,
    /// Every defined symbol with an address, for `sym(%rip)` argument operands.
    pub symbols: symbols::SymbolTable,
    /// Size of the static TLS block of an executable (`PT_TLS` rounded to its
    /// alignment): `%fs`-relative offsets of its thread-locals lie in `-size..0`.
    pub executable_tls_size: Option<u64>,
}

impl ElfInfo {
    /// Reads `path` (any ELF: executable, shared library, or `/proc/PID/map_files/...`).
    pub fn read(path: &Path) -> Result<ElfInfo, ElfError> {
        let file = File::open(path).map_err(|source| ElfError::Open {
            path: path.to_owned(),
            source,
        })?;
        // SAFETY: the map is read-only and private; a concurrent truncation of the file
        // could fault, which is the accepted risk of every ELF reader that maps files.
        let data = unsafe { Mmap::map(&file) }.map_err(|source| ElfError::Open {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &data)
    }

    /// Parses an ELF image held in memory; `path` is only used in messages.
    pub fn parse(path: &Path, data: &[u8]) -> Result<ElfInfo, ElfError> {
        let elf = Elf::parse(data).map_err(|e| ElfError::Parse {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        if !elf.is_64
            || !elf.little_endian
            || elf.header.e_machine != goblin::elf::header::EM_X86_64
        {
            return Err(ElfError::Unsupported {
                path: path.to_owned(),
                class: format!(
                    "{}-bit {} machine {}",
                    if elf.is_64 { 64 } else { 32 },
                    if elf.little_endian {
                        "little-endian"
                    } else {
                        "big-endian"
                    },
                    elf.header.e_machine
                ),
            });
        }
        let segments = segments::load_segments(&elf);
        let mut probes = notes::read_probes(path, &elf, data)?;
        verify::verify_probes(&elf, data, &segments, &mut probes);
        let symbols = symbols::SymbolTable::from_elf(&elf);
        let section = |name: &str| {
            elf.section_headers
                .iter()
                .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(name))
                .map(|sh| (sh.sh_addr, sh.sh_size))
        };
        Ok(ElfInfo {
            path: path.to_owned(),
            position_independent: elf.header.e_type == goblin::elf::header::ET_DYN,
            segments,
            probes,
            build_id: notes::build_id(&elf, data),
            py_runtime: symbols.address("_PyRuntime"),
            py_runtime_section: section(".PyRuntime"),
            asyncio_debug_section: section(".AsyncioDebug"),
            py_version_symbol: symbols.address("Py_Version"),
            symbols,
            executable_tls_size: segments::executable_tls_size(&elf),
        })
    }

    /// The file offset at which link-time address `vaddr` is stored, if a PT_LOAD
    /// segment holds file bytes for it.
    pub fn file_offset(&self, vaddr: u64) -> Option<u64> {
        segments::file_offset(&self.segments, vaddr)
    }

    /// Probes of one provider (e.g. `python`).
    pub fn provider_probes<'a>(&'a self, provider: &'a str) -> impl Iterator<Item = &'a SdtProbe> {
        self.probes.iter().filter(move |p| p.provider == provider)
    }
}
