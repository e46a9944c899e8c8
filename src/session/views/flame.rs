//! `pyprobe flame`: a recording as a flame graph, folded stacks, or an export for
//! other tools (speedscope, Chrome trace), written to a file the user names or
//! beside the recording.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};

use pyprobe_recording::analyze::folded::{Folded, Measure};
use pyprobe_recording::analyze::{SampleFilter, SampleTally, SliceFilter};
use pyprobe_recording::output::chrome::{write_chrome, ChromeOptions};
use pyprobe_recording::output::file::{check, first_free, numbered, Existing, Output, Stdout};
use pyprobe_recording::output::flame::{
    choose_measure, default_title, thousands, write_collapsed, write_svg, By, FrameGrain,
    FrameNames, SvgOptions,
};
use pyprobe_recording::output::pprof::{build_profile, write_gzipped};
use pyprobe_recording::output::pstats::{build_stats, write_pstats};
use pyprobe_recording::output::speedscope::{write_speedscope, SpeedscopeOptions};
use pyprobe_recording::output::speedscope_stacks::write_speedscope_stacks;
use pyprobe_recording::output::{Census, TraceExport};
use pyprobe_recording::recording::RecordingReader;

use super::reading::{
    is_broken_pipe, note_cut_short, note_samples, open, stacks_of, FoldedRecording, Threads,
};
use super::stored::kept_planned;

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
    /// Gzipped pprof `profile.proto` (go tool pprof, Pyroscope and the like).
    Pprof,
    /// cProfile's `.prof` (pstats, snakeviz, tuna, gprof2dot).
    Pstats,
    /// One self-contained HTML page: flame graph, hot spots, GC, imports, audit
    /// events, return types and the hottest files' source.
    Html,
}

impl FlameFormat {
    /// File name ending used when no output is given.
    fn suffix(self) -> &'static str {
        match self {
            FlameFormat::Svg => ".svg",
            FlameFormat::Collapsed => ".folded.txt",
            FlameFormat::Speedscope => ".speedscope.json",
            FlameFormat::Chrome => ".trace.json",
            FlameFormat::Pprof => ".pb.gz",
            FlameFormat::Pstats => ".prof",
            FlameFormat::Html => ".html",
        }
    }

    /// File name endings (lower case, after a dot) an output of this format may
    /// have.
    fn extensions(self) -> &'static [&'static str] {
        match self {
            FlameFormat::Svg => &["svg"],
            FlameFormat::Collapsed => &["txt", "folded"],
            FlameFormat::Speedscope | FlameFormat::Chrome => &["json"],
            FlameFormat::Pprof => &["pb.gz", "pprof"],
            FlameFormat::Pstats => &["prof", "pstats"],
            FlameFormat::Html => &["html", "htm"],
        }
    }

    /// Whether `path`'s name has one of this format's endings.
    fn fits(self, path: &Path) -> bool {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        self.extensions()
            .iter()
            .any(|e| name.len() > e.len() + 1 && name.ends_with(&format!(".{e}")))
    }

    /// The format an output named `path` gets when none is asked for: `.svg`
    /// flame graph, `.txt` (or `.folded`) collapsed stacks, `.json` speedscope,
    /// `.pb.gz` (or `.pprof`) pprof.
    pub fn for_extension(path: &Path) -> Option<FlameFormat> {
        if FlameFormat::Pprof.fits(path) {
            return Some(FlameFormat::Pprof);
        }
        match extension(path).as_deref() {
            Some("svg") => Some(FlameFormat::Svg),
            Some("txt" | "folded") => Some(FlameFormat::Collapsed),
            Some("json") => Some(FlameFormat::Speedscope),
            Some("prof" | "pstats") => Some(FlameFormat::Pstats),
            Some("html" | "htm") => Some(FlameFormat::Html),
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
            FlameFormat::Pprof => "pprof profile (gzipped protobuf)",
            FlameFormat::Pstats => "pstats profile (cProfile's .prof)",
            FlameFormat::Html => "report page (HTML)",
        }
    }

    /// The `--format` value naming it.
    fn flag(self) -> &'static str {
        match self {
            FlameFormat::Svg => "svg",
            FlameFormat::Collapsed => "collapsed",
            FlameFormat::Speedscope => "speedscope",
            FlameFormat::Chrome => "chrome",
            FlameFormat::Pprof => "pprof",
            FlameFormat::Pstats => "pstats",
            FlameFormat::Html => "html",
        }
    }

    fn what(self) -> &'static str {
        match self {
            FlameFormat::Svg => "flame graph (open it in a browser)",
            FlameFormat::Collapsed => "folded stacks",
            FlameFormat::Speedscope => "speedscope profile (open it at speedscope.app)",
            FlameFormat::Chrome => "Chrome trace (open it in ui.perfetto.dev or chrome://tracing)",
            FlameFormat::Pprof => "pprof profile (go tool pprof reads it; Pyroscope ingests it)",
            FlameFormat::Pstats => {
                "pstats profile (python -m pstats, snakeviz, tuna and gprof2dot read it)"
            }
            FlameFormat::Html => "HTML report (open it in a browser; it needs nothing else)",
        }
    }
}

