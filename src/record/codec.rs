//! Compact encoding of events inside one events chunk.
//!
//! Each event is a tag byte (kind in the low bits, `SAME_TID` when the thread is
//! the previous event's), the thread id as a varint unless `SAME_TID`, the
//! timestamp (absolute varint for a chunk's first event, then a zigzag delta
//! against the previous event: threads interleave, so deltas may be negative),
//! and the kind's payload. State resets at every chunk so chunks stand alone.

use super::wire::{put_uvarint, zigzag, Cursor};
use super::{Event, EventKind, FrameRef, RecordError, StrId, WalkedFrame};

const SAME_TID: u8 = 0x80;
const KIND_MASK: u8 = 0x7f;

mod tag {
    pub const CALL: u8 = 0;
    pub const RETURN: u8 = 1;
    pub const LINE: u8 = 2;
    pub const GC_START: u8 = 3;
    pub const GC_DONE: u8 = 4;
    pub const IMPORT_START: u8 = 5;
    pub const IMPORT_DONE: u8 = 6;
    pub const AUDIT: u8 = 7;
    /// Format 1: frames without their first line. Read, no longer written.
    pub const SAMPLE_V1: u8 = 8;
    pub const THREAD_START: u8 = 9;
    pub const THREAD_EXIT: u8 = 10;
    pub const LOST: u8 = 11;
    /// Format 1, as `SAMPLE_V1`.
    pub const STACK_V1: u8 = 12;
    pub const WINDOW: u8 = 13;
    pub const SAMPLE: u8 = 14;
    pub const STACK: u8 = 15;
    pub const RUNNING: u8 = 16;
    /// Format 3: a thread start naming its process (`THREAD_START` names none).
    pub const THREAD_START_IN: u8 = 17;
    pub const PROCESS_START: u8 = 18;
    pub const EXEC: u8 = 19;
}

/// Smallest encoding of a frame: three one-byte varints.
const MIN_FRAME_LEN: usize = 3;
/// Smallest encoding of a walked frame: four one-byte varints.
const MIN_WALKED_LEN: usize = 4;

/// Delta state of the previous event in the current chunk.
#[derive(Default)]
struct Prev {
    last: Option<(u32, u64)>,
}

/// Encodes events into an events-chunk payload.
#[derive(Default)]
pub(crate) struct EventEncoder {
    prev: Prev,
}

impl EventEncoder {
    /// Starts a new chunk: the next event is encoded with absolute values.
    pub(crate) fn reset(&mut self) {
        self.prev.last = None;
    }

    /// Appends `event`; a sample keeps only its innermost `max_frames` frames.
    pub(crate) fn encode(&mut self, buf: &mut Vec<u8>, event: &Event, max_frames: usize) {
        let kind = kind_tag(&event.kind);
        match self.prev.last {
            Some((tid, ts)) => {
                if tid == event.tid {
                    buf.push(kind | SAME_TID);
                } else {
                    buf.push(kind);
                    put_uvarint(buf, u64::from(event.tid));
                }
                put_uvarint(buf, zigzag(event.ts_ns.wrapping_sub(ts) as i64));
            }
            None => {
                buf.push(kind);
                put_uvarint(buf, u64::from(event.tid));
                put_uvarint(buf, event.ts_ns);
            }
        }
        self.prev.last = Some((event.tid, event.ts_ns));
        match &event.kind {
            EventKind::Call { frame } | EventKind::Return { frame } | EventKind::Line { frame } => {
                put_frame(buf, frame)
            }
            EventKind::GcStart { generation } => put_uvarint(buf, zigzag(i64::from(*generation))),
            EventKind::GcDone { collected } => put_uvarint(buf, zigzag(*collected)),
            EventKind::ImportStart { module } => put_uvarint(buf, u64::from(module.0)),
            EventKind::ImportDone { module, found } => {
                put_uvarint(buf, u64::from(module.0));
                buf.push(u8::from(*found));
            }
            EventKind::Audit { event } => put_uvarint(buf, u64::from(event.0)),
            EventKind::Sample { frames }
            | EventKind::Stack { frames }
            | EventKind::Running { frames } => {
                let kept = &frames[frames.len().saturating_sub(max_frames)..];
                put_uvarint(buf, kept.len() as u64);
                for f in kept {
                    put_frame(buf, &f.code);
                    put_uvarint(buf, u64::from(f.line));
                }
            }
            EventKind::ThreadStart { pid: 0 } | EventKind::ThreadExit => {}
            EventKind::ThreadStart { pid } => put_uvarint(buf, u64::from(*pid)),
            EventKind::ProcessStart { parent, command } => {
                put_uvarint(buf, u64::from(*parent));
                put_uvarint(buf, u64::from(command.0));
            }
            EventKind::Exec { command } => put_uvarint(buf, u64::from(command.0)),
            EventKind::Window { exact } => buf.push(u8::from(*exact)),
            EventKind::Lost { count } => put_uvarint(buf, *count),
        }
    }
}

fn kind_tag(kind: &EventKind) -> u8 {
    match kind {
        EventKind::Call { .. } => tag::CALL,
        EventKind::Return { .. } => tag::RETURN,
        EventKind::Line { .. } => tag::LINE,
        EventKind::GcStart { .. } => tag::GC_START,
        EventKind::GcDone { .. } => tag::GC_DONE,
        EventKind::ImportStart { .. } => tag::IMPORT_START,
        EventKind::ImportDone { .. } => tag::IMPORT_DONE,
        EventKind::Audit { .. } => tag::AUDIT,
        EventKind::Sample { .. } => tag::SAMPLE,
        EventKind::Stack { .. } => tag::STACK,
        EventKind::Running { .. } => tag::RUNNING,
        EventKind::ThreadStart { pid: 0 } => tag::THREAD_START,
        EventKind::ThreadStart { .. } => tag::THREAD_START_IN,
        EventKind::ProcessStart { .. } => tag::PROCESS_START,
        EventKind::Exec { .. } => tag::EXEC,
        EventKind::ThreadExit => tag::THREAD_EXIT,
        EventKind::Lost { .. } => tag::LOST,
        EventKind::Window { .. } => tag::WINDOW,
    }
}

