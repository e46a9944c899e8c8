//! Making a stopped thread of the target run system calls for pyprobe: point its
//! rip at a `syscall` instruction already in its memory, set the registers, let it
//! run exactly that call, read the result, and put every register back.
//!
//! [`Injector`] is the one way in: the SIGTRAP net (`safety_net`) and the ring's
//! set-up (`ring::setup`) both go through it, and so should any engine that needs
//! the target to map, open or signal something. Its contract:
//!
//! * **Which thread.** Only a thread stopped inside the kernel's signal path (an
//!   interrupt stop, a group-stop, or the signal-delivery stop of a hit pyprobe
//!   swallows): there the thread's own system call, if one was under way, has already
//!   been cut short with its restart code (`-ERESTART*`), and the kernel restarts it
//!   when the thread leaves the signal path with its registers back. An event stop
//!   (clone, fork, exec) is *inside* a system call: the call would finish after the
//!   injected registers were set and write its result over them, and the thread's own
//!   call would then return garbage (a `fork()` that made a child would report
//!   ENOSYS). The caller picks the thread; the engine's `clean_thread` picks one, or
//!   brings one to such a stop, and never injects elsewhere.
//! * **How it runs.** Between a syscall-entry and a syscall-exit stop
//!   (PTRACE_SYSCALL), never by single-stepping: a single-step raises a forced
//!   SIGTRAP, and the kernel forcing a signal that the program ignores or blocks
//!   resets it to its default and unblocks it for good. After the exit stop an
//!   interrupt brings the thread back into the signal path, where its registers are
//!   restored, so the restart logic sees them exactly as at the original stop.
//! * **Signals meanwhile.** A signal that arrives for the thread before the call runs
//!   is taken off (the thread must not run its handler with pyprobe's registers) and
//!   queued again to the same thread afterwards, by the thread itself, with its
//!   original `siginfo` (the kernel lets a thread queue any `siginfo` to itself, not
//!   to others).
//! * **If pyprobe dies meanwhile.** The kernel lets the thread go with pyprobe's
//!   registers. So that it never runs the program's code with them, each call goes
//!   through a spin loop (`syscall; jmp .`) written over the program's entry point
//!   for the call's duration (code that ran once, at start), after the guardian was
//!   told the thread's registers and the bytes the loop replaced: a thread let go
//!   mid-call makes the call and spins until the guardian gives it its registers and
//!   the entry point its bytes. Without a guardian or an entry point the call goes
//!   through a `syscall` found in the process's code, as before. Signals held back
//!   for the thread (below) are lost if pyprobe dies before it queues them again.
//! * **Results.** A call the kernel refused comes back as an error naming the call,
//!   the process and the errno; an injection that failed (the thread ended, a ptrace
//!   request was refused) as one naming the thread and the step.

use std::cell::RefCell;
use std::io;

use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::process::maps::read_maps;
use crate::process::memory::ProcessMemory;
use crate::process::status::tgid_of;
use crate::tracer::guardian::{Guardian, GuardianLink};

/// Most bytes of executable memory searched for an instruction.
const MAX_SCAN: usize = 64 << 20;
/// Most stops awaited for one injected call before giving up.
const MAX_STOPS: usize = 64;
/// Most signals held back during one injected call (queued again afterwards).
const MAX_HELD: usize = 16;
const SIGINFO_BYTES: usize = 128;
/// Bytes below the stack pointer left alone: the red zone and a margin.
const STACK_GAP: u64 = 128 + 512;

/// The `syscall` instruction.
const SYSCALL: [u8; 2] = [0x0f, 0x05];
/// `syscall; jmp .`: what an injected call runs through at the entry point.
pub(crate) const SPIN_LOOP: [u8; 4] = [0x0f, 0x05, 0xeb, 0xfe];
/// `AT_ENTRY` in the auxiliary vector: the program's entry point.
const AT_ENTRY: u64 = 9;

