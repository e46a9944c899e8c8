//! Writes a recording: header, then string and event chunks, then a trailer.
//!
//! Memory stays bounded: events are buffered up to [`FLUSH_THRESHOLD`] bytes, then
//! written as one chunk, preceded by a chunk of the strings interned since the
//! last flush (so a string always precedes the first event using it). After an
//! I/O error the writer refuses further writes, so the file ends with whole
//! chunks followed by at most one partial chunk, which a reader treats as the
//! point where the recording was cut short.

use rustc_hash::FxHashMap;
use std::io::{self, Write};
use std::path::Path;

pub use super::background::BackgroundWriter;
use super::codec::{EventEncoder, FrameNumberHint};
use super::qualnames;
use super::wire::{put_str, put_uvarint, truncate_str};
use super::{kind, Event, EventKind, FrameRef, Header, StrId, FORMAT_VERSION, MAGIC};

/// Longest string stored, in bytes; longer strings are truncated (and counted).
pub const MAX_STRING_LEN: usize = 4096;
/// Most frames stored per sample; the outermost frames beyond it are dropped.
pub const MAX_SAMPLE_FRAMES: usize = 512;
/// Buffered event bytes that trigger writing a chunk.
const FLUSH_THRESHOLD: usize = 256 * 1024;

/// What a finished recording holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Events written.
    pub events: u64,
    /// Sum of the `Lost` events' counts.
    pub lost_events: u64,
    /// Distinct strings interned.
    pub strings: u64,
    /// Strings cut to [`MAX_STRING_LEN`].
    pub(crate) truncated_strings: u64,
    /// Samples cut to [`MAX_SAMPLE_FRAMES`].
    pub(crate) truncated_samples: u64,
    /// Chunks written, header and trailer included.
    pub(crate) chunks: u64,
    /// Bytes handed to the output: the recording's size, but where a
    /// [`BackgroundWriter`] stores its events chunks compressed (see
    /// [`RecordingWriter::stored_bytes`]).
    pub bytes: u64,
}

/// Entries of a table chunk (strings, qualified names) not yet written.
#[derive(Default)]
struct PendingTable {
    entries: Vec<u8>,
    count: u64,
}

impl PendingTable {
    /// The chunk's payload (a count, then the entries), leaving the table empty;
    /// `None` when it is empty.
    fn take_payload(&mut self) -> Option<Vec<u8>> {
        if self.count == 0 {
            return None;
        }
        let mut payload = Vec::with_capacity(self.entries.len() + 5);
        put_uvarint(&mut payload, self.count);
        payload.extend_from_slice(&self.entries);
        self.entries.clear();
        self.count = 0;
        Some(payload)
    }
}

/// Streams events into a recording.
pub struct RecordingWriter<W: Write> {
    out: W,
    /// The first I/O error; every later call fails with it.
    failed: Option<(io::ErrorKind, String)>,
    strings: FxHashMap<String, StrId>,
    /// Strings interned since the last flush.
    pending_strings: PendingTable,
    /// Qualified names given since the last flush (see [`name_code`](Self::name_code)).
    pending_qualnames: PendingTable,
    events: Vec<u8>,
    encoder: EventEncoder,
    summary: Summary,
}

impl RecordingWriter<BackgroundWriter> {
    /// Bytes in the file so far, compressed chunks as stored: those handed to the
    /// writer thread and not written yet are not counted.
    pub fn stored_bytes(&self) -> u64 {
        self.out.written()
    }

    /// Creates (or truncates) the file at `path` (mode 0600 when new) and writes the
    /// header. The file is written by a thread of its own (see [`BackgroundWriter`]).
    /// For callers that own `path` (tests, tools): pyprobe's commands write through
    /// the output layer's `output::file`, which never truncates a file.
    pub fn create(path: &Path, header: &Header) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot create recording {}: {e}", path.display()),
                )
            })?;
        Self::new(BackgroundWriter::new(file)?, header)
    }
}

