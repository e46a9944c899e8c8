//! The walk itself, over any [`MemoryReader`]: interpreters → thread states → frames →
//! code objects. Everything read is treated as hostile: every list and chain is bounded
//! and checked for cycles, every read has a size fixed by the layout or capped.

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::Arc;

use super::layout::{FrameLayout, FrameRoot, GilLayout, Layout, LineTable};
use super::lines;
use super::objects::{
    field_i32, field_u64, field_u8, plausible_pointer, read_bytes, read_str, read_u64,
};
use super::PyFrame;
use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::sdt::MemoryReader;

/// Deepest stack walked (frames, shims included); deeper stacks are cut and flagged.
pub const MAX_DEPTH: usize = 1024;
/// Most thread states read, over all interpreters.
pub const MAX_THREADS: usize = 4096;
/// Most interpreters read.
pub const MAX_INTERPRETERS: usize = 256;
/// Code objects remembered; the cache is emptied when it grows past this.
const MAX_CODES: usize = 32 * 1024;
/// Lines remembered per code object.
const MAX_LINES_PER_CODE: usize = 512;

/// One thread state as read, before its native thread id is resolved.
#[derive(Debug, Clone)]
pub struct RawThread {
    pub thread_state: u64,
    /// `thread_id`: the thread's `pthread_t` (`threading.get_ident()`).
    pub thread_id: u64,
    /// `native_thread_id` (3.11+), as the target's PID namespace numbers it.
    pub native_id: Option<i32>,
    pub frames: Vec<PyFrame>,
    pub truncated: bool,
    /// See [`super::ThreadStack::eval_calls`].
    pub eval_calls: Option<Vec<usize>>,
    /// See [`super::ThreadStack::torn`].
    pub torn: bool,
}

/// What the walker keeps of a code object, checked against the object on each use.
struct CodeInfo {
    /// Pointers and first line as last read: a different value means the address now
    /// holds another code object.
    key: [u64; 5],
    file: Arc<str>,
    function: Arc<str>,
    name: Arc<str>,
    table: Option<Box<[u8]>>,
    lines: HashMap<i64, u32>,
    /// The naming batch in which the key was last checked against the target.
    checked_in: u64,
}

impl CodeInfo {
    /// The line of the instruction at byte offset `addr`, from the cache or the
    /// line table (cached, up to [`MAX_LINES_PER_CODE`] per code object).
    fn line_at(&mut self, addr: i64, first_line: u32, table: LineTable) -> u32 {
        if let Some(&line) = self.lines.get(&addr) {
            return line;
        }
        let line = self
            .table
            .as_deref()
            .and_then(|t| match table {
                LineTable::Lnotab => lines::lnotab_line(t, first_line, addr),
                LineTable::Linetable310 => lines::linetable310_line(t, first_line, addr),
                LineTable::Locations => lines::locations_line(t, first_line, addr),
            })
            .unwrap_or(first_line);
        if self.lines.len() < MAX_LINES_PER_CODE {
            self.lines.insert(addr, line);
        }
        line
    }
}

pub struct StackReader<M> {
    pub mem: M,
    pub layout: Layout,
    /// Runtime address of `_PyRuntime`.
    pub runtime: u64,
    /// Runtime address of `PyCode_Type`, to check that a frame's code is a code object.
    pub code_type: Option<u64>,
    codes: HashMap<u64, CodeInfo>,
    /// How the frames of the last [`Self::frames`] walk divide between eval-loop
    /// calls, outermost first (3.12+: each call pushes a shim owned by the C stack).
    last_eval_calls: Option<Vec<usize>>,
    /// The last walk ended, uncut, on a frame that begins no call of the eval
    /// loop: the chain was left while its frames changed.
    last_rootless: bool,
    /// Naming batch of [`Self::name_captured`]: see [`Self::new_naming_batch`].
    batch: u64,
}

/// Why a frame could not be used.
enum FrameError {
    /// Not Python code (a shim, or not a code object): skip it, keep walking.
    Skip,
    /// Unreadable or corrupt: stop the walk here.
    Broken,
}

