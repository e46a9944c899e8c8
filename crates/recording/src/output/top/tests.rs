use std::time::Duration;

use crossterm::event::{KeyCode, KeyModifiers};
use ratatui::Terminal;

use super::*;
use crate::analyze::Report;
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
        qualname: "f".into(),
        file: "/a/b.py".into(),
        line: 1,
        calls: Some(calls),
        resumes: Some(0),
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
    let mut st = ViewState::new(Duration::from_secs(1), 10);
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
    let mut st = ViewState::new(Duration::from_secs(1), 10);
    st.paused = true;
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

fn screen(terminal: &Terminal<TestBackend>) -> Vec<String> {
    let buf = terminal.backend().buffer().clone();
    (0..buf.area.height)
        .map(|y| {
            (0..buf.area.width)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect()
        })
        .collect()
}

fn type_keys(st: &mut ViewState, keys: &str) {
    for c in keys.chars() {
        assert_eq!(
            handle_key(st, KeyCode::Char(c), KeyModifiers::NONE),
            Some(false)
        );
    }
}

#[test]
fn slash_filters_by_name_file_or_line_and_esc_clears() {
    let mut st = ViewState::new(Duration::from_secs(1), 10);
    type_keys(&mut st, "/");
    assert!(st.editing);
    // Keys are the filter's text while it is typed: `q` does not quit.
    type_keys(&mut st, "BUSq");
    handle_key(&mut st, KeyCode::Backspace, KeyModifiers::NONE);
    handle_key(&mut st, KeyCode::Enter, KeyModifiers::NONE);
    assert!(!st.editing);
    assert_eq!(st.filter, "BUS");
    let snap = snapshot();
    let shown: Vec<&str> = snap
        .rows
        .iter()
        .filter(|r| st.shows(r))
        .map(|r| r.function.as_str())
        .collect();
    assert_eq!(shown, ["busy"]);
    let mut terminal = Terminal::new(TestBackend::new(110, 8)).unwrap();
    draw_on(&mut terminal, &snap, &st).unwrap();
    let text = screen(&terminal);
    assert!(text[1].contains("1 of 2 functions match"), "{text:#?}");
    assert!(
        text[3].contains("busy") && !text[4].contains("slow"),
        "{text:#?}"
    );
    assert!(text[7].contains("filter /BUS"), "{text:#?}");
    // By file and by file:line.
    st.filter = "main.py:3".into();
    assert!(snap.rows.iter().all(|r| st.shows(r)));
    st.filter = "other.py".into();
    assert!(!snap.rows.iter().any(|r| st.shows(r)));
    // Esc clears the filter, a second Esc quits.
    assert_eq!(
        handle_key(&mut st, KeyCode::Esc, KeyModifiers::NONE),
        Some(false)
    );
    assert!(st.filter.is_empty());
    assert_eq!(handle_key(&mut st, KeyCode::Esc, KeyModifiers::NONE), None);
}

#[test]
fn esc_while_typing_drops_the_filter_and_ctrl_c_still_quits() {
    let mut st = ViewState::new(Duration::from_secs(1), 10);
    type_keys(&mut st, "/slo");
    let mut terminal = Terminal::new(TestBackend::new(110, 8)).unwrap();
    draw_on(&mut terminal, &snapshot(), &st).unwrap();
    assert!(screen(&terminal)[7].contains("filter: /slo_"));
    handle_key(&mut st, KeyCode::Esc, KeyModifiers::NONE);
    assert!(!st.editing && st.filter.is_empty());
    type_keys(&mut st, "/x");
    assert_eq!(
        handle_key(&mut st, KeyCode::Char('c'), KeyModifiers::CONTROL),
        None
    );
}

#[test]
fn t_cycles_through_the_threads_seen_then_all_and_shift_t_sorts_by_total() {
    let mut st = ViewState::new(Duration::from_secs(1), 20);
    let seen = Snapshot {
        threads: vec![7, 12, 30],
        ..snapshot()
    };
    st.saw(&seen);
    let mut shown = Vec::new();
    for _ in 0..4 {
        // Each press asks for a new snapshot, of the thread now shown.
        assert_eq!(
            handle_key(&mut st, KeyCode::Char('t'), KeyModifiers::NONE),
            Some(true)
        );
        shown.push(st.thread);
    }
    assert_eq!(shown, [Some(7), Some(12), Some(30), None]);
    // A thread shown that has gone quiet stays in the cycle.
    handle_key(&mut st, KeyCode::Char('t'), KeyModifiers::NONE);
    handle_key(&mut st, KeyCode::Char('t'), KeyModifiers::NONE);
    st.saw(&Snapshot {
        threads: vec![7, 30],
        ..snapshot()
    });
    assert_eq!(st.threads, [7, 12, 30]);
    handle_key(&mut st, KeyCode::Char('t'), KeyModifiers::NONE);
    assert_eq!(st.thread, Some(30));
    assert_eq!(st.sort, TopSort::Hot);
    handle_key(&mut st, KeyCode::Char('T'), KeyModifiers::NONE);
    assert_eq!(st.sort, TopSort::Total);
    let title = text::title_line(&Snapshot {
        thread: Some(30),
        ..snapshot()
    });
    assert!(
        title.starts_with("pyprobe top: pid 42, thread 30, CPython"),
        "{title}"
    );
}
