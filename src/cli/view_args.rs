//! The arguments of the subcommands that read a recording: `flame`, `report`
//! and `calls`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use pyprobe::session::report::ReportRequest;
use pyprobe::session::views::{self, CallsRequest, FlameRequest};
use pyprobe_recording::analyze::{parse_duration, FileFilter, SliceFilter};
use pyprobe_recording::output::flame::{By, FrameGrain};
use pyprobe_recording::output::report::SortKey as ReportSort;

use super::{SampleArgs, TextFormat};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FlameFormat {
    Svg,
    Collapsed,
    Speedscope,
    Chrome,
    /// Gzipped pprof profile.proto, for `go tool pprof` and continuous profilers
    /// (Pyroscope, Grafana, Parca): samples/count and cpu/nanoseconds for a sampled
    /// recording, calls/count and wall/nanoseconds (exclusive) for a traced one,
    /// each stack labelled with its thread and pid.
    Pprof,
    /// cProfile's .prof, for `python -m pstats`, snakeviz, tuna and gprof2dot:
    /// calls, primitive calls, own and cumulative time and callers of each function
    /// (exact from a traced recording; estimated times, no calls, from a sampled one).
    Pstats,
    /// One self-contained HTML page (as `report --format html`): an interactive
    /// flame graph with the hot spots, GC, imports, audit events, return types
    /// and a per-line heatmap of the hottest files.
    Html,
}

