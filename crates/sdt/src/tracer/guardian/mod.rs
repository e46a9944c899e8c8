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
//!
//! Ring sites (a `jmp rel32` to a trampoline) come last, and not with the threads
//! running: a thread entering a site while its bytes change would run a torn jump,
//! whatever the order of the writes (see `ring`, "Restoring"). Left in place a jump
//! is harmless (its trampoline and ring stay mapped; a full ring only counts losses),
//! so the guardian stops every thread of the process with ptrace, now that the
//! tracer's link is gone, writes the original bytes, and lets them go. Where it
//! cannot stop them (another tracer, a thread that does not stop), the jumps stay,
//! and the next pyprobe recognises and takes them over.
//!
//! A thread running a system call pyprobe injected (see `inject`) has pyprobe's
//! registers until pyprobe puts its own back. The call goes through a spin loop
//! borrowed at the program's entry point, so a tracer dying meanwhile leaves the
//! thread spinning there, not running the program's code with foreign registers; the
//! guardian stops it, gives it the registers it was told, and puts the borrowed
//! bytes back.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::sys::ptrace;
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::unistd::{fork, pipe2, ForkResult, Pid};

mod injection;
mod stops;
mod watch;

pub use injection::GuardianLink;
use injection::{
    finish_injection, regs_from_bytes, Injection, BORROWED_BYTES, INJECTION_PAYLOAD, REGS_BYTES,
};
use stops::hold;
use watch::{Control, Verdict, Watch};

use crate::process::status::start_time;
use crate::ring::format::{H_ALIVE, H_SOLO};
use crate::tracer::patch::{INT3, NOP};

pub(super) const MSG_LEN: usize = 13;
/// Bytes of a ring site's original and patch in a [`Op::RingSiteArmed`] message.
const SITE_BYTES: usize = 24;
/// After the 13-byte head of [`Op::RingSiteArmed`]: length, original, patch.
const RING_PAYLOAD: usize = 1 + 2 * SITE_BYTES;
/// How long the guardian waits for the dead tracer's ptrace link to go and for
/// the target's threads to stop, before it leaves the ring jumps in place.
pub(super) const HOLD_LIMIT: Duration = Duration::from_secs(2);

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
    /// A ring jump is about to be written at `addr` over the site's `int3`; the
    /// message goes on with the original bytes and the jump (see [`Guardian::tell_ring_site`]).
    /// `SiteRestored` ends it, `SiteArmed` makes it an `int3` site again.
    RingSiteArmed = 7,
    /// A system call is about to be injected in a thread through a spin loop written
    /// at `addr`; the message goes on with the thread, the bytes the loop replaces
    /// and the thread's registers (see [`GuardianLink::tell_injection`]).
    Injecting = 8,
    /// The injected call is over: the thread has its registers, `addr` its bytes.
    /// `addr` holds the thread id.
    Injected = 9,
    /// A ring is about to be served: `addr` is its `alive` word in the target. Should
    /// the tracer die, the guardian writes 0 there first, so that producers waiting
    /// for room in the ring stop waiting at once.
    RingServed = 10,
}

/// The tracer's end of the link.
pub struct Guardian {
    pipe: File,
    guardian_pid: i32,
    /// What pyprobe and the guardian say to each other about pyprobe being stopped
    /// (see `watch`).
    control: Control,
}

impl Guardian {
    /// Forks the guardian, which watches the calling thread (pyprobe's tracing
    /// thread). Call before the process creates threads: the child goes on running
    /// Rust code from a copy of a single-threaded process.
    pub fn spawn() -> Result<Guardian> {
        let (read_end, write_end) =
            pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("cannot create the guardian pipe")?;
        let control = Control::new().context("cannot map the guardian's control page")?;
        // SAFETY: getpid and gettid cannot fail.
        let tracer = unsafe { (libc::getpid(), libc::gettid()) };
        // SAFETY: pyprobe is single-threaded here (the guardian is started first).
        match unsafe { fork() }.context("cannot fork the guardian")? {
            ForkResult::Child => {
                drop(write_end);
                // A session of its own: whatever ends pyprobe's process group
                // (`kill -9 -PGID`, `timeout -s KILL`, a terminal's hang-up or Ctrl-Z)
                // does not end or stop the guardian with it.
                // SAFETY: setsid has no preconditions; a failure leaves it as it was.
                unsafe { libc::setsid() };
                let watch = Watch::new(tracer.0, tracer.1);
                let code = run_guardian(File::from(read_end), &control, watch);
                // SAFETY: leave without running the parent's destructors or atexit.
                unsafe { libc::_exit(code) }
            }
            ForkResult::Parent { child } => {
                drop(read_end);
                Ok(Guardian {
                    pipe: File::from(write_end),
                    guardian_pid: child.as_raw(),
                    control,
                })
            }
        }
    }

