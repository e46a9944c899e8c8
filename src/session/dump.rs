//! `pyprobe dump -p PID [--format text|json] [--locals]`: every thread's Python
//! stack, once, read with the frame walker, each thread with its system name and
//! whether it is the main thread. Stacks alone are read without stopping the target;
//! with `--locals`, each frame's local variables too, its threads held meanwhile so
//! that the values belong together. With `--async`, threads running asyncio tasks
//! as their tasks' logical stacks, then every task (`dump_async`).

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;

use pyprobe_cpython::python::walker::{Local, ThreadStack, Walker, TASK_FILE};
use pyprobe_recording::output::names::short_path;
use pyprobe_recording::output::terminal::escaped;
use pyprobe_sdt::process::hold::hold;
use pyprobe_sdt::process::status::tracer_of;

pub struct DumpRequest {
    pub pid: i32,
    pub json: bool,
    pub full_paths: bool,
    pub verbose: bool,
    /// Each frame's local variables too.
    pub locals: bool,
    /// Threads running asyncio tasks as their tasks' logical stacks, and every
    /// task as a tree.
    pub async_tasks: bool,
}

/// How long `--locals` waits for the target's threads to stop.
const HOLD_DEADLINE: Duration = Duration::from_secs(2);
/// Longest `--async` holds the target's threads to read its waiting tasks (the
/// running ones are read whatever it takes, about 100 µs each): past it, the
/// rest are read with the target running, so that a server with 30,000 tasks is
/// not frozen for the 1.5 to 2.5 s reading them all takes.
const TASKS_HOLD: Duration = Duration::from_millis(100);

