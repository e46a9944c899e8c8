//! Attaching again: the ring, tag word and trampolines an earlier pyprobe left in
//! the process are used again, so that attaching and detaching any number of times
//! leaves one ring and one trampoline region per code segment mapped, not one more
//! per attach.
//!
//! Nothing pyprobe maps in the target is unmapped (a thread interrupted by a signal
//! inside a trampoline keeps that rip in its signal frame, where ptrace does not
//! show it). What is left, and how it is found again:
//!
//! * **Trampoline regions**: private anonymous `r-x` mappings starting with a
//!   [`RegionHeader`] (marker, checksum, every trampoline ever written in the region
//!   and the site it serves), which names the ring and the tag word its trampolines
//!   use.
//! * **The tag word**: the first 4 bytes of a private anonymous writable page whose
//!   bytes at [`NAME_AT`] are [`RING_NAME`] (the memfd's name, kept there for
//!   `memfd_create`).
//! * **The ring**: a `MAP_SHARED` mapping of a memfd named [`RING_NAME`] at the
//!   header's `ring_addr`, exactly [`ring_bytes`]`(CAPACITY)` long, whose header has
//!   pyprobe's magic, this version, slot and header size and `CAPACITY`.
//!
//! Everything read is the target's and treated as hostile: bounded reads, every
//! field checked, and any doubt means a new ring and new trampolines, as on a first
//! attach, with the reason said under `-v`.
//!
//! # The ring: replaced where it stands
//!
//! pyprobe needs a `MAP_SHARED` view of the ring, and cannot open another process's
//! mapping (`/proc/PID/map_files` needs privileges a tracer lacks). So the old ring
//! is not reopened: a new memfd is made in the target, formatted by pyprobe
//! ([`init_zeroed_ring`](crate::ring::init_zeroed_ring), before the target can see it), and mapped
//! over the old ring with `MAP_FIXED`, at the same address and of the same length,
//! then its descriptor closed. The target keeps no descriptor of pyprobe's; the old
//! memfd's pages are freed with its last mapping (the earlier pyprobe's went with
//! it); and a forked child, whose inherited ring mapping shares its parent's memfd,
//! gets a memfd of its own instead of writing into its parent's. The tag word is
//! private memory (a child has its own copy): the current pid is written into it, so
//! records name the process that wrote them.
//!
//! This is done only with every thread stopped (as all of the set-up), and only
//! when nothing can be writing into the old ring: no thread's rip is inside any
//! region of pyprobe's, no site listed by a region using that ring holds its jump,
//! no probe site's jump was refused at install (such a jump leads to trampolines
//! that could not be vouched for), and every region carrying the marker has a valid
//! header. A thread interrupted by a signal inside a trampoline, which ptrace does
//! not show, resumes code whose every address is still mapped, writable and of the
//! same size: at worst it publishes one stale record into the new ring (the
//! consumer checks each record), never a fault in the target.
//!
//! # Trampolines: used again only where identical
//!
//! A thread interrupted by a signal inside a trampoline returns into it, so a byte
//! of a trampoline that a thread may ever have entered must never change. The
//! header lists every trampoline written in its region before any site jumps to one
//! (see [`crate::ring::region`]); so the rule is: a region is used again only if
//! every site the new session patches in that segment is listed in it, with the
//! same original bytes, and the trampoline built for it now, at the listed address
//! (same ring, same tag word, same probe), is byte for byte what is already there.
//! Then nothing in the region is written at all: no code, no header, no
//! `mprotect`. Otherwise the session gets a new region, as on a first attach (a
//! changed probe selection or a new pyprobe version costs one more region, once:
//! the next attach with the same selection finds it). The jump written at each site
//! is then the one the header describes, so a pyprobe killed later leaves jumps the
//! next one takes over as before.

use std::collections::HashMap;

use crate::process::maps::MapEntry;
use crate::process::memory::ProcessMemory;
use crate::ring::format::{
    HEADER_SIZE, H_CAPACITY, H_HEADER_SIZE, H_MAGIC, H_SLOT_SIZE, H_VERSION, MAGIC, VERSION,
};
use crate::ring::region::{self, RegionHeader};
use crate::ring::{ring_bytes, Slots};

use super::leftovers::read_header;
use super::setup::{CAPACITY, PAGE};

/// The ring memfd's name; also the marker of the tag word's page.
pub(crate) const RING_NAME: &[u8] = b"pyprobe-ring\0";
/// Where in the tag word's page the name lies.
pub const NAME_AT: u64 = 64;
/// The ring's path in `/proc/PID/maps`.
pub(crate) const RING_PATH: &str = "/memfd:pyprobe-ring (deleted)";
/// Most marked regions looked at (each costs one read of a header).
const MAX_REGIONS: usize = 64;

