//! Machine code of the hook page and of the detour at the safe point (see [`super`]).
//!
//! Everything is built at its final address: constants first, then code, assembled
//! with iced-x86's `CodeAssembler`. Addresses of the C API functions, the state page
//! and the ring are immediates (`movabs`), so only the detour has a placement
//! constraint (its `jmp rel32` back to the function it was displaced from).

use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, Decoder, DecoderOptions, FlowControl, IcedError};
use thiserror::Error;

use pyprobe_sdt::ring::codegen::{emit_reserve, record_lines};
use pyprobe_sdt::ring::format::{
    H_ALIVE, H_FINISHED, H_HEAD, H_HEARTBEAT, H_STALE, STRINGS_LEN, S_ARGS, S_NARGS, S_PROBE,
    S_SEQ, S_STRINGS, S_STRING_MASK, S_TAG, S_THREAD, S_TRUNCATED, S_TSC,
};

use super::{
    AT_EXIT_MAX_TRIES, AT_EXIT_RETRY_EVENTS, AT_EXIT_WAIT_MS, HOOK_MAGIC, KIND_CALL, KIND_RAISE,
    KIND_RETURN, STATUS_FAILED, STATUS_OK, STATUS_REMOVED, STATUS_RUNNING, ST_ARMED, ST_AT_EXIT,
    ST_AT_EXIT_MODULE, ST_AT_EXIT_RETRY, ST_AT_EXIT_TRIES, ST_GONE, ST_ON, ST_STATUS, TOOL_ID,
};

/// `METH_FASTCALL`.
const METH_FASTCALL: u64 = 0x80;
/// `METH_NOARGS`.
const METH_NOARGS: u64 = 0x04;
/// `offsetof(PyASCIIObject, hash)` (3.7 to 3.15).
pub const STR_HASH: i32 = 24;
/// `offsetof(PyASCIIObject, length)` and `state` (its `compact` and `ascii` bits are
/// 0x20 and 0x40 of the first byte; 3.7 to 3.11).
pub const STR_LENGTH: i32 = 16;
const STR_STATE: i32 = 32;
/// `PyTrace_RETURN` (`PyTrace_CALL` is 0).
const PY_TRACE_RETURN: u32 = 3;
/// `SYS_nanosleep`.
const SYS_NANOSLEEP: u32 = 35;
/// Bytes of constants before the code.
const CONSTS: usize = 1024;
/// Bytes of one `PyMethodDef`.
const METHOD_DEF: usize = 32;
/// `PyCFunctionObject.m_ml`: the definition a builtin function was made from.
const CFUNCTION_ML: i32 = 16;
/// The `jmp rel32` written at the safe point.
pub const JMP_LEN: usize = 5;
/// Most bytes of instructions a detour displaces.
const MAX_DISPLACED: usize = 24;

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
    pub sys_get_object: u64,
    pub import_module: u64,
    pub call_method: u64,
    pub cfunction_new_ex: u64,
    pub dec_ref: u64,
    pub err_clear: u64,
    pub none: u64,
    /// `PyCode_Type`: a monitoring callback records only when its first argument
    /// is a code object (anyone may call it: `register_callback` hands it out).
    pub code_type: u64,
    /// `PyUnicode_Type`, `PyUnicode_CompareWithASCIIString` and `PyCFunction_Type`:
    /// the uninstaller gives back only a tool id still named "pyprobe", and takes
    /// off only callbacks that are its own functions.
    pub unicode_type: u64,
    pub compare_ascii: u64,
    pub cfunction_type: u64,
    /// `PyThreadState_Get` (the profile route: a thread drops its own hook).
    pub thread_state_get: u64,
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
    pub profile_func: i32,
    /// 3.11: `offsetof(PyFrameObject, f_frame)`, the interpreter frame that holds
    /// the code object; `None` before (the frame object holds it).
    pub frame_via: Option<i32>,
    /// `offsetof(..., f_code)` in the frame object, or in the interpreter frame.
    pub frame_code: i32,
    /// `offsetof(PyCodeObject, co_flags)`.
    pub code_flags: i32,
}

/// Everything [`build_hook`] needs.
#[derive(Debug, Clone)]
pub struct HookParams {
    /// Where the page will be placed in the target.
    pub addr: u64,
    pub state_addr: u64,
    pub ring_addr: u64,
    pub capacity: u64,
    /// Written into each record's `tag`: the process id.
    pub tag: u32,
    pub symbols: HookSymbols,
    pub route: Route,
    /// Offsets of `co_name`, `co_filename` and `co_firstlineno` (an int) in a code
    /// object: each record carries them too, so that pyprobe can name a code object
    /// that is gone (or whose address holds another) by the time it reads the record.
    pub code_fields: [u32; 3],
    /// Where a compact ASCII `str`'s text starts: `sizeof(PyASCIIObject)`, 48 before
    /// 3.12, 40 since.
    pub str_ascii_data: i32,
}