/// Runs system calls in one stopped thread of a process, through a `syscall`
/// instruction found in the process's code (see the module documentation for which
/// thread may be used).
pub struct Injector {
    pid: i32,
    tid: i32,
    insn: u64,
    spin: Option<Spin>,
}

/// The entry point a call borrows for its spin loop, and the guardian to tell.
struct Spin {
    addr: u64,
    original: [u8; SPIN_LOOP.len()],
    link: RefCell<GuardianLink>,
}

impl Injector {
    /// Finds a `syscall` instruction in `pid`'s code, to inject through thread `tid`.
    pub fn find(pid: i32, tid: i32, mem: &ProcessMemory) -> io::Result<Injector> {
        let insn = find_code(pid, mem, &SYSCALL).ok_or_else(|| {
            io::Error::other(format!("no `syscall` instruction found in process {pid}"))
        })?;
        Ok(Injector {
            pid,
            tid,
            insn,
            spin: None,
        })
    }

    /// Through a `syscall` instruction found before (by [`Injector::find`]).
    pub(crate) fn with_insn(pid: i32, tid: i32, insn: u64) -> Injector {
        Injector {
            pid,
            tid,
            insn,
            spin: None,
        }
    }

    /// Calls go through a spin loop at the program's entry point, with `guard` told
    /// (see the module documentation), where there is a guardian and an entry point
    /// in executable memory.
    pub fn guarded(mut self, guard: Option<&Guardian>, mem: &ProcessMemory) -> Injector {
        let Some(link) = guard.and_then(|g| g.link().ok()) else {
            return self;
        };
        let Some(addr) = entry_point(self.pid) else {
            return self;
        };
        let mut original = [0u8; SPIN_LOOP.len()];
        if mem.read(addr, &mut original).is_err() || original == SPIN_LOOP {
            return self;
        }
        self.spin = Some(Spin {
            addr,
            original,
            link: RefCell::new(link),
        });
        self
    }

    /// Where the `syscall` instruction is.
    pub(crate) fn insn(&self) -> u64 {
        self.insn
    }

    /// Runs `what` (system call `nr`) with `args`; its result, or an error naming
    /// the call, the process and the errno.
    pub fn call(&self, what: &str, nr: i64, args: [u64; 6]) -> io::Result<u64> {
        let r = match &self.spin {
            Some(spin) => self.through_spin(spin, nr, args),
            None => syscall(self.tid, self.insn, nr, args),
        }
        .map_err(|e| io::Error::new(e.kind(), format!("injecting {what}: {e}")))?;
        if (-4095..0).contains(&r) {
            let e = io::Error::from_raw_os_error(-r as i32);
            return Err(io::Error::new(
                e.kind(),
                format!("{what} in process {} failed: {e}", self.pid),
            ));
        }
        Ok(r as u64)
    }

    /// One call through the spin loop: the guardian told first, the loop written,
    /// the call run, the entry point's bytes put back, the guardian told it is over.
    /// Where the loop cannot be used, through the plain `syscall` instruction.
    fn through_spin(&self, spin: &Spin, nr: i64, args: [u64; 6]) -> io::Result<i64> {
        let (pid, tid) = (self.pid, self.tid);
        let saved = ptrace::getregs(Pid::from_raw(tid))
            .map_err(|e| ptrace_error(tid, "reading registers", e))?;
        let end = spin.addr + SPIN_LOOP.len() as u64;
        let mut link = spin.link.borrow_mut();
        if (spin.addr..end).contains(&saved.rip)
            || link
                .tell_injection(pid, tid, spin.addr, &spin.original, &saved)
                .is_err()
        {
            return syscall_from(tid, &saved, self.insn, nr, args);
        }
        let mut mem = ProcessMemory::new(pid);
        if mem.write(spin.addr, &SPIN_LOOP).is_err() {
            let _ = link.tell_injected(pid, tid);
            return syscall_from(tid, &saved, self.insn, nr, args);
        }
        let result = syscall_from(tid, &saved, spin.addr, nr, args);
        // The thread is stopped with its registers back (or gone): the entry point
        // gets its bytes; until then the guardian keeps the thread's registers.
        let restored = mem.write(spin.addr, &spin.original);
        if restored.is_ok() {
            let _ = link.tell_injected(pid, tid);
        }
        restored.map_err(|e| {
            io::Error::other(format!(
                "process {pid}: cannot put back the entry point's bytes at {:#x}: {e}",
                spin.addr
            ))
        })?;
        result
    }

