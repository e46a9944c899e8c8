//! The first pass over a recording, which every view of its calls needs before
//! it replays them: the replay's plan, and the census of what the recording
//! holds (for the exports' sizes). Done here as the events are read, or done
//! while the recording was written and taken from [`planned_ahead`](super::planned_ahead).

use std::io::{Read, Seek};

use rustc_hash::FxHashMap;

use super::{Plan, Planner, SliceFilter};
use crate::recording::{Event, EventKind, Header, RecordError, RecordingReader, StrId};

/// A recording's first pass done before: the replay's plan and the census of
/// every call (no filter), as its views file keeps them.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Planned {
    pub plan: Plan,
    pub census: Census,
}

/// What a recording holds, counted while its replay is planned, with the trace
/// exports' filter applied: enough to estimate an export's size before a byte of
/// it is written, and to choose the shortest call it keeps so that it fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Census {
    /// Every event of the recording.
    pub events: u64,
    /// Calls the filter keeps: a slice each in a Chrome trace, an open and a
    /// close event in speedscope.
    pub calls: u64,
    /// Bytes of the names of those calls (function and file).
    pub(crate) call_name_bytes: u64,
    /// Stack samples, and the frames they hold together.
    pub samples: u64,
    pub(crate) sample_frames: u64,
    /// GC, import, audit, lost-event and window events.
    pub(crate) others: u64,
    /// The calls the file filter keeps, by duration: bucket `b` holds those of
    /// 2^b ns up to 2^(b+1) (the last also the calls never seen to end), as
    /// (calls, bytes of their names).
    #[serde(with = "duration_buckets")]
    pub(crate) durations: [(u64, u64); DURATION_BUCKETS],
}

/// The census's buckets stored as a list (serde stores arrays of up to 32).
mod duration_buckets {
    use super::DURATION_BUCKETS;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(
        buckets: &[(u64, u64); DURATION_BUCKETS],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        buckets.to_vec().serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<[(u64, u64); DURATION_BUCKETS], D::Error> {
        let list = Vec::<(u64, u64)>::deserialize(d)?;
        let n = list.len();
        list.try_into().map_err(|_| {
            serde::de::Error::custom(format!("a census has {DURATION_BUCKETS} buckets, not {n}"))
        })
    }
}

pub(crate) const DURATION_BUCKETS: usize = 64;

impl Default for Census {
    fn default() -> Self {
        Census {
            events: 0,
            calls: 0,
            call_name_bytes: 0,
            samples: 0,
            sample_frames: 0,
            others: 0,
            durations: [(0, 0); DURATION_BUCKETS],
        }
    }
}

/// Counts a recording for its [`Census`]. Calls are paired with returns per
/// thread (by function) to know their durations.
struct Counter<'a> {
    filter: &'a SliceFilter,
    census: Census,
    /// Whether each file passes the filter, by string id.
    files: FxHashMap<StrId, bool>,
    /// Per thread: the open calls (function, entry time, name bytes if kept).
    open: FxHashMap<u32, Vec<(StrId, u64, Option<u64>)>>,
}

impl<'a> Counter<'a> {
    fn new(filter: &'a SliceFilter) -> Self {
        Counter {
            filter,
            census: Census::default(),
            files: FxHashMap::default(),
            open: FxHashMap::default(),
        }
    }

    /// A call the file filter kept, `ns` long (`None`: never seen to end).
    fn kept_call(&mut self, ns: Option<u64>, name_bytes: u64) {
        count_kept_call(&mut self.census, self.filter, ns, name_bytes);
    }

