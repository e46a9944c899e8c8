//! The header at the start of every trampoline region.
//!
//! A pyprobe that dies without cleaning up (SIGKILL, and a guardian that could
//! not act) leaves its `jmp rel32`s at the probe sites. The header lets the
//! next pyprobe recognise such a jump as its own and put the original bytes
//! back: it marks the region as pyprobe's and lists, per site it serves, the
//! site, its trampoline and the bytes the jump replaced. It also names the
//! ring and tag word the trampolines write to, so a later pyprobe can find
//! them again. The region starts on a page, so the header is found by looking
//! at page starts below a jump's target.
//!
//! Whatever reads a header reads target memory: [`RegionHeader::parse`]
//! treats it as hostile (bounded sizes, checksum, and every listed original
//! must decode into the shape a site plan has).
//!
//! # Layout (little-endian)
//!
//! | offset | type | field |
//! | --- | --- | --- |
//! | 0  | 8 bytes | magic [`MAGIC`] (`"PYPRTRMP"`) |
//! | 8  | u32 | version [`VERSION`] |
//! | 12 | u32 | `header_len`: [`encoded_len`]`(count)` |
//! | 16 | u32 | `count`: sites listed, at most [`MAX_SITES`] |
//! | 20 | u32 | CRC-32 of the `header_len` bytes with this field zeroed |
//! | 24 | u64 | `region_len`: bytes of the region, header included |
//! | 32 | u64 | `ring_addr`: the ring the trampolines write to |
//! | 40 | u64 | `ring_len`: its mapping's length |
//! | 48 | u64 | `tag_addr`: the tag word they read |
//! | 56 | u64 | reserved, 0 |
//!
//! Then `count` entries of [`ENTRY_LEN`] bytes:
//!
//! | offset | type | field |
//! | --- | --- | --- |
//! | 0  | u64 | site address |
//! | 8  | u64 | trampoline address (inside the region, after the header) |
//! | 16 | u8  | `len`: bytes replaced, [`PATCH_LEN`] ..= [`MAX_PLAN_LEN`] |
//! | 17 | 7 bytes | reserved, 0 |
//! | 24 | 24 bytes | the original bytes, zero after `len` |

use iced_x86::{Decoder, DecoderOptions};
use thiserror::Error;

use super::site::{MAX_PLAN_LEN, PATCH_LEN};

/// `"PYPRTRMP"`: a region of pyprobe's trampolines.
pub(crate) const MAGIC: [u8; 8] = *b"PYPRTRMP";
/// Bumped on any incompatible change of this layout.
pub(crate) const VERSION: u32 = 1;
/// Bytes before the first entry.
pub(crate) const PREFIX_LEN: usize = 64;
/// Bytes per site entry.
pub(crate) const ENTRY_LEN: usize = 48;
/// Most sites one region lists (a header of at most 48 KiB).
pub(crate) const MAX_SITES: usize = 1024;
/// Largest region accepted: the header and [`MAX_SITES`] trampolines of 1 KiB.
pub(crate) const MAX_REGION_LEN: u64 = 2 << 20;
const ORIGINAL_LEN: usize = 24;
const _: () = assert!(MAX_PLAN_LEN <= ORIGINAL_LEN && 24 + ORIGINAL_LEN == ENTRY_LEN);

/// One site a region serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSite {
    pub(crate) site: u64,
    pub(crate) tramp: u64,
    /// The bytes the jump replaced, from the site's `nop` on.
    pub(crate) original: Vec<u8>,
}

impl RegionSite {
    /// The bytes the site holds while this trampoline serves it.
    pub fn patch(&self) -> Option<Vec<u8>> {
        jump_patch(self.site, self.tramp, self.original.len())
    }
}

/// What a trampoline region's header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionHeader {
    pub(crate) region_len: u64,
    pub(crate) ring_addr: u64,
    pub(crate) ring_len: u64,
    pub(crate) tag_addr: u64,
    pub sites: Vec<RegionSite>,
}

