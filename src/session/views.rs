//! `pyprobe flame`, `pyprobe calls` and `pyprobe top`: read a recording (or
//! record one) and hand it to a view.

use std::fs::File;
use std::io::{self, BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::analyze::{SampleFilter, SampleTally, SliceFilter};
use crate::output::calls::{write_calls, CallsOptions};
use crate::output::chrome::{write_chrome, ChromeOptions};
use crate::output::file::{check, first_free, numbered, partial_path, Existing, Output, Stdout};
use crate::output::flame::{
    choose_measure, read_folded_filtered, write_collapsed, write_svg, By, FrameNames, SvgOptions,
    ViewError,
};
use crate::output::report::build_report_filtered;
use crate::output::speedscope::{write_speedscope, SpeedscopeOptions};
use crate::output::top::{render_text, run_tui, snapshot_between, Snapshot, TopSort, ViewState};
use crate::output::Census;
use crate::record::{Completion, RecordingReader};

/// Output formats of `pyprobe flame`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FlameFormat {
    /// Flame graph (inferno).
    #[default]
    Svg,
    /// Folded stacks.
    Collapsed,
    /// speedscope JSON.
    Speedscope,
    /// Chrome trace event JSON (Perfetto).
    Chrome,
}

impl FlameFormat {
    /// File name ending used when no output is given.
    fn suffix(self) -> &'static str {
        match self {
            FlameFormat::Svg => ".svg",
            FlameFormat::Collapsed => ".folded.txt",
            FlameFormat::Speedscope => ".speedscope.json",
            FlameFormat::Chrome => ".trace.json",
        }
    }

    /// File name extensions (lower case) an output of this format may have.
    fn extensions(self) -> &'static [&'static str] {
        match self {
            FlameFormat::Svg => &["svg"],
            FlameFormat::Collapsed => &["txt", "folded"],
            FlameFormat::Speedscope | FlameFormat::Chrome => &["json"],
        }
    }

    /// The format an output named `path` gets when none is asked for: `.svg`
    /// flame graph, `.txt` (or `.folded`) collapsed stacks, `.json` speedscope.
    pub fn for_extension(path: &Path) -> Option<FlameFormat> {
        match extension(path).as_deref() {
            Some("svg") => Some(FlameFormat::Svg),
            Some("txt" | "folded") => Some(FlameFormat::Collapsed),
            Some("json") => Some(FlameFormat::Speedscope),
            _ => None,
        }
    }

    /// What it is, in a few words.
    fn short(self) -> &'static str {
        match self {
            FlameFormat::Svg => "flame graph (SVG)",
            FlameFormat::Collapsed => "collapsed stacks (text)",
            FlameFormat::Speedscope => "speedscope profile (JSON)",
            FlameFormat::Chrome => "Chrome trace (JSON)",
        }
    }

    /// The `--format` value naming it.
    fn flag(self) -> &'static str {
        match self {
            FlameFormat::Svg => "svg",
            FlameFormat::Collapsed => "collapsed",
            FlameFormat::Speedscope => "speedscope",
            FlameFormat::Chrome => "chrome",
        }
    }

    fn what(self) -> &'static str {
        match self {
            FlameFormat::Svg => "flame graph (open it in a browser)",
            FlameFormat::Collapsed => "folded stacks",
            FlameFormat::Speedscope => "speedscope profile (open it at speedscope.app)",
            FlameFormat::Chrome => "Chrome trace (open it in ui.perfetto.dev or chrome://tracing)",
        }
    }
}

/// The extension of `path`, in lower case.
pub fn extension(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
}

/// Whether `path` is a FIFO now (links followed): whatever it is named, it takes
/// any format.
pub fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

/// What `pyprobe flame` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct FlameRequest {
    /// The recording.
    pub file: PathBuf,
    /// Where to write; `-` for standard output; default beside the recording.
    pub output: Option<PathBuf>,
    /// `None`: as the output's extension says, else SVG.
    pub format: Option<FlameFormat>,
    pub title: Option<String>,
    pub full_paths: bool,
    pub by: By,
    /// Which samples count (`--idle`, `--gil`).
    pub samples: SampleFilter,
    /// Replace an existing output.
    pub force: bool,
    /// What the trace exports keep (`--include`, `--exclude`, `--min-duration`).
    pub filter: SliceFilter,
}