/// The built hook page.
#[derive(Debug, Clone)]
pub struct HookCode {
    pub addr: u64,
    pub bytes: Vec<u8>,
    /// `void installer(void)` (monitoring only) and `void uninstaller(void)`: called by the detour and by
    /// a callback, with the GIL held.
    pub installer: Option<u64>,
    pub uninstaller: u64,
    /// One callback per monitoring event, in the order of [`Route::Monitoring`]; the
    /// profile function alone on the profile route.
    pub callbacks: Vec<u64>,
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

    let mut a = CodeAssembler::new(64)?;
    let mut installer = a.create_label();
    let mut uninstaller = a.create_label();
    let mut register_exit = a.create_label();
    let mut common = a.create_label();
    let mut off = a.create_label();
    let mut done = a.create_label();
    let mut callbacks: Vec<CodeLabel> = Vec::new();

    let mut record = a.create_label();
    match &p.route {
        Route::Monitoring { events } => {
            // Callbacks: r8d = kind, then the shared body.
            for &(_, kind) in events {
                let mut l = a.create_label();
                a.set_label(&mut l)?;
                a.mov(r8d, kind)?;
                a.jmp(common)?;
                callbacks.push(l);
            }
            emit_callback_entry(&mut a, p.state_addr, &mut common, off)?;
            // Only a call as the interpreter makes it is recorded: a program that
            // fetched the callback (`register_callback` returns it) may call it
            // with anything. At least (code, offset), and a code object first.
            a.cmp(rdx, 2)?;
            a.jl(done)?;
            // r12 = the code object (args[0]), r13 = the returned object's type
            // (args[2]), or 0.
            a.mov(r12, qword_ptr(rsi))?;
            a.test(r12, r12)?;
            a.jz(done)?;
            a.mov(rax, p.symbols.code_type)?;
            a.cmp(qword_ptr(r12 + 8), rax)?;
            a.jne(done)?;
            a.xor(r13d, r13d)?;
            a.cmp(ebx, KIND_RETURN)?;
            a.jne(record)?;
            a.cmp(rdx, 3)?;
            a.jl(record)?;
            a.mov(rax, qword_ptr(rsi + 16))?;
            a.test(rax, rax)?;
            a.jz(record)?;
            a.mov(r13, qword_ptr(rax + 8))?;
            a.jmp(record)?;
        }
        Route::Profile(layout) => {
            // int cb(PyObject *obj, PyFrameObject *frame, int what, PyObject *arg):
            // a call, or a return (arg NULL: left by an exception); C-function
            // events are not recorded.
            let mut l = a.create_label();
            let mut is_call = a.create_label();
            let mut is_return = a.create_label();
            a.set_label(&mut l)?;
            callbacks.push(l);
            a.test(edx, edx)?;
            a.je(is_call)?;
            a.cmp(edx, PY_TRACE_RETURN)?;
            a.je(is_return)?;
            a.xor(eax, eax)?;
            a.ret()?;
            a.set_label(&mut is_call)?;
            a.mov(r8d, KIND_CALL)?;
            a.xor(ecx, ecx)?;
            a.jmp(common)?;
            a.set_label(&mut is_return)?;
            a.mov(r8d, KIND_RETURN)?;
            a.test(rcx, rcx)?;
            a.jnz(common)?;
            a.mov(r8d, KIND_RAISE)?;
            emit_callback_entry(&mut a, p.state_addr, &mut common, off)?;
            // r12 = the frame's code object, r13 = the returned object's type, or 0.
            match layout.frame_via {
                Some(via) => {
                    a.mov(rax, qword_ptr(rsi + via))?;
                    a.mov(r12, qword_ptr(rax + layout.frame_code))?;
                }
                None => a.mov(r12, qword_ptr(rsi + layout.frame_code))?,
            }
            a.xor(r13d, r13d)?;
            a.test(rcx, rcx)?;
            a.jz(record)?;
            a.mov(r13, qword_ptr(rcx + 8))?;
        }
    }
    // The record's parts are in callee-saved registers (ebx kind, r12 code, r13
    // type): the ring's shared producer code clobbers every caller-saved one.
    a.set_label(&mut record)?;
    let mut exit_retry = a.create_label();
    let mut retried = a.create_label();
    a.cmp(qword_ptr(r9 + ST_AT_EXIT_RETRY as i32), 0)?;
    a.jne(exit_retry)?;
    a.set_label(&mut retried)?;
    // Reserve with the ring's producer protocol (format.rs): a full ring is waited
    // on, spinning then asleep on `tail`, while pyprobe lives and reads; the wait
    // ends when it leaves, dies (its guardian clears `alive`) or goes silent.
    let mut lost = a.create_label();
    // The fixed part, and through the profile function a body's name in the strings.
    let lines = record_lines(matches!(p.route, Route::Profile(_)));
    emit_reserve(&mut a, p.ring_addr, p.capacity, 0, lines, &mut lost)
        .map_err(|e| HookError::Reserve(e.to_string()))?;
    // r8 = the slot, r10 = its index.
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(qword_ptr(r8 + S_TSC as i32), rax)?;
    a.mov(dword_ptr(r8 + S_PROBE as i32), ebx)?;
    a.mov(dword_ptr(r8 + S_TAG as i32), p.tag)?;
    a.mov(rax, qword_ptr(0u64).fs())?;
    a.mov(qword_ptr(r8 + S_THREAD as i32), rax)?;
    a.mov(qword_ptr(r8 + S_ARGS as i32), r12)?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 8), r13)?;
    let [name, filename, first_line] = p.code_fields;
    a.mov(rax, qword_ptr(r12 + name))?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 16), rax)?;
    emit_str_identity(&mut a, rax, rcx, p.str_ascii_data)?;
    a.mov(rax, qword_ptr(r12 + filename))?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 24), rax)?;
    emit_str_identity(&mut a, rax, rdx, p.str_ascii_data)?;
    a.movsxd(rax, dword_ptr(r12 + first_line))?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 32), rax)?;
    // The two strings' identities, folded: pyprobe names a code object that is
    // gone from these strings only while they still read the same (before 3.12
    // they may be freed too, and their memory hold other strings).
    a.rol(rdx, 1)?;
    a.xor(rcx, rdx)?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 40), rcx)?;
    // nargs = 6, no strings, no stack.
    a.mov(dword_ptr(r8 + S_NARGS as i32), 6)?;
    a.mov(dword_ptr(r8 + S_NARGS as i32 + 4), 0)?;
    const _: () = assert!(S_STRING_MASK == S_NARGS + 1 && S_TRUNCATED == S_NARGS + 2);
    if let Route::Profile(layout) = &p.route {
        emit_copy_body_name(&mut a, p, layout)?;
    }
    // Publish last.
    a.lea(rax, ptr(r10 + 1))?;
    a.mov(qword_ptr(r8 + S_SEQ as i32), rax)?;
    a.jmp(done)?;
    // Lost (counted by the reservation; r9 = the ring). With nobody serving the
    // ring (pyprobe left or died) or a consumer silent past `stale`, the hook is
    // no use any more: `on` is cleared and the next event unregisters it, guardian
    // or not. A budget's short patience running out is not that.
    let mut give_up = a.create_label();
    a.set_label(&mut lost)?;
    jump_if_unserved(&mut a, give_up)?;
    a.jmp(done)?;
    a.set_label(&mut give_up)?;
    a.mov(rax, p.state_addr)?;
    a.mov(qword_ptr(rax + ST_ON as i32), 0)?;
    a.set_label(&mut done)?;
    a.pop(r13)?;
    a.pop(r12)?;
    a.pop(rbx)?;
    match p.route {
        // `None`, immortal on 3.12+: no reference to take.
        Route::Monitoring { .. } => a.mov(rax, p.symbols.none)?,
        // 0: go on.
        Route::Profile(_) => a.xor(eax, eax)?,
    }
    a.ret()?;
    // `on` clear: the first callback to see it uninstalls (GIL held: any Python may run).
    // `gone` is taken before any call, so that a thread found outside this page
    // with `gone` clear has not begun to uninstall (a later pyprobe reuses the page
    // on that condition).
    a.set_label(&mut off)?;
    let mut dropped = a.create_label();
    a.xor(eax, eax)?;
    a.mov(ecx, 1)?;
    a.lock().cmpxchg(qword_ptr(r9 + ST_GONE as i32), rcx)?;
    a.jne(dropped)?;
    a.call(uninstaller)?;
    a.set_label(&mut dropped)?;
    if let Route::Profile(layout) = &p.route {
        // A profile function is per thread: each thread drops its own at its next
        // event. The interpreter recomputes `use_tracing` from `c_profilefunc` when
        // this callback returns.
        call(&mut a, p.symbols.thread_state_get, &[])?;
        a.mov(qword_ptr(rax + layout.profile_func), 0)?;
    }
    a.jmp(done)?;
    // A try to register the exit callback is pending: one event nearer; at zero, try
    // (GIL held: the import may run Python). The record's parts are callee-saved.
    a.set_label(&mut exit_retry)?;
    a.dec(qword_ptr(r9 + ST_AT_EXIT_RETRY as i32))?;
    a.jnz(retried)?;
    a.call(register_exit)?;
    a.jmp(retried)?;

    // PyObject *at_exit(PyObject *self, PyObject *unused): the interpreter is
    // ending; wait until pyprobe has finished with what was written so far,
    // the code objects' names read too (they still exist now; finalization frees
    // them), while it serves the ring, at most AT_EXIT_WAIT_MS. `tail` is not
    // enough: it moves when records are copied out, before they are named.
    let mut at_exit = a.create_label();
    let mut exit_wait = a.create_label();
    let mut exit_done = a.create_label();
    a.set_label(&mut at_exit)?;
    a.push(rbx)?;
    a.push(r12)?;
    a.mov(r9, p.state_addr)?;
    a.cmp(qword_ptr(r9 + ST_ON as i32), 0)?;
    a.je(exit_done)?;
    a.mov(r9, p.ring_addr)?;
    a.mov(rbx, qword_ptr(r9 + H_HEAD as i32))?;
    a.mov(r12d, AT_EXIT_WAIT_MS)?;
    a.set_label(&mut exit_wait)?;
    a.mov(r9, p.ring_addr)?;
    a.cmp(qword_ptr(r9 + H_FINISHED as i32), rbx)?;
    a.jae(exit_done)?;
    jump_if_unserved(&mut a, exit_done)?;
    a.dec(r12d)?;
    a.jz(exit_done)?;
    a.mov(eax, SYS_NANOSLEEP)?;
    a.mov(rdi, nap)?;
    a.xor(esi, esi)?;
    a.syscall()?;
    a.jmp(exit_wait)?;
    a.set_label(&mut exit_done)?;
    a.pop(r12)?;
    a.pop(rbx)?;
    a.mov(rax, p.symbols.none)?;
    if let Route::Profile(_) = p.route {
        // Before 3.12 `None` is not immortal: the caller owns a reference.
        a.inc(qword_ptr(rax))?;
    }
    a.ret()?;

    // void uninstaller(void)
    a.set_label(&mut uninstaller)?;
    a.push(rbx)?;
    a.push(r12)?;
    a.push(r13)?;
    let mut out = a.create_label();
    let events: &[(u32, u32)] = match &p.route {
        Route::Monitoring { events } => events,
        Route::Profile(_) => &[],
    };
    if !events.is_empty() {
        // The tool id is given back only while it is still pyprobe's: a program
        // that freed it and took it for itself keeps it, events and callbacks.
        call(&mut a, p.symbols.sys_get_object, &[Arg::Imm(s_monitoring)])?;
        a.mov(rbx, rax)?;
        a.test(rbx, rbx)?;
        a.jz(out)?;
        call_method(&mut a, p, s_get_tool, s_i, &[Arg::Imm(TOOL_ID as u64)])?;
        a.test(rax, rax)?;
        a.jz(out)?;
        a.mov(r12, rax)?;
        let mut named = a.create_label();
        a.xor(r13d, r13d)?;
        a.mov(rax, p.symbols.unicode_type)?;
        a.cmp(qword_ptr(r12 + 8), rax)?;
        a.jne(named)?;
        call(
            &mut a,
            p.symbols.compare_ascii,
            &[Arg::Reg(r12), Arg::Imm(s_name)],
        )?;
        a.test(eax, eax)?;
        a.setz(r13b)?;
        a.set_label(&mut named)?;
        call(&mut a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
        a.test(r13d, r13d)?;
        a.jz(out)?;
        // Each event's callback taken off; one that is not pyprobe's function
        // (the program registered its own) is put back, and counted in r13.
        a.xor(r13d, r13d)?;
        for (k, &(ev, _)) in events.iter().enumerate() {
            let def = defs + (k * METHOD_DEF) as u64;
            let mut next = a.create_label();
            let mut release = a.create_label();
            register_callback(&mut a, p, (s_register, s_iio), ev, Arg::Imm(p.symbols.none))?;
            a.test(rax, rax)?;
            a.jz(next)?;
            a.mov(r12, rax)?;
            a.mov(rax, p.symbols.none)?;
            a.cmp(r12, rax)?;
            a.je(release)?;
            a.mov(rax, p.symbols.cfunction_type)?;
            let mut foreign = a.create_label();
            a.cmp(qword_ptr(r12 + 8), rax)?;
            a.jne(foreign)?;
            a.mov(rax, def)?;
            a.cmp(qword_ptr(r12 + CFUNCTION_ML), rax)?;
            a.je(release)?;
            a.set_label(&mut foreign)?;
            a.inc(r13d)?;
            register_callback(&mut a, p, (s_register, s_iio), ev, Arg::Reg(r12))?;
            decref_rax(&mut a, p)?;
            a.set_label(&mut release)?;
            call(&mut a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
            a.set_label(&mut next)?;
        }
        // Events off and the id given back only when every callback was pyprobe's.
        a.test(r13d, r13d)?;
        a.jnz(out)?;
        call_method(
            &mut a,
            p,
            s_set,
            s_ii,
            &[Arg::Imm(TOOL_ID as u64), Arg::Imm(0)],
        )?;
        decref_rax(&mut a, p)?;
        call_method(&mut a, p, s_free, s_i, &[Arg::Imm(TOOL_ID as u64)])?;
        decref_rax(&mut a, p)?;
    }
    a.set_label(&mut out)?;
    // atexit.unregister(the exit callback), through the module kept since.
    let mut no_exit = a.create_label();
    a.mov(rax, p.state_addr)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_RETRY as i32), 0)?;
    a.mov(r12, qword_ptr(rax + ST_AT_EXIT as i32))?;
    a.test(r12, r12)?;
    a.jz(no_exit)?;
    a.mov(rbx, qword_ptr(rax + ST_AT_EXIT_MODULE as i32))?;
    a.mov(qword_ptr(rax + ST_AT_EXIT as i32), 0)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_MODULE as i32), 0)?;
    call_method(&mut a, p, s_at_unregister, s_o, &[Arg::Reg(r12)])?;
    decref_rax(&mut a, p)?;
    call(&mut a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
    call(&mut a, p.symbols.dec_ref, &[Arg::Reg(rbx)])?;
    a.set_label(&mut no_exit)?;
    call(&mut a, p.symbols.err_clear, &[])?;
    a.mov(rax, p.state_addr)?;
    a.mov(rcx, STATUS_REMOVED)?;
    a.mov(qword_ptr(rax + ST_STATUS as i32), rcx)?;
    a.pop(r13)?;
    a.pop(r12)?;
    a.pop(rbx)?;
    a.ret()?;

    // void installer(void): registers the callbacks with sys.monitoring (the
    // profile route has none: pyprobe sets each thread's profile function itself).
    if let Route::Monitoring { events } = &p.route {
        let mask: u64 = events.iter().fold(0, |m, &(ev, _)| m | (1 << ev));
        a.set_label(&mut installer)?;
        a.push(rbx)?;
        a.push(r12)?;
        a.push(r13)?;
        // Said before any call: a thread found outside this page with `status` 0
        // has not begun to install.
        a.mov(rax, p.state_addr)?;
        a.mov(qword_ptr(rax + ST_STATUS as i32), STATUS_RUNNING as i32)?;
        let mut fails: Vec<CodeLabel> = (0..5).map(|_| a.create_label()).collect();
        call(&mut a, p.symbols.sys_get_object, &[Arg::Imm(s_monitoring)])?;
        a.mov(rbx, rax)?;
        a.test(rbx, rbx)?;
        a.jz(fails[0])?;
        call_method(
            &mut a,
            p,
            s_use,
            s_is,
            &[Arg::Imm(TOOL_ID as u64), Arg::Imm(s_name)],
        )?;
        a.test(rax, rax)?;
        a.jz(fails[1])?;
        decref_rax(&mut a, p)?;
        for (k, &(ev, _)) in events.iter().enumerate() {
            let def = defs + (k * METHOD_DEF) as u64;
            call(
                &mut a,
                p.symbols.cfunction_new_ex,
                &[Arg::Imm(def), Arg::Imm(0), Arg::Imm(0)],
            )?;
            a.test(rax, rax)?;
            a.jz(fails[2])?;
            a.mov(r12, rax)?;
            register_callback(&mut a, p, (s_register, s_iio), ev, Arg::Reg(r12))?;
            a.mov(r13, rax)?;
            // The registry holds its own reference to the function.
            call(&mut a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
            a.test(r13, r13)?;
            a.jz(fails[3])?;
            call(&mut a, p.symbols.dec_ref, &[Arg::Reg(r13)])?;
        }
        call_method(
            &mut a,
            p,
            s_set,
            s_ii,
            &[Arg::Imm(TOOL_ID as u64), Arg::Imm(mask)],
        )?;
        a.test(rax, rax)?;
        a.jz(fails[4])?;
        decref_rax(&mut a, p)?;
        // The exit callback first: pyprobe, seeing `status` OK, reads whether it is in.
        a.call(register_exit)?;
        a.mov(rax, p.state_addr)?;
        a.mov(qword_ptr(rax + ST_STATUS as i32), STATUS_OK as i32)?;
        let mut leave = a.create_label();
        a.jmp(leave)?;
        for (k, l) in fails.iter_mut().enumerate() {
            a.set_label(l)?;
            call(&mut a, p.symbols.err_clear, &[])?;
            if k >= 2 {
                // The tool id was taken: give it back (and whatever was registered).
                a.call(uninstaller)?;
            }
            a.mov(rax, p.state_addr)?;
            a.mov(
                qword_ptr(rax + ST_STATUS as i32),
                (STATUS_FAILED as i32) + k as i32 + 1,
            )?;
            a.jmp(leave)?;
        }
        a.set_label(&mut leave)?;
        a.pop(r13)?;
        a.pop(r12)?;
        a.pop(rbx)?;
        a.ret()?;
    }

    // void register_exit(void): atexit.register(the exit callback), GIL held. A
    // failure is cleared and tried again AT_EXIT_RETRY_EVENTS events later (the
    // interpreter may still be starting), AT_EXIT_MAX_TRIES times at most.
    a.set_label(&mut register_exit)?;
    a.push(rbx)?;
    a.push(r12)?;
    a.push(r13)?;
    let mut exit_no_fn = a.create_label();
    let mut exit_no_module = a.create_label();
    let mut exit_out = a.create_label();
    call(&mut a, p.symbols.import_module, &[Arg::Imm(s_atexit)])?;
    a.test(rax, rax)?;
    a.jz(exit_no_module)?;
    a.mov(rbx, rax)?;
    call(
        &mut a,
        p.symbols.cfunction_new_ex,
        &[Arg::Imm(exit_def), Arg::Imm(0), Arg::Imm(0)],
    )?;
    a.test(rax, rax)?;
    a.jz(exit_no_fn)?;
    a.mov(r12, rax)?;
    call_method(&mut a, p, s_at_register, s_o, &[Arg::Reg(r12)])?;
    a.test(rax, rax)?;
    let mut exit_refused = a.create_label();
    a.jz(exit_refused)?;
    decref_rax(&mut a, p)?;
    // Both references kept: the uninstaller unregisters with them.
    a.mov(rax, p.state_addr)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT as i32), r12)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_MODULE as i32), rbx)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_RETRY as i32), 0)?;
    a.jmp(exit_out)?;
    a.set_label(&mut exit_refused)?;
    call(&mut a, p.symbols.dec_ref, &[Arg::Reg(r12)])?;
    a.set_label(&mut exit_no_fn)?;
    call(&mut a, p.symbols.dec_ref, &[Arg::Reg(rbx)])?;
    a.set_label(&mut exit_no_module)?;
    call(&mut a, p.symbols.err_clear, &[])?;
    let mut give_up_exit = a.create_label();
    a.mov(rax, p.state_addr)?;
    a.inc(qword_ptr(rax + ST_AT_EXIT_TRIES as i32))?;
    a.cmp(
        qword_ptr(rax + ST_AT_EXIT_TRIES as i32),
        AT_EXIT_MAX_TRIES as i32,
    )?;
    a.jae(give_up_exit)?;
    a.mov(
        qword_ptr(rax + ST_AT_EXIT_RETRY as i32),
        AT_EXIT_RETRY_EVENTS as i32,
    )?;
    a.jmp(exit_out)?;
    a.set_label(&mut give_up_exit)?;
    a.mov(qword_ptr(rax + ST_AT_EXIT_RETRY as i32), 0)?;
    a.set_label(&mut exit_out)?;
    a.pop(r13)?;
    a.pop(r12)?;
    a.pop(rbx)?;
    a.ret()?;

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

