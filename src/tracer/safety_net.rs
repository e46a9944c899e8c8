//! A SIGTRAP safety net in the target, for the moment pyprobe might die.
//!
//! While pyprobe traces, every `int3` stops the thread and pyprobe swallows the
//! SIGTRAP. If pyprobe is killed (SIGKILL), the kernel detaches the target with the
//! `int3`s still in place; the guardian puts the bytes back, but a running thread can
//! reach a site first, and SIGTRAP's default action would kill the target. So, while
//! tracing, the target's SIGTRAP disposition is a handler that does nothing: a hit
//! without a tracer then costs a signal delivery and resumes right after the `int3`,
//! which is exactly past the `nop` it replaced. The handler lives on a page pyprobe
//! maps into the target; on a clean exit the original disposition comes back and the
//! page is unmapped. Installed only when the target has SIGTRAP at its default.

use std::io;

use crate::process::memory::ProcessMemory;

use super::inject::{find_code, syscall};

const SYS_MMAP: i64 = 9;
const SYS_MUNMAP: i64 = 11;
const SYS_RT_SIGACTION: i64 = 13;
const SA_RESTORER: u64 = 0x0400_0000;
const SA_RESTART: u64 = 0x1000_0000;
const SA_NODEFER: u64 = 0x4000_0000;
const SIGTRAP: u64 = 5;
/// `ret` at offset 0 (the handler), `mov $15, %rax; syscall` (rt_sigreturn) at 8.
const PAGE_CODE: [u8; 17] = [
    0xc3, 0x90, 0x90, 0x90, 0x90, 0x90, 0x90, 0x90, 0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f,
    0x05,
];

/// What was installed in one process image, to undo on a clean exit.
#[derive(Debug, Clone, Copy)]
pub struct SafetyNet {
    page: u64,
    syscall_insn: u64,
    /// The original `struct sigaction` (kernel layout: handler, flags, restorer, mask).
    original: [u64; 4],
}

/// Where to put a `struct sigaction` for the kernel to read: below the stopped
/// thread's stack pointer and its red zone.
fn scratch(tid: i32) -> io::Result<u64> {
    let regs =
        nix::sys::ptrace::getregs(nix::unistd::Pid::from_raw(tid)).map_err(io::Error::from)?;
    Ok((regs.rsp - 128 - 256) & !15)
}

fn write_action(mem: &mut ProcessMemory, at: u64, action: &[u64; 4]) -> io::Result<()> {
    let mut bytes = [0u8; 32];
    for (i, v) in action.iter().enumerate() {
        bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    mem.write(at, &bytes)
}

fn read_action(mem: &ProcessMemory, at: u64) -> io::Result<[u64; 4]> {
    let mut bytes = [0u8; 32];
    mem.read(at, &mut bytes)?;
    let mut out = [0u64; 4];
    for (i, v) in out.iter_mut().enumerate() {
        *v = u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    }
    Ok(out)
}

fn check(result: i64, what: &str) -> io::Result<i64> {
    if (-4095..0).contains(&result) {
        Err(io::Error::from_raw_os_error(-result as i32))
            .map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))
    } else {
        Ok(result)
    }
}

/// Installs the net through stopped thread `tid`. `Ok(None)`: the target handles
/// SIGTRAP itself (its handler is left alone).
pub fn install(tid: i32, mem: &mut ProcessMemory) -> io::Result<Option<SafetyNet>> {
    let pid = mem.pid();
    let syscall_insn = find_code(pid, mem, &[0x0f, 0x05])
        .ok_or_else(|| io::Error::other("no `syscall` instruction found in the target"))?;
    let prot = (libc::PROT_READ | libc::PROT_EXEC) as u64;
    let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
    let page = check(
        syscall(
            tid,
            syscall_insn,
            SYS_MMAP,
            [0, 4096, prot, flags, u64::MAX, 0],
        )?,
        "mmap",
    )? as u64;
    let result = (|| {
        // /proc/PID/mem writes reach read-only pages (as debuggers' breakpoints do).
        mem.write(page, &PAGE_CODE)?;
        let at = scratch(tid)?;
        let action = [page, SA_RESTORER | SA_RESTART | SA_NODEFER, page + 8, 0];
        write_action(mem, at, &action)?;
        check(
            syscall(
                tid,
                syscall_insn,
                SYS_RT_SIGACTION,
                [SIGTRAP, at, at + 32, 8, 0, 0],
            )?,
            "rt_sigaction",
        )?;
        let original = read_action(mem, at + 32)?;
        Ok::<_, io::Error>(original)
    })();
    let original = match result {
        Ok(o) => o,
        Err(e) => {
            let _ = syscall(tid, syscall_insn, SYS_MUNMAP, [page, 4096, 0, 0, 0, 0]);
            return Err(e);
        }
    };
    let net = SafetyNet {
        page,
        syscall_insn,
        original,
    };
    if original[0] != 0 {
        // SIG_IGN or the target's own handler: give it back and do without the net.
        uninstall(tid, mem, &net)?;
        return Ok(None);
    }
    Ok(Some(net))
}

/// Puts the original SIGTRAP disposition back and unmaps the page. Safe while
/// traced: no thread can be inside the handler, since pyprobe swallows every SIGTRAP
/// of its own sites before it is delivered.
pub fn uninstall(tid: i32, mem: &mut ProcessMemory, net: &SafetyNet) -> io::Result<()> {
    let at = scratch(tid)?;
    write_action(mem, at, &net.original)?;
    check(
        syscall(
            tid,
            net.syscall_insn,
            SYS_RT_SIGACTION,
            [SIGTRAP, at, 0, 8, 0, 0],
        )?,
        "rt_sigaction",
    )?;
    check(
        syscall(
            tid,
            net.syscall_insn,
            SYS_MUNMAP,
            [net.page, 4096, 0, 0, 0, 0],
        )?,
        "munmap",
    )?;
    Ok(())
}
