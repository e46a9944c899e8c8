//! The guardian: a small process, forked before any patching, that holds no ptrace
//! link to the target. The tracer tells it, through a pipe, every byte it is about
//! to patch and every semaphore it is about to raise, and what it has undone. If the
//! tracer dies without saying goodbye (SIGKILL, OOM kill), the pipe reaches
//! end-of-file and the guardian undoes everything through `/proc/PID/mem`:
//! semaphores first (CPython stops reaching the sites at once), then the bytes.
//!
//! A thread stopped at a hit when the tracer dies is resumed by the kernel past the
//! `int3` (rip = site + 1, after the replaced `nop`) with its SIGTRAP discarded, so it
//! is safe; the danger is a running thread reaching an `int3` after the kernel has
//! detached it and before the guardian has restored the byte: that is the window.
//!
//! Ring sites (a `jmp rel32` to a trampoline) come last, and not with the threads
//! running: a thread entering a site while its bytes change would run a torn jump,
//! whatever the order of the writes (see `ring`, "Restoring"). Left in place a jump
//! is harmless (its trampoline and ring stay mapped; a full ring only counts losses),
//! so the guardian stops every thread of the process with ptrace, now that the
//! tracer's link is gone, writes the original bytes, and lets them go. Where it
//! cannot stop them (another tracer, a thread that does not stop), the jumps stay,
//! and the next pyprobe recognises and takes them over.
//!
//! A thread running a system call pyprobe injected (see `inject`) has pyprobe's
//! registers until pyprobe puts its own back. The call goes through a spin loop
//! borrowed at the program's entry point, so a tracer dying meanwhile leaves the
//! thread spinning there, not running the program's code with foreign registers; the
//! guardian stops it, gives it the registers it was told, and puts the borrowed
//! bytes back.
//!
//! Here: the tracer's end of the link (what it tells the guardian). Beside it:
//! `vigil` (the guardian process: listening, then undoing), `undo` (what is undone
//! in one process, and how), `injection` (injected system calls), `stops`
//! (stopping a process's threads) and `watch` (pyprobe stopped while it holds
//! the target).

use std::fs::File;
use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use nix::unistd::{fork, pipe2, ForkResult};

mod injection;
#[cfg(test)]
mod tests;
mod undo;
mod vigil;
mod watch;

pub use injection::GuardianLink;
use undo::Undo;
use vigil::run_guardian;
use watch::{Control, Watch};

pub(super) const MSG_LEN: usize = 13;
/// Bytes of a ring site's original and patch in a [`Op::RingSiteArmed`] message.
const SITE_BYTES: usize = 24;
/// After the 13-byte head of [`Op::RingSiteArmed`]: length, original, patch.
const RING_PAYLOAD: usize = 1 + 2 * SITE_BYTES;
/// How long the guardian waits for the dead tracer's ptrace link to go and for
/// the target's threads to stop, before it leaves the ring jumps in place.
pub(super) const HOLD_LIMIT: Duration = Duration::from_secs(2);
/// Most words a [`Op::ToolSilenced`] message names (a callback per event, and the
/// tool's name).
pub(super) const TOOL_WORDS: usize = 24;
/// Its payload: how many words, the tool's bit, the bytes of `monitors` checked,
/// then each word's address and the value it must still hold.
pub(super) const TOOL_PAYLOAD: usize = 3 + 16 * TOOL_WORDS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// An `int3` is about to be written at `addr` (the original byte is a `nop`).
    SiteArmed = 1,
    SiteRestored = 2,
    /// A semaphore at `addr` is about to be raised by one.
    SemaphoreRaised = 3,
    SemaphoreLowered = 4,
    /// The process's image is gone (exec, exit): nothing of it to undo.
    Forget = 5,
    /// The tracer left cleanly: nothing to undo.
    Done = 6,
    /// A ring jump is about to be written at `addr` over the site's `int3`; the
    /// message goes on with the original bytes and the jump (see [`Guardian::tell_ring_site`]).
    /// `SiteRestored` ends it, `SiteArmed` makes it an `int3` site again.
    RingSiteArmed = 7,
    /// A system call is about to be injected in a thread through a spin loop written
    /// at `addr`; the message goes on with the thread, the bytes the loop replaces
    /// and the thread's registers (see [`GuardianLink::tell_injection`]).
    Injecting = 8,
    /// The injected call is over: the thread has its registers, `addr` its bytes.
    /// `addr` holds the thread id.
    Injected = 9,
    /// A ring is about to be served: `addr` is its `alive` word in the target. Should
    /// the tracer die, the guardian writes 0 there first, so that producers waiting
    /// for room in the ring stop waiting at once.
    RingServed = 10,
    /// The program turned off every event of pyprobe's `sys.monitoring` tool,
    /// leaving its callbacks: `addr` is the interpreter's `monitors` table; the
    /// message goes on with the words that hold the tool (see
    /// [`Guardian::tell_tool_silenced`]). Should the tracer die, the guardian frees
    /// the tool as pyprobe would when it leaves: the hook, never called again, cannot.
    ToolSilenced = 11,
}

