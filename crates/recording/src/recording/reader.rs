//! Reads a recording chunk by chunk, in bounded memory, treating the file as hostile.

use std::borrow::Cow;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Arc;

use super::ahead::{Piece, ReadAhead};
use super::codec::EventDecoder;
use super::compress::decompress_events;
use super::qualnames::{self, Qualnames};
use super::wire::Cursor;
use super::{
    kind, Event, Header, RecordError, StrId, CHUNK_HEADER_LEN, FORMAT_VERSION, MAGIC,
    MAX_CHUNK_LEN, OLDEST_FORMAT_VERSION,
};

/// The trailer of a recording that was finished properly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    /// Monotonic end time, ns.
    pub end_ns: u64,
    /// Events the recorder knew were lost.
    pub lost_events: u64,
    /// Events the writer wrote.
    pub events: u64,
}

/// How reading ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The events have not all been read yet.
    Reading,
    /// The trailer was seen: the recording is whole.
    Complete(Trailer),
    /// The file ends without a trailer; every whole chunk before `offset` was read.
    Truncated {
        /// Where the first incomplete chunk starts (or the file ends).
        offset: u64,
    },
    /// Reading stopped at an error about `offset` (already returned by the iterator).
    Failed {
        /// The offset named by the error.
        offset: u64,
    },
}

/// Streams a recording's events.
pub struct RecordingReader<R: Read> {
    input: R,
    header: Header,
    strings: Vec<String>,
    qualnames: Qualnames,
    /// File offset of the next chunk.
    offset: u64,
    /// File offset of the first chunk after the header.
    events_start: u64,
    /// Payload of the current events chunk and the read position in it.
    chunk: Vec<u8>,
    pos: usize,
    chunk_base: u64,
    decoder: EventDecoder,
    /// For compressed events chunks: made at the first, kept.
    decompressor: Option<zstd::bulk::Decompressor<'static>>,
    /// A compressed chunk's payload, while it is decompressed into `chunk`.
    packed: Vec<u8>,
    events_read: u64,
    completion: Completion,
    /// The events are being read again (after [`rewind`](Self::rewind)).
    reread: bool,
    /// The recording's file (a reader of a file), and whether a thread reads it ahead.
    file: Option<Arc<File>>,
    reads_ahead: bool,
    /// That thread, from the first event read on.
    ahead: Option<ReadAhead>,
    /// The batch of events it handed on, being returned; the error that ended
    /// it; whether it ends its chunk.
    batch: std::vec::IntoIter<Event>,
    batch_error: Option<RecordError>,
    batch_ends_chunk: bool,
}

impl RecordingReader<BufReader<File>> {
    /// Opens the recording at `path` and reads its header.
    pub fn open(path: &Path) -> Result<Self, RecordError> {
        Self::open_reading_ahead(path, true)
    }

    /// As [`open`](Self::open), the events decoded as they are read, by the
    /// thread that reads them (one that must not wait for another).
    pub fn open_in_place(path: &Path) -> Result<Self, RecordError> {
        Self::open_reading_ahead(path, false)
    }

    fn open_reading_ahead(path: &Path, ahead: bool) -> Result<Self, RecordError> {
        let file = File::open(path).map_err(|error| RecordError::Io { offset: 0, error })?;
        Self::of_file(file, ahead)
    }

    fn of_file(file: File, ahead: bool) -> Result<Self, RecordError> {
        // Without a second handle the events are decoded as they are read.
        let second = file.try_clone().ok().map(Arc::new);
        let mut reader = Self::from_reader(BufReader::with_capacity(256 * 1024, file))?;
        reader.reads_ahead = ahead && second.is_some();
        reader.file = second;
        Ok(reader)
    }

    /// A reader of the same file (even renamed since) that decodes ahead in a
    /// thread, going on where this one is, at a chunk end
    /// ([`at_chunk_end`](Self::at_chunk_end)), knowing `strings` and `qualnames`:
    /// at least those defined before this place (this reader's), at most the
    /// whole recording's (read by another reader). This one is not to be read
    /// again: the two share the file's offset.
    pub(crate) fn go_on_reading_ahead(
        &self,
        strings: Vec<String>,
        qualnames: Qualnames,
    ) -> Result<Self, RecordError> {
        let offset = self.bytes_read();
        let io = |error| RecordError::Io { offset, error };
        let mut file = self
            .file
            .as_deref()
            .ok_or_else(|| io(io::Error::other("the file is no longer open")))?
            .try_clone()
            .map_err(io)?;
        file.seek(SeekFrom::Start(0))
            .map_err(|error| RecordError::Io { offset: 0, error })?;
        let mut reader = Self::of_file(file, true)?;
        reader.know_names(strings, qualnames);
        reader.seek_to_chunk(offset, self.events_read())?;
        Ok(reader)
    }
}

