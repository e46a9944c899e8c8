//! Qualified names read from source: what `co_qualname` says on 3.11+
//! (`Class.method`, `outer.<locals>.inner`), found for older interpreters from
//! the function's own source file.
//!
//! The scan knows just enough of Python's tokens to find where each logical line
//! starts and how far it is indented: strings (triple-quoted ones span lines),
//! comments, brackets and backslash continuations. The scopes around a function
//! are then the `def` and `class` lines above it that are less indented. A file
//! is untrusted text (it may have changed since the code was compiled): a name
//! is given only when the line holds a `def` of that very name.

/// Longest source file scanned, in bytes; a longer file gives no names.
pub const MAX_SOURCE_BYTES: usize = 16 << 20;

/// What a logical line begins with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Head {
    Def(String),
    Class(String),
    Decorator,
    /// Any other statement.
    Other,
    /// Empty, or only a comment: it says nothing of the nesting.
    Blank,
}

/// One physical line.
#[derive(Debug, Clone)]
struct Line {
    /// It starts a logical line (not inside brackets, a string or after `\`).
    starts: bool,
    /// Columns of indentation (a tab to the next multiple of 8), when it starts.
    indent: u32,
    head: Head,
    /// Lambdas and comprehensions (`for` inside brackets) it holds.
    expression_scopes: u32,
}

/// The scopes of one source file.
#[derive(Debug)]
pub struct SourceScopes {
    /// `lines[0]` is line 1.
    lines: Vec<Line>,
}

/// Tokenizer state carried from one physical line to the next.
#[derive(Default)]
struct Carry {
    depth: u32,
    /// Inside a string: its quote and whether it is triple-quoted.
    string: Option<(u8, bool)>,
    continued: bool,
}

impl SourceScopes {
    pub fn parse(text: &str) -> SourceScopes {
        let mut carry = Carry::default();
        let lines = text
            .split('\n')
            .map(|raw| {
                let raw = raw.strip_suffix('\r').unwrap_or(raw);
                let starts = carry.depth == 0 && carry.string.is_none() && !carry.continued;
                let (indent, head) = if starts {
                    head_of(raw)
                } else {
                    (0, Head::Other)
                };
                let expression_scopes = scan_line(raw.as_bytes(), &mut carry);
                Line {
                    starts,
                    indent,
                    head,
                    expression_scopes,
                }
            })
            .collect();
        SourceScopes { lines }
    }

    /// The qualified name of the function `name` whose code starts at (or, for a
    /// generator resumed, runs) `line`, and the line of its first decorator or
    /// `def`; `None` when the source does not show that function there, or the
    /// name would be the bare name (`<module>`).
    pub fn qualname(&self, name: &str, line: u32) -> Option<(String, u32)> {
        if name.is_empty() || name == "<module>" {
            return None;
        }
        let at = self.logical_start(line.checked_sub(1)? as usize)?;
        let (def_at, scopes_below) = if name.starts_with('<') {
            // A lambda or comprehension: named inside whatever encloses its line,
            // when it is the line's only one (else it may be inside another).
            if self.expression_scopes(at) != 1 {
                return None;
            }
            (at, self.lines[at].indent)
        } else {
            let def_at = self.def_at(name, at)?;
            (def_at, self.lines[def_at].indent)
        };
        let mut parts: Vec<String> = Vec::new();
        let mut threshold = scopes_below;
        for i in (0..def_at).rev() {
            if threshold == 0 {
                break;
            }
            let l = &self.lines[i];
            if !l.starts || l.head == Head::Blank || l.indent >= threshold {
                continue;
            }
            threshold = l.indent;
            match &l.head {
                Head::Def(n) => parts.push(format!("{n}.<locals>")),
                Head::Class(n) => parts.push(n.clone()),
                _ => {}
            }
        }
        parts.reverse();
        parts.push(name.to_owned());
        let qualname = parts.join(".");
        let first = self.first_decorator(def_at) as u32 + 1;
        (qualname != name).then_some((qualname, first))
    }

    /// Lambdas and comprehensions in the logical line starting at `at`.
    fn expression_scopes(&self, at: usize) -> u32 {
        let end = (at + 1..self.lines.len())
            .find(|&j| self.lines[j].starts)
            .unwrap_or(self.lines.len());
        self.lines[at..end]
            .iter()
            .map(|l| l.expression_scopes)
            .fold(0, u32::saturating_add)
    }

    /// The physical line (0-based) where the logical line holding `i` starts.
    fn logical_start(&self, i: usize) -> Option<usize> {
        if i >= self.lines.len() {
            return None;
        }
        (0..=i).rev().find(|&j| self.lines[j].starts)
    }