    /// Says whether pyprobe holds nothing of the target (paused, about to stop
    /// itself): the guardian leaves a paused pyprobe stopped.
    pub fn set_paused(&self, paused: bool) {
        self.control.set_paused(paused);
    }

    /// If the guardian found pyprobe stopped by a signal it cannot catch while it
    /// held the target, and continued it so that it lets go: how long it had been
    /// stopped (ms). Taken once.
    pub fn take_release(&self) -> Option<u64> {
        self.control.take_release()
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

    /// Tells the guardian that `patch` is about to replace `original` at the ring
    /// site `addr` (as [`Guardian::tell`]: a failure means do not patch).
    pub fn tell_ring_site(
        &mut self,
        pid: i32,
        addr: u64,
        original: &[u8],
        patch: &[u8],
    ) -> std::io::Result<()> {
        let len = original.len();
        if len == 0 || len > SITE_BYTES || patch.len() != len {
            return Err(std::io::Error::other(format!(
                "ring site {addr:#x} of process {pid}: {len} original and {} patch bytes \
                 do not fit the guardian's message",
                patch.len()
            )));
        }
        let mut msg = [0u8; MSG_LEN + RING_PAYLOAD];
        msg[0] = Op::RingSiteArmed as u8;
        msg[1..5].copy_from_slice(&pid.to_le_bytes());
        msg[5..13].copy_from_slice(&addr.to_le_bytes());
        msg[13] = len as u8;
        msg[14..14 + len].copy_from_slice(original);
        msg[14 + SITE_BYTES..14 + SITE_BYTES + len].copy_from_slice(patch);
        // One write of less than PIPE_BUF: the guardian reads it whole or not at all.
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

    /// Another writer on the pipe (see [`GuardianLink`]).
    pub fn link(&self) -> std::io::Result<GuardianLink> {
        Ok(GuardianLink {
            pipe: self.pipe.try_clone()?,
        })
    }
}

/// A ring site: the bytes to put back, and the jump that replaced them.
struct RingSite {
    original: Vec<u8>,
    patch: Vec<u8>,
}

#[derive(Default)]
pub(super) struct Undo {
    sites: HashSet<u64>,
    ring: HashMap<u64, RingSite>,
    semaphores: HashMap<u64, u32>,
    /// The `alive` word of each ring pyprobe serves in the process.
    served: HashSet<u64>,
    /// `/proc/PID/mem`, opened while the tracer is alive so that undoing costs only
    /// reads and writes when every microsecond counts.
    mem: Option<File>,
    /// The process's start time when `mem` was opened, so that the guardian never
    /// stops another process that got the same pid since.
    started: Option<u64>,
}

impl Undo {
    fn open(&mut self, pid: i32) {
        if self.mem.is_none() {
            self.mem = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(format!("/proc/{pid}/mem"))
                .ok();
            self.started = start_time(pid);
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

    /// A ring site still holding the `int3` its jump was about to replace gets its
    /// `nop` back at once, like any `int3` site (one byte: safe with threads running).
    fn restore_unpatched_ring(&self, site: u64, ring: &RingSite) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(mem) = &self.mem else { return false };
        let mut now = vec![0u8; ring.patch.len()];
        if mem.read_exact_at(&mut now, site).is_err() {
            return false;
        }
        match ring_fix(&now, ring) {
            Some(fix) if fix.len() == 1 => mem.write_all_at(fix, site).is_ok(),
            _ => false,
        }
    }

    fn write_word(&self, addr: u64, value: u64) -> bool {
        use std::os::unix::fs::FileExt;
        self.mem
            .as_ref()
            .is_some_and(|mem| mem.write_all_at(&value.to_le_bytes(), addr).is_ok())
    }

    fn restore(&self, site: u64) -> bool {
        use std::os::unix::fs::FileExt;
        self.mem
            .as_ref()
            .is_some_and(|mem| mem.write_all_at(&[NOP], site).is_ok())
    }
}

/// What to write at a ring site found holding `now` to give it its original bytes
/// back: all of them over the jump; only the first over the `int3` that the jump
/// was about to replace (the tracer died between telling and writing); nothing
/// over anything else (restored already, or not pyprobe's any more).
fn ring_fix<'a>(now: &[u8], site: &'a RingSite) -> Option<&'a [u8]> {
    let original = site.original.as_slice();
    if now == site.patch {
        Some(original)
    } else if now.first() == Some(&INT3) && now.get(1..) == original.get(1..) {
        original.get(..1)
    } else {
        None
    }
}

/// Puts the original bytes back at the ring sites of `pid`, with every thread of
/// it stopped. Returns how many it restored and, if it left some, how many and why.
fn restore_ring(pid: i32, undo: &Undo) -> (usize, Option<(usize, String)>) {
    use std::os::unix::fs::FileExt;
    let all = undo.ring.len();
    let Some(mem) = &undo.mem else {
        return (0, Some((all, "its memory could not be opened".into())));
    };
    let Some(started) = undo.started else {
        return (0, Some((all, "its start time could not be read".into())));
    };
    if start_time(pid) != Some(started) {
        return (0, None); // exited: nothing left to restore
    }
    let held = match hold(pid, Instant::now() + HOLD_LIMIT) {
        Ok(held) => held,
        Err(why) => {
            return (
                0,
                Some((all, format!("its threads could not be stopped: {why}"))),
            )
        }
    };
    let mut rips = Vec::new();
    for &(tid, _) in &held.threads {
        match ptrace::getregs(Pid::from_raw(tid)) {
            Ok(regs) => rips.push(regs.rip),
            Err(e) => {
                return (
                    0,
                    Some((all, format!("its thread {tid} cannot be read: {e}"))),
                )
            }
        }
    }
    let mut restored = 0;
    let mut left = 0;
    for (&addr, site) in &undo.ring {
        let end = addr.saturating_add(site.original.len() as u64);
        // Only a signal frame could put a thread there; its code must stay.
        if rips.iter().any(|&rip| rip > addr && rip < end) {
            left += 1;
            continue;
        }
        let mut now = vec![0u8; site.patch.len()];
        if mem.read_exact_at(&mut now, addr).is_err() {
            left += 1;
            continue;
        }
        match ring_fix(&now, site) {
            Some(bytes) if mem.write_all_at(bytes, addr).is_ok() => restored += 1,
            Some(_) => left += 1,
            None => {}
        }
    }
    drop(held);
    let why = (left > 0).then(|| {
        (
            left,
            "a thread stood inside them, or their memory could not be read or written".into(),
        )
    });
    (restored, why)
}

/// What the guardian's next look at its pipe found.
enum Heard {
    /// A whole message, in `msg`.
    Message,
    /// Nothing yet.
    Quiet,
    /// End of file or a broken pipe: the tracer is gone.
    Gone,
}

/// Waits at most `timeout` for the next message.
fn listen(pipe: &mut File, msg: &mut [u8; MSG_LEN], timeout: Duration) -> Heard {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: pipe.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut fd, 1, timeout.as_millis() as libc::c_int) };
    if n == 0
        || (n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted)
    {
        return Heard::Quiet;
    }
    // Readable, or its writers are gone (POLLHUP): messages are single writes below
    // PIPE_BUF, so a readable pipe holds a whole one, or the end of file.
    match pipe.read_exact(msg) {
        Ok(()) => Heard::Message,
        Err(_) => Heard::Gone,
    }
}

