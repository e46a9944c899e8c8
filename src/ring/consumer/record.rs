//! One record of the ring, decoded from a private copy of its slot: the probe, its
//! arguments and the prefixes of its string arguments, never trusting the slot's
//! counts or masks.

use crate::ring::format::*;

/// A decoded record. Strings borrow from a private copy of the slot, so the
/// callback may keep nothing past its return; copy what you need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingRecord<'a> {
    /// Ring index of the slot (0, 1, 2, ... in reservation order).
    pub index: u64,
    pub tsc: u64,
    pub probe: u32,
    pub tag: u32,
    /// The thread's `%fs` base; map it to a tid on the engine side.
    pub thread: u64,
    /// Number of meaningful entries in `args` (clamped to [`MAX_ARGS`]).
    pub nargs: usize,
    pub args: [u64; MAX_ARGS],
    /// `strings[i]` is `Some` if argument `i` was captured as a C string.
    pub strings: [Option<RingString<'a>>; MAX_ARGS],
    /// The Python stack the trampoline captured, for a stack probe's record.
    pub stack: Option<RingStack>,
}

/// A stack captured in the target (see [`super::stack`]), innermost frame first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingStack {
    /// The thread's thread state was found (else no frames).
    pub found: bool,
    /// Frames were left out: more than fit the record, or the walk hit its bound.
    pub truncated: bool,
    /// Frames counted by the walk (at least `frames.len()`).
    pub depth: usize,
    /// (code pointer, position) pairs, innermost first; at most [`MAX_STACK_FRAMES`].
    pub frames: Vec<(u64, u64)>,
    /// The record claimed a stack but its continuation slots did not check out
    /// (a torn or hostile ring): `frames` is empty.
    pub broken: bool,
}

/// The captured prefix of a C-string argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingString<'a> {
    /// Bytes before the terminating NUL (never includes it).
    pub bytes: &'a [u8],
    /// The string continues past `bytes`: read the rest from the pointer in `args[i]`.
    pub truncated: bool,
    /// The pointer was NULL (`bytes` is empty).
    pub null: bool,
}

/// Decodes one copied slot; never trusts its counts or masks.
pub fn decode(index: u64, slot: &[u8; SLOT_SIZE]) -> RingRecord<'_> {
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&slot[o..o + 8]);
        u64::from_le_bytes(b)
    };
    let u32_at = |o: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&slot[o..o + 4]);
        u32::from_le_bytes(b)
    };
    let nargs = usize::from(slot[S_NARGS]).min(MAX_ARGS);
    let mut args = [0u64; MAX_ARGS];
    for (i, a) in args.iter_mut().enumerate().take(nargs) {
        *a = u64_at(S_ARGS + 8 * i);
    }
    let valid = (1u8 << nargs) - 1;
    let string_mask = slot[S_STRING_MASK] & valid;
    let count = string_mask.count_ones() as usize;
    let mut strings: [Option<RingString<'_>>; MAX_ARGS] = [None; MAX_ARGS];
    let mut k = 0;
    for (i, s) in strings.iter_mut().enumerate() {
        if string_mask & (1 << i) == 0 {
            continue;
        }
        let Some((off, len)) = string_area(k, count) else {
            break;
        };
        k += 1;
        let area = &slot[off..off + len];
        // A well-formed area always has a NUL; a missing one means a
        // hostile or torn slot: keep the area and say the string is cut.
        let (bytes, cut) = match find_nul(area) {
            Some(n) => (&area[..n], false),
            None => (area, true),
        };
        *s = Some(RingString {
            bytes,
            truncated: cut || slot[S_TRUNCATED] & (1 << i) != 0,
            null: slot[S_NULL] & (1 << i) != 0,
        });
    }
    RingRecord {
        index,
        tsc: u64_at(S_TSC),
        probe: u32_at(S_PROBE),
        tag: u32_at(S_TAG),
        thread: u64_at(S_THREAD),
        nargs,
        args,
        strings,
        stack: None,
    }
}

/// The index of the first NUL in `bytes`, eight bytes at a time (this runs for
/// every string of every event).
pub(super) fn find_nul(bytes: &[u8]) -> Option<usize> {
    const LOW: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut chunks = bytes.chunks_exact(8);
    let mut base = 0;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        // Nonzero exactly when some byte of `w` is zero.
        if w.wrapping_sub(LOW) & !w & HIGH != 0 {
            return chunk.iter().position(|&b| b == 0).map(|i| base + i);
        }
        base += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&b| b == 0)
        .map(|i| base + i)
}
