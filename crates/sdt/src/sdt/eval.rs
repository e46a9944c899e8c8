//! Evaluating a parsed argument against a stopped thread's registers and memory.

use std::io;

use super::register::{RegFamily, RegWidth};
use super::spec::{ArgSpec, Displacement, MemOperand, Operand};

/// The registers of a stopped thread.
///
/// `read` returns the full 64-bit value of a register; the evaluator picks the
/// part an operand names. For [`RegFamily::Rip`] return the address that
/// `%rip`-relative operands are relative to: the address of the instruction
/// after the probe's `nop` (which is also `rip` after the `int3` replacing it
/// traps). `sym(%rip)` operands never read `rip`.
///
/// Any `Fn(RegFamily) -> u64` closure is a register file.
pub trait RegisterFile {
    fn read(&self, family: RegFamily) -> u64;
}

impl<F: Fn(RegFamily) -> u64> RegisterFile for F {
    fn read(&self, family: RegFamily) -> u64 {
        self(family)
    }
}

/// The target's memory.
pub trait MemoryReader {
    /// Fills all of `buf` from target address `address`, or fails.
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()>;
}

/// Why an argument could not be evaluated.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The resolver knew no address for a symbol the argument refers to.
    #[error(
        "cannot resolve symbol `{symbol}` used by an SDT argument: \
         it is not in the target's symbol tables (the binary may be stripped)"
    )]
    UnresolvedSymbol { symbol: String },
    /// Reading the argument's bytes from target memory failed.
    #[error("cannot read {len} bytes of target memory at {address:#x} for an SDT argument")]
    MemoryRead {
        address: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    /// The spec's size is not 1, 2, 4 or 8 (only possible for a hand-built [`ArgSpec`]).
    #[error("invalid SDT argument size {0} (must be 1, 2, 4 or 8)")]
    InvalidSize(u8),
}

/// Computes an argument's value.
///
/// Register operands take the low `size` bytes of the named register,
/// immediates the low `size` bytes of the constant, and memory operands read
/// exactly `size` bytes (little-endian) at the effective address. The result
/// is then sign-extended to 64 bits if `arg.signed`, zero-extended otherwise,
/// and returned as raw bits: use `value as i64` for signed arguments.
///
/// `symbols` maps a symbol name to its runtime address (load bias applied).
///
/// ```
/// use pyprobe_sdt::sdt::{evaluate, parse_args, RegFamily};
/// # struct NoMemory;
/// # impl pyprobe_sdt::sdt::MemoryReader for NoMemory {
/// #     fn read_exact(&self, _: u64, _: &mut [u8]) -> std::io::Result<()> {
/// #         Err(std::io::ErrorKind::Unsupported.into())
/// #     }
/// # }
/// let args = parse_args("-4@%eax").unwrap();
/// let regs = |f: RegFamily| if f == RegFamily::Rax { 0xffff_fffe } else { 0 };
/// let value = evaluate(&args[0], &regs, &NoMemory, &|_| None).unwrap();
/// assert_eq!(value as i64, -2);
/// ```
pub fn evaluate<R, M>(
    arg: &ArgSpec,
    regs: &R,
    mem: &M,
    symbols: &dyn Fn(&str) -> Option<u64>,
) -> Result<u64, EvalError>
where
    R: RegisterFile + ?Sized,
    M: MemoryReader + ?Sized,
{
    let len = match arg.size {
        1 | 2 | 4 | 8 => usize::from(arg.size),
        other => return Err(EvalError::InvalidSize(other)),
    };
    let raw = match &arg.operand {
        Operand::Register(r) => r.extract(regs.read(r.family())),
        Operand::Immediate(v) => *v as u64,
        Operand::Memory(m) => read_le(mem, effective_address(m, regs, symbols)?, len)?,
        Operand::Through(t) => {
            let pointer = read_le(mem, effective_address(&t.pointer, regs, symbols)?, 8)?;
            read_le(mem, (pointer & t.mask).wrapping_add(t.offset as u64), len)?
        }
    };
    Ok(extend(raw, len, arg.signed))
}

