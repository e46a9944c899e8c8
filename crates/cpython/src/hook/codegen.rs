//! Machine code of the hook page and of the detour at the safe point (see [`super`]).
//!
//! Everything is built at its final address: constants first, then code, assembled
//! with iced-x86's `CodeAssembler`. Addresses of the C API functions, the state page
//! and the ring are immediates (`movabs`), so only the detour has a placement
//! constraint (its `jmp rel32` back to the function it was displaced from).
//!
//! This file holds the parameters, the constants area and [`build_hook`], which lays
//! the page out; the code is emitted by `callbacks` (the hot path, and the exit
//! callback), `install` (installer, uninstaller, `register_exit`) through
//! `c_calls` (calling the C API); `detour` builds the safe point's detour.

mod c_calls;
mod callbacks;
mod detour;
mod install;
mod record;

pub use detour::{build_detour, Detour, DetourCalls, JMP_LEN};

use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, IcedError};
use thiserror::Error;

use super::HOOK_MAGIC;
use callbacks::{emit_at_exit, emit_callbacks};
use detour::MAX_DISPLACED;

/// `METH_FASTCALL`.
const METH_FASTCALL: u64 = 0x80;
/// `METH_NOARGS`.
const METH_NOARGS: u64 = 0x04;
/// `offsetof(PyASCIIObject, hash)` (3.7 to 3.15).
pub(crate) const STR_HASH: i32 = 24;
/// `offsetof(PyASCIIObject, length)` and `state` (its `compact` and `ascii` bits are
/// 0x20 and 0x40 of the first byte; 3.7 to 3.11).
pub(crate) const STR_LENGTH: i32 = 16;
/// Bytes of constants before the code.
const CONSTS: usize = 1024;
/// Bytes of one `PyMethodDef`.
const METHOD_DEF: usize = 32;

/// Why the hook or the detour could not be built.
#[derive(Debug, Error)]
pub enum HookError {
    #[error("assembling the hook: {0}")]
    Asm(#[from] IcedError),
    #[error("the hook's constants need {0} bytes, more than the {CONSTS} reserved")]
    Constants(usize),
    #[error("ring capacity {0} is not a power of two up to 2^24")]
    Capacity(u64),
    #[error("assembling the hook's ring reservation: {0}")]
    Reserve(String),
    #[error("the entry of the safe point at {addr:#x} starts with `{insn}`, which moves control: it cannot be displaced")]
    Flow { addr: u64, insn: String },
    #[error("the entry of the safe point at {0:#x} does not decode into whole instructions of at most {MAX_DISPLACED} bytes")]
    Undecodable(u64),
    #[error("a branch in the safe point's function lands at {target:#x}, inside the bytes a jump would replace")]
    BranchInside { target: u64 },
    #[error("the detour at {detour:#x} is out of rel32 reach of the safe point at {site:#x}")]
    TooFar { site: u64, detour: u64 },
}

/// Runtime addresses of the C API the hook calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct HookSymbols {
    pub(crate) sys_get_object: u64,
    pub(crate) import_module: u64,
    pub(crate) call_method: u64,
    pub(crate) cfunction_new_ex: u64,
    pub(crate) dec_ref: u64,
    pub(crate) err_clear: u64,
    pub(crate) none: u64,
    /// `PyCode_Type`: a monitoring callback records only when its first argument
    /// is a code object (anyone may call it: `register_callback` hands it out).
    pub(crate) code_type: u64,
    /// `PyUnicode_Type`, `PyUnicode_CompareWithASCIIString` and `PyCFunction_Type`:
    /// the uninstaller gives back only a tool id still named "pyprobe", and takes
    /// off only callbacks that are its own functions.
    pub(crate) unicode_type: u64,
    pub(crate) compare_ascii: u64,
    pub(crate) cfunction_type: u64,
    /// `PyThreadState_Get` (the profile route: a thread drops its own hook).
    pub(crate) thread_state_get: u64,
}

/// How the interpreter is made to call the hook.
#[derive(Debug, Clone)]
pub enum Route {
    /// CPython 3.12+: one `sys.monitoring` callback per (event number, record kind).
    Monitoring { events: Vec<(u32, u32)> },
    /// CPython 3.7 to 3.11: one C profile function (`Py_tracefunc`), which pyprobe
    /// sets in each thread state itself (see `hook_engine::profile`).
    Profile(ProfileLayout),
}

impl Route {
    /// `PyMethodDef`s the callbacks need.
    fn method_defs(&self) -> usize {
        match self {
            Route::Monitoring { events } => events.len(),
            Route::Profile(_) => 0,
        }
    }
}

