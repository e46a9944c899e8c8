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
//! as a varint (`CALL_AT`, `RETURN_AT`). Kinds 0 to `0x3f` are event kinds, room
//! for new ones; `0x40` to `0x7f` are the compact calls and returns.

use rustc_hash::FxHashMap;

use super::wire::{put_uvarint, zigzag, Cursor};
use super::{Event, EventKind, FrameRef, RecordError, SampleState, StrId, ThinLevel, WalkedFrame};

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
    /// Format 2: a sample without its thread's state. Read, no longer written.
    pub const SAMPLE_V2: u8 = 14;
    pub const STACK: u8 = 15;
    pub const RUNNING: u8 = 16;
    /// A sample: its thread's state (one byte, see `put_state`), then its frames.
    pub const SAMPLE: u8 = 17;
    pub const THINNED: u8 = 18;
    pub const AUDITS_COUNTED: u8 = 19;
    /// Format 4: a thread start naming its process (`THREAD_START` names none).
    pub const THREAD_START_IN: u8 = 20;
    pub const PROCESS_START: u8 = 21;
    pub const EXEC: u8 = 22;
    /// Format 5: a return naming its function's first line (`RETURN` names none).
    pub const RETURN_FROM: u8 = 23;
    /// Format 6: a running total of one function's returns of one type.
    pub const RETURN_TYPE: u8 = 24;
    /// Format 7: pyprobe let go of the target for a while (Ctrl-Z, SIGSTOP).
    pub const PAUSED: u8 = 25;
    /// Format 6: a call spelling out its frame, which gets the chunk's next frame number.
    pub const CALL_NEW: u8 = 32;
    /// Format 6: a return spelling out its frame and first line (0: unknown), which
    /// get the chunk's next frame number.
    pub const RETURN_NEW: u8 = 33;
    /// Format 6: a call of a numbered frame, the number as a varint.
    pub const CALL_AT: u8 = 34;
    /// Format 6: a return of a numbered frame, the number as a varint.
    pub const RETURN_AT: u8 = 35;
    /// Format 6, from here to `0x7f`: a call (bit 0 clear) or return (set) of frame
    /// number `(kind >> 1) & 0x1f`.
    pub const COMPACT: u8 = 0x40;
}

/// Frame numbers that fit in a compact tag.
const COMPACT_FRAMES: u32 = 32;

/// A numbered frame of the current chunk: the frame and its first line (0 for
/// calls, and for returns that name none).
type FrameKey = (FrameRef, u32);

/// Smallest encoding of a frame: three one-byte varints.
const MIN_FRAME_LEN: usize = 3;
/// Smallest encoding of a walked frame: four one-byte varints.
const MIN_WALKED_LEN: usize = 4;

/// Delta state of the previous event in the current chunk.
#[derive(Default)]
struct Prev {
    last: Option<(u32, u64)>,
}

/// What a caller remembers of a call or return it writes again and again (a
/// ring record that repeats): the tag its frame number gave it in the
/// encoder's chunk `chunk`. While that chunk lasts, the event is written with
/// no lookup and no branch on its kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameNumberHint {
    /// The chunk the number belongs to (`None`: not written yet).
    chunk: Option<u64>,
    /// The event's tag: see [`numbered_tag`].
    tag: u8,
    number: u32,
}

/// Encodes events into an events-chunk payload.
#[derive(Default)]
pub(crate) struct EventEncoder {
    /// Chunks started so far: names the current one in hints.
    chunk: u64,
    prev: Prev,
    /// The frames numbered in the current chunk.
    frames: FxHashMap<FrameKey, u32>,
    /// Recently numbered frames by a hash of their key, looked at before `frames`:
    /// a trace repeats a few frames, and this is cheaper than the map's lookup.
    recent: Recent,
}

/// Slots of [`Recent`].
const RECENT_SLOTS: usize = 64;

/// A direct-mapped cache of frame numbers: a slot holds the last key that hashed
/// to it (the number is the chunk's, so it is emptied with `frames`).
struct Recent([Option<(FrameKey, u32)>; RECENT_SLOTS]);

impl Default for Recent {
    fn default() -> Recent {
        Recent([None; RECENT_SLOTS])
    }
}

