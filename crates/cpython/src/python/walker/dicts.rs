//! Python dicts read from memory, CPython 3.7 to 3.15: the key and value of each
//! live entry. Enough for the few lookups that find asyncio's tasks before 3.14
//! (`sys.modules`, a module's globals, a `WeakSet`'s attributes), not a general
//! reader: no hash is computed (str hashes are salted per process), so a lookup
//! compares the keys' text.
//!
//! The keys' layout is CPython's private `PyDictKeysObject` (`Objects/dict-common.h`
//! up to 3.10, `Include/internal/pycore_dict.h` from 3.11), the same on every build
//! of a minor version; the dict itself (`ma_keys`, `ma_values`) has not moved since
//! 3.6. Every read is bounded: a table larger than [`MAX_ENTRIES`] is refused.

use super::objects::{field_u64, plausible_pointer};
use pyprobe_sdt::sdt::MemoryReader;

/// `PyDictObject.ma_keys` and `ma_values`.
const MA_KEYS: u64 = 32;
const MA_VALUES: u64 = 40;
/// Most entries read of one dict (`sys.modules` holds a few thousand at most).
const MAX_ENTRIES: u64 = 1 << 16;
/// Bytes of a keys object's head read (every field below lies in it).
const KEYS_HEAD: usize = 48;

/// How one minor version lays out a dict's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DictKeys {
    /// Up to 3.10: `dk_size` (at 8) and `dk_nentries` (at 32); the index table at
    /// 40, its entries as wide as the table needs; entries of hash, key, value.
    Sized,
    /// 3.11 to 3.15: `dk_log2_size` (at 8), `dk_log2_index_bytes` (at 9), `dk_kind`
    /// (at 10), `dk_nentries` (at 24); the index table at 32. Entries of key and
    /// value where every key is a str (`dk_kind` 1 or 2), else hash, key, value. A
    /// split dict's values start `split_values` bytes into `ma_values` (3.13+
    /// put four bytes of bookkeeping, padded to a word, before them).
    Log2 { split_values: u64 },
}

impl DictKeys {
    /// The layout of CPython 3.`minor`, for 3.7 to 3.15.
    pub(crate) fn of(minor: u8) -> Option<DictKeys> {
        match minor {
            7..=10 => Some(DictKeys::Sized),
            11 | 12 => Some(DictKeys::Log2 { split_values: 0 }),
            13..=15 => Some(DictKeys::Log2 { split_values: 8 }),
            _ => None,
        }
    }

    /// Where the entries of the keys whose head is `head` begin (from the keys
    /// object), how many are used, how long each is and where its key is.
    fn entries(self, head: &[u8]) -> Option<Entries> {
        match self {
            DictKeys::Sized => {
                let size = field_u64(head, 8).ok()?;
                let used = field_u64(head, 32).ok()?;
                if !size.is_power_of_two() || size > MAX_ENTRIES * 2 || used > size {
                    return None;
                }
                let width = match size {
                    0..=0xff => 1,
                    0x100..=0xffff => 2,
                    _ => 4,
                };
                Some(Entries {
                    start: 40 + size * width,
                    used,
                    stride: 24,
                    key: 8,
                })
            }
            DictKeys::Log2 { .. } => {
                let (log2_size, log2_index_bytes, kind) = (head[8], head[9], head[10]);
                let used = field_u64(head, 24).ok()?;
                if log2_size > 20 || log2_index_bytes > 23 || used > 1 << log2_size {
                    return None;
                }
                let unicode = matches!(kind, 1 | 2);
                Some(Entries {
                    start: 32 + (1u64 << log2_index_bytes),
                    used,
                    stride: if unicode { 16 } else { 24 },
                    key: if unicode { 0 } else { 8 },
                })
            }
        }
    }

    /// Where the values of a split dict start in its `ma_values`.
    fn split_values(self) -> u64 {
        match self {
            DictKeys::Sized => 0,
            DictKeys::Log2 { split_values } => split_values,
        }
    }
}

