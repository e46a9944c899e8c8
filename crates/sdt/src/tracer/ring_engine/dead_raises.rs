//! Semaphore raises a pyprobe killed together with its guardian left behind.
//!
//! Such a pyprobe's ring lists, in its header, each semaphore it raised with a
//! flag that is 1 while that raise is still to be undone (see `held` in the ring
//! format). The target's producers undo them when they find the ring full and
//! unserved; a probe that fires rarely (GC, imports) never fills it, so its
//! raise stays. A later pyprobe, attaching with every thread stopped, undoes
//! those raises here, before it raises anything of its own: swaps each flag to 0
//! and lowers that semaphore by one, never below 0. Whoever clears a flag first
//! undoes that raise, so a guardian that wakes later lowers nothing twice.
//!
//! Everything read is the target's: only a ring of this pyprobe's format, listing
//! this very process as its owner, whose consumer said it was alive and has been
//! silent longer than its producers wait, is looked at; and only semaphores of
//! the probes of this object (`ours`) are ever written.

use crate::process::maps::MapEntry;
use crate::process::memory::ProcessMemory;
use crate::ring::format::{
    HEADER_SIZE, H_ALIVE, H_HEARTBEAT, H_HELD, H_HELD_COUNT, H_OWNER, H_STALE, MAX_HELD,
};
use crate::ring::Slots;

use super::reuse::{check_ring_mapping, RING_PATH};
use super::tsc::read_tsc;
use super::CAPACITY;
use crate::tracer::patch::check_semaphore;

/// What undoing a dead pyprobe's raises came to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct DeadRaises {
    /// Semaphores lowered by one (the same one twice if two rings held it).
    pub lowered: Vec<u64>,
    /// Raises that could not be undone, with why.
    pub failed: Vec<String>,
}

/// Undoes in `mem`'s process (every thread stopped) the raises of the semaphores
/// `ours` that the rings in `maps` list as still held by a pyprobe that died.
pub(crate) fn undo_dead_raises(
    mem: &mut ProcessMemory,
    maps: &[MapEntry],
    ours: &[u64],
) -> DeadRaises {
    let mut done = DeadRaises::default();
    let pid = mem.pid();
    for ring in maps.iter().filter(|m| m.path == RING_PATH) {
        let at = ring.start;
        if check_ring_mapping(mem, maps, at, RING_PATH, CAPACITY, Slots::Records).is_err() {
            continue;
        }
        let mut header = vec![0u8; HEADER_SIZE];
        if mem.read(at, &mut header).is_err() {
            continue;
        }
        let word = |offset: usize| {
            header
                .get(offset..offset + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0)
        };
        let silent = read_tsc().checked_sub(word(H_HEARTBEAT));
        if word(H_OWNER) != pid as u64
            || word(H_ALIVE) != 1
            || silent.is_none_or(|s| s <= word(H_STALE))
        {
            continue;
        }
        let count = (word(H_HELD_COUNT) as usize).min(MAX_HELD);
        for k in 0..count {
            let sem = word(H_HELD + 16 * k);
            if word(H_HELD + 16 * k + 8) != 1 || !ours.contains(&sem) {
                continue;
            }
            let flag = at + (H_HELD + 16 * k + 8) as u64;
            match lower(mem, flag, sem) {
                Ok(true) => done.lowered.push(sem),
                Ok(false) => {}
                Err(why) => done.failed.push(format!(
                    "a raise left by a pyprobe killed with its guardian (ring at {at:#x}) is \
                     not undone: {why}"
                )),
            }
        }
    }
    done
}

