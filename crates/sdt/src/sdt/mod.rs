//! SystemTap SDT argument specs (x86-64): parsing and evaluation.
//!
//! Each probe in a `.note.stapsdt` note carries a string describing where its
//! arguments are at the probe site, in AT&T syntax, separated by whitespace:
//! `8@%rbp -4@%eax -4@112(%rsp) 8@-8(%rbp,%rax,8) -1@$5 8@_PyRuntime+16(%rip)`.
//! Each argument is `[-]SIZE@OPERAND`: SIZE bytes (1, 2, 4 or 8), signed if
//! the `-` is there.
//!
//! * [`parse_args`] turns the string into [`ArgSpec`]s; errors
//!   ([`ParseError`]) name the spec, the byte position and what was expected.
//! * [`evaluate`] computes one argument's value at a probe hit from a
//!   [`RegisterFile`], a [`MemoryReader`] and a symbol resolver.
//! * [`Operand::registers`] and [`Operand::reads_memory`] say what an
//!   evaluation will need, so a tracer can fetch only that.
//! * `Display` on [`ArgSpec`] prints the canonical form, which parses back to
//!   the same value.
//!
//! The module is pure: no system calls, no I/O, no panics on any input, and
//! address arithmetic wraps.

mod eval;
mod parse;
mod register;
mod spec;

#[cfg(test)]
mod fakes;
#[cfg(test)]
mod tests;

pub use eval::{effective_address, evaluate, EvalError, MemoryReader, RegisterFile};
pub use parse::{parse_arg, parse_args, ParseError, ParseErrorKind};
pub use register::{RegFamily, RegSet, RegWidth, Register};
pub use spec::{ArgSpec, Displacement, MemOperand, Operand, Through};
