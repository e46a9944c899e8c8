//! What the functions a hook sees return, by type: type objects named once each,
//! and a table of counts per (function, type) whose changed rows go to the
//! recording now and then and at the end (so a killed recording keeps most of it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::tracer::engine::ReturnRow;

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
/// pointer read again, for all the drain's types at once by
/// [`recheck`](Self::recheck)) before it is trusted.
#[derive(Default)]
pub(super) struct TypeNames {
    /// type address → (`tp_name` pointer, name).
    known: FxHashMap<u64, (u64, Arc<str>)>,
    /// Addresses checked in this drain.
    checked: FxHashSet<u64>,
    /// The type named last in this drain, and its name: a function returns one
    /// type run after run, looked up with no hashing.
    last: Option<(u64, Arc<str>)>,
}

impl TypeNames {
    /// A new drain: every cached name is checked again before its next use.
    pub(super) fn new_batch(&mut self) {
        self.checked.clear();
        self.last = None;
    }

    /// Where type object `ty` keeps its `tp_name` pointer.
    pub(super) fn name_pointer_at(ty: u64) -> u64 {
        ty.wrapping_add(TP_NAME)
    }

    /// The `tp_name` pointers of this drain's `types`, read just now (`None`:
    /// unreadable): a cached name whose pointer changed is forgotten, and each
    /// type read counts as checked for this drain.
    pub(super) fn recheck(&mut self, types: &[u64], pointers: &[Option<u64>]) {
        for (&ty, &now) in types.iter().zip(pointers) {
            let Some(p) = now else { continue };
            if self.known.get(&ty).is_some_and(|(known, _)| *known != p) {
                self.known.remove(&ty);
            }
            self.checked.insert(ty);
        }
    }

    /// The name last read for type object `ty`, without reading ("?" when none
    /// was): the process's memory is no longer the image it lived in.
    pub(super) fn cached(&self, ty: u64) -> Arc<str> {
        self.known
            .get(&ty)
            .map_or_else(|| "?".into(), |(_, name)| name.clone())
    }

    /// The name of type object `ty` ("?" when it cannot be read).
    pub(super) fn name(&mut self, mem: &ProcessMemory, ty: u64) -> &Arc<str> {
        if self.last.as_ref().is_none_or(|(last, _)| *last != ty) {
            let name = self.read_name(mem, ty);
            self.last = Some((ty, name));
        }
        match &self.last {
            Some((_, name)) => name,
            None => unreachable!("set just above"),
        }
    }

    /// [`Self::name`], from the cache (checked once per drain) or the target.
    fn read_name(&mut self, mem: &ProcessMemory, ty: u64) -> Arc<str> {
        if self.checked.contains(&ty) {
            if let Some((_, name)) = self.known.get(&ty) {
                return name.clone();
            }
        }
        let pointer = mem
            .read_u64(Self::name_pointer_at(ty))
            .ok()
            .filter(|&p| p > 0xffff && p < 1 << 47);
        let Some(p) = pointer else {
            return "?".into();
        };
        self.checked.insert(ty);
        if let Some((known, name)) = self.known.get(&ty) {
            if *known == p {
                return name.clone();
            }
        }
        let name: Arc<str> = match mem.read_c_string(p, MAX_TYPE_NAME) {
            // `module.Class` for types defined in C: the class name is the last part.
            // Not an identifier: the type is gone and its memory holds something
            // else (a class made in a function or module body, freed since).
            Ok(s) => match s.rsplit('.').next().filter(|n| is_identifier(n)) {
                Some(n) => n.into(),
                None => return "?".into(),
            },
            Err(_) => return "?".into(),
        };
        if self.known.len() >= MAX_TYPES {
            self.known.clear();
        }
        self.known.insert(ty, (p, name.clone()));
        name
    }
}

/// Whether `name` reads as a Python identifier (what a class name is).
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
}

/// A key by the addresses of its names (`Arc::as_ptr`): file, function, first line,
/// returned type (0 for raised).
type FastKey = (usize, usize, u32, usize);

/// Most fast keys kept (names re-made by the caches make new ones).
const MAX_FAST: usize = 1 << 16;

/// One (function, type) row: its running total, and whether it changed since it
/// was last handed on.
struct Row {
    key: Key,
    total: u64,
    changed: bool,
}

/// Counts per (function, type) and which changed since they were last handed on.
///
/// A return is counted through a key of its names' addresses (no string hashed),
/// which leads to the row of their text: two copies of one name share a row. Each
/// fast entry holds its names, so an address cannot name other text while it stands.
pub(super) struct ReturnTable {
    fast: FxHashMap<FastKey, (usize, Key)>,
    /// The key counted last and its row (its names held by its `fast` entry).
    last: Option<(FastKey, usize)>,
    by_text: FxHashMap<Key, usize>,
    rows: Vec<Row>,
    changed: Vec<usize>,
    flushed: Instant,
}

impl Default for ReturnTable {
    fn default() -> Self {
        ReturnTable {
            fast: FxHashMap::default(),
            last: None,
            by_text: FxHashMap::default(),
            rows: Vec::new(),
            changed: Vec::new(),
            flushed: Instant::now(),
        }
    }
}

