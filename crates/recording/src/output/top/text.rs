//! A snapshot as text: its title and status lines, its rows.

use std::fmt::Write as _;

use super::snapshot::{sort_rows, Snapshot, TopMode, TopRow, TopSort};
use crate::analyze::SampleFilter;
use crate::output::names::short_path;
use crate::output::terminal::{escaped, escaped_string};
use crate::output::units::format_ns;

fn rate(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The first header line: what is watched and over what window.
pub(super) fn title_line(s: &Snapshot) -> String {
    let python = if s.python.is_empty() { "?" } else { &s.python };
    let mode = match s.mode {
        TopMode::Trace => "trace",
        TopMode::Sample => "sample",
    };
    let what = match s.mode {
        TopMode::Trace => format!("{} events", s.events),
        TopMode::Sample => {
            let which = match (s.filter.idle, s.filter.gil) {
                _ if s.samples > 0 && s.state_unknown >= s.samples => {
                    " (thread state not recorded)"
                }
                (false, false) => " on a CPU",
                (true, false) => " (idle included)",
                (_, true) => " of the GIL holder",
            };
            let left = match s.left_out {
                0 => String::new(),
                n if s.filter == SampleFilter::default() => {
                    format!(" ({n} idle left out: --idle includes them)")
                }
                n => format!(" ({n} left out)"),
            };
            format!("{} samples{which}{left}", s.samples)
        }
    };
    let lost = if s.lost > 0 {
        format!(", {} lost", s.lost)
    } else {
        String::new()
    };
    let thread = s
        .thread
        .map(|tid| format!(", thread {tid}"))
        .unwrap_or_default();
    format!(
        "pyprobe top: pid {}{thread}, CPython {python}, {mode} mode, over {}: {what}{lost}",
        s.pid,
        format_ns(s.window_ns)
    )
}

/// The status line: GC and imports.
pub(super) fn status_line(s: &Snapshot) -> String {
    format!(
        "GC {}/s ({:.1}% of the time), imports {}/s",
        rate(s.gc_per_s),
        s.gc_pct,
        rate(s.imports_per_s)
    )
}

pub(super) fn headers(mode: TopMode) -> Vec<&'static str> {
    match mode {
        TopMode::Trace => vec![
            "CALLS/S",
            "OWN%",
            "TOTAL%",
            "OWN",
            "PID",
            "FUNCTION",
            "FILE:LINE",
        ],
        TopMode::Sample => vec!["OWN%", "TOTAL%", "SAMPLES", "PID", "FUNCTION", "FILE:LINE"],
    }
}

pub(super) fn cells(r: &TopRow, mode: TopMode) -> Vec<String> {
    let place = format!("{}:{}", escaped(short_path(&r.file)), r.line);
    match mode {
        TopMode::Trace => vec![
            r.calls_per_s.map(rate).unwrap_or_else(|| "-".into()),
            format!("{:.1}", r.own_pct),
            format!("{:.1}", r.total_pct),
            format_ns(r.own_ns),
            r.pid.to_string(),
            escaped_string(&r.function),
            place,
        ],
        TopMode::Sample => vec![
            format!("{:.1}", r.own_pct),
            format!("{:.1}", r.total_pct),
            r.samples.to_string(),
            r.pid.to_string(),
            escaped_string(&r.function),
            place,
        ],
    }
}

/// One snapshot as text: a header, the status line, then at most `limit` rows,
/// hottest first.
pub fn render_text(snapshot: &Snapshot, sort: TopSort, limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", title_line(snapshot));
    let _ = writeln!(out, "{}", status_line(snapshot));
    if let Some(status) = &snapshot.status {
        let _ = writeln!(out, "{status}");
    }
    let mut rows = snapshot.rows.clone();
    sort_rows(&mut rows, sort, snapshot.mode);
    rows.truncate(limit);
    let heads = headers(snapshot.mode);
    let body: Vec<Vec<String>> = rows.iter().map(|r| cells(r, snapshot.mode)).collect();
    let mut widths: Vec<usize> = heads.iter().map(|h| h.chars().count()).collect();
    for row in &body {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let numeric = heads.len() - 2;
    let fmt_row = |cols: Vec<String>| -> String {
        let mut line = String::new();
        for (i, (c, w)) in cols.iter().zip(&widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let pad = w.saturating_sub(c.chars().count());
            if i < numeric {
                line.push_str(&" ".repeat(pad));
                line.push_str(c);
            } else if i + 1 == cols.len() {
                line.push_str(c);
            } else {
                line.push_str(c);
                line.push_str(&" ".repeat(pad));
            }
        }
        line.trim_end().to_string()
    };
    let _ = writeln!(
        out,
        "{}",
        fmt_row(heads.iter().map(|h| h.to_string()).collect())
    );
    for row in body {
        let _ = writeln!(out, "{}", fmt_row(row));
    }
    if rows.is_empty() {
        let _ = writeln!(out, "(no Python function ran in this window)");
    }
    out
}
