//! Sampling ticks: every traced process's threads interrupted at once, each process
//! sampled (its ring drained first) and resumed as soon as its own threads are all
//! held (or, with `--nonblocking`, sampled running).

use std::collections::HashMap;

use anyhow::{bail, Result};
use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::process::status::tgid_of;
use crate::process::task_looks::TickLook;

use crate::sdt::MemoryReader;
use crate::tracer::clock::monotonic_ns;

use super::threads::WaitingForStops;
use super::{Engine, StopKind, Thread, ThreadState, TraceEvent};

impl Engine {
    /// A sampling tick: with `blocking`, every thread is stopped while the sink reads
    /// the stacks, for a consistent picture; threads the target itself has stopped
    /// (group-stop) stay as they are.
    pub(in crate::tracer) fn on_tick(&mut self, sink: &mut dyn FnMut(TraceEvent)) -> Result<()> {
        if self.options.sample_interval_ns.is_none() {
            return Ok(());
        }
        let functions_traced = self
            .procs
            .values()
            .any(|p| !p.patches.set.budgeted.is_empty());
        if functions_traced && self.budget.meter.as_ref().is_some_and(|b| b.exact()) {
            // An exact window: the probes say it all, a sample would be thrown away.
            self.poll_budget(sink);
            return Ok(());
        }
        self.budget_sample_stops();
        if self.options.blocking_samples && !self.budget.samples_unblocked {
            self.unblock_samples_of_many_threads(sink);
        }
        let blocking = self.options.blocking_samples && !self.budget.samples_unblocked;
        self.tick_number += 1;
        // Each process is sampled on its own: stopped only while its own stacks are
        // read, never while another process's are. One still starting (its
        // interpreter not mapped yet) has nothing to read.
        let mut pids: Vec<i32> = self
            .procs
            .iter()
            .filter(|(_, p)| !p.awaiting_object)
            .map(|(&pid, _)| pid)
            .collect();
        pids.sort_unstable();
        if blocking {
            self.sample_stopped(pids, sink)?;
        } else {
            // Running on: what each published before its read is recorded first
            // (up to what was there then; it may publish faster than it is read).
            for pid in pids {
                if !self.resolver.samples_used(pid) {
                    continue;
                }
                self.drain_ring_of(pid, sink);
                let (on_cpu, still) = self.cpu_states(pid);
                sink(TraceEvent::Tick {
                    pid,
                    ts_ns: monotonic_ns(),
                    stopped: false,
                    on_cpu,
                    tick: self.tick_number,
                    still,
                });
            }
        }
        self.poll_budget(sink);
        if blocking {
            self.unblock_costly_samples(sink);
        }
        Ok(())
    }
    /// Samples each process of `pids` with every thread of it stopped: all are
    /// interrupted at once, and each is read and let go as soon as its own threads
    /// are all held, so none waits for another's threads or stack reads.
    pub(in crate::tracer) fn sample_stopped(
        &mut self,
        mut left: Vec<i32>,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<()> {
        // Threads seized but not seen yet stop by themselves; threads parked in
        // group-stop stay parked (their stacks do not move).
        let running = |t: &Thread| matches!(t.state, ThreadState::Running | ThreadState::New);
        let mut interrupted = std::collections::HashSet::new();
        // Before the stop, which would show every thread as stopped.
        let mut on_cpu: HashMap<i32, CpuStates> = left
            .iter()
            .map(|&pid| (pid, self.cpu_states(pid)))
            .collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut waiting = WaitingForStops::new();
        loop {
            for (&tid, thread) in &self.threads {
                if left.contains(&thread.tgid) && running(thread) && interrupted.insert(tid) {
                    let _ = ptrace::interrupt(Pid::from_raw(tid));
                }
            }
            let mut i = 0;
            while i < left.len() {
                let pid = left[i];
                let mut threads = self.threads.values().filter(|t| t.tgid == pid);
                let (mut any, mut held) = (false, true);
                for t in &mut threads {
                    any = true;
                    held &= !running(t);
                }
                if any && !held {
                    i += 1;
                    continue;
                }
                left.swap_remove(i);
                if !any {
                    continue; // gone meanwhile
                }
                // Charged from the moment all are stopped: until then they ran (or
                // waited for a CPU, which is not pyprobe's doing); and without the
                // time pyprobe waited for a CPU, which the target would have too.
                // Timed only for a budget: the reads lengthen the stop.
                let budgeted = self.budget.meter.is_some();
                let hold = budgeted.then(|| self.budget.own_schedule.begin());
                self.drain_ring_of(pid, sink);
                let (mut cpu, still) = on_cpu.remove(&pid).unwrap_or_default();
                for (tid, on) in &mut cpu {
                    *on = *on && !self.stopped_in_a_blocking_call(pid, *tid);
                }
                sink(TraceEvent::Tick {
                    pid,
                    ts_ns: monotonic_ns(),
                    stopped: true,
                    on_cpu: cpu,
                    tick: self.tick_number,
                    still,
                });
                self.resume_process(pid);
                if let Some(hold) = hold {
                    let cost = self.budget.own_schedule.end(hold);
                    if let Some(b) = self.budget.meter.as_mut() {
                        b.sampled(cost);
                    }
                }
                sink(TraceEvent::TickDone { pid });
            }
            if left.is_empty() {
                return Ok(());
            }
            // The rings of the processes still running fill meanwhile: drained
            // while waiting, so that a slow stop does not make them overflow.
            let awaited = |t: &Thread| left.contains(&t.tgid) && running(t);
            // Every stop reported by now before the threads are looked at again.
            let alive =
                self.collect_stops(&mut waiting, &awaited, deadline, |engine, status| {
                    // The processes not sampled yet are held; the others' stops are
                    // handled and resumed as in the event loop.
                    let holding = status.pid().is_some_and(|tid| {
                        let tid = tid.as_raw();
                        engine
                            .threads
                            .get(&tid)
                            .map(|t| t.tgid)
                            .or_else(|| tgid_of(tid))
                            .is_some_and(|pid| left.contains(&pid))
                    });
                    engine.handle(status, holding, sink)
                })?;
            if !alive {
                return Ok(());
            }
            if self.ring_active() {
                self.drain_rings(sink);
            }
            if std::time::Instant::now() > deadline {
                bail!("the target's threads did not stop within 10 s");
            }
        }
    }
    /// Whether thread `tid` of process `pid`, held at pyprobe's interrupt, was
    /// stopped out of a system call that waited: its registers hold the call's
    /// restart code, or the call is set to run again (`rax` its number, `rip` on
    /// the `syscall` instruction). An interrupt wakes a waiting thread, and the
    /// kernel shows it runnable until it runs and goes back to sleep: on a loaded
    /// machine, at the next tick still. Its stack is the wait's: counted waiting.
    fn stopped_in_a_blocking_call(&self, pid: i32, tid: i32) -> bool {
        let ours = self.threads.get(&tid).is_some_and(|t| {
            matches!(
                t.state,
                ThreadState::Stopped {
                    kind: StopKind::Interrupt,
                    ..
                }
            )
        });
        let Some(regs) = ours
            .then(|| ptrace::getregs(Pid::from_raw(tid)).ok())
            .flatten()
        else {
            return false;
        };
        if cut_short_to_restart(regs.orig_rax, regs.rax) {
            return true;
        }
        let mut at = [0u8; 2];
        regs.orig_rax == regs.rax
            && (regs.orig_rax as i64) >= 0
            && self
                .procs
                .get(&pid)
                .is_some_and(|p| p.mem.read_exact(regs.rip, &mut at).is_ok())
            && at == SYSCALL
    }

    /// Whether each thread of process `pid` is on a CPU (running or runnable), from
    /// the kernel's scheduler state. A thread in a ptrace-stop of pyprobe's own (a
    /// probe hit, an interrupt) was caught running; one in a group-stop (SIGSTOP) or a
    /// vfork wait was not. And the threads that have not run since an earlier tick
    /// (see [`TraceEvent::Tick`]): of 2,000 threads waiting, reading each one's
    /// `stat` and stack at every tick left most ticks untaken.
    pub(in crate::tracer) fn cpu_states(&mut self, pid: i32) -> CpuStates {
        let threads = &self.threads;
        self.task_states.keep_only(|tid| threads.contains_key(&tid));
        let states = &mut self.task_states;
        let tick = self.tick_number;
        let mut still = Vec::new();
        let on_cpu = threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .filter_map(|(&tid, t)| {
                let look = states.tick_look(pid, tid, tick)?;
                if let TickLook::Still { since, .. } = look {
                    still.push((tid, since));
                }
                let on_cpu = match look.state() {
                    'R' => true,
                    't' => !matches!(
                        t.state,
                        ThreadState::Listening
                            | ThreadState::Stopped {
                                kind: StopKind::Group | StopKind::Vfork,
                                ..
                            }
                    ),
                    _ => false,
                };
                Some((tid, on_cpu))
            })
            .collect();
        still.sort_unstable();
        (on_cpu, still)
    }
}

/// Of one process's threads: (tid, on a CPU), and (tid, since) of those still
/// since tick `since` (see [`TraceEvent::Tick`]).
type CpuStates = (Vec<(i32, bool)>, Vec<(i32, u64)>);

/// Whether registers at a stop in the signal path show a system call (`orig_rax`,
/// not -1) cut short to be restarted when the thread runs on: it was waiting in it.
/// `-ERESTARTSYS`, `-ERESTARTNOINTR`, `-ERESTARTNOHAND`, `-ERESTART_RESTARTBLOCK`:
/// what futex, poll, select, epoll_wait, nanosleep and blocking reads return to a
/// ptrace interrupt.
/// x86-64's `syscall` instruction.
const SYSCALL: [u8; 2] = [0x0f, 0x05];

fn cut_short_to_restart(orig_rax: u64, rax: u64) -> bool {
    const RESTART_CODES: [i64; 4] = [-512, -513, -514, -516];
    (orig_rax as i64) >= 0 && RESTART_CODES.contains(&(rax as i64))
}

#[cfg(test)]
mod tests {
    use super::cut_short_to_restart;

    #[test]
    fn only_a_call_cut_short_to_restart_is_a_wait() {
        let neg = |e: i64| e as u64;
        // futex (202) cut short: -ERESTARTSYS; nanosleep (35): -ERESTART_RESTARTBLOCK.
        assert!(cut_short_to_restart(202, neg(-512)));
        assert!(cut_short_to_restart(35, neg(-516)));
        // A call that returned (a result, or -EINTR to a handler), or no call at all.
        assert!(!cut_short_to_restart(0, 4096));
        assert!(!cut_short_to_restart(202, neg(-4)));
        assert!(!cut_short_to_restart(u64::MAX, neg(-512)));
    }
}
