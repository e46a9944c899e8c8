//! The report of a recording: every event replayed and aggregated into a
//! [`Report`], and the report as `--sort`, `--limit`, `--include` and
//! `--exclude` shape it.

use std::io::{Read, Seek};
use std::str::FromStr;

use super::aggregate::Aggregator;
use super::filter::{FileFilter, FilterError};
use super::model::{FunctionSource, FunctionStats, Report};
use super::recording::replay_recording;
use super::replay::Replay;
use super::states::SampleFilter;
use crate::recording::{Completion, RecordError, RecordingReader};

/// Reads every event of `reader` and aggregates them, with the samples of threads
/// on a CPU (the default [`SampleFilter`]). A recording cut short gives a report of
/// what it holds, with `truncated_at` set.
pub fn build_report<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
) -> Result<Report, RecordError> {
    build_report_filtered(reader, SampleFilter::default())
}

/// As [`build_report`], with the samples `filter` keeps.
pub fn build_report_filtered<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: SampleFilter,
) -> Result<Report, RecordError> {
    build_thread_report(reader, filter, None)
}

/// As [`build_report_filtered`], counting the functions and samples of thread
/// `thread` alone (`None`: of every thread).
pub fn build_thread_report<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: SampleFilter,
    thread: Option<u32>,
) -> Result<Report, RecordError> {
    let mut agg = Aggregator::with_filter(reader.header(), filter).only_thread(thread);
    let replay = replay_recording(reader, |_, event, ts, steps, replay| {
        agg.push(event, ts, steps, replay);
        Ok::<(), RecordError>(())
    })?;
    Ok(finish_report(agg, replay, reader))
}

/// The report `agg` made of every event of `reader` (read to the end), replayed
/// by `replay`: ended at the trailer's end, names resolved.
pub(crate) fn finish_report<R: Read>(
    agg: Aggregator,
    replay: Replay,
    reader: &RecordingReader<R>,
) -> Report {
    let (end, lost, truncated_at) = match reader.completion() {
        Completion::Complete(t) => (Some(t.end_ns), t.lost_events, None),
        Completion::Truncated { offset } => (None, 0, Some(offset)),
        Completion::Reading | Completion::Failed { .. } => (None, 0, None),
    };
    let mut report = agg.finish_named(
        replay,
        end,
        |id| reader.string(id).into_owned(),
        reader.qualnames(),
    );
    report.lost_events = report.lost_events.max(lost);
    report.truncated_at = truncated_at;
    report
}

/// Order of the functions table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SortKey {
    /// Time on the stack, callees included (the default).
    #[default]
    Inclusive,
    /// Self time.
    Exclusive,
    /// Calls, or samples when calls are unknown.
    Calls,
}

impl FromStr for SortKey {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "inclusive" => Ok(SortKey::Inclusive),
            "exclusive" => Ok(SortKey::Exclusive),
            "calls" => Ok(SortKey::Calls),
            _ => Err(format!(
                "unknown sort key {s:?} (expected inclusive, exclusive or calls)"
            )),
        }
    }
}

/// `--sort`, `--limit`, `--include`, `--exclude`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReportOptions {
    /// Order of the functions.
    pub sort: SortKey,
    /// Most functions shown; `None` shows all.
    pub limit: Option<usize>,
    /// Globs on the source file name; see [`FileFilter`].
    pub include: Vec<String>,
    /// Globs on the source file name whose functions are left out.
    pub exclude: Vec<String>,
}

impl ReportOptions {
    /// The report as these options show it: functions filtered by file, sorted,
    /// and limited. Other sections are unchanged.
    pub fn apply(&self, report: &Report) -> Result<Report, FilterError> {
        let filter = FileFilter::new(&self.include, &self.exclude)?;
        let mut view = report.clone();
        let key = |f: &FunctionStats| match self.sort {
            SortKey::Inclusive => (f.inclusive_ns, f.exclusive_ns),
            SortKey::Exclusive => (f.exclusive_ns, f.inclusive_ns),
            SortKey::Calls => (f.calls.unwrap_or(f.samples), f.inclusive_ns),
        };
        let shape = |functions: &mut Vec<FunctionStats>| {
            functions.retain(|f| filter.matches(&f.file));
            functions.sort_by(|a, b| {
                key(b)
                    .cmp(&key(a))
                    .then_with(|| a.function.cmp(&b.function))
                    .then_with(|| a.file.cmp(&b.file))
                    .then(a.line.cmp(&b.line))
            });
            if let Some(limit) = self.limit {
                functions.truncate(limit);
            }
        };
        shape(&mut view.functions);
        for p in &mut view.processes {
            shape(&mut p.functions);
        }
        view.return_types.retain(|r| filter.matches(&r.file));
        Ok(view)
    }
}

/// The mode to show: the recording's, unless it was `auto`, then what happened.
pub(crate) fn effective_mode(report: &Report) -> &str {
    match (report.mode.as_str(), report.source) {
        ("auto", FunctionSource::Sampled) => "sample",
        ("auto", _) => "trace",
        (mode, _) => mode,
    }
}

/// Share of the recording's time with function calls traced exactly.
pub fn exact_fraction(report: &Report) -> f64 {
    match report.exact_windows {
        Some(w) if report.duration_ns > 0 => {
            (w.exact_ns as f64 / report.duration_ns as f64).min(1.0)
        }
        Some(_) => 0.0,
        None if report.source == FunctionSource::Traced
            && report.functions.iter().any(|f| f.calls.is_some()) =>
        {
            1.0
        }
        None => 0.0,
    }
}
