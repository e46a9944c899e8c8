//! Probe sites that do not hold their `nop` at install: a jump that a pyprobe which
//! died left there is recognised by its trampoline region's header and put back to
//! the original code; anything else is refused, with why.

use std::collections::HashMap;

use crate::process::maps::{read_maps, MapEntry};
use crate::process::memory::ProcessMemory;
use crate::ring::region::{self, jump_target, RegionHeader};
use crate::ring::site::PATCH_LEN;

use super::setup::PAGE;

/// Probe sites that do not hold their `nop` at install: a jump that a pyprobe
/// which died left there is put back to the original code; anything else is
/// refused, with why. Every thread of the process must be stopped (attaching).
#[derive(Debug, Default)]
pub struct Leftovers {
    maps: Option<Vec<MapEntry>>,
    /// The threads' instruction pointers, or why they could not all be read.
    rips: Option<Result<Vec<u64>, String>>,
    /// Trampoline regions read so far, by address.
    regions: HashMap<u64, Result<RegionHeader, String>>,
}

/// How far below a jump's target its region's header may lie.
const MAX_REGION_PAGES: u64 = region::MAX_REGION_LEN / PAGE;

impl Leftovers {
    /// Puts the original bytes back at `site` (one of the object's probe sites: the
    /// caller's), whose byte is `found`, if it holds a jump into a region of
    /// pyprobe's trampolines whose header lists it. Returns why not otherwise: the
    /// site is then left as it is.
    pub(crate) fn take_over(
        &mut self,
        mem: &mut ProcessMemory,
        site: u64,
        found: u8,
    ) -> Result<(), String> {
        let pid = mem.pid();
        if found == 0xcc {
            return Err(
                "holds an int3, not its nop (0x90): a breakpoint of another tool, or of \
                 a pyprobe killed together with its guardian; left as it is"
                    .into(),
            );
        }
        if found != 0xe9 {
            return Err(format!(
                "holds {found:#04x}, not its nop (0x90) nor a jump of pyprobe's (another tool \
                 may have patched it); left as it is"
            ));
        }
        let mut head = [0u8; PATCH_LEN];
        mem.read(site, &mut head)
            .map_err(|e| format!("holds a jump, but {e}"))?;
        let target = jump_target(site, &head).ok_or("not a jump")?;
        let (at, header) = self
            .region(mem, target)
            .map_err(|why| format!("holds a jump to {target:#x}, {why}; left as it is"))?;
        let entry = header.find(site).ok_or_else(|| {
            format!(
                "holds a jump into pyprobe's trampolines at {at:#x}, whose header does not \
                 list this site; left as it is"
            )
        })?;
        let patch = entry
            .patch()
            .filter(|_| entry.tramp == target)
            .ok_or_else(|| {
                format!(
                    "holds a jump to {target:#x}, but the header at {at:#x} lists trampoline \
                     {:#x} for it; left as it is",
                    entry.tramp
                )
            })?;
        let mut now = vec![0u8; patch.len()];
        mem.read(site, &mut now)
            .map_err(|e| format!("holds a jump, but {e}"))?;
        if now != patch {
            return Err(format!(
                "holds a jump into pyprobe's trampolines at {at:#x}, but not the bytes their \
                 header describes; left as it is"
            ));
        }
        let end = site.saturating_add(patch.len() as u64);
        match self.rips(pid) {
            Ok(rips) if rips.iter().any(|&rip| rip > site && rip < end) => {
                return Err(format!(
                    "holds pyprobe's jump, but a thread of process {pid} stands inside it; \
                     left as it is"
                ))
            }
            Ok(_) => {}
            Err(why) => return Err(format!("holds pyprobe's jump, but {why}; left as it is")),
        }
        // Every thread is stopped and none inside the jump: one write, never seen half done.
        mem.write(site, &entry.original)
            .map_err(|e| format!("holds pyprobe's jump, but {e}"))
    }

    /// The process's mappings, read once.
    pub(crate) fn maps(&mut self, pid: i32) -> Result<&[MapEntry], String> {
        if self.maps.is_none() {
            self.maps = Some(read_maps(pid).map_err(|e| format!("{e:#}"))?);
        }
        Ok(self.maps.as_deref().unwrap_or_default())
    }

    /// The header of the pyprobe trampoline region holding `target`: the nearest
    /// page start at or below it with the marker, in the same mapping.
    fn region(&mut self, mem: &ProcessMemory, target: u64) -> Result<(u64, RegionHeader), String> {
        let pid = mem.pid();
        let m = self
            .maps(pid)?
            .iter()
            .find(|m| m.start <= target && target < m.end)
            .ok_or("where nothing is mapped")?;
        // pyprobe's regions are anonymous, private and read-only code.
        if !m.executable || m.writable || m.inode != 0 || !m.path.is_empty() {
            return Err(format!(
                "in {} ({:#x}..{:#x}), not pyprobe's trampolines",
                if m.path.is_empty() {
                    "a mapping"
                } else {
                    &m.path
                },
                m.start,
                m.end
            ));
        }
        let mut page = target & !(PAGE - 1);
        for _ in 0..MAX_REGION_PAGES {
            if page < m.start {
                break;
            }
            let mut magic = [0u8; 8];
            if mem.read(page, &mut magic).is_ok() && magic == region::MAGIC {
                let header = self
                    .regions
                    .entry(page)
                    .or_insert_with(|| read_header(mem, page))
                    .clone()
                    .map_err(|e| {
                        format!("whose pyprobe trampoline header at {page:#x} is unusable: {e}")
                    })?;
                if target >= page.saturating_add(header.region_len) {
                    return Err(format!(
                        "past the end of the pyprobe trampoline region at {page:#x}"
                    ));
                }
                return Ok((page, header));
            }
            page = page.wrapping_sub(PAGE);
        }
        Err("in code without pyprobe's trampoline marker".into())
    }

    fn rips(&mut self, pid: i32) -> Result<&[u64], String> {
        let rips = self.rips.get_or_insert_with(|| {
            let tids = crate::process::status::thread_ids(pid).map_err(|e| format!("{e:#}"))?;
            tids.into_iter()
                .map(|t| {
                    nix::sys::ptrace::getregs(nix::unistd::Pid::from_raw(t))
                        .map(|r| r.rip)
                        .map_err(|e| format!("thread {t} of process {pid} is not stopped ({e})"))
                })
                .collect()
        });
        rips.as_deref().map_err(Clone::clone)
    }
}

/// Reads and checks the header of the region at `page` (bounded by its format).
pub(super) fn read_header(mem: &ProcessMemory, page: u64) -> Result<RegionHeader, String> {
    let mut prefix = [0u8; region::PREFIX_LEN];
    mem.read(page, &mut prefix).map_err(|e| e.to_string())?;
    let len = RegionHeader::announced_len(&prefix).map_err(|e| e.to_string())?;
    let mut bytes = vec![0u8; len];
    mem.read(page, &mut bytes).map_err(|e| e.to_string())?;
    RegionHeader::parse(&bytes, page).map_err(|e| e.to_string())
}
