//! `pyprobe dump -p PID [--format text|json]`: every thread's Python stack, once, read
//! with the frame walker (no ptrace: the target is not stopped).

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, Result};
use serde_json::json;

use crate::python::walker::{ThreadStack, Walker};

pub struct DumpRequest {
    pub pid: i32,
    pub json: bool,
}

pub fn run(request: &DumpRequest) -> Result<ExitCode> {
    let mut walker = Walker::attach(request.pid)?;
    eprintln!("pyprobe: {}", walker.describe());
    let stacks = walker.stacks()?;
    let text = if request.json {
        render_json(&walker, &stacks) + "\n"
    } else {
        render_text(&stacks)
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("cannot write to standard output")?;
    Ok(ExitCode::SUCCESS)
}

/// Like a Python traceback: each thread, its frames outermost first, innermost last.
pub fn render_text(stacks: &[ThreadStack]) -> String {
    let mut out = String::new();
    for (i, thread) in stacks.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let tid = thread
            .native_tid
            .map_or_else(|| "tid unknown".to_owned(), |t| format!("tid {t}"));
        let gil = match thread.holds_gil {
            Some(true) => ", holding the GIL",
            _ => "",
        };
        out.push_str(&format!(
            "Thread {tid}, ident {:#x}{gil} (most recent call last):\n",
            thread.thread_id
        ));
        if thread.frames.is_empty() && !thread.truncated {
            out.push_str("  (no Python frames)\n");
        }
        if thread.truncated {
            out.push_str("  ... (older frames could not be read)\n");
        }
        for f in &thread.frames {
            out.push_str(&format!(
                "  File \"{}\", line {}, in {}\n",
                f.file, f.line, f.function
            ));
        }
    }
    if stacks.is_empty() {
        out.push_str("no Python thread states (the interpreter is starting or finalising)\n");
    }
    out
}

pub fn render_json(walker: &Walker, stacks: &[ThreadStack]) -> String {
    let threads: Vec<_> = stacks
        .iter()
        .map(|t| {
            json!({
                "native_tid": t.native_tid,
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