impl Recent {
    fn slot(key: &FrameKey) -> usize {
        let (f, first_line) = key;
        let h = f.function.0.wrapping_mul(0x9e37_79b9)
            ^ f.line.wrapping_mul(0x85eb_ca6b)
            ^ first_line.wrapping_mul(0xc2b2_ae35)
            ^ f.file.0;
        (h >> 26) as usize % RECENT_SLOTS
    }
}

/// How a call or return names its frame.
enum Numbered {
    /// First use in the chunk, which gives it this number: spelled out.
    New(u32),
    /// Numbered already.
    At(u32),
}

impl EventEncoder {
    /// Starts a new chunk: the next event is encoded with absolute values.
    pub(crate) fn reset(&mut self) {
        self.chunk = self.chunk.wrapping_add(1);
        self.prev.last = None;
        self.frames.clear();
        self.recent = Recent::default();
    }

    /// As [`encode`](Self::encode) for a call or return, with what `hint`
    /// remembers of its frame number: valid in this chunk, nothing is looked
    /// up; else the event is encoded as usual and `hint` remembers its number.
    /// The bytes are the same either way. Other kinds are encoded as usual.
    #[inline]
    pub(crate) fn encode_hinted(
        &mut self,
        buf: &mut Vec<u8>,
        event: &Event,
        max_frames: usize,
        hint: &mut FrameNumberHint,
    ) {
        if hint.chunk == Some(self.chunk) {
            self.put_head(buf, hint.tag, event);
            if hint.number >= COMPACT_FRAMES {
                put_uvarint(buf, u64::from(hint.number));
            }
            return;
        }
        if let Some((number, is_return)) = self.encode_numbering(buf, event, max_frames) {
            *hint = FrameNumberHint {
                chunk: Some(self.chunk),
                tag: numbered_tag(number, is_return),
                number,
            };
        }
    }

    /// An event's first bytes: its tag, its thread unless the previous
    /// event's, its time (absolute first in a chunk, else a delta).
    #[inline]
    fn put_head(&mut self, buf: &mut Vec<u8>, kind: u8, event: &Event) {
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
    }

    /// The frame number of a call or return, numbering it if new. The look in
    /// `recent` is inlined: it runs for every traced call and return, and mostly
    /// finds the frame there.
    #[inline(always)]
    fn number(&mut self, key: FrameKey) -> Numbered {
        let slot = Recent::slot(&key);
        if let Some((k, n)) = self.recent.0[slot] {
            if k == key {
                return Numbered::At(n);
            }
        }
        self.number_in_chunk(key, slot)
    }

