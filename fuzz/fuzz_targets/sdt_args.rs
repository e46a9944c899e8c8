//! The SDT argument-spec parser and evaluator on arbitrary text: never a panic;
//! every parsed argument prints in canonical form that parses back to itself, and
//! evaluates against fake registers and memory without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pyprobe_sdt::sdt::{evaluate, parse_arg, parse_args, MemoryReader, RegFamily};

/// 256 bytes of memory at 0x7000 (filled from the input); everything else unmapped.
struct Memory<'a>(&'a [u8]);

impl MemoryReader for Memory<'_> {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let unmapped = || std::io::Error::from(std::io::ErrorKind::InvalidInput);
        let start = address.checked_sub(0x7000).ok_or_else(unmapped)?;
        let start = usize::try_from(start).map_err(|_| unmapped())?;
        let end = start.checked_add(buf.len()).ok_or_else(unmapped)?;
        buf.copy_from_slice(self.0.get(start..end).ok_or_else(unmapped)?);
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    // The first bytes (if any) give register values; the rest is the spec text.
    let split = data.len().min(17);
    let (seed, text) = data.split_at(split);
    let text = String::from_utf8_lossy(text);
    let regs = |f: RegFamily| {
        let b = seed.get(f.index()).copied().unwrap_or(0) as u64;
        // Small values hit the mapped page; large ones exercise wrapping.
        if b & 0x80 == 0 {
            0x7000 + b
        } else {
            b.wrapping_mul(0x0101_0101_0101_0101)
        }
    };
    let mut memory = [0u8; 256];
    for (i, b) in data.iter().enumerate().take(256) {
        memory[i] = *b;
    }
    let mem = Memory(&memory);
    let symbols = |name: &str| (name.len() % 3 != 0).then_some(0x7000 + name.len() as u64);

    let Ok(args) = parse_args(&text) else { return };
    for arg in &args {
        let canonical = arg.to_string();
        let again = parse_arg(&canonical).unwrap_or_else(|e| {
            panic!("canonical form {canonical:?} of {text:?} does not parse: {e}")
        });
        assert_eq!(
            &again, arg,
            "{canonical:?} parses back to the same argument"
        );
        let _ = arg.operand.registers();
        let _ = arg.operand.reads_memory();
        let _ = evaluate(arg, &regs, &mem, &symbols);
    }
});
