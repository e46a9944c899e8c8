//! What each turn of the event loop checks in the hooked processes: the state
//! page's `status` (the installer done, failed, or still to be woken; the hook
//! gone by itself) and, on the profile route, thread states without the hook.
//! Apart from placing and leaving: these run for as long as the hook is in.

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::hook::failed_step;
use crate::hook::{
    STATUS_OK, STATUS_REMOVED, STATUS_RUNNING, ST_AT_EXIT, ST_GONE, ST_STATUS, TOOL_ID,
};
use pyprobe_sdt::tracer::engine::source::SweepNeed;
use pyprobe_sdt::tracer::engine::TraceEvent;
use pyprobe_sdt::tracer::guardian::{Guardian, Op};
use pyprobe_sdt::tracer::signals::monotonic_ns;

use super::profile::Slot;
use super::tool::{monitoring_events, FirstLook, ToolLost, ToolSlots};
use super::{setup, HookBook, HookProc, Phase, RAISE_EVERY, RAISE_SLOWLY, SLOW_AFTER, SWEEP_EVERY};

/// How often the interpreters of a process traced through `sys.monitoring`, and
/// pyprobe's tool in its main one, are looked at.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// On the monitoring route, says once (a caveat) that calls in subinterpreters
/// are not traced when the process has any (`sys.monitoring` is per interpreter;
/// the detour installs the hook in the main one only), and once that the program
/// freed pyprobe's tool or replaced one of its callbacks.
///
/// `now_or_due`: look now (leaving: what happened since the last look is said
/// too), else only when the time has come.
pub(super) fn look_at_monitoring(
    pid: i32,
    h: &mut HookProc,
    now_or_due: bool,
    guardian: Option<&mut Guardian>,
    sink: &mut dyn FnMut(TraceEvent),
) {
    // Every turn, not every look: one read, and a subinterpreter that came and
    // went between two looks counts as well. (The profile route hooks every
    // interpreter's threads.)
    if !h.said_subinterpreters && h.profile.is_none() {
        if let Some(made) = h.walker.subinterpreters_made().filter(|&n| n > 0) {
            h.said_subinterpreters = true;
            sink(TraceEvent::Caveat {
                pid,
                ts_ns: monotonic_ns(),
                text: format!(
                    "the program runs subinterpreters ({made} made so far): calls made in them \
                     are not traced (sys.monitoring, which the hook uses on this CPython, is per \
                     interpreter, and pyprobe's hook is in the main one); `--mode sample` \
                     samples every interpreter's threads, and `--engine ring` traces them where \
                     the interpreter has function probes"
                ),
            });
        }
    }
    let now = Instant::now();
    match h.next_look {
        Some(_) if now_or_due => {}
        Some(at) if at <= now => {}
        _ => return,
    }
    h.next_look = Some(now + LOOK_EVERY);
    let gone_by_itself =
        |h: &HookProc| h.mem.read_u64(h.state_addr + ST_GONE as u64).unwrap_or(0) != 0;
    let lost = if h.tool_looked {
        h.tool.as_ref().and_then(|t| t.lost(&h.mem, &h.walker))
    } else {
        h.tool_looked = true;
        let events = monitoring_events(&h.walker);
        let look = match h.walker.main_interpreter() {
            Some(interp) => ToolSlots::look(&h.mem, &h.walker, interp, h.state_addr, &events),
            None => FirstLook::Unknown,
        };
        match look {
            FirstLook::Held(slots) => {
                // The program may have acted before this first look already.
                let lost = slots.lost(&h.mem, &h.walker);
                h.tool = Some(slots);
                lost
            }
            FirstLook::Lost(lost) => Some(lost),
            FirstLook::Unknown => {
                sink(TraceEvent::Detail(format!(
                    "hook engine in process {pid}: its sys.monitoring slots were not found in the \
                     main interpreter's state, so a program freeing tool {TOOL_ID} or replacing \
                     its callbacks would go unsaid"
                )));
                None
            }
        }
    };
    // The hook giving the tool back itself (pyprobe gone too long) is not the
    // program's doing: it sets `gone` first, and says so through `status`.
    if let Some(lost) = lost.filter(|_| !gone_by_itself(h)) {
        let slots = h.tool.take();
        if lost == ToolLost::EventsOff {
            // Should pyprobe die before it leaves, the guardian frees the tool.
            if let (Some(slots), Some(g)) = (&slots, guardian) {
                if let Err(e) = slots.tell_guardian(pid, g) {
                    sink(TraceEvent::Notice(format!(
                        "hook engine in process {pid}: cannot tell the guardian about \
                         sys.monitoring tool {TOOL_ID}: {e}; should pyprobe be killed, the \
                         program gets it back only by freeing it"
                    )));
                }
            }
            h.silenced = slots;
        }
        sink(TraceEvent::Caveat {
            pid,
            ts_ns: monotonic_ns(),
            text: lost.caveat(),
        });
    }
    if h.said_subinterpreters && h.tool.is_none() {
        h.next_look = None;
    }
}

