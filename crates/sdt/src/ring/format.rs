//! The ring's shared-memory format: one header page followed by fixed-size slots.
//!
//! The ring lives in a memfd mapped `MAP_SHARED` both in the target (where the
//! trampolines write it) and in pyprobe (which reads it). All integers are
//! little-endian (x86-64 native) and naturally aligned.
//!
//! # Header (`HEADER_SIZE` = 4096 bytes, at the start of the mapping)
//!
//! | offset | type | field |
//! | --- | --- | --- |
//! | 0   | u64 | `magic` = [`MAGIC`] (`"PYPRRING"`) |
//! | 8   | u32 | `version` = [`VERSION`] |
//! | 12  | u32 | `slot_size` = [`SLOT_SIZE`], or [`UNIT_SIZE`] for a ring of [`Slots::Units`] |
//! | 16  | u64 | `capacity`: number of slots, a power of two, 1 ..= [`MAX_CAPACITY`] |
//! | 24  | u32 | `header_size` = [`HEADER_SIZE`] |
//! | 64  | u64 | `head`: next slot index to reserve (producers, `cmpxchg`: see `solo`) |
//! | 72  | u64 | `solo`: 1 while the ring has one producer thread, which reserves without `lock` (written only by the consumer) |
//! | 128 | u64 | `tail`: next slot index to read (written only by the consumer) |
//! | 192 | u64 | `lost`: events dropped (ring full or reservation retries exhausted) |
//! | 200 | u64 | `waited`: TSC cycles records spent waiting for room (`lock add`) |
//! | 256 | 64 × u8 | `thin`: per probe id below [`THIN_PROBES`], how a stack probe records: [`THIN_OFF`] with its stack, [`THIN_STACKLESS`] without, [`THIN_COUNT`] not at all but counted (written only by the consumer) |
//! | 512 | 64 × u64 | `counted`: per probe id, events counted instead of recorded (`lock inc`) |
//! | 1024 | u64 | `alive`: 1 while a consumer reads the ring (producers wait for room), else 0 |
//! | 1032 | u64 | `heartbeat`: the consumer's TSC when it last looked at the ring |
//! | 1040 | u64 | `stale`: TSC cycles without a heartbeat after which the consumer counts as wedged |
//! | 1048 | u32 | `sleepers`: producers asleep on `tail` waiting for room (`lock inc`/`lock dec`) |
//! | 1056 | 2 × i64 | `nap`: the `timespec` a sleeping producer's `futex` wait lasts at most |
//! | 1072 | u64 | `patience`: TSC cycles an event waits for room at most (`u64::MAX`: as long as the consumer lives) |
//! | 1080 | u64 | `finished`: every record below this index is done with, what it points at read too (written only by the consumer, after `tail`) |
//! | 1088 | u64 | `owner`: the process whose semaphores `held` lists (its pid) |
//! | 1096 | u64 | `let_go`: times a producer lowered semaphores of `held` itself (`lock inc`) |
//! | 2048 | u64 | `held_count`: entries of `held` in use (0 ..= [`MAX_HELD`]) |
//! | 2056 | [`MAX_HELD`] × (u64, u64) | `held`: each semaphore pyprobe raised in `owner` (its address) and whether that raise is still pyprobe's to undo (1) or was undone (0) |
//!
//! `head`, `tail` and `lost` each own a 64-byte cache line so producers
//! bumping `head` do not bounce the consumer's `tail`. Indices grow forever
//! (no wrap in practice: 2^64 events); slot `i` lives at
//! `HEADER_SIZE + (i & (capacity - 1)) * SLOT_SIZE`. The mapping is exactly
//! [`ring_bytes`]`(capacity)` long.
//!
//! # Slot (`SLOT_SIZE` = 256 bytes)
//!
//! | offset | type | field |
//! | --- | --- | --- |
//! | 0  | u64 | `seq`: `i + 1` once slot index `i` is published (stored last) |
//! | 8  | u64 | `tsc`: `rdtsc` taken after the slot was reserved |
//! | 16 | u32 | `probe`: probe id chosen by the engine |
//! | 20 | u32 | `tag`: per-process tag (the engine writes the pid into the trampoline page) |
//! | 24 | u64 | `thread`: the thread's `%fs` base (`mov rax, fs:[0]` or `rdfsbase`) |
//! | 32 | 6 × u64 | `args`: argument values, sign- or zero-extended per the spec |
//! | 80 | u8 | `nargs` (0 ..= 6) |
//! | 81 | u8 | `string_mask`: bit `i` set if argument `i` is a C string |
//! | 82 | u8 | `truncated_mask`: bit `i` set if string `i` did not fit its area |
//! | 83 | u8 | `null_mask`: bit `i` set if string `i`'s pointer was NULL |
//! | 84 | u32 | stack: continuation slots, flags, depth (0 unless a stack probe: `stack.rs`) |
//! | 88 | 168 bytes | string areas |
//!
//! The string area is split evenly among the string arguments, in argument
//! order: with `n` strings, the `k`-th (counting only strings) starts at
//! `SLOT_STRINGS + k * (STRINGS_LEN / n)` and is `STRINGS_LEN / n` bytes
//! long (see [`string_area`]). It holds the string's first bytes, always
//! NUL-terminated inside the area; when the string had more bytes the
//! `truncated_mask` bit is set and the full string can be read from the
//! pointer in `args[i]`.
//!
//! # Producer protocol (what each trampoline does)
//!
//! 1. Load `tail`, then `head` (in that order, so `head - tail` never
//!    underflows with an honest consumer).
//! 2. If `head - tail >= capacity` (a stack record needs its 1 + N slots, see
//!    `stack.rs`), the ring is full: while `alive` is 1 and the `heartbeat` is
//!    less than `stale` cycles old, the event waits for room, re-reading from
//!    step 1: `pause` by `pause` for [`SPIN_CYCLES`], then asleep in
//!    `futex(&tail, FUTEX_WAIT, tail, &nap)` with `sleepers` raised (and the
//!    ring looked at again after raising it, so a wake-up cannot be missed),
//!    at most `patience` cycles (a budgeted recording would rather lose a rare
//!    event than have the target wait long for it).
//!    It adds the cycles it waited to `waited` (the target's time lost to a
//!    full ring). With no live consumer: `lock inc lost`, skip the event.
//! 3. `lock cmpxchg head: head -> head + 1`; on failure go back to 1, at most
//!    [`RESERVE_ATTEMPTS`] times in a row, then as with a full ring (step 2).
//!    While `solo` is 1 the same `cmpxchg` goes without `lock`: a single
//!    instruction is still whole against a signal handler on the same thread,
//!    and it costs a few cycles where the locked one drains the store buffer
//!    (about 11 ns an event). pyprobe sets `solo` only with the process's one
//!    thread stopped, and clears it at every new task before that task or its
//!    creator runs again (and when it leaves, or its guardian when it dies):
//!    a second producer can only appear through a `clone` of the first, which
//!    is never inside a trampoline.
//! 4. Write the payload of slot `head`, then store `seq = head + 1` last (an
//!    x86 store is a release: the consumer sees the payload once it sees `seq`).
//!
//! A consumer silent past `stale` with `alive` still 1 is dead without anyone
//! to undo its work (pyprobe and its guardian both killed): the producer that
//! finds so, in the `owner` process, lets go of pyprobe's probes itself. For
//! each `held` entry it swaps the flag to 0 (`xchg`), and if it was 1 lowers
//! that semaphore by one (never below 0, `lock cmpxchg`), within the bounds its
//! code was built with; then `lock inc let_go`. CPython stops reaching the
//! sites: the target runs as fast as before pyprobe came, where it would else
//! pay for every probe hit for good. Whoever else lowers a semaphore pyprobe
//! raised (pyprobe leaving or pausing a probe, its guardian) swaps its flag to
//! 0 first and lowers it only if the flag was 1, so each raise is undone once;
//! whoever raises it again sets the flag back to 1 after raising.
//!
//! Nothing is lost while the consumer lives: a producer waits as long as it
//! takes, and stops waiting once the consumer leaves (`alive` = 0, written by
//! pyprobe when it detaches and by its guardian when it dies) or its heartbeat
//! goes stale (a consumer stopped, or dead with no guardian: bounded by
//! `stale`). The consumer reads slot `tail` once its `seq == tail + 1`, copies
//! it out, then stores `tail + 1`, and `futex(&tail, FUTEX_WAKE)` when
//! `sleepers` is not 0 (after a full fence, pairing with the producer's `lock
//! inc`). `tail`'s low 32 bits are the futex word: the memfd is shared, so
//! the futex key is the same in both processes (no `FUTEX_PRIVATE_FLAG`).

