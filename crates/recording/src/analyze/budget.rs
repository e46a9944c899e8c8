//! What an overhead budget did to a recording, over time: the exact windows of
//! function tracing, and the stretches where GC, import and audit events went
//! without their stacks.

use super::model::{ExactWindows, Thinned};
use crate::recording::ThinLevel;

/// Stretches where GC, import and audit events went without their stacks.
#[derive(Default, Clone, Copy)]
pub(super) struct ThinningTracker {
    seen: bool,
    /// Since when thinned, and since when audit events are not even counted.
    since: Option<u64>,
    uncounted_since: Option<u64>,
    thinned_ns: u64,
    uncounted_ns: u64,
    events: u64,
    pub audits_counted: u64,
}

impl ThinningTracker {
    pub(crate) fn set(&mut self, level: ThinLevel, ts: u64) {
        self.seen = true;
        let close = |since: &mut Option<u64>, total: &mut u64| {
            if let Some(s) = since.take() {
                *total = total.saturating_add(ts.saturating_sub(s));
            }
        };
        if level == ThinLevel::Full {
            close(&mut self.since, &mut self.thinned_ns);
        } else if self.since.is_none() {
            self.since = Some(ts);
        }
        if level == ThinLevel::Uncounted {
            self.uncounted_since.get_or_insert(ts);
        } else {
            close(&mut self.uncounted_since, &mut self.uncounted_ns);
        }
    }

    /// A GC, import or audit event: counted if it went without its stack.
    pub fn event(&mut self) {
        if self.since.is_some() {
            self.events += 1;
        }
    }

    pub fn finish(self, end: u64) -> Option<Thinned> {
        let open = |since: Option<u64>| since.map_or(0, |s| end.saturating_sub(s));
        self.seen.then(|| Thinned {
            events: self.events,
            audits_counted: self.audits_counted,
            thinned_ns: self.thinned_ns.saturating_add(open(self.since)),
            uncounted_ns: self.uncounted_ns.saturating_add(open(self.uncounted_since)),
        })
    }
}

/// Exact windows of a budget-limited recording: when function tracing was on.
#[derive(Default, Clone, Copy)]
pub(super) struct WindowTracker {
    /// Window events seen at all (else the recording had no budget).
    pub(crate) seen: bool,
    open_since: Option<u64>,
    exact_ns: u64,
    windows: u64,
}

impl WindowTracker {
    pub(crate) fn toggle(&mut self, exact: bool, ts: u64) {
        self.seen = true;
        match (exact, self.open_since) {
            (true, None) => {
                self.open_since = Some(ts);
                self.windows += 1;
            }
            (false, Some(since)) => {
                self.exact_ns = self.exact_ns.saturating_add(ts.saturating_sub(since));
                self.open_since = None;
            }
            _ => {}
        }
    }

    pub fn finish(self, end: u64) -> Option<ExactWindows> {
        self.seen.then(|| ExactWindows {
            exact_ns: self
                .exact_ns
                .saturating_add(self.open_since.map_or(0, |s| end.saturating_sub(s))),
            windows: self.windows,
        })
    }
}
