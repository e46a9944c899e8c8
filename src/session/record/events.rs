//! Turning probe hits and samples into recording events.

use rustc_hash::FxHashMap;
use std::path::{Path, PathBuf};

use pyprobe_cpython::python::probe_catalog::{ProbeKind, PythonProbe, LASTI_ARG};
use pyprobe_cpython::python::tracing::FRAME_ARG;
use pyprobe_recording::analyze::FileFilter;
use pyprobe_recording::output::file::{Existing, Output};
use pyprobe_recording::recording::{
    BackgroundWriter, Event, EventKind, FrameNumberHint, FrameRef, Header, RecordingWriter, StrId,
};
use pyprobe_sdt::tracer::signals;
use pyprobe_sdt::tracer::Hit;

use super::codes::ReturnHit;
use super::periods::Periods;
use super::qualnames::CodeNames;
use super::repeats::Repeats;
use super::resolver::Chosen;

/// Turns probe hits into recording events, filtering as asked.
pub struct EventBuilder {
    /// Created once the interpreter is known (for `-- CMD`, after it has started),
    /// so the header names the right executable and Python version.
    writer: Option<RecordingWriter<BackgroundWriter>>,
    header: Header,
    output: PathBuf,
    /// Whether a file at `output` may be replaced.
    existing: Existing,
    /// The file the writer writes (`OUT.partial` until the recording ends).
    file: Option<Output>,
    /// Events seen before the writer exists (thread and process starts, execs: no
    /// probe can hit yet), with the string each names, interned once it exists.
    early: Vec<(Event, Option<(String, NamedKind)>)>,
    filter: FileFilter,
    start_at: Option<String>,
    /// Per thread: depth inside the `--start-at` function (0: outside).
    inside: FxHashMap<i32, u32>,
    write_error: Option<std::io::Error>,
    events: u64,
    last_flush_ns: u64,
    /// The (file, function) of recent hits by their string pointers in the target,
    /// checked against the text before use: most hits repeat a few code objects,
    /// and interning their names again is the costliest part of a hit.
    frames: FxHashMap<(u64, u64), CachedNames>,
    /// The strings stamp of the last named hit and what it was named: a run of
    /// hits with the same strings (a recursion, a loop's calls) names them once.
    last_named: Option<(u64, Option<(StrId, StrId)>)>,
    /// The sampling interval of stacks taken alongside return-only tracing
    /// (CPython 3.11 in trace mode), written to the header when that is the case.
    alongside_interval_ns: u64,
    /// `--every`: each event goes to its period's recording too.
    periods: Option<Periods>,
    /// The recording's strings by id, kept for the periods (which intern their own).
    strings: Vec<String>,
    /// Events of hits that repeat (see [`Hit::repeats_as`]), by token.
    repeats: Repeats,
    /// Which functions have been given their qualified name.
    code_names: CodeNames,
}

/// An event that names a string, made once the string has its id.
#[derive(Debug, Clone, Copy)]
pub enum NamedKind {
    /// `process_start` of a child of this parent, naming its command line.
    ProcessStart { parent: u32 },
    /// `exec`, naming the new command line.
    Exec,
    /// A caveat, its text.
    Caveat,
}

impl NamedKind {
    fn kind(self, command: StrId) -> EventKind {
        match self {
            NamedKind::ProcessStart { parent } => EventKind::ProcessStart { parent, command },
            NamedKind::Exec => EventKind::Exec { command },
            NamedKind::Caveat => EventKind::Caveat { text: command },
        }
    }
}

/// What a pair of name pointers resolved to last time.
struct CachedNames {
    file: String,
    function: String,
    /// `None`: the file is filtered out.
    ids: Option<(StrId, StrId)>,
}

/// Most pointer pairs remembered; past it the cache starts over.
const MAX_CACHED_FRAMES: usize = 65_536;

