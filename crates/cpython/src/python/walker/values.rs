//! A Python object shown as text from target memory alone, never running any of its
//! code: `int`, `bool`, `float`, `str`, `bytes` and `None` by value (bounded), the
//! containers by type and length, anything else by type and address. Every read is
//! bounded and every failure shown in the text, never raised.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::layout::{Layout, LocalsLayout};
use super::objects::{plausible_pointer, read_bytes_prefix, read_u64};
use pyprobe_sdt::process::memory::read_c_string;
use pyprobe_sdt::sdt::MemoryReader;

/// Most characters of a `str` shown (its length is said when cut).
pub(crate) const MAX_SHOWN_CHARS: usize = 80;
/// Most bytes of a `bytes` shown.
const MAX_SHOWN_BYTES: usize = 48;
/// Longest type name read.
const MAX_TYPE_NAME: usize = 96;
/// Most digits (30 bits each) of an int shown exactly: 120 bits.
const MAX_EXACT_DIGITS: u64 = 4;

// `tp_flags` bits that say a type is (a subclass of) a built-in.
const LONG_SUBCLASS: u64 = 1 << 24;
const LIST_SUBCLASS: u64 = 1 << 25;
const TUPLE_SUBCLASS: u64 = 1 << 26;
const BYTES_SUBCLASS: u64 = 1 << 27;
const UNICODE_SUBCLASS: u64 = 1 << 28;
const DICT_SUBCLASS: u64 = 1 << 29;

/// A type: its `tp_name` and `tp_flags`.
#[derive(Debug, Clone)]
struct TypeInfo {
    name: String,
    flags: u64,
}

/// Reads objects of one process for display; type names are read once per type.
pub(crate) struct ValueReader<'a, M: ?Sized> {
    mem: &'a M,
    layout: &'a Layout,
    locals: LocalsLayout,
    types: HashMap<u64, Option<TypeInfo>>,
}

impl<'a, M: MemoryReader + ?Sized> ValueReader<'a, M> {
    pub(crate) fn new(mem: &'a M, layout: &'a Layout, locals: LocalsLayout) -> Self {
        ValueReader {
            mem,
            layout,
            locals,
            types: HashMap::new(),
        }
    }

    /// Where an object's own fields begin.
    fn head(&self) -> u64 {
        self.locals.object_head
    }

    /// The type of the object at `addr`.
    fn type_of(&mut self, addr: u64) -> Option<TypeInfo> {
        let ty = read_u64(self.mem, addr + self.layout.ob_type).ok()?;
        if !plausible_pointer(ty) {
            return None;
        }
        if let Some(known) = self.types.get(&ty) {
            return known.clone();
        }
        // PyTypeObject: its variable-size head, `tp_name`, then 18 more words to
        // `tp_flags` (the same from 3.7 to 3.15).
        let tp_name = ty + self.head() + 8;
        let info = (|| {
            let name_at = read_u64(self.mem, tp_name).ok()?;
            let flags = read_u64(self.mem, tp_name + 18 * 8).ok()?;
            // A C string: any alignment, in user space.
            if name_at == 0 || name_at >= 1 << 47 {
                return None;
            }
            let name = read_c_string(self.mem, name_at, MAX_TYPE_NAME).ok()?;
            Some(TypeInfo { name, flags })
        })();
        self.types.insert(ty, info.clone());
        info
    }

    /// The name of the type of the object at `addr`.
    pub(crate) fn type_name(&mut self, addr: u64) -> Option<String> {
        if !plausible_pointer(addr) {
            return None;
        }
        self.type_of(addr).map(|t| t.name)
    }

    /// Whether the object at `addr` is a cell (which a cell or free variable's slot
    /// holds once the frame has made it).
    pub(crate) fn is_cell(&mut self, addr: u64) -> bool {
        plausible_pointer(addr) && self.type_of(addr).is_some_and(|t| t.name == "cell")
    }

    /// What a cell holds (0 when empty).
    pub(crate) fn cell_contents(&self, cell: u64) -> Option<u64> {
        read_u64(self.mem, cell + self.head()).ok()
    }

    /// The object at `addr` as text, as `repr` would show the simple built-ins.
    pub(crate) fn show(&mut self, addr: u64) -> String {
        if !plausible_pointer(addr) {
            return format!("<not an object: {addr:#x}>");
        }
        let Some(ty) = self.type_of(addr) else {
            return format!("<unreadable object at {addr:#x}>");
        };
        let shown = match ty.name.as_str() {
            "NoneType" => Some("None".to_string()),
            "bool" if ty.flags & LONG_SUBCLASS != 0 => self
                .int_value(addr)
                .map(|v| if v == "0" { "False" } else { "True" }.to_string()),
            "float" => read_u64(self.mem, addr + self.head())
                .ok()
                .map(|bits| python_float(f64::from_bits(bits))),
            _ if ty.flags & LONG_SUBCLASS != 0 => self.int_value(addr),
            _ if ty.flags & UNICODE_SUBCLASS != 0 => self.str_value(addr),
            _ if ty.flags & BYTES_SUBCLASS != 0 => self.bytes_value(addr),
            "set" | "frozenset" => self
                .length(addr, self.head() + 8)
                .map(|n| container(&ty.name, n)),
            _ if ty.flags & (TUPLE_SUBCLASS | LIST_SUBCLASS | DICT_SUBCLASS) != 0 => {
                // A tuple's and a list's `ob_size`, a dict's `ma_used`: first field.
                self.length(addr, self.head())
                    .map(|n| container(&ty.name, n))
            }
            _ => return format!("<{} object at {addr:#x}>", ty.name),
        };
        let Some(value) = shown else {
            return format!("<{} object at {addr:#x}, unreadable>", ty.name);
        };
        // A subclass of a built-in says which: `Color(3)`, `MyStr('a')`.
        let builtin = [
            "NoneType",
            "bool",
            "float",
            "int",
            "str",
            "bytes",
            "set",
            "frozenset",
            "tuple",
            "list",
            "dict",
        ];
        if builtin.contains(&ty.name.as_str()) || value.starts_with('<') {
            value
        } else {
            format!("{}({value})", ty.name)
        }
    }

