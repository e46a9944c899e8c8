//! The frame walker: the Python stacks of a live CPython process, read from outside with
//! `process_vm_readv` only (no ptrace, no stop, nothing written).
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use pyprobe_cpython::python::walker::Walker;
//! let mut walker = Walker::attach(1234)?;
//! eprintln!("{}", walker.describe());
//! for thread in walker.stacks()? {
//!     for frame in &thread.frames {   // outermost first
//!         println!("{:?} {}:{} in {}", thread.native_tid, frame.file, frame.line, frame.function);
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! How it finds things:
//! * the interpreter is the mapped object defining `_PyRuntime` (or with a `.PyRuntime`
//!   section): the executable, `libpython3.X.so`, or a python binary run through the
//!   dynamic loader; SDT notes are not needed;
//! * the version comes from `Py_Version` (3.11+), else `_Py_DebugOffsets`, else the
//!   object's name, else a `python3.X` path among the mappings;
//! * the structure layout of 3.7 – 3.12 comes from `offsets/3.X.json` (generated from
//!   that version's headers by `scripts/gen-offsets.sh`, embedded at build time); 3.13+
//!   reads it from the `_Py_DebugOffsets` at the start of `_PyRuntime` (cookie, version
//!   and sizes checked), so a new patch release needs nothing new.
//!
//! Per version: 3.7 – 3.10 walk `PyFrameObject`s (`f_back`, line from `f_lasti` and
//! `co_lnotab` / 3.10's `co_linetable`); 3.11+ walk `_PyInterpreterFrame`s (line from
//! `prev_instr`/`instr_ptr` and the location table), skip the shim frames owned by the C
//! stack or the interpreter (3.12+), mask the tag bits of `f_executable` (3.14+), and
//! skip any frame whose code is not a code object (`ob_type != &PyCode_Type`). Function
//! names are `co_qualname` from 3.11 (`Class.method`), `co_name` before.
//!
//! The GIL's holder: up to 3.11 `_PyRuntime.gilstate.tstate_current`, the thread state
//! holding it (NULL while released); 3.12+ each interpreter's `ceval.gil`, held by its
//! `last_holder` while `locked` is set (offsets from `offsets/3.12.json`, or from
//! `_Py_DebugOffsets`). Without those offsets (a free-threaded build, a positions file
//! without them) whether a thread holds the GIL is unknown: `None`, never guessed.
//!
//! Native thread ids: 3.11+ read `native_thread_id`; 3.7 – 3.10 read the tid out of the
//! thread's `struct pthread` (its `pthread_t` is its address; the offset of the tid is
//! found once against the live task list; see `threads.rs`); `None` when that fails.
//! Tids are as pyprobe sees them, translated out of the target's PID namespace.
//!
//! Safety against a corrupt or hostile target: every read has a size fixed by the layout
//! or capped (strings at 1024 code points, line tables at 1 MiB), stacks at 1024
//! frames, 65,536 thread states in all, 256 interpreters, with cycle detection on every
//! chain; nothing here panics on what it reads. A walk cut short is flagged
//! ([`ThreadStack::truncated`]) rather than failed.
//!
//! The target keeps running while it is read: a thread that runs meanwhile may give a
//! torn stack (usually flagged truncated). Stop the threads (e.g. PTRACE_INTERRUPT) around
//! [`Walker::stacks`] for a consistent one.
//!
//! Decoded code objects are cached by address (checked against the object's name,
//! file, line-table pointers and first line on every use), so a steady-state sample costs
//! one `process_vm_readv` per frame (a frame's code object and the next frame are read
//! together), one per thread state (two on 3.11/3.12: `cframe`), two for the
//! interpreter list, and for the GIL one (up to 3.11) or one plus two per interpreter.
//! [`Walker`] is `Send`: it can live on a sampling thread.

pub(crate) mod current;
mod dicts;
mod instances;
pub(crate) mod layout;
mod legacy_listing;
mod legacy_registry;
mod legacy_tasks;
pub mod lines;
mod locals;
mod locate;
mod objects;
mod py_tasks;
mod stacks;
mod still;
mod task_listing;
mod tasks;
mod threads;
mod values;
mod waiting;

pub use still::TickStill;
pub use task_listing::TaskListing;
pub use tasks::{task_marker, AsyncTask, TaskInfo, MAX_TASKS, TASK_FILE};
pub use waiting::{WaitingLimits, WaitingPlan, WaitingTasks};

