//! One record of the ring, decoded from a private copy of its slot: the probe, its
//! arguments and the prefixes of its string arguments, never trusting the slot's
//! counts or masks.

use std::ops::Deref;

use crate::ring::format::*;

/// What a record's fixed words say: all of a record with no string and no stack
/// (as [`RingReader::drain_fixed`](super::RingReader::drain_fixed) reads it in
/// place), and the start of every [`RingRecord`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedRecord {
    /// Ring index of the slot (0, 1, 2, ... in reservation order).
    pub index: u64,
    pub tsc: u64,
    pub probe: u32,
    pub tag: u32,
    /// The thread's `%fs` base; map it to a tid on the engine side.
    pub thread: u64,
    /// Number of meaningful entries in `args` (clamped to [`MAX_ARGS`]); the rest are 0.
    pub nargs: usize,
    pub args: [u64; MAX_ARGS],
}

impl FixedRecord {
    /// The record at `index` whose slot's words `word` reads (8-aligned
    /// offsets), its time and its flags word (at [`S_NARGS`]) read already;
    /// trusts no count.
    #[inline]
    pub(super) fn from_words(
        index: u64,
        tsc: u64,
        flags: u64,
        word: impl Fn(usize) -> u64,
    ) -> FixedRecord {
        let nargs = ((flags & 0xff) as usize).min(MAX_ARGS);
        let mut args = [0u64; MAX_ARGS];
        for (i, a) in args.iter_mut().enumerate().take(nargs) {
            *a = word(S_ARGS + 8 * i);
        }
        let probe_word = word(S_PROBE);
        FixedRecord {
            index,
            tsc,
            probe: probe_word as u32,
            tag: (probe_word >> 32) as u32,
            thread: word(S_THREAD),
            nargs,
            args,
        }
    }
}

/// A decoded record: its fixed words (through `Deref`: `record.tsc`,
/// `record.args`), its stack and its strings. Strings borrow from a private copy
/// of the slot, so the callback may keep nothing past its return; copy what you
/// need.
#[derive(Clone)]
pub struct RingRecord<'a> {
    fixed: FixedRecord,
    /// The Python stack the trampoline captured, for a stack probe's record.
    pub stack: Option<RingStack>,
    /// The copy of the slot the strings are read from.
    slot: &'a [u8; SLOT_SIZE],
    /// Where each string argument's prefix lies in `slot`.
    spans: [Option<StringSpan>; MAX_ARGS],
}

/// A string prefix in a copied slot: `start..start + len`, NUL excluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StringSpan {
    pub(super) start: u8,
    pub(super) len: u8,
    /// No NUL in its area: the area is kept and the string said cut.
    pub(super) unterminated: bool,
}

impl<'a> RingRecord<'a> {
    /// A record of `slot` (a private copy) whose strings lie at `spans`, bounded
    /// by their areas.
    pub(super) fn new(
        index: u64,
        slot: &'a [u8; SLOT_SIZE],
        spans: [Option<StringSpan>; MAX_ARGS],
        stack: Option<RingStack>,
    ) -> RingRecord<'a> {
        let word = |o: usize| u64::from_le_bytes(slot[o..o + 8].try_into().unwrap_or([0; 8]));
        RingRecord {
            fixed: FixedRecord::from_words(index, word(S_TSC), word(S_NARGS), word),
            stack,
            slot,
            spans,
        }
    }

    /// The prefix of argument `i` if it was captured as a C string.
    pub fn string(&self, i: usize) -> Option<RingString<'a>> {
        let span = (*self.spans.get(i)?)?;
        let start = usize::from(span.start);
        let bit = 1u8 << i;
        Some(RingString {
            bytes: self.slot.get(start..start + usize::from(span.len))?,
            truncated: span.unterminated || self.slot[S_TRUNCATED] & bit != 0,
            null: self.slot[S_NULL] & bit != 0,
        })
    }

    /// Word `offset` of the copied slot (an 8-aligned offset below `SLOT_SIZE`;
    /// string words past a string's NUL were not copied and hold anything).
    pub(super) fn slot_word(&self, offset: usize) -> u64 {
        let bytes = self.slot.get(offset..offset + 8).unwrap_or(&[0; 8]);
        u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]))
    }

    /// Where string `i` lies in the slot, `(start, len)` before its NUL, if it
    /// ended inside its area.
    pub(super) fn string_span(&self, i: usize) -> Option<(usize, usize)> {
        let span = (*self.spans.get(i)?)?;
        (!span.unterminated).then_some((usize::from(span.start), usize::from(span.len)))
    }

    /// Every argument's string prefix, as [`string`](Self::string) gives it.
    pub(crate) fn strings(&self) -> [Option<RingString<'a>>; MAX_ARGS] {
        std::array::from_fn(|i| self.string(i))
    }
}