/// Where the profile function finds what it records, by version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileLayout {
    /// `offsetof(PyThreadState, c_profilefunc)`.
    pub(crate) profile_func: i32,
    /// 3.11: `offsetof(PyFrameObject, f_frame)`, the interpreter frame that holds
    /// the code object; `None` before (the frame object holds it).
    pub(crate) frame_via: Option<i32>,
    /// `offsetof(..., f_code)` in the frame object, or in the interpreter frame.
    pub frame_code: i32,
    /// `offsetof(PyCodeObject, co_flags)`.
    pub(crate) code_flags: i32,
    /// How a call event tells a generator's or coroutine's resume from a call.
    pub(crate) resume: ResumeTest,
}

/// How the profile function tells, at a call event, that the frame ran before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeTest {
    /// 3.7 to 3.10: `offsetof(PyFrameObject, f_lasti)`, an `int` that is -1 until
    /// the frame first runs.
    Lasti(i32),
    /// 3.11: `offsetof(_PyInterpreterFrame, prev_instr)` (in the frame
    /// `frame_via` leads to): a first entry stands at `RESUME 0` (or its
    /// quickened form); a resume at the `YIELD_VALUE` or `SEND` it left by.
    PrevInstr(i32),
}

/// Everything [`build_hook`] needs.
#[derive(Debug, Clone)]
pub struct HookParams {
    /// Where the page will be placed in the target.
    pub(crate) addr: u64,
    pub(crate) state_addr: u64,
    pub(crate) ring_addr: u64,
    /// The ring's units.
    pub(crate) capacity: u64,
    pub(crate) symbols: HookSymbols,
    pub(crate) route: Route,
    /// Offsets of `co_name`, `co_filename` and `co_firstlineno` (an int) in a code
    /// object: each record carries them too, so that pyprobe can name a code object
    /// that is gone (or whose address holds another) by the time it reads the record.
    pub(crate) code_fields: [u32; 3],
    /// Where a compact ASCII `str`'s text starts: `sizeof(PyASCIIObject)`, 48 before
    /// 3.12, 40 since.
    pub(crate) str_ascii_data: i32,
}

/// The built hook page.
#[derive(Debug, Clone)]
pub struct HookCode {
    pub(crate) addr: u64,
    pub(crate) bytes: Vec<u8>,
    /// `void installer(void)` (monitoring only) and `void uninstaller(void)`: called by the detour and by
    /// a callback, with the GIL held.
    pub(crate) installer: Option<u64>,
    pub uninstaller: u64,
    /// One callback per monitoring event, in the order of [`Route::Monitoring`]; the
    /// profile function alone on the profile route.
    pub(crate) callbacks: Vec<u64>,
    /// `PyObject *at_exit(PyObject *self, PyObject *unused)`, registered with `atexit`.
    pub at_exit: u64,
}

impl HookCode {
    pub fn contains(&self, rip: u64) -> bool {
        (self.addr..self.addr + self.bytes.len() as u64).contains(&rip)
    }
}

/// The constants area: strings and method definitions.
struct Consts {
    bytes: Vec<u8>,
    base: u64,
}

impl Consts {
    fn string(&mut self, s: &str) -> u64 {
        let at = self.base + self.bytes.len() as u64;
        self.bytes.extend_from_slice(s.as_bytes());
        self.bytes.push(0);
        at
    }
    /// Fills the `PyMethodDef` at `at` (reserved): `ml_name`, `ml_meth`,
    /// `ml_flags` (`ml_doc` stays NULL).
    fn method_def(&mut self, at: usize, name: u64, meth: u64, flags: u64) {
        for (k, word) in [name, meth, flags].into_iter().enumerate() {
            self.bytes[at + 8 * k..at + 8 * k + 8].copy_from_slice(&word.to_le_bytes());
        }
    }
    fn align(&mut self, to: usize) {
        while self.bytes.len() % to != 0 {
            self.bytes.push(0);
        }
    }
}

/// Addresses in the constants area that the installer, the uninstaller and
/// `register_exit` pass to the C API, named as `build_hook` names them.
#[derive(Clone, Copy)]
struct ApiConsts {
    s_monitoring: u64,
    s_use: u64,
    s_register: u64,
    s_set: u64,
    s_free: u64,
    s_get_tool: u64,
    s_name: u64,
    s_is: u64,
    s_iio: u64,
    s_ii: u64,
    s_i: u64,
    s_atexit: u64,
    s_at_register: u64,
    s_at_unregister: u64,
    s_o: u64,
    defs: u64,
    exit_def: u64,
}

