//! Decoding one probe hit without allocating: argument values into a reused
//! buffer, and every string argument fetched with one `process_vm_readv` (one iovec
//! per string) into reused buffers. A string longer than the first read, or one the
//! batched read could not reach, is finished by a bounded page-wise read.

use std::io::IoSliceMut;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

use crate::process::memory::{ProcessMemory, MAX_STRING};
use crate::sdt;

use super::regs::Registers;
use crate::probe_set::{Probe, Site};

/// Bytes read per string in the batched read; most file and function names fit.
const FIRST_READ: usize = 192;
/// Most string arguments a probe may have (CPython's have two).
const MAX_STRINGS: usize = 4;

/// Reused buffers for one hit's decoded arguments.
#[derive(Default, Debug)]
pub struct HitBuffers {
    pub args: Vec<u64>,
    /// `strings[i]` is meaningful when `present[i]`.
    strings: Vec<String>,
    present: Vec<bool>,
    /// Changes whenever a string argument changes (its text, or whether it is
    /// there), and is never the same in two buffers: a consumer that saw this
    /// stamp before has seen these strings, and need not compare them again.
    stamp: u64,
    raw: Vec<[u8; FIRST_READ]>,
}

/// The source of [`HitBuffers`] stamps (0 is never given: a fresh buffer's
/// strings are not yet known).
static NEXT_STAMP: AtomicU64 = AtomicU64::new(1);

impl HitBuffers {
    /// Fills the buffers for a hit of `site` of `probe`.
    pub fn decode(
        &mut self,
        probe: &Probe,
        site: &Site,
        regs: &Registers,
        mem: &ProcessMemory,
        symbols: &dyn Fn(&str) -> Option<u64>,
    ) {
        let n = site.args.len();
        // A stop is rare next to ring records: its strings count as new.
        self.new_stamp();
        self.args.clear();
        for arg in &site.args {
            self.args
                .push(sdt::evaluate(arg, regs, mem, symbols).unwrap_or(0));
        }
        self.hold_strings(n);
        if self.raw.len() < MAX_STRINGS {
            self.raw.resize(MAX_STRINGS, [0; FIRST_READ]);
        }
        // Which arguments are strings to read, and where.
        let mut wanted = [(0usize, 0u64); MAX_STRINGS];
        let mut count = 0;
        for i in 0..n {
            self.present[i] = false;
            let is_string = probe.string_args.get(i).copied().unwrap_or(false);
            if is_string && self.args[i] != 0 && count < MAX_STRINGS {
                wanted[count] = (i, self.args[i]);
                count += 1;
            }
        }
        if count == 0 {
            return;
        }
        let got = self.batched_read(mem.pid(), &wanted[..count]);
        for (k, &(i, addr)) in wanted[..count].iter().enumerate() {
            let read = got.saturating_sub(k * FIRST_READ).min(FIRST_READ);
            let bytes = &self.raw[k][..read];
            let text = &mut self.strings[i];
            text.clear();
            match bytes.iter().position(|&b| b == 0) {
                Some(end) => push_lossy(text, &bytes[..end]),
                // Longer than the first read, or near an unmapped page: finish it with
                // the careful page-wise reader.
                None => match mem.read_c_string(addr, MAX_STRING) {
                    Ok(s) => text.push_str(&s),
                    Err(_) => continue,
                },
            }
            self.present[i] = true;
        }
    }

    /// Fills the buffers from a ring record of `probe`: its argument values, and
    /// its string prefixes, completed from the target's memory when the record
    /// had to cut them.
    pub(crate) fn fill_from_ring(
        &mut self,
        probe: &Probe,
        record: &crate::ring::RingRecord<'_>,
        mem: &ProcessMemory,
    ) {
        let n = record.nargs.min(record.args.len());
        self.args.clear();
        self.args.extend_from_slice(&record.args[..n]);
        self.hold_strings(n);
        let mut changed = false;
        for i in 0..self.present.len() {
            let was = std::mem::replace(&mut self.present[i], false);
            if i >= n || !probe.string_args.get(i).copied().unwrap_or(false) {
                changed |= was;
                continue;
            }
            let Some(s) = record.string(i) else {
                changed |= was;
                continue;
            };
            if s.null {
                changed |= was;
                continue;
            }
            self.present[i] = true;
            let text = &mut self.strings[i];
            // Most events repeat the last event's file or function name: equal bytes
            // are valid UTF-8 already (the buffer is a String) and need no copy.
            if was && !s.truncated && same_bytes(text.as_bytes(), s.bytes) {
                continue;
            }
            changed = true;
            text.clear();
            if s.truncated {
                match mem.read_c_string(self.args[i], MAX_STRING) {
                    Ok(full) => text.push_str(&full),
                    // Gone meanwhile: the prefix is what there is.
                    Err(_) => push_lossy(text, s.bytes),
                }
            } else {
                push_lossy(text, s.bytes);
            }
        }
        if changed {
            self.new_stamp();
        }
    }

    /// Sets the arguments to `args` and the string arguments to `texts` (the
    /// first ones), copying a text only when it differs from what is there.
    pub fn set(&mut self, args: &[u64], texts: &[&str]) {
        self.args.clear();
        self.args.extend_from_slice(args);
        self.hold_strings(texts.len());
        let mut changed = false;
        for was in &mut self.present[texts.len()..] {
            changed |= std::mem::replace(was, false);
        }
        for (i, text) in texts.iter().enumerate() {
            let was = std::mem::replace(&mut self.present[i], true);
            if was && self.strings[i] == *text {
                continue;
            }
            changed = true;
            self.strings[i].clear();
            self.strings[i].push_str(text);
        }
        if changed {
            self.new_stamp();
        }
    }