    /// [`number`](Self::number) past `recent`: the chunk's map.
    #[inline(never)]
    fn number_in_chunk(&mut self, key: FrameKey, slot: usize) -> Numbered {
        let next = self.frames.len() as u32;
        let (n, numbered) = match self.frames.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => (*e.get(), Numbered::At(*e.get())),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(next);
                (next, Numbered::New(next))
            }
        };
        self.recent.0[slot] = Some((key, n));
        numbered
    }

    /// Appends `event`; a sample keeps only its innermost `max_frames` frames.
    pub(crate) fn encode(&mut self, buf: &mut Vec<u8>, event: &Event, max_frames: usize) {
        self.encode_numbering(buf, event, max_frames);
    }

    /// [`encode`](Self::encode), giving a call's or return's frame number in
    /// the chunk and whether it is a return.
    fn encode_numbering(
        &mut self,
        buf: &mut Vec<u8>,
        event: &Event,
        max_frames: usize,
    ) -> Option<(u32, bool)> {
        let numbered = match &event.kind {
            EventKind::Call { frame } => Some((self.number((*frame, 0)), false)),
            EventKind::Return { frame, first_line } => {
                Some((self.number((*frame, *first_line)), true))
            }
            _ => None,
        };
        let kind = match &numbered {
            None => kind_tag(&event.kind),
            Some((Numbered::New(_), false)) => tag::CALL_NEW,
            Some((Numbered::New(_), true)) => tag::RETURN_NEW,
            Some((Numbered::At(n), ret)) => numbered_tag(*n, *ret),
        };
        self.put_head(buf, kind, event);
        match (numbered, &event.kind) {
            (Some((Numbered::At(n), ret)), _) => {
                if n >= COMPACT_FRAMES {
                    put_uvarint(buf, u64::from(n));
                }
                return Some((n, ret));
            }
            (Some((Numbered::New(n), false)), EventKind::Call { frame }) => {
                put_frame(buf, frame);
                return Some((n, false));
            }
            (Some((Numbered::New(n), true)), EventKind::Return { frame, first_line }) => {
                put_frame(buf, frame);
                put_uvarint(buf, u64::from(*first_line));
                return Some((n, true));
            }
            _ => {}
        }
        match &event.kind {
            EventKind::Return { frame, first_line } => {
                put_frame(buf, frame);
                if *first_line != 0 {
                    put_uvarint(buf, u64::from(*first_line));
                }
            }
            EventKind::Call { frame } | EventKind::Line { frame } => put_frame(buf, frame),
            EventKind::GcStart { generation } => put_uvarint(buf, zigzag(i64::from(*generation))),
            EventKind::GcDone { collected } => put_uvarint(buf, zigzag(*collected)),
            EventKind::ImportStart { module } => put_uvarint(buf, u64::from(module.0)),
            EventKind::ImportDone { module, found } => {
                put_uvarint(buf, u64::from(module.0));
                buf.push(u8::from(*found));
            }
            EventKind::Audit { event } => put_uvarint(buf, u64::from(event.0)),
            EventKind::Sample { frames, state } => {
                buf.push(state_byte(*state));
                put_walked(buf, frames, max_frames);
            }
            EventKind::Stack { frames } | EventKind::Running { frames } => {
                put_walked(buf, frames, max_frames)
            }
            EventKind::ThreadStart { pid: 0 } | EventKind::ThreadExit => {}
            EventKind::ThreadStart { pid } => put_uvarint(buf, u64::from(*pid)),
            EventKind::ProcessStart { parent, command } => {
                put_uvarint(buf, u64::from(*parent));
                put_uvarint(buf, u64::from(command.0));
            }
            EventKind::Exec { command } => put_uvarint(buf, u64::from(command.0)),
            EventKind::Window { exact } => buf.push(u8::from(*exact)),
            EventKind::Thinned { level } => buf.push(*level as u8),
            EventKind::Lost { count } | EventKind::AuditsCounted { count } => {
                put_uvarint(buf, *count)
            }
            EventKind::Paused { ns } => put_uvarint(buf, *ns),
            EventKind::ReturnType {
                function,
                returned,
                total,
            } => {
                put_frame(buf, function);
                // 0: raised; else the type's string id + 1.
                put_uvarint(buf, returned.map_or(0, |s| u64::from(s.0) + 1));
                put_uvarint(buf, *total);
            }
        }
        None
    }
}

/// The tag of a call (`is_return` false) or return of frame number `n`, numbered
/// earlier in the chunk: compact for the first [`COMPACT_FRAMES`], else followed
/// by the number as a varint.
fn numbered_tag(n: u32, is_return: bool) -> u8 {
    match (n < COMPACT_FRAMES, is_return) {
        (true, _) => tag::COMPACT | (n as u8) << 1 | u8::from(is_return),
        (false, false) => tag::CALL_AT,
        (false, true) => tag::RETURN_AT,
    }
}

/// A sample's frames: its innermost `max_frames`.
fn put_walked(buf: &mut Vec<u8>, frames: &[WalkedFrame], max_frames: usize) {
    let kept = &frames[frames.len().saturating_sub(max_frames)..];
    put_uvarint(buf, kept.len() as u64);
    for f in kept {
        put_frame(buf, &f.code);
        put_uvarint(buf, u64::from(f.line));
    }
}

/// A sample's state in one byte: bits 0-1 on CPU (0 unknown, 1 yes, 2 no), bits 2-3
/// holding the GIL (the same); the other bits are 0.
fn state_byte(state: SampleState) -> u8 {
    let two = |v: Option<bool>| match v {
        None => 0u8,
        Some(true) => 1,
        Some(false) => 2,
    };
    two(state.on_cpu) | two(state.holds_gil) << 2
}

fn get_state(c: &mut Cursor<'_>) -> Result<SampleState, RecordError> {
    let at = c.offset();
    let b = c.u8()?;
    let two = |v: u8| match v {
        0 => Ok(None),
        1 => Ok(Some(true)),
        2 => Ok(Some(false)),
        _ => Err(()),
    };
    match (b >> 4, two(b & 3), two((b >> 2) & 3)) {
        (0, Ok(on_cpu), Ok(holds_gil)) => Ok(SampleState { on_cpu, holds_gil }),
        _ => Err(RecordError::Corrupt {
            offset: at,
            what: format!("bad sample state {b:#04x}"),
        }),
    }
}