/// Why a header could not be written or read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RegionError {
    #[error("{0} bytes are too few for a trampoline region header")]
    Short(usize),
    #[error("no pyprobe trampoline marker")]
    BadMagic,
    #[error("trampoline header version {0}, this pyprobe reads version {VERSION}")]
    BadVersion(u32),
    #[error("trampoline header lists {0} sites, more than {MAX_SITES}")]
    TooManySites(usize),
    #[error("trampoline header length {got} does not match its {count} sites")]
    BadLength { got: u32, count: u32 },
    #[error("trampoline header checksum {got:#010x}, expected {expected:#010x}")]
    BadChecksum { got: u32, expected: u32 },
    #[error("trampoline region length {0} is out of bounds")]
    BadRegionLength(u64),
    #[error("entry {index}: {why}")]
    BadEntry { index: usize, why: String },
    #[error("site {0:#x} is listed twice")]
    Duplicate(u64),
}

/// Header bytes for `count` sites.
pub(crate) fn encoded_len(count: usize) -> usize {
    PREFIX_LEN + count * ENTRY_LEN
}

/// `jmp rel32` from `site` to `tramp`, padded with `int3` to `len` bytes
/// (as [`super::Trampoline::patch`]); `None` out of rel32 reach or for a bad `len`.
pub(crate) fn jump_patch(site: u64, tramp: u64, len: usize) -> Option<Vec<u8>> {
    if !(PATCH_LEN..=MAX_PLAN_LEN).contains(&len) {
        return None;
    }
    let rel = i32::try_from(tramp.wrapping_sub(site.wrapping_add(PATCH_LEN as u64)) as i64).ok()?;
    let mut patch = Vec::with_capacity(len);
    patch.push(0xe9);
    patch.extend_from_slice(&rel.to_le_bytes());
    patch.resize(len, 0xcc);
    Some(patch)
}

/// Where the `jmp rel32` in `bytes` (at `site`) leads, if that is what they hold.
pub(crate) fn jump_target(site: u64, bytes: &[u8]) -> Option<u64> {
    match bytes {
        [0xe9, a, b, c, d, ..] => {
            let rel = i32::from_le_bytes([*a, *b, *c, *d]) as i64;
            Some(site.wrapping_add(PATCH_LEN as u64).wrapping_add(rel as u64))
        }
        _ => None,
    }
}

/// Whether `original` (at `site`) has the shape of a site plan's bytes: the
/// site's `nop`, then whole instructions, the last one the first to reach
/// [`PATCH_LEN`] bytes. Anything else was not written by pyprobe.
pub(crate) fn check_original(site: u64, original: &[u8]) -> Result<(), String> {
    let len = original.len();
    if !(PATCH_LEN..=MAX_PLAN_LEN).contains(&len) {
        return Err(format!(
            "{len} original bytes (a site replaces {PATCH_LEN} to {MAX_PLAN_LEN})"
        ));
    }
    if original[0] != 0x90 {
        return Err(format!("original byte {:#04x} is not a nop", original[0]));
    }
    let mut decoder = Decoder::with_ip(
        64,
        &original[1..],
        site.wrapping_add(1),
        DecoderOptions::NONE,
    );
    let mut covered = 1;
    // Each instruction takes at least one byte: at most MAX_PLAN_LEN rounds.
    while decoder.can_decode() {
        if covered >= PATCH_LEN {
            return Err(format!(
                "original bytes go on after the first {covered}, enough for the jump"
            ));
        }
        let instr = decoder.decode();
        if instr.is_invalid() {
            return Err(format!(
                "original bytes do not decode at {:#x}",
                site.wrapping_add(covered as u64)
            ));
        }
        covered += instr.len();
    }
    if covered != len || covered < PATCH_LEN {
        return Err("original bytes end inside an instruction".into());
    }
    Ok(())
}

impl RegionHeader {
    /// The entry for `site`, if listed.
    pub fn find(&self, site: u64) -> Option<&RegionSite> {
        self.sites.iter().find(|s| s.site == site)
    }

