//! Text from the target as a terminal may show it: function and file names,
//! command lines and thread names are the target's to choose, and a control
//! character in them could set the terminal's title, clear the screen or forge
//! a line of pyprobe's output. They are shown escaped, as `ps` and `git` do:
//! `\x1b`, `\n`, `\u{202e}`.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` must not reach a terminal as it is: control characters (C0,
/// DEL, C1) and the bidirectional overrides and isolates, which reorder what
/// follows them on screen.
fn is_unsafe(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every character a terminal would act on escaped.
pub fn escaped(s: &str) -> Cow<'_, str> {
    escape(s, false)
}

/// A line of source as a terminal may show it: as [`escaped`], but its tabs
/// (indentation) kept.
pub(crate) fn escaped_source_line(s: &str) -> Cow<'_, str> {
    escape(s, true)
}

fn escape(s: &str, keep_tabs: bool) -> Cow<'_, str> {
    let unsafe_here = |c: char| is_unsafe(c) && !(keep_tabs && c == '\t');
    if !s.chars().any(unsafe_here) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\t' if keep_tabs => out.push(c),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_unsafe(c) && u32::from(c) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if is_unsafe(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// As [`escaped`], owned.
pub(crate) fn escaped_string(s: &str) -> String {
    escaped(s).into_owned()
}

#[cfg(test)]
mod tests {
    use super::escaped;

    #[test]
    fn plain_text_is_left_alone() {
        for s in ["Circle.area", "/app/é/ü.py", "<module>", "a\\b"] {
            assert!(matches!(escaped(s), std::borrow::Cow::Borrowed(_)), "{s}");
        }
    }

    #[test]
    fn what_a_terminal_would_act_on_is_escaped() {
        assert_eq!(escaped("\x1b]0;owned\x07x"), "\\x1b]0;owned\\x07x");
        assert_eq!(escaped("a\nb\rc\td"), "a\\nb\\rc\\td");
        assert_eq!(escaped("\u{9b}2J"), "\\x9b2J");
        assert_eq!(escaped("x\u{202e}yz"), "x\\u{202e}yz");
        assert_eq!(escaped("\x7f"), "\\x7f");
        assert_eq!(super::escaped_source_line("\tx = '\x1b'"), "\tx = '\\x1b'");
    }
}
