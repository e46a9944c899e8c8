//! `dump --async`: every asyncio task of the process as a tree, each under the task
//! that awaits it, with its state (running on a thread, or waiting) and where its
//! coroutine stands; like `python -m asyncio pstree` of CPython 3.14, from outside.

use std::collections::HashMap;

use serde_json::{json, Value};

use pyprobe_cpython::python::walker::{AsyncTask, PyFrame, Walker, MAX_TASKS};
use pyprobe_recording::output::names::short_path;
use pyprobe_recording::output::terminal::escaped;

/// Why asyncio's pure-Python tasks are not listed on CPython 3.14+ (said by
/// `dump --async` and in the caveat of `record --async=all`).
pub(crate) const PURE_PYTHON_UNLISTED: &str = "pyprobe reads the lists of asyncio's C tasks \
     there, and CPython keeps the others apart";

/// Says on stderr why the tasks of the process cannot be read.
pub fn why_no_tasks(walker: &Walker) {
    let why = if walker.version().at_least(3, 14) {
        "asyncio's C module is not loaded (no task has been made)".to_string()
    } else if walker.version().at_least(3, 7) {
        "asyncio is not imported, or its C module is not loaded".to_string()
    } else {
        format!(
            "CPython {}: pyprobe reads asyncio's tasks from 3.7 on",
            walker.version()
        )
    };
    eprintln!(
        "pyprobe: --async: process {}: no asyncio tasks read: {why}",
        walker.pid()
    );
}

/// One frame as the text shows it: `function (file:line)`.
fn frame_text(f: &PyFrame, full_paths: bool) -> String {
    let file = if full_paths {
        &f.file
    } else {
        short_path(&f.file)
    };
    format!("{} ({}:{})", escaped(&f.function), escaped(file), f.line)
}

/// The tree of tasks, roots (awaited by no task) first in the order listed.
pub fn render_text(tasks: &[AsyncTask], full_paths: bool) -> String {
    let mut out = format!(
        "\nasyncio tasks: {}{}\n",
        tasks.len(),
        if tasks.len() >= MAX_TASKS {
            " (the first listed; more were not read)"
        } else {
            ""
        }
    );
    let listed: HashMap<u64, usize> = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| (t.info.address, i))
        .collect();
    let mut children: HashMap<Option<u64>, Vec<usize>> = HashMap::new();
    for (i, t) in tasks.iter().enumerate() {
        // A parent not in the list (a task of another kind) makes a root.
        let parent = t.parent.filter(|p| listed.contains_key(p));
        children.entry(parent).or_default().push(i);
    }
    let mut stack: Vec<(usize, usize)> = children
        .get(&None)
        .into_iter()
        .flatten()
        .rev()
        .map(|&i| (i, 0))
        .collect();
    let mut shown = 0;
    while let Some((i, depth)) = stack.pop() {
        shown += 1;
        let t = &tasks[i];
        let indent = "  ".repeat(depth.min(32) + 1);
        let state = match (t.running, t.running_on) {
            (true, Some(tid)) => format!("running on tid {tid}"),
            (true, None) => "running".to_string(),
            (false, _) => "waiting".to_string(),
        };
        let shared = if t.info.awaiters > 1 {
            format!(", awaited by {}", t.info.awaiters)
        } else {
            String::new()
        };
        let frames: Vec<String> = t.frames.iter().map(|f| frame_text(f, full_paths)).collect();
        out.push_str(&format!(
            "{indent}{} ({state}{shared}){}{}\n",
            escaped(&t.info.name),
            if frames.is_empty() { "" } else { ": " },
            frames.join(" → ")
        ));
        for &c in children
            .get(&Some(t.info.address))
            .into_iter()
            .flatten()
            .rev()
        {
            stack.push((c, depth + 1));
        }
    }
    // Tasks in a loop of awaiters have no root to hang from.
    if shown < tasks.len() {
        out.push_str(&format!(
            "  ... {} tasks awaiting each other in a loop\n",
            tasks.len() - shown
        ));
    }
    out
}

/// The tasks as JSON: each with its address, name, state, what awaits it, frames.
pub fn json(tasks: &[AsyncTask]) -> Value {
    Value::Array(
        tasks
            .iter()
            .map(|t| {
                json!({
                    "address": format!("{:#x}", t.info.address),
                    "name": t.info.name,
                    "named_by_program": t.info.named,
                    "running": t.running,
                    "running_on": t.running_on,
                    "awaited_by": t.parent.map(|p| format!("{p:#x}")),
                    "awaiters": t.info.awaiters,
                    "frames": t.frames.iter().map(|f| json!({
                        "function": &*f.function,
                        "file": &*f.file,
                        "line": f.line,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}