/// The extension of `path`, in lower case.
pub fn extension(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
}

/// Where the recording goes beside the view `view`: its name with the view's
/// ending replaced by `.pyprobe` (`run.pb.gz` → `run.pyprobe`).
pub fn recording_beside(view: &Path) -> PathBuf {
    if FlameFormat::Pprof.fits(view) {
        let name = view.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(name) = name {
            let lower = name.to_ascii_lowercase();
            let stem_len = FlameFormat::Pprof
                .extensions()
                .iter()
                .find(|e| lower.ends_with(&format!(".{e}")))
                .map_or(name.len(), |e| name.len() - e.len() - 1);
            // The endings are ASCII: the cut falls on a character boundary.
            return view.with_file_name(format!("{}.pyprobe", &name[..stem_len]));
        }
    }
    view.with_extension("pyprobe")
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
    /// Sampled frames as functions, or split by line (`--lines`).
    pub grain: FrameGrain,
    /// When the sample filter leaves every sample out as waiting, count them all
    /// (the view `record` writes itself: a short run still gets its graph).
    pub idle_if_all_waiting: bool,
    /// Replace an existing output.
    pub force: bool,
    /// What the trace exports keep (`--include`, `--exclude`, `--min-duration`).
    pub filter: SliceFilter,
    /// Trace exports keep every call, however large (`--all`).
    pub all: bool,
    /// speedscope: every call where it happened, not each thread's stacks
    /// (`--timeline`).
    pub timeline: bool,
}

impl FlameRequest {
    /// Whether a speedscope file must be the timeline of the calls: asked for,
    /// or by what only the timeline has (a cut by duration, every call, calls
    /// kept by file).
    fn wants_timeline(&self) -> bool {
        self.timeline || self.all || !self.filter.is_empty()
    }

    /// Whether the stacks can be folded for this request (functions, not lines,
    /// under the default sample filter or any other).
    fn by_stacks_possible(&self) -> bool {
        self.grain == FrameGrain::Functions
    }
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

/// Sizes a trace export before it is written. Past the threshold, with no
/// `--min-duration` or `--all` given, it keeps only the calls long enough for
/// the export to fit, and says so; returns that shortest call. Otherwise it
/// warns of a large export, with the filters that shrink it.
fn size_export(request: &FlameRequest, format: FlameFormat, census: &Census) -> Option<u64> {
    let (export, bytes, what) = match format {
        FlameFormat::Chrome => (TraceExport::Chrome, census.chrome_bytes(), "Chrome trace"),
        FlameFormat::Speedscope => (
            TraceExport::Speedscope,
            census.speedscope_bytes(),
            "speedscope file",
        ),
        _ => return None,
    };
    let limit = large_view_bytes();
    if bytes <= limit {
        return None;
    }
    let chosen = request.filter.min_duration_ns == 0 && !request.all;
    if let Some((min_ns, calls, kept_bytes)) =
        census.min_duration_within(export, limit).filter(|_| chosen)
    {
        eprintln!(
            "pyprobe: note: a {what} of every call would be about {}; it keeps the {} calls of \
             {} or longer (of {}), about {}: --min-duration chooses the cut, --all keeps every \
             call",
            human_bytes(bytes),
            thousands(calls),
            format_duration(min_ns),
            thousands(census.calls),
            human_bytes(kept_bytes),
        );
        return Some(min_ns);
    }
    eprintln!(
        "pyprobe: warning: the {what} will be about {} ({} calls and {} samples of the \
         recording's {} events{}); viewers slow down past a few hundred MB: --min-duration \
         (e.g. 100us) drops shorter calls, --include/--exclude GLOB keep or drop functions by \
         file",
        human_bytes(bytes),
        census.calls,
        census.samples,
        census.events,
        if request.filter.is_empty() {
            ""
        } else {
            ", with the filters given"
        },
    );
    None
}

/// A power-of-two count of nanoseconds as people read it: `16.4 µs`, `1.05 ms`.
fn format_duration(ns: u64) -> String {
    match ns {
        n if n >= 1_000_000_000 => format!("{:.3} s", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.3} ms", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.3} µs", n as f64 / 1e3),
        n => format!("{n} ns"),
    }
}