/// The [`Op::ToolSilenced`] message (see [`Guardian::tell_tool_silenced`]).
pub(super) fn tool_silenced_message(
    pid: i32,
    monitors: u64,
    (tool, checked): (u8, u8),
    words: &[(u64, u64)],
) -> std::io::Result<[u8; MSG_LEN + TOOL_PAYLOAD]> {
    if words.is_empty() || words.len() > TOOL_WORDS || tool > 7 {
        return Err(std::io::Error::other(format!(
            "process {pid}: {} words of sys.monitoring tool {tool} do not fit the guardian's \
             message",
            words.len()
        )));
    }
    let mut msg = [0u8; MSG_LEN + TOOL_PAYLOAD];
    msg[0] = Op::ToolSilenced as u8;
    msg[1..5].copy_from_slice(&pid.to_le_bytes());
    msg[5..13].copy_from_slice(&monitors.to_le_bytes());
    msg[13] = words.len() as u8;
    msg[14] = tool;
    msg[15] = checked;
    for (k, &(addr, value)) in words.iter().enumerate() {
        let at = MSG_LEN + 3 + 16 * k;
        msg[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        msg[at + 8..at + 16].copy_from_slice(&value.to_le_bytes());
    }
    Ok(msg)
}

/// The tracer's end of the link.
pub struct Guardian {
    pipe: File,
    guardian_pid: i32,
    /// What pyprobe and the guardian say to each other about pyprobe being stopped
    /// (see `watch`).
    control: Control,
}

impl Guardian {
    /// Forks the guardian, which watches the calling thread (pyprobe's tracing
    /// thread). Call before the process creates threads: the child goes on running
    /// Rust code from a copy of a single-threaded process.
    pub(crate) fn spawn() -> Result<Guardian> {
        let (read_end, write_end) =
            pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("cannot create the guardian pipe")?;
        let control = Control::new().context("cannot map the guardian's control page")?;
        // SAFETY: getpid and gettid cannot fail.
        let tracer = unsafe { (libc::getpid(), libc::gettid()) };
        // SAFETY: pyprobe is single-threaded here (the guardian is started first).
        match unsafe { fork() }.context("cannot fork the guardian")? {
            ForkResult::Child => {
                drop(write_end);
                // A session of its own: whatever ends pyprobe's process group
                // (`kill -9 -PGID`, `timeout -s KILL`, a terminal's hang-up or Ctrl-Z)
                // does not end or stop the guardian with it.
                // SAFETY: setsid has no preconditions; a failure leaves it as it was.
                unsafe { libc::setsid() };
                let watch = Watch::new(tracer.0, tracer.1);
                let code = run_guardian(File::from(read_end), &control, watch);
                // SAFETY: leave without running the parent's destructors or atexit.
                unsafe { libc::_exit(code) }
            }
            ForkResult::Parent { child } => {
                drop(read_end);
                Ok(Guardian {
                    pipe: File::from(write_end),
                    guardian_pid: child.as_raw(),
                    control,
                })
            }
        }
    }

    /// Says whether pyprobe holds nothing of the target (paused, about to stop
    /// itself): the guardian leaves a paused pyprobe stopped.
    pub(crate) fn set_paused(&self, paused: bool) {
        self.control.set_paused(paused);
    }

    /// If the guardian found pyprobe stopped by a signal it cannot catch while it
    /// held the target, and continued it so that it lets go: how long it had been
    /// stopped (ms). Taken once.
    pub(crate) fn take_release(&self) -> Option<u64> {
        self.control.take_release()
    }

    /// Tells the guardian about one change. A failure to tell is returned: the caller
    /// must not patch what the guardian could not be told about.
    pub fn tell(&mut self, op: Op, pid: i32, addr: u64) -> std::io::Result<()> {
        let mut msg = [0u8; MSG_LEN];
        msg[0] = op as u8;
        msg[1..5].copy_from_slice(&pid.to_le_bytes());
        msg[5..13].copy_from_slice(&addr.to_le_bytes());
        self.pipe.write_all(&msg)
    }

    /// Tells the guardian that `patch` is about to replace `original` at the ring
    /// site `addr` (as [`Guardian::tell`]: a failure means do not patch).
    pub fn tell_ring_site(
        &mut self,
        pid: i32,
        addr: u64,
        original: &[u8],
        patch: &[u8],
    ) -> std::io::Result<()> {
        let len = original.len();
        if len == 0 || len > SITE_BYTES || patch.len() != len {
            return Err(std::io::Error::other(format!(
                "ring site {addr:#x} of process {pid}: {len} original and {} patch bytes \
                 do not fit the guardian's message",
                patch.len()
            )));
        }
        let mut msg = [0u8; MSG_LEN + RING_PAYLOAD];
        msg[0] = Op::RingSiteArmed as u8;
        msg[1..5].copy_from_slice(&pid.to_le_bytes());
        msg[5..13].copy_from_slice(&addr.to_le_bytes());
        msg[13] = len as u8;
        msg[14..14 + len].copy_from_slice(original);
        msg[14 + SITE_BYTES..14 + SITE_BYTES + len].copy_from_slice(patch);
        // One write of less than PIPE_BUF: the guardian reads it whole or not at all.
        self.pipe.write_all(&msg)
    }

    /// Tells the guardian that the program turned off every event of `sys.monitoring`
    /// tool `tool` in process `pid`, whose `monitors` table (a byte per event, a bit
    /// per tool) starts at `monitors`; `checked` of its bytes are read. `words` are
    /// the callback and name slots that hold the tool, each with the value it holds
    /// now: should pyprobe die, the guardian clears them, as `free_tool_id` does,
    /// if the events are still off and every word still holds its value.
    pub fn tell_tool_silenced(
        &mut self,
        pid: i32,
        monitors: u64,
        tool: (u8, u8),
        words: &[(u64, u64)],
    ) -> std::io::Result<()> {
        let msg = tool_silenced_message(pid, monitors, tool, words)?;
        // One write of less than PIPE_BUF: the guardian reads it whole or not at all.
        self.pipe.write_all(&msg)
    }

    /// The tracer is leaving cleanly: the guardian exits without touching anything.
    pub(crate) fn finish(mut self) {
        let _ = self.tell(Op::Done, 0, 0);
        drop(self.pipe);
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.guardian_pid), None);
    }

    pub fn pid(&self) -> i32 {
        self.guardian_pid
    }

    /// Another writer on the pipe (see [`GuardianLink`]).
    pub(crate) fn link(&self) -> std::io::Result<GuardianLink> {
        Ok(GuardianLink {
            pipe: self.pipe.try_clone()?,
        })
    }
}