use thiserror::Error;

/// `"PYPRRING"` read as a little-endian u64.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"PYPRRING");
/// Bumped on any incompatible change of this layout.
pub(crate) const VERSION: u32 = 5;
/// The header occupies one page.
pub const HEADER_SIZE: usize = 4096;
/// The size of a record's slot in an SDT ring ([`Slots::Records`]).
pub const SLOT_SIZE: usize = 256;
/// The size of a unit in a ring of [`Slots::Units`].
pub const UNIT_SIZE: usize = 16;
/// Most units one group of a ring of [`Slots::Units`] spans (its length is a
/// nibble of its first word).
pub const MAX_GROUP_UNITS: usize = 16;
/// Largest capacity accepted: keeps the index mask an imm32 in the
/// trampoline and the ring at most 4 GiB.
pub(crate) const MAX_CAPACITY: u64 = 1 << 24;
/// Arguments carried per record (SDT probes have at most 12; CPython's at most 3).
pub(crate) const MAX_ARGS: usize = 6;
/// How many times in a row a producer tries to reserve a slot before it waits
/// as on a full ring (or, with no live consumer, counts the event lost).
pub(crate) const RESERVE_ATTEMPTS: u32 = 8;

pub(crate) const H_MAGIC: usize = 0;
pub(crate) const H_VERSION: usize = 8;
pub(crate) const H_SLOT_SIZE: usize = 12;
pub const H_CAPACITY: usize = 16;
pub(crate) const H_HEADER_SIZE: usize = 24;
pub const H_HEAD: usize = 64;
/// In `head`'s line: read with it by every producer, written about never.
pub(crate) const H_SOLO: usize = 72;
pub(crate) const H_TAIL: usize = 128;
pub(crate) const H_LOST: usize = 192;
/// Shares `lost`'s line: both are written only when the ring is full.
pub(crate) const H_WAITED: usize = 200;
pub(crate) const H_THIN: usize = 256;
pub(crate) const H_COUNTED: usize = 512;
/// The consumer's line: whether one reads the ring, and how a producer waits for it.
pub const H_ALIVE: usize = 1024;
pub const H_HEARTBEAT: usize = 1032;
pub const H_STALE: usize = 1040;
pub(crate) const H_SLEEPERS: usize = 1048;
pub(crate) const H_NAP: usize = 1056;
pub(crate) const H_PATIENCE: usize = 1072;
/// `tail` says a record was copied out; this says pyprobe also read what it
/// points at (a code object's names): a target about to free those waits on it.
pub const H_FINISHED: usize = 1080;
/// The process whose semaphores `held` lists: only its producers let go of them.
pub(crate) const H_OWNER: usize = 1088;
/// Times a producer let go of pyprobe's semaphores itself (a dead consumer).
pub(crate) const H_LET_GO: usize = 1096;
/// Entries of `held` in use.
pub(crate) const H_HELD_COUNT: usize = 2048;
/// The semaphores pyprobe raised in `owner`: (address, still pyprobe's to undo).
pub(crate) const H_HELD: usize = 2056;
/// Most semaphores `held` lists (CPython's provider has about a dozen probes).
pub const MAX_HELD: usize = 64;
/// How long a sleeping producer's `futex` wait lasts at most before it looks
/// at the ring (and the consumer's liveness) again.
pub(crate) const NAP_NS: i64 = 1_000_000;
/// TSC cycles a producer spins (`pause`) for room before it sleeps: a few
/// microseconds, less than a futex round trip, enough for a consumer on another
/// CPU that is draining.
pub(crate) const SPIN_CYCLES: i32 = 1 << 14;
/// Probe ids that can be thinned (one `thin` byte and one `counted` word each).
pub(crate) const THIN_PROBES: u32 = 64;
/// `thin` values.
pub(crate) const THIN_OFF: u8 = 0;
pub(crate) const THIN_STACKLESS: u8 = 1;
pub(crate) const THIN_COUNT: u8 = 2;