#[cfg(test)]
mod tests;

use std::sync::Arc;

use anyhow::{Context, Result};

pub use layout::LayoutSource;
pub use locals::{Local, LocalKind};
pub use locate::find_interpreter_object;

use crate::python::version::PyVersion;
use layout::{FrameLayout, FrameRoot, Layout};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::{StackCapture, StackFrame, StackRoot};
use stacks::{RawThread, RootShim, StackReader};
use threads::Tids;

/// Whether `name` can be a code object's `co_name`: an identifier, or one of the
/// compiler's bracketed names (`<module>`, `<lambda>`, `<genexpr>` ...).
fn plausible_code_name(name: &str) -> bool {
    let bracketed = name
        .strip_prefix('<')
        .and_then(|n| n.strip_suffix('>'))
        .is_some_and(|n| {
            !n.is_empty()
                && n.chars()
                    .all(|c| c.is_alphanumeric() || c == '_' || c == '.')
        });
    let identifier = name
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_alphanumeric() || c == '_');
    bracketed || identifier
}

/// The name of a frame whose code object was freed before pyprobe could read it.
pub const GONE_CODE: &str = "<code object gone before pyprobe read it>";

/// One Python frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyFrame {
    /// `co_filename`.
    pub file: Arc<str>,
    /// `co_qualname` on 3.11+ (`Class.method`, `outer.<locals>.inner`), `co_name` before.
    pub function: Arc<str>,
    /// `co_name`: the name the function probes pass, which recordings use so that
    /// sampled and traced frames name a function the same way.
    pub name: Arc<str>,
    /// `co_firstlineno`: the line of the `def`.
    pub first_line: u32,
    /// The line being executed (the call, in an outer frame); the first line when the
    /// frame has not started or its line table has no line for the instruction.
    pub line: u32,
}

impl PyFrame {
    /// A frame known to have run a code object that pyprobe cannot name ([`GONE_CODE`]):
    /// drawn so that the stack keeps its depth and says what is missing.
    pub fn gone() -> Self {
        PyFrame {
            file: GONE_CODE.into(),
            function: GONE_CODE.into(),
            name: GONE_CODE.into(),
            first_line: 0,
            line: 0,
        }
    }
}

/// Where a `_PyInterpreterFrame` (3.11+) keeps its code object, and the code
/// object its first line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameCodeLayout {
    /// Offset of the code word (`f_code`, `f_executable`) in a frame.
    pub(crate) word: u64,
    /// Tag bits of that word (3.14+ keep a tagged reference there).
    pub(crate) tag_mask: u64,
    /// Offset of `co_firstlineno` (an int) in a code object.
    pub first_line: u64,
}

/// The Python stack of one thread state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadStack {
    /// The kernel tid, as pyprobe sees it (outside the target's PID namespace); `None`
    /// when the version does not record it and it could not be found.
    pub native_tid: Option<i32>,
    /// `threading.get_ident()`: the thread's `pthread_t`.
    pub thread_id: u64,
    /// Address of the `PyThreadState`.
    pub thread_state: u64,
    /// Outermost first (`<module>` first, the running function last).
    pub frames: Vec<PyFrame>,
    /// The walk stopped early: unreadable or corrupt memory (often: the thread ran
    /// while being read), a cycle, or more than 1024 frames.
    pub truncated: bool,
    /// Read with the thread running ([`Walker::stacks_at_tick`], `running`), and its
    /// innermost frame changed under the walk: the frames may not be one stack.
    pub torn: bool,
    /// How many of `frames` each call of the eval loop runs, outermost first, where
    /// the stack shows it (3.11: the frame marked `is_entry`; 3.12+: the entry shim
    /// each call pushes, a call just entered running none); `None` elsewhere. 3.7 –
    /// 3.10 run one frame per call.
    pub eval_calls: Option<Vec<usize>>,
    /// Whether this thread held the GIL when the stacks were read; `None` when that
    /// cannot be told (no GIL offsets for this version, a free-threaded build, or
    /// unreadable).
    pub holds_gil: Option<bool>,
    /// The thread has not run since the last tick it was read at: these are the
    /// frames read then ([`Walker::stacks_at_tick`]).
    pub kept: bool,
}

/// The (frame, code object) addresses of one thread's frames, outermost first.
type FrameAddresses = Vec<(u64, u64)>;