fn run_guardian(mut pipe: File, control: &Control, mut watch: Watch) -> i32 {
    // Ctrl-C, hang-ups and job control reach the whole process group (and the
    // guardian has left it, see `spawn`): the guardian outlives them, is never
    // stopped by them, and ends only when the tracer is gone.
    for sig in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGPIPE,
        Signal::SIGALRM,
        Signal::SIGTSTP,
        Signal::SIGTTIN,
        Signal::SIGTTOU,
    ] {
        // SAFETY: setting a signal to ignored.
        let _ = unsafe { signal(sig, SigHandler::SigIgn) };
    }
    // Close every inherited descriptor but the pipe and stdio: the guardian must not
    // keep the target's pipes or pyprobe's output file open.
    close_other_fds(&pipe);
    let mut state: HashMap<i32, Undo> = HashMap::new();
    let mut injections: HashMap<i32, Injection> = HashMap::new();
    let mut msg = [0u8; MSG_LEN];
    // Until EOF (the tracer died) or a broken pipe; between messages, a look at
    // whether the tracer is stopped while it holds the target.
    loop {
        match watch.look(control, Instant::now()) {
            Verdict::Fine => {}
            Verdict::AskRelease { stopped_ms } => {
                stop_waiting(&state);
                watch.ask(control, stopped_ms);
            }
            Verdict::End { state: letter } => {
                eprintln!(
                    "pyprobe guardian: pyprobe (process {}) stays stopped ({}) and holds the \
                     program it traces; ending pyprobe so that the program runs on, its probes \
                     undone",
                    watch.pid(),
                    if letter == 't' {
                        "held by a debugger"
                    } else {
                        "by a signal"
                    }
                );
                watch.end();
            }
        }
        match listen(&mut pipe, &mut msg, watch::LOOK_EVERY) {
            Heard::Message => {}
            Heard::Quiet => continue,
            Heard::Gone => break,
        }
        let pid = i32::from_le_bytes([msg[1], msg[2], msg[3], msg[4]]);
        let addr = u64::from_le_bytes(msg[5..13].try_into().unwrap_or([0; 8]));
        let undo = state.entry(pid).or_default();
        if msg[0] != Op::Forget as u8 && msg[0] != Op::Done as u8 {
            undo.open(pid);
        }
        match msg[0] {
            x if x == Op::SiteArmed as u8 => {
                undo.ring.remove(&addr);
                undo.sites.insert(addr);
            }
            x if x == Op::SiteRestored as u8 => {
                undo.sites.remove(&addr);
                undo.ring.remove(&addr);
            }
            x if x == Op::RingSiteArmed as u8 => {
                let mut payload = [0u8; RING_PAYLOAD];
                if pipe.read_exact(&mut payload).is_err() {
                    break;
                }
                let len = usize::from(payload[0]).min(SITE_BYTES);
                let original = payload[1..1 + len].to_vec();
                let patch = payload[1 + SITE_BYTES..1 + SITE_BYTES + len].to_vec();
                undo.sites.remove(&addr);
                undo.ring.insert(addr, RingSite { original, patch });
            }
            x if x == Op::Injecting as u8 => {
                let mut payload = [0u8; INJECTION_PAYLOAD];
                if pipe.read_exact(&mut payload).is_err() {
                    break;
                }
                let tid = i32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
                let len = usize::from(payload[4]).min(BORROWED_BYTES);
                let mut regs = [0u8; REGS_BYTES];
                regs.copy_from_slice(&payload[5 + BORROWED_BYTES..]);
                injections.insert(
                    tid,
                    Injection {
                        pid,
                        addr,
                        borrowed: payload[5..5 + len].to_vec(),
                        regs: regs_from_bytes(&regs),
                    },
                );
            }
            x if x == Op::RingServed as u8 => {
                undo.served.insert(addr);
            }
            x if x == Op::Injected as u8 => {
                injections.remove(&(addr as i32));
            }
            x if x == Op::SemaphoreRaised as u8 => *undo.semaphores.entry(addr).or_insert(0) += 1,
            x if x == Op::SemaphoreLowered as u8 => {
                if let Some(n) = undo.semaphores.get_mut(&addr) {
                    *n = n.saturating_sub(1);
                }
            }
            x if x == Op::Forget as u8 => {
                state.remove(&pid);
                injections.retain(|_, i| i.pid != pid);
            }
            x if x == Op::Done as u8 => return 0,
            _ => {}
        }
    }
    let start = crate::tracer::clock::monotonic_ns();
    stop_waiting(&state);
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
        for (&site, ring) in &undo.ring {
            if undo.restore_unpatched_ring(site, ring) {
                restored.0 += 1;
            }
        }
    }
    // A thread left in an injected call spins in its loop, harming no one but
    // itself: it gets its registers back before the ring sites are seen to.
    let mut injection_notes = Vec::new();
    for (&tid, injection) in &injections {
        let Some(undo) = state.get(&injection.pid) else {
            continue;
        };
        if let Err(why) = finish_injection(tid, injection, undo) {
            injection_notes.push(format!(
                "pyprobe guardian: process {}: thread {tid} was running a system call for \
                 pyprobe and could not be given its registers back: {why}; it spins at {:#x}",
                injection.pid, injection.addr
            ));
        }
    }
    // Ring jumps last: harmless meanwhile, and they need the threads stopped.
    let mut ring_restored = 0;
    let mut ring_left = Vec::new();
    for (&pid, undo) in &state {
        if undo.ring.is_empty() {
            continue;
        }
        let (n, left) = restore_ring(pid, undo);
        ring_restored += n;
        if let Some((left, why)) = left {
            ring_left.push((pid, left, why));
        }
    }
    let took = crate::tracer::clock::monotonic_ns().saturating_sub(start);
    if !state
        .values()
        .all(|u| u.sites.is_empty() && u.ring.is_empty() && u.semaphores.values().all(|&n| n == 0))
    {
        eprintln!(
            "pyprobe guardian: pyprobe died; restored {} probe sites ({ring_restored} of them ring jumps) \
             and lowered {} semaphores in {} process(es) in {} µs",
            restored.0 + ring_restored,
            restored.1,
            state.len(),
            took / 1000
        );
    }
    for note in injection_notes {
        eprintln!("{note}");
    }
    for (pid, left, why) in ring_left {
        eprintln!(
            "pyprobe guardian: process {pid}: {left} ring jumps left in place ({why}); harmless \
             (their trampolines stay mapped), and the next pyprobe attaching takes them over"
        );
    }
    0
}

