//! Draining: reading the published records in order, in chunks copied out of
//! the ring, or recognised in place as records kept before; and reading a
//! stack record's continuation slots.

use super::Token;
use std::sync::atomic::Ordering;

use super::{
    Copied, DrainStop, Drained, Drawn, FixedRecord, KnownRecord, KnownRecords, Plain, RingReader,
    RingRecord, RingStack,
};
use crate::ring::format::*;
use crate::ring::stack::*;

/// Records copied out of the ring before they are handed on: few enough that
/// their copies stay in the nearest cache until they are read.
const COPY_CHUNK: usize = 32;
/// How many slots ahead of the one being copied the reader asks for its lines.
const PREFETCH_AHEAD: u64 = 8;
/// The bits of the word at [`S_NARGS`] a record with no string and no stack has
/// clear: the string mask (its second byte) and the stack word (its upper half).
const PLAIN_MASK: u64 = 0xffff_ffff_0000_ff00;
const _: () = assert!(S_STRING_MASK == S_NARGS + 1 && S_STACK_SLOTS == S_NARGS + 4);

impl RingReader {
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
    pub(crate) fn drain_known<F>(
        &mut self,
        max: usize,
        known: &mut KnownRecords,
        mut f: F,
    ) -> Drained
    where
        F: FnMut(Drawn<'_>) -> Option<Token>,
    {
        self.drain_in_place(max, |reader, (index, slot, tsc), head, copies| {
            if let Some(token) = known.find(|o| reader.word(slot + o).load(Ordering::Relaxed)) {
                let probe_word = reader.word(slot + S_PROBE).load(Ordering::Relaxed);
                let thread = reader.word(slot + S_THREAD).load(Ordering::Relaxed);
                reader.take_in_place(index, slot)?;
                f(Drawn::Known(KnownRecord {
                    index,
                    tsc,
                    tag: (probe_word >> 32) as u32,
                    thread,
                    token,
                }));
                return Ok(1);
            }
            let n = reader.copy_one(copies, head)?;
            let record = copies[0].record();
            if let Some(token) = f(Drawn::Record(&record)) {
                known.keep(&record, token);
            }
            Ok(n)
        })
    }

    /// As [`drain`](Self::drain), but a record with no string argument and no
    /// stack (the flags word says so) comes as [`Plain::Fixed`], read from the
    /// slot in place: its fixed words only, nothing copied into a slot buffer or
    /// decoded. The others come as [`Plain::Copied`], as `drain` gives them.
    pub fn drain_fixed<F: FnMut(Plain<'_, '_>)>(&mut self, max: usize, mut f: F) -> Drained {
        self.drain_in_place(max, |reader, (index, slot, tsc), head, copies| {
            // The word of `nargs`: the string mask is its second byte, the stack
            // word its upper half.
            let flags = reader.word(slot + S_NARGS).load(Ordering::Relaxed);
            if flags & PLAIN_MASK != 0 {
                let n = reader.copy_one(copies, head)?;
                f(Plain::Copied(&copies[0].record()));
                return Ok(n);
            }
            let fixed = FixedRecord::from_words(index, tsc, flags, |o| {
                reader.word(slot + o).load(Ordering::Relaxed)
            });
            reader.take_in_place(index, slot)?;
            f(Plain::Fixed(&fixed));
            Ok(1)
        })
    }

    /// The loop of the drains that read records in place: `step` is given the
    /// record at `tail` (index, slot offset, time) once it is published, reads
    /// it, moves `tail` past it and says how many records it took, or why the
    /// drain stops there.
    fn drain_in_place<S>(&mut self, max: usize, mut step: S) -> Drained
    where
        S: FnMut(
            &mut RingReader,
            (u64, usize, u64),
            u64,
            &mut [Copied],
        ) -> Result<usize, DrainStop>,
    {
        let (head, budget, mut copies) = self.begin_drain(max);
        let mut records = 0;
        let mut stop = None;
        while records < budget {
            let taken = self
                .next_in_place(head)
                .and_then(|next| step(self, next, head, &mut copies));
            match taken {
                Ok(n) => records += n,
                Err(why) => {
                    stop = Some(why);
                    break;
                }
            }
        }
        self.end_drain(copies, records, stop, head)
    }

    /// Moves `tail` past the record at `index` (its slot at `slot`), read in
    /// place, if it is still published; else it was rewritten while read (only
    /// after a skip), and counts as not published.
    fn take_in_place(&mut self, index: u64, slot: usize) -> Result<(), DrainStop> {
        let want = index.wrapping_add(1);
        if self.word(slot + S_SEQ).load(Ordering::Acquire) != want {
            return Err(DrainStop::Pending { index });
        }
        self.tail = want;
        Ok(())
    }

    /// The record at `tail` copied into `copies[0]` (and `tail` moved past it and
    /// its stack's slots): how many records that is, or why it could not be.
    fn copy_one(&mut self, copies: &mut [Copied], head: u64) -> Result<usize, DrainStop> {
        match self.copy_out(&mut copies[..1], 1, head) {
            (_, Some(why)) => Err(why),
            (n, None) => Ok(n),
        }
    }

    /// The record at `tail`, to be read in place: its index, its slot's offset
    /// and its time, once it is published and not stamped past the bound (else
    /// why the drain stops there). Asks for the lines of a slot further on.
    #[inline]
    fn next_in_place(&self, head: u64) -> Result<(u64, usize, u64), DrainStop> {
        let index = self.tail;
        if index >= head {
            return Err(DrainStop::Empty);
        }
        let ahead = index.wrapping_add(PREFETCH_AHEAD);
        if ahead.wrapping_add(PREFETCH_AHEAD) < head {
            self.prefetch(ahead);
        }
        let slot = self.slot_offset(index);
        if self.word(slot + S_SEQ).load(Ordering::Acquire) != index.wrapping_add(1) {
            return Err(DrainStop::Pending { index });
        }
        let tsc = self.word(slot + S_TSC).load(Ordering::Relaxed);
        if self.tsc_bound != u64::MAX && tsc > self.tsc_bound {
            return Err(DrainStop::Later);
        }
        Ok((index, slot, tsc))
    }

    /// A drain's start, of a ring of either kind: says the consumer looks, and
    /// gives the head read now and how many records (or groups) it may read:
    /// bounded by `max` and by `capacity` (a hostile head cannot make it
    /// longer), none from a ring whose slots are not `slots`.
    pub(super) fn begin_reading(&mut self, max: usize, slots: Slots) -> (u64, usize) {
        self.heartbeat();
        let max = if self.slots == slots { max } else { 0 };
        let budget = max.min(usize::try_from(self.capacity).unwrap_or(usize::MAX));
        (self.head(), budget)
    }

    /// A drain's end, of a ring of either kind: frees the slots read, says why it
    /// stopped.
    pub(super) fn end_reading(
        &mut self,
        records: usize,
        stop: Option<DrainStop>,
        head: u64,
    ) -> Drained {
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

    /// A records drain's start: [`begin_reading`](Self::begin_reading), and the
    /// copies' room.
    fn begin_drain(&mut self, max: usize) -> (u64, usize, Vec<Copied>) {
        let (head, budget) = self.begin_reading(max, Slots::Records);
        let mut copies = std::mem::take(&mut self.copies);
        copies.resize_with(COPY_CHUNK, Copied::default);
        (head, budget, copies)
    }

    /// A records drain's end: keeps the copies' room, then
    /// [`end_reading`](Self::end_reading).
    fn end_drain(
        &mut self,
        copies: Vec<Copied>,
        records: usize,
        stop: Option<DrainStop>,
        head: u64,
    ) -> Drained {
        self.copies = copies;
        self.end_reading(records, stop, head)
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
}
