//! Reading and writing another process's memory.
//!
//! Reads go through `process_vm_readv` (one syscall, no stop needed); writes go
//! through `/proc/PID/mem`, which the kernel lets a tracer use even on read-only code
//! pages. Every read has a caller-given size: nothing here allocates by what the
//! target says.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

/// Longest string pyprobe reads from a target (file names, function names, modules).
pub const MAX_STRING: usize = 1024;

#[derive(Debug)]
pub struct ProcessMemory {
    pid: i32,
    mem: Option<File>,
}

impl ProcessMemory {
    pub fn new(pid: i32) -> ProcessMemory {
        ProcessMemory { pid, mem: None }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Reads exactly `buf.len()` bytes at `addr`.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let local = [io::IoSliceMut::new(buf)];
        let remote = [RemoteIoVec {
            base: addr as usize,
            len: local[0].len(),
        }];
        let want = local[0].len();
        let mut local = local;
        match process_vm_readv(Pid::from_raw(self.pid), &mut local, &remote) {
            Ok(n) if n == want => Ok(()),
            Ok(n) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "pid {}: short read at {addr:#x}: {n} of {want} bytes",
                    self.pid
                ),
            )),
            Err(e) => Err(io::Error::new(
                io::Error::from(e).kind(),
                format!(
                    "pid {}: cannot read {want} bytes at {addr:#x}: {e}",
                    self.pid
                ),
            )),
        }
    }

    /// Reads `len` bytes at each of `addrs` into consecutive `len`-byte pieces of
    /// `out` (which holds `addrs.len() * len` bytes), with one `process_vm_readv`
    /// per [`WORDS_PER_READ`] blocks; returns how many leading blocks were read
    /// whole (the kernel stops at the first it cannot read).
    pub fn read_blocks(&self, addrs: &[u64], len: usize, out: &mut [u8]) -> usize {
        if len == 0 || out.len() < addrs.len().saturating_mul(len) {
            return 0;
        }
        let mut done = 0;
        for (addrs, out) in addrs
            .chunks(WORDS_PER_READ)
            .zip(out.chunks_mut(WORDS_PER_READ * len))
        {
            let remote: Vec<RemoteIoVec> = addrs
                .iter()
                .map(|&a| RemoteIoVec {
                    base: a as usize,
                    len,
                })
                .collect();
            let mut local: Vec<io::IoSliceMut<'_>> =
                out.chunks_mut(len).map(io::IoSliceMut::new).collect();
            let got = process_vm_readv(Pid::from_raw(self.pid), &mut local, &remote).unwrap_or(0);
            let whole = (got / len).min(addrs.len());
            done += whole;
            if whole < addrs.len() {
                break;
            }
        }
        done
    }

    /// Reads the 64-bit word at each of `addrs` into `out` (`None` where it
    /// cannot be read), with one `process_vm_readv` per [`WORDS_PER_READ`] words
    /// when all can be read: for checking many objects at once, where a read
    /// each would cost a system call each. The kernel stops at the first word it
    /// cannot read; reading goes on after it.
    pub fn read_words(&self, addrs: &[u64], out: &mut Vec<Option<u64>>) {
        out.clear();
        out.resize(addrs.len(), None);
        let mut words = [[0u8; 8]; WORDS_PER_READ];
        let mut at = 0;
        // Each pass reads at least one word or gives one up: at most 2 passes a word.
        while at < addrs.len() {
            let n = (addrs.len() - at).min(WORDS_PER_READ);
            let remote: Vec<RemoteIoVec> = addrs[at..at + n]
                .iter()
                .map(|&a| RemoteIoVec {
                    base: a as usize,
                    len: 8,
                })
                .collect();
            let mut local: Vec<io::IoSliceMut<'_>> = words[..n]
                .iter_mut()
                .map(|w| io::IoSliceMut::new(w))
                .collect();
            let got = process_vm_readv(Pid::from_raw(self.pid), &mut local, &remote).unwrap_or(0);
            drop(local);
            let whole = got / 8;
            for k in 0..whole.min(n) {
                out[at + k] = Some(u64::from_le_bytes(words[k]));
            }
            // The word after the last whole one could not be read (or a short
            // read cut it): given up, the rest read afresh.
            at += whole.min(n) + usize::from(whole < n);
        }
    }

    pub fn read_u64(&self, addr: u64) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    pub fn read_u16(&self, addr: u64) -> io::Result<u16> {
        let mut b = [0u8; 2];
        self.read(addr, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Reads a NUL-terminated string of at most `max` bytes (see [`read_c_string`]).
    pub fn read_c_string(&self, addr: u64, max: usize) -> io::Result<String> {
        read_c_string(self, addr, max)
    }

    /// Writes `bytes` at `addr` through `/proc/PID/mem`.
    pub fn write(&mut self, addr: u64, bytes: &[u8]) -> io::Result<()> {
        let pid = self.pid;
        if self.mem.is_none() {
            let path = format!("/proc/{pid}/mem");
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot open {path} for writing: {e}"))
                })?;
            self.mem = Some(file);
        }
        let Some(mem) = self.mem.as_ref() else {
            unreachable!("opened above")
        };
        mem.write_all_at(bytes, addr).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "pid {pid}: cannot write {} bytes at {addr:#x}: {e}",
                    bytes.len()
                ),
            )
        })
    }
}

impl crate::sdt::MemoryReader for ProcessMemory {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read(address, buf)
    }
}

/// Most words [`ProcessMemory::read_words`] asks for in one system call (the
/// kernel takes at most 1024 iovecs).
pub(crate) const WORDS_PER_READ: usize = 256;

/// Reads a NUL-terminated string of at most `max` bytes from any target memory. A
/// string without a terminator within `max` is cut there (the target is not trusted
/// to end it). Reads stop at page ends so a string near an unmapped page still reads.
pub fn read_c_string<M: crate::sdt::MemoryReader + ?Sized>(
    mem: &M,
    addr: u64,
    max: usize,
) -> io::Result<String> {
    let mut out = Vec::new();
    let mut at = addr;
    while out.len() < max {
        let to_page_end = 4096 - (at % 4096) as usize;
        let n = to_page_end.min(max - out.len()).min(256);
        let mut chunk = vec![0u8; n];
        if let Err(e) = mem.read_exact(at, &mut chunk) {
            if out.is_empty() {
                return Err(e);
            }
            break;
        }
        if let Some(end) = chunk.iter().position(|&b| b == 0) {
            out.extend_from_slice(&chunk[..end]);
            return Ok(String::from_utf8_lossy(&out).into_owned());
        }
        out.extend_from_slice(&chunk);
        at = at.wrapping_add(n as u64);
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_read_together_and_an_unreadable_one_does_not_hide_the_rest() {
        let mem = ProcessMemory::new(std::process::id() as i32);
        let values: Vec<u64> = (0..600u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let mut addrs: Vec<u64> = values.iter().map(|v| v as *const u64 as u64).collect();
        // Unmapped words among them: the first, one in the middle, the last.
        for at in [0, 300, 599] {
            addrs[at] = 8;
        }
        let mut out = Vec::new();
        mem.read_words(&addrs, &mut out);
        assert_eq!(out.len(), values.len());
        for (i, (got, want)) in out.iter().zip(&values).enumerate() {
            if [0, 300, 599].contains(&i) {
                assert_eq!(*got, None, "word {i}");
            } else {
                assert_eq!(*got, Some(*want), "word {i}");
            }
        }
        mem.read_words(&[], &mut out);
        assert!(out.is_empty());
    }
}
