//! The decoded form of one SDT argument, and its canonical AT&T text.

use std::fmt;
use std::str::FromStr;

use super::parse::{parse_arg, ParseError};
use super::register::{RegFamily, RegSet, Register};

/// One probe argument: `[-]SIZE@OPERAND`.
///
/// `size` is the argument's width in bytes (1, 2, 4 or 8 from the parser);
/// `signed` is the leading `-`. A bare operand from an old note (no `SIZE@`)
/// parses as 8 bytes, unsigned.
///
/// `Display` prints the canonical AT&T form (`-4@-84(%rbp)`), which parses
/// back to an equal value; `FromStr` parses exactly one argument.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ArgSpec {
    pub size: u8,
    pub signed: bool,
    pub operand: Operand,
}

/// Where an argument's value comes from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    /// `%eax`: the low `size` bytes of a register.
    Register(Register),
    /// `$-5`, `$0x10`: a constant.
    Immediate(i64),
    /// `-84(%rbp)`, `8(%rax,%rbx,4)`, `_PyRuntime+16(%rip)`: `size` bytes of memory.
    Memory(MemOperand),
    /// Not from a note: `size` bytes at `offset` into what a pointer in memory
    /// points to; see [`Through`].
    Through(Through),
}

/// A field of a structure that a pointer in memory points to: `size` bytes at
/// `(8 bytes at pointer) & mask + offset`. pyprobe adds such arguments itself
/// (a frame's code object's first line) where the code at the site proves both
/// reads safe; a note cannot express them, so they print as
/// `4@48(*(%r13)&0xfffffffffffffffe)` and do not parse back.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Through {
    pub pointer: MemOperand,
    pub mask: u64,
    pub offset: i64,
}

/// An AT&T memory reference: `displacement(base, index, scale)`.
///
/// The effective address is `displacement + base + index * scale`, in
/// wrapping 64-bit arithmetic, except that with a [`Displacement::Symbol`] and
/// a `%rip` base the address is just the symbol's (plus its offset): that is
/// what the assembler meant by `sym(%rip)`. If a 32-bit register is used for
/// addressing (`(%eax)`), the address is truncated to 32 bits.
///
/// `scale` is 1, 2, 4 or 8, and 1 when there is no index.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MemOperand {
    pub(crate) displacement: Displacement,
    pub(crate) base: Option<Register>,
    pub index: Option<Register>,
    pub(crate) scale: u8,
}

/// The constant part of a memory reference.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Displacement {
    /// A number (`-84` in `-84(%rbp)`; 0 when absent).
    Absolute(i64),
    /// `name+offset`: the runtime address of a symbol, resolved at evaluation
    /// time, plus `offset`.
    Symbol { name: String, offset: i64 },
}

impl Operand {
    /// Whether evaluating this operand reads target memory.
    pub fn reads_memory(&self) -> bool {
        matches!(self, Operand::Memory(_) | Operand::Through(_))
    }

    /// The 64-bit registers evaluating this operand reads. `sym(%rip)` needs
    /// no register (its address comes from the symbol); `16(%rip)` needs `rip`.
    pub fn registers(&self) -> RegSet {
        match self {
            Operand::Register(r) => RegSet::EMPTY.with(r.family()),
            Operand::Immediate(_) => RegSet::EMPTY,
            Operand::Memory(m) => m.registers(),
            Operand::Through(t) => t.pointer.registers(),
        }
    }

    /// The symbol this operand refers to, if any (to resolve it ahead of time).
    pub fn symbol(&self) -> Option<&str> {
        match self {
            Operand::Memory(MemOperand {
                displacement: Displacement::Symbol { name, .. },
                ..
            })
            | Operand::Through(Through {
                pointer:
                    MemOperand {
                        displacement: Displacement::Symbol { name, .. },
                        ..
                    },
                ..
            }) => Some(name),
            _ => None,
        }
    }
}

impl MemOperand {
    /// The 64-bit registers that go into the effective address.
    pub fn registers(&self) -> RegSet {
        let mut set = RegSet::EMPTY;
        if let Some(base) = self.base {
            if !self.base_is_ignored() {
                set.insert(base.family());
            }
        }
        if let Some(index) = self.index {
            set.insert(index.family());
        }
        set
    }

    /// True for `sym(%rip)`: the symbol already is the address.
    pub(crate) fn base_is_ignored(&self) -> bool {
        matches!(self.displacement, Displacement::Symbol { .. })
            && self.base.map(Register::family) == Some(RegFamily::Rip)
    }
}

impl fmt::Display for ArgSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.signed { "-" } else { "" };
        write!(f, "{sign}{}@{}", self.size, self.operand)
    }
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operand::Register(r) => write!(f, "{r}"),
            Operand::Immediate(v) => write!(f, "${v}"),
            Operand::Memory(m) => write!(f, "{m}"),
            Operand::Through(t) => write!(f, "{}(*{}&{:#x})", t.offset, t.pointer, t.mask),
        }
    }
}

