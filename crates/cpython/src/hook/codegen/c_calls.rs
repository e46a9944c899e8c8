//! How the hook calls C functions (SysV ABI), the C API's `PyObject_CallMethod` and
//! `Py_DecRef` in particular: the installer, the uninstaller and the callbacks all
//! make such calls, so the helpers are apart from each of them.

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use super::HookParams;
use crate::hook::TOOL_ID;

/// An argument of a call the hook makes.
#[derive(Clone, Copy)]
pub(super) enum Arg {
    Imm(u64),
    Reg(AsmRegister64),
}

const ARG_REGS: [AsmRegister64; 6] = [rdi, rsi, rdx, rcx, r8, r9];

/// `call fn(args...)` with `al = 0` (so variadic functions work too). The stack must
/// be 16-byte aligned here. Clobbers the caller-saved registers.
pub(super) fn call(a: &mut CodeAssembler, f: u64, args: &[Arg]) -> Result<(), IcedError> {
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
pub(super) fn call_method(
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

/// `sys.monitoring.register_callback(TOOL, 1 << ev, callback)` through the module in
/// rbx (`names`: the method's name and the format `"iiO"` in the page): rax = the
/// callback it replaces (a new reference), or NULL.
pub(super) fn register_callback(
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
pub(super) fn decref_rax(a: &mut CodeAssembler, p: &HookParams) -> Result<(), IcedError> {
    a.mov(rdi, rax)?;
    call(a, p.symbols.dec_ref, &[Arg::Reg(rdi)])
}
