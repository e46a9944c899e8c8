//! `record --async=all`: besides each thread's stack, the logical stack of every
//! asyncio task that waits, so that a wall-clock view shows what the program
//! waits on: the tasks awaiting it (as for a running task), its own marker, the
//! coroutines it stands in, and a last marker naming what it awaits
//! (`[awaiting Future]`, `[awaiting Task]`, `[awaiting _GatheringFuture]`;
//! `[sleep]` in `asyncio.sleep`).

use std::collections::HashMap;

use super::layout::AsyncioObjects;
use super::objects::read_u64;
use super::tasks::{marker_frame, read_fields, task_marker, TaskLayout};
use super::values::ValueReader;
use super::{PyFrame, ThreadStack, Walker};

/// How much of a sample the waiting tasks may take.
#[derive(Debug, Clone, Copy)]
pub struct WaitingLimits {
    /// Most waiting tasks sampled.
    pub max: usize,
    /// Longest time spent reading them (the threads are held meanwhile).
    pub budget: std::time::Duration,
    /// Where in the list of tasks (by address) to begin: the previous sample's
    /// `next`, so that tasks past a limit are read at later samples, in turn.
    pub start: usize,
}

/// The waiting tasks of one sample, and how many were not looked at.
#[derive(Debug, Default)]
pub struct WaitingTasks {
    /// One stack per waiting task, on the thread whose list holds it (`None`:
    /// the interpreter's list, of threads that ended): no GIL, off any CPU.
    pub stacks: Vec<ThreadStack>,
    /// Tasks not looked at, past a limit: the next samples begin with them.
    pub deferred: usize,
    /// Where the next sample should begin ([`WaitingLimits::start`]).
    pub next: usize,
}

impl Walker {
    /// As [`Walker::async_stacks`], with the logical stacks of the tasks that no
    /// thread runs, within `limits`: the tasks are taken in address order from
    /// `limits.start`, round the list, so that past a limit the others come at
    /// the next samples. No waiting task where the version publishes no task
    /// layout (before 3.14: the running ones' stacks are still logical) or
    /// asyncio is not loaded.
    pub fn async_stacks_and_waiting(
        &mut self,
        running: bool,
        limits: WaitingLimits,
    ) -> anyhow::Result<(Vec<ThreadStack>, WaitingTasks)> {
        let (mut stacks, frames) = self.walk_keeping_frames(running)?;
        let Some(layout) = self.task_layout() else {
            if let Some(legacy) = self.legacy_tasks {
                self.make_logical_legacy(legacy, &mut stacks, &frames);
            }
            return Ok((stacks, WaitingTasks::default()));
        };
        // The running tasks first: their frames' addresses are this walk's.
        self.make_logical(layout, &mut stacks, &frames);
        let waiting = self.waiting_tasks(layout, &stacks, limits);
        Ok((stacks, waiting))
    }

    /// The logical stacks of the tasks in the lists of the threads of `stacks`
    /// and of the interpreter whose coroutine is suspended in an await, within
    /// `limits`.
    fn waiting_tasks(
        &mut self,
        layout: (TaskLayout, AsyncioObjects),
        stacks: &[ThreadStack],
        limits: WaitingLimits,
    ) -> WaitingTasks {
        let (tasks, objects) = layout;
        let found = self.all_tasks(tasks, stacks);
        let running = self.running_tasks(tasks, stacks);
        let mut out = WaitingTasks::default();
        // Per task: where its awaiters and it stand, read once a tick (a server's
        // tasks share their awaiters).
        let mut standing: HashMap<u64, Vec<PyFrame>> = HashMap::new();
        // The budget is for reading the tasks: the lists themselves are walked
        // whole (a linked list has no other way in), about 2 µs a task.
        let deadline = std::time::Instant::now() + limits.budget;
        let count = found.len();
        let first = if count == 0 { 0 } else { limits.start % count };
        out.next = first;
        for k in 0..count {
            if out.stacks.len() >= limits.max || std::time::Instant::now() >= deadline {
                out.deferred = count - k;
                break;
            }
            let (task, thread) = found[(first + k) % count];
            out.next = (first + k + 1) % count;
            if running.iter().any(|&(t, _)| t == task) {
                continue;
            }
            let Some(fields) = read_fields(&self.reader.mem, tasks, task) else {
                continue;
            };
            let Some(info) = self.task_info(objects, task, &fields) else {
                continue;
            };
            // A task that waits has its coroutine suspended in an await: one
            // not started yet is ready to run, one finished is done.
            let Some(coro) = info.coro_frame().filter(|&f| self.is_awaiting(objects, f)) else {
                continue;
            };
            let mut frames = self.awaiting_prefix(layout, &info, &mut standing);
            frames.push(task_marker(&info));
            let (own, awaited) = self.awaited_end(objects, coro);
            if own.is_empty() {
                continue;
            }
            let sleeping = own
                .last()
                .is_some_and(|f| &*f.name == "sleep" && f.file.ends_with("asyncio/tasks.py"));
            frames.extend(own);
            frames.push(if sleeping {
                marker_frame("[sleep]")
            } else {
                let what = awaited.and_then(|a| self.awaited_name(a));
                marker_frame(&match what {
                    Some(name) => format!("[awaiting {name}]"),
                    None => "[awaiting]".to_string(),
                })
            });
            let on = thread.and_then(|i| stacks.get(i));
            out.stacks.push(ThreadStack {
                native_tid: on.and_then(|s| s.native_tid),
                thread_id: on.map_or(0, |s| s.thread_id),
                thread_state: on.map_or(0, |s| s.thread_state),
                frames,
                truncated: false,
                torn: false,
                eval_calls: None,
                holds_gil: Some(false),
            });
        }
        out
    }

    /// What a task awaits, by the type of the object at `addr`, as the program
    /// names it (`Future`, `Task`, `_GatheringFuture`): through the iterator
    /// `await future` makes (`_asyncio.FutureIter`, whose first field is its
    /// future), without the C module's prefix.
    fn awaited_name(&mut self, addr: u64) -> Option<String> {
        let locals = self.reader.layout.locals?;
        let mut values = ValueReader::new(&self.reader.mem, &self.reader.layout, locals);
        let mut name = values.type_name(addr)?;
        if name == "_asyncio.FutureIter" {
            let future = read_u64(&self.reader.mem, addr.checked_add(locals.object_head)?).ok()?;
            name = values.type_name(future)?;
        }
        Some(name.strip_prefix("_asyncio.").unwrap_or(&name).to_owned())
    }
}
