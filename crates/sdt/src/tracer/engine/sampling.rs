//! Sampling ticks: every traced process's threads interrupted at once, each process
//! sampled (its ring drained first) and resumed as soon as its own threads are all
//! held (or, with `--nonblocking`, sampled running).

use std::collections::HashMap;

use anyhow::{bail, Result};
use nix::sys::ptrace;
use nix::unistd::Pid;

use crate::process::status::tgid_of;

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
        if self.options.blocking_samples && !self.budget.samples_unblocked {
            self.unblock_samples_of_many_threads(sink);
        }
        let blocking = self.options.blocking_samples && !self.budget.samples_unblocked;
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
                let on_cpu = self.cpu_states(pid);
                sink(TraceEvent::Tick {
                    pid,
                    ts_ns: monotonic_ns(),
                    stopped: false,
                    on_cpu,
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
        let mut on_cpu: HashMap<i32, Vec<(i32, bool)>> = left
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
                sink(TraceEvent::Tick {
                    pid,
                    ts_ns: monotonic_ns(),
                    stopped: true,
                    on_cpu: on_cpu.remove(&pid).unwrap_or_default(),
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
    /// Whether each thread of process `pid` is on a CPU (running or runnable), from
    /// the kernel's scheduler state. A thread in a ptrace-stop of pyprobe's own (a
    /// probe hit, an interrupt) was caught running; one in a group-stop (SIGSTOP) or a
    /// vfork wait was not.
    pub(in crate::tracer) fn cpu_states(&mut self, pid: i32) -> Vec<(i32, bool)> {
        let threads = &self.threads;
        self.task_states.keep_only(|tid| threads.contains_key(&tid));
        let states = &mut self.task_states;
        threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .filter_map(|(&tid, t)| {
                let on_cpu = match states.state(pid, tid)? {
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
            .collect()
    }
}