/// The body every callback shares from `common` (r8d = the record kind): saves the
/// callee-saved registers the record's parts live in (entry: rsp = 8 mod 16; three
/// pushes make it 0 for the calls below), ebx = the kind, r9 = the state page, and
/// to `off` when its `on` is clear.
fn emit_callback_entry(
    a: &mut CodeAssembler,
    state_addr: u64,
    common: &mut CodeLabel,
    off: CodeLabel,
) -> Result<(), IcedError> {
    a.set_label(common)?;
    a.push(rbx)?;
    a.push(r12)?;
    a.push(r13)?;
    a.mov(ebx, r8d)?;
    a.mov(r9, state_addr)?;
    a.cmp(qword_ptr(r9 + ST_ON as i32), 0)?;
    a.je(off)
}

/// What identifies a `str` (at `src`) to pyprobe later, in `out`: its hash, or while
/// that is not computed (-1), its length, xor its first 8 bytes when it has as many
/// (read no further: the object may end there). Clobbers rsi.
fn emit_str_identity(
    a: &mut CodeAssembler,
    src: AsmRegister64,
    out: AsmRegister64,
    data: i32,
) -> Result<(), IcedError> {
    let mut done = a.create_label();
    a.mov(out, qword_ptr(src + STR_HASH))?;
    a.cmp(out, -1)?;
    a.jne(done)?;
    a.mov(out, qword_ptr(src + STR_LENGTH))?;
    a.cmp(out, 8)?;
    a.jb(done)?;
    a.mov(rsi, qword_ptr(src + data))?;
    a.xor(out, rsi)?;
    a.set_label(&mut done)?;
    Ok(())
}

