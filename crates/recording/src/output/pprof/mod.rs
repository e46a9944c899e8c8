//! `pprof`: a recording as a gzipped `profile.proto`, the format of Go's
//! `go tool pprof` and of continuous profilers (Pyroscope, Grafana, Parca,
//! Cloud Profiler) that collect profiles from a fleet.
//!
//! The profile is the flame graph's folded stacks ([`read_folded_by_thread`]),
//! so its numbers are the flame graph's: a sampled recording gives
//! `samples`/`count` and `cpu`/`nanoseconds` (samples × the sampling interval;
//! `wall` when `--idle` counts waiting threads too), a traced one `calls`/`count`
//! and `wall`/`nanoseconds` (exclusive time, as the flame graph weighs stacks by
//! it; a GC pause is a `[gc gen N]` function on top of the code that triggered
//! it, its time taken out of that code's). A recording with neither samples nor
//! calls is of its mode's kind (an `auto` one: sampled), so that the periods of
//! one recording keep one kind unless some trace calls exactly and others not.
//!
//! Each sample is labelled with its `thread` (named as every view names threads:
//! the recording keeps thread ids, not names) and its process's `pid`. A
//! location is a function at its first line: stacks are folded by function.
//!
//! [`read_folded_by_thread`]: crate::output::flame::read_folded_by_thread

mod proto;

use std::collections::HashMap;
use std::io::{self, Write};

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;

use crate::analyze::folded::{FoldFrame, Folded, Measure};
use crate::output::flame::{is_sampled, ViewInfo};
use crate::output::names::thread_name;
use crate::recording::{or_unnamed, FrameRef, Qualnames, StrId};

pub use proto::Profile;
use proto::{Function, Label, Line, Location, Sample, ValueType};

/// What a profile's two values per sample count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfileKind {
    /// `samples`/`count`, and `cpu`/`nanoseconds` (`wall` with idle threads).
    Sampled,
    /// `calls`/`count` and `wall`/`nanoseconds`.
    Traced,
}

/// What was written: the kind, and the sum of each value over the samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PprofTotals {
    pub kind: ProfileKind,
    /// Samples (or calls) in all, then their nanoseconds.
    pub(crate) values: [u64; 2],
    /// Distinct stacks written (pprof samples).
    pub stacks: usize,
}

/// Interns strings into the profile's string table (index 0 is "").
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Strings::default();
        s.id("");
        s
    }

    fn id(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_owned());
        self.index.insert(s.to_owned(), i);
        i
    }
}

/// Builds the profile's functions and locations: a function per frame's
/// function, a location per frame (a function at a line, with `--lines`).
struct Builder<'a> {
    strings: Strings,
    recording_strings: &'a [String],
    qualnames: &'a Qualnames,
    locations: HashMap<FoldFrame, u64>,
    functions: HashMap<FoldFrame, u64>,
    profile: Profile,
}

impl<'a> Builder<'a> {
    fn recording_string(&self, id: StrId) -> &'a str {
        self.recording_strings
            .get(id.0 as usize)
            .map_or("?", String::as_str)
    }

    /// The function `frame` runs (its line aside), made the first time.
    fn function(&mut self, frame: FoldFrame) -> u64 {
        if let Some(&id) = self.functions.get(&frame) {
            return id;
        }
        let (name, file, first_line) = match frame {
            FoldFrame::Python(code) | FoldFrame::PythonLine { code, .. } => {
                let FrameRef { file, line, .. } = code;
                let function = self.qualnames.shown(&code);
                let name = or_unnamed(self.recording_string(function));
                (name.to_owned(), self.recording_string(file), line)
            }
            FoldFrame::Gc { generation } => (format!("[gc gen {generation}]"), "", 0),
            // Process and thread frames are labels, never locations.
            FoldFrame::Process { pid, .. } => (format!("[pid {pid}]"), "", 0),
            FoldFrame::Thread { tid, pid } => (thread_name(tid, pid), "", 0),
        };
        let id = self.profile.function.len() as u64 + 1;
        let name = self.strings.id(&name);
        let filename = self.strings.id(file);
        self.profile.function.push(Function {
            id,
            name,
            system_name: name,
            filename,
            start_line: i64::from(first_line),
        });
        self.functions.insert(frame, id);
        id
    }

    /// The location of `frame`, made with its function the first time: at the
    /// line it ran for a [`FoldFrame::PythonLine`], else at its first line.
    fn location(&mut self, frame: FoldFrame) -> u64 {
        if let Some(&id) = self.locations.get(&frame) {
            return id;
        }
        let (function_id, line) = match frame {
            FoldFrame::PythonLine { code, line } => (self.function(FoldFrame::Python(code)), line),
            FoldFrame::Python(code) => (self.function(frame), code.line),
            _ => (self.function(frame), 0),
        };
        let id = self.profile.location.len() as u64 + 1;
        self.profile.location.push(Location {
            id,
            line: vec![Line {
                function_id,
                line: i64::from(line),
            }],
        });
        self.locations.insert(frame, id);
        id
    }
}

