//! A stopped thread's registers, as the SDT evaluator reads them.

use crate::sdt::{RegFamily, RegisterFile};

/// Registers from `PTRACE_GETREGS`.
#[derive(Clone, Copy)]
pub struct Registers(pub libc::user_regs_struct);

impl RegisterFile for Registers {
    fn read(&self, family: RegFamily) -> u64 {
        let r = &self.0;
        match family {
            RegFamily::Rax => r.rax,
            RegFamily::Rbx => r.rbx,
            RegFamily::Rcx => r.rcx,
            RegFamily::Rdx => r.rdx,
            RegFamily::Rsi => r.rsi,
            RegFamily::Rdi => r.rdi,
            RegFamily::Rbp => r.rbp,
            RegFamily::Rsp => r.rsp,
            RegFamily::R8 => r.r8,
            RegFamily::R9 => r.r9,
            RegFamily::R10 => r.r10,
            RegFamily::R11 => r.r11,
            RegFamily::R12 => r.r12,
            RegFamily::R13 => r.r13,
            RegFamily::R14 => r.r14,
            RegFamily::R15 => r.r15,
            // After the int3 that replaced the probe's nop, rip is site + 1: the
            // address of the next instruction, which rip-relative operands use.
            RegFamily::Rip => r.rip,
        }
    }
}

impl std::fmt::Debug for Registers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Registers {{ rip: {:#x}, rsp: {:#x} }}",
            self.0.rip, self.0.rsp
        )
    }
}
