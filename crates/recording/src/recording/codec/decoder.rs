//! Decoding events, never trusting the chunk: every tag, count, frame number
//! and value is checked, and formats older than the one written are read too.

use super::{tag, FrameKey, Prev, KIND_MASK, SAME_TID};
use crate::recording::wire::Cursor;
use crate::recording::{
    Event, EventKind, FrameRef, RecordError, SampleState, StrId, ThinLevel, WalkedFrame,
};

/// Smallest encoding of a frame: three one-byte varints.
const MIN_FRAME_LEN: usize = 3;
/// Smallest encoding of a walked frame: four one-byte varints.
const MIN_WALKED_LEN: usize = 4;

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

    /// The frame numbered `n` in this chunk.
    fn frame_numbered(&self, n: u32, at: u64) -> Result<FrameKey, RecordError> {
        self.frames
            .get(n as usize)
            .copied()
            .ok_or_else(|| RecordError::Corrupt {
                offset: at,
                what: format!(
                    "frame number {n}, but the chunk numbered {} frames so far",
                    self.frames.len()
                ),
            })
    }

    /// A numbered frame's call (`ret` false) or return.
    fn numbered(&self, n: u32, ret: bool, at: u64) -> Result<EventKind, RecordError> {
        let (frame, first_line) = self.frame_numbered(n, at)?;
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
            tag::RESUME_NEW => {
                let frame = get_frame(c)?;
                self.frames.push((frame, 0));
                EventKind::Resume { frame }
            }
            tag::RESUME_AT => {
                let at = c.offset();
                let n = c.u32v("frame number")?;
                EventKind::Resume {
                    frame: self.frame_numbered(n, at)?.0,
                }
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
            tag::CAVEAT => EventKind::Caveat {
                text: StrId(c.u32v("string id")?),
            },
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