/// Target memory as the walker reads it: a [`MemoryReader`] that can also read two
/// places in one go (a frame's code object and the next frame).
pub trait Memory: MemoryReader {
    /// Reads all of `abuf` at `a` and all of `bbuf` at `b`; says which succeeded. The
    /// default makes two reads; [`ProcessMemory`] makes one `process_vm_readv`.
    fn read_pair(&self, a: u64, abuf: &mut [u8], b: u64, bbuf: &mut [u8]) -> (bool, bool) {
        (
            self.read_exact(a, abuf).is_ok(),
            self.read_exact(b, bbuf).is_ok(),
        )
    }
}

impl Memory for ProcessMemory {
    fn read_pair(&self, a: u64, abuf: &mut [u8], b: u64, bbuf: &mut [u8]) -> (bool, bool) {
        let (alen, blen) = (abuf.len(), bbuf.len());
        let remote = [
            RemoteIoVec {
                base: a as usize,
                len: alen,
            },
            RemoteIoVec {
                base: b as usize,
                len: blen,
            },
        ];
        let result = {
            let mut local = [io::IoSliceMut::new(abuf), io::IoSliceMut::new(&mut *bbuf)];
            process_vm_readv(Pid::from_raw(self.pid()), &mut local, &remote)
        };
        match result {
            Ok(n) if n == alen + blen => (true, true),
            // The transfer stops at the first failing iovec.
            Ok(n) if n >= alen => (true, false),
            _ => (false, self.read_exact(b, bbuf).is_ok()),
        }
    }
}

/// Where a frame is in its code.
#[derive(Clone, Copy)]
enum Position {
    /// Byte offset of the instruction (`f_lasti` up to 3.10).
    Offset(i64),
    /// The instruction pointer (3.11+), and the thread-local bytecode copy (3.14+ FT).
    Pointer { ip: u64, tlbc_index: Option<i32> },
}

/// A frame's fields.
struct RawFrame {
    /// The next (outer) frame.
    next: u64,
    /// The code object, or `None` for a shim frame.
    code: Option<u64>,
    /// Where an eval-loop call begins: a shim owned by the C stack, the entry frame
    /// a call pushes first (3.12+), or a frame marked `is_entry` (3.11).
    entry_shim: bool,
    /// Not owned by the thread (3.11+): a generator's or coroutine's frame, whose
    /// caller link is cleared when it is suspended, or a frame that has returned
    /// and left its data to a frame object. Never a thread's outermost frame.
    not_thread_owned: bool,
    position: Position,
}

/// `FRAME_OWNED_BY_THREAD`, the same from 3.11 to 3.15.
const FRAME_OWNED_BY_THREAD: u8 = 0;

impl<M: Memory> StackReader<M> {
    pub fn new(mem: M, layout: Layout, runtime: u64, code_type: Option<u64>) -> Self {
        StackReader {
            mem,
            layout,
            runtime,
            code_type,
            codes: HashMap::new(),
            last_eval_calls: None,
            last_rootless: false,
            batch: 1,
        }
    }

    /// Starts a new batch of captured stacks to name. Within a batch (the records
    /// one drain of a ring took, named within microseconds), a code object checked
    /// against the target once is not read again: a storm of rare events (an audit
    /// event per `id()` call) costs one read per code object per batch instead of
    /// one per frame per event. Every batch checks again, so a code object freed and
    /// another allocated at its address is seen at the next batch.
    pub fn new_naming_batch(&mut self) {
        self.batch += 1;
    }

