//! Event types and the recording file (`.pyprobe`): its writer and its reader.
//!
//! A recording is the magic `PYPROBE\0`, a little-endian `u32` format version, then
//! a stream of self-contained chunks. Each chunk is a kind byte, a `u32` payload
//! length, the `u32` CRC-32 of the payload, and the payload. The first chunk is the
//! [`Header`]; then come string-table chunks, event chunks, and finally a trailer
//! whose absence means the recording was cut short. All integers inside payloads
//! are LEB128 varints (zigzag for signed values). From format 11 an events chunk
//! may be stored compressed (a zstd frame, see `compress`).

mod ahead;
mod background;
mod codec;
mod compress;
mod error;
pub mod event;
mod header;
mod made_ahead;
mod qualnames;
mod reader;
mod wire;
mod writer;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ahead;

pub use codec::FrameNumberHint;
pub use error::RecordError;
pub use event::*;
pub use header::{Header, FORMAT_VERSION, MAGIC, OLDEST_FORMAT_VERSION};
pub(crate) use made_ahead::MadeAhead;
pub use qualnames::{or_unnamed, Qualnames, MAX_QUALNAMES, UNNAMED};
pub use reader::{Completion, Events, FileKey, RecordingReader, Trailer};
pub use writer::{BackgroundWriter, RecordingWriter, Summary, MAX_SAMPLE_FRAMES, MAX_STRING_LEN};

/// Largest chunk payload a reader accepts; anything longer is corruption.
pub(crate) const MAX_CHUNK_LEN: u32 = 64 << 20;

/// Chunk kind bytes.
pub mod kind {
    pub(crate) const HEADER: u8 = 1;
    pub(crate) const STRINGS: u8 = 2;
    pub(crate) const EVENTS: u8 = 3;
    pub(crate) const TRAILER: u8 = 4;
    /// Qualified names of functions (format 8).
    pub(crate) const QUALNAMES: u8 = 5;
    /// An events chunk's payload as one zstd frame that says its size (format 11).
    pub(crate) const EVENTS_ZSTD: u8 = 6;
}

/// Bytes before a chunk's payload: kind, length, checksum.
pub(crate) const CHUNK_HEADER_LEN: u64 = 9;
