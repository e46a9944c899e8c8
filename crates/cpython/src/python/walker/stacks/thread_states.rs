//! The thread states of every interpreter, and which hold a GIL: where each walk
//! starts. Apart from the frame walk: these lists are read once per sample,
//! before any frame chain is followed.

use std::collections::{HashMap, HashSet};
use std::io;

use super::{Memory, RawThread, StackReader, MAX_INTERPRETERS, MAX_THREADS};
use crate::python::walker::layout::{FrameRoot, GilLayout};
use crate::python::walker::objects::{field_i32, field_u64, plausible_pointer, read_u64};

impl<M: Memory> StackReader<M> {
    /// How many subinterpreters the process has made since it started, running or
    /// gone: `_PyRuntime.interpreters.next_id` less the main one. The field follows
    /// `head` and `main` in `struct pyinterpreters` on 3.7 to 3.15 (checked in live
    /// 3.8, 3.9, 3.11, 3.12, 3.13 and 3.15 making one). `None` when it cannot be
    /// read or holds no plausible count.
    pub(crate) fn subinterpreters_made(&self) -> Option<u64> {
        let at = self.runtime + self.layout.runtime_interpreters_head + 16;
        let next_id = read_u64(&self.mem, at).ok()?;
        (1..=1 << 32).contains(&next_id).then(|| next_id - 1)
    }

    /// The interpreters of the process, newest first (the main one, made first,
    /// is the last), each with the head of its thread list; and whether the list
    /// was read to its end (not cut by a read that failed, a loop or
    /// `MAX_INTERPRETERS`). Fails only if `_PyRuntime` itself cannot be read.
    pub(crate) fn interpreters(&self) -> io::Result<(Vec<(u64, u64)>, bool)> {
        let l = &self.layout;
        let mut interp = read_u64(&self.mem, self.runtime + l.runtime_interpreters_head)?;
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        while plausible_pointer(interp) {
            if seen.len() >= MAX_INTERPRETERS || !seen.insert(interp) {
                return Ok((out, false));
            }
            let Ok((head, next_interp)) =
                self.two_fields(interp, l.interp_threads_head, l.interp_next)
            else {
                return Ok((out, false));
            };
            out.push((interp, head));
            interp = next_interp;
        }
        Ok((out, true))
    }

    /// Every thread state of every interpreter, with its bytes (the span the walker
    /// uses), oldest thread first per interpreter: the main thread first. Fails only if
    /// `_PyRuntime` itself cannot be read.
    pub(crate) fn thread_states(&self) -> io::Result<Vec<(u64, Vec<u8>)>> {
        let l = &self.layout;
        let span = l.tstate_span() as usize;
        let mut out = Vec::new();
        let mut chains = HashMap::new();
        let last_chains = std::mem::take(&mut *self.last_chains.borrow_mut());
        for (_, head) in self.interpreters()?.0 {
            let mut threads = Vec::new();
            let mut tstate = head;
            let mut seen_threads = HashSet::new();
            // The list as it was last time, read at once (a thread state each
            // read apart cost a system call each): taken while each state is the
            // one the list leads to now, then read on one by one.
            if let Some(guess) = last_chains.get(&head) {
                let guess = &guess[..guess.len().min(MAX_THREADS.saturating_sub(out.len()))];
                let mut bytes = vec![0u8; span * guess.len()];
                let read = self.mem.read_blocks(guess, span, &mut bytes);
                for (&addr, buf) in guess[..read].iter().zip(bytes.chunks(span)) {
                    if addr != tstate || !plausible_pointer(tstate) || !seen_threads.insert(tstate)
                    {
                        break;
                    }
                    let Ok(next) = field_u64(buf, l.tstate_next) else {
                        break;
                    };
                    threads.push((tstate, buf.to_vec()));
                    tstate = next;
                }
            }
            while plausible_pointer(tstate)
                && out.len() + threads.len() < MAX_THREADS
                && seen_threads.insert(tstate)
            {
                let mut buf = vec![0u8; l.tstate_span() as usize];
                if self.mem.read_exact(tstate, &mut buf).is_err() {
                    break;
                }
                let Ok(next) = field_u64(&buf, l.tstate_next) else {
                    break;
                };
                threads.push((tstate, buf));
                tstate = next;
            }
            chains.insert(head, threads.iter().map(|(t, _)| *t).collect());
            // New thread states are pushed at the head: reverse for oldest first.
            out.extend(threads.into_iter().rev());
        }
        *self.last_chains.borrow_mut() = chains;
        Ok(out)
    }