    /// Every thread state of every interpreter, with its bytes (the span the walker
    /// uses), oldest thread first per interpreter: the main thread first. Fails only if
    /// `_PyRuntime` itself cannot be read.
    pub fn thread_states(&self) -> io::Result<Vec<(u64, Vec<u8>)>> {
        let l = &self.layout;
        let mut interp = read_u64(&self.mem, self.runtime + l.runtime_interpreters_head)?;
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        while plausible_pointer(interp) && seen.len() < MAX_INTERPRETERS && seen.insert(interp) {
            let Ok((head, next_interp)) =
                self.two_fields(interp, l.interp_threads_head, l.interp_next)
            else {
                break;
            };
            let mut threads = Vec::new();
            let mut tstate = head;
            let mut seen_threads = HashSet::new();
            while plausible_pointer(tstate)
                && out.len() + threads.len() < MAX_THREADS
                && seen_threads.insert(tstate)
            {
                let mut buf = vec![0u8; l.tstate_span() as usize];
                if self.mem.read_exact(tstate, &mut buf).is_err() {
                    break;
                }
                let Ok(next) = field_u64(&buf, l.tstate_next) else {
                    break;
                };
                threads.push((tstate, buf));
                tstate = next;
            }
            // New thread states are pushed at the head: reverse for oldest first.
            out.extend(threads.into_iter().rev());
            interp = next_interp;
        }
        Ok(out)
    }

    /// The thread states holding a GIL now (one per GIL at most; none while no thread
    /// holds it), or `None` when that cannot be told: this version's GIL offsets are
    /// unknown, or something on the way could not be read.
    pub fn gil_holders(&self) -> Option<Vec<u64>> {
        match self.layout.gil? {
            GilLayout::RuntimeCurrent { tstate_current } => {
                let current =
                    read_u64(&self.mem, self.runtime.checked_add(tstate_current)?).ok()?;
                Some(if current == 0 { vec![] } else { vec![current] })
            }
            GilLayout::Interpreter {
                ceval_gil,
                last_holder,
                locked,
            } => {
                let l = &self.layout;
                let mut interp =
                    read_u64(&self.mem, self.runtime + l.runtime_interpreters_head).ok()?;
                let (lo, hi) = (last_holder.min(locked), last_holder.max(locked) + 8);
                let mut buf = vec![0u8; (hi - lo) as usize];
                let mut seen = HashSet::new();
                let mut gils = HashSet::new();
                let mut holders = Vec::new();
                while plausible_pointer(interp)
                    && seen.len() < MAX_INTERPRETERS
                    && seen.insert(interp)
                {
                    let (gil, next) = self.two_fields(interp, ceval_gil, l.interp_next).ok()?;
                    if !plausible_pointer(gil) {
                        return None;
                    }
                    // Interpreters may share one GIL (the main interpreter's).
                    if gils.insert(gil) {
                        self.mem.read_exact(gil.checked_add(lo)?, &mut buf).ok()?;
                        let holder = field_u64(&buf, last_holder - lo).ok()?;
                        // 1 while held; 0 free; -1 not initialised yet.
                        if field_i32(&buf, locked - lo).ok()? > 0 && holder != 0 {
                            holders.push(holder);
                        }
                    }
                    interp = next;
                }
                Some(holders)
            }
        }
    }

    /// Two pointer fields of one structure: one read when they are near each other.
    fn two_fields(&self, addr: u64, a: u64, b: u64) -> io::Result<(u64, u64)> {
        let (lo, hi) = (a.min(b), a.max(b) + 8);
        if hi - lo <= 4096 {
            let mut buf = [0u8; 4096];
            let buf = &mut buf[..(hi - lo) as usize];
            self.mem.read_exact(addr + lo, buf)?;
            Ok((field_u64(buf, a - lo)?, field_u64(buf, b - lo)?))
        } else {
            Ok((
                read_u64(&self.mem, addr + a)?,
                read_u64(&self.mem, addr + b)?,
            ))
        }
    }

    /// A thread state's ids and innermost frame (`None`: unreadable), from its bytes.
    pub fn thread_header(&self, tstate: u64, buf: &[u8]) -> (RawThread, Option<u64>) {
        let mut raw = RawThread {
            thread_state: tstate,
            thread_id: field_u64(buf, self.layout.tstate_thread_id).unwrap_or(0),
            native_id: self
                .layout
                .tstate_native_thread_id
                .and_then(|o| field_i32(buf, o).ok())
                .filter(|&t| t > 0),
            frames: Vec::new(),
            truncated: false,
            eval_calls: None,
            torn: false,
        };
        let frame = self.innermost_of(buf);
        if frame.is_none() {
            raw.truncated = true;
        }
        (raw, frame)
    }

