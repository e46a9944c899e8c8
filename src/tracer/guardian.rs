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

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Write};

use anyhow::{Context, Result};
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::unistd::{fork, pipe2, ForkResult};

use super::patch::NOP;

const MSG_LEN: usize = 13;

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
}

/// The tracer's end of the link.
pub struct Guardian {
    pipe: File,
    guardian_pid: i32,
}

impl Guardian {
    /// Forks the guardian. Call before the process creates threads: the child goes
    /// on running Rust code from a copy of a single-threaded process.
    pub fn spawn() -> Result<Guardian> {
        let (read_end, write_end) =
            pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("cannot create the guardian pipe")?;
        // SAFETY: pyprobe is single-threaded here (the guardian is started first).
        match unsafe { fork() }.context("cannot fork the guardian")? {
            ForkResult::Child => {
                drop(write_end);
                let code = run_guardian(File::from(read_end));
                // SAFETY: leave without running the parent's destructors or atexit.
                unsafe { libc::_exit(code) }
            }
            ForkResult::Parent { child } => {
                drop(read_end);
                Ok(Guardian {
                    pipe: File::from(write_end),
                    guardian_pid: child.as_raw(),
                })
            }
        }
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

    /// The tracer is leaving cleanly: the guardian exits without touching anything.
    pub fn finish(mut self) {
        let _ = self.tell(Op::Done, 0, 0);
        drop(self.pipe);
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.guardian_pid), None);
    }

    pub fn pid(&self) -> i32 {
        self.guardian_pid
    }
}

#[derive(Default)]
struct Undo {
    sites: HashSet<u64>,
    semaphores: HashMap<u64, u32>,
    /// `/proc/PID/mem`, opened while the tracer is alive so that undoing costs only
    /// reads and writes when every microsecond counts.
    mem: Option<File>,
}

impl Undo {
    fn open(&mut self, pid: i32) {
        if self.mem.is_none() {
            self.mem = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(format!("/proc/{pid}/mem"))
                .ok();
        }
    }

    fn lower(&self, sem: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(mem) = &self.mem else { return false };
        let mut b = [0u8; 2];
        if mem.read_exact_at(&mut b, sem).is_err() {
            return false;
        }
        let v = u16::from_le_bytes(b).saturating_sub(1);
        mem.write_all_at(&v.to_le_bytes(), sem).is_ok()
    }

    fn restore(&self, site: u64) -> bool {
        use std::os::unix::fs::FileExt;
        self.mem
            .as_ref()
            .is_some_and(|mem| mem.write_all_at(&[NOP], site).is_ok())
    }
}

fn run_guardian(mut pipe: File) -> i32 {
    // Ctrl-C and hang-ups reach the whole process group: the guardian outlives them
    // and ends only when the tracer is gone.
    for sig in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGPIPE,
        Signal::SIGALRM,
    ] {
        // SAFETY: setting a signal to ignored.
        let _ = unsafe { signal(sig, SigHandler::SigIgn) };
    }
    // Close every inherited descriptor but the pipe and stdio: the guardian must not
    // keep the target's pipes or pyprobe's output file open.
    close_other_fds(&pipe);
    let mut state: HashMap<i32, Undo> = HashMap::new();
    let mut msg = [0u8; MSG_LEN];
    // Until EOF (the tracer died) or a broken pipe.
    while pipe.read_exact(&mut msg).is_ok() {
        let pid = i32::from_le_bytes([msg[1], msg[2], msg[3], msg[4]]);
        let addr = u64::from_le_bytes(msg[5..13].try_into().unwrap_or([0; 8]));
        let undo = state.entry(pid).or_default();
        if msg[0] != Op::Forget as u8 && msg[0] != Op::Done as u8 {
            undo.open(pid);
        }
        match msg[0] {
            x if x == Op::SiteArmed as u8 => {
                undo.sites.insert(addr);
            }
            x if x == Op::SiteRestored as u8 => {
                undo.sites.remove(&addr);
            }
            x if x == Op::SemaphoreRaised as u8 => *undo.semaphores.entry(addr).or_insert(0) += 1,
            x if x == Op::SemaphoreLowered as u8 => {
                if let Some(n) = undo.semaphores.get_mut(&addr) {
                    *n = n.saturating_sub(1);
                }
            }
            x if x == Op::Forget as u8 => {
                state.remove(&pid);
            }
            x if x == Op::Done as u8 => return 0,
            _ => {}
        }
    }
    let start = crate::tracer::signals::monotonic_ns();
    let mut restored = (0usize, 0usize);
    // Semaphores of every process first: CPython checks them before reaching a site,
    // so lowering them closes the window fastest; then the bytes.
    for undo in state.values() {
        for (&sem, &count) in &undo.semaphores {
            for _ in 0..count {
                if undo.lower(sem) {
                    restored.1 += 1;
                }
            }
        }
    }
    for undo in state.values() {
        for &site in &undo.sites {
            if undo.restore(site) {
                restored.0 += 1;
            }
        }
    }
    let took = crate::tracer::signals::monotonic_ns().saturating_sub(start);
    if !state
        .values()
        .all(|u| u.sites.is_empty() && u.semaphores.values().all(|&n| n == 0))
    {
        eprintln!(
            "pyprobe guardian: pyprobe died; restored {} probe sites and lowered {} semaphores in {} process(es) in {} µs",
            restored.0,
            restored.1,
            state.len(),
            took / 1000
        );
    }
    0
}

fn close_other_fds(keep: &File) {
    use std::os::fd::AsRawFd;
    let keep = keep.as_raw_fd();
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds {
        if fd > 2 && fd != keep {
            // SAFETY: closing descriptors this process will never use again (one of
            // them, the directory listing's, is already closed: EBADF is fine).
            unsafe { libc::close(fd) };
        }
    }
}
