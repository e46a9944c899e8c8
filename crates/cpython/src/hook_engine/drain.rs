//! Reading a hook ring: records are named as they are read (while their code
//! objects most likely still exist) and held, then passed on in time order with
//! the SDT ring of the same process (GC, imports, audit events), which the engine
//! reads between ([`Engine::drain_rings`](pyprobe_sdt::tracer::engine::Engine)): a call
//! never reaches the recording after a later event of the other ring, which would
//! put that event inside the wrong call.

use std::rc::Rc;
use std::sync::Arc;

use crate::hook::codegen::{STR_HASH, STR_LENGTH};
use crate::hook::units::Decoded;
use crate::hook::{enters, KIND_CALL, KIND_RAISE, KIND_RESUME, KIND_RETURN};
use crate::python::walker::{PyFrame, Walker, GONE_CODE};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::DrainStop;
use pyprobe_sdt::tracer::clock::monotonic_ns;
use pyprobe_sdt::tracer::engine::{Hit, RepeatSlot, TraceEvent};
use pyprobe_sdt::tracer::ring_engine::tsc::{read_tsc, TscClock};

use super::parts::CodeParts;
use super::returns::TypeNames;
use super::setup::ascii_data;
use super::{HookProc, BATCH, MAX_NAMED, MAX_REPEATS, MAX_SHADOW};

/// [`HookProc::recheck`]'s room, kept between drains.
#[derive(Default)]
pub(super) struct Recheck {
    seen: rustc_hash::FxHashSet<CodeParts>,
    parts: Vec<CodeParts>,
    seen_types: rustc_hash::FxHashSet<u64>,
    types: Vec<u64>,
    addrs: Vec<u64>,
    words: Vec<Option<u64>>,
}

