//! Reading a hook ring: records are named as they are read (while their code
//! objects most likely still exist) and held, then passed on in time order with
//! the SDT ring of the same process (GC, imports, audit events), which the engine
//! reads between ([`Engine::drain_rings`](crate::tracer::engine::Engine)): a call
//! never reaches the recording after a later event of the other ring, which would
//! put that event inside the wrong call.

use std::sync::Arc;

use crate::hook::codegen::{STR_HASH, STR_LENGTH};
use crate::hook::{KIND_CALL, KIND_RAISE, KIND_RETURN};
use crate::process::memory::ProcessMemory;
use crate::python::walker::{PyFrame, Walker};
use crate::ring::DrainStop;
use crate::tracer::clock::monotonic_ns;
use crate::tracer::engine::{Hit, RepeatSlot, TraceEvent};
use crate::tracer::ring::tsc::{read_tsc, TscClock};

use super::setup::ascii_data;
use super::{HookProc, BATCH, MAX_NAMED, MAX_REPEATS, MAX_SHADOW, UNKNOWN};

/// A record as the ring holds it: kind, `%fs` base, the code object's parts
/// (address, name and file pointers, first line, the strings' hash check), the
/// returned type, the counter stamp, a body's copied name.
pub(super) struct RawRecord {
    kind: u32,
    thread: u64,
    parts: [u64; 5],
    ty: u64,
    stamp: u64,
    body_name: Option<String>,
}

/// A record read and named, not yet passed on.
pub(super) struct HookRecord {
    kind: u32,
    tid: i32,
    code: u64,
    frame: Arc<PyFrame>,
    ts_ns: u64,
}

