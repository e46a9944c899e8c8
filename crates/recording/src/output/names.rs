//! What every view calls a frame: `function (file:line)`, file paths shortened
//! unless full paths are asked for, processes by their command line.

use std::borrow::Cow;

use crate::analyze::folded::FoldFrame;
use crate::recording::{FrameRef, Header, Qualnames, StrId, UNNAMED};

/// Where a source file comes from, for colours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    App,
    Stdlib,
    ThirdParty,
    /// A process or thread frame at the root of its stacks.
    Process,
}

pub(super) fn origin(file: &str) -> Origin {
    if file.contains("/site-packages/") || file.contains("/dist-packages/") {
        Origin::ThirdParty
    } else if file.starts_with('<') || stdlib_split(file).is_some() {
        Origin::Stdlib
    } else {
        Origin::App
    }
}

/// Byte offset just after a `lib/pythonX.Y/` (or `lib64/`, `Lib/`) component.
fn stdlib_split(file: &str) -> Option<usize> {
    let mut offset = 0;
    let mut prev: Option<&str> = None;
    for part in file.split('/') {
        let next = offset + part.len() + 1;
        if let (Some(p), Some(version)) = (prev, part.strip_prefix("python")) {
            if matches!(p, "lib" | "lib64" | "Lib")
                && !version.is_empty()
                && version.chars().all(|c| c.is_ascii_digit() || c == '.')
                && next < file.len()
            {
                return Some(next);
            }
        }
        prev = Some(part);
        offset = next;
    }
    None
}

/// A shorter name for a source file: what follows `site-packages/` or the
/// standard library's `lib/pythonX.Y/`, else the last two path components.
/// Names like `<frozen importlib._bootstrap>` stay as they are.
pub fn short_path(file: &str) -> &str {
    if file.starts_with('<') {
        return file;
    }
    for marker in ["/site-packages/", "/dist-packages/"] {
        if let Some(i) = file.rfind(marker) {
            return &file[i + marker.len()..];
        }
    }
    if let Some(i) = stdlib_split(file) {
        return &file[i..];
    }
    let mut slashes = file.rmatch_indices('/');
    match (slashes.next(), slashes.next()) {
        (Some(_), Some((i, _))) => &file[i + 1..],
        _ => file,
    }
}

/// Options of the dynamic loader (`ld.so --library-path DIR PROGRAM ...`) that
/// take a value.
const LOADER_OPTIONS: [&str; 7] = [
    "--argv0",
    "--library-path",
    "--preload",
    "--audit",
    "--inhibit-rpath",
    "--glibc-hwcaps-prepend",
    "--glibc-hwcaps-mask",
];

/// A command line (arguments joined by spaces) as views show it: the program by
/// its file name (`python3.11 -m black`, not `/usr/bin/python3.11 -m black`); a
/// program run through the dynamic loader by its own name (or its `--argv0`).
pub fn short_command(command: &str) -> String {
    let base = |w: &str| w.rsplit('/').next().unwrap_or(w).to_owned();
    let mut words = command.split(' ');
    let Some(first) = words.next() else {
        return String::new();
    };
    let mut program = base(first);
    let mut rest: Vec<&str> = words.collect();
    if program.starts_with("ld-linux") || program.starts_with("ld.so") {
        let mut argv0 = None;
        let mut i = 0;
        while i < rest.len() && rest[i].starts_with("--") {
            if LOADER_OPTIONS.contains(&rest[i]) {
                if rest[i] == "--argv0" {
                    argv0 = rest.get(i + 1).copied();
                }
                i += 1;
            }
            i += 1;
        }
        if let Some(p) = rest.get(i) {
            program = base(argv0.unwrap_or(p));
            rest.drain(..=i);
        }
    }
    std::iter::once(program.as_str())
        .chain(rest)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Names frames from a recording's string table.
pub struct FrameNames<'a> {
    strings: &'a [String],
    qualnames: Option<&'a Qualnames>,
    full_paths: bool,
    /// The recording's command line: its own process's, until an exec.
    command: String,
}

/// Longest command line shown in a process frame, in characters.
const MAX_COMMAND_CHARS: usize = 80;

impl<'a> FrameNames<'a> {
    /// Names from `strings` (a reader's string table, read to the end).
    pub fn new(strings: &'a [String], full_paths: bool) -> Self {
        FrameNames {
            strings,
            qualnames: None,
            full_paths,
            command: String::new(),
        }
    }