/// Clears the flag at `flag`, then lowers the semaphore `sem` by one unless it
/// is 0 already (`Ok(false)`: nothing to undo) or holds more than a count.
fn lower(mem: &mut ProcessMemory, flag: u64, sem: u64) -> Result<bool, String> {
    mem.write(flag, &0u64.to_le_bytes()).map_err(|e| {
        format!("the flag at {flag:#x} of semaphore {sem:#x} could not be cleared: {e}")
    })?;
    let value = mem
        .read_u16(sem)
        .map_err(|e| format!("semaphore {sem:#x} could not be read: {e}"))?;
    if value == 0 {
        return Ok(false);
    }
    check_semaphore(sem, value)?;
    mem.write(sem, &(value - 1).to_le_bytes())
        .map_err(|e| format!("semaphore {sem:#x} could not be lowered: {e}"))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;
    use crate::process::maps::read_maps;
    use crate::ring::format::{init_ring, ring_bytes};

    /// A ring of this pyprobe's format in this very process, as a target would
    /// hold one: a shared mapping of a memfd named as pyprobe names its rings.
    fn ring_here() -> memmap2::MmapMut {
        let len = ring_bytes(CAPACITY, Slots::Records).expect("ring size");
        // SAFETY: a NUL-terminated name; the descriptor is owned below.
        let fd = unsafe { libc::memfd_create(c"pyprobe-ring".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: fd was just created and is ours alone.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(len as u64).expect("size the memfd");
        // SAFETY: a fresh memfd nothing else maps or resizes.
        let mut map = unsafe { memmap2::MmapMut::map_mut(file.as_raw_fd()) }.expect("map");
        init_ring(&mut map, CAPACITY, Slots::Records).expect("format");
        map
    }

    fn put(map: &mut [u8], offset: usize, value: u64) {
        map[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
    }

    fn get(map: &[u8], offset: usize) -> u64 {
        u64::from_le_bytes(map[offset..offset + 8].try_into().unwrap())
    }

    /// Only a dead consumer's raises of this process's own semaphores are undone,
    /// each once, never below 0, and one holding more than a count is left alone.
    #[test]
    fn only_a_dead_owners_raises_of_our_semaphores_are_undone() {
        let pid = std::process::id() as i32;
        let mut map = ring_here();
        // A: ours, raised by the dead one and another tracer; B: ours, listed as
        // not held; C: held, but not one of ours; D: ours, let go already; E: ours,
        // holding more than a count.
        let sems: Box<[u16; 5]> = Box::new([2, 1, 1, 0, 2000]);
        let at = |k: usize| sems.as_ptr() as u64 + 2 * k as u64;
        let ours = [at(0), at(1), at(3), at(4)];
        let held = [(at(0), 1), (at(1), 0), (at(2), 1), (at(3), 1), (at(4), 1)];
        for (k, &(sem, flag)) in held.iter().enumerate() {
            put(&mut map, H_HELD + 16 * k, sem);
            put(&mut map, H_HELD + 16 * k + 8, flag);
        }
        put(&mut map, H_HELD_COUNT, held.len() as u64);
        // Some seconds of cycles: a beat of this test stays fresh on a loaded
        // machine, one at 0 is stale on any machine up for longer than that.
        put(&mut map, H_STALE, 10_000_000_000);
        let mut mem = ProcessMemory::new(pid);
        let undo =
            |mem: &mut ProcessMemory| undo_dead_raises(mem, &read_maps(pid).expect("maps"), &ours);
        // Another process's ring, a consumer that left, one that beats (just
        // now): untouched.
        for (owner, alive, beats) in [(pid + 1, 1, false), (pid, 0, false), (pid, 1, true)] {
            let beat = if beats { read_tsc() } else { 0 };
            put(&mut map, H_OWNER, owner as u64);
            put(&mut map, H_ALIVE, alive);
            put(&mut map, H_HEARTBEAT, beat);
            assert_eq!(
                undo(&mut mem),
                DeadRaises::default(),
                "{owner} {alive} {beat}"
            );
            // SAFETY: the semaphores' memory was written through /proc, not Rust.
            let values = unsafe { std::ptr::read_volatile(&*sems) };
            assert_eq!(values, [2, 1, 1, 0, 2000]);
        }
        put(&mut map, H_OWNER, pid as u64);
        put(&mut map, H_ALIVE, 1);
        put(&mut map, H_HEARTBEAT, 0);
        let done = undo(&mut mem);
        assert_eq!(done.lowered, vec![at(0)]);
        assert_eq!(done.failed.len(), 1, "{:?}", done.failed);
        assert!(done.failed[0].contains("holds 2000"), "{:?}", done.failed);
        // SAFETY: as above.
        let values = unsafe { std::ptr::read_volatile(&*sems) };
        assert_eq!(values, [1, 1, 1, 0, 2000]);
        let flags: Vec<u64> = (0..5).map(|k| get(&map, H_HELD + 16 * k + 8)).collect();
        assert_eq!(flags, [0, 0, 1, 0, 0]);
        // Each raise once: a second look finds nothing left to undo.
        assert_eq!(undo(&mut mem), DeadRaises::default());
    }
}
