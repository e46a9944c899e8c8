//! Attaching to a running process and launching a command: pyprobe's two ways to
//! start tracing. Apart from the engine's core because they run once, before the
//! event loop, and carry the seizing rules (thread races, EPERM, launch cleanup).

use std::ffi::CString;

use anyhow::{anyhow, bail, Context, Result};
use nix::errno::Errno;
use nix::sys::ptrace::{self, Options};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

use crate::process::status::thread_ids;
use crate::tracer::guardian::Guardian;

use super::{Engine, EngineOptions, Proc, Resolver, StopKind, Thread, ThreadState, TraceEvent};

fn trace_options() -> Options {
    Options::PTRACE_O_TRACECLONE
        | Options::PTRACE_O_TRACEFORK
        | Options::PTRACE_O_TRACEVFORK
        | Options::PTRACE_O_TRACEEXEC
        | Options::PTRACE_O_TRACEEXIT
        | Options::PTRACE_O_TRACESYSGOOD
}

impl Engine {
    /// Seizes every thread of `pid`, stops them, installs the probes and lets them run.
    pub fn attach(
        pid: i32,
        resolver: Box<dyn Resolver>,
        options: EngineOptions,
        sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<Engine> {
        let mut engine = Engine::new(pid, resolver, options);
        if options.guardian {
            engine.guardian = Some(Guardian::spawn()?);
        }
        engine.procs.insert(pid, Proc::new(pid));
        engine.seize_process(pid)?;
        if engine.threads.is_empty() {
            bail!("process {pid} exited while pyprobe was attaching");
        }
        let children = if options.subprocesses {
            engine.seize_existing_children(pid, sink)
        } else {
            Vec::new()
        };
        engine.prepared = Some((pid, engine.resolver.resolve(pid)));
        engine.prescan_ring_code(pid);
        engine.note_busy_threads();
        engine.stop_all(sink)?;
        if engine.threads.values().all(|t| {
            matches!(
                t.state,
                ThreadState::Stopped {
                    kind: StopKind::Group,
                    ..
                }
            )
        }) {
            sink(TraceEvent::Notice(format!(
                "process {pid} is stopped (SIGSTOP or Ctrl-Z): it stays stopped, and events come \
                 once it is continued (SIGCONT)"
            )));
        }
        let installed = engine.install(pid, false, sink);
        if let Err(e) = installed.and_then(|found| {
            if found {
                Ok(())
            } else {
                Err(anyhow!("no probes found"))
            }
        }) {
            engine.detach_all(sink);
            // Its probes vanish with it: an exit is what to say, not the missing probes.
            if crate::process::status::process_is_ending(pid) {
                bail!("process {pid} exited while pyprobe was attaching");
            }
            return Err(e.context(format!("cannot install probes in process {pid}")));
        }
        engine.ring_book.prescanned.clear();
        engine.install_existing_children(children, sink);
        engine.resume_all();
        engine.busy.clear();
        Ok(engine)
    }

    /// Seizes every thread of process `pid` (left running), until its thread list
    /// is stable: a thread created by a not yet seized thread would otherwise escape.
    pub(super) fn seize_process(&mut self, pid: i32) -> Result<()> {
        let mut ending = Vec::new();
        loop {
            let tids = thread_ids(pid)
                .with_context(|| format!("process {pid} vanished while attaching"))?;
            let new: Vec<i32> = tids
                .into_iter()
                .filter(|t| !self.threads.contains_key(t) && !ending.contains(t))
                .collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                match ptrace::seize(Pid::from_raw(tid), trace_options()) {
                    Ok(()) => {
                        self.threads.insert(
                            tid,
                            Thread {
                                tgid: pid,
                                state: ThreadState::Running,
                            },
                        );
                    }
                    Err(Errno::ESRCH) => continue, // ended meanwhile
                    // Any thread but the leader: the task list is in tid order, and
                    // after pid wrap-around a new thread may sort before the leader.
                    Err(Errno::EPERM) if tid != pid => {
                        if crate::process::status::traced_by_us(tid) {
                            // Created by a thread seized already: traced from birth
                            // (PTRACE_O_TRACECLONE); its first stop is on its way.
                            self.threads.insert(
                                tid,
                                Thread {
                                    tgid: pid,
                                    state: ThreadState::New,
                                },
                            );
                        } else if crate::process::status::thread_is_ending(tid) {
                            ending.push(tid); // nothing left of it to trace
                        } else {
                            bail!("cannot seize thread {tid} of process {pid}: EPERM");
                        }
                    }
                    Err(e) if self.threads.is_empty() => {
                        return Err(crate::process::access::seize_error(pid, e))
                    }
                    Err(e) => bail!("cannot seize thread {tid} of process {pid}: {e}"),
                }
            }
        }
        Ok(())
    }

    /// Starts `command` as a traced child, stopped before it runs a single
    /// instruction of the new program; the probes are installed as soon as the object
    /// carrying them is mapped.
    pub fn launch(
        command: &[String],
        resolver: Box<dyn Resolver>,
        options: EngineOptions,
        _sink: &mut dyn FnMut(TraceEvent),
    ) -> Result<Engine> {
        let program = command
            .first()
            .ok_or_else(|| anyhow!("no command given after `--`"))?;
        let resolved = crate::tracer::launch::find_program(program)?;
        let argv: Vec<CString> = command
            .iter()
            .map(|a| CString::new(a.as_bytes()))
            .collect::<Result<_, _>>()
            .context("a command argument contains a NUL byte")?;
        let path = CString::new(resolved.as_os_str().as_encoded_bytes())
            .context("program path has a NUL byte")?;
        let guardian = if options.guardian {
            Some(Guardian::spawn()?)
        } else {
            None
        };
        let child = crate::tracer::launch::spawn_stopped(&path, &argv)?;
        let pid = child.as_raw();
        if let Err(e) = ptrace::seize(child, trace_options()) {
            let error = crate::process::access::seize_error(pid, e);
            // Never leave the forked command stopped before its exec: it would stay
            // stopped for ever, holding pyprobe's pipes.
            let _ = kill(child, Signal::SIGKILL);
            let _ = waitpid(child, None);
            return Err(error);
        }
        let mut engine = Engine::new(pid, resolver, options);
        engine.launched = true;
        engine.guardian = guardian;
        engine.procs.insert(pid, Proc::new(pid));
        engine.threads.insert(
            pid,
            Thread {
                tgid: pid,
                state: ThreadState::Running,
            },
        );
        // It stopped itself with SIGSTOP before exec; let it go on to exec.
        kill(child, Signal::SIGCONT).context("cannot continue the started command")?;
        Ok(engine)
    }
}
