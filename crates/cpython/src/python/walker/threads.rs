//! Native thread ids of thread states.
//!
//! 3.11+ stores `native_thread_id` in the thread state. Before that only `thread_id`,
//! the thread's `pthread_t`, is there: on x86-64 glibc (and musl) that is the address of
//! the thread's `struct pthread`, which starts with a pointer to itself and holds the
//! kernel tid at a fixed offset (0x2d0 on glibc 2.26+). pyprobe finds that offset once,
//! by checking candidates against the process's live task ids, so it needs no ptrace
//! (no `fs_base`) and no libc symbols. When nothing checks out, the tid is `None`.
//!
//! Tids as the target numbers them (in its PID namespace) are translated to the ones
//! pyprobe sees through `/proc/PID/task/TID/status` (`NSpid`).

use std::collections::{HashMap, HashSet};

use pyprobe_sdt::sdt::MemoryReader;

/// glibc ≥ 2.26's `offsetof(struct pthread, tid)` on x86-64, tried first.
const GLIBC_TID_OFFSET: u64 = 0x2d0;
/// How much of a `struct pthread` is searched for the tid.
const PTHREAD_SEARCH: usize = 0x800;

/// Tid translation for one process.
#[derive(Debug, Default)]
pub(crate) struct Tids {
    pid: i32,
    /// Whether the target lives in another PID namespace than pyprobe.
    namespaced: bool,
    /// Whether the task list was read in this round (see [`Tids::begin_round`]).
    refreshed: bool,
    /// Tid as the target sees it → tid as pyprobe sees it; refreshed on a miss.
    inner_to_outer: HashMap<i32, i32>,
    /// `offsetof(struct pthread, tid)`: `None` not searched yet, `Some(None)` not found.
    pthread_tid_offset: Option<Option<u64>>,
}

/// `/proc/PID/task`: (tid as pyprobe sees it, tid in the target's own namespace).
/// Each task's status is read only when they differ (`namespaced`): with 10,000
/// threads, reading them all took 200 ms, with the target stopped.
fn read_tasks(pid: i32, namespaced: bool) -> Vec<(i32, i32)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let tids = dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok());
    if !namespaced {
        return tids.map(|tid| (tid, tid)).collect();
    }
    tids.map(|tid| {
        let inner = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("NSpid:"))
                    .and_then(|ids| ids.split_whitespace().last()?.parse().ok())
            })
            .unwrap_or(tid);
        (tid, inner)
    })
    .collect()
}

impl Tids {
    pub fn new(pid: i32, namespaced: bool) -> Tids {
        Tids {
            pid,
            namespaced,
            ..Tids::default()
        }
    }

    /// Starts a round of lookups (one `stacks()` call): the task list is read at most
    /// once per round.
    pub(crate) fn begin_round(&mut self) {
        self.refreshed = false;
    }

    fn refresh(&mut self) {
        self.refreshed = true;
        self.inner_to_outer = read_tasks(self.pid, self.namespaced)
            .into_iter()
            .map(|(o, i)| (i, o))
            .collect();
    }

    /// The tid pyprobe sees for the target's `inner` tid. Without a PID namespace
    /// between them that is `inner` itself; else `None` when no live task has it.
    pub(crate) fn outer(&mut self, inner: i32) -> Option<i32> {
        if !self.namespaced {
            return Some(inner);
        }
        if !self.inner_to_outer.contains_key(&inner) && !self.refreshed {
            self.refresh();
        }
        self.inner_to_outer.get(&inner).copied()
    }

    /// Inner tids of `pthread_t`s, through the tid field of `struct pthread`.
    pub(crate) fn inner_of_pthreads<M: MemoryReader + ?Sized>(
        &mut self,
        mem: &M,
        pthreads: &[u64],
    ) -> Vec<Option<i32>> {
        if self.pthread_tid_offset.is_none() {
            self.refresh();
            let live: HashSet<i32> = self.inner_to_outer.keys().copied().collect();
            let found = find_tid_offset(mem, pthreads, &live);
            // While the interpreter starts, its thread state may not have its pthread_t
            // yet: a failure is final only once there was a real pthread_t to test.
            if found.is_some() || pthreads.iter().any(|&t| t != 0) {
                self.pthread_tid_offset = Some(found);
            }
        }
        let Some(Some(offset)) = self.pthread_tid_offset else {
            return vec![None; pthreads.len()];
        };
        pthreads
            .iter()
            .map(|&t| {
                if t == 0 || t % 8 != 0 {
                    return None;
                }
                let mut b = [0u8; 4];
                mem.read_exact(t + offset, &mut b).ok()?;
                Some(i32::from_le_bytes(b)).filter(|&tid| tid > 0)
            })
            .collect()
    }
}