/// What tells one state of one file from another: its device, inode, size and
/// modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileKey {
    dev: u64,
    ino: u64,
    len: u64,
    modified: (i64, i64),
}

impl FileKey {
    /// The key of `file` as it is now.
    pub fn of(file: &File) -> io::Result<FileKey> {
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata()?;
        Ok(FileKey {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            modified: (meta.mtime(), meta.mtime_nsec()),
        })
    }
}

/// Outcome of reading one chunk.
pub(super) enum Chunk {
    /// A whole, checksummed chunk of this kind is in `self.chunk`.
    Whole(u8),
    /// The file ends cleanly at a chunk boundary.
    Eof,
    /// The file ends inside the chunk starting at the current offset.
    Partial,
}

impl<R: Read> RecordingReader<R> {
    /// Reads the magic, version and header from `input`.
    pub fn from_reader(input: R) -> Result<Self, RecordError> {
        let mut r = RecordingReader {
            input,
            header: Header::default(),
            strings: Vec::new(),
            qualnames: Qualnames::default(),
            offset: 0,
            events_start: 0,
            chunk: Vec::new(),
            pos: 0,
            chunk_base: 0,
            decoder: EventDecoder::default(),
            decompressor: None,
            packed: Vec::new(),
            events_read: 0,
            completion: Completion::Reading,
            reread: false,
            file: None,
            reads_ahead: false,
            ahead: None,
            batch: Vec::new().into_iter(),
            batch_error: None,
            batch_ends_chunk: true,
        };
        let mut prefix = [0u8; 12];
        let n = read_full(&mut r.input, &mut prefix, 0)?;
        if n == 0 {
            return Err(RecordError::Empty);
        }
        let magic_len = n.min(MAGIC.len());
        if prefix[..magic_len] != MAGIC[..magic_len] {
            return Err(RecordError::NotARecording);
        }
        if n < prefix.len() {
            return Err(RecordError::TruncatedHeader { offset: n as u64 });
        }
        let version = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]);
        if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(RecordError::UnsupportedVersion { version });
        }
        r.offset = prefix.len() as u64;
        let at = r.offset;
        match r.read_chunk()? {
            Chunk::Whole(kind::HEADER) => {}
            Chunk::Whole(k) => {
                return Err(RecordError::Corrupt {
                    offset: at,
                    what: format!("expected the header chunk, found chunk kind {k}"),
                })
            }
            Chunk::Eof | Chunk::Partial => return Err(RecordError::TruncatedHeader { offset: at }),
        }
        let mut c = Cursor::new(&r.chunk, 0, at + CHUNK_HEADER_LEN);
        r.header = Header::decode(&mut c, version)?;
        r.chunk.clear();
        r.events_start = r.offset;
        Ok(r)
    }

    /// The recording's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The string for `id`, or a placeholder such as `<unknown #7>` for an id the
    /// recording never defined (e.g. one whose strings chunk was cut off).
    pub fn string(&self, id: StrId) -> Cow<'_, str> {
        match self.strings.get(id.0 as usize) {
            Some(s) => Cow::Borrowed(s),
            None => Cow::Owned(format!("<unknown #{}>", id.0)),
        }
    }

    /// The string table read so far, indexed by [`StrId`].
    pub fn strings(&self) -> &[String] {
        &self.strings
    }

    /// How far into the file reading has come: the offset of the next chunk.
    pub fn bytes_read(&self) -> u64 {
        self.offset
    }

    /// Whether the events chunk being read has no event left: the next event
    /// comes from the chunk at [`bytes_read`](Self::bytes_read), so a reader
    /// [positioned](Self::seek_to_chunk) there takes up from here.
    pub(crate) fn at_chunk_end(&self) -> bool {
        let batch_done =
            self.batch.len() == 0 && self.batch_error.is_none() && self.batch_ends_chunk;
        self.pos >= self.chunk.len() && batch_done
    }

    /// The string table read so far, the reader done with.
    pub fn into_strings(self) -> Vec<String> {
        self.strings
    }

    /// The qualified names of functions read so far (all of them, once the
    /// events are read to the end).
    pub fn qualnames(&self) -> &Qualnames {
        &self.qualnames
    }

    /// Events returned so far.
    pub fn events_read(&self) -> u64 {
        self.events_read
    }

    /// How reading ended; [`Completion::Reading`] until the last event was returned.
    pub fn completion(&self) -> Completion {
        self.completion
    }

    /// Iterates over the remaining events.
    pub fn events(&mut self) -> Events<'_, R> {
        Events { reader: self }
    }

    /// The next event, `None` at the end (see [`completion`](Self::completion)).
    /// After an error, returns `None`.
    pub(crate) fn next_event(&mut self) -> Option<Result<Event, RecordError>> {
        match self.advance() {
            Ok(Some(e)) => {
                self.events_read += 1;
                Some(Ok(e))
            }
            Ok(None) => None,
            Err(e) => {
                self.completion = Completion::Failed { offset: e.offset() };
                Some(Err(e))
            }
        }
    }

    fn advance(&mut self) -> Result<Option<Event>, RecordError> {
        if self.reads_ahead {
            return self.advance_ahead();
        }
        loop {
            if self.completion != Completion::Reading {
                return Ok(None);
            }
            if self.pos < self.chunk.len() {
                let mut c = Cursor::new(&self.chunk, self.pos, self.chunk_base);
                let event = self.decoder.decode(&mut c)?;
                self.pos = c.pos();
                return Ok(Some(event));
            }
            let at = self.offset;
            match self.read_chunk()? {
                Chunk::Eof | Chunk::Partial => {
                    self.completion = Completion::Truncated { offset: at };
                }
                Chunk::Whole(k @ (kind::EVENTS | kind::EVENTS_ZSTD)) => {
                    unpack_events(
                        k,
                        at,
                        &mut self.chunk,
                        &mut self.packed,
                        &mut self.decompressor,
                    )?;
                    self.pos = 0;
                    // Offsets within it count its (decompressed) bytes from its payload.
                    self.chunk_base = at + CHUNK_HEADER_LEN;
                    self.decoder.reset();
                }
                Chunk::Whole(k) => self.other_chunk(k, at)?,
            }
        }
    }

    /// As [`advance`](Self::advance), the events decoded by the thread reading ahead.
    fn advance_ahead(&mut self) -> Result<Option<Event>, RecordError> {
        loop {
            if let Some(event) = self.batch.next() {
                return Ok(Some(event));
            }
            if let Some(e) = self.batch_error.take() {
                // Left inside the chunk, as reading in place is.
                self.batch_ends_chunk = false;
                return Err(e);
            }
            if self.completion != Completion::Reading {
                return Ok(None);
            }
            let piece = match (&self.ahead, &self.file) {
                (Some(ahead), _) => ahead.next(self.offset),
                (None, Some(file)) => {
                    let started = ReadAhead::start(Arc::clone(file), self.offset);
                    let ahead = started.map_err(|error| RecordError::Io {
                        offset: self.offset,
                        error,
                    })?;
                    self.ahead.insert(ahead).next(self.offset)
                }
                (None, None) => return Ok(None),
            };
            match piece {
                Piece::Events {
                    events,
                    error,
                    last,
                    next,
                } => {
                    self.offset = next;
                    self.batch = events.into_iter();
                    self.batch_error = error;
                    self.batch_ends_chunk = last;
                }
                Piece::Other {
                    kind,
                    payload,
                    at,
                    next,
                } => {
                    self.offset = next;
                    self.chunk = payload;
                    self.batch_ends_chunk = true;
                    self.other_chunk(kind, at)?;
                    self.chunk.clear();
                    self.pos = 0;
                }
                Piece::End { at } => {
                    self.offset = at;
                    self.completion = Completion::Truncated { offset: at };
                }
                Piece::Failed(e) => return Err(e),
            }
        }
    }

    /// Takes in the chunk of kind `k` at `at` (in `self.chunk`) that holds no events.
    fn other_chunk(&mut self, k: u8, at: u64) -> Result<(), RecordError> {
        match k {
            kind::STRINGS => self.read_strings(at + CHUNK_HEADER_LEN),
            kind::QUALNAMES => {
                let mut c = Cursor::new(&self.chunk, 0, at + CHUNK_HEADER_LEN);
                qualnames::read_chunk(&mut c, self.strings.len(), &mut self.qualnames)?;
                self.chunk.clear();
                self.pos = 0;
                Ok(())
            }
            kind::TRAILER => {
                let mut c = Cursor::new(&self.chunk, 0, at + CHUNK_HEADER_LEN);
                let trailer = Trailer {
                    end_ns: c.uvarint()?,
                    lost_events: c.uvarint()?,
                    events: c.uvarint()?,
                };
                // Anything after the trailer is not part of the recording.
                self.completion = Completion::Complete(trailer);
                Ok(())
            }
            k => Err(RecordError::Corrupt {
                offset: at,
                what: format!("unexpected chunk kind {k}"),
            }),
        }
    }

    fn read_strings(&mut self, base: u64) -> Result<(), RecordError> {
        let mut c = Cursor::new(&self.chunk, 0, base);
        // An entry is at least an id and a length.
        let n = c.count(2, "string")?;
        for _ in 0..n {
            let at = c.offset();
            let id = c.uvarint()?;
            if id < self.strings.len() as u64 && self.reread {
                // Read again after a rewind: the table already holds it.
                c.string()?;
                continue;
            }
            if id != self.strings.len() as u64 {
                return Err(RecordError::Corrupt {
                    offset: at,
                    what: format!(
                        "string id {id} out of order (expected {})",
                        self.strings.len()
                    ),
                });
            }
            self.strings.push(c.string()?);
        }
        // The events that follow reuse the buffer.
        self.chunk.clear();
        self.pos = 0;
        Ok(())
    }

    /// Reads the chunk at `self.offset` into `self.chunk`, checking its length and
    /// checksum; advances `self.offset` past it when whole.
    fn read_chunk(&mut self) -> Result<Chunk, RecordError> {
        let at = self.offset;
        self.pos = 0;
        let chunk = read_chunk(&mut self.input, at, &mut self.chunk)?;
        if let Chunk::Whole(_) = chunk {
            self.offset = at + CHUNK_HEADER_LEN + self.chunk.len() as u64;
        }
        Ok(chunk)
    }
}

