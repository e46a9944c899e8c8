//! The callbacks the interpreter calls: one per monitoring event or the profile
//! function, the record they write to the ring, their ways off that path (ring
//! lost, `on` clear, exit registration due), and the exit callback. Apart from
//! the installer and uninstaller: this runs at every event, and records without
//! calling the C API.

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use pyprobe_sdt::ring::codegen::{emit_reserve, record_lines};
use pyprobe_sdt::ring::format::{
    H_ALIVE, H_FINISHED, H_HEAD, H_HEARTBEAT, H_STALE, STRINGS_LEN, S_ARGS, S_NARGS, S_PROBE,
    S_SEQ, S_STRINGS, S_STRING_MASK, S_TAG, S_THREAD, S_TRUNCATED, S_TSC,
};

use super::c_calls::call;
use super::{HookError, HookParams, ResumeTest, Route, STR_HASH, STR_LENGTH};
use crate::hook::{
    AT_EXIT_WAIT_MS, KIND_CALL, KIND_RAISE, KIND_RESUME, KIND_RETURN, SENT_ENTRIES,
    SENT_ENTRY_SHIFT, ST_AT_EXIT_RETRY, ST_GONE, ST_ON, ST_SENT,
};

/// `offsetof(PyASCIIObject, state)` (see [`STR_LENGTH`]).
const STR_STATE: i32 = 32;
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
    emit_reserve(a, p.ring_addr, p.capacity, 0, lines, &mut lost)
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
    emit_str_identity(a, rax, rcx, p.str_ascii_data)?;
    a.mov(rax, qword_ptr(r12 + filename))?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 24), rax)?;
    emit_str_identity(a, rax, rdx, p.str_ascii_data)?;
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
    let body_flags = match &p.route {
        Route::Profile(layout) => Some(layout.code_flags),
        Route::Monitoring { .. } => None,
    };
    emit_copy_names(a, p, body_flags)?;
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
    jump_if_unserved(a, give_up)?;
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

/// A code object, and its strings with it, may be freed before pyprobe reads its
/// records (a module or class body, as soon as it has run; code that runs once
/// while the interpreter starts; a function made in a loop), and its memory reused
/// by others under other names. Two kinds of records carry the text of `co_name`
/// and `co_filename` (compact ASCII `str`s) as one string, "NAME\x01FILE" (the
/// file left out when both do not fit, the name too when it alone does not):
///
/// * through the profile function (before 3.12, `body_flags`: where `co_flags`
///   is), a body's record (no `CO_OPTIMIZED`), every time, as argument 2's
///   string, with the file name's identity alone in argument 5 (two bodies made
///   from one template at one address share every other part);
/// * any other call's record, as argument 3's string, the first time its parts
///   (code object, name pointer, identity check, first line) are met since the
///   last miss in the state page's table of [`SENT_ENTRIES`] parts (direct
///   mapped by code address, emptied by pyprobe at each attach): the same parts
///   mean the same name and file texts, which pyprobe keeps.
///
/// r8 = the slot (its arguments written), r12 = the code object, ebx = the kind;
/// clobbers rax, rcx, rdx, rsi, rdi.
fn emit_copy_names(
    a: &mut CodeAssembler,
    p: &HookParams,
    body_flags: Option<i32>,
) -> Result<(), IcedError> {
    const CO_OPTIMIZED: i32 = 1;
    let done = a.create_label();
    let Some(code_flags) = body_flags else {
        return emit_copy_once(a, p, done);
    };
    let mut function = a.create_label();
    a.test(dword_ptr(r12 + code_flags), CO_OPTIMIZED)?;
    a.jnz(function)?;
    emit_copy_texts(a, p, 2, done)?;
    let [_, filename, _] = p.code_fields;
    a.mov(rax, qword_ptr(r12 + filename))?;
    emit_str_identity(a, rax, rcx, p.str_ascii_data)?;
    a.rol(rcx, 1)?;
    a.mov(qword_ptr(r8 + S_ARGS as i32 + 40), rcx)?;
    a.jmp(done)?;
    a.set_label(&mut function)?;
    emit_copy_once(a, p, done)
}

/// A table entry's words, each with the record argument it holds: code object,
/// identity check, name pointer, first line.
const SENT_ENTRY_WORDS: [(i32, i32); 4] = [(0, 0), (8, 5), (16, 2), (24, 4)];

/// The second kind of [`emit_copy_names`]: at a call only (a resume or a return
/// is named after its call), when the table does not hold its parts; ends at
/// `done`, which it binds.
fn emit_copy_once(
    a: &mut CodeAssembler,
    p: &HookParams,
    mut done: CodeLabel,
) -> Result<(), IcedError> {
    a.cmp(ebx, KIND_CALL)?;
    a.jne(done)?;
    let mut miss = a.create_label();
    // rax = the entry: code objects are 16-byte aligned, and a few apart.
    a.mov(rax, r12)?;
    a.shr(rax, 4)?;
    a.mov(rdx, r12)?;
    a.shr(rdx, 10)?;
    a.xor(rax, rdx)?;
    a.and(eax, (SENT_ENTRIES - 1) as u32)?;
    a.shl(eax, SENT_ENTRY_SHIFT)?;
    a.mov(rdx, p.state_addr + ST_SENT as u64)?;
    a.add(rax, rdx)?;
    for (word, arg) in SENT_ENTRY_WORDS {
        a.mov(rdx, qword_ptr(r8 + S_ARGS as i32 + 8 * arg))?;
        a.cmp(qword_ptr(rax + word), rdx)?;
        a.jne(miss)?;
    }
    a.jmp(done)?;
    a.set_label(&mut miss)?;
    for (word, arg) in SENT_ENTRY_WORDS {
        a.mov(rdx, qword_ptr(r8 + S_ARGS as i32 + 8 * arg))?;
        a.mov(qword_ptr(rax + word), rdx)?;
    }
    emit_copy_texts(a, p, 3, done)?;
    a.set_label(&mut done)?;
    Ok(())
}

/// Copies "NAME\x01FILE" of the code object at r12 into the slot at r8 as the
/// string of argument `arg` (see [`emit_copy_names`]); to `skip` when the name is
/// not a compact ASCII `str` that fits. Clobbers rax, rcx, rdx, rsi, rdi.
fn emit_copy_texts(
    a: &mut CodeAssembler,
    p: &HookParams,
    arg: u8,
    skip: CodeLabel,
) -> Result<(), IcedError> {
    const COMPACT_ASCII: i32 = 0x60;
    let [name, filename, _] = p.code_fields;
    let max = (STRINGS_LEN - 1) as i32;
    let mut finish = a.create_label();
    let compact_ascii = |a: &mut CodeAssembler, to: CodeLabel| -> Result<(), IcedError> {
        a.movzx(eax, byte_ptr(rsi + STR_STATE))?;
        a.and(eax, COMPACT_ASCII)?;
        a.cmp(eax, COMPACT_ASCII)?;
        a.jne(to)
    };
    a.mov(rsi, qword_ptr(r12 + name))?;
    compact_ascii(a, skip)?;
    a.mov(rcx, qword_ptr(rsi + STR_LENGTH))?;
    a.cmp(rcx, max)?;
    a.ja(skip)?;
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
    a.mov(byte_ptr(r8 + S_STRING_MASK as i32), 1u32 << arg)?;
    Ok(())
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
