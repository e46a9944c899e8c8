//! `pyprobe flame`: flame graphs (SVG through `inferno`) and folded stacks.
//!
//! Also the naming shared by every view: frames are called `function (file:line)`,
//! with file paths shortened (standard-library and site-packages prefixes stripped,
//! else the last two path components) unless full paths are asked for.

use std::borrow::Cow;
use std::io::{self, Read, Seek, Write};

use inferno::flamegraph::color::{Color, PaletteMap};
use inferno::flamegraph::{self, Options};

use crate::analyze::folded::{FoldFrame, Folded, Folder, Measure};
use crate::analyze::recording::replay_recording;
use crate::analyze::SampleFilter;
use crate::output::report::format_ns;
use crate::record::{Completion, FrameRef, Header, RecordError, RecordingReader, StrId};

/// An error while writing a view: reading the recording or writing the output.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The recording could not be read.
    #[error(transparent)]
    Record(#[from] crate::record::RecordError),
    /// The output (or the temporary file) could not be written.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// What the width of a frame stands for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum By {
    /// Time: exclusive time in trace mode, samples in sample mode.
    #[default]
    Time,
    /// Finished calls (trace mode).
    Calls,
}

/// What a view needs to know about the recording besides its events.
#[derive(Debug, Clone, Default)]
pub struct ViewInfo {
    /// The recording's header.
    pub header: Header,
    /// End time from the trailer, when the recording was finished properly.
    pub end_ns: Option<u64>,
    /// Lost events according to the trailer.
    pub trailer_lost: u64,
    /// Where the recording was cut short, if it was.
    pub truncated_at: Option<u64>,
}

impl ViewInfo {
    /// Reads what `reader` knows once its events have been read.
    pub fn of<R: Read>(reader: &RecordingReader<R>) -> Self {
        let (end_ns, trailer_lost, truncated_at) = match reader.completion() {
            Completion::Complete(t) => (Some(t.end_ns), t.lost_events, None),
            Completion::Truncated { offset } => (None, 0, Some(offset)),
            Completion::Reading | Completion::Failed { .. } => (None, 0, None),
        };
        ViewInfo {
            header: reader.header().clone(),
            end_ns,
            trailer_lost,
            truncated_at,
        }
    }

    /// Where timestamps count from: the header's start, else the first event.
    pub fn start_ns(&self, first_ts: Option<u64>) -> u64 {
        match (self.header.start_ns, first_ts) {
            (0, Some(t)) => t,
            (s, Some(t)) => s.min(t),
            (s, None) => s,
        }
    }

    /// From the start to the trailer's end or the last event.
    pub fn duration_ns(&self, first_ts: Option<u64>, last_ts: Option<u64>) -> u64 {
        let start = self.start_ns(first_ts);
        let end = self.end_ns.unwrap_or(0).max(last_ts.unwrap_or(start));
        end.saturating_sub(start)
    }
}

/// Reads every event of `reader` into folded stacks, with the samples of threads on
/// a CPU (the default [`SampleFilter`]).
pub fn read_folded<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
) -> Result<(Folded, ViewInfo), RecordError> {
    read_folded_filtered(reader, SampleFilter::default())
}

/// Reads every event of `reader` into folded stacks, with the samples `filter` keeps.
pub fn read_folded_filtered<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: SampleFilter,
) -> Result<(Folded, ViewInfo), RecordError> {
    let mut folder = Folder::for_recording(reader.header(), filter);
    let replay = replay_recording(reader, |_, event, ts, steps, replay| {
        folder.push(event, ts, steps, replay);
        Ok::<(), RecordError>(())
    })?;
    let info = ViewInfo::of(reader);
    Ok((folder.finish(replay, info.end_ns), info))
}

/// Whether the recording holds samples rather than calls.
pub fn is_sampled(folded: &Folded, header: &Header) -> bool {
    let c = folded.counts;
    c.samples > 0 && (header.mode == "sample" || c.calls + c.returns == 0)
}

/// The measure `by` means for this recording, and a note when it could not be
/// honoured as asked.
pub fn choose_measure(folded: &Folded, header: &Header, by: By) -> (Measure, Option<String>) {
    let sampled = is_sampled(folded, header);
    let c = folded.counts;
    match by {
        By::Calls if sampled => (
            Measure::Samples,
            Some("a sampled recording has no call counts: width is samples".into()),
        ),
        By::Calls => (Measure::Calls, None),
        By::Time if sampled => (Measure::Samples, None),
        By::Time if c.returns_only || (c.calls == 0 && c.returns > 0) => {
            if c.samples > 0 {
                (Measure::Samples, None)
            } else {
                (
                    Measure::Calls,
                    Some(
                        "return events only (CPython 3.11): no times, width is call counts".into(),
                    ),
                )
            }
        }
        By::Time => (Measure::Time, None),
    }
}