/// A record read and named, not yet passed on.
pub(super) struct HookRecord {
    kind: u32,
    tid: i32,
    code: u64,
    frame: Rc<PyFrame>,
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
        let units = &mut self.units;
        let drained = self.reader.drain_units(BATCH, |_, words| {
            records.extend(units.decode(words, start));
        });
        self.read_to = match (drained.stop, records.last()) {
            (DrainStop::Empty, _) => start,
            (_, Some(last)) => last.stamp,
            (_, None) => self.read_to,
        };
        pyprobe_sdt::tracer::ring_engine::report_lost(
            &mut self.lost,
            self.reader.lost(),
            monotonic_ns(),
            "hook",
            pid,
            sink,
        );
        if records.is_empty() {
            // Units with no event after them (a thread, a type, parts) point at
            // nothing to read later: done with, or an ending target's exit
            // callback would wait for them.
            if drained.records > 0 {
                self.reader.mark_finished();
            }
            self.raw = records;
            return 0;
        }
        self.walker.new_naming_batch();
        self.names.clear();
        self.last_named = None;
        self.types.new_batch();
        self.recheck(&records);
        for r in &records {
            let (kind, thread, ty, stamp) = (r.kind, r.thread, r.ty, r.stamp);
            let parts = CodeParts(r.parts);
            let (body_name, function_name) = match r.texts.as_deref() {
                Some(t) => (t.body.as_deref(), t.call.as_deref()),
                None => (None, None),
            };
            let frame = match function_name {
                Some(copy) if kind == KIND_CALL => self.name_from_copy(thread, parts, copy),
                _ => self.name(kind, thread, parts, body_name),
            };
            if !enters(kind) {
                let (file, name, line) = (&frame.file, &frame.name, frame.first_line);
                match kind {
                    KIND_RAISE => self.returns.count(file, name, line, None),
                    _ if self.image_gone => {
                        let returned = self.types.cached(ty);
                        self.returns.count(file, name, line, Some(&returned))
                    }
                    _ => {
                        let returned = self.types.name(&self.mem, ty);
                        self.returns.count(file, name, line, Some(returned))
                    }
                }
            }
            self.pending.push_back(HookRecord {
                kind,
                tid: self.fs_tids.get(&thread).copied().unwrap_or(pid),
                code: parts.code(),
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

    /// Before a drain's records are named, with one system call for the drain
    /// (a drain of a program that keeps pyprobe's pace holds a few dozen records,
    /// and a read each cost more than the rest of their naming):
    /// * the parts among them named before keep that name only if their code
    ///   object's `co_qualname` pointer is the one it had then; the others are
    ///   forgotten, to be named afresh. Not before 3.11 (no qualified name: the
    ///   parts are the whole name);
    /// * the types they returned have their `tp_name` pointers read, which
    ///   [`TypeNames`](super::returns::TypeNames) checks its names against.
    ///
    /// Nothing is read when the image is gone: what was named is all there is.
    fn recheck(&mut self, records: &[Decoded]) {
        if self.image_gone {
            return;
        }
        let offset = self
            .walker
            .code_qualname_offset()
            .filter(|_| !self.named.is_empty());
        let Recheck {
            seen,
            parts,
            seen_types,
            types,
            addrs,
            words,
        } = &mut self.recheck;
        seen.clear();
        parts.clear();
        seen_types.clear();
        types.clear();
        addrs.clear();
        // Runs of one code object and of one returned type are the rule (a
        // loop, a recursion): a record like the one before it costs a compare,
        // not a hash.
        let (mut previous, mut previous_type) = (None, None);
        for r in records {
            if r.kind == KIND_RETURN && previous_type != Some(r.ty) {
                previous_type = Some(r.ty);
                if seen_types.insert(r.ty) {
                    types.push(r.ty);
                }
            }
            let Some(offset) = offset else { continue };
            let p = CodeParts(r.parts);
            if previous == Some(p) {
                continue;
            }
            previous = Some(p);
            if seen.insert(p) && self.named.contains_key(&p) {
                parts.push(p);
                addrs.push(p.code().wrapping_add(offset));
            }
        }
        addrs.extend(types.iter().map(|&ty| TypeNames::name_pointer_at(ty)));
        self.mem.read_words(addrs, words);
        let (code_words, type_words) = words.split_at(parts.len());
        for (p, now) in parts.iter().zip(code_words) {
            if self.named.get(p).map(|(_, q)| Some(*q)) != Some(*now) {
                self.named.remove(p);
            }
        }
        self.types.recheck(types, type_words);
    }

    /// The name of a record's code object: a return takes the name of the entry it
    /// closes (the innermost of the same code object on its thread's shadow stack:
    /// the code object may be gone and its memory reused by now), an entry is named
    /// from the target's memory (or from names read before, when the image is gone).
    fn name(
        &mut self,
        kind: u32,
        thread: u64,
        parts: CodeParts,
        body_name: Option<&str>,
    ) -> Rc<PyFrame> {
        let code = parts.code();
        if !enters(kind) {
            let shadow = self.shadow.entry(thread).or_default();
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
        let image_gone = self.image_gone;
        // A module or class body (before 3.12) carries its name in the record, and
        // its parts' check covers only its file: two bodies made from one template
        // at one address share every part. Named from the record each time (a
        // body runs once), never from a cache.
        let body = body_name
            .filter(|_| !image_gone)
            .and_then(|b| name_code(walker, mem, parts, Some(b)))
            .map(Rc::new);
        let frame = match body {
            Some(frame) => {
                // Kept for records read after the image is gone, as any name.
                if self.named.len() >= MAX_NAMED {
                    self.named.clear();
                }
                self.named.insert(parts, (frame.clone(), 0));
                frame
            }
            None => self.cached_name(parts, body_name),
        };
        if enters(kind) {
            self.push_shadow(thread, code, frame.clone());
        }
        frame
    }

    /// The name of a call that carried its name and file as text: the
    /// target's own (with its qualified name) while its code object still holds
    /// that name and file, else the copied text. Kept for its parts' later
    /// records, which carry no text.
    fn name_from_copy(&mut self, thread: u64, parts: CodeParts, copy: &str) -> Rc<PyFrame> {
        let (name, file) = match copy.split_once('\x01') {
            Some((n, f)) => (n, Some(f)),
            None => (copy, None),
        };
        let first_line = parts.0[3] as u32;
        // Named as any record is (this drain's names, those named before, the
        // target's memory), if that agrees with the text.
        let known = self.cached_name(parts, None);
        let frame = if &*known.name == name && file.is_none_or(|file| &*known.file == file) {
            known
        } else {
            let frame = Rc::new(PyFrame {
                file: file.unwrap_or(GONE_CODE).into(),
                function: name.into(),
                name: name.into(),
                first_line,
                line: first_line,
            });
            self.names.insert(parts, Some(frame.clone()));
            self.last_named = None;
            frame
        };
        if self.copied.len() >= MAX_NAMED {
            self.copied.clear();
        }
        self.copied.insert(parts, frame.clone());
        self.push_shadow(thread, parts.code(), frame.clone());
        frame
    }

    /// An entry on `thread`'s shadow stack, which its return is named from.
    fn push_shadow(&mut self, thread: u64, code: u64, frame: Rc<PyFrame>) {
        let shadow = self.shadow.entry(thread).or_default();
        if shadow.len() >= MAX_SHADOW {
            shadow.drain(..MAX_SHADOW / 2);
        }
        shadow.push((code, frame));
    }

    /// The name of a code object from this drain's names, from those named
    /// before, or read now.
    fn cached_name(&mut self, parts: CodeParts, body_name: Option<&str>) -> Rc<PyFrame> {
        if let Some((last, frame)) = &self.last_named {
            if *last == parts {
                return frame.clone();
            }
        }
        let frame = self.named_in_drain(parts, body_name);
        self.last_named = Some((parts, frame.clone()));
        frame
    }

    /// [`Self::cached_name`], through this drain's table.
    fn named_in_drain(&mut self, parts: CodeParts, body_name: Option<&str>) -> Rc<PyFrame> {
        let walker = &mut self.walker;
        let mem = &self.mem;
        let named = &mut self.named;
        let copied = &self.copied;
        let image_gone = self.image_gone;
        self.names
            .entry(parts)
            .or_insert_with(|| {
                // Parts named before (and rechecked in this drain): the same
                // frame, not read again. One frame per code object across
                // drains, which its repeats are known by; reading each afresh
                // cost some ten `process_vm_readv`s per code object per drain.
                if let Some((known, _)) = named.get(&parts) {
                    return Some(known.clone());
                }
                let read = (!image_gone)
                    .then(|| name_code(walker, mem, parts, body_name))
                    .flatten();
                let Some(frame) = read.map(Rc::new) else {
                    // Gone from memory: the text a call of the same parts carried.
                    return copied.get(&parts).cloned();
                };
                if named.len() >= MAX_NAMED {
                    named.clear();
                }
                let qualname = walker
                    .code_qualname_offset()
                    .and_then(|o| mem.read_u64(parts.code().wrapping_add(o)).ok())
                    .unwrap_or(0);
                named.insert(parts, (frame.clone(), qualname));
                Some(frame)
            })
            .clone()
            .unwrap_or_else(|| self.unknown.clone())
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
        let qualified = self.walker.code_qualname_offset().is_some();
        while self.pending.front().is_some_and(|r| r.ts_ns <= upto_ns) {
            let Some(r) = self.pending.pop_front() else {
                break;
            };
            *hits += 1;
            passed += 1;
            // The same frame (the same `Rc`, held in the key's entry) entered or
            // left again: the event the sink named the first time.
            let key = (r.kind, Rc::as_ptr(&r.frame) as usize);
            let last = &mut self.last_repeats[(r.kind & 3) as usize];
            let known = match *last {
                (address, token) if address == key.1 => Some(token),
                _ => self.repeats.get(&key).map(|&(token, _)| token),
            };
            if let Some(token) = known {
                *last = (key.1, token);
                sink(TraceEvent::Repeat {
                    pid,
                    tid: r.tid,
                    ts_ns: r.ts_ns,
                    token,
                });
                continue;
            }
            let b = &mut self.buffers;
            // A third string, the qualified name, where the interpreter has one
            // (3.11+).
            let f = &r.frame;
            let texts: [&str; 3] = [&f.file, &f.name, &f.function];
            b.set(
                &[r.code, r.code, f.first_line as u64],
                &texts[..if qualified { 3 } else { 2 }],
            );
            let (probe, name) = match r.kind {
                KIND_CALL => (usize::MAX - 1, "function__entry"),
                KIND_RESUME => (usize::MAX - 2, "function__resume"),
                _ => (usize::MAX, "function__return"),
            };
            let slot = RepeatSlot::default();
            sink(TraceEvent::Hit(Hit::from_source(
                (pid, r.tid, r.ts_ns),
                (probe, name),
                b,
                &slot,
            )));
            if let Some(token) = slot.token() {
                if self.repeats.len() >= MAX_REPEATS {
                    self.repeats.clear();
                    self.last_repeats = [(0, 0); 4];
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
/// `crate::hook::codegen::callbacks::emit_str_identity`): its hash now, and its length xor its
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
    parts: CodeParts,
    body: Option<&str>,
) -> Option<PyFrame> {
    let [code, name, filename, first_line, check] = parts.0;
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
                .unwrap_or_else(|| GONE_CODE.into()),
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
    let name_holds = || identities(mem, name, data).is_some_and(|ids| holds(&ids));
    if !name_holds() {
        return None;
    }
    let frame = walker
        .code_named_as(code, [name, filename, first_line])
        .filter(|frame| qualname_fits(&frame.function, &frame.name))
        .or_else(|| walker.name_code_parts(name, filename, first_line as u32))?;
    // The target ran while the texts were read: the strings may have been freed
    // and made again under them. Still the ones the hook saw after the reads,
    // the texts read are theirs.
    name_holds().then_some(frame)
}

/// Whether `qualname` can be the qualified name of a function called `name`: it
/// is the name, or ends in `.name` (`Class.method`, `f.<locals>.<lambda>`). The
/// name was checked against what the hook saw; the qualified name was not, and a
/// code object freed since may point at a string freed and reused too (an empty
/// qualified name was read so on docutils through the 3.11 hook).
fn qualname_fits(qualname: &str, name: &str) -> bool {
    qualname
        .strip_suffix(name)
        .is_some_and(|outer| outer.is_empty() || outer.ends_with('.'))
        && !name.is_empty()
}

#[cfg(test)]
mod tests {
    use super::qualname_fits;

    #[test]
    fn a_qualified_name_fits_only_the_name_it_ends_in() {
        for (qualname, name) in [
            ("f", "f"),
            ("C.method", "method"),
            ("C.__private", "__private"),
            ("outer.<locals>.<lambda>", "<lambda>"),
            ("<dictcomp>", "<dictcomp>"),
        ] {
            assert!(qualname_fits(qualname, name), "{qualname} / {name}");
        }
        for (qualname, name) in [
            ("", "<dictcomp>"),
            ("C.other", "method"),
            ("Cmethod", "method"),
            ("", ""),
            ("x", ""),
        ] {
            assert!(!qualname_fits(qualname, name), "{qualname} / {name}");
        }
    }
}