    /// The `def name` (or `class name`) line for code of `name` at logical line
    /// `at`: that line itself, the `def` its decorators lead to, or the `def`
    /// whose body it is in.
    fn def_at(&self, name: &str, at: usize) -> Option<usize> {
        // A class body is code of the class's name too.
        let is_def =
            |i: usize| matches!(&self.lines[i].head, Head::Def(n) | Head::Class(n) if n == name);
        let mut i = at;
        while self.lines[i].head == Head::Decorator {
            i = (i + 1..self.lines.len())
                .find(|&j| self.lines[j].starts && self.lines[j].head != Head::Blank)?;
        }
        if is_def(i) {
            return Some(i);
        }
        // A line of the body: the nearest less indented line that is not a plain
        // block (`if`, `for`, ...) must be this `def`.
        let mut threshold = self.lines[i].indent;
        for j in (0..i).rev() {
            let l = &self.lines[j];
            if threshold == 0 {
                return None;
            }
            if !l.starts || l.head == Head::Blank || l.indent >= threshold {
                continue;
            }
            threshold = l.indent;
            match l.head {
                Head::Def(_) | Head::Class(_) if is_def(j) => return Some(j),
                Head::Def(_) | Head::Class(_) => return None,
                _ => {}
            }
        }
        None
    }

    /// The first of the decorators right above `def_at` (or `def_at` itself).
    fn first_decorator(&self, def_at: usize) -> usize {
        let mut first = def_at;
        for j in (0..def_at).rev() {
            let l = &self.lines[j];
            if !l.starts || l.head == Head::Blank {
                continue;
            }
            if l.head != Head::Decorator {
                break;
            }
            first = j;
        }
        first
    }
}

/// Indentation and head of a line that starts a logical line.
fn head_of(raw: &str) -> (u32, Head) {
    let mut indent = 0u32;
    let mut rest = raw;
    for (i, c) in raw.char_indices() {
        match c {
            ' ' => indent = indent.saturating_add(1),
            '\t' => indent = (indent / 8).saturating_add(1).saturating_mul(8),
            '\x0c' => indent = 0,
            _ => {
                rest = &raw[i..];
                break;
            }
        }
        rest = &raw[i + c.len_utf8()..];
    }
    let head = if rest.is_empty() || rest.starts_with('#') {
        Head::Blank
    } else if rest.starts_with('@') {
        Head::Decorator
    } else {
        let stmt = rest
            .strip_prefix("async")
            .filter(|r| r.starts_with([' ', '\t']))
            .map_or(rest, str::trim_start);
        match keyword_name(stmt, "def") {
            Some(n) => Head::Def(n),
            None => keyword_name(stmt, "class").map_or(Head::Other, Head::Class),
        }
    };
    (indent, head)
}

/// The identifier after `keyword` and white space (`def name(`).
fn keyword_name(stmt: &str, keyword: &str) -> Option<String> {
    let rest = stmt.strip_prefix(keyword)?;
    if !rest.starts_with([' ', '\t']) {
        return None;
    }
    let rest = rest.trim_start();
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = &rest[..end];
    (!name.is_empty() && !name.starts_with(|c: char| c.is_ascii_digit())).then(|| name.to_owned())
}

/// Follows strings, comments, brackets and continuations through one line;
/// returns how many lambdas and comprehensions it holds.
fn scan_line(b: &[u8], carry: &mut Carry) -> u32 {
    carry.continued = false;
    let mut scopes = 0u32;
    let mut i = 0;
    while i < b.len() {
        if let Some((q, triple)) = carry.string {
            match b[i] {
                b'\\' => i += 2,
                c if c == q && !triple => {
                    carry.string = None;
                    i += 1;
                }
                c if c == q && b.get(i..i + 3) == Some(&[q, q, q][..]) => {
                    carry.string = None;
                    i += 3;
                }
                _ => i += 1,
            }
            continue;
        }
        match b[i] {
            b'#' => break,
            q @ (b'"' | b'\'') => {
                let triple = b.get(i..i + 3) == Some(&[q, q, q][..]);
                carry.string = Some((q, triple));
                i += if triple { 3 } else { 1 };
                continue;
            }
            b'(' | b'[' | b'{' => carry.depth = carry.depth.saturating_add(1),
            b')' | b']' | b'}' => carry.depth = carry.depth.saturating_sub(1),
            b'\\' if i + 1 == b.len() => carry.continued = true,
            c if c == b'_' || c.is_ascii_alphabetic() => {
                let start = i;
                while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
                    i += 1;
                }
                let word = &b[start..i];
                if word == b"lambda" || (word == b"for" && carry.depth > 0) {
                    scopes = scopes.saturating_add(1);
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    match carry.string {
        // A backslash at the end continues a one-line string; without it the
        // line is broken: the tokenizer would stop there.
        Some((_, false)) if !b.ends_with(b"\\") => carry.string = None,
        _ => {}
    }
    scopes
}

#[cfg(test)]
mod tests;