impl EventBuilder {
    pub fn new(
        header: Header,
        output: PathBuf,
        existing: Existing,
        filter: FileFilter,
        start_at: Option<String>,
    ) -> EventBuilder {
        EventBuilder {
            writer: None,
            header,
            output,
            existing,
            file: None,
            early: Vec::new(),
            filter,
            start_at,
            inside: FxHashMap::default(),
            write_error: None,
            events: 0,
            last_flush_ns: 0,
            frames: FxHashMap::default(),
            last_named: None,
            alongside_interval_ns: 0,
            periods: None,
            strings: Vec::new(),
            repeats: Repeats::default(),
            code_names: CodeNames::default(),
        }
    }

    /// Every event goes to `periods` too.
    pub(super) fn with_periods(&mut self, periods: Periods) {
        self.periods = Some(periods);
    }

    /// Ends the period under way if its time is up.
    pub fn rotate_periods(&mut self, now_ns: u64) {
        if let Some(p) = self.periods.as_mut() {
            p.rotate_if_due(now_ns);
        }
    }

    /// The periods, to finish with the recording.
    pub(super) fn take_periods(&mut self) -> Option<Periods> {
        self.periods.take()
    }

    /// Stacks will be sampled every `ns` alongside a return-only trace.
    pub fn sample_alongside(&mut self, ns: u64) {
        self.alongside_interval_ns = ns;
    }

    pub fn events(&self) -> u64 {
        self.events
    }

    /// Bytes written to the recording so far, as stored.
    pub fn bytes(&self) -> u64 {
        self.writer.as_ref().map_or(0, |w| w.stored_bytes())
    }

    /// Flushes buffered events at most every half second, so a recording being
    /// written can be watched (`pyprobe top`) without waiting for a full chunk.
    pub fn flush_if_due(&mut self, now_ns: u64) {
        if now_ns.saturating_sub(self.last_flush_ns) < 500_000_000 {
            return;
        }
        self.last_flush_ns = now_ns;
        self.flush_now();
    }

    /// Flushes buffered events now (before pyprobe stops for a pause).
    pub fn flush_now(&mut self) {
        if let Some(w) = self.writer.as_mut() {
            if let Err(e) = w.flush() {
                self.write_error.get_or_insert(e);
                signals::request_stop();
            }
        }
    }

    /// Ends the recording: the writer and its file (if it was ever opened) and the
    /// first write error.
    pub fn into_parts(
        mut self,
    ) -> (
        Option<(RecordingWriter<BackgroundWriter>, Output)>,
        Option<std::io::Error>,
    ) {
        let opened = self.writer.take().zip(self.file.take());
        (opened, self.write_error.take())
    }

    pub fn write(&mut self, tid: i32, ts_ns: u64, kind: EventKind) {
        self.write_hinted(tid, ts_ns, kind, None);
    }

    /// [`write`](Self::write), with what the writer remembers of a call or
    /// return written again and again (see [`FrameNumberHint`]).
    #[inline]
    fn write_hinted(
        &mut self,
        tid: i32,
        ts_ns: u64,
        kind: EventKind,
        hint: Option<&mut FrameNumberHint>,
    ) {
        if self.write_error.is_some() {
            return;
        }
        let event = Event {
            tid: tid as u32,
            ts_ns,
            kind,
        };
        let Some(writer) = self.writer.as_mut() else {
            self.early.push((event, None));
            return;
        };
        let written = match hint {
            Some(hint) => writer.write_hinted(&event, hint),
            None => writer.write(&event),
        };
        match written {
            Ok(()) => {
                self.events += 1;
                if let Some(p) = self.periods.as_mut() {
                    p.write(&event, &self.strings);
                }
            }
            Err(e) => {
                self.write_error = Some(e);
                signals::request_stop();
            }
        }
    }