fn address(s: &Arc<str>) -> usize {
    Arc::as_ptr(s) as *const u8 as usize
}

impl ReturnTable {
    /// One return of `function` (or a raise: `returned` is `None`).
    pub(super) fn count(
        &mut self,
        file: &Arc<str>,
        function: &Arc<str>,
        first_line: u32,
        returned: Option<&Arc<str>>,
    ) {
        let fast_key = (
            address(file),
            address(function),
            first_line,
            returned.map_or(0, address),
        );
        let fast = match self.last {
            // A function returning one type run after run: no hashing.
            Some((last, row)) if last == fast_key => Some(row),
            _ => self.fast.get(&fast_key).map(|&(row, _)| row),
        };
        let row = match fast {
            Some(row) => row,
            None => {
                let key = (
                    file.clone(),
                    function.clone(),
                    first_line,
                    returned.cloned(),
                );
                let rows = &mut self.rows;
                let row = *self.by_text.entry(key.clone()).or_insert_with(|| {
                    rows.push(Row {
                        key: key.clone(),
                        total: 0,
                        changed: false,
                    });
                    rows.len() - 1
                });
                if self.fast.len() >= MAX_FAST {
                    self.fast.clear();
                    self.last = None;
                }
                self.fast.insert(fast_key, (row, key));
                row
            }
        };
        self.last = Some((fast_key, row));
        let r = &mut self.rows[row];
        r.total += 1;
        if !r.changed {
            r.changed = true;
            self.changed.push(row);
        }
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
            .drain(..)
            .map(|i| {
                let row = &mut self.rows[i];
                row.changed = false;
                let (file, function, first_line, returned) = row.key.clone();
                ReturnRow {
                    file,
                    function,
                    first_line,
                    returned,
                    total: row.total,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_type_name_that_is_no_identifier_is_not_taken() {
        for good in ["int", "_Private", "Point3", "Ünïcode"] {
            assert!(is_identifier(good), "{good}");
        }
        for bad in ["", "@", "3D", "a b", "x\u{1}"] {
            assert!(!is_identifier(bad), "{bad:?}");
        }
    }

    fn s(text: &str) -> Arc<str> {
        text.into()
    }

    /// A type object's header in this process's memory: its `tp_name` points at
    /// `name`.
    fn type_object(name: &std::ffi::CStr) -> Box<[u64; 4]> {
        Box::new([1, 0, 0, name.as_ptr() as u64])
    }

    #[test]
    fn a_drains_read_pointers_decide_which_cached_type_names_are_kept() {
        let mem = ProcessMemory::new(std::process::id() as i32);
        // A process that does not exist: any read of it fails.
        let unreadable = ProcessMemory::new(i32::MAX);
        let mut names = TypeNames::default();
        let mut ty = type_object(c"Point");
        let at = ty.as_ptr() as u64;
        names.new_batch();
        assert_eq!(&**names.name(&mem, at), "Point");

        // A new drain: a name is not trusted before it is checked, and nothing
        // can be read to check it.
        names.new_batch();
        assert_eq!(&**names.name(&unreadable, at), "?");

        // The drain's pointers, read together, check it: the same `tp_name`
        // pointer, the cached name, with no read of its own.
        names.new_batch();
        names.recheck(&[at], &[Some(ty[3])]);
        assert_eq!(&**names.name(&unreadable, at), "Point");

        // Another type at the same address (another `tp_name`): read afresh.
        ty[3] = c"Fresh".as_ptr() as u64;
        let pointer = std::hint::black_box(ty[3]);
        names.new_batch();
        names.recheck(&[at], &[Some(pointer)]);
        assert_eq!(&**names.name(&unreadable, at), "?");
        names.new_batch();
        names.recheck(&[at], &[Some(pointer)]);
        assert_eq!(&**names.name(&mem, at), "Fresh");
        drop(ty);
    }

    #[test]
    fn totals_run_per_text_and_only_changed_rows_are_handed_on() {
        let mut t = ReturnTable::default();
        let (file, f) = (s("a.py"), s("f"));
        let (list, tuple) = (s("list"), s("tuple"));
        for _ in 0..3 {
            t.count(&file, &f, 1, Some(&list));
        }
        // Other copies of the same names: the same row.
        t.count(&s("a.py"), &s("f"), 1, Some(&s("list")));
        t.count(&file, &f, 1, Some(&tuple));
        t.count(&file, &f, 1, None);
        // Another first line is another function.
        t.count(&file, &f, 9, Some(&list));
        let rows: Vec<(u32, Option<String>, u64)> = t
            .take_changed()
            .into_iter()
            .map(|r| (r.first_line, r.returned.map(|t| t.to_string()), r.total))
            .collect();
        assert_eq!(
            rows,
            [
                (1, None, 1),
                (1, Some("list".into()), 4),
                (1, Some("tuple".into()), 1),
                (9, Some("list".into()), 1)
            ]
        );
        assert!(t.take_changed().is_empty(), "nothing changed since");
        t.count(&file, &f, 1, Some(&list));
        let rows = t.take_changed();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].total, 5, "a running total");
    }
}