    /// The header's bytes. Fails on what [`RegionHeader::parse`] would refuse
    /// but the region's address (which `parse` checks the trampolines against).
    pub(crate) fn encode(&self) -> Result<Vec<u8>, RegionError> {
        let count = self.sites.len();
        if count > MAX_SITES {
            return Err(RegionError::TooManySites(count));
        }
        let len = encoded_len(count);
        if self.region_len < len as u64 || self.region_len > MAX_REGION_LEN {
            return Err(RegionError::BadRegionLength(self.region_len));
        }
        let mut out = vec![0u8; len];
        out[0..8].copy_from_slice(&MAGIC);
        put32(&mut out, 8, VERSION);
        put32(&mut out, 12, len as u32);
        put32(&mut out, 16, count as u32);
        put64(&mut out, 24, self.region_len);
        put64(&mut out, 32, self.ring_addr);
        put64(&mut out, 40, self.ring_len);
        put64(&mut out, 48, self.tag_addr);
        for (index, s) in self.sites.iter().enumerate() {
            check_original(s.site, &s.original)
                .map_err(|why| RegionError::BadEntry { index, why })?;
            let at = PREFIX_LEN + index * ENTRY_LEN;
            put64(&mut out, at, s.site);
            put64(&mut out, at + 8, s.tramp);
            out[at + 16] = s.original.len() as u8;
            out[at + 24..at + 24 + s.original.len()].copy_from_slice(&s.original);
        }
        let crc = crc32fast::hash(&out);
        put32(&mut out, 20, crc);
        Ok(out)
    }

    /// The header length announced by the first [`PREFIX_LEN`] bytes, after
    /// checking the marker, version and bounds: how many bytes to read for
    /// [`RegionHeader::parse`].
    pub(crate) fn announced_len(prefix: &[u8]) -> Result<usize, RegionError> {
        if prefix.len() < PREFIX_LEN {
            return Err(RegionError::Short(prefix.len()));
        }
        if prefix[0..8] != MAGIC {
            return Err(RegionError::BadMagic);
        }
        let version = get32(prefix, 8);
        if version != VERSION {
            return Err(RegionError::BadVersion(version));
        }
        let (got, count) = (get32(prefix, 12), get32(prefix, 16));
        if count as usize > MAX_SITES {
            return Err(RegionError::TooManySites(count as usize));
        }
        if got as usize != encoded_len(count as usize) {
            return Err(RegionError::BadLength { got, count });
        }
        Ok(got as usize)
    }

    /// Reads the header of the region at `region_addr` from `bytes` (at least
    /// its announced length; more is ignored). Never trusts a field unchecked.
    pub fn parse(bytes: &[u8], region_addr: u64) -> Result<RegionHeader, RegionError> {
        let len = Self::announced_len(bytes)?;
        let bytes = bytes.get(..len).ok_or(RegionError::Short(bytes.len()))?;
        let mut zeroed = bytes.to_vec();
        put32(&mut zeroed, 20, 0);
        let (got, expected) = (get32(bytes, 20), crc32fast::hash(&zeroed));
        if got != expected {
            return Err(RegionError::BadChecksum { got, expected });
        }
        let region_len = get64(bytes, 24);
        if region_len < len as u64 || region_len > MAX_REGION_LEN {
            return Err(RegionError::BadRegionLength(region_len));
        }
        // Trampolines lie after the header, inside the region.
        let first = region_addr.checked_add(len as u64);
        let end = region_addr.checked_add(region_len);
        let (Some(first), Some(end)) = (first, end) else {
            return Err(RegionError::BadRegionLength(region_len));
        };
        let count = get32(bytes, 16) as usize;
        let mut sites: Vec<RegionSite> = Vec::with_capacity(count);
        for index in 0..count {
            let at = PREFIX_LEN + index * ENTRY_LEN;
            let entry = &bytes[at..at + ENTRY_LEN];
            let bad = |why: String| RegionError::BadEntry { index, why };
            let (site, tramp, n) = (get64(entry, 0), get64(entry, 8), entry[16] as usize);
            if !(PATCH_LEN..=MAX_PLAN_LEN).contains(&n) {
                return Err(bad(format!("{n} original bytes")));
            }
            if entry[17..24]
                .iter()
                .chain(&entry[24 + n..])
                .any(|&b| b != 0)
            {
                return Err(bad("reserved bytes are not zero".into()));
            }
            if !(first..end).contains(&tramp) {
                return Err(bad(format!(
                    "trampoline {tramp:#x} is outside the region {first:#x}..{end:#x}"
                )));
            }
            let original = entry[24..24 + n].to_vec();
            check_original(site, &original).map_err(bad)?;
            if jump_patch(site, tramp, n).is_none() {
                return Err(bad(format!(
                    "trampoline {tramp:#x} is out of a jump's reach from {site:#x}"
                )));
            }
            if sites.iter().any(|s| s.site == site) {
                return Err(RegionError::Duplicate(site));
            }
            sites.push(RegionSite {
                site,
                tramp,
                original,
            });
        }
        Ok(RegionHeader {
            region_len,
            ring_addr: get64(bytes, 32),
            ring_len: get64(bytes, 40),
            tag_addr: get64(bytes, 48),
            sites,
        })
    }
}

