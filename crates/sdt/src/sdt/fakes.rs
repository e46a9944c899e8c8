//! Test doubles: a register file and a target memory.

use std::io;

use super::eval::{MemoryReader, RegisterFile};
use super::register::RegFamily;

/// An array-backed register file.
#[derive(Clone, Debug, Default)]
pub(crate) struct FakeRegs([u64; 17]);

impl FakeRegs {
    /// Distinct, recognisable values in every register.
    pub(crate) fn sample() -> FakeRegs {
        let mut regs = FakeRegs::default();
        regs.set(RegFamily::Rax, 0x1122_3344_5566_7788);
        regs.set(RegFamily::Rbx, 0x2122_2324_2526_6627);
        regs.set(RegFamily::Rcx, 0x3132_3334_3536_5537);
        regs.set(RegFamily::Rdx, 0x4142_4344_4546_4447);
        regs.set(RegFamily::Rsi, 0x0102_0304_0506_07f0);
        regs.set(RegFamily::Rdi, 0x0a0b_0c0d_0e0f_1011);
        regs.set(RegFamily::Rbp, 0x7040);
        regs.set(RegFamily::Rsp, 0x7000);
        for (n, family) in RegFamily::ALL.into_iter().enumerate().skip(8).take(8) {
            // r8 = 0x8182_8384_8586_8788, r9 = 0x9192_..., ...
            let hi = 0x80 + 0x10 * (n as u64 - 8);
            let value = (1..=8).fold(0u64, |v, b| (v << 8) | (hi + b));
            regs.set(family, value);
        }
        regs.set(RegFamily::Rip, 0x5555_5555_1234);
        regs
    }

    /// All zero but `family`.
    pub(crate) fn with(family: RegFamily, value: u64) -> FakeRegs {
        let mut regs = FakeRegs::default();
        regs.set(family, value);
        regs
    }

    pub fn set(&mut self, family: RegFamily, value: u64) {
        if let Some(slot) = self.0.get_mut(family.index()) {
            *slot = value;
        }
    }
}

impl RegisterFile for FakeRegs {
    fn read(&self, family: RegFamily) -> u64 {
        self.0.get(family.index()).copied().unwrap_or(0)
    }
}

/// One mapped region; everything else is unmapped.
#[derive(Clone, Debug)]
pub(crate) struct FakeMemory {
    start: u64,
    bytes: Vec<u8>,
}

impl FakeMemory {
    pub fn at(start: u64, bytes: &[u8]) -> FakeMemory {
        FakeMemory {
            start,
            bytes: bytes.to_vec(),
        }
    }

    /// Bytes 0x10..=0x4f at 0x7000..0x7040.
    pub(crate) fn sample() -> FakeMemory {
        FakeMemory::at(0x7000, &(0x10u8..=0x4f).collect::<Vec<_>>())
    }
}

impl MemoryReader for FakeMemory {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
        let unmapped = || io::Error::new(io::ErrorKind::InvalidInput, "unmapped address");
        let offset = address.checked_sub(self.start).ok_or_else(unmapped)?;
        let offset = usize::try_from(offset).map_err(|_| unmapped())?;
        let end = offset.checked_add(buf.len()).ok_or_else(unmapped)?;
        let src = self.bytes.get(offset..end).ok_or_else(unmapped)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}
