//! asyncio's tasks as the program sees them, read from its memory: which task each
//! thread runs, and the tasks that await it, so that a sample shows the task's
//! logical stack (`[task Task-1]`, `main`, `[task worker-3]`, `worker`, `fetch`)
//! rather than the event loop's frames.
//!
//! CPython 3.14+ publish the layout of asyncio's C tasks in the `.AsyncioDebug`
//! section of the object that defines them (the interpreter, or the `_asyncio`
//! extension module once imported), as they publish the interpreter's in
//! `_Py_DebugOffsets`: a task's name, coroutine and awaiters (`task_awaited_by`: one
//! future, or a set of them), and in each thread state the task it runs. A task
//! awaited through a future that is not a task (`gather`'s) is awaited by what
//! awaits that future. Where several await one task, the one at the lowest address
//! is its parent, and the marker says how many there are.
//!
//! Every read is bounded and checked: a chain of awaiters longer than
//! [`MAX_ANCESTORS`] or a loop in it ends the chain, never the sample.

use std::collections::HashMap;

use super::layout::AsyncioObjects;
use super::objects::{field_u64, plausible_pointer, read_u64};
use super::values::ValueReader;
use super::{FrameAddresses, PyFrame, ThreadStack, Walker};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::process::objects::{mapped_files, open_object};
use pyprobe_sdt::process::read_maps;
use pyprobe_sdt::sdt::MemoryReader;

/// Words of `_Py_AsyncioModuleDebugOffsets`: the task object's seven, the
/// interpreter state's two, the thread state's four.
const SECTION_WORDS: usize = 13;
/// Largest plausible task object and thread state.
const MAX_TASK_SIZE: u64 = 4096;
const MAX_TSTATE_SIZE: u64 = 1 << 20;
const MAX_INTERP_SIZE: u64 = 64 << 20;
/// Most tasks listed (`dump --async`).
pub const MAX_TASKS: usize = 100_000;
/// Most awaiting tasks followed above a running one.
pub(crate) const MAX_ANCESTORS: usize = 64;
/// Most futures that are not tasks followed between two tasks.
const MAX_FUTURE_HOPS: usize = 8;
/// Most task names kept.
const MAX_NAMES: usize = 4096;
/// Most coroutines followed down from a waiting task's own (see
/// [`Walker::awaited_frames`]).
const MAX_AWAIT_DEPTH: usize = 64;
/// Largest plausible distance from a frame to the top of its value stack.
const MAX_FRAME_SPAN: u64 = 1 << 20;
/// Most entries of an awaiters' set looked at.
const MAX_SET_ENTRIES: u64 = 1 << 16;
/// How long to wait before looking for asyncio's layout again (a program imports
/// asyncio some time after it starts; the look reads the process's maps).
const LOOK_AGAIN: std::time::Duration = std::time::Duration::from_millis(100);
/// The file shown for a task's marker frame.
pub const TASK_FILE: &str = "<asyncio>";

/// Where asyncio keeps what a logical stack needs (3.14+).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TaskLayout {
    name: u64,
    awaited_by: u64,
    is_task: u64,
    awaited_by_is_set: u64,
    coro: u64,
    /// A task's node in its thread's list of tasks (`struct llist_node`: next, prev).
    pub(super) node: u64,
    /// The head of the list of tasks of the interpreter (tasks of threads that
    /// ended), and of each thread state.
    pub(super) interpreter_tasks: u64,
    pub(super) thread_tasks: u64,
    /// In a thread state: the task it runs now (0: none).
    pub(super) running_task: u64,
}

impl TaskLayout {
    /// The layout from the section's bytes, if every offset lies inside its
    /// structure of a plausible size.
    pub(crate) fn parse(bytes: &[u8]) -> Option<TaskLayout> {
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .take(SECTION_WORDS)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
            .collect();
        if words.len() < SECTION_WORDS {
            return None;
        }
        let task_size = words[0];
        let tstate_size = words[9];
        let in_task = words[1..7].iter().all(|&o| o < task_size);
        let in_interpreter = words[8] < words[7] && words[7] <= MAX_INTERP_SIZE;
        let in_tstate = words[10..13].iter().all(|&o| o < tstate_size);
        let plausible = (1..=MAX_TASK_SIZE).contains(&task_size)
            && (1..=MAX_TSTATE_SIZE).contains(&tstate_size)
            && in_task
            && in_interpreter
            && in_tstate;
        plausible.then_some(TaskLayout {
            name: words[1],
            awaited_by: words[2],
            is_task: words[3],
            awaited_by_is_set: words[4],
            coro: words[5],
            node: words[6],
            interpreter_tasks: words[8],
            thread_tasks: words[12],
            running_task: words[11],
        })
    }
}