/// Says that `--lines` changed nothing where no frame was sampled: traced
/// calls carry no line per frame.
fn note_lines_unsampled(grain: FrameGrain, folded: &Folded) {
    if grain == FrameGrain::Lines && folded.counts.samples == 0 {
        eprintln!(
            "pyprobe: note: --lines splits sampled frames by the line they ran; this recording \
             holds no samples (its calls were traced, without a line per frame), so its frames \
             stay functions. Record with --mode sample or auto for lines"
        );
    }
}

/// Renders `request.file` in `format` to `out`.
fn render(request: &FlameRequest, format: FlameFormat, out: &mut dyn Write) -> Result<()> {
    let file = &request.file;
    let mut reader = open(file)?;
    let tally = match format {
        FlameFormat::Svg | FlameFormat::Collapsed => {
            let FoldedRecording {
                folded,
                info,
                strings,
                ..
            } = stacks_of(
                file,
                request.samples,
                request.idle_if_all_waiting,
                request.grain,
                Threads::Merged,
                "flame graph",
            )?;
            note_lines_unsampled(request.grain, &folded);
            let (measure, note) = choose_measure(&folded, &info.header, request.by);
            if let Some(note) = note {
                eprintln!("pyprobe: note: {note}");
            }
            let names = FrameNames::new(&strings, request.full_paths)
                .with_header(&info.header)
                .with_qualnames(&info.qualnames);
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
        FlameFormat::Pprof => {
            let stacks = stacks_by_thread(request)?;
            note_lines_unsampled(request.grain, &stacks.folded);
            let (profile, _) = build_profile(
                &stacks.folded,
                &stacks.info,
                &stacks.strings,
                request.samples.idle,
            );
            write_gzipped(&profile, &mut *out)?;
            stacks.folded.tally
        }
        FlameFormat::Pstats => {
            let grain = FrameGrain::Functions;
            let stacks = stacks_of(file, request.samples, false, grain, Threads::Merged, "")?;
            let folded = &stacks.folded;
            let stats = build_stats(folded, &stacks.info, &stacks.strings);
            if stats.sampled {
                eprintln!(
                    "pyprobe: note: a sampled recording: the pstats times are estimates (samples \
                     × the sampling interval) and its call counts 0 (unknown); record with \
                     --mode trace for exact calls and times"
                );
            }
            write_pstats(&stats, &mut *out)?;
            folded.tally
        }
        FlameFormat::Html => super::html::render_html(
            file,
            request.samples,
            request.idle_if_all_waiting,
            request.title.as_deref(),
            &mut *out,
        )?,
        FlameFormat::Speedscope if !request.wants_timeline() && request.by_stacks_possible() => {
            match speedscope_of_stacks(request, &mut *out)? {
                Some(tally) => tally,
                None => speedscope_timeline(request, &mut reader, format, &mut *out)?,
            }
        }
        FlameFormat::Speedscope => speedscope_timeline(request, &mut reader, format, &mut *out)?,
        FlameFormat::Chrome => {
            let options = ChromeOptions {
                full_paths: request.full_paths,
                samples: request.samples,
                filter: request.filter.clone(),
                planned: kept_planned(file),
            };
            let before = |c: &Census| size_export(request, format, c);
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

/// The stacks of `request`'s recording, each thread's apart.
fn stacks_by_thread(request: &FlameRequest) -> Result<FoldedRecording> {
    stacks_of(
        &request.file,
        request.samples,
        false,
        request.grain,
        Threads::Apart,
        "",
    )
}

/// The speedscope file of every call where it happened (evented profiles), as
/// large as the calls (cut to about 200 MB unless `--all`).
fn speedscope_timeline(
    request: &FlameRequest,
    reader: &mut RecordingReader<BufReader<File>>,
    format: FlameFormat,
    out: &mut dyn Write,
) -> Result<SampleTally> {
    let file = &request.file;
    let options = SpeedscopeOptions {
        full_paths: request.full_paths,
        samples: request.samples,
        filter: request.filter.clone(),
        planned: kept_planned(file),
        ..SpeedscopeOptions::default()
    };
    let before = |c: &Census| size_export(request, format, c);
    let tally = write_speedscope(reader, &options, before, out)
        .with_context(|| format!("cannot convert {}", file.display()))?;
    note_cut_short(reader, file);
    Ok(tally)
}

/// The speedscope file of a traced recording's stacks (sampled profiles, one
/// per thread, weighted by own time or calls), from the stacks every view
/// shares; `None` when the recording's stacks are samples (its timeline is
/// as small as its samples).
fn speedscope_of_stacks(
    request: &FlameRequest,
    out: &mut dyn Write,
) -> Result<Option<SampleTally>> {
    let FoldedRecording {
        folded,
        info,
        strings,
        ..
    } = stacks_by_thread(request)?;
    let (measure, note) = choose_measure(&folded, &info.header, request.by);
    if measure == Measure::Samples {
        return Ok(None);
    }
    if let Some(note) = note {
        eprintln!("pyprobe: note: {note}");
    }
    let names = FrameNames::new(&strings, request.full_paths)
        .with_header(&info.header)
        .with_qualnames(&info.qualnames);
    let title = request
        .title
        .clone()
        .unwrap_or_else(|| default_title(&info.header));
    write_speedscope_stacks(&folded, measure, &names, &title, out)?;
    eprintln!(
        "pyprobe: note: the speedscope file holds each thread's stacks with their {} (its \
         left-heavy and sandwich views); --timeline writes every call where it happened",
        if measure == Measure::Calls {
            "calls"
        } else {
            "own time"
        }
    );
    Ok(Some(folded.tally))
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
    // A file that is no recording is said to be one, not a failure to write.
    open(&request.file)?;
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
            if !format.fits(out) {
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
                 .svg (flame graph), .txt (collapsed stacks), .json (speedscope; a Chrome trace \
                 with --format chrome), .pb.gz (pprof), .prof (pstats) or .html (report page), or give --format",
                out.display()
            )
        }),
    }
}

/// `pyprobe flame FILE`.
pub fn flame(request: &FlameRequest) -> Result<ExitCode> {
    let format = flame_format(request)?;
    if (!request.filter.is_empty() || request.all)
        && !matches!(format, FlameFormat::Chrome | FlameFormat::Speedscope)
    {
        bail!(
            "--include, --exclude, --min-duration and --all filter the trace exports (--format \
             chrome or speedscope), not a {}",
            format.short()
        );
    }
    if request.grain == FrameGrain::Lines
        && matches!(
            format,
            FlameFormat::Chrome | FlameFormat::Speedscope | FlameFormat::Html
        )
    {
        bail!(
            "--lines splits the frames of a flame graph, collapsed stacks or pprof profile by \
             line; a {} keeps functions",
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
/// speedscope, `.txt` or `.folded` collapsed stacks, `.pb.gz` pprof) from the recording at
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
        idle_if_all_waiting: true,
        ..FlameRequest::default()
    };
    render_to_file(&request, format, out, Stdout::Refused, existing)?;
    Ok(true)
}