    /// Makes room for `n` string arguments (`strings` and `present` always have
    /// the same length).
    fn hold_strings(&mut self, n: usize) {
        if self.strings.len() < n {
            self.strings.resize_with(n, String::new);
            self.present.resize(n, false);
        }
    }

    /// What the strings are now, as a stamp (see the field).
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp
    }

    fn new_stamp(&mut self) {
        self.stamp = NEXT_STAMP.fetch_add(1, Ordering::Relaxed);
    }

    /// One `process_vm_readv` with one iovec per string; returns the bytes read (the
    /// kernel stops at the first iovec it cannot fully read).
    fn batched_read(&mut self, pid: i32, wanted: &[(usize, u64)]) -> usize {
        let mut remote = [RemoteIoVec { base: 0, len: 0 }; MAX_STRINGS];
        for (k, &(_, addr)) in wanted.iter().enumerate() {
            remote[k] = RemoteIoVec {
                base: addr as usize,
                len: FIRST_READ,
            };
        }
        let (a, rest) = self.raw.split_at_mut(1);
        let (b, rest) = rest.split_at_mut(1);
        let (c, d) = rest.split_at_mut(1);
        let mut local = [
            IoSliceMut::new(&mut a[0]),
            IoSliceMut::new(&mut b[0]),
            IoSliceMut::new(&mut c[0]),
            IoSliceMut::new(&mut d[0]),
        ];
        let k = wanted.len();
        process_vm_readv(Pid::from_raw(pid), &mut local[..k], &remote[..k]).unwrap_or(0)
    }

    /// The string argument `i` of the last decoded hit.
    pub fn string(&self, i: usize) -> Option<&str> {
        (self.present.get(i) == Some(&true)).then(|| self.strings[i].as_str())
    }
}

/// `a == b`, inline and a word at a time: the strings of a record are short (a
/// file or function name), and comparing them with the previous record's is done
/// for every record, where a call to `memcmp` costs more than the comparison.
#[inline]
pub(crate) fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (words_a, words_b) = (a.chunks_exact(8), b.chunks_exact(8));
    let (rest_a, rest_b) = (words_a.remainder(), words_b.remainder());
    let word = |w: &[u8]| u64::from_ne_bytes(w.try_into().unwrap_or([0; 8]));
    words_a.zip(words_b).all(|(x, y)| word(x) == word(y))
        && rest_a.iter().zip(rest_b).all(|(x, y)| x == y)
}

fn push_lossy(out: &mut String, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(s) => out.push_str(s),
        Err(_) => out.push_str(&String::from_utf8_lossy(bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The word-at-a-time comparison agrees with `==` whatever the lengths and
    /// wherever the first difference lies (in a word or in the remainder).
    #[test]
    fn same_bytes_is_equality() {
        let base: Vec<u8> = (0..40u8).map(|b| b.wrapping_mul(37) | 1).collect();
        for len in 0..=base.len() {
            let a = &base[..len];
            assert!(same_bytes(a, a));
            for other in 0..=base.len() {
                assert_eq!(same_bytes(a, &base[..other]), len == other);
            }
            for at in 0..len {
                let mut b = a.to_vec();
                b[at] ^= 0x40;
                assert!(!same_bytes(a, &b), "len {len}, difference at {at}");
            }
        }
    }

    /// Decodes against pyprobe's own memory: short and long strings, a null pointer.
    #[test]
    fn strings_short_long_and_null() {
        let short = std::ffi::CString::new("fib").unwrap();
        let long = std::ffi::CString::new("x".repeat(700)).unwrap();
        // SAFETY: user_regs_struct is plain integers; all zeros is a valid value.
        let mut raw: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        raw.rdi = short.as_ptr() as u64;
        raw.rsi = long.as_ptr() as u64;
        raw.rdx = 0;
        raw.rcx = 42;
        let regs = Registers(raw);
        let site = Site::new(0, sdt::parse_args("8@%rdi 8@%rsi 8@%rdx -4@%ecx").unwrap());
        let probe = Probe {
            name: "p".into(),
            semaphore: None,
            sites: vec![site.clone()],
            string_args: vec![true, true, true, false],
        };
        let mem = ProcessMemory::new(std::process::id() as i32);
        let mut buffers = HitBuffers::default();
        for _ in 0..2 {
            buffers.decode(&probe, &site, &regs, &mem, &|_| None);
            assert_eq!(buffers.string(0), Some("fib"));
            assert_eq!(buffers.string(1).map(str::len), Some(700));
            assert_eq!(buffers.string(2), None, "a null pointer is no string");
            assert_eq!(buffers.string(3), None, "not a string argument");
            assert_eq!(buffers.args[3], 42);
        }
        // Strings set by hand (the hook's records) between two decodes: the same
        // texts keep the stamp, others change it, and a decode after still fills
        // all four arguments.
        buffers.set(&[1, 2], &["f.py", "g"]);
        let stamp = buffers.stamp();
        buffers.set(&[3, 4], &["f.py", "g"]);
        assert_eq!(buffers.stamp(), stamp, "same strings, same stamp");
        assert_eq!(buffers.string(1), Some("g"));
        assert_eq!(buffers.string(2), None, "only two strings were set");
        buffers.set(&[3, 4], &["f.py", "h"]);
        assert_ne!(buffers.stamp(), stamp);
        buffers.decode(&probe, &site, &regs, &mem, &|_| None);
        assert_eq!(buffers.string(0), Some("fib"));
        assert_eq!(buffers.string(1).map(str::len), Some(700));
        assert_eq!(buffers.args[3], 42);
    }
}