pub const S_SEQ: usize = 0;
pub const S_TSC: usize = 8;
pub const S_PROBE: usize = 16;
pub const S_TAG: usize = 20;
pub const S_THREAD: usize = 24;
pub const S_ARGS: usize = 32;
pub const S_NARGS: usize = 80;
pub const S_STRING_MASK: usize = 81;
pub const S_TRUNCATED: usize = 82;
pub(crate) const S_NULL: usize = 83;
pub const S_STRINGS: usize = 88;
/// Bytes shared by all string arguments of a record.
pub const STRINGS_LEN: usize = SLOT_SIZE - S_STRINGS;

// The fields must not overlap and the header fields must fit their page.
const _: () = assert!(S_ARGS + 8 * MAX_ARGS <= S_NARGS && S_NULL < S_STRINGS);
const _: () = assert!(H_THIN + THIN_PROBES as usize <= H_COUNTED);
const _: () = assert!(H_COUNTED + 8 * THIN_PROBES as usize <= H_ALIVE);
const _: () =
    assert!(H_ALIVE % 64 == 0 && H_NAP + 16 <= H_PATIENCE && H_PATIENCE + 8 <= H_FINISHED);
const _: () = assert!(H_LET_GO + 8 <= H_HELD_COUNT && H_HELD + 16 * MAX_HELD <= HEADER_SIZE);
const _: () = assert!(SLOT_SIZE.is_power_of_two() && UNIT_SIZE.is_power_of_two());