/// How many times a torn walk is made again at once ([`Walker::stacks_at_tick`], `running`).
const TORN_RETRIES: usize = 2;

/// Reads the Python stacks of one process. See the module documentation.
pub struct Walker {
    pid: i32,
    version: PyVersion,
    version_from: &'static str,
    interpreter_path: String,
    layout_source: LayoutSource,
    reader: StackReader<ProcessMemory>,
    tids: Tids,
    /// Where the target's threads find their own thread state, or why not.
    current: std::result::Result<pyprobe_sdt::ring::CurrentThreadState, String>,
    /// asyncio's task layout (3.14+), once found.
    tasks: Option<tasks::TaskLayout>,
    /// When it was last looked for (asyncio may be imported later).
    tasks_looked_for: Option<std::time::Instant>,
    /// The nodes of each list of asyncio tasks (by its head) at the last look,
    /// read again in one go next time.
    task_lists: std::collections::HashMap<u64, Vec<u64>>,
    /// Task names read (and whether the program gave them), by task and name object.
    task_names: std::collections::HashMap<(u64, u64), (String, bool)>,
    /// Where asyncio's C task keeps its coroutine and awaiters before 3.14.
    legacy_tasks: Option<legacy_tasks::LegacyTasks>,
    /// asyncio's registry of tasks before 3.14, once found, and when it was
    /// last looked for.
    legacy_registry: Option<legacy_registry::LegacyRegistry>,
    legacy_registry_looked_for: Option<std::time::Instant>,
    /// The short names of the types `legacy_tasks` met, by type address.
    legacy_type_names: std::cell::RefCell<std::collections::HashMap<u64, Option<String>>>,
    /// Whether each method definition `legacy_tasks` met is `task_wakeup`.
    legacy_wakeups: std::cell::RefCell<std::collections::HashMap<u64, bool>>,
    /// Where instances of Python classes keep their attributes (3.7 to 3.15).
    instances: Option<instances::InstanceLayout>,
    /// 3.14+: a thread was seen running one of asyncio's pure-Python tasks,
    /// which cannot be listed there.
    pure_python_tasks_seen: bool,
    /// The stacks read at the last sampling tick, for threads still at the next.
    kept_stacks: still::KeptStacks,
    /// The `tp_basicsize` and `tp_dictoffset` of the types `instances` met.
    instance_types: std::cell::RefCell<std::collections::HashMap<u64, Option<(u64, u64)>>>,
    /// The attribute names `instances` read, by address.
    attribute_names: std::cell::RefCell<std::collections::HashMap<u64, Option<Arc<str>>>>,
}

