//! The report's JSON document. Its schema is docs/report.schema.json.

use serde::Serialize;

use crate::analyze::report::{effective_mode, exact_fraction};
use crate::analyze::{FunctionSource, FunctionStats, ProcessStats, Report};

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
    /// What functions returned, by type, most returns first (recorded by the
    /// hook engine; empty otherwise).
    return_types: Vec<JsonReturnTypes<'a>>,
    /// The times pyprobe let go of the target while it was stopped (Ctrl-Z,
    /// SIGSTOP): nothing of them is recorded.
    paused: Vec<JsonPause>,
    /// Why the recording is incomplete or its counts cannot be trusted, as
    /// pyprobe said while recording, in order.
    caveats: Vec<JsonCaveat<'a>>,
}

#[derive(Serialize)]
struct JsonCaveat<'a> {
    /// From the recording's start.
    at_ns: u64,
    pid: u32,
    text: &'a str,
}

#[derive(Serialize)]
struct JsonPause {
    /// From the recording's start.
    at_ns: u64,
    ns: u64,
}

#[derive(Serialize)]
struct JsonReturnTypes<'a> {
    function: &'a str,
    file: &'a str,
    /// The function's first line.
    line: u32,
    /// Each type returned and how often, most frequent first.
    returned: Vec<JsonTypeCount<'a>>,
    /// Frames left by an exception.
    raised: u64,
}

#[derive(Serialize)]
struct JsonTypeCount<'a> {
    #[serde(rename = "type")]
    type_name: &'a str,
    count: u64,
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
    /// What tracing cost its threads per call or return, and in all: left out
    /// of the traced times.
    event_cost_ns: u64,
    tracing_cost_ns: u64,
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
    /// `co_name`: rows are keyed by it, the file and the first line.
    function: &'a str,
    /// `Class.method`, `outer.<locals>.inner`; the name when not known.
    qualname: &'a str,
    file: &'a str,
    line: u32,
    calls: Option<u64>,
    /// Generator and coroutine resumes: `calls + resumes` is cProfile's count.
    resumes: Option<u64>,
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
    /// Tracing's cost left out of them.
    tracing_cost_ns: u64,
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
    out_of_order_events: u64,
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
        qualname: &f.qualname,
        file: &f.file,
        line: f.line,
        calls: f.calls,
        resumes: f.resumes,
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
                tracing_cost_ns: t.tracing_cost_ns,
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
                event_cost_ns: p.event_cost_ns,
                tracing_cost_ns: p.tracing_cost_ns,
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
        return_types: report
            .return_types
            .iter()
            .map(|r| JsonReturnTypes {
                function: &r.function,
                file: &r.file,
                line: r.line,
                returned: r
                    .returned
                    .iter()
                    .map(|t| JsonTypeCount {
                        type_name: &t.type_name,
                        count: t.count,
                    })
                    .collect(),
                raised: r.raised,
            })
            .collect(),
        paused: report
            .paused
            .iter()
            .map(|p| JsonPause {
                at_ns: p.at_ns,
                ns: p.ns,
            })
            .collect(),
        caveats: report
            .caveats
            .iter()
            .map(|c| JsonCaveat {
                at_ns: c.at_ns,
                pid: c.pid,
                text: &c.text,
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
            out_of_order_events: a.replay.out_of_order,
        },
    };
    // Serialising plain structs of strings and integers cannot fail.
    let mut s = serde_json::to_string_pretty(&doc).unwrap_or_default();
    s.push('\n');
    s
}
