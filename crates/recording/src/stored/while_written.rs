//! A recording read while it is written: `pyprobe record`'s planning thread
//! makes the first pass as the file grows and, once the recording holds enough
//! to plan with (every traced process's cost per event settled), replays the
//! events into its views, [`lag`](LAG_EVENTS) events behind that pass, with
//! the plan of the events so far.
//!
//! The views' reader first catches up with the first pass's; from then on it
//! reads for both, and the events it read wait until the replay is far enough
//! behind (each event is decoded once).
//!
//! When the recording is finished, the views are kept for the file
//! ([`ahead`](super::ahead)) only if the whole recording's plan gives every
//! answer those provisional plans gave: then they are exactly the views a
//! replay of the finished file makes. Else they are dropped, and the view
//! reads the events as before.

use std::collections::VecDeque;
use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use super::side_by_side::{side_by_side, ViewsAtTheEnd};
use super::{ahead, ViewsBuilder};
use crate::analyze::checkpoints::ChunkEnd;
use crate::analyze::first_pass::{FirstPass, Planned};
use crate::analyze::SliceFilter;
use crate::recording::{Completion, Event, FileKey, Qualnames, RecordError, RecordingReader};

/// Events the replay stays at least behind the first pass: what the plan
/// learns of an event from later ones (a function's first line, from its first
/// return; on CPython 3.15, which entries were generator creations) comes
/// mostly within them.
const LAG_EVENTS: u64 = 1 << 17;
/// Events one look reads into the first pass, and replays while the views
/// catch up, before the other gets its turn.
const PER_LOOK: u64 = 1 << 20;
/// Events looked at between two looks at whether the recording is finished.
const EVENTS_BETWEEN_LOOKS: u32 = 4096;
/// Events [`WhileWritten::finish`] reads or replays between two additions to
/// its count of work done.
pub const DONE_EVERY: u64 = 1 << 16;

/// Counts the events of a pass into a shared count, a batch at a time.
pub(super) struct Counted<'a> {
    done: &'a AtomicU64,
    batch: u64,
}

impl<'a> Counted<'a> {
    pub(super) fn new(done: &'a AtomicU64) -> Self {
        Counted { done, batch: 0 }
    }

    pub(super) fn one(&mut self) {
        self.batch += 1;
        if self.batch == DONE_EVERY {
            self.done.fetch_add(DONE_EVERY, Ordering::Relaxed);
            self.batch = 0;
        }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.done.fetch_add(self.batch, Ordering::Relaxed);
    }
}

pub(super) type Reader = RecordingReader<BufReader<File>>;

/// The session's flag that the recording is finished, looked at once every
/// [`EVENTS_BETWEEN_LOOKS`] events.
struct Flag<'a> {
    flag: &'a AtomicBool,
    events: u32,
}

impl<'a> Flag<'a> {
    fn new(flag: &'a AtomicBool) -> Self {
        Flag { flag, events: 0 }
    }

    /// Counts an event; whether the flag was found set.
    fn now(&mut self) -> bool {
        self.events += 1;
        if self.events < EVENTS_BETWEEN_LOOKS {
            return false;
        }
        self.events = 0;
        self.flag.load(Ordering::Acquire)
    }
}

/// The first pass's filter: none (every call counted).
fn no_filter() -> &'static SliceFilter {
    static NONE: OnceLock<SliceFilter> = OnceLock::new();
    NONE.get_or_init(SliceFilter::default)
}

/// See the module documentation.
pub struct WhileWritten {
    /// The recording, as it is written.
    path: PathBuf,
    /// The first pass's reader, until the views' reader reads for both.
    planner: Reader,
    pass: FirstPass<'static>,
    /// Events in the pass.
    planned: u64,
    views: Option<Views>,
    /// The views were dropped: they are not begun again.
    views_dropped: bool,
    /// Events the replay stays behind the pass.
    lag: u64,
    /// Events one look replays while the views catch up.
    catch_up_per_look: u64,
}