/// Nobody reads the rings any more (or not for a while): producers waiting for room
/// go on at once. And they reserve with `lock`: nobody follows their threads.
fn stop_waiting(state: &HashMap<i32, Undo>) {
    for undo in state.values() {
        for &alive in &undo.served {
            undo.write_word(alive, 0);
            let solo = alive
                .wrapping_sub(H_ALIVE as u64)
                .wrapping_add(H_SOLO as u64);
            undo.write_word(solo, 0);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_sites_get_their_original_bytes_only_over_pyprobes_own() {
        let site = RingSite {
            original: vec![0x90, 0x48, 0x8b, 0x4b, 0x20],
            patch: vec![0xe9, 1, 2, 3, 4],
        };
        // The jump: every original byte back.
        assert_eq!(ring_fix(&site.patch, &site), Some(&site.original[..]));
        // The int3 the jump was about to replace: its nop back.
        assert_eq!(
            ring_fix(&[0xcc, 0x48, 0x8b, 0x4b, 0x20], &site),
            Some(&[0x90][..])
        );
        // Restored already, or someone else's bytes: left alone.
        assert_eq!(ring_fix(&site.original, &site), None);
        assert_eq!(ring_fix(&[0xe9, 9, 9, 9, 9], &site), None);
        assert_eq!(ring_fix(&[0xcc, 0, 0, 0, 0], &site), None);
    }

    #[test]
    fn a_ring_site_message_holds_both_byte_strings() {
        let (read_end, write_end) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let mut g = Guardian {
            pipe: File::from(write_end),
            guardian_pid: 0,
            control: Control::new().expect("control page"),
        };
        let original = [0x90, 0x55, 0x48, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8];
        let patch = [0xe9, 1, 2, 3, 4, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc];
        g.tell_ring_site(42, 0x1234, &original, &patch)
            .expect("told");
        // Too long for the message, or mismatched: refused, so never patched.
        assert!(g
            .tell_ring_site(42, 0x1234, &[0x90; 25], &[0xcc; 25])
            .is_err());
        assert!(g
            .tell_ring_site(42, 0x1234, &original, &patch[..5])
            .is_err());
        drop(g);
        let mut msg = Vec::new();
        File::from(read_end).read_to_end(&mut msg).expect("read");
        assert_eq!(msg.len(), MSG_LEN + RING_PAYLOAD);
        assert_eq!(msg[0], Op::RingSiteArmed as u8);
        assert_eq!(msg[13], 12);
        assert_eq!(&msg[14..26], &original);
        assert_eq!(&msg[14 + SITE_BYTES..26 + SITE_BYTES], &patch);
    }
}
