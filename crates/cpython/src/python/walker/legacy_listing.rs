//! Every asyncio task of a process before 3.14, from asyncio's registry (see
//! `legacy_registry`): each with what awaits it, whether a thread runs it and
//! where it stands (`dump --async`); the logical stack of each task that waits
//! (`record --async=all`); and the task a thread runs where no `Handle._run`
//! shows it (uvloop's compiled loop).
//!
//! A task runs on a thread when its coroutine's frame is on that thread's stack;
//! it waits when its coroutine, and each it awaits in turn, is suspended in an
//! `await`, the last on something that is no coroutine (a future, a task).

use std::collections::HashMap;

use super::legacy_tasks::LegacyTasks;
use super::task_listing::TaskListing;
use super::tasks::{task_marker, AsyncTask, MAX_TASKS};
use super::waiting::WaitingPlan;
use super::{FrameAddresses, PyFrame, ThreadStack, Walker};

/// Where each frame of `frames` is: (index of its thread, index in its stack).
fn frames_on_stacks(frames: &[FrameAddresses]) -> HashMap<u64, (usize, usize)> {
    frames
        .iter()
        .enumerate()
        .flat_map(|(t, stack)| {
            stack
                .iter()
                .enumerate()
                .map(move |(i, &(f, _))| (f, (t, i)))
        })
        .collect()
}

/// Whether `frame` is the event loop's `BaseEventLoop._run_once`.
fn is_run_once(frame: &PyFrame) -> bool {
    &*frame.name == "_run_once" && frame.file.ends_with("base_events.py")
}

impl Walker {
    /// The tasks `_current_tasks` says the loops run, each with its coroutine
    /// and that coroutine's frame.
    pub(super) fn current_task_frames(&mut self, legacy: LegacyTasks) -> Vec<(u64, u64, u64)> {
        let Some(registry) = self.legacy_registry() else {
            return Vec::new();
        };
        self.current_tasks(&registry)
            .into_iter()
            .filter_map(|task| {
                let coro = self.task_coroutine(legacy, task)?;
                Some((task, coro, self.coroutine_frame(legacy, coro)?))
            })
            .collect()
    }

    /// Every task of the process (at most [`MAX_TASKS`]), as
    /// `Walker::async_stacks_and_tasks` lists them (the running ones first, the
    /// others until `deadline`), from the threads' stacks as walked (`stacks`,
    /// their frames at `frames`); `None` until asyncio's registry is found.
    pub(super) fn legacy_list(
        &mut self,
        legacy: LegacyTasks,
        stacks: &[ThreadStack],
        frames: &[FrameAddresses],
        deadline: std::time::Instant,
    ) -> Option<TaskListing> {
        let registry = self.legacy_registry()?;
        let on_stack = frames_on_stacks(frames);
        let tasks = self.registered_tasks(legacy, &registry, MAX_TASKS);
        let coros: Vec<u64> = tasks.iter().map(|&(_, coro)| coro).collect();
        let running: HashMap<u64, (usize, usize)> = tasks
            .iter()
            .zip(self.coroutine_frames(legacy, &coros))
            .filter_map(|(&(task, _), frame)| Some((task, *on_stack.get(&frame?)?)))
            .collect();
        Some(self.in_order(
            &tasks,
            deadline,
            |(task, _)| running.contains_key(&task),
            |walker, (task, coro)| {
                let at = running.get(&task).copied();
                walker.legacy_task(legacy, task, coro, at, stacks)
            },
        ))
    }

    /// The task at `task` (its coroutine `coro`), running at `at` (the index
    /// of its thread in `stacks`, and of its coroutine's frame there), or
    /// waiting.
    pub(super) fn legacy_task(
        &mut self,
        legacy: LegacyTasks,
        task: u64,
        coro: u64,
        at: Option<(usize, usize)>,
        stacks: &[ThreadStack],
    ) -> Option<AsyncTask> {
        let info = self.legacy_task_info(legacy, task, coro)?;
        let on = at.and_then(|(t, i)| Some((stacks.get(t)?, i)));
        let frames = match on {
            Some((stack, i)) => stack.frames.get(i..).unwrap_or_default().to_vec(),
            None => self.awaiting_coroutines(legacy, coro).0,
        };
        Some(AsyncTask {
            parent: info.awaited_by.first().copied(),
            running: on.is_some(),
            running_on: on.and_then(|(stack, _)| stack.native_tid),
            info,
            frames,
        })
    }

    /// What the tasks that wait are read from (see `WaitingPlan`), from the
    /// threads' stacks as walked: the tasks the loops run (`_current_tasks`),
    /// and the thread the others are put on, the one running the event loop
    /// (`_run_once`, or a running task), when one alone does. The tasks
    /// themselves are read once the threads run again
    /// ([`Self::legacy_plan_tasks`]).
    pub(super) fn legacy_waiting_plan(
        &mut self,
        legacy: LegacyTasks,
        stacks: &[ThreadStack],
        frames: &[FrameAddresses],
    ) -> WaitingPlan {
        let mut plan = WaitingPlan::new(stacks, true);
        let on_stack = frames_on_stacks(frames);
        let mut loops: Vec<usize> = stacks
            .iter()
            .enumerate()
            .filter(|(_, s)| s.frames.iter().any(is_run_once))
            .map(|(t, _)| t)
            .collect();
        for (task, _, frame) in self.current_task_frames(legacy) {
            plan.running.insert(task);
            loops.extend(on_stack.get(&frame).map(|&(t, _)| t));
        }
        loops.sort_unstable();
        loops.dedup();
        plan.on = match loops.as_slice() {
            [t] => Some(*t),
            _ => None,
        };
        plan
    }

    /// The members of asyncio's registry into `plan`, once: each read as its
    /// turn comes ([`Self::member_task`]), so that a tick of a server with
    /// 30,000 tasks reads its sets' tables, not every task.
    pub(super) fn legacy_plan_tasks(&mut self, plan: &mut WaitingPlan) {
        if !plan.members.is_empty() {
            return;
        }
        if let Some(registry) = self.legacy_registry() {
            plan.members = self.registry_members(&registry);
        }
    }

    /// The logical stack of the task at `task` (its coroutine `coro`), if it
    /// waits: its coroutines each suspended in an await, the last on something
    /// that is no coroutine.
    pub(super) fn legacy_waiting_task(
        &mut self,
        legacy: LegacyTasks,
        task: u64,
        coro: u64,
        standing: &mut HashMap<u64, Vec<PyFrame>>,
    ) -> Option<Vec<PyFrame>> {
        let (own, awaited) = self.awaiting_coroutines(legacy, coro);
        let awaited = awaited.filter(|_| !own.is_empty())?;
        let info = self.legacy_task_info(legacy, task, coro)?;
        let mut frames = self.legacy_prefix(legacy, &info, standing);
        frames.push(task_marker(&info));
        let end = self.awaited_marker(&own, Some(awaited));
        frames.extend(own);
        frames.push(end);
        Some(frames)
    }
}