#[derive(Debug, Args)]
pub struct FlameArgs {
    /// A recording made by `pyprobe record`.
    pub file: PathBuf,
    /// Where to write (`-` for standard output). Its extension must fit the
    /// format (.svg; .txt or .folded for collapsed; .json for speedscope and
    /// chrome; .pb.gz or .pprof for pprof; .prof for pstats; .html for html), else pyprobe
    /// refuses; without --format, it chooses the format (.json: speedscope). An existing
    /// file is refused unless --force is given. Default: beside the recording (FILE.svg,
    /// .folded.txt, .speedscope.json, .trace.json, .pb.gz, .prof, .html), or FILE.1.svg,
    /// .2, ... when that exists.
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// What to write (default: from OUT's extension, else svg).
    #[arg(long, value_enum)]
    pub format: Option<FlameFormat>,
    /// Replace an existing output file (OUT, or the default name).
    #[arg(long)]
    pub force: bool,
    /// Chrome trace and speedscope only: drop calls (and GC pauses, imports,
    /// sampled slices) shorter than this, e.g. 50us, 1ms. A call dropped takes
    /// its callees with it (they are shorter still). Without it, an export of
    /// every call estimated above 200 MB keeps only the calls long enough to fit
    /// (see --all); with it, such an export is announced on stderr.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub min_duration: Option<u64>,
    /// Chrome trace and speedscope only: keep every call however large the file.
    /// Without it (or --min-duration), an export of every call estimated above
    /// 200 MB keeps only the calls long enough to fit (the shortest kept is a power
    /// of two of nanoseconds, said on stderr).
    #[arg(long, conflicts_with = "min_duration")]
    pub all: bool,
    /// speedscope only: every call where it happened (evented profiles, as large
    /// as the calls; --all, --min-duration, --include and --exclude imply it).
    /// Without it, a traced recording's speedscope file holds each thread's
    /// stacks weighted by their own time (or calls, --by calls): written at
    /// once, as small as the flame graph, for speedscope's left-heavy and
    /// sandwich views.
    #[arg(long)]
    pub timeline: bool,
    /// Chrome trace and speedscope only: keep only functions whose file matches
    /// this glob (repeatable); GC, import and audit events stay.
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Chrome trace and speedscope only: drop functions whose file matches this
    /// glob (repeatable); their callees stay, under their caller.
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Title of the SVG (default: the target's command line).
    #[arg(long, value_name = "T")]
    pub title: Option<String>,
    /// Keep full file paths in frame names (default: shortened).
    #[arg(long)]
    pub full_paths: bool,
    /// What a frame's width stands for: time (trace: own time, sample: samples)
    /// or calls (trace mode).
    #[arg(long, value_enum, default_value_t = FlameBy::Time)]
    pub by: FlameBy,
    /// Split each sampled frame by the line it was running: `work (app.py:8)
    /// line 11` and `work (app.py:8) line 14` are two boxes, an outer frame's
    /// line being its call. SVG, collapsed and pprof (whose locations then carry
    /// the lines, for `go tool pprof -lines`); traced calls have no line per
    /// frame and stay functions. `report --lines FILE` gives the same per line of
    /// one file, as annotated source.
    #[arg(long)]
    pub lines: bool,
    #[command(flatten)]
    pub samples: SampleArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FlameBy {
    Time,
    Calls,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    Table,
    Json,
    /// One self-contained page, written to a file (-o, default beside the
    /// recording): an interactive flame graph (zoom, search by name or
    /// file.py:42, inverted, per thread or process), the hot spots, GC pauses
    /// and their triggers, imports, audit events, return types, and a per-line
    /// heatmap of the hottest files. Nothing is fetched when it is opened.
    Html,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SortKey {
    Inclusive,
    Exclusive,
    Calls,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A recording made by `pyprobe record`.
    pub file: PathBuf,
    /// What to print or write (default: table; html when -o names a .html file).
    #[arg(long, value_enum)]
    pub format: Option<ReportFormat>,
    /// Order of the functions (default: inclusive time; calls when the recording
    /// has exact counts but no times, as on CPython 3.11 traced through its
    /// probes with --engine ring or int3).
    #[arg(long, value_enum)]
    pub sort: Option<SortKey>,
    /// Show at most N functions (table only; JSON lists all).
    #[arg(long, value_name = "N", default_value_t = 30)]
    pub limit: usize,
    /// Keep only functions whose file matches this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Hide functions whose file matches this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    #[command(flatten)]
    pub samples: SampleArgs,
    /// Instead of the report: the source of FILE (read from disk now), each line
    /// with the samples whose innermost frame ran it (own, and its time: own ×
    /// the sampling interval), the samples with it anywhere on their stack
    /// (total), and the `line` probe's hits on it (`record --probes line`). FILE
    /// is the path the recording names, or its end (`app/main.py`).
    #[arg(long, value_name = "FILE")]
    pub lines: Option<PathBuf>,
    /// Keep full file paths in the table (by default from the package's root:
    /// `sympy/core/mul.py`; JSON always has them whole).
    #[arg(long)]
    pub full_paths: bool,
    /// With --format html: where to write the page (`-` for standard output).
    /// Default: beside the recording (FILE.html, or FILE.1.html when that exists).
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// With --format html: replace an existing OUT.
    #[arg(long)]
    pub force: bool,
}

/// What `pyprobe report` does: print the report, or write the HTML page.
pub enum ReportAction {
    Print(ReportRequest),
    Page(FlameRequest),
}

#[derive(Debug, Args)]
pub struct CallsArgs {
    /// A recording made by `pyprobe record --mode trace`.
    pub file: PathBuf,
    /// Show only what happens inside calls of this function.
    #[arg(long, value_name = "FUNCTION")]
    pub start_at: Option<String>,
    #[arg(long, value_enum, default_value_t = TextFormat::Text)]
    pub format: TextFormat,
    /// Only this thread.
    #[arg(long, value_name = "TID")]
    pub thread: Option<u32>,
    /// Only calls less than N deep (below --start-at's call, if given).
    #[arg(long, value_name = "N")]
    pub max_depth: Option<usize>,
    /// Keep full file paths in the text (JSON always has them).
    #[arg(long)]
    pub full_paths: bool,
}

impl From<FlameFormat> for views::FlameFormat {
    fn from(format: FlameFormat) -> views::FlameFormat {
        match format {
            FlameFormat::Svg => views::FlameFormat::Svg,
            FlameFormat::Collapsed => views::FlameFormat::Collapsed,
            FlameFormat::Speedscope => views::FlameFormat::Speedscope,
            FlameFormat::Chrome => views::FlameFormat::Chrome,
            FlameFormat::Pprof => views::FlameFormat::Pprof,
            FlameFormat::Pstats => views::FlameFormat::Pstats,
            FlameFormat::Html => views::FlameFormat::Html,
        }
    }
}

impl From<FlameBy> for By {
    fn from(by: FlameBy) -> By {
        match by {
            FlameBy::Time => By::Time,
            FlameBy::Calls => By::Calls,
        }
    }
}

impl From<SortKey> for ReportSort {
    fn from(key: SortKey) -> ReportSort {
        match key {
            SortKey::Inclusive => ReportSort::Inclusive,
            SortKey::Exclusive => ReportSort::Exclusive,
            SortKey::Calls => ReportSort::Calls,
        }
    }
}

impl FlameArgs {
    /// Refuses a bad `--include`/`--exclude` glob.
    pub fn request(self) -> anyhow::Result<FlameRequest> {
        let files =
            FileFilter::new(&self.include, &self.exclude).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(FlameRequest {
            file: self.file,
            output: self.output,
            format: self.format.map(Into::into),
            title: self.title,
            full_paths: self.full_paths,
            by: self.by.into(),
            force: self.force,
            samples: self.samples.into(),
            idle_if_all_waiting: false,
            grain: if self.lines {
                FrameGrain::Lines
            } else {
                FrameGrain::Functions
            },
            filter: SliceFilter {
                files,
                min_duration_ns: self.min_duration.unwrap_or(0),
            },
            all: self.all,
            timeline: self.timeline,
        })
    }
}

impl ReportArgs {
    pub fn action(mut self) -> anyhow::Result<ReportAction> {
        let page =
            |p: &PathBuf| views::FlameFormat::for_extension(p) == Some(views::FlameFormat::Html);
        if self.format.is_none() && self.output.as_ref().is_some_and(page) {
            self.format = Some(ReportFormat::Html);
        }
        if self.format == Some(ReportFormat::Html) {
            if self.lines.is_some() {
                anyhow::bail!(
                    "--lines prints one file's annotated source as text; the HTML page \
                     (--format html) has the hottest files' already"
                );
            }
            if !self.include.is_empty() || !self.exclude.is_empty() || self.sort.is_some() {
                anyhow::bail!(
                    "--include, --exclude and --sort shape the table; the HTML page \
                     holds every function (filter it with its search box)"
                );
            }
            return Ok(ReportAction::Page(FlameRequest {
                file: self.file,
                output: self.output,
                format: Some(views::FlameFormat::Html),
                full_paths: self.full_paths,
                force: self.force,
                samples: self.samples.into(),
                ..FlameRequest::default()
            }));
        }
        if self.output.is_some() || self.force {
            anyhow::bail!(
                "-o and --force name the file of the HTML page (--format html, or -o \
                 FILE.html); the table and the JSON go to standard output (redirect it)"
            );
        }
        Ok(ReportAction::Print(self.request()))
    }

    fn request(self) -> ReportRequest {
        let table = self.format.unwrap_or(ReportFormat::Table) == ReportFormat::Table;
        ReportRequest {
            file: self.file,
            json: !table,
            sort: self.sort.map(Into::into),
            // The JSON document lists every function.
            limit: table.then_some(self.limit),
            include: self.include,
            exclude: self.exclude,
            samples: self.samples.into(),
            lines: self.lines,
            full_paths: self.full_paths,
        }
    }
}

impl CallsArgs {
    pub fn request(self) -> CallsRequest {
        CallsRequest {
            file: self.file,
            start_at: self.start_at,
            thread: self.thread,
            max_depth: self.max_depth,
            json: self.format == TextFormat::Json,
            full_paths: self.full_paths,
        }
    }
}
