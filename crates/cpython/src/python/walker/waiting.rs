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

/// The sample of a waiting task whose logical stack is `frames`, on the thread
/// of `on` (`None`: no thread's): no GIL, off any CPU.
pub(super) fn waiting_stack(on: Option<&ThreadStack>, frames: Vec<PyFrame>) -> ThreadStack {
    ThreadStack {
        native_tid: on.and_then(|s| s.native_tid),
        thread_id: on.map_or(0, |s| s.thread_id),
        thread_state: on.map_or(0, |s| s.thread_state),
        frames,
        truncated: false,
        torn: false,
        eval_calls: None,
        holds_gil: Some(false),
    }
}

impl Walker {
    /// As [`Walker::async_stacks`], with the logical stacks of the tasks that no
    /// thread runs, within `limits`: the tasks are taken in address order from
    /// `limits.start`, round the list, so that past a limit the others come at
    /// the next samples. Before 3.14 the tasks are those of asyncio's own
    /// registry (see `legacy_listing`). No waiting task before asyncio is loaded.
    pub fn async_stacks_and_waiting(
        &mut self,
        running: bool,
        limits: WaitingLimits,
    ) -> anyhow::Result<(Vec<ThreadStack>, WaitingTasks)> {
        let (mut stacks, frames) = self.walk_keeping_frames(running)?;
        let Some(layout) = self.task_layout() else {
            let Some(legacy) = self.legacy_tasks else {
                return Ok((stacks, WaitingTasks::default()));
            };
            // The waiting tasks first: they are told from the threads' own stacks.
            let waiting = self.legacy_waiting(legacy, &stacks, &frames, limits);
            self.make_logical_legacy(legacy, &mut stacks, &frames);
            return Ok((stacks, waiting));
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
        // Per task: where its awaiters and it stand, read once a tick (a server's
        // tasks share their awaiters).
        let mut standing: HashMap<u64, Vec<PyFrame>> = HashMap::new();
        // The budget is for reading the tasks: the lists themselves are walked
        // whole (a linked list has no other way in), about 2 µs a task.
        self.in_turn(found.len(), limits, |walker, i| {
            let (task, thread) = found[i];
            if running.iter().any(|&(t, _)| t == task) {
                return None;
            }
            let fields = read_fields(&walker.reader.mem, tasks, task)?;
            let info = walker.task_info(objects, task, &fields)?;
            // A task that waits has its coroutine suspended in an await: one
            // not started yet is ready to run, one finished is done.
            let coro = info
                .coro_frame()
                .filter(|&f| walker.is_awaiting(objects, f))?;
            let mut frames = walker.awaiting_prefix(layout, &info, &mut standing);
            frames.push(task_marker(&info));
            let (own, awaited) = walker.awaited_end(objects, coro);
            if own.is_empty() {
                return None;
            }
            let end = walker.awaited_marker(&own, awaited);
            frames.extend(own);
            frames.push(end);
            let on = thread.and_then(|i| stacks.get(i));
            Some(waiting_stack(on, frames))
        })
    }

    /// Reads the waiting tasks `0..count` in turn with `read` (a task's stack, or
    /// `None` for one that does not wait), from `limits.start` round the list,
    /// until the limits say stop: the next sample begins where this one ended.
    pub(super) fn in_turn(
        &mut self,
        count: usize,
        limits: WaitingLimits,
        mut read: impl FnMut(&mut Walker, usize) -> Option<ThreadStack>,
    ) -> WaitingTasks {
        let mut out = WaitingTasks::default();
        let deadline = std::time::Instant::now() + limits.budget;
        let first = if count == 0 { 0 } else { limits.start % count };
        out.next = first;
        for k in 0..count {
            if out.stacks.len() >= limits.max || std::time::Instant::now() >= deadline {
                out.deferred = count - k;
                break;
            }
            let i = (first + k) % count;
            out.next = (i + 1) % count;
            out.stacks.extend(read(self, i));
        }
        out
    }

    /// The last frame of a waiting task's stack, after `own` (its coroutines,
    /// the last awaiting `awaited`): `[sleep]` in `asyncio.sleep`, else what it
    /// awaits (`[awaiting Future]`).
    pub(super) fn awaited_marker(&mut self, own: &[PyFrame], awaited: Option<u64>) -> PyFrame {
        let sleeping = own
            .last()
            .is_some_and(|f| &*f.name == "sleep" && f.file.ends_with("asyncio/tasks.py"));
        if sleeping {
            return marker_frame("[sleep]");
        }
        marker_frame(&match awaited.and_then(|a| self.awaited_name(a)) {
            Some(name) => format!("[awaiting {name}]"),
            None => "[awaiting]".to_string(),
        })
    }

    /// What a task awaits, by the type of the object at `addr`, as the program
    /// names it (`Future`, `Task`, `_GatheringFuture`): through the iterator
    /// `await future` makes (`_asyncio.FutureIter`, whose first field is its
    /// future), without the C module's prefix.
    pub(super) fn awaited_name(&mut self, addr: u64) -> Option<String> {
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