/// What a ring's slots hold: the header and the producer protocol are the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slots {
    /// Records of [`SLOT_SIZE`] bytes, each published by its `seq` word (see the
    /// slot table above): the SDT engines' rings.
    Records,
    /// Units of [`UNIT_SIZE`] bytes (two words), written in groups of 1 ..=
    /// [`MAX_GROUP_UNITS`] reserved at once: the injected hook's compact records.
    /// A group is published by its first word, stored last and never 0, whose
    /// bits 4..8 say how many units the group spans less one; the other words
    /// are the producer's own. The consumer stores 0 over the first word of every
    /// unit it read before it moves `tail` past them, so a first word is not 0
    /// only once published in this lap (the ring starts all zero).
    Units,
}

/// Where a group's length stands in its first word ([`Slots::Units`]).
const GROUP_LEN_SHIFT: u32 = 4;

/// The bits of a group's first word that say it spans `units` units (1 ..=
/// [`MAX_GROUP_UNITS`]).
pub const fn group_len_bits(units: u64) -> u64 {
    (units - 1) << GROUP_LEN_SHIFT
}

/// How many units the group whose first word is `first` spans.
pub(crate) fn group_units(first: u64) -> u64 {
    1 + ((first >> GROUP_LEN_SHIFT) & 0xf)
}

impl Slots {
    /// Bytes of one slot.
    pub const fn size(self) -> usize {
        match self {
            Slots::Records => SLOT_SIZE,
            Slots::Units => UNIT_SIZE,
        }
    }

