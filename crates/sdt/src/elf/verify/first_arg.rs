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

/// Most loads through the argument remembered (a site's function makes a few).
const MAX_LOADED: usize = 16;

/// Instructions decoded from a site to its function's `ret`.
const MAX_TO_RET: usize = 32;

/// Follows the function's first argument through its code up to a site.
pub(super) struct FirstArg {
    /// Registers holding the argument now (bits in [`TRACKED`] order).
    holders: u16,
    /// Displacements of the 8-byte loads made through the argument so far.
    loaded: Vec<i64>,
    /// Per register (in [`TRACKED`] order): it holds the 8-byte word at this
    /// displacement from the argument, perhaps with low tag bits cleared.
    derived: [Option<i64>; 16],
    /// (displacement of the word, end of the bytes read through it): reads
    /// `[word + d]` of `n` bytes made so far, the farthest `d + n` per word.
    derived_read: Vec<(i64, i64)>,
    /// A branch, return or undecodable instruction was met: no answer.
    lost: bool,
    info: InstructionInfoFactory,
}

impl FirstArg {
    pub(super) fn new() -> Self {
        FirstArg {
            holders: bit(Register::RDI),
            loaded: Vec::new(),
            derived: [None; 16],
            derived_read: Vec::new(),
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
                    self.set_derived(r, None);
                }
                return;
            }
            _ => {
                self.lost = true;
                return;
            }
        }
        let word = self.note_load(instr);
        self.note_derived_read(instr);
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
            let from = self.derived_of(instr.op1_register());
            self.set_derived(instr.op0_register(), from);
            return;
        }
        // `and $-2, %r12`: a tagged word's tag bits cleared; still the pointer.
        let untag = instr.mnemonic() == Mnemonic::And
            && instr.op0_kind() == OpKind::Register
            && instr.op0_register().is_gpr64()
            && matches!(
                instr.op1_kind(),
                OpKind::Immediate8to64 | OpKind::Immediate32to64
            )
            && (-16..=-1).contains(&(instr.immediate(1) as i64));
        let keep = untag
            .then(|| self.derived_of(instr.op0_register()))
            .flatten();
        let info = self.info.info(instr);
        let written: Vec<Register> = info
            .used_registers()
            .iter()
            .filter(|used| {
                matches!(
                    used.access(),
                    OpAccess::Write
                        | OpAccess::CondWrite
                        | OpAccess::ReadWrite
                        | OpAccess::ReadCondWrite
                ) && used.register().is_gpr()
            })
            .map(|used| used.register())
            .collect();
        for reg in written {
            self.holders &= !bit(reg);
            self.set_derived(reg, None);
        }
        if let Some((dst, w)) = word {
            self.set_derived(dst, Some(w));
        }
        if keep.is_some() {
            self.set_derived(instr.op0_register(), keep);
        }
    }

    fn derived_of(&self, reg: Register) -> Option<i64> {
        let i = TRACKED
            .iter()
            .position(|(r, _)| *r == reg.full_register())?;
        self.derived[i]
    }

    fn set_derived(&mut self, reg: Register, word: Option<i64>) {
        if let Some(i) = TRACKED.iter().position(|(r, _)| *r == reg.full_register()) {
            self.derived[i] = word;
        }
    }

    /// Remembers a read `[r + d]` of any size where `r` holds a word loaded
    /// through the argument.
    fn note_derived_read(&mut self, instr: &Instruction) {
        let through_word = (0..instr.op_count()).any(|i| instr.op_kind(i) == OpKind::Memory)
            && instr.memory_index() == Register::None
            && instr.segment_prefix() == Register::None
            && instr.memory_base().is_gpr64();
        if !through_word {
            return;
        }
        let Some(w) = self.derived_of(instr.memory_base()) else {
            return;
        };
        let d = instr.memory_displacement64() as i64;
        let size = instr.memory_size().size() as i64;
        if d < 0 || size == 0 {
            return;
        }
        let end = d.saturating_add(size);
        match self.derived_read.iter().position(|(word, _)| *word == w) {
            Some(i) => self.derived_read[i].1 = self.derived_read[i].1.max(end),
            None if self.derived_read.len() < MAX_LOADED => self.derived_read.push((w, end)),
            None => {}
        }
    }

    /// (displacement `w` of a word from the argument, `end`): the code read, before
    /// this point, what that word points to as far as `end` bytes into it.
    pub(super) fn read_through(&self) -> &[(i64, i64)] {
        &self.derived_read
    }

    /// Remembers `mov r64, qword [holder + d]`: the word at `d` from the argument
    /// was read (before the instruction's own writes, which `step` applies after).
    /// Returns the register loaded and `d`.
    fn note_load(&mut self, instr: &Instruction) -> Option<(Register, i64)> {
        let load = instr.mnemonic() == Mnemonic::Mov
            && instr.op_count() == 2
            && instr.op0_kind() == OpKind::Register
            && instr.op0_register().is_gpr64()
            && instr.op1_kind() == OpKind::Memory
            && instr.memory_index() == Register::None
            && instr.segment_prefix() == Register::None
            && instr.memory_base().is_gpr64()
            && self.holders & bit(instr.memory_base()) != 0;
        let d = instr.memory_displacement64() as i64;
        if load && !self.loaded.contains(&d) && self.loaded.len() < MAX_LOADED {
            self.loaded.push(d);
        }
        load.then(|| (instr.op0_register(), d))
    }

    /// Displacements of the 8-byte words read through the argument so far (only
    /// meaningful while [`Self::holder`] gives a register).
    pub(super) fn loaded(&self) -> &[i64] {
        &self.loaded
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

/// Whether the code `decoder` decodes (from a site) runs straight to a `ret`:
/// calls return, and nothing else may leave the way (no jump, in particular no
/// jump table).
pub(super) fn straight_to_ret(decoder: &mut iced_x86::Decoder<'_>) -> bool {
    let mut instr = Instruction::default();
    for _ in 0..MAX_TO_RET {
        if !decoder.can_decode() {
            return false;
        }
        decoder.decode_out(&mut instr);
        match instr.flow_control() {
            FlowControl::Next | FlowControl::Call | FlowControl::IndirectCall
                if !instr.is_invalid() => {}
            FlowControl::Return => return true,
            _ => return false,
        }
    }
    false
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

    /// The loads through the argument, and the way from the site to `ret`.
    #[test]
    fn the_315_entry_reads_the_code_word_and_returns_straight() {
        let mut decoder = iced_x86::Decoder::with_ip(64, ENTRY_315, 0, Default::default());
        let mut flow = FirstArg::new();
        let mut instr = Instruction::default();
        while decoder.ip() < ENTRY_315.len() as u64 - 1 {
            decoder.decode_out(&mut instr);
            flow.step(&instr);
        }
        // `mov (%rdi),%r12` only: 0x70(%r12) is through another register,
        // which holds that word (tag bit cleared): 0x70 and 0x78 read through it.
        assert_eq!(flow.loaded(), &[0]);
        assert_eq!(flow.read_through(), &[(0, 0x80)]);
        let tail = [0x90, 0x5b, 0x41, 0x5c, 0xe8, 0, 0, 0, 0, 0xc3]; // nop pop pop call ret
        let straight = |code: &[u8]| {
            straight_to_ret(&mut iced_x86::Decoder::with_ip(
                64,
                code,
                0,
                Default::default(),
            ))
        };
        assert!(straight(&tail));
        // A jump table's `jmp *%rax` on the way, a conditional branch, or no `ret`.
        assert!(!straight(&[0x90, 0xff, 0xe0, 0xc3]));
        assert!(!straight(&[0x90, 0x74, 0x00, 0xc3]));
        assert!(!straight(&[0x90, 0x5b]));
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
