//! The SDT arguments in machine code: each argument's value computed from the
//! registers as they were at the site (read back from the trampoline's saved
//! registers), and the prefixes of C-string arguments copied into the slot.

use iced_x86::code_asm::*;

use super::{CodegenError, FRAME, SAVED};
use crate::ring::format::*;
use crate::sdt::{
    ArgSpec, Displacement, MemOperand, Operand, RegFamily, RegWidth, Register, Through,
};

/// Leaves argument `index`'s value in r11. Uses rsi, rdi, r11 only.
pub(super) fn emit_arg(
    a: &mut CodeAssembler,
    arg: &ArgSpec,
    index: usize,
    site_rip: u64,
    symbols: &dyn Fn(&str) -> Option<u64>,
) -> Result<(), CodegenError> {
    if !matches!(arg.size, 1 | 2 | 4 | 8) {
        return Err(CodegenError::BadSize {
            index,
            spec: arg.to_string(),
            size: arg.size,
        });
    }
    match &arg.operand {
        Operand::Immediate(v) => {
            a.mov(r11, extend_value(*v as u64, arg.size, arg.signed))?;
            return Ok(());
        }
        Operand::Register(reg) => {
            load_family(a, r11, reg.family(), site_rip)?;
            extract(a, r11, *reg)?;
        }
        Operand::Memory(m) | Operand::Through(Through { pointer: m, .. }) => {
            emit_address(a, m, index, arg, site_rip, symbols)?;
            if let Operand::Through(t) = &arg.operand {
                // The pointer, masked, then the field `offset` into what it points to.
                a.mov(rsi, qword_ptr(rsi))?;
                a.mov(r11, t.mask)?;
                a.and(rsi, r11)?;
                a.mov(r11, t.offset as u64)?;
                a.add(rsi, r11)?;
            }
            match arg.size {
                1 => a.movzx(r11d, byte_ptr(rsi))?,
                2 => a.movzx(r11d, word_ptr(rsi))?,
                4 => a.mov(r11d, dword_ptr(rsi))?,
                _ => a.mov(r11, qword_ptr(rsi))?,
            }
        }
    }
    extend(a, r11, arg.size, arg.signed)
}

/// Effective address of `m` into rsi, following `sdt::effective_address`.
fn emit_address(
    a: &mut CodeAssembler,
    m: &MemOperand,
    index: usize,
    arg: &ArgSpec,
    site_rip: u64,
    symbols: &dyn Fn(&str) -> Option<u64>,
) -> Result<(), CodegenError> {
    let displacement = match &m.displacement {
        Displacement::Absolute(d) => *d as u64,
        Displacement::Symbol { name, offset } => symbols(name)
            .ok_or_else(|| CodegenError::UnresolvedSymbol {
                index,
                spec: arg.to_string(),
                symbol: name.clone(),
            })?
            .wrapping_add(*offset as u64),
    };
    a.mov(rsi, displacement)?;
    let mut address_32 = false;
    if let Some(base) = m.base {
        if !m.base_is_ignored() {
            load_family(a, rdi, base.family(), site_rip)?;
            extract(a, rdi, base)?;
            a.add(rsi, rdi)?;
        }
        address_32 |= base.width() == RegWidth::Dword;
    }
    if let Some(reg) = m.index {
        if !matches!(m.scale, 1 | 2 | 4 | 8) {
            return Err(CodegenError::BadScale {
                index,
                spec: arg.to_string(),
                scale: m.scale,
            });
        }
        load_family(a, rdi, reg.family(), site_rip)?;
        extract(a, rdi, reg)?;
        a.lea(rsi, ptr(rsi + rdi * u32::from(m.scale)))?;
        address_32 |= reg.width() == RegWidth::Dword;
    }
    if address_32 {
        a.mov(esi, esi)?;
    }
    Ok(())
}

