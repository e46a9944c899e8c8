//! `pyprobe report`: a JSON document (a stable interface) or a
//! text table.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{Read, Seek};
use std::str::FromStr;

use serde::Serialize;

use crate::analyze::{
    Aggregator, FileFilter, FilterError, FunctionSource, FunctionStats, ProcessStats, Report,
    SampleFilter,
};
use crate::output::flame::short_command;
use crate::output::replay_recording;
use crate::record::{Completion, RecordError, RecordingReader};

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
    let mut agg = Aggregator::with_filter(reader.header(), filter);
    let replay = replay_recording(reader, |_, event, ts, steps, replay| {
        agg.push(event, ts, steps, replay);
        Ok::<(), RecordError>(())
    })?;
    let (end, lost, truncated_at) = match reader.completion() {
        Completion::Complete(t) => (Some(t.end_ns), t.lost_events, None),
        Completion::Truncated { offset } => (None, 0, Some(offset)),
        Completion::Reading | Completion::Failed { .. } => (None, 0, None),
    };
    let mut report = agg.finish(replay, end, |id| reader.string(id).into_owned());
    report.lost_events = report.lost_events.max(lost);
    report.truncated_at = truncated_at;
    Ok(report)
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
        Ok(view)
    }
}

/// The mode to show: the recording's, unless it was `auto`, then what happened.
fn effective_mode(report: &Report) -> &str {
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

fn source_name(source: FunctionSource) -> &'static str {
    match source {
        FunctionSource::Traced => "traced",
        FunctionSource::ReturnsOnly => "returns_only",
        FunctionSource::Sampled => "sampled",
    }
}

// The JSON document. Field order and names are a stable schema that users script against;
// keys after the schema's are additions.

#[derive(Serialize)]
struct JsonReport<'a> {
    pyprobe_version: &'static str,
    format: u32,
    target: JsonTarget<'a>,
    mode: &'a str,
    duration_ns: u64,
    lost_events: u64,
    functions: Vec<JsonFunction<'a>>,
    gc: Vec<JsonGc<'a>>,
    imports: Vec<JsonImport<'a>>,
    audit: Vec<JsonAudit<'a>>,
    threads: Vec<JsonThread>,
    events: u64,
    source: &'static str,
    sample_interval_ns: u64,
    truncated_at: Option<u64>,
    anomalies: JsonAnomalies,
    /// Share of the recording with function calls traced exactly: 1 for a plain
    /// trace, 0 when only sampled, in between under an overhead budget.
    exact_fraction: f64,
    /// Exact windows of a budget-limited recording (null without a budget).
    exact_windows: Option<u64>,
    /// GC, import and audit events recorded without their stacks to stay within
    /// the overhead budget (null when the budget never thinned them).
    thinned: Option<JsonThinned>,
    /// Which samples were counted, by what their thread was doing, and how many not.
    sample_filter: JsonSampleFilter,
    /// The recording's own process, then each child traced with it
    /// (`--subprocesses`): its functions on their own, with shares of its own time.
    processes: Vec<JsonProcess<'a>>,
}

#[derive(Serialize)]
struct JsonThinned {
    /// GC, import and audit events recorded without their stack.
    events: u64,
    duration_ns: u64,
    /// Audit events counted but not recorded: not in `audit` (names unknown).
    audits_counted: u64,
    /// Time with audit events neither recorded nor counted (even counting them
    /// cost more than the budget).
    uncounted_ns: u64,
}

#[derive(Serialize)]
struct JsonSampleFilter {
    /// `--idle`: waiting threads' samples count too.
    idle: bool,
    /// `--gil`: only the GIL holder's samples count.
    gil: bool,
    /// False for a trace-mode recording: its samples time exact calls, all count.
    applied: bool,
    /// Samples in the recording.
    samples: u64,
    /// Samples counted: the functions' samples and percentages are of these.
    kept: u64,
    /// Left out because their thread was waiting.
    idle_left_out: u64,
    /// Left out by `--gil`: their thread did not hold the GIL.
    gil_left_out: u64,
    /// Counted without a recorded thread state (older recordings): as on a CPU.
    cpu_state_unknown: u64,
    /// Counted without knowing whether their thread held the GIL.
    gil_state_unknown: u64,
}

#[derive(Serialize)]
struct JsonProcess<'a> {
    pid: u32,
    parent: Option<u32>,
    command: &'a str,
    threads: u64,
    samples: u64,
    duration_ns: u64,
    /// The sum of its functions' exclusive times.
    own_ns: u64,
    functions: Vec<JsonProcessFunction<'a>>,
}

#[derive(Serialize)]
struct JsonProcessFunction<'a> {
    #[serde(flatten)]
    function: JsonFunction<'a>,
    /// Its share of the process's own time: its samples over the process's counted
    /// samples when sampled, else `exclusive_ns` over `own_ns`.
    share: f64,
}

#[derive(Serialize)]
struct JsonTarget<'a> {
    pid: u32,
    python: &'a str,
    executable: &'a str,
}

#[derive(Serialize)]
struct JsonFunction<'a> {
    function: &'a str,
    file: &'a str,
    line: u32,
    calls: Option<u64>,
    inclusive_ns: u64,
    exclusive_ns: u64,
    samples: u64,
}

