//! A snapshot drawn in a terminal frame (ratatui), and the keys of the live view.

use std::io;
use std::time::Duration;

use crossterm::event::{KeyCode, KeyModifiers};
use ratatui::backend::Backend;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::{Frame, Terminal};

use super::snapshot::{sort_rows, Snapshot, TopRow, TopSort};
use super::text::{cells, headers, status_line, title_line};
use crate::output::units::format_ns;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewState {
    /// Order of the rows.
    pub sort: TopSort,
    /// No refresh while paused.
    pub paused: bool,
    /// Refresh period.
    pub interval: Duration,
    /// Most rows shown.
    pub limit: usize,
    /// Only rows whose name, file or `file:line` contain this (any case).
    pub filter: String,
    /// The filter is being typed (`/` until Enter or Esc).
    pub editing: bool,
    /// The one thread shown (`t` cycles through the threads seen, then all).
    pub thread: Option<u32>,
    /// The threads seen in the last snapshot, by id (what `t` cycles through).
    pub threads: Vec<u32>,
}

impl ViewState {
    /// The hottest first, refreshed each `interval`, at most `limit` rows.
    pub fn new(interval: Duration, limit: usize) -> ViewState {
        ViewState {
            sort: TopSort::Hot,
            paused: false,
            interval,
            limit,
            filter: String::new(),
            editing: false,
            thread: None,
            threads: Vec::new(),
        }
    }

    /// Takes the threads a new snapshot saw, for `t` to cycle through.
    pub fn saw(&mut self, snapshot: &Snapshot) {
        self.threads.clone_from(&snapshot.threads);
        if let Some(tid) = self.thread {
            // The thread shown stays in the cycle, quiet or gone.
            if let Err(at) = self.threads.binary_search(&tid) {
                self.threads.insert(at, tid);
            }
        }
    }

    /// The next thread to show: all threads, then each thread seen in turn by id,
    /// then all again.
    fn next_thread(&mut self) {
        self.thread = match self.thread {
            None => self.threads.first().copied(),
            Some(tid) => self.threads.iter().copied().find(|&t| t > tid),
        };
    }

    /// Whether `row` passes the filter.
    pub fn shows(&self, row: &TopRow) -> bool {
        if self.filter.is_empty() {
            return true;
        }
        let wanted = self.filter.to_lowercase();
        let located = format!("{}:{}", row.file, row.line);
        [&row.function, &row.file, &located]
            .iter()
            .any(|text| text.to_lowercase().contains(&wanted))
    }
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

    let mut rows: Vec<TopRow> = snapshot
        .rows
        .iter()
        .filter(|r| state.shows(r))
        .cloned()
        .collect();
    if !state.filter.is_empty() {
        st.push_str(&format!(
            "   {} of {} functions match",
            rows.len(),
            snapshot.rows.len()
        ));
    }
    frame.render_widget(Paragraph::new(st), status);
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
    let helptext = if state.editing {
        format!(
            "filter: /{}_   (name, file or file:line; Enter keeps it, Esc clears it)",
            state.filter
        )
    } else {
        // A filter in force comes first: the line is cut at the terminal's width.
        let filter = if state.filter.is_empty() {
            String::new()
        } else {
            format!("filter /{} (Esc clears)   ", state.filter)
        };
        let thread = match state.thread {
            None => "all".to_string(),
            Some(tid) => tid.to_string(),
        };
        format!(
            "{filter}q quit  p pause  / filter  t thread ({thread})  c calls/hot  o own  T total  n name  f file  +/- interval ({})   sorted by {}",
            format_ns(state.interval.as_nanos() as u64),
            state.sort.label(snapshot.mode)
        )
    };
    frame.render_widget(
        Paragraph::new(helptext).style(Style::default().add_modifier(Modifier::DIM)),
        help,
    );
}

/// What a key does to the view; `None` to quit. While the filter is typed, keys
/// are its text.
pub fn handle_key(state: &mut ViewState, code: KeyCode, modifiers: KeyModifiers) -> Option<bool> {
    if code == KeyCode::Char('c') && modifiers.contains(KeyModifiers::CONTROL) {
        return None;
    }
    if state.editing {
        match code {
            KeyCode::Enter => state.editing = false,
            KeyCode::Esc => {
                state.editing = false;
                state.filter.clear();
            }
            KeyCode::Backspace => {
                state.filter.pop();
            }
            KeyCode::Char(c) if !c.is_control() => state.filter.push(c),
            _ => {}
        }
        return Some(false);
    }
    let mut refresh = false;
    match code {
        KeyCode::Char('q') => return None,
        // Esc clears a filter first, then quits.
        KeyCode::Esc if !state.filter.is_empty() => state.filter.clear(),
        KeyCode::Esc => return None,
        KeyCode::Char('/') => state.editing = true,
        KeyCode::Char('p') | KeyCode::Char(' ') => state.paused = !state.paused,
        KeyCode::Char('c') | KeyCode::Char('h') => state.sort = TopSort::Hot,
        KeyCode::Char('o') => state.sort = TopSort::Own,
        KeyCode::Char('T') => state.sort = TopSort::Total,
        KeyCode::Char('t') => {
            state.next_thread();
            refresh = true;
        }
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
