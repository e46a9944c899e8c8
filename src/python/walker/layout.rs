//! Where the walker finds things in a CPython's structures: one [`Layout`], built either
//! from an offsets file (3.7 – 3.12, `offsets/3.X.json`, generated from the version's
//! headers by `scripts/gen-offsets.sh`) or from the `_Py_DebugOffsets` the interpreter
//! carries at the start of `_PyRuntime` (3.13+; the offsets file of those versions only
//! says where in `_Py_DebugOffsets` each number is).

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

use crate::python::version::PyVersion;
use crate::sdt::MemoryReader;

/// The embedded offsets files, by minor version.
const FILES: &[(u8, &str)] = &[
    (7, include_str!("../../../offsets/3.7.json")),
    (8, include_str!("../../../offsets/3.8.json")),
    (9, include_str!("../../../offsets/3.9.json")),
    (10, include_str!("../../../offsets/3.10.json")),
    (11, include_str!("../../../offsets/3.11.json")),
    (12, include_str!("../../../offsets/3.12.json")),
    (13, include_str!("../../../offsets/3.13.json")),
    (14, include_str!("../../../offsets/3.14.json")),
    (15, include_str!("../../../offsets/3.15.json")),
];

/// The cookie `_Py_DebugOffsets` starts with.
pub const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";

/// Upper bounds for the sizes `_Py_DebugOffsets` reports: a corrupt or foreign block is
/// refused rather than trusted.
const MAX_RUNTIME_SIZE: u64 = 64 << 20;
const MAX_INTERP_SIZE: u64 = 64 << 20;
const MAX_TSTATE_SIZE: u64 = 1 << 20;
const MAX_SMALL_STRUCT: u64 = 4096;

/// How a frame records its current instruction's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineTable {
    /// `co_lnotab` (3.6 – 3.9): (address delta, line delta) byte pairs.
    Lnotab,
    /// `co_linetable` of 3.10: (address delta, line delta) pairs, -128 = no line.
    Linetable310,
    /// `co_linetable` of 3.11+: the location table (`Objects/locations.md`).
    Locations,
}

/// Where a thread state keeps its innermost frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameRoot {
    /// A pointer field of the thread state (`frame` up to 3.10, `current_frame` 3.13+).
    Direct(u64),
    /// `tstate->cframe->current_frame` (3.11, 3.12).
    CFrame { cframe: u64, current_frame: u64 },
}

/// What a frame is and where its fields are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameLayout {
    /// `PyFrameObject` (up to 3.10): `f_back`, `f_code`, `f_lasti`.
    Object {
        back: u64,
        code: u64,
        lasti: u64,
        /// Bytes per unit of `f_lasti`: 1 up to 3.9, 2 (code units) in 3.10.
        lasti_unit: u64,
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
        /// Tag bits of `_PyStackRef f_executable` (3.14+), masked off.
        tag_mask: u64,
        /// Free-threaded 3.14+: (`tlbc_index` in the frame, `co_tlbc` in the code).
        tlbc: Option<(u64, u64)>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnicodeLayout {
    pub length: u64,
    pub state: u64,
    /// sizeof(PyASCIIObject): compact ASCII data starts here.
    pub ascii_size: u64,
    /// sizeof(PyCompactUnicodeObject): compact non-ASCII data starts here; the data
    /// pointer of a legacy (non-compact) string is stored here.
    pub compact_size: u64,
    pub kind_shift: u32,
    pub compact_bit: u32,
    pub ascii_bit: u32,
}

/// Where the thread state holding the GIL is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GilLayout {
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

/// Every offset the walker uses, for one interpreter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub runtime_interpreters_head: u64,
    pub interp_next: u64,
    pub interp_threads_head: u64,
    pub tstate_next: u64,
    pub tstate_thread_id: u64,
    pub tstate_native_thread_id: Option<u64>,
    pub tstate_frame: FrameRoot,
    pub frame: FrameLayout,
    pub code_filename: u64,
    pub code_name: u64,
    pub code_qualname: Option<u64>,
    pub code_firstlineno: u64,
    pub code_linetable: u64,
    /// Offset of the bytecode inside the code object (3.11+).
    pub code_adaptive: Option<u64>,
    pub line_table: LineTable,
    pub ob_type: u64,
    pub bytes_ob_size: u64,
    pub bytes_ob_sval: u64,
    pub unicode: UnicodeLayout,
    /// How to tell the GIL's holder; `None` when this version's offsets are not
    /// known (then whether a thread holds the GIL is unknown, never guessed).
    pub gil: Option<GilLayout>,
}