/// The views so far.
struct Views {
    reader: Reader,
    builder: ViewsBuilder,
    /// Events in the pass when the current plan was made.
    planned_at: u64,
    /// Once the views' reader caught up: the events it read, and where each
    /// chunk ended, not replayed yet.
    waiting: Option<VecDeque<(Event, Option<ChunkEnd>)>>,
}

/// What a look at the file came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Looked {
    /// Everything written so far was read: look again later.
    Later,
    /// More was written than this look read: look again at once.
    Again,
    /// Stopped: the recording is finished (the session says so, or the end
    /// marker was read).
    Finished,
}

/// What became of the views when the recording was finished.
pub enum ViewsOutcome {
    /// Kept for the file: the events replayed after the recording ended.
    Kept { late: u64 },
    /// The plan of the whole recording answered otherwise.
    Refuted,
    /// The file could not be read to its end.
    Unread,
    /// After the recording ended, the first pass could not plan for long (a
    /// process whose cost per event was still being measured): the replay
    /// gave up rather than hold the events waiting for a plan.
    Unplanned,
}

/// The first pass of the whole recording and its names, and the views.
pub struct Finished {
    pub key: FileKey,
    pub planned: Planned,
    pub strings: Vec<String>,
    pub qualnames: Qualnames,
    /// Events of the recording.
    pub events: u64,
    /// Of those, the ones the first pass read after the recording ended.
    pub planned_late: u64,
    /// What became of the views, if they were begun.
    pub views: Option<ViewsOutcome>,
}

impl WhileWritten {
    /// Reads the recording being written at `path`, which `planner` reads
    /// (opened in place, at its first event).
    pub fn new(path: PathBuf, planner: Reader) -> Self {
        let pass = FirstPass::new(planner.header(), no_filter());
        WhileWritten {
            path,
            planner,
            pass,
            planned: 0,
            views: None,
            views_dropped: false,
            lag: LAG_EVENTS,
            catch_up_per_look: PER_LOOK,
        }
    }

    /// Stays `lag` events behind the first pass instead of [`LAG_EVENTS`].
    #[cfg(test)]
    pub(super) fn with_lag(self, lag: u64) -> Self {
        WhileWritten { lag, ..self }
    }

    /// Replays at most `events` a look while catching up, instead of
    /// [`PER_LOOK`].
    #[cfg(test)]
    pub(super) fn with_catch_up_per_look(self, events: u64) -> Self {
        WhileWritten {
            catch_up_per_look: events,
            ..self
        }
    }

    /// Whether the views' reader reads for both (each event decoded once).
    #[cfg(test)]
    pub(super) fn reads_once(&self) -> bool {
        self.views.as_ref().is_some_and(|v| v.waiting.is_some())
    }

    /// Reads what was written since the last look, until it is all read or
    /// `finished` is set (looked at now and then).
    pub fn look(&mut self, finished: &AtomicBool) -> Result<Looked, RecordError> {
        let finished = &mut Flag::new(finished);
        if self.views.as_ref().is_some_and(|v| v.waiting.is_some()) {
            return self.look_together(finished);
        }
        self.planner.resume()?;
        let planning = plan_some(&mut self.planner, &mut self.pass, PER_LOOK, finished)?;
        self.planned = self.planner.events_read();
        match planning {
            Planning::Stopped => return Ok(Looked::Finished),
            Planning::AllRead => match self.planner.completion() {
                Completion::Truncated { .. } => {}
                _ => return Ok(Looked::Finished),
            },
            Planning::MoreToRead => {}
        }
        if self.views.is_none() && !self.views_dropped {
            self.views = self.begin_views();
        }
        match self.catch_up(finished)? {
            Looked::Later if planning == Planning::MoreToRead => Ok(Looked::Again),
            looked => Ok(looked),
        }
    }

    /// The views, when the pass can plan them.
    fn begin_views(&self) -> Option<Views> {
        let plan = self.pass.provisional_plan()?;
        // A file description of its own: readers of one share its offset.
        let reader = RecordingReader::open_in_place(&self.path).ok()?;
        let builder = ViewsBuilder::provisional(reader.header(), plan);
        Some(Views {
            reader,
            builder,
            planned_at: self.planned,
            waiting: None,
        })
    }

