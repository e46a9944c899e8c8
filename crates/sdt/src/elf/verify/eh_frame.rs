//! Function starts from the `.eh_frame_hdr` binary search table, for sites no
//! symbol covers: where decoding toward a site begins.

use goblin::elf::program_header::PT_GNU_EH_FRAME;
use goblin::elf::Elf;

/// `DW_EH_PE_datarel | DW_EH_PE_sdata4`: the search table encoding every linker emits.
const TABLE_DATAREL_SDATA4: u8 = 0x3b;
const DW_EH_PE_OMIT: u8 = 0xff;

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
pub(super) fn eh_frame_hdr_starts(elf: &Elf, data: &[u8]) -> Vec<u64> {
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