    /// The innermost frame a thread state's bytes point to (`None`: unreadable).
    fn innermost_of(&self, buf: &[u8]) -> Option<u64> {
        match self.layout.tstate_frame {
            FrameRoot::Direct(o) => field_u64(buf, o).ok(),
            FrameRoot::CFrame {
                cframe,
                current_frame,
            } => field_u64(buf, cframe)
                .ok()
                .filter(|&c| plausible_pointer(c))
                .and_then(|c| read_u64(&self.mem, c + current_frame).ok()),
        }
    }

    /// A thread state and its stack; with `running`, the thread may run while it
    /// is read, and [`RawThread::torn`] says whether it did so under the walk.
    pub fn thread(&mut self, tstate: u64, buf: &[u8], running: bool) -> RawThread {
        let (mut raw, frame) = self.thread_header(tstate, buf);
        if let Some(frame) = frame {
            (raw.frames, raw.truncated) = self.frames(frame);
            raw.eval_calls = self.last_eval_calls();
            raw.torn = running && (raw.truncated || self.last_rootless);
        }
        raw
    }

    /// How the frames of the last [`Self::frames`] walk divide between eval-loop
    /// calls (taken: asked once per walk).
    pub fn last_eval_calls(&mut self) -> Option<Vec<usize>> {
        self.last_eval_calls.take()
    }

    /// Walks the frame chain from the innermost frame; returns the frames outermost
    /// first, and whether the walk was cut short. One read per frame: each frame's code
    /// object is read together with the next frame.
    pub fn frames(&mut self, innermost: u64) -> (Vec<PyFrame>, bool) {
        let mut out = Vec::new();
        // Python frames per eval-loop call, innermost first, while shims show them.
        let mut calls = Vec::new();
        let mut in_call = 0;
        let mut outermost_not_thread_owned = false;
        let mut ends_on_root = false;
        self.last_eval_calls = None;
        self.last_rootless = false;
        if innermost == 0 {
            return (out, false);
        }
        let mut seen = HashSet::new();
        let span = self.layout.frame_span() as usize;
        let (mut frame, mut next_frame) = (vec![0u8; span], vec![0u8; span]);
        let mut code_buf = vec![0u8; self.layout.code_span() as usize];
        if !plausible_pointer(innermost) || self.mem.read_exact(innermost, &mut frame).is_err() {
            return (out, true);
        }
        seen.insert(innermost);
        let truncated = loop {
            let Some(raw) = self.raw_frame(&frame) else {
                break true;
            };
            let next = raw.next;
            // The next frame is read only if it can be one: no cycle, within the depth.
            let follow =
                next != 0 && plausible_pointer(next) && seen.len() < MAX_DEPTH && seen.insert(next);
            let code = raw.code.filter(|&c| plausible_pointer(c));
            let (code_ok, next_ok) = match (code, follow) {
                (Some(c), true) => self.mem.read_pair(c, &mut code_buf, next, &mut next_frame),
                (Some(c), false) => (self.mem.read_exact(c, &mut code_buf).is_ok(), false),
                (None, true) => (false, self.mem.read_exact(next, &mut next_frame).is_ok()),
                (None, false) => (false, false),
            };
            let result = match code {
                // A shim, or no code object (e.g. None): not Python code.
                None => Err(FrameError::Skip),
                Some(_) if !code_ok => Err(FrameError::Broken),
                Some(c) => self.py_frame(c, &code_buf, raw.position),
            };
            let python = result.is_ok();
            match result {
                Ok(f) => {
                    out.push(f);
                    in_call += 1;
                    outermost_not_thread_owned = raw.not_thread_owned;
                }
                Err(FrameError::Skip) => {}
                Err(FrameError::Broken) => break true,
            }
            if raw.entry_shim {
                calls.push(std::mem::take(&mut in_call));
            }
            if next == 0 {
                // A shim, or (3.11) a Python frame its thread owns that begins a call.
                ends_on_root =
                    raw.code.is_none() || (python && raw.entry_shim && !raw.not_thread_owned);
                break false;
            }
            if !(follow && next_ok) {
                break true;
            }
            std::mem::swap(&mut frame, &mut next_frame);
        };
        out.reverse();
        // Every call of the eval loop begins with a frame that says so (3.11: the
        // entry flag; 3.12+: the shim it pushes), so a whole stack ends on one,
        // below a frame its thread owns (a chain followed into a suspended
        // generator's frame, or a returned one, ends there).
        self.last_rootless = self.layout.marks_entries()
            && !truncated
            && !out.is_empty()
            && (!ends_on_root || in_call > 0 || outermost_not_thread_owned);
        if !calls.is_empty() && !truncated {
            // Frames below the outermost entry shim (none are expected) run in the
            // outermost call.
            if let Some(outermost) = calls.last_mut() {
                *outermost += in_call;
            }
            calls.reverse();
            self.last_eval_calls = Some(calls);
        }
        (out, truncated)
    }

