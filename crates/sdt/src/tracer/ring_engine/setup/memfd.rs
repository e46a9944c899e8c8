//! Making a ring in the target: a sealed memfd, formatted by pyprobe and mapped
//! shared in the target. Apart from the setup's outline because the hook engine
//! (`pyprobe-cpython`) makes its rings the same way, through [`map_ring`].

use std::fs::OpenOptions;

use anyhow::{anyhow, bail, Context, Result};
use memmap2::MmapMut;

use crate::ring::{init_zeroed_ring, ring_bytes, Slots};
use crate::tracer::inject::Injector;

use super::PROT_RW;

/// A memfd made in the target (named by the string at `name_addr`), sized for
/// `capacity` slots of `slots` and sealed at that size, mapped and formatted by pyprobe, then
/// mapped `MAP_SHARED` in the target (at `over`, over what is there, or where the
/// kernel chooses), its descriptor closed: the target never sees an unformatted
/// ring, and keeps no descriptor of pyprobe's. Returns the ring's address in the
/// target and pyprobe's mapping of it.
///
/// The seals are pyprobe's own safety: a target that reopens the memfd (through
/// `/proc/self/map_files`, as root can) and truncates it would otherwise make
/// pyprobe's next read of the ring a SIGBUS, which kills pyprobe.
pub fn map_ring(
    inj: &Injector,
    pid: i32,
    name_addr: u64,
    over: Option<u64>,
    capacity: u64,
    slots: Slots,
) -> Result<(u64, MmapMut)> {
    let bytes = ring_bytes(capacity, slots).map_err(|e| anyhow!("{e}"))? as u64;
    let fd = inj.call(
        "memfd_create",
        libc::SYS_memfd_create,
        [
            name_addr,
            (libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) as u64,
            0,
            0,
            0,
            0,
        ],
    )?;
    let mapped = (|| {
        inj.call("ftruncate", libc::SYS_ftruncate, [fd, bytes, 0, 0, 0, 0])?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/fd/{fd}"))
            .with_context(|| format!("opening the ring of process {pid} (its fd {fd})"))?;
        seal_size(&file).with_context(|| format!("sealing the ring of process {pid}"))?;
        // SAFETY: a shared mapping of a memfd only pyprobe and the target use; the
        // reader accesses it with atomic and volatile operations.
        let mut mapping = unsafe { MmapMut::map_mut(&file) }.context("mapping the ring")?;
        if mapping.len() as u64 != bytes {
            bail!(
                "the ring of process {pid} is {} bytes, not {bytes}",
                mapping.len()
            );
        }
        // A new memfd, zero-filled by the kernel: the header is all there is to write.
        init_zeroed_ring(&mut mapping, capacity, slots).map_err(|e| anyhow!("{e}"))?;
        // A ring of units (the hook's: 16 bytes an event) is filled in the target at
        // once, while it is stopped: its first lap would otherwise take a page
        // fault, allocating and zeroing, every 256 events (a sixth of a short
        // traced run's cost). A ring of records fills lazily: a quiet process's
        // stays small.
        let populate = if slots == Slots::Units {
            libc::MAP_POPULATE
        } else {
            0
        };
        let ring_addr = match over {
            Some(addr) => {
                let flags = libc::MAP_SHARED | libc::MAP_FIXED | populate;
                let got = inj.mmap(addr, bytes, PROT_RW, flags, fd as i64)?;
                if got != addr {
                    bail!("the new ring was mapped at {got:#x}, not over the old one at {addr:#x}");
                }
                got
            }
            None => inj.mmap(0, bytes, PROT_RW, libc::MAP_SHARED | populate, fd as i64)?,
        };
        Ok::<_, anyhow::Error>((ring_addr, mapping))
    })();
    // The mappings keep the memory; the target keeps no descriptor of ours.
    let _ = inj.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0]);
    mapped
}

/// Seals the memfd behind `file` at its size, and its seals with it: it can never
/// shrink (what SIGBUS needs), grow, or take other seals (`F_SEAL_FUTURE_WRITE`
/// would stop a later pyprobe mapping it).
fn seal_size(file: &std::fs::File) -> Result<()> {
    use std::os::fd::AsRawFd;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor pyprobe owns.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("fcntl(F_ADD_SEALS)");
    }
    Ok(())
}
