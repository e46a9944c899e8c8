//! Tasks the traced processes create or replace: a new thread is followed; a forked
//! or vforked child is traced on its own (`--subprocesses`) or cleaned of the
//! parent's patches and let go; after an exec the old image's patches are
//! forgotten and the probes looked for again.

use nix::sys::ptrace::{self, Event};
use nix::unistd::Pid;

use crate::process::memory::ProcessMemory;
use crate::process::status::tgid_of;

use crate::tracer::clock::monotonic_ns;
use crate::tracer::guardian::Op;
use crate::tracer::patch::clean_copy;
use crate::tracer::safety_net;

use super::{Engine, Proc, RingUse, StopKind, Thread, ThreadState, TraceEvent};

/// A forked child seen by its parent's event, not yet by its own first stop, or
/// the other way round.
#[derive(Debug, Clone, Copy)]
pub(in crate::tracer) struct PendingChild {
    pub(in crate::tracer) parent: i32,
    pub(in crate::tracer) vfork: bool,
}

impl Engine {
    /// A clone, fork or vfork event of `tid`: a new thread is followed; a new process
    /// is adopted once both its parent's event and its own first stop are seen.
    pub(in crate::tracer) fn on_new_task(
        &mut self,
        tid: i32,
        event: i32,
        holding: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        const CLONE: i32 = Event::PTRACE_EVENT_CLONE as i32;
        const VFORK: i32 = Event::PTRACE_EVENT_VFORK as i32;
        let new = ptrace::getevent(Pid::from_raw(tid)).unwrap_or(0) as i32;
        let parent_tgid = self.threads.get(&tid).map_or(tid, |t| t.tgid);
        // Before the creator runs on: the new task may write the same ring.
        self.ring_many_producers(parent_tgid);
        self.source_many_producers(parent_tgid);
        if new > 0 {
            if event == CLONE && tgid_of(new).is_none_or(|g| g == parent_tgid) {
                self.threads.entry(new).or_insert(Thread {
                    tgid: parent_tgid,
                    state: ThreadState::New,
                });
                sink(TraceEvent::ThreadStart {
                    pid: parent_tgid,
                    tid: new,
                    ts_ns: monotonic_ns(),
                });
            } else {
                let pending = PendingChild {
                    parent: parent_tgid,
                    vfork: event == VFORK,
                };
                self.pending_children.insert(new, pending);
                if !pending.vfork && self.options.subprocesses {
                    // Read while the parent stands at its event, as the child got it.
                    self.source_forked(parent_tgid, new);
                }
                if let Some(i) = self.early_children.iter().position(|&c| c == new) {
                    self.early_children.remove(i);
                    self.adopt_child(new, pending, sink);
                }
            }
        }
        let kind = if event == VFORK {
            StopKind::Vfork
        } else {
            StopKind::InSyscall
        };
        self.resume_or_hold(tid, None, kind, holding);
    }

    /// An exec event of `tid`: the process is its leader alone, with a new image
    /// whose probes are looked for again.
    pub(in crate::tracer) fn on_exec(
        &mut self,
        tid: i32,
        holding: bool,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        // After exec the thread group is the leader alone; the old image and its
        // patches are gone.
        let tgid = self.threads.get(&tid).map_or(tid, |t| t.tgid);
        self.threads.retain(|&t, th| th.tgid != tgid || t == tgid);
        self.threads.insert(
            tgid,
            Thread {
                tgid,
                state: ThreadState::Running,
            },
        );
        let mut proc = Proc::new(tgid);
        if let Some(old) = self.procs.get_mut(&tgid) {
            old.patches.forget();
        }
        // The old image's hook went with it; the new one is hooked once its probes are.
        self.source_image_gone(tgid, sink);
        if let Some(g) = self.guardian.as_mut() {
            let _ = g.tell(Op::Forget, tgid, 0);
        }
        proc.awaiting_object = true;
        self.procs.insert(tgid, proc);
        sink(TraceEvent::Exec {
            pid: tgid,
            ts_ns: monotonic_ns(),
        });
        self.set_state(
            tgid,
            ThreadState::Stopped {
                pending: None,
                kind: StopKind::InSyscall,
            },
        );
        self.check_awaited_object(tgid, sink);
        self.resume_or_hold(tgid, None, StopKind::InSyscall, holding);
    }

