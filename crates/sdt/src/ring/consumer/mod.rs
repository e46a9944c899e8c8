//! Reading the ring from pyprobe's side of the shared mapping.
//!
//! The target writes the same memory concurrently and may be hostile: every
//! access is an atomic load of an aligned word, each slot is copied out before
//! it is decoded, and no value read from the mapping is trusted (counts are
//! clamped, indices compared, lengths bounded).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use super::format::*;
use super::stack::*;

mod known;
mod record;

pub use known::{KnownRecords, KEY_ARGS};
pub use record::{decode, RingRecord, RingStack, RingString};
use record::{string_areas, StringSpan};

/// Records copied out of the ring before they are handed on: few enough that
/// their copies stay in the nearest cache until they are read.
const COPY_CHUNK: usize = 32;
/// How many slots ahead of the one being copied the reader asks for its lines.
const PREFETCH_AHEAD: u64 = 8;

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

    /// Says whether the ring has a single producer thread, which then reserves
    /// slots without `lock` (see `solo` in the ring format). `true` only while
    /// that thread is stopped and no other task of its process exists; `false`
    /// before any new task, or its creator, runs again.
    pub fn set_solo(&self, solo: bool) {
        self.word(H_SOLO).store(u64::from(solo), Ordering::Release);
    }

    /// Says the consumer is alive and looking (producers waiting on a full ring
    /// go on waiting). [`drain`](Self::drain) calls it.
    pub fn heartbeat(&self) {
        self.word(H_HEARTBEAT).store(tsc_now(), Ordering::Release);
    }

    /// Where the `heartbeat` word is in the consumer's mapping, for a thread that
    /// beats it (it must stop before the mapping goes).
    pub fn heartbeat_address(&self) -> usize {
        self.word(H_HEARTBEAT) as *const AtomicU64 as usize
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

    /// Drains stop before a record stamped after `tsc` (`u64::MAX`: no bound): a
    /// consumer merging two rings reads one only as far as the other has been read.
    pub fn set_tsc_bound(&mut self, tsc: u64) {
        self.tsc_bound = tsc;
    }

    /// Reads up to `max` published records in order, calling `f` for each.
    ///
    /// Records are copied out [`COPY_CHUNK`] at a time, each checked published
    /// before and after its copy, and handed to `f` from the copies (a record never
    /// reads the ring twice, so a producer rewriting a slot cannot tear it). `tail`
    /// is published once, at the end: a store per record would pull the line
    /// producers read back and forth between the CPUs, and a drain is short beside
    /// the ring's capacity. Stops at the first slot that is reserved but not
    /// published.
    pub fn drain<F: FnMut(&RingRecord<'_>)>(&mut self, max: usize, mut f: F) -> Drained {
        let (head, budget, mut copies) = self.begin_drain(max);
        let mut records = 0;
        let mut stop = None;
        while stop.is_none() && records < budget {
            let chunk = self.copy_out(&mut copies, (budget - records).min(COPY_CHUNK), head);
            records += chunk.0;
            stop = chunk.1;
            for copy in &mut copies[..chunk.0] {
                f(&copy.record());
            }
        }
        self.end_drain(copies, records, stop, head)
    }

    /// As [`drain`](Self::drain), but a record equal to one `known` keeps comes
    /// as [`Drawn::Known`], recognised in the ring itself (nothing copied); the
    /// others come as [`Drawn::Record`], and one `f` gives a token for is kept.
    pub fn drain_known<F>(&mut self, max: usize, known: &mut KnownRecords, mut f: F) -> Drained
    where
        F: FnMut(Drawn<'_>) -> Option<u32>,
    {
        let (head, budget, mut copies) = self.begin_drain(max);
        let mut records = 0;
        let mut stop = None;
        while records < budget {
            let index = self.tail;
            if index >= head {
                stop = Some(DrainStop::Empty);
                break;
            }
            let ahead = index.wrapping_add(PREFETCH_AHEAD);
            if ahead.wrapping_add(PREFETCH_AHEAD) < head {
                self.prefetch(ahead);
            }
            let slot = self.slot_offset(index);
            let want = index.wrapping_add(1);
            if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
                stop = Some(DrainStop::Pending { index });
                break;
            }
            let tsc = self.word(slot + S_TSC).load(Ordering::Relaxed);
            if self.tsc_bound != u64::MAX && tsc > self.tsc_bound {
                stop = Some(DrainStop::Later);
                break;
            }
            if let Some(token) = known.find(|o| self.word(slot + o).load(Ordering::Relaxed)) {
                let probe_word = self.word(slot + S_PROBE).load(Ordering::Relaxed);
                let thread = self.word(slot + S_THREAD).load(Ordering::Relaxed);
                // Rewritten meanwhile (only after a skip): as if not published.
                if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
                    stop = Some(DrainStop::Pending { index });
                    break;
                }
                self.tail = want;
                records += 1;
                f(Drawn::Known(KnownRecord {
                    index,
                    tsc,
                    tag: (probe_word >> 32) as u32,
                    thread,
                    token,
                }));
                continue;
            }
            let (n, why) = self.copy_out(&mut copies[..1], 1, head);
            if let Some(why) = why {
                stop = Some(why);
                break;
            }
            records += n;
            let record = copies[0].record();
            if let Some(token) = f(Drawn::Record(&record)) {
                known.keep(&record, token);
            }
        }
        self.end_drain(copies, records, stop, head)
    }

    /// A drain's start: says the consumer looks, and gives the head read now, how
    /// many records it may read (bounded by `max` and by `capacity`: a hostile
    /// head cannot make it longer) and the copies' room.
    fn begin_drain(&mut self, max: usize) -> (u64, usize, Vec<Copied>) {
        self.heartbeat();
        let budget = max.min(usize::try_from(self.capacity).unwrap_or(usize::MAX));
        let mut copies = std::mem::take(&mut self.copies);
        copies.resize_with(COPY_CHUNK, Copied::default);
        (self.head(), budget, copies)
    }

    /// A drain's end: frees the slots read, keeps the copies' room, says why it stopped.
    fn end_drain(
        &mut self,
        copies: Vec<Copied>,
        records: usize,
        stop: Option<DrainStop>,
        head: u64,
    ) -> Drained {
        if records > 0 {
            self.publish_tail();
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

    /// Copies up to `max` published records from `tail` on into `copies`, moving
    /// `tail` past them (not yet published); returns how many, and why it stopped
    /// short if it did.
    fn copy_out(
        &mut self,
        copies: &mut [Copied],
        max: usize,
        head: u64,
    ) -> (usize, Option<DrainStop>) {
        for (n, copy) in copies.iter_mut().take(max).enumerate() {
            if self.tail >= head {
                return (n, Some(DrainStop::Empty));
            }
            // Not the slots nearest `head`: producers may be writing them still, and a
            // line pulled from under a producer costs it a miss.
            let ahead = self.tail.wrapping_add(PREFETCH_AHEAD);
            if ahead.wrapping_add(PREFETCH_AHEAD) < head {
                self.prefetch(ahead);
            }
            // Copied out before `tail` moves past it: a producer may reuse the slot then.
            if !self.copy_record(self.tail, copy) {
                return (n, Some(DrainStop::Pending { index: self.tail }));
            }
            if self.tsc_bound != u64::MAX {
                let stamp = &copy.slot[S_TSC..S_TSC + 8];
                if u64::from_le_bytes(stamp.try_into().unwrap_or([0; 8])) > self.tsc_bound {
                    return (n, Some(DrainStop::Later));
                }
            }
            let (stack, used) = self.stack_of(&copy.slot, head);
            copy.stack = stack;
            self.tail = self.tail.wrapping_add(1 + used);
        }
        (max.min(copies.len()), None)
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
            unreadable: flags & STACK_UNREADABLE != 0,
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
            let owner_ok = self.copy_whole(index, continuation_seq(index), &mut copy)
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
        if self.tail >= self.head() || self.published(self.tail) {
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

    /// Byte offset of the slot for `index` in the mapping.
    fn slot_offset(&self, index: u64) -> usize {
        HEADER_SIZE + ((index & (self.capacity - 1)) as usize) * SLOT_SIZE
    }

    /// Asks for the first three cache lines of the slot for `index` (its fixed part
    /// and usual strings) ahead of their copy: the copy of a slot waits on its
    /// first load, and the slots after it are not loaded until it is done.
    #[inline]
    fn prefetch(&self, index: u64) {
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
    fn published(&self, index: u64) -> bool {
        let slot = self.slot_offset(index);
        self.word(slot + S_SEQ).load(Ordering::Acquire) == index.wrapping_add(1)
    }

    /// Copies the record at `index` into `copy` if it is published; says whether
    /// it did (else `copy` holds nothing of use).
    ///
    /// The fixed part, then each string's prefix word by word up to its NUL: a
    /// record reads the cache lines its producer wrote and no others, and its
    /// strings are measured on the way.
    fn copy_record(&self, index: u64, copy: &mut Copied) -> bool {
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
    fn copy_whole(&self, index: u64, want: u64, copy: &mut [u8; SLOT_SIZE]) -> bool {
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
