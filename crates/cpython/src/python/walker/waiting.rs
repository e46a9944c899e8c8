//! `record --async=all`: besides each thread's stack, the logical stack of every
//! asyncio task that waits, so that a wall-clock view shows what the program
//! waits on: the tasks awaiting it (as for a running task), its own marker, the
//! coroutines it stands in, and a last marker naming what it awaits
//! (`[awaiting Future]`, `[awaiting Task]`, `[awaiting _GatheringFuture]`;
//! `[sleep]` in `asyncio.sleep`).

use std::collections::{HashMap, HashSet};

use super::layout::AsyncioObjects;
use super::legacy_registry::Member;
use super::objects::read_u64;
use super::tasks::{marker_frame, read_fields, task_marker, TaskLayout};
use super::values::ValueReader;
use super::{PyFrame, ThreadStack, Walker};

/// How much of a sample the waiting tasks may take.
#[derive(Debug, Clone, Copy)]
pub struct WaitingLimits {
    /// Most waiting tasks sampled.
    pub max: usize,
    /// Longest time spent reading them.
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
        kept: false,
    }
}

/// What a tick's waiting tasks are read from, found while its threads were held:
/// which tasks ran then (a task that ran is that thread's sample, not a waiting
/// one) and the threads. Read with [`Walker::waiting_of`], once the threads are
/// let go, which lists the tasks (3.14+: asyncio's lists, each link checked;
/// before: asyncio's registry) and reads each waiting one: a waiting task's
/// objects change only when it runs.
#[derive(Debug, Default)]
pub struct WaitingPlan {
    /// 3.14+, in address order: (task, the index in `threads` of the thread
    /// whose list holds it).
    pub(super) tasks: Vec<(u64, Option<usize>)>,
    pub(super) running: HashSet<u64>,
    /// The threads of the tick, frames left out.
    threads: Vec<ThreadStack>,
    /// Before 3.14: the members of asyncio's registry, read after the hold, and
    /// the index in `threads` of the thread the waiting tasks are put on.
    pub(super) members: Vec<Member>,
    pub(super) on: Option<usize>,
    /// Before 3.14 (the tasks from asyncio's registry).
    legacy: bool,
}

impl WaitingPlan {
    pub(super) fn new(stacks: &[ThreadStack], legacy: bool) -> WaitingPlan {
        let threads = stacks
            .iter()
            .map(|s| waiting_stack(Some(s), Vec::new()))
            .collect();
        WaitingPlan {
            threads,
            legacy,
            ..WaitingPlan::default()
        }
    }
}

impl Walker {
    /// As [`Walker::async_stacks`], with the logical stacks of the tasks that no
    /// thread runs, within `limits` (see [`Walker::waiting_of`]).
    pub fn async_stacks_and_waiting(
        &mut self,
        running: bool,
        limits: WaitingLimits,
    ) -> anyhow::Result<(Vec<ThreadStack>, WaitingTasks)> {
        let (stacks, mut plan) = self.async_stacks_and_waiting_plan(running)?;
        let waiting = self.waiting_of(&mut plan, limits);
        Ok((stacks, waiting))
    }

    /// As [`Walker::async_stacks`], with what the tasks that wait are read from
    /// ([`Walker::waiting_of`]): of held threads, the part that needs them held.
    /// Before 3.14 the tasks are those of asyncio's own registry (see
    /// `legacy_listing`). No task before asyncio is loaded.
    pub fn async_stacks_and_waiting_plan(
        &mut self,
        running: bool,
    ) -> anyhow::Result<(Vec<ThreadStack>, WaitingPlan)> {
        let (mut stacks, frames) = self.walk_keeping_frames(running)?;
        let Some(layout) = self.task_layout() else {
            let Some(legacy) = self.legacy_tasks else {
                self.make_logical_pure(&mut stacks, &frames);
                return Ok((stacks, WaitingPlan::default()));
            };
            // The plan first: it is told from the threads' own stacks.
            let plan = self.legacy_waiting_plan(legacy, &stacks, &frames);
            self.make_logical_legacy(legacy, &mut stacks, &frames);
            return Ok((stacks, plan));
        };
        let mut plan = WaitingPlan::new(&stacks, false);
        plan.running = self
            .running_tasks(layout.0, &stacks)
            .into_iter()
            .map(|(task, _)| task)
            .collect();
        // The running tasks' stacks: their frames' addresses are this walk's.
        self.make_logical(layout, &mut stacks, &frames);
        self.make_logical_pure(&mut stacks, &frames);
        Ok((stacks, plan))
    }

