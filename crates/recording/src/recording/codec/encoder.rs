//! Encoding events: the frame numbers of the current chunk (with a small cache
//! in front of their map, as calls and returns are most of a trace) and each
//! kind's payload.

use rustc_hash::FxHashMap;

use super::{tag, FrameKey, Prev, COMPACT_FRAMES, SAME_TID};
use crate::recording::wire::{put_uvarint, zigzag};
use crate::recording::{Event, EventKind, FrameRef, SampleState, WalkedFrame};

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
    /// Whether the number follows the tag as a varint (not inside the tag).
    spelled: bool,
}

/// Which of the numbered events one is: they share the chunk's frame numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Numbering {
    Call,
    Return,
    Resume,
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
            if hint.spelled {
                put_uvarint(buf, u64::from(hint.number));
            }
            return;
        }
        if let Some((number, numbering)) = self.encode_numbering(buf, event, max_frames) {
            let (tag, spelled) = numbered_tag(number, numbering);
            *hint = FrameNumberHint {
                chunk: Some(self.chunk),
                tag,
                number,
                spelled,
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

    /// [`encode`](Self::encode), giving a call's, resume's or return's frame
    /// number in the chunk and which of them it is.
    fn encode_numbering(
        &mut self,
        buf: &mut Vec<u8>,
        event: &Event,
        max_frames: usize,
    ) -> Option<(u32, Numbering)> {
        let numbered = match &event.kind {
            EventKind::Call { frame } => Some((self.number((*frame, 0)), Numbering::Call)),
            EventKind::Resume { frame } => Some((self.number((*frame, 0)), Numbering::Resume)),
            EventKind::Return { frame, first_line } => {
                Some((self.number((*frame, *first_line)), Numbering::Return))
            }
            _ => None,
        };
        // The tag, and whether a numbered frame's number follows it.
        let (kind, spelled) = match &numbered {
            None => (kind_tag(&event.kind), false),
            Some((Numbered::New(_), Numbering::Call)) => (tag::CALL_NEW, false),
            Some((Numbered::New(_), Numbering::Resume)) => (tag::RESUME_NEW, false),
            Some((Numbered::New(_), Numbering::Return)) => (tag::RETURN_NEW, false),
            Some((Numbered::At(n), numbering)) => numbered_tag(*n, *numbering),
        };
        self.put_head(buf, kind, event);
        match (numbered, &event.kind) {
            (Some((Numbered::At(n), numbering)), _) => {
                if spelled {
                    put_uvarint(buf, u64::from(n));
                }
                return Some((n, numbering));
            }
            (Some((Numbered::New(n), numbering)), EventKind::Call { frame })
            | (Some((Numbered::New(n), numbering)), EventKind::Resume { frame }) => {
                put_frame(buf, frame);
                return Some((n, numbering));
            }
            (Some((Numbered::New(n), _)), EventKind::Return { frame, first_line }) => {
                put_frame(buf, frame);
                put_uvarint(buf, u64::from(*first_line));
                return Some((n, Numbering::Return));
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
            EventKind::Call { frame } | EventKind::Resume { frame } | EventKind::Line { frame } => {
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
            EventKind::Caveat { text } => put_uvarint(buf, u64::from(text.0)),
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

/// The tag of a call, resume or return of frame number `n`, numbered earlier in
/// the chunk, and whether the number follows it as a varint: calls and returns
/// are compact for the first [`COMPACT_FRAMES`]; a resume always spells it.
fn numbered_tag(n: u32, numbering: Numbering) -> (u8, bool) {
    match (n < COMPACT_FRAMES, numbering) {
        (_, Numbering::Resume) => (tag::RESUME_AT, true),
        (true, Numbering::Call) => (tag::COMPACT | (n as u8) << 1, false),
        (true, Numbering::Return) => (tag::COMPACT | (n as u8) << 1 | 1, false),
        (false, Numbering::Call) => (tag::CALL_AT, true),
        (false, Numbering::Return) => (tag::RETURN_AT, true),
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

fn kind_tag(kind: &EventKind) -> u8 {
    match kind {
        EventKind::Call { .. } => tag::CALL,
        // Always numbered: never written with this tag.
        EventKind::Resume { .. } => tag::RESUME_AT,
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
        EventKind::Caveat { .. } => tag::CAVEAT,
    }
}

fn put_frame(buf: &mut Vec<u8>, f: &FrameRef) {
    put_uvarint(buf, u64::from(f.file.0));
    put_uvarint(buf, u64::from(f.function.0));
    put_uvarint(buf, u64::from(f.line));
}