#[derive(Serialize)]
struct JsonGc<'a> {
    generation: i32,
    collections: u64,
    collected: i64,
    total_ns: u64,
    max_ns: u64,
    /// Pauses per power-of-two bucket `[from_ns, to_ns)`, non-empty buckets only.
    histogram: Vec<JsonBucket>,
    /// Where collections started: the function running, most frequent first.
    triggers: Vec<JsonTrigger<'a>>,
}

#[derive(Serialize)]
struct JsonTrigger<'a> {
    function: &'a str,
    file: &'a str,
    line: u32,
    count: u64,
}

#[derive(Serialize)]
struct JsonRaisingStack<'a> {
    /// Outermost first.
    frames: &'a [String],
    count: u64,
}

#[derive(Serialize)]
struct JsonBucket {
    from_ns: u64,
    to_ns: u64,
    count: u64,
}

#[derive(Serialize)]
struct JsonImport<'a> {
    module: &'a str,
    found: bool,
    total_ns: u64,
    count: u64,
    self_ns: u64,
    importer: Option<&'a str>,
}

#[derive(Serialize)]
struct JsonAudit<'a> {
    event: &'a str,
    count: u64,
    /// The Python stacks that raised it, where known, most frequent first.
    stacks: Vec<JsonRaisingStack<'a>>,
}

#[derive(Serialize)]
struct JsonThread {
    tid: u32,
    /// The process it ran in.
    pid: u32,
    events: u64,
    /// From the start of its first traced frame to the end of its last.
    traced_ns: u64,
    /// Sum of its traced frames' exclusive times.
    exclusive_ns: u64,
}

#[derive(Serialize)]
struct JsonAnomalies {
    resyncs: u64,
    unpaired_entries: u64,
    orphan_returns: u64,
    depth_overflows: u64,
    open_at_end: u64,
    unpaired_gc: u64,
    unpaired_imports: u64,
    open_at_start: u64,
    generator_creations: u64,
    shim_returns: u64,
}

/// A function's share of its process's own time: of its counted samples when
/// sampled (as the whole recording's table counts them), else of the sum of its
/// functions' exclusive times.
fn process_share(r: &Report, p: &ProcessStats, f: &FunctionStats) -> f64 {
    let (part, whole) = if r.source == FunctionSource::Sampled {
        (f.samples, p.samples)
    } else {
        (f.exclusive_ns, p.own_ns)
    };
    if whole > 0 {
        part as f64 / whole as f64
    } else {
        0.0
    }
}

fn json_function(f: &FunctionStats) -> JsonFunction<'_> {
    JsonFunction {
        function: &f.function,
        file: &f.file,
        line: f.line,
        calls: f.calls,
        inclusive_ns: f.inclusive_ns,
        exclusive_ns: f.exclusive_ns,
        samples: f.samples,
    }
}

/// The report as its JSON document (pretty-printed, newline-terminated).
pub fn render_json(report: &Report) -> String {
    let a = report.anomalies;
    let doc = JsonReport {
        pyprobe_version: env!("CARGO_PKG_VERSION"),
        format: 1,
        target: JsonTarget {
            pid: report.target.pid,
            python: &report.target.python,
            executable: &report.target.executable,
        },
        mode: effective_mode(report),
        duration_ns: report.duration_ns,
        lost_events: report.lost_events,
        functions: report.functions.iter().map(json_function).collect(),
        gc: report
            .gc
            .iter()
            .map(|g| JsonGc {
                generation: g.generation,
                collections: g.collections,
                collected: g.collected,
                total_ns: g.total_ns,
                max_ns: g.max_ns,
                histogram: g
                    .histogram
                    .buckets()
                    .map(|(from_ns, to_ns, count)| JsonBucket {
                        from_ns,
                        to_ns,
                        count,
                    })
                    .collect(),
                triggers: g
                    .triggers
                    .iter()
                    .map(|t| JsonTrigger {
                        function: &t.function,
                        file: &t.file,
                        line: t.line,
                        count: t.count,
                    })
                    .collect(),
            })
            .collect(),
        imports: report
            .imports
            .iter()
            .map(|i| JsonImport {
                module: &i.module,
                found: i.found,
                total_ns: i.total_ns,
                count: i.count,
                self_ns: i.self_ns,
                importer: i.importer.as_deref(),
            })
            .collect(),
        audit: report
            .audit
            .iter()
            .map(|a| JsonAudit {
                event: &a.event,
                count: a.count,
                stacks: a
                    .stacks
                    .iter()
                    .map(|st| JsonRaisingStack {
                        frames: &st.frames,
                        count: st.count,
                    })
                    .collect(),
            })
            .collect(),
        threads: report
            .threads
            .iter()
            .map(|t| JsonThread {
                tid: t.tid,
                pid: t.pid,
                events: t.events,
                traced_ns: t.traced_ns,
                exclusive_ns: t.exclusive_ns,
            })
            .collect(),
        events: report.events,
        source: source_name(report.source),
        sample_interval_ns: report.sample_interval_ns,
        truncated_at: report.truncated_at,
        exact_fraction: exact_fraction(report),
        exact_windows: report.exact_windows.map(|w| w.windows),
        thinned: report.thinned.map(|t| JsonThinned {
            events: t.events,
            duration_ns: t.thinned_ns,
            audits_counted: t.audits_counted,
            uncounted_ns: t.uncounted_ns,
        }),
        sample_filter: JsonSampleFilter {
            idle: report.samples.filter.idle,
            gil: report.samples.filter.gil,
            applied: report.samples.applied,
            samples: report.samples.samples,
            kept: report.samples.kept,
            idle_left_out: report.samples.idle_left_out,
            gil_left_out: report.samples.gil_left_out,
            cpu_state_unknown: report.samples.cpu_unknown,
            gil_state_unknown: report.samples.gil_unknown,
        },
        processes: report
            .processes
            .iter()
            .map(|p| JsonProcess {
                pid: p.pid,
                parent: p.parent,
                command: &p.command,
                threads: p.threads,
                samples: p.samples,
                duration_ns: p.duration_ns,
                own_ns: p.own_ns,
                functions: p
                    .functions
                    .iter()
                    .map(|f| JsonProcessFunction {
                        function: json_function(f),
                        share: process_share(report, p, f),
                    })
                    .collect(),
            })
            .collect(),
        anomalies: JsonAnomalies {
            resyncs: a.replay.resyncs,
            unpaired_entries: a.replay.unpaired_entries,
            orphan_returns: a.replay.orphan_returns,
            depth_overflows: a.replay.depth_overflows,
            open_at_end: a.replay.open_at_end,
            unpaired_gc: a.unpaired_gc,
            unpaired_imports: a.unpaired_imports,
            open_at_start: a.replay.open_at_start,
            generator_creations: a.replay.generator_creations,
            shim_returns: a.replay.shim_returns,
        },
    };
    // Serialising plain structs of strings and integers cannot fail.
    let mut s = serde_json::to_string_pretty(&doc).unwrap_or_default();
    s.push('\n');
    s
}