    /// `mmap(addr, len, prot, flags, fd, 0)` in the target.
    pub fn mmap(&self, addr: u64, len: u64, prot: i32, flags: i32, fd: i64) -> io::Result<u64> {
        self.call(
            "mmap",
            libc::SYS_mmap,
            [addr, len, prot as u64, flags as u64, fd as u64, 0],
        )
    }

    /// An address below the stopped thread's stack pointer and its red zone, for a
    /// small structure the kernel reads or writes during a call.
    pub(crate) fn scratch(&self) -> io::Result<u64> {
        let regs = ptrace::getregs(Pid::from_raw(self.tid)).map_err(io::Error::from)?;
        Ok((regs.rsp - STACK_GAP) & !15)
    }
}

/// The program's entry point (`AT_ENTRY`), if it lies in executable memory.
fn entry_point(pid: i32) -> Option<u64> {
    let auxv = std::fs::read(format!("/proc/{pid}/auxv")).ok()?;
    let entry = auxv
        .chunks_exact(16)
        .take(64)
        .map(|pair| {
            let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
            (word(&pair[..8]), word(&pair[8..]))
        })
        .find(|&(kind, _)| kind == AT_ENTRY)?
        .1;
    let maps = read_maps(pid).ok()?;
    let end = entry.checked_add(SPIN_LOOP.len() as u64)?;
    maps.iter()
        .any(|m| m.executable && m.start <= entry && end <= m.end)
        .then_some(entry)
}

/// Finds `pattern` in the process's executable mappings (the vdso first: it is always
/// there and always has `syscall`).
pub(crate) fn find_code(pid: i32, mem: &ProcessMemory, pattern: &[u8]) -> Option<u64> {
    let mut maps = read_maps(pid).ok()?;
    maps.retain(|m| m.executable && m.readable || m.path == "[vdso]");
    maps.sort_by_key(|m| m.path != "[vdso]");
    let mut scanned = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    for m in maps {
        let mut at = m.start;
        while at < m.end && scanned < MAX_SCAN {
            let n = ((m.end - at) as usize).min(buf.len());
            if mem.read(at, &mut buf[..n]).is_err() {
                break;
            }
            if let Some(i) = buf[..n].windows(pattern.len()).position(|w| w == pattern) {
                return Some(at + i as u64);
            }
            scanned += n;
            // Overlap so a pattern across the chunk border is not missed.
            at += (n.saturating_sub(pattern.len() - 1)).max(1) as u64;
        }
    }
    None
}

/// A signal taken off the thread during an injected call, to queue again.
struct Held {
    signal: i32,
    info: [u8; SIGINFO_BYTES],
}

/// Runs `nr(args...)` in stopped thread `tid` using the `syscall` instruction at
/// `syscall_insn`; returns the raw result (negative errno on failure). The thread is
/// left at an interrupt stop with all its registers as they were.
pub(crate) fn syscall(tid: i32, syscall_insn: u64, nr: i64, args: [u64; 6]) -> io::Result<i64> {
    let pid = Pid::from_raw(tid);
    let saved = ptrace::getregs(pid).map_err(|e| ptrace_error(tid, "reading registers", e))?;
    syscall_from(tid, &saved, syscall_insn, nr, args)
}