    /// Replays up to the lag behind the pass, with plans made from it as it
    /// goes; reads for both once there.
    fn catch_up(&mut self, finished: &mut Flag) -> Result<Looked, RecordError> {
        let lag = self.lag;
        for _ in 0..self.catch_up_per_look {
            let Some(v) = self.views.as_mut() else {
                return Ok(Looked::Later);
            };
            if v.reader.events_read() + lag >= self.planned {
                // Caught up: the views' reader reads for both from here.
                v.waiting = Some(VecDeque::new());
                return self.look_together(finished);
            }
            if v.reader.events_read() + lag >= v.planned_at && !self.replan() {
                return Ok(Looked::Later);
            }
            if finished.now() {
                return Ok(Looked::Finished);
            }
            let Some(v) = self.views.as_mut() else {
                return Ok(Looked::Later);
            };
            match v.reader.events().next() {
                Some(Ok(event)) => v.builder.push(&v.reader, &event),
                Some(Err(e)) => return Err(e),
                // Behind the pass: never at the end of what was written.
                None => return Ok(Looked::Later),
            }
        }
        // The pass's turn.
        Ok(Looked::Later)
    }

    /// A plan made from the pass as it is now, for the views; `false` when the
    /// views were dropped (a question already answered two ways).
    fn replan(&mut self) -> bool {
        let Some(v) = self.views.as_mut() else {
            return false;
        };
        let Some(plan) = self.pass.provisional_plan() else {
            return true;
        };
        v.planned_at = self.planned;
        if v.builder.replan(plan) {
            return true;
        }
        self.drop_views();
        false
    }

    fn drop_views(&mut self) {
        self.views = None;
        self.views_dropped = true;
    }

    /// The views' reader reads for the pass and the views: each event into the
    /// pass (unless it was planned before), then waits until the replay is
    /// twice the lag behind the newest, so that each is replayed with a plan
    /// that saw at least the lag of events after it.
    fn look_together(&mut self, finished: &mut Flag) -> Result<Looked, RecordError> {
        let lag = self.lag;
        loop {
            if finished.now() {
                return Ok(Looked::Finished);
            }
            let Some(v) = self.views.as_mut() else {
                return Ok(Looked::Later);
            };
            let event = match v.reader.events().next() {
                Some(Ok(event)) => event,
                Some(Err(e)) => return Err(e),
                None => {
                    return match v.reader.completion() {
                        Completion::Truncated { .. } => {
                            v.reader.resume()?;
                            Ok(Looked::Later)
                        }
                        _ => Ok(Looked::Finished),
                    };
                }
            };
            let read = v.reader.events_read();
            if read > self.planned {
                self.pass.push(&event, v.reader.strings());
                self.planned = read;
            }
            let end = ChunkEnd::of(&v.reader);
            let Some(waiting) = v.waiting.as_mut() else {
                return Ok(Looked::Later);
            };
            waiting.push_back((event, end));
            while waiting.len() as u64 > 2 * lag {
                if let Some((event, end)) = waiting.pop_front() {
                    v.builder.push_at(end, &event);
                }
            }
            if self.planned >= v.planned_at + lag && !self.replan() {
                return Ok(Looked::Later);
            }
        }
    }

    /// What [`Self::finish`] has left to do on a recording of `events` events:
    /// events to read into the first pass, and to replay into the views.
    pub fn left(&self, events: u64) -> u64 {
        let replayed = self.views.as_ref().map(|v| v.builder.events());
        events.saturating_sub(self.planned) + replayed.map_or(0, |r| events.saturating_sub(r))
    }

