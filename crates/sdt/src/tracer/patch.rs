//! Turning probes on and off in one process image: semaphores raised and lowered by
//! read-modify-write, `int3` written over each site's `nop` and the `nop` put back.

use std::collections::HashMap;
use std::io;

use crate::process::memory::ProcessMemory;

use super::guardian::{Guardian, Op};
use super::ring_engine::dead_raises::{undo_dead_raises, DeadRaises};
use super::ring_engine::leftovers::Leftovers;
use crate::probe_set::{ProbeSet, Refusal};
use crate::ring::RingReader;

/// Tells the guardian, if there is one. What it cannot be told must not be patched.
fn tell(guard: &mut Option<&mut Guardian>, op: Op, pid: i32, addr: u64) -> io::Result<()> {
    match guard {
        Some(g) => g.tell(op, pid, addr),
        None => Ok(()),
    }
}

pub(crate) const NOP: u8 = 0x90;
pub(crate) const INT3: u8 = 0xcc;

/// Most a semaphore may hold when pyprobe raises it: a count of tracers, never
/// a pointer or other data a wrong address would find there.
pub(crate) const MAX_SEMAPHORE: u16 = 1024;

/// Why a semaphore holding `value` must not be raised, if so.
pub fn check_semaphore(addr: u64, value: u16) -> Result<(), String> {
    if value > MAX_SEMAPHORE {
        return Err(format!(
            "semaphore {addr:#x} refused: it holds {value}, not a count of tracers (at most \
             {MAX_SEMAPHORE}); the address may not be a semaphore"
        ));
    }
    Ok(())
}

/// The probes installed in one address space, and what must be undone.
#[derive(Debug, Clone, Default)]
pub struct Patches {
    pub set: ProbeSet,
    /// Runtime site address → (probe index, site index).
    pub sites: HashMap<u64, (usize, usize)>,
    /// Sites holding our `int3` now.
    written: Vec<u64>,
    /// Semaphores we raised by one.
    raised: Vec<u64>,
    /// Budgeted semaphores lowered back for now (see [`Patches::pause_budgeted`]).
    paused: Vec<u64>,
    /// Everything left alone, with the reason: what the set's builder refused, and
    /// semaphores found holding more than a count at install time (their probes
    /// are not armed).
    pub(crate) refusals: Vec<Refusal>,
    /// Sites that held something else than a `nop` or a ring jump pyprobe can
    /// vouch for, with why they were left alone.
    pub(crate) jump_refusals: Vec<(u64, String)>,
    /// Sites that held a jump left by a pyprobe that died, put back to their
    /// original code and armed.
    pub(crate) taken_over: Vec<u64>,
    /// Sites of probes not armed that held such a jump, put back to their
    /// original code (a pyprobe that traced what this one does not leaves the
    /// target as it found it).
    pub(crate) put_back: Vec<u64>,
    /// Raises of the object's semaphores that a pyprobe killed with its guardian
    /// left listed in its ring, undone before this one raised any.
    pub(crate) dead_raises: DeadRaises,
}

impl Patches {
    /// Raises each probe's semaphore and writes `int3` over each site, in that order
    /// for each probe. A site whose byte is not `0x90` is refused (left alone): the
    /// resume-after-the-nop trick would be wrong there; unless it holds a ring jump
    /// that a pyprobe which died left behind, which is undone first (see
    /// [`Leftovers`]; only when attaching, with every thread stopped).
    pub fn install(
        set: ProbeSet,
        mem: &mut ProcessMemory,
        mut guard: Option<&mut Guardian>,
    ) -> io::Result<Patches> {
        let mut patches = Patches {
            refusals: set.refused.clone(),
            set,
            ..Patches::default()
        };
        if let Err(e) = patches.arm(mem, &mut guard) {
            // Never leave half an installation behind.
            let _ = patches.remove(mem, guard);
            return Err(e);
        }
        Ok(patches)
    }

    fn arm(
        &mut self,
        mem: &mut ProcessMemory,
        guard: &mut Option<&mut Guardian>,
    ) -> io::Result<()> {
        let pid = mem.pid();
        let mut leftovers = Leftovers::default();
        let ours = self.set.all_semaphores();
        if !ours.is_empty() {
            if let Ok(maps) = leftovers.maps(pid) {
                self.dead_raises = undo_dead_raises(mem, maps, &ours);
            }
        }
        for (pi, probe) in self.set.probes.clone().iter().enumerate() {
            if let Some(sem) = probe.semaphore {
                if !self.raised.contains(&sem) {
                    let value = mem.read_u16(sem)?;
                    if let Err(reason) = check_semaphore(sem, value) {
                        // Neither raised nor armed: nothing is written for this probe.
                        self.refusals.push(Refusal {
                            address: sem,
                            probe: probe.name.clone(),
                            reason: format!("{reason}; probe {} not armed", probe.name),
                        });
                        continue;
                    }
                    tell(guard, Op::SemaphoreRaised, pid, sem)?;
                    if let Err(e) = mem.write(sem, &(value + 1).to_le_bytes()) {
                        let _ = tell(guard, Op::SemaphoreLowered, pid, sem);
                        return Err(e);
                    }
                    self.raised.push(sem);
                }
            }
            for (si, site) in probe.sites.iter().enumerate() {
                let mut byte = [0u8];
                mem.read(site.address, &mut byte)?;
                if byte[0] != NOP {
                    match leftovers.take_over(mem, site.address, byte[0]) {
                        Ok(()) => self.taken_over.push(site.address),
                        Err(why) => {
                            self.jump_refusals.push((site.address, why));
                            continue;
                        }
                    }
                }
                tell(guard, Op::SiteArmed, pid, site.address)?;
                if let Err(e) = mem.write(site.address, &[INT3]) {
                    let _ = tell(guard, Op::SiteRestored, pid, site.address);
                    return Err(e);
                }
                self.written.push(site.address);
                self.sites.insert(site.address, (pi, si));
            }
        }
        for &site in &self.set.unarmed_sites {
            let mut byte = [0u8];
            // Anything but a jump pyprobe can vouch for is left as it is.
            if mem.read(site, &mut byte).is_ok()
                && byte[0] != NOP
                && leftovers.take_over(mem, site, byte[0]).is_ok()
            {
                self.put_back.push(site);
            }
        }
        Ok(())
    }

