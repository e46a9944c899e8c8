//! Parser for SDT argument strings.
//!
//! Grammar (arguments are separated by ASCII whitespace):
//!
//! ```text
//! arg      := [ '-' ] SIZE '@' operand | operand          SIZE in 1, 2, 4, 8
//! operand  := '%' REG | '$' number | memory
//! memory   := disp [ '(' addr ')' ] | '(' addr ')'
//! addr     := '%' REG [ ',' index ] | ',' index
//! index    := '%' REG [ ',' SCALE ]                        SCALE in 1, 2, 4, 8
//! disp     := number | SYMBOL [ ('+' | '-') unsigned ]
//! number   := [ '-' ] unsigned
//! unsigned := DECIMAL | '0x' HEX                           at most 64 bits
//! SYMBOL   := [A-Za-z_.] [A-Za-z0-9_.$]*
//! ```
//!
//! A bare operand (no `SIZE@`, from older notes) means 8 bytes, unsigned.
//! Numbers that do not fit in `i64` but fit in `u64` wrap (`$0xffffffffffffffff`
//! is -1). Base and index registers must be 64-bit, or both 32-bit; `%rsp` and
//! `%rip` cannot be an index, and `%rip` takes no index.

use std::fmt;

use super::register::{RegFamily, RegWidth, Register};
use super::spec::{ArgSpec, Displacement, MemOperand, Operand};

/// Why a spec did not parse, and where.
///
/// `Display` names the whole spec, the byte position and what went wrong:
/// `invalid SDT argument spec "8@%foo" at byte 2: unknown register %foo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// The whole text given to the parser.
    pub spec: String,
    /// Byte offset into `spec` where the problem starts.
    pub position: usize,
    /// What went wrong.
    pub kind: ParseErrorKind,
}

/// What went wrong in a [`ParseError`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseErrorKind {
    /// Something else was required here; `found` is `None` at the end of the text.
    Expected {
        expected: &'static str,
        found: Option<char>,
    },
    /// A `SIZE@` other than 1, 2, 4 or 8 (the digits as written).
    BadSize(String),
    /// A `%name` that is no x86-64 register (the name without `%`).
    UnknownRegister(String),
    /// An index scale other than 1, 2, 4 or 8 (the digits as written).
    BadScale(String),
    /// A number that does not fit in 64 bits.
    NumberTooLarge,
    /// A register that cannot be used where it is (`%rsp` as an index, `(%al)`).
    BadAddressRegister {
        register: Register,
        reason: &'static str,
    },
}

impl fmt::Display for ParseErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseErrorKind::Expected { expected, found } => {
                write!(f, "expected {expected}, found ")?;
                match found {
                    Some(c) => write!(f, "{c:?}"),
                    None => f.write_str("end of text"),
                }
            }
            ParseErrorKind::BadSize(s) => {
                write!(f, "argument size must be 1, 2, 4 or 8, found {s}")
            }
            ParseErrorKind::UnknownRegister(name) => write!(f, "unknown register %{name}"),
            ParseErrorKind::BadScale(s) => write!(f, "index scale must be 1, 2, 4 or 8, found {s}"),
            ParseErrorKind::NumberTooLarge => f.write_str("number does not fit in 64 bits"),
            ParseErrorKind::BadAddressRegister { register, reason } => {
                write!(f, "{register} {reason}")
            }
        }
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid SDT argument spec {:?} at byte {}: {}",
            self.spec, self.position, self.kind
        )
    }
}

impl std::error::Error for ParseError {}

/// Parses a whole argument string (as found in a `.note.stapsdt` note) into
/// its arguments, in order. Empty or all-whitespace text gives no arguments.
///
/// ```
/// use pyprobe::sdt::parse_args;
/// let args = parse_args("8@%rbp -4@112(%rsp)").unwrap();
/// assert_eq!(args.len(), 2);
/// assert_eq!(args[1].to_string(), "-4@112(%rsp)");
/// ```
pub fn parse_args(text: &str) -> Result<Vec<ArgSpec>, ParseError> {
    let mut parser = Parser::new(text);
    let mut args = Vec::new();
    loop {
        parser.skip_whitespace();
        if parser.at_end() {
            return Ok(args);
        }
        args.push(parser.arg()?);
        parser.end_of_arg()?;
    }
}