/// Exports estimated larger than this many bytes are announced before they are
/// written, with the filters that shrink them. `PYPROBE_LARGE_VIEW_BYTES`
/// overrides it, for tests.
const LARGE_VIEW_BYTES: u64 = 200_000_000;

fn large_view_bytes() -> u64 {
    std::env::var("PYPROBE_LARGE_VIEW_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LARGE_VIEW_BYTES)
}

/// `bytes` for people: `230 MB`, `1.6 GB`.
fn human_bytes(bytes: u64) -> String {
    match bytes {
        b if b >= 10_000_000_000 => format!("{} GB", b / 1_000_000_000),
        b if b >= 1_000_000_000 => format!("{:.1} GB", b as f64 / 1e9),
        b if b >= 100_000_000 => format!("{} MB", b / 1_000_000),
        b if b >= 1_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        b if b >= 1_000 => format!("{} kB", b / 1_000),
        b => format!("{b} bytes"),
    }
}

/// Says on stderr, before it is written, that an export will be large, and how
/// to make it smaller.
fn warn_if_large(format: FlameFormat, census: &Census, filtered: bool) {
    let bytes = match format {
        FlameFormat::Chrome => census.chrome_bytes(),
        FlameFormat::Speedscope => census.speedscope_bytes(),
        FlameFormat::Svg | FlameFormat::Collapsed => return,
    };
    if bytes <= large_view_bytes() {
        return;
    }
    let what = match format {
        FlameFormat::Chrome => "Chrome trace",
        _ => "speedscope file",
    };
    eprintln!(
        "pyprobe: warning: the {what} will be about {} ({} calls and {} samples of the \
         recording's {} events{}); viewers slow down past a few hundred MB: --min-duration \
         (e.g. 100us) drops shorter calls, --include/--exclude GLOB keep or drop functions by \
         file",
        human_bytes(bytes),
        census.calls,
        census.samples,
        census.events,
        if filtered {
            ", with the filters given"
        } else {
            ""
        },
    );
}

fn open(file: &Path) -> Result<RecordingReader<io::BufReader<File>>> {
    RecordingReader::open(file).with_context(|| format!("cannot read {}", file.display()))
}

fn note_cut_short<R: io::Read>(reader: &RecordingReader<R>, file: &Path) {
    if let Completion::Truncated { offset } = reader.completion() {
        eprintln!(
            "pyprobe: note: {} was cut short (no end marker): read every whole chunk before offset {offset}",
            file.display()
        );
    }
}

/// Whether an error is the reader of our output going away (`| head`).
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
            || c.downcast_ref::<ViewError>().is_some_and(
                |v| matches!(v, ViewError::Io(e) if e.kind() == io::ErrorKind::BrokenPipe),
            )
    })
}

/// Says which samples a view counted and what it left out, unless it was all of them.
fn note_samples(tally: &SampleTally) {
    if tally.left_out() > 0 || tally.cpu_unknown > 0 || tally.filter != SampleFilter::default() {
        for line in tally.notes() {
            eprintln!("pyprobe: {line}");
        }
    }
}