/// A duration in human units with three significant digits: `850 ns`,
/// `12.3 µs`, `4.56 ms`, `1.20 s`.
pub fn format_ns(ns: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1_000_000_000, "s"), (1_000_000, "ms"), (1_000, "µs")];
    for (scale, unit) in UNITS {
        if ns >= scale {
            let v = ns as f64 / scale as f64;
            return if v >= 100.0 {
                format!("{v:.0} {unit}")
            } else if v >= 10.0 {
                format!("{v:.1} {unit}")
            } else {
                format!("{v:.2} {unit}")
            };
        }
    }
    format!("{ns} ns")
}

/// Characters of `s`, cut to `max` by dropping its start (paths keep their end).
fn fit_left(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let keep = max.saturating_sub(1);
    let tail: String = s.chars().skip(n - keep).collect();
    format!("…{tail}")
}

/// Characters of `s`, cut to `max` by dropping its end.
fn fit_right(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let head: String = s.chars().take(max.saturating_sub(1)).collect();
    format!("{head}…")
}

fn pad(s: &str, width: usize) -> String {
    let n = s.chars().count();
    format!("{s}{}", " ".repeat(width.saturating_sub(n)))
}

/// The report as a text table `width` columns wide (function names and paths
/// are shortened to fit).
pub fn render_table(report: &Report, width: usize) -> String {
    let mut out = String::new();
    header_section(&mut out, report);
    functions_section(&mut out, report, width);
    gc_section(&mut out, report);
    imports_section(&mut out, report, width);
    audit_section(&mut out, report, width);
    threads_section(&mut out, report);
    out
}

fn header_section(out: &mut String, r: &Report) {
    let python = if r.target.python.is_empty() {
        "?"
    } else {
        &r.target.python
    };
    let _ = writeln!(
        out,
        "pid {}, python {}, mode {}, duration {}, {} events, {} lost",
        r.target.pid,
        python,
        effective_mode(r),
        format_ns(r.duration_ns),
        r.events,
        r.lost_events
    );
    if !r.target.executable.is_empty() {
        let _ = writeln!(out, "executable {}", r.target.executable);
    }
    if let Some(w) = r.exact_windows {
        let _ = writeln!(
            out,
            "overhead budget: calls traced exactly {:.1}% of the time, in {} windows; sampled in \
             between (call counts cover the exact windows only, times add the samples)",
            exact_fraction(r) * 100.0,
            w.windows
        );
    }
    if let Some(t) = r.thinned.filter(|t| t.events + t.audits_counted > 0) {
        let _ = writeln!(
            out,
            "overhead budget: stacks of GC, import and audit events were left out for {} of the \
             run: {} events recorded without the stack that raised them, {} audit events \
             counted without their names (not in the audit table); --max-overhead raises the budget",
            format_ns(t.thinned_ns),
            t.events,
            t.audits_counted
        );
        if t.uncounted_ns > 0 {
            let _ = writeln!(
                out,
                "overhead budget: for {} even counting audit events cost more than the budget: \
                 their probe was off, and those events are not counted",
                format_ns(t.uncounted_ns)
            );
        }
    }
    if let Some(offset) = r.truncated_at {
        let _ = writeln!(
            out,
            "note: the recording was cut short at offset {offset}; this is what it holds up to there"
        );
    }
    match r.source {
        FunctionSource::ReturnsOnly
            if r.sample_interval_ns > 0 && r.functions.iter().any(|f| f.samples > 0) =>
        {
            let _ = writeln!(
                out,
                "note: return events only (CPython 3.11): call counts are exact; times are sampled \
                 (every {}, stacks read alongside), samples × interval",
                format_ns(r.sample_interval_ns)
            );
        }
        FunctionSource::ReturnsOnly => {
            let _ = writeln!(
                out,
                "note: return events only (CPython 3.11): call counts are exact; no times (no samples were taken)"
            );
        }
        FunctionSource::Sampled => {
            let _ = writeln!(
                out,
                "note: sampled every {}: no call counts, times are samples × interval",
                format_ns(r.sample_interval_ns)
            );
        }
        FunctionSource::Traced => {}
    }
    for line in r.samples.notes() {
        let _ = writeln!(out, "{line}");
    }
    let a = r.anomalies;
    if a.replay.resyncs > 0 || (a.replay.orphan_returns > 0 && r.source == FunctionSource::Traced) {
        let _ = writeln!(
            out,
            "note: {} stack resyncs ({} entries without return), {} returns without entry (counted, not timed)",
            a.replay.resyncs, a.replay.unpaired_entries, a.replay.orphan_returns
        );
    }
    if a.replay.open_at_start > 0 {
        let _ = writeln!(
            out,
            "note: {} frames were already running when tracing began: their times count from then",
            a.replay.open_at_start
        );
    }
    if a.replay.open_at_end > 0 {
        let _ = writeln!(
            out,
            "note: {} frames were still running at the end: their times count, their calls do not",
            a.replay.open_at_end
        );
    }
    if a.replay.generator_creations > 0 {
        let _ = writeln!(
            out,
            "note: {} generator or coroutine creations fired an entry without return (CPython 3.15): \
             left out, as they run no code",
            a.replay.generator_creations
        );
    }
    if a.replay.depth_overflows > 0 {
        let _ = writeln!(
            out,
            "note: {} calls deeper than {} frames were counted but not timed",
            a.replay.depth_overflows,
            crate::analyze::MAX_DEPTH
        );
    }
    if a.unpaired_gc + a.unpaired_imports > 0 {
        let _ = writeln!(
            out,
            "note: {} unpaired GC and {} unpaired import events were left out of the times",
            a.unpaired_gc, a.unpaired_imports
        );
    }
}

