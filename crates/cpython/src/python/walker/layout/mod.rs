//! Where the walker finds things in a CPython's structures: one [`Layout`], built either
//! from an offsets file (3.7 – 3.12, `offsets/3.X.json`, generated from the version's
//! headers by `scripts/gen-offsets.sh`) or from the `_Py_DebugOffsets` the interpreter
//! carries at the start of `_PyRuntime` (3.13+; the offsets file of those versions only
//! says where in `_Py_DebugOffsets` each number is).

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

use crate::python::version::PyVersion;
use pyprobe_sdt::sdt::MemoryReader;

mod debug_offsets;
mod offsets_file;

#[cfg(test)]
use debug_offsets::debug_offsets_size;
pub use debug_offsets::from_debug_offsets;
pub use offsets_file::from_offsets_file;

/// The embedded offsets files, by minor version.
const FILES: &[(u8, &str)] = &[
    (7, include_str!("../../../../offsets/3.7.json")),
    (8, include_str!("../../../../offsets/3.8.json")),
    (9, include_str!("../../../../offsets/3.9.json")),
    (10, include_str!("../../../../offsets/3.10.json")),
    (11, include_str!("../../../../offsets/3.11.json")),
    (12, include_str!("../../../../offsets/3.12.json")),
    (13, include_str!("../../../../offsets/3.13.json")),
    (14, include_str!("../../../../offsets/3.14.json")),
    (15, include_str!("../../../../offsets/3.15.json")),
];

/// The cookie `_Py_DebugOffsets` starts with.
pub(crate) const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";

/// Upper bounds for the sizes `_Py_DebugOffsets` reports: a corrupt or foreign block is
/// refused rather than trusted.
const MAX_RUNTIME_SIZE: u64 = 64 << 20;
const MAX_INTERP_SIZE: u64 = 64 << 20;
const MAX_TSTATE_SIZE: u64 = 1 << 20;
const MAX_SMALL_STRUCT: u64 = 4096;

/// How a frame records its current instruction's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LineTable {
    /// `co_lnotab` (3.6 – 3.9): (address delta, line delta) byte pairs.
    Lnotab,
    /// `co_linetable` of 3.10: (address delta, line delta) pairs, -128 = no line.
    Linetable310,
    /// `co_linetable` of 3.11+: the location table (`Objects/locations.md`).
    Locations,
}

/// Where a thread state keeps its innermost frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameRoot {
    /// A pointer field of the thread state (`frame` up to 3.10, `current_frame` 3.13+).
    Direct(u64),
    /// `tstate->cframe->current_frame` (3.11, 3.12).
    CFrame { cframe: u64, current_frame: u64 },
}

/// What a frame is and where its fields are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameLayout {
    /// `PyFrameObject` (up to 3.10): `f_back`, `f_code`, `f_lasti`.
    Object {
        back: u64,
        code: u64,
        lasti: u64,
        /// Bytes per unit of `f_lasti`: 1 up to 3.9, 2 (code units) in 3.10.
        lasti_unit: u64,
        /// Where a frame says it runs, and what every frame of a thread's stack
        /// holds there: `f_executing`, 1 (up to 3.9), or `f_state`,
        /// `FRAME_EXECUTING`, 0 (3.10). A suspended generator's frame, or one that
        /// returned (freed, or kept for reuse), holds another value.
        executing: (u64, u8),
    },
    /// `_PyInterpreterFrame` (3.11+).
    Interpreter {
        previous: u64,
        executable: u64,
        /// `prev_instr` (3.11, 3.12) or `instr_ptr` (3.13+).
        instr_ptr: u64,
        owner: u64,
        /// Frames whose owner is at least this are shims owned by the C stack or the
        /// interpreter (3.12+), not Python code.
        first_shim_owner: Option<u8>,
        /// 3.11: the `is_entry` byte, set on the outermost frame of each call of
        /// the eval loop (3.12+ mark it with a shim frame instead).
        entry_flag: Option<u64>,
        /// Tag bits of `_PyStackRef f_executable` (3.14+), masked off.
        tag_mask: u64,
        /// Free-threaded 3.14+: (`tlbc_index` in the frame, `co_tlbc` in the code).
        tlbc: Option<(u64, u64)>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UnicodeLayout {
    pub(crate) length: u64,
    pub(crate) state: u64,
    /// sizeof(PyASCIIObject): compact ASCII data starts here.
    pub(crate) ascii_size: u64,
    /// sizeof(PyCompactUnicodeObject): compact non-ASCII data starts here; the data
    /// pointer of a legacy (non-compact) string is stored here.
    pub(crate) compact_size: u64,
    pub(crate) kind_shift: u32,
    pub(crate) compact_bit: u32,
    pub(crate) ascii_bit: u32,
}

/// Where the thread state holding the GIL is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GilLayout {
    /// Up to 3.11: `_PyRuntime.gilstate.tstate_current` (its offset in `_PyRuntime`),
    /// the thread state holding the GIL, NULL while none does (a thread releasing
    /// the GIL swaps it out first, and swaps it back in once it has taken it again).
    RuntimeCurrent { tstate_current: u64 },
    /// 3.12+: each interpreter's `ceval.gil` (its offset in the interpreter state)
    /// points to a `struct _gil_runtime_state`, held by `last_holder` (a thread
    /// state) while `locked` (an int) is set; offsets in that structure.
    Interpreter {
        ceval_gil: u64,
        last_holder: u64,
        locked: u64,
    },
}

