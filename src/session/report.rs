//! `pyprobe report FILE`: read a recording and print the report.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};

use pyprobe_recording::analyze::{FunctionSource, SampleFilter};
use pyprobe_recording::output::report::{
    build_report_filtered, render_json, render_table_paths, ReportOptions, SortKey,
};
use pyprobe_recording::recording::RecordingReader;

use crate::session::views::{note_cut_short, usable_views, Notes};

/// What `pyprobe report` was asked to do. `--sort` left open picks what the
/// recording can sort by.
pub struct ReportRequest {
    /// The recording.
    pub file: PathBuf,
    /// The JSON document instead of the table.
    pub json: bool,
    pub sort: Option<SortKey>,
    pub limit: Option<usize>,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    /// Which samples count (`--idle`, `--gil`).
    pub samples: SampleFilter,
    /// `--lines FILE`: the annotated source of FILE instead of the report.
    pub lines: Option<PathBuf>,
    /// `--full-paths`: file paths whole in the table.
    pub full_paths: bool,
}

pub fn run(request: &ReportRequest) -> Result<ExitCode> {
    let file = &request.file;
    if let Some(source) = &request.lines {
        if request.json {
            anyhow::bail!("--lines prints the annotated source as text: leave out --format json");
        }
        return crate::session::report_lines::report_lines(file, source, request.samples);
    }
    let report = match usable_views(file, request.samples, false, Notes::Say)? {
        Some(views) => views.report,
        None => {
            let mut reader = RecordingReader::open(file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let report = build_report_filtered(&mut reader, request.samples)
                .with_context(|| format!("cannot read {}", file.display()))?;
            note_cut_short(&reader, file);
            report
        }
    };
    let default_sort = match report.source {
        FunctionSource::ReturnsOnly => SortKey::Calls,
        _ => SortKey::Inclusive,
    };
    let options = ReportOptions {
        sort: request.sort.unwrap_or(default_sort),
        limit: request.limit,
        include: request.include.clone(),
        exclude: request.exclude.clone(),
    };
    let view = options.apply(&report).map_err(|e| anyhow::anyhow!("{e}"))?;
    let text = if request.json {
        render_json(&view) + "\n"
    } else {
        render_table_paths(&view, terminal_width(), request.full_paths)
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("cannot write to standard output")?;
    Ok(ExitCode::SUCCESS)
}

fn terminal_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(120)
}
