//! The walk itself, over any [`MemoryReader`]: interpreters → thread states → frames →
//! code objects. Everything read is treated as hostile: every list and chain is bounded
//! and checked for cycles, every read has a size fixed by the layout or capped.
//!
//! This file holds the reader and the walk of a frame chain; `thread_states` finds
//! the thread states (and the GIL's holders) the walk starts from, and `code_names`
//! names a frame's code object, with the cache that spares reading it again.

mod code_names;
mod thread_states;

use std::collections::{HashMap, HashSet};
use std::io;

use super::layout::{FrameLayout, Layout};
use super::objects::{field_i32, field_u64, field_u8, plausible_pointer, read_u64};
use super::PyFrame;
use code_names::CodeInfo;
use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::sdt::MemoryReader;

/// Deepest stack walked (frames, shims included); deeper stacks are cut and flagged.
pub(crate) const MAX_DEPTH: usize = 1024;
/// Most thread states read, over all interpreters.
pub(crate) const MAX_THREADS: usize = 65_536;
/// Most interpreters read.
pub(crate) const MAX_INTERPRETERS: usize = 256;
/// Thread states whose stack's first frame is remembered (see `StackReader::roots`).
const MAX_ROOTS: usize = MAX_THREADS;

/// One thread state as read, before its native thread id is resolved.
#[derive(Debug, Clone)]
pub(crate) struct RawThread {
    pub thread_state: u64,
    /// `thread_id`: the thread's `pthread_t` (`threading.get_ident()`).
    pub thread_id: u64,
    /// `native_thread_id` (3.11+), as the target's PID namespace numbers it.
    pub(crate) native_id: Option<i32>,
    pub frames: Vec<PyFrame>,
    pub truncated: bool,
    /// See [`super::ThreadStack::eval_calls`].
    pub eval_calls: Option<Vec<usize>>,
    /// See [`super::ThreadStack::torn`].
    pub torn: bool,
    /// See [`super::ThreadStack::kept`].
    pub kept: bool,
}

pub(crate) struct StackReader<M> {
    pub(crate) mem: M,
    pub(crate) layout: Layout,
    /// Runtime address of `_PyRuntime`.
    pub(crate) runtime: u64,
    /// Runtime address of `PyCode_Type`, to check that a frame's code is a code object.
    pub(crate) code_type: Option<u64>,
    codes: HashMap<u64, CodeInfo>,
    /// How the frames of the last [`Self::frames`] walk divide between eval-loop
    /// calls, outermost first (3.12+: each call pushes a shim owned by the C stack).
    last_eval_calls: Option<Vec<usize>>,
    /// The last walk ended, uncut, on a frame that begins no call of the eval
    /// loop: the chain was left while its frames changed.
    last_rootless: bool,
    /// Where the last walk ended, when it ended on a frame with no caller.
    last_root: Option<u64>,
    /// Up to 3.10, read running: the frame each thread state's stack was last
    /// seen to begin with, and one seen once since that a second walk must
    /// confirm (see [`StackReader::root_unconfirmed`]).
    roots: HashMap<u64, (u64, Option<u64>)>,
    /// What the shim a thread's stack ends on holds as its code (3.12+).
    root_shim: RootShim,
    /// Objects found to be code objects in this naming batch, as a root shim's code
    /// (3.12's trampoline).
    shim_codes: HashSet<u64>,
    /// Naming batch of [`Self::name_captured`]: see [`Self::new_naming_batch`].
    batch: u64,
    /// The thread states read last time, per list head, in list order: read in
    /// one go next time and kept while each link still leads to the next.
    last_chains: std::cell::RefCell<HashMap<u64, Vec<u64>>>,
    /// Code object headers read in this batch, by address: a sample of 300 threads
    /// waiting in the same five functions reads five headers, not 1,500.
    batch_headers: HashMap<u64, Box<[u8]>>,
    /// When kept (`Some`, emptied by the caller before a walk): the (frame, code
    /// object) addresses of the walk's Python frames, outermost first, one per frame
    /// it returns, for reading their locals.
    pub(crate) frame_addresses: Option<Vec<(u64, u64)>>,
}