    /// The recording is finished (its end marker written): reads the rest into
    /// the first pass and, if every answer of their plans holds, into the views:
    /// side by side, each on a thread of its own (see [`side_by_side`]), where
    /// the rest goes past the chunk being read; else the pass first, then the
    /// views. Adds to `done` as it goes (every [`DONE_EVERY`] events read or
    /// replayed), for a progress line. `None` when the file cannot be read to
    /// its end marker.
    pub fn finish(self, done: &AtomicU64) -> Option<Finished> {
        let WhileWritten {
            planner,
            mut pass,
            planned,
            views,
            lag,
            ..
        } = self;
        let Some(Views {
            reader,
            builder,
            planned_at,
            waiting,
        }) = views
        else {
            let names = read_tail(planner, &mut pass, planned, done)?;
            let (plan, census) = pass.finish();
            return Some(finished(planned, names, Planned { plan, census }, None));
        };
        // The views' reader reads for both (the events it read wait for the
        // replay), or the pass's own while the views catch up: first the rest of
        // its chunk, into the pass.
        let (mut waiting, mut for_pass, views_reader) = match waiting {
            Some(waiting) => (Some(waiting), reader, None),
            None => (None, planner, Some(reader)),
        };
        read_in_place(&mut for_pass, &mut pass, planned, waiting.as_mut(), done)?;
        let waiting = waiting.unwrap_or_default();
        if matches!(for_pass.completion(), Completion::Reading) {
            // The rest: read once, by the views' reader, for both.
            let in_pass = for_pass.events_read();
            let views = ViewsAtTheEnd {
                builder,
                planned_at,
                waiting,
                reader: views_reader.unwrap_or(for_pass),
            };
            let ended = side_by_side(pass, in_pass, views, lag, done)?;
            return Some(finished(
                planned,
                ended.names,
                ended.planned,
                Some(ended.views),
            ));
        }
        let names = names_at_the_end(&for_pass)?;
        let reader = views_reader.unwrap_or(for_pass);
        let (plan, census) = pass.finish();
        let whole = Planned { plan, census };
        let views = replay_rest(builder, waiting, reader, &whole, done);
        Some(finished(planned, names, whole, Some(views)))
    }
}

/// What [`WhileWritten::finish`] comes to, the pass having planned `planned`
/// events before the recording ended.
fn finished(planned: u64, names: Names, whole: Planned, views: Option<ViewsOutcome>) -> Finished {
    Finished {
        key: names.key,
        planned: whole,
        events: names.events,
        planned_late: names.events.saturating_sub(planned),
        strings: names.strings,
        qualnames: names.qualnames,
        views,
    }
}

/// What the reader that read a recording to its end marker knows.
pub(super) struct Names {
    key: FileKey,
    strings: Vec<String>,
    qualnames: Qualnames,
    events: u64,
}

impl Names {
    pub(super) fn of(reader: &Reader) -> Option<Names> {
        Some(Names {
            key: reader.file_key()?,
            strings: reader.strings().to_vec(),
            qualnames: reader.qualnames().clone(),
            events: reader.events_read(),
        })
    }
}

/// Reads every event of `reader` from where it is to the end marker, into
/// `pass` those after the first `planned`. `None` unless it reads to the end
/// marker.
fn read_tail(
    reader: Reader,
    pass: &mut FirstPass<'static>,
    planned: u64,
    done: &AtomicU64,
) -> Option<Names> {
    let mut counted = Counted::new(done);
    let tail = read_to_the_end(reader, |r, event| {
        if r.events_read() > planned {
            pass.push(&event, r.strings());
            counted.one();
        }
    })?;
    Names::of(&tail)
}

/// Reads `reader` in place to the end of its chunk (or to the end marker),
/// into `pass` the events after the first `planned`, and into `waiting` too,
/// when given. `None` at an error.
fn read_in_place(
    reader: &mut Reader,
    pass: &mut FirstPass<'static>,
    planned: u64,
    mut waiting: Option<&mut VecDeque<(Event, Option<ChunkEnd>)>>,
    done: &AtomicU64,
) -> Option<()> {
    let mut counted = Counted::new(done);
    read_to_chunk_end(reader, |r, event| {
        if r.events_read() > planned {
            pass.push(&event, r.strings());
            counted.one();
        }
        if let Some(w) = waiting.as_mut() {
            w.push_back((event, ChunkEnd::of(r)));
        }
    })
}