/// Before 3.12 a module or class body's code object (no `CO_OPTIMIZED`) is freed as
/// soon as the body has run, and with it, often, its `co_name` (`<module>` is not
/// immortal then) and its file name: its record carries their text (compact ASCII
/// `str`s), as argument 2's string, "NAME\x01FILE" (the file left out when both do
/// not fit, the name too when it alone does not), and in argument 5 the file name's
/// identity alone. r8 = the slot, r12 = the code object; clobbers rax, rcx, rdx, rsi,
/// rdi.
fn emit_copy_body_name(
    a: &mut CodeAssembler,
    p: &HookParams,
    layout: &ProfileLayout,
) -> Result<(), IcedError> {
    const CO_OPTIMIZED: i32 = 1;
    const COMPACT_ASCII: i32 = 0x60;
    let [name, filename, _] = p.code_fields;
    let max = (STRINGS_LEN - 1) as i32;
    let mut done = a.create_label();
    let mut finish = a.create_label();
    let compact_ascii = |a: &mut CodeAssembler, to: CodeLabel| -> Result<(), IcedError> {
        a.movzx(eax, byte_ptr(rsi + STR_STATE))?;
        a.and(eax, COMPACT_ASCII)?;
        a.cmp(eax, COMPACT_ASCII)?;
        a.jne(to)
    };
    a.test(dword_ptr(r12 + layout.code_flags), CO_OPTIMIZED)?;
    a.jnz(done)?;
    a.mov(rsi, qword_ptr(r12 + name))?;
    compact_ascii(a, done)?;
    a.mov(rcx, qword_ptr(rsi + STR_LENGTH))?;
    a.cmp(rcx, max)?;
    a.ja(done)?;
    a.mov(rdx, rcx)?;
    a.lea(rsi, ptr(rsi + p.str_ascii_data))?;
    a.lea(rdi, ptr(r8 + S_STRINGS as i32))?;
    // The direction flag is clear at a C function's entry (SysV ABI).
    a.rep().movsb()?;
    a.mov(rsi, qword_ptr(r12 + filename))?;
    compact_ascii(a, finish)?;
    a.mov(rcx, qword_ptr(rsi + STR_LENGTH))?;
    a.lea(rax, ptr(rdx + rcx + 1))?;
    a.cmp(rax, max)?;
    a.ja(finish)?;
    a.mov(byte_ptr(rdi), 1)?;
    a.inc(rdi)?;
    a.lea(rsi, ptr(rsi + p.str_ascii_data))?;
    a.rep().movsb()?;
    a.set_label(&mut finish)?;
    a.mov(byte_ptr(rdi), 0)?;
    a.mov(byte_ptr(r8 + S_STRING_MASK as i32), 1 << 2)?;
    a.mov(rax, qword_ptr(r12 + filename))?;
    emit_str_identity(a, rax, rcx, p.str_ascii_data)?;
    a.rol(rcx, 1)?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 40), rcx)?;
    a.set_label(&mut done)?;
    Ok(())
}