/// Where a source file comes from, for colours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    App,
    Stdlib,
    ThirdParty,
    /// A process frame at the root of its stacks.
    Process,
}

fn origin(file: &str) -> Origin {
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
            full_paths,
            command: String::new(),
        }
    }

    /// Names the recording's own process by its header's command line.
    pub fn with_header(mut self, header: &Header) -> Self {
        self.command = header.command_line.join(" ");
        self
    }

    /// `pid 1234: python3 app.py` (the command line shortened, see
    /// [`short_command`], and cut to fit).
    pub fn process(&self, pid: u32, command: Option<StrId>) -> String {
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
        let function = self.string(f.function);
        let function = if function.is_empty() {
            Cow::Borrowed("?")
        } else {
            function
        };
        format!("{function} ({}:{})", self.file(f.file), f.line)
    }

    /// The name of a folded frame, safe for folded stacks (no `;`, no newline).
    pub fn fold_frame(&self, f: &FoldFrame) -> String {
        let name = match f {
            FoldFrame::Python(p) => self.python(p),
            FoldFrame::Gc { generation } => format!("[gc gen {generation}]"),
            FoldFrame::Process { pid, command } => self.process(*pid, *command),
        };
        clean(name)
    }

    fn origin(&self, f: &FoldFrame) -> Option<Origin> {
        match f {
            FoldFrame::Python(p) => Some(origin(&self.string(p.file))),
            FoldFrame::Gc { .. } => None,
            FoldFrame::Process { .. } => Some(Origin::Process),
        }
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

/// Folded stack lines (`a;b;c 123`): depth first, siblings in name order, so
/// stacks sharing a prefix are together and the output is stable.
pub fn collapsed_lines(folded: &Folded, measure: Measure, names: &FrameNames<'_>) -> Vec<String> {
    let mut lines = Vec::new();
    folded.walk_named(
        measure,
        1,
        |f| names.fold_frame(f),
        |path, value| lines.push(format!("{} {value}", path.join(";"))),
    );
    lines
}

/// Writes folded stacks, one line per stack, as [`collapsed_lines`] orders them,
/// without holding them all in memory.
pub fn write_collapsed<W: Write>(
    folded: &Folded,
    measure: Measure,
    names: &FrameNames<'_>,
    mut out: W,
) -> io::Result<()> {
    let mut result = Ok(());
    let mut line = String::new();
    folded.walk_named(
        measure,
        1,
        |f| names.fold_frame(f),
        |path, value| {
            if result.is_err() {
                return;
            }
            line.clear();
            for (i, name) in path.iter().enumerate() {
                if i > 0 {
                    line.push(';');
                }
                line.push_str(name);
            }
            line.push(' ');
            line.push_str(&value.to_string());
            line.push('\n');
            result = out.write_all(line.as_bytes());
        },
    );
    result?;
    out.flush()
}

/// The default title: the target's command line.
pub fn default_title(header: &Header) -> String {
    let what = if !header.command_line.is_empty() {
        header.command_line.join(" ")
    } else if !header.executable.is_empty() {
        header.executable.clone()
    } else {
        format!("pid {}", header.pid)
    };
    let what: String = if what.chars().count() > 100 {
        what.chars().take(99).collect::<String>() + "…"
    } else {
        what
    };
    format!("pyprobe: {what}")
}

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The subtitle: pid, python version, mode, duration, events or samples, and
/// what the width means.
pub fn subtitle(folded: &Folded, info: &ViewInfo, measure: Measure) -> String {
    let h = &info.header;
    let c = folded.counts;
    let python = if h.python_version.is_empty() {
        "?"
    } else {
        &h.python_version
    };
    let sampled = measure == Measure::Samples;
    let mode = match h.mode.as_str() {
        "auto" if sampled => "auto (sampled)",
        "auto" => "auto (traced)",
        m => m,
    };
    let duration = format_ns(info.duration_ns(c.first_ts, c.last_ts));
    let count = if sampled {
        let every = if h.sample_interval_ns > 0 {
            format!(" every {}", format_ns(h.sample_interval_ns))
        } else {
            String::new()
        };
        let t = folded.tally;
        let which = match (t.applied, t.filter.idle, t.filter.gil) {
            (false, ..) => "",
            // Recorded before samples kept their thread's state: nothing was told apart.
            _ if t.kept > 0 && t.cpu_unknown == t.kept => ", thread state not recorded",
            (true, false, false) => ", threads on a CPU",
            (true, true, false) => ", idle threads included",
            (true, _, true) => ", the GIL holder's",
        };
        let left = match t.left_out() {
            0 => String::new(),
            n if t.filter == SampleFilter::default() => {
                format!(" ({} idle left out)", thousands(n))
            }
            n => format!(" ({} left out)", thousands(n)),
        };
        format!("{} samples{every}{which}{left}", thousands(t.kept))
    } else {
        format!("{} events", thousands(c.events))
    };
    let lost = c.lost.max(info.trailer_lost);
    let lost = if lost > 0 {
        format!(", {} lost", thousands(lost))
    } else {
        String::new()
    };
    let cut = if info.truncated_at.is_some() {
        ", cut short"
    } else {
        ""
    };
    let width = match measure {
        Measure::Time => "width: own time",
        Measure::Calls => "width: calls",
        Measure::Samples => "width: samples",
    };
    format!(
        "pid {}, CPython {python}, {mode} mode, {duration}, {count}{lost}{cut}; {width}",
        h.pid
    )
}

/// A colour per frame name: application code warm, the standard library
/// yellow, third-party packages aqua, GC blue; the shade comes from a hash of
/// the name, so a function keeps its colour from one graph to the next.
fn frame_color(name: &str, origin: Option<Origin>) -> Color {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.as_bytes() {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    let v = |shift: u32| ((hash >> shift) & 0xffff) as f32 / 65535.0;
    let (v1, v2, v3) = (v(0), v(16), v(32));
    let c = |base: u8, range: f32, x: f32| base.saturating_add((range * x) as u8);
    match origin {
        Some(Origin::App) => Color {
            r: c(205, 50.0, v3),
            g: c(0, 230.0, v1),
            b: c(0, 55.0, v2),
        },
        Some(Origin::Stdlib) => Color {
            r: c(175, 55.0, v1),
            g: c(175, 55.0, v1),
            b: c(50, 20.0, v1),
        },
        Some(Origin::ThirdParty) => Color {
            r: c(50, 60.0, v1),
            g: c(165, 55.0, v1),
            b: c(165, 55.0, v1),
        },
        None => Color {
            r: c(80, 60.0, v1),
            g: c(80, 60.0, v1),
            b: c(205, 50.0, v1),
        },
        Some(Origin::Process) => Color {
            r: c(160, 40.0, v1),
            g: c(160, 40.0, v1),
            b: c(160, 40.0, v1),
        },
    }
}

/// Everything [`write_svg`] draws besides the stacks.
pub struct SvgOptions<'a> {
    /// The title; default [`default_title`].
    pub title: Option<&'a str>,
}

/// Draws the flame graph as SVG. Fails when there is nothing to draw.
pub fn write_svg<W: Write>(
    folded: &Folded,
    info: &ViewInfo,
    measure: Measure,
    names: &FrameNames<'_>,
    options: &SvgOptions<'_>,
    out: W,
) -> io::Result<()> {
    let mut opt = Options::default();
    // Stacks narrower than inferno draws need not reach it: fold them into
    // their parents (half its threshold, to stay clear of its rounding), which
    // keeps memory to the frames drawn, not every stack recorded.
    let total = folded.total(measure);
    let min_total = (opt.min_width * total as f64 / 100.0 / 2.0).floor() as u64;
    let mut palette = PaletteMap::default();
    let mut lines = Vec::new();
    folded.walk_named(
        measure,
        min_total.max(1),
        |f| {
            let name = names.fold_frame(f);
            if palette.get(&name).is_none() {
                palette.insert(&name, frame_color(&name, names.origin(f)));
            }
            name
        },
        |path, value| lines.push(format!("{} {value}", path.join(";"))),
    );
    if lines.is_empty() {
        let t = folded.tally;
        let why = if t.kept == 0 && t.left_out() > 0 {
            format!(
                "nothing to draw: every one of the {} samples was left out ({}; --idle \
                 includes waiting threads{})",
                t.samples,
                t.filter.describe(),
                if t.filter.gil {
                    ", without --gil every thread"
                } else {
                    ""
                }
            )
        } else {
            "nothing to draw: the recording has no stacks (no call/return or sample events)"
                .to_string()
        };
        return Err(io::Error::new(io::ErrorKind::InvalidData, why));
    }
    lines.sort_unstable();
    let title = options
        .title
        .map(str::to_owned)
        .unwrap_or_else(|| default_title(&info.header));
    opt.title = title;
    opt.subtitle = Some(subtitle(folded, info, measure));
    opt.deterministic = true;
    opt.palette_map = Some(&mut palette);
    opt.no_sort = true;
    opt.name_type = "Function:".into();
    opt.notes = format!("pyprobe {}", env!("CARGO_PKG_VERSION"));
    match measure {
        Measure::Time => {
            // Values are ns; show µs.
            opt.count_name = "µs".into();
            opt.factor = 0.001;
        }
        Measure::Calls => opt.count_name = "calls".into(),
        Measure::Samples => opt.count_name = "samples".into(),
    }
    flamegraph::from_lines(&mut opt, lines.iter().map(String::as_str), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_paths() {
        assert_eq!(
            short_path("/usr/lib/python3.9/json/__init__.py"),
            "json/__init__.py"
        );
        assert_eq!(
            short_path("/usr/lib/python3.9/threading.py"),
            "threading.py"
        );
        assert_eq!(
            short_path("/opt/py/.pythons/3.9/usr/lib/python3.9/os.py"),
            "os.py"
        );
        assert_eq!(
            short_path("/venv/lib/python3.11/site-packages/requests/api.py"),
            "requests/api.py"
        );
        assert_eq!(
            short_path("/usr/lib/python3/dist-packages/six.py"),
            "six.py"
        );
        assert_eq!(short_path("/srv/app/fixtures/demo.py"), "fixtures/demo.py");
        assert_eq!(short_path("app/demo.py"), "app/demo.py");
        assert_eq!(short_path("/demo.py"), "/demo.py");
        assert_eq!(short_path("demo.py"), "demo.py");
        assert_eq!(
            short_path("<frozen importlib._bootstrap>"),
            "<frozen importlib._bootstrap>"
        );
        // Not the standard library: a directory merely named python3.
        assert_eq!(short_path("/home/u/python3/x/y.py"), "x/y.py");
    }

    #[test]
    fn origins() {
        assert_eq!(
            origin("/usr/lib/python3.9/json/__init__.py"),
            Origin::Stdlib
        );
        assert_eq!(origin("<frozen importlib._bootstrap>"), Origin::Stdlib);
        assert_eq!(
            origin("/v/lib/python3.9/site-packages/x.py"),
            Origin::ThirdParty
        );
        assert_eq!(origin("/app/main.py"), Origin::App);
    }

    #[test]
    fn names_are_safe_for_folded_stacks() {
        let strings: Vec<String> = vec!["/a/b/c.py".into(), "f;g\nh".into(), String::new()];
        let names = FrameNames::new(&strings, false);
        let f = FoldFrame::Python(FrameRef {
            file: StrId(0),
            function: StrId(1),
            line: 3,
        });
        assert_eq!(names.fold_frame(&f), "f,g h (b/c.py:3)");
        let f = FoldFrame::Python(FrameRef {
            file: StrId(9),
            function: StrId(2),
            line: 1,
        });
        assert_eq!(names.fold_frame(&f), "? (<unknown #9>:1)");
        let full = FrameNames::new(&strings, true);
        assert_eq!(full.file(StrId(0)), "/a/b/c.py");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(thousands(12), "12");
    }

    #[test]
    fn commands_are_shown_by_their_programs_name() {
        assert_eq!(
            short_command("/usr/bin/python3.11 -m black src"),
            "python3.11 -m black src"
        );
        assert_eq!(short_command("python3 app.py"), "python3 app.py");
        assert_eq!(
            short_command(
                "/p/lib64/ld-linux-x86-64.so.2 --argv0 /p/bin/python3.13 --library-path /p/lib \
                 /p/usr/bin/python3.13 -c work"
            ),
            "python3.13 -c work"
        );
        assert_eq!(
            short_command("/lib64/ld-linux-x86-64.so.2 /usr/bin/python3 x.py"),
            "python3 x.py"
        );
        assert_eq!(short_command(""), "");
        let strings: Vec<String> = vec!["/usr/bin/python3 -c pass".into()];
        let header = Header {
            command_line: vec!["/usr/bin/python3".into(), "app.py".into()],
            ..Header::default()
        };
        let names = FrameNames::new(&strings, false).with_header(&header);
        assert_eq!(names.process(7, None), "pid 7: python3 app.py");
        assert_eq!(names.process(8, Some(StrId(0))), "pid 8: python3 -c pass");
        assert_eq!(FrameNames::new(&strings, false).process(9, None), "pid 9");
    }
}
