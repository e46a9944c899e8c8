//! Copying one slot out of the mapping: where it lies, asking for its lines
//! ahead, and copying only what the record uses (its fixed part and each
//! string's prefix up to its NUL), each copy checked still published after.

use std::sync::atomic::Ordering;

use super::record::{string_areas, StringSpan};
use super::{Copied, RingReader};
use crate::ring::format::*;

impl RingReader {
    /// Byte offset of the slot for `index` in the mapping.
    pub(super) fn slot_offset(&self, index: u64) -> usize {
        HEADER_SIZE + (((index & (self.capacity - 1)) as usize) << self.slots.shift())
    }

    /// Asks for the first three cache lines of the slot for `index` (its fixed part
    /// and usual strings) ahead of their copy: the copy of a slot waits on its
    /// first load, and the slots after it are not loaded until it is done.
    #[inline]
    pub(super) fn prefetch(&self, index: u64) {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let slot = self.slot_offset(index);
        for line in [0, 64, 128] {
            // SAFETY: `slot + line` lies inside the slot, inside the mapping
            // (contract of `new`); a prefetch reads nothing into the program and
            // cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.base.add(slot + line).cast::<i8>()) };
        }
    }

    /// Whether the slot for `index` holds the record of that index.
    pub(super) fn published(&self, index: u64) -> bool {
        let slot = self.slot_offset(index);
        self.word(slot + S_SEQ).load(Ordering::Acquire) == index.wrapping_add(1)
    }

    /// Copies the record at `index` into `copy` if it is published; says whether
    /// it did (else `copy` holds nothing of use).
    ///
    /// The fixed part, then each string's prefix word by word up to its NUL: a
    /// record reads the cache lines its producer wrote and no others, and its
    /// strings are measured on the way.
    pub(super) fn copy_record(&self, index: u64, copy: &mut Copied) -> bool {
        let slot = self.slot_offset(index);
        let want = index.wrapping_add(1);
        if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
            return false;
        }
        self.copy_words(slot, &mut copy.slot, 0..S_STRINGS / 8);
        copy.index = index;
        copy.strings = [None; MAX_ARGS];
        for (i, start, len) in string_areas(&copy.slot) {
            copy.strings[i] = Some(self.copy_string(slot, &mut copy.slot, start, len));
        }
        // A changed seq means the slot was rewritten while copying (only after
        // a skip): treat it as not published rather than return a torn record.
        self.word(slot + S_SEQ).load(Ordering::Acquire) == want
    }

    /// Copies the words of the string area `start..start + len` of the slot at
    /// byte offset `slot` up to the one holding the string's NUL.
    fn copy_string(
        &self,
        slot: usize,
        copy: &mut [u8; SLOT_SIZE],
        start: usize,
        len: usize,
    ) -> StringSpan {
        const LOW: u64 = 0x0101_0101_0101_0101;
        const HIGH: u64 = 0x8080_8080_8080_8080;
        let end = start + len;
        let mut at = start & !7;
        // The bytes of the first word before the area, made non-zero.
        let mut before = (1u64 << (8 * (start - at))) - 1;
        while at < end {
            let v = self.word(slot + at).load(Ordering::Relaxed);
            copy[at..at + 8].copy_from_slice(&v.to_le_bytes());
            let seen = v | before;
            before = 0;
            // The lowest flagged byte of the zero-byte test is the first NUL from
            // `start` on; one past the area's end means the area has none.
            let zeros = seen.wrapping_sub(LOW) & !seen & HIGH;
            if zeros != 0 {
                let nul = at + (zeros.trailing_zeros() / 8) as usize;
                if nul >= end {
                    break;
                }
                return StringSpan {
                    start: start as u8,
                    len: (nul - start) as u8,
                    unterminated: false,
                };
            }
            at += 8;
        }
        StringSpan {
            start: start as u8,
            len: len as u8,
            unterminated: true,
        }
    }

    /// Copies the whole slot for `index` (a stack's continuation slot) into `copy`
    /// if its `seq` is `want`; says whether it did.
    pub(super) fn copy_whole(&self, index: u64, want: u64, copy: &mut [u8; SLOT_SIZE]) -> bool {
        let slot = self.slot_offset(index);
        if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
            return false;
        }
        self.copy_words(slot, copy, 0..SLOT_SIZE / 8);
        self.word(slot + S_SEQ).load(Ordering::Acquire) == want
    }

    /// Copies words `words` of the slot at byte offset `slot` into `copy`.
    fn copy_words(&self, slot: usize, copy: &mut [u8; SLOT_SIZE], words: std::ops::Range<usize>) {
        for i in words {
            let v = self.word(slot + i * 8).load(Ordering::Relaxed);
            copy[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
    }
}
