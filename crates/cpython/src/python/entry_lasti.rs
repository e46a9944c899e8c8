//! Where a `function__entry` site of CPython 3.7 to 3.9 can read the frame's
//! `f_lasti`, which tells a call from a resume.
//!
//! Those versions fire the probe from `dtrace_function_entry(f)`, which passes
//! `PyCode_Addr2Line(f->f_code, f->f_lasti)` as the line: the compiler loads
//! `f_lasti` (an `int`) into `%esi` through the register holding `f`, calls
//! `PyCode_Addr2Line` and puts the site right after the call. When that register is
//! callee-saved and nothing between the load and the site writes it, the same
//! memory operand read at the site is `f_lasti`: -1 before the frame first ran,
//! so the entry is a call; the offset of its last instruction when a generator or
//! coroutine resumes. The site's own code read that word just before, so reading it
//! there cannot fault, as long as nothing jumps in between (the caller guards it:
//! [`pyprobe_sdt::probe_set::GuardedArgs`]).
//!
//! CPython 3.10 computes the line inside `PyFrame_GetLineNumber(f)`: no such
//! load at the site, no answer.

use iced_x86::{FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind};
use iced_x86::{MemorySize, Register};

/// Registers a call preserves (System V), which may carry `f` across it.
const CALLEE_SAVED: [(Register, &str); 6] = [
    (Register::RBX, "%rbx"),
    (Register::RBP, "%rbp"),
    (Register::R12, "%r12"),
    (Register::R13, "%r13"),
    (Register::R14, "%r14"),
    (Register::R15, "%r15"),
];

/// Where `f_lasti` is read at a site.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastiOperand {
    /// The SDT argument spec that reads it: `-4@DISP(%REG)`.
    pub spec: String,
    /// Link-time address of the site's own load of it: from there to the site the
    /// code runs straight.
    pub load_at: u64,
}

/// The operand `f_lasti` is at when the site at `site` (link-time) is reached
/// through `lead_in` (the instructions just before it, exact boundaries) and the
/// call just before it is to `addr2line` (`PyCode_Addr2Line`, link-time).
pub fn lasti_operand(lead_in: &[Instruction], site: u64, addr2line: u64) -> Option<LastiOperand> {
    let (call, before) = lead_in.split_last()?;
    let is_the_call = call.next_ip() == site
        && call.flow_control() == FlowControl::Call
        && call.op0_kind() == OpKind::NearBranch64
        && call.near_branch_target() == addr2line;
    if !is_the_call {
        return None;
    }
    let mut info = InstructionInfoFactory::new();
    // The nearest instruction before the call that writes %rsi (in any width).
    let at = before
        .iter()
        .rposition(|i| writes(&mut info, i, Register::RSI) || i.is_invalid())?;
    let load = &before[at];
    let is_load = load.mnemonic() == Mnemonic::Mov
        && load.op_count() == 2
        && load.op0_kind() == OpKind::Register
        && load.op0_register() == Register::ESI
        && load.op1_kind() == OpKind::Memory
        && matches!(load.memory_size(), MemorySize::UInt32 | MemorySize::Int32)
        && load.memory_index() == Register::None
        && load.segment_prefix() == Register::None;
    if !is_load {
        return None;
    }
    let base = load.memory_base();
    let (_, name) = CALLEE_SAVED.iter().find(|(r, _)| *r == base)?;
    // From the load to the site: straight code (calls return) that leaves the base
    // register as it was.
    for i in &before[at + 1..] {
        let straight = matches!(i.flow_control(), FlowControl::Next | FlowControl::Call);
        if !straight || i.is_invalid() || writes(&mut info, i, base) {
            return None;
        }
    }
    let disp = load.memory_displacement64() as i64;
    Some(LastiOperand {
        spec: format!("-4@{disp}({name})"),
        load_at: load.ip(),
    })
}