/// Reads the chunk at offset `at` of `input` (which is there) into `chunk`,
/// checking its length and checksum.
pub(super) fn read_chunk(
    input: &mut impl Read,
    at: u64,
    chunk: &mut Vec<u8>,
) -> Result<Chunk, RecordError> {
    chunk.clear();
    let mut head = [0u8; CHUNK_HEADER_LEN as usize];
    let n = read_full(input, &mut head, at)?;
    if n == 0 {
        return Ok(Chunk::Eof);
    }
    if n < head.len() {
        return Ok(Chunk::Partial);
    }
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    let stored = u32::from_le_bytes([head[5], head[6], head[7], head[8]]);
    if len > MAX_CHUNK_LEN {
        return Err(RecordError::ChunkTooLong { offset: at, len });
    }
    // `take` grows the buffer as bytes arrive: a lying length in a short file
    // costs no more memory than the file holds.
    input
        .take(u64::from(len))
        .read_to_end(chunk)
        .map_err(|error| RecordError::Io {
            offset: at + CHUNK_HEADER_LEN,
            error,
        })?;
    if chunk.len() < len as usize {
        chunk.clear();
        return Ok(Chunk::Partial);
    }
    let computed = crc32fast::hash(chunk);
    if computed != stored {
        chunk.clear();
        return Err(RecordError::Checksum {
            offset: at,
            stored,
            computed,
        });
    }
    Ok(Chunk::Whole(head[0]))
}

