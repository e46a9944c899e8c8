//! `pyprobe top`: the hottest Python functions, as one text snapshot or as a live
//! terminal view (ratatui + crossterm).
//!
//! The view knows nothing of where its numbers come from: the session's terminal
//! loop calls a data source (`FnMut() -> Snapshot`) once per refresh and
//! [`draw`]s each. [`snapshot_between`] turns two successive reports of a growing
//! recording into a snapshot of the window between them; a live sampler can
//! build [`Snapshot`]s directly.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io;
use std::time::Duration;

use crossterm::event::{KeyCode, KeyModifiers};
use ratatui::backend::Backend;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::{Frame, Terminal};

use crate::analyze::{FunctionSource, Report, SampleFilter};
use crate::output::flame::short_path;
use crate::output::report::format_ns;

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
    /// Function name.
    pub function: String,
    /// Source file (full path).
    pub file: String,
    /// First line (trace) or a sampled line (sample).
    pub line: u32,
    /// Calls finished in the window (trace mode).
    pub calls: Option<u64>,
    /// Calls per second (trace mode).
    pub calls_per_s: Option<f64>,
    /// Share of the window spent in the function itself, % (samples as leaf in
    /// sample mode). May pass 100 with several threads.
    pub own_pct: f64,
    /// Share of the window with the function on the stack, %.
    pub total_pct: f64,
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
    fn label(self, mode: TopMode) -> &'static str {
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
                function: f.function.clone(),
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
    }
}

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
fn title_line(s: &Snapshot) -> String {
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
    format!(
        "pyprobe top: pid {}, CPython {python}, {mode} mode, over {}: {what}{lost}",
        s.pid,
        format_ns(s.window_ns)
    )
}

/// The status line: GC and imports.
fn status_line(s: &Snapshot) -> String {
    format!(
        "GC {}/s ({:.1}% of the time), imports {}/s",
        rate(s.gc_per_s),
        s.gc_pct,
        rate(s.imports_per_s)
    )
}

fn headers(mode: TopMode) -> Vec<&'static str> {
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