impl fmt::Display for MemOperand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parens = self.base.is_some() || self.index.is_some();
        match &self.displacement {
            Displacement::Absolute(0) if parens => {}
            Displacement::Absolute(d) => write!(f, "{d}")?,
            Displacement::Symbol { name, offset } => {
                write!(f, "{name}")?;
                if *offset > 0 {
                    write!(f, "+{offset}")?;
                } else if *offset < 0 {
                    write!(f, "-{}", offset.unsigned_abs())?;
                }
            }
        }
        if parens {
            f.write_str("(")?;
            if let Some(base) = self.base {
                write!(f, "{base}")?;
            }
            if let Some(index) = self.index {
                write!(f, ",{index},{}", self.scale)?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl FromStr for ArgSpec {
    type Err = ParseError;

    /// Parses exactly one argument; see [`parse_arg`].
    fn from_str(s: &str) -> Result<ArgSpec, ParseError> {
        parse_arg(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(name: &str) -> Register {
        Register::from_name(name).expect("test register")
    }

    fn mem(
        displacement: Displacement,
        base: Option<&str>,
        index: Option<&str>,
        scale: u8,
    ) -> Operand {
        Operand::Memory(MemOperand {
            displacement,
            base: base.map(reg),
            index: index.map(reg),
            scale,
        })
    }

    fn arg(size: u8, signed: bool, operand: Operand) -> String {
        ArgSpec {
            size,
            signed,
            operand,
        }
        .to_string()
    }

    #[test]
    fn display_registers_and_immediates() {
        assert_eq!(arg(8, false, Operand::Register(reg("rbp"))), "8@%rbp");
        assert_eq!(arg(4, true, Operand::Register(reg("eax"))), "-4@%eax");
        assert_eq!(arg(1, true, Operand::Immediate(5)), "-1@$5");
        assert_eq!(arg(8, true, Operand::Immediate(-16)), "-8@$-16");
        assert_eq!(
            arg(8, true, Operand::Immediate(i64::MIN)),
            "-8@$-9223372036854775808"
        );
    }

    #[test]
    fn display_memory_forms() {
        use Displacement::*;
        let cases = [
            (mem(Absolute(0), Some("rsp"), None, 1), "(%rsp)"),
            (mem(Absolute(112), Some("rsp"), None, 1), "112(%rsp)"),
            (
                mem(Absolute(-8), Some("rbp"), Some("rax"), 8),
                "-8(%rbp,%rax,8)",
            ),
            (mem(Absolute(0), None, Some("rax"), 4), "(,%rax,4)"),
            (
                mem(Absolute(0), Some("rax"), Some("rbx"), 1),
                "(%rax,%rbx,1)",
            ),
            (mem(Absolute(4096), None, None, 1), "4096"),
            (mem(Absolute(0), None, None, 1), "0"),
        ];
        for (operand, text) in cases {
            assert_eq!(operand.to_string(), text);
        }
    }

    #[test]
    fn display_symbols() {
        let sym = |offset| Displacement::Symbol {
            name: "_PyRuntime".into(),
            offset,
        };
        assert_eq!(
            mem(sym(16), Some("rip"), None, 1).to_string(),
            "_PyRuntime+16(%rip)"
        );
        assert_eq!(
            mem(sym(-16), Some("rip"), None, 1).to_string(),
            "_PyRuntime-16(%rip)"
        );
        assert_eq!(
            mem(sym(0), Some("rip"), None, 1).to_string(),
            "_PyRuntime(%rip)"
        );
        assert_eq!(mem(sym(0), None, None, 1).to_string(), "_PyRuntime");
        assert_eq!(
            mem(sym(i64::MIN), None, None, 1).to_string(),
            "_PyRuntime-9223372036854775808"
        );
    }

    #[test]
    fn registers_and_memory_use() {
        use RegFamily::*;
        let r = Operand::Register(reg("ah"));
        assert!(!r.reads_memory());
        assert_eq!(r.registers().iter().collect::<Vec<_>>(), [Rax]);

        let imm = Operand::Immediate(3);
        assert!(!imm.reads_memory() && imm.registers().is_empty());

        let sib = mem(Displacement::Absolute(-8), Some("rbp"), Some("r12d"), 8);
        assert!(sib.reads_memory());
        assert_eq!(sib.registers().iter().collect::<Vec<_>>(), [Rbp, R12]);

        let rip_num = mem(Displacement::Absolute(16), Some("rip"), None, 1);
        assert_eq!(rip_num.registers().iter().collect::<Vec<_>>(), [Rip]);
        assert_eq!(rip_num.symbol(), None);

        let sym = Displacement::Symbol {
            name: "foo".into(),
            offset: 0,
        };
        let rip_sym = mem(sym.clone(), Some("rip"), None, 1);
        assert!(rip_sym.reads_memory() && rip_sym.registers().is_empty());
        assert_eq!(rip_sym.symbol(), Some("foo"));

        let sym_base = mem(sym, Some("rax"), None, 1);
        assert_eq!(sym_base.registers().iter().collect::<Vec<_>>(), [Rax]);
    }
}
