//! Reading the ring from pyprobe's side of the shared mapping.
//!
//! The target writes the same memory concurrently and may be hostile: every
//! access is an atomic load of an aligned word, each slot is copied out before
//! it is decoded, and no value read from the mapping is trusted (counts are
//! clamped, indices compared, lengths bounded).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use super::layout::*;
use super::stack::*;

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

    /// Reads up to `max` published records in order, calling `f` for each,
    /// and publishes the new `tail` once at the end (a store per record would
    /// pull the line producers read back and forth between the CPUs). Stops at
    /// the first slot that is reserved but not published.
    pub fn drain<F: FnMut(&RingRecord<'_>)>(&mut self, max: usize, mut f: F) -> Drained {
        let head = self.head();
        let mut records = 0;
        // Bounded by `max` and by `capacity` (a hostile head cannot make it longer).
        let budget = max.min(usize::try_from(self.capacity).unwrap_or(usize::MAX));
        let mut stop = None;
        while records < budget {
            if self.tail >= head {
                stop = Some(DrainStop::Empty);
                break;
            }
            // Copied out before `tail` moves past it: a producer may reuse the slot then.
            let Some(copy) = self.copy_published(self.tail) else {
                stop = Some(DrainStop::Pending { index: self.tail });
                break;
            };
            let mut record = decode(self.tail, &copy);
            let used = self.stack_of(&copy, head, &mut record);
            f(&record);
            self.tail = self.tail.wrapping_add(1 + used);
            records += 1;
        }
        if records > 0 {
            self.publish_tail();
        }
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
    /// `first`) into `record.stack`; returns how many slots they take. A claim that
    /// does not fit what producers reserved takes none (the record keeps no stack).
    fn stack_of(&self, first: &[u8; SLOT_SIZE], head: u64, record: &mut RingRecord<'_>) -> u64 {
        let slots = first[S_STACK_SLOTS];
        let flags = first[S_STACK_FLAGS];
        if slots == 0 || flags & STACK_CAPTURED == 0 {
            return 0;
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
            record.stack = Some(stack);
            return 0;
        }
        let want = stack.depth.min(frames_for(slots));
        stack.truncated |= stack.depth > want;
        for k in 1..=n {
            let index = self.tail.wrapping_add(k);
            let owner_ok = self
                .copy_with_seq(index, continuation_seq(index))
                .filter(|c| {
                    u64::from_le_bytes(c[C_OWNER..C_OWNER + 8].try_into().unwrap_or([0; 8]))
                        == self.tail
                });
            let Some(copy) = owner_ok else {
                stack.broken = true;
                continue;
            };
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
        record.stack = Some(stack);
        n
    }

    /// Gives up on the slot at `tail` if it is reserved but unpublished,
    /// counting it in `lost`. Returns whether a slot was skipped.
    ///
    /// Use only after a timeout: a producer that was merely slow will still
    /// write that slot later, possibly over a record of the next lap, which
    /// then decodes as a mix (or stays unpublished and is skipped in turn).
    pub fn skip_pending(&mut self) -> bool {
        if self.tail >= self.head() || self.copy_published(self.tail).is_some() {
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
    }

    /// The slot for `index` copied out, if its `seq` says it is published.
    fn copy_published(&self, index: u64) -> Option<[u8; SLOT_SIZE]> {
        self.copy_with_seq(index, index.wrapping_add(1))
    }

    /// The slot for `index` copied out, if its `seq` is `want`.
    fn copy_with_seq(&self, index: u64, want: u64) -> Option<[u8; SLOT_SIZE]> {
        let slot = HEADER_SIZE + ((index & (self.capacity - 1)) as usize) * SLOT_SIZE;
        if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
            return None;
        }
        let mut copy = [0u8; SLOT_SIZE];
        for (i, chunk) in copy.chunks_exact_mut(8).enumerate() {
            let v = self.word(slot + i * 8).load(Ordering::Relaxed);
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        // A changed seq means the slot was rewritten while copying (only after
        // a skip): treat it as not published rather than return a torn record.
        if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
            return None;
        }
        Some(copy)
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
fn find_nul(bytes: &[u8]) -> Option<usize> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A heap ring, 8-aligned, standing in for the shared mapping.
    struct TestRing {
        words: Vec<u64>,
    }

    impl TestRing {
        fn new(capacity: u64) -> TestRing {
            let len = ring_bytes(capacity).expect("size");
            let mut ring = TestRing {
                words: vec![0; len / 8],
            };
            init_ring(ring.bytes(), capacity).expect("init");
            ring
        }

        fn bytes(&mut self) -> &mut [u8] {
            let len = self.words.len() * 8;
            // SAFETY: a u64 buffer viewed as bytes, same length in bytes.
            unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
        }

        fn reader(&mut self) -> Result<RingReader, RingError> {
            let len = self.words.len() * 8;
            // SAFETY: the buffer outlives the reader in every test below.
            unsafe { RingReader::new(self.words.as_mut_ptr().cast(), len) }
        }

        /// A Rust model of one producer (single-threaded).
        fn produce(&mut self, probe: u32, args: &[u64], strings: &[Option<&[u8]>]) -> bool {
            let bytes = self.bytes();
            let get = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8"));
            let (head, tail) = (get(bytes, H_HEAD), get(bytes, H_TAIL));
            let capacity = get(bytes, H_CAPACITY);
            if head - tail >= capacity {
                let lost = get(bytes, H_LOST) + 1;
                bytes[H_LOST..H_LOST + 8].copy_from_slice(&lost.to_le_bytes());
                return false;
            }
            bytes[H_HEAD..H_HEAD + 8].copy_from_slice(&(head + 1).to_le_bytes());
            let s = HEADER_SIZE + ((head & (capacity - 1)) as usize) * SLOT_SIZE;
            let slot = &mut bytes[s..s + SLOT_SIZE];
            slot[S_TSC..S_TSC + 8].copy_from_slice(&(100 + head).to_le_bytes());
            slot[S_PROBE..S_PROBE + 4].copy_from_slice(&probe.to_le_bytes());
            slot[S_NARGS] = args.len() as u8;
            for (i, a) in args.iter().enumerate() {
                slot[S_ARGS + 8 * i..S_ARGS + 8 * i + 8].copy_from_slice(&a.to_le_bytes());
            }
            let count = strings.iter().filter(|s| s.is_some()).count();
            let (mut mask, mut trunc, mut k) = (0u8, 0u8, 0);
            for (i, s) in strings.iter().enumerate() {
                let Some(s) = s else { continue };
                mask |= 1 << i;
                let (off, len) = string_area(k, count).expect("area");
                k += 1;
                let n = s.len().min(len - 1);
                slot[off..off + n].copy_from_slice(&s[..n]);
                slot[off + n] = 0;
                if s.len() > n {
                    trunc |= 1 << i;
                }
            }
            slot[S_STRING_MASK] = mask;
            slot[S_TRUNCATED] = trunc;
            slot[S_SEQ..S_SEQ + 8].copy_from_slice(&(head + 1).to_le_bytes());
            true
        }
    }

    #[test]
    fn drains_in_order_and_frees_slots() {
        let mut ring = TestRing::new(4);
        let long = [b'x'; 200];
        for i in 0..3u64 {
            assert!(ring.produce(7, &[i, 0, 0], &[None, Some(b"fib"), Some(&long)]));
        }
        let mut reader = ring.reader().expect("valid");
        let mut seen = Vec::new();
        let out = reader.drain(100, |r| {
            let fib = r.strings[1].expect("string 1");
            let big = r.strings[2].expect("string 2");
            assert_eq!(
                (fib.bytes, fib.truncated, fib.null),
                (&b"fib"[..], false, false)
            );
            assert!(big.truncated && big.bytes.len() == 83);
            assert!(r.strings[0].is_none());
            seen.push((r.index, r.probe, r.args[0], r.nargs, r.tsc));
        });
        assert_eq!(
            out,
            Drained {
                records: 3,
                stop: DrainStop::Empty
            }
        );
        assert_eq!(seen[2], (2, 7, 2, 3, 102));
        // tail was published: the producer can fill the ring again (4 slots).
        for _ in 0..4 {
            assert!(ring.produce(1, &[], &[]));
        }
        assert!(!ring.produce(1, &[], &[]));
        assert_eq!(reader.lost(), 1);
        assert_eq!(reader.drain(2, |_| {}).stop, DrainStop::Limit);
        assert_eq!(reader.drain(9, |_| {}).records, 2);
    }

    #[test]
    fn unpublished_slot_stops_and_can_be_skipped() {
        let mut ring = TestRing::new(8);
        assert!(ring.produce(1, &[], &[]));
        assert!(ring.produce(2, &[], &[]));
        // Unpublish slot 1 (as if its producer had not finished), then add one more.
        let s = HEADER_SIZE + SLOT_SIZE;
        ring.bytes()[s..s + 8].fill(0);
        assert!(ring.produce(3, &[], &[]));
        let mut reader = ring.reader().expect("valid");
        let out = reader.drain(10, |r| assert_eq!(r.probe, 1));
        assert_eq!(out.stop, DrainStop::Pending { index: 1 });
        assert_eq!(reader.drain(10, |_| {}).records, 0);
        assert!(reader.skip_pending());
        assert!(!reader.skip_pending());
        assert_eq!((reader.lost(), reader.skipped()), (1, 1));
        let mut probes = Vec::new();
        reader.drain(10, |r| probes.push(r.probe));
        assert_eq!(probes, [3]);
    }

    #[test]
    fn rejects_corrupt_headers() {
        let mut ring = TestRing::new(4);
        type Check = fn(&RingError) -> bool;
        let cases: [(usize, u8, Check); 5] = [
            (H_MAGIC, b'X', |e| matches!(e, RingError::BadMagic(_))),
            (H_VERSION, 9, |e| matches!(e, RingError::BadVersion(9))),
            (H_SLOT_SIZE + 1, 2, |e| {
                matches!(e, RingError::BadSlotSize(512))
            }),
            (H_CAPACITY, 8, |e| {
                matches!(e, RingError::LengthMismatch { .. })
            }),
            (H_CAPACITY, 3, |e| matches!(e, RingError::BadCapacity(3))),
        ];
        for (offset, byte, check) in cases {
            let saved = ring.bytes()[offset];
            ring.bytes()[offset] = byte;
            let err = ring.reader().expect_err("corrupt header accepted");
            assert!(check(&err), "{offset}: {err}");
            assert!(!err.to_string().is_empty());
            ring.bytes()[offset] = saved;
        }
        assert!(ring.reader().is_ok());
        let mut small = [0u64; 8];
        // SAFETY: valid 64-byte buffer.
        let err = unsafe { RingReader::new(small.as_mut_ptr().cast(), 64) };
        assert_eq!(err.err(), Some(RingError::TooSmall(64)));
    }

    #[test]
    fn hostile_indices_are_bounded() {
        let mut ring = TestRing::new(4);
        let mut reader = ring.reader().expect("valid");
        // head far ahead with nothing published: stops at once.
        ring.bytes()[H_HEAD..H_HEAD + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let out = reader.drain(usize::MAX, |_| {});
        assert_eq!(out.stop, DrainStop::Pending { index: 0 });
        // Slots whose seq happens to match but whose contents are garbage.
        for i in 0..4u64 {
            let s = HEADER_SIZE + (i as usize) * SLOT_SIZE;
            ring.bytes()[s..s + SLOT_SIZE].fill(0xff);
            ring.bytes()[s..s + 8].copy_from_slice(&(i + 1).to_le_bytes());
        }
        let out = reader.drain(usize::MAX, |r| {
            assert_eq!(r.nargs, MAX_ARGS);
            for s in r.strings.iter().flatten() {
                assert!(s.truncated && s.null && s.bytes.len() == 28);
            }
        });
        // One drain reads at most `capacity` records, whatever head says.
        assert_eq!(out.records, 4);
        assert_eq!(out.stop, DrainStop::Limit);
        let out = reader.drain(usize::MAX, |_| {});
        assert_eq!(out.stop, DrainStop::Pending { index: 4 });
    }

    proptest! {
        #[test]
        fn find_nul_agrees_with_a_byte_scan(
            bytes in proptest::collection::vec(prop::sample::select(vec![0u8, 1, 0x7f, 0x80, 0xfe, 0xff]), 0..100)
        ) {
            prop_assert_eq!(find_nul(&bytes), bytes.iter().position(|&b| b == 0));
        }

        #[test]
        fn random_headers_never_panic(header in proptest::collection::vec(any::<u8>(), 256)) {
            let mut ring = TestRing::new(4);
            ring.bytes()[..256].copy_from_slice(&header);
            if let Ok(mut reader) = ring.reader() {
                let _ = reader.drain(16, |_| {});
                let _ = reader.skip_pending();
            }
        }

        #[test]
        fn random_slots_decode(bytes in proptest::collection::vec(any::<u8>(), SLOT_SIZE)) {
            let mut slot = [0u8; SLOT_SIZE];
            slot.copy_from_slice(&bytes);
            let r = decode(0, &slot);
            prop_assert!(r.nargs <= MAX_ARGS);
            for s in r.strings.iter().flatten() {
                prop_assert!(s.bytes.len() <= STRINGS_LEN);
            }
        }
    }

    /// Writes slot `index` raw: `seq`, then `fields` as (offset, bytes).
    fn put_slot(ring: &mut TestRing, index: u64, seq: u64, fields: &[(usize, &[u8])]) {
        let bytes = ring.bytes();
        let capacity = u64::from_le_bytes(bytes[H_CAPACITY..H_CAPACITY + 8].try_into().expect("8"));
        let s = HEADER_SIZE + ((index & (capacity - 1)) as usize) * SLOT_SIZE;
        for (o, b) in fields {
            bytes[s + o..s + o + b.len()].copy_from_slice(b);
        }
        bytes[s..s + 8].copy_from_slice(&seq.to_le_bytes());
    }

    fn set_head(ring: &mut TestRing, head: u64) {
        ring.bytes()[H_HEAD..H_HEAD + 8].copy_from_slice(&head.to_le_bytes());
    }

    /// A first slot claiming `slots` continuation slots and `depth` frames.
    fn stack_head(ring: &mut TestRing, index: u64, slots: u8, depth: u16) {
        let meta = [
            slots,
            STACK_CAPTURED | STACK_FOUND,
            depth as u8,
            (depth >> 8) as u8,
        ];
        put_slot(ring, index, index + 1, &[(S_STACK_SLOTS, &meta)]);
    }

    fn continuation(ring: &mut TestRing, index: u64, owner: u64, pairs: &[(u64, u64)]) {
        let mut body = Vec::new();
        for (c, p) in pairs {
            body.extend_from_slice(&c.to_le_bytes());
            body.extend_from_slice(&p.to_le_bytes());
        }
        let owner = owner.to_le_bytes();
        put_slot(
            ring,
            index,
            continuation_seq(index),
            &[(C_OWNER, &owner), (C_PAIRS, &body)],
        );
    }

    #[test]
    fn stack_records_are_checked_before_they_are_trusted() {
        let mut ring = TestRing::new(16);
        // 0: a good record of 1 + 2 slots, 3 frames: the first three pairs.
        stack_head(&mut ring, 0, 2, 3);
        let pairs: Vec<(u64, u64)> = (0..PAIRS_PER_SLOT as u64)
            .map(|k| (0x1000 + k, k))
            .collect();
        continuation(&mut ring, 1, 0, &pairs);
        continuation(&mut ring, 2, 0, &pairs);
        // 3: a record whose second continuation names another owner: broken, 3 slots.
        stack_head(&mut ring, 3, 2, 2);
        continuation(&mut ring, 4, 3, &pairs);
        continuation(&mut ring, 5, 99, &pairs);
        // 6: claims more slots than a record can have: broken, takes only its own.
        stack_head(&mut ring, 6, MAX_STACK_SLOTS + 1, 2);
        // 7: claims slots past what producers reserved (head is 8): broken, 1 slot.
        stack_head(&mut ring, 7, 2, 2);
        set_head(&mut ring, 8);
        let mut reader = ring.reader().expect("reader");
        let mut got = Vec::new();
        let out = reader.drain(100, |r| {
            got.push((r.index, r.stack.clone().expect("stack")))
        });
        assert_eq!(out.stop, DrainStop::Empty);
        let summary: Vec<_> = got
            .iter()
            .map(|(i, s)| (*i, s.broken, s.frames.len(), s.depth))
            .collect();
        assert_eq!(
            summary,
            [
                (0, false, 3, 3),
                (3, true, 0, 2),
                (6, true, 0, 2),
                (7, true, 0, 2)
            ]
        );
        assert_eq!(got[0].1.frames, pairs[..3]);
        assert_eq!(reader.tail(), 8);
        // A continuation slot is never read as a record of its own, even at the tail.
        continuation(&mut ring, 8, 7, &pairs);
        set_head(&mut ring, 9);
        let mut reader = ring.reader().expect("reader");
        assert_eq!(reader.tail(), 8);
        let out = reader.drain(100, |_| panic!("a continuation slot read as a record"));
        assert_eq!(out.stop, DrainStop::Pending { index: 8 });
    }
}
