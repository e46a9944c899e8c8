//! The layout of 3.13+, from the `_Py_DebugOffsets` the interpreter carries at the
//! start of `_PyRuntime`; the version's offsets file only says where in it each
//! number is, and gives the few it lacks.

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

use super::*;

/// A 3.13+ file: positions inside `_Py_DebugOffsets`, and what it lacks.
#[derive(Debug, Deserialize)]
pub(super) struct DebugFile {
    pub(super) debug_offsets: BTreeMap<String, u64>,
    unicode_object: DebugUnicode,
    frame: DebugFrame,
    /// Not in `_Py_DebugOffsets` (3.13): `sys.modules`.
    #[serde(default)]
    imports: Option<super::offsets_file::Imports>,
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
    /// `gi_frame_state` of a coroutine suspended in an `await` (3.14+).
    #[serde(default)]
    yield_from_state: Option<u8>,
    #[serde(default)]
    yield_from_locked_state: Option<u8>,
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
pub(super) fn debug_minor(version: PyVersion) -> Result<(u8, bool)> {
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

pub(super) fn parse_debug_offsets(
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
    // Locals: optional, as for the GIL (a positions file without them reads stacks).
    let locals = (|| -> Result<LocalsLayout> {
        let frame = within(
            "interpreter_frame.size",
            MAX_SMALL_STRUCT,
            &["interpreter_frame.localsplus"],
        )?;
        let names = within(
            "code_object.size",
            MAX_SMALL_STRUCT,
            &["code_object.localsplusnames", "code_object.localspluskinds"],
        )?;
        let tuple_items = pos("tuple_object.ob_item")?;
        Ok(LocalsLayout {
            tuple_items,
            frame_localsplus: frame[0],
            names: LocalNames::LocalsPlus {
                names: names[0],
                kinds: names[1],
            },
            object_head: pos("pyobject.size")?,
            long_tagged: true,
        })
    })()
    .ok()
    .filter(locals_plausible);
    // 3.14+: what asyncio's tasks need; absent before, or when implausible.
    let objects = (|| -> Result<AsyncioObjects> {
        let gen = within(
            "gen_object.size",
            MAX_SMALL_STRUCT,
            &["gen_object.gi_iframe"],
        )?;
        let set = within(
            "set_object.size",
            MAX_SMALL_STRUCT,
            &["set_object.table", "set_object.mask"],
        )?;
        // Optional: without them a waiting coroutine is shown alone.
        let awaits = (|| -> Result<AwaitLayout> {
            let state = within(
                "gen_object.size",
                MAX_SMALL_STRUCT,
                &["gen_object.gi_frame_state"],
            )?;
            let sp = within(
                "interpreter_frame.size",
                MAX_SMALL_STRUCT,
                &["interpreter_frame.stackpointer"],
            )?;
            let first = f
                .frame
                .yield_from_state
                .ok_or_else(|| anyhow!("no yield_from_state"))?;
            Ok(AwaitLayout {
                gen_frame_state: state[0],
                frame_stackpointer: sp[0],
                awaiting_states: [first, f.frame.yield_from_locked_state.unwrap_or(first)],
                tag_mask: f.frame.tag_mask,
            })
        })()
        .ok();
        Ok(AsyncioObjects {
            gen_iframe: gen[0],
            set_table: set[0],
            set_mask: set[1],
            awaits,
        })
    })()
    .ok();
    let layout = Layout {
        runtime_interpreters_head: rt[0],
        interp_next: is[0],
        interp_threads_head: is[1],
        tstate_next: ts[0],
        tstate_thread_id: ts[2],
        tstate_native_thread_id: Some(ts[3]),
        tstate_frame: FrameRoot::Direct(ts[1]),
        free_threaded,
        // Optional (3.15+): without it a walk's end is checked as before 3.15.
        tstate_base_frame: within(
            "thread_state.size",
            MAX_TSTATE_SIZE,
            &["thread_state.base_frame"],
        )
        .ok()
        .map(|b| b[0]),
        frame: FrameLayout::Interpreter {
            previous: fr[0],
            executable: fr[1],
            instr_ptr: fr[2],
            owner: fr[3],
            first_shim_owner: Some(f.frame.first_shim_owner),
            entry_flag: None,
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
        locals,
        objects,
        interp_modules: f
            .imports
            .as_ref()
            .map(|i| i.interpreter_modules)
            .filter(|&m| pos("interpreter_state.size").is_ok_and(|size| m + 8 <= size)),
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
