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

use crate::sdt::register::{RegFamily, RegWidth, Register};
use crate::sdt::spec::{ArgSpec, Displacement, MemOperand, Operand};

mod error;

pub use error::{ParseError, ParseErrorKind};

/// Parses a whole argument string (as found in a `.note.stapsdt` note) into
/// its arguments, in order. Empty or all-whitespace text gives no arguments.
///
/// ```
/// use pyprobe_sdt::sdt::parse_args;
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
mod tests;
