//! The guardian's part in injected system calls: the message the injector sends
//! before each call (the thread's registers, the bytes its spin loop borrows), and
//! what the guardian does with a thread the dead tracer left inside one.

use std::fs::File;
use std::io::Write;
use std::time::Instant;

use nix::sys::ptrace;
use nix::unistd::Pid;

use super::{Op, Undo, HOLD_LIMIT, MSG_LEN};
use crate::process::hold::{seize_and_stop, Held};
use crate::process::status::start_time;

/// Bytes a spin loop borrows, at most.
pub(super) const BORROWED_BYTES: usize = 8;
/// `user_regs_struct`: 27 registers.
pub(super) const REGS_BYTES: usize = std::mem::size_of::<libc::user_regs_struct>();
/// After the 13-byte head of [`Op::Injecting`]: tid, length, bytes, registers.
pub(super) const INJECTION_PAYLOAD: usize = 4 + 1 + BORROWED_BYTES + REGS_BYTES;

/// A second writer on the guardian's pipe, for the injector (which lives apart from
/// the engine that owns the [`Guardian`]). Messages are single writes below
/// `PIPE_BUF`: the guardian reads each whole.
pub struct GuardianLink {
    pub(super) pipe: File,
}

impl GuardianLink {
    /// Tells the guardian that thread `tid` of `pid` is about to run an injected call
    /// through the spin loop written at `addr` over `borrowed`, and that `regs` are its
    /// own registers. A failure means: do not inject through the loop.
    pub(crate) fn tell_injection(
        &mut self,
        pid: i32,
        tid: i32,
        addr: u64,
        borrowed: &[u8],
        regs: &libc::user_regs_struct,
    ) -> std::io::Result<()> {
        if borrowed.is_empty() || borrowed.len() > BORROWED_BYTES {
            return Err(std::io::Error::other(format!(
                "{} bytes borrowed at {addr:#x} do not fit the guardian's message",
                borrowed.len()
            )));
        }
        let mut msg = [0u8; MSG_LEN + INJECTION_PAYLOAD];
        msg[0] = Op::Injecting as u8;
        msg[1..5].copy_from_slice(&pid.to_le_bytes());
        msg[5..13].copy_from_slice(&addr.to_le_bytes());
        msg[13..17].copy_from_slice(&tid.to_le_bytes());
        msg[17] = borrowed.len() as u8;
        msg[18..18 + borrowed.len()].copy_from_slice(borrowed);
        msg[18 + BORROWED_BYTES..].copy_from_slice(&regs_to_bytes(regs));
        self.pipe.write_all(&msg)
    }

    /// The injected call in `tid` is over.
    pub(crate) fn tell_injected(&mut self, pid: i32, tid: i32) -> std::io::Result<()> {
        let mut msg = [0u8; MSG_LEN];
        msg[0] = Op::Injected as u8;
        msg[1..5].copy_from_slice(&pid.to_le_bytes());
        msg[5..13].copy_from_slice(&(tid as u64).to_le_bytes());
        self.pipe.write_all(&msg)
    }
}

fn regs_to_bytes(regs: &libc::user_regs_struct) -> [u8; REGS_BYTES] {
    let mut out = [0u8; REGS_BYTES];
    // SAFETY: user_regs_struct is repr(C) of 27 u64 (no padding); reading its bytes
    // is reading plain integers.
    let raw = unsafe {
        std::slice::from_raw_parts(
            (regs as *const libc::user_regs_struct).cast::<u8>(),
            REGS_BYTES,
        )
    };
    out.copy_from_slice(raw);
    out
}

pub(super) fn regs_from_bytes(bytes: &[u8; REGS_BYTES]) -> libc::user_regs_struct {
    // SAFETY: any bit pattern is a valid user_regs_struct (27 u64); the read is
    // unaligned-safe.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<libc::user_regs_struct>()) }
}

/// An injected call under way in a thread: where its spin loop is, what it replaced,
/// and the thread's own registers.
pub(super) struct Injection {
    pub(super) pid: i32,
    pub(super) addr: u64,
    pub(super) borrowed: Vec<u8>,
    pub(super) regs: libc::user_regs_struct,
}

/// Gives thread `tid`, left in an injected call by the dead tracer, its own
/// registers if it is still in the spin loop, then the loop's bytes back. Left in
/// the loop (not seized), the thread keeps spinning rather than run the program's
/// bytes with pyprobe's registers.
pub(super) fn finish_injection(tid: i32, injection: &Injection, undo: &Undo) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let Some(mem) = &undo.mem else {
        return Err("its memory could not be opened".into());
    };
    if undo.started.is_none() || start_time(injection.pid) != undo.started {
        return Ok(()); // the process is gone
    }
    let deadline = Instant::now() + HOLD_LIMIT;
    let thread = Pid::from_raw(tid);
    let held = Held {
        threads: match seize_and_stop(injection.pid, tid, deadline)? {
            Some(sig) => vec![(tid, sig)],
            None => return Ok(()), // it ended
        },
    };
    let regs = ptrace::getregs(thread).map_err(|e| format!("cannot read it: {e}"))?;
    let end = injection.addr + injection.borrowed.len() as u64;
    if (injection.addr..end).contains(&regs.rip) {
        ptrace::setregs(thread, injection.regs).map_err(|e| format!("cannot set it: {e}"))?;
    }
    drop(held);
    // The loop's bytes, unless something else is there now.
    let mut now = vec![0u8; injection.borrowed.len()];
    if mem.read_exact_at(&mut now, injection.addr).is_ok()
        && now == crate::tracer::inject::SPIN_LOOP[..now.len()]
    {
        mem.write_all_at(&injection.borrowed, injection.addr)
            .map_err(|e| format!("cannot put the bytes at {:#x} back: {e}", injection.addr))?;
    }
    Ok(())
}
