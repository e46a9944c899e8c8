//! The guardian process itself: it listens to the tracer's pipe, keeping what each
//! message says must be undone, and once the tracer is gone undoes it all, in the
//! order that closes the window fastest. Apart from the tracer's end (`mod.rs`),
//! which runs in pyprobe, not here.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::time::{Duration, Instant};

use nix::sys::signal::{signal, SigHandler, Signal};

use crate::ring::format::{H_ALIVE, H_SOLO};

use super::injection::{
    finish_injection, regs_from_bytes, Injection, BORROWED_BYTES, INJECTION_PAYLOAD, REGS_BYTES,
};
use super::undo::{restore_ring, RingSite, SilencedTool, Undo};
use super::watch::{self, Control, Verdict, Watch};
use super::{Op, MSG_LEN, RING_PAYLOAD, SITE_BYTES, TOOL_PAYLOAD};

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

pub(super) fn run_guardian(mut pipe: File, control: &Control, mut watch: Watch) -> i32 {
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
            x if x == Op::ToolSilenced as u8 => {
                let mut payload = [0u8; TOOL_PAYLOAD];
                if pipe.read_exact(&mut payload).is_err() {
                    break;
                }
                undo.tool = SilencedTool::from_payload(addr, &payload);
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
    // What the target undid itself is not undone again.
    let mut let_go = 0;
    for (&pid, undo) in state.iter_mut() {
        let_go += undo.take_back_held(pid);
    }
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
    // A tool the program silenced is freed last: nothing waits on it.
    let mut tool_notes = Vec::new();
    for (&pid, undo) in &state {
        let Some(tool) = &undo.tool else { continue };
        tool_notes.push(match tool.free(pid, undo) {
            Ok(true) => format!(
                "pyprobe guardian: process {pid}: gave sys.monitoring tool {} back (the program \
                 had turned its events off, so pyprobe's hook could not)",
                tool.tool
            ),
            Ok(false) => continue,
            Err(why) => format!(
                "pyprobe guardian: process {pid}: sys.monitoring tool {} stays held by \
                 \"pyprobe\" ({why}); `sys.monitoring.free_tool_id({})` in the program frees it",
                tool.tool, tool.tool
            ),
        });
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
    if let_go > 0 {
        eprintln!(
            "pyprobe guardian: {let_go} semaphores had been lowered by the target itself \
             (pyprobe was silent before it died)"
        );
    }
    for note in injection_notes.into_iter().chain(tool_notes) {
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