/// [`syscall`], with the thread's registers `saved` already read.
fn syscall_from(
    tid: i32,
    saved: &libc::user_regs_struct,
    syscall_insn: u64,
    nr: i64,
    args: [u64; 6],
) -> io::Result<i64> {
    let mut held = Vec::new();
    let result = run_one(tid, saved, syscall_insn, nr, args, &mut held);
    requeue(tid, saved, syscall_insn, held);
    result
}

/// One injected call; the registers are `saved` again whenever the thread is left
/// stopped, whatever happened.
fn run_one(
    tid: i32,
    saved: &libc::user_regs_struct,
    insn: u64,
    nr: i64,
    args: [u64; 6],
    held: &mut Vec<Held>,
) -> io::Result<i64> {
    let pid = Pid::from_raw(tid);
    let mut regs = *saved;
    regs.rip = insn;
    regs.rax = nr as u64;
    // Not in a system call as far as the restart logic is concerned.
    regs.orig_rax = u64::MAX;
    regs.rdi = args[0];
    regs.rsi = args[1];
    regs.rdx = args[2];
    regs.r10 = args[3];
    regs.r8 = args[4];
    regs.r9 = args[5];
    ptrace::setregs(pid, regs).map_err(|e| ptrace_error(tid, "setting registers", e))?;
    crate::tracer::test_switches::die_here_if_asked();
    let outcome = drive(tid, insn, held);
    // Back at a stop in the signal path (or ended): the thread's own registers.
    let restored = ptrace::setregs(pid, *saved);
    let result = outcome?;
    restored.map_err(|e| ptrace_error(tid, "restoring registers", e))?;
    Ok(result)
}

/// Where the injected call is.
#[derive(PartialEq)]
enum Phase {
    /// Not entered yet.
    Before,
    /// Entered; the exit stop comes next.
    Inside,
    /// Done (`result`); waiting for the interrupt stop in the signal path.
    After,
}

fn drive(tid: i32, insn: u64, held: &mut Vec<Held>) -> io::Result<i64> {
    let pid = Pid::from_raw(tid);
    let mut phase = Phase::Before;
    let mut result = 0i64;
    ptrace::syscall(pid, None).map_err(|e| ptrace_error(tid, "resuming", e))?;
    for _ in 0..MAX_STOPS {
        let status = match waitpid(pid, Some(WaitPidFlag::__WALL)) {
            Ok(s) => s,
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(ptrace_error(tid, "waiting", e)),
        };
        match status {
            WaitStatus::PtraceSyscall(_) => match phase {
                Phase::Before => {
                    let at = ptrace::getregs(pid).map_err(|e| ptrace_error(tid, "reading", e))?;
                    if at.rip != insn + 2 {
                        // Not our call: the thread ran code it should not have.
                        return Err(io::Error::other(format!(
                            "thread {tid}: a system call stop at {:#x}, not at the injected \
                             call at {insn:#x}",
                            at.rip
                        )));
                    }
                    phase = Phase::Inside;
                    ptrace::syscall(pid, None).map_err(|e| ptrace_error(tid, "resuming", e))?;
                }
                Phase::Inside => {
                    let at = ptrace::getregs(pid).map_err(|e| ptrace_error(tid, "reading", e))?;
                    result = at.rax as i64;
                    phase = Phase::After;
                    // Back into the signal path before user mode: an interrupt is
                    // taken on the way out of the system call.
                    ptrace::interrupt(pid).map_err(|e| ptrace_error(tid, "interrupting", e))?;
                    ptrace::cont(pid, None).map_err(|e| ptrace_error(tid, "resuming", e))?;
                }
                Phase::After => {
                    ptrace::cont(pid, None).map_err(|e| ptrace_error(tid, "resuming", e))?;
                }
            },
            WaitStatus::PtraceEvent(_, _, event) if event == libc::PTRACE_EVENT_STOP => {
                if phase == Phase::After {
                    return Ok(result);
                }
                // A stale interrupt, or the thread taking part in a group-stop that
                // was under way: on to the call.
                ptrace::syscall(pid, None).map_err(|e| ptrace_error(tid, "resuming", e))?;
            }
            WaitStatus::Stopped(_, sig) => {
                // A signal on its way to the thread: hold it back now, queue it again
                // once the thread has its registers back.
                let info = siginfo(tid).unwrap_or([0; SIGINFO_BYTES]);
                if held.len() < MAX_HELD {
                    held.push(Held {
                        signal: sig as i32,
                        info,
                    });
                }
                let resume = if phase == Phase::After {
                    ptrace::cont(pid, None)
                } else {
                    ptrace::syscall(pid, None)
                };
                resume.map_err(|e| ptrace_error(tid, "resuming", e))?;
            }
            WaitStatus::PtraceEvent(..) => {
                // No other event comes out of the calls pyprobe injects.
                let resume = if phase == Phase::After {
                    ptrace::cont(pid, None)
                } else {
                    ptrace::syscall(pid, None)
                };
                resume.map_err(|e| ptrace_error(tid, "resuming", e))?;
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("thread {tid} ended during an injected system call: {other:?}"),
                ))
            }
        }
    }
    // Still not back after all that: stop it before anyone restores its registers.
    let _ = ptrace::interrupt(pid);
    loop {
        match waitpid(pid, Some(WaitPidFlag::__WALL)) {
            Err(Errno::EINTR) => continue,
            Ok(WaitStatus::Stopped(_, sig)) => {
                if held.len() < MAX_HELD {
                    held.push(Held {
                        signal: sig as i32,
                        info: siginfo(tid).unwrap_or([0; SIGINFO_BYTES]),
                    });
                }
                break;
            }
            _ => break,
        }
    }
    Err(io::Error::other(format!(
        "thread {tid}: the injected system call did not complete within {MAX_STOPS} stops"
    )))
}

