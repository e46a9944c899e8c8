//! The reader's dealings with the header: what it reports of the ring, what it
//! tells producers (serving, thinning, solo, heartbeat, leaving), and publishing
//! its tail and waking producers asleep on it. Apart from draining, which reads
//! the slots.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{tsc_now, RingReader};
use crate::ring::format::*;

impl RingReader {
    /// Slots in the ring.
    pub(crate) fn capacity(&self) -> u64 {
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
    pub(crate) fn heartbeat_address(&self) -> usize {
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
    pub(crate) fn set_thin(&self, probe: u32, mode: u8) {
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
    pub(crate) fn counted(&self, probe: u32) -> u64 {
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
    pub(crate) fn set_tsc_bound(&mut self, tsc: u64) {
        self.tsc_bound = tsc;
    }

    /// Gives up on the slot at `tail` if it is reserved but unpublished,
    /// counting it in `lost`. Returns whether a slot was skipped.
    ///
    /// Use only after a timeout: a producer that was merely slow will still
    /// write that slot later, possibly over a record of the next lap, which
    /// then decodes as a mix (or stays unpublished and is skipped in turn).
    pub(crate) fn skip_pending(&mut self) -> bool {
        // A unit ring's group length is in its unpublished first word: unknown.
        if self.slots != Slots::Records || self.tail >= self.head() || self.published(self.tail) {
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

    pub(super) fn publish_tail(&self) {
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
}
