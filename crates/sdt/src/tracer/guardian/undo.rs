//! What the guardian undoes in one process, and how: `int3` sites, semaphores and
//! ring jumps, written back through `/proc/PID/mem`. Apart from the listening loop
//! (`vigil`), which only gathers these records and calls on them once the tracer
//! is gone.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::time::Instant;

use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::process::status::start_time;
use crate::ring::format::{H_ALIVE, H_HELD, H_HELD_COUNT, H_OWNER, MAX_HELD};
use crate::tracer::patch::{INT3, NOP};

use super::{HOLD_LIMIT, TOOL_PAYLOAD, TOOL_WORDS};
use crate::process::hold::{hold, Held};

/// A ring site: the bytes to put back, and the jump that replaced them.
pub(super) struct RingSite {
    pub(super) original: Vec<u8>,
    pub(super) patch: Vec<u8>,
}

#[derive(Default)]
pub(super) struct Undo {
    pub(super) sites: HashSet<u64>,
    pub(super) ring: HashMap<u64, RingSite>,
    pub(super) semaphores: HashMap<u64, u32>,
    /// The `alive` word of each ring pyprobe serves in the process.
    pub(super) served: HashSet<u64>,
    /// `/proc/PID/mem`, opened while the tracer is alive so that undoing costs only
    /// reads and writes when every microsecond counts.
    pub(super) mem: Option<File>,
    /// The process's start time when `mem` was opened, so that the guardian never
    /// stops another process that got the same pid since.
    pub(super) started: Option<u64>,
    /// pyprobe's `sys.monitoring` tool, its events turned off by the program.
    pub(super) tool: Option<SilencedTool>,
}

/// What [`Op::ToolSilenced`](super::Op::ToolSilenced) told: where the tool's
/// events are wanted, and the words that hold it, with their values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SilencedTool {
    pub(super) tool: u8,
    monitors: u64,
    checked: usize,
    words: Vec<(u64, u64)>,
}

impl SilencedTool {
    #[cfg(test)]
    pub(super) fn new(tool: u8, monitors: u64, checked: usize, words: Vec<(u64, u64)>) -> Self {
        SilencedTool {
            tool,
            monitors,
            checked,
            words,
        }
    }

    /// Reads the message's payload; `None` when it does not make sense.
    pub(crate) fn from_payload(monitors: u64, payload: &[u8; TOOL_PAYLOAD]) -> Option<Self> {
        let count = usize::from(payload[0]);
        let tool = payload[1];
        let checked = usize::from(payload[2]);
        if count == 0 || count > TOOL_WORDS || tool > 7 || checked == 0 || checked > 64 {
            return None;
        }
        let word = |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().unwrap_or([0; 8]));
        let words = (0..count)
            .map(|k| (word(3 + 16 * k), word(3 + 16 * k + 8)))
            .collect();
        Some(SilencedTool {
            tool,
            monitors,
            checked,
            words,
        })
    }

    /// Frees the tool in `pid`, every thread stopped, if its events are still off
    /// and every word still holds what it held (else the program has done
    /// something since: left alone). Their references are left, as pyprobe does,
    /// so a few small objects leak. Returns whether it did.
    pub(super) fn free(&self, pid: i32, undo: &Undo) -> Result<bool, String> {
        use std::os::unix::fs::FileExt;
        let Some((mem, held)) = undo.hold_same(pid)? else {
            return Ok(false); // exited
        };
        let mut wanted = vec![0u8; self.checked];
        if mem.read_exact_at(&mut wanted, self.monitors).is_err() {
            return Err(format!(
                "its events table at {:#x} cannot be read",
                self.monitors
            ));
        }
        if wanted.iter().any(|&mask| mask & (1 << self.tool) != 0) {
            return Ok(false); // the program turned events on again
        }
        let holds = self.words.iter().all(|&(addr, value)| {
            let mut now = [0u8; 8];
            mem.read_exact_at(&mut now, addr).is_ok() && u64::from_le_bytes(now) == value
        });
        if !holds {
            return Ok(false);
        }
        let cleared = self
            .words
            .iter()
            .all(|&(addr, _)| mem.write_all_at(&0u64.to_le_bytes(), addr).is_ok());
        drop(held);
        if cleared {
            Ok(true)
        } else {
            Err("its words could not be written".into())
        }
    }
}

impl Undo {
    /// Its memory, and every thread of it held, if `pid` is still the process the
    /// guardian was told about (`None`: it exited); else why not.
    fn hold_same(&self, pid: i32) -> Result<Option<(&File, Held)>, String> {
        let Some(mem) = &self.mem else {
            return Err("its memory could not be opened".into());
        };
        let Some(started) = self.started else {
            return Err("its start time could not be read".into());
        };
        if start_time(pid) != Some(started) {
            return Ok(None);
        }
        let held = hold(pid, Instant::now() + HOLD_LIMIT)
            .map_err(|why| format!("its threads could not be stopped: {why}"))?;
        Ok(Some((mem, held)))
    }

    pub(super) fn open(&mut self, pid: i32) {
        if self.mem.is_none() {
            self.mem = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(format!("/proc/{pid}/mem"))
                .ok();
            self.started = start_time(pid);
        }
    }

