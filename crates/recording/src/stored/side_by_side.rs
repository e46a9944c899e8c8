//! The rest of a recording read while it was written, once it has ended
//! ([`WhileWritten::finish`](super::WhileWritten::finish)), with views begun:
//! a thread of its own reads the rest once into the first pass and hands each
//! event on, with the pass's provisional plans, to this thread, which replays
//! them into the views as the recording did while it grew (at least the lag
//! behind the pass), then with the whole recording's plan once the pass has
//! made it.
//!
//! During a busy run the views get only idle CPU, so most of their work can be
//! left for after the end: then the pass (with the thread decoding for it) and
//! the replay each have a CPU, instead of one waiting for the other. The views
//! are the recording's only if the whole plan settles them
//! ([`ViewsBuilder::settle`]), as before.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use super::while_written::{read_to_the_end, Counted, Names, Reader};
use super::{ahead, ViewsBuilder, ViewsOutcome};
use crate::analyze::checkpoints::ChunkEnd;
use crate::analyze::first_pass::{FirstPass, Planned};
use crate::analyze::replay::Plan;
use crate::recording::Event;

/// Events handed on at a time.
const BATCH: usize = 4096;
/// Batches on their way at most: the pass waits for the replay beyond.
const BATCHES_ON_THE_WAY: usize = 32;
/// Events the replay keeps waiting for a plan at most, in lags. Past it, the
/// pass could not plan for that long (a process whose cost per event is still
/// being measured, whose answers the whole plan would refute anyway): the views
/// are given up, so that the pass has the CPUs to itself and memory stays
/// bounded.
const MOST_WAITING_LAGS: u64 = 4;

/// Events read, each with where its chunk ended (when it was the last).
type Waiting = VecDeque<(Event, Option<ChunkEnd>)>;

/// What the pass hands on to the replay, in order.
enum HandedOn {
    Events(Vec<(Event, Option<ChunkEnd>)>),
    /// A plan of the events up to `at`.
    Provisional {
        at: u64,
        plan: Plan,
    },
    /// The whole recording's plan: the last thing handed on.
    Whole(Plan),
}

/// Where the views stand when the recording ended.
pub(super) struct ViewsAtTheEnd {
    pub(super) builder: ViewsBuilder,
    /// Events in the pass when the plan the builder replays with was made.
    pub(super) planned_at: u64,
    /// Events read, not replayed yet, that come before `reader`'s.
    pub(super) waiting: Waiting,
    /// Reads the rest for both: at a chunk end, or inside one.
    pub(super) reader: Reader,
}

/// What [`side_by_side`] came to: the whole recording's names and plan, and
/// what became of the views.
pub(super) struct SideBySide {
    pub(super) names: Names,
    pub(super) planned: Planned,
    pub(super) views: ViewsOutcome,
}

/// Reads the rest of the recording with `views.reader` into `pass` (the events
/// after the first `planned`, which the pass holds) and replays it into the
/// views beside it, staying `lag` events behind. `None` when the pass could not
/// read the file to its end marker.
pub(super) fn side_by_side(
    pass: FirstPass<'static>,
    planned: u64,
    views: ViewsAtTheEnd,
    lag: u64,
    done: &AtomicU64,
) -> Option<SideBySide> {
    let ViewsAtTheEnd {
        builder,
        planned_at,
        waiting,
        reader,
    } = views;
    let (to_replay, handed) = sync_channel(BATCHES_ON_THE_WAY);
    std::thread::scope(|scope| {
        let planning =
            scope.spawn(|| plan_and_hand_on(reader, pass, planned, lag, to_replay, done));
        let replay = Replay {
            builder,
            planned_at,
            lag,
            settled: false,
            waiting,
        };
        let replayed = replay.run(&handed, done);
        // Gone with the replay: the pass reads on alone.
        drop(handed);
        let (names, planned, rest) = planning.join().ok()??;
        let views = match replayed {
            Ok((builder, late)) => {
                let key = rest.file_key()?;
                let completion = rest.completion();
                ahead::remember(key, builder.finish(&rest, planned.clone()), completion);
                ViewsOutcome::Kept { late }
            }
            Err(outcome) => outcome,
        };
        Some(SideBySide {
            names,
            planned,
            views,
        })
    })
}