/// Queues the held signals again to `tid`, each with its own `siginfo`, through an
/// injected `rt_tgsigqueueinfo` to itself; `tgkill` from pyprobe if that fails
/// (same signal, pyprobe as its sender).
fn requeue(tid: i32, saved: &libc::user_regs_struct, insn: u64, mut held: Vec<Held>) {
    let tgid = tgid_of(tid).unwrap_or(tid);
    let scratch = (saved.rsp.wrapping_sub(STACK_GAP + SIGINFO_BYTES as u64)) & !15;
    let mut rounds = 0;
    while let Some(h) = held.pop() {
        rounds += 1;
        let queued = rounds <= MAX_HELD
            && ProcessMemory::new(tgid).write(scratch, &h.info).is_ok()
            && run_one(
                tid,
                saved,
                insn,
                libc::SYS_rt_tgsigqueueinfo,
                [tgid as u64, tid as u64, h.signal as u64, scratch, 0, 0],
                &mut held,
            )
            .is_ok_and(|r| r == 0);
        if !queued {
            // SAFETY: plain system call on integer arguments.
            unsafe { libc::syscall(libc::SYS_tgkill, tgid, tid, h.signal) };
        }
    }
}

fn siginfo(tid: i32) -> Option<[u8; SIGINFO_BYTES]> {
    let mut info = [0u8; SIGINFO_BYTES];
    // SAFETY: the kernel writes one siginfo_t (128 bytes) into the buffer.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_GETSIGINFO,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            info.as_mut_ptr(),
        )
    };
    (r == 0).then_some(info)
}

fn ptrace_error(tid: i32, what: &str, e: Errno) -> io::Error {
    let kind = if e == Errno::ESRCH {
        io::ErrorKind::NotFound
    } else {
        io::ErrorKind::Other
    };
    io::Error::new(
        kind,
        format!("thread {tid}: {what} for an injected system call: {e}"),
    )
}
