//! The injected hook engine's pure core: exact Python calls and returns on a CPython
//! with no function probes, through the interpreter's own public API.
//!
//! pyprobe writes one code page (the *hook*, built here per target) and one state
//! page into the target, next to a ring in the format of [`pyprobe_sdt::ring::format`].
//! Two routes ([`Route`]): on CPython 3.12+ the interpreter runs the hook's
//! *installer* at a safe point with the GIL held; the installer registers the hook's
//! callbacks with `sys.monitoring` under a tool id of pyprobe's own; from then on the
//! interpreter calls them at every Python function start, resume, return, yield,
//! throw and unwind. On 3.7 to 3.11 the hook has one callback, a C profile function
//! (`Py_tracefunc`: calls, and returns with the value or NULL for an exception), which
//! pyprobe sets in each thread state itself (`hook_engine::profile`); there is no
//! installer. Either way each event writes one ring record. The engine's side
//! (mapping, placing, the safe point, naming code objects, leaving) is `hook_engine`.
//!
//! # What the hook page holds ([`build_hook`])
//!
//! * Constants: the C strings the installer passes to the C API, and six
//!   `PyMethodDef`s (`METH_FASTCALL`), one per monitoring event, whose `ml_meth`
//!   points at a callback below. The page is an ordinary private mapping: a forked
//!   child keeps it, and the function objects made from these definitions stay valid.
//! * The callbacks, `PyObject *cb(PyObject *self, PyObject *const *args, Py_ssize_t n)`.
//!   Each loads the state word `on`; when set, and when called as the interpreter
//!   calls it (`n >= 2`, `args[0]` an object of type `PyCode_Type`: a program can
//!   fetch the callback with `register_callback` and call it with anything, and
//!   gets `None` then, nothing recorded), it writes the event as compact units
//!   ([`units`]: one unit of 16 bytes, {kind, `rdtsc`; the code object}, after
//!   the thread's `%fs` base, the returned type and the code object's parts only
//!   when they differ from what it sent last), each reserved with the ring's
//!   producer protocol, the very code the SDT trampolines run
//!   (`pyprobe_sdt::ring::codegen::emit_reserve`: a full ring is waited on while pyprobe
//!   serves it, spinning then asleep in `futex` on `tail`, so the target runs at
//!   pyprobe's pace rather than lose calls; without `lock` while the process has
//!   one thread, as for the SDT ring), publishes each by its first word, stored
//!   last, and returns `None` (immortal on 3.12+, so no reference is taken).
//!   No allocation, no C API call on this path; a system call only while
//!   the ring is full.
//! * The installer: `PySys_GetObject("monitoring")`, `use_tool_id(TOOL, "pyprobe")`,
//!   (events are passed as their `sys.monitoring.events` bit, `1 << number`),
//!   one `PyCFunction_NewEx` and `register_callback` per event, `set_events`; its
//!   outcome in the state word `status` ([`STATUS_OK`], or [`STATUS_FAILED`] + the
//!   step). On a failure after the tool id was taken it gives the id back.
//! * The exit callback (`METH_NOARGS`), which the installer also registers with
//!   `atexit` (not fatal if that fails): when the interpreter ends, before it
//!   frees modules, functions and their code objects, it waits (asleep, 1 ms at a
//!   time, the GIL held) until pyprobe has read every record written so far, so
//!   that pyprobe names the code objects of a short program while they still
//!   exist. It returns at once when `on` is clear, when nobody serves the ring
//!   (`alive` 0, heartbeat stale) and after [`AT_EXIT_WAIT_MS`].
//! * The profile function (3.7 to 3.11) writes the same record; C-function events are
//!   ignored; it returns 0. When it finds `on` clear it first clears its own
//!   thread's `c_profilefunc` (the interpreter recomputes `use_tracing` as the
//!   tracing call returns), so each thread drops the hook at its own next event.
//! * The uninstaller: only while `get_tool(TOOL)` is still the string "pyprobe" (a
//!   program that freed the id and took it for itself keeps it, untouched):
//!   `register_callback(TOOL, ev, None)` for each event, putting back any callback
//!   that is not pyprobe's own function (a builtin made from this page's
//!   definition); then, when every one was pyprobe's, `set_events(TOOL, 0)` and
//!   `free_tool_id(TOOL)`. Always `atexit.unregister` of the exit callback and
//!   `PyErr_Clear()`. A callback runs it, once
//!   (`lock cmpxchg` on the state word `gone`), when it finds `on` clear: pyprobe
//!   cleared it to detach, the guardian cleared it because pyprobe died, or the
//!   process is a forked child (the state page is `MADV_WIPEONFORK`: all zero there).
//!   A monitoring callback runs with the GIL held at a point where any Python code may
//!   run (callbacks are Python callables in general), so calling `sys.monitoring` from
//!   it is as safe as a Python tool doing so from its own callback.
//! * The detour: what the safe point's function entry jumps to (see below). It saves
//!   the argument registers, and on a thread of the main interpreter (a hook in a
//!   subinterpreter would see none of the program's calls and die with it) runs
//!   the installer once (`lock cmpxchg` on `armed`, 1 → 2), restores them, runs
//!   the instructions the jump displaced (relocated) and jumps back behind them.
//!
//! # The safe point
//!
//! `_Py_HandlePending(tstate)` (CPython 3.12 to 3.15): the eval loop calls it, with
//! the GIL held and the frame's state saved, when the eval breaker is set; it runs
//! signal handlers and pending calls there, i.e. arbitrary Python code. So at its entry
//! any C API call is allowed, as in a pending call: no allocator or lock is half-taken
//! by this thread. pyprobe (every thread stopped) rewrites its first instructions into
//! a `jmp rel32` to the detour and raises the eval breaker (3.12: the interpreter's
//! `ceval.eval_breaker`, recomputed by the handler; 3.13 to 3.15: the `_PY_CALLS_TO_DO` bit of
//! each thread state's `eval_breaker`, cleared by the handler when no call is queued);
//! the next thread to check the breaker installs the hook. (3.12 recomputes its
//! breaker whenever a thread takes the GIL: the interpreter's `pending.calls_to_do`
//! flag is raised too, which keeps it set until `_Py_HandlePending` runs and clears
//! it, finding no call queued.) The jump is put back by
//! pyprobe with every thread stopped as soon as the installer has run (threads inside
//! the detour finish it: the page is never unmapped).
//!
//! # State pages (private, `MADV_WIPEONFORK`; [`STATE_LEN`] bytes)
//!
//! | offset | field |
//! | --- | --- |
//! | [`ST_ON`] | 1: record; 0: uninstall at the next event |
//! | [`ST_ARMED`] | 1: the detour runs the installer (once: it sets 2) |
//! | [`ST_STATUS`] | 0 not run, [`STATUS_RUNNING`], [`STATUS_OK`], [`STATUS_FAILED`] + step, [`STATUS_REMOVED`] |
//! | [`ST_GONE`] | set by the callback that runs the uninstaller |
//! | [`ST_AT_EXIT`] | the exit callback's function object, while `atexit` holds it |
//! | [`ST_AT_EXIT_MODULE`] | the `atexit` module, to unregister it without an import |
//! | [`ST_AT_EXIT_RETRY`] | events until the next try to register the exit callback (0: none pending) |
//! | [`ST_AT_EXIT_TRIES`] | failed tries to register it |
//! | [`ST_CALLBACKS`] | the function objects registered, one per event (monitoring route) |
//! | [`ST_SCRATCH`] | where a callback builds a parts or body group |
//! | [`ST_LAST_THREAD`], [`ST_TYPES`], [`ST_SENT`] | what was sent to pyprobe ([`units`]): cleared at each attach |
//!
//! # The exit callback
//!
//! Registered with `atexit` by the installer, it holds the ending interpreter
//! (before finalization frees the code objects) until pyprobe has named what was
//! written. A program launched by pyprobe is hooked while the interpreter starts:
//! `import atexit` fails then (importlib is not set up yet), so the callbacks try
//! again every [`AT_EXIT_RETRY_EVENTS`] events, at most [`AT_EXIT_MAX_TRIES`] times.
//!
//! # If pyprobe stops reading
//!
//! A callback waits for room in a full ring (holding the GIL) as long as pyprobe
//! serves the ring: its `alive` word is set and its heartbeat younger than `stale`
//! (300 ms: a thread of pyprobe's that does nothing else beats it, so a slow or
//! starved pyprobe stays fresh and only a stopped or dead one goes stale). Once an
//! event is lost because nobody serves the ring (pyprobe left or paused, its
//! guardian cleared `alive` when it died or was stopped) or its heartbeat went stale,
//! the hook clears `on` itself and unregisters at the next event. So the worst a
//! vanished pyprobe costs the target is one wait of `stale`, then nothing.