/// Makes the events chunk of kind `k` at `at`, read into `chunk`, its events'
/// bytes: a compressed one decompressed (through `packed`).
pub(super) fn unpack_events(
    k: u8,
    at: u64,
    chunk: &mut Vec<u8>,
    packed: &mut Vec<u8>,
    decompressor: &mut Option<zstd::bulk::Decompressor<'static>>,
) -> Result<(), RecordError> {
    if k == kind::EVENTS_ZSTD {
        std::mem::swap(chunk, packed);
        decompress_events(decompressor, packed, chunk).map_err(|why| RecordError::Corrupt {
            offset: at,
            what: format!("the compressed events chunk {why}"),
        })?;
    }
    Ok(())
}

impl<R: Read + Seek> RecordingReader<R> {
    /// Goes back to the first event, to read the events again (the string table
    /// read so far stays).
    pub(crate) fn rewind(&mut self) -> Result<(), RecordError> {
        self.input
            .seek(SeekFrom::Start(self.events_start))
            .map_err(|error| RecordError::Io {
                offset: self.events_start,
                error,
            })?;
        self.offset = self.events_start;
        self.chunk.clear();
        self.pos = 0;
        self.chunk_base = 0;
        self.decoder.reset();
        self.events_read = 0;
        self.completion = Completion::Reading;
        self.reread = true;
        self.forget_read_ahead();
        Ok(())
    }
}

