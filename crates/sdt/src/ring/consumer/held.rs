//! The semaphores pyprobe raised, listed in the ring's header for its producers:
//! a producer that finds the consumer dead with nobody left to undo its work
//! lowers them itself (see `held` in the ring format). Each raise is undone once,
//! by whoever swaps its flag from 1 to 0 first.

use std::sync::atomic::{AtomicU64, Ordering};

use super::RingReader;
use crate::ring::format::*;

impl RingReader {
    /// Lists the semaphores pyprobe raised in process `owner` (`raised`), and
    /// those it may raise again later (`not_now`, listed as not held), at most
    /// [`MAX_HELD`] in all: the rest are not listed, and only pyprobe or its
    /// guardian lowers those. Before any producer of `owner` can find the ring
    /// unserved.
    pub fn hold_semaphores(&self, owner: u32, raised: &[u64], not_now: &[u64]) {
        let entries = raised
            .iter()
            .map(|&s| (s, 1))
            .chain(not_now.iter().map(|&s| (s, 0)));
        let mut listed = 0;
        for (k, (sem, held)) in entries.take(MAX_HELD).enumerate() {
            self.word(H_HELD + 16 * k).store(sem, Ordering::Relaxed);
            self.word(H_HELD + 16 * k + 8)
                .store(held, Ordering::Relaxed);
            listed = k + 1;
        }
        self.word(H_OWNER)
            .store(u64::from(owner), Ordering::Relaxed);
        self.word(H_HELD_COUNT)
            .store(listed as u64, Ordering::Release);
    }

    /// The flag of semaphore `sem`'s entry, if listed.
    fn held_flag(&self, sem: u64) -> Option<&AtomicU64> {
        let count = (self.load(H_HELD_COUNT) as usize).min(MAX_HELD);
        (0..count)
            .find(|&k| self.load(H_HELD + 16 * k) == sem)
            .map(|k| self.word(H_HELD + 16 * k + 8))
    }

    /// Takes back pyprobe's raise of `sem` from the producers: `Some(true)` if it
    /// is still to be undone (by the caller, now), `Some(false)` if a producer
    /// already lowered it, `None` if it is not listed.
    pub fn take_held(&self, sem: u64) -> Option<bool> {
        Some(self.held_flag(sem)?.swap(0, Ordering::AcqRel) != 0)
    }

    /// Says `sem`, just raised again by pyprobe, is pyprobe's to undo again
    /// (a producer that lets go lowers it). Nothing if it is not listed.
    pub fn set_held(&self, sem: u64) {
        if let Some(flag) = self.held_flag(sem) {
            flag.store(1, Ordering::Release);
        }
    }

    /// Whether pyprobe's raise of `sem` is still pyprobe's to undo (`None`: not
    /// listed). `false` for one a producer lowered, or pyprobe took back.
    pub fn is_held(&self, sem: u64) -> Option<bool> {
        Some(self.held_flag(sem)?.load(Ordering::Acquire) != 0)
    }

    /// Times a producer let go of the semaphores listed (the ring unserved past
    /// `stale` while `alive` said a consumer lived).
    pub fn let_go_count(&self) -> u64 {
        self.load(H_LET_GO)
    }
}