impl HookProc {
    /// Reads up to [`BATCH`] records from the ring, names them and holds them; says
    /// what was lost. Returns the records read. Afterwards every record stamped
    /// before `read_to` has been read.
    pub(super) fn collect(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize {
        let start = read_tsc();
        let mut records = std::mem::take(&mut self.raw);
        records.clear();
        let drained = self.reader.drain(BATCH, |r| {
            records.push(RawRecord {
                kind: r.probe,
                thread: r.thread,
                parts: [r.args[0], r.args[2], r.args[3], r.args[4], r.args[5]],
                ty: r.args[1],
                stamp: r.tsc,
                // A module or class body's name and file, copied by the hook
                // (before 3.12).
                body_name: r
                    .string(2)
                    .filter(|s| !s.truncated)
                    .map(|s| String::from_utf8_lossy(s.bytes).into_owned()),
            });
        });
        self.read_to = match (drained.stop, records.last()) {
            (DrainStop::Empty, _) => start,
            (_, Some(last)) => last.stamp,
            (_, None) => self.read_to,
        };
        let lost = self.reader.lost();
        if lost > self.lost_reported {
            sink(TraceEvent::Lost {
                pid,
                count: lost - self.lost_reported,
                ts_ns: monotonic_ns(),
            });
            self.lost_reported = lost;
        }
        if records.is_empty() {
            self.raw = records;
            return 0;
        }
        self.walker.new_naming_batch();
        self.names.clear();
        self.types.new_batch();
        for r in &records {
            let (kind, thread, parts, ty, stamp) = (r.kind, r.thread, r.parts, r.ty, r.stamp);
            if !matches!(kind, KIND_CALL | KIND_RETURN | KIND_RAISE) {
                continue;
            }
            let frame = self.name(kind, thread, parts, r.body_name.as_deref());
            if kind != KIND_CALL {
                let returned = match kind {
                    KIND_RAISE => None,
                    _ if self.image_gone => Some(self.types.cached(ty)),
                    _ => Some(self.types.name(&self.mem, ty)),
                };
                self.returns
                    .count(&frame.file, &frame.name, frame.first_line, returned);
            }
            self.pending.push_back(HookRecord {
                kind,
                tid: self.fs_tids.get(&thread).copied().unwrap_or(pid),
                code: parts[0],
                frame,
                ts_ns: tsc.map_or_else(monotonic_ns, |c| c.to_ns(stamp)),
            });
        }
        // Named: an ending target's exit callback may let finalization free them now.
        self.reader.mark_finished();
        let read = records.len();
        self.raw = records;
        read
    }

    /// The name of a record's code object: a return takes the name of the entry it
    /// closes (the innermost of the same code object on its thread's shadow stack:
    /// the code object may be gone and its memory reused by now), an entry is named
    /// from the target's memory (or from names read before, when the image is gone).
    fn name(
        &mut self,
        kind: u32,
        thread: u64,
        parts: [u64; 5],
        body_name: Option<&str>,
    ) -> Arc<PyFrame> {
        let code = parts[0];
        let shadow = self.shadow.entry(thread).or_default();
        if kind != KIND_CALL {
            let at = shadow
                .iter()
                .rev()
                .take(64)
                .position(|(c, _)| *c == code)
                .map(|k| shadow.len() - 1 - k);
            if let Some(i) = at {
                let (_, frame) = shadow.swap_remove(i);
                shadow.truncate(i);
                return frame;
            }
        }
        let walker = &mut self.walker;
        let mem = &self.mem;
        let named = &mut self.named;
        let image_gone = self.image_gone;
        let frame = self
            .names
            .entry(parts)
            .or_insert_with(|| {
                // The name read before, when the read finds it again: one frame per
                // code object across drains, which its repeats are known by.
                let frame = match (
                    (!image_gone)
                        .then(|| name_code(walker, mem, parts, body_name))
                        .flatten(),
                    named.get(&parts),
                ) {
                    (Some(read), Some(known)) if **known == read => Some(known.clone()),
                    (Some(read), _) => Some(Arc::new(read)),
                    (None, known) => known.cloned(),
                };
                if let Some(f) = &frame {
                    if named.len() >= MAX_NAMED {
                        named.clear();
                    }
                    named.insert(parts, f.clone());
                }
                frame
            })
            .clone()
            .unwrap_or_else(|| self.unknown.clone());
        if kind == KIND_CALL {
            if shadow.len() >= MAX_SHADOW {
                shadow.drain(..MAX_SHADOW / 2);
            }
            shadow.push((code, frame.clone()));
        }
        frame
    }

    /// Passes on the held records stamped no later than `upto_ns`, in order, as
    /// function entry and return hits (`hits` counts them). Returns how many.
    pub(super) fn emit(
        &mut self,
        pid: i32,
        upto_ns: u64,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> usize {
        let mut passed = 0;
        while self.pending.front().is_some_and(|r| r.ts_ns <= upto_ns) {
            let Some(r) = self.pending.pop_front() else {
                break;
            };
            *hits += 1;
            passed += 1;
            // The same frame (the same `Arc`, held in the key's entry) entered or
            // left again: the event the sink named the first time.
            let key = (r.kind == KIND_CALL, Arc::as_ptr(&r.frame) as usize);
            if let Some(&(token, _)) = self.repeats.get(&key) {
                sink(TraceEvent::Repeat {
                    pid,
                    tid: r.tid,
                    ts_ns: r.ts_ns,
                    token,
                });
                continue;
            }
            let b = &mut self.buffers;
            b.set(
                &[r.code, r.code, r.frame.first_line as u64],
                &[&r.frame.file, &r.frame.name],
            );
            let (probe, name) = match r.kind {
                KIND_CALL => (usize::MAX - 1, "function__entry"),
                _ => (usize::MAX, "function__return"),
            };
            let slot = RepeatSlot::default();
            sink(TraceEvent::Hit(Hit {
                pid,
                tid: r.tid,
                ts_ns: r.ts_ns,
                probe,
                probe_name: name,
                args: &b.args,
                buffers: b,
                stack: None,
                stopped: false,
                repeat: Some(&slot),
            }));
            if let Some(token) = slot.token() {
                if self.repeats.len() >= MAX_REPEATS {
                    self.repeats.clear();
                }
                self.repeats.insert(key, (token, r.frame));
            }
        }
        if passed > 0 {
            sink(TraceEvent::RingDrained { pid });
        }
        if self.returns.due() {
            let rows = self.returns.take_changed();
            sink(TraceEvent::ReturnTypes {
                pid,
                ts_ns: monotonic_ns(),
                rows: &rows,
            });
        }
        passed
    }
}

/// What may identify the `str` at `s` as the hook saw it (see
/// `crate::hook::codegen::emit_str_identity`): its hash now, and its length xor its
/// first 8 bytes (its length alone when shorter), which a hash computed since does
/// not change.
fn identities(mem: &ProcessMemory, s: u64, data: u64) -> Option<[u64; 2]> {
    let hash = mem.read_u64(s + STR_HASH as u64).ok()?;
    let len = mem.read_u64(s + STR_LENGTH as u64).ok()?;
    let by_text = if len < 8 {
        len
    } else {
        len ^ mem.read_u64(s + data).ok()?
    };
    Some([hash, by_text])
}

/// Names the code object of a record. Its strings must still read as they did when
/// the hook ran (`check`: the name's identity xor the file's rotated, or the file's
/// alone for a body, whose name, and file when it fits, the record carries): before
/// 3.12 a code object and its strings may be freed by now, their memory still
/// holding the old pointers or other strings. Then the walker's name (with
/// `co_qualname`) while the object at that address still has the `co_name`,
/// `co_filename` and first line the record saw, else from those parts themselves.
fn name_code(
    walker: &mut Walker,
    mem: &ProcessMemory,
    parts: [u64; 5],
    body: Option<&str>,
) -> Option<PyFrame> {
    let [code, name, filename, first_line, check] = parts;
    let data = ascii_data(u32::from(walker.version().minor)) as u64;
    let file_ids = identities(mem, filename, data);
    let holds = |names: &[u64]| {
        file_ids.is_some_and(|files| {
            names
                .iter()
                .any(|n| files.iter().any(|f| n ^ f.rotate_left(1) == check))
        })
    };
    if let Some(body) = body {
        let (body_name, body_file) = match body.split_once('\x01') {
            Some((n, f)) => (n, Some(f)),
            None => (body, None),
        };
        let file: Arc<str> = match body_file {
            Some(f) => f.into(),
            None => holds(&[0])
                .then(|| walker.read_str(filename))
                .flatten()
                .unwrap_or_else(|| UNKNOWN.into()),
        };
        let name: Arc<str> = body_name.into();
        return Some(PyFrame {
            file,
            function: name.clone(),
            name,
            first_line: first_line as u32,
            line: first_line as u32,
        });
    }
    if !holds(&identities(mem, name, data)?) {
        return None;
    }
    let [o_name, o_file, o_line] = walker.code_field_offsets();
    let same = mem.read_u64(code + o_name).ok() == Some(name)
        && mem.read_u64(code + o_file).ok() == Some(filename)
        && mem
            .read_u64(code + o_line)
            .ok()
            .map(|v| v as u32 as i32 as i64 as u64)
            == Some(first_line);
    if same {
        let (frames, _) = walker.name_captured(&[(code, 0)]);
        if let Some(frame) = frames.into_iter().next() {
            return Some(frame);
        }
    }
    walker.name_code_parts(name, filename, first_line as u32)
}