/// An argument of a call the hook makes.
#[derive(Clone, Copy)]
enum Arg {
    Imm(u64),
    Reg(AsmRegister64),
}

const ARG_REGS: [AsmRegister64; 6] = [rdi, rsi, rdx, rcx, r8, r9];

/// `call fn(args...)` with `al = 0` (so variadic functions work too). The stack must
/// be 16-byte aligned here. Clobbers the caller-saved registers.
fn call(a: &mut CodeAssembler, f: u64, args: &[Arg]) -> Result<(), IcedError> {
    for (k, arg) in args.iter().enumerate() {
        match *arg {
            Arg::Imm(v) => a.mov(ARG_REGS[k], v)?,
            Arg::Reg(r) => a.mov(ARG_REGS[k], r)?,
        }
    }
    a.xor(eax, eax)?;
    a.mov(r11, f)?;
    a.call(r11)
}

/// `PyObject_CallMethod(rbx, name, fmt, args...)`.
fn call_method(
    a: &mut CodeAssembler,
    p: &HookParams,
    name: u64,
    fmt: u64,
    args: &[Arg],
) -> Result<(), IcedError> {
    let mut all = vec![Arg::Reg(rbx), Arg::Imm(name), Arg::Imm(fmt)];
    all.extend_from_slice(args);
    call(a, p.symbols.call_method, &all)
}