    /// Names functions by their qualified names (`Class.method`) where known.
    pub fn with_qualnames(mut self, qualnames: &'a Qualnames) -> Self {
        self.qualnames = Some(qualnames);
        self
    }

    /// The function `code` names as views show it: its qualified name when the
    /// recording has one, else its name; [`UNNAMED`] when that is empty.
    pub fn function(&self, code: &FrameRef) -> Cow<'a, str> {
        match self.string(self.qualnames.map_or(code.function, |q| q.shown(code))) {
            name if name.is_empty() => Cow::Borrowed(UNNAMED),
            name => name,
        }
    }

    /// Names the recording's own process by its header's command line.
    pub fn with_header(mut self, header: &Header) -> Self {
        self.command = header.command_line.join(" ");
        self
    }

    /// `pid 1234: python3 app.py` (the command line shortened, see
    /// [`short_command`], and cut to fit).
    pub(crate) fn process(&self, pid: u32, command: Option<StrId>) -> String {
        let command = match command {
            Some(id) => self.string(id),
            None => Cow::Borrowed(self.command.as_str()),
        };
        let command = short_command(&command);
        if command.is_empty() {
            return format!("pid {pid}");
        }
        let shown: String = if command.chars().count() > MAX_COMMAND_CHARS {
            command
                .chars()
                .take(MAX_COMMAND_CHARS - 1)
                .collect::<String>()
                + "…"
        } else {
            command
        };
        format!("pid {pid}: {shown}")
    }

    /// The string `id`, or a placeholder for an id never defined.
    pub fn string(&self, id: StrId) -> Cow<'a, str> {
        match self.strings.get(id.0 as usize) {
            Some(s) => Cow::Borrowed(s.as_str()),
            None => Cow::Owned(format!("<unknown #{}>", id.0)),
        }
    }

    /// The file of `id` as views show it.
    pub fn file(&self, id: StrId) -> Cow<'a, str> {
        match self.string(id) {
            Cow::Borrowed(s) if !self.full_paths => Cow::Borrowed(short_path(s)),
            other => other,
        }
    }

    /// `function (file:line)`.
    pub fn python(&self, f: &FrameRef) -> String {
        let function = self.function(f);
        if f.line == 0 {
            // A native frame (`--native`): its file is the object, it has no line.
            return format!("{function} ({})", self.file(f.file));
        }
        format!("{function} ({}:{})", self.file(f.file), f.line)
    }

    /// A function at the line it ran: `name (file:first) line N`, so the
    /// function reads as in the other views and the line stands apart.
    pub(crate) fn python_line(&self, f: &FrameRef, line: u32) -> String {
        format!("{} line {line}", self.python(f))
    }

    /// The name of a folded frame, safe for folded stacks (no `;`, no newline).
    pub(crate) fn fold_frame(&self, f: &FoldFrame) -> String {
        let name = match f {
            FoldFrame::Python(p) => self.python(p),
            FoldFrame::PythonLine { code, line } => self.python_line(code, *line),
            FoldFrame::Gc { generation } => format!("[gc gen {generation}]"),
            FoldFrame::Process { pid, command } => self.process(*pid, *command),
            FoldFrame::Thread { tid, pid } => thread_name(*tid, *pid),
        };
        clean(name)
    }

    pub(super) fn origin(&self, f: &FoldFrame) -> Option<Origin> {
        match f {
            FoldFrame::Python(p) | FoldFrame::PythonLine { code: p, .. } => {
                Some(origin(&self.string(p.file)))
            }
            FoldFrame::Gc { .. } => None,
            FoldFrame::Process { .. } | FoldFrame::Thread { .. } => Some(Origin::Process),
        }
    }
}

/// How views name a thread: `main thread (TID)` for its process's first
/// thread, else `thread TID` (recordings keep thread ids, not names).
pub(crate) fn thread_name(tid: u32, pid: u32) -> String {
    if tid == pid {
        format!("main thread ({tid})")
    } else {
        format!("thread {tid}")
    }
}

/// Replaces the characters folded stacks cannot hold.
fn clean(name: String) -> String {
    if name.contains([';', '\n', '\r', '\t']) {
        name.replace(';', ",").replace(['\n', '\r', '\t'], " ")
    } else {
        name
    }
}
