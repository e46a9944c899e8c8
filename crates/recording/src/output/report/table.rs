//! The report as a text table.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use crate::analyze::report::{effective_mode, exact_fraction};
use crate::analyze::{FunctionSource, FunctionStats, Report};
use crate::output::names::{short_command, short_path};
use crate::output::units::format_ns;

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
/// are shortened to fit; paths from their package's root, as `sympy/core/mul.py`).
pub fn render_table(report: &Report, width: usize) -> String {
    render_table_paths(report, width, false)
}

/// As [`render_table`]; with `full_paths`, paths are kept whole (as far as the
/// width allows).
pub fn render_table_paths(report: &Report, width: usize, full_paths: bool) -> String {
    // Names and paths are the target's: shown escaped.
    let mut report = super::terminal_safe::escaped_report(report);
    if !full_paths {
        shorten_paths(&mut report);
    }
    let report = &report;
    let mut out = String::new();
    header_section(&mut out, report);
    functions_section(&mut out, report, width);
    gc_section(&mut out, report);
    imports_section(&mut out, report, width);
    audit_section(&mut out, report, width);
    return_types_section(&mut out, report, width);
    threads_section(&mut out, report);
    out
}

/// Every source path of the report from its package's root (what follows
/// `site-packages/`, the standard library's own directory), as `dump` and the
/// flame graph show them.
fn shorten_paths(r: &mut Report) {
    let short = |p: &mut String| *p = short_path(p).to_owned();
    for f in r
        .functions
        .iter_mut()
        .chain(r.processes.iter_mut().flat_map(|p| p.functions.iter_mut()))
    {
        short(&mut f.file);
    }
    for t in r.gc.iter_mut().flat_map(|g| g.triggers.iter_mut()) {
        short(&mut t.file);
    }
    for t in &mut r.return_types {
        short(&mut t.file);
    }
    // Audit stacks' frames read `function (file:line)`.
    for frame in r
        .audit
        .iter_mut()
        .flat_map(|a| a.stacks.iter_mut())
        .flat_map(|st| st.frames.iter_mut())
    {
        if let Some((name, place)) = frame.strip_suffix(')').and_then(|f| f.rsplit_once(" (")) {
            if let Some((file, line)) = place.rsplit_once(':') {
                *frame = format!("{name} ({}:{line})", short_path(file));
            }
        }
    }
}

