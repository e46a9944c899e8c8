//! The record a callback writes: the units of [`crate::hook::units`], each
//! reserved with the ring's producer protocol. On the common path that is one
//! unit (the event); the thread, the returned type and the code object's parts go
//! before it only when they are not what the hook last sent.

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use pyprobe_sdt::ring::codegen::{emit_reserve, Shape};
use pyprobe_sdt::ring::format::{group_len_bits, HEADER_SIZE};

use super::{HookError, HookParams, STR_HASH, STR_LENGTH};
use crate::hook::units::{
    AUX_SHIFT, GROUP_UNITS, SENT_ENTRIES, SENT_WORDS, STAMP_SHIFT, TEXT_AT, TEXT_MAX, TYPE_ENTRIES,
    U_BODY, U_PARTS, U_THREAD, U_TYPE,
};
use crate::hook::{ST_LAST_THREAD, ST_SCRATCH, ST_SENT, ST_TYPES};

/// `offsetof(PyASCIIObject, state)` (see [`STR_LENGTH`]).
const STR_STATE: i32 = 32;
/// `CO_OPTIMIZED`: set on functions, clear on module and class bodies.
const CO_OPTIMIZED: i32 = 1;

/// Emits the record of an event: ebx = its kind, r12 = its code object, r13 =
/// the returned object's type or 0; r14 and r15 are free (callee-saved, pushed
/// by the callback). `body_flags` (the profile route, before 3.12): where
/// `co_flags` is, and a module or class body sends its parts and name with every
/// event (two bodies made from one template at one address share every part but
/// their file's identity). Ends at `done`; on a lost unit at `lost` (r9 = the ring).
pub(super) fn emit_record(
    a: &mut CodeAssembler,
    p: &HookParams,
    body_flags: Option<i32>,
    lost: &mut CodeLabel,
    done: CodeLabel,
) -> Result<(), HookError> {
    let reserve = |a: &mut CodeAssembler, extra: u32, lost: &mut CodeLabel| {
        emit_reserve(a, p.ring_addr, p.capacity, extra, Shape::Units, None, lost)
            .map_err(|e| HookError::Reserve(e.to_string()))
    };
    // The thread, when another's event was the last.
    let mut thread_known = a.create_label();
    a.mov(r15, qword_ptr(0u64).fs())?;
    a.mov(rax, p.state_addr)?;
    a.cmp(qword_ptr(rax + ST_LAST_THREAD as i32), r15)?;
    a.je(thread_known)?;
    reserve(a, 0, lost)?;
    a.mov(qword_ptr(r8 + 8), r15)?;
    a.mov(qword_ptr(r8), U_THREAD as i32)?;
    a.mov(rax, p.state_addr)?;
    a.mov(qword_ptr(rax + ST_LAST_THREAD as i32), r15)?;
    a.set_label(&mut thread_known)?;

    // The returned type: r14 = its entry + 1 (0: none), sent when the entry
    // holds another.
    let mut typed = a.create_label();
    a.xor(r14d, r14d)?;
    a.test(r13, r13)?;
    a.jz(typed)?;
    emit_table_index(a, r13, TYPE_ENTRIES)?;
    a.lea(r14, ptr(rax + 1))?;
    a.mov(rdx, p.state_addr + ST_TYPES as u64)?;
    a.cmp(qword_ptr(rdx + rax * 8), r13)?;
    a.je(typed)?;
    reserve(a, 0, lost)?;
    a.mov(qword_ptr(r8 + 8), r13)?;
    a.mov(rax, r14)?;
    a.shl(rax, AUX_SHIFT)?;
    a.or(rax, U_TYPE as i32)?;
    a.mov(qword_ptr(r8), rax)?;
    a.mov(rdx, p.state_addr + ST_TYPES as u64 - 8)?;
    a.mov(qword_ptr(rdx + r14 * 8), r13)?;
    a.set_label(&mut typed)?;

    // The code object's parts, when its sent table entry holds others.
    let mut parts_known = a.create_label();
    let mut send_parts = a.create_label();
    if let Some(flags) = body_flags {
        let mut function = a.create_label();
        a.test(dword_ptr(r12 + flags), CO_OPTIMIZED)?;
        a.jnz(function)?;
        emit_group(a, p, U_BODY, lost)?;
        a.jmp(parts_known)?;
        a.set_label(&mut function)?;
    }
    // r15 = the entry.
    emit_table_index(a, r12, SENT_ENTRIES)?;
    a.lea(rax, ptr(rax + rax * 2))?;
    a.shl(rax, 4)?;
    const _: () = assert!(SENT_WORDS * 8 == 48);
    a.mov(r15, p.state_addr + ST_SENT as u64)?;
    a.add(r15, rax)?;
    let [name, filename, first_line] = p.code_fields.map(|o| o as i32);
    a.cmp(qword_ptr(r15), r12)?;
    a.jne(send_parts)?;
    a.mov(rax, qword_ptr(r12 + name))?;
    a.cmp(qword_ptr(r15 + 8), rax)?;
    a.jne(send_parts)?;
    a.mov(rax, qword_ptr(r12 + filename))?;
    a.cmp(qword_ptr(r15 + 16), rax)?;
    a.jne(send_parts)?;
    a.movsxd(rax, dword_ptr(r12 + first_line))?;
    a.cmp(qword_ptr(r15 + 24), rax)?;
    a.jne(send_parts)?;
    emit_identity(a, p, false)?;
    a.cmp(qword_ptr(r15 + 32), rcx)?;
    a.je(parts_known)?;
    a.set_label(&mut send_parts)?;
    emit_group(a, p, U_PARTS, lost)?;
    // Sent: the entry holds them now (the group's words 1 to 5).
    a.mov(rsi, p.state_addr + ST_SCRATCH as u64)?;
    for k in 0..5 {
        a.mov(rax, qword_ptr(rsi + 8 * (k + 1)))?;
        a.mov(qword_ptr(r15 + 8 * k), rax)?;
    }
    a.set_label(&mut parts_known)?;

    // The event: kind + 1, aux, stamp; its code object; first word last.
    reserve(a, 0, lost)?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.shl(rax, STAMP_SHIFT)?;
    a.mov(rcx, r14)?;
    a.shl(rcx, AUX_SHIFT)?;
    a.or(rax, rcx)?;
    a.lea(ecx, ptr(rbx + 1))?;
    a.or(rax, rcx)?;
    a.mov(qword_ptr(r8 + 8), r12)?;
    a.mov(qword_ptr(r8), rax)?;
    a.jmp(done)?;
    Ok(())
}