    pub(super) fn lower(&self, sem: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(mem) = &self.mem else { return false };
        let mut b = [0u8; 2];
        if mem.read_exact_at(&mut b, sem).is_err() {
            return false;
        }
        let v = u16::from_le_bytes(b).saturating_sub(1);
        mem.write_all_at(&v.to_le_bytes(), sem).is_ok()
    }

    /// A ring site still holding the `int3` its jump was about to replace gets its
    /// `nop` back at once, like any `int3` site (one byte: safe with threads running).
    pub(super) fn restore_unpatched_ring(&self, site: u64, ring: &RingSite) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(mem) = &self.mem else { return false };
        let mut now = vec![0u8; ring.patch.len()];
        if mem.read_exact_at(&mut now, site).is_err() {
            return false;
        }
        match ring_fix(&now, ring) {
            Some(fix) if fix.len() == 1 => mem.write_all_at(fix, site).is_ok(),
            _ => false,
        }
    }

    fn read_word(&self, addr: u64) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 8];
        let mem = self.mem.as_ref()?;
        mem.read_exact_at(&mut b, addr).ok()?;
        Some(u64::from_le_bytes(b))
    }

    /// Takes pyprobe's semaphores back from the producers of every ring of
    /// `pid` it owns (see `held` in the ring format), once their `alive` is 0: a
    /// raise whose flag a producer already cleared (it found pyprobe silent and
    /// lowered it) is one fewer to undo; a flag still set is cleared before the
    /// guardian lowers its semaphore. Everything read is the target's: a
    /// listing that does not make sense is ignored. Returns the raises the
    /// target had undone.
    pub(super) fn take_back_held(&mut self, pid: i32) -> usize {
        let mut undone = 0;
        for &alive in &self.served {
            let base = alive.wrapping_sub(H_ALIVE as u64);
            if self.read_word(base + H_OWNER as u64) != Some(pid as u64) {
                continue;
            }
            let Some(count) = self.read_word(base + H_HELD_COUNT as u64) else {
                continue;
            };
            for k in 0..(count as usize).min(MAX_HELD) {
                let entry = base + (H_HELD + 16 * k) as u64;
                let (Some(sem), Some(held)) = (self.read_word(entry), self.read_word(entry + 8))
                else {
                    continue;
                };
                let Some(raises) = self.semaphores.get(&sem).copied().filter(|&n| n > 0) else {
                    continue;
                };
                if held == 0 {
                    self.semaphores.insert(sem, raises - 1);
                    undone += 1;
                } else {
                    self.write_word(entry + 8, 0);
                }
            }
        }
        undone
    }

    pub(super) fn write_word(&self, addr: u64, value: u64) -> bool {
        use std::os::unix::fs::FileExt;
        self.mem
            .as_ref()
            .is_some_and(|mem| mem.write_all_at(&value.to_le_bytes(), addr).is_ok())
    }

    pub(super) fn restore(&self, site: u64) -> bool {
        use std::os::unix::fs::FileExt;
        self.mem
            .as_ref()
            .is_some_and(|mem| mem.write_all_at(&[NOP], site).is_ok())
    }
}

/// What to write at a ring site found holding `now` to give it its original bytes
/// back: all of them over the jump; only the first over the `int3` that the jump
/// was about to replace (the tracer died between telling and writing); nothing
/// over anything else (restored already, or not pyprobe's any more).
pub(super) fn ring_fix<'a>(now: &[u8], site: &'a RingSite) -> Option<&'a [u8]> {
    let original = site.original.as_slice();
    if now == site.patch {
        Some(original)
    } else if now.first() == Some(&INT3) && now.get(1..) == original.get(1..) {
        original.get(..1)
    } else {
        None
    }
}

/// Puts the original bytes back at the ring sites of `pid`, with every thread of
/// it stopped. Returns how many it restored and, if it left some, how many and why.
pub(super) fn restore_ring(pid: i32, undo: &Undo) -> (usize, Option<(usize, String)>) {
    use std::os::unix::fs::FileExt;
    let all = undo.ring.len();
    let (mem, held) = match undo.hold_same(pid) {
        Ok(Some(held)) => held,
        Ok(None) => return (0, None), // exited: nothing left to restore
        Err(why) => return (0, Some((all, why))),
    };
    let mut rips = Vec::new();
    for &(tid, _) in &held.threads {
        match ptrace::getregs(Pid::from_raw(tid)) {
            Ok(regs) => rips.push(regs.rip),
            Err(e) => {
                return (
                    0,
                    Some((all, format!("its thread {tid} cannot be read: {e}"))),
                )
            }
        }
    }
    let mut restored = 0;
    let mut left = 0;
    for (&addr, site) in &undo.ring {
        let end = addr.saturating_add(site.original.len() as u64);
        // Only a signal frame could put a thread there; its code must stay.
        if rips.iter().any(|&rip| rip > addr && rip < end) {
            left += 1;
            continue;
        }
        let mut now = vec![0u8; site.patch.len()];
        if mem.read_exact_at(&mut now, addr).is_err() {
            left += 1;
            continue;
        }
        match ring_fix(&now, site) {
            Some(bytes) if mem.write_all_at(bytes, addr).is_ok() => restored += 1,
            Some(_) => left += 1,
            None => {}
        }
    }
    drop(held);
    let why = (left > 0).then(|| {
        (
            left,
            "a thread stood inside them, or their memory could not be read or written".into(),
        )
    });
    (restored, why)
}
