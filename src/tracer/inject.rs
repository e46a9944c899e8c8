//! Making a stopped thread of the target run one system call for pyprobe: point
//! its rip at a `syscall` instruction already in its memory, set the registers,
//! single-step, read the result, and put every register back.
//!
//! Only at clean stops: an event stop, an interrupt stop, or a syscall-exit stop
//! (at a syscall-entry stop the kernel would run the pending call with our arguments).

use std::io;

use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::process::maps::read_maps;
use crate::process::memory::ProcessMemory;

/// Most bytes of executable memory searched for an instruction.
const MAX_SCAN: usize = 64 << 20;

/// Finds `pattern` in the process's executable mappings (the vdso first: it is always
/// there and always has `syscall`).
pub fn find_code(pid: i32, mem: &ProcessMemory, pattern: &[u8]) -> Option<u64> {
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

/// Runs `nr(args...)` in stopped thread `tid` using the `syscall` instruction at
/// `syscall_insn`; returns the raw result (negative errno on failure).
pub fn syscall(tid: i32, syscall_insn: u64, nr: i64, args: [u64; 6]) -> io::Result<i64> {
    let pid = Pid::from_raw(tid);
    let saved = ptrace::getregs(pid).map_err(io::Error::from)?;
    let mut regs = saved;
    regs.rip = syscall_insn;
    regs.rax = nr as u64;
    // No syscall restart logic for the injected call.
    regs.orig_rax = u64::MAX;
    regs.rdi = args[0];
    regs.rsi = args[1];
    regs.rdx = args[2];
    regs.r10 = args[3];
    regs.r8 = args[4];
    regs.r9 = args[5];
    ptrace::setregs(pid, regs).map_err(io::Error::from)?;
    let mut held = Vec::new();
    let result = step_over_syscall(pid, syscall_insn, &mut held);
    let after = ptrace::getregs(pid);
    // Whatever happened, the thread gets its own registers back. A thread stopped in
    // an interrupted system call (rax = -ERESTART*, orig_rax = its number) has it
    // restarted by the kernel's signal path when it resumes from this stop, exactly as
    // it would have from the original one.
    let restored = ptrace::setregs(pid, saved).map_err(io::Error::from);
    // Signals that arrived during the step were held back (delivering them would
    // have stopped the step short, for ever with SIGSTOP): queue them again now,
    // with the thread's own registers back.
    for sig in held {
        let _ = nix::sys::signal::kill(pid, sig);
    }
    restored?;
    result?;
    let after = after.map_err(io::Error::from)?;
    if after.rip != syscall_insn + 2 {
        return Err(io::Error::other(format!(
            "thread {tid}: injected system call at {syscall_insn:#x} ended at {:#x}, not after the \
             instruction (thread was at {:#x}, orig_rax {:#x}, rax {:#x})",
            after.rip,
            saved.rip,
            saved.orig_rax,
            saved.rax
        )));
    }
    Ok(after.rax as i64)
}

/// Single-steps until the instruction at `insn` has run. A SIGTRAP stop reported
/// before it ran (rip still at `insn`: a trap left pending from an earlier stop) just
/// means: step again. Any other signal is held back in `held` (suppressed now, for
/// the caller to queue again). Whatever the outcome, the thread is left stopped:
/// never running with the injected registers.
fn step_over_syscall(pid: Pid, insn: u64, held: &mut Vec<Signal>) -> io::Result<()> {
    ptrace::step(pid, None).map_err(io::Error::from)?;
    for _ in 0..100 {
        match waitpid(pid, Some(WaitPidFlag::__WALL)) {
            Ok(WaitStatus::Stopped(_, Signal::SIGTRAP)) => {
                let rip = ptrace::getregs(pid).map_err(io::Error::from)?.rip;
                if rip != insn {
                    return Ok(());
                }
            }
            Ok(WaitStatus::Stopped(_, sig)) => {
                if !held.contains(&sig) {
                    held.push(sig);
                }
            }
            Ok(WaitStatus::PtraceEvent(..)) | Ok(WaitStatus::PtraceSyscall(_)) => {}
            Ok(other) => {
                return Err(io::Error::other(format!(
                    "thread ended during an injected call: {other:?}"
                )))
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
        // Stopped: step on (a held signal is not delivered).
        if let Err(e) = ptrace::step(pid, None) {
            return Err(e.into());
        }
    }
    // Still stepping after all that: stop it before anyone restores its registers.
    let _ = ptrace::interrupt(pid);
    loop {
        match waitpid(pid, Some(WaitPidFlag::__WALL)) {
            Ok(WaitStatus::Stopped(_, sig)) if sig != Signal::SIGTRAP => {
                if !held.contains(&sig) {
                    held.push(sig);
                }
                break;
            }
            Ok(WaitStatus::Stopped(..)) | Ok(WaitStatus::PtraceEvent(..)) => break,
            Ok(WaitStatus::PtraceSyscall(_)) => break,
            Err(nix::errno::Errno::EINTR) => continue,
            _ => break,
        }
    }
    Err(io::Error::other("injected system call did not complete"))
}