    /// Creates the recording, completing the header with what is known now.
    pub fn open(&mut self, pid: i32, chosen: &Chosen) {
        if self.writer.is_some() || self.write_error.is_some() {
            return;
        }
        self.header.executable = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if !chosen.object_path.is_empty() {
            // Through a loader, /proc/PID/exe is the loader: name the interpreter.
            self.header.executable = chosen.object_path.clone();
        }
        self.header.python_version = chosen.version.map(|v| v.to_string()).unwrap_or_default();
        // No `co_qualname` before 3.11: the source files say.
        self.code_names
            .interpreter_has_qualnames(chosen.version.is_some_and(|v| v.at_least(3, 11)));
        self.header.probes = chosen.groups.iter().map(|g| g.name().to_owned()).collect();
        if super::resolver::returns_only(chosen.version, &chosen.groups, chosen.hook) {
            self.header.sample_interval_ns = self
                .header
                .sample_interval_ns
                .max(self.alongside_interval_ns);
        }
        self.open_as_is();
    }

    /// Creates the recording with the header as it stands (the drain benchmark's
    /// way in; [`open`](Self::open) completes it first).
    pub fn open_as_is(&mut self) {
        if self.writer.is_some() || self.write_error.is_some() {
            return;
        }
        // The header reaches the file at once: a watcher (`top`) can open it now.
        let opened = Output::partial(&self.output, self.existing).and_then(|file| {
            let mut w =
                RecordingWriter::new(BackgroundWriter::new(file.try_clone_file()?)?, &self.header)?;
            w.flush()?;
            Ok((w, file))
        });
        match opened {
            Ok((w, file)) => {
                self.writer = Some(w);
                self.file = Some(file);
                if let Some(p) = self.periods.as_mut() {
                    p.begin(&self.header);
                }
            }
            Err(e) => {
                self.write_error = Some(e);
                signals::request_stop();
                return;
            }
        }
        for (event, named) in std::mem::take(&mut self.early) {
            let kind = match named {
                Some((text, make)) => make.kind(self.intern(&text)),
                None => event.kind,
            };
            self.write(event.tid as i32, event.ts_ns, kind);
        }
    }

    /// Once the recording is open: where it is written now (`OUT.partial`, or a
    /// FIFO) and the name it gets when it ends.
    pub fn writing_to(&self) -> Option<(&Path, &Path)> {
        let file = self.file.as_ref()?;
        let now = if file.is_renamed() {
            file.writing_to()
        } else {
            self.output.as_path()
        };
        Some((now, self.output.as_path()))
    }

    /// Writes an event naming `text` (a command line): interned now, or once the
    /// recording exists.
    pub fn write_named(&mut self, tid: i32, ts_ns: u64, text: &str, make: NamedKind) {
        if self.writer.is_none() && self.write_error.is_none() {
            let event = Event {
                tid: tid as u32,
                ts_ns,
                kind: EventKind::ThreadExit,
            };
            self.early.push((event, Some((text.to_owned(), make))));
            return;
        }
        let id = self.intern(text);
        self.write(tid, ts_ns, make.kind(id));
    }

    /// Gives function `code` (its file, `co_name` and first line, as recorded) of
    /// process `pid` the qualified name views show: `qualname` when the
    /// interpreter said it (`co_qualname`, 3.11+: final), else what its source
    /// file says. Once per function; nothing when it is the bare name.
    pub fn name_code(
        &mut self,
        pid: i32,
        code: FrameRef,
        (file, name): (&str, &str),
        qualname: Option<&str>,
    ) {
        if self.writer.is_none() || !self.code_names.first_sight(code) {
            return;
        }
        let (qualname, first) = match qualname {
            Some(q) if q != name => (q.to_owned(), code.line),
            Some(_) => return,
            None => match self.code_names.in_source(pid, file, name, code.line) {
                Some(found) => found,
                None => return,
            },
        };
        let q = self.intern(&qualname);
        // A generator resumed (3.9) calls at a line of its body: its first line
        // is named too, which its rows are keyed by.
        let lines = if first == code.line {
            &[code.line][..]
        } else {
            &[code.line, first][..]
        };
        for &line in lines {
            let named = FrameRef { line, ..code };
            if let Some(w) = self.writer.as_mut() {
                w.name_code(&named, q);
            }
            if let Some(p) = self.periods.as_mut() {
                p.name_code(&named, q, &self.strings);
            }
        }
    }

