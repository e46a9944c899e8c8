//! Keeping the interrupted code's flags across the trampoline: the cheaper
//! `lahf`/`sahf` where the CPU has it, else `pushfq`/`popfq`. Apart because
//! the choice depends on the CPU, not on the site.

use iced_x86::code_asm::*;

use super::CodegenError;

/// How a trampoline keeps the interrupted code's flags (the displaced
/// instructions after it may read them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagSave {
    /// `lahf` and `seto` into the slot `pushfq` would use, `add al, 0x7f` and
    /// `sahf` back: the six status flags, which is all the trampoline changes
    /// (it never touches DF or the system flags). About 2 ns where
    /// `pushfq`/`popfq` cost 12 (`popfq` is microcoded).
    Lahf,
    /// `pushfq`/`popfq`: for a CPU without `lahf`/`sahf` in 64-bit mode.
    Pushfq,
}

impl FlagSave {
    /// The cheaper way where this CPU has it (CPUID 0x8000_0001, ECX bit 0).
    /// pyprobe and the target it writes trampolines for run on the same machine.
    pub(crate) fn for_this_cpu() -> FlagSave {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let has = *HAS.get_or_init(|| extended_feature_ecx() & 1 != 0);
        if has {
            FlagSave::Lahf
        } else {
            FlagSave::Pushfq
        }
    }
}

/// CPUID 0x8000_0001's ECX, 0 on a CPU without the extended leaf.
pub(super) fn extended_feature_ecx() -> u32 {
    use std::arch::x86_64::__cpuid;
    // The extended leaf is asked for only when the CPU says it has it.
    if __cpuid(0x8000_0000).eax >= 0x8000_0001 {
        __cpuid(0x8000_0001).ecx
    } else {
        0
    }
}

/// Steps over the red zone and saves the flags and rax, leaving the stack as
/// `lea rsp, [rsp-128]; pushfq; push rax` would (arguments are read from those
/// slots, see [`FRAME`](super::FRAME)).
pub(super) fn emit_save_flags(a: &mut CodeAssembler, how: FlagSave) -> Result<(), CodegenError> {
    match how {
        FlagSave::Lahf => {
            // lea keeps the flags; lahf and seto only read them.
            a.lea(rsp, ptr(rsp - 136))?;
            a.push(rax)?;
            a.lahf()?;
            a.seto(al)?;
            a.mov(qword_ptr(rsp + 8), rax)?;
        }
        FlagSave::Pushfq => {
            a.lea(rsp, ptr(rsp - 128))?;
            a.pushfq()?;
            a.push(rax)?;
        }
    }
    Ok(())
}

/// Undoes [`emit_save_flags`] (every other saved register already popped).
pub(super) fn emit_restore_flags(a: &mut CodeAssembler, how: FlagSave) -> Result<(), CodegenError> {
    match how {
        FlagSave::Lahf => {
            a.mov(rax, qword_ptr(rsp + 8))?;
            // al is 1 if OF was set: 1 + 0x7f overflows, 0 + 0x7f does not.
            a.add(al, 0x7f)?;
            a.sahf()?;
            a.pop(rax)?;
            a.lea(rsp, ptr(rsp + 136))?;
        }
        FlagSave::Pushfq => {
            a.pop(rax)?;
            a.popfq()?;
            a.lea(rsp, ptr(rsp + 128))?;
        }
    }
    Ok(())
}