    /// log2 of [`size`](Self::size).
    pub const fn shift(self) -> u32 {
        self.size().trailing_zeros()
    }

    pub(crate) fn from_size(size: u32) -> Option<Slots> {
        [Slots::Records, Slots::Units]
            .into_iter()
            .find(|s| s.size() == size as usize)
    }
}

/// Why a ring could not be formatted or opened.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RingError {
    #[error("ring capacity {0} is not a power of two between 1 and {MAX_CAPACITY}")]
    BadCapacity(u64),
    #[error("ring mapping is {actual} bytes but capacity {capacity} needs exactly {expected}")]
    LengthMismatch {
        capacity: u64,
        expected: usize,
        actual: usize,
    },
    #[error("ring mapping of {0} bytes is smaller than the {HEADER_SIZE}-byte header")]
    TooSmall(usize),
    #[error("ring mapping is not 8-byte aligned")]
    Misaligned,
    #[error("ring header has magic {0:#018x}, not a pyprobe ring")]
    BadMagic(u64),
    #[error("ring header has version {0}, this pyprobe reads version {VERSION}")]
    BadVersion(u32),
    #[error("ring header has slot size {0}, expected {SLOT_SIZE} or {UNIT_SIZE}")]
    BadSlotSize(u32),
    #[error("ring header has header size {0}, expected {HEADER_SIZE}")]
    BadHeaderSize(u32),
}

/// Whether `capacity` is acceptable: a power of two in 1 ..= [`MAX_CAPACITY`].
pub(crate) fn check_capacity(capacity: u64) -> Result<(), RingError> {
    if capacity.is_power_of_two() && capacity <= MAX_CAPACITY {
        Ok(())
    } else {
        Err(RingError::BadCapacity(capacity))
    }
}

/// Total mapping length for `capacity` slots of `slots`.
pub fn ring_bytes(capacity: u64, slots: Slots) -> Result<usize, RingError> {
    check_capacity(capacity)?;
    // capacity <= 2^24, so this is at most 4 GiB + 4 KiB: fits usize on x86-64.
    usize::try_from(capacity)
        .ok()
        .and_then(|c| c.checked_mul(slots.size()))
        .and_then(|s| s.checked_add(HEADER_SIZE))
        .ok_or(RingError::BadCapacity(capacity))
}

/// Byte range (offset within the slot, length) of the `k`-th of `count`
/// string arguments, or `None` if `k >= count` or `count` is 0 or above [`MAX_ARGS`].
pub fn string_area(k: usize, count: usize) -> Option<(usize, usize)> {
    if count == 0 || count > MAX_ARGS || k >= count {
        return None;
    }
    // A table, not a division: this runs for every string of every record.
    let len = AREA_LEN[count];
    Some((S_STRINGS + k * len, len))
}

/// `STRINGS_LEN / count` for each count of string arguments.
const AREA_LEN: [usize; MAX_ARGS + 1] = {
    let mut t = [0; MAX_ARGS + 1];
    let mut c = 1;
    while c <= MAX_ARGS {
        t[c] = STRINGS_LEN / c;
        c += 1;
    }
    t
};

/// Formats a fresh ring in `mem` (the whole mapping): header fields, zero
/// indices and counters, and every slot's `seq` zeroed so no stale slot looks
/// published. Call it before the mapping is shared with the target.
pub fn init_ring(mem: &mut [u8], capacity: u64, slots: Slots) -> Result<(), RingError> {
    check_length(mem, capacity, slots)?;
    mem.fill(0);
    write_header(mem, capacity, slots)
}

/// [`init_ring`] for a mapping known to hold only zeros (a memfd just made and
/// sized: the kernel zero-fills it): writes the header alone. The slots' pages are
/// then first touched, and only allocated, when the target writes them: attaching
/// does not zero 8 MiB twice, and a ring a quiet process barely uses stays small.
pub fn init_zeroed_ring(mem: &mut [u8], capacity: u64, slots: Slots) -> Result<(), RingError> {
    check_length(mem, capacity, slots)?;
    write_header(mem, capacity, slots)
}