/// What an earlier pyprobe left that this one can use again.
#[derive(Debug)]
pub struct Earlier {
    pub(crate) ring_addr: u64,
    pub(crate) tag_addr: u64,
    /// The regions whose trampolines write to that ring: (address, header).
    pub(crate) regions: Vec<(u64, RegionHeader)>,
}

/// Finds what an earlier pyprobe left in the process (every thread stopped, at
/// `rips`), if it can be used again; `Ok(None)` if there is nothing, `Err(why)` if
/// there is something that cannot be trusted or used.
pub fn find(
    mem: &ProcessMemory,
    maps: &[MapEntry],
    rips: &[(i32, u64)],
    jumps_refused: usize,
) -> Result<Option<Earlier>, String> {
    let mut regions = Vec::new();
    for m in maps.iter().filter(|m| region_like(m)) {
        let mut magic = [0u8; 8];
        if mem.read(m.start, &mut magic).is_err() || magic != region::MAGIC {
            continue;
        }
        if regions.len() == MAX_REGIONS {
            return Err(format!(
                "more than {MAX_REGIONS} trampoline regions of pyprobe's are mapped"
            ));
        }
        let header = read_header(mem, m.start).map_err(|e| {
            format!(
                "the trampoline region at {:#x} has an unusable header: {e}",
                m.start
            )
        })?;
        if m.start
            .checked_add(header.region_len)
            .is_none_or(|end| end > m.end)
        {
            return Err(format!(
                "the trampoline region at {:#x} is longer than its mapping",
                m.start
            ));
        }
        regions.push((m.start, m.end, header));
    }
    if regions.is_empty() {
        return Ok(None);
    }
    if let Some((tid, rip)) = rips
        .iter()
        .find(|(_, rip)| regions.iter().any(|(s, e, _)| (*s..*e).contains(rip)))
    {
        return Err(format!(
            "thread {tid} stands in an earlier pyprobe's trampolines (at {rip:#x})"
        ));
    }
    if jumps_refused > 0 {
        return Err(format!(
            "{jumps_refused} probe sites hold jumps that could not be taken over"
        ));
    }
    // The rings named by the regions, most used first.
    let mut uses: HashMap<(u64, u64), usize> = HashMap::new();
    for (_, _, h) in &regions {
        *uses.entry((h.ring_addr, h.tag_addr)).or_default() += 1;
    }
    let mut rings: Vec<((u64, u64), usize)> = uses.into_iter().collect();
    rings.sort_unstable_by_key(|&((ring, tag), n)| (std::cmp::Reverse(n), ring, tag));
    let mut why_not = String::new();
    for ((ring_addr, tag_addr), _) in rings {
        let found = check_ring(mem, maps, ring_addr)
            .and_then(|()| check_tag(mem, maps, tag_addr))
            .and_then(|()| {
                let mine: Vec<(u64, RegionHeader)> = regions
                    .iter()
                    .filter(|(_, _, h)| h.ring_addr == ring_addr && h.tag_addr == tag_addr)
                    .map(|(at, _, h)| (*at, h.clone()))
                    .collect();
                check_no_jumps(mem, &mine)?;
                Ok(mine)
            });
        match found {
            Ok(regions) => {
                return Ok(Some(Earlier {
                    ring_addr,
                    tag_addr,
                    regions,
                }))
            }
            Err(why) if why_not.is_empty() => why_not = why,
            Err(_) => {}
        }
    }
    Err(why_not)
}

/// Whether `m` could be a trampoline region (or hold a hook page): private
/// anonymous read-only code.
pub fn region_like(m: &MapEntry) -> bool {
    m.executable
        && !m.writable
        && !m.shared
        && m.inode == 0
        && m.path.is_empty()
        && m.start % PAGE == 0
}

/// The ring at `ring_addr`: a whole shared mapping of pyprobe's memfd, of the
/// length this pyprobe's rings have, with a header this pyprobe formats.
fn check_ring(mem: &ProcessMemory, maps: &[MapEntry], ring_addr: u64) -> Result<(), String> {
    check_ring_mapping(mem, maps, ring_addr, RING_PATH, CAPACITY, Slots::Records)
}

/// Whether `at` starts a whole shared mapping of the memfd whose path in
/// `/proc/PID/maps` is `path`, of the length of a ring of `capacity` slots, whose
/// header this pyprobe formats (the SDT ring's and the hook's).
pub fn check_ring_mapping(
    mem: &ProcessMemory,
    maps: &[MapEntry],
    at: u64,
    path: &str,
    capacity: u64,
    slots: Slots,
) -> Result<(), String> {
    let bytes = ring_bytes(capacity, slots).map_err(|e| e.to_string())? as u64;
    let m = maps
        .iter()
        .find(|m| m.start == at)
        .ok_or_else(|| format!("nothing is mapped where the earlier ring was ({at:#x})"))?;
    if m.path != path
        || !m.shared
        || !m.readable
        || !m.writable
        || m.executable
        || m.offset != 0
        || m.end - m.start != bytes
    {
        return Err(format!(
            "the mapping at {at:#x} is not a ring of this pyprobe's ({} bytes, {:?})",
            m.end - m.start,
            m.path
        ));
    }
    let mut header = [0u8; 32];
    mem.read(at, &mut header)
        .map_err(|e| format!("reading the earlier ring: {e}"))?;
    check_ring_header(&header, capacity, slots)
}