fn put_frame(buf: &mut Vec<u8>, f: &FrameRef) {
    put_uvarint(buf, u64::from(f.file.0));
    put_uvarint(buf, u64::from(f.function.0));
    put_uvarint(buf, u64::from(f.line));
}

/// Decodes events from an events-chunk payload.
#[derive(Default)]
pub(crate) struct EventDecoder {
    prev: Prev,
}

impl EventDecoder {
    /// Starts a new chunk.
    pub(crate) fn reset(&mut self) {
        self.prev.last = None;
    }

    /// Decodes the next event at the cursor.
    pub(crate) fn decode(&mut self, c: &mut Cursor<'_>) -> Result<Event, RecordError> {
        let tag_at = c.offset();
        let tag_byte = c.u8()?;
        let (tid, ts_ns) = match (self.prev.last, tag_byte & SAME_TID != 0) {
            (Some((tid, ts)), same) => {
                let tid = if same { tid } else { c.u32v("thread id")? };
                (tid, ts.wrapping_add(c.ivarint()? as u64))
            }
            (None, false) => (c.u32v("thread id")?, c.uvarint()?),
            (None, true) => {
                return Err(RecordError::Corrupt {
                    offset: tag_at,
                    what: "first event of a chunk refers to a previous thread".into(),
                })
            }
        };
        self.prev.last = Some((tid, ts_ns));
        let kind = match tag_byte & KIND_MASK {
            tag::CALL => EventKind::Call {
                frame: get_frame(c)?,
            },
            tag::RETURN => EventKind::Return {
                frame: get_frame(c)?,
            },
            tag::LINE => EventKind::Line {
                frame: get_frame(c)?,
            },
            tag::GC_START => {
                let at = c.offset();
                let g = c.ivarint()?;
                let generation = i32::try_from(g).map_err(|_| RecordError::Corrupt {
                    offset: at,
                    what: format!("gc generation {g} out of range"),
                })?;
                EventKind::GcStart { generation }
            }
            tag::GC_DONE => EventKind::GcDone {
                collected: c.ivarint()?,
            },
            tag::IMPORT_START => EventKind::ImportStart {
                module: StrId(c.u32v("string id")?),
            },
            tag::IMPORT_DONE => {
                let module = StrId(c.u32v("string id")?);
                let found = get_bool(c)?;
                EventKind::ImportDone { module, found }
            }
            tag::WINDOW => EventKind::Window {
                exact: get_bool(c)?,
            },
            tag::AUDIT => EventKind::Audit {
                event: StrId(c.u32v("string id")?),
            },
            tag::SAMPLE_V1 => EventKind::Sample {
                frames: get_frames_v1(c, "sample frame")?,
            },
            tag::STACK_V1 => EventKind::Stack {
                frames: get_frames_v1(c, "stack frame")?,
            },
            tag::SAMPLE => EventKind::Sample {
                frames: get_walked(c, "sample frame")?,
            },
            tag::STACK => EventKind::Stack {
                frames: get_walked(c, "stack frame")?,
            },
            tag::RUNNING => EventKind::Running {
                frames: get_walked(c, "running frame")?,
            },
            tag::THREAD_START => EventKind::ThreadStart { pid: 0 },
            tag::THREAD_START_IN => EventKind::ThreadStart {
                pid: c.u32v("process id")?,
            },
            tag::PROCESS_START => EventKind::ProcessStart {
                parent: c.u32v("process id")?,
                command: StrId(c.u32v("string id")?),
            },
            tag::EXEC => EventKind::Exec {
                command: StrId(c.u32v("string id")?),
            },
            tag::THREAD_EXIT => EventKind::ThreadExit,
            tag::LOST => EventKind::Lost {
                count: c.uvarint()?,
            },
            other => {
                return Err(RecordError::Corrupt {
                    offset: tag_at,
                    what: format!("unknown event kind {other}"),
                })
            }
        };
        Ok(Event { tid, ts_ns, kind })
    }
}

fn get_bool(c: &mut Cursor<'_>) -> Result<bool, RecordError> {
    let at = c.offset();
    match c.u8()? {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(RecordError::Corrupt {
            offset: at,
            what: format!("bad boolean {b}"),
        }),
    }
}

fn get_frame(c: &mut Cursor<'_>) -> Result<FrameRef, RecordError> {
    Ok(FrameRef {
        file: StrId(c.u32v("string id")?),
        function: StrId(c.u32v("string id")?),
        line: c.u32v("line")?,
    })
}

/// Frames of format 1: the current line only, the first line unknown (0).
fn get_frames_v1(c: &mut Cursor<'_>, what: &str) -> Result<Vec<WalkedFrame>, RecordError> {
    let n = c.count(MIN_FRAME_LEN, what)?;
    (0..n)
        .map(|_| {
            let f = get_frame(c)?;
            Ok(WalkedFrame {
                code: FrameRef { line: 0, ..f },
                line: f.line,
            })
        })
        .collect()
}

fn get_walked(c: &mut Cursor<'_>, what: &str) -> Result<Vec<WalkedFrame>, RecordError> {
    let n = c.count(MIN_WALKED_LEN, what)?;
    (0..n)
        .map(|_| {
            Ok(WalkedFrame {
                code: get_frame(c)?,
                line: c.u32v("line")?,
            })
        })
        .collect()
}
