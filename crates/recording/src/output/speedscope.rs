//! `pyprobe flame --format speedscope`: a speedscope JSON file
//! (<https://www.speedscope.app/file-format-schema.json>).
//!
//! Trace mode gives one *evented* profile per thread: a frame is opened (`O`) at
//! its call and closed (`C`) at its end, in stack order, as the shared replay
//! pushes and pops it, so the events always balance: frames running when tracing
//! began open at its start, frames still open close at the end, and returns
//! without entry open and close nothing. Sample mode gives one *sampled* profile
//! per thread.
//!
//! The recording is read twice (once to plan the replay). Each thread's events are rendered as they come
//! into a per-thread buffer; when the buffers together pass a limit they are
//! spilled to an unnamed temporary file, so memory stays bounded however long
//! the recording is; the profiles are then written thread by thread.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};

use crate::analyze::recording::replay_planned;
use crate::analyze::{SampleFilter, SampleTally, SliceFilter, Step};
use crate::output::flame::{ViewError, ViewInfo};
use crate::output::names::{thread_name, FrameNames};
use crate::output::{plan_export, Census, Planned};
use crate::recording::{EventKind, FrameRef, RecordingReader, StrId};

/// Bytes of rendered events kept in memory before spilling to a temporary file.
pub(crate) const DEFAULT_SPOOL_LIMIT: usize = 32 << 20;

/// Per-key byte streams kept in memory up to a limit, then in a temporary file.
pub(crate) struct Spool<K: Ord + Copy> {
    streams: BTreeMap<K, Stream>,
    buffered: usize,
    limit: usize,
    file: Option<File>,
    file_len: u64,
}

#[derive(Default)]
struct Stream {
    buf: Vec<u8>,
    /// Spilled parts: offset and length in the temporary file.
    segments: Vec<(u64, u64)>,
    /// Items appended (for separators).
    items: u64,
}

impl<K: Ord + Copy> Spool<K> {
    pub fn new(limit: usize) -> Self {
        Spool {
            streams: BTreeMap::new(),
            buffered: 0,
            limit,
            file: None,
            file_len: 0,
        }
    }

    /// Appends one item to `key`'s stream, preceded by `sep` unless it is the first.
    pub fn push(&mut self, key: K, sep: &[u8], item: &[u8]) -> io::Result<()> {
        let s = self.streams.entry(key).or_default();
        if s.items > 0 {
            s.buf.extend_from_slice(sep);
            self.buffered += sep.len();
        }
        s.items += 1;
        s.buf.extend_from_slice(item);
        self.buffered += item.len();
        if self.buffered > self.limit {
            self.spill()?;
        }
        Ok(())
    }

    /// Items appended to `key`'s stream.
    pub(crate) fn items(&self, key: K) -> u64 {
        self.streams.get(&key).map_or(0, |s| s.items)
    }

    /// Keys with a stream, in order.
    pub(crate) fn keys(&self) -> Vec<K> {
        self.streams.keys().copied().collect()
    }

    fn spill(&mut self) -> io::Result<()> {
        if self.file.is_none() {
            self.file = Some(tempfile::tempfile()?);
        }
        let Some(file) = self.file.as_mut() else {
            return Ok(());
        };
        for s in self.streams.values_mut() {
            if s.buf.is_empty() {
                continue;
            }
            file.write_all(&s.buf)?;
            s.segments.push((self.file_len, s.buf.len() as u64));
            self.file_len += s.buf.len() as u64;
            s.buf.clear();
            s.buf.shrink_to(64 * 1024);
        }
        self.buffered = 0;
        Ok(())
    }

    /// Copies `key`'s stream to `out`.
    pub(crate) fn copy_to(&mut self, key: K, out: &mut dyn Write) -> io::Result<()> {
        let Some(s) = self.streams.get(&key) else {
            return Ok(());
        };
        if let Some(file) = self.file.as_mut() {
            let mut chunk = vec![0u8; 256 * 1024];
            for &(offset, len) in &s.segments {
                file.seek(SeekFrom::Start(offset))?;
                let mut left = len;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    file.read_exact(&mut chunk[..n])?;
                    out.write_all(&chunk[..n])?;
                    left -= n as u64;
                }
            }
            file.seek(SeekFrom::End(0))?;
        }
        out.write_all(&s.buf)
    }
}

