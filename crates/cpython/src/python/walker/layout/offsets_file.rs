//! The layout of 3.7 – 3.12, from the version's offsets file (`offsets/3.X.json`,
//! generated from its headers): every offset the walker uses, given directly.

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use super::*;

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
    #[serde(default)]
    locals: Option<Locals>,
    #[serde(default)]
    imports: Option<Imports>,
}

/// `sys.modules` (asyncio's tasks before 3.14).
#[derive(Debug, Deserialize)]
pub(super) struct Imports {
    pub(super) interpreter_modules: u64,
}

/// Where local variables are: up to 3.10 in a frame object, named by `co_varnames`,
/// `co_cellvars` and `co_freevars`; 3.11 and 3.12 in an interpreter frame, named by
/// `co_localsplusnames`.
#[derive(Debug, Deserialize)]
struct Locals {
    frame_localsplus: u64,
    code_nlocals: Option<u64>,
    code_varnames: Option<u64>,
    code_cellvars: Option<u64>,
    code_freevars: Option<u64>,
    code_localsplusnames: Option<u64>,
    code_localspluskinds: Option<u64>,
    tuple_items: u64,
}

impl Locals {
    fn layout(&self, object_head: u64, long_tagged: bool) -> Option<LocalsLayout> {
        let names = match (self.code_localsplusnames, self.code_localspluskinds) {
            (Some(names), Some(kinds)) => LocalNames::LocalsPlus { names, kinds },
            _ => LocalNames::Varnames {
                nlocals: self.code_nlocals?,
                varnames: self.code_varnames?,
                cellvars: self.code_cellvars?,
                freevars: self.code_freevars?,
            },
        };
        Some(LocalsLayout {
            frame_localsplus: self.frame_localsplus,
            names,
            object_head,
            long_tagged,
            tuple_items: self.tuple_items,
        })
    }
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
    #[serde(default)]
    is_entry: Option<u64>,
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
    let layout = layout_of_file(&f, version)?;
    Ok((
        layout,
        LayoutSource::OffsetsFile {
            file: format!("offsets/{}.json", head.python),
            generated_from: head.source,
        },
    ))
}

fn layout_of_file(f: &OffsetsFile, version: PyVersion) -> Result<Layout> {
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
            // Measured on each version (a running frame, its caller, a
            // suspended generator's); the frame object is private to CPython.
            executing: if version.at_least(3, 10) {
                (108, 0)
            } else {
                (116, 1)
            },
        },
        (None, Some(i)) => FrameLayout::Interpreter {
            previous: i.previous,
            executable: i.executable,
            instr_ptr: i.instr_ptr,
            owner: i.owner,
            first_shim_owner: i.first_shim_owner,
            entry_flag: i.is_entry,
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
        free_threaded: false,
        tstate_base_frame: None,
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
        // PyObject is its reference count and its type.
        locals: f
            .locals
            .as_ref()
            .and_then(|l| l.layout(f.pyobject.ob_type + 8, version.at_least(3, 12))),
        objects: None,
        interp_modules: f.imports.as_ref().map(|i| i.interpreter_modules),
    };
    check_spans(&layout)?;
    Ok(layout)
}