/// Renders `request.file` in `format` to `out`.
fn render(request: &FlameRequest, format: FlameFormat, out: &mut dyn Write) -> Result<()> {
    let file = &request.file;
    let mut reader = open(file)?;
    let filtered = !request.filter.is_empty();
    let tally = match format {
        FlameFormat::Svg | FlameFormat::Collapsed => {
            let (folded, info) = read_folded_filtered(&mut reader, request.samples)
                .with_context(|| format!("cannot read {}", file.display()))?;
            note_cut_short(&reader, file);
            let (measure, note) = choose_measure(&folded, &info.header, request.by);
            if let Some(note) = note {
                eprintln!("pyprobe: note: {note}");
            }
            let names =
                FrameNames::new(reader.strings(), request.full_paths).with_header(&info.header);
            if format == FlameFormat::Svg {
                let options = SvgOptions {
                    title: request.title.as_deref(),
                };
                write_svg(&folded, &info, measure, &names, &options, &mut *out)?;
            } else {
                write_collapsed(&folded, measure, &names, &mut *out)?;
            }
            folded.tally
        }
        FlameFormat::Speedscope => {
            let options = SpeedscopeOptions {
                full_paths: request.full_paths,
                samples: request.samples,
                filter: request.filter.clone(),
                ..SpeedscopeOptions::default()
            };
            let before = |c: &Census| warn_if_large(format, c, filtered);
            let tally = write_speedscope(&mut reader, &options, before, &mut *out)
                .with_context(|| format!("cannot convert {}", file.display()))?;
            note_cut_short(&reader, file);
            tally
        }
        FlameFormat::Chrome => {
            let options = ChromeOptions {
                full_paths: request.full_paths,
                samples: request.samples,
                filter: request.filter.clone(),
            };
            let before = |c: &Census| warn_if_large(format, c, filtered);
            let tally = write_chrome(&mut reader, &options, before, &mut *out)
                .with_context(|| format!("cannot convert {}", file.display()))?;
            note_cut_short(&reader, file);
            tally
        }
    };
    note_samples(&tally);
    out.flush()?;
    Ok(())
}

/// Writes the view to `path` (a FIFO, or a new file renamed over `path` once the
/// view is complete: a failure leaves whatever was at `path` untouched).
fn render_to_file(
    request: &FlameRequest,
    format: FlameFormat,
    path: &Path,
    stdout: Stdout,
    existing: Existing,
) -> Result<()> {
    let output = Output::replace(path, stdout, existing)?;
    let mut out = BufWriter::new(output.file());
    render(request, format, &mut out)
        .and_then(|()| out.flush().context("cannot write the output"))
        .with_context(|| format!("cannot write {}", path.display()))?;
    drop(out);
    output.commit()?;
    Ok(())
}

/// The default output: the recording's name with the format's ending.
fn default_output(file: &Path, format: FlameFormat) -> PathBuf {
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "pyprobe".into());
    file.with_file_name(format!("{stem}{}", format.suffix()))
}

/// The format to write: `--format`, else what the output's extension says, else
/// SVG. An output named for another format is refused (a FIFO takes any).
fn flame_format(request: &FlameRequest) -> Result<FlameFormat> {
    let named = request
        .output
        .as_deref()
        .filter(|p| p.as_os_str() != "-" && !is_fifo(p));
    let Some(out) = named else {
        return Ok(request.format.unwrap_or_default());
    };
    // What OUT is first (a device, a directory): its name is beside the point.
    check(out, Stdout::Allowed, Existing::Replace)?;
    match request.format {
        Some(format) => {
            let fits = extension(out).is_some_and(|e| format.extensions().contains(&e.as_str()));
            if !fits {
                let endings: Vec<String> = format
                    .extensions()
                    .iter()
                    .map(|e| format!(".{e}"))
                    .collect();
                bail!(
                    "{} does not fit --format {}, which writes a {}: name the output {}, or \
                     `-o -` for standard output",
                    out.display(),
                    format.flag(),
                    format.short(),
                    endings.join(" or ")
                );
            }
            Ok(format)
        }
        None => FlameFormat::for_extension(out).ok_or_else(|| {
            anyhow::anyhow!(
                "pyprobe flame cannot tell what to write to {} from its extension: name it \
                 .svg (flame graph), .txt (collapsed stacks) or .json (speedscope; a Chrome trace \
                 with --format chrome), or give --format",
                out.display()
            )
        }),
    }
}