    /// Names frames captured elsewhere (by a ring trampoline), innermost first, as
    /// (code pointer, position): `f_lasti` up to 3.10, the instruction pointer
    /// from 3.11. Returns them outermost first, and whether any was dropped. Each
    /// code object's header is read again and checked against the cache's key, so
    /// an address reused by another code object since the capture is named afresh;
    /// one that holds no code object any more keeps the name it had when last read.
    pub fn name_captured(&mut self, captured: &[(u64, u64)]) -> (Vec<PyFrame>, bool) {
        let mut out = Vec::new();
        let mut dropped = false;
        let mut header = vec![0u8; self.layout.code_span() as usize];
        for &(code, position) in captured.iter().take(MAX_DEPTH) {
            if !plausible_pointer(code) {
                dropped = true;
                continue;
            }
            let position = match self.layout.frame {
                FrameLayout::Object { lasti_unit, .. } => {
                    Position::Offset((position as i64).wrapping_mul(lasti_unit as i64))
                }
                FrameLayout::Interpreter { .. } => Position::Pointer {
                    ip: position,
                    tlbc_index: None,
                },
            };
            let checked = self.codes.get(&code).map(|c| c.checked_in);
            let frame = if checked == Some(self.batch) {
                self.cached_frame(code, position)
            } else if self.mem.read_exact(code, &mut header).is_ok() {
                match self.py_frame(code, &header, position) {
                    Ok(frame) => {
                        if let Some(info) = self.codes.get_mut(&code) {
                            info.checked_in = self.batch;
                        }
                        Some(frame)
                    }
                    // No code object there now, but the frame ran one there when it
                    // was captured: freed since (a module's code ends with its run;
                    // the allocator overwrites a freed block's first words). The
                    // name this address last had, if it was ever read.
                    Err(FrameError::Skip) => self.cached_frame(code, position),
                    Err(FrameError::Broken) => None,
                }
            } else {
                // The target is gone (it exited with records still in the ring): the
                // name this address last had, validated when it was read.
                self.cached_frame(code, position)
            };
            match frame {
                Some(f) => out.push(f),
                None => dropped = true,
            }
        }
        out.reverse();
        (out, dropped)
    }

    /// The code object a `_PyInterpreterFrame` at `frame` runs (3.11+), and its
    /// file, `co_name` and first line (the frame's `line` is its first line too):
    /// the frame's executable read (tag bits masked), then the code object's header,
    /// checked as on every walk (a code object's type, the cache's key). `None` for
    /// any frame that cannot be read or is not running a code object, and on
    /// versions whose frames are objects (up to 3.10). Reads two small blocks: the
    /// pointer, and the header.
    pub fn frame_code(&mut self, frame: u64) -> Option<(u64, PyFrame)> {
        let FrameLayout::Interpreter {
            executable,
            tag_mask,
            ..
        } = self.layout.frame
        else {
            return None;
        };
        if !plausible_pointer(frame) {
            return None;
        }
        let word = read_u64(&self.mem, frame.checked_add(executable)?).ok()?;
        self.code_named(word & !tag_mask)
    }

