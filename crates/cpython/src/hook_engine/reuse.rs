//! Attaching again: the hook page, state page and ring an earlier pyprobe left in
//! the process are used again, so that attaching and detaching any number of times
//! leaves one of each mapped, not one more set per attach.
//!
//! Nothing the hook maps is unmapped when pyprobe leaves: a thread may be inside a
//! callback (waiting for room, or interrupted by a signal there), and the target's
//! function objects and thread states point into the page. What is left is found
//! again by the page's header ([`HOOK_MAGIC`], then the state page's and the ring's
//! addresses), checked field by field as hostile memory:
//!
//! * the page is private anonymous read-and-execute code, none of whose bytes
//!   changes: it is used again only if the hook built now for the same three
//!   addresses is byte for byte what is there (and so is the detour after it on the
//!   monitoring route); nothing is written into it;
//! * the state page is private anonymous writable memory marked with the ring's
//!   memfd name (a forked child's is all zero: `MADV_WIPEONFORK`);
//! * the ring is a whole shared mapping of pyprobe's memfd with pyprobe's header.
//!   It is replaced where it stands, as the SDT ring is (`tracer::ring_engine::reuse`): a
//!   new memfd mapped over it with `MAP_FIXED`, so its pages go with the old one.
//!
//! The state words say whether the earlier hook is still in (`gone` clear, `status`
//! OK: its `sys.monitoring` registration or the threads' profile functions and its
//! exit callback stand, and setting `on` again resumes them), or out (`gone` set and
//! `status` removed; or never installed; or failed), when it goes in afresh as on a
//! first attach. Both callbacks and installer say so before any call they make
//! (`gone` is taken, `status` set to running), so with every thread stopped and none
//! inside the page, no thread is half-way through either. Anything else (a thread in
//! the page, `on` still set, an uninstall or install under way) means a new set, as
//! on a first attach, with the reason said under `-v`.

use crate::hook::{
    HEADER_RING, HEADER_STATE, HOOK_MAGIC, STATE_LEN, STATUS_FAILED, STATUS_OK, STATUS_REMOVED,
    STATUS_RUNNING, ST_AT_EXIT, ST_GONE, ST_ON, ST_STATUS,
};
use pyprobe_sdt::process::maps::MapEntry;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::Slots;
use pyprobe_sdt::tracer::ring_engine::reuse::{check_ring_mapping, is_marked_page, region_like};

use super::setup::{PAGE, REGION, UNITS};

/// The ring memfd's name; also the marker of the state page, at
/// [`NAME_AT`] there as in the SDT ring's tag word page.
pub(crate) const RING_NAME: &[u8] = b"pyprobe-hook\0";
pub use pyprobe_sdt::tracer::ring_engine::reuse::NAME_AT;
/// The ring's path in `/proc/PID/maps`.
const RING_PATH: &str = "/memfd:pyprobe-hook (deleted)";
/// Most hook pages looked at (each costs one read), and most pages of one mapping
/// searched for them (anonymous mappings of equal protection merge).
const MAX_PAGES: usize = 64;
const MAX_MAPPING_PAGES: u64 = 256;

/// What the state words say the new session must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resume {
    /// The earlier hook is still in: setting `on` again resumes it.
    Registered,
    /// The earlier hook is out, or never went in: its words are cleared and it goes
    /// in as on a first attach.
    Afresh,
}

/// An earlier pyprobe's hook, fit to be used again if its page is what would be
/// built now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Earlier {
    pub(crate) addr: u64,
    pub(crate) state_addr: u64,
    pub(crate) ring_addr: u64,
    pub(crate) resume: Resume,
}

/// The earlier hooks in the process (every thread stopped, at `rips`) that can be
/// used again, and for those that cannot, why.
pub(crate) fn find(
    mem: &ProcessMemory,
    maps: &[MapEntry],
    rips: &[u64],
) -> (Vec<Earlier>, Vec<String>) {
    let (mut fit, mut unfit) = (Vec::new(), Vec::new());
    for addr in hook_pages(mem, maps) {
        match check(mem, maps, rips, addr) {
            Ok(earlier) => fit.push(earlier),
            Err(why) => unfit.push(format!("the earlier hook at {addr:#x}: {why}")),
        }
    }
    (fit, unfit)
}

/// Addresses of pages starting with the hook's marker in private anonymous code
/// mappings.
fn hook_pages(mem: &ProcessMemory, maps: &[MapEntry]) -> Vec<u64> {
    let mut found = Vec::new();
    for m in maps.iter().filter(|m| region_like(m)) {
        let pages = ((m.end - m.start) / PAGE).min(MAX_MAPPING_PAGES);
        for k in 0..pages {
            let at = m.start + k * PAGE;
            let mut magic = [0u8; 8];
            if mem.read(at, &mut magic).is_ok() && &magic == HOOK_MAGIC {
                found.push(at);
                if found.len() == MAX_PAGES {
                    return found;
                }
            }
        }
    }
    found
}

