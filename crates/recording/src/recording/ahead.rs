//! Reading ahead: a thread of its own reads, checks, decompresses and decodes the
//! chunks after the events being returned, so that decoding a recording (a
//! quarter of a view's first pass over it) runs beside what its reader does with
//! the events. Only a reader of a file has one (`RecordingReader::open`): the
//! thread reads the file by offset through a handle of its own.
//!
//! What the thread hands on is what the reader would have found itself, in the
//! same order: events in batches, other chunks whole and checked, then the end or
//! the first error. Memory stays bounded: at most [`QUEUED`] pieces wait, each
//! of at most [`BATCH`] events or one chunk.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::background::spawn_without_signals;
use super::codec::EventDecoder;
use super::wire::Cursor;
use super::{kind, Event, RecordError, CHUNK_HEADER_LEN};
use crate::recording::reader::{read_chunk, unpack_events, Chunk};

/// Most events in one piece: a hostile chunk of 64 MiB could hold millions.
pub(super) const BATCH: usize = 16 * 1024;
/// Pieces decoded ahead of the reader.
const QUEUED: usize = 4;

/// What the thread found next in the file.
pub(super) enum Piece {
    /// Events of one events chunk, in order; `error` when decoding stopped
    /// after them; `last` when the chunk has no more. The chunk ends at `next`.
    Events {
        events: Vec<Event>,
        error: Option<RecordError>,
        last: bool,
        next: u64,
    },
    /// Another chunk, whole and checked: its kind, payload, start and end.
    Other {
        kind: u8,
        payload: Vec<u8>,
        at: u64,
        next: u64,
    },
    /// The file ends at `at`, at a chunk boundary or inside a chunk.
    End { at: u64 },
    /// Reading stopped at this error.
    Failed(RecordError),
}

/// The reading thread, stopped and joined when dropped.
pub(super) struct ReadAhead {
    pieces: Option<Receiver<Piece>>,
    thread: Option<JoinHandle<()>>,
}

impl ReadAhead {
    /// Starts reading `file` at the chunk at `offset`.
    pub(super) fn start(file: Arc<File>, offset: u64) -> io::Result<ReadAhead> {
        let (sender, pieces) = sync_channel(QUEUED);
        let thread =
            spawn_without_signals("pyprobe-read", move || read_ahead(&file, offset, &sender))?;
        Ok(ReadAhead {
            pieces: Some(pieces),
            thread: Some(thread),
        })
    }

    /// The next piece, waiting for the thread.
    pub(super) fn next(&self, offset: u64) -> Piece {
        match self.pieces.as_ref().map(Receiver::recv) {
            Some(Ok(piece)) => piece,
            // The thread ends only after its last piece, or by panicking.
            _ => Piece::Failed(RecordError::Io {
                offset,
                error: io::Error::other("the thread reading the recording stopped"),
            }),
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        // Without a receiver the thread's next send fails, and it returns.
        self.pieces = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Reads a file from a position of its own, leaving the file's offset alone.
struct At<'a> {
    file: &'a File,
    offset: u64,
}

impl Read for At<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(buf, self.offset)?;
        self.offset += n as u64;
        Ok(n)
    }
}

/// The thread: every chunk from `offset` on, until the end, an error, or the
/// reader gone.
fn read_ahead(file: &File, mut offset: u64, pieces: &SyncSender<Piece>) {
    let mut input = BufReader::with_capacity(256 * 1024, At { file, offset });
    let mut chunk = Vec::new();
    let mut packed = Vec::new();
    let mut decompressor = None;
    let mut decoder = EventDecoder::default();
    loop {
        let at = offset;
        let piece = match read_chunk(&mut input, at, &mut chunk) {
            Err(e) => Piece::Failed(e),
            Ok(Chunk::Eof | Chunk::Partial) => Piece::End { at },
            Ok(Chunk::Whole(k)) => {
                offset = at + CHUNK_HEADER_LEN + chunk.len() as u64;
                if k == kind::EVENTS || k == kind::EVENTS_ZSTD {
                    match unpack_events(k, at, &mut chunk, &mut packed, &mut decompressor) {
                        Ok(()) => {
                            decoder.reset();
                            let sent = decode_events(&mut decoder, &chunk, at, offset, pieces);
                            if sent.is_err() {
                                return;
                            }
                            continue;
                        }
                        Err(e) => Piece::Failed(e),
                    }
                } else {
                    Piece::Other {
                        kind: k,
                        payload: std::mem::take(&mut chunk),
                        at,
                        next: offset,
                    }
                }
            }
        };
        let done = !matches!(piece, Piece::Other { kind: k, .. } if k != kind::TRAILER);
        if pieces.send(piece).is_err() || done {
            return;
        }
    }
}

/// Decodes the events chunk at `at` (its payload `chunk`, the next chunk at
/// `next`) into pieces; `Err` when reading stops here: the reader is gone, or
/// a decoding error was handed on.
fn decode_events(
    decoder: &mut EventDecoder,
    chunk: &[u8],
    at: u64,
    next: u64,
    pieces: &SyncSender<Piece>,
) -> Result<(), ()> {
    let mut c = Cursor::new(chunk, 0, at + CHUNK_HEADER_LEN);
    loop {
        let mut events = Vec::with_capacity(BATCH.min(chunk.len()));
        let mut error = None;
        while events.len() < BATCH && c.pos() < chunk.len() {
            match decoder.decode(&mut c) {
                Ok(event) => events.push(event),
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        let stopped = error.is_some();
        let last = stopped || c.pos() >= chunk.len();
        pieces
            .send(Piece::Events {
                events,
                error,
                last,
                next,
            })
            .map_err(|_| ())?;
        if stopped {
            // The reader stops at the error: nothing after it is read.
            return Err(());
        }
        if last {
            return Ok(());
        }
    }
}
