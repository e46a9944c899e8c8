//! A program pyprobe starts: its hook goes in before the program's own code runs.
//!
//! The interpreter is not initialised when its probes are installed (at exec, or once
//! libpython is mapped), so the hook waits for a thread state. Until it is in, the
//! process's threads stop at every system call (`PTRACE_SYSCALL`); at each exit stop
//! the thread states are looked for (a few reads through a walker attached once),
//! and the hook is installed there, the thread held. The interpreter makes system
//! calls between creating its thread state and running the script (finding and
//! reading it, at the least), so the script's first call is traced. While the
//! target runs, the thread states are also looked for every [`AWAIT_EVERY`]: the
//! way in for an interpreter that made no system call since.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::python::walker::Walker;
use pyprobe_sdt::process::memory::ProcessMemory;

/// A launched interpreter is looked for this often while it runs.
const AWAIT_EVERY: Duration = Duration::from_millis(1);
/// A walker is attached at most this often while attaching fails (the runtime may
/// not be readable yet).
const ATTACH_EVERY: Duration = Duration::from_millis(1);

/// A launched process whose hook waits for its interpreter.
pub(super) struct Awaiting {
    /// The next look while the target runs.
    next_look: Instant,
    /// The next try to attach a walker, while `walker` is `None`.
    next_attach: Instant,
    pub(super) walker: Option<Walker>,
}

impl Awaiting {
    pub(super) fn new() -> Awaiting {
        let now = Instant::now();
        Awaiting {
            next_look: now,
            next_attach: now,
            walker: None,
        }
    }

    /// Whether the interpreter is far enough into its start for the hook.
    pub(super) fn started(&mut self, pid: i32) -> bool {
        if self.walker.is_none() {
            let now = Instant::now();
            if now < self.next_attach {
                return false;
            }
            self.next_attach = now + ATTACH_EVERY;
            self.walker = Walker::attach(pid).ok();
        }
        let mem = ProcessMemory::new(pid);
        self.walker
            .as_mut()
            .is_some_and(|w| super::setup::ready(w, &mem))
    }
}

/// The awaited processes whose time to look has come and whose interpreter is
/// started far enough for the hook (the others looked at again later).
pub(super) fn due_ready(awaiting: &mut HashMap<i32, Awaiting>, now: Instant) -> Vec<i32> {
    let mut ready = Vec::new();
    for (&pid, a) in awaiting.iter_mut() {
        if a.next_look > now {
            continue;
        }
        if a.started(pid) {
            ready.push(pid);
        } else {
            a.next_look = now + AWAIT_EVERY;
        }
    }
    ready
}
