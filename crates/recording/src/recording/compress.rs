//! Event chunks compressed with zstd (format 11): a trace's calls and returns
//! repeat a few frame numbers and time deltas, which zstd at its fastest level
//! stores in well under half the bytes (fib: 2.8 bytes an event to 1.1).
//!
//! The writer's own thread compresses (see `background`), so the thread that
//! drains the rings never waits for it: [`ChunkCompressor`] takes the bytes the
//! [`RecordingWriter`](super::RecordingWriter) wrote, whole chunks as they come,
//! and gives each events chunk back as an `EVENTS_ZSTD` chunk when that is
//! smaller. Every other byte passes as it is. The reader undoes it with
//! [`decompress_events`], bounded by [`MAX_CHUNK_LEN`] whatever the frame claims.

use std::io;

use zstd::bulk::{Compressor, Decompressor};
use zstd::zstd_safe;

use super::{kind, CHUNK_HEADER_LEN, MAX_CHUNK_LEN};

/// zstd's fastest standard level: about 250 MB/s on one core.
const LEVEL: i32 = 1;
/// The magic and the format version before the first chunk.
const PREFIX_LEN: usize = 12;

/// Passes a recording's bytes through, its events chunks compressed.
pub(crate) struct ChunkCompressor {
    compressor: Option<Compressor<'static>>,
    /// Bytes of the prefix still to pass through.
    prefix_left: usize,
    /// The chunk being gathered: its header, then its payload.
    chunk: Vec<u8>,
    packed: Vec<u8>,
}

impl ChunkCompressor {
    pub(crate) fn new() -> ChunkCompressor {
        ChunkCompressor {
            // Without a context (no memory for one) chunks pass as they are.
            compressor: Compressor::new(LEVEL).ok(),
            prefix_left: PREFIX_LEN,
            chunk: Vec::new(),
            packed: Vec::new(),
        }
    }

    /// Appends to `out` what `bytes` become: the prefix and each chunk made
    /// whole by them; the rest of a chunk waits for the next call.
    pub(crate) fn feed(&mut self, mut bytes: &[u8], out: &mut Vec<u8>) {
        let passed = self.prefix_left.min(bytes.len());
        out.extend_from_slice(&bytes[..passed]);
        self.prefix_left -= passed;
        bytes = &bytes[passed..];
        while !bytes.is_empty() {
            let head = CHUNK_HEADER_LEN as usize;
            let need = if self.chunk.len() < head {
                head - self.chunk.len()
            } else {
                head + payload_len(&self.chunk) - self.chunk.len()
            };
            let take = need.min(bytes.len());
            self.chunk.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.chunk.len() >= head && self.chunk.len() == head + payload_len(&self.chunk) {
                self.emit(out);
            }
        }
    }

    /// Whether a chunk is partly gathered (the writer hands whole chunks over,
    /// so none is at a flush).
    pub(crate) fn holds_part(&self) -> bool {
        !self.chunk.is_empty()
    }

    /// Writes the whole chunk gathered, compressed if it is an events chunk
    /// that gets smaller.
    fn emit(&mut self, out: &mut Vec<u8>) {
        let head = CHUNK_HEADER_LEN as usize;
        let payload = &self.chunk[head..];
        let packed = match (&mut self.compressor, self.chunk[0]) {
            (Some(c), kind::EVENTS) => {
                self.packed.clear();
                self.packed
                    .reserve(zstd_safe::compress_bound(payload.len()));
                c.compress_to_buffer(payload, &mut self.packed).is_ok()
                    && self.packed.len() < payload.len()
            }
            _ => false,
        };
        if packed {
            out.push(kind::EVENTS_ZSTD);
            out.extend_from_slice(&(self.packed.len() as u32).to_le_bytes());
            out.extend_from_slice(&crc32fast::hash(&self.packed).to_le_bytes());
            out.extend_from_slice(&self.packed);
        } else {
            out.extend_from_slice(&self.chunk);
        }
        self.chunk.clear();
    }
}