    /// A forked child: trace it (`--subprocesses`) or clean its copy of the patches
    /// and release it, before it runs on.
    pub(in crate::tracer) fn adopt_child(
        &mut self,
        child: i32,
        pending: PendingChild,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        self.pending_children.remove(&child);
        let parent_patches = self
            .procs
            .get(&pending.parent)
            .map(|p| p.patches.clone())
            .unwrap_or_default();
        let parent_net = self.procs.get(&pending.parent).and_then(|p| p.net);
        if self.options.subprocesses {
            let hooked = parent_patches.set.hook
                && self
                    .source
                    .as_ref()
                    .is_some_and(|s| s.serves(pending.parent));
            let mut proc = Proc::new(child);
            proc.patches = parent_patches;
            if pending.vfork {
                // It runs in its parent's memory until it execs: what is written
                // there is the parent's, undone with the parent's. Its copy of the
                // patches only names the hits it might take meanwhile.
                proc.shares_parent_memory = true;
            } else {
                if let Err(e) = Self::ring_fork(self.procs.get(&pending.parent), &mut proc) {
                    sink(TraceEvent::Notice(format!(
                        "forked child {child}: cannot turn its ring sites back into int3s: {e:#}"
                    )));
                }
                // Its sites move to a ring of its own at its first hit, as after an
                // exec: a hit is a clean stop to set it up from.
                proc.ring_pending =
                    self.options.ring != RingUse::Off && proc.patches.installed_sites() > 0;
                // The hook's state is wiped in it (it must never write into its
                // parent's ring): it goes on with a ring of its own, or the child
                // is said untraced.
                if hooked {
                    let why = match self.source_adopt(pending.parent, child, sink) {
                        Ok(true) => None,
                        Ok(false) => {
                            Some("the hook was not in its parent yet when it forked".into())
                        }
                        Err(e) => Some(format!("{e:#}")),
                    };
                    proc.unhooked = why.map(|why| (monotonic_ns(), why));
                }
                if let Some(g) = self.guardian.as_mut() {
                    let (written, raised) = proc.patches.undo_list();
                    for &sem in raised {
                        let _ = g.tell(Op::SemaphoreRaised, child, sem);
                    }
                    for &site in written {
                        let _ = g.tell(Op::SiteArmed, child, site);
                    }
                }
            }
            proc.net = parent_net;
            self.procs.insert(child, proc);
            self.threads.insert(
                child,
                Thread {
                    tgid: child,
                    state: ThreadState::Running,
                },
            );
            sink(TraceEvent::ProcessStart {
                pid: child,
                parent: pending.parent,
                ts_ns: monotonic_ns(),
            });
            let _ = ptrace::cont(Pid::from_raw(child), None);
            return;
        }
        if !pending.vfork {
            // The child has its own copy of the parent's memory, int3s included.
            let (written, raised) = parent_patches.undo_list();
            let mut mem = ProcessMemory::new(child);
            if let Err(e) = clean_copy(written, raised, &mut mem) {
                sink(TraceEvent::Notice(format!(
                    "cannot clean forked child {child}: {e}"
                )));
            }
            if let Err(e) = Self::ring_clean_released(self.procs.get(&pending.parent), child) {
                sink(TraceEvent::Notice(format!(
                    "cannot clean the ring sites of forked child {child}: {e:#}"
                )));
            }
            // And its copy of the SIGTRAP safety net (it is at its first, clean stop).
            if let Some(net) = parent_net {
                let guard = self.guardian.as_ref();
                if let Err(e) = safety_net::uninstall(child, &mut mem, &net, guard) {
                    sink(TraceEvent::Notice(format!(
                        "forked child {child}: cannot remove the SIGTRAP safety net: {e}"
                    )));
                }
            }
        }
        // A vfork child shares the parent's memory until it execs: nothing to clean.
        let _ = ptrace::detach(Pid::from_raw(child), None);
    }
}