/// Jumps to `to` when nobody serves the ring at r9: `alive` is 0, or the
/// heartbeat is older than `stale` cycles. Clobbers rax and rdx.
fn jump_if_unserved(a: &mut CodeAssembler, to: CodeLabel) -> Result<(), IcedError> {
    a.cmp(qword_ptr(r9 + H_ALIVE as i32), 0)?;
    a.je(to)?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.sub(rax, qword_ptr(r9 + H_HEARTBEAT as i32))?;
    a.cmp(rax, qword_ptr(r9 + H_STALE as i32))?;
    a.jg(to)
}

/// `sys.monitoring.register_callback(TOOL, 1 << ev, callback)` through the module in
/// rbx (`names`: the method's name and the format `"iiO"` in the page): rax = the
/// callback it replaces (a new reference), or NULL.
fn register_callback(
    a: &mut CodeAssembler,
    p: &HookParams,
    (name, fmt): (u64, u64),
    ev: u32,
    callback: Arg,
) -> Result<(), IcedError> {
    let args = [Arg::Imm(TOOL_ID as u64), Arg::Imm(1u64 << ev), callback];
    call_method(a, p, name, fmt, &args)
}

/// `Py_DecRef(rax)` (which accepts NULL).
fn decref_rax(a: &mut CodeAssembler, p: &HookParams) -> Result<(), IcedError> {
    a.mov(rdi, rax)?;
    call(a, p.symbols.dec_ref, &[Arg::Reg(rdi)])
}