/// Where a keys object's entries are (see [`DictKeys::entries`]).
struct Entries {
    start: u64,
    used: u64,
    stride: u64,
    key: u64,
}

/// The (key, value) of each live entry of the dict at `dict`, in insertion order;
/// none when it cannot be read or is not plausible.
pub(crate) fn dict_items<M: MemoryReader + ?Sized>(
    mem: &M,
    layout: DictKeys,
    dict: u64,
) -> Vec<(u64, u64)> {
    dict_items_checked(mem, layout, dict).unwrap_or_default()
}

fn dict_items_checked<M: MemoryReader + ?Sized>(
    mem: &M,
    layout: DictKeys,
    dict: u64,
) -> Option<Vec<(u64, u64)>> {
    if !plausible_pointer(dict) {
        return None;
    }
    let mut head = [0u8; MA_VALUES as usize + 8];
    mem.read_exact(dict, &mut head).ok()?;
    let (keys, values) = (
        field_u64(&head, MA_KEYS).ok()?,
        field_u64(&head, MA_VALUES).ok()?,
    );
    keys_items_checked(mem, layout, keys, values)
}

/// The (key, value) of each live entry of the keys object at `keys`, in
/// insertion order: its values in its entries (`values` 0), or the array at
/// `values` (as a split dict's `ma_values`, an instance's own values); none
/// when it cannot be read or is not plausible.
pub(crate) fn keys_items<M: MemoryReader + ?Sized>(
    mem: &M,
    layout: DictKeys,
    keys: u64,
    values: u64,
) -> Vec<(u64, u64)> {
    keys_items_checked(mem, layout, keys, values).unwrap_or_default()
}

