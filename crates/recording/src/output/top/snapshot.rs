//! The numbers of one refresh: a [`Snapshot`] of the hottest functions, made
//! from two successive reports of a growing recording.

use crate::analyze::{FunctionSource, Report, SampleFilter};
use std::collections::HashMap;

/// Where the numbers come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TopMode {
    /// Exact calls and times.
    #[default]
    Trace,
    /// Stack samples.
    Sample,
}

/// One function over the snapshot's window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopRow {
    /// Process the function runs in.
    pub pid: u32,
    /// Function name as views show it (`Class.method` when known).
    pub function: String,
    /// Source file (full path).
    pub file: String,
    /// First line (trace) or a sampled line (sample).
    pub line: u32,
    /// Calls finished in the window (trace mode).
    pub calls: Option<u64>,
    /// Calls per second (trace mode).
    pub(crate) calls_per_s: Option<f64>,
    /// Share of the window spent in the function itself, % (samples as leaf in
    /// sample mode). May pass 100 with several threads.
    pub(crate) own_pct: f64,
    /// Share of the window with the function on the stack, %.
    pub(crate) total_pct: f64,
    /// Time in the function itself, ns (estimated from samples in sample mode).
    pub own_ns: u64,
    /// Samples with the function as leaf (sample mode).
    pub samples: u64,
}

/// What `top` shows at one refresh.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The process watched (0 for several).
    pub pid: u32,
    /// CPython version.
    pub python: String,
    /// Trace or sample.
    pub mode: TopMode,
    /// Time the numbers cover, ns.
    pub window_ns: u64,
    /// The functions, any order (the view sorts).
    pub rows: Vec<TopRow>,
    /// Collections per second.
    pub gc_per_s: f64,
    /// Share of the window spent in GC, %.
    pub gc_pct: f64,
    /// Imports per second.
    pub imports_per_s: f64,
    /// Events in the window.
    pub events: u64,
    /// Samples counted in the window (sample mode).
    pub samples: u64,
    /// Samples left out in the window by `filter` (a waiting thread's, by default).
    pub left_out: u64,
    /// Which samples count.
    pub filter: SampleFilter,
    /// Samples counted in the window whose thread's state was not recorded.
    pub state_unknown: u64,
    /// Events lost in the window.
    pub lost: u64,
    /// A line for the status bar (where the data comes from, an error...).
    pub status: Option<String>,
    /// The threads with events in the window, by id: those `t` cycles through.
    pub threads: Vec<u32>,
    /// The one thread whose functions and samples the rows count (`None`: all).
    pub thread: Option<u32>,
}

/// Order of the rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TopSort {
    /// Calls/s in trace mode, own % in sample mode.
    #[default]
    Hot,
    /// Own time.
    Own,
    /// Time on the stack.
    Total,
    /// Function name.
    Name,
    /// File and line.
    File,
}

impl TopSort {
    pub(super) fn label(self, mode: TopMode) -> &'static str {
        match (self, mode) {
            (TopSort::Hot, TopMode::Trace) => "calls/s",
            (TopSort::Hot, TopMode::Sample) | (TopSort::Own, _) => "own",
            (TopSort::Total, _) => "total",
            (TopSort::Name, _) => "name",
            (TopSort::File, _) => "file",
        }
    }
}

/// Sorts rows for display: the hottest first, ties by name, file and line.
pub fn sort_rows(rows: &mut [TopRow], sort: TopSort, mode: TopMode) {
    let num = |r: &TopRow| -> (f64, f64) {
        match (sort, mode) {
            (TopSort::Hot, TopMode::Trace) => (r.calls_per_s.unwrap_or(0.0), r.own_pct),
            (TopSort::Hot, TopMode::Sample) | (TopSort::Own, _) => (r.own_pct, r.total_pct),
            (TopSort::Total, _) => (r.total_pct, r.own_pct),
            _ => (0.0, 0.0),
        }
    };
    rows.sort_by(|a, b| {
        let by_name = || {
            a.function
                .cmp(&b.function)
                .then_with(|| a.file.cmp(&b.file))
                .then(a.line.cmp(&b.line))
        };
        match sort {
            TopSort::Name => by_name(),
            TopSort::File => a
                .file
                .cmp(&b.file)
                .then(a.line.cmp(&b.line))
                .then_with(|| a.function.cmp(&b.function)),
            _ => {
                let (x, y) = (num(a), num(b));
                y.0.total_cmp(&x.0)
                    .then(y.1.total_cmp(&x.1))
                    .then_with(by_name)
            }
        }
    });
}

fn per_s(count: f64, window_ns: u64) -> f64 {
    if window_ns == 0 {
        0.0
    } else {
        count * 1e9 / window_ns as f64
    }
}

fn pct(part: f64, whole: f64) -> f64 {
    if whole <= 0.0 {
        0.0
    } else {
        100.0 * part / whole
    }
}

