//! Which function a return belongs to, named by its code object.
//!
//! A return passes its function's file and name and the line it returns from:
//! two functions of one name in one file (two classes' `__init__`) are told apart
//! only by the line, and that line says nothing of the function's first line
//! when its entry passed none (CPython 3.15's functions with cells) or was never
//! seen (CPython 3.11 fires returns only). CPython 3.11+ keep the frame of the
//! function that returns in a register at the probe's site, which pyprobe records
//! as one more argument ([`FRAME_ARG`]): through the frame walker's layout the
//! frame names its code object, whose `co_firstlineno` is the function's first
//! line, the one the walker gives sampled frames.
//!
//! The frame is only a number until checked, and every read is the walker's
//! (bounded, checked, never a panic):
//! * the code object it runs must carry the file and name the probe passed, else
//!   the read says nothing; a process where no read ever names the probe's
//!   function (the register holds something else in that build) is given up after
//!   [`GIVE_UP_AFTER`] reads at `int3` stops (or [`GIVE_UP_LATE`] from the ring,
//!   whose reads often find the frame reused);
//! * a record read from the ring is read after the fact: the frame may hold
//!   another call by then (frames are reused at each depth), perhaps of a function
//!   of the same name. So the code object must also have an instruction at the
//!   line the return passed (distinct functions of one file do not share lines);
//!   at an `int3` stop the frame is the returning one, and that check is only made
//!   where it can be. From the ring, then, a read names the function only when the
//!   frame still runs it or was last used by it: often for functions called
//!   again and again, seldom for rare ones. Where the site also gives the frame's
//!   code word, read at the site ([`CODE_ARG`]: the ring's trampolines read it
//!   where the site's code proves that safe), the read is of the returning
//!   function's own code object, as good as one at a stop, unless it was freed
//!   since; then the first line read at the site ([`FIRST_LINE_ARG`]) answers,
//!   once the process's code words have been seen to name their functions;
//! * the answer is kept per (file, name, line returned from), which a function
//!   owns: one read per return site of a program, not per return. A site whose
//!   reads keep failing is tried [`MAX_TRIES`] times.
//!
//! When nothing holds, the return names no first line (0) and the replay keys it
//! as before: by the first lines known from the walker and from entries.

use rustc_hash::FxHashMap;

use pyprobe_cpython::python::tracing::{CODE_ARG, FIRST_LINE_ARG, FRAME_ARG};
use pyprobe_cpython::python::walker::Walker;
use pyprobe_recording::recording::{FrameRef, StrId};

/// Reads tried per (file, name, line) before it is left without first line.
const MAX_TRIES: u8 = 8;
/// Reads of a process's frames at `int3` stops that name another function than
/// the probe's, with none naming it, after which its frame argument is given up.
pub const GIVE_UP_AFTER: u64 = 64;
/// The same for reads of frames from ring records, which may be reused meanwhile.
pub const GIVE_UP_LATE: u64 = 4096;
/// Most (file, name, line) remembered; past it the memory starts over.
const MAX_KNOWN: usize = 1 << 20;

/// The line a probe passes for an instruction without location (-1).
const NO_LINE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
enum Known {
    Line(u32),
    Tried(u8),
}

/// What reads of one process's frames have shown.
#[derive(Debug, Default)]
struct Checks {
    /// Reads whose code object carried the probe's file and name.
    named: u64,
    /// Reads at `int3` stops, and from ring records, that found something else.
    misnamed: u64,
    misnamed_late: u64,
}

impl Checks {
    fn given_up(&self) -> bool {
        self.named == 0 && (self.misnamed >= GIVE_UP_AFTER || self.misnamed_late >= GIVE_UP_LATE)
    }
}

/// One return, as [`FirstLines::of_return`] needs it.
pub struct ReturnHit<'a> {
    pub pid: i32,
    /// Its arguments: file, name, line, and the frame when the site gives it.
    pub args: &'a [u64],
    pub file: &'a str,
    pub function: &'a str,
    /// Its file, name and line as recorded.
    pub frame: FrameRef,
    /// The thread is held at an `int3` stop for it (the frame is the returning one).
    pub stopped: bool,
}

/// First lines of returning functions; see the module documentation.
#[derive(Default)]
pub struct FirstLines {
    known: FxHashMap<(StrId, StrId, u32), Known>,
    checks: FxHashMap<i32, Checks>,
}

impl FirstLines {
    /// The first line of the function `hit` returns from, read through the walker
    /// of `hit.pid` (`walker` gives it, if there is one; asked only when a read is
    /// due); 0 when not known.
    pub fn of_return<'w>(
        &mut self,
        hit: &ReturnHit,
        walker: impl FnOnce() -> Option<&'w mut Walker>,
    ) -> u32 {
        let Some(&frame_ptr) = hit.args.get(FRAME_ARG) else {
            return 0;
        };
        // The code word read at the site names the returning function's code
        // object, however late it is read: as good as a read at a stop.
        let code_word = hit.args.get(CODE_ARG).copied();
        let exact = hit.stopped || code_word.is_some();
        let at = hit.frame;
        if at.line == NO_LINE {
            return 0;
        }
        let key = (at.file, at.function, at.line);
        let tries = match self.known.get(&key) {
            Some(Known::Line(first)) => return *first,
            Some(Known::Tried(n)) if *n >= MAX_TRIES => return 0,
            Some(Known::Tried(n)) => *n,
            None => 0,
        };
        let checks = self.checks.entry(hit.pid).or_default();
        if checks.given_up() {
            return 0;
        }
        let Some(walker) = walker() else {
            return 0;
        };
        let found = match code_word {
            Some(word) => walker.code_of_word(word),
            None => walker.frame_code(frame_ptr),
        };
        let named = found
            .as_ref()
            .filter(|(_, f)| &*f.file == hit.file && &*f.name == hit.function);
        let first = match named {
            // A code object named by a word read at the site may be gone since
            // (a class body's is freed once the class is made): not a sign of a
            // wrong register, so counted as a late read.
            None if hit.stopped => {
                checks.misnamed += 1;
                None
            }
            None => {
                checks.misnamed_late += 1;
                None
            }
            Some((code, f)) => {
                checks.named += 1;
                match walker.code_has_line(*code, at.line) {
                    Some(true) => Some(f.first_line),
                    None if exact => Some(f.first_line),
                    _ => None,
                }
            }
        };
        // The first line read at the site, once this process's code words have
        // been seen to name their functions.
        let at_site = hit
            .args
            .get(FIRST_LINE_ARG)
            .map(|&v| v as i32)
            .filter(|&l| l > 0 && checks.named > 0);
        let first = first.or(at_site.map(|l| l as u32));
        if self.known.len() >= MAX_KNOWN {
            self.known.clear();
        }
        match first.filter(|&l| l != 0) {
            Some(first) => {
                self.known.insert(key, Known::Line(first));
                first
            }
            None => {
                self.known.insert(key, Known::Tried(tries + 1));
                0
            }
        }
    }
}