/// Whether the hook at `addr` can be used again, and how.
fn check(
    mem: &ProcessMemory,
    maps: &[MapEntry],
    rips: &[u64],
    addr: u64,
) -> Result<Earlier, String> {
    let within = |at: u64, len: u64| {
        maps.iter().any(|m| {
            m.start <= at && at.checked_add(len).is_some_and(|end| end <= m.end) && region_like(m)
        })
    };
    if !within(addr, REGION) {
        return Err(format!("its {REGION} bytes are not one code mapping"));
    }
    if let Some(rip) = rips.iter().find(|&&r| (addr..addr + REGION).contains(&r)) {
        return Err(format!("a thread stands in it (at {rip:#x})"));
    }
    let word = |at: u64| {
        mem.read_u64(at)
            .map_err(|e| format!("reading {at:#x}: {e}"))
    };
    let state_addr = word(addr + HEADER_STATE)?;
    let ring_addr = word(addr + HEADER_RING)?;
    check_state_page(mem, maps, state_addr)?;
    check_ring(mem, maps, ring_addr)?;
    let on = word(state_addr + ST_ON as u64)?;
    let gone = word(state_addr + ST_GONE as u64)?;
    let status = word(state_addr + ST_STATUS as u64)?;
    let at_exit = word(state_addr + ST_AT_EXIT as u64)?;
    Ok(Earlier {
        addr,
        state_addr,
        ring_addr,
        resume: resume_of(on, gone, status, at_exit)?,
    })
}

/// What the state words `on`, `gone`, `status` and the exit callback's say.
pub(crate) fn resume_of(on: u64, gone: u64, status: u64, at_exit: u64) -> Result<Resume, String> {
    if on != 0 {
        return Err("its `on` word is set (a pyprobe may still serve it)".into());
    }
    match (gone, status) {
        (0, STATUS_OK) => Ok(Resume::Registered),
        (0, STATUS_RUNNING) => Err("its installer is running".into()),
        (0, s) if s == 0 || s > STATUS_FAILED => afresh(at_exit),
        (1, STATUS_REMOVED) => afresh(at_exit),
        (1, _) => Err("it is being uninstalled".into()),
        (g, s) => Err(format!("its state words read gone {g}, status {s:#x}")),
    }
}

fn afresh(at_exit: u64) -> Result<Resume, String> {
    if at_exit != 0 {
        return Err("it is out, yet holds an exit callback".into());
    }
    Ok(Resume::Afresh)
}

/// The state pages: private anonymous writable memory marked with the ring's name,
/// mapped for the whole of [`STATE_LEN`] (the hook writes its tables up to there).
fn check_state_page(mem: &ProcessMemory, maps: &[MapEntry], at: u64) -> Result<(), String> {
    let end = at.saturating_add(STATE_LEN as u64);
    let whole = maps
        .iter()
        .any(|m| m.start <= at && end <= m.end && m.writable);
    if is_marked_page(mem, maps, at, RING_NAME) && whole {
        Ok(())
    } else {
        Err(format!("its state pages at {at:#x} are not pyprobe's"))
    }
}

/// The ring: a whole shared mapping of pyprobe's hook memfd, of the length this
/// pyprobe's hook rings have, with a header this pyprobe formats.
fn check_ring(mem: &ProcessMemory, maps: &[MapEntry], at: u64) -> Result<(), String> {
    check_ring_mapping(mem, maps, at, RING_PATH, UNITS, Slots::Units)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_hook_at_rest_is_used_again() {
        // Still in: resumed as it is.
        assert_eq!(resume_of(0, 0, STATUS_OK, 0x1000), Ok(Resume::Registered));
        // Out, never in, or failed: afresh.
        assert_eq!(resume_of(0, 1, STATUS_REMOVED, 0), Ok(Resume::Afresh));
        assert_eq!(resume_of(0, 0, 0, 0), Ok(Resume::Afresh));
        assert_eq!(resume_of(0, 0, STATUS_FAILED + 2, 0), Ok(Resume::Afresh));
        // Served, half-way through installing or uninstalling, or inconsistent.
        assert!(resume_of(1, 0, STATUS_OK, 0).is_err());
        assert!(resume_of(0, 0, STATUS_RUNNING, 0).is_err());
        assert!(resume_of(0, 1, STATUS_OK, 0).is_err());
        assert!(resume_of(0, 1, STATUS_REMOVED, 0x1000).is_err());
        assert!(resume_of(0, 0, STATUS_REMOVED, 0).is_err());
        assert!(resume_of(0, 2, STATUS_REMOVED, 0).is_err());
        assert!(resume_of(0, 0, STATUS_FAILED, 0).is_err());
    }
}
