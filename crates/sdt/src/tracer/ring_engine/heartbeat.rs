//! The consumer's heartbeat, beaten by a thread of its own.
//!
//! A producer waits for room in a full ring only while the ring's `heartbeat` is
//! younger than `stale` ([`super::CONSUMER_STALE_NS`]). The thread that drains the
//! rings is the wrong one to beat it: it may be busy for a while with one batch, or
//! starved on a loaded machine (it even runs under `SCHED_IDLE` while it follows a
//! thread's CPU), and a starved pyprobe is slow, not gone. So a small thread that
//! does nothing else beats every ring every [`BEAT`]: it stops beating only when
//! pyprobe as a whole is stopped (SIGSTOP, Ctrl-Z, a debugger) or dead, and then
//! the producers stop waiting within `stale`, which can therefore be short.
//!
//! It also stops when the draining thread has made no progress for [`WEDGED_NS`]
//! (a pyprobe that runs but no longer drains), so that a wedged consumer costs the
//! target that long at most, as it did before the heartbeat had a thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::ring::RingReader;
use crate::tracer::clock::monotonic_ns;

/// How often the heartbeat thread stamps every ring.
const BEAT: Duration = Duration::from_millis(10);
/// The draining thread silent this long counts as wedged: no more beats.
const WEDGED_NS: u64 = 10_000_000_000;

/// The heartbeat words of the rings pyprobe reads, by ticket.
struct Hearts {
    next: u64,
    /// (ticket, address of the `heartbeat` word in pyprobe's mapping).
    words: Vec<(u64, usize)>,
}

static HEARTS: Mutex<Hearts> = Mutex::new(Hearts {
    next: 0,
    words: Vec::new(),
});
/// When the draining thread last went round its loop (CLOCK_MONOTONIC ns).
static PROGRESS_NS: AtomicU64 = AtomicU64::new(0);
static STARTED: OnceLock<bool> = OnceLock::new();

/// Keeps a ring's heartbeat beaten while it lives. Declare it before the field
/// holding the ring's mapping: dropped first, it takes the word out of the
/// heartbeat thread's hands (under its lock) before the mapping goes.
#[derive(Debug)]
pub struct BeatTicket(u64);

impl Drop for BeatTicket {
    fn drop(&mut self) {
        let mut hearts = HEARTS.lock().unwrap_or_else(|e| e.into_inner());
        hearts.words.retain(|&(ticket, _)| ticket != self.0);
    }
}

/// Beats `reader`'s heartbeat from now on, until the ticket is dropped. The
/// mapping behind `reader` must outlive the ticket.
pub fn keep_beating(reader: &RingReader) -> BeatTicket {
    note_progress();
    start_thread();
    let mut hearts = HEARTS.lock().unwrap_or_else(|e| e.into_inner());
    hearts.next += 1;
    let ticket = hearts.next;
    hearts.words.push((ticket, reader.heartbeat_address()));
    BeatTicket(ticket)
}

/// Says the draining thread is going round its loop (cheap: one store).
pub(crate) fn note_progress() {
    PROGRESS_NS.store(monotonic_ns(), Ordering::Relaxed);
}

fn start_thread() {
    STARTED.get_or_init(|| {
        crate::tracer::signals::spawn_helper("pyprobe-heartbeat", beat_forever).is_ok()
    });
}

fn beat_forever() {
    // Not the policy or CPU of the thread that started it (which may be following
    // a traced thread's CPU under SCHED_IDLE): a beat must not wait for pyprobe's
    // busy thread to be scheduled.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain system calls on this thread, with valid arguments.
    unsafe {
        libc::sched_setscheduler(0, libc::SCHED_OTHER, &param);
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        for cpu in 0..libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut all);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &all);
    }
    loop {
        std::thread::sleep(BEAT);
        let silent = monotonic_ns().saturating_sub(PROGRESS_NS.load(Ordering::Relaxed));
        if silent > WEDGED_NS {
            continue;
        }
        // SAFETY: rdtsc has no preconditions on x86-64.
        let now = unsafe { core::arch::x86_64::_rdtsc() };
        let hearts = HEARTS.lock().unwrap_or_else(|e| e.into_inner());
        for &(_, word) in &hearts.words {
            // SAFETY: the word is 8-aligned inside a ring mapping that stays mapped
            // while its ticket is registered, and the ticket is dropped (under this
            // lock) before the mapping.
            unsafe { AtomicU64::from_ptr(word as *mut u64) }.store(now, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_is_beaten_while_its_ticket_lives_and_not_after() {
        let len = crate::ring::format::ring_bytes(8, crate::ring::Slots::Records).expect("size");
        // u64s: the ring must be 8-aligned.
        let mut mem = vec![0u64; len / 8];
        // SAFETY: u64 to bytes, same allocation.
        let bytes = unsafe { std::slice::from_raw_parts_mut(mem.as_mut_ptr().cast::<u8>(), len) };
        crate::ring::format::init_ring(bytes, 8, crate::ring::Slots::Records).expect("init");
        // SAFETY: the buffer outlives the reader and the ticket (both dropped below).
        let reader = unsafe { RingReader::new(mem.as_mut_ptr().cast(), len) }.expect("ring");
        let word = reader.heartbeat_address();
        // SAFETY: the word is inside `mem`, alive until the end of the test.
        let read = || unsafe { AtomicU64::from_ptr(word as *mut u64) }.load(Ordering::Acquire);
        let ticket = keep_beating(&reader);
        let before = read();
        let beaten = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(5));
            note_progress();
            read() > before
        });
        assert!(beaten, "the heartbeat thread never stamped the ring");
        drop(ticket);
        // Once the ticket is gone, at most a beat already under way lands.
        std::thread::sleep(BEAT * 3);
        let after = read();
        std::thread::sleep(BEAT * 5);
        assert_eq!(
            read(),
            after,
            "a ring was beaten after its ticket was dropped"
        );
        drop(reader);
        drop(mem);
    }
}