pub(crate) mod codegen;
pub(crate) mod units;

#[cfg(test)]
mod tests_exec;

pub use codegen::{
    build_detour, build_hook, Detour, DetourCalls, HookCode, HookError, HookParams, HookSymbols,
    ProfileLayout, ResumeTest, Route,
};

/// The first bytes of every hook page, followed by the addresses of its state page
/// and its ring (a later pyprobe finds the three by it, see `hook_engine::reuse`).
pub(crate) const HOOK_MAGIC: &[u8; 8] = b"PYPRHOOK";
/// Offsets in the hook page of the state page's and the ring's address.
pub(crate) const HEADER_STATE: u64 = 8;
pub(crate) const HEADER_RING: u64 = 16;

/// `sys.monitoring` tool id pyprobe asks for (0-2 and 5 are named for debuggers,
/// coverage, profilers and optimizers; 3 and 4 are free for other tools).
pub(crate) const TOOL_ID: u32 = 4;

/// Record kinds (the ring slot's `probe` field).
pub(crate) const KIND_CALL: u32 = 0;
/// A return or yield: `args[1]` is the type of the returned object.
pub(crate) const KIND_RETURN: u32 = 1;
/// The frame was left by an exception (`args[1]` is 0).
pub(crate) const KIND_RAISE: u32 = 2;
/// A generator or coroutine entered again: resumed after a `yield` or an
/// `await`, or thrown into (a call is its first entry).
pub(crate) const KIND_RESUME: u32 = 3;