/// Builds the hook page for `p`.
pub fn build_hook(p: &HookParams) -> Result<HookCode, HookError> {
    if !p.capacity.is_power_of_two() || p.capacity > 1 << 24 {
        return Err(HookError::Capacity(p.capacity));
    }
    let mut c = Consts {
        bytes: Vec::new(),
        base: p.addr,
    };
    // The page's header: what a later pyprobe finds it by, and what it serves.
    c.bytes.extend_from_slice(HOOK_MAGIC);
    c.bytes.extend_from_slice(&p.state_addr.to_le_bytes());
    c.bytes.extend_from_slice(&p.ring_addr.to_le_bytes());
    let s_monitoring = c.string("monitoring");
    let s_use = c.string("use_tool_id");
    let s_register = c.string("register_callback");
    let s_set = c.string("set_events");
    let s_free = c.string("free_tool_id");
    let s_get_tool = c.string("get_tool");
    let s_name = c.string("pyprobe");
    let s_is = c.string("is");
    let s_iio = c.string("iiO");
    let s_ii = c.string("ii");
    let s_i = c.string("i");
    let s_cb = c.string("pyprobe_hook");
    let s_atexit = c.string("atexit");
    let s_at_register = c.string("register");
    let s_at_unregister = c.string("unregister");
    let s_o = c.string("O");
    let s_drain = c.string("pyprobe_drain");
    c.align(16);
    // struct timespec { 0 s, 1 ms }: the exit callback's nap.
    let nap = c.base + c.bytes.len() as u64;
    c.bytes.extend_from_slice(&0u64.to_le_bytes());
    c.bytes.extend_from_slice(&1_000_000u64.to_le_bytes());
    let defs = c.base + c.bytes.len() as u64;
    let defs_off = c.bytes.len();
    // One definition per event, then the exit callback's.
    c.bytes
        .resize(defs_off + METHOD_DEF * (p.route.method_defs() + 1), 0);
    let exit_def_off = defs_off + METHOD_DEF * p.route.method_defs();
    let exit_def = c.base + exit_def_off as u64;
    if c.bytes.len() > CONSTS {
        return Err(HookError::Constants(c.bytes.len()));
    }
    let code_addr = p.addr + CONSTS as u64;
    let s = ApiConsts {
        s_monitoring,
        s_use,
        s_register,
        s_set,
        s_free,
        s_get_tool,
        s_name,
        s_is,
        s_iio,
        s_ii,
        s_i,
        s_atexit,
        s_at_register,
        s_at_unregister,
        s_o,
        defs,
        exit_def,
    };

    let mut a = CodeAssembler::new(64)?;
    let mut installer = a.create_label();
    let mut uninstaller = a.create_label();
    let mut register_exit = a.create_label();
    // Laid out in this order; each part jumps to the others by these labels.
    let callbacks = emit_callbacks(&mut a, p, uninstaller, register_exit)?;
    let at_exit = emit_at_exit(&mut a, p, nap)?;
    install::emit_uninstaller(&mut a, p, &s, &mut uninstaller)?;
    install::emit_installer(&mut a, p, &s, &mut installer, uninstaller, register_exit)?;
    install::emit_register_exit(&mut a, p, &s, &mut register_exit)?;

    let assembled = a.assemble_options(
        code_addr,
        BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
    )?;
    let installer = match p.route {
        Route::Monitoring { .. } => Some(assembled.label_ip(&installer)?),
        Route::Profile(_) => None,
    };
    let uninstaller = assembled.label_ip(&uninstaller)?;
    let callbacks = callbacks
        .iter()
        .map(|l| assembled.label_ip(l))
        .collect::<Result<Vec<u64>, IcedError>>()?;
    let at_exit = assembled.label_ip(&at_exit)?;
    c.method_def(exit_def_off, s_drain, at_exit, METH_NOARGS);
    for (k, &cb) in callbacks.iter().enumerate().take(p.route.method_defs()) {
        c.method_def(defs_off + k * METHOD_DEF, s_cb, cb, METH_FASTCALL);
    }
    let mut bytes = c.bytes;
    bytes.resize(CONSTS, 0);
    bytes.extend_from_slice(&assembled.inner.code_buffer);
    Ok(HookCode {
        addr: p.addr,
        bytes,
        installer,
        uninstaller,
        callbacks,
        at_exit,
    })
}
