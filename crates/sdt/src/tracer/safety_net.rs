//! Putting the SIGTRAP net (see [`crate::sigtrap_page`]) into a stopped process
//! and taking it out again, through system calls injected in a thread at a clean stop.
//!
//! While pyprobe has `int3`s in a process, the process's SIGTRAP disposition is the
//! net's handler standing in for whatever the program set (default, ignored, or a
//! handler of its own): pyprobe's traps are told apart and swallowed, the program's
//! own SIGTRAPs get the program's disposition. On a clean exit the program's
//! disposition comes back, unless the program set another one meanwhile: then that
//! one stays. The page stays mapped (a signal frame may still return through its
//! restorer); a later attach finds it by its marker and reuses it.

use std::io;

use crate::process::maps::read_maps;
use crate::process::memory::ProcessMemory;
use crate::process::status::{signal_set, thread_ids};
use crate::sigtrap_page::{self, KernelSigaction, PAGE_SIZE};

use super::guardian::Guardian;
use super::inject::Injector;

const SIGTRAP: u64 = libc::SIGTRAP as u64;

/// The net as installed in one process image.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SafetyNet {
    pub(crate) page: u64,
    syscall_insn: u64,
    /// The program's own disposition the net stands in for.
    pub(crate) original: KernelSigaction,
}

/// The disposition SIGTRAP has now in the process.
fn current(inj: &Injector, mem: &ProcessMemory) -> io::Result<KernelSigaction> {
    let at = inj.scratch()?;
    inj.call(
        "rt_sigaction (reading SIGTRAP's disposition)",
        libc::SYS_rt_sigaction,
        [SIGTRAP, 0, at, 8, 0, 0],
    )?;
    let mut bytes = [0u8; KernelSigaction::BYTES];
    mem.read(at, &mut bytes)?;
    Ok(KernelSigaction::from_bytes(&bytes))
}

fn set(inj: &Injector, mem: &mut ProcessMemory, action: KernelSigaction) -> io::Result<()> {
    let at = inj.scratch()?;
    mem.write(at, &action.to_bytes())?;
    inj.call(
        "rt_sigaction",
        libc::SYS_rt_sigaction,
        [SIGTRAP, at, 0, 8, 0, 0],
    )?;
    Ok(())
}

/// Net pages left in the process by an earlier pyprobe: anonymous executable
/// one-page mappings carrying the marker, with the disposition each recorded.
fn earlier_pages(mem: &ProcessMemory) -> Vec<(u64, KernelSigaction)> {
    let Ok(maps) = read_maps(mem.pid()) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let mut buf = vec![0u8; PAGE_SIZE];
    for m in maps
        .iter()
        .filter(|m| m.executable && m.inode == 0 && m.end - m.start == PAGE_SIZE as u64)
        .take(256)
    {
        if mem.read(m.start, &mut buf).is_ok() {
            if let Some(original) = sigtrap_page::parse_page(&buf) {
                found.push((m.start, original));
            }
        }
    }
    found
}

/// Installs the net through stopped thread `tid` (at a clean stop), for the
/// process's probe `sites`.
pub fn install(
    tid: i32,
    mem: &mut ProcessMemory,
    sites: &[u64],
    guard: Option<&Guardian>,
) -> io::Result<SafetyNet> {
    let inj = Injector::find(mem.pid(), tid, mem)?.guarded(guard, mem);
    let now = current(&inj, mem)?;
    let earlier = earlier_pages(mem);
    // An earlier pyprobe's net still in place (it was killed): the program's own
    // disposition is the one that net recorded.
    let (page, original) = match earlier.iter().find(|(page, _)| now.handler == *page) {
        Some(&(page, original)) => (page, original),
        None => match earlier.first() {
            Some(&(page, _)) => (page, now),
            None => {
                let page = inj.mmap(
                    0,
                    PAGE_SIZE as u64,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                )?;
                (page, now)
            }
        },
    };
    let net = SafetyNet {
        page,
        syscall_insn: inj.insn(),
        original,
    };
    write_page(mem, &net, sites)?;
    set(&inj, mem, sigtrap_page::net_action(page, original))?;
    Ok(net)
}

/// Writes the page for `sites` (the same code; only the table changes). No thread
/// runs the handler meanwhile: every one is stopped, or the program's own trap
/// would be what brought it there, and that path reads no table.
pub(crate) fn write_page(
    mem: &mut ProcessMemory,
    net: &SafetyNet,
    sites: &[u64],
) -> io::Result<()> {
    let bytes =
        sigtrap_page::build_page(net.page, net.original, sites).map_err(io::Error::other)?;
    // /proc/PID/mem writes reach read-only private pages (as debuggers' breakpoints do).
    mem.write(net.page, &bytes)
}

/// Gives SIGTRAP back the program's disposition through stopped thread `tid` (at a
/// clean stop), unless the program replaced the net meanwhile: its choice stays.
pub(crate) fn uninstall(
    tid: i32,
    mem: &mut ProcessMemory,
    net: &SafetyNet,
    guard: Option<&Guardian>,
) -> io::Result<()> {
    let inj = Injector::with_insn(mem.pid(), tid, net.syscall_insn).guarded(guard, mem);
    let now = current(&inj, mem)?;
    if now.handler == net.page {
        set(&inj, mem, net.original)?;
    }
    // No site of pyprobe's is left: a trap at one of those addresses is not its own.
    write_page(mem, net, &[])
}

/// Threads of `pid` that block SIGTRAP: a probe hit in such a thread makes the kernel
/// unblock it and reset SIGTRAP to its default (a forced signal), which pyprobe
/// cannot undo.
pub(crate) fn threads_blocking_sigtrap(pid: i32) -> Vec<i32> {
    let Ok(tids) = thread_ids(pid) else {
        return Vec::new();
    };
    tids.into_iter()
        .filter(|&tid| {
            signal_set(tid, "SigBlk")
                // A mask with every signal blocked is a passing state (a thread
                // being created, a handler running), not a choice about SIGTRAP.
                .is_some_and(|mask| mask & (1 << (SIGTRAP - 1)) != 0 && mask.count_ones() < 60)
        })
        .collect()
}
