//! `dump --async`: every asyncio task of a process, each with what awaits it,
//! whether a thread runs it and where it stands, read while its threads are held
//! for a bounded time: the running tasks first (their frames are the held
//! stacks'), then the waiting ones until the deadline; the rest are read after
//! the threads are let go, so that a server with tens of thousands of tasks is
//! not frozen for seconds. A waiting task's objects change only when it runs.

use std::collections::HashMap;
use std::time::Instant;

use super::layout::AsyncioObjects;
use super::tasks::{read_fields, AsyncTask, TaskLayout};
use super::{FrameAddresses, ThreadStack, Walker};

/// A task and its coroutine (before 3.14; 0 from 3.14, where the task's layout
/// gives it).
pub(super) type TaskAndCoroutine = (u64, u64);

/// The tasks of one look: those read, and those left to read.
#[derive(Debug, Default)]
pub struct TaskListing {
    /// In address order.
    pub tasks: Vec<AsyncTask>,
    /// Tasks not read by the deadline, none of them running then: (task, its
    /// coroutine before 3.14, else 0).
    rest: Vec<TaskAndCoroutine>,
    /// 3.14+: asyncio's pure-Python tasks found running, not in `tasks` (only
    /// the lists of asyncio's C tasks are read there).
    pub pure_python_running: usize,
}

impl TaskListing {
    /// How many tasks are left to read ([`Walker::read_rest`]).
    pub fn unread(&self) -> usize {
        self.rest.len()
    }
}

impl Walker {
    /// As [`Walker::async_stacks`] of held threads, with every asyncio task of
    /// the process, at most [`super::MAX_TASKS`]: on 3.14+ its C tasks, in the
    /// lists asyncio keeps per thread and for the interpreter; before, those of
    /// asyncio's own registry (see `legacy_listing`). The running tasks are read
    /// now, the waiting ones until `deadline`, the rest left for
    /// [`Walker::read_rest`]. `None` before asyncio is loaded, and before 3.7.
    /// One walk serves both.
    pub fn async_stacks_and_tasks(
        &mut self,
        deadline: Instant,
    ) -> anyhow::Result<(Vec<ThreadStack>, Option<TaskListing>)> {
        let (mut stacks, frames) = self.walk_keeping_frames(false)?;
        let Some(layout) = self.task_layout() else {
            let Some(legacy) = self.legacy_tasks else {
                // 3.14+ without asyncio's C module: only pure-Python tasks.
                let running = self.make_logical_pure(&mut stacks, &frames);
                let listing = (running > 0).then(|| TaskListing {
                    pure_python_running: running,
                    ..TaskListing::default()
                });
                return Ok((stacks, listing));
            };
            let tasks = self.legacy_list(legacy, &stacks, &frames, deadline);
            self.make_logical_legacy(legacy, &mut stacks, &frames);
            return Ok((stacks, tasks));
        };
        let mut tasks = self.list(layout, &stacks, &frames, deadline);
        self.make_logical(layout, &mut stacks, &frames);
        tasks.pure_python_running = self.make_logical_pure(&mut stacks, &frames);
        Ok((stacks, Some(tasks)))
    }

    /// Reads the tasks `listing` left, as waiting ones, into its list.
    pub fn read_rest(&mut self, listing: &mut TaskListing) {
        let rest = std::mem::take(&mut listing.rest);
        let layout = self.task_layout();
        for (task, coro) in rest {
            let read = match (layout, self.legacy_tasks) {
                (Some(layout), _) => self.published_task(layout, task, None, &[], &[]),
                (None, Some(legacy)) => self.legacy_task(legacy, task, coro, None, &[]),
                (None, None) => None,
            };
            listing.tasks.extend(read);
        }
        listing.tasks.sort_unstable_by_key(|t| t.info.address);
    }

    /// Every task in the lists of the threads of `stacks` and of the interpreter,
    /// the running ones first, the others until `deadline`.
    fn list(
        &mut self,
        layout: (TaskLayout, AsyncioObjects),
        stacks: &[ThreadStack],
        frames: &[FrameAddresses],
        deadline: Instant,
    ) -> TaskListing {
        let found: Vec<TaskAndCoroutine> = self
            .all_tasks(layout.0, stacks)
            .into_iter()
            .map(|(task, _)| (task, 0))
            .collect();
        let running: HashMap<u64, usize> =
            self.running_tasks(layout.0, stacks).into_iter().collect();
        self.in_order(
            &found,
            deadline,
            |(task, _)| running.contains_key(&task),
            |walker, (task, _)| {
                let thread = running.get(&task).copied();
                walker.published_task(layout, task, thread, stacks, frames)
            },
        )
    }

    /// Lists `tasks` with `read`: those `is_running` says run first, then the
    /// others until `deadline`, the rest left unread; in address order.
    pub(super) fn in_order(
        &mut self,
        tasks: &[TaskAndCoroutine],
        deadline: Instant,
        is_running: impl Fn(TaskAndCoroutine) -> bool,
        mut read: impl FnMut(&mut Walker, TaskAndCoroutine) -> Option<AsyncTask>,
    ) -> TaskListing {
        let mut listing = TaskListing::default();
        let (running, waiting): (Vec<TaskAndCoroutine>, Vec<TaskAndCoroutine>) =
            tasks.iter().partition(|&&pair| is_running(pair));
        for pair in running {
            listing.tasks.extend(read(self, pair));
        }
        for (k, &pair) in waiting.iter().enumerate() {
            if Instant::now() >= deadline {
                listing.rest = waiting[k..].to_vec();
                break;
            }
            listing.tasks.extend(read(self, pair));
        }
        listing.tasks.sort_unstable_by_key(|t| t.info.address);
        listing
    }

    /// The task at `task` (3.14+), run by the thread `thread` of `stacks` (its
    /// frames at `frames`), or waiting.
    fn published_task(
        &mut self,
        (tasks, objects): (TaskLayout, AsyncioObjects),
        task: u64,
        thread: Option<usize>,
        stacks: &[ThreadStack],
        frames: &[FrameAddresses],
    ) -> Option<AsyncTask> {
        let fields = read_fields(&self.reader.mem, tasks, task)?;
        let info = self.task_info(objects, task, &fields)?;
        let parent = self
            .parent(tasks, objects, &info.awaited_by)
            .map(|(p, _)| p);
        let stack = thread.and_then(|t| Some((stacks.get(t)?, frames.get(t)?)));
        let frames = match (stack, info.coro_frame()) {
            (Some((stack, walked)), Some(coro)) => {
                match walked
                    .iter()
                    .position(|&(f, _)| f == coro)
                    .and_then(|at| stack.frames.get(at..))
                {
                    Some(running) => running.to_vec(),
                    // The loop's current task, caught between its step's start
                    // and its coroutine's resume (or after it yielded): the
                    // coroutine is suspended, and read as a waiting one is.
                    None => self.awaited_frames(objects, coro),
                }
            }
            (None, Some(coro)) => self.awaited_frames(objects, coro),
            (_, None) => Vec::new(),
        };
        Some(AsyncTask {
            running_on: stack.and_then(|(stack, _)| stack.native_tid),
            running: stack.is_some(),
            info,
            parent,
            frames,
        })
    }
}
