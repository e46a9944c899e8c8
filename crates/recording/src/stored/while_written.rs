//! The views of a recording, built while it is written: `pyprobe record`'s
//! planning thread, which makes the first pass as the file grows, also replays
//! the events, a little behind that pass, with the plan of the events so far.
//! When the recording is finished, the views are kept for the file
//! ([`ahead`](super::ahead)) only if the whole recording's plan gives every
//! answer those provisional plans gave: then they are exactly the views a
//! replay of the finished file makes. Else they are dropped, and the view
//! reads the events as before.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{ahead, ViewsBuilder};
use crate::analyze::first_pass::{FirstPass, Planned};
use crate::recording::{Completion, Qualnames, RecordingReader};

/// Events the replay stays behind the first pass: what the plan learns of an
/// event from later ones (a function's first line, from its first return)
/// comes mostly within them.
const LAG_EVENTS: u64 = 1 << 20;
/// Events looked at between two looks at whether the recording is finished.
const EVENTS_BETWEEN_LOOKS: u32 = 4096;

/// The views so far.
pub struct ViewsAhead {
    reader: RecordingReader<BufReader<File>>,
    views: ViewsBuilder,
    /// Events the first pass had read when the current plan was made.
    planned_at: u64,
    /// Events the replay stays behind the first pass.
    lag: u64,
}

/// What became of the views when the recording was finished.
pub enum ViewsOutcome {
    /// Kept for the file: the events replayed after the recording ended.
    Kept { late: u64 },
    /// The plan of the whole recording answered otherwise.
    Refuted,
    /// The file could not be read to its end.
    Unread,
}

impl ViewsAhead {
    /// Starts the views of the recording at `partial` when its first pass can
    /// plan them (`pass` has read `planned` events); `None` until then.
    pub fn start(partial: &Path, pass: &FirstPass, planned: u64) -> Option<ViewsAhead> {
        let plan = pass.provisional_plan()?;
        let reader = RecordingReader::open_in_place(partial).ok()?;
        let views = ViewsBuilder::provisional(reader.header(), plan);
        Some(ViewsAhead {
            reader,
            views,
            planned_at: planned,
            lag: LAG_EVENTS,
        })
    }

    /// Stays `lag` events behind the first pass instead of [`LAG_EVENTS`].
    #[cfg(test)]
    pub(super) fn with_lag(self, lag: u64) -> Self {
        ViewsAhead { lag, ..self }
    }

    /// Replays the events up to [`LAG_EVENTS`] behind the first pass (`pass`,
    /// which has read `planned` events), with plans made from it as it goes, or
    /// until `finished` is set. `false` when the views can no longer be the
    /// recording's, or the file cannot be read.
    pub fn advance(&mut self, pass: &FirstPass, planned: u64, finished: &AtomicBool) -> bool {
        let mut since_look = 0u32;
        loop {
            if self.reader.events_read() + self.lag >= self.planned_at {
                if planned < self.planned_at + self.lag {
                    // The pass has not read far enough ahead for a new plan.
                    return !self.views.contradicted();
                }
                let Some(plan) = pass.provisional_plan() else {
                    return !self.views.contradicted();
                };
                if !self.views.replan(plan) {
                    return false;
                }
                self.planned_at = planned;
            }
            since_look += 1;
            if since_look == EVENTS_BETWEEN_LOOKS {
                since_look = 0;
                if finished.load(Ordering::Acquire) {
                    return !self.views.contradicted();
                }
            }
            match self.reader.events().next() {
                Some(Ok(event)) => self.views.push(&self.reader, &event),
                Some(Err(_)) => return false,
                // Caught up with the writer (or read the whole file): later.
                None => {
                    return match self.reader.completion() {
                        Completion::Truncated { .. } => {
                            self.reader.resume().is_ok() && !self.views.contradicted()
                        }
                        Completion::Complete(_) => !self.views.contradicted(),
                        Completion::Reading | Completion::Failed { .. } => false,
                    };
                }
            }
        }
    }

    /// The recording is finished, and `planned` its first pass, `strings` and
    /// `qualnames` its names (read to the end): keeps the views for the file if
    /// they are its views, reading the events left.
    pub fn finish(
        mut self,
        planned: &Planned,
        strings: &[String],
        qualnames: &Qualnames,
    ) -> ViewsOutcome {
        if !self.views.settle(planned.plan.clone()) {
            return ViewsOutcome::Refuted;
        }
        let before = self.views.events();
        if self.reader.resume().is_err() {
            return ViewsOutcome::Unread;
        }
        // The chunk being read, in place; the rest decoded ahead by a thread,
        // now that the recording is finished and a CPU may be free.
        while !self.reader.at_chunk_end() {
            match self.reader.events().next() {
                Some(Ok(event)) => self.views.push(&self.reader, &event),
                Some(Err(_)) => return ViewsOutcome::Unread,
                None => break,
            }
        }
        let mut reader = match self.reader.completion() {
            Completion::Reading => {
                match self
                    .reader
                    .go_on_reading_ahead(strings.to_vec(), qualnames.clone())
                {
                    Ok(reader) => reader,
                    Err(_) => return ViewsOutcome::Unread,
                }
            }
            _ => self.reader,
        };
        while let Some(event) = reader.events().next() {
            match event {
                Ok(event) => self.views.push(&reader, &event),
                Err(_) => return ViewsOutcome::Unread,
            }
        }
        let Completion::Complete(_) = reader.completion() else {
            return ViewsOutcome::Unread;
        };
        let Some(key) = reader.file_key() else {
            return ViewsOutcome::Unread;
        };
        let late = self.views.events() - before;
        let completion = reader.completion();
        let views = self.views.finish(&reader, planned.clone());
        ahead::remember(key, views, completion);
        ViewsOutcome::Kept { late }
    }
}