/// The task layout of process `pid`, from the first mapped object (the
/// interpreter, `_asyncio`'s module) that carries `.AsyncioDebug`, read from its
/// memory; `None` before asyncio's C module is loaded, or on versions without it.
pub(crate) fn find_task_layout(pid: i32, mem: &ProcessMemory) -> Option<TaskLayout> {
    let maps = read_maps(pid).ok()?;
    for entries in mapped_files(&maps) {
        let name = entries[0].path.rsplit('/').next().unwrap_or_default();
        if !(name.contains("python") || name.starts_with("_asyncio")) {
            continue;
        }
        let Some(object) = open_object(pid, &entries) else {
            continue;
        };
        let Some((address, size)) = object.elf.asyncio_debug_section else {
            continue;
        };
        let mut bytes = [0u8; SECTION_WORDS * 8];
        if size < bytes.len() as u64 {
            continue;
        }
        if mem.read_exact(object.runtime(address), &mut bytes).is_ok() {
            return TaskLayout::parse(&bytes);
        }
    }
    None
}

/// What a task is, as a logical stack shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInfo {
    pub address: u64,
    /// Its name (`Task-N` when the program gave none).
    pub name: String,
    /// Whether the program gave that name (else asyncio did).
    pub named: bool,
    /// Its coroutine's frame.
    pub(super) coro_frame: Option<u64>,
    /// How many await it (0 for the outermost).
    pub awaiters: usize,
    /// The tasks and futures that await it.
    pub(super) awaited_by: Vec<u64>,
}

impl TaskInfo {
    /// Its coroutine's frame.
    pub(super) fn coro_frame(&self) -> Option<u64> {
        self.coro_frame
    }
}

/// The marker frame of a task in a logical stack: `[task NAME]`, `[task]` for a
/// task the program did not name (so that the samples of a server's thousands of
/// request tasks add up), and with several awaiters `(awaited by N)` after it.
pub fn task_marker(task: &TaskInfo) -> PyFrame {
    let name = if task.named {
        format!(" {}", task.name)
    } else {
        String::new()
    };
    let text = if task.awaiters > 1 {
        format!("[task{name} (awaited by {})]", task.awaiters)
    } else {
        format!("[task{name}]")
    };
    marker_frame(&text)
}

/// A frame of a logical stack that is no Python code: a task's marker, what a
/// waiting task awaits. Its file is [`TASK_FILE`].
pub(super) fn marker_frame(text: &str) -> PyFrame {
    let text: std::sync::Arc<str> = text.into();
    PyFrame {
        file: TASK_FILE.into(),
        function: text.clone(),
        name: text,
        first_line: 0,
        line: 0,
    }
}

impl Walker {
    /// As [`Walker::stacks`] (`running`: read running, as by [`Walker::stacks_at_tick`]), each
    /// thread that runs an asyncio task shown as the task's logical stack: the tasks
    /// awaiting it, outermost first, each a marker frame and the frames of the
    /// coroutines it stands in (see [`Self::awaited_frames`]),
    /// then its own marker and the frames from its coroutine in. Before 3.14, which
    /// publishes no layout of asyncio's tasks, the tasks are found from asyncio's
    /// own objects (see `legacy_tasks`), 3.8 to 3.13; so are the pure-Python
    /// tasks of 3.14+. Threads that run no task, and every thread where asyncio
    /// is not loaded, come back as they are.
    pub fn async_stacks(&mut self, running: bool) -> anyhow::Result<Vec<ThreadStack>> {
        let (mut stacks, frames) = self.walk_keeping_frames(running)?;
        if let Some(layout) = self.task_layout() {
            self.make_logical(layout, &mut stacks, &frames);
        } else if let Some(legacy) = self.legacy_tasks {
            self.make_logical_legacy(legacy, &mut stacks, &frames);
        }
        self.make_logical_pure(&mut stacks, &frames);
        Ok(stacks)
    }