/// What the shim a whole stack ends on (3.12+) holds where a frame's code is: a
/// stale shim read from reused C stack while the thread ran holds anything, and a
/// stack ending on one was torn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RootShim {
    /// Not checked (before 3.12, or where the object is not known).
    Unchecked,
    /// This object: `None` (3.13+).
    Object(u64),
    /// A code object: the interpreter's trampoline (3.12).
    CodeObject,
}

/// Most objects remembered as a root shim's code object (one per interpreter).
const MAX_SHIM_CODES: usize = 64;

/// Why a frame could not be used.
enum FrameError {
    /// Not Python code (a shim, or not a code object): skip it, keep walking.
    Skip,
    /// Unreadable or corrupt: stop the walk here.
    Broken,
}

/// Target memory as the walker reads it: a [`MemoryReader`] that can also read two
/// places in one go (a frame's code object and the next frame).
pub(crate) trait Memory: MemoryReader {
    /// Reads `len` bytes at each of `addrs` into consecutive pieces of `out`;
    /// returns how many leading blocks were read whole. The default reads them one
    /// by one; [`ProcessMemory`] reads many with each `process_vm_readv`.
    fn read_blocks(&self, addrs: &[u64], len: usize, out: &mut [u8]) -> usize {
        let mut read = 0;
        for (&a, block) in addrs.iter().zip(out.chunks_mut(len.max(1))) {
            if block.len() != len || self.read_exact(a, block).is_err() {
                break;
            }
            read += 1;
        }
        read
    }

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
    fn read_blocks(&self, addrs: &[u64], len: usize, out: &mut [u8]) -> usize {
        ProcessMemory::read_blocks(self, addrs, len, out)
    }

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

/// Most code object headers kept per batch.
const MAX_BATCH_HEADERS: usize = 4096;

/// Blocks of a thread's stacks read at once (3.11+): a frame and the rest of its
/// page below it, where the frames of its callers are. A thread's chain goes back
/// and forth between its data stack (Python frames) and its C stack (the shim each
/// call of the eval loop pushes), so the last few blocks are kept; a later frame
/// inside one is taken from it rather than read again.
#[derive(Default)]
struct FrameWindow {
    /// (start, bytes), the newest last.
    blocks: Vec<(u64, Vec<u8>)>,
}

impl FrameWindow {
    /// Blocks kept: a data stack, a C stack, and a frame elsewhere.
    const KEPT: usize = 3;

    /// Copies the `out.len()` bytes at `addr` from a block, if one holds them all.
    fn copy(&self, addr: u64, out: &mut [u8]) -> bool {
        self.blocks.iter().rev().any(|(start, bytes)| {
            let held = addr.checked_sub(*start).and_then(|offset| {
                bytes.get(offset as usize..(offset as usize).checked_add(out.len())?)
            });
            held.map(|held| out.copy_from_slice(held)).is_some()
        })
    }

    /// After a read of the newest block (`read`: whether it succeeded), the frame
    /// at `addr` from it; a block that could not be read is forgotten, and the
    /// frame alone is read from `mem` instead.
    fn read_into(
        &mut self,
        read: bool,
        addr: u64,
        out: &mut [u8],
        mem: &(impl MemoryReader + ?Sized),
    ) -> bool {
        if read && self.copy(addr, out) {
            return true;
        }
        if !read {
            self.blocks.pop();
        }
        mem.read_exact(addr, out).is_ok()
    }