/// The offset of the tid in `struct pthread`: one where every thread that is a TCB
/// (starts with a pointer to itself) gives a distinct live tid, and at least half of
/// them do. glibc's known offset first, then every 4-byte slot.
pub(crate) fn find_tid_offset<M: MemoryReader + ?Sized>(
    mem: &M,
    pthreads: &[u64],
    live: &HashSet<i32>,
) -> Option<u64> {
    let blocks: Vec<Vec<u8>> = pthreads
        .iter()
        .filter(|&&t| t != 0 && t % 8 == 0)
        .filter_map(|&t| {
            let mut block = vec![0u8; PTHREAD_SEARCH];
            mem.read_exact(t, &mut block).ok()?;
            (block[..8] == t.to_le_bytes()).then_some(block)
        })
        .collect();
    if blocks.is_empty() {
        return None;
    }
    let fits = |offset: usize| {
        let mut seen = HashSet::new();
        let mut matched = 0;
        for block in &blocks {
            let tid = i32::from_le_bytes(block[offset..offset + 4].try_into().unwrap_or_default());
            if live.contains(&tid) {
                if !seen.insert(tid) {
                    return false;
                }
                matched += 1;
            }
        }
        matched > 0 && matched * 2 >= blocks.len()
    };
    std::iter::once(GLIBC_TID_OFFSET as usize)
        .chain((8..PTHREAD_SEARCH - 4).step_by(4))
        .find(|&o| fits(o))
        .map(|o| o as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    struct Blocks(Vec<(u64, Vec<u8>)>);

    impl MemoryReader for Blocks {
        fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
            for (base, data) in &self.0 {
                if address >= *base && address + buf.len() as u64 <= base + data.len() as u64 {
                    let at = (address - base) as usize;
                    buf.copy_from_slice(&data[at..at + buf.len()]);
                    return Ok(());
                }
            }
            Err(io::Error::from(io::ErrorKind::InvalidInput))
        }
    }

    fn pthread(base: u64, tid_at: usize, tid: i32) -> (u64, Vec<u8>) {
        let mut data = vec![0u8; PTHREAD_SEARCH];
        data[..8].copy_from_slice(&base.to_le_bytes());
        data[16..24].copy_from_slice(&base.to_le_bytes());
        data[tid_at..tid_at + 4].copy_from_slice(&tid.to_le_bytes());
        (base, data)
    }

    #[test]
    fn finds_glibc_and_other_offsets() {
        let live: HashSet<i32> = [100, 101, 102].into();
        let mem = Blocks(vec![
            pthread(0x1000, 0x2d0, 100),
            pthread(0x9000, 0x2d0, 101),
        ]);
        assert_eq!(find_tid_offset(&mem, &[0x1000, 0x9000], &live), Some(0x2d0));
        let mem = Blocks(vec![pthread(0x1000, 0x38, 101), pthread(0x9000, 0x38, 102)]);
        assert_eq!(find_tid_offset(&mem, &[0x1000, 0x9000], &live), Some(0x38));
        // Not a TCB (no self pointer), unreadable, or no live tid anywhere: not found.
        let mut not_tcb = pthread(0x1000, 0x2d0, 100);
        not_tcb.1[0] = 1;
        assert_eq!(
            find_tid_offset(&Blocks(vec![not_tcb]), &[0x1000], &live),
            None
        );
        assert_eq!(find_tid_offset(&Blocks(vec![]), &[0x1000], &live), None);
        let mem = Blocks(vec![pthread(0x1000, 0x2d0, 7)]);
        assert_eq!(find_tid_offset(&mem, &[0x1000], &live), None);
    }
}