    fn push(&mut self, event: &Event, strings: &[String]) {
        self.census.events += 1;
        let len = |id: StrId| strings.get(id.0 as usize).map_or(0, |s| s.len() as u64);
        match &event.kind {
            EventKind::Call { frame } | EventKind::Resume { frame } => {
                let filter = self.filter;
                let kept = *self.files.entry(frame.file).or_insert_with(|| {
                    let file = strings
                        .get(frame.file.0 as usize)
                        .map_or("", String::as_str);
                    filter.files.matches(file)
                });
                let names = kept.then(|| 2 * len(frame.function) + 2 * len(frame.file));
                let stack = self.open.entry(event.tid).or_default();
                if stack.len() < crate::analyze::MAX_DEPTH {
                    stack.push((frame.function, event.ts_ns, names));
                } else if let Some(bytes) = names {
                    self.kept_call(None, bytes);
                }
            }
            EventKind::Return { frame, .. } => {
                let Some(stack) = self.open.get_mut(&event.tid) else {
                    return;
                };
                let Some(i) = stack.iter().rposition(|(f, ..)| *f == frame.function) else {
                    return;
                };
                // Frames above it never returned: they end with it.
                for (_, start, names) in stack.drain(i..) {
                    if let Some(bytes) = names {
                        let ns = Some(event.ts_ns.saturating_sub(start));
                        count_kept_call(&mut self.census, self.filter, ns, bytes);
                    }
                }
            }
            EventKind::Sample { frames, .. } => {
                self.census.samples += 1;
                self.census.sample_frames += frames.len() as u64;
            }
            EventKind::GcStart { .. }
            | EventKind::ImportStart { .. }
            | EventKind::Audit { .. }
            | EventKind::Lost { .. }
            | EventKind::Window { .. } => self.census.others += 1,
            _ => {}
        }
    }

    /// Calls still open at the end last until then: counted.
    fn finish(mut self) -> Census {
        let open: Vec<u64> = self
            .open
            .values()
            .flatten()
            .filter_map(|&(_, _, names)| names)
            .collect();
        for bytes in open {
            self.kept_call(None, bytes);
        }
        self.census
    }
}

/// Counts into `census` a call `filter`'s files kept, `ns` long (`None`: never
/// seen to end), its names `name_bytes` long.
fn count_kept_call(census: &mut Census, filter: &SliceFilter, ns: Option<u64>, name_bytes: u64) {
    let bucket = match ns {
        Some(0) => 0,
        Some(ns) => (63 - ns.leading_zeros()) as usize,
        None => DURATION_BUCKETS - 1,
    };
    let d = &mut census.durations[bucket];
    d.0 += 1;
    d.1 += name_bytes;
    if ns.is_none_or(|ns| filter.long_enough(ns)) {
        census.calls += 1;
        census.call_name_bytes += name_bytes;
    }
}

/// Events between two calls of a pass's progress callback.
pub(crate) const PROGRESS_EVENTS: u64 = 1 << 20;

/// The first pass over `reader`: the replay's plan, and the recording's
/// [`Census`] under `filter`, calling `progress` with the bytes read now and
/// then. Leaves the reader at the first event again (with every name of the
/// recording known).
pub(crate) fn plan_recording_reporting<R: Read + Seek>(
    reader: &mut RecordingReader<R>,
    filter: &SliceFilter,
    progress: &mut dyn FnMut(u64),
) -> Result<(Plan, Census), RecordError> {
    if filter.is_empty() {
        if let Some(known) = super::planned_ahead::known(reader) {
            return Ok((known.plan, known.census));
        }
    }
    let mut pass = FirstPass::new(reader.header(), filter);
    let mut events = 0u64;
    while let Some(event) = reader.next_event() {
        pass.push(&event?, reader.strings());
        events += 1;
        if events % PROGRESS_EVENTS == 0 {
            progress(reader.bytes_read());
        }
    }
    reader.rewind()?;
    Ok(pass.finish())
}

/// The first pass, fed one event at a time.
pub struct FirstPass<'a> {
    planner: Planner,
    counter: Counter<'a>,
}

impl<'a> FirstPass<'a> {
    /// The first pass of the recording whose header is `header`, counting the
    /// calls `filter` keeps.
    pub fn new(header: &Header, filter: &'a SliceFilter) -> Self {
        FirstPass {
            planner: Planner::new(header),
            counter: Counter::new(filter),
        }
    }

    /// Takes the next event in; `strings`: the recording's strings read so far.
    pub fn push(&mut self, event: &Event, strings: &[String]) {
        self.planner.push(event, strings);
        self.counter.push(event, strings);
    }

    /// The plan of the events pushed so far, for a replay made while the
    /// recording is written; `None` while it cannot be the whole recording's
    /// yet (a process's cost per event not settled).
    pub fn provisional_plan(&self) -> Option<Plan> {
        self.planner
            .costs_settled()
            .then(|| self.planner.provisional())
    }

    /// The plan and census of every event pushed.
    pub fn finish(self) -> (Plan, Census) {
        (self.planner.finish(), self.counter.finish())
    }
}