/// `len` (1 to 8) bytes at `address`, little-endian.
fn read_le<M: MemoryReader + ?Sized>(mem: &M, address: u64, len: usize) -> Result<u64, EvalError> {
    let mut bytes = [0u8; 8];
    let buf = bytes
        .get_mut(..len)
        .ok_or(EvalError::InvalidSize(len as u8))?;
    mem.read_exact(address, buf)
        .map_err(|source| EvalError::MemoryRead {
            address,
            len,
            source,
        })?;
    Ok(u64::from_le_bytes(bytes))
}

/// The address a memory operand refers to (see [`MemOperand`] for the rules).
pub fn effective_address<R>(
    m: &MemOperand,
    regs: &R,
    symbols: &dyn Fn(&str) -> Option<u64>,
) -> Result<u64, EvalError>
where
    R: RegisterFile + ?Sized,
{
    let mut address = match &m.displacement {
        Displacement::Absolute(d) => *d as u64,
        Displacement::Symbol { name, offset } => symbols(name)
            .ok_or_else(|| EvalError::UnresolvedSymbol {
                symbol: name.clone(),
            })?
            .wrapping_add(*offset as u64),
    };
    let mut address_32 = false;
    if let Some(base) = m.base {
        if !m.base_is_ignored() {
            address = address.wrapping_add(base.extract(regs.read(base.family())));
        }
        address_32 |= base.width() == RegWidth::Dword;
    }
    if let Some(index) = m.index {
        let scaled = index
            .extract(regs.read(index.family()))
            .wrapping_mul(u64::from(m.scale));
        address = address.wrapping_add(scaled);
        address_32 |= index.width() == RegWidth::Dword;
    }
    if address_32 {
        address &= 0xffff_ffff;
    }
    Ok(address)
}

/// Truncates `raw` to `len` bytes (1..=8), then sign- or zero-extends it.
fn extend(raw: u64, len: usize, signed: bool) -> u64 {
    let shift = 64u32.saturating_sub((len as u32).saturating_mul(8));
    if shift == 0 || shift >= 64 {
        return raw;
    }
    if signed {
        (((raw << shift) as i64) >> shift) as u64
    } else {
        (raw << shift) >> shift
    }
}

#[cfg(test)]
mod tests {
    use super::super::fakes::{FakeMemory, FakeRegs};
    use super::super::parse::parse_arg;
    use super::*;

    const PY_RUNTIME: u64 = 0x5555_5555_9000;

    fn resolver(name: &str) -> Option<u64> {
        (name == "_PyRuntime").then_some(PY_RUNTIME)
    }

    fn eval_with(text: &str, regs: &FakeRegs, mem: &FakeMemory) -> Result<u64, EvalError> {
        let arg = parse_arg(text).expect("valid spec");
        evaluate(&arg, regs, mem, &resolver)
    }

    fn eval(text: &str) -> u64 {
        eval_with(text, &FakeRegs::sample(), &FakeMemory::sample()).expect("evaluates")
    }

