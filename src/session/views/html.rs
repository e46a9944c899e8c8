//! The HTML report: the recording's report, stacks by thread and per-line
//! counts (its stored views, or read from its events three times) and the
//! hottest files' source read from disk, written as one page.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use pyprobe_recording::analyze::line_counts::{count_lines, LineCounts};
use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::analyze::SampleTally;
use pyprobe_recording::output::flame::{
    choose_measure, default_title, read_folded_by_thread, subtitle, By, FrameGrain, FrameNames,
};
use pyprobe_recording::output::html::{write_html, HtmlPage, SourceFile};
use pyprobe_recording::output::report::{
    build_report_filtered, render_json, ReportOptions, SortKey,
};

use super::reading::{fold_counting_waiting, open, FoldedRecording};
use super::stored::{usable_views, Notes};
use crate::session::report_lines::read_source;

/// Files whose source the heatmap shows, busiest first.
const HEATMAP_FILES: usize = 6;
/// Largest source file put in the page.
const MAX_SOURCE_BYTES: u64 = 1 << 20;
/// Functions the page's tables can list (by own time): the rest only in the
/// flame graph.
const MAX_FUNCTIONS: usize = 1000;

/// The source of `file` for the page, or why it is left out. Only Python
/// source is read: a recording names the files, and a page must not carry
/// any other file of this machine.
fn page_source(file: &str) -> Result<Vec<String>, String> {
    if !file.ends_with(".py") {
        return Err("not a .py file".into());
    }
    read_source(Path::new(file), MAX_SOURCE_BYTES).map_err(|e| format!("cannot read it now: {e}"))
}

/// The per-line counts and source of the busiest files.
fn heatmap(counts: &LineCounts, strings: &[String]) -> Vec<SourceFile> {
    counts
        .files()
        .into_iter()
        .filter(|&(_, own, hits)| own + hits > 0)
        .take(HEATMAP_FILES)
        .map(|(id, ..)| {
            let name = strings.get(id.0 as usize).cloned().unwrap_or_default();
            let text = page_source(&name);
            SourceFile::new(name, &counts.of_file(id), text)
        })
        .collect()
}

/// Writes the HTML report of `file` to `out`; returns which samples it counted.
/// With `idle_if_all_waiting`, a recording whose every sample found its thread
/// waiting is drawn with them all (as `--idle`), and said so.
pub(super) fn render_html(
    file: &Path,
    samples: SampleFilter,
    idle_if_all_waiting: bool,
    title: Option<&str>,
    out: &mut dyn Write,
) -> Result<SampleTally> {
    let (recording, report, lines) =
        match usable_views(file, samples, idle_if_all_waiting, Notes::Say)? {
            Some(views) => FoldedRecording::stored(views, true),
            None => {
                let recording = fold_counting_waiting(
                    file,
                    samples,
                    idle_if_all_waiting,
                    "report",
                    |reader, samples| read_folded_by_thread(reader, samples, FrameGrain::Functions),
                )?;
                let mut reader = open(file)?;
                let report = build_report_filtered(&mut reader, recording.samples)
                    .with_context(|| format!("cannot read {}", file.display()))?;
                let mut reader = open(file)?;
                let (lines, _) = count_lines(&mut reader, recording.samples)
                    .with_context(|| format!("cannot read {}", file.display()))?;
                (recording, report, lines)
            }
        };
    let FoldedRecording {
        folded,
        info,
        strings,
        ..
    } = recording;
    let options = ReportOptions {
        sort: SortKey::Exclusive,
        limit: Some(MAX_FUNCTIONS),
        include: Vec::new(),
        exclude: Vec::new(),
    };
    let view = options.apply(&report).map_err(|e| anyhow::anyhow!("{e}"))?;
    let report_json = render_json(&view);

    let (measure, _) = choose_measure(&folded, &info.header, By::Time);
    let names = FrameNames::new(&strings, true)
        .with_header(&info.header)
        .with_qualnames(&info.qualnames);
    let sources = heatmap(&lines, &strings);
    let title = title.map_or_else(|| default_title(&info.header), str::to_owned);
    let subtitle = subtitle(&folded, &info, measure);
    let page = HtmlPage {
        title: &title,
        subtitle: &subtitle,
        report_json: &report_json,
        sample_interval_ns: info.header.sample_interval_ns,
        sources: &sources,
    };
    write_html(&folded, measure, &names, &page, &mut *out)?;
    Ok(folded.tally)
}
