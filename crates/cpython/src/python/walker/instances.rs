//! The attributes of instances of Python classes, read from memory by name
//! (CPython 3.7 to 3.15): what asyncio keeps in its pure-Python objects (a
//! `WeakSet`'s `data`, a `TaskGroup`'s parent task, the pure-Python `Task`'s
//! coroutine, name and done-callbacks).
//!
//! An instance keeps its attributes in its `__dict__` up to 3.10 (at the
//! type's `tp_dictoffset`). From 3.11 it keeps their values without a
//! dictionary while it can, in the order of its class's shared keys
//! (`PyHeapTypeObject.ht_cached_keys`), and points at a dictionary once one is
//! made. Names are compared as text (str hashes are salted per process); each
//! key's text is read once.

use std::sync::Arc;

use super::dicts::{dict_items, keys_items, DictKeys};
use super::legacy_tasks::remember;
use super::objects::{plausible_pointer, read_u64};
use super::Walker;
use pyprobe_sdt::sdt::MemoryReader;

/// `PyTypeObject.tp_basicsize` and `tp_dictoffset`.
const TYPE_BASICSIZE: u64 = 32;
const TYPE_DICTOFFSET: u64 = 288;
/// Where 3.11 to 3.15 keep a materialised instance dictionary: the word three
/// before the object (3.12 tags it: an odd word holds values instead).
const MANAGED_DICT: u64 = 24;
/// Largest instance head (`tp_basicsize`) and dictionary offset believed.
const MAX_BASICSIZE: u64 = 4096;
/// An instance whose head is at most this is of a class with no C structure
/// of its own under it (an object's head, a dictionary and a weak-reference
/// list at most): its state is all in its attributes.
const PLAIN_INSTANCE: u64 = 48;
/// Longest attribute name compared.
const MAX_NAME_CHARS: usize = 64;
/// Most attributes of an instance looked at (asyncio's objects have a dozen;
/// each name is read once, but an instance may have thousands).
const MAX_ATTRIBUTES: usize = 64;

/// Where an instance of a Python class keeps its attributes' values while it has
/// no dictionary of its own (3.11 to 3.15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InstanceValues {
    /// None to read (up to 3.10: every instance has a dictionary).
    Dictionary,
    /// A pointer to the values, four words before the object (3.11).
    Before,
    /// A pointer to them less one (odd: the low bit says values, not a
    /// dictionary), three words before (3.12).
    TaggedBefore,
    /// Inline, after the object's own `tp_basicsize` bytes, behind a header of
    /// capacity, size, embedded and valid bytes (3.13+).
    Inline,
}

/// How one minor version lays out an instance's attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InstanceLayout {
    keys: DictKeys,
    values: InstanceValues,
    /// `offsetof(PyHeapTypeObject, ht_cached_keys)`, measured on each version
    /// (the word after `ht_qualname`, which Python gives).
    cached_keys: u64,
}

impl InstanceLayout {
    /// The layout of CPython 3.`minor`, for 3.7 to 3.15.
    pub(crate) fn of(minor: u8) -> Option<InstanceLayout> {
        let cached_keys = match minor {
            7 => 856,
            9 => 864,
            8 | 10 | 11 => 872,
            12..=14 => 880,
            15 => 888,
            _ => return None,
        };
        let values = match minor {
            11 => InstanceValues::Before,
            12 => InstanceValues::TaggedBefore,
            13..=15 => InstanceValues::Inline,
            _ => InstanceValues::Dictionary,
        };
        Some(InstanceLayout {
            keys: DictKeys::of(minor)?,
            values,
            cached_keys,
        })
    }
}

impl Walker {
    /// The values of the attributes `names` of the instance at `object`, each
    /// `None` where it has none (or it cannot be read).
    pub(super) fn attributes<const N: usize>(
        &self,
        object: u64,
        names: [&str; N],
    ) -> [Option<u64>; N] {
        let mut found = [None; N];
        for (key, value) in self.instance_items(object).into_iter().take(MAX_ATTRIBUTES) {
            let Some(text) = self.attribute_name(key) else {
                continue;
            };
            if let Some(i) = names.iter().position(|n| **n == *text) {
                found[i].get_or_insert(value);
            }
        }
        found
    }

    /// Whether the object at `addr` is an instance of a class with no C
    /// structure under it (see [`PLAIN_INSTANCE`]): asyncio's pure-Python `Task`,
    /// not its C one.
    pub(super) fn is_plain_instance(&self, addr: u64) -> bool {
        self.instance_type(addr)
            .is_some_and(|(_, size, _)| size <= PLAIN_INSTANCE)
    }