impl Walker {
    /// Finds the interpreter in `pid`, its version and its structure layout. Reads only:
    /// no ptrace, nothing stopped or written.
    pub fn attach(pid: i32) -> Result<Walker> {
        let status = pyprobe_sdt::process::status::check_inspectable(pid)?;
        let mem = ProcessMemory::new(pid);
        let found = locate::locate(pid, &mem)?;
        // The runtime must be readable now, or nothing will be.
        if let Err(e) =
            pyprobe_sdt::sdt::MemoryReader::read_exact(&mem, found.runtime, &mut [0u8; 8])
        {
            let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                " (reading another process's memory needs its user or CAP_SYS_PTRACE, and a \
                 /proc/sys/kernel/yama/ptrace_scope that allows it)"
            } else {
                ""
            };
            anyhow::bail!(
                "cannot read _PyRuntime of process {pid} in {}: {e}{hint}",
                found.object.target_path
            );
        }
        let version = found.version;
        let (layout, layout_source) = if layout::uses_debug_offsets(version) {
            layout::from_debug_offsets(&mem, found.runtime, version).with_context(|| {
                format!(
                    "python {version} in {}: cannot use its _Py_DebugOffsets",
                    found.object.target_path
                )
            })?
        } else {
            layout::from_offsets_file(version)?
        };
        let symbol = |name| {
            found
                .object
                .elf
                .symbols
                .address(name)
                .map(|a| found.object.runtime(a))
        };
        let code_type = symbol("PyCode_Type");
        let current = current::current_thread_state(&found.object, &mem);
        // The shim each call of the eval loop pushes holds `None` as its code from
        // 3.13, the interpreter's trampoline code object on 3.12.
        let root_shim = if version.at_least(3, 13) {
            symbol("_Py_NoneStruct").map_or(RootShim::Unchecked, RootShim::Object)
        } else if version.at_least(3, 12) {
            RootShim::CodeObject
        } else {
            RootShim::Unchecked
        };
        let mut reader = StackReader::new(mem, layout, found.runtime, code_type);
        reader.set_root_shim(root_shim);
        reader.thread_states().with_context(|| {
            format!(
                "cannot read the thread states of process {pid} (_PyRuntime at {:#x})",
                found.runtime
            )
        })?;
        Ok(Walker {
            pid,
            version,
            version_from: found.version_from,
            interpreter_path: found.object.target_path.clone(),
            layout_source,
            reader,
            tids: Tids::new(pid, status.inner_pid().is_some()),
            current,
            tasks: None,
            tasks_looked_for: None,
            task_lists: std::collections::HashMap::new(),
            task_names: std::collections::HashMap::new(),
            legacy_tasks: (version.major == 3)
                .then(|| legacy_tasks::LegacyTasks::of(version.minor))
                .flatten(),
            legacy_registry: None,
            legacy_registry_looked_for: None,
            legacy_type_names: Default::default(),
            legacy_wakeups: Default::default(),
            pure_python_tasks_seen: false,
            instances: (version.major == 3)
                .then(|| instances::InstanceLayout::of(version.minor))
                .flatten(),
            instance_types: Default::default(),
            kept_stacks: Default::default(),
            attribute_names: Default::default(),
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The interpreter's version (micro version when the target records it: 3.11+).
    pub fn version(&self) -> PyVersion {
        self.version
    }

    /// The mapped file that carries the interpreter (`_PyRuntime`), as the target sees it.
    pub fn interpreter_path(&self) -> &str {
        &self.interpreter_path
    }

    /// Where the structure layout came from: an offsets table or `_Py_DebugOffsets`.
    pub fn layout_source(&self) -> &LayoutSource {
        &self.layout_source
    }

    /// One line for messages: version, where it was found, how the layout was obtained.
    pub fn describe(&self) -> String {
        format!(
            "python {} in {} (version from {}); layout: {}",
            self.version, self.interpreter_path, self.version_from, self.layout_source
        )
    }

    /// The Python stack of every thread state of every interpreter, main thread first.
    /// Fails only when `_PyRuntime` cannot be read (e.g. the process is gone); a thread
    /// whose stack cannot be read whole comes back [`truncated`](ThreadStack::truncated).
    pub fn stacks(&mut self) -> Result<Vec<ThreadStack>> {
        self.read_stacks(false, None)
    }

    /// As [`Self::stacks`], at a sampling tick: a thread still since a tick at or
    /// before the last one it was read at is not walked again (see [`TickStill`]).
    /// With `running`, of threads that may run while they are read: each stack
    /// says whether its thread ran under the walk ([`ThreadStack::torn`]).
    pub fn stacks_at_tick(&mut self, running: bool, at: TickStill) -> Result<Vec<ThreadStack>> {
        let stacks = self.read_stacks(running, Some(&at))?;
        self.kept_stacks.keep(at.tick, &stacks);
        Ok(stacks)
    }

    fn read_stacks(&mut self, running: bool, at: Option<&TickStill>) -> Result<Vec<ThreadStack>> {
        // One moment's walk: each code object is checked once in it.
        self.reader.new_naming_batch();
        let tstates = self
            .reader
            .thread_states()
            .with_context(|| format!("cannot read the thread states of process {}", self.pid))?;
        let holders = self.reader.gil_holders();
        let raws: Vec<RawThread> = tstates
            .iter()
            .map(|(t, buf)| {
                at.and_then(|at| {
                    let thread_id = self.reader.thread_id_of(buf);
                    let mut raw = self.kept_stacks.still(*t, thread_id, at)?;
                    raw.native_id = self.reader.native_id_of(buf);
                    Some(raw)
                })
                .unwrap_or_else(|| self.thread_walked(*t, buf, running))
            })
            .collect();
        Ok(self.resolve(raws, holders.as_deref()))
    }

    /// The thread at `tstate` (its state's bytes `buf`), walked; a walk torn while
    /// it ran (not cut short) is made again from its state read anew, up to
    /// [`TORN_RETRIES`] times. Up to 3.10, whose frames are read one at a time, a
    /// deep recursion tears most first reads; dropped, those samples would leave
    /// out the code that moves fastest.
    fn thread_walked(&mut self, tstate: u64, buf: &[u8], running: bool) -> RawThread {
        let mut raw = self.reader.thread(tstate, buf, running);
        let mut fresh = vec![0u8; buf.len()];
        for _ in 0..TORN_RETRIES {
            if !raw.torn || raw.truncated {
                break;
            }
            if pyprobe_sdt::sdt::MemoryReader::read_exact(&self.reader.mem, tstate, &mut fresh)
                .is_err()
            {
                break;
            }
            raw = self.reader.thread(tstate, &fresh, running);
        }
        raw
    }

    /// As [`Self::stacks`], with each frame's local variables (outermost first, as
    /// the frames): read so only with the threads held, for values that belong
    /// together. Empty lists when this version's layout does not say where locals are
    /// ([`Self::reads_locals`]).
    pub fn stacks_with_locals(&mut self) -> Result<Vec<(ThreadStack, Vec<Vec<Local>>)>> {
        let (stacks, frames) = self.walk_keeping_frames(false)?;
        let mut names = locals::LocalNamesCache::new();
        let reader = &self.reader;
        Ok(stacks
            .into_iter()
            .zip(frames)
            .map(|(stack, frames)| {
                let locals = frames
                    .iter()
                    .map(|&(frame, code)| reader.frame_locals(frame, code, &mut names))
                    .collect();
                (stack, locals)
            })
            .collect())
    }

    /// As [`Self::stacks`] (`running`: read running, as by [`Self::stacks_at_tick`]), with the
    /// address of each frame and of its code object, outermost first as the frames.
    fn walk_keeping_frames(
        &mut self,
        running: bool,
    ) -> Result<(Vec<ThreadStack>, Vec<FrameAddresses>)> {
        // One moment's walk: each code object is checked once in it.
        self.reader.new_naming_batch();
        let tstates = self
            .reader
            .thread_states()
            .with_context(|| format!("cannot read the thread states of process {}", self.pid))?;
        let holders = self.reader.gil_holders();
        self.reader.frame_addresses = Some(Vec::new());
        let mut raws = Vec::with_capacity(tstates.len());
        let mut frames = Vec::with_capacity(tstates.len());
        for (t, buf) in &tstates {
            // A thread without a frame walks none: no addresses left from the last.
            if let Some(kept) = self.reader.frame_addresses.as_mut() {
                kept.clear();
            }
            raws.push(self.reader.thread(*t, buf, running));
            // One address pair per frame the walk returned, in the same order.
            frames.push(self.reader.frame_addresses.clone().unwrap_or_default());
        }
        self.reader.frame_addresses = None;
        Ok((self.resolve(raws, holders.as_deref()), frames))
    }

    /// Whether this version's layout says where a frame's local variables are.
    pub fn reads_locals(&self) -> bool {
        self.reader.layout.locals.is_some()
    }

    /// The Python stack of the thread with kernel tid `native_tid` (as pyprobe sees it),
    /// reading only that thread's frames; `None` when no thread state has that tid.
    pub fn thread_stack(&mut self, native_tid: i32) -> Result<Option<ThreadStack>> {
        // One moment's walk: each code object is checked once in it.
        self.reader.new_naming_batch();
        let tstates = self
            .reader
            .thread_states()
            .with_context(|| format!("cannot read the thread states of process {}", self.pid))?;
        let headers: Vec<(RawThread, Option<u64>)> = tstates
            .iter()
            .map(|(t, buf)| self.reader.thread_header(*t, buf))
            .collect();
        let tids = self.native_tids(&headers.iter().map(|(r, _)| r).collect::<Vec<_>>());
        let Some(index) = tids.iter().position(|&t| t == Some(native_tid)) else {
            return Ok(None);
        };
        let holders = self.reader.gil_holders();
        let Some((mut raw, frame)) = headers.into_iter().nth(index) else {
            return Ok(None);
        };
        if let Some(frame) = frame {
            (raw.frames, raw.truncated) = self.reader.frames(frame);
            raw.eval_calls = self.reader.last_eval_calls();
        }
        Ok(Some(ThreadStack {
            native_tid: Some(native_tid),
            eval_calls: raw.eval_calls,
            thread_id: raw.thread_id,
            thread_state: raw.thread_state,
            holds_gil: holders.map(|h| h.contains(&raw.thread_state)),
            frames: raw.frames,
            truncated: raw.truncated,
            torn: raw.torn,
            kept: false,
        }))
    }

    /// Offsets of `co_name`, `co_filename` and `co_firstlineno` (an int) in a code
    /// object of this interpreter.
    pub(crate) fn code_field_offsets(&self) -> [u64; 3] {
        let l = &self.reader.layout;
        [l.code_name, l.code_filename, l.code_firstlineno]
    }

    /// Offset of `co_qualname` in a code object (3.11+; `None` before, where a
    /// frame's name is its `co_name`).
    pub(crate) fn code_qualname_offset(&self) -> Option<u64> {
        self.reader.layout.code_qualname
    }

    /// A frame named from a code object's parts read when it ran (its `co_name` and
    /// `co_filename` str objects and first line), for a code object that may be gone
    /// since; `None` when they are not readable strs, or hold what no code object's
    /// name or file holds (freed memory partly written over since: its header can
    /// still match what the hook saw while its text does not).
    pub(crate) fn name_code_parts(
        &self,
        name: u64,
        filename: u64,
        first_line: u32,
    ) -> Option<PyFrame> {
        let name = self.read_str(name).filter(|n| plausible_code_name(n))?;
        let file = self
            .read_str(filename)
            .filter(|f| !f.is_empty() && !f.chars().any(char::is_control))?;
        Some(PyFrame {
            file,
            function: name.clone(),
            name,
            first_line,
            line: first_line,
        })
    }

    /// The text of the `str` object at `addr`; `None` when it is not a readable one.
    pub(crate) fn read_str(&self, addr: u64) -> Option<Arc<str>> {
        let u = &self.reader.layout.unicode;
        objects::read_str(&self.reader.mem, u, addr)
            .ok()
            .map(Arc::from)
    }

    /// How many subinterpreters the process has made since it started (one read).
    pub(crate) fn subinterpreters_made(&self) -> Option<u64> {
        self.reader.subinterpreters_made()
    }

    /// The address of the main interpreter's state (the first made, last in the
    /// list); `None` unless the whole list could be read (the last of a cut
    /// list is not the main one).
    pub fn main_interpreter(&mut self) -> Option<u64> {
        match self.reader.interpreters().ok()? {
            (list, true) => list.last().map(|&(interp, _)| interp),
            (_, false) => None,
        }
    }

    /// The address of every thread state of every interpreter (the hook engine raises
    /// their eval breakers).
    pub(crate) fn thread_state_addrs(&mut self) -> Result<Vec<u64>> {
        let tstates = self
            .reader
            .thread_states()
            .with_context(|| format!("cannot read the thread states of process {}", self.pid))?;
        Ok(tstates.into_iter().map(|(t, _)| t).collect())
    }

    /// Names a stack captured in the target by a ring trampoline (see
    /// [`StackReader::name_captured`]): outermost first, `None` for a frame whose
    /// code object pyprobe never read before it was freed.
    pub fn name_captured(&mut self, captured: &[(u64, u64)]) -> Vec<Option<PyFrame>> {
        self.reader.name_captured(captured)
    }

    /// The code object the interpreter frame at `frame` runs (3.11+): its address
    /// and its file, `co_name` and first line (see [`StackReader::frame_code`]).
    /// Everything read is checked as on a walk; `None` when it does not hold.
    pub fn frame_code(&mut self, frame: u64) -> Option<(u64, PyFrame)> {
        self.reader.frame_code(frame)
    }

    /// The code object whose frame's code word is `word` (as read from the frame,
    /// tag bits and all): its address, file, `co_name` and first line. `None` when
    /// it does not hold, or on versions whose frames are objects.
    pub fn code_of_word(&mut self, word: u64) -> Option<(u64, PyFrame)> {
        let (_, tag_mask) = self.reader.frame_code_word()?;
        self.reader.code_named(word & !tag_mask)
    }

    /// Whether the interpreter is a free-threaded build (3.13+, as its
    /// `_Py_DebugOffsets` says).
    pub(crate) fn free_threaded(&self) -> bool {
        self.reader.layout.free_threaded
    }

    /// The code object at `code` named from one read, if it still has the
    /// `co_name` and `co_filename` pointers and first line a record saw (see
    /// [`StackReader::code_named_as`]).
    pub(crate) fn code_named_as(&mut self, code: u64, parts: [u64; 3]) -> Option<PyFrame> {
        self.reader.code_named_as(code, parts)
    }

    /// Where an interpreter frame (3.11+) keeps its code word: its offset in the
    /// frame, the tag bits in it, and where the code object keeps its first line.
    pub fn frame_code_layout(&self) -> Option<FrameCodeLayout> {
        let (word, tag_mask) = self.reader.frame_code_word()?;
        Some(FrameCodeLayout {
            word,
            tag_mask,
            first_line: self.reader.layout.code_firstlineno,
        })
    }

    /// Whether code object `code`, just named by [`Self::frame_code`], has an
    /// instruction at `line`; `None` when that cannot be told.
    pub fn code_has_line(&self, code: u64, line: u32) -> Option<bool> {
        self.reader.code_has_line(code, line)
    }

    /// Starts a new batch of captured stacks (see [`StackReader::new_naming_batch`]).
    pub fn new_naming_batch(&mut self) {
        self.reader.new_naming_batch()
    }

    /// The offsets a ring trampoline walks this interpreter's frames by: the same
    /// layout this walker reads with. `Err` says why the trampolines cannot.
    pub fn stack_capture(&self, slots: u8) -> std::result::Result<StackCapture, String> {
        let current = self.current.clone()?;
        capture_of(&self.reader.layout, current, slots)
    }

    fn native_tids(&mut self, raws: &[&RawThread]) -> Vec<Option<i32>> {
        self.tids.begin_round();
        let inner: Vec<Option<i32>> = if self.reader.layout.tstate_native_thread_id.is_some() {
            raws.iter().map(|r| r.native_id).collect()
        } else {
            let pthreads: Vec<u64> = raws.iter().map(|r| r.thread_id).collect();
            self.tids.inner_of_pthreads(&self.reader.mem, &pthreads)
        };
        inner
            .into_iter()
            .map(|t| t.and_then(|t| self.tids.outer(t)))
            .collect()
    }

    fn resolve(&mut self, raws: Vec<RawThread>, gil_holders: Option<&[u64]>) -> Vec<ThreadStack> {
        let tids = self.native_tids(&raws.iter().collect::<Vec<_>>());
        raws.into_iter()
            .zip(tids)
            .map(|(raw, native_tid)| ThreadStack {
                native_tid,
                thread_id: raw.thread_id,
                thread_state: raw.thread_state,
                holds_gil: gil_holders.map(|h| h.contains(&raw.thread_state)),
                frames: raw.frames,
                truncated: raw.truncated,
                torn: raw.torn,
                eval_calls: raw.eval_calls,
                kept: raw.kept,
            })
            .collect()
    }
}

/// The offsets of `layout` as a ring stack capture, the thread state read from
/// `current`.
pub(crate) fn capture_of(
    layout: &Layout,
    current: pyprobe_sdt::ring::CurrentThreadState,
    slots: u8,
) -> std::result::Result<StackCapture, String> {
    let root = match layout.tstate_frame {
        FrameRoot::Direct(o) => StackRoot::Direct(o),
        FrameRoot::CFrame {
            cframe,
            current_frame,
        } => StackRoot::Indirect {
            pointer: cframe,
            field: current_frame,
        },
    };
    let frame = match layout.frame {
        FrameLayout::Object {
            back, code, lasti, ..
        } => StackFrame {
            back,
            code,
            position: lasti,
            position_size: 4,
            owner: None,
            code_tag_mask: 0,
        },
        FrameLayout::Interpreter { tlbc: Some(_), .. } => {
            // Not built for: positions there index per-thread copies of the
            // bytecode, and nothing tests captures on such a build.
            return Err("stack capture in the target is not built for free-threaded builds".into());
        }
        FrameLayout::Interpreter {
            previous,
            executable,
            instr_ptr,
            owner,
            first_shim_owner,
            tag_mask,
            tlbc: None,
            // The trampolines' stack capture needs no call boundaries.
            entry_flag: _,
        } => StackFrame {
            back: previous,
            code: executable,
            position: instr_ptr,
            position_size: 8,
            owner: first_shim_owner.map(|first| (owner, first)),
            code_tag_mask: tag_mask,
        },
    };
    Ok(StackCapture {
        current,
        tstate_thread_id: layout.tstate_thread_id,
        root,
        frame,
        slots,
    })
}

/// The walker moves to whatever thread samples.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Walker>();
};