impl<R: Read + Seek> RecordingReader<R> {
    /// Goes to the chunk at `offset`, where `events_before` events have gone
    /// before, to read on from there: a place kept by an earlier reading of
    /// this recording (at a chunk boundary, [`at_chunk_end`](Self::at_chunk_end)).
    /// The strings and qualified names the events there use must already be
    /// known: see [`know_names`](Self::know_names).
    pub(crate) fn seek_to_chunk(
        &mut self,
        offset: u64,
        events_before: u64,
    ) -> Result<(), RecordError> {
        if offset < self.events_start {
            return Err(RecordError::Corrupt {
                offset,
                what: format!(
                    "a kept place before the first event ({})",
                    self.events_start
                ),
            });
        }
        self.input
            .seek(SeekFrom::Start(offset))
            .map_err(|error| RecordError::Io { offset, error })?;
        self.offset = offset;
        self.chunk.clear();
        self.pos = 0;
        self.chunk_base = 0;
        self.decoder.reset();
        self.events_read = events_before;
        self.completion = Completion::Reading;
        self.reread = true;
        self.forget_read_ahead();
        Ok(())
    }

    /// Reads on where the file ended, when it did not end properly (a recording
    /// still being written): from the chunk that was incomplete then. `false`
    /// when reading had not stopped there.
    pub fn resume(&mut self) -> Result<bool, RecordError> {
        let Completion::Truncated { offset } = self.completion else {
            return Ok(false);
        };
        self.seek_to_chunk(offset, self.events_read)?;
        Ok(true)
    }

    /// Takes the whole string table and qualified names of the recording, read
    /// before (kept with its views), so the reader can start anywhere; the
    /// chunks that define them are then read again without adding to them.
    pub(crate) fn know_names(&mut self, strings: Vec<String>, qualnames: Qualnames) {
        if strings.len() >= self.strings.len() {
            self.strings = strings;
            self.qualnames = qualnames;
            self.reread = true;
        }
    }
}

impl<R: Read> RecordingReader<R> {
    /// The key of the file read, as it is now (a reader of a file).
    pub fn file_key(&self) -> Option<FileKey> {
        self.file.as_deref().and_then(|f| FileKey::of(f).ok())
    }

    /// Whether a thread decodes the events ahead of this reader.
    #[cfg(test)]
    pub(super) fn reads_ahead(&self) -> bool {
        self.reads_ahead
    }

    /// Stops the thread reading ahead, if any, and drops what it read: reading
    /// goes on from `self.offset`.
    fn forget_read_ahead(&mut self) {
        self.ahead = None;
        self.batch = Vec::new().into_iter();
        self.batch_error = None;
        self.batch_ends_chunk = true;
    }
}

/// Iterator over a recording's events; see [`RecordingReader::events`].
pub struct Events<'a, R: Read> {
    reader: &'a mut RecordingReader<R>,
}

impl<R: Read> Iterator for Events<'_, R> {
    type Item = Result<Event, RecordError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.reader.next_event()
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8], offset: u64) -> Result<usize, RecordError> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => {
                return Err(RecordError::Io {
                    offset: offset + n as u64,
                    error,
                })
            }
        }
    }
    Ok(n)
}
