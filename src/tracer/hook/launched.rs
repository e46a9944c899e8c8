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

use std::time::{Duration, Instant};

use crate::process::memory::ProcessMemory;
use crate::python::walker::Walker;
use crate::tracer::engine::{at_syscall_entry, Engine, TraceEvent};

/// A launched interpreter is looked for this often while it runs.
const AWAIT_EVERY: Duration = Duration::from_millis(1);
/// A walker is attached at most this often while attaching fails (the runtime may
/// not be readable yet).
const ATTACH_EVERY: Duration = Duration::from_millis(1);

/// A launched process whose hook waits for its interpreter.
pub(in crate::tracer) struct Awaiting {
    /// The next look while the target runs.
    next_look: Instant,
    /// The next try to attach a walker, while `walker` is `None`.
    next_attach: Instant,
    walker: Option<Walker>,
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
    fn started(&mut self, pid: i32) -> bool {
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

impl Engine {
    /// Whether the threads of `tgid` stop at system calls: its hook awaits its
    /// interpreter.
    pub(in crate::tracer) fn hook_awaits(&self, tgid: i32) -> bool {
        self.hook_book.awaiting.contains_key(&tgid)
    }

    /// `tid` is held at a system-call stop (`holding`: while every thread is being
    /// stopped, which installing would nest in; the next stop does it). At an exit
    /// stop of a process whose hook awaits a thread state that now exists, with
    /// every thread of it held: the hook goes in now.
    pub(in crate::tracer) fn hook_at_syscall(
        &mut self,
        tid: i32,
        holding: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(pid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return;
        };
        if holding || !self.hook_awaits(pid) || at_syscall_entry(tid) {
            return;
        }
        // Other threads running (an embedding program's own): the look while the
        // target runs stops them all first.
        if !self.all_threads_held(pid) {
            return;
        }
        let started = self
            .hook_book
            .awaiting
            .get_mut(&pid)
            .is_some_and(|a| a.started(pid));
        if !started {
            return;
        }
        let walker = self.hook_book.awaiting.remove(&pid).and_then(|a| a.walker);
        if let Err(e) = self.hook_install_at_clean_thread(pid, walker, sink) {
            self.hook_failed(pid, e, sink);
        }
    }

    /// Launched processes, while they run: once the interpreter has a thread state,
    /// every thread is stopped and the hook installed. The installer runs only from
    /// the eval loop, at the next check of the breaker.
    pub(super) fn hook_await(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        let now = Instant::now();
        let due: Vec<i32> = self
            .hook_book
            .awaiting
            .iter()
            .filter(|(_, a)| a.next_look <= now)
            .map(|(&p, _)| p)
            .collect();
        for pid in due {
            let Some(awaiting) = self.hook_book.awaiting.get_mut(&pid) else {
                continue;
            };
            if !awaiting.started(pid) {
                awaiting.next_look = now + AWAIT_EVERY;
                continue;
            }
            let walker = self.hook_book.awaiting.remove(&pid).and_then(|a| a.walker);
            let result = self
                .stop_all_running(sink)
                .and_then(|()| self.hook_install_at_clean_thread(pid, walker, sink));
            self.resume_all();
            if let Err(e) = result {
                self.hook_failed(pid, e, sink);
            }
        }
    }

    /// Installs the hook of `pid` (every thread of it held) through a thread at a
    /// stop where system calls can be injected, with the walker that saw it ready.
    fn hook_install_at_clean_thread(
        &mut self,
        pid: i32,
        walker: Option<Walker>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> anyhow::Result<()> {
        match self.clean_thread(pid, sink) {
            Some(tid) => self.hook_install(pid, tid, walker, sink),
            None => anyhow::bail!("no thread of it is at a stop where the hook can be put in"),
        }
    }
}