/// How a code object names its frame's local variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LocalNames {
    /// Up to 3.10: `co_nlocals` (an int) locals named by `co_varnames`, then one cell
    /// per name of `co_cellvars`, then one per name of `co_freevars` (tuples).
    Varnames {
        nlocals: u64,
        varnames: u64,
        cellvars: u64,
        freevars: u64,
    },
    /// 3.11+: `co_localsplusnames` (a tuple) and `co_localspluskinds` (bytes, one
    /// kind per name: local, cell, free, hidden).
    LocalsPlus { names: u64, kinds: u64 },
}

/// Where a frame keeps its local variables (`dump --locals`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LocalsLayout {
    /// Offset of the first local's slot in a frame (`f_localsplus`, `localsplus`).
    pub(crate) frame_localsplus: u64,
    pub(crate) names: LocalNames,
    /// `sizeof(PyObject)`: where an object's own fields begin (a tuple's size, an
    /// int's digit count, a float's value, a dict's length, a cell's content ...).
    pub(crate) object_head: u64,
    /// 3.12+: an int's size and sign are one tagged word (`lv_tag`), not `ob_size`.
    pub(crate) long_tagged: bool,
    /// Where a tuple's items begin (3.14+ caches the tuple's hash before them).
    pub(crate) tuple_items: u64,
}

/// Every offset the walker uses, for one interpreter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) runtime_interpreters_head: u64,
    pub(crate) interp_next: u64,
    pub(crate) interp_threads_head: u64,
    pub(crate) tstate_next: u64,
    pub(crate) tstate_thread_id: u64,
    pub(crate) tstate_native_thread_id: Option<u64>,
    pub(crate) tstate_frame: FrameRoot,
    /// A free-threaded build (3.13+'s `_Py_DebugOffsets.free_threaded`): no GIL,
    /// objects laid out and shared otherwise.
    pub(crate) free_threaded: bool,
    /// `offsetof(PyThreadState, base_frame)` (3.15+): a pointer to the frame every
    /// whole stack of the thread ends at.
    pub(crate) tstate_base_frame: Option<u64>,
    pub frame: FrameLayout,
    pub(crate) code_filename: u64,
    pub(crate) code_name: u64,
    pub(crate) code_qualname: Option<u64>,
    pub(crate) code_firstlineno: u64,
    pub(crate) code_linetable: u64,
    /// Offset of the bytecode inside the code object (3.11+).
    pub(crate) code_adaptive: Option<u64>,
    pub(crate) line_table: LineTable,
    pub(crate) ob_type: u64,
    pub(crate) bytes_ob_size: u64,
    pub(crate) bytes_ob_sval: u64,
    pub(crate) unicode: UnicodeLayout,
    /// How to tell the GIL's holder; `None` when this version's offsets are not
    /// known (then whether a thread holds the GIL is unknown, never guessed).
    pub(crate) gil: Option<GilLayout>,
    /// Where local variables are; `None` when this version's offsets do not say.
    pub(crate) locals: Option<LocalsLayout>,
    /// The objects asyncio's tasks are made of (3.14+); `None` when this version's
    /// offsets do not say.
    pub(crate) objects: Option<AsyncioObjects>,
    /// `offsetof(PyInterpreterState, modules)` (`imports.modules` from 3.12):
    /// `sys.modules`, where asyncio's tasks are found before 3.14; `None` when
    /// this version's offsets do not say.
    pub(crate) interp_modules: Option<u64>,
}