    /// 3.14+: makes the stack of each thread that runs one of asyncio's
    /// pure-Python tasks its logical stack (see `legacy_tasks`); returns how
    /// many it made. A stack made logical already (a C task's) has no
    /// `Handle._run` left: it stays.
    pub(super) fn make_logical_pure(
        &mut self,
        stacks: &mut [ThreadStack],
        frames: &[FrameAddresses],
    ) -> usize {
        if self.legacy_tasks.is_some() || self.instances.is_none() {
            return 0;
        }
        let Some(objects) = self.reader.layout.objects else {
            return 0;
        };
        let pure = super::legacy_tasks::LegacyTasks::pure_python(objects);
        let made = self.make_logical_legacy(pure, stacks, frames);
        self.pure_python_tasks_seen |= made > 0;
        made
    }

    /// Whether a thread was seen running one of asyncio's pure-Python tasks on
    /// 3.14+, where those cannot be listed: their waiting ones are missing from
    /// `--async=all` and `dump --async`.
    pub fn unlisted_tasks_seen(&self) -> bool {
        self.pure_python_tasks_seen
    }

    /// asyncio's task layout and the objects it needs, looked for again now and
    /// then until found (asyncio may be imported later); `None` until then, and on
    /// versions that publish none.
    pub(super) fn task_layout(&mut self) -> Option<(TaskLayout, AsyncioObjects)> {
        let objects = self.reader.layout.objects?;
        let due = self
            .tasks_looked_for
            .is_none_or(|at| at.elapsed() >= LOOK_AGAIN);
        if self.tasks.is_none() && due {
            self.tasks_looked_for = Some(std::time::Instant::now());
            self.tasks = find_task_layout(self.pid, &self.reader.mem);
        }
        Some((self.tasks?, objects))
    }

    /// Makes the stack of each thread that runs a task its logical stack.
    pub(super) fn make_logical(
        &mut self,
        layout: (TaskLayout, AsyncioObjects),
        stacks: &mut [ThreadStack],
        frames: &[FrameAddresses],
    ) {
        for (stack, frames) in stacks.iter_mut().zip(frames) {
            if let Some(logical) = self.logical_stack(layout, stack, frames) {
                stack.frames = logical;
            }
        }
    }

    /// The logical stack of `stack` (whose frames are at `frames`, outermost
    /// first), if its thread runs a task whose coroutine is on it.
    fn logical_stack(
        &mut self,
        (tasks, objects): (TaskLayout, AsyncioObjects),
        stack: &ThreadStack,
        frames: &FrameAddresses,
    ) -> Option<Vec<PyFrame>> {
        let mem = &self.reader.mem;
        let task = read_u64(mem, stack.thread_state.checked_add(tasks.running_task)?).ok()?;
        let fields = read_fields(mem, tasks, task)?;
        let running = self.task_info(objects, task, &fields)?;
        let from = frames
            .iter()
            .position(|&(f, _)| Some(f) == running.coro_frame)
            .filter(|&i| i < stack.frames.len())?;
        let mut logical = self.awaiting_prefix((tasks, objects), &running, &mut HashMap::new());
        logical.push(task_marker(&running));
        logical.extend(stack.frames[from..].iter().cloned());
        Some(logical)
    }

    /// The tasks awaiting `first`, outermost first, each its marker frame and
    /// the frames of the coroutines it stands in: what comes above `first`'s own
    /// marker in a logical stack. `standing` keeps, per awaiting task, its own
    /// part and all above it, so that the tasks of one sample that share their
    /// awaiters read them once. At most [`MAX_ANCESTORS`]; a loop in the awaiters
    /// ends the chain.
    pub(super) fn awaiting_prefix(
        &mut self,
        layout: (TaskLayout, AsyncioObjects),
        first: &TaskInfo,
        standing: &mut HashMap<u64, Vec<PyFrame>>,
    ) -> Vec<PyFrame> {
        let mut seen = vec![first.address];
        self.standing_above(layout, first, standing, &mut seen)
    }