    /// The interpreter frame's code word: its offset in a `_PyInterpreterFrame`
    /// and the tag bits to mask off it (3.11+; `None` where frames are objects).
    pub fn frame_code_word(&self) -> Option<(u64, u64)> {
        match self.layout.frame {
            FrameLayout::Interpreter {
                executable,
                tag_mask,
                ..
            } => Some((executable, tag_mask)),
            _ => None,
        }
    }

    /// The file, `co_name` and first line of the code object at `code` (a frame's
    /// code word, tag bits masked), checked as on every walk; see [`Self::frame_code`].
    pub fn code_named(&mut self, code: u64) -> Option<(u64, PyFrame)> {
        if !plausible_pointer(code) {
            return None;
        }
        let mut header = vec![0u8; self.layout.code_span() as usize];
        self.mem.read_exact(code, &mut header).ok()?;
        let frame = self.py_frame(code, &header, Position::Offset(-1)).ok()?;
        Some((code, frame))
    }

    /// Whether code object `code` (named by [`Self::frame_code`] just before, so
    /// cached) has an instruction at `line`; `None` when that cannot be told (no
    /// line table read, a format before 3.11's).
    pub fn code_has_line(&self, code: u64, line: u32) -> Option<bool> {
        let info = self.codes.get(&code)?;
        let table = info.table.as_deref()?;
        match self.layout.line_table {
            LineTable::Locations => {
                Some(lines::locations_has_line(table, info.key[4] as u32, line))
            }
            LineTable::Lnotab | LineTable::Linetable310 => None,
        }
    }

    /// The frame of `code` at `position` from the cache alone, without reading.
    fn cached_frame(&mut self, code: u64, position: Position) -> Option<PyFrame> {
        let addr = match position {
            Position::Offset(addr) => addr,
            Position::Pointer { ip, .. } => {
                let start = code + self.layout.code_adaptive.unwrap_or(0);
                (ip.wrapping_sub(start) as i64).div_euclid(2) * 2
            }
        };
        let line_table = self.layout.line_table;
        let info = self.codes.get_mut(&code)?;
        let first_line = info.key[4] as u32;
        let line = info.line_at(addr, first_line, line_table);
        Some(PyFrame {
            file: info.file.clone(),
            function: info.function.clone(),
            name: info.name.clone(),
            first_line,
            line,
        })
    }

    /// A frame's fields from its bytes; `None` when they cannot be had.
    fn raw_frame(&self, buf: &[u8]) -> Option<RawFrame> {
        match self.layout.frame {
            FrameLayout::Object {
                back,
                code,
                lasti,
                lasti_unit,
            } => Some(RawFrame {
                next: field_u64(buf, back).ok()?,
                code: Some(field_u64(buf, code).ok()?),
                entry_shim: false,
                not_thread_owned: false,
                position: Position::Offset(
                    i64::from(field_i32(buf, lasti).ok()?) * lasti_unit as i64,
                ),
            }),
            FrameLayout::Interpreter {
                previous,
                executable,
                instr_ptr,
                owner,
                first_shim_owner,
                tag_mask,
                tlbc,
                entry_flag,
            } => {
                let owner = field_u8(buf, owner).ok();
                let shim =
                    first_shim_owner.is_some_and(|first| owner.is_none_or(|owner| owner >= first));
                // 3.11: the frame itself says it is the first of its call.
                let entry = entry_flag.is_some_and(|at| field_u8(buf, at).is_ok_and(|b| b != 0));
                Some(RawFrame {
                    // The first shim owner is FRAME_OWNED_BY_CSTACK; the one after it
                    // (3.14+) owns the interpreter's base frame, no call's.
                    entry_shim: entry || (shim && owner.is_some() && owner == first_shim_owner),
                    not_thread_owned: owner.is_some_and(|o| o != FRAME_OWNED_BY_THREAD),
                    next: field_u64(buf, previous).ok()?,
                    code: if shim {
                        None
                    } else {
                        Some(field_u64(buf, executable).ok()? & !tag_mask)
                    },
                    position: Position::Pointer {
                        ip: field_u64(buf, instr_ptr).ok()?,
                        tlbc_index: tlbc.and_then(|(i, _)| field_i32(buf, i).ok()),
                    },
                })
            }
        }
    }