impl Deref for RingRecord<'_> {
    type Target = FixedRecord;

    fn deref(&self) -> &FixedRecord {
        &self.fixed
    }
}

impl PartialEq for RingRecord<'_> {
    /// Equal when everything read through the record is: the bytes of the slot
    /// no string covers do not count.
    fn eq(&self, other: &Self) -> bool {
        self.fixed == other.fixed && self.stack == other.stack && self.strings() == other.strings()
    }
}

impl Eq for RingRecord<'_> {}

impl std::fmt::Debug for RingRecord<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingRecord")
            .field("index", &self.index)
            .field("tsc", &self.tsc)
            .field("probe", &self.probe)
            .field("tag", &self.tag)
            .field("thread", &format_args!("{:#x}", self.thread))
            .field("args", &&self.args[..self.nargs])
            .field("strings", &self.strings())
            .field("stack", &self.stack)
            .finish()
    }
}

/// A stack captured in the target (see [`super::stack`]), innermost frame first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingStack {
    /// The thread's thread state was found (else no frames).
    pub found: bool,
    /// Frames were left out: more than fit the record, or the walk hit its bound.
    pub truncated: bool,
    /// The walk stopped at a link to memory that could not hold a frame (the
    /// program's own corruption, which the interpreter had not followed yet).
    pub(crate) unreadable: bool,
    /// Frames counted by the walk (at least `frames.len()`).
    pub(crate) depth: usize,
    /// (code pointer, position) pairs, innermost first; at most [`MAX_STACK_FRAMES`].
    pub frames: Vec<(u64, u64)>,
    /// The record claimed a stack but its continuation slots did not check out
    /// (a torn or hostile ring): `frames` is empty.
    pub(crate) broken: bool,
}

/// The captured prefix of a C-string argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingString<'a> {
    /// Bytes before the terminating NUL (never includes it).
    pub bytes: &'a [u8],
    /// The string continues past `bytes`: read the rest from the pointer in `args[i]`.
    pub truncated: bool,
    /// The pointer was NULL (`bytes` is empty).
    pub(crate) null: bool,
}

#[cfg(test)]
/// Decodes one copied slot, all of it at hand; never trusts its counts or masks.
/// (The reader measures the strings while it copies them; this is the reference
/// its records are tested against.)
pub fn decode(index: u64, slot: &[u8; SLOT_SIZE]) -> RingRecord<'_> {
    let mut spans = [None; MAX_ARGS];
    for (i, off, len) in string_areas(slot) {
        // A well-formed area always has a NUL; a missing one means a
        // hostile or torn slot: keep the area and say the string is cut.
        let (n, unterminated) = match find_nul(&slot[off..off + len]) {
            Some(n) => (n, false),
            None => (len, true),
        };
        spans[i] = Some(StringSpan {
            start: off as u8,
            len: n as u8,
            unterminated,
        });
    }
    RingRecord::new(index, slot, spans, None)
}

/// The string arguments of the slot whose fixed part `slot` holds, as (argument,
/// area start, area length), in argument order; never trusts its counts or masks
/// (an argument past `nargs` is no string). Only the fixed part is read.
pub(super) fn string_areas(slot: &[u8; SLOT_SIZE]) -> impl Iterator<Item = (usize, usize, usize)> {
    let nargs = usize::from(slot[S_NARGS]).min(MAX_ARGS);
    let mask = slot[S_STRING_MASK] & ((1u8 << nargs) - 1);
    let count = mask.count_ones() as usize;
    (0..MAX_ARGS)
        .filter(move |&i| mask & (1 << i) != 0)
        .zip(0..)
        .filter_map(move |(i, k)| string_area(k, count).map(|(start, len)| (i, start, len)))
}

#[cfg(test)]
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