/// Whether records of `kind` enter a frame (a call or a resume).
pub(crate) fn enters(kind: u32) -> bool {
    matches!(kind, KIND_CALL | KIND_RESUME)
}

/// State page words.
pub(crate) const ST_ON: usize = 0;
pub(crate) const ST_ARMED: usize = 8;
pub(crate) const ST_STATUS: usize = 16;
pub(crate) const ST_GONE: usize = 24;
/// The function object registered with `atexit` (a reference the hook holds), 0
/// when none is.
pub(crate) const ST_AT_EXIT: usize = 32;
/// The `atexit` module (a reference the hook holds while [`ST_AT_EXIT`] is set).
pub(crate) const ST_AT_EXIT_MODULE: usize = 40;
/// Events until the next try to register the exit callback (0: none pending:
/// registered, or given up).
pub(crate) const ST_AT_EXIT_RETRY: usize = 48;
/// Failed tries to register the exit callback.
pub(crate) const ST_AT_EXIT_TRIES: usize = 56;
/// The monitoring route: the function object the installer registered for each
/// event, in the order of the route's events (one word each), so that pyprobe
/// can tell from outside whether the interpreter still holds them. (Bytes 64 to
/// 77 hold the name that marks the page as pyprobe's.)
pub(crate) const ST_CALLBACKS: usize = 128;
/// The scratch room a callback builds a parts or body group in (the callbacks
/// run one at a time: with the GIL held) before copying it into the ring.
pub(crate) const ST_SCRATCH: usize = 192;
/// What the callbacks sent pyprobe, from here to the state's end (see
/// [`units`]); pyprobe clears it at each attach, every thread stopped: a new
/// pyprobe has been sent nothing. The thread of the last event.
pub(crate) const ST_TABLES: usize = 448;
pub(crate) const ST_LAST_THREAD: usize = ST_TABLES;
/// The types table: [`units::TYPE_ENTRIES`] type objects.
pub(crate) const ST_TYPES: usize = 512;
/// The sent table, from the second page on: [`units::SENT_ENTRIES`] entries of
/// [`units::SENT_WORDS`] words (code object, name and file pointers, first line,
/// identity check).
pub(crate) const ST_SENT: usize = 4096;
/// Bytes of the state: whole pages, up to the sent table's end.
pub(crate) const STATE_LEN: usize = ST_SENT + 8 * units::SENT_WORDS * units::SENT_ENTRIES;
const _: () = assert!(ST_SCRATCH + units::GROUP_UNITS as usize * 16 <= ST_TABLES);
const _: () = assert!(ST_TYPES + 8 * units::TYPE_ENTRIES <= ST_SENT);
const _: () = assert!(STATE_LEN % 4096 == 0);
/// Events between two tries to register the exit callback.
pub(crate) const AT_EXIT_RETRY_EVENTS: u32 = 256;
/// Tries to register the exit callback before the hook gives up on it.
pub(crate) const AT_EXIT_MAX_TRIES: u32 = 64;
/// Most milliseconds the exit callback waits for pyprobe to read the ring (its
/// heartbeat going stale ends the wait sooner).
pub(crate) const AT_EXIT_WAIT_MS: u32 = 10_000;

