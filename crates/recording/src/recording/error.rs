//! Errors from reading a recording. Every message names the file offset.

use std::io;

use super::{FORMAT_VERSION, MAX_CHUNK_LEN, OLDEST_FORMAT_VERSION};

/// Why a recording could not be read (further). A recording that is merely cut
/// short is not an error: see [`Completion`](super::Completion).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Reading the file failed.
    // The I/O error is in the message, not a source of its own: an error chain
    // would say it twice ("No such file or directory ...: No such file or directory").
    #[error("I/O error at offset {offset}: {error}")]
    Io {
        /// Where the read was.
        offset: u64,
        /// The underlying error.
        error: io::Error,
    },
    /// The file has no bytes at all.
    #[error("empty file (no bytes at offset 0): not a pyprobe recording")]
    Empty,
    /// The file does not start with the magic.
    #[error("not a pyprobe recording: bad magic at offset 0")]
    NotARecording,
    /// Written by a newer (or unknown) format version.
    #[error(
        "unsupported recording format version {version} at offset 8 (this pyprobe reads versions {} to {})",
        OLDEST_FORMAT_VERSION,
        FORMAT_VERSION
    )]
    UnsupportedVersion {
        /// The version in the file.
        version: u32,
    },
    /// The file ends before its header is whole.
    #[error("recording cut short inside its header at offset {offset}")]
    TruncatedHeader {
        /// Where the file ends.
        offset: u64,
    },
    /// A chunk's payload does not match its CRC-32.
    #[error(
        "checksum mismatch in chunk at offset {offset} (stored {stored:#010x}, computed {computed:#010x})"
    )]
    Checksum {
        /// Start of the chunk.
        offset: u64,
        /// CRC-32 in the chunk header.
        stored: u32,
        /// CRC-32 of the payload as read.
        computed: u32,
    },
    /// A chunk claims a payload longer than [`MAX_CHUNK_LEN`].
    #[error(
        "chunk length {len} absurd at offset {offset} (limit {})",
        MAX_CHUNK_LEN
    )]
    ChunkTooLong {
        /// Start of the chunk.
        offset: u64,
        /// The claimed payload length.
        len: u32,
    },
    /// A varint is too long or runs off the end of its chunk.
    #[error("bad varint at offset {offset}")]
    BadVarint {
        /// Start of the varint.
        offset: u64,
    },
    /// A checksummed chunk holds something this format does not allow.
    #[error("corrupt recording at offset {offset}: {what}")]
    Corrupt {
        /// Where the problem is.
        offset: u64,
        /// What is wrong.
        what: String,
    },
}

impl RecordError {
    /// The file offset the error refers to.
    pub(crate) fn offset(&self) -> u64 {
        match self {
            RecordError::Io { offset, .. }
            | RecordError::TruncatedHeader { offset }
            | RecordError::Checksum { offset, .. }
            | RecordError::ChunkTooLong { offset, .. }
            | RecordError::BadVarint { offset }
            | RecordError::Corrupt { offset, .. } => *offset,
            RecordError::Empty | RecordError::NotARecording => 0,
            RecordError::UnsupportedVersion { .. } => 8,
        }
    }
}