/// The names of a reader that stopped reading: `None` unless at the end marker.
fn names_at_the_end(reader: &Reader) -> Option<Names> {
    match reader.completion() {
        Completion::Complete(_) => Names::of(reader),
        _ => None,
    }
}

/// Settles the views with the whole recording's plan and, if they hold,
/// replays the events waiting, then the rest from `reader`'s place (a chunk
/// end, or in place up to one), and keeps them for the file.
fn replay_rest(
    mut builder: ViewsBuilder,
    waiting: VecDeque<(Event, Option<ChunkEnd>)>,
    reader: Reader,
    planned: &Planned,
    done: &AtomicU64,
) -> ViewsOutcome {
    if !builder.settle(planned.plan.clone()) {
        return ViewsOutcome::Refuted;
    }
    let mut counted = Counted::new(done);
    let before = builder.events();
    for (event, end) in &waiting {
        builder.push_at(*end, event);
        counted.one();
    }
    // Events already waiting were read in place up to a chunk end; a reader
    // still catching up may be inside one.
    let rest = read_to_the_end(reader, |r, event| {
        builder.push(r, &event);
        counted.one();
    });
    let Some((rest, key)) = rest.and_then(|r| r.file_key().map(|key| (r, key))) else {
        return ViewsOutcome::Unread;
    };
    let late = builder.events() - before;
    let completion = rest.completion();
    ahead::remember(key, builder.finish(&rest, planned.clone()), completion);
    ViewsOutcome::Kept { late }
}

/// Reads `reader` in place (resumed where the file ended, if it did) to the
/// end of the events chunk it is in, or to the end marker, giving `each` every
/// event with the reader that read it; `None` at an error.
fn read_to_chunk_end(reader: &mut Reader, mut each: impl FnMut(&Reader, Event)) -> Option<()> {
    reader.resume().ok()?;
    while !reader.at_chunk_end() {
        // None: the end marker was read (the thread read to it before it
        // stopped).
        let Some(event) = reader.events().next() else {
            break;
        };
        each(reader, event.ok()?);
    }
    Some(())
}

/// Reads every event from `reader`'s place to the end marker: in place to the
/// end of its chunk, then decoded ahead by a thread that knows the names
/// `reader` knows, giving `each` every event with the reader that read it.
/// Returns the reader that read the end marker; `None` at an error, or without
/// it.
pub(super) fn read_to_the_end(
    mut reader: Reader,
    mut each: impl FnMut(&Reader, Event),
) -> Option<Reader> {
    read_to_chunk_end(&mut reader, &mut each)?;
    match reader.completion() {
        Completion::Reading => {}
        Completion::Complete(_) => return Some(reader),
        _ => return None,
    }
    let (strings, qualnames) = (reader.strings().to_vec(), reader.qualnames().clone());
    let mut rest = reader.go_on_reading_ahead(strings, qualnames).ok()?;
    while let Some(event) = rest.events().next() {
        each(&rest, event.ok()?);
    }
    matches!(rest.completion(), Completion::Complete(_)).then_some(rest)
}

/// How far a look's first pass went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Planning {
    /// Every event written so far is in the pass.
    AllRead,
    /// A look's events were read, and more were written: the views get their
    /// turn before the pass reads on.
    MoreToRead,
    /// `finished` was set.
    Stopped,
}

/// Reads the events there are into `pass`, at most `per_look`, or until
/// `finished` is set (looked at now and then).
fn plan_some(
    reader: &mut Reader,
    pass: &mut FirstPass<'static>,
    per_look: u64,
    finished: &mut Flag,
) -> Result<Planning, RecordError> {
    for _ in 0..per_look {
        if finished.now() {
            return Ok(Planning::Stopped);
        }
        match reader.events().next() {
            Some(Ok(event)) => pass.push(&event, reader.strings()),
            Some(Err(e)) => return Err(e),
            None => return Ok(Planning::AllRead),
        }
    }
    Ok(Planning::MoreToRead)
}