/// Parses exactly one argument; surrounding whitespace is allowed.
pub fn parse_arg(text: &str) -> Result<ArgSpec, ParseError> {
    let mut parser = Parser::new(text);
    parser.skip_whitespace();
    let arg = parser.arg()?;
    parser.skip_whitespace();
    if parser.at_end() {
        Ok(arg)
    } else {
        Err(parser.expected("end of argument"))
    }
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

fn is_symbol_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b == b'.'
}

fn is_symbol_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'$'
}

impl<'a> Parser<'a> {
    fn new(text: &'a str) -> Parser<'a> {
        Parser { text, pos: 0 }
    }

    fn byte_at(&self, pos: usize) -> Option<u8> {
        self.text.as_bytes().get(pos).copied()
    }

    fn peek(&self) -> Option<u8> {
        self.byte_at(self.pos)
    }

    fn at_end(&self) -> bool {
        self.pos >= self.text.len()
    }

    fn eat(&mut self, b: u8) -> bool {
        if self.peek() == Some(b) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Advances over bytes matching `pred` and returns them. Only ASCII bytes
    /// are ever matched, so the slice is on character boundaries.
    fn take_while(&mut self, pred: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(&pred) {
            self.pos += 1;
        }
        self.text.get(start..self.pos).unwrap_or("")
    }

    fn skip_whitespace(&mut self) {
        self.take_while(|b| b.is_ascii_whitespace());
    }

    fn error_at(&self, position: usize, kind: ParseErrorKind) -> ParseError {
        ParseError {
            spec: self.text.to_owned(),
            position,
            kind,
        }
    }

    fn expected(&self, expected: &'static str) -> ParseError {
        let found = self.text.get(self.pos..).and_then(|s| s.chars().next());
        self.error_at(self.pos, ParseErrorKind::Expected { expected, found })
    }

    fn end_of_arg(&self) -> Result<(), ParseError> {
        match self.peek() {
            None => Ok(()),
            Some(b) if b.is_ascii_whitespace() => Ok(()),
            Some(_) => Err(self.expected("whitespace or end of spec after argument")),
        }
    }

    fn arg(&mut self) -> Result<ArgSpec, ParseError> {
        // Look ahead for `[-]DIGITS@`; anything else is a bare operand.
        let start = self.pos;
        let digits_start = if self.byte_at(start) == Some(b'-') {
            start + 1
        } else {
            start
        };
        let mut digits_end = digits_start;
        while self.byte_at(digits_end).is_some_and(|b| b.is_ascii_digit()) {
            digits_end += 1;
        }
        if digits_end > digits_start && self.byte_at(digits_end) == Some(b'@') {
            let digits = self.text.get(digits_start..digits_end).unwrap_or("");
            let size = match digits.parse::<u64>() {
                Ok(n @ (1 | 2 | 4 | 8)) => n as u8,
                _ => {
                    return Err(
                        self.error_at(digits_start, ParseErrorKind::BadSize(digits.to_owned()))
                    )
                }
            };
            self.pos = digits_end + 1;
            let operand = self.operand()?;
            Ok(ArgSpec {
                size,
                signed: digits_start > start,
                operand,
            })
        } else {
            let operand = self.operand()?;
            Ok(ArgSpec {
                size: 8,
                signed: false,
                operand,
            })
        }
    }

    fn operand(&mut self) -> Result<Operand, ParseError> {
        match self.peek() {
            Some(b'%') => Ok(Operand::Register(self.register()?)),
            Some(b'$') => {
                self.pos += 1;
                Ok(Operand::Immediate(self.number()?))
            }
            Some(b) if b == b'(' || b == b'-' || b.is_ascii_digit() || is_symbol_start(b) => {
                Ok(Operand::Memory(self.memory()?))
            }
            _ => Err(self.expected("an operand (%register, $immediate or memory reference)")),
        }
    }

    fn register(&mut self) -> Result<Register, ParseError> {
        let start = self.pos;
        if !self.eat(b'%') {
            return Err(self.expected("a register (%name)"));
        }
        let name = self.take_while(|b| b.is_ascii_alphanumeric());
        if name.is_empty() {
            return Err(self.expected("a register name after '%'"));
        }
        Register::from_name(name)
            .ok_or_else(|| self.error_at(start, ParseErrorKind::UnknownRegister(name.to_owned())))
    }

    /// `[-]unsigned`, wrapped into `i64`.
    fn number(&mut self) -> Result<i64, ParseError> {
        let negative = self.eat(b'-');
        let magnitude = self.unsigned()?;
        let bits = if negative {
            magnitude.wrapping_neg()
        } else {
            magnitude
        };
        Ok(bits as i64)
    }

    /// Decimal or `0x` hexadecimal, at most `u64::MAX`.
    fn unsigned(&mut self) -> Result<u64, ParseError> {
        let start = self.pos;
        let is_hex =
            self.peek() == Some(b'0') && matches!(self.byte_at(start + 1), Some(b'x' | b'X'));
        let (digits, radix) = if is_hex {
            self.pos += 2;
            (self.take_while(|b| b.is_ascii_hexdigit()), 16)
        } else {
            (self.take_while(|b| b.is_ascii_digit()), 10)
        };
        if digits.is_empty() {
            return Err(self.expected(if is_hex {
                "a hexadecimal digit"
            } else {
                "a number"
            }));
        }
        u64::from_str_radix(digits, radix)
            .map_err(|_| self.error_at(start, ParseErrorKind::NumberTooLarge))
    }

    fn memory(&mut self) -> Result<MemOperand, ParseError> {
        let displacement = match self.peek() {
            Some(b'(') => Displacement::Absolute(0),
            Some(b) if is_symbol_start(b) => {
                let name = self.take_while(is_symbol_char).to_owned();
                let offset = if self.eat(b'+') {
                    self.unsigned()? as i64
                } else if self.eat(b'-') {
                    self.unsigned()?.wrapping_neg() as i64
                } else {
                    0
                };
                Displacement::Symbol { name, offset }
            }
            _ => Displacement::Absolute(self.number()?),
        };
        let mut operand = MemOperand {
            displacement,
            base: None,
            index: None,
            scale: 1,
        };
        if self.eat(b'(') {
            self.address(&mut operand)?;
        }
        Ok(operand)
    }

    /// The inside of `( ... )`, and the closing parenthesis.
    fn address(&mut self, operand: &mut MemOperand) -> Result<(), ParseError> {
        let base_pos = self.pos;
        match self.peek() {
            Some(b'%') => operand.base = Some(self.register()?),
            Some(b',') => {}
            _ => return Err(self.expected("a base register or ','")),
        }
        let mut index_pos = self.pos;
        if self.eat(b',') {
            index_pos = self.pos;
            operand.index = Some(self.register()?);
            if self.eat(b',') {
                let scale_pos = self.pos;
                let digits = self.take_while(|b| b.is_ascii_digit());
                operand.scale = match digits.parse::<u64>() {
                    Ok(n @ (1 | 2 | 4 | 8)) => n as u8,
                    _ if digits.is_empty() => return Err(self.expected("a scale (1, 2, 4 or 8)")),
                    _ => {
                        return Err(
                            self.error_at(scale_pos, ParseErrorKind::BadScale(digits.to_owned()))
                        )
                    }
                };
            }
        }
        if !self.eat(b')') {
            let what = if operand.index.is_some() {
                "')' or ',' and a scale"
            } else {
                "')' or ',' and an index register"
            };
            return Err(self.expected(what));
        }
        self.check_address_registers(operand, base_pos, index_pos)
    }

    fn check_address_registers(
        &self,
        operand: &MemOperand,
        base_pos: usize,
        index_pos: usize,
    ) -> Result<(), ParseError> {
        let bad = |position, register, reason| {
            self.error_at(
                position,
                ParseErrorKind::BadAddressRegister { register, reason },
            )
        };
        let addressing = |r: Register| matches!(r.width(), RegWidth::Qword | RegWidth::Dword);
        if let Some(base) = operand.base {
            if !addressing(base) {
                return Err(bad(
                    base_pos,
                    base,
                    "cannot address memory (use a 64-bit or 32-bit register)",
                ));
            }
        }
        if let Some(index) = operand.index {
            if !addressing(index) {
                return Err(bad(
                    index_pos,
                    index,
                    "cannot address memory (use a 64-bit or 32-bit register)",
                ));
            }
            if matches!(index.family(), RegFamily::Rsp | RegFamily::Rip) {
                return Err(bad(index_pos, index, "cannot be an index register"));
            }
            if let Some(base) = operand.base {
                if base.family() == RegFamily::Rip {
                    return Err(bad(
                        index_pos,
                        index,
                        "cannot be used with %rip-relative addressing",
                    ));
                }
                if base.width() != index.width() {
                    return Err(bad(
                        index_pos,
                        index,
                        "must have the same width as the base register",
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(name: &str) -> Register {
        Register::from_name(name).expect("test register")
    }

    fn one(text: &str) -> ArgSpec {
        match parse_args(text) {
            Ok(mut args) if args.len() == 1 => args.remove(0),
            other => panic!("{text:?} gave {other:?}"),
        }
    }

    fn memory(text: &str) -> MemOperand {
        match one(text).operand {
            Operand::Memory(m) => m,
            other => panic!("{text:?} gave {other:?}"),
        }
    }

    fn err(text: &str) -> ParseError {
        match parse_args(text) {
            Err(e) => e,
            Ok(args) => panic!("{text:?} parsed as {args:?}"),
        }
    }

    /// Checks the error's position and that the message names spec, position and `needle`.
    fn check_err(text: &str, position: usize, needle: &str) -> ParseError {
        let e = err(text);
        let msg = e.to_string();
        assert_eq!(e.position, position, "{msg}");
        assert!(msg.contains(&format!("at byte {position}")), "{msg}");
        assert!(msg.contains(&format!("{text:?}")), "{msg}");
        assert!(msg.contains(needle), "{msg} lacks {needle:?}");
        e
    }

    #[test]
    fn empty_text_has_no_args() {
        assert_eq!(parse_args(""), Ok(vec![]));
        assert_eq!(parse_args(" \t\n "), Ok(vec![]));
    }

    #[test]
    fn sizes_and_signs() {
        for (text, size, signed) in [
            ("1@%al", 1, false),
            ("-1@%al", 1, true),
            ("2@%ax", 2, false),
            ("-2@%ax", 2, true),
            ("4@%eax", 4, false),
            ("-4@%eax", 4, true),
            ("8@%rax", 8, false),
            ("-8@%rax", 8, true),
        ] {
            let a = one(text);
            assert_eq!((a.size, a.signed), (size, signed), "{text}");
        }
    }

    #[test]
    fn register_operands() {
        for name in [
            "rax", "eax", "ax", "al", "ah", "r8d", "r8w", "r8b", "sil", "dil", "rip",
        ] {
            let a = one(&format!("8@%{name}"));
            assert_eq!(a.operand, Operand::Register(reg(name)));
        }
    }

    #[test]
    fn bare_operand_is_8_unsigned() {
        let a = one("%rax");
        assert_eq!((a.size, a.signed), (8, false));
        assert_eq!(a.operand, Operand::Register(reg("rax")));
        let m = memory("-8(%rbp)");
        assert_eq!(m.displacement, Displacement::Absolute(-8));
        assert_eq!(one("-8(%rbp)").size, 8);
        assert_eq!(one("$5").operand, Operand::Immediate(5));
    }

    #[test]
    fn immediates() {
        for (text, value) in [
            ("-1@$5", 5),
            ("8@$-5", -5),
            ("8@$0x10", 16),
            ("8@$0X1f", 31),
            ("8@$-0x10", -16),
            ("8@$0", 0),
            ("8@$0xffffffffffffffff", -1),
            ("8@$-9223372036854775808", i64::MIN),
            ("8@$18446744073709551615", -1),
        ] {
            assert_eq!(one(text).operand, Operand::Immediate(value), "{text}");
        }
    }

    #[test]
    fn memory_forms() {
        let m = memory("8@(%rax)");
        assert_eq!(
            m,
            MemOperand {
                displacement: Displacement::Absolute(0),
                base: Some(reg("rax")),
                index: None,
                scale: 1
            }
        );
        let m = memory("-4@112(%rsp)");
        assert_eq!(
            (m.displacement, m.base),
            (Displacement::Absolute(112), Some(reg("rsp")))
        );
        let m = memory("8@0x70(%rsp)");
        assert_eq!(m.displacement, Displacement::Absolute(0x70));
        let m = memory("8@-0x10(%rbp)");
        assert_eq!(m.displacement, Displacement::Absolute(-16));
        let m = memory("8@-8(%rbp,%rax,8)");
        assert_eq!(
            m,
            MemOperand {
                displacement: Displacement::Absolute(-8),
                base: Some(reg("rbp")),
                index: Some(reg("rax")),
                scale: 8
            }
        );
        let m = memory("4@(,%rcx,4)");
        assert_eq!((m.base, m.index, m.scale), (None, Some(reg("rcx")), 4));
        let m = memory("4@16(,%r9,2)");
        assert_eq!(
            (m.displacement, m.base, m.index, m.scale),
            (Displacement::Absolute(16), None, Some(reg("r9")), 2)
        );
        let m = memory("2@(%rdi,%rsi)");
        assert_eq!(
            (m.base, m.index, m.scale),
            (Some(reg("rdi")), Some(reg("rsi")), 1)
        );
        let m = memory("1@(%rdi,%rsi,1)");
        assert_eq!(m.scale, 1);
        let m = memory("4@(%eax,%ebx,2)");
        assert_eq!((m.base, m.index), (Some(reg("eax")), Some(reg("ebx"))));
        let m = memory("8@16(%rip)");
        assert_eq!(
            (m.displacement, m.base),
            (Displacement::Absolute(16), Some(reg("rip")))
        );
        let m = memory("8@4096");
        assert_eq!(
            (m.displacement, m.base, m.index),
            (Displacement::Absolute(4096), None, None)
        );
    }

    #[test]
    fn symbols() {
        let sym = |name: &str, offset| Displacement::Symbol {
            name: name.into(),
            offset,
        };
        let m = memory("8@_PyRuntime+16(%rip)");
        assert_eq!(
            (m.displacement, m.base),
            (sym("_PyRuntime", 16), Some(reg("rip")))
        );
        assert_eq!(memory("4@foo(%rip)").displacement, sym("foo", 0));
        assert_eq!(memory("4@foo-8(%rip)").displacement, sym("foo", -8));
        assert_eq!(memory("4@foo+0x20(%rip)").displacement, sym("foo", 32));
        assert_eq!(
            memory("4@.L.str$1.2(%rip)").displacement,
            sym(".L.str$1.2", 0)
        );
        assert_eq!(memory("4@a1_b(%rax)").base, Some(reg("rax")));
        let m = memory("8@table(,%rax,8)");
        assert_eq!(
            (m.displacement, m.index, m.scale),
            (sym("table", 0), Some(reg("rax")), 8)
        );
        let m = memory("8@counter");
        assert_eq!((m.displacement, m.base), (sym("counter", 0), None));
    }

    #[test]
    fn whitespace_separation() {
        let args = parse_args("  8@%rbp\t-4@%eax\n\n-4@112(%rsp)  ").expect("parses");
        assert_eq!(args.len(), 3);
        let args = parse_args(
            "8@%rbp -4@%eax -4@112(%rsp) 8@-8(%rbp,%rax,8) -1@$5 8@_PyRuntime+16(%rip) 4@foo(%rip)",
        )
        .expect("parses");
        assert_eq!(args.len(), 7);
    }

    #[test]
    fn uppercase_registers() {
        assert_eq!(one("8@%RAX").operand, Operand::Register(reg("rax")));
    }

    #[test]
    fn parse_arg_takes_exactly_one() {
        assert_eq!(parse_arg(" 8@%rax ").map(|a| a.size), Ok(8));
        let e = parse_arg("8@%rax 8@%rbx").expect_err("two args");
        assert_eq!(e.position, 7);
        assert!(e.to_string().contains("end of argument"));
        assert!(parse_arg("").is_err());
    }

    #[test]
    fn error_unknown_register() {
        let e = check_err("8@%rbp 8@%foo", 9, "unknown register %foo");
        assert_eq!(e.kind, ParseErrorKind::UnknownRegister("foo".into()));
        check_err("8@%eip", 2, "unknown register %eip");
        check_err("8@%r16", 2, "unknown register %r16");
        check_err("8@(%rxx)", 3, "unknown register %rxx");
        check_err("8@%", 3, "register name");
        check_err("8@%-", 3, "register name");
    }

    #[test]
    fn error_bad_size() {
        let e = check_err("3@%rax", 0, "size must be 1, 2, 4 or 8, found 3");
        assert_eq!(e.kind, ParseErrorKind::BadSize("3".into()));
        check_err("8@%rax -16@%rbx", 8, "found 16");
        check_err("0@%rax", 0, "found 0");
        check_err("99999999999999999999999@%rax", 0, "size must be");
    }

    #[test]
    fn error_missing_operand() {
        check_err("8@", 2, "expected an operand");
        check_err("8@ 8@%rax", 2, "expected an operand");
        check_err("-4@@%eax", 3, "expected an operand");
        check_err("@%rax", 0, "expected an operand");
        check_err("8@!", 2, "found '!'");
    }

    #[test]
    fn error_missing_at() {
        // `8%rax`: the 8 reads as an absolute address, then '%' is unexpected.
        check_err("8%rax", 1, "found '%'");
        check_err("-4%eax", 2, "found '%'");
    }

    #[test]
    fn error_unterminated_parens() {
        check_err("8@-8(%rbp", 9, "expected ')'");
        check_err("8@-8(%rbp,%rax", 14, "expected ')'");
        check_err("8@-8(%rbp,%rax,8", 16, "expected ')'");
        check_err("8@-8(%rbp %rax", 9, "expected ')'");
        check_err("8@(", 3, "base register");
        check_err("8@()", 3, "base register");
        check_err("8@(%rax,)", 8, "expected a register");
        check_err("8@(%rax,%rbx,)", 13, "expected a scale");
    }

    #[test]
    fn error_bad_scale() {
        let e = check_err("8@(%rax,%rbx,3)", 13, "scale must be 1, 2, 4 or 8, found 3");
        assert_eq!(e.kind, ParseErrorKind::BadScale("3".into()));
        check_err("8@(%rax,%rbx,16)", 13, "found 16");
        check_err("8@(%rax,%rbx,0)", 13, "found 0");
        check_err("8@(%rax,%rbx,x)", 13, "expected a scale");
    }

    #[test]
    fn error_trailing_garbage() {
        check_err("8@%rax,", 6, "whitespace or end");
        check_err("8@%raxx", 2, "unknown register %raxx");
        check_err("8@-8(%rbp)x", 10, "whitespace or end");
        check_err("8@$5x", 4, "whitespace or end");
        check_err("8@12abc(%rax)", 4, "whitespace or end");
        check_err("8@(%rax))", 8, "found ')'");
    }

    #[test]
    fn error_bad_numbers() {
        check_err("8@$", 3, "expected a number");
        check_err("8@$-", 4, "expected a number");
        check_err("8@$0x", 5, "hexadecimal digit");
        check_err("8@$0xg", 5, "hexadecimal digit");
        check_err("8@$18446744073709551616", 3, "does not fit in 64 bits");
        check_err("8@$0x10000000000000000", 3, "does not fit in 64 bits");
        check_err("8@foo+(%rip)", 6, "expected a number");
        check_err("8@foo+-4(%rip)", 6, "expected a number");
    }

    #[test]
    fn error_bad_address_registers() {
        check_err("8@(%al)", 3, "%al cannot address memory");
        check_err("8@(%rax,%ax)", 8, "%ax cannot address memory");
        check_err("8@(%rax,%rsp,2)", 8, "%rsp cannot be an index register");
        check_err("8@(,%rip)", 4, "%rip cannot be an index register");
        check_err("8@16(%rip,%rax,2)", 10, "%rip-relative");
        check_err("8@(%rax,%ebx,2)", 8, "same width");
        check_err("8@(%eax,%rbx,2)", 8, "same width");
    }

    #[test]
    fn error_non_ascii_is_reported_not_panicked() {
        let e = check_err("8@%r\u{e9}x", 2, "unknown register %r");
        assert!(matches!(e.kind, ParseErrorKind::UnknownRegister(_)));
        check_err("8@\u{1F600}", 2, "found '\u{1F600}'");
        check_err("\u{e9}", 0, "expected an operand");
    }
}