    #[test]
    fn register_widths() {
        // rax = 0x1122_3344_5566_7788 (see FakeRegs::sample)
        assert_eq!(eval("8@%rax"), 0x1122_3344_5566_7788);
        assert_eq!(eval("4@%eax"), 0x5566_7788);
        assert_eq!(eval("2@%ax"), 0x7788);
        assert_eq!(eval("1@%al"), 0x88);
        assert_eq!(eval("1@%ah"), 0x77);
        assert_eq!(eval("-1@%al"), 0xffff_ffff_ffff_ff88);
        assert_eq!(eval("1@%bh"), 0x66);
        assert_eq!(eval("1@%ch"), 0x55);
        assert_eq!(eval("1@%dh"), 0x44);
        // r8 = 0x8182_8384_8586_8788
        assert_eq!(eval("8@%r8"), 0x8182_8384_8586_8788);
        assert_eq!(eval("4@%r8d"), 0x8586_8788);
        assert_eq!(eval("2@%r8w"), 0x8788);
        assert_eq!(eval("1@%r8b"), 0x88);
        assert_eq!(eval("-4@%r8d") as i64, 0x8586_8788_u32 as i32 as i64);
        // rsi = 0x0102_0304_0506_07f0, rdi = 0x0a0b_0c0d_0e0f_1011
        assert_eq!(eval("1@%sil"), 0xf0);
        assert_eq!(eval("-1@%sil") as i64, -16);
        assert_eq!(eval("1@%dil"), 0x11);
        assert_eq!(eval("4@%esi"), 0x0506_07f0);
        assert_eq!(eval("2@%di"), 0x1011);
        assert_eq!(eval("8@%r15"), FakeRegs::sample().read(RegFamily::R15));
        assert_eq!(eval("8@%rip"), FakeRegs::sample().read(RegFamily::Rip));
    }

    #[test]
    fn every_register_reads_its_own_family() {
        let regs = FakeRegs::sample();
        for r in super::super::Register::all() {
            let text = format!("8@{r}");
            let got = eval_with(&text, &regs, &FakeMemory::sample()).expect("evaluates");
            assert_eq!(got, r.extract(regs.read(r.family())), "{text}");
        }
    }

    #[test]
    fn size_narrower_than_register_truncates() {
        assert_eq!(eval("1@%rax"), 0x88);
        assert_eq!(eval("-2@%rax"), 0x7788);
        assert_eq!(eval("4@%rax"), 0x5566_7788);
        // A size wider than the register zero-extends the register.
        assert_eq!(eval("8@%eax"), 0x5566_7788);
        assert_eq!(eval("-8@%al"), 0x88);
    }

    #[test]
    fn sign_extension_of_minus_one() {
        let regs = FakeRegs::with(RegFamily::Rbx, u64::MAX);
        let mem = FakeMemory::sample();
        for (text, want) in [
            ("-1@%rbx", -1i64 as u64),
            ("-2@%rbx", -1i64 as u64),
            ("-4@%rbx", -1i64 as u64),
            ("-8@%rbx", -1i64 as u64),
            ("1@%rbx", 0xff),
            ("2@%rbx", 0xffff),
            ("4@%rbx", 0xffff_ffff),
            ("8@%rbx", u64::MAX),
            ("-1@%bl", -1i64 as u64),
            ("-2@%bx", -1i64 as u64),
            ("-4@%ebx", -1i64 as u64),
        ] {
            assert_eq!(
                eval_with(text, &regs, &mem).expect("evaluates"),
                want,
                "{text}"
            );
        }
    }

    #[test]
    fn positive_signed_values_stay_positive() {
        let regs = FakeRegs::with(RegFamily::Rbx, 0x7f7f_7f7f_7f7f_7f7f);
        let mem = FakeMemory::sample();
        for (text, want) in [
            ("-1@%rbx", 0x7f),
            ("-2@%rbx", 0x7f7f),
            ("-4@%rbx", 0x7f7f_7f7f),
            ("-8@%rbx", 0x7f7f_7f7f_7f7f_7f7f),
        ] {
            assert_eq!(
                eval_with(text, &regs, &mem).expect("evaluates"),
                want,
                "{text}"
            );
        }
    }

    #[test]
    fn immediates() {
        assert_eq!(eval("-1@$5"), 5);
        assert_eq!(eval("-4@$-5") as i64, -5);
        assert_eq!(eval("4@$-5"), 0xffff_fffb);
        assert_eq!(eval("8@$0x10"), 16);
        assert_eq!(eval("-8@$-0x10") as i64, -16);
        assert_eq!(eval("1@$0x1ff"), 0xff);
        assert_eq!(eval("-1@$0x80") as i64, -128);
    }