    /// Whether the frame walker's names are qualified names (3.11+).
    pub fn walker_qualifies(&self) -> bool {
        self.code_names.walker_qualifies()
    }

    pub fn intern(&mut self, s: &str) -> StrId {
        let Some(w) = self.writer.as_mut() else {
            return pyprobe_recording::recording::StrId(0);
        };
        let id = w.intern(s);
        // Ids are dense: a new one is the next.
        if self.periods.is_some() && id.0 as usize == self.strings.len() {
            self.strings.push(s.to_owned());
        }
        id
    }

    fn frame(&mut self, hit: &Hit) -> Option<FrameRef> {
        let file = hit.string(0).unwrap_or("");
        let function = hit.string(1).unwrap_or("");
        let line = hit.args.get(2).copied().unwrap_or(0) as u32;
        let key = (
            hit.args.first().copied().unwrap_or(0),
            hit.args.get(1).copied().unwrap_or(0),
        );
        let (file, function) = self.names_of(hit.strings_stamp(), key, file, function)?;
        Some(FrameRef {
            file,
            function,
            line,
        })
    }

    /// The ids of `file` and `function` (`None`: the file is filtered out), whose
    /// pointers in the target were `key` and whose strings' stamp is `stamp`.
    fn names_of(
        &mut self,
        stamp: u64,
        key: (u64, u64),
        file: &str,
        function: &str,
    ) -> Option<(StrId, StrId)> {
        if self.writer.is_none() {
            return self.name(file, function);
        }
        match self.last_named {
            Some((last, ids)) if last == stamp && stamp != 0 => return ids,
            _ => {}
        }
        let ids = self.name_cached(key, file, function);
        self.last_named = Some((stamp, ids));
        ids
    }

    fn name(&mut self, file: &str, function: &str) -> Option<(StrId, StrId)> {
        self.filter
            .matches(file)
            .then(|| (self.intern(file), self.intern(function)))
    }

    /// Names through the cache of pointer pairs (once the writer exists: the ids
    /// are its own).
    fn name_cached(
        &mut self,
        key: (u64, u64),
        file: &str,
        function: &str,
    ) -> Option<(StrId, StrId)> {
        if let Some(c) = self.frames.get(&key) {
            // The same pointers may name other strings later (freed, reused):
            // only the same text counts.
            if c.file == file && c.function == function {
                return c.ids;
            }
        }
        let ids = self.name(file, function);
        if self.frames.len() >= MAX_CACHED_FRAMES {
            self.frames.clear();
        }
        self.frames.insert(
            key,
            CachedNames {
                file: file.to_owned(),
                function: function.to_owned(),
                ids,
            },
        );
        ids
    }

    /// Whether a function event on `tid` is inside the `--start-at` window,
    /// updating the window on entry to and return from that function.
    fn in_window(&mut self, tid: i32, function: &str, is_call: bool, is_return: bool) -> bool {
        let Some(target) = &self.start_at else {
            return true;
        };
        let depth = self.inside.entry(tid).or_insert(0);
        let matches = function == target.as_str();
        if is_call && matches {
            *depth += 1;
            return true;
        }
        if is_return && matches && *depth > 0 {
            *depth -= 1;
            return true;
        }
        *depth > 0
    }

    /// Writes the event a ring record repeats (see [`Hit::repeats_as`]).
    #[inline]
    pub fn repeat(&mut self, tid: i32, ts_ns: u64, token: u32) {
        // Most of a trace: the writer remembers the event's frame number by
        // its token.
        let Some((kind, mut hint)) = self.repeats.event(token) else {
            return;
        };
        self.write_hinted(tid, ts_ns, kind, Some(&mut hint));
        self.repeats.remember(token, hint);
    }