impl Layout {
    /// Bytes to read of a thread state to see every field the walker uses.
    pub fn tstate_span(&self) -> u64 {
        let root = match self.tstate_frame {
            FrameRoot::Direct(o) => o,
            FrameRoot::CFrame { cframe, .. } => cframe,
        };
        [
            self.tstate_next,
            self.tstate_thread_id,
            self.tstate_native_thread_id.unwrap_or(0),
            root,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            + 8
    }

    /// Bytes to read of a frame.
    pub fn frame_span(&self) -> u64 {
        match self.frame {
            FrameLayout::Object {
                back, code, lasti, ..
            } => back.max(code).max(lasti) + 8,
            FrameLayout::Interpreter {
                previous,
                executable,
                instr_ptr,
                owner,
                tlbc,
                ..
            } => {
                previous
                    .max(executable)
                    .max(instr_ptr)
                    .max(owner)
                    .max(tlbc.map_or(0, |t| t.0))
                    + 8
            }
        }
    }

    /// Bytes to read of a code object's header.
    pub fn code_span(&self) -> u64 {
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
// The files.
// ---------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
struct Header {
    python: String,
    kind: String,
    source: String,
}

#[derive(Debug, Deserialize)]
struct OffsetsFile {
    runtime_state: RuntimeState,
    interpreter_state: InterpreterState,
    /// 3.12: `struct _gil_runtime_state`.
    #[serde(default)]
    gil_runtime_state: Option<GilRuntimeState>,
    thread_state: ThreadState,
    frame_object: Option<FrameObject>,
    interpreter_frame: Option<InterpreterFrame>,
    code_object: CodeObject,
    line_table: String,
    lasti_unit: u64,
    pyobject: PyObject,
    bytes_object: BytesObject,
    unicode_object: UnicodeObject,
}

#[derive(Debug, Deserialize)]
struct RuntimeState {
    interpreters_head: u64,
    /// Up to 3.11: `gilstate.tstate_current`.
    #[serde(default)]
    gilstate_tstate_current: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct InterpreterState {
    next: u64,
    threads_head: u64,
    /// 3.12+: `ceval.gil`.
    #[serde(default)]
    ceval_gil: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct GilRuntimeState {
    last_holder: u64,
    locked: u64,
}

#[derive(Debug, Deserialize)]
struct ThreadState {
    next: u64,
    thread_id: u64,
    frame: Option<u64>,
    cframe: Option<u64>,
    cframe_current_frame: Option<u64>,
    native_thread_id: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct FrameObject {
    back: u64,
    code: u64,
    lasti: u64,
}

#[derive(Debug, Deserialize)]
struct InterpreterFrame {
    previous: u64,
    executable: u64,
    instr_ptr: u64,
    owner: u64,
    first_shim_owner: Option<u8>,
}

#[derive(Debug, Deserialize)]
struct CodeObject {
    filename: u64,
    name: u64,
    qualname: Option<u64>,
    linetable: u64,
    code_adaptive: Option<u64>,
    firstlineno: u64,
}

#[derive(Debug, Deserialize)]
struct PyObject {
    ob_type: u64,
}

#[derive(Debug, Deserialize)]
struct BytesObject {
    ob_size: u64,
    ob_sval: u64,
}

#[derive(Debug, Deserialize)]
struct UnicodeObject {
    length: u64,
    state: u64,
    ascii_size: u64,
    compact_size: u64,
    kind_shift: u32,
    compact_bit: u32,
    ascii_bit: u32,
}

/// A 3.13+ file: positions inside `_Py_DebugOffsets`, and what it lacks.
#[derive(Debug, Deserialize)]
struct DebugFile {
    debug_offsets: BTreeMap<String, u64>,
    unicode_object: DebugUnicode,
    frame: DebugFrame,
}

#[derive(Debug, Deserialize)]
struct DebugUnicode {
    compact_size: u64,
    kind_shift: u32,
    compact_bit: u32,
    ascii_bit: u32,
}

#[derive(Debug, Deserialize)]
struct DebugFrame {
    first_shim_owner: u8,
    tag_mask: u64,
}

fn file_text(minor: u8) -> Option<&'static str> {
    FILES.iter().find(|(m, _)| *m == minor).map(|(_, t)| *t)
}

fn header(minor: u8) -> Result<Header> {
    let text = file_text(minor).ok_or_else(|| anyhow!("no offsets file for 3.{minor}"))?;
    serde_json::from_str(text).with_context(|| format!("offsets/3.{minor}.json is malformed"))
}

/// The minor versions with an offsets file of `kind` ("offsets" or "debug_offsets").
pub fn known_minors(kind: &str) -> Vec<u8> {
    FILES
        .iter()
        .filter(|(m, _)| header(*m).is_ok_and(|h| h.kind == kind))
        .map(|(m, _)| *m)
        .collect()
}

/// Whether `version` reads its layout from `_Py_DebugOffsets` (3.13+).
pub fn uses_debug_offsets(version: PyVersion) -> bool {
    version.at_least(3, 13)
}

/// The layout of 3.7 – 3.12 from its offsets file.
pub fn from_offsets_file(version: PyVersion) -> Result<(Layout, LayoutSource)> {
    let minor = version.minor;
    if version.major != 3 || file_text(minor).is_none() {
        bail!(
            "python {version} is not supported by the frame walker (supported: 3.{}; \
             3.13+ through _Py_DebugOffsets)",
            known_minors("offsets")
                .iter()
                .map(|m| m.to_string())
                .collect::<Vec<_>>()
                .join(", 3.")
        );
    }
    let head = header(minor)?;
    if head.kind != "offsets" {
        bail!("python {version} reads its layout from _Py_DebugOffsets, not an offsets table");
    }
    let text = file_text(minor).unwrap_or_default();
    let f: OffsetsFile = serde_json::from_str(text)
        .with_context(|| format!("offsets/3.{minor}.json is malformed"))?;
    let layout = layout_of_file(&f)?;
    Ok((
        layout,
        LayoutSource::OffsetsFile {
            file: format!("offsets/{}.json", head.python),
            generated_from: head.source,
        },
    ))
}

fn layout_of_file(f: &OffsetsFile) -> Result<Layout> {
    let t = &f.thread_state;
    let tstate_frame = match (t.frame, t.cframe, t.cframe_current_frame) {
        (Some(frame), _, _) => FrameRoot::Direct(frame),
        (None, Some(cframe), Some(current_frame)) => FrameRoot::CFrame {
            cframe,
            current_frame,
        },
        _ => bail!("offsets file gives neither thread_state.frame nor thread_state.cframe"),
    };
    let frame = match (&f.frame_object, &f.interpreter_frame) {
        (Some(o), _) => FrameLayout::Object {
            back: o.back,
            code: o.code,
            lasti: o.lasti,
            lasti_unit: f.lasti_unit,
        },
        (None, Some(i)) => FrameLayout::Interpreter {
            previous: i.previous,
            executable: i.executable,
            instr_ptr: i.instr_ptr,
            owner: i.owner,
            first_shim_owner: i.first_shim_owner,
            tag_mask: 0,
            tlbc: None,
        },
        (None, None) => bail!("offsets file gives no frame layout"),
    };
    let line_table = match f.line_table.as_str() {
        "lnotab" => LineTable::Lnotab,
        "linetable310" => LineTable::Linetable310,
        "locations" => LineTable::Locations,
        other => bail!("unknown line table kind {other:?}"),
    };
    let gil = match (
        f.runtime_state.gilstate_tstate_current,
        f.interpreter_state.ceval_gil,
        &f.gil_runtime_state,
    ) {
        (Some(tstate_current), _, _) => Some(GilLayout::RuntimeCurrent { tstate_current }),
        (None, Some(ceval_gil), Some(g)) => Some(GilLayout::Interpreter {
            ceval_gil,
            last_holder: g.last_holder,
            locked: g.locked,
        }),
        _ => None,
    };
    let u = &f.unicode_object;
    let layout = Layout {
        runtime_interpreters_head: f.runtime_state.interpreters_head,
        interp_next: f.interpreter_state.next,
        interp_threads_head: f.interpreter_state.threads_head,
        tstate_next: t.next,
        tstate_thread_id: t.thread_id,
        tstate_native_thread_id: t.native_thread_id,
        tstate_frame,
        frame,
        code_filename: f.code_object.filename,
        code_name: f.code_object.name,
        code_qualname: f.code_object.qualname,
        code_firstlineno: f.code_object.firstlineno,
        code_linetable: f.code_object.linetable,
        code_adaptive: f.code_object.code_adaptive,
        line_table,
        ob_type: f.pyobject.ob_type,
        bytes_ob_size: f.bytes_object.ob_size,
        bytes_ob_sval: f.bytes_object.ob_sval,
        unicode: UnicodeLayout {
            length: u.length,
            state: u.state,
            ascii_size: u.ascii_size,
            compact_size: u.compact_size,
            kind_shift: u.kind_shift,
            compact_bit: u.compact_bit,
            ascii_bit: u.ascii_bit,
        },
        gil,
    };
    check_spans(&layout)?;
    Ok(layout)
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
    {
        bail!("structure offsets out of range: {l:?}");
    }
    Ok(())
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

/// The GIL's offsets from `_Py_DebugOffsets` (3.13+): the interpreter's `ceval.gil`
/// pointer, and where `locked` and `last_holder` are in the GIL structure (given as
/// offsets of the interpreter's own `_gil`). `None` when the positions file lacks
/// them or a value is implausible: the GIL state is then unknown.
fn debug_gil(pos: &dyn Fn(&str) -> Result<u64>) -> Option<GilLayout> {
    let size = pos("interpreter_state.size").ok()?;
    let ceval_gil = pos("interpreter_state.ceval_gil").ok()?;
    let own = pos("interpreter_state.gil_runtime_state").ok()?;
    let locked = pos("interpreter_state.gil_runtime_state_locked").ok()?;
    let holder = pos("interpreter_state.gil_runtime_state_holder").ok()?;
    if [ceval_gil, own, locked, holder].iter().any(|&o| o >= size) {
        return None;
    }
    let g = GilLayout::Interpreter {
        ceval_gil,
        last_holder: holder.checked_sub(own)?,
        locked: locked.checked_sub(own)?,
    };
    gil_plausible(&g).then_some(g)
}

/// The minor version whose `_Py_DebugOffsets` layout describes `version`: its own, or
/// the newest known for a newer target.
fn debug_minor(version: PyVersion) -> Result<(u8, bool)> {
    let known = known_minors("debug_offsets");
    if known.contains(&version.minor) {
        return Ok((version.minor, false));
    }
    match known.iter().max() {
        Some(&newest) if version.minor > newest => Ok((newest, true)),
        _ => bail!("no _Py_DebugOffsets layout for python {version}"),
    }
}

/// How many bytes of `_Py_DebugOffsets` to read for `version`.
pub fn debug_offsets_size(version: PyVersion) -> Result<u64> {
    let (minor, _) = debug_minor(version)?;
    let text = file_text(minor).unwrap_or_default();
    let f: DebugFile = serde_json::from_str(text)
        .with_context(|| format!("offsets/3.{minor}.json is malformed"))?;
    f.debug_offsets
        .get("size")
        .copied()
        .filter(|&s| s > 0 && s <= MAX_SMALL_STRUCT)
        .ok_or_else(|| anyhow!("offsets/3.{minor}.json: bad debug_offsets.size"))
}

/// Reads `_Py_DebugOffsets` at `runtime` (the start of `_PyRuntime`) and builds the
/// layout from it: checks the cookie, the version, and that every size and offset is
/// plausible. `free_threaded` builds get their unicode state bits shifted (3.14+:
/// `interned` is a whole byte there).
pub fn from_debug_offsets<M: MemoryReader + ?Sized>(
    mem: &M,
    runtime: u64,
    version: PyVersion,
) -> Result<(Layout, LayoutSource)> {
    let (minor, newer_than_known) = debug_minor(version)?;
    let text = file_text(minor).unwrap_or_default();
    let f: DebugFile = serde_json::from_str(text)
        .with_context(|| format!("offsets/3.{minor}.json is malformed"))?;
    let size = debug_offsets_size(version)?;
    let mut block = vec![0u8; size as usize];
    mem.read_exact(runtime, &mut block)
        .context("cannot read _Py_DebugOffsets at the start of _PyRuntime")?;
    parse_debug_offsets(&block, &f, minor, version, newer_than_known)
}

fn parse_debug_offsets(
    block: &[u8],
    f: &DebugFile,
    minor: u8,
    version: PyVersion,
    newer_than_known: bool,
) -> Result<(Layout, LayoutSource)> {
    let pos = |name: &str| -> Result<u64> {
        let at = *f
            .debug_offsets
            .get(name)
            .ok_or_else(|| anyhow!("offsets/3.{minor}.json lacks debug_offsets.{name}"))?
            as usize;
        let bytes = block
            .get(at..at + 8)
            .ok_or_else(|| anyhow!("_Py_DebugOffsets.{name} is past its end"))?;
        Ok(u64::from_le_bytes(bytes.try_into().unwrap_or_default()))
    };
    if block.get(..8) != Some(&DEBUG_COOKIE[..]) {
        bail!(
            "no _Py_DebugOffsets at the start of _PyRuntime (the \"xdebugpy\" cookie is missing)"
        );
    }
    let version_hex = pos("version")?;
    let (major, minor_found) = ((version_hex >> 24) & 0xff, (version_hex >> 16) & 0xff);
    if major != 3 || minor_found != version.minor as u64 {
        bail!("_Py_DebugOffsets says version {version_hex:#x}, but the interpreter is {version}");
    }
    let free_threaded = match pos("free_threaded")? {
        0 => false,
        1 => true,
        other => bail!("_Py_DebugOffsets.free_threaded is {other}"),
    };
    // Each offset must lie inside its structure's reported size, and each size be sane.
    let within = |size_name: &str, max: u64, fields: &[&str]| -> Result<Vec<u64>> {
        let size = pos(size_name)?;
        if size == 0 || size > max {
            bail!("_Py_DebugOffsets.{size_name} = {size} is not plausible");
        }
        fields
            .iter()
            .map(|name| {
                let v = pos(name)?;
                if v >= size {
                    bail!("_Py_DebugOffsets.{name} = {v} is outside its structure ({size_name} = {size})");
                }
                Ok(v)
            })
            .collect()
    };
    let rt = within(
        "runtime_state.size",
        MAX_RUNTIME_SIZE,
        &["runtime_state.interpreters_head"],
    )?;
    let is = within(
        "interpreter_state.size",
        MAX_INTERP_SIZE,
        &["interpreter_state.next", "interpreter_state.threads_head"],
    )?;
    let ts = within(
        "thread_state.size",
        MAX_TSTATE_SIZE,
        &[
            "thread_state.next",
            "thread_state.current_frame",
            "thread_state.thread_id",
            "thread_state.native_thread_id",
        ],
    )?;
    let fr = within(
        "interpreter_frame.size",
        MAX_SMALL_STRUCT,
        &[
            "interpreter_frame.previous",
            "interpreter_frame.executable",
            "interpreter_frame.instr_ptr",
            "interpreter_frame.owner",
        ],
    )?;
    let co = within(
        "code_object.size",
        MAX_SMALL_STRUCT,
        &[
            "code_object.filename",
            "code_object.name",
            "code_object.qualname",
            "code_object.linetable",
            "code_object.firstlineno",
        ],
    )?;
    // co_code_adaptive is where the (variable-sized) object's bytecode starts: its end.
    let code_adaptive = pos("code_object.co_code_adaptive")?;
    let code_size = pos("code_object.size")?;
    if code_adaptive > code_size || code_adaptive < 16 {
        bail!("_Py_DebugOffsets.code_object.co_code_adaptive = {code_adaptive} is not plausible");
    }
    let ob = within("pyobject.size", 64, &["pyobject.ob_type"])?;
    let by = within(
        "bytes_object.size",
        256,
        &["bytes_object.ob_size", "bytes_object.ob_sval"],
    )?;
    let un = within(
        "unicode_object.size",
        256,
        &["unicode_object.state", "unicode_object.length"],
    )?;
    let gil = if free_threaded {
        // No GIL to hold, or one enabled for a while: not told apart here.
        None
    } else {
        debug_gil(&pos)
    };
    let ascii_size = pos("unicode_object.asciiobject_size")?;
    if !(24..=256).contains(&ascii_size) || ascii_size < un[0] + 4 {
        bail!("_Py_DebugOffsets.unicode_object.asciiobject_size = {ascii_size} is not plausible");
    }
    let tlbc = if free_threaded {
        let frame_index = pos("interpreter_frame.tlbc_index").ok();
        let code_tlbc = pos("code_object.co_tlbc").ok();
        match (frame_index, code_tlbc) {
            (Some(i), Some(c)) if i > 0 && c > 0 => Some((i, c)),
            _ => None,
        }
    } else {
        None
    };
    // Free-threaded 3.14+ keeps `interned` in a whole byte before the bitfields.
    let state_shift = if free_threaded && version.at_least(3, 14) {
        8 - 2
    } else {
        0
    };
    let layout = Layout {
        runtime_interpreters_head: rt[0],
        interp_next: is[0],
        interp_threads_head: is[1],
        tstate_next: ts[0],
        tstate_thread_id: ts[2],
        tstate_native_thread_id: Some(ts[3]),
        tstate_frame: FrameRoot::Direct(ts[1]),
        frame: FrameLayout::Interpreter {
            previous: fr[0],
            executable: fr[1],
            instr_ptr: fr[2],
            owner: fr[3],
            first_shim_owner: Some(f.frame.first_shim_owner),
            tag_mask: f.frame.tag_mask,
            tlbc,
        },
        code_filename: co[0],
        code_name: co[1],
        code_qualname: Some(co[2]),
        code_linetable: co[3],
        code_firstlineno: co[4],
        code_adaptive: Some(code_adaptive),
        line_table: LineTable::Locations,
        ob_type: ob[0],
        bytes_ob_size: by[0],
        bytes_ob_sval: by[1],
        unicode: UnicodeLayout {
            length: un[1],
            state: un[0],
            ascii_size,
            compact_size: f.unicode_object.compact_size,
            kind_shift: f.unicode_object.kind_shift + state_shift,
            compact_bit: f.unicode_object.compact_bit + state_shift,
            ascii_bit: f.unicode_object.ascii_bit + state_shift,
        },
        gil,
    };
    check_spans(&layout)?;
    Ok((
        layout,
        LayoutSource::DebugOffsets {
            version_hex,
            positions_file: format!("offsets/3.{minor}.json"),
            newer_than_known,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(minor: u8) -> PyVersion {
        PyVersion {
            major: 3,
            minor,
            micro: None,
        }
    }

    #[test]
    fn every_embedded_file_parses() {
        for minor in 7..=12 {
            let (layout, source) = from_offsets_file(v(minor)).unwrap();
            assert!(source.to_string().contains(&format!("3.{minor}.json")));
            assert_eq!(layout.code_qualname.is_some(), minor >= 11);
            assert_eq!(layout.tstate_native_thread_id.is_some(), minor >= 11);
            match layout.gil {
                Some(GilLayout::RuntimeCurrent { tstate_current }) => {
                    assert!(minor <= 11 && tstate_current > 0)
                }
                Some(GilLayout::Interpreter {
                    last_holder,
                    locked,
                    ..
                }) => assert!(minor == 12 && last_holder != locked),
                None => panic!("3.{minor}: no GIL offsets"),
            }
        }
        for minor in 13..=15 {
            assert!(debug_offsets_size(v(minor)).unwrap() > 100);
            assert!(from_offsets_file(v(minor)).is_err());
        }
        assert_eq!(known_minors("debug_offsets"), vec![13, 14, 15]);
        assert!(from_offsets_file(v(6)).is_err());
        assert!(from_offsets_file(v(16)).is_err());
        // A newer target tries the newest known _Py_DebugOffsets layout.
        assert_eq!(debug_minor(v(16)).unwrap(), (15, true));
    }

    /// A synthetic `_Py_DebugOffsets` block for the 3.13 positions file.
    fn block_313(edit: impl Fn(&mut BTreeMap<&str, u64>)) -> Vec<u8> {
        let f: DebugFile = serde_json::from_str(file_text(13).unwrap()).unwrap();
        let mut values: BTreeMap<&str, u64> = BTreeMap::new();
        for (k, val) in [
            ("version", 0x030d05f0),
            ("free_threaded", 0),
            ("runtime_state.size", 100_000),
            ("runtime_state.interpreters_head", 632),
            ("interpreter_state.size", 200_000),
            ("interpreter_state.next", 8),
            ("interpreter_state.threads_head", 7000),
            ("interpreter_state.ceval_gil", 7100),
            ("interpreter_state.gil_runtime_state", 7200),
            ("interpreter_state.gil_runtime_state_locked", 7216),
            ("interpreter_state.gil_runtime_state_holder", 7208),
            ("thread_state.size", 400),
            ("thread_state.next", 8),
            ("thread_state.interp", 16),
            ("thread_state.current_frame", 72),
            ("thread_state.thread_id", 144),
            ("thread_state.native_thread_id", 152),
            ("interpreter_frame.size", 80),
            ("interpreter_frame.previous", 8),
            ("interpreter_frame.executable", 0),
            ("interpreter_frame.instr_ptr", 56),
            ("interpreter_frame.owner", 70),
            ("code_object.size", 208),
            ("code_object.filename", 112),
            ("code_object.name", 120),
            ("code_object.qualname", 128),
            ("code_object.linetable", 136),
            ("code_object.firstlineno", 68),
            ("code_object.co_code_adaptive", 200),
            ("pyobject.size", 16),
            ("pyobject.ob_type", 8),
            ("bytes_object.size", 40),
            ("bytes_object.ob_size", 16),
            ("bytes_object.ob_sval", 32),
            ("unicode_object.size", 56),
            ("unicode_object.state", 32),
            ("unicode_object.length", 16),
            ("unicode_object.asciiobject_size", 40),
        ] {
            values.insert(k, val);
        }
        edit(&mut values);
        let mut block = vec![0u8; f.debug_offsets["size"] as usize];
        block[..8].copy_from_slice(DEBUG_COOKIE);
        for (k, val) in values {
            let at = f.debug_offsets[k] as usize;
            block[at..at + 8].copy_from_slice(&val.to_le_bytes());
        }
        block
    }

    fn parse_313(block: &[u8]) -> Result<Layout> {
        let f: DebugFile = serde_json::from_str(file_text(13).unwrap()).unwrap();
        parse_debug_offsets(block, &f, 13, v(13), false).map(|(l, _)| l)
    }

    #[test]
    fn debug_offsets_are_read_and_checked() {
        let layout = parse_313(&block_313(|_| {})).unwrap();
        assert_eq!(layout.runtime_interpreters_head, 632);
        assert_eq!(layout.tstate_frame, FrameRoot::Direct(72));
        assert_eq!(layout.tstate_native_thread_id, Some(152));
        assert_eq!(layout.code_adaptive, Some(200));
        assert_eq!(layout.unicode.ascii_size, 40);
        assert_eq!(
            layout.gil,
            Some(GilLayout::Interpreter {
                ceval_gil: 7100,
                last_holder: 8,
                locked: 16
            })
        );
        // GIL offsets that make no sense leave the GIL state unknown, the rest usable.
        for (field, value) in [
            ("interpreter_state.gil_runtime_state_locked", 7100),
            ("interpreter_state.gil_runtime_state_holder", 1 << 30),
            ("interpreter_state.ceval_gil", 300_000),
        ] {
            let layout = parse_313(&block_313(|m| {
                m.insert(field, value);
            }))
            .unwrap();
            assert_eq!(layout.gil, None, "{field} = {value}");
        }
        let free_threaded = parse_313(&block_313(|m| {
            m.insert("free_threaded", 1);
        }))
        .unwrap();
        assert_eq!(free_threaded.gil, None);

        let mut bad_cookie = block_313(|_| {});
        bad_cookie[0] = b'y';
        assert!(parse_313(&bad_cookie)
            .unwrap_err()
            .to_string()
            .contains("cookie"));
        let wrong_version = block_313(|m| {
            m.insert("version", 0x030e00f0);
        });
        assert!(parse_313(&wrong_version).is_err());
        let outside = block_313(|m| {
            m.insert("thread_state.native_thread_id", 500);
        });
        assert!(parse_313(&outside)
            .unwrap_err()
            .to_string()
            .contains("outside"));
        let huge = block_313(|m| {
            m.insert("interpreter_frame.size", 1 << 40);
        });
        assert!(parse_313(&huge).is_err());
        let ft = block_313(|m| {
            m.insert("free_threaded", 7);
        });
        assert!(parse_313(&ft).is_err());
        assert!(parse_313(&[0u8; 16]).is_err());
    }
}