/// Most return types named per function; the rest are counted.
const RETURN_TYPES_SHOWN: usize = 5;
/// Most call sites shown per audit event; the rest are counted.
const AUDIT_SITES_SHOWN: usize = 3;
/// Most import rows shown; the rest are counted.
const IMPORT_ROWS_SHOWN: usize = 20;

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
    if !r.paused.is_empty() {
        let total: u64 = r.paused.iter().map(|p| p.ns).sum();
        let _ = writeln!(
            out,
            "paused {} time{} for {} in all (pyprobe was stopped: Ctrl-Z or SIGSTOP); the target \
             ran untraced then, and nothing of that time is in this report",
            r.paused.len(),
            if r.paused.len() == 1 { "" } else { "s" },
            format_ns(total)
        );
    }
    for c in &r.caveats {
        let _ = writeln!(
            out,
            "caveat (pid {}, at {}): {}",
            c.pid,
            format_ns(c.at_ns),
            c.text
        );
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
    for p in r.processes.iter().filter(|p| p.tracing_cost_ns > 0) {
        let whose = match r.processes.len() {
            1 => String::new(),
            _ => format!("process {}: ", p.pid),
        };
        let _ = writeln!(
            out,
            "note: {whose}traced times leave out tracing's cost, {} per call or return \
             (1 % of the gaps between them are shorter): {} in all",
            format_ns(p.event_cost_ns),
            format_ns(p.tracing_cost_ns)
        );
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
    if a.replay.out_of_order > 0 {
        let _ = writeln!(
            out,
            "warning: {} calls and returns reached the recording more than 5 µs before an earlier \
             event of their thread: their times were held at it (a pyprobe bug; please report it)",
            a.replay.out_of_order
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
            // Traced: of the time the frames account for (the process's own
            // time), as with several processes, not of the recording's length,
            // which begins before tracing does.
            let whole = Whole {
                samples: r.samples.kept,
                ns: r.processes.first().map_or(r.duration_ns, |p| p.own_ns),
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
    // Resumes get a column when a listed generator or coroutine was entered again.
    let resumes = !sampled && functions.iter().any(|f| f.resumes.unwrap_or(0) > 0);
    let _ = writeln!(
        out,
        "{:>10}  {}{:>9}  {:>9}  {:>6}  function  file:line",
        if sampled { "samples" } else { "calls" },
        if resumes { "   resumes  " } else { "" },
        "inclusive",
        "exclusive",
        "self%"
    );
    // Fixed columns take 44 characters (56 with resumes); names and places
    // share the rest.
    let fixed = if resumes { 56 } else { 44 };
    let room = width.saturating_sub(fixed).max(30);
    let name_width = functions
        .iter()
        .map(|f| f.qualname.chars().count())
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
        let resumed = if resumes {
            format!("{:>10}  ", f.resumes.unwrap_or(0))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{count:>10}  {resumed}{:>9}  {:>9}  {share:>6}  {}  {place}",
            format_ns(f.inclusive_ns),
            format_ns(f.exclusive_ns),
            pad(&fit_right(&f.qualname, name_width), name_width),
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
    'rows: for start in roots.into_iter().chain(0..r.imports.len()) {
        let mut stack = vec![(start, 0usize)];
        while let Some((i, depth)) = stack.pop() {
            if shown.contains(&i) {
                continue;
            }
            if shown.len() == IMPORT_ROWS_SHOWN {
                break 'rows;
            }
            shown.insert(i);
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
    let more = r.imports.len() - shown.len();
    if more > 0 {
        let _ = writeln!(
            out,
            "{:>9}  {:>9}  {:>5}  … {more} more module{} (--format json lists every one)",
            "",
            "",
            "",
            if more == 1 { "" } else { "s" }
        );
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
        // The innermost frame of each raising stack is the line that raised it;
        // stacks that differ only further out raise it from the same line.
        let mut sites: Vec<(&str, u64)> = Vec::new();
        for st in &a.stacks {
            if let Some(leaf) = st.frames.last() {
                match sites.iter_mut().find(|(l, _)| *l == leaf.as_str()) {
                    Some(site) => site.1 += st.count,
                    None => sites.push((leaf, st.count)),
                }
            }
        }
        sites.sort_by_key(|site| std::cmp::Reverse(site.1));
        for (leaf, count) in sites.iter().take(AUDIT_SITES_SHOWN) {
            let _ = writeln!(
                out,
                "{:>9}  from {}",
                format!("×{count}"),
                fit_right(leaf, width.saturating_sub(16).max(20))
            );
        }
        if sites.len() > AUDIT_SITES_SHOWN {
            let more = &sites[AUDIT_SITES_SHOWN..];
            let _ = writeln!(
                out,
                "{:>9}  … {} more call sites",
                format!("×{}", more.iter().map(|s| s.1).sum::<u64>()),
                more.len()
            );
        }
    }
}

/// One line per function, as many as the functions table shows at most:
/// "Return types for 'f' (file:line): list 39, tuple 39, raised 2".
fn return_types_section(out: &mut String, r: &Report, width: usize) {
    if r.return_types.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nReturn types");
    let shown = r.functions.len().max(MIN_RETURN_TYPE_ROWS);
    for t in r.return_types.iter().take(shown) {
        let mut parts: Vec<String> = t
            .returned
            .iter()
            .take(RETURN_TYPES_SHOWN)
            .map(|c| format!("{} {}", c.type_name, c.count))
            .collect();
        let rest = &t.returned[t.returned.len().min(RETURN_TYPES_SHOWN)..];
        if !rest.is_empty() {
            let returns: u64 = rest.iter().map(|c| c.count).sum();
            parts.push(format!(
                "… {} more type{} ({returns} return{})",
                rest.len(),
                if rest.len() == 1 { "" } else { "s" },
                if returns == 1 { "" } else { "s" }
            ));
        }
        if t.raised > 0 {
            parts.push(format!("raised {}", t.raised));
        }
        let place = fit_right(
            &format!("{}:{}", t.file, t.line),
            width.saturating_sub(30).max(20),
        );
        let _ = writeln!(
            out,
            "Return types for '{}' ({place}): {}",
            t.function,
            parts.join(", ")
        );
    }
}

/// Return-type lines shown even when the functions table is short (`--limit`).
const MIN_RETURN_TYPE_ROWS: usize = 10;

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