/// The payload length a chunk's header gives.
fn payload_len(chunk: &[u8]) -> usize {
    u32::from_le_bytes([chunk[1], chunk[2], chunk[3], chunk[4]]) as usize
}

/// Decompresses an `EVENTS_ZSTD` chunk's payload into `into` (emptied first).
/// The frame must say its size, at most [`MAX_CHUNK_LEN`], and give exactly it.
pub(crate) fn decompress_events(
    decompressor: &mut Option<Decompressor<'static>>,
    packed: &[u8],
    into: &mut Vec<u8>,
) -> Result<(), String> {
    into.clear();
    let size = match zstd_safe::get_frame_content_size(packed) {
        Ok(Some(size)) if size <= u64::from(MAX_CHUNK_LEN) => size as usize,
        Ok(Some(size)) => return Err(format!("claims {size} bytes decompressed")),
        Ok(None) => return Err("does not say its decompressed size".into()),
        Err(_) => return Err("is no zstd frame".into()),
    };
    if decompressor.is_none() {
        *decompressor = Some(Decompressor::new().map_err(|e| e.to_string())?);
    }
    let d = decompressor.as_mut().ok_or("no decompression context")?;
    into.reserve(size);
    let n = d
        .decompress_to_buffer(packed, into)
        .map_err(|e: io::Error| format!("does not decompress: {e}"))?;
    if n != size {
        into.clear();
        return Err(format!("decompresses to {n} bytes, not the {size} it says"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut c = vec![kind];
        c.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        c.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        c.extend_from_slice(payload);
        c
    }

    /// A stream of a prefix, a strings chunk, an events chunk that compresses
    /// and one that does not, fed in pieces of every size.
    #[test]
    fn events_chunks_come_out_compressed_and_the_rest_as_it_was() {
        let repetitive: Vec<u8> = (0..60_000u32).map(|i| (i % 7) as u8).collect();
        let noise: Vec<u8> = (0..40u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut input = b"PYPROBE\0\x0b\0\0\0".to_vec();
        let strings = chunk(kind::STRINGS, b"\x01\x00\x03abc");
        input.extend(&strings);
        input.extend(chunk(kind::EVENTS, &repetitive));
        input.extend(chunk(kind::EVENTS, &noise));
        for piece in [1, 5, 9, 10, 4096, input.len()] {
            let mut c = ChunkCompressor::new();
            let mut out = Vec::new();
            for part in input.chunks(piece) {
                c.feed(part, &mut out);
            }
            assert!(!c.holds_part());
            assert_eq!(&out[..12], &input[..12]);
            assert_eq!(&out[12..12 + strings.len()], &strings[..]);
            let at = 12 + strings.len();
            assert_eq!(out[at], kind::EVENTS_ZSTD);
            let len = payload_len(&out[at..]);
            assert!(len < repetitive.len() / 20, "{len}");
            let packed = &out[at + 9..at + 9 + len];
            let crc = u32::from_le_bytes(out[at + 5..at + 9].try_into().unwrap());
            assert_eq!(crc, crc32fast::hash(packed));
            let mut back = Vec::new();
            decompress_events(&mut None, packed, &mut back).unwrap();
            assert_eq!(back, repetitive);
            // Not smaller compressed: as it was.
            assert_eq!(&out[at + 9 + len..], &chunk(kind::EVENTS, &noise)[..]);
        }
    }

    #[test]
    fn a_hostile_frame_is_refused_not_trusted() {
        let mut d = None;
        let mut into = Vec::new();
        assert!(decompress_events(&mut d, b"not zstd at all", &mut into).is_err());
        let good = zstd::bulk::compress(&[7u8; 1000], 1).unwrap();
        // Cut short, or one byte changed: an error, never a panic.
        assert!(decompress_events(&mut d, &good[..good.len() / 2], &mut into).is_err());
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x5a;
            let _ = decompress_events(&mut d, &bad, &mut into);
            assert!(into.len() <= MAX_CHUNK_LEN as usize);
        }
        decompress_events(&mut d, &good, &mut into).unwrap();
        assert_eq!(into, vec![7u8; 1000]);
    }
}