/// At most this many existing descendants are taken at attach.
const MAX_EXISTING_CHILDREN: usize = 256;

impl Engine {
    /// `--subprocesses` with `-p`: seizes the processes descending from `pid` that
    /// exist now (a pool's workers, forked before pyprobe came), each as `attach`
    /// seizes its target; returns them with their parents. One that cannot be
    /// seized (another tracer, gone) is said and left alone.
    pub(in crate::tracer) fn seize_existing_children(
        &mut self,
        pid: i32,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Vec<(i32, i32)> {
        let mut seized = Vec::new();
        let found = crate::process::status::descendants(pid, MAX_EXISTING_CHILDREN + 1);
        if found.len() > MAX_EXISTING_CHILDREN {
            sink(TraceEvent::Notice(format!(
                "process {pid} has more than {MAX_EXISTING_CHILDREN} descendants: the first \
                 {MAX_EXISTING_CHILDREN} are traced, and the children forked from now on"
            )));
        }
        for (child, parent) in found.into_iter().take(MAX_EXISTING_CHILDREN) {
            self.procs.insert(child, Proc::new(child));
            match self.seize_process(child) {
                Ok(()) => seized.push((child, parent)),
                Err(e) => {
                    self.let_go_of(child);
                    sink(TraceEvent::Notice(format!(
                        "child process {child} of {parent} is not traced: {e:#}"
                    )));
                }
            }
        }
        seized
    }

    /// Installs the probes of the existing children seized by
    /// [`Self::seize_existing_children`], every thread stopped; a child that is not
    /// a CPython pyprobe can read is let go.
    pub(in crate::tracer) fn install_existing_children(
        &mut self,
        children: Vec<(i32, i32)>,
        sink: &mut dyn FnMut(TraceEvent),
    ) {
        for (child, parent) in children {
            let why = match self.install(child, false, sink) {
                Ok(true) => {
                    self.children_to_announce
                        .push((child, parent, monotonic_ns()));
                    continue;
                }
                Ok(false) => "no CPython interpreter found in it".to_owned(),
                Err(e) => format!("{e:#}"),
            };
            self.let_go_of(child);
            sink(TraceEvent::Detail(format!(
                "child process {child} of {parent} is not traced: {why}"
            )));
        }
    }

    /// Undoes what was written in process `pid` and lets its threads go, before
    /// it was ever resumed by pyprobe (its threads stopped or just seized).
    fn let_go_of(&mut self, pid: i32) {
        if let Some(mut proc) = self.procs.remove(&pid) {
            let _ = proc.patches.remove(&mut proc.mem, self.guardian.as_mut());
        }
        let tids: Vec<i32> = self
            .threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .map(|(&tid, _)| tid)
            .collect();
        for tid in tids {
            let pending = match self.threads.remove(&tid).map(|t| t.state) {
                Some(ThreadState::Stopped { pending, .. }) => pending,
                _ => None,
            };
            let _ = ptrace::detach(Pid::from_raw(tid), pending);
        }
    }

    /// A forked child whose calls went untraced (see `Proc::unhooked`) and
    /// that never ran a new program, ending or left: kept as a caveat rather than
    /// a process whose calls silently count nothing.
    pub(in crate::tracer) fn say_unhooked(&self, pid: i32, sink: &mut dyn FnMut(TraceEvent)) {
        let Some((since, why)) = self.procs.get(&pid).and_then(|p| p.unhooked.as_ref()) else {
            return;
        };
        sink(TraceEvent::Caveat {
            pid,
            ts_ns: *since,
            text: format!(
                "process {pid} was forked from a process traced through the hook engine, \
                 which could not go on in it ({why}): its Python calls are not traced (its GC, \
                 import and audit events are; a child that runs a new program is traced again)"
            ),
        });
    }
}