/// rax = the entry of the object at `reg` in a table of `entries` (as
/// [`table_index`](crate::hook::units::table_index)). Clobbers rdx.
fn emit_table_index(
    a: &mut CodeAssembler,
    reg: AsmRegister64,
    entries: usize,
) -> Result<(), IcedError> {
    a.mov(rax, reg)?;
    a.shr(rax, 4)?;
    a.mov(rdx, reg)?;
    a.shr(rdx, 10)?;
    a.xor(rax, rdx)?;
    a.and(eax, (entries - 1) as u32)
}

/// rcx = the identity check of the code object at r12's strings: its name's
/// identity xor its file's rotated by one, or for a body (`file_only`) its file's
/// alone, rotated. pyprobe names a code object that is gone from its strings only
/// while they still read the same (before 3.12 they may be freed too, and their
/// memory hold other strings). Clobbers rax, rdx, rsi.
fn emit_identity(a: &mut CodeAssembler, p: &HookParams, file_only: bool) -> Result<(), IcedError> {
    let [name, filename, _] = p.code_fields.map(|o| o as i32);
    a.mov(rax, qword_ptr(r12 + filename))?;
    emit_str_identity(a, rax, rdx, p.str_ascii_data)?;
    a.rol(rdx, 1)?;
    if file_only {
        a.mov(rcx, rdx)?;
        return Ok(());
    }
    a.mov(rax, qword_ptr(r12 + name))?;
    emit_str_identity(a, rax, rcx, p.str_ascii_data)?;
    a.xor(rcx, rdx)
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

/// A parts or body group (`kind`) of the code object at r12: built in the state
/// page's scratch room (code object, name and file pointers, first line,
/// identity, then the text; a body's identity is its file's alone when its text
/// went with it), then reserved as [`GROUP_UNITS`] units and copied
/// in, unit by unit (the units may wrap to the ring's start), the first word
/// last. Leaves the scratch room as built; clobbers every caller-saved register.
fn emit_group(
    a: &mut CodeAssembler,
    p: &HookParams,
    kind: u64,
    lost: &mut CodeLabel,
) -> Result<(), HookError> {
    let [name, filename, first_line] = p.code_fields.map(|o| o as i32);
    let scratch = p.state_addr + ST_SCRATCH as u64;
    a.mov(rdi, scratch)?;
    a.mov(qword_ptr(rdi + 8), r12)?;
    a.mov(rax, qword_ptr(r12 + name))?;
    a.mov(qword_ptr(rdi + 16), rax)?;
    a.mov(rax, qword_ptr(r12 + filename))?;
    a.mov(qword_ptr(rdi + 24), rax)?;
    a.movsxd(rax, dword_ptr(r12 + first_line))?;
    a.mov(qword_ptr(rdi + 32), rax)?;
    emit_identity(a, p, kind == U_BODY)?;
    a.mov(rdi, scratch)?;
    a.mov(qword_ptr(rdi + 40), rcx)?;
    emit_copy_text(a, p, scratch + TEXT_AT as u64)?;
    if kind == U_BODY {
        // No text (a name that does not fit): named from memory, by both strings.
        let mut has_text = a.create_label();
        a.mov(rdi, scratch)?;
        a.cmp(byte_ptr(rdi + TEXT_AT as i32), 0)?;
        a.jne(has_text)?;
        emit_identity(a, p, false)?;
        a.mov(rdi, scratch)?;
        a.mov(qword_ptr(rdi + 40), rcx)?;
        a.set_label(&mut has_text)?;
    }
    emit_reserve(
        a,
        p.ring_addr,
        p.capacity,
        (GROUP_UNITS - 1) as u32,
        Shape::Units,
        // The hook raises no semaphore: it unhooks itself instead.
        None,
        lost,
    )
    .map_err(|e| HookError::Reserve(e.to_string()))?;
    // r8 = the first unit, r10 = its index, r9 = the ring. Units 1.. first.
    let mask = (p.capacity - 1) as i32;
    let mut unit = a.create_label();
    a.mov(r11, scratch)?;
    a.mov(ecx, 1)?;
    a.set_label(&mut unit)?;
    a.lea(rax, ptr(r10 + rcx))?;
    a.and(rax, mask)?;
    a.shl(rax, 4)?;
    a.lea(rdi, ptr(r9 + rax + HEADER_SIZE as i32))?;
    a.mov(rdx, rcx)?;
    a.shl(rdx, 4)?;
    a.mov(rsi, qword_ptr(r11 + rdx))?;
    a.mov(qword_ptr(rdi), rsi)?;
    a.mov(rsi, qword_ptr(r11 + rdx + 8))?;
    a.mov(qword_ptr(rdi + 8), rsi)?;
    a.inc(ecx)?;
    a.cmp(ecx, GROUP_UNITS as u32)?;
    a.jb(unit)?;
    a.mov(rax, qword_ptr(r11 + 8))?;
    a.mov(qword_ptr(r8 + 8), rax)?;
    a.mov(qword_ptr(r8), (kind | group_len_bits(GROUP_UNITS)) as i32)?;
    Ok(())
}

/// Copies "NAME\x01FILE" of the code object at r12 to `to`, NUL-terminated (the
/// file left out when both do not fit in [`TEXT_MAX`] bytes, both when the name
/// alone does not, or is not a compact ASCII `str`: then the text is empty).
/// Clobbers rax, rcx, rdx, rsi, rdi.
fn emit_copy_text(a: &mut CodeAssembler, p: &HookParams, to: u64) -> Result<(), IcedError> {
    const COMPACT_ASCII: i32 = 0x60;
    let [name, filename, _] = p.code_fields.map(|o| o as i32);
    let max = TEXT_MAX as i32;
    let mut finish = a.create_label();
    let mut empty = a.create_label();
    let compact_ascii = |a: &mut CodeAssembler, to: CodeLabel| -> Result<(), IcedError> {
        a.movzx(eax, byte_ptr(rsi + STR_STATE))?;
        a.and(eax, COMPACT_ASCII)?;
        a.cmp(eax, COMPACT_ASCII)?;
        a.jne(to)
    };
    a.mov(rdi, to)?;
    a.mov(rsi, qword_ptr(r12 + name))?;
    compact_ascii(a, empty)?;
    a.mov(rcx, qword_ptr(rsi + STR_LENGTH))?;
    a.cmp(rcx, max)?;
    a.ja(empty)?;
    a.mov(rdx, rcx)?;
    a.lea(rsi, ptr(rsi + p.str_ascii_data))?;
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
    a.jmp(finish)?;
    a.set_label(&mut empty)?;
    a.mov(rdi, to)?;
    a.set_label(&mut finish)?;
    a.mov(byte_ptr(rdi), 0)?;
    Ok(())
}
