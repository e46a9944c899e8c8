//! Compact encoding of events inside one events chunk.
//!
//! Each event is a tag byte (kind in the low bits, `SAME_TID` when the thread is
//! the previous event's), the thread id as a varint unless `SAME_TID`, the
//! timestamp (absolute varint for a chunk's first event, then a zigzag delta
//! against the previous event: threads interleave, so deltas may be negative),
//! and the kind's payload. State resets at every chunk so chunks stand alone.
//!
//! Calls and returns (format 6), most of a trace, name their frame by a number
//! local to the chunk: the first event of a chunk with a given frame (and, for a
//! return, first line) spells it out (`CALL_NEW`, `RETURN_NEW`) and so numbers it
//! 0, 1, 2, ...; later ones give only the number, inside the tag byte itself for
//! the first [`COMPACT_FRAMES`] (`COMPACT`: one byte besides the timestamp), else
//! as a varint (`CALL_AT`, `RETURN_AT`). Resumes (format 10) share the calls'
//! numbers and always give theirs as a varint (`RESUME_NEW`, `RESUME_AT`). Kinds 0 to `0x3f` are event kinds, room
//! for new ones; `0x40` to `0x7f` are the compact calls and returns.
//!
//! What both directions share, the tag byte and the chunk's state, is here; the
//! encoder is in `encoder`, the decoder (which also reads the older formats)
//! in `decoder`.

use super::FrameRef;

mod decoder;
mod encoder;

pub(crate) use decoder::EventDecoder;
pub(crate) use encoder::EventEncoder;
pub use encoder::FrameNumberHint;

const SAME_TID: u8 = 0x80;
const KIND_MASK: u8 = 0x7f;

mod tag {
    pub(crate) const CALL: u8 = 0;
    pub(crate) const RETURN: u8 = 1;
    pub(crate) const LINE: u8 = 2;
    pub(crate) const GC_START: u8 = 3;
    pub(crate) const GC_DONE: u8 = 4;
    pub(crate) const IMPORT_START: u8 = 5;
    pub(crate) const IMPORT_DONE: u8 = 6;
    pub(crate) const AUDIT: u8 = 7;
    /// Format 1: frames without their first line. Read, no longer written.
    pub(crate) const SAMPLE_V1: u8 = 8;
    pub(crate) const THREAD_START: u8 = 9;
    pub(crate) const THREAD_EXIT: u8 = 10;
    pub(crate) const LOST: u8 = 11;
    /// Format 1, as `SAMPLE_V1`.
    pub(crate) const STACK_V1: u8 = 12;
    pub(crate) const WINDOW: u8 = 13;
    /// Format 2: a sample without its thread's state. Read, no longer written.
    pub(crate) const SAMPLE_V2: u8 = 14;
    pub(crate) const STACK: u8 = 15;
    pub(crate) const RUNNING: u8 = 16;
    /// A sample: its thread's state (one byte, see `put_state`), then its frames.
    pub(crate) const SAMPLE: u8 = 17;
    pub(crate) const THINNED: u8 = 18;
    pub(crate) const AUDITS_COUNTED: u8 = 19;
    /// Format 4: a thread start naming its process (`THREAD_START` names none).
    pub(crate) const THREAD_START_IN: u8 = 20;
    pub(crate) const PROCESS_START: u8 = 21;
    pub(crate) const EXEC: u8 = 22;
    /// Format 5: a return naming its function's first line (`RETURN` names none).
    pub(crate) const RETURN_FROM: u8 = 23;
    /// Format 6: a running total of one function's returns of one type.
    pub(crate) const RETURN_TYPE: u8 = 24;
    /// Format 7: pyprobe let go of the target for a while (Ctrl-Z, SIGSTOP).
    pub(crate) const PAUSED: u8 = 25;
    /// Format 9: the recording of a process is incomplete, for a reason (a string).
    pub(crate) const CAVEAT: u8 = 26;
    /// Format 6: a call spelling out its frame, which gets the chunk's next frame number.
    pub(crate) const CALL_NEW: u8 = 32;
    /// Format 6: a return spelling out its frame and first line (0: unknown), which
    /// get the chunk's next frame number.
    pub(crate) const RETURN_NEW: u8 = 33;
    /// Format 6: a call of a numbered frame, the number as a varint.
    pub(crate) const CALL_AT: u8 = 34;
    /// Format 6: a return of a numbered frame, the number as a varint.
    pub(crate) const RETURN_AT: u8 = 35;
    /// Format 10: a resume spelling out its frame, which gets the chunk's next
    /// frame number (numbered as a call's: a call and a resume of one frame share it).
    pub(crate) const RESUME_NEW: u8 = 36;
    /// Format 10: a resume of a numbered frame, the number as a varint.
    pub(crate) const RESUME_AT: u8 = 37;
    /// Format 6, from here to `0x7f`: a call (bit 0 clear) or return (set) of frame
    /// number `(kind >> 1) & 0x1f`.
    pub(crate) const COMPACT: u8 = 0x40;
}

/// Frame numbers that fit in a compact tag.
const COMPACT_FRAMES: u32 = 32;

/// A numbered frame of the current chunk: the frame and its first line (0 for
/// calls, and for returns that name none).
type FrameKey = (FrameRef, u32);

/// Delta state of the previous event in the current chunk.
#[derive(Default)]
struct Prev {
    last: Option<(u32, u64)>,
}