/// Functions: one table, or one per process when the recording holds several
/// (`--subprocesses`), each with shares of that process's own time.
fn functions_section(out: &mut String, r: &Report, width: usize) {
    if r.processes.len() <= 1 {
        if !r.functions.is_empty() {
            let _ = writeln!(out, "\nFunctions");
            let whole = Whole {
                samples: r.samples.kept,
                ns: r.duration_ns,
            };
            function_rows(out, r, &r.functions, whole, width);
        }
        return;
    }
    let _ = writeln!(
        out,
        "\nProcesses ({}): each one's functions below, self% of that process's own time",
        r.processes.len()
    );
    let _ = writeln!(
        out,
        "{:>8}  {:>8}  {:>7}  {:>8}  {:>9}  {:>9}  command",
        "pid", "parent", "threads", "samples", "lived", "own time"
    );
    let room = width.saturating_sub(60).max(20);
    for p in &r.processes {
        let parent = p.parent.map_or("-".to_string(), |p| p.to_string());
        let _ = writeln!(
            out,
            "{:>8}  {parent:>8}  {:>7}  {:>8}  {:>9}  {:>9}  {}",
            p.pid,
            p.threads,
            p.samples,
            format_ns(p.duration_ns),
            format_ns(p.own_ns),
            fit_right(&short_command(&p.command), room)
        );
    }
    for p in &r.processes {
        if p.functions.is_empty() {
            continue;
        }
        let of = if r.source == FunctionSource::Sampled {
            format!("self% of its {} samples counted", p.samples)
        } else {
            format!("self% of its own time, {}", format_ns(p.own_ns))
        };
        let _ = writeln!(
            out,
            "\nFunctions of process {} ({}): {of}",
            p.pid,
            fit_right(&short_command(&p.command), width.saturating_sub(60).max(20)),
        );
        let whole = Whole {
            samples: p.samples,
            ns: p.own_ns,
        };
        function_rows(out, r, &p.functions, whole, width);
    }
}

/// What self% is a share of: samples counted when sampled, else time.
struct Whole {
    samples: u64,
    ns: u64,
}