/// `dst` = the full 64-bit value `family` had at the site.
fn load_family(
    a: &mut CodeAssembler,
    dst: AsmRegister64,
    family: RegFamily,
    site_rip: u64,
) -> Result<(), CodegenError> {
    if let Some(pos) = SAVED.iter().position(|&f| f == family) {
        // Pushed in SAVED order: the last push is at [rsp].
        let offset = 8 * (SAVED.len() - 1 - pos) as i32;
        a.mov(dst, qword_ptr(rsp + offset))?;
    } else if family == RegFamily::Rsp {
        a.lea(dst, ptr(rsp + FRAME))?;
    } else if family == RegFamily::Rip {
        a.mov(dst, site_rip)?;
    } else {
        a.mov(dst, gpr(family))?;
    }
    Ok(())
}

/// Keeps only the part of the family `reg` names (zero-extended), as `Register::extract`.
fn extract(a: &mut CodeAssembler, dst: AsmRegister64, reg: Register) -> Result<(), CodegenError> {
    let bits = if reg.is_high_byte() {
        a.shr(dst, 8)?;
        8
    } else {
        u32::from(reg.width().bytes()) * 8
    };
    if bits < 64 {
        a.shl(dst, 64 - bits)?;
        a.shr(dst, 64 - bits)?;
    }
    Ok(())
}

/// Truncates `dst` to `size` bytes and sign- or zero-extends it.
fn extend(
    a: &mut CodeAssembler,
    dst: AsmRegister64,
    size: u8,
    signed: bool,
) -> Result<(), CodegenError> {
    let bits = u32::from(size) * 8;
    if bits < 64 {
        a.shl(dst, 64 - bits)?;
        if signed {
            a.sar(dst, 64 - bits)?;
        } else {
            a.shr(dst, 64 - bits)?;
        }
    }
    Ok(())
}

/// The same as [`extend`], at build time (for immediates).
fn extend_value(raw: u64, size: u8, signed: bool) -> u64 {
    let shift = 64 - u32::from(size.clamp(1, 8)) * 8;
    if shift == 0 {
        raw
    } else if signed {
        (((raw << shift) as i64) >> shift) as u64
    } else {
        (raw << shift) >> shift
    }
}