    /// A container's length from the signed word at `offset`.
    fn length(&self, addr: u64, offset: u64) -> Option<u64> {
        let n = read_u64(self.mem, addr + offset).ok()? as i64;
        u64::try_from(n).ok()
    }

    /// An int's decimal value (exact up to 120 bits, else its size).
    fn int_value(&self, addr: u64) -> Option<String> {
        let word = read_u64(self.mem, addr + self.head()).ok()?;
        let (negative, digits) = if self.locals.long_tagged {
            // 3.12+: `lv_tag` is the digit count shifted by 3, and the sign below.
            match word & 3 {
                1 => return Some("0".into()),
                sign => (sign == 2, word >> 3),
            }
        } else {
            // Up to 3.11: `ob_size` is the digit count, negative for a negative int.
            let size = word as i64;
            (size < 0, size.unsigned_abs())
        };
        if digits == 0 {
            return Some("0".into());
        }
        if digits > MAX_EXACT_DIGITS {
            // 30 bits a digit: log10(2^30) ≈ 9.03 decimal digits.
            let decimal = (digits as f64 * 9.03).round() as u64;
            return Some(format!("<int of about {decimal} digits>"));
        }
        let mut buf = [0u8; 4 * MAX_EXACT_DIGITS as usize];
        let buf = &mut buf[..4 * digits as usize];
        self.mem.read_exact(addr + self.head() + 8, buf).ok()?;
        let mut value: u128 = 0;
        for chunk in buf.chunks_exact(4).rev() {
            let digit = u32::from_le_bytes(chunk.try_into().ok()?) & ((1 << 30) - 1);
            value = (value << 30) | u128::from(digit);
        }
        Some(if negative {
            format!("-{value}")
        } else {
            value.to_string()
        })
    }

    /// A str's repr, cut to [`MAX_SHOWN_CHARS`] characters.
    fn str_value(&self, addr: u64) -> Option<String> {
        let u = &self.layout.unicode;
        let length = read_u64(self.mem, addr + u.length).ok()? as i64;
        let text = super::objects::read_str(self.mem, u, addr).ok()?;
        let shown: String = text.chars().take(MAX_SHOWN_CHARS).collect();
        let mut out = python_str_repr(&shown);
        if length > MAX_SHOWN_CHARS as i64 {
            out.insert_str(out.len() - 1, "...");
            let _ = write!(out, " ({length} characters)");
        }
        Some(out)
    }

    /// A bytes object's repr, cut to [`MAX_SHOWN_BYTES`] bytes.
    fn bytes_value(&self, addr: u64) -> Option<String> {
        let (size, data) = read_bytes_prefix(self.mem, self.layout, addr, MAX_SHOWN_BYTES).ok()?;
        // As Python: double quotes for bytes with a single quote and no double one.
        let quote = if data.contains(&b'\'') && !data.contains(&b'"') {
            b'"'
        } else {
            b'\''
        };
        let mut out = format!("b{}", char::from(quote));
        for &b in &data {
            match b {
                b'\\' => out.push_str("\\\\"),
                b if b == quote => {
                    out.push('\\');
                    out.push(char::from(b));
                }
                b'\n' => out.push_str("\\n"),
                b'\r' => out.push_str("\\r"),
                b'\t' => out.push_str("\\t"),
                0x20..=0x7e => out.push(char::from(b)),
                _ => {
                    let _ = write!(out, "\\x{b:02x}");
                }
            }
        }
        if size > MAX_SHOWN_BYTES as u64 {
            let _ = write!(out, "...{} ({size} bytes)", char::from(quote));
        } else {
            out.push(char::from(quote));
        }
        Some(out)
    }
}

/// `<list of 3 items>`.
fn container(name: &str, n: u64) -> String {
    format!("<{name} of {n} item{}>", if n == 1 { "" } else { "s" })
}

/// A str as Python's `repr` shows it: single quotes (double when the text has a
/// single quote and no double one), control characters escaped.
pub(crate) fn python_str_repr(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (0x80..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// A float as Python's `repr` shows it: the shortest digits that read back the
/// same, in positional notation for exponents from -4 to 15, else as `1e+16`.
pub(crate) fn python_float(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-5".
    let sci = format!("{v:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{int}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let mantissa = if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first}.{rest}")
        };
        let esign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{esign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_as_python_writes_them() {
        for (v, shown) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (100.0, "100.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.25e-5, "1.25e-05"),
            (0.0001, "0.0001"),
            (-2.5e300, "-2.5e+300"),
            (std::f64::consts::PI, "3.141592653589793"),
            (f64::INFINITY, "inf"),
            (f64::NAN, "nan"),
        ] {
            assert_eq!(python_float(v), shown, "{v:e}");
        }
    }

    #[test]
    fn strings_read_as_python_writes_them() {
        assert_eq!(python_str_repr("plain"), "'plain'");
        assert_eq!(python_str_repr("it's"), "\"it's\"");
        assert_eq!(python_str_repr("both ' and \""), "'both \\' and \"'");
        assert_eq!(python_str_repr("a\nb\t\x1b[2J"), "'a\\nb\\t\\x1b[2J'");
        assert_eq!(python_str_repr("héllo ☃"), "'héllo ☃'");
    }
}