/// `pyprobe flame FILE`.
pub fn flame(request: &FlameRequest) -> Result<ExitCode> {
    let format = flame_format(request)?;
    if !request.filter.is_empty()
        && !matches!(format, FlameFormat::Chrome | FlameFormat::Speedscope)
    {
        bail!(
            "--include, --exclude and --min-duration filter the trace exports (--format chrome \
             or speedscope), not a {}",
            format.short()
        );
    }
    let existing = if request.force {
        Existing::Replace
    } else {
        Existing::Keep
    };
    match &request.output {
        Some(p) if p.as_os_str() == "-" => {
            let stdout = io::stdout();
            let mut out = BufWriter::new(stdout.lock());
            match render(request, format, &mut out) {
                Err(e) if is_broken_pipe(&e) => {}
                other => other?,
            }
        }
        Some(path) => {
            render_to_file(request, format, path, Stdout::Allowed, existing)?;
            eprintln!("pyprobe: wrote the {} to {}", format.what(), path.display());
        }
        None => {
            // Beside the recording, under the next free name unless --force.
            let base = default_output(&request.file, format);
            let path = match existing {
                Existing::Replace => base.clone(),
                Existing::Keep => first_free(|n| numbered(&base, format.suffix(), n), false)
                    .with_context(|| {
                        format!("cannot find a free name beside {}", base.display())
                    })?,
            };
            render_to_file(request, format, &path, Stdout::Allowed, existing)?;
            let taken = if path == base {
                String::new()
            } else {
                format!(" ({} exists; --force replaces it)", base.display())
            };
            eprintln!(
                "pyprobe: wrote the {} to {}{taken}",
                format.what(),
                path.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the view `out`'s extension names (`.svg` flame graph, `.json`
/// speedscope, `.txt` or `.folded` collapsed stacks) from the recording at
/// `recording`, with the samples `samples` keeps. Returns `false`, writing
/// nothing, for any other extension.
pub fn write_view_for_extension(
    recording: &Path,
    out: &Path,
    samples: SampleFilter,
    existing: Existing,
) -> Result<bool> {
    let Some(format) = FlameFormat::for_extension(out) else {
        return Ok(false);
    };
    let request = FlameRequest {
        file: recording.to_path_buf(),
        output: Some(out.to_path_buf()),
        format: Some(format),
        samples,
        ..FlameRequest::default()
    };
    render_to_file(&request, format, out, Stdout::Refused, existing)?;
    Ok(true)
}

/// What `pyprobe calls` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct CallsRequest {
    pub file: PathBuf,
    pub start_at: Option<String>,
    pub thread: Option<u32>,
    pub max_depth: Option<usize>,
    pub json: bool,
    pub full_paths: bool,
}

/// `pyprobe calls FILE`.
pub fn calls(request: &CallsRequest) -> Result<ExitCode> {
    let file = &request.file;
    let mut reader = open(file)?;
    let options = CallsOptions {
        start_at: request.start_at.clone(),
        thread: request.thread,
        max_depth: request.max_depth,
        json: request.json,
        full_paths: request.full_paths,
    };
    let stdout = io::stdout();
    let out = BufWriter::new(stdout.lock());
    let summary = match write_calls(&mut reader, &options, out) {
        Ok(s) => s,
        Err(ViewError::Io(e)) if e.kind() == io::ErrorKind::BrokenPipe => {
            return Ok(ExitCode::SUCCESS)
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", file.display())),
    };
    note_cut_short(&reader, file);
    if summary.calls + summary.returns == 0 {
        if summary.samples > 0 {
            eprintln!(
                "pyprobe: note: {} holds samples, not calls: there is no call flow (see `pyprobe flame` and `pyprobe report`)",
                file.display()
            );
        } else {
            eprintln!(
                "pyprobe: note: {} holds no call or return events",
                file.display()
            );
        }
    } else if let Some(f) = &request.start_at {
        if summary.start_at_calls == 0 {
            eprintln!("pyprobe: note: no call of `{f}` in {}", file.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What `pyprobe top` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct TopRequest {
    pub pid: Option<i32>,
    pub command: Vec<String>,
    pub all: bool,
    /// Watch a recording (possibly being written) instead of a process.
    pub from: Option<PathBuf>,
    pub interval: f64,
    pub limit: usize,
    pub once: bool,
    /// Which samples count (`--idle`, `--gil`).
    pub samples: SampleFilter,
}

/// Opens a recording that may still be written: its `.partial` while the recorder
/// runs, the recording itself once it has ended.
fn open_live(
    file: &Path,
) -> Result<RecordingReader<io::BufReader<File>>, crate::record::RecordError> {
    match RecordingReader::open(&partial_path(file)) {
        Err(crate::record::RecordError::Io { source, .. })
            if source.kind() == io::ErrorKind::NotFound =>
        {
            RecordingReader::open(file)
        }
        other => other,
    }
}

/// A data source reading a recording again at each refresh: the numbers cover
/// what was added since the previous one.
fn recording_source(file: PathBuf, samples: SampleFilter) -> impl FnMut() -> Snapshot {
    let mut previous = None;
    move || {
        let report = open_live(&file)
            .map_err(anyhow::Error::from)
            .and_then(|mut r| build_report_filtered(&mut r, samples).map_err(anyhow::Error::from));
        match report {
            Ok(report) => {
                let mut s = snapshot_between(previous.as_ref(), &report);
                let grown = previous
                    .as_ref()
                    .is_none_or(|p: &crate::analyze::Report| p.events != report.events);
                if !grown {
                    // Nothing new (the recording is finished): show the whole of it.
                    s = snapshot_between(None, &report);
                    s.status = Some(format!(
                        "{}: no new events; whole recording shown",
                        file.display()
                    ));
                } else {
                    s.status = Some(format!("from {}", file.display()));
                }
                previous = Some(report);
                s
            }
            Err(e) => Snapshot {
                status: Some(format!("cannot read {}: {e:#}", file.display())),
                ..Snapshot::default()
            },
        }
    }
}

/// Whether `pid` runs a CPython pyprobe can read, owned by this user (cheap test
/// first: a mapped file named like python, then the interpreter itself).
fn is_python_of_this_user(pid: i32) -> bool {
    let Ok(status) = crate::process::ProcessStatus::read(pid) else {
        return false;
    };
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if status.kernel_thread || status.state == 'Z' || (uid != 0 && status.uid != uid) {
        return false;
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    maps.contains("python") && crate::python::walker::find_interpreter_object(pid).is_ok()
}

/// One recorder of `top --all`, and the view of its recording.
struct Watched {
    recorder: std::process::Child,
    source: Box<dyn FnMut() -> Snapshot>,
}

/// The processes `top --all` watches: one recorder each.
struct AllProcesses {
    dir: tempfile::TempDir,
    exe: PathBuf,
    me: i32,
    watched: std::collections::HashMap<i32, Watched>,
    /// Processes found not to be (readable) Python, until they end.
    not_python: std::collections::HashSet<i32>,
    /// Which samples count.
    samples: SampleFilter,
}

impl AllProcesses {
    /// Starts recorders for new Python processes, drops ended ones, and merges what
    /// every recording shows now.
    fn refresh(&mut self) -> Snapshot {
        let pids: Vec<i32> = std::fs::read_dir("/proc")
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let alive: std::collections::HashSet<i32> = pids.iter().copied().collect();
        self.watched.retain(|pid, w| {
            let ended = !alive.contains(pid) && matches!(w.recorder.try_wait(), Ok(Some(_)));
            if ended {
                let _ = w.recorder.wait();
            }
            !ended
        });
        self.not_python.retain(|pid| alive.contains(pid));
        for pid in pids {
            if pid == self.me || self.watched.contains_key(&pid) || self.not_python.contains(&pid) {
                continue;
            }
            if !is_python_of_this_user(pid) {
                self.not_python.insert(pid);
                continue;
            }
            let recording = self.dir.path().join(format!("{pid}.pyprobe"));
            let recorder = std::process::Command::new(&self.exe)
                .args([
                    "record",
                    "--mode",
                    "auto",
                    "-r",
                    &TOP_SAMPLE_RATE.to_string(),
                    "-p",
                    &pid.to_string(),
                    // A pid used again while `top --all` runs: its own file.
                    "--force",
                    "-o",
                ])
                .arg(&recording)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
            match recorder {
                Ok(recorder) => {
                    let source = Box::new(recording_source(recording, self.samples));
                    self.watched.insert(pid, Watched { recorder, source });
                }
                Err(_) => {
                    self.not_python.insert(pid);
                }
            }
        }
        let mut merged = Snapshot {
            mode: crate::output::top::TopMode::Sample,
            filter: self.samples,
            ..Snapshot::default()
        };
        for w in self.watched.values_mut() {
            let s = (w.source)();
            merged.rows.extend(s.rows);
            merged.window_ns = merged.window_ns.max(s.window_ns);
            merged.gc_per_s += s.gc_per_s;
            merged.imports_per_s += s.imports_per_s;
            merged.events += s.events;
            merged.samples += s.samples;
            merged.left_out += s.left_out;
            merged.state_unknown += s.state_unknown;
            merged.lost += s.lost;
        }
        merged.status = Some(format!("{} Python processes watched", self.watched.len()));
        merged
    }

    /// Stops every recorder; SIGINT makes each detach cleanly.
    fn stop(&mut self) {
        for w in self.watched.values() {
            // SAFETY: plain kill(2) of our own child.
            unsafe { libc::kill(w.recorder.id() as i32, libc::SIGINT) };
        }
        for w in self.watched.values_mut() {
            let _ = w.recorder.wait();
        }
    }
}

/// `top --all`: every Python process this user may trace; processes that start or
/// end while it runs come and go at the next refresh.
fn all_top(
    interval: Duration,
    limit: usize,
    once: bool,
    samples: SampleFilter,
) -> Result<ExitCode> {
    let mut all = AllProcesses {
        dir: tempfile::tempdir().context("cannot create a temporary directory")?,
        exe: std::env::current_exe().context("cannot find pyprobe's own executable")?,
        me: std::process::id() as i32,
        watched: Default::default(),
        not_python: Default::default(),
        samples,
    };
    let shown = if once {
        all.refresh();
        std::thread::sleep(interval);
        let snapshot = all.refresh();
        print_snapshot(&snapshot, limit)
    } else {
        let state = ViewState {
            sort: TopSort::Hot,
            paused: false,
            interval,
            limit,
        };
        run_tui(|| all.refresh(), state).context("the terminal view failed")
    };
    all.stop();
    shown?;
    Ok(ExitCode::SUCCESS)
}

/// Samples per second for `top --once -p PID`.
const TOP_SAMPLE_RATE: u32 = 200;

/// `pyprobe top`.
pub fn top(request: &TopRequest) -> Result<ExitCode> {
    if !(request.interval > 0.0 && request.interval.is_finite()) {
        bail!("--interval must be a positive number of seconds");
    }
    let interval = Duration::from_secs_f64(request.interval);
    let once = request.once || !io::stdout().is_terminal();
    let limit = request.limit.max(1);
    if let Some(file) = &request.from {
        if once {
            let mut reader =
                open_live(file).with_context(|| format!("cannot read {}", file.display()))?;
            let report = build_report_filtered(&mut reader, request.samples)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let snapshot = snapshot_between(None, &report);
            print_snapshot(&snapshot, limit)?;
            return Ok(ExitCode::SUCCESS);
        }
        let state = ViewState {
            sort: TopSort::Hot,
            paused: false,
            interval,
            limit,
        };
        run_tui(recording_source(file.clone(), request.samples), state)
            .context("the terminal view failed")?;
        return Ok(ExitCode::SUCCESS);
    }
    if request.all {
        return all_top(interval, limit, once, request.samples);
    }
    if !request.command.is_empty() {
        if once {
            bail!("`top --once -- CMD` is not supported: record it (`pyprobe record -- CMD`) and use `top --from`");
        }
        return live_top(
            Watch::Command(&request.command),
            interval,
            limit,
            request.samples,
        );
    }
    let Some(pid) = request.pid else {
        eprintln!(
            "pyprobe: top: nothing to watch: give -p PID, --from RECORDING (or -- CMD, --all)"
        );
        return Ok(ExitCode::from(2));
    };
    if !once {
        return live_top(Watch::Pid(pid), interval, limit, request.samples);
    }
    // One snapshot of a live process: record it for one interval, sampling
    // stacks (GC and imports exact where the build has their probes).
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let recording = dir.path().join("top.pyprobe");
    let record = crate::session::record::RecordRequest {
        pid: Some(pid),
        output: Some(recording.clone()),
        duration: Some(request.interval),
        mode: "auto".into(),
        rate: TOP_SAMPLE_RATE,
        ..Default::default()
    };
    let code = crate::session::record::run(&record)?;
    if !recording.exists() {
        bail!("nothing was recorded from process {pid}");
    }
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    let mut reader = open(&recording)?;
    let report = build_report_filtered(&mut reader, request.samples)
        .context("cannot read the snapshot's recording")?;
    print_snapshot(&snapshot_between(None, &report), limit)?;
    Ok(ExitCode::SUCCESS)
}

/// The live view of a running process: a recorder (`pyprobe record -p PID`, a child
/// process with its own ptrace thread) writes a recording that the view re-reads at
/// each interval. Quitting stops the recorder with SIGINT, which detaches cleanly.
/// What a live `top` watches.
enum Watch<'a> {
    Pid(i32),
    /// A command started under the recorder; it is ended (SIGTERM) when the view quits.
    Command(&'a [String]),
}

fn live_top(
    watch: Watch,
    interval: Duration,
    limit: usize,
    samples: SampleFilter,
) -> Result<ExitCode> {
    let target = match &watch {
        Watch::Pid(pid) => {
            crate::process::status::check_inspectable(*pid)?;
            vec!["-p".to_string(), pid.to_string()]
        }
        Watch::Command(cmd) => std::iter::once("--".to_string())
            .chain(cmd.iter().cloned())
            .collect(),
    };
    let what = match &watch {
        Watch::Pid(pid) => format!("process {pid}"),
        Watch::Command(cmd) => format!("`{}`", cmd.join(" ")),
    };
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let recording = dir.path().join("top.pyprobe");
    let log_path = dir.path().join("record.log");
    let log = std::fs::File::create(&log_path).context("cannot create the recorder's log")?;
    let exe = std::env::current_exe().context("cannot find pyprobe's own executable")?;
    let mut recorder = std::process::Command::new(exe)
        .args([
            "record",
            "--mode",
            "auto",
            "-r",
            &TOP_SAMPLE_RATE.to_string(),
            "-o",
        ])
        .arg(&recording)
        .args(&target)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .context("cannot start the recorder")?;
    // Wait (bounded) for the recording to appear: attach can fail (permissions).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !recording.exists() && !partial_path(&recording).exists() {
        if let Some(status) = recorder.try_wait()? {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            bail!("cannot watch {what} ({status}): {}", log.trim());
        }
        if std::time::Instant::now() > deadline {
            let _ = recorder.kill();
            bail!("{what}: the recorder did not start within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let state = ViewState {
        sort: TopSort::Hot,
        paused: false,
        interval,
        limit,
    };
    let shown = run_tui(recording_source(recording.clone(), samples), state);
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(recorder.id() as i32, libc::SIGINT) };
    if let Watch::Command(_) = watch {
        // The recorder waits for the command it started: end it, as quitting means.
        if let Ok(reader) = open_live(&recording) {
            let pid = reader.header().pid as i32;
            if pid > 0 {
                // SAFETY: plain kill(2) of the command the recorder started.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
    let _ = recorder.wait();
    shown.context("the terminal view failed")?;
    Ok(ExitCode::SUCCESS)
}

fn print_snapshot(snapshot: &Snapshot, limit: usize) -> Result<()> {
    let text = render_text(snapshot, TopSort::Hot, limit);
    match io::stdout().write_all(text.as_bytes()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("cannot write to standard output"),
    }
}