    /// A new block for a frame of `span` bytes at `addr`, from the start of its
    /// page: where it begins, and the buffer to read it into.
    fn block_for(&mut self, addr: u64, span: usize) -> (u64, &mut [u8]) {
        if self.blocks.len() >= Self::KEPT {
            self.blocks.remove(0);
        }
        let start = addr & !(PAGE - 1);
        self.blocks
            .push((start, vec![0u8; (addr - start) as usize + span]));
        let bytes = self
            .blocks
            .last_mut()
            .map_or(&mut [][..], |(_, b)| &mut b[..]);
        (start, bytes)
    }
}

/// The page size the windows keep to (a read never reaches below a frame's page).
const PAGE: u64 = 4096;

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
    /// Up to 3.10: a frame that does not say it runs.
    not_thread_owned: bool,
    /// A shim's code field (3.12+, tag bits cleared).
    shim_executable: Option<u64>,
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
            last_root: None,
            roots: HashMap::new(),
            root_shim: RootShim::Unchecked,
            shim_codes: HashSet::new(),
            batch: 1,
            batch_headers: HashMap::new(),
            last_chains: Default::default(),
            frame_addresses: None,
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
        self.batch_headers.clear();
        // A trampoline dies with its interpreter: its address is checked again.
        self.shim_codes.clear();
    }

    /// A thread state and its stack; with `running`, the thread may run while it
    /// is read, and [`RawThread::torn`] says whether it did so under the walk.
    pub(crate) fn thread(&mut self, tstate: u64, buf: &[u8], running: bool) -> RawThread {
        let (mut raw, frame) = self.thread_header(tstate, buf);
        if let Some(frame) = frame {
            (raw.frames, raw.truncated) = self.frames(frame);
            raw.eval_calls = self.last_eval_calls();
            // 3.15+: every whole stack ends at the thread's base frame.
            let off_base = self
                .layout
                .tstate_base_frame
                .and_then(|o| field_u64(buf, o).ok())
                .filter(|&base| base != 0)
                .is_some_and(|base| !raw.frames.is_empty() && self.last_root != Some(base));
            let unconfirmed = self.root_unconfirmed(tstate, raw.frames.is_empty(), running);
            raw.torn = running && (raw.truncated || self.last_rootless || off_base || unconfirmed);
        }
        raw
    }

    /// Up to 3.10, whose frames are objects read one at a time: whether a running
    /// walk (whole by every other test) ended on a frame this thread's stack was
    /// not seen to begin with before. A frame read while the interpreter reuses it
    /// can show its new `f_executing` beside the cleared caller link it had in the
    /// free list, and pass for a root. Such a walk counts as torn (and is made
    /// again) until a second walk ends on the same frame; the thread's stack
    /// begins there from then on. A walk of a stopped thread (`running` false)
    /// is whole: its first frame stands at once.
    fn root_unconfirmed(&mut self, tstate: u64, empty: bool, running: bool) -> bool {
        let whole = !self.last_rootless;
        if !matches!(self.layout.frame, FrameLayout::Object { .. }) || empty || !whole {
            return false;
        }
        let Some(root) = self.last_root else {
            return false;
        };
        if self.roots.len() >= MAX_ROOTS && !self.roots.contains_key(&tstate) {
            self.roots.clear();
        }
        let entry = self.roots.entry(tstate).or_insert((0, None));
        if !running {
            *entry = (root, None);
            return false;
        }
        if entry.0 == root {
            entry.1 = None;
            return false;
        }
        if entry.1 == Some(root) {
            *entry = (root, None);
            return false;
        }
        entry.1 = Some(root);
        true
    }

    /// Says what a thread's outermost shim holds as its code (see [`RootShim`]).
    pub(crate) fn set_root_shim(&mut self, root_shim: RootShim) {
        self.root_shim = root_shim;
    }

    /// Whether an object whose type word is `ob_type` is a code object (yes when
    /// the interpreter's code type is not known).
    pub(super) fn has_code_type(&self, ob_type: u64) -> bool {
        self.code_type.is_none_or(|code_type| ob_type == code_type)
    }

    /// Whether a shim with no caller, holding `executable` as its code, can be
    /// where a thread's stack ends.
    fn root_shim_holds(&mut self, executable: u64) -> bool {
        match self.root_shim {
            RootShim::Unchecked => true,
            RootShim::Object(object) => executable == object,
            RootShim::CodeObject => {
                if self.code_type.is_none() || self.shim_codes.contains(&executable) {
                    return true;
                }
                let is_code = plausible_pointer(executable)
                    && read_u64(&self.mem, executable + self.layout.ob_type)
                        .is_ok_and(|t| self.has_code_type(t));
                if is_code && self.shim_codes.len() < MAX_SHIM_CODES {
                    self.shim_codes.insert(executable);
                }
                is_code
            }
        }
    }

    /// How the frames of the last [`Self::frames`] walk divide between eval-loop
    /// calls (taken: asked once per walk).
    pub(crate) fn last_eval_calls(&mut self) -> Option<Vec<usize>> {
        self.last_eval_calls.take()
    }

    /// Walks the frame chain from the innermost frame; returns the frames outermost
    /// first, and whether the walk was cut short. At most one read per frame: each
    /// frame's code object is read together with the next frame, a code object only
    /// once per batch (see [`Self::new_naming_batch`]), and from 3.11 a frame with
    /// the rest of its page below it, where its callers' frames are in the thread's
    /// data stack (see [`FrameWindow`]).
    pub fn frames(&mut self, innermost: u64) -> (Vec<PyFrame>, bool) {
        let mut out = Vec::new();
        // Python frames per eval-loop call, innermost first, while shims show them.
        let mut calls = Vec::new();
        let mut in_call = 0;
        let mut outermost_not_thread_owned = false;
        let mut ends_on_root = false;
        self.last_eval_calls = None;
        self.last_rootless = false;
        self.last_root = None;
        if innermost == 0 {
            return (out, false);
        }
        let mut seen = HashSet::new();
        let span = self.layout.frame_span() as usize;
        let (mut frame, mut next_frame) = (vec![0u8; span], vec![0u8; span]);
        let mut code_buf = vec![0u8; self.layout.code_span() as usize];
        let contiguous = matches!(self.layout.frame, FrameLayout::Interpreter { .. });
        let mut window = FrameWindow::default();
        let first_read = plausible_pointer(innermost)
            && if contiguous {
                let (start, block) = window.block_for(innermost, span);
                let read = self.mem.read_exact(start, block).is_ok();
                window.read_into(read, innermost, &mut frame, &self.mem)
            } else {
                self.mem.read_exact(innermost, &mut frame).is_ok()
            };
        if !first_read {
            return (out, true);
        }
        seen.insert(innermost);
        let mut address = innermost;
        let truncated = loop {
            let Some(raw) = self.raw_frame(&frame) else {
                break true;
            };
            let next = raw.next;
            // The next frame is read only if it can be one: no cycle, within the depth.
            let follow =
                next != 0 && plausible_pointer(next) && seen.len() < MAX_DEPTH && seen.insert(next);
            let code = raw.code.filter(|&c| plausible_pointer(c));
            let code_known = code
                .and_then(|c| self.batch_headers.get(&c))
                .filter(|h| h.len() == code_buf.len())
                .map(|h| code_buf.copy_from_slice(h))
                .is_some();
            let next_known = follow && window.copy(next, &mut next_frame);
            let code_read = code.filter(|_| !code_known);
            let next_read = (follow && !next_known).then_some(next);
            let (code_ok, next_ok) = match (code_read, next_read) {
                (Some(c), Some(n)) if contiguous => {
                    let (start, buffer) = window.block_for(n, span);
                    let (code_ok, window_ok) = self.mem.read_pair(c, &mut code_buf, start, buffer);
                    let next_ok = window.read_into(window_ok, n, &mut next_frame, &self.mem);
                    (code_ok, next_ok)
                }
                (Some(c), Some(n)) => self.mem.read_pair(c, &mut code_buf, n, &mut next_frame),
                (Some(c), None) => (self.mem.read_exact(c, &mut code_buf).is_ok(), next_known),
                (None, Some(n)) if contiguous => {
                    let (start, buffer) = window.block_for(n, span);
                    let window_ok = self.mem.read_exact(start, buffer).is_ok();
                    let next_ok = window.read_into(window_ok, n, &mut next_frame, &self.mem);
                    (code_known, next_ok)
                }
                (None, Some(n)) => (code_known, self.mem.read_exact(n, &mut next_frame).is_ok()),
                (None, None) => (code_known, next_known),
            };
            if let (Some(c), true, false) = (code, code_ok, code_known) {
                if self.batch_headers.len() < MAX_BATCH_HEADERS {
                    self.batch_headers
                        .insert(c, code_buf.clone().into_boxed_slice());
                }
            }
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
                    if let (Some(kept), Some(c)) = (self.frame_addresses.as_mut(), code) {
                        kept.push((address, c));
                    }
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
                let shim = raw.code.is_none()
                    && raw
                        .shim_executable
                        .is_none_or(|executable| self.root_shim_holds(executable));
                ends_on_root = shim || (python && raw.entry_shim && !raw.not_thread_owned);
                self.last_root = Some(address);
                break false;
            }
            if !(follow && next_ok) {
                break true;
            }
            std::mem::swap(&mut frame, &mut next_frame);
            address = next;
        };
        out.reverse();
        if let Some(kept) = self.frame_addresses.as_mut() {
            kept.reverse();
        }
        // Every call of the eval loop begins with a frame that says so (3.11: the
        // entry flag; 3.12+: the shim it pushes), so a whole stack ends on one,
        // below a frame its thread owns (a chain followed into a suspended
        // generator's frame, or a returned one, ends there).
        self.last_rootless = self.layout.marks_entries()
            && !truncated
            && !out.is_empty()
            && (!ends_on_root || in_call > 0 || outermost_not_thread_owned);
        // Up to 3.10 nothing marks a call of the eval loop, but the frame a
        // thread's stack begins with runs as long as the thread does: a chain
        // that ends on a frame that does not (a suspended coroutine's, whose
        // caller link is cleared; one of the freed frames CPython keeps for
        // reuse, linked to each other) was left while the thread moved.
        let objects = matches!(self.layout.frame, FrameLayout::Object { .. });
        self.last_rootless |= objects && !truncated && outermost_not_thread_owned;
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

    /// A frame's fields from its bytes; `None` when they cannot be had.
    fn raw_frame(&self, buf: &[u8]) -> Option<RawFrame> {
        match self.layout.frame {
            FrameLayout::Object {
                back,
                code,
                lasti,
                lasti_unit,
                executing: (executing, runs),
            } => Some(RawFrame {
                next: field_u64(buf, back).ok()?,
                code: Some(field_u64(buf, code).ok()?),
                entry_shim: false,
                not_thread_owned: field_u8(buf, executing).ok()? != runs,
                shim_executable: None,
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
                let executable = field_u64(buf, executable).ok()? & !tag_mask;
                Some(RawFrame {
                    // The first shim owner is FRAME_OWNED_BY_CSTACK; the one after it
                    // (3.14+) owns the interpreter's base frame, no call's.
                    entry_shim: entry || (shim && owner.is_some() && owner == first_shim_owner),
                    not_thread_owned: owner.is_some_and(|o| o != FRAME_OWNED_BY_THREAD),
                    next: field_u64(buf, previous).ok()?,
                    code: (!shim).then_some(executable),
                    shim_executable: shim.then_some(executable),
                    position: Position::Pointer {
                        ip: field_u64(buf, instr_ptr).ok()?,
                        tlbc_index: tlbc.and_then(|(i, _)| field_i32(buf, i).ok()),
                    },
                })
            }
        }
    }
}
