//! Reading the ring from pyprobe's side of the shared mapping.
//!
//! The target writes the same memory concurrently and may be hostile: every
//! access is an atomic load of an aligned word, each slot is copied out before
//! it is decoded, and no value read from the mapping is trusted (counts are
//! clamped, indices compared, lengths bounded).
//!
//! This module holds the reader, its opening and its raw access to the mapping;
//! the header words it reads and writes are in `control`, draining in `drain`,
//! and copying a slot out in `copying`.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use super::format::*;
// The tests write stack records by hand, through `use super::*`.
#[cfg(test)]
use super::stack::*;

mod control;
mod copying;
mod drain;
mod held;
mod known;
mod record;
mod units;

pub use known::{KnownRecords, Token, KEY_ARGS};
#[cfg(test)]
use record::decode;
use record::StringSpan;
pub use record::{FixedRecord, RingRecord, RingStack, RingString};

/// Why [`RingReader::drain`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainStop {
    /// Every reserved slot was read.
    Empty,
    /// Slot `index` is reserved but not yet published: retry later, or
    /// [`RingReader::skip_pending`] after a timeout of the caller's choosing.
    Pending { index: u64 },
    /// `max` records were read; more may be waiting.
    Limit,
    /// The next record was stamped after the bound set with
    /// [`RingReader::set_tsc_bound`]: left for a later drain.
    Later,
}

/// A record as [`RingReader::drain_known`] hands it on.
pub enum Drawn<'a> {
    /// Equal to a record kept with this token.
    Known(KnownRecord),
    /// Not known: the whole record, copied out.
    Record(&'a RingRecord<'a>),
}

/// A record as [`RingReader::drain_fixed`] hands it on.
#[derive(Debug)]
pub enum Plain<'r, 'a> {
    /// No string and no stack: its fixed words, read in place.
    Fixed(&'r FixedRecord),
    /// Any other: copied out and decoded as [`RingReader::drain`] does.
    Copied(&'r RingRecord<'a>),
}

/// What of a known record differs from the one kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownRecord {
    pub index: u64,
    pub tsc: u64,
    pub tag: u32,
    /// The thread's `%fs` base.
    pub thread: u64,
    pub token: u32,
}

/// Result of one [`RingReader::drain`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    pub records: usize,
    pub stop: DrainStop,
}

/// The consumer end of a ring.
///
/// It keeps its own copy of `tail` (it is the only writer) and publishes it
/// after each slot, so producers can reuse the slot.
#[derive(Debug)]
pub struct RingReader {
    base: *const u8,
    capacity: u64,
    /// What its slots hold (the header says).
    slots: Slots,
    tail: u64,
    skipped: u64,
    /// The records of the current drain, copied out of the ring (kept between
    /// drains so that a drain allocates nothing).
    copies: Vec<Copied>,
    /// Records stamped after this are left in the ring (see `set_tsc_bound`).
    tsc_bound: u64,
}

/// One record copied out of the ring, with its stack's continuation slots read.
///
/// Only what the record uses is copied: its fixed part and each string's prefix
/// up to its NUL (found while copying, so nothing scans it again). The rest of
/// `slot` holds whatever an earlier record left there and is never read.
#[derive(Debug)]
struct Copied {
    index: u64,
    slot: [u8; SLOT_SIZE],
    /// Where each string argument's prefix lies in `slot`.
    strings: [Option<StringSpan>; MAX_ARGS],
    stack: Option<RingStack>,
}

impl Default for Copied {
    fn default() -> Copied {
        Copied {
            index: 0,
            slot: [0; SLOT_SIZE],
            strings: [None; MAX_ARGS],
            stack: None,
        }
    }
}

impl Copied {
    /// The record (the spans were bounded by their areas when copied).
    fn record(&mut self) -> RingRecord<'_> {
        RingRecord::new(self.index, &self.slot, self.strings, self.stack.take())
    }
}

// SAFETY: the reader only performs atomic loads/stores on the mapping, which
// the caller guarantees outlives it (see `new`); moving it across threads is fine.
unsafe impl Send for RingReader {}

impl RingReader {
    /// Opens the ring mapped at `ptr` for `len` bytes, validating its header.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be a readable and writable mapping (e.g. the
    /// consumer's `MAP_SHARED` view of the memfd) that stays mapped for the
    /// reader's lifetime. Its contents may change at any time; the reader
    /// never trusts them.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Result<RingReader, RingError> {
        if len < HEADER_SIZE {
            return Err(RingError::TooSmall(len));
        }
        if ptr.is_null() || (ptr as usize) % 8 != 0 {
            return Err(RingError::Misaligned);
        }
        let mut reader = RingReader {
            base: ptr,
            capacity: 0,
            slots: Slots::Records,
            tail: 0,
            skipped: 0,
            copies: Vec::new(),
            tsc_bound: u64::MAX,
        };
        let magic = reader.load(H_MAGIC);
        if magic != MAGIC {
            return Err(RingError::BadMagic(magic));
        }
        let word = reader.load(H_VERSION);
        let (version, slot_size) = (word as u32, (word >> 32) as u32);
        if version != VERSION {
            return Err(RingError::BadVersion(version));
        }
        let Some(slots) = Slots::from_size(slot_size) else {
            return Err(RingError::BadSlotSize(slot_size));
        };
        let header_size = reader.load(H_HEADER_SIZE) as u32;
        if header_size as usize != HEADER_SIZE {
            return Err(RingError::BadHeaderSize(header_size));
        }
        let capacity = reader.load(H_CAPACITY);
        let expected = ring_bytes(capacity, slots)?;
        if expected != len {
            return Err(RingError::LengthMismatch {
                capacity,
                expected,
                actual: len,
            });
        }
        reader.capacity = capacity;
        reader.slots = slots;
        reader.tail = reader.load(H_TAIL);
        Ok(reader)
    }

    fn load(&self, offset: usize) -> u64 {
        self.word(offset).load(Ordering::Acquire)
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0);
        // SAFETY: callers pass 8-aligned offsets inside the mapping: header
        // fields (< HEADER_SIZE, checked in `new`) or slot words
        // (< HEADER_SIZE + capacity * slot size == len, checked in `new`);
        // `base` is 8-aligned and the mapping outlives `self` (contract of `new`).
        unsafe { AtomicU64::from_ptr(self.base.add(offset) as *mut u64) }
    }

    fn thin_byte(&self, probe: u32) -> Option<&AtomicU8> {
        if probe >= THIN_PROBES {
            return None;
        }
        // SAFETY: H_THIN + probe < H_COUNTED < HEADER_SIZE, inside the mapping
        // (checked in `new`), which outlives `self`; bytes need no alignment.
        Some(unsafe { AtomicU8::from_ptr(self.base.add(H_THIN + probe as usize) as *mut u8) })
    }
}

/// The time-stamp counter, the clock of the ring's heartbeat and records.
fn tsc_now() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86-64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(test)]
mod tests;