    /// The logical stacks of the tasks of `plan` that did not run, within
    /// `limits`: taken in address order from `limits.start`, round the list, so
    /// that past a limit the others come at the next samples.
    pub fn waiting_of(&mut self, plan: &mut WaitingPlan, limits: WaitingLimits) -> WaitingTasks {
        let layout = self.task_layout();
        let legacy = self.legacy_tasks.filter(|_| plan.legacy);
        match (legacy, layout) {
            (Some(_), _) => self.legacy_plan_tasks(plan),
            // asyncio's lists are walked now, the threads running: each link is
            // checked as it is followed, and a list cut by a task that ended
            // meanwhile ends there for this tick.
            (None, Some(layout)) if plan.tasks.is_empty() => {
                plan.tasks = self.all_tasks(layout.0, &plan.threads);
            }
            _ => {}
        }
        let count = match legacy {
            Some(_) => plan.members.len(),
            None => plan.tasks.len(),
        };
        // Per task: where its awaiters and it stand, read once a tick (a server's
        // tasks share their awaiters).
        let mut standing: HashMap<u64, Vec<PyFrame>> = HashMap::new();
        self.in_turn(count, limits, |walker, i| {
            let (task, coro, thread) = match legacy {
                Some(legacy) => {
                    let (task, coro) = walker.member_task(legacy, *plan.members.get(i)?)?;
                    (task, coro, plan.on)
                }
                None => {
                    let (task, thread) = *plan.tasks.get(i)?;
                    (task, 0, thread)
                }
            };
            if plan.running.contains(&task) {
                return None;
            }
            let frames = match (legacy, layout) {
                (Some(legacy), _) => walker.legacy_waiting_task(legacy, task, coro, &mut standing),
                (None, Some(layout)) => walker.waiting_task(layout, task, &mut standing),
                (None, None) => None,
            }?;
            let on = thread.and_then(|i| plan.threads.get(i));
            Some(waiting_stack(on, frames))
        })
    }

    /// The logical stack of the task at `task` (3.14+), if it waits: its
    /// coroutine suspended in an await (one not started yet is ready to run, one
    /// finished is done).
    fn waiting_task(
        &mut self,
        layout: (TaskLayout, AsyncioObjects),
        task: u64,
        standing: &mut HashMap<u64, Vec<PyFrame>>,
    ) -> Option<Vec<PyFrame>> {
        let (tasks, objects) = layout;
        let fields = read_fields(&self.reader.mem, tasks, task)?;
        let info = self.task_info(objects, task, &fields)?;
        let coro = info
            .coro_frame()
            .filter(|&f| self.is_awaiting(objects, f))?;
        let mut frames = self.awaiting_prefix(layout, &info, standing);
        frames.push(task_marker(&info));
        let (own, awaited) = self.awaited_end(objects, coro);
        if own.is_empty() {
            return None;
        }
        let end = self.awaited_marker(&own, awaited);
        frames.extend(own);
        frames.push(end);
        Some(frames)
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
    /// future), or the generator the pure-Python future's `__await__` makes
    /// (its first local, `self`, a future), without the C module's prefix.
    pub(super) fn awaited_name(&mut self, addr: u64) -> Option<String> {
        let locals = self.reader.layout.locals?;
        let mut values = ValueReader::new(&self.reader.mem, &self.reader.layout, locals);
        let mut name = values.type_name(addr)?;
        if name == "_asyncio.FutureIter" {
            let future = read_u64(&self.reader.mem, addr.checked_add(locals.object_head)?).ok()?;
            name = values.type_name(future)?;
        } else if let Some(legacy) = self.legacy_tasks.filter(|_| name == "generator") {
            let future = self
                .coroutine_frame(legacy, addr)
                .and_then(|frame| frame.checked_add(locals.frame_localsplus))
                .and_then(|at| read_u64(&self.reader.mem, at).ok());
            let awaited = future.and_then(|f| values.type_name(f));
            name = awaited
                .filter(|n| n.ends_with("Task") || n.ends_with("Future"))
                .unwrap_or(name);
        }
        Some(name.strip_prefix("_asyncio.").unwrap_or(&name).to_owned())
    }
}