    /// Where `code`'s bytecode starts: inside the object (`co_code_adaptive`), or in a
    /// free-threaded 3.14+ build, the thread-local copy `co_tlbc[tlbc_index]`.
    fn bytecode_start(&self, code: u64, tlbc_index: Option<i32>) -> io::Result<u64> {
        let adaptive = code + self.layout.code_adaptive.unwrap_or(0);
        let (
            Some(index),
            FrameLayout::Interpreter {
                tlbc: Some((_, co_tlbc)),
                ..
            },
        ) = (tlbc_index, self.layout.frame)
        else {
            return Ok(adaptive);
        };
        if index <= 0 {
            return Ok(adaptive);
        }
        // _PyCodeArray { Py_ssize_t size; char *entries[]; }
        let array = read_u64(&self.mem, code + co_tlbc)?;
        if !plausible_pointer(array) {
            return Ok(adaptive);
        }
        let size = read_u64(&self.mem, array)?;
        if (index as u64) >= size.min(1 << 16) {
            return Ok(adaptive);
        }
        read_u64(&self.mem, array + 8 + 8 * index as u64)
    }

    /// The frame of code object `code` (whose header bytes are `header`) at `position`.
    fn py_frame(
        &mut self,
        code: u64,
        header: &[u8],
        position: Position,
    ) -> Result<PyFrame, FrameError> {
        let l = &self.layout;
        let get = |o: u64| field_u64(header, o).map_err(|_| FrameError::Broken);
        if let Some(code_type) = self.code_type {
            if get(l.ob_type)? != code_type {
                return Err(FrameError::Skip);
            }
        }
        let addr = match position {
            Position::Offset(addr) => addr,
            Position::Pointer { ip, tlbc_index } => {
                let start = self
                    .bytecode_start(code, tlbc_index)
                    .map_err(|_| FrameError::Broken)?;
                // Code units are 2 bytes: the instruction's offset, in bytes.
                (ip.wrapping_sub(start) as i64).div_euclid(2) * 2
            }
        };
        let l = &self.layout;
        let first_line = field_i32(header, l.code_firstlineno)
            .map_err(|_| FrameError::Broken)?
            .max(0) as u32;
        let key = [
            get(l.code_filename)?,
            get(l.code_name)?,
            l.code_qualname.map(get).transpose()?.unwrap_or(0),
            get(l.code_linetable)?,
            u64::from(first_line),
        ];
        let cached = self.codes.get(&code).is_some_and(|c| c.key == key);
        if !cached {
            let info = self.code_info(key)?;
            if self.codes.len() >= MAX_CODES {
                self.codes.clear();
            }
            self.codes.insert(code, info);
        }
        let line_table = self.layout.line_table;
        let info = self.codes.get_mut(&code).ok_or(FrameError::Broken)?;
        let line = info.line_at(addr, first_line, line_table);
        Ok(PyFrame {
            file: info.file.clone(),
            function: info.function.clone(),
            name: info.name.clone(),
            first_line,
            line,
        })
    }

    fn code_info(&self, key: [u64; 5]) -> Result<CodeInfo, FrameError> {
        let [filename, name, qualname, linetable, _] = key;
        let u = &self.layout.unicode;
        let file = read_str(&self.mem, u, filename).map_err(|_| FrameError::Broken)?;
        let name = read_str(&self.mem, u, name).map_err(|_| FrameError::Broken)?;
        let function = if qualname != 0 {
            read_str(&self.mem, u, qualname).map_err(|_| FrameError::Broken)?
        } else {
            name.clone()
        };
        // A table that cannot be read costs the line numbers, not the frame.
        let table = read_bytes(&self.mem, &self.layout, linetable)
            .ok()
            .map(Vec::into_boxed_slice);
        Ok(CodeInfo {
            key,
            file: file.into(),
            function: function.into(),
            name: name.into(),
            table,
            lines: HashMap::new(),
            checked_in: 0,
        })
    }

    /// How many code objects are cached.
    #[cfg(test)]
    pub fn cached_codes(&self) -> usize {
        self.codes.len()
    }
}
