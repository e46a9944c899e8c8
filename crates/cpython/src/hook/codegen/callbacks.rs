//! The callbacks the interpreter calls: one per monitoring event or the profile
//! function, the record they write to the ring, their ways off that path (ring
//! lost, `on` clear, exit registration due), and the exit callback. Apart from
//! the installer and uninstaller: this runs at every event, and records without
//! calling the C API.

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use pyprobe_sdt::ring::format::{H_ALIVE, H_FINISHED, H_HEAD, H_HEARTBEAT, H_STALE};

use super::c_calls::call;
use super::record::emit_record;
use super::{HookError, HookParams, ResumeTest, Route};
use crate::hook::{
    AT_EXIT_WAIT_MS, KIND_CALL, KIND_RAISE, KIND_RESUME, KIND_RETURN, ST_AT_EXIT_RETRY, ST_GONE,
    ST_ON,
};
/// `PyTrace_RETURN` (`PyTrace_CALL` is 0).
const PY_TRACE_RETURN: u32 = 3;
/// CPython 3.11's `RESUME 0` as a code unit (opcode 151, oparg 0): where a frame
/// stands when it first runs.
const RESUME_311: u32 = 151;
/// The same, quickened (`RESUME_QUICK`, 150).
const RESUME_QUICK_311: u32 = 150;
/// `SYS_nanosleep`.
const SYS_NANOSLEEP: u32 = 35;

/// Emits the callbacks and the body they share; returns their labels, in the order
/// of [`HookCode::callbacks`](super::HookCode::callbacks). `uninstaller` and
/// `register_exit` are called from here, emitted later.
pub(super) fn emit_callbacks(
    a: &mut CodeAssembler,
    p: &HookParams,
    uninstaller: CodeLabel,
    register_exit: CodeLabel,
) -> Result<Vec<CodeLabel>, HookError> {
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
            emit_callback_entry(a, p.state_addr, &mut common, off)?;
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
            let mut called = a.create_label();
            match (layout.resume, layout.frame_via) {
                (ResumeTest::Lasti(lasti), _) => {
                    a.cmp(dword_ptr(rsi + lasti), -1)?;
                    a.je(called)?;
                }
                (ResumeTest::PrevInstr(prev_instr), Some(via)) => {
                    // The code unit the frame stands at: opcode, then oparg.
                    a.mov(rax, qword_ptr(rsi + via))?;
                    a.mov(rax, qword_ptr(rax + prev_instr))?;
                    a.movzx(eax, word_ptr(rax))?;
                    a.cmp(eax, RESUME_311)?;
                    a.je(called)?;
                    a.cmp(eax, RESUME_QUICK_311)?;
                    a.je(called)?;
                }
                // No interpreter frame to look in: every entry a call.
                (ResumeTest::PrevInstr(_), None) => a.jmp(called)?,
            }
            a.mov(r8d, KIND_RESUME)?;
            a.set_label(&mut called)?;
            a.xor(ecx, ecx)?;
            a.jmp(common)?;
            a.set_label(&mut is_return)?;
            a.mov(r8d, KIND_RETURN)?;
            a.test(rcx, rcx)?;
            a.jnz(common)?;
            a.mov(r8d, KIND_RAISE)?;
            emit_callback_entry(a, p.state_addr, &mut common, off)?;
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
    // type; r14 and r15 free): the ring's shared producer code clobbers every
    // caller-saved one.
    a.set_label(&mut record)?;
    let mut exit_retry = a.create_label();
    let mut retried = a.create_label();
    a.cmp(qword_ptr(r9 + ST_AT_EXIT_RETRY as i32), 0)?;
    a.jne(exit_retry)?;
    a.set_label(&mut retried)?;
    // The record's units, each reserved with the ring's producer protocol
    // (format.rs): a full ring is waited on, spinning then asleep on `tail`,
    // while pyprobe lives and reads; the wait ends when it leaves, dies (its
    // guardian clears `alive`) or goes silent.
    let mut lost = a.create_label();
    let body_flags = match &p.route {
        Route::Profile(layout) => Some(layout.code_flags),
        Route::Monitoring { .. } => None,
    };
    emit_record(a, p, body_flags, &mut lost, done)?;
    // Lost (counted by the reservation; r9 = the ring). With nobody serving the
    // ring (pyprobe left or died) or a consumer silent past `stale`, the hook is
    // no use any more: `on` is cleared and the next event unregisters it, guardian
    // or not. A budget's short patience running out is not that.
    let mut give_up = a.create_label();
    a.set_label(&mut lost)?;
    jump_if_unserved(a, give_up)?;
    a.jmp(done)?;
    a.set_label(&mut give_up)?;
    a.mov(rax, p.state_addr)?;
    a.mov(qword_ptr(rax + ST_ON as i32), 0)?;
    a.set_label(&mut done)?;
    a.pop(r15)?;
    a.pop(r14)?;
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
        call(a, p.symbols.thread_state_get, &[])?;
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
    Ok(callbacks)
}

/// Emits the exit callback, which `register_exit` gives `atexit`; `nap` is the
/// page's 1 ms `timespec`.
pub(super) fn emit_at_exit(
    a: &mut CodeAssembler,
    p: &HookParams,
    nap: u64,
) -> Result<CodeLabel, IcedError> {
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
    jump_if_unserved(a, exit_done)?;
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
    Ok(at_exit)
}

/// The body every callback shares from `common` (r8d = the record kind): saves the
/// callee-saved registers the record's parts live in (entry: rsp = 8 mod 16; five
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
    a.push(r14)?;
    a.push(r15)?;
    a.mov(ebx, r8d)?;
    a.mov(r9, state_addr)?;
    a.cmp(qword_ptr(r9 + ST_ON as i32), 0)?;
    a.je(off)
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
