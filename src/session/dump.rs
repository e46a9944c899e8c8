//! `pyprobe dump -p PID [--format text|json]`: every thread's Python stack, once, read
//! with the frame walker (no ptrace: the target is not stopped), each thread with
//! its system name and whether it is the main thread.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, Result};
use serde_json::json;

use pyprobe_cpython::python::walker::{ThreadStack, Walker};
use pyprobe_recording::output::names::short_path;
use pyprobe_recording::output::terminal::escaped;

pub struct DumpRequest {
    pub pid: i32,
    pub json: bool,
    pub full_paths: bool,
    pub verbose: bool,
}

pub fn run(request: &DumpRequest) -> Result<ExitCode> {
    let mut walker = Walker::attach(request.pid)?;
    if request.verbose {
        eprintln!("pyprobe: {}", walker.describe());
    }
    let stacks = walker.stacks()?;
    let names = SystemThreadNames::read(request.pid, &stacks);
    let text = if request.json {
        render_json(&walker, &stacks, &names) + "\n"
    } else {
        render_text(&stacks, &names, request.full_paths)
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("cannot write to standard output")?;
    Ok(ExitCode::SUCCESS)
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

/// Like a Python traceback: each thread, its frames outermost first, innermost last.
pub fn render_text(stacks: &[ThreadStack], names: &SystemThreadNames, full_paths: bool) -> String {
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
        for f in &thread.frames {
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
        }
    }
    if stacks.is_empty() {
        out.push_str("no Python thread states (the interpreter is starting or finalising)\n");
    }
    out
}

pub fn render_json(walker: &Walker, stacks: &[ThreadStack], names: &SystemThreadNames) -> String {
    let threads: Vec<_> = stacks
        .iter()
        .map(|t| {
            json!({
                "native_tid": t.native_tid,
                "name": t.native_tid.and_then(|tid| names.name(tid)),
                "main": t.native_tid.is_some_and(|tid| names.is_main(tid)),
                "thread_id": t.thread_id,
                "thread_state": format!("{:#x}", t.thread_state),
                "truncated": t.truncated,
                "holds_gil": t.holds_gil,
                "frames": t.frames.iter().map(|f| json!({
                    "function": &*f.function,
                    "file": &*f.file,
                    "line": f.line,
                    "first_line": f.first_line,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let value = json!({
        "pid": walker.pid(),
        "python": walker.version().to_string(),
        "interpreter": walker.interpreter_path(),
        "layout": walker.layout_source().to_string(),
        "frames_order": "outermost first",
        "threads": threads,
    });
    serde_json::to_string_pretty(&value).unwrap_or_default()
}