    /// The thread states holding a GIL now (one per GIL at most; none while no thread
    /// holds it), or `None` when that cannot be told: this version's GIL offsets are
    /// unknown, or something on the way could not be read.
    pub(crate) fn gil_holders(&self) -> Option<Vec<u64>> {
        match self.layout.gil? {
            GilLayout::RuntimeCurrent { tstate_current } => {
                let current =
                    read_u64(&self.mem, self.runtime.checked_add(tstate_current)?).ok()?;
                Some(if current == 0 { vec![] } else { vec![current] })
            }
            GilLayout::Interpreter {
                ceval_gil,
                last_holder,
                locked,
            } => {
                let l = &self.layout;
                let mut interp =
                    read_u64(&self.mem, self.runtime + l.runtime_interpreters_head).ok()?;
                let (lo, hi) = (last_holder.min(locked), last_holder.max(locked) + 8);
                let mut buf = vec![0u8; (hi - lo) as usize];
                let mut seen = HashSet::new();
                let mut gils = HashSet::new();
                let mut holders = Vec::new();
                while plausible_pointer(interp)
                    && seen.len() < MAX_INTERPRETERS
                    && seen.insert(interp)
                {
                    let (gil, next) = self.two_fields(interp, ceval_gil, l.interp_next).ok()?;
                    if !plausible_pointer(gil) {
                        return None;
                    }
                    // Interpreters may share one GIL (the main interpreter's).
                    if gils.insert(gil) {
                        self.mem.read_exact(gil.checked_add(lo)?, &mut buf).ok()?;
                        let holder = field_u64(&buf, last_holder - lo).ok()?;
                        // 1 while held; 0 free; -1 not initialised yet.
                        if field_i32(&buf, locked - lo).ok()? > 0 && holder != 0 {
                            holders.push(holder);
                        }
                    }
                    interp = next;
                }
                Some(holders)
            }
        }
    }

    /// Two pointer fields of one structure: one read when they are near each other.
    fn two_fields(&self, addr: u64, a: u64, b: u64) -> io::Result<(u64, u64)> {
        let (lo, hi) = (a.min(b), a.max(b) + 8);
        if hi - lo <= 4096 {
            let mut buf = [0u8; 4096];
            let buf = &mut buf[..(hi - lo) as usize];
            self.mem.read_exact(addr + lo, buf)?;
            Ok((field_u64(buf, a - lo)?, field_u64(buf, b - lo)?))
        } else {
            Ok((
                read_u64(&self.mem, addr + a)?,
                read_u64(&self.mem, addr + b)?,
            ))
        }
    }

    /// A thread state's thread id (`pthread_t`), from its bytes (0: unreadable).
    pub(crate) fn thread_id_of(&self, buf: &[u8]) -> u64 {
        field_u64(buf, self.layout.tstate_thread_id).unwrap_or(0)
    }

    /// A thread state's `native_thread_id` (3.11+), from its bytes.
    pub(crate) fn native_id_of(&self, buf: &[u8]) -> Option<i32> {
        self.layout
            .tstate_native_thread_id
            .and_then(|o| field_i32(buf, o).ok())
            .filter(|&t| t > 0)
    }

    /// A thread state's ids and innermost frame (`None`: unreadable), from its bytes.
    pub(crate) fn thread_header(&self, tstate: u64, buf: &[u8]) -> (RawThread, Option<u64>) {
        let mut raw = RawThread {
            thread_state: tstate,
            thread_id: self.thread_id_of(buf),
            native_id: self.native_id_of(buf),
            frames: Vec::new(),
            truncated: false,
            eval_calls: None,
            torn: false,
            kept: false,
        };
        let frame = self.innermost_of(buf);
        if frame.is_none() {
            raw.truncated = true;
        }
        (raw, frame)
    }

    /// The innermost frame a thread state's bytes point to (`None`: unreadable).
    fn innermost_of(&self, buf: &[u8]) -> Option<u64> {
        match self.layout.tstate_frame {
            FrameRoot::Direct(o) => field_u64(buf, o).ok(),
            FrameRoot::CFrame {
                cframe,
                current_frame,
            } => field_u64(buf, cframe)
                .ok()
                .filter(|&c| plausible_pointer(c))
                .and_then(|c| read_u64(&self.mem, c + current_frame).ok()),
        }
    }
}
