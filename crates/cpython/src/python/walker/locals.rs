//! A frame's local variables: their names from its code object, their values from
//! the frame's slots, each shown by [`ValueReader`]. Up to 3.10 the slots of a frame
//! object are named by `co_varnames`, then `co_cellvars` and `co_freevars`; from 3.11
//! an interpreter frame's slots are named by `co_localsplusnames`, with a kind each.

use serde::Serialize;

use super::layout::{FrameLayout, LocalNames, LocalsLayout};
use super::objects::{field_i32, plausible_pointer, read_bytes_prefix, read_str, read_u64};
use super::stacks::{Memory, StackReader};
use super::values::ValueReader;

/// The slot names of each code object read so far, by its address (valid while
/// the threads are held: a code object cannot die meanwhile).
pub(crate) type LocalNamesCache = std::collections::HashMap<u64, Vec<(String, LocalKind)>>;

/// Most local variables read per frame.
pub(crate) const MAX_LOCALS: usize = 512;

// `co_localspluskinds` bits (3.11+; HIDDEN from 3.12, for inlined comprehensions).
const CO_FAST_HIDDEN: u8 = 0x10;
const CO_FAST_CELL: u8 = 0x40;
const CO_FAST_FREE: u8 = 0x80;

/// How a variable is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalKind {
    /// An argument or a local variable.
    Local,
    /// A local variable that inner functions use (kept in a cell).
    Cell,
    /// A variable of an enclosing function (`nonlocal`, or read by a closure).
    Free,
}

/// One local variable of a frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Local {
    pub name: String,
    pub kind: LocalKind,
    /// Its value as text (see [`ValueReader`]); `None` while it is unbound.
    pub value: Option<String>,
}

impl<M: Memory> StackReader<M> {
    /// The local variables of the frame at `frame`, which runs the code object at
    /// `code`, in the order the code names them; empty when this version's layout
    /// does not say where they are. Unreadable names or slots end the list.
    pub(crate) fn frame_locals(
        &self,
        frame: u64,
        code: u64,
        names: &mut LocalNamesCache,
    ) -> Vec<Local> {
        let Some(layout) = self.layout.locals else {
            return Vec::new();
        };
        // A code object's names, read once per read of the stacks (a recursion
        // repeats them), then used again while the threads are held.
        let names = names
            .entry(code)
            .or_insert_with(|| self.local_names(code, &layout))
            .clone();
        if names.is_empty() {
            return Vec::new();
        }
        let mut slots = vec![0u8; names.len() * 8];
        if self
            .mem
            .read_exact(frame + layout.frame_localsplus, &mut slots)
            .is_err()
        {
            return Vec::new();
        }
        // 3.14+: each slot is a tagged reference.
        let tag_mask = match self.layout.frame {
            FrameLayout::Interpreter { tag_mask, .. } => tag_mask,
            FrameLayout::Object { .. } => 0,
        };
        let mut values = ValueReader::new(&self.mem, &self.layout, layout);
        let mut out: Vec<Local> = Vec::with_capacity(names.len());
        for ((name, kind), slot) in names.into_iter().zip(slots.chunks_exact(8)) {
            if name.is_empty() {
                continue;
            }
            let mut object = u64::from_le_bytes(slot.try_into().unwrap_or_default()) & !tag_mask;
            if kind != LocalKind::Local && values.is_cell(object) {
                object = values.cell_contents(object).unwrap_or(0);
            }
            let value = (object != 0).then(|| values.show(object));
            // Up to 3.10 an argument that inner functions use is named twice: as
            // a local (its value at the call) and as a cell (its value now).
            if kind == LocalKind::Cell {
                if let Some(arg) = out.iter_mut().find(|l| l.name == name) {
                    arg.kind = LocalKind::Cell;
                    arg.value = value;
                    continue;
                }
            }
            out.push(Local { name, kind, value });
        }
        out
    }

    /// The names of a code object's local slots, in slot order, with their kinds;
    /// hidden ones (3.12+ inlined comprehensions) named with an empty name, so that
    /// the slots stay in step, and dropped by the caller.
    fn local_names(&self, code: u64, layout: &LocalsLayout) -> Vec<(String, LocalKind)> {
        match layout.names {
            LocalNames::Varnames {
                nlocals,
                varnames,
                cellvars,
                freevars,
            } => {
                let mut head = [0u8; 4];
                if self.mem.read_exact(code + nlocals, &mut head).is_err() {
                    return Vec::new();
                }
                let count = field_i32(&head, 0).unwrap_or(0).clamp(0, MAX_LOCALS as i32) as usize;
                let tuple = |offset: u64| {
                    read_u64(&self.mem, code + offset)
                        .map(|t| self.str_tuple(t, layout))
                        .unwrap_or_default()
                };
                let mut names: Vec<(String, LocalKind)> = tuple(varnames)
                    .into_iter()
                    .take(count)
                    .map(|n| (n, LocalKind::Local))
                    .collect();
                if names.len() < count {
                    // The slots after the locals are the cells: without every local's
                    // name they cannot be placed.
                    return names;
                }
                names.extend(tuple(cellvars).into_iter().map(|n| (n, LocalKind::Cell)));
                names.extend(tuple(freevars).into_iter().map(|n| (n, LocalKind::Free)));
                names.truncate(MAX_LOCALS);
                names
            }
            LocalNames::LocalsPlus { names, kinds } => {
                let Ok(names_at) = read_u64(&self.mem, code + names) else {
                    return Vec::new();
                };
                let Ok(kinds_at) = read_u64(&self.mem, code + kinds) else {
                    return Vec::new();
                };
                let names = self.str_tuple(names_at, layout);
                let kinds = read_bytes_prefix(&self.mem, &self.layout, kinds_at, names.len())
                    .map(|(_, kinds)| kinds)
                    .unwrap_or_default();
                names
                    .into_iter()
                    .zip(kinds)
                    .map(|(name, kind)| {
                        let k = if kind & CO_FAST_FREE != 0 {
                            LocalKind::Free
                        } else if kind & CO_FAST_CELL != 0 {
                            LocalKind::Cell
                        } else {
                            LocalKind::Local
                        };
                        let name = if kind & CO_FAST_HIDDEN != 0 {
                            String::new()
                        } else {
                            name
                        };
                        (name, k)
                    })
                    .collect()
            }
        }
    }

    /// The strings of a tuple of str (at most [`MAX_LOCALS`]); an item that is not a
    /// readable str ends it.
    fn str_tuple(&self, tuple: u64, layout: &LocalsLayout) -> Vec<String> {
        if !plausible_pointer(tuple) {
            return Vec::new();
        }
        let Ok(size) = read_u64(&self.mem, tuple + layout.object_head) else {
            return Vec::new();
        };
        let size = (size as i64).clamp(0, MAX_LOCALS as i64) as usize;
        let mut items = vec![0u8; size * 8];
        if self
            .mem
            .read_exact(tuple + layout.tuple_items, &mut items)
            .is_err()
        {
            return Vec::new();
        }
        items
            .chunks_exact(8)
            .map_while(|item| {
                let at = u64::from_le_bytes(item.try_into().ok()?);
                read_str(&self.mem, &self.layout.unicode, at).ok()
            })
            .collect()
    }
}