/// The rows of `functions`, self% of `whole`.
fn function_rows(
    out: &mut String,
    r: &Report,
    functions: &[FunctionStats],
    whole: Whole,
    width: usize,
) {
    let sampled = r.source == FunctionSource::Sampled;
    let _ = writeln!(
        out,
        "{:>10}  {:>9}  {:>9}  {:>6}  function  file:line",
        if sampled { "samples" } else { "calls" },
        "inclusive",
        "exclusive",
        "self%"
    );
    // Fixed columns take 44 characters; names and places share the rest.
    let room = width.saturating_sub(44).max(30);
    let name_width = functions
        .iter()
        .map(|f| f.function.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(8, room / 2);
    let place_width = room.saturating_sub(name_width + 2).max(12);
    for f in functions {
        let count = match f.calls {
            Some(c) if !sampled => c.to_string(),
            _ => f.samples.to_string(),
        };
        // Sampled: a share of the samples counted (threads add up to 100 %, not
        // to 100 % each).
        let share = if sampled && whole.samples > 0 {
            format!("{:.1}%", f.samples as f64 * 100.0 / whole.samples as f64)
        } else if sampled {
            "-".to_string()
        } else if whole.ns > 0 {
            format!("{:.1}%", f.exclusive_ns as f64 * 100.0 / whole.ns as f64)
        } else {
            "-".to_string()
        };
        let place = fit_left(&format!("{}:{}", f.file, f.line), place_width);
        let _ = writeln!(
            out,
            "{count:>10}  {:>9}  {:>9}  {share:>6}  {}  {place}",
            format_ns(f.inclusive_ns),
            format_ns(f.exclusive_ns),
            pad(&fit_right(&f.function, name_width), name_width),
        );
    }
}

fn gc_section(out: &mut String, r: &Report) {
    if r.gc.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nGC");
    let _ = writeln!(
        out,
        "{:>5}  {:>11}  {:>10}  {:>9}  {:>9}  {:>9}",
        "gen", "collections", "collected", "total", "mean", "max"
    );
    for g in &r.gc {
        let mean = g.total_ns.checked_div(g.collections).unwrap_or(0);
        let _ = writeln!(
            out,
            "{:>5}  {:>11}  {:>10}  {:>9}  {:>9}  {:>9}",
            g.generation,
            g.collections,
            g.collected,
            format_ns(g.total_ns),
            format_ns(mean),
            format_ns(g.max_ns)
        );
        let buckets: Vec<_> = g.histogram.buckets().collect();
        let most = buckets.iter().map(|b| b.2).max().unwrap_or(1).max(1);
        for (from, _, count) in buckets {
            let bar = ((count * 30).div_ceil(most)) as usize;
            let _ = writeln!(
                out,
                "{:>18} {} {count}",
                format!("≥ {}", format_ns(from)),
                "#".repeat(bar)
            );
        }
        for t in &g.triggers {
            let _ = writeln!(
                out,
                "{:>18} {} ({}:{}) ×{}",
                "started in",
                t.function,
                fit_right(&t.file, 50),
                t.line,
                t.count
            );
        }
    }
}

fn imports_section(out: &mut String, r: &Report, width: usize) {
    if r.imports.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nImports (slowest first, nested under their importer)"
    );
    let _ = writeln!(out, "{:>9}  {:>9}  {:>5}  module", "total", "self", "count");
    let index: HashMap<&str, usize> = r
        .imports
        .iter()
        .enumerate()
        .map(|(i, m)| (m.module.as_str(), i))
        .collect();
    let mut children: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut roots = Vec::new();
    for (i, m) in r.imports.iter().enumerate() {
        match m.importer.as_deref().and_then(|p| index.get(p)) {
            Some(&p) if p != i => children.entry(p).or_default().push(i),
            _ => roots.push(i),
        }
    }
    // Imports are sorted slowest first, so children are too. Modules caught in an
    // importer cycle are reached by the second loop.
    let mut shown = HashSet::new();
    let name_room = width.saturating_sub(32).max(20);
    for start in roots.into_iter().chain(0..r.imports.len()) {
        let mut stack = vec![(start, 0usize)];
        while let Some((i, depth)) = stack.pop() {
            if !shown.insert(i) {
                continue;
            }
            let m = &r.imports[i];
            let indent = "  ".repeat(depth.min(16));
            let missing = if m.found { "" } else { " (not found)" };
            let _ = writeln!(
                out,
                "{:>9}  {:>9}  {:>5}  {indent}{}{missing}",
                format_ns(m.total_ns),
                format_ns(m.self_ns),
                m.count,
                fit_right(&m.module, name_room.saturating_sub(indent.len()).max(8))
            );
            if let Some(kids) = children.get(&i) {
                stack.extend(kids.iter().rev().map(|&k| (k, depth + 1)));
            }
        }
    }
}

fn audit_section(out: &mut String, r: &Report, width: usize) {
    if r.audit.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nAudit events");
    let _ = writeln!(out, "{:>9}  event", "count");
    for a in &r.audit {
        let _ = writeln!(
            out,
            "{:>9}  {}",
            a.count,
            fit_right(&a.event, width.saturating_sub(11).max(20))
        );
        // The innermost frame of each raising stack is the line that raised it.
        for st in a.stacks.iter().take(3) {
            if let Some(leaf) = st.frames.last() {
                let _ = writeln!(
                    out,
                    "{:>9}  from {}",
                    format!("×{}", st.count),
                    fit_right(leaf, width.saturating_sub(16).max(20))
                );
            }
        }
    }
}