fn put32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(out: &mut [u8], at: usize, v: u64) {
    out[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Callers check `bytes` holds `at + 4` (the prefix, or an entry).
fn get32(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

fn get64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const REGION: u64 = 0x7f00_0000_0000;
    const SITE: u64 = 0x7f00_1000_0000;

    fn header(count: usize) -> RegionHeader {
        // nop; mov rcx, [rbx+0x20]   and   nop; push rbp; movabs rax, imm64
        let originals: [&[u8]; 2] = [
            &[0x90, 0x48, 0x8b, 0x4b, 0x20],
            &[0x90, 0x55, 0x48, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8],
        ];
        let start = REGION + encoded_len(count) as u64;
        RegionHeader {
            region_len: 64 << 10,
            ring_addr: 0x7f00_2000_0000,
            ring_len: 8 << 20,
            tag_addr: 0x7f00_3000_0000,
            sites: (0..count)
                .map(|k| RegionSite {
                    site: SITE + 64 * k as u64,
                    tramp: start + 1024 * k as u64,
                    original: originals[k % 2].to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn round_trip() {
        for count in [0, 1, 7] {
            let h = header(count);
            let bytes = h.encode().expect("encodes");
            assert_eq!(bytes.len(), encoded_len(count));
            assert_eq!(RegionHeader::announced_len(&bytes), Ok(bytes.len()));
            assert_eq!(RegionHeader::parse(&bytes, REGION), Ok(h.clone()));
            if let Some(s) = h.sites.first() {
                let patch = s.patch().expect("in reach");
                assert_eq!(jump_target(s.site, &patch), Some(s.tramp));
                assert_eq!(patch.len(), s.original.len());
            }
        }
    }

    #[test]
    fn listed_originals_must_have_a_plans_shape() {
        assert!(check_original(SITE, &[0x90, 0x48, 0x8b, 0x4b, 0x20]).is_ok());
        // Not a nop first; too short; an instruction cut off; more than needed.
        for bad in [
            &[0xcc, 0x48, 0x8b, 0x4b, 0x20][..],
            &[0x90, 0x90, 0x90, 0x90][..],
            &[0x90, 0x48, 0x8b, 0x4b, 0x20, 0x48, 0x8b][..],
            &[0x90, 0x90, 0x90, 0x90, 0x90, 0x90][..],
            &[0x90, 0x0f, 0x0b, 0x0f, 0xff][..],
        ] {
            assert!(check_original(SITE, bad).is_err(), "{bad:02x?}");
        }
        let mut h = header(1);
        h.sites[0].original = vec![0x90; 6];
        assert!(h.encode().is_err());
    }

    #[test]
    fn damage_is_named() {
        let h = header(2);
        let good = h.encode().expect("encodes");
        let mut bytes = good.clone();
        bytes[0] ^= 1;
        assert_eq!(
            RegionHeader::parse(&bytes, REGION),
            Err(RegionError::BadMagic)
        );
        let mut bytes = good.clone();
        bytes[PREFIX_LEN + 30] ^= 1;
        assert!(matches!(
            RegionHeader::parse(&bytes, REGION),
            Err(RegionError::BadChecksum { .. })
        ));
        assert_eq!(
            RegionHeader::parse(&good[..good.len() - 1], REGION),
            Err(RegionError::Short(good.len() - 1))
        );
        // A region elsewhere: the listed trampolines are not in it.
        assert!(matches!(
            RegionHeader::parse(&good, REGION + (1 << 30)),
            Err(RegionError::BadEntry { index: 0, .. })
        ));
    }

    /// A header rewritten by hand with a fresh checksum: the fields themselves are checked.
    fn resealed(mut bytes: Vec<u8>) -> Vec<u8> {
        put32(&mut bytes, 20, 0);
        let crc = crc32fast::hash(&bytes);
        put32(&mut bytes, 20, crc);
        bytes
    }

    #[test]
    fn checksummed_lies_are_refused_too() {
        let good = header(2).encode().expect("encodes");
        // Original bytes that are not a plan's.
        let mut bytes = good.clone();
        bytes[PREFIX_LEN + 24] = 0xcc;
        assert!(RegionHeader::parse(&resealed(bytes), REGION).is_err());
        // Length byte too large.
        let mut bytes = good.clone();
        bytes[PREFIX_LEN + 16] = 200;
        assert!(RegionHeader::parse(&resealed(bytes), REGION).is_err());
        // The same site twice.
        let mut bytes = good.clone();
        let first = bytes[PREFIX_LEN..PREFIX_LEN + 8].to_vec();
        bytes[PREFIX_LEN + ENTRY_LEN..PREFIX_LEN + ENTRY_LEN + 8].copy_from_slice(&first);
        bytes[PREFIX_LEN + ENTRY_LEN + 16] = 5;
        bytes[PREFIX_LEN + ENTRY_LEN + 24..PREFIX_LEN + 2 * ENTRY_LEN].copy_from_slice(&[
            0x90, 0x48, 0x8b, 0x4b, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ]);
        assert_eq!(
            RegionHeader::parse(&resealed(bytes), REGION),
            Err(RegionError::Duplicate(SITE))
        );
        // A count that announces more than the bound, or a length that does not match it.
        let mut bytes = good.clone();
        put32(&mut bytes, 16, u32::MAX);
        assert!(matches!(
            RegionHeader::announced_len(&bytes),
            Err(RegionError::TooManySites(_))
        ));
        let mut bytes = good;
        put32(&mut bytes, 12, u32::MAX);
        assert!(matches!(
            RegionHeader::announced_len(&bytes),
            Err(RegionError::BadLength { .. })
        ));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
            region in any::<u64>(),
        ) {
            let _ = RegionHeader::parse(&bytes, region);
            let mut marked = bytes;
            if marked.len() >= 12 {
                marked[0..8].copy_from_slice(&MAGIC);
                marked[8..12].copy_from_slice(&VERSION.to_le_bytes());
            }
            let _ = RegionHeader::parse(&marked, region);
        }

        /// Any corruption of a valid header is refused or still yields entries
        /// that pass every check (never a panic, never an unchecked entry).
        #[test]
        fn corrupt_headers_are_refused_or_valid(
            edits in proptest::collection::vec((0usize..encoded_len(3), any::<u8>()), 1..8),
            reseal in any::<bool>(),
        ) {
            let mut bytes = header(3).encode().expect("encodes");
            for (at, v) in edits {
                bytes[at] = v;
            }
            if reseal {
                bytes = resealed(bytes);
            }
            if let Ok(h) = RegionHeader::parse(&bytes, REGION) {
                prop_assert!(h.sites.len() <= MAX_SITES);
                prop_assert!(h.region_len <= MAX_REGION_LEN);
                for s in &h.sites {
                    prop_assert!(check_original(s.site, &s.original).is_ok());
                    prop_assert!(s.tramp >= REGION && s.tramp < REGION + h.region_len);
                    prop_assert!(s.patch().is_some());
                }
            }
        }
    }
}
