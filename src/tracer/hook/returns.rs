//! What the functions a hook sees return, by type: type objects named once each,
//! and a table of counts per (function, type) whose changed rows go to the
//! recording now and then and at the end (so a killed recording keeps most of it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::process::memory::ProcessMemory;
use crate::tracer::engine::ReturnRow;

/// Changed rows are handed on at most this often while tracing.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Longest type name read (`tp_name` is a C string in the target).
const MAX_TYPE_NAME: usize = 128;
/// Offset of `tp_name` in every `PyTypeObject` (after the variable-size object
/// header: refcount, type, size), the same in every CPython 3.
const TP_NAME: u64 = 24;
/// Type objects whose names are kept (a program making types without end gets
/// its cache emptied rather than grown).
const MAX_TYPES: usize = 4096;

/// (file, function, first line, returned type or `None` for raised).
type Key = (Arc<str>, Arc<str>, u32, Option<Arc<str>>);

/// Names of type objects, cached by address. A type may be freed and another
/// put at its address: each entry is checked once per drain (its `tp_name`
/// pointer read again) before it is trusted.
#[derive(Default)]
pub(super) struct TypeNames {
    /// type address → (`tp_name` pointer, name).
    known: FxHashMap<u64, (u64, Arc<str>)>,
    /// Addresses checked in this drain.
    checked: FxHashSet<u64>,
}

impl TypeNames {
    /// A new drain: every cached name is checked again before its next use.
    pub(super) fn new_batch(&mut self) {
        self.checked.clear();
    }

    /// The name last read for type object `ty`, without reading ("?" when none
    /// was): the process's memory is no longer the image it lived in.
    pub(super) fn cached(&self, ty: u64) -> Arc<str> {
        self.known
            .get(&ty)
            .map_or_else(|| "?".into(), |(_, name)| name.clone())
    }

    /// The name of type object `ty` ("?" when it cannot be read).
    pub(super) fn name(&mut self, mem: &ProcessMemory, ty: u64) -> Arc<str> {
        if self.checked.contains(&ty) {
            if let Some((_, name)) = self.known.get(&ty) {
                return name.clone();
            }
        }
        let pointer = mem
            .read_u64(ty + TP_NAME)
            .ok()
            .filter(|&p| p > 0xffff && p < 1 << 47);
        self.checked.insert(ty);
        let Some(p) = pointer else {
            return "?".into();
        };
        if let Some((known, name)) = self.known.get(&ty) {
            if *known == p {
                return name.clone();
            }
        }
        let name: Arc<str> = match mem.read_c_string(p, MAX_TYPE_NAME) {
            // `module.Class` for types defined in C: the class name is the last part.
            Ok(s) => s.rsplit('.').next().unwrap_or(&s).into(),
            Err(_) => return "?".into(),
        };
        if self.known.len() >= MAX_TYPES {
            self.known.clear();
        }
        self.known.insert(ty, (p, name.clone()));
        name
    }
}

/// Counts per (function, type) and which changed since they were last handed on.
pub(super) struct ReturnTable {
    counts: FxHashMap<Key, u64>,
    changed: FxHashSet<Key>,
    flushed: Instant,
}

impl Default for ReturnTable {
    fn default() -> Self {
        ReturnTable {
            counts: FxHashMap::default(),
            changed: FxHashSet::default(),
            flushed: Instant::now(),
        }
    }
}

impl ReturnTable {
    /// One return of `function` (or a raise: `returned` is `None`).
    pub(super) fn count(
        &mut self,
        file: &Arc<str>,
        function: &Arc<str>,
        first_line: u32,
        returned: Option<Arc<str>>,
    ) {
        let key = (file.clone(), function.clone(), first_line, returned);
        *self.counts.entry(key.clone()).or_insert(0) += 1;
        self.changed.insert(key);
    }

    /// Whether changed rows wait and it is time to hand them on.
    pub(super) fn due(&self) -> bool {
        !self.changed.is_empty() && self.flushed.elapsed() >= FLUSH_EVERY
    }

    /// The rows changed since the last call, with their totals.
    pub(super) fn take_changed(&mut self) -> Vec<ReturnRow> {
        self.flushed = Instant::now();
        let mut rows: Vec<ReturnRow> = self
            .changed
            .drain()
            .map(|key| {
                let total = self.counts.get(&key).copied().unwrap_or(0);
                let (file, function, first_line, returned) = key;
                ReturnRow {
                    file,
                    function,
                    first_line,
                    returned,
                    total,
                }
            })
            .collect();
        rows.sort_by(|a, b| {
            (&a.file, &a.function, a.first_line, &a.returned).cmp(&(
                &b.file,
                &b.function,
                b.first_line,
                &b.returned,
            ))
        });
        rows
    }
}