fn keys_items_checked<M: MemoryReader + ?Sized>(
    mem: &M,
    layout: DictKeys,
    keys: u64,
    values: u64,
) -> Option<Vec<(u64, u64)>> {
    if !plausible_pointer(keys) {
        return None;
    }
    let mut keys_head = [0u8; KEYS_HEAD];
    mem.read_exact(keys, &mut keys_head).ok()?;
    let e = layout.entries(&keys_head)?;
    let used = e.used.min(MAX_ENTRIES);
    let mut table = vec![0u8; (used * e.stride) as usize];
    mem.read_exact(keys.checked_add(e.start)?, &mut table)
        .ok()?;
    let split = (values != 0)
        .then(|| {
            let mut words = vec![0u8; used as usize * 8];
            let at = values.checked_add(layout.split_values())?;
            (plausible_pointer(values) && mem.read_exact(at, &mut words).is_ok()).then_some(words)
        })
        .flatten();
    if values != 0 && split.is_none() {
        return None;
    }
    let items = table
        .chunks_exact(e.stride as usize)
        .enumerate()
        .filter_map(|(i, entry)| {
            let key = field_u64(entry, e.key).ok()?;
            let value = match &split {
                Some(words) => field_u64(words, i as u64 * 8).ok()?,
                None => field_u64(entry, e.key + 8).ok()?,
            };
            (plausible_pointer(key) && plausible_pointer(value)).then_some((key, value))
        })
        .collect();
    Some(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory made of blocks at given addresses.
    struct Blocks(Vec<(u64, Vec<u8>)>);

    impl MemoryReader for Blocks {
        fn read_exact(&self, address: u64, buf: &mut [u8]) -> std::io::Result<()> {
            for (at, bytes) in &self.0 {
                if address >= *at && address + buf.len() as u64 <= at + bytes.len() as u64 {
                    let from = (address - at) as usize;
                    buf.copy_from_slice(&bytes[from..from + buf.len()]);
                    return Ok(());
                }
            }
            Err(std::io::Error::from(std::io::ErrorKind::InvalidInput))
        }
    }

    fn words(ws: &[u64]) -> Vec<u8> {
        ws.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn dict(keys: u64, values: u64) -> (u64, Vec<u8>) {
        (0x1000, words(&[1, 0x99, 2, 0, keys, values]))
    }

    #[test]
    fn a_310_combined_dict_reads_its_live_entries_in_order() {
        // dk_size 8 (one-byte indices): entries at 40 + 8; the second deleted.
        let mut keys = words(&[1, 8, 0, 3, 3]);
        keys.extend([0u8; 8]);
        keys.extend(words(&[7, 0x2000, 0x3000, 0, 0, 0, 9, 0x2008, 0x3008]));
        let mem = Blocks(vec![dict(0x4000, 0), (0x4000, keys)]);
        assert_eq!(
            dict_items(&mem, DictKeys::Sized, 0x1000),
            [(0x2000, 0x3000), (0x2008, 0x3008)]
        );
    }

    #[test]
    fn a_313_split_dict_takes_its_values_past_their_header() {
        // Unicode keys (kind 2), log2 size 3, one byte per index: entries at 40.
        let mut keys = words(&[1]);
        keys.extend([3, 3, 2, 0, 0, 0, 0, 0]);
        keys.extend(words(&[0, 2, 0]));
        keys.extend(words(&[0x2000, 0, 0x2008, 0]));
        let values = words(&[0x0202_0000, 0x3000, 0x3008]);
        let mem = Blocks(vec![dict(0x4000, 0x5000), (0x4000, keys), (0x5000, values)]);
        let layout = DictKeys::of(13).unwrap();
        assert_eq!(
            dict_items(&mem, layout, 0x1000),
            [(0x2000, 0x3000), (0x2008, 0x3008)]
        );
        // 3.11 reads the values from the start of `ma_values`: here, a header.
        let other = dict_items(&mem, DictKeys::of(11).unwrap(), 0x1000);
        assert_ne!(other, [(0x2000, 0x3000), (0x2008, 0x3008)]);
    }

    proptest::proptest! {
        /// Whatever the dict, its keys and values hold, reading them ends
        /// without a panic, within the bound, with plausible pointers only.
        #[test]
        fn any_bytes_read_as_a_dict_end_in_bounded_items(
            keys in proptest::collection::vec(proptest::num::u8::ANY, 0..512),
            values in proptest::collection::vec(proptest::num::u8::ANY, 0..256),
            with_values in proptest::bool::ANY,
            minor in 7u8..=13,
        ) {
            let mem = Blocks(vec![
                dict(0x4000, if with_values { 0x8000 } else { 0 }),
                (0x4000, keys),
                (0x8000, values),
            ]);
            let items = dict_items(&mem, DictKeys::of(minor).unwrap(), 0x1000);
            proptest::prop_assert!(items.len() as u64 <= MAX_ENTRIES);
            proptest::prop_assert!(items
                .iter()
                .all(|&(k, v)| plausible_pointer(k) && plausible_pointer(v)));
        }
    }

    #[test]
    fn implausible_tables_are_refused() {
        // A size that is no power of two, and more entries used than the size.
        for mut head in [words(&[1, 6, 0, 0, 3]), words(&[1, 8, 0, 0, 9])] {
            head.extend([0u8; 64]);
            let mem = Blocks(vec![dict(0x4000, 0), (0x4000, head)]);
            assert!(dict_items(&mem, DictKeys::Sized, 0x1000).is_empty());
        }
        let mut huge = words(&[1]);
        huge.extend([40, 3, 1, 0, 0, 0, 0, 0]);
        huge.extend(words(&[0, 2, 0]));
        huge.extend([0u8; 64]);
        let mem = Blocks(vec![dict(0x4000, 0), (0x4000, huge)]);
        assert!(dict_items(&mem, DictKeys::of(12).unwrap(), 0x1000).is_empty());
        assert!(DictKeys::of(16).is_none() && DictKeys::of(6).is_none());
    }
}
