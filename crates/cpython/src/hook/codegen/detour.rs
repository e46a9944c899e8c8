//! The detour at the safe point and the jump patched in to reach it. Apart from the
//! hook page: it is built for a function's entry (decoded and relocated), placed
//! within rel32 reach of it, and undone by pyprobe rather than by the hook.

use iced_x86::code_asm::*;
use iced_x86::{Decoder, DecoderOptions, FlowControl};

use super::HookError;
use crate::hook::ST_ARMED;

/// The `jmp rel32` written at the safe point.
pub const JMP_LEN: usize = 5;
/// Most bytes of instructions a detour displaces.
pub(super) const MAX_DISPLACED: usize = 24;

/// The detour at the safe point, and the patch that jumps to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detour {
    pub(crate) addr: u64,
    pub code: Vec<u8>,
    /// The function entry rewritten.
    pub(crate) site: u64,
    /// Bytes at `site` now.
    pub(crate) original: Vec<u8>,
    /// `jmp rel32` to `addr`, padded with `int3` to the length of `original`.
    pub(crate) patch: Vec<u8>,
}

impl Detour {
    pub fn contains(&self, rip: u64) -> bool {
        (self.addr..self.addr + self.code.len() as u64).contains(&rip)
    }
    /// A thread whose rip is strictly inside the bytes the patch replaces would
    /// resume in the middle of the jump.
    pub(crate) fn splits(&self, rip: u64) -> bool {
        rip > self.site && rip < self.site + self.original.len() as u64
    }
}

/// The functions a detour calls.
#[derive(Debug, Clone, Copy)]
pub struct DetourCalls {
    /// The hook's installer.
    pub installer: u64,
    /// `PyInterpreterState_Get` and `PyInterpreterState_Main`: only a thread of
    /// the main interpreter installs. `sys.monitoring` is per interpreter, and a
    /// hook installed in a short-lived subinterpreter would trace nothing of the
    /// program and die with it, while pyprobe took it for installed.
    pub interpreter_get: u64,
    pub interpreter_main: u64,
}

/// Builds the detour placed at `addr` for the function whose entry `site` holds
/// `code` (its first bytes; `targets`: branch targets known in that function):
/// saves the argument registers; on a thread of the main interpreter, runs the
/// installer if `state.armed` goes 1 → 2; restores them, runs the displaced
/// instructions, jumps back.
pub fn build_detour(
    addr: u64,
    site: u64,
    code: &[u8],
    targets: &pyprobe_sdt::ring::BranchTargets,
    state_addr: u64,
    calls: DetourCalls,
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
    // The current interpreter kept on the stack (two words: rsp stays aligned)
    // while the main one is asked for.
    a.mov(rax, calls.interpreter_get)?;
    a.call(rax)?;
    a.push(rax)?;
    a.sub(rsp, 8)?;
    a.mov(rax, calls.interpreter_main)?;
    a.call(rax)?;
    a.add(rsp, 8)?;
    a.pop(rcx)?;
    a.cmp(rax, rcx)?;
    a.jne(skip)?;
    a.mov(r11, state_addr)?;
    a.mov(eax, 1)?;
    a.mov(ecx, 2)?;
    a.lock().cmpxchg(qword_ptr(r11 + ST_ARMED as i32), rcx)?;
    a.jne(skip)?;
    a.mov(rax, calls.installer)?;
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
