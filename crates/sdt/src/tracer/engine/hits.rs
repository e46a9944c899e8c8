//! Probes in a process image: installing them (and the SIGTRAP net and the ring
//! with them) once the object carrying them is mapped, and catching each `int3` hit.

use anyhow::{Context, Result};
use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::tracer::clock::monotonic_ns;
use crate::tracer::guardian::Guardian;
use crate::tracer::patch::Patches;
use crate::tracer::regs::Registers;
use crate::tracer::safety_net;

use super::threads::at_syscall_entry;
use super::{Engine, Hit, NotTraceable, Proc, TraceEvent};

impl Engine {
    /// Decodes a breakpoint hit if `tid` stopped at one of our sites.
    pub(in crate::tracer) fn try_hit(
        &mut self,
        tid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> bool {
        let Some(tgid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return false;
        };
        // Ring records this thread published before reaching this int3 come first:
        // all of them (a GC's end before the next GC's start), not one batch.
        self.drain_ring_of(tgid, sink);
        let Some(proc) = self.procs.get(&tgid) else {
            return false;
        };
        let Ok(raw) = ptrace::getregs(Pid::from_raw(tid)) else {
            return false;
        };
        let regs = Registers(raw);
        let site_addr = regs.0.rip.wrapping_sub(1);
        let Some(&(pi, si)) = proc.patches.sites.get(&site_addr) else {
            return false;
        };
        // An `int3` reports SI_KERNEL; the program's own kill/raise/tgkill reports
        // SI_USER or SI_TKILL even when it lands just after a site.
        match ptrace::getsiginfo(Pid::from_raw(tid)) {
            Ok(info) if info.si_code == libc::SI_KERNEL => {}
            _ => return false,
        }
        // A ring or hook buffer polled by pyprobe: its consumer must not yield.
        let polling = self.ring_active() || self.source_active();
        self.cpu.hit(tgid, tid, polling);
        let Some(proc) = self.procs.get(&tgid) else {
            return true;
        };
        if self.budget.meter.as_ref().is_some_and(|b| !b.exact())
            && proc.patches.set.budgeted.contains(&pi)
        {
            // It passed the semaphore check just before the probe went off: the
            // window is closed, so this hit is not recorded.
            return true;
        }
        // What was deferred to the first hit (the SIGTRAP net, the ring) is set up
        // before the hit is stamped: pyprobe's own time is in no call or pause.
        if proc.net_pending {
            if let Some(proc) = self.procs.get_mut(&tgid) {
                Self::install_net(proc, tgid, tid, self.guardian.as_ref(), sink);
                self.sigtrap_blockers_due.push(tgid);
            }
        }
        self.ring_at_hit(tgid, tid, sink);
        let Some(proc) = self.procs.get(&tgid) else {
            return true;
        };
        let ts_ns = monotonic_ns();
        let probe = &proc.patches.set.probes[pi];
        let site = &probe.sites[si];
        let symbols = |name: &str| proc.patches.set.symbol(name);
        self.hit_buffers
            .decode(probe, site, &regs, &proc.mem, &symbols);
        self.hits += 1;
        sink(TraceEvent::Hit(Hit {
            pid: tgid,
            tid,
            ts_ns,
            probe: pi,
            probe_name: &probe.name,
            args: &self.hit_buffers.args,
            buffers: &self.hit_buffers,
            stack: None,
            stopped: true,
            repeat: None,
        }));
        true
    }
    /// Resolves and installs the probes of `pid`, every thread of it stopped.
    /// `starting`: the process is still being loaded (launch, exec); its sites move
    /// to the ring only at their first hit, once the loader has finished mapping
    /// (a trampoline region placed now could be mapped over). `Ok(false)`: not
    /// mapped yet.
    pub(in crate::tracer) fn install(
        &mut self,
        pid: i32,
        starting: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<bool> {
        let resolved = match self.prepared.take() {
            Some((prepared_for, resolved)) if prepared_for == pid => resolved,
            other => {
                self.prepared = other;
                self.resolver.resolve(pid)
            }
        };
        let Some(set) = resolved? else {
            return Ok(false);
        };
        // A thread where system calls can be injected, found before any `int3` is
        // written (finding one may let a thread finish the system call it is in).
        let clean = if set.probes.is_empty() {
            None
        } else {
            self.clean_thread(pid, sink)
        };
        let proc = self.procs.entry(pid).or_insert_with(|| Proc::new(pid));
        let patches = Patches::install(set, &mut proc.mem, self.guardian.as_mut())
            .with_context(|| format!("patching process {pid}"))?;
        sink(TraceEvent::Installed {
            pid,
            sites: patches.installed_sites(),
        });
        proc.patches = patches;
        proc.awaiting_object = false;
        if proc.net.is_none() && proc.patches.installed_sites() > 0 {
            match clean {
                Some(tid) => {
                    Self::install_net(proc, pid, tid, self.guardian.as_ref(), sink);
                    self.sigtrap_blockers_due.push(pid);
                }
                None => proc.net_pending = true,
            }
        }
        self.budget_installed(pid, sink);
        self.ring_installed(pid, if starting { None } else { clean }, sink)?;
        self.source_installed(pid, starting, clean, sink)?;
        Ok(true)
    }
    pub(in crate::tracer) fn install_net(
        proc: &mut Proc,
        pid: i32,
        tid: i32,
        guard: Option<&Guardian>,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        proc.net_pending = false;
        let mut sites: Vec<u64> = proc.patches.sites.keys().copied().collect();
        sites.sort_unstable();
        match safety_net::install(tid, &mut proc.mem, &sites, guard) {
            Ok(net) => proc.net = Some(net),
            Err(e) => sink(TraceEvent::Notice(format!(
                "process {pid}: no SIGTRAP safety net ({e}); if pyprobe is killed, a thread reaching a \
                 probe site before the guardian restores it would die"
            ))),
        }
    }
    /// Says which threads of the processes whose safety net was just installed
    /// block SIGTRAP. Done once the target runs again: reading every thread's
    /// status took 200 ms of a 10,000-thread process's attach, all of it held.
    pub(in crate::tracer) fn say_sigtrap_blockers(&mut self, sink: &mut dyn FnMut(TraceEvent)) {
        for pid in std::mem::take(&mut self.sigtrap_blockers_due) {
            let blocking = safety_net::threads_blocking_sigtrap(pid);
            if !blocking.is_empty() {
                sink(TraceEvent::Notice(format!(
                    "process {pid}: threads {blocking:?} block SIGTRAP; a probe hit there makes the \
                     kernel unblock it and reset it to its default"
                )));
            }
        }
    }
    /// In a process that is starting up: once its maps changed, look for the probes.
    pub(in crate::tracer) fn check_awaited_object(
        &mut self,
        tid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        let Some(tgid) = self.threads.get(&tid).map(|t| t.tgid) else {
            return;
        };
        let Some(proc) = self.procs.get_mut(&tgid) else {
            return;
        };
        if !proc.awaiting_object {
            return;
        }
        let maps_len = crate::process::maps::maps_len(tgid);
        if maps_len == proc.last_maps_len {
            return;
        }
        proc.last_maps_len = maps_len;
        // At a syscall-entry stop the kernel is about to run the pending call: no
        // injection there; the exit stop follows at once.
        if at_syscall_entry(tid) {
            proc.last_maps_len = 0;
            return;
        }
        if let Err(e) = self.install(tgid, true, sink) {
            if e.downcast_ref::<NotTraceable>().is_some() {
                // Refused before the process ran any code of its own: the run ends.
                self.fatal.get_or_insert(e);
                return;
            }
            sink(TraceEvent::Notice(format!("{e:#}")));
            if let Some(p) = self.procs.get_mut(&tgid) {
                p.awaiting_object = false;
            }
        }
    }
}
