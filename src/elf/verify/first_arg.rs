//! Where a probe site's function keeps its first argument.
//!
//! CPython 3.11+ fire their function probes from a small function that takes the
//! `_PyInterpreterFrame *` as its only argument (`dtrace_function_entry(frame)`),
//! and keep it in a callee-saved register across the calls that compute the
//! probe's arguments. That register holds the frame at the site: a probe argument
//! the note does not list, which names the code object where the line the probe
//! passes cannot (CPython 3.15 passes -1 for functions with cells).
//!
//! This is the static half: a dataflow over the straight-line code from the
//! function's start to the site, following `%rdi` (the System V first argument)
//! through register-to-register moves and dropping every register an instruction
//! writes and the caller-saved ones at each call. Code with a branch, a return or
//! anything but a plain sequence before the site gives no answer. What the
//! register holds is checked at run time (its frame's code object must carry the
//! names the probe passes) before anything relies on it.

use iced_x86::{
    FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind, Register,
};

/// The 64-bit registers tracked, as AT&T names.
const TRACKED: [(Register, &str); 16] = [
    (Register::RAX, "%rax"),
    (Register::RCX, "%rcx"),
    (Register::RDX, "%rdx"),
    (Register::RBX, "%rbx"),
    (Register::RSP, "%rsp"),
    (Register::RBP, "%rbp"),
    (Register::RSI, "%rsi"),
    (Register::RDI, "%rdi"),
    (Register::R8, "%r8"),
    (Register::R9, "%r9"),
    (Register::R10, "%r10"),
    (Register::R11, "%r11"),
    (Register::R12, "%r12"),
    (Register::R13, "%r13"),
    (Register::R14, "%r14"),
    (Register::R15, "%r15"),
];

/// Registers a call may change (System V).
const CALLER_SAVED: [Register; 9] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RSI,
    Register::RDI,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
];

/// Preferred answers first: callee-saved registers, then `%rdi` itself.
const PREFERRED: [Register; 6] = [
    Register::RBX,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
    Register::RDI,
];

fn bit(reg: Register) -> u16 {
    let full = reg.full_register();
    TRACKED
        .iter()
        .position(|(r, _)| *r == full)
        .map_or(0, |i| 1 << i)
}

/// Follows the function's first argument through its code up to a site.
pub(super) struct FirstArg {
    /// Registers holding the argument now (bits in [`TRACKED`] order).
    holders: u16,
    /// A branch, return or undecodable instruction was met: no answer.
    lost: bool,
    info: InstructionInfoFactory,
}

impl FirstArg {
    pub(super) fn new() -> Self {
        FirstArg {
            holders: bit(Register::RDI),
            lost: false,
            info: InstructionInfoFactory::new(),
        }
    }

    /// Takes one instruction (in order, from the function's start).
    pub(super) fn step(&mut self, instr: &Instruction) {
        if self.lost {
            return;
        }
        if instr.is_invalid() {
            self.lost = true;
            return;
        }
        match instr.flow_control() {
            FlowControl::Next => {}
            FlowControl::Call | FlowControl::IndirectCall => {
                for r in CALLER_SAVED {
                    self.holders &= !bit(r);
                }
                return;
            }
            _ => {
                self.lost = true;
                return;
            }
        }
        let reg_to_reg = instr.mnemonic() == Mnemonic::Mov
            && instr.op_count() == 2
            && instr.op0_kind() == OpKind::Register
            && instr.op1_kind() == OpKind::Register
            && instr.op0_register().is_gpr64()
            && instr.op1_register().is_gpr64();
        if reg_to_reg {
            let (dst, src) = (bit(instr.op0_register()), bit(instr.op1_register()));
            if self.holders & src != 0 {
                self.holders |= dst;
            } else {
                self.holders &= !dst;
            }
            return;
        }
        let info = self.info.info(instr);
        for used in info.used_registers() {
            if matches!(
                used.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            ) && used.register().is_gpr()
            {
                self.holders &= !bit(used.register());
            }
        }
    }