/// Whether `instr` writes any part of `reg` (a full 64-bit register).
fn writes(info: &mut InstructionInfoFactory, instr: &Instruction, reg: Register) -> bool {
    info.info(instr).used_registers().iter().any(|u| {
        u.register().full_register() == reg
            && matches!(
                u.access(),
                OpAccess::Write
                    | OpAccess::ReadWrite
                    | OpAccess::CondWrite
                    | OpAccess::ReadCondWrite
            )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions};

    /// Decodes `bytes` at `ip`.
    fn decode(bytes: &[u8], ip: u64) -> Vec<Instruction> {
        Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE)
            .into_iter()
            .collect()
    }

    /// Debian 3.9's entry site (0x42daa2): `f_lasti` at 0x68(%rbx).
    const DEBIAN_39: [u8; 40] = [
        0x4c, 0x8b, 0x7c, 0x24, 0x38, // mov 0x38(%rsp),%r15
        0x49, 0x8b, 0x7f, 0x68, // mov 0x68(%r15),%rdi
        0xe8, 0x98, 0x90, 0x0f, 0x00, // call 0x526b20
        0x49, 0x8b, 0x7f, 0x70, // mov 0x70(%r15),%rdi
        0x49, 0x89, 0xc5, // mov %rax,%r13
        0xe8, 0x8c, 0x90, 0x0f, 0x00, // call 0x526b20
        0x8b, 0x73, 0x68, // mov 0x68(%rbx),%esi
        0x4c, 0x89, 0xff, // mov %r15,%rdi
        0x49, 0x89, 0xc6, // mov %rax,%r14
        0xe8, 0x5e, 0x8b, 0x10, 0x00, // call 0x536600
    ];

    #[test]
    fn debian_39s_entry_site_reads_f_lasti_through_rbx() {
        let lead_in = decode(&DEBIAN_39, 0x42da7a);
        assert_eq!(lead_in.last().map(|i| i.next_ip()), Some(0x42daa2));
        assert_eq!(
            lasti_operand(&lead_in, 0x42daa2, 0x536600),
            Some(LastiOperand {
                spec: "-4@104(%rbx)".into(),
                load_at: 0x42da94,
            })
        );
    }

    #[test]
    fn no_answer_for_another_call_a_clobbered_base_or_a_jump_between() {
        let lead_in = decode(&DEBIAN_39, 0x42da7a);
        // The call is to something else.
        assert_eq!(lasti_operand(&lead_in, 0x42daa2, 0x526b20), None);
        // Not right before the site.
        assert_eq!(lasti_operand(&lead_in, 0x42daa3, 0x536600), None);
        // %rbx written after the load: `mov %rax,%rbx` in place of `mov %rax,%r14`.
        let mut clobbered = DEBIAN_39;
        clobbered[32..35].copy_from_slice(&[0x48, 0x89, 0xc3]);
        let lead_in = decode(&clobbered, 0x42da7a);
        assert_eq!(lasti_operand(&lead_in, 0x42daa2, 0x536600), None);
        // A jump between the load and the call: `jmp +1` over a one-byte nop
        // (replacing `mov %rax,%r14`).
        let mut jumped = DEBIAN_39;
        jumped[32..35].copy_from_slice(&[0xeb, 0x01, 0x90]);
        let lead_in = decode(&jumped, 0x42da7a);
        assert_eq!(lasti_operand(&lead_in, 0x42daa2, 0x536600), None);
        // %esi from a register, not memory: `mov %ebp,%esi` + `nop`.
        let mut from_register = DEBIAN_39;
        from_register[26..29].copy_from_slice(&[0x89, 0xee, 0x90]);
        let lead_in = decode(&from_register, 0x42da7a);
        assert_eq!(lasti_operand(&lead_in, 0x42daa2, 0x536600), None);
        // Through a caller-saved register: `mov 0x68(%rcx),%esi`.
        let mut caller_saved = DEBIAN_39;
        caller_saved[26..29].copy_from_slice(&[0x8b, 0x71, 0x68]);
        let lead_in = decode(&caller_saved, 0x42da7a);
        assert_eq!(lasti_operand(&lead_in, 0x42daa2, 0x536600), None);
    }
}