impl<W: Write> RecordingWriter<W> {
    /// Writes the magic, format version and header to `out`.
    pub fn new(out: W, header: &Header) -> io::Result<Self> {
        let mut w = RecordingWriter {
            out,
            failed: None,
            strings: FxHashMap::default(),
            pending_strings: PendingTable::default(),
            pending_qualnames: PendingTable::default(),
            events: Vec::new(),
            encoder: EventEncoder::default(),
            summary: Summary::default(),
        };
        let mut prefix = MAGIC.to_vec();
        prefix.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        w.write_raw(&[&prefix])?;
        w.write_chunk(kind::HEADER, &header.encode())?;
        Ok(w)
    }

    /// Returns the id of `s`, adding it to the string table on first use. Ids are
    /// dense from 0. Strings longer than [`MAX_STRING_LEN`] are truncated.
    pub fn intern(&mut self, s: &str) -> StrId {
        let kept = truncate_str(s, MAX_STRING_LEN);
        if let Some(&id) = self.strings.get(kept) {
            return id;
        }
        if kept.len() < s.len() {
            self.summary.truncated_strings += 1;
        }
        let id = StrId(self.strings.len() as u32);
        self.strings.insert(kept.to_string(), id);
        let table = &mut self.pending_strings;
        put_uvarint(&mut table.entries, u64::from(id.0));
        put_str(&mut table.entries, kept);
        table.count += 1;
        self.summary.strings += 1;
        if table.entries.len() >= FLUSH_THRESHOLD {
            // A failure poisons the writer; the next `write`/`finish` reports it.
            let _ = self.flush_tables();
        }
        id
    }

    /// Gives the function `code` (file, `co_name`, first line) its qualified name,
    /// written before the next events; every id must have been interned by this
    /// writer (else the name is dropped).
    pub fn name_code(&mut self, code: &FrameRef, qualname: StrId) {
        let n = self.strings.len() as u32;
        if [code.file, code.function, qualname]
            .iter()
            .any(|id| id.0 >= n)
        {
            return;
        }
        qualnames::put_entry(&mut self.pending_qualnames.entries, code, qualname);
        self.pending_qualnames.count += 1;
    }

    /// Appends one event. Its strings must have been interned by this writer.
    pub fn write(&mut self, event: &Event) -> io::Result<()> {
        self.write_with(event, None)
    }

    /// As [`write`](Self::write) for a call or return written again and again:
    /// `hint` keeps its frame number in the current chunk (see
    /// [`FrameNumberHint`]); the bytes written are the same.
    #[inline]
    pub fn write_hinted(&mut self, event: &Event, hint: &mut FrameNumberHint) -> io::Result<()> {
        self.write_with(event, Some(hint))
    }

    #[inline]
    fn write_with(&mut self, event: &Event, hint: Option<&mut FrameNumberHint>) -> io::Result<()> {
        self.check_failed()?;
        self.check_ids(&event.kind)?;
        if let EventKind::Sample { frames, .. } = &event.kind {
            if frames.len() > MAX_SAMPLE_FRAMES {
                self.summary.truncated_samples += 1;
            }
        }
        if let EventKind::Lost { count } = event.kind {
            self.summary.lost_events = self.summary.lost_events.saturating_add(count);
        }
        match hint {
            Some(hint) => {
                self.encoder
                    .encode_hinted(&mut self.events, event, MAX_SAMPLE_FRAMES, hint)
            }
            None => self
                .encoder
                .encode(&mut self.events, event, MAX_SAMPLE_FRAMES),
        }
        self.summary.events += 1;
        if self.events.len() >= FLUSH_THRESHOLD {
            self.flush_chunks()?;
        }
        Ok(())
    }