impl HookBook {
    /// Hooks waiting for their installer: done, failed, or due to raise the
    /// breaker again (the pids returned, whose threads must be stopped to put the
    /// entry back or raise the breaker).
    pub(super) fn watch_status(
        &mut self,
        mut guardian: Option<&mut Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Vec<i32> {
        for (&pid, h) in self.procs.iter_mut() {
            if h.phase != Phase::Installed {
                continue;
            }
            let status = h.mem.read_u64(h.state_addr + ST_STATUS as u64).unwrap_or(0);
            if status == STATUS_REMOVED {
                h.phase = Phase::Failed;
                sink(TraceEvent::Caveat {
                    pid,
                    ts_ns: monotonic_ns(),
                    text: "the hook unregistered itself: pyprobe had not read its ring for 10 s \
                           (stopped?), so calls after that are not traced"
                        .into(),
                });
                continue;
            }
            look_at_monitoring(pid, h, false, guardian.as_deref_mut(), sink);
        }
        let mut stop_for = Vec::new();
        for (&pid, h) in self.procs.iter_mut() {
            if h.phase != Phase::Waiting {
                continue;
            }
            let status = h.mem.read_u64(h.state_addr + ST_STATUS as u64).unwrap_or(0);
            if status == STATUS_OK {
                h.phase = Phase::Installed;
                let exit_in = h
                    .mem
                    .read_u64(h.state_addr + ST_AT_EXIT as u64)
                    .unwrap_or(0)
                    != 0;
                sink(TraceEvent::Detail(format!(
                    "hook engine in process {pid}: installed after {} ms ({}); its exit callback {}",
                    h.since.elapsed().as_millis(),
                    if h.profile.is_some() {
                        "each thread's profile function"
                    } else {
                        "sys.monitoring tool 4"
                    },
                    if exit_in {
                        "registered with atexit"
                    } else {
                        "not taken by atexit yet (the interpreter is starting): tried again as \
                         calls come"
                    }
                )));
            } else if status != 0 && status != STATUS_RUNNING {
                h.phase = Phase::Failed;
                sink(TraceEvent::Caveat {
                    pid,
                    ts_ns: monotonic_ns(),
                    text: format!(
                        "the hook could not register with sys.monitoring ({}), so no calls are \
                         traced",
                        failed_step(status).unwrap_or("unknown step")
                    ),
                });
            } else {
                if h.since.elapsed() >= SLOW_AFTER && !h.said_slow {
                    h.said_slow = true;
                    sink(TraceEvent::Notice(format!(
                        "process {pid}: no thread has run Python code in the {} s since the hook was \
                         armed (blocked in C or idle?); calls are traced from when one does",
                        SLOW_AFTER.as_secs()
                    )));
                }
                let every = if h.said_slow {
                    RAISE_SLOWLY
                } else {
                    RAISE_EVERY
                };
                if h.last_raise.elapsed() < every {
                    continue;
                }
            }
            if h.detour.is_none() && h.phase != Phase::Waiting {
                continue;
            }
            stop_for.push(pid);
        }
        stop_for
    }

    /// Threads stopped: the entry put back, or the breaker raised again.
    pub(super) fn status_stopped(
        &mut self,
        pid: i32,
        guardian: Option<&mut Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(h) = self.procs.get_mut(&pid) else {
            return;
        };
        if h.phase == Phase::Waiting {
            h.last_raise = Instant::now();
            let tstates = h.walker.thread_state_addrs().unwrap_or_default();
            if let Some(breaker) = h.breaker {
                let _ = setup::raise(&mut h.mem, &tstates, breaker);
            }
        } else if let Err(e) = unpatch(pid, h, guardian) {
            sink(TraceEvent::Notice(format!("process {pid}: {e:#}")));
        }
    }

    /// The profile route: the thread states read for ones without the hook (reads
    /// only); those that have one get it with every thread stopped, and a new
    /// thread held for this goes on.
    pub(super) fn sweep_profiles(
        &mut self,
        now: Instant,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Vec<(i32, SweepNeed)> {
        let mut due = Vec::new();
        for (&pid, h) in self.procs.iter_mut() {
            if h.profile.is_none() || h.phase != Phase::Installed {
                continue;
            }
            if !h.sweep_now && now < h.next_sweep {
                continue;
            }
            let held = std::mem::take(&mut h.sweep_now);
            h.next_sweep = now + SWEEP_EVERY;
            let Some(target) = h.profile else { continue };
            let cb = h.hook.callbacks[0];
            let tstates = h.walker.thread_state_addrs().unwrap_or_default();
            let mut free = false;
            let mut taken = Vec::new();
            for &t in &tstates {
                match target.slot(&h.mem, t, cb) {
                    Ok(Slot::Free) => free = true,
                    Ok(Slot::Taken) => taken.push(t),
                    _ => {}
                }
            }
            say_taken(pid, &taken, &mut h.said_taken, sink);
            if free {
                due.push((pid, SweepNeed::Stop));
            } else if held {
                due.push((pid, SweepNeed::Release));
            }
        }
        due
    }

    pub(super) fn sweep_profiles_stopped(&mut self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let Some(h) = self.procs.get_mut(&pid) else {
            return;
        };
        let Some(target) = h.profile else { return };
        let cb = h.hook.callbacks[0];
        // Read again, every thread stopped: the list may have changed.
        let tstates = h.walker.thread_state_addrs().unwrap_or_default();
        match setup::set_profiles(&mut h.mem, &target, &tstates, cb) {
            Ok(taken) => say_taken(pid, &taken, &mut h.said_taken, sink),
            Err(e) => sink(TraceEvent::Notice(format!(
                "process {pid}: a thread could not be given the hook: {e:#}"
            ))),
        }
    }
}

/// Says once per thread state that the target's own profiler holds its profile
/// function (profile route): its calls are not traced while it does.
pub(super) fn say_taken(
    pid: i32,
    taken: &[u64],
    said: &mut std::collections::HashSet<u64>,
    sink: &mut dyn FnMut(TraceEvent),
) {
    let new = taken.iter().filter(|&&t| said.insert(t)).count();
    if new > 0 {
        sink(TraceEvent::Notice(format!(
            "process {pid}: {new} thread(s) run a profile function of the target's own (cProfile, \
             sys.setprofile); before CPython 3.12 a thread has one, so their calls are not traced \
             until the target lets it go"
        )));
    }
}

/// Puts the safe point's bytes back (every thread stopped).
pub(super) fn unpatch(pid: i32, h: &mut HookProc, guardian: Option<&mut Guardian>) -> Result<()> {
    let Some(d) = h.detour.take() else {
        return Ok(());
    };
    let mut now = vec![0u8; d.patch.len()];
    h.mem.read(d.site, &mut now)?;
    if now == d.patch {
        h.mem.write(d.site, &d.original)?;
    }
    if let Some(g) = guardian {
        let _ = g.tell(Op::SiteRestored, pid, d.site);
    }
    Ok(())
}
