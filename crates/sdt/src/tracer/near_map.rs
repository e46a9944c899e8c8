//! Fresh memory within rel32 reach of code: a jump written over the code lands in
//! it, and a jump from it returns. The nearest free gaps of the address space are
//! tried, a page away from their neighbours, never over anything mapped
//! (`MAP_FIXED_NOREPLACE`).

use std::ops::Range;

use anyhow::{bail, Result};

use crate::process::maps::MapEntry;
use crate::process::PAGE_SIZE;
use crate::tracer::inject::Injector;

/// How close mapped memory must lie to the code it serves: rel32 reach, with room
/// for the memory itself.
pub(crate) const REACH: u64 = (1 << 31) - (64 << 20);
/// Nothing is mapped below this address (the kernel refuses low pages anyway).
const LOWEST: u64 = 1 << 20;
/// Gaps tried at most (each try is an injected `mmap`).
const TRIES: usize = 8;

/// What is mapped, and for what.
pub struct NearMap<'a> {
    /// Every address a jump to or from the memory starts or lands at.
    pub code: Range<u64>,
    pub size: u64,
    pub prot: i32,
    /// Names the code and the memory in the error: "the code", "the trampolines".
    pub code_name: &'a str,
    pub what: &'a str,
}

/// Maps `want.size` bytes of private anonymous memory (`want.prot`) in the free gap
/// nearest `want.code` that lies within [`REACH`] of all of it. Returns its address.
pub fn map_near(inj: &Injector, maps: &[MapEntry], want: &NearMap<'_>) -> Result<u64> {
    for at in candidates(maps, &want.code, want.size)
        .into_iter()
        .take(TRIES)
    {
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE;
        match inj.mmap(at, want.size, want.prot, flags, -1) {
            Ok(got) if got == at => return Ok(at),
            Ok(got) => {
                // An old kernel took the address as a hint only: give it back.
                let _ = inj.call("munmap", libc::SYS_munmap, [got, want.size, 0, 0, 0, 0]);
            }
            Err(_) => continue,
        }
    }
    bail!(
        "no free address within 2 GiB of {} at {:#x} for {}",
        want.code_name,
        want.code.start,
        want.what
    )
}

/// Where `size` bytes could go, nearest `code` first: each gap's two ends, a page
/// from its neighbours, within reach of every address of `code`.
fn candidates(maps: &[MapEntry], code: &Range<u64>, size: u64) -> Vec<u64> {
    let mut spans: Vec<(u64, u64)> = maps.iter().map(|m| (m.start, m.end)).collect();
    spans.sort_unstable();
    let reach = |at: u64| {
        at >= LOWEST
            && at >= code.end.saturating_sub(REACH)
            && at.saturating_add(size) <= code.start.saturating_add(REACH)
    };
    let mut found = Vec::new();
    for w in spans.windows(2) {
        let gap_start = w[0].1.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let gap_end = w[1].0 / PAGE_SIZE * PAGE_SIZE;
        if gap_end <= gap_start || gap_end - gap_start < size + 2 * PAGE_SIZE {
            continue;
        }
        for at in [gap_start + PAGE_SIZE, gap_end - PAGE_SIZE - size] {
            if reach(at) {
                found.push(at);
            }
        }
    }
    found.sort_unstable_by_key(|&at| at.abs_diff(code.start));
    found.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(start: u64, end: u64) -> MapEntry {
        MapEntry {
            start,
            end,
            readable: true,
            writable: false,
            executable: true,
            shared: false,
            offset: 0,
            dev: (0, 0),
            inode: 0,
            path: String::new(),
        }
    }

    #[test]
    fn the_nearest_gap_end_comes_first_a_page_from_its_neighbours() {
        let code = 0x5000_0000..0x5000_2000;
        let maps = [
            map(0x1000_0000, 0x1000_1000),
            map(0x5000_0000, 0x5000_2000),
            map(0x5000_5000, 0x5000_6000),
            map(0x5001_0000, 0x5001_1000),
        ];
        let found = candidates(&maps, &code, 0x2000);
        // Below the code, a page under it; then above the mapping after it (the
        // gap between the two holds 0x2000 but not with a page on each side).
        assert_eq!(found[..2], [0x4fff_d000, 0x5000_7000], "{found:#x?}");
        assert!(!found
            .iter()
            .any(|at| (0x5000_2000..0x5000_5000).contains(at)));
        assert!(found.iter().all(|&at| at.abs_diff(code.start) < REACH));
    }

    #[test]
    fn nothing_out_of_reach_or_too_low() {
        let code = 0x7f00_0000_0000..0x7f00_0000_1000;
        let maps = [
            map(0x10_0000, 0x11_0000),
            map(0x7f00_0000_0000, 0x7f00_0000_1000),
        ];
        // The gap's two ends: one just above 1 MiB (out of reach), one just below
        // the code.
        let found = candidates(&maps, &code, 0x1000);
        assert_eq!(found, vec![0x7f00_0000_0000 - 0x2000]);
        let low_code = 0x1000..0x2000;
        let maps = [map(0x1000, 0x2000), map(0x10_0000, 0x10_1000)];
        assert!(candidates(&maps, &low_code, 0x1000).is_empty());
    }
}
