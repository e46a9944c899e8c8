//! What a parse error says: the spec, the byte position and what went wrong.

use std::fmt;

use crate::sdt::register::Register;

/// Why a spec did not parse, and where.
///
/// `Display` names the whole spec, the byte position and what went wrong:
/// `invalid SDT argument spec "8@%foo" at byte 2: unknown register %foo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// The whole text given to the parser.
    pub(crate) spec: String,
    /// Byte offset into `spec` where the problem starts.
    pub position: usize,
    /// What went wrong.
    pub(crate) kind: ParseErrorKind,
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