    #[test]
    fn memory_reads_exactly_size_bytes() {
        // FakeMemory::sample: bytes 0x10..=0x4f at 0x7000..0x7040
        assert_eq!(eval("1@28672"), 0x10);
        assert_eq!(eval("8@0x7000"), 0x1716_1514_1312_1110);
        // rsp = 0x7000
        assert_eq!(eval("4@(%rsp)"), 0x1312_1110);
        assert_eq!(eval("2@(%rsp)"), 0x1110);
        assert_eq!(eval("-4@8(%rsp)"), 0x1b1a_1918);
        // The last byte of the region can be read with size 1 but not 2.
        assert_eq!(eval("1@63(%rsp)"), 0x4f);
        let err = eval_with("2@63(%rsp)", &FakeRegs::sample(), &FakeMemory::sample())
            .expect_err("past the end");
        assert!(matches!(
            err,
            EvalError::MemoryRead {
                address: 0x703f,
                len: 2,
                ..
            }
        ));
        assert!(err.to_string().contains("0x703f"));
    }

    #[test]
    fn memory_sign_extension() {
        let mem = FakeMemory::at(0x1000, &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        let regs = FakeRegs::with(RegFamily::Rbp, 0x1000);
        for (text, want) in [
            ("-1@(%rbp)", -2i64),
            ("-2@(%rbp)", -2),
            ("-4@(%rbp)", -2),
            ("-8@(%rbp)", -2),
            ("1@(%rbp)", 0xfe),
            ("2@(%rbp)", 0xfffe),
            ("4@(%rbp)", 0xffff_fffe),
        ] {
            let got = eval_with(text, &regs, &mem).expect("evaluates");
            assert_eq!(got as i64, want, "{text}");
        }
        assert_eq!(
            eval_with("8@(%rbp)", &regs, &mem).expect("evaluates"),
            u64::MAX - 1
        );
    }

    #[test]
    fn sib_with_negative_offsets() {
        // rbp = 0x7040, rax = index 3: -40(%rbp,%rax,8) = 0x7040 - 40 + 24 = 0x7030
        let mut regs = FakeRegs::sample();
        regs.set(RegFamily::Rbp, 0x7040);
        regs.set(RegFamily::Rax, 3);
        let mem = FakeMemory::sample();
        assert_eq!(
            eval_with("1@-40(%rbp,%rax,8)", &regs, &mem).expect("ok"),
            0x40
        );
        assert_eq!(
            eval_with("1@-0x28(%rbp,%rax,8)", &regs, &mem).expect("ok"),
            0x40
        );
        // Negative index register value.
        regs.set(RegFamily::Rax, (-2i64) as u64);
        assert_eq!(
            eval_with("1@-8(%rbp,%rax,4)", &regs, &mem).expect("ok"),
            0x40
        );
        // (,%idx,scale) and (%base,%idx)
        regs.set(RegFamily::Rcx, 0x1c04);
        assert_eq!(eval_with("1@(,%rcx,4)", &regs, &mem).expect("ok"), 0x20);
        regs.set(RegFamily::Rdx, 0x7001);
        regs.set(RegFamily::Rsi, 2);
        assert_eq!(eval_with("1@(%rdx,%rsi)", &regs, &mem).expect("ok"), 0x13);
    }

    #[test]
    fn effective_address_wraps() {
        let regs = FakeRegs::with(RegFamily::Rax, u64::MAX);
        let m = |text: &str| match parse_arg(text).expect("valid").operand {
            Operand::Memory(m) => m,
            other => panic!("{other:?}"),
        };
        let ea = |text: &str| effective_address(&m(text), &regs, &resolver).expect("ok");
        assert_eq!(ea("8@1(%rax)"), 0);
        assert_eq!(ea("8@(%rax,%rax,8)"), u64::MAX.wrapping_mul(9));
        assert_eq!(ea("8@-1(,%rax,2)"), u64::MAX - 2);
        assert_eq!(ea("8@_PyRuntime-0xffffffffffffffff"), PY_RUNTIME + 1);
        // 32-bit addressing truncates.
        assert_eq!(ea("8@16(%eax)"), 15);
        assert_eq!(ea("8@(%eax,%eax,2)"), 0xffff_fffd);
    }

    #[test]
    fn rip_relative_symbols() {
        // _PyRuntime+16 holds 0x3a
        let mem = FakeMemory::at(PY_RUNTIME, &(0u8..64).map(|b| b + 0x20).collect::<Vec<_>>());
        let regs = FakeRegs::sample();
        assert_eq!(
            eval_with("1@_PyRuntime+16(%rip)", &regs, &mem).expect("ok"),
            0x30
        );
        assert_eq!(
            eval_with("1@_PyRuntime(%rip)", &regs, &mem).expect("ok"),
            0x20
        );
        assert_eq!(
            eval_with("2@_PyRuntime+0x3e(%rip)", &regs, &mem).expect("ok"),
            0x5f5e
        );
        let below = eval_with("1@_PyRuntime-1(%rip)", &regs, &mem).expect_err("below region");
        assert!(
            matches!(below, EvalError::MemoryRead { address, .. } if address == PY_RUNTIME - 1)
        );
        // A symbol without %rip is absolute, plus any base register.
        let mut regs = FakeRegs::sample();
        regs.set(RegFamily::Rax, 4);
        assert_eq!(
            eval_with("1@_PyRuntime(,%rax,2)", &regs, &mem).expect("ok"),
            0x28
        );
        assert_eq!(eval_with("1@_PyRuntime+1", &regs, &mem).expect("ok"), 0x21);
    }

    #[test]
    fn rip_relative_number_uses_rip() {
        let regs = FakeRegs::with(RegFamily::Rip, 0x7000);
        assert_eq!(
            eval_with("1@16(%rip)", &regs, &FakeMemory::sample()).expect("ok"),
            0x20
        );
    }

    #[test]
    fn unresolved_symbol_names_it() {
        let err = eval_with("4@foo(%rip)", &FakeRegs::sample(), &FakeMemory::sample())
            .expect_err("unresolved");
        assert!(matches!(&err, EvalError::UnresolvedSymbol { symbol } if symbol == "foo"));
        let msg = err.to_string();
        assert!(msg.contains("`foo`") && msg.contains("stripped"), "{msg}");
    }

    #[test]
    fn invalid_hand_built_size() {
        let arg = ArgSpec {
            size: 3,
            signed: false,
            operand: Operand::Immediate(1),
        };
        let err = evaluate(&arg, &FakeRegs::sample(), &FakeMemory::sample(), &resolver);
        assert!(matches!(err, Err(EvalError::InvalidSize(3))));
    }

    #[test]
    fn memory_error_keeps_its_source() {
        use std::error::Error;
        let err = eval_with("8@(%rax)", &FakeRegs::sample(), &FakeMemory::sample())
            .expect_err("unmapped");
        let source = err.source().expect("has a source");
        assert!(source.to_string().contains("unmapped"));
    }

    #[test]
    fn closures_are_register_files() {
        let arg = parse_arg("-2@%r9w").expect("valid");
        let regs = |f: RegFamily| if f == RegFamily::R9 { 0xfffe } else { 0 };
        let value = evaluate(&arg, &regs, &FakeMemory::sample(), &resolver).expect("ok");
        assert_eq!(value as i64, -2);
    }

    #[test]
    fn extend_edge_cases() {
        assert_eq!(extend(0x80, 1, true), 0xffff_ffff_ffff_ff80);
        assert_eq!(extend(0x180, 1, false), 0x80);
        assert_eq!(extend(0x8000_0000, 4, true), 0xffff_ffff_8000_0000);
        assert_eq!(extend(u64::MAX, 8, false), u64::MAX);
        // Out-of-range lengths never panic.
        assert_eq!(extend(7, 0, true), 7);
        assert_eq!(extend(7, 100, true), 7);
        assert_eq!(extend(7, usize::MAX, false), 7);
    }
}