    /// Puts every `nop` back and lowers every semaphore raised. Goes on after an error
    /// so as much as possible is undone; returns the first error.
    pub(crate) fn remove(
        &mut self,
        mem: &mut ProcessMemory,
        mut guard: Option<&mut Guardian>,
    ) -> io::Result<()> {
        let pid = mem.pid();
        let mut first_error = None;
        // Semaphores first: the sites stop being reached, then the bytes go back.
        for sem in self.raised.drain(..) {
            match adjust_semaphore(mem, sem, -1) {
                Ok(()) => {
                    let _ = tell(&mut guard, Op::SemaphoreLowered, pid, sem);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        for addr in self.written.drain(..) {
            match mem.write(addr, &[NOP]) {
                Ok(()) => {
                    let _ = tell(&mut guard, Op::SiteRestored, pid, addr);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        // Paused semaphores are at their original value already.
        self.paused.clear();
        self.sites.clear();
        first_error.map_or(Ok(()), Err)
    }

    /// Lowers the semaphores of the budgeted probes that we raised: CPython stops
    /// reaching their sites (the `int3`s stay, harmless). Returns how many.
    pub(crate) fn pause_budgeted(
        &mut self,
        mem: &mut ProcessMemory,
        guard: Option<&mut Guardian>,
        ring: Option<&RingReader>,
    ) -> io::Result<usize> {
        let sems = self.semaphores_of(&self.set.budgeted);
        self.pause_semaphores(mem, guard, ring, sems)
    }

    /// Lowers the semaphores of the probes an overhead budget thins to counts,
    /// when even counting them costs more than the budget: their hits stop.
    pub(crate) fn pause_counted(
        &mut self,
        mem: &mut ProcessMemory,
        guard: Option<&mut Guardian>,
        ring: Option<&RingReader>,
    ) -> io::Result<usize> {
        let sems = self.semaphores_of(&self.set.count_when_thin);
        self.pause_semaphores(mem, guard, ring, sems)
    }

    fn pause_semaphores(
        &mut self,
        mem: &mut ProcessMemory,
        mut guard: Option<&mut Guardian>,
        ring: Option<&RingReader>,
        sems: Vec<u64>,
    ) -> io::Result<usize> {
        let pid = mem.pid();
        let mut paused = 0;
        for sem in sems {
            let Some(i) = self.raised.iter().position(|&s| s == sem) else {
                continue;
            };
            // Taken back from the ring's producers first: lowered once, by whoever
            // took it (a producer that let go of it already did).
            if ring.and_then(|r| r.take_held(sem)) != Some(false) {
                adjust_semaphore(mem, sem, -1)?;
            }
            self.raised.swap_remove(i);
            self.paused.push(sem);
            let _ = tell(&mut guard, Op::SemaphoreLowered, pid, sem);
            paused += 1;
        }
        Ok(paused)
    }

    /// Raises again what [`Patches::pause_budgeted`] and [`Patches::pause_counted`]
    /// lowered.
    pub(crate) fn resume_budgeted(
        &mut self,
        mem: &mut ProcessMemory,
        mut guard: Option<&mut Guardian>,
        ring: Option<&RingReader>,
    ) -> io::Result<usize> {
        let pid = mem.pid();
        let mut resumed = 0;
        while let Some(sem) = self.paused.pop() {
            let Some(value) = self.value_to_raise_again(mem, sem)? else {
                continue;
            };
            tell(&mut guard, Op::SemaphoreRaised, pid, sem)?;
            if let Err(e) = mem.write(sem, &(value + 1).to_le_bytes()) {
                let _ = tell(&mut guard, Op::SemaphoreLowered, pid, sem);
                return Err(e);
            }
            self.raised.push(sem);
            if let Some(ring) = ring {
                ring.set_held(sem);
            }
            resumed += 1;
        }
        Ok(resumed)
    }

    /// Takes every semaphore pyprobe raised back from `ring`'s producers (see
    /// `held` in the ring format), before pyprobe lowers them as it leaves: those a
    /// producer already lowered (it found pyprobe silent past `stale`) are not
    /// lowered again. Returns how many a producer had lowered.
    pub(crate) fn take_back(
        &mut self,
        ring: &RingReader,
        pid: i32,
        mut guard: Option<&mut Guardian>,
    ) -> usize {
        let before = self.raised.len();
        self.raised.retain(|&sem| {
            if ring.take_held(sem) == Some(false) {
                let _ = tell(&mut guard, Op::SemaphoreLowered, pid, sem);
                return false;
            }
            true
        });
        before - self.raised.len()
    }

    /// Raises again the semaphores `ring`'s producers lowered while pyprobe still
    /// counts them raised (it was silent past `stale`: stopped or starved of
    /// CPU), and gives them back to the producers. The guardian still counts
    /// each raised once, as it is again. Returns how many.
    pub(crate) fn raise_let_go(
        &mut self,
        ring: &RingReader,
        mem: &mut ProcessMemory,
    ) -> io::Result<usize> {
        let let_go: Vec<u64> = (self.raised.iter().copied())
            .filter(|&sem| ring.is_held(sem) == Some(false))
            .collect();
        let mut raised = 0;
        for sem in let_go {
            let Some(value) = self.value_to_raise_again(mem, sem)? else {
                continue;
            };
            mem.write(sem, &(value + 1).to_le_bytes())?;
            ring.set_held(sem);
            raised += 1;
        }
        Ok(raised)
    }

    /// The value of semaphore `sem`, pyprobe's raise of which was undone, if it
    /// may be raised again; else (changed since: not a count of tracers) it is
    /// left, its hits stop, and the refusal is kept.
    fn value_to_raise_again(
        &mut self,
        mem: &mut ProcessMemory,
        sem: u64,
    ) -> io::Result<Option<u16>> {
        let value = mem.read_u16(sem)?;
        match check_semaphore(sem, value) {
            Ok(()) => Ok(Some(value)),
            Err(reason) => {
                self.refusals.push(Refusal {
                    address: sem,
                    probe: String::new(),
                    reason,
                });
                Ok(None)
            }
        }
    }

    fn semaphores_of(&self, probes: &[usize]) -> Vec<u64> {
        let mut sems: Vec<u64> = probes
            .iter()
            .filter_map(|&i| self.set.probes.get(i).and_then(|p| p.semaphore))
            .collect();
        sems.sort_unstable();
        sems.dedup();
        sems
    }

    /// Hands the site at `addr` over to another mechanism (the ring engine, which has
    /// written its own patch there): it is no longer an `int3` to catch or restore.
    /// Returns its (probe index, site index).
    pub(crate) fn take_site(&mut self, addr: u64) -> Option<(usize, usize)> {
        let at = self.sites.remove(&addr)?;
        self.written.retain(|&a| a != addr);
        Some(at)
    }

    /// Takes back a site handed over with [`Patches::take_site`], now holding our
    /// `int3` again (in a forked child traced on its own).
    pub(crate) fn give_site(&mut self, addr: u64, at: (usize, usize)) {
        self.sites.insert(addr, at);
        self.written.push(addr);
    }

    /// Forgets what was written without touching memory (the image is gone: exec).
    pub(crate) fn forget(&mut self) {
        self.written.clear();
        self.raised.clear();
        self.paused.clear();
        self.sites.clear();
    }

    pub(crate) fn installed_sites(&self) -> usize {
        self.written.len()
    }

    pub fn is_active(&self) -> bool {
        !self.written.is_empty() || !self.raised.is_empty()
    }

    /// Addresses of the sites holding `int3` and the semaphores raised (for a guardian
    /// or a forked child that must be cleaned).
    pub(crate) fn undo_list(&self) -> (&[u64], &[u64]) {
        (&self.written, &self.raised)
    }

    /// The semaphores raised, and those lowered for the overhead budget for now
    /// (raised again when it allows).
    pub(crate) fn semaphores(&self) -> (&[u64], &[u64]) {
        (&self.raised, &self.paused)
    }
}

/// Adds `delta` to a 2-byte semaphore counter: read, add, write back. Never an absolute
/// write: other tracers may hold the semaphore too.
pub(crate) fn adjust_semaphore(mem: &mut ProcessMemory, addr: u64, delta: i32) -> io::Result<()> {
    let value = mem.read_u16(addr)?;
    let new = if delta >= 0 {
        value.saturating_add(delta as u16)
    } else {
        value.saturating_sub(delta.unsigned_abs() as u16)
    };
    mem.write(addr, &new.to_le_bytes())
}

/// Cleans a forked child's copy of the parent's patches (same addresses, own memory).
pub(crate) fn clean_copy(
    written: &[u64],
    raised: &[u64],
    mem: &mut ProcessMemory,
) -> io::Result<()> {
    let mut first_error = None;
    for &addr in written {
        if let Err(e) = mem.write(addr, &[NOP]) {
            first_error.get_or_insert(e);
        }
    }
    for &sem in raised {
        if let Err(e) = adjust_semaphore(mem, sem, -1) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}