/// Whether the first 32 bytes of a ring are the header of a ring of `capacity`
/// slots of `slots` that this pyprobe formats.
pub(crate) fn check_ring_header(header: &[u8], capacity: u64, slots: Slots) -> Result<(), String> {
    let u32_at = |at: usize| {
        header
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |at: usize| {
        header.get(at..at + 8).map(|b| {
            let mut w = [0u8; 8];
            w.copy_from_slice(b);
            u64::from_le_bytes(w)
        })
    };
    let fields = (|| {
        Some((
            u64_at(H_MAGIC)?,
            u32_at(H_VERSION)?,
            u32_at(H_SLOT_SIZE)?,
            u64_at(H_CAPACITY)?,
            u32_at(H_HEADER_SIZE)?,
        ))
    })();
    let Some((magic, version, slot, cap, head)) = fields else {
        return Err("the earlier ring's header is cut short".into());
    };
    if magic != MAGIC {
        return Err(format!("the earlier ring has magic {magic:#018x}"));
    }
    if version != VERSION {
        return Err(format!(
            "the earlier ring is of version {version}, this pyprobe's of {VERSION}"
        ));
    }
    if slot as usize != slots.size() || head as usize != HEADER_SIZE || cap != capacity {
        return Err(format!(
            "the earlier ring has {cap} slots of {slot} bytes after {head}, this pyprobe's \
             {capacity} of {} after {HEADER_SIZE}",
            slots.size()
        ));
    }
    Ok(())
}

/// The tag word at `tag_addr`: the start of a private anonymous writable page
/// marked with the ring's name.
fn check_tag(mem: &ProcessMemory, maps: &[MapEntry], tag_addr: u64) -> Result<(), String> {
    if is_marked_page(mem, maps, tag_addr, RING_NAME) {
        Ok(())
    } else {
        Err(format!(
            "the earlier tag word at {tag_addr:#x} is not on a page of pyprobe's"
        ))
    }
}

/// Whether `at` starts a page of private anonymous writable memory holding `name`
/// at [`NAME_AT`] (the SDT ring's tag word's page, the hook's state page).
pub fn is_marked_page(mem: &ProcessMemory, maps: &[MapEntry], at: u64, name: &[u8]) -> bool {
    let fits = at % PAGE == 0
        && maps.iter().any(|m| {
            m.start <= at
                && at + PAGE <= m.end
                && m.readable
                && m.writable
                && !m.executable
                && !m.shared
                && m.inode == 0
                && m.path.is_empty()
        });
    let mut now = vec![0u8; name.len()];
    fits && mem.read(at + NAME_AT, &mut now).is_ok() && now == name
}

/// No site listed by `regions` holds its jump: nothing runs their trampolines.
fn check_no_jumps(mem: &ProcessMemory, regions: &[(u64, RegionHeader)]) -> Result<(), String> {
    for (at, header) in regions {
        for entry in &header.sites {
            let Some(patch) = entry.patch() else { continue };
            let mut now = vec![0u8; patch.len()];
            if mem.read(entry.site, &mut now).is_ok() && now == patch {
                return Err(format!(
                    "site {:#x} still jumps into the trampolines at {at:#x}",
                    entry.site
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::init_ring;

    #[test]
    fn a_ring_header_is_checked_field_by_field() {
        let mut ring = vec![0u8; ring_bytes(4, Slots::Records).unwrap()];
        init_ring(&mut ring, 4, Slots::Records).unwrap();
        assert_eq!(check_ring_header(&ring[..32], 4, Slots::Records), Ok(()));
        assert!(check_ring_header(&ring[..32], 4, Slots::Units).is_err());
        assert!(check_ring_header(&ring[..32], 8, Slots::Records).is_err());
        assert!(check_ring_header(&ring[..20], 4, Slots::Records).is_err());
        for at in [H_MAGIC, H_VERSION, H_SLOT_SIZE, H_CAPACITY, H_HEADER_SIZE] {
            let mut bad = ring[..32].to_vec();
            bad[at] ^= 0x40;
            assert!(
                check_ring_header(&bad, 4, Slots::Records).is_err(),
                "field at {at}"
            );
        }
    }

    #[test]
    fn random_ring_headers_never_panic() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..64 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = check_ring_header(&bytes, CAPACITY, Slots::Records);
        }
    }
}