    fn standing_above(
        &mut self,
        (tasks, objects): (TaskLayout, AsyncioObjects),
        task: &TaskInfo,
        standing: &mut HashMap<u64, Vec<PyFrame>>,
        seen: &mut Vec<u64>,
    ) -> Vec<PyFrame> {
        let Some((parent, fields)) = self.parent(tasks, objects, &task.awaited_by) else {
            return Vec::new();
        };
        if let Some(known) = standing.get(&parent) {
            return known.clone();
        }
        if seen.contains(&parent) || seen.len() > MAX_ANCESTORS {
            return Vec::new();
        }
        seen.push(parent);
        let Some(info) = self.task_info(objects, parent, &fields) else {
            return Vec::new();
        };
        let mut frames = self.standing_above((tasks, objects), &info, standing, seen);
        frames.push(task_marker(&info));
        if let Some(frame) = info.coro_frame {
            frames.extend(self.awaited_frames(objects, frame));
        }
        standing.insert(parent, frames.clone());
        frames
    }

    /// Every task in the lists asyncio keeps (each thread's of `stacks`, and
    /// the interpreter's, of threads that ended), in address order, each with
    /// the index in `stacks` of the thread whose list holds it (`None`: the
    /// interpreter's); at most [`MAX_TASKS`]. Each list's nodes are kept and read
    /// again in one go at the next look (see [`list_nodes`]).
    pub(super) fn all_tasks(
        &mut self,
        tasks: TaskLayout,
        stacks: &[ThreadStack],
    ) -> Vec<(u64, Option<usize>)> {
        let mut heads: Vec<(u64, Option<usize>)> = stacks
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((s.thread_state.checked_add(tasks.thread_tasks)?, Some(i))))
            .collect();
        if let Some(interp) = self.main_interpreter() {
            heads.extend(
                interp
                    .checked_add(tasks.interpreter_tasks)
                    .map(|h| (h, None)),
            );
        }
        let mut found = Vec::new();
        let mut lists = HashMap::new();
        for (head, thread) in heads {
            let mut nodes = Vec::new();
            let known = self.task_lists.get(&head).map_or(&[][..], Vec::as_slice);
            let room = MAX_TASKS.saturating_sub(found.len());
            list_nodes(&self.reader.mem, head, known, room, &mut nodes);
            found.extend(
                nodes
                    .iter()
                    .filter_map(|n| n.checked_sub(tasks.node))
                    .map(|t| (t, thread)),
            );
            lists.insert(head, nodes);
        }
        // The lists of threads that ended go with them.
        self.task_lists = lists;
        found.sort_unstable();
        found.dedup_by_key(|(t, _)| *t);
        found
    }

    /// The task each thread of `stacks` runs, read once: (task, index of its
    /// thread).
    pub(super) fn running_tasks(
        &self,
        tasks: TaskLayout,
        stacks: &[ThreadStack],
    ) -> Vec<(u64, usize)> {
        stacks
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let at = s.thread_state.checked_add(tasks.running_task)?;
                Some((read_u64(&self.reader.mem, at).ok()?, i))
            })
            .collect()
    }

    /// Where a waiting task stands: the frame of its suspended coroutine (at
    /// `frame`), then that of the coroutine it awaits, and so on, outermost first
    /// (`main`, `gather_workers`). A suspended coroutine's frame has no caller
    /// link; what it awaits is the top of its value stack (below a NULL on 3.15)
    /// while its state says it is suspended in an `await`. The chain ends at an awaited object of another
    /// type than the task's own coroutine (a future, a task, a generator), at
    /// [`MAX_AWAIT_DEPTH`], or at the first read that fails; without the layout
    /// for it (before 3.14) it is the task's own frame alone.
    pub(super) fn awaited_frames(&mut self, objects: AsyncioObjects, frame: u64) -> Vec<PyFrame> {
        self.awaited_end(objects, frame).0
    }

    /// As [`Self::awaited_frames`], with the object the last coroutine awaits
    /// when it is not a coroutine (a future, a task): what the task waits on.
    pub(super) fn awaited_end(
        &mut self,
        objects: AsyncioObjects,
        frame: u64,
    ) -> (Vec<PyFrame>, Option<u64>) {
        let mut out = Vec::new();
        let mut frame = frame;
        let mut coroutine_type = None;
        for _ in 0..MAX_AWAIT_DEPTH {
            // A suspended coroutine's frame links to no caller: one that does is
            // on a thread's stack, running, whatever its state byte says.
            let (mut walked, _) = self.reader.frames(frame);
            if walked.len() != 1 {
                break;
            }
            let Some(top) = walked.pop() else { break };
            out.push(top);
            let Some(awaited) = self.awaited_object(objects, frame, &mut coroutine_type) else {
                break;
            };
            let ob_type = self.reader.layout.ob_type;
            let is_coroutine = awaited
                .checked_add(ob_type)
                .and_then(|at| read_u64(&self.reader.mem, at).ok())
                .is_some_and(|t| Some(t) == coroutine_type);
            match awaited.checked_add(objects.gen_iframe) {
                Some(next) if is_coroutine => frame = next,
                _ => return (out, Some(awaited)),
            }
        }
        (out, None)
    }

    /// Whether the coroutine whose frame is at `frame` is suspended in an
    /// `await` (not running, not finished, not yet started).
    pub(super) fn is_awaiting(&self, objects: AsyncioObjects, frame: u64) -> bool {
        let Some(awaits) = objects.awaits else {
            return false;
        };
        let mut state = [0u8; 1];
        frame
            .checked_sub(objects.gen_iframe)
            .and_then(|c| c.checked_add(awaits.gen_frame_state))
            .is_some_and(|at| {
                self.reader.mem.read_exact(at, &mut state).is_ok()
                    && awaits.awaiting_states.contains(&state[0])
            })
    }

    /// The object the suspended coroutine whose frame is at `frame` awaits, if
    /// it is suspended in an `await`; sets `coroutine_type` to that coroutine's
    /// type on the first call.
    fn awaited_object(
        &self,
        objects: AsyncioObjects,
        frame: u64,
        coroutine_type: &mut Option<u64>,
    ) -> Option<u64> {
        let awaits = objects.awaits?;
        let mem = &self.reader.mem;
        let ob_type = self.reader.layout.ob_type;
        let coroutine = frame.checked_sub(objects.gen_iframe)?;
        if coroutine_type.is_none() {
            *coroutine_type = Some(read_u64(mem, coroutine.checked_add(ob_type)?).ok()?);
        }
        if !self.is_awaiting(objects, frame) {
            return None;
        }
        let top = read_u64(mem, frame.checked_add(awaits.frame_stackpointer)?).ok()?;
        if top <= frame || top - frame > MAX_FRAME_SPAN || top % 8 != 0 {
            return None;
        }
        // The awaited object is the top entry of the stack; 3.15 keeps a NULL
        // (tag bits alone) above it while suspended.
        let mut two = [0u8; 16];
        mem.read_exact(top.checked_sub(16)?, &mut two).ok()?;
        let entry = |i: usize| {
            let bytes: [u8; 8] = two[i * 8..i * 8 + 8].try_into().unwrap_or_default();
            u64::from_le_bytes(bytes) & !awaits.tag_mask
        };
        let awaited = match entry(1) {
            0 => entry(0),
            top_entry => top_entry,
        };
        plausible_pointer(awaited).then_some(awaited)
    }

    /// The task at `task`, whose fields are `fields`: its name, its coroutine's
    /// frame, what awaits it.
    pub(super) fn task_info(
        &mut self,
        objects: AsyncioObjects,
        task: u64,
        fields: &Fields,
    ) -> Option<TaskInfo> {
        let (name_object, coro) = fields.task?;
        let coro_frame = plausible_pointer(coro)
            .then(|| coro.checked_add(objects.gen_iframe))
            .flatten();
        let awaited_by = awaiters(&self.reader.mem, objects, fields);
        let (name, named) = self.task_name(task, name_object);
        Some(TaskInfo {
            address: task,
            name,
            named,
            coro_frame,
            awaiters: awaited_by.len(),
            awaited_by,
        })
    }

    /// A task's name as the program would print it, and whether the program gave it:
    /// asyncio names a task created without a name by a number it keeps until asked
    /// (`Task-N` then). Kept by task and name object: a task renamed gets a new name
    /// object.
    pub(super) fn task_name(&mut self, task: u64, object: u64) -> (String, bool) {
        if let Some(name) = self.task_names.get(&(task, object)) {
            return name.clone();
        }
        let Some(locals) = self.reader.layout.locals else {
            return (format!("<task at {task:#x}>"), false);
        };
        let shown = ValueReader::new(&self.reader.mem, &self.reader.layout, locals).show(object);
        let name = if shown.len() >= 2 && (shown.starts_with('\'') || shown.starts_with('"')) {
            let text = shown[1..shown.len() - 1].to_string();
            let named = !is_asyncio_name(&text);
            (text, named)
        } else if !shown.is_empty() && shown.bytes().all(|b| b.is_ascii_digit()) {
            (format!("Task-{shown}"), false)
        } else {
            (shown, true)
        };
        if self.task_names.len() >= MAX_NAMES {
            self.task_names.clear();
        }
        self.task_names.insert((task, object), name.clone());
        name
    }

    /// The task awaiting a task whose awaiters are `awaited_by` (through futures
    /// that are not tasks, as `gather`'s; the one at the lowest address where
    /// several do), with its fields.
    pub(super) fn parent(
        &self,
        tasks: TaskLayout,
        objects: AsyncioObjects,
        awaited_by: &[u64],
    ) -> Option<(u64, Fields)> {
        let mem = &self.reader.mem;
        let mut first = awaited_by.iter().copied().min()?;
        for _ in 0..MAX_FUTURE_HOPS {
            let fields = read_fields(mem, tasks, first)?;
            if fields.task.is_some() {
                return Some((first, fields));
            }
            first = awaiters(mem, objects, &fields).into_iter().min()?;
        }
        None
    }
}