fn check_length(mem: &[u8], capacity: u64, slots: Slots) -> Result<(), RingError> {
    let expected = ring_bytes(capacity, slots)?;
    if mem.len() != expected {
        return Err(RingError::LengthMismatch {
            capacity,
            expected,
            actual: mem.len(),
        });
    }
    Ok(())
}

fn write_header(mem: &mut [u8], capacity: u64, slots: Slots) -> Result<(), RingError> {
    put(mem, H_MAGIC, &MAGIC.to_le_bytes());
    put(mem, H_VERSION, &VERSION.to_le_bytes());
    put(mem, H_SLOT_SIZE, &(slots.size() as u32).to_le_bytes());
    put(mem, H_CAPACITY, &capacity.to_le_bytes());
    put(mem, H_HEADER_SIZE, &(HEADER_SIZE as u32).to_le_bytes());
    // No consumer yet (`alive` 0): producers do not wait until one says so.
    put(mem, H_NAP + 8, &NAP_NS.to_le_bytes());
    Ok(())
}

fn put(mem: &mut [u8], offset: usize, bytes: &[u8]) {
    if let Some(dst) = mem.get_mut(offset..offset + bytes.len()) {
        dst.copy_from_slice(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_areas() {
        assert_eq!(ring_bytes(1, Slots::Records), Ok(HEADER_SIZE + SLOT_SIZE));
        assert_eq!(
            ring_bytes(4096, Slots::Records),
            Ok(HEADER_SIZE + 4096 * SLOT_SIZE)
        );
        assert_eq!(ring_bytes(4096, Slots::Units), Ok(HEADER_SIZE + 4096 * 16));
        for bad in [0, 3, 6, MAX_CAPACITY * 2, u64::MAX] {
            assert_eq!(
                ring_bytes(bad, Slots::Records),
                Err(RingError::BadCapacity(bad))
            );
        }
        assert_eq!(string_area(0, 1), Some((88, 168)));
        assert_eq!(string_area(1, 2), Some((88 + 84, 84)));
        assert_eq!(string_area(5, 6), Some((88 + 5 * 28, 28)));
        assert_eq!(string_area(2, 2), None);
        assert_eq!(string_area(0, 7), None);
        assert_eq!(string_area(0, 0), None);
        // Areas never run past the slot.
        for n in 1..=MAX_ARGS {
            let (off, len) = string_area(n - 1, n).expect("area");
            assert!(off + len <= SLOT_SIZE && len >= 2);
        }
    }

    #[test]
    fn init_formats_header() {
        let mut mem = vec![0xffu8; ring_bytes(4, Slots::Records).expect("size")];
        init_ring(&mut mem, 4, Slots::Records).expect("init");
        assert_eq!(&mem[0..8], b"PYPRRING");
        assert_eq!(mem[H_CAPACITY], 4);
        assert!(mem[H_HEAD..H_NAP].iter().all(|&b| b == 0));
        // No consumer yet; a producer's nap is set.
        assert_eq!(mem[H_ALIVE], 0);
        assert_eq!(mem[H_NAP + 8..H_NAP + 16], NAP_NS.to_le_bytes());
        assert!(mem[H_PATIENCE..].iter().all(|&b| b == 0));
        // On zeros, formatting the header alone gives the same ring.
        let mut zeroed = vec![0u8; mem.len()];
        init_zeroed_ring(&mut zeroed, 4, Slots::Records).expect("init zeroed");
        assert_eq!(zeroed, mem);
        let mut short = vec![0u8; 100];
        assert!(matches!(
            init_ring(&mut short, 4, Slots::Records),
            Err(RingError::LengthMismatch { .. })
        ));
    }
}