/// Where a coroutine keeps its frame, and a set its entries (3.14+'s
/// `_Py_DebugOffsets`): what reading asyncio's tasks needs besides their own layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AsyncioObjects {
    /// `offsetof(PyGenObject, gi_iframe)`: the coroutine's `_PyInterpreterFrame`.
    pub(crate) gen_iframe: u64,
    /// `offsetof(PySetObject, table)`, `offsetof(PySetObject, mask)`.
    pub(crate) set_table: u64,
    pub(crate) set_mask: u64,
    /// What a suspended coroutine awaits; `None` when the offsets do not say.
    pub(crate) awaits: Option<AwaitLayout>,
}

/// Where a suspended coroutine's awaited object is: `gi_frame_state` (a byte)
/// says it is suspended in an `await`, and then the top of its frame's value
/// stack (`stackpointer[-1]`, a tagged `_PyStackRef`) is what it awaits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AwaitLayout {
    /// `offsetof(PyGenObject, gi_frame_state)`.
    pub(crate) gen_frame_state: u64,
    /// `offsetof(_PyInterpreterFrame, stackpointer)`.
    pub(crate) frame_stackpointer: u64,
    /// The states of a coroutine suspended in an `await` (3.15 has a second,
    /// while another thread is looking at it).
    pub(crate) awaiting_states: [u8; 2],
    /// `_PyStackRef` tag bits.
    pub(crate) tag_mask: u64,
}