/// An asyncio task, as `dump --async` lists it.
#[derive(Debug, Clone)]
pub struct AsyncTask {
    pub info: TaskInfo,
    /// The task awaiting it (the one at the lowest address where several do).
    pub parent: Option<u64>,
    /// A thread runs it now.
    pub running: bool,
    /// That thread's kernel tid, where known.
    pub running_on: Option<i32>,
    /// Running: its thread's frames from its coroutine in; waiting: its coroutine's
    /// frame, at the line it awaits on.
    pub frames: Vec<PyFrame>,
}

/// The nodes of the list at `head`, in order, into `nodes`: the ones `known`
/// (the list at the last look) read in one go and taken while each still links
/// to the next, then the rest one by one. At most `max`. Each node (`struct
/// llist_node`: next, prev) must link back to the one before it: the list is
/// read while the program runs, and a task that ends meanwhile cuts it there.
fn list_nodes(mem: &ProcessMemory, head: u64, known: &[u64], max: usize, nodes: &mut Vec<u64>) {
    let Ok(mut node) = read_u64(mem, head) else {
        return;
    };
    let mut before = head;
    let word = |links: &[u8], at: usize| field_u64(links, at as u64).unwrap_or(0);
    let known = &known[..known.len().min(max)];
    if known.first() == Some(&node) {
        let mut links = vec![0u8; known.len() * 16];
        let read = mem.read_blocks(known, 16, &mut links);
        for (i, &at) in known[..read].iter().enumerate() {
            if at != node || !plausible_pointer(at) || word(&links, i * 16 + 8) != before {
                break;
            }
            nodes.push(at);
            before = at;
            node = word(&links, i * 16);
        }
    }
    while node != head && plausible_pointer(node) && nodes.len() < max {
        let mut link = [0u8; 16];
        if mem.read_exact(node, &mut link).is_err() || word(&link, 8) != before {
            return;
        }
        nodes.push(node);
        before = node;
        node = word(&link, 0);
    }
}

