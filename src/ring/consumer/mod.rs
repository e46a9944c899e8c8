//! Reading the ring from pyprobe's side of the shared mapping.
//!
//! The target writes the same memory concurrently and may be hostile: every
//! access is an atomic load of an aligned word, each slot is copied out before
//! it is decoded, and no value read from the mapping is trusted (counts are
//! clamped, indices compared, lengths bounded).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use super::format::*;
use super::stack::*;

mod record;

pub use record::{decode, RingRecord, RingStack, RingString};

/// How much of a slot to copy out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// A record: its fixed part and its strings as far as they go.
    Record,
    /// A stack's continuation slot: all of it.
    Whole,
}

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
    tail: u64,
    skipped: u64,
    /// The records of the current drain, copied out of the ring (kept between
    /// drains so that a drain allocates nothing).
    copies: Vec<Copied>,
    /// Records stamped after this are left in the ring (see `set_tsc_bound`).
    tsc_bound: u64,
}

/// One record copied out of the ring, with its stack's continuation slots read.
#[derive(Debug)]
struct Copied {
    index: u64,
    slot: [u8; SLOT_SIZE],
    stack: Option<RingStack>,
}

impl Default for Copied {
    fn default() -> Copied {
        Copied {
            index: 0,
            slot: [0; SLOT_SIZE],
            stack: None,
        }
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
        if slot_size as usize != SLOT_SIZE {
            return Err(RingError::BadSlotSize(slot_size));
        }
        let header_size = reader.load(H_HEADER_SIZE) as u32;
        if header_size as usize != HEADER_SIZE {
            return Err(RingError::BadHeaderSize(header_size));
        }
        let capacity = reader.load(H_CAPACITY);
        let expected = ring_bytes(capacity)?;
        if expected != len {
            return Err(RingError::LengthMismatch {
                capacity,
                expected,
                actual: len,
            });
        }
        reader.capacity = capacity;
        reader.tail = reader.load(H_TAIL);
        Ok(reader)
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Index of the next slot to read.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Index of the next slot producers will reserve (as the target wrote it).
    pub fn head(&self) -> u64 {
        self.load(H_HEAD)
    }

    /// Events the producers dropped, plus slots this reader skipped.
    pub fn lost(&self) -> u64 {
        self.load(H_LOST)
    }

    /// TSC cycles the target's stack records spent waiting for room, since the
    /// ring was made.
    pub fn waited_cycles(&self) -> u64 {
        self.load(H_WAITED)
    }

    /// Says a consumer reads this ring from now on: a producer that finds it full
    /// waits for room instead of dropping its event, as long as [`heartbeat`]
    /// (Self::heartbeat) was called less than `stale_cycles` TSC cycles ago, for
    /// at most `patience_cycles` (`u64::MAX`: as long as it takes).
    pub fn serve(&self, stale_cycles: u64, patience_cycles: u64) {
        let stale = stale_cycles.min(i64::MAX as u64);
        self.word(H_STALE).store(stale, Ordering::Relaxed);
        self.word(H_PATIENCE)
            .store(patience_cycles, Ordering::Relaxed);
        self.heartbeat();
        self.word(H_ALIVE).store(1, Ordering::Release);
    }

    /// Says the consumer is alive and looking (producers waiting on a full ring
    /// go on waiting). [`drain`](Self::drain) calls it.
    pub fn heartbeat(&self) {
        self.word(H_HEARTBEAT).store(tsc_now(), Ordering::Release);
    }

    /// Says every record drained so far is done with, what it points at read too
    /// (a producer about to free that memory waits for it: the hook's exit callback).
    pub fn mark_finished(&self) {
        self.word(H_FINISHED).store(self.tail, Ordering::Release);
    }

    /// Says no consumer reads this ring any more: producers stop waiting (the
    /// ones asleep are woken) and drop what does not fit.
    pub fn leave(&self) {
        self.word(H_ALIVE).store(0, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
        self.wake_sleepers();
    }

    /// Whether a consumer serves the ring (see [`serve`](Self::serve)).
    pub fn served(&self) -> bool {
        self.load(H_ALIVE) != 0
    }

    /// Producers asleep waiting for room right now.
    pub fn sleepers(&self) -> u32 {
        self.load(H_SLEEPERS) as u32
    }

    /// Tells stack probe `probe` how to record ([`THIN_OFF`], [`THIN_STACKLESS`],
    /// [`THIN_COUNT`]): thinning costs the target and pyprobe a fraction of a
    /// stack record. Probes from [`THIN_PROBES`] on are never thinned.
    pub fn set_thin(&self, probe: u32, mode: u8) {
        if let Some(byte) = self.thin_byte(probe) {
            byte.store(mode, Ordering::Relaxed);
        }
    }

    /// How stack probe `probe` records now.
    pub fn thin(&self, probe: u32) -> u8 {
        self.thin_byte(probe)
            .map_or(THIN_OFF, |b| b.load(Ordering::Relaxed))
    }

    /// Events of `probe` counted instead of recorded, since the ring was made.
    pub fn counted(&self, probe: u32) -> u64 {
        if probe < THIN_PROBES {
            self.load(H_COUNTED + 8 * probe as usize)
        } else {
            0
        }
    }

    /// Slots skipped by [`skip_pending`](Self::skip_pending) (also counted in [`lost`](Self::lost)).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Reads up to `max` published records in order, calling `f` for each.
    ///
    /// The records are copied out of the ring first, all of them, and `tail` is
    /// published once before any is decoded: producers get their slots back
    /// without waiting for pyprobe's work on them (and a store per record would
    /// pull the line producers read back and forth between the CPUs). Stops at the
    /// first slot that is reserved but not published.
    /// Drains stop before a record stamped after `tsc` (`u64::MAX`: no bound): a
    /// consumer merging two rings reads one only as far as the other has been read.
    pub fn set_tsc_bound(&mut self, tsc: u64) {
        self.tsc_bound = tsc;
    }

    pub fn drain<F: FnMut(&RingRecord<'_>)>(&mut self, max: usize, mut f: F) -> Drained {
        self.heartbeat();
        let head = self.head();
        // Bounded by `max` and by `capacity` (a hostile head cannot make it longer).
        let budget = max.min(usize::try_from(self.capacity).unwrap_or(usize::MAX));
        let mut copies = std::mem::take(&mut self.copies);
        let mut records = 0;
        let mut stop = None;
        while records < budget {
            if self.tail >= head {
                stop = Some(DrainStop::Empty);
                break;
            }
            if records == copies.len() {
                copies.push(Copied::default());
            }
            let copy = &mut copies[records];
            // Copied out before `tail` moves past it: a producer may reuse the slot then.
            if !self.copy_with_seq(
                self.tail,
                self.tail.wrapping_add(1),
                &mut copy.slot,
                Part::Record,
            ) {
                stop = Some(DrainStop::Pending { index: self.tail });
                break;
            }
            if self.tsc_bound != u64::MAX {
                let stamp = &copy.slot[S_TSC..S_TSC + 8];
                if u64::from_le_bytes(stamp.try_into().unwrap_or([0; 8])) > self.tsc_bound {
                    stop = Some(DrainStop::Later);
                    break;
                }
            }
            copy.index = self.tail;
            let (stack, used) = self.stack_of(&copy.slot, head);
            copy.stack = stack;
            self.tail = self.tail.wrapping_add(1 + used);
            records += 1;
        }
        if records > 0 {
            self.publish_tail();
        }
        for copy in &mut copies[..records] {
            let mut record = decode(copy.index, &copy.slot);
            record.stack = copy.stack.take();
            f(&record);
        }
        self.copies = copies;
        Drained {
            records,
            stop: stop.unwrap_or(if self.tail >= head {
                DrainStop::Empty
            } else {
                DrainStop::Limit
            }),
        }
    }

    /// Reads the continuation slots of the record at `tail` (its first slot is
    /// `first`): its stack, and how many slots they take. A claim that does not fit
    /// what producers reserved takes none (the stack is said broken).
    fn stack_of(&self, first: &[u8; SLOT_SIZE], head: u64) -> (Option<RingStack>, u64) {
        let slots = first[S_STACK_SLOTS];
        let flags = first[S_STACK_FLAGS];
        if slots == 0 || flags & STACK_CAPTURED == 0 {
            return (None, 0);
        }
        let n = u64::from(slots);
        let mut stack = RingStack {
            found: flags & STACK_FOUND != 0,
            truncated: flags & STACK_TRUNCATED != 0,
            depth: usize::from(u16::from_le_bytes([
                first[S_STACK_DEPTH],
                first[S_STACK_DEPTH + 1],
            ])),
            frames: Vec::new(),
            broken: false,
        };
        if slots > MAX_STACK_SLOTS || n >= self.capacity || head.wrapping_sub(self.tail) <= n {
            stack.broken = true;
            return (Some(stack), 0);
        }
        let want = stack.depth.min(frames_for(slots));
        stack.truncated |= stack.depth > want;
        let mut copy = [0u8; SLOT_SIZE];
        for k in 1..=n {
            let index = self.tail.wrapping_add(k);
            let owner_ok =
                self.copy_with_seq(index, continuation_seq(index), &mut copy, Part::Whole)
                    && u64::from_le_bytes(copy[C_OWNER..C_OWNER + 8].try_into().unwrap_or([0; 8]))
                        == self.tail;
            if !owner_ok {
                stack.broken = true;
                continue;
            }
            for pair in copy[C_PAIRS..].chunks_exact(16).take(PAIRS_PER_SLOT) {
                if stack.frames.len() >= want {
                    break;
                }
                let word =
                    |o: usize| u64::from_le_bytes(pair[o..o + 8].try_into().unwrap_or([0; 8]));
                stack.frames.push((word(0), word(8)));
            }
        }
        if stack.broken {
            stack.frames.clear();
        }
        (Some(stack), n)
    }

    /// Gives up on the slot at `tail` if it is reserved but unpublished,
    /// counting it in `lost`. Returns whether a slot was skipped.
    ///
    /// Use only after a timeout: a producer that was merely slow will still
    /// write that slot later, possibly over a record of the next lap, which
    /// then decodes as a mix (or stays unpublished and is skipped in turn).
    pub fn skip_pending(&mut self) -> bool {
        let mut copy = [0u8; SLOT_SIZE];
        if self.tail >= self.head()
            || self.copy_with_seq(
                self.tail,
                self.tail.wrapping_add(1),
                &mut copy,
                Part::Record,
            )
        {
            return false;
        }
        self.word(H_LOST).fetch_add(1, Ordering::Relaxed);
        self.skipped += 1;
        self.advance();
        true
    }

    fn advance(&mut self) {
        self.tail = self.tail.wrapping_add(1);
        self.publish_tail();
    }

    fn publish_tail(&self) {
        self.word(H_TAIL).store(self.tail, Ordering::Release);
        // Pairs with the producer's `lock inc sleepers` before its last look:
        // either we see it asleep here, or it sees the tail just stored.
        // Woken once half the ring is free, not at every batch: a producer then
        // writes many records per wake-up (its nap bounds any wait anyway).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleepers() != 0 && self.head().saturating_sub(self.tail) <= self.capacity / 2 {
            self.wake_sleepers();
        }
    }

    /// Wakes every producer asleep on `tail` (a shared futex: the memfd's page is
    /// the key, the same through the target's mapping and ours).
    fn wake_sleepers(&self) {
        let tail = self.word(H_TAIL).as_ptr();
        // SAFETY: FUTEX_WAKE only reads the address's page to form the key; `tail`
        // is an aligned word inside the live mapping (contract of `new`). The call
        // has no other effect on our memory, and its result (woken count) is unused.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                tail,
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Copies the slot for `index` into `copy` if its `seq` is `want`; says whether
    /// it did (else `copy` holds nothing of use).
    fn copy_with_seq(&self, index: u64, want: u64, copy: &mut [u8; SLOT_SIZE], part: Part) -> bool {
        let slot = HEADER_SIZE + ((index & (self.capacity - 1)) as usize) * SLOT_SIZE;
        if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
            return false;
        }
        // The fixed part first; the strings area only when the record has strings
        // (a hook record seldom does: half the slot's cache lines are not pulled
        // from the producer's core). `decode` reads no string its mask lacks. A
        // stack's continuation slot has no mask: all of it.
        let fixed = S_STRINGS / 8;
        self.copy_words(slot, copy, 0..fixed);
        if part == Part::Whole || copy[S_STRING_MASK] != 0 {
            self.copy_words(slot, copy, fixed..SLOT_SIZE / 8);
        }
        // A changed seq means the slot was rewritten while copying (only after
        // a skip): treat it as not published rather than return a torn record.
        self.word(slot + S_SEQ).load(Ordering::Acquire) == want
    }

    /// Copies words `words` of the slot at byte offset `slot` into `copy`.
    fn copy_words(&self, slot: usize, copy: &mut [u8; SLOT_SIZE], words: std::ops::Range<usize>) {
        for i in words {
            let v = self.word(slot + i * 8).load(Ordering::Relaxed);
            copy[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
    }

    fn load(&self, offset: usize) -> u64 {
        self.word(offset).load(Ordering::Acquire)
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0);
        // SAFETY: callers pass 8-aligned offsets inside the mapping: header
        // fields (< HEADER_SIZE, checked in `new`) or slot words
        // (< HEADER_SIZE + capacity * SLOT_SIZE == len, checked in `new`);
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
