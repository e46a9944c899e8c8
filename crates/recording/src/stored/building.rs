//! The views built one event at a time as the replay goes: from a finished
//! recording with its plan ([`StoredViews::build`](super::StoredViews::build)),
//! or from one still being written with provisional plans, settled when it
//! ends ([`ViewsBuilder::provisional`]).

use std::io::Read;

use super::StoredViews;
use crate::analyze::aggregate::Aggregator;
use crate::analyze::checkpoints::{CheckpointBuilder, ChunkEnd};
use crate::analyze::folded::Folder;
use crate::analyze::line_counts::LineCounts;
use crate::analyze::replay::{Plan, Replay, Step};
use crate::analyze::report::finish_report;
use crate::analyze::SampleFilter;
use crate::output::flame::ViewInfo;
use crate::output::Planned;
use crate::recording::{Event, Header, RecordingReader};

/// See the module documentation.
pub struct ViewsBuilder {
    agg: Aggregator,
    folder: Folder,
    lines: LineCounts,
    checkpoints: CheckpointBuilder,
    replay: Replay,
    steps: Vec<Step>,
    events: u64,
}

impl ViewsBuilder {
    pub(super) fn new(header: &Header, replay: Replay, checkpoints: CheckpointBuilder) -> Self {
        let filter = SampleFilter::default();
        ViewsBuilder {
            agg: Aggregator::with_filter(header, filter),
            folder: Folder::for_recording(header, filter).by_thread(),
            lines: LineCounts::for_recording(header, filter),
            checkpoints,
            replay,
            steps: Vec::new(),
            events: 0,
        }
    }

    /// The views of the recording described by `header`, still being written,
    /// replayed with `plan`, made from its events so far: they are its views
    /// only if [`settle`](Self::settle) says so.
    pub fn provisional(header: &Header, plan: Plan) -> Self {
        Self::new(
            header,
            Replay::provisional(header, plan),
            CheckpointBuilder::default(),
        )
    }

    /// Takes in `event`, the next event read from `reader`.
    pub fn push<R: Read>(&mut self, reader: &RecordingReader<R>, event: &Event) {
        self.push_at(ChunkEnd::of(reader), event);
    }

    /// Takes in `event`, the next event, read before; `chunk_end`: the place
    /// after it, when it was the last of its chunk.
    pub(crate) fn push_at(&mut self, chunk_end: Option<ChunkEnd>, event: &Event) {
        self.steps.clear();
        let ts = self.replay.push(event, &mut self.steps);
        let steps = &self.steps[..];
        self.checkpoints
            .push(chunk_end, event, ts, steps, &self.replay);
        self.agg.push(event, ts, steps, &self.replay);
        self.folder.push(event, ts, steps, &self.replay);
        self.lines.push(&event.kind);
        self.events += 1;
    }

    /// Events taken in.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Goes on with `plan`, a provisional plan of more events; `false` when the
    /// views so far can no longer be the recording's.
    pub fn replan(&mut self, plan: Plan) -> bool {
        self.replay.replan(plan)
    }

    /// Whether a question of the replay was already answered two ways by the
    /// provisional plans: the views can no longer be the recording's.
    pub fn contradicted(&self) -> bool {
        self.replay.contradicted()
    }

    /// Goes on with `plan`, the plan of the whole recording, if every answer the
    /// provisional plans gave is its own: then the views so far are exactly
    /// those of the recording. `false` (and the views are not its) otherwise.
    pub fn settle(&mut self, plan: Plan) -> bool {
        self.replay.settle(plan)
    }

    /// The views, once every event of `reader` is taken in; `planned` is its
    /// first pass, kept with them.
    pub fn finish<R: Read>(self, reader: &RecordingReader<R>, planned: Planned) -> StoredViews {
        let info = ViewInfo::of(reader);
        let stacks = self.folder.finish(self.replay.clone(), info.end_ns);
        let report = finish_report(self.agg, self.replay, reader);
        StoredViews {
            strings: reader.strings().to_vec(),
            info,
            stacks,
            report,
            lines: self.lines,
            planned,
            checkpoints: self.checkpoints.finish(),
        }
    }
}