/// Whether `name` is one asyncio gives a task created without a name: `Task-N`.
fn is_asyncio_name(name: &str) -> bool {
    name.strip_prefix("Task-")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// What the chain needs of a task or a future, read at once.
pub(super) struct Fields {
    awaited_by: u64,
    awaited_by_is_set: bool,
    /// A task's name object and coroutine; `None` for a future that is not a task.
    task: Option<(u64, u64)>,
}

/// The fields of the task or future at `at`: its head first (a future is smaller
/// than a task, so the task's own fields are read only past it where they exist).
pub(super) fn read_fields(mem: &ProcessMemory, tasks: TaskLayout, at: u64) -> Option<Fields> {
    if !plausible_pointer(at) {
        return None;
    }
    let head_end = (tasks.awaited_by + 8)
        .max(tasks.is_task + 1)
        .max(tasks.awaited_by_is_set + 1) as usize;
    let task_end = (head_end as u64).max(tasks.name + 8).max(tasks.coro + 8) as usize;
    let mut buf = vec![0u8; task_end];
    if mem.read_exact(at, &mut buf).is_err() {
        // A future whose object ends before a task's fields, at a mapping's end.
        buf.truncate(head_end);
        mem.read_exact(at, &mut buf).ok()?;
    }
    let word = |o: u64| {
        buf.get(o as usize..o as usize + 8)
            .and_then(|w| w.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let byte = |o: u64| buf.get(o as usize).copied();
    let is_task = byte(tasks.is_task)? != 0;
    let task = if is_task {
        Some((word(tasks.name)?, word(tasks.coro)?))
    } else {
        None
    };
    Some(Fields {
        awaited_by: word(tasks.awaited_by)?,
        awaited_by_is_set: byte(tasks.awaited_by_is_set)? != 0,
        task,
    })
}

/// The objects that await a task or future: its `awaited_by`, one object or a
/// set's entries.
fn awaiters(mem: &ProcessMemory, objects: AsyncioObjects, fields: &Fields) -> Vec<u64> {
    let by = fields.awaited_by;
    if !plausible_pointer(by) {
        return Vec::new();
    }
    if fields.awaited_by_is_set {
        set_entries(mem, objects, by)
    } else {
        vec![by]
    }
}

/// The keys of the set at `set`, whose table and mask are at these offsets.
fn set_entries(mem: &ProcessMemory, objects: AsyncioObjects, set: u64) -> Vec<u64> {
    set_keys(
        mem,
        set,
        (objects.set_table, objects.set_mask),
        MAX_SET_ENTRIES,
    )
}

/// The keys of the set at `set` (`PySetObject`: `mask + 1` entries of key and
/// hash at `table`), without the empty and deleted ones (a deleted entry's hash is
/// -1); none past `max_slots` entries.
pub(super) fn set_keys(
    mem: &ProcessMemory,
    set: u64,
    (table, mask): (u64, u64),
    max_slots: u64,
) -> Vec<u64> {
    let (Some(table_at), Some(mask_at)) = (set.checked_add(table), set.checked_add(mask)) else {
        return Vec::new();
    };
    let (Ok(table), Ok(mask)) = (read_u64(mem, table_at), read_u64(mem, mask_at)) else {
        return Vec::new();
    };
    let slots = mask.saturating_add(1);
    if !plausible_pointer(table) || slots > max_slots || !slots.is_power_of_two() {
        return Vec::new();
    }
    let mut bytes = vec![0u8; (slots * 16) as usize];
    if mem.read_exact(table, &mut bytes).is_err() {
        return Vec::new();
    }
    bytes
        .chunks_exact(16)
        .filter_map(|entry| {
            let key = u64::from_le_bytes(entry[..8].try_into().ok()?);
            let hash = i64::from_le_bytes(entry[8..].try_into().ok()?);
            (key != 0 && hash != -1 && plausible_pointer(key)).then_some(key)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(words: [u64; SECTION_WORDS]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn asyncio_names_its_tasks_task_n_and_a_program_names_them_otherwise() {
        assert!(is_asyncio_name("Task-1"));
        assert!(is_asyncio_name("Task-9977"));
        assert!(!is_asyncio_name("Task-"));
        assert!(!is_asyncio_name("Task-1a"));
        assert!(!is_asyncio_name("worker-2"));
        let unnamed = TaskInfo {
            address: 1,
            name: "Task-3".into(),
            named: false,
            coro_frame: None,
            awaiters: 1,
            awaited_by: vec![2],
        };
        assert_eq!(&*task_marker(&unnamed).function, "[task]");
        let shared = TaskInfo {
            name: "fetch".into(),
            named: true,
            awaiters: 2,
            ..unnamed
        };
        assert_eq!(
            &*task_marker(&shared).function,
            "[task fetch (awaited by 2)]"
        );
    }

    #[test]
    fn debian_314s_section_parses_and_implausible_ones_do_not() {
        // `.AsyncioDebug` of Debian's 3.14 `_asyncio` module.
        let words = [
            168, 136, 96, 108, 109, 128, 152, 225864, 10880, 936, 864, 872, 880,
        ];
        let layout = TaskLayout::parse(&section(words)).unwrap();
        assert_eq!(
            (layout.name, layout.coro, layout.running_task),
            (136, 128, 872)
        );
        assert_eq!(TaskLayout::parse(&section(words)[..96]), None);
        let mut outside = words;
        outside[1] = 168;
        assert_eq!(TaskLayout::parse(&section(outside)), None);
        let mut huge = words;
        huge[9] = u64::MAX;
        assert_eq!(TaskLayout::parse(&section(huge)), None);
    }
}
