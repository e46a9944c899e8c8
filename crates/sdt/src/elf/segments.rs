//! PT_LOAD segments: link-time address ↔ file offset.

use goblin::elf::program_header::{PF_W, PF_X, PT_INTERP, PT_LOAD, PT_TLS};
use goblin::elf::Elf;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LoadSegment {
    pub vaddr: u64,
    pub memsz: u64,
    pub offset: u64,
    pub(crate) filesz: u64,
    pub executable: bool,
    pub writable: bool,
}

impl LoadSegment {
    pub fn contains_vaddr(&self, vaddr: u64) -> bool {
        vaddr >= self.vaddr && vaddr - self.vaddr < self.memsz
    }

    pub fn contains_offset(&self, offset: u64) -> bool {
        offset >= self.offset && offset - self.offset < self.filesz
    }
}

pub fn load_segments(elf: &Elf) -> Vec<LoadSegment> {
    elf.program_headers
        .iter()
        .filter(|ph| ph.p_type == PT_LOAD)
        .map(|ph| LoadSegment {
            vaddr: ph.p_vaddr,
            memsz: ph.p_memsz,
            offset: ph.p_offset,
            filesz: ph.p_filesz,
            executable: ph.p_flags & PF_X != 0,
            writable: ph.p_flags & PF_W != 0,
        })
        .collect()
}

/// The executable's static TLS block, as the thread pointer sees it: the block
/// ends at `%fs:0` and is `memsz` rounded up to its alignment long (x86-64 TLS
/// variant II). `None` for a shared library (no `PT_INTERP`: its block is placed
/// by the loader) or an object without TLS.
pub(super) fn executable_tls_size(elf: &Elf) -> Option<u64> {
    if !elf.program_headers.iter().any(|ph| ph.p_type == PT_INTERP) {
        return None;
    }
    let tls = elf.program_headers.iter().find(|ph| ph.p_type == PT_TLS)?;
    let align = tls.p_align.max(1);
    if !align.is_power_of_two() || tls.p_memsz > 1 << 20 {
        return None;
    }
    Some(tls.p_memsz.checked_add(align - 1)? & !(align - 1))
}

pub(super) fn file_offset(segments: &[LoadSegment], vaddr: u64) -> Option<u64> {
    // A hostile header may put the segment's file offset near u64::MAX: no offset then.
    segments
        .iter()
        .find(|s| s.contains_vaddr(vaddr) && vaddr - s.vaddr < s.filesz)
        .and_then(|s| s.offset.checked_add(vaddr - s.vaddr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_past_u64_max_is_no_offset() {
        let segs = [LoadSegment {
            vaddr: 0x1000,
            memsz: 0x1000,
            offset: u64::MAX - 4,
            filesz: 0x1000,
            executable: false,
            writable: false,
        }];
        assert_eq!(file_offset(&segs, 0x1004), Some(u64::MAX));
        assert_eq!(file_offset(&segs, 0x1005), None);
    }

    #[test]
    fn maps_addresses_inside_file_bytes_only() {
        let segs = [
            LoadSegment {
                vaddr: 0x400000,
                memsz: 0x1000,
                offset: 0,
                filesz: 0x1000,
                executable: true,
                writable: false,
            },
            LoadSegment {
                vaddr: 0x601e00,
                memsz: 0x400,
                offset: 0x1e00,
                filesz: 0x200,
                executable: false,
                writable: false,
            },
        ];
        assert_eq!(file_offset(&segs, 0x400123), Some(0x123));
        assert_eq!(file_offset(&segs, 0x601f00), Some(0x1f00));
        // .bss: in memory but not in the file.
        assert_eq!(file_offset(&segs, 0x602100), None);
        assert_eq!(file_offset(&segs, 0x10), None);
    }
}
