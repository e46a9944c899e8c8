//! Leaving: the hook told to unregister and the entry put back (detach), or a
//! process's image gone; either way its ring drained and its last totals said.
//! Apart from the engine's face: the end of a [`HookProc`]'s life.

use pyprobe_sdt::tracer::clock::monotonic_ns;
use pyprobe_sdt::tracer::engine::source::EventSource;
use pyprobe_sdt::tracer::engine::TraceEvent;
use pyprobe_sdt::tracer::guardian::{Guardian, Op};
use pyprobe_sdt::tracer::ring_engine::tsc::TscClock;

use crate::hook::{ST_ARMED, ST_ON, TOOL_ID};

use super::watch::{look_at_monitoring, unpatch};
use super::{HookBook, HookProc, Phase};

impl HookBook {
    /// Leaving (every thread stopped): the hook told to unregister, the entry put
    /// back, the ring drained, what the functions returned said.
    pub(super) fn leave_all(
        &mut self,
        alive: &dyn Fn(i32) -> bool,
        mut guardian: Option<&mut Guardian>,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let pids: Vec<i32> = self.procs.keys().copied().collect();
        for pid in pids {
            if let Some(h) = self.procs.get_mut(&pid).filter(|_| alive(pid)) {
                if h.phase == Phase::Installed {
                    // What the program did since the last look is said too.
                    look_at_monitoring(pid, h, true, guardian.as_deref_mut(), sink);
                    if let Some(slots) = h.silenced.take() {
                        if slots.free_silenced(&mut h.mem, &h.walker) {
                            sink(TraceEvent::Detail(format!(
                                "hook engine in process {pid}: gave sys.monitoring tool {TOOL_ID} \
                                 back from outside: the program had turned its events off, so \
                                 the hook's callbacks could not"
                            )));
                        }
                    }
                }
                let _ = h
                    .mem
                    .write(h.state_addr + ST_ARMED as u64, &0u64.to_le_bytes());
                let _ = h
                    .mem
                    .write(h.state_addr + ST_ON as u64, &0u64.to_le_bytes());
                if let Err(e) = unpatch(pid, h, guardian.as_deref_mut()) {
                    sink(TraceEvent::Notice(format!("process {pid}: {e:#}")));
                }
                if let Some(g) = guardian.as_deref_mut() {
                    let _ = g.tell(Op::SiteRestored, pid, h.state_addr + ST_ON as u64);
                }
            }
            while self.drain_of(pid, tsc, hits, sink) > 0 {}
            if let Some(h) = self.procs.remove(&pid) {
                say_waited(pid, &h, tsc, sink);
                // Callbacks stop waiting for room: nobody reads the ring any more,
                // nor follows the process's threads.
                h.reader.set_solo(false);
                h.reader.leave();
                if h.phase == Phase::Installed {
                    sink(TraceEvent::Detail(format!(
                        "hook engine in process {pid}: told to unregister; it does at the target's \
                         next Python call; its page ({:#x}, {} bytes) and its ring stay mapped for the next \
                         attach to use again",
                        h.hook.addr,
                        h.hook.bytes.len()
                    )));
                }
                flush_return_types(pid, h, sink);
            }
        }
        self.awaiting.clear();
    }

    /// The image of `pid` is gone (it exec'd, or its leader exited): what its ring
    /// still holds is read (named from what was named before: the memory is no
    /// longer the image the records point into), its last return-type totals go
    /// out, and its ring mapping is dropped. A new image is hooked afresh.
    pub(super) fn leave_image(
        &mut self,
        pid: i32,
        tsc: Option<&TscClock>,
        hits: &mut u64,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.awaiting.remove(&pid);
        let Some(h) = self.procs.get_mut(&pid) else {
            return;
        };
        h.image_gone = true;
        while self.drain_of(pid, tsc, hits, sink) > 0 {}
        if let Some(h) = self.procs.remove(&pid) {
            say_waited(pid, &h, tsc, sink);
            flush_return_types(pid, h, sink);
        }
    }
}

/// For `-v`: how long the target's callbacks waited for room in the hook's ring,
/// i.e. held the target because pyprobe read more slowly than it wrote.
fn say_waited(pid: i32, h: &HookProc, tsc: Option<&TscClock>, sink: &mut dyn FnMut(TraceEvent)) {
    let Some(tsc) = tsc else {
        return;
    };
    let waited_ns = tsc.ticks_to_ns(h.reader.waited_cycles());
    sink(pyprobe_sdt::tracer::ring_engine::waited_detail(
        "hook", pid, waited_ns,
    ));
}

/// The last return-type totals of a hook that is done with.
fn flush_return_types(pid: i32, h: HookProc, sink: &mut dyn FnMut(TraceEvent)) {
    let mut returns = h.returns;
    let rows = returns.take_changed();
    if !rows.is_empty() {
        sink(TraceEvent::ReturnTypes {
            pid,
            ts_ns: monotonic_ns(),
            rows: &rows,
        });
    }
}