/// The snapshot of what happened between report `prev` and report `cur` of the
/// same growing recording (`prev` `None`: since the start).
pub fn snapshot_between(prev: Option<&Report>, cur: &Report) -> Snapshot {
    type Key<'a> = (&'a str, &'a str, u32);
    let before: HashMap<Key<'_>, &crate::analyze::FunctionStats> = prev
        .map(|p| {
            p.functions
                .iter()
                .map(|f| ((f.file.as_str(), f.function.as_str(), f.line), f))
                .collect()
        })
        .unwrap_or_default();
    let window_ns = cur
        .duration_ns
        .saturating_sub(prev.map_or(0, |p| p.duration_ns));
    let mode = if cur.source == FunctionSource::Sampled {
        TopMode::Sample
    } else {
        TopMode::Trace
    };
    let interval = cur.sample_interval_ns.max(1);
    let mut rows = Vec::new();
    let mut total_samples = 0u64;
    for f in &cur.functions {
        let b = before.get(&(f.file.as_str(), f.function.as_str(), f.line));
        let calls = f
            .calls
            .map(|c| c.saturating_sub(b.and_then(|b| b.calls).unwrap_or(0)));
        let own_ns = f
            .exclusive_ns
            .saturating_sub(b.map_or(0, |b| b.exclusive_ns));
        let incl_ns = f
            .inclusive_ns
            .saturating_sub(b.map_or(0, |b| b.inclusive_ns));
        let samples = f.samples.saturating_sub(b.map_or(0, |b| b.samples));
        total_samples += samples;
        if calls.unwrap_or(0) == 0 && own_ns == 0 && incl_ns == 0 && samples == 0 {
            continue;
        }
        rows.push((f, calls, own_ns, incl_ns, samples));
    }
    let rows = rows
        .into_iter()
        .map(|(f, calls, own_ns, incl_ns, samples)| {
            let (own_pct, total_pct) = match mode {
                TopMode::Trace => (
                    pct(own_ns as f64, window_ns as f64),
                    pct(incl_ns as f64, window_ns as f64),
                ),
                TopMode::Sample => (
                    pct(samples as f64, total_samples as f64),
                    pct((incl_ns / interval) as f64, total_samples as f64).min(100.0),
                ),
            };
            TopRow {
                pid: cur.target.pid,
                function: f.qualname.clone(),
                file: f.file.clone(),
                line: f.line,
                calls: if mode == TopMode::Trace { calls } else { None },
                calls_per_s: match mode {
                    TopMode::Trace => calls.map(|c| per_s(c as f64, window_ns)),
                    TopMode::Sample => None,
                },
                own_pct,
                total_pct,
                own_ns,
                samples,
            }
        })
        .collect();
    let gc = |r: &Report| -> (u64, u64) {
        r.gc.iter().fold((0, 0), |(n, t), g| {
            (n + g.collections, t.saturating_add(g.total_ns))
        })
    };
    let imports = |r: &Report| -> u64 { r.imports.iter().map(|i| i.count).sum() };
    let (gc_now, gc_ns_now) = gc(cur);
    let (gc_then, gc_ns_then) = prev.map(gc).unwrap_or((0, 0));
    let imports_now = imports(cur);
    let imports_then = prev.map(imports).unwrap_or(0);
    Snapshot {
        pid: cur.target.pid,
        python: cur.target.python.clone(),
        mode,
        window_ns,
        rows,
        gc_per_s: per_s(gc_now.saturating_sub(gc_then) as f64, window_ns),
        gc_pct: pct(
            gc_ns_now.saturating_sub(gc_ns_then) as f64,
            window_ns as f64,
        ),
        imports_per_s: per_s(imports_now.saturating_sub(imports_then) as f64, window_ns),
        events: cur.events.saturating_sub(prev.map_or(0, |p| p.events)),
        samples: total_samples,
        left_out: cur
            .samples
            .left_out()
            .saturating_sub(prev.map_or(0, |p| p.samples.left_out())),
        filter: cur.samples.filter,
        state_unknown: cur
            .samples
            .cpu_unknown
            .saturating_sub(prev.map_or(0, |p| p.samples.cpu_unknown)),
        lost: cur
            .lost_events
            .saturating_sub(prev.map_or(0, |p| p.lost_events)),
        status: None,
        threads: active_threads(prev, cur),
        thread: None,
    }
}

/// The threads of `cur` with events since `prev`, by id.
fn active_threads(prev: Option<&Report>, cur: &Report) -> Vec<u32> {
    let before: HashMap<u32, u64> = prev
        .map(|p| p.threads.iter().map(|t| (t.tid, t.events)).collect())
        .unwrap_or_default();
    let mut tids: Vec<u32> = cur
        .threads
        .iter()
        .filter(|t| t.events > before.get(&t.tid).copied().unwrap_or(0))
        .map(|t| t.tid)
        .collect();
    tids.sort_unstable();
    tids
}