/// Copies at most `len - 1` bytes of the C string whose pointer is in
/// argument `index` into its area, NUL-terminates it, and sets the null or
/// truncated bit. Uses rax, rcx, rdx, rsi, rdi, r9, r11.
///
/// Eight bytes at a time once the source is 8-aligned: an aligned word that
/// holds a byte of the string lies in that byte's page, so it is as readable as
/// the byte-by-byte copy's reads (the bytes past the NUL it also reads are
/// copied into the area after the NUL, where the reader never looks).
pub(super) fn emit_string_copy(
    a: &mut CodeAssembler,
    index: usize,
    (offset, len): (usize, usize),
) -> Result<(), CodegenError> {
    let bit = 1u32 << index;
    let mut copy = a.create_label();
    let mut head = a.create_label();
    let mut words = a.create_label();
    let mut word = a.create_label();
    let mut tail = a.create_label();
    let mut byte = a.create_label();
    let mut full = a.create_label();
    let mut done = a.create_label();
    a.mov(rsi, qword_ptr(r8 + slot_arg(index)))?;
    a.lea(rdi, ptr(r8 + offset as i32))?;
    a.test(rsi, rsi)?;
    a.jnz(copy)?;
    a.or(byte_ptr(r8 + S_NULL as i32), bit)?;
    a.mov(byte_ptr(rdi), 0u32)?;
    a.jmp(done)?;
    a.set_label(&mut copy)?;
    // ecx: bytes that may still be copied (the area's last byte is for the NUL).
    a.mov(ecx, (len - 1) as u32)?;
    // Byte by byte up to the first aligned address.
    a.set_label(&mut head)?;
    a.test(esi, 7u32)?;
    a.jz(words)?;
    emit_copy_byte(a, done)?;
    a.jnz(head)?;
    a.jmp(full)?;
    a.set_label(&mut words)?;
    a.mov(r11, 0x0101_0101_0101_0101u64)?;
    a.mov(r9, 0x8080_8080_8080_8080u64)?;
    a.set_label(&mut word)?;
    a.cmp(ecx, 8u32)?;
    a.jb(tail)?;
    a.mov(rax, qword_ptr(rsi))?;
    // A zero byte in rax iff (rax - 0x01..01) & !rax & 0x80..80 is not 0;
    // `not` leaves the flags of `test` alone.
    a.mov(rdx, rax)?;
    a.sub(rdx, r11)?;
    a.and(rdx, r9)?;
    a.not(rax)?;
    a.test(rdx, rax)?;
    a.not(rax)?;
    // The whole word either way: with a NUL in it, the copy ends with that NUL
    // (ecx >= 8 leaves room for it).
    a.mov(qword_ptr(rdi), rax)?;
    a.jnz(done)?;
    a.add(rsi, 8)?;
    a.add(rdi, 8)?;
    a.sub(ecx, 8u32)?;
    a.jmp(word)?;
    // Fewer than eight bytes of room left: byte by byte.
    a.set_label(&mut tail)?;
    a.test(ecx, ecx)?;
    a.jz(full)?;
    a.set_label(&mut byte)?;
    emit_copy_byte(a, done)?;
    a.jnz(byte)?;
    // Area full: terminate, and flag truncation unless the string ended exactly here.
    a.set_label(&mut full)?;
    a.mov(byte_ptr(rdi), 0u32)?;
    a.cmp(byte_ptr(rsi), 0u32)?;
    a.je(done)?;
    a.or(byte_ptr(r8 + S_TRUNCATED as i32), bit)?;
    a.set_label(&mut done)?;
    // A label needs an instruction; this one costs nothing.
    a.nop()?;
    Ok(())
}

/// Copies the byte at rsi to rdi; at its NUL jumps to `done`, else steps both on
/// and counts it off ecx (the flags of that `dec` are left for the caller's loop).
fn emit_copy_byte(a: &mut CodeAssembler, done: CodeLabel) -> Result<(), CodegenError> {
    a.movzx(eax, byte_ptr(rsi))?;
    a.mov(byte_ptr(rdi), al)?;
    a.test(al, al)?;
    a.jz(done)?;
    a.inc(rsi)?;
    a.inc(rdi)?;
    a.dec(ecx)?;
    Ok(())
}

pub(super) fn slot_arg(index: usize) -> i32 {
    (S_ARGS + 8 * index) as i32
}

pub(super) fn gpr(family: RegFamily) -> AsmRegister64 {
    match family {
        RegFamily::Rax => rax,
        RegFamily::Rbx => rbx,
        RegFamily::Rcx => rcx,
        RegFamily::Rdx => rdx,
        RegFamily::Rsi => rsi,
        RegFamily::Rdi => rdi,
        RegFamily::Rbp => rbp,
        RegFamily::Rsp => rsp,
        RegFamily::R8 => r8,
        RegFamily::R9 => r9,
        RegFamily::R10 => r10,
        RegFamily::R11 => r11,
        RegFamily::R12 => r12,
        RegFamily::R13 => r13,
        RegFamily::R14 => r14,
        RegFamily::R15 => r15,
        // Never asked for: load_family handles rip before calling gpr.
        RegFamily::Rip => rax,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_extend_like_the_evaluator() {
        assert_eq!(extend_value(5, 1, true), 5);
        assert_eq!(extend_value(0x1ff, 1, false), 0xff);
        assert_eq!(extend_value(0x80, 1, true) as i64, -128);
        assert_eq!(extend_value(-5i64 as u64, 4, false), 0xffff_fffb);
        assert_eq!(extend_value(-5i64 as u64, 8, true) as i64, -5);
    }
}