fn kind_tag(kind: &EventKind) -> u8 {
    match kind {
        EventKind::Call { .. } => tag::CALL,
        EventKind::Return { first_line: 0, .. } => tag::RETURN,
        EventKind::Return { .. } => tag::RETURN_FROM,
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
        EventKind::Thinned { .. } => tag::THINNED,
        EventKind::AuditsCounted { .. } => tag::AUDITS_COUNTED,
        EventKind::ReturnType { .. } => tag::RETURN_TYPE,
        EventKind::Paused { .. } => tag::PAUSED,
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
    /// The frames numbered in the current chunk (each took at least
    /// `MIN_FRAME_LEN` bytes of it: bounded by the chunk's length).
    frames: Vec<FrameKey>,
}

impl EventDecoder {
    /// Starts a new chunk.
    pub(crate) fn reset(&mut self) {
        self.prev.last = None;
        self.frames.clear();
    }

    /// A numbered frame's call (`ret` false) or return.
    fn numbered(&self, n: u32, ret: bool, at: u64) -> Result<EventKind, RecordError> {
        let &(frame, first_line) =
            self.frames
                .get(n as usize)
                .ok_or_else(|| RecordError::Corrupt {
                    offset: at,
                    what: format!(
                        "frame number {n}, but the chunk numbered {} frames so far",
                        self.frames.len()
                    ),
                })?;
        Ok(if ret {
            EventKind::Return { frame, first_line }
        } else {
            EventKind::Call { frame }
        })
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
            k if k >= tag::COMPACT => {
                self.numbered(u32::from((k >> 1) & 0x1f), k & 1 != 0, tag_at)?
            }
            tag::CALL_NEW => {
                let frame = get_frame(c)?;
                self.frames.push((frame, 0));
                EventKind::Call { frame }
            }
            tag::RETURN_NEW => {
                let frame = get_frame(c)?;
                let first_line = c.u32v("first line")?;
                self.frames.push((frame, first_line));
                EventKind::Return { frame, first_line }
            }
            tag::CALL_AT | tag::RETURN_AT => {
                let at = c.offset();
                let n = c.u32v("frame number")?;
                self.numbered(n, tag_byte & KIND_MASK == tag::RETURN_AT, at)?
            }
            tag::CALL => EventKind::Call {
                frame: get_frame(c)?,
            },
            tag::RETURN_FROM => EventKind::Return {
                frame: get_frame(c)?,
                first_line: c.u32v("first line")?,
            },
            tag::RETURN => EventKind::Return {
                frame: get_frame(c)?,
                first_line: 0,
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
            tag::THINNED => {
                let v = c.u8()?;
                EventKind::Thinned {
                    level: ThinLevel::from_u8(v)
                        .ok_or_else(|| c.corrupt(format!("thinning level {v}")))?,
                }
            }
            tag::AUDITS_COUNTED => EventKind::AuditsCounted {
                count: c.uvarint()?,
            },
            tag::AUDIT => EventKind::Audit {
                event: StrId(c.u32v("string id")?),
            },
            tag::SAMPLE_V1 => EventKind::Sample {
                frames: get_frames_v1(c, "sample frame")?,
                state: SampleState::default(),
            },
            tag::STACK_V1 => EventKind::Stack {
                frames: get_frames_v1(c, "stack frame")?,
            },
            tag::SAMPLE_V2 => EventKind::Sample {
                frames: get_walked(c, "sample frame")?,
                state: SampleState::default(),
            },
            tag::SAMPLE => {
                let state = get_state(c)?;
                EventKind::Sample {
                    frames: get_walked(c, "sample frame")?,
                    state,
                }
            }
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
            tag::PAUSED => EventKind::Paused { ns: c.uvarint()? },
            tag::RETURN_TYPE => {
                let function = get_frame(c)?;
                let returned = match c.u32v("string id")? {
                    0 => None,
                    id => Some(StrId(id - 1)),
                };
                EventKind::ReturnType {
                    function,
                    returned,
                    total: c.uvarint()?,
                }
            }
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