fn cells(r: &TopRow, mode: TopMode) -> Vec<String> {
    let place = format!("{}:{}", short_path(&r.file), r.line);
    match mode {
        TopMode::Trace => vec![
            r.calls_per_s.map(rate).unwrap_or_else(|| "-".into()),
            format!("{:.1}", r.own_pct),
            format!("{:.1}", r.total_pct),
            format_ns(r.own_ns),
            r.pid.to_string(),
            r.function.clone(),
            place,
        ],
        TopMode::Sample => vec![
            format!("{:.1}", r.own_pct),
            format!("{:.1}", r.total_pct),
            r.samples.to_string(),
            r.pid.to_string(),
            r.function.clone(),
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

/// State of the live view besides the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewState {
    /// Order of the rows.
    pub sort: TopSort,
    /// No refresh while paused.
    pub paused: bool,
    /// Refresh period.
    pub interval: Duration,
    /// Most rows shown.
    pub limit: usize,
}

/// Draws one frame of the live view.
pub fn draw(frame: &mut Frame<'_>, snapshot: &Snapshot, state: &ViewState) {
    let [head, status, table, help] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Min(1),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let bold = Style::default().add_modifier(Modifier::BOLD);
    frame.render_widget(Paragraph::new(title_line(snapshot)).style(bold), head);
    let mut st = status_line(snapshot);
    if state.paused {
        st.push_str("   [PAUSED]");
    }
    if let Some(s) = &snapshot.status {
        st.push_str("   ");
        st.push_str(s);
    }
    frame.render_widget(Paragraph::new(st), status);

    let mut rows = snapshot.rows.clone();
    sort_rows(&mut rows, state.sort, snapshot.mode);
    let shown = (table.height.saturating_sub(1) as usize).min(state.limit);
    rows.truncate(shown);
    let heads = headers(snapshot.mode);
    let numeric = heads.len() - 2;
    let body: Vec<Vec<String>> = rows.iter().map(|r| cells(r, snapshot.mode)).collect();
    let mut widths: Vec<Constraint> = Vec::new();
    for (i, h) in heads.iter().enumerate() {
        let w = body
            .iter()
            .map(|r| r[i].chars().count())
            .chain([h.chars().count()])
            .max()
            .unwrap_or(4) as u16;
        widths.push(if i == heads.len() - 1 {
            Constraint::Min(w.min(60))
        } else if i == heads.len() - 2 {
            Constraint::Length(w.min(40))
        } else {
            Constraint::Length(w)
        });
    }
    let right = |s: String, i: usize| -> Line<'static> {
        if i < numeric {
            Line::from(s).right_aligned()
        } else {
            Line::from(s)
        }
    };
    let header = Row::new(
        heads
            .iter()
            .enumerate()
            .map(|(i, h)| right(h.to_string(), i)),
    )
    .style(Style::default().add_modifier(Modifier::REVERSED));
    let body = body
        .into_iter()
        .map(|r| Row::new(r.into_iter().enumerate().map(|(i, c)| right(c, i))));
    frame.render_widget(Table::new(body, widths).header(header), table);
    let helptext = format!(
        "q quit  p pause  c calls/hot  o own  t total  n name  f file  +/- interval ({})   sorted by {}",
        format_ns(state.interval.as_nanos() as u64),
        state.sort.label(snapshot.mode)
    );
    frame.render_widget(
        Paragraph::new(helptext).style(Style::default().add_modifier(Modifier::DIM)),
        help,
    );
}

/// What a key does to the view; `None` to quit.
pub fn handle_key(state: &mut ViewState, code: KeyCode, modifiers: KeyModifiers) -> Option<bool> {
    let mut refresh = false;
    match code {
        KeyCode::Char('q') | KeyCode::Esc => return None,
        KeyCode::Char('c') if modifiers.contains(KeyModifiers::CONTROL) => return None,
        KeyCode::Char('p') | KeyCode::Char(' ') => state.paused = !state.paused,
        KeyCode::Char('c') | KeyCode::Char('h') => state.sort = TopSort::Hot,
        KeyCode::Char('o') => state.sort = TopSort::Own,
        KeyCode::Char('t') => state.sort = TopSort::Total,
        KeyCode::Char('n') => state.sort = TopSort::Name,
        KeyCode::Char('f') => state.sort = TopSort::File,
        KeyCode::Char('r') => refresh = true,
        KeyCode::Char('+') => state.interval = (state.interval * 2).min(Duration::from_secs(60)),
        KeyCode::Char('-') => {
            state.interval = (state.interval / 2).max(Duration::from_millis(100));
        }
        _ => {}
    }
    Some(refresh)
}

/// Draws one frame on any backend (tests use ratatui's `TestBackend`).
pub fn draw_on<B: Backend>(
    terminal: &mut Terminal<B>,
    snapshot: &Snapshot,
    state: &ViewState,
) -> io::Result<()> {
    terminal.draw(|f| draw(f, snapshot, state)).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;

    fn row(function: &str, calls_per_s: f64, own: f64) -> TopRow {
        TopRow {
            pid: 42,
            function: function.into(),
            file: "/app/x/main.py".into(),
            line: 3,
            calls: Some(calls_per_s as u64),
            calls_per_s: Some(calls_per_s),
            own_pct: own,
            total_pct: own,
            own_ns: 1000,
            samples: 0,
        }
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            pid: 42,
            python: "3.9.2".into(),
            mode: TopMode::Trace,
            window_ns: 1_000_000_000,
            rows: vec![row("slow", 10.0, 80.0), row("busy", 5000.0, 10.0)],
            gc_per_s: 2.0,
            gc_pct: 0.5,
            imports_per_s: 0.0,
            events: 10020,
            ..Snapshot::default()
        }
    }

    #[test]
    fn text_snapshot_hottest_first() {
        let text = render_text(&snapshot(), TopSort::Hot, 10);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("pyprobe top: pid 42, CPython 3.9.2, trace mode"));
        assert!(lines[1].starts_with("GC 2.00/s (0.5% of the time), imports 0.00/s"));
        assert!(lines[2].trim_start().starts_with("CALLS/S"));
        assert!(lines[3].contains("busy"), "{text}");
        assert!(lines[4].contains("slow"));
        assert!(lines[3].contains("x/main.py:3"));
        let own = render_text(&snapshot(), TopSort::Own, 1);
        assert!(own.lines().nth(3).unwrap().contains("slow"));
        assert_eq!(own.lines().count(), 4);
    }

    #[test]
    fn rates_over_the_window_between_two_reports() {
        use crate::analyze::{FunctionStats, GcStats};
        let f = |calls, excl| FunctionStats {
            function: "f".into(),
            file: "/a/b.py".into(),
            line: 1,
            calls: Some(calls),
            inclusive_ns: excl,
            exclusive_ns: excl,
            samples: 0,
        };
        let mut before = Report {
            duration_ns: 1_000_000_000,
            events: 100,
            functions: vec![f(10, 100_000_000)],
            gc: vec![GcStats {
                collections: 1,
                total_ns: 1_000_000,
                ..GcStats::default()
            }],
            ..Report::default()
        };
        before.target.pid = 7;
        let mut after = before.clone();
        after.duration_ns = 3_000_000_000;
        after.events = 300;
        after.functions = vec![f(50, 600_000_000)];
        after.gc[0].collections = 5;
        after.gc[0].total_ns = 21_000_000;
        let s = snapshot_between(Some(&before), &after);
        assert_eq!(s.window_ns, 2_000_000_000);
        assert_eq!(s.events, 200);
        assert_eq!(s.rows.len(), 1);
        assert_eq!(s.rows[0].calls, Some(40));
        assert_eq!(s.rows[0].calls_per_s, Some(20.0));
        assert!((s.rows[0].own_pct - 25.0).abs() < 1e-9);
        assert!((s.gc_per_s - 2.0).abs() < 1e-9);
        assert!((s.gc_pct - 1.0).abs() < 1e-9);
        // Nothing ran in a window: no rows.
        assert!(snapshot_between(Some(&after), &after).rows.is_empty());
    }

    #[test]
    fn keys() {
        let mut st = ViewState {
            sort: TopSort::Hot,
            paused: false,
            interval: Duration::from_secs(1),
            limit: 10,
        };
        assert_eq!(
            handle_key(&mut st, KeyCode::Char('p'), KeyModifiers::NONE),
            Some(false)
        );
        assert!(st.paused);
        handle_key(&mut st, KeyCode::Char('o'), KeyModifiers::NONE);
        assert_eq!(st.sort, TopSort::Own);
        handle_key(&mut st, KeyCode::Char('+'), KeyModifiers::NONE);
        assert_eq!(st.interval, Duration::from_secs(2));
        assert_eq!(
            handle_key(&mut st, KeyCode::Char('c'), KeyModifiers::CONTROL),
            None
        );
        assert_eq!(
            handle_key(&mut st, KeyCode::Char('q'), KeyModifiers::NONE),
            None
        );
    }

    #[test]
    fn draws_the_table() {
        let mut terminal = Terminal::new(TestBackend::new(100, 8)).unwrap();
        let st = ViewState {
            sort: TopSort::Hot,
            paused: true,
            interval: Duration::from_secs(1),
            limit: 10,
        };
        draw_on(&mut terminal, &snapshot(), &st).unwrap();
        let buf = terminal.backend().buffer().clone();
        let text: Vec<String> = (0..buf.area.height)
            .map(|y| {
                (0..buf.area.width)
                    .map(|x| buf[(x, y)].symbol().to_string())
                    .collect()
            })
            .collect();
        assert!(text[0].starts_with("pyprobe top: pid 42"));
        assert!(text[1].contains("[PAUSED]"));
        assert!(text[2].contains("CALLS/S") && text[2].contains("FUNCTION"));
        assert!(text[3].contains("busy"), "{text:#?}");
        assert!(text[4].contains("slow"));
        assert!(text[7].contains("q quit"));
    }
}