    /// Names `kind` (`None`: nothing written) for the records equal to `hit`'s,
    /// when they all have that event: no `--start-at` window (it depends on
    /// what came before), the writer's ids, a return whose first line is
    /// settled (known, or not asked for: no frame argument). With `lasti`, an
    /// entry's `f_lasti` (which makes it a call or a resume) is part of its event.
    fn name_repeats(&mut self, hit: &Hit, kind: Option<&EventKind>, lasti: bool) {
        if !hit.may_repeat() || self.start_at.is_some() || self.writer.is_none() {
            return;
        }
        let settled = match kind {
            Some(EventKind::Return { first_line, .. }) => {
                *first_line != 0 || hit.args.len() <= FRAME_ARG
            }
            _ => true,
        };
        if let Some(token) = settled.then(|| self.repeats.token(kind)).flatten() {
            if lasti {
                hit.repeats_as_keyed(token, LASTI_ARG + 1);
            } else {
                hit.repeats_as(token);
            }
        }
    }

    /// Writes the event of `hit`; `name_return` gives the first line of the
    /// function a return belongs to (0: not known).
    pub fn hit(
        &mut self,
        meaning: &PythonProbe,
        hit: &Hit,
        name_return: &mut dyn FnMut(&ReturnHit) -> u32,
    ) {
        let arg = |i: usize| hit.args.get(i).copied().unwrap_or(0);
        let kind = match meaning.kind {
            ProbeKind::FunctionEntry
            | ProbeKind::FunctionEntryWithLasti
            | ProbeKind::FunctionResume
            | ProbeKind::FunctionReturn
            | ProbeKind::Line => {
                let is_call = !matches!(meaning.kind, ProbeKind::FunctionReturn | ProbeKind::Line);
                let is_return = meaning.kind == ProbeKind::FunctionReturn;
                if !self.in_window(hit.tid, hit.string(1).unwrap_or(""), is_call, is_return) {
                    return;
                }
                let Some(frame) = self.frame(hit) else {
                    self.name_repeats(hit, None, false);
                    return;
                };
                // The hook passes a function's qualified name as a third string
                // (3.11+); else its source says.
                if meaning.kind != ProbeKind::Line {
                    let names = (hit.string(0).unwrap_or(""), hit.string(1).unwrap_or(""));
                    self.name_code(hit.pid, frame, names, hit.string(2));
                }
                match meaning.kind {
                    ProbeKind::FunctionResume => EventKind::Resume { frame },
                    // A frame that ran before (`f_lasti` past -1) resumes.
                    ProbeKind::FunctionEntryWithLasti
                        if hit.args.get(LASTI_ARG).is_some_and(|&l| l as i32 != -1) =>
                    {
                        EventKind::Resume { frame }
                    }
                    ProbeKind::FunctionEntry | ProbeKind::FunctionEntryWithLasti => {
                        EventKind::Call { frame }
                    }
                    ProbeKind::FunctionReturn => EventKind::Return {
                        frame,
                        first_line: name_return(&ReturnHit {
                            pid: hit.pid,
                            args: hit.args,
                            file: hit.string(0).unwrap_or(""),
                            function: hit.string(1).unwrap_or(""),
                            frame,
                            stopped: hit.stopped,
                        }),
                    },
                    _ => EventKind::Line { frame },
                }
            }
            ProbeKind::GcStart => EventKind::GcStart {
                generation: arg(0) as i64 as i32,
            },
            ProbeKind::GcDone => EventKind::GcDone {
                collected: arg(0) as i64,
            },
            ProbeKind::ImportStart => EventKind::ImportStart {
                module: self.intern(hit.string(0).unwrap_or("")),
            },
            ProbeKind::ImportDone => EventKind::ImportDone {
                module: self.intern(hit.string(0).unwrap_or("")),
                found: arg(1) as i32 != 0,
            },
            ProbeKind::Audit => EventKind::Audit {
                event: self.intern(hit.string(0).unwrap_or("")),
            },
        };
        // Only calls, resumes, returns and lines get a token (`Repeats::token`).
        let lasti = meaning.kind == ProbeKind::FunctionEntryWithLasti;
        self.name_repeats(hit, Some(&kind), lasti);
        self.write(hit.tid, hit.ts_ns, kind);
    }
}