    /// Writes out everything buffered and flushes the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.flush_chunks()?;
        let r = self.out.flush();
        self.fail_on(r)
    }

    /// Writes the trailer (`end_ns` is the monotonic end time) and flushes.
    pub fn finish(mut self, end_ns: u64) -> io::Result<Summary> {
        self.flush_chunks()?;
        let mut trailer = Vec::new();
        put_uvarint(&mut trailer, end_ns);
        put_uvarint(&mut trailer, self.summary.lost_events);
        put_uvarint(&mut trailer, self.summary.events);
        self.write_chunk(kind::TRAILER, &trailer)?;
        let r = self.out.flush();
        self.fail_on(r)?;
        Ok(self.summary)
    }

    /// Counts so far (bytes count only what reached the underlying writer).
    pub fn summary(&self) -> Summary {
        self.summary
    }

    fn check_ids(&self, kind: &EventKind) -> io::Result<()> {
        let n = self.strings.len() as u32;
        let ok_frame = |f: &FrameRef| f.file.0 < n && f.function.0 < n;
        let ok = match kind {
            EventKind::Call { frame }
            | EventKind::Resume { frame }
            | EventKind::Return { frame, .. }
            | EventKind::Line { frame } => ok_frame(frame),
            EventKind::ImportStart { module } | EventKind::ImportDone { module, .. } => {
                module.0 < n
            }
            EventKind::Audit { event } => event.0 < n,
            EventKind::Sample { frames, .. }
            | EventKind::Stack { frames }
            | EventKind::Running { frames } => frames.iter().all(|f| ok_frame(&f.code)),
            _ => true,
        };
        if ok {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "event refers to a string id this recording never interned",
            ))
        }
    }

    /// Writes the strings, then the qualified names (which use them), given
    /// since the last flush.
    fn flush_tables(&mut self) -> io::Result<()> {
        for (kind, is_strings) in [(kind::STRINGS, true), (kind::QUALNAMES, false)] {
            let table = if is_strings {
                &mut self.pending_strings
            } else {
                &mut self.pending_qualnames
            };
            if let Some(payload) = table.take_payload() {
                self.write_chunk(kind, &payload)?;
            }
        }
        Ok(())
    }

    fn flush_chunks(&mut self) -> io::Result<()> {
        self.check_failed()?;
        self.flush_tables()?;
        if !self.events.is_empty() {
            let events = std::mem::take(&mut self.events);
            let r = self.write_chunk(kind::EVENTS, &events);
            // Keep the allocation for the next chunk.
            self.events = events;
            self.events.clear();
            self.encoder.reset();
            r?;
        }
        Ok(())
    }

    fn write_chunk(&mut self, kind: u8, payload: &[u8]) -> io::Result<()> {
        let mut head = [0u8; 9];
        head[0] = kind;
        head[1..5].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        head[5..9].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
        self.write_raw(&[&head, payload])?;
        self.summary.chunks += 1;
        Ok(())
    }

    fn write_raw(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        self.check_failed()?;
        for part in parts {
            let r = self.out.write_all(part);
            self.fail_on(r)?;
            self.summary.bytes += part.len() as u64;
        }
        Ok(())
    }

    /// Records the first error (with the offset it happened at) and poisons the writer.
    fn fail_on(&mut self, r: io::Result<()>) -> io::Result<()> {
        r.map_err(|e| {
            let msg = format!(
                "writing the recording failed near offset {}: {e}",
                self.summary.bytes
            );
            self.failed = Some((e.kind(), msg.clone()));
            io::Error::new(e.kind(), msg)
        })
    }

    fn check_failed(&self) -> io::Result<()> {
        match &self.failed {
            Some((kind, msg)) => Err(io::Error::new(*kind, msg.clone())),
            None => Ok(()),
        }
    }
}

impl<W: Write> Drop for RecordingWriter<W> {
    /// A writer dropped without [`finish`](RecordingWriter::finish) (an error
    /// path, a panic) still writes out what it buffered: the recording then
    /// reads back whole, only without a trailer ("cut short").
    fn drop(&mut self) {
        if self.failed.is_none() {
            let _ = self.flush();
        }
    }
}