pub fn run(request: &DumpRequest) -> Result<ExitCode> {
    let mut walker = Walker::attach(request.pid)?;
    if request.verbose {
        eprintln!("pyprobe: {}", walker.describe());
    }
    let (stacks, tasks, locals) = if request.locals {
        let (stacks, locals) = read_with_locals(&mut walker, request)?;
        (stacks, None, locals)
    } else if request.async_tasks {
        let (stacks, mut tasks) = while_held(request, "asyncio tasks", || {
            walker.async_stacks_and_tasks(Instant::now() + TASKS_HOLD)
        })?;
        if let Some(listing) = tasks.as_mut().filter(|l| l.unread() > 0) {
            eprintln!(
                "pyprobe: process {}: {} asyncio tasks read while its threads were held (at \
                 most {} ms), the other {} with it running: a task that ran meanwhile is \
                 shown as it stood then",
                request.pid,
                listing.tasks.len(),
                TASKS_HOLD.as_millis(),
                listing.unread()
            );
            walker.read_rest(listing);
        }
        if let Some(running) = tasks
            .as_ref()
            .map(|l| l.pure_python_running)
            .filter(|&n| n > 0)
        {
            eprintln!(
                "pyprobe: process {}: asyncio's pure-Python tasks (asyncio.tasks._PyTask) are not \
                 listed on CPython 3.14+ ({}); those running now ({running}) stand in their \
                 threads' stacks",
                request.pid,
                super::dump_async::PURE_PYTHON_UNLISTED
            );
        }
        (stacks, tasks.map(|l| l.tasks), None)
    } else {
        (walker.stacks()?, None, None)
    };
    if request.async_tasks && tasks.is_none() {
        super::dump_async::why_no_tasks(&walker);
    }
    let names = SystemThreadNames::read(request.pid, &stacks);
    let text = if request.json {
        let mut value = render_json(&walker, &stacks, locals.as_deref(), &names);
        if let Some(tasks) = &tasks {
            value["asyncio_tasks"] = super::dump_async::json(tasks);
        }
        serde_json::to_string_pretty(&value).unwrap_or_default() + "\n"
    } else {
        let mut text = render_text(&stacks, locals.as_deref(), &names, request.full_paths);
        if let Some(tasks) = &tasks {
            text.push_str(&super::dump_async::render_text(tasks, request.full_paths));
        }
        text
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("cannot write to standard output")?;
    Ok(ExitCode::SUCCESS)
}

/// Each thread's locals, frame by frame (outermost first), beside its stack.
type ThreadLocals = Vec<Vec<Local>>;

/// The stacks and their frames' locals, read with every thread of the target held
/// (or, when it cannot be held, read running, which the user is told).
fn read_with_locals(
    walker: &mut Walker,
    request: &DumpRequest,
) -> Result<(Vec<ThreadStack>, Option<Vec<ThreadLocals>>)> {
    let pid = request.pid;
    if !walker.reads_locals() {
        eprintln!(
            "pyprobe: process {pid}: CPython {}: where a frame keeps its locals is not known \
             for this version; stacks only",
            walker.version()
        );
        return Ok((walker.stacks()?, None));
    }
    let read = while_held(request, "locals", || walker.stacks_with_locals());
    let (stacks, locals) = read?.into_iter().unzip();
    Ok((stacks, Some(locals)))
}

/// `read`, run with every thread of the target held (or, when it cannot be held,
/// running, which the user is told: `what` may then not belong together).
fn while_held<T>(request: &DumpRequest, what: &str, read: impl FnOnce() -> T) -> T {
    let pid = request.pid;
    let started = Instant::now();
    // Another tracer (a pyprobe recording it, a debugger) keeps its hold: no wait
    // for it to let go.
    let held = match tracer_of(pid) {
        Some(tracer) if tracer != 0 => Err(format!("it is traced by process {tracer}")),
        _ => hold(pid, started + HOLD_DEADLINE),
    };
    let held = match held {
        Ok(held) => Some(held),
        Err(why) => {
            eprintln!(
                "pyprobe: process {pid}: its threads could not be held ({why}): {what} read \
                 while it runs, so they may not belong together"
            );
            None
        }
    };
    let read = read();
    let threads = held.as_ref().map_or(0, |h| h.threads.len());
    // Let go before anything else: the target waits only for the read.
    drop(held);
    if request.verbose && threads > 0 {
        eprintln!(
            "pyprobe: process {pid}: {threads} thread{} held {:.1} ms to read stacks and {what}",
            if threads == 1 { "" } else { "s" },
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    read
}

/// What the system calls each thread: `/proc/PID/task/TID/comm` (Python 3.14+
/// gives it the `threading.Thread`'s name; a program can set it), and which one
/// is the process's main thread (its tid is the pid).
pub struct SystemThreadNames {
    pid: i32,
    /// The process's own name: a thread called the same has no name of its own.
    process: Option<String>,
    by_tid: std::collections::HashMap<i32, String>,
}

impl SystemThreadNames {
    pub fn read(pid: i32, stacks: &[ThreadStack]) -> SystemThreadNames {
        let comm = |path: String| {
            std::fs::read_to_string(path)
                .ok()
                .map(|s| s.trim_end_matches('\n').to_owned())
        };
        let by_tid = stacks
            .iter()
            .filter_map(|t| t.native_tid)
            .filter_map(|tid| Some((tid, comm(format!("/proc/{pid}/task/{tid}/comm"))?)))
            .collect();
        SystemThreadNames {
            pid,
            process: comm(format!("/proc/{pid}/comm")),
            by_tid,
        }
    }

    /// The system's name of the thread.
    pub fn name(&self, tid: i32) -> Option<&str> {
        self.by_tid.get(&tid).map(String::as_str)
    }

    /// The thread's name when it has one of its own (not the process's).
    fn own_name(&self, tid: i32) -> Option<&str> {
        self.name(tid)
            .filter(|n| Some(*n) != self.process.as_deref())
    }

    pub fn is_main(&self, tid: i32) -> bool {
        tid == self.pid
    }
}

/// Like a Python traceback: each thread, its frames outermost first, innermost last;
/// with `locals`, each frame's variables below it (`name = value`).
pub fn render_text(
    stacks: &[ThreadStack],
    locals: Option<&[ThreadLocals]>,
    names: &SystemThreadNames,
    full_paths: bool,
) -> String {
    let mut out = String::new();
    for (i, thread) in stacks.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let mut about = match thread.native_tid {
            Some(t) => format!("tid {t}"),
            None => "tid unknown".to_owned(),
        };
        if let Some(name) = thread.native_tid.and_then(|t| names.own_name(t)) {
            about.push_str(&format!(" \"{}\"", escaped(name)));
        }
        if thread.native_tid.is_some_and(|t| names.is_main(t)) {
            about.push_str(", the main thread");
        }
        about.push_str(&format!(", ident {:#x}", thread.thread_id));
        if thread.holds_gil == Some(true) {
            about.push_str(", holding the GIL");
        }
        out.push_str(&format!("Thread {about} (most recent call last):\n"));
        if thread.frames.is_empty() && !thread.truncated {
            out.push_str("  (no Python frames)\n");
        }
        if thread.truncated {
            out.push_str("  ... (older frames could not be read)\n");
        }
        let thread_locals = locals.and_then(|l| l.get(i));
        for (j, f) in thread.frames.iter().enumerate() {
            if &*f.file == TASK_FILE {
                // `--async`: the task the frames below run in.
                out.push_str(&format!("  {}\n", escaped(&f.function)));
                continue;
            }
            let file = if full_paths {
                &f.file
            } else {
                short_path(&f.file)
            };
            out.push_str(&format!(
                "  File \"{}\", line {}, in {}\n",
                escaped(file),
                f.line,
                escaped(&f.function)
            ));
            for local in thread_locals.and_then(|l| l.get(j)).into_iter().flatten() {
                out.push_str(&format!(
                    "    {} = {}\n",
                    escaped(&local.name),
                    escaped(local.value.as_deref().unwrap_or("<unbound>"))
                ));
            }
        }
    }
    if stacks.is_empty() {
        out.push_str("no Python thread states (the interpreter is starting or finalising)\n");
    }
    out
}

pub fn render_json(
    walker: &Walker,
    stacks: &[ThreadStack],
    locals: Option<&[ThreadLocals]>,
    names: &SystemThreadNames,
) -> serde_json::Value {
    let threads: Vec<_> = stacks
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let thread_locals = locals.and_then(|l| l.get(i));
            json!({
                "native_tid": t.native_tid,
                "name": t.native_tid.and_then(|tid| names.name(tid)),
                "main": t.native_tid.is_some_and(|tid| names.is_main(tid)),
                "thread_id": t.thread_id,
                "thread_state": format!("{:#x}", t.thread_state),
                "truncated": t.truncated,
                "holds_gil": t.holds_gil,
                "frames": t.frames.iter().enumerate().map(|(j, f)| {
                    let mut frame = json!({
                        "function": &*f.function,
                        "file": &*f.file,
                        "line": f.line,
                        "first_line": f.first_line,
                    });
                    if let Some(l) = thread_locals {
                        frame["locals"] = json!(l.get(j).cloned().unwrap_or_default());
                    }
                    frame
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "pid": walker.pid(),
        "python": walker.version().to_string(),
        "interpreter": walker.interpreter_path(),
        "layout": walker.layout_source().to_string(),
        "frames_order": "outermost first",
        "threads": threads,
    })
}