/// The profile of `folded` (folded by thread), read from a recording with
/// `recording_strings` described by `info`. `idle`: waiting threads' samples
/// were counted too (their time is not CPU time).
pub fn build_profile(
    folded: &Folded,
    info: &ViewInfo,
    recording_strings: &[String],
    idle: bool,
) -> (Profile, PprofTotals) {
    let header = &info.header;
    // As the flame graph weighs stacks; a recording (or a period of one) with
    // neither samples nor calls is of the kind its mode gives, so that the
    // periods of one recording keep one kind.
    let c = folded.counts;
    let empty_of_calls = c.calls + c.returns == 0 && header.mode != "trace";
    let kind = if is_sampled(folded, header) || empty_of_calls {
        ProfileKind::Sampled
    } else {
        ProfileKind::Traced
    };
    let interval = header.sample_interval_ns;
    // Return-only traces (CPython 3.11) time their calls by the samples taken
    // alongside, as the report does.
    let returns_only = folded.counts.returns_only;
    let mut b = Builder {
        strings: Strings::new(),
        recording_strings,
        qualnames: &info.qualnames,
        locations: HashMap::new(),
        functions: HashMap::new(),
        profile: Profile::default(),
    };
    let (count, time) = match kind {
        ProfileKind::Sampled => ("samples", if idle { "wall" } else { "cpu" }),
        ProfileKind::Traced => ("calls", "wall"),
    };
    let value_type = |s: &mut Strings, t: &str, u: &str| ValueType {
        r#type: s.id(t),
        unit: s.id(u),
    };
    b.profile.sample_type = vec![
        value_type(&mut b.strings, count, "count"),
        value_type(&mut b.strings, time, "nanoseconds"),
    ];
    b.profile.period_type = Some(value_type(&mut b.strings, time, "nanoseconds"));
    b.profile.period = if kind == ProfileKind::Sampled || returns_only {
        interval as i64
    } else {
        0
    };
    b.profile.default_sample_type = b.strings.id(time);
    let thread_key = b.strings.id("thread");
    let pid_key = b.strings.id("pid");

    let mut totals = PprofTotals {
        kind,
        values: [0, 0],
        stacks: 0,
    };
    let mut path = Vec::new();
    for node in 1..folded.tree.len() as u32 {
        let values = match kind {
            ProfileKind::Sampled => {
                let n = folded.value(node, Measure::Samples);
                [n, n.saturating_mul(interval)]
            }
            ProfileKind::Traced if returns_only => [
                folded.value(node, Measure::Calls),
                folded
                    .value(node, Measure::Samples)
                    .saturating_mul(interval),
            ],
            ProfileKind::Traced => [
                folded.value(node, Measure::Calls),
                folded.value(node, Measure::Time),
            ],
        };
        if values == [0, 0] {
            continue;
        }
        folded.tree.path(node, &mut path);
        let mut label = Vec::new();
        let mut locations = Vec::with_capacity(path.len());
        for frame in path.iter().rev() {
            match *frame {
                FoldFrame::Thread { tid, pid } => {
                    let name = b.strings.id(&thread_name(tid, pid));
                    let pid = b.strings.id(&pid.to_string());
                    label.push(Label {
                        key: thread_key,
                        str: name,
                        num: 0,
                    });
                    label.push(Label {
                        key: pid_key,
                        str: pid,
                        num: 0,
                    });
                }
                // The thread frame names the process already.
                FoldFrame::Process { .. } => {}
                f => locations.push(b.location(f)),
            }
        }
        if locations.is_empty() {
            // Time on a thread outside any frame is no stack.
            continue;
        }
        totals.values[0] = totals.values[0].saturating_add(values[0]);
        totals.values[1] = totals.values[1].saturating_add(values[1]);
        totals.stacks += 1;
        b.profile.sample.push(Sample {
            location_id: locations,
            value: values
                .iter()
                .map(|&v| v.min(i64::MAX as u64) as i64)
                .collect(),
            label,
        });
    }
    let first = folded.counts.first_ts;
    b.profile.time_nanos = header.wall_start_unix_ns.min(i64::MAX as u64) as i64;
    b.profile.duration_nanos = info
        .duration_ns(first, folded.counts.last_ts)
        .min(i64::MAX as u64) as i64;
    let command = header.command_line.join(" ");
    let comment = b.strings.id(&format!(
        "pyprobe {}: pid {}, {}",
        env!("CARGO_PKG_VERSION"),
        header.pid,
        command
    ));
    b.profile.comment = vec![comment];
    b.profile.string_table = std::mem::take(&mut b.strings.table);
    (b.profile, totals)
}

/// Writes `profile` gzipped, as `go tool pprof` and profile collectors read it.
pub fn write_gzipped(profile: &Profile, out: impl Write) -> io::Result<()> {
    let mut gz = GzEncoder::new(out, Compression::default());
    gz.write_all(&profile.encode_to_vec())?;
    gz.finish()?.flush()
}

#[cfg(test)]
mod tests;