/// Interns frames as indices of speedscope's shared frame table.
#[derive(Default)]
struct FrameTable {
    index: HashMap<FrameRef, u32>,
    frames: Vec<FrameRef>,
}

impl FrameTable {
    fn get(&mut self, f: FrameRef) -> u32 {
        let next = self.frames.len() as u32;
        *self.index.entry(f).or_insert_with(|| {
            self.frames.push(f);
            next
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Evented,
    Sampled,
}

/// Options of the speedscope export.
#[derive(Debug, Clone)]
pub struct SpeedscopeOptions {
    /// Keep full file paths in frame names.
    pub full_paths: bool,
    /// Which samples go into the sampled profiles.
    pub samples: SampleFilter,
    /// Bytes of events kept in memory before spilling to a temporary file.
    pub spool_limit: usize,
    /// Which functions (by file) and which calls (by duration) to keep. Sampled
    /// stacks lose the frames of files it drops; they have no durations.
    pub filter: SliceFilter,
    /// The first pass, done before (a large recording's views keep it).
    pub planned: Option<Planned>,
}

impl Default for SpeedscopeOptions {
    fn default() -> Self {
        SpeedscopeOptions {
            full_paths: false,
            samples: SampleFilter::default(),
            spool_limit: DEFAULT_SPOOL_LIMIT,
            filter: SliceFilter::default(),
            planned: None,
        }
    }
}

/// Where a frame of a thread's evented profile stands.
#[derive(Clone, Copy)]
enum Open {
    /// Its file is filtered out: it has no events.
    Dropped,
    /// Not written yet: it is written once it (or a frame it calls) proves long
    /// enough; it started at `start`.
    Waiting { start: u64, code: FrameRef },
    /// Its open event is written.
    Written,
}

/// Decides which frames of the evented profiles are written. A call shorter than
/// the minimum duration has only shorter calls inside it, so a frame is written
/// (with every waiting frame below it, whose calls contain it and are longer) at
/// the first exit that lasted long enough; frames filtered out by file leave
/// their callees to their caller.
struct Pruner {
    filter: SliceFilter,
    files: HashMap<StrId, bool>,
    stacks: HashMap<u32, Vec<Open>>,
}

impl Pruner {
    fn keeps_file(&mut self, names: &FrameNames<'_>, file: StrId) -> bool {
        if self.filter.files.is_empty() {
            return true;
        }
        let filter = &self.filter;
        *self
            .files
            .entry(file)
            .or_insert_with(|| filter.files.matches(&names.string(file)))
    }
}

/// Reads the whole recording and writes it as a speedscope file to `out`.
/// `before` gets the recording's [`Census`] (under the options' filter) once it is
/// read and before anything is written: what the file will hold; it returns the
/// shortest call to keep when it chose one (else the options' filter holds).
pub fn write_speedscope<R: Read + Seek, W: Write>(
    reader: &mut RecordingReader<R>,
    options: &SpeedscopeOptions,
    before: impl FnOnce(&Census) -> Option<u64>,
    mut out: W,
) -> Result<SampleTally, ViewError> {
    let header = reader.header().clone();
    let mut tally = SampleTally::new(options.samples, &header);
    let (plan, census) = plan_export(reader, &options.filter, options.planned.as_ref())?;
    let chosen_min = before(&census);
    let mut spool: Spool<(u32, Kind)> = Spool::new(options.spool_limit);
    let mut frames = FrameTable::default();
    // Per thread: the last `at` written, so times never go backwards.
    let mut last_at: HashMap<u32, u64> = HashMap::new();
    let mut base: Option<u64> = (header.start_ns != 0).then_some(header.start_ns);
    let mut last_ts: Option<u64> = None;
    let mut item = Vec::with_capacity(128);
    let mut pruner = Pruner {
        filter: SliceFilter {
            min_duration_ns: chosen_min.unwrap_or(options.filter.min_duration_ns),
            ..options.filter.clone()
        },
        files: HashMap::new(),
        stacks: HashMap::new(),
    };

    struct Sink<'s> {
        spool: &'s mut Spool<(u32, Kind)>,
        frames: &'s mut FrameTable,
        last_at: &'s mut HashMap<u32, u64>,
        item: &'s mut Vec<u8>,
        start: u64,
    }

    impl Sink<'_> {
        fn event(&mut self, tid: u32, ts: u64, code: FrameRef, open: bool) -> io::Result<()> {
            let slot = self.last_at.entry(tid).or_insert(0);
            let at = ts.saturating_sub(self.start).max(*slot);
            *slot = at;
            self.item.clear();
            let _ = write!(
                self.item,
                "{{\"type\":\"{}\",\"frame\":{},\"at\":{at}}}",
                if open { "O" } else { "C" },
                self.frames.get(code)
            );
            self.spool.push((tid, Kind::Evented), b",", self.item)
        }
    }

    fn write_steps(
        sink: &mut Sink<'_>,
        pruner: &mut Pruner,
        names: &FrameNames<'_>,
        steps: &[Step],
    ) -> io::Result<()> {
        for step in steps {
            match *step {
                Step::Enter { tid, ts, code, .. } => {
                    let open = if !pruner.keeps_file(names, code.file) {
                        Open::Dropped
                    } else if pruner.filter.min_duration_ns == 0 {
                        sink.event(tid, ts, code, true)?;
                        Open::Written
                    } else {
                        Open::Waiting { start: ts, code }
                    };
                    pruner.stacks.entry(tid).or_default().push(open);
                }
                Step::Exit(e) => {
                    let stack = pruner.stacks.entry(e.tid).or_default();
                    match stack.pop() {
                        Some(Open::Written) => sink.event(e.tid, e.ts, e.code, false)?,
                        Some(Open::Waiting { start, .. })
                            if pruner.filter.long_enough(e.ts.saturating_sub(start)) =>
                        {
                            // The frames below it that wait are its callers: longer.
                            for open in stack.iter_mut() {
                                if let Open::Waiting { start, code } = *open {
                                    sink.event(e.tid, start, code, true)?;
                                    *open = Open::Written;
                                }
                            }
                            sink.event(e.tid, start, e.code, true)?;
                            sink.event(e.tid, e.ts, e.code, false)?;
                        }
                        _ => {}
                    }
                }
                Step::Untimed { .. } => {}
            }
        }
        Ok(())
    }

    let mut replay = replay_planned(reader, plan, |reader, event, ts, steps, replay| {
        let start = *base.get_or_insert(ts);
        last_ts = Some(last_ts.map_or(ts, |t| t.max(ts)));
        let names = FrameNames::new(reader.strings(), options.full_paths)
            .with_qualnames(reader.qualnames());
        let mut sink = Sink {
            spool: &mut spool,
            frames: &mut frames,
            last_at: &mut last_at,
            item: &mut item,
            start,
        };
        write_steps(&mut sink, &mut pruner, &names, steps)?;
        let sample = match &event.kind {
            EventKind::Sample { frames, state } if tally.admit(*state) => Some(frames),
            _ => None,
        };
        if let Some(stack) = sample {
            item.clear();
            item.push(b'[');
            let mut first = true;
            for w in stack {
                let code = replay.walked_code(w);
                if !pruner.keeps_file(&names, code.file) {
                    continue;
                }
                if !first {
                    item.push(b',');
                }
                first = false;
                let _ = write!(item, "{}", frames.get(code));
            }
            item.push(b']');
            spool.push((event.tid, Kind::Sampled), b",", &item)?;
        }
        Ok::<(), ViewError>(())
    })?;
    let info = ViewInfo::of(reader);
    let start = base.unwrap_or(0);
    let end_ts = info.end_ns.unwrap_or(0).max(last_ts.unwrap_or(start));
    let end_at = end_ts.saturating_sub(start);
    // Close what is still open, thread by thread, at the end.
    let mut steps = Vec::new();
    replay.finish(end_ts, &mut steps);
    let names =
        FrameNames::new(reader.strings(), options.full_paths).with_qualnames(reader.qualnames());
    let mut sink = Sink {
        spool: &mut spool,
        frames: &mut frames,
        last_at: &mut last_at,
        item: &mut item,
        start,
    };
    write_steps(&mut sink, &mut pruner, &names, &steps)?;

    let interval = header.sample_interval_ns;
    let name = crate::output::flame::default_title(&header);
    write!(
        out,
        "{{\"$schema\":\"https://www.speedscope.app/file-format-schema.json\",\
         \"exporter\":\"pyprobe {}\",\"name\":{},\"activeProfileIndex\":0,\"profiles\":[",
        env!("CARGO_PKG_VERSION"),
        json_str(&name)
    )?;
    for (i, (tid, kind)) in spool.keys().into_iter().enumerate() {
        if i > 0 {
            out.write_all(b",\n")?;
        } else {
            out.write_all(b"\n")?;
        }
        // Under --subprocesses, a thread is named with its process.
        let tname = if replay.several_processes() {
            let pid = replay.process_of(tid);
            format!("pid {pid}, {}", thread_name(tid, pid))
        } else {
            thread_name(tid, header.pid)
        };
        match kind {
            Kind::Evented => {
                let end = end_at.max(last_at.get(&tid).copied().unwrap_or(0));
                write!(
                    out,
                    "{{\"type\":\"evented\",\"name\":{},\"unit\":\"nanoseconds\",\
                     \"startValue\":0,\"endValue\":{end},\"events\":[",
                    json_str(&tname)
                )?;
                spool.copy_to((tid, kind), &mut out)?;
                out.write_all(b"]}")?;
            }
            Kind::Sampled => {
                let n = spool.items((tid, kind));
                let (unit, weight) = if interval > 0 {
                    ("nanoseconds", interval)
                } else {
                    ("none", 1)
                };
                write!(
                    out,
                    "{{\"type\":\"sampled\",\"name\":{},\"unit\":\"{unit}\",\
                     \"startValue\":0,\"endValue\":{},\"samples\":[",
                    json_str(&format!("{tname} (sampled)")),
                    n.saturating_mul(weight)
                )?;
                spool.copy_to((tid, kind), &mut out)?;
                out.write_all(b"],\"weights\":[")?;
                let w = weight.to_string();
                for j in 0..n {
                    if j > 0 {
                        out.write_all(b",")?;
                    }
                    out.write_all(w.as_bytes())?;
                }
                out.write_all(b"]}")?;
            }
        }
    }
    out.write_all(b"\n],\"shared\":{\"frames\":[")?;
    for (i, f) in frames.frames.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        let full = names.string(f.file);
        write!(
            out,
            "\n{{\"name\":{},\"file\":{},\"line\":{}}}",
            json_str(&names.python(f)),
            json_str(&full),
            f.line
        )?;
    }
    out.write_all(b"\n]}}\n")?;
    out.flush()?;
    Ok(tally)
}

/// `s` as a JSON string literal.
pub(crate) fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spool_spills_and_reads_back_in_order() {
        let mut spool: Spool<u32> = Spool::new(8);
        for i in 0..20u32 {
            spool.push(i % 3, b",", i.to_string().as_bytes()).unwrap();
        }
        assert!(spool.file.is_some());
        let mut out = Vec::new();
        spool.copy_to(1, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "1,4,7,10,13,16,19");
        let mut out = Vec::new();
        spool.copy_to(0, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "0,3,6,9,12,15,18");
        assert_eq!(spool.items(2), 6);
        assert_eq!(spool.keys(), vec![0, 1, 2]);
    }
}
