//! Direct branch targets of an executable segment, to check that no jump
//! lands inside the bytes a site patch replaces.

use iced_x86::{Decoder, DecoderOptions, FlowControl, Instruction, OpKind};

/// Sorted, deduplicated targets of every direct near `jmp`, `jcc`, `call`,
/// `loop`/`jrcxz` and `xbegin` found by a linear sweep of one segment.
///
/// The sweep decodes from the segment start; undecodable bytes are skipped
/// one at a time (x86 resynchronises within a few instructions). A linear
/// sweep is exact for compiler output that keeps data out of `.text` (GCC
/// and Clang on x86-64). It cannot see indirect targets (jump tables,
/// function pointers) except those [`add_code_pointers`](Self::add_code_pointers)
/// finds stored as 8-byte addresses in data; `qualify_site` also refuses
/// `endbr64` in the displaced bytes, the marker CET builds put at such
/// targets. Table-relative jump tables (4-byte offsets, as in PIC switch
/// statements) remain invisible.
#[derive(Debug, Clone, Default)]
pub struct BranchTargets {
    targets: Vec<u64>,
}

impl BranchTargets {
    /// Sweeps `text`, which is mapped (or linked) at `text_addr`. Runs in
    /// time linear in `text.len()`; reuse the result for every site of the segment.
    pub fn scan(text: &[u8], text_addr: u64) -> BranchTargets {
        let mut decoder = Decoder::with_ip(64, text, text_addr, DecoderOptions::NONE);
        let mut instr = Instruction::default();
        let mut targets = Vec::new();
        // Each iteration consumes at least one byte, so this ends after at most text.len() rounds.
        while decoder.can_decode() {
            let start = decoder.position();
            decoder.decode_out(&mut instr);
            if instr.is_invalid() {
                // Resume at the next byte (position and ip both: the decoder
                // advanced them by the invalid instruction's length).
                if decoder.set_position(start + 1).is_err() {
                    break;
                }
                decoder.set_ip(text_addr.wrapping_add(start as u64 + 1));
                continue;
            }
            if let Some(target) = direct_target(&instr) {
                targets.push(target);
            }
        }
        targets.sort_unstable();
        targets.dedup();
        BranchTargets { targets }
    }

    /// Adds every aligned 8-byte word of `data` (mapped at `data_addr`) whose
    /// value lies in `code`: addresses stored in data, such as computed-goto
    /// tables (CPython's `opcode_targets`), absolute jump tables and function
    /// pointers. Conservative: any word that merely looks like a code address
    /// counts. Scan the data as mapped at run time (after relocation) and the
    /// code at its run-time address, so PIE objects' pointers are seen too.
    pub fn add_code_pointers(&mut self, data: &[u8], data_addr: u64, code: std::ops::Range<u64>) {
        // Skip to the first 8-aligned address; chunks then stay aligned.
        let skip = ((8 - data_addr % 8) % 8) as usize;
        let words = data.get(skip..).unwrap_or_default().chunks_exact(8);
        let before = self.targets.len();
        for word in words {
            let mut b = [0u8; 8];
            b.copy_from_slice(word);
            let v = u64::from_le_bytes(b);
            if code.contains(&v) {
                self.targets.push(v);
            }
        }
        if self.targets.len() != before {
            self.targets.sort_unstable();
            self.targets.dedup();
        }
    }

    /// Builds from a known list (tests, or targets gathered elsewhere).
    pub fn from_targets(mut targets: Vec<u64>) -> BranchTargets {
        targets.sort_unstable();
        targets.dedup();
        BranchTargets { targets }
    }

    /// The lowest target `t` with `lo < t < hi`, if any.
    pub fn strictly_inside(&self, lo: u64, hi: u64) -> Option<u64> {
        let first = self.targets.partition_point(|&t| t <= lo);
        self.targets.get(first).copied().filter(|&t| t < hi)
    }

    /// Number of distinct targets.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }
}

/// The target of a direct near branch, call or `xbegin`, if `instr` is one.
pub(crate) fn direct_target(instr: &Instruction) -> Option<u64> {
    let branchy = matches!(
        instr.flow_control(),
        FlowControl::UnconditionalBranch
            | FlowControl::ConditionalBranch
            | FlowControl::Call
            | FlowControl::XbeginXabortXend
    );
    let near = matches!(
        instr.op0_kind(),
        OpKind::NearBranch64 | OpKind::NearBranch32 | OpKind::NearBranch16
    );
    (branchy && near).then(|| instr.near_branch_target())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_targets_and_skips_garbage() {
        // jmp +2 ; (bad 0x06 in 64-bit) ; jz -4 ; call +0 ; ret
        let code = [0xeb, 0x02, 0x06, 0x74, 0xfc, 0xe8, 0, 0, 0, 0, 0xc3];
        let t = BranchTargets::scan(&code, 0x1000);
        assert_eq!(t.targets, vec![0x1001, 0x1004, 0x100a]);
        assert_eq!(t.strictly_inside(0x1000, 0x1004), Some(0x1001));
        assert_eq!(t.strictly_inside(0x1001, 0x1004), None);
        assert_eq!(t.strictly_inside(0x1004, 0x1005), None);
        assert_eq!(t.strictly_inside(u64::MAX, 0), None);
        assert!(BranchTargets::scan(&[], 0).is_empty());
        // Truncated instruction at the end does not loop forever.
        let t = BranchTargets::scan(&[0x0f], u64::MAX);
        assert!(t.is_empty());
    }

    #[test]
    fn code_pointers_in_data() {
        let mut t = BranchTargets::from_targets(vec![0x1004]);
        let mut data = vec![0xffu8; 4];
        for v in [0x1001u64, 0x0fff, 0x2000, 0x1004, 0x1fff] {
            data.extend_from_slice(&v.to_le_bytes());
        }
        data.extend_from_slice(&[1, 2, 3]);
        // data_addr 0x3004: the first aligned word starts 4 bytes in.
        t.add_code_pointers(&data, 0x3004, 0x1000..0x2000);
        assert_eq!(t.targets, vec![0x1001, 0x1004, 0x1fff]);
        t.add_code_pointers(&[], 0, 0..u64::MAX);
        t.add_code_pointers(&data, 0x3000, 0x1000..0x2000);
        assert_eq!(t.len(), 3);
    }
}