/// The detour at the safe point, and the patch that jumps to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detour {
    pub addr: u64,
    pub code: Vec<u8>,
    /// The function entry rewritten.
    pub site: u64,
    /// Bytes at `site` now.
    pub original: Vec<u8>,
    /// `jmp rel32` to `addr`, padded with `int3` to the length of `original`.
    pub patch: Vec<u8>,
}

impl Detour {
    pub fn contains(&self, rip: u64) -> bool {
        (self.addr..self.addr + self.code.len() as u64).contains(&rip)
    }
    /// A thread whose rip is strictly inside the bytes the patch replaces would
    /// resume in the middle of the jump.
    pub fn splits(&self, rip: u64) -> bool {
        rip > self.site && rip < self.site + self.original.len() as u64
    }
}

/// Builds the detour placed at `addr` for the function whose entry `site` holds
/// `code` (its first bytes; `targets`: branch targets known in that function):
/// saves the argument registers, runs `installer` if `state.armed` goes 1 → 2,
/// restores them, runs the displaced instructions, jumps back.
pub fn build_detour(
    addr: u64,
    site: u64,
    code: &[u8],
    targets: &pyprobe_sdt::ring::BranchTargets,
    state_addr: u64,
    installer: u64,
) -> Result<Detour, HookError> {
    let mut decoder = Decoder::with_ip(64, code, site, DecoderOptions::NONE);
    let mut displaced = Vec::new();
    let mut len = 0usize;
    while len < JMP_LEN {
        if !decoder.can_decode() {
            return Err(HookError::Undecodable(site));
        }
        let insn = decoder.decode();
        if insn.is_invalid() {
            return Err(HookError::Undecodable(site));
        }
        if insn.flow_control() != FlowControl::Next {
            return Err(HookError::Flow {
                addr: insn.ip(),
                insn: format!("{:?}", insn.mnemonic()),
            });
        }
        len += insn.len();
        displaced.push(insn);
    }
    if len > MAX_DISPLACED {
        return Err(HookError::Undecodable(site));
    }
    if let Some(target) = targets.strictly_inside(site, site + len as u64) {
        return Err(HookError::BranchInside { target });
    }
    let mut a = CodeAssembler::new(64)?;
    let saved = [rax, rcx, rdx, rsi, rdi, r8, r9, r10, r11];
    for r in saved {
        a.push(r)?;
    }
    // Entry: rsp = 8 mod 16; nine pushes make it 0.
    let mut skip = a.create_label();
    a.mov(r11, state_addr)?;
    a.mov(eax, 1)?;
    a.mov(ecx, 2)?;
    a.lock().cmpxchg(qword_ptr(r11 + ST_ARMED as i32), rcx)?;
    a.jne(skip)?;
    a.mov(rax, installer)?;
    a.call(rax)?;
    a.set_label(&mut skip)?;
    for r in saved.iter().rev() {
        a.pop(*r)?;
    }
    for insn in &displaced {
        a.add_instruction(*insn)?;
    }
    a.jmp(site + len as u64)?;
    let assembled = a.assemble(addr)?;
    let rel = addr.wrapping_sub(site + JMP_LEN as u64) as i64;
    let rel = i32::try_from(rel).map_err(|_| HookError::TooFar { site, detour: addr })?;
    let mut patch = vec![0xe9];
    patch.extend_from_slice(&rel.to_le_bytes());
    patch.resize(len, 0xcc);
    Ok(Detour {
        addr,
        code: assembled,
        site,
        original: code[..len].to_vec(),
        patch,
    })
}