pub(crate) const STATUS_OK: u64 = 1;
pub(crate) const STATUS_REMOVED: u64 = 2;
/// The installer has begun (it sets OK or FAILED + step when it ends).
pub(crate) const STATUS_RUNNING: u64 = 3;
pub(crate) const STATUS_FAILED: u64 = 0x100;

/// What the installer's failed steps were doing, by `status - STATUS_FAILED`.
pub(crate) fn failed_step(status: u64) -> Option<&'static str> {
    let step = status.checked_sub(STATUS_FAILED)?;
    Some(match step {
        1 => "sys.monitoring is missing",
        2 => "sys.monitoring tool id 4 is in use (another tool, or a pyprobe that died while the target was idle: it frees the id at the target's next Python call)",
        3 => "a callback object could not be created",
        4 => "sys.monitoring.register_callback failed",
        5 => "sys.monitoring.set_events failed",
        _ => "unknown step",
    })
}

/// Monitoring events the hook registers for, with the record kind of each, by the
/// event numbers of CPython 3.12 and 3.13 (`sys.monitoring.events`; the 3.14 numbers
/// were checked against its `sys.monitoring.events`, as these against theirs).
pub(crate) const EVENTS_312: [(u32, u32); 6] = [
    (0, KIND_CALL),    // PY_START
    (1, KIND_RESUME),  // PY_RESUME
    (13, KIND_RESUME), // PY_THROW
    (2, KIND_RETURN),  // PY_RETURN
    (3, KIND_RETURN),  // PY_YIELD
    (12, KIND_RAISE),  // PY_UNWIND
];

/// The same for CPython 3.14 and 3.15, whose `BRANCH_LEFT` and `BRANCH_RIGHT` (8 and
/// 9) moved `PY_UNWIND` and `PY_THROW` up by one (3.15's numbers checked against its
/// `sys.monitoring.events` too).
pub(crate) const EVENTS_314: [(u32, u32); 6] = [
    (0, KIND_CALL),    // PY_START
    (1, KIND_RESUME),  // PY_RESUME
    (14, KIND_RESUME), // PY_THROW
    (2, KIND_RETURN),  // PY_RETURN
    (3, KIND_RETURN),  // PY_YIELD
    (13, KIND_RAISE),  // PY_UNWIND
];

/// The monitoring events of CPython 3.`minor` (3.12 to 3.15), `None` for others.
pub(crate) fn events_of(minor: u32) -> Option<&'static [(u32, u32)]> {
    match minor {
        12 | 13 => Some(&EVENTS_312),
        14 | 15 => Some(&EVENTS_314),
        _ => None,
    }
}