    /// The register holding the argument at this point (AT&T name), if one surely does.
    pub(super) fn holder(&self) -> Option<&'static str> {
        if self.lost {
            return None;
        }
        PREFERRED
            .into_iter()
            .find(|r| self.holders & bit(*r) != 0)
            .and_then(|r| TRACKED.iter().find(|(t, _)| *t == r).map(|(_, n)| *n))
    }
}

/// The register holding the first argument of the function starting at `start`
/// (whose code is `bytes`) at `site`, decoding straight from the start.
#[cfg(test)]
fn first_arg_at(bytes: &[u8], start: u64, site: u64) -> Option<&'static str> {
    let mut decoder = iced_x86::Decoder::with_ip(64, bytes, start, iced_x86::DecoderOptions::NONE);
    let mut instr = Instruction::default();
    let mut flow = FirstArg::new();
    while decoder.can_decode() && decoder.ip() < site {
        decoder.decode_out(&mut instr);
        flow.step(&instr);
    }
    (decoder.ip() == site).then(|| flow.holder()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPython 3.15's `dtrace_function_entry` (Debian sid build), start to site.
    const ENTRY_315: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, // endbr64
        0x55, // push %rbp
        0x48, 0x89, 0xe5, // mov %rsp,%rbp
        0x41, 0x56, // push %r14
        0x41, 0x55, // push %r13
        0x49, 0x89, 0xfd, // mov %rdi,%r13
        0x41, 0x54, // push %r12
        0x53, // push %rbx
        0x4c, 0x8b, 0x27, // mov (%rdi),%r12
        0x49, 0x83, 0xe4, 0xfe, // and $-2,%r12
        0xe8, 0, 0, 0, 0, // call
        0x49, 0x8b, 0x7c, 0x24, 0x70, // mov 0x70(%r12),%rdi
        0x49, 0x89, 0xc6, // mov %rax,%r14
        0xe8, 0, 0, 0, 0, // call
        0x49, 0x8b, 0x7c, 0x24, 0x78, // mov 0x78(%r12),%rdi
        0x48, 0x89, 0xc3, // mov %rax,%rbx
        0xe8, 0, 0, 0, 0, // call
        0x4c, 0x89, 0xf7, // mov %r14,%rdi
        0x49, 0x89, 0xc4, // mov %rax,%r12
        0xe8, 0, 0, 0, 0, // call
        0xb8, 0xa4, 0xa1, 0x88, 0x00, // mov $0x88a1a4,%eax
        0x48, 0x85, 0xdb, // test %rbx,%rbx
        0x4c, 0x89, 0xef, // mov %r13,%rdi
        0x48, 0x0f, 0x44, 0xd8, // cmove %rax,%rbx
        0x4d, 0x85, 0xe4, // test %r12,%r12
        0x4c, 0x0f, 0x44, 0xe0, // cmove %rax,%r12
        0xe8, 0, 0, 0, 0,    // call
        0x90, // the site
    ];

    #[test]
    fn the_315_entry_site_keeps_the_frame_in_r13() {
        let site = ENTRY_315.len() as u64 - 1;
        assert_eq!(first_arg_at(ENTRY_315, 0, site), Some("%r13"));
    }

    #[test]
    fn a_clobbered_register_a_branch_or_a_missed_site_gives_nothing() {
        let site = ENTRY_315.len() as u64 - 1;
        // `mov %rax,%r13` just before the site.
        let mut clobbered = ENTRY_315[..ENTRY_315.len() - 1].to_vec();
        clobbered.extend_from_slice(&[0x49, 0x89, 0xc5, 0x90]);
        assert_eq!(first_arg_at(&clobbered, 0, site + 3), None);
        // A conditional branch before the site.
        let mut branch = vec![0x74, 0x00];
        branch.extend_from_slice(ENTRY_315);
        assert_eq!(first_arg_at(&branch, 0, site + 2), None);
        // A site inside an instruction.
        assert_eq!(first_arg_at(ENTRY_315, 0, 13), None);
        // Nothing at all: the argument is still in %rdi.
        assert_eq!(first_arg_at(&[0x90], 0, 0), Some("%rdi"));
    }
}