fn threads_section(out: &mut String, r: &Report) {
    if r.threads.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nThreads");
    if r.processes.len() > 1 {
        let _ = writeln!(out, "{:>10}  {:>10}  {:>10}", "tid", "pid", "events");
        for t in &r.threads {
            let _ = writeln!(out, "{:>10}  {:>10}  {:>10}", t.tid, t.pid, t.events);
        }
        return;
    }
    let _ = writeln!(out, "{:>10}  {:>10}", "tid", "events");
    for t in &r.threads {
        let _ = writeln!(out, "{:>10}  {:>10}", t.tid, t.events);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::analyze::{
        AuditCount, GcStats, Histogram, ImportStats, ProcessStats, Target, ThreadStats,
    };
    use crate::record::{
        Event, EventKind, FrameRef, Header, RecordingWriter, SampleState, WalkedFrame,
    };

    fn function(name: &str, file: &str, calls: Option<u64>, incl: u64, excl: u64) -> FunctionStats {
        FunctionStats {
            function: name.into(),
            file: file.into(),
            line: 3,
            calls,
            inclusive_ns: incl,
            exclusive_ns: excl,
            samples: 0,
        }
    }

    fn sample_report() -> Report {
        let mut histogram = Histogram::default();
        histogram.record(40_000);
        histogram.record(90_000);
        let import =
            |module: &str, importer: Option<&str>, total_ns: u64, found: bool| ImportStats {
                module: module.into(),
                found,
                total_ns,
                self_ns: total_ns / 2,
                count: 1,
                importer: importer.map(str::to_string),
            };
        Report {
            target: Target {
                pid: 1234,
                python: "3.9.2".into(),
                executable: "/usr/bin/python3.9".into(),
            },
            mode: "trace".into(),
            duration_ns: 2_000_000_000,
            events: 999,
            functions: vec![
                function("main", "/app/main.py", Some(1), 1_900_000_000, 100_000),
                function(
                    "fib",
                    "/app/fib.py",
                    Some(196_418),
                    1_500_000_000,
                    1_500_000_000,
                ),
                function(
                    "loads",
                    "/usr/lib/python3.9/json/__init__.py",
                    Some(7),
                    300_000,
                    2_000,
                ),
            ],
            gc: vec![GcStats {
                generation: 0,
                collections: 2,
                collected: 3400,
                total_ns: 130_000,
                max_ns: 90_000,
                histogram,
                triggers: vec![],
            }],
            imports: vec![
                import("app", None, 800_000, true),
                import("json", Some("app"), 500_000, true),
                import("ujson", Some("app"), 1_000, false),
                import("json.decoder", Some("json"), 200_000, true),
            ],
            audit: vec![AuditCount {
                event: "open".into(),
                count: 3,
                stacks: vec![],
            }],
            threads: vec![ThreadStats {
                tid: 1234,
                events: 999,
                ..ThreadStats::default()
            }],
            ..Report::default()
        }
    }

    /// The object's keys, sorted (`serde_json::Value` sorts them).
    fn keys(v: &Value) -> Vec<&str> {
        v.as_object().unwrap().keys().map(String::as_str).collect()
    }

    /// Whether `v` has all of `expected` (and perhaps more).
    fn has_keys(v: &Value, expected: &[&str]) -> bool {
        let have = keys(v);
        expected.iter().all(|k| have.contains(k))
    }

    #[test]
    fn json_follows_the_schema() {
        let text = render_json(&sample_report());
        let doc: Value = serde_json::from_str(&text).unwrap();
        let schema = [
            "pyprobe_version",
            "format",
            "target",
            "mode",
            "duration_ns",
            "lost_events",
            "functions",
            "gc",
            "imports",
            "audit",
            "threads",
        ];
        // Top-level keys of the pretty output are indented by two spaces; the
        // schema's come first, in its order.
        let top: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("  \""))
            .filter_map(|l| l.split('"').next())
            .collect();
        assert_eq!(top[..schema.len()], schema, "schema keys first, in order");
        assert_eq!(doc["pyprobe_version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(doc["format"], 1);
        assert!(has_keys(&doc["target"], &["pid", "python", "executable"]));
        assert_eq!(doc["target"]["pid"], 1234);
        assert_eq!(doc["mode"], "trace");
        assert_eq!(doc["duration_ns"], 2_000_000_000u64);
        let f = &doc["functions"][1];
        let function_keys = [
            "function",
            "file",
            "line",
            "calls",
            "inclusive_ns",
            "exclusive_ns",
            "samples",
        ];
        assert!(has_keys(f, &function_keys));
        assert_eq!(f["function"], "fib");
        assert_eq!(f["calls"], 196_418);
        let gc = &doc["gc"][0];
        assert!(has_keys(
            gc,
            &[
                "generation",
                "collections",
                "collected",
                "total_ns",
                "max_ns"
            ]
        ));
        assert_eq!(gc["histogram"].as_array().unwrap().len(), 2);
        let imp = &doc["imports"][1];
        assert!(has_keys(imp, &["module", "found", "total_ns", "count"]));
        assert_eq!(imp["importer"], "app");
        assert!(has_keys(&doc["audit"][0], &["event", "count"]));
        assert!(has_keys(&doc["threads"][0], &["tid", "events"]));
        assert!(doc["truncated_at"].is_null());
    }

    #[test]
    fn several_processes_have_sections_of_their_own() {
        let mut r = sample_report();
        r.processes = vec![
            ProcessStats {
                pid: 1234,
                command: "/usr/bin/python3 pool.py".into(),
                threads: 1,
                own_ns: 2_000_000_000,
                functions: vec![function(
                    "main",
                    "/app/main.py",
                    None,
                    2_000_000_000,
                    2_000_000_000,
                )],
                ..ProcessStats::default()
            },
            ProcessStats {
                pid: 1240,
                parent: Some(1234),
                command: "/usr/bin/python3 -c spawn_main".into(),
                threads: 1,
                own_ns: 400_000_000,
                functions: vec![
                    function(
                        "worker_burn",
                        "/app/pool.py",
                        None,
                        400_000_000,
                        300_000_000,
                    ),
                    function(
                        "recv",
                        "/usr/lib/python3.9/x.py",
                        None,
                        100_000_000,
                        100_000_000,
                    ),
                ],
                ..ProcessStats::default()
            },
        ];
        r.threads.push(ThreadStats {
            tid: 1240,
            pid: 1240,
            events: 5,
            ..ThreadStats::default()
        });
        let t = render_table(&r, 100);
        assert!(t.contains("\nProcesses (2): "), "{t}");
        assert!(
            t.lines().any(|l| l.trim_start().starts_with("1240")
                && l.contains("1234")
                && l.ends_with("python3 -c spawn_main")),
            "{t}"
        );
        let section = t
            .split("\nFunctions of process 1240 (python3 -c spawn_main)")
            .nth(1)
            .unwrap_or_else(|| panic!("{t}"));
        let burn = section.lines().find(|l| l.contains("worker_burn")).unwrap();
        assert!(
            burn.contains("75.0%"),
            "a share of the worker's own time: {burn}"
        );
        assert!(t.contains("       tid         pid      events"), "{t}");
        let doc: Value = serde_json::from_str(&render_json(&r)).unwrap();
        let worker = &doc["processes"][1];
        assert_eq!(worker["parent"], 1234);
        assert_eq!(worker["functions"][0]["function"], "worker_burn");
        assert_eq!(worker["functions"][0]["share"], 0.75);
        assert_eq!(doc["processes"][0]["parent"], Value::Null);
        assert_eq!(doc["threads"][1]["pid"], 1240);
        // The options shape each process's rows too.
        let limited = ReportOptions {
            limit: Some(1),
            sort: SortKey::Exclusive,
            ..ReportOptions::default()
        }
        .apply(&r)
        .unwrap();
        assert_eq!(limited.processes[1].functions.len(), 1);
    }

    #[test]
    fn json_calls_are_null_when_sampled() {
        let mut r = sample_report();
        r.mode = "auto".into();
        r.source = FunctionSource::Sampled;
        for f in &mut r.functions {
            f.calls = None;
        }
        let doc: Value = serde_json::from_str(&render_json(&r)).unwrap();
        assert!(doc["functions"][0]["calls"].is_null());
        assert_eq!(doc["mode"], "sample");
        assert_eq!(doc["source"], "sampled");
    }

    #[test]
    fn units() {
        assert_eq!(format_ns(0), "0 ns");
        assert_eq!(format_ns(999), "999 ns");
        assert_eq!(format_ns(1_000), "1.00 µs");
        assert_eq!(format_ns(12_345), "12.3 µs");
        assert_eq!(format_ns(456_000_000), "456 ms");
        assert_eq!(format_ns(1_200_000_000), "1.20 s");
        assert_eq!(format_ns(u64::MAX), "18446744074 s");
    }

    #[test]
    fn table_has_every_section() {
        let t = render_table(&sample_report(), 100);
        assert!(
            t.starts_with(
                "pid 1234, python 3.9.2, mode trace, duration 2.00 s, 999 events, 0 lost\n"
            ),
            "{t}"
        );
        let fib = t.lines().find(|l| l.contains("fib ")).unwrap();
        assert!(
            fib.contains("196418") && fib.contains("1.50 s") && fib.contains("75.0%"),
            "{fib}"
        );
        assert!(fib.ends_with("/app/fib.py:3"), "{fib}");
        assert!(t.contains("\nGC\n"));
        assert!(t.contains("90.0 µs"));
        assert!(
            t.lines()
                .any(|l| l.trim_start().starts_with("≥ 32.8 µs") && l.contains("# 1")),
            "{t}"
        );
        // json.decoder nests under json, which nests under app; slowest first.
        let lines: Vec<&str> = t.lines().collect();
        let at = |m: &str| {
            lines
                .iter()
                .position(|l| l.ends_with(m))
                .unwrap_or_else(|| panic!("{m}: {t}"))
        };
        assert!(at("  app") < at("    json") && at("    json") < at("      json.decoder"));
        assert!(at("      json.decoder") < at("    ujson (not found)"));
        assert!(t.contains("\nAudit events\n") && t.contains("        3  open"));
        assert!(t.contains("\nThreads\n") && t.contains("      1234         999"));
        for line in t.lines() {
            assert!(line.chars().count() <= 100, "too wide: {line}");
        }
    }

    #[test]
    fn table_fits_narrow_widths_and_survives_import_cycles() {
        let mut r = sample_report();
        r.functions[0].function = "a_very_long_function_name_".repeat(10);
        r.functions[0].file = "/deep/".repeat(40) + "x.py";
        r.imports[0].importer = Some("json.decoder".into());
        r.truncated_at = Some(4096);
        let t = render_table(&r, 80);
        assert!(t.contains("cut short at offset 4096"));
        assert!(t.contains("…"));
        assert_eq!(t.matches("json.decoder").count(), 1);
        assert!(t.lines().any(|l| l.ends_with(" app")));
    }

    #[test]
    fn options_sort_limit_and_filter() {
        let r = sample_report();
        let names = |o: ReportOptions| -> Vec<String> {
            o.apply(&r)
                .unwrap()
                .functions
                .into_iter()
                .map(|f| f.function)
                .collect()
        };
        assert_eq!(names(ReportOptions::default()), ["main", "fib", "loads"]);
        let by = |sort: &str| ReportOptions {
            sort: sort.parse().unwrap(),
            ..ReportOptions::default()
        };
        assert_eq!(names(by("exclusive")), ["fib", "main", "loads"]);
        assert_eq!(names(by("calls")), ["fib", "loads", "main"]);
        assert!("bogus".parse::<SortKey>().is_err());
        let limited = ReportOptions {
            limit: Some(1),
            ..by("calls")
        };
        assert_eq!(names(limited), ["fib"]);
        let only_app = ReportOptions {
            include: vec!["/app/*".into()],
            exclude: vec!["main.py".into()],
            ..ReportOptions::default()
        };
        assert_eq!(names(only_app), ["fib"]);
        let bad = ReportOptions {
            include: vec!["[".into()],
            ..ReportOptions::default()
        };
        assert!(bad.apply(&r).is_err());
    }

    fn record(cut: Option<usize>) -> Report {
        let mut buf = Vec::new();
        let header = Header {
            pid: 77,
            python_version: "3.9.2".into(),
            start_ns: 1_000,
            ..Header::default()
        };
        let mut w = RecordingWriter::new(&mut buf, &header).unwrap();
        let file = w.intern("/app/fib.py");
        let fib = w.intern("fib");
        let frame = FrameRef {
            file,
            function: fib,
            line: 3,
        };
        for i in 0..100u64 {
            let kind = if i % 2 == 0 {
                EventKind::Call { frame }
            } else {
                EventKind::Return { frame }
            };
            w.write(&Event {
                tid: 77,
                ts_ns: 1_000 + i * 10,
                kind,
            })
            .unwrap();
        }
        w.write(&Event {
            tid: 77,
            ts_ns: 2_000,
            kind: EventKind::Lost { count: 2 },
        })
        .unwrap();
        w.finish(3_000).unwrap();
        let bytes = std::io::Cursor::new(&buf[..cut.unwrap_or(buf.len())]);
        let mut reader = RecordingReader::from_reader(bytes).unwrap();
        build_report(&mut reader).unwrap()
    }

    /// A sampled recording: thread 1 in `burn` on a CPU holding the GIL (6 samples),
    /// thread 2 in `nap` waiting (3), thread 3 in `hash` on a CPU without the GIL (1).
    fn sampled_with_states() -> Vec<u8> {
        let mut buf = Vec::new();
        let header = Header {
            pid: 1,
            mode: "sample".into(),
            sample_interval_ns: 10_000_000,
            ..Header::default()
        };
        let mut w = RecordingWriter::new(&mut buf, &header).unwrap();
        let file = w.intern("/app/x.py");
        let mut sample = |tid: u32, ts: u64, name: &str, on_cpu: bool, gil: bool| {
            let function = w.intern(name);
            let code = FrameRef {
                file,
                function,
                line: 1,
            };
            w.write(&Event {
                tid,
                ts_ns: ts,
                kind: EventKind::Sample {
                    frames: vec![WalkedFrame { code, line: 2 }],
                    state: SampleState {
                        on_cpu: Some(on_cpu),
                        holds_gil: Some(gil),
                    },
                },
            })
            .unwrap();
        };
        for i in 0..6 {
            sample(1, 1_000 + i * 10_000_000, "burn", true, true);
        }
        for i in 0..3 {
            sample(2, 2_000 + i * 10_000_000, "nap", false, false);
        }
        sample(3, 3_000, "hash", true, false);
        w.finish(60_000_000).unwrap();
        buf
    }

    #[test]
    fn samples_are_filtered_by_thread_state_and_the_report_says_so() {
        let buf = sampled_with_states();
        let report = |filter: SampleFilter| {
            let mut reader = RecordingReader::from_reader(std::io::Cursor::new(&buf[..])).unwrap();
            build_report_filtered(&mut reader, filter).unwrap()
        };
        let samples = |r: &Report| -> Vec<(String, u64)> {
            r.functions
                .iter()
                .map(|f| (f.function.clone(), f.samples))
                .collect()
        };
        let on_cpu = report(SampleFilter::default());
        assert_eq!(
            samples(&on_cpu),
            [("burn".to_string(), 6), ("hash".to_string(), 1)]
        );
        let t = render_table(&on_cpu, 120);
        assert!(
            t.contains("idle samples left out: 3 of 10; --idle includes them"),
            "{t}"
        );
        // Percentages are of the samples kept: 6 of 7.
        assert!(
            t.lines().any(|l| l.contains("burn") && l.contains("85.7%")),
            "{t}"
        );
        let doc: Value = serde_json::from_str(&render_json(&on_cpu)).unwrap();
        let f = &doc["sample_filter"];
        assert_eq!(
            (f["idle"].as_bool(), f["gil"].as_bool()),
            (Some(false), Some(false))
        );
        assert_eq!(
            (
                f["samples"].as_u64(),
                f["kept"].as_u64(),
                f["idle_left_out"].as_u64()
            ),
            (Some(10), Some(7), Some(3))
        );

        let idle = report(SampleFilter {
            idle: true,
            gil: false,
        });
        assert_eq!(samples(&idle).len(), 3);
        assert!(render_table(&idle, 120).contains("--idle); 10 counted"));

        let gil = report(SampleFilter {
            idle: false,
            gil: true,
        });
        assert_eq!(samples(&gil), [("burn".to_string(), 6)]);
        let t = render_table(&gil, 120);
        assert!(t.contains("not holding the GIL left out: 1 of 10"), "{t}");
        assert!(
            t.lines()
                .any(|l| l.contains("burn") && l.contains("100.0%")),
            "{t}"
        );
    }

    #[test]
    fn report_from_a_recording() {
        let r = record(None);
        assert_eq!(r.target.pid, 77);
        assert_eq!(r.duration_ns, 2_000);
        assert_eq!(r.lost_events, 2);
        assert_eq!(r.truncated_at, None);
        let fib = &r.functions[0];
        assert_eq!(
            (fib.function.as_str(), fib.calls, fib.inclusive_ns),
            ("fib", Some(50), 500)
        );
        // Cut before the trailer: still a report, flagged as cut short.
        let cut = record(Some(60));
        assert!(cut.truncated_at.is_some());
    }
}