    /// [`Self::is_plain_instance`] of each of `objects`, their types read in one
    /// go (a dump lists thousands of tasks).
    pub(super) fn plain_instances(&self, objects: &[u64]) -> Vec<bool> {
        objects
            .iter()
            .zip(self.object_types(objects))
            .map(|(&object, ty)| match ty {
                Some(ty) => {
                    let known = self.instance_types.borrow().get(&ty).copied();
                    match known {
                        Some(known) => known.is_some_and(|(size, _)| size <= PLAIN_INSTANCE),
                        None => self.is_plain_instance(object),
                    }
                }
                _ => false,
            })
            .collect()
    }

    /// The (name, value) of each attribute of the instance at `object`, in the
    /// order they were set; none when it cannot be read.
    fn instance_items(&self, object: u64) -> Vec<(u64, u64)> {
        let (Some(layout), Some((ty, size, dict_offset))) =
            (self.instances, self.instance_type(object))
        else {
            return Vec::new();
        };
        let mem = &self.reader.mem;
        let shared = |values: u64| -> Vec<(u64, u64)> {
            let keys = read_u64(mem, ty + layout.cached_keys).unwrap_or(0);
            keys_items(mem, layout.keys, keys, values)
        };
        let dict = match layout.values {
            InstanceValues::Dictionary => {
                if dict_offset == 0 || dict_offset > MAX_BASICSIZE {
                    return Vec::new();
                }
                read_u64(mem, object + dict_offset).unwrap_or(0)
            }
            InstanceValues::Before => match object.checked_sub(32).map(|at| read_u64(mem, at)) {
                Some(Ok(values)) if values != 0 => return shared(values),
                _ => read_u64(mem, object.saturating_sub(MANAGED_DICT)).unwrap_or(0),
            },
            InstanceValues::TaggedBefore => {
                match object.checked_sub(MANAGED_DICT).map(|at| read_u64(mem, at)) {
                    Some(Ok(tagged)) if tagged & 1 == 1 => return shared(tagged.wrapping_add(1)),
                    Some(Ok(dict)) => dict,
                    _ => 0,
                }
            }
            InstanceValues::Inline => {
                // capacity, size, embedded, valid: values not valid (moved
                // into a dictionary) are not read.
                let mut head = [0u8; 4];
                if mem.read_exact(object + size, &mut head).is_ok() && head[3] != 0 {
                    return shared(object + size);
                }
                read_u64(mem, object.saturating_sub(MANAGED_DICT)).unwrap_or(0)
            }
        };
        if self.short_type_name(dict).as_deref() != Some("dict") {
            return Vec::new();
        }
        dict_items(mem, layout.keys, dict)
    }

    /// The type of the object at `addr`, its instances' `tp_basicsize` and
    /// `tp_dictoffset`; each type's read once.
    fn instance_type(&self, addr: u64) -> Option<(u64, u64, u64)> {
        if !plausible_pointer(addr) {
            return None;
        }
        let mem = &self.reader.mem;
        let ty = read_u64(mem, addr + self.reader.layout.ob_type).ok()?;
        if let Some(&known) = self.instance_types.borrow().get(&ty) {
            return known.map(|(size, offset)| (ty, size, offset));
        }
        let mut words = Vec::new();
        mem.read_words(&[ty + TYPE_BASICSIZE, ty + TYPE_DICTOFFSET], &mut words);
        let read = match words[..] {
            [Some(size), Some(offset)] if plausible_pointer(ty) && size <= MAX_BASICSIZE => {
                Some((size, offset))
            }
            _ => None,
        };
        remember(&self.instance_types, ty, read).map(|(size, offset)| (ty, size, offset))
    }

    /// The text of the attribute name (a str) at `key`; each read once.
    fn attribute_name(&self, key: u64) -> Option<Arc<str>> {
        if let Some(known) = self.attribute_names.borrow().get(&key) {
            return known.clone();
        }
        let text = self
            .read_str(key)
            .filter(|t| t.chars().count() <= MAX_NAME_CHARS);
        remember(&self.attribute_names, key, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_version_from_3_7_to_3_15_has_a_layout_and_no_other() {
        assert!(InstanceLayout::of(6).is_none());
        assert!(InstanceLayout::of(16).is_none());
        for minor in 7..=15 {
            let l = InstanceLayout::of(minor).unwrap();
            assert_eq!(
                l.values == InstanceValues::Dictionary,
                minor <= 10,
                "3.{minor}"
            );
        }
    }
}