/// The pass's side: every event of `reader` from its place into `pass` (those
/// after the first `planned`) and on to the replay, a provisional plan every
/// `lag` events, then the whole plan. Returns the reader that read the end marker.
fn plan_and_hand_on(
    reader: Reader,
    mut pass: FirstPass<'static>,
    planned: u64,
    lag: u64,
    to_replay: SyncSender<HandedOn>,
    done: &AtomicU64,
) -> Option<(Names, Planned, Reader)> {
    let mut hand = Hand {
        to_replay: Some(to_replay),
        batch: Vec::with_capacity(BATCH),
    };
    if let Some(plan) = pass.provisional_plan() {
        hand.on(HandedOn::Provisional { at: planned, plan });
    }
    let mut counted = Counted::new(done);
    let mut since_plan = 0;
    let mut each = |r: &Reader, event: Event| {
        let read = r.events_read();
        if read > planned {
            pass.push(&event, r.strings());
            counted.one();
            since_plan += 1;
        }
        hand.event(event, ChunkEnd::of(r));
        if since_plan >= lag {
            since_plan = 0;
            if let Some(plan) = pass.provisional_plan() {
                hand.on(HandedOn::Provisional { at: read, plan });
            }
        }
    };
    let rest = read_to_the_end(reader, &mut each)?;
    let names = Names::of(&rest)?;
    let (plan, census) = pass.finish();
    hand.on(HandedOn::Whole(plan.clone()));
    Some((names, Planned { plan, census }, rest))
}

/// The pass's end of the channel: events go in batches, a plan after the
/// events read before it.
struct Hand {
    /// `None` once the replay has stopped.
    to_replay: Option<SyncSender<HandedOn>>,
    batch: Vec<(Event, Option<ChunkEnd>)>,
}

impl Hand {
    fn event(&mut self, event: Event, end: Option<ChunkEnd>) {
        if self.to_replay.is_none() {
            return;
        }
        self.batch.push((event, end));
        if self.batch.len() == BATCH {
            self.flush();
        }
    }

    fn on(&mut self, handed: HandedOn) {
        self.flush();
        self.send(handed);
    }

    fn flush(&mut self) {
        if !self.batch.is_empty() {
            let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
            self.send(HandedOn::Events(batch));
        }
    }

    fn send(&mut self, handed: HandedOn) {
        if let Some(to) = &self.to_replay {
            if to.send(handed).is_err() {
                self.to_replay = None;
            }
        }
    }
}

/// The replay's side.
struct Replay {
    builder: ViewsBuilder,
    planned_at: u64,
    lag: u64,
    /// The whole plan settled the views: every event may be replayed.
    settled: bool,
    waiting: Waiting,
}

impl Replay {
    /// Replays what the pass hands on until it ends. The views settled, and
    /// how many events were replayed.
    fn run(
        mut self,
        handed: &Receiver<HandedOn>,
        done: &AtomicU64,
    ) -> Result<(ViewsBuilder, u64), ViewsOutcome> {
        let mut counted = Counted::new(done);
        let before = self.builder.events();
        loop {
            self.replay_what_may_be(&mut counted);
            let Ok(next) = handed.recv() else { break };
            match next {
                HandedOn::Events(batch) => self.waiting.extend(batch),
                HandedOn::Provisional { at, plan } => {
                    self.planned_at = at;
                    if !self.settled && !self.builder.replan(plan) {
                        return Err(ViewsOutcome::Refuted);
                    }
                }
                HandedOn::Whole(plan) => {
                    if !self.builder.settle(plan) {
                        return Err(ViewsOutcome::Refuted);
                    }
                    self.settled = true;
                }
            }
            if !self.settled && self.waiting.len() as u64 > MOST_WAITING_LAGS * self.lag {
                return Err(ViewsOutcome::Unplanned);
            }
        }
        // The pass ended: with the whole plan, unless it could not read on.
        if !self.settled {
            return Err(ViewsOutcome::Unread);
        }
        self.replay_what_may_be(&mut counted);
        let late = self.builder.events() - before;
        Ok((self.builder, late))
    }

    /// Replays the events waiting that a plan saw `lag` events past (all, once
    /// settled).
    fn replay_what_may_be(&mut self, counted: &mut Counted) {
        while self.settled || self.builder.events() + self.lag < self.planned_at {
            let Some((event, end)) = self.waiting.pop_front() else {
                return;
            };
            self.builder.push_at(end, &event);
            counted.one();
        }
    }
}