impl Layout {
    /// Bytes to read of a thread state to see every field the walker uses.
    pub(crate) fn tstate_span(&self) -> u64 {
        let root = match self.tstate_frame {
            FrameRoot::Direct(o) => o,
            FrameRoot::CFrame { cframe, .. } => cframe,
        };
        [
            self.tstate_next,
            self.tstate_thread_id,
            self.tstate_native_thread_id.unwrap_or(0),
            self.tstate_base_frame.unwrap_or(0),
            root,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            + 8
    }

    /// Whether frames say which of them begins a call of the eval loop (3.11:
    /// the entry flag; 3.12+: the shim frame each call pushes).
    pub(crate) fn marks_entries(&self) -> bool {
        match self.frame {
            FrameLayout::Object { .. } => false,
            FrameLayout::Interpreter {
                entry_flag,
                first_shim_owner,
                ..
            } => entry_flag.is_some() || first_shim_owner.is_some(),
        }
    }

    /// Bytes to read of a frame.
    pub(crate) fn frame_span(&self) -> u64 {
        match self.frame {
            FrameLayout::Object {
                back,
                code,
                lasti,
                executing,
                ..
            } => back.max(code).max(lasti).max(executing.0) + 8,
            FrameLayout::Interpreter {
                previous,
                executable,
                instr_ptr,
                owner,
                tlbc,
                entry_flag,
                ..
            } => {
                previous
                    .max(executable)
                    .max(instr_ptr)
                    .max(owner)
                    .max(tlbc.map_or(0, |t| t.0))
                    .max(entry_flag.unwrap_or(0))
                    + 8
            }
        }
    }

    /// Bytes to read of a code object's header.
    pub(crate) fn code_span(&self) -> u64 {
        let tlbc = match self.frame {
            FrameLayout::Interpreter { tlbc, .. } => tlbc.map_or(0, |t| t.1),
            FrameLayout::Object { .. } => 0,
        };
        [
            self.ob_type,
            self.code_filename,
            self.code_name,
            self.code_qualname.unwrap_or(0),
            self.code_firstlineno,
            self.code_linetable,
            tlbc,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            + 8
    }
}

/// Where a [`Layout`] came from, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutSource {
    /// `offsets/3.X.json`, embedded in pyprobe.
    OffsetsFile {
        file: String,
        /// Which headers it was generated from.
        generated_from: String,
    },
    /// `_Py_DebugOffsets` read from the target, located with `offsets/3.X.json`.
    DebugOffsets {
        /// The `version` field of `_Py_DebugOffsets` (`PY_VERSION_HEX`).
        version_hex: u64,
        positions_file: String,
        /// True when the target is newer than every known `_Py_DebugOffsets` layout
        /// and the newest one was tried.
        newer_than_known: bool,
    },
}

impl std::fmt::Display for LayoutSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayoutSource::OffsetsFile {
                file,
                generated_from,
            } => write!(f, "offsets table {file} (generated from {generated_from})"),
            LayoutSource::DebugOffsets {
                version_hex,
                positions_file,
                newer_than_known,
            } => {
                write!(
                    f,
                    "_Py_DebugOffsets read from the target (version {version_hex:#010x}; \
                     its layout from {positions_file}"
                )?;
                if *newer_than_known {
                    write!(f, ", the newest known: the target is newer")?;
                }
                write!(f, ")")
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The files, shared by both builders.
// ---------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
struct Header {
    python: String,
    kind: String,
    source: String,
}

fn file_text(minor: u8) -> Option<&'static str> {
    FILES.iter().find(|(m, _)| *m == minor).map(|(_, t)| *t)
}

fn header(minor: u8) -> Result<Header> {
    let text = file_text(minor).ok_or_else(|| anyhow!("no offsets file for 3.{minor}"))?;
    serde_json::from_str(text).with_context(|| format!("offsets/3.{minor}.json is malformed"))
}

/// The minor versions with an offsets file of `kind` ("offsets" or "debug_offsets").
pub(crate) fn known_minors(kind: &str) -> Vec<u8> {
    FILES
        .iter()
        .filter(|(m, _)| header(*m).is_ok_and(|h| h.kind == kind))
        .map(|(m, _)| *m)
        .collect()
}

/// Whether `version` reads its layout from `_Py_DebugOffsets` (3.13+).
pub(crate) fn uses_debug_offsets(version: PyVersion) -> bool {
    version.at_least(3, 13)
}

fn check_spans(l: &Layout) -> Result<()> {
    let u = &l.unicode;
    // Only the first bytes of each structure are read: keep every read small.
    if l.tstate_span() > MAX_SMALL_STRUCT
        || l.frame_span() > MAX_SMALL_STRUCT
        || l.code_span() > MAX_SMALL_STRUCT
        || u.ascii_size > 256
        || u.compact_size > 256
        || u.ascii_size < u.state + 4
        || u.compact_size < u.ascii_size
        || u.kind_shift > 29
        || u.compact_bit > 31
        || u.ascii_bit > 31
        || l.bytes_ob_sval > 256
        || l.code_adaptive.is_some_and(|c| c > MAX_SMALL_STRUCT)
        || !l.gil.is_none_or(|g| gil_plausible(&g))
        || !l.locals.is_none_or(|g| locals_plausible(&g))
    {
        bail!("structure offsets out of range: {l:?}");
    }
    Ok(())
}

/// Whether the locals' offsets keep every read small.
fn locals_plausible(l: &LocalsLayout) -> bool {
    let names = match l.names {
        LocalNames::Varnames {
            nlocals,
            varnames,
            cellvars,
            freevars,
        } => nlocals.max(varnames).max(cellvars).max(freevars),
        LocalNames::LocalsPlus { names, kinds } => names.max(kinds),
    };
    l.frame_localsplus < MAX_SMALL_STRUCT
        && names < MAX_SMALL_STRUCT
        && (16..=64).contains(&l.object_head)
        && (l.object_head + 8..=l.object_head + 64).contains(&l.tuple_items)
}

/// Whether the GIL offsets keep every read small and inside its structure.
fn gil_plausible(g: &GilLayout) -> bool {
    match *g {
        GilLayout::RuntimeCurrent { tstate_current } => tstate_current < MAX_RUNTIME_SIZE,
        GilLayout::Interpreter {
            ceval_gil,
            last_holder,
            locked,
        } => {
            ceval_gil < MAX_INTERP_SIZE
                && last_holder < MAX_SMALL_STRUCT
                && locked < MAX_SMALL_STRUCT
                && last_holder.abs_diff(locked) >= 4
        }
    }
}

#[cfg(test)]
mod tests;
