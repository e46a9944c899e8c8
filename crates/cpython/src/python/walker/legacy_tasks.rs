//! asyncio's running tasks on CPython 3.7 to 3.13, which publish no layout of them:
//! the task a thread runs, and the tasks awaiting it, found from what asyncio's
//! own objects hold.
//!
//! * **The running task.** A task runs inside the event loop's `Handle._run`,
//!   whose `self` (its first local) is the handle, whose `_callback` (a slot) is
//!   what steps the task: a `TaskStepMethWrapper` (its task the first field), or
//!   the wakeup of a task whose awaited future finished (`TaskWakeupMethWrapper`
//!   up to 3.9, the built-in method `task_wakeup` bound to the task from 3.10).
//!   The task's coroutine must be the next coroutine frame of the stack, or the
//!   stack is left as it is.
//! * **Its awaiters.** A task awaiting another added its wakeup to the other's
//!   done-callbacks (`fut_callback0`, then the list `fut_callbacks` of
//!   (callback, context) pairs). `gather` adds its `_done_callback` instead, whose
//!   closure holds the `_GatheringFuture` the awaiting task's wakeup waits on; and
//!   `wait_for` up to 3.11 a `functools.partial` holding the future it waits on.
//!   Both are followed, at most [`MAX_FUTURE_HOPS`] deep. A `TaskGroup` (3.11+)
//!   adds its `_on_task_done`, bound to the group, whose `_parent_task` (read by
//!   name, see `instances`) awaits its tasks. asyncio's pure-Python task (see
//!   `py_tasks`) is read from its attributes instead, wherever a C task is.
//!
//! * **Where a waiting task stands.** A suspended coroutine awaits the object on
//!   top of its frame's value stack: followed while it is a coroutine, as 3.14's
//!   layout allows.
//!
//! From 3.14, asyncio's C tasks are read through the layout the interpreter
//! publishes (see `tasks`), but its pure-Python task is not one of them: it
//! keeps its own current task (`asyncio.tasks._current_tasks`), not the thread
//! state's. Its running task is found the same way as before 3.14, from
//! `Handle._run`, and its awaiters from its done-callbacks
//! ([`LegacyTasks::pure_python`]); the coroutines a waiting task stands in are
//! read through the published layout.
//!
//! The offsets are asyncio's C structures' (`TaskObj`, `FutureObj`) and the
//! interpreter's, the same on every build of a minor version, measured on each
//! (with `ctypes`, against objects whose addresses Python gives) and checked by
//! the logical-stack tests of `tests/integration/async_tasks.rs` on every version
//! this machine has. Every read is bounded; a read that fails, or an object of
//! another type than expected, ends the chain there.

use std::collections::HashMap;

use super::layout::AsyncioObjects;
use super::objects::{field_u64, plausible_pointer, read_u64};
use super::tasks::{task_marker, TaskInfo, MAX_ANCESTORS};
use super::values::ValueReader;
use super::{FrameAddresses, PyFrame, ThreadStack, Walker};
use pyprobe_sdt::process::memory::read_c_string;
use pyprobe_sdt::sdt::MemoryReader;

/// `FutureObj`: its first done-callback, and the list of the others.
const FUT_CALLBACK0: u64 = 24;
const FUT_CALLBACKS: u64 = 40;
/// `Handle._callback`: the second slot of `asyncio.events.Handle`.
const HANDLE_CALLBACK: u64 = 24;
/// `TaskStepMethWrapper.sw_task`, `TaskWakeupMethWrapper.ww_task`.
const WRAPPER_TASK: u64 = 16;
/// `PyCFunctionObject.m_ml` and `m_self`.
const CFUNCTION_ML: u64 = 16;
const CFUNCTION_SELF: u64 = 24;
/// `partial.args`.
const PARTIAL_ARGS: u64 = 24;
/// `PyCellObject.ob_ref`.
const CELL_REF: u64 = 16;
/// `PyVarObject.ob_size`; where a tuple's items are (up to 3.13: 3.14 put a
/// cached hash before them, and the layout says where), and a list's item array.
const VAR_SIZE: u64 = 16;
const TUPLE_ITEMS: u64 = 24;
const LIST_ITEMS: u64 = 24;
/// `PyGenObject.gi_frame` (up to 3.10: the frame object).
const GEN_FRAME_OBJECT: u64 = 16;
/// Most done-callbacks and closure cells looked at per future.
const MAX_CALLBACKS: u64 = 64;
/// Most futures that are not tasks followed between two tasks.
const MAX_FUTURE_HOPS: usize = 8;
/// Longest method name read.
const MAX_METHOD_NAME: usize = 64;
/// Most type names kept.
const MAX_TYPE_NAMES: usize = 1024;
/// Most frames of a task's own between the loop's handle and its coroutine
/// (the C task has none; the pure-Python one `__step` and from 3.12
/// `__step_run_and_handle_result`).
const MAX_STEP_FRAMES: usize = 3;

/// `PyFrameObject.f_valuestack` (3.8 to 3.10).
const FRAME_VALUESTACK: u64 = 64;
/// Most coroutines followed down from an awaiting task's own.
const MAX_AWAIT_DEPTH: usize = 64;
/// Deepest value stack believed.
const MAX_STACK_DEPTH: u64 = 4096;
/// `gi_frame_state` of a coroutine suspended in an `await` (3.11 to 3.13).
const SUSPENDED_IN_AWAIT: u8 = 0xff;

/// Where a suspended frame's value stack ends: its top is what an `await`
/// waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StackTop {
    /// `PyFrameObject.f_stacktop`, a pointer past the top (3.8, 3.9).
    Pointer(u64),
    /// `PyFrameObject.f_stackdepth`, an int (3.10).
    Depth(u64),
    /// `_PyInterpreterFrame.stacktop`, an int counting from `localsplus`, just
    /// before it (3.11 to 3.13).
    Index,
}

/// `PyMethodObject.im_self`.
const METHOD_SELF: u64 = 24;

/// Where asyncio's C task keeps what a logical stack needs, on one version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LegacyTasks {
    /// `offsetof(TaskObj, task_coro)`; `task_name` is the next field from 3.8.
    pub(super) task_coro: u64,
    /// Tasks have names (3.8+).
    named: bool,
    /// `offsetof(PyFunctionObject, func_closure)`.
    function_closure: u64,
    /// Up to 3.10 a coroutine's frame is an object of its own (`gi_frame`);
    /// from 3.11 it lies inside the coroutine, this far in (`gi_iframe`).
    frame_object: bool,
    gen_iframe: u64,
    stack_top: StackTop,
    /// 3.14+: only pure-Python tasks are read here (C tasks have the published
    /// layout), and where a coroutine waits is read through these objects.
    published: Option<AsyncioObjects>,
}

impl LegacyTasks {
    /// The layout of CPython 3.`minor`, for 3.7 to 3.13.
    pub(crate) fn of(minor: u8) -> Option<LegacyTasks> {
        let (task_coro, function_closure) = match minor {
            7 | 8 => (112, 48),
            9 => (152, 48),
            10 => (160, 72),
            11 | 12 => (136, 72),
            13 => (120, 72),
            _ => return None,
        };
        let stack_top = match minor {
            7..=9 => StackTop::Pointer(72),
            10 => StackTop::Depth(80),
            _ => StackTop::Index,
        };
        // `gi_iframe` follows the generator's head: 3.11 has `gi_code` and a
        // two-word exception state more than 3.12 and 3.13.
        let gen_iframe = match minor {
            11 => 80,
            12 | 13 => 72,
            _ => 0,
        };
        Some(LegacyTasks {
            task_coro,
            gen_iframe,
            named: minor >= 8,
            function_closure,
            frame_object: minor <= 10,
            stack_top,
            published: None,
        })
    }

    /// 3.14+: asyncio's pure-Python tasks (see the module documentation), with
    /// the interpreter's published layout of coroutines.
    pub(crate) fn pure_python(objects: AsyncioObjects) -> LegacyTasks {
        LegacyTasks {
            // A C task is never read through this layout.
            task_coro: 0,
            named: true,
            // `PyFunctionObject.func_closure`, where it has been since 3.10.
            function_closure: 72,
            frame_object: false,
            gen_iframe: objects.gen_iframe,
            stack_top: StackTop::Index,
            published: Some(objects),
        }
    }
}

/// The last part of a type's name: `TaskStepMethWrapper` of
/// `_asyncio.TaskStepMethWrapper`.
fn short(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
}

/// Keeps `value` for `key` in a cache of at most [`MAX_TYPE_NAMES`] entries
/// (emptied when full: the entries are read again as needed).
pub(super) fn remember<V: Clone>(
    cache: &std::cell::RefCell<std::collections::HashMap<u64, V>>,
    key: u64,
    value: V,
) -> V {
    let mut cache = cache.borrow_mut();
    if cache.len() >= MAX_TYPE_NAMES {
        cache.clear();
    }
    cache.insert(key, value.clone());
    value
}

/// Whether `frame` is the event loop's `Handle._run`.
fn is_handle_run(frame: &PyFrame) -> bool {
    &*frame.name == "_run"
        && (frame.file.ends_with("asyncio/events.py") || frame.file.ends_with("asyncio\\events.py"))
}

impl Walker {
    /// Makes the stack of each thread that runs a task its logical stack (see the
    /// module documentation); returns how many it made.
    pub(super) fn make_logical_legacy(
        &mut self,
        legacy: LegacyTasks,
        stacks: &mut [ThreadStack],
        frames: &[FrameAddresses],
    ) -> usize {
        // The tasks the loops run, read once for the threads that need them.
        let mut current = None;
        let mut made = 0;
        for (stack, frames) in stacks.iter_mut().zip(frames) {
            if let Some(logical) = self.legacy_logical_stack(legacy, stack, frames, &mut current) {
                stack.frames = logical;
                made += 1;
            }
        }
        made
    }

    fn legacy_logical_stack(
        &mut self,
        legacy: LegacyTasks,
        stack: &ThreadStack,
        frames: &FrameAddresses,
        current: &mut Option<Vec<(u64, u64, u64)>>,
    ) -> Option<Vec<PyFrame>> {
        let end = frames.len().min(stack.frames.len());
        let (task, coro, from) = match self.handle_task(legacy, stack, &frames[..end]) {
            Some(found) => found,
            // No `Handle._run` (uvloop's loop is compiled): the task asyncio
            // says a loop runs, if its coroutine is on this stack (before 3.14:
            // after, a C task's, read through the published layout).
            None if legacy.published.is_some() => return None,
            None => {
                if current.is_none() {
                    *current = Some(self.current_task_frames(legacy));
                }
                current.iter().flatten().find_map(|&(task, coro, frame)| {
                    let at = frames[..end].iter().position(|&(f, _)| f == frame)?;
                    Some((task, coro, at))
                })?
            }
        };
        let running = self.legacy_task_info(legacy, task, coro)?;
        let mut logical = self.legacy_prefix(legacy, &running, &mut Default::default());
        logical.push(task_marker(&running));
        logical.extend(stack.frames[from..].iter().cloned());
        Some(logical)
    }

    /// The task the innermost `Handle._run` of `stack` steps, its coroutine and
    /// the index of that coroutine's frame, right above the handle's (C calls
    /// between).
    fn handle_task(
        &self,
        legacy: LegacyTasks,
        stack: &ThreadStack,
        frames: &[(u64, u64)],
    ) -> Option<(u64, u64, usize)> {
        let locals = self.reader.layout.locals?;
        let at = stack.frames[..frames.len()]
            .iter()
            .rposition(is_handle_run)?;
        let mem = &self.reader.mem;
        // From 3.14 a local is a tagged stack reference.
        let tags = legacy
            .published
            .and_then(|o| o.awaits)
            .map_or(0, |a| a.tag_mask);
        let handle =
            read_u64(mem, frames[at].0.checked_add(locals.frame_localsplus)?).ok()? & !tags;
        let callback = read_u64(mem, handle.checked_add(HANDLE_CALLBACK)?).ok()?;
        let task = self.stepped_task(callback)?;
        let coro = self.task_coroutine(legacy, task)?;
        // A pure-Python task's `__step` (and from 3.12 the method it calls)
        // stand between: they leave the stack with the loop's.
        let own = frames.len().min(at + 1 + MAX_STEP_FRAMES);
        let from = (at + 1..own).find(|&i| self.is_frame_of(legacy, coro, frames[i].0))?;
        Some((task, coro, from))
    }

    /// The short name of the type of the object at `addr`; each type's name is
    /// read once (a sample asks for a dozen).
    pub(super) fn short_type_name(&self, addr: u64) -> Option<String> {
        if !plausible_pointer(addr) {
            return None;
        }
        let ty = read_u64(&self.reader.mem, addr + self.reader.layout.ob_type).ok()?;
        if let Some(known) = self.legacy_type_names.borrow().get(&ty) {
            return known.clone();
        }
        let locals = self.reader.layout.locals?;
        let name = ValueReader::new(&self.reader.mem, &self.reader.layout, locals)
            .type_name(addr)
            .map(|n| short(&n).to_string());
        remember(&self.legacy_type_names, ty, name)
    }

    /// The short type names of the objects at `objects`, as
    /// [`Self::short_type_name`], their types read in one go.
    pub(super) fn short_type_names(&self, objects: &[u64]) -> Vec<Option<String>> {
        objects
            .iter()
            .zip(self.object_types(objects))
            .map(|(&object, ty)| {
                let ty = ty?;
                if let Some(known) = self.legacy_type_names.borrow().get(&ty) {
                    return known.clone();
                }
                self.short_type_name(object)
            })
            .collect()
    }

    /// The type of each of the objects at `objects`, read in one go; `None`
    /// where it is no object pointer or cannot be read.
    pub(super) fn object_types(&self, objects: &[u64]) -> Vec<Option<u64>> {
        let at: Vec<u64> = objects
            .iter()
            .map(|&o| match plausible_pointer(o) {
                true => o + self.reader.layout.ob_type,
                false => 0,
            })
            .collect();
        let mut types = Vec::new();
        self.reader.mem.read_words(&at, &mut types);
        objects
            .iter()
            .zip(types)
            .map(|(&object, ty)| ty.filter(|_| plausible_pointer(object)))
            .collect()
    }

    /// The task a handle's callback steps or wakes, if it is one of asyncio's.
    fn stepped_task(&self, callback: u64) -> Option<u64> {
        let kind = self.short_type_name(callback)?;
        self.task_of_callback(callback, &kind, true)
    }

    /// The task a callback of type `kind` belongs to: a step (when `steps`) or
    /// wakeup wrapper's, or the task `task_wakeup` is bound to.
    fn task_of_callback(&self, callback: u64, kind: &str, steps: bool) -> Option<u64> {
        let mem = &self.reader.mem;
        let task = match kind {
            "TaskStepMethWrapper" if steps => read_u64(mem, callback + WRAPPER_TASK).ok()?,
            "TaskWakeupMethWrapper" => read_u64(mem, callback + WRAPPER_TASK).ok()?,
            "builtin_function_or_method" => {
                // The method's definition and self, at once.
                let mut head = [0u8; CFUNCTION_SELF as usize + 8];
                mem.read_exact(callback, &mut head).ok()?;
                if !self.is_task_wakeup(field_u64(&head, CFUNCTION_ML).ok()?) {
                    return None;
                }
                field_u64(&head, CFUNCTION_SELF).ok()?
            }
            // The pure-Python task's own `__step` or `__wakeup`, bound to it.
            "method" => {
                let task = read_u64(mem, callback + METHOD_SELF).ok()?;
                self.py_task(task)?;
                task
            }
            _ => return None,
        };
        plausible_pointer(task).then_some(task)
    }

    /// Whether the method definition at `ml` is asyncio's `task_wakeup`; each
    /// definition's name is read once (they are static).
    fn is_task_wakeup(&self, ml: u64) -> bool {
        if !plausible_pointer(ml) {
            return false;
        }
        if let Some(&known) = self.legacy_wakeups.borrow().get(&ml) {
            return known;
        }
        let mem = &self.reader.mem;
        let is = read_u64(mem, ml)
            .ok()
            .filter(|&p| p != 0 && p < 1 << 47)
            .and_then(|at| read_c_string(mem, at, MAX_METHOD_NAME).ok())
            .is_some_and(|name| name == "task_wakeup");
        remember(&self.legacy_wakeups, ml, is)
    }

    /// The coroutine of the task at `task`, if it holds one.
    pub(super) fn task_coroutine(&self, legacy: LegacyTasks, task: u64) -> Option<u64> {
        if self.is_plain_instance(task) {
            return self.plain_py_task(task).map(|t| t.coro);
        }
        if legacy.published.is_some() {
            return None;
        }
        let coro = read_u64(&self.reader.mem, task.checked_add(legacy.task_coro)?).ok()?;
        (self.short_type_name(coro)? == "coroutine").then_some(coro)
    }

    /// Whether the frame at `frame` is the coroutine `coro`'s own.
    fn is_frame_of(&self, legacy: LegacyTasks, coro: u64, frame: u64) -> bool {
        self.coroutine_frame(legacy, coro) == Some(frame)
    }

    /// The frame of the coroutine `coro`: `gi_frame` up to 3.10, inside it from
    /// 3.11.
    pub(super) fn coroutine_frame(&self, legacy: LegacyTasks, coro: u64) -> Option<u64> {
        if legacy.frame_object {
            let frame = read_u64(&self.reader.mem, coro + GEN_FRAME_OBJECT).ok()?;
            plausible_pointer(frame).then_some(frame)
        } else {
            coro.checked_add(legacy.gen_iframe)
        }
    }

    /// The frames of the coroutines `coros`, as [`Self::coroutine_frame`], read
    /// in one go.
    pub(super) fn coroutine_frames(&self, legacy: LegacyTasks, coros: &[u64]) -> Vec<Option<u64>> {
        if !legacy.frame_object {
            return coros
                .iter()
                .map(|c| c.checked_add(legacy.gen_iframe))
                .collect();
        }
        let at: Vec<u64> = coros.iter().map(|c| c + GEN_FRAME_OBJECT).collect();
        let mut frames = Vec::new();
        self.reader.mem.read_words(&at, &mut frames);
        frames
            .into_iter()
            .map(|f| f.filter(|&f| plausible_pointer(f)))
            .collect()
    }

    /// The task at `task` (its coroutine `coro`): its name, its coroutine's
    /// frame, what awaits it.
    pub(super) fn legacy_task_info(
        &mut self,
        legacy: LegacyTasks,
        task: u64,
        coro: u64,
    ) -> Option<TaskInfo> {
        // A pure-Python task's attributes are read once for its name and its
        // done-callbacks; an object of that size that is no such task, not at all.
        let py = match self.is_plain_instance(task) {
            true => Some(self.plain_py_task(task)?),
            false if legacy.published.is_some() => return None,
            false => None,
        };
        let name_object = match py {
            Some(py) => py.name,
            None => read_u64(&self.reader.mem, task.checked_add(legacy.task_coro + 8)?).ok(),
        };
        let (name, named) = if legacy.named {
            self.task_name(task, name_object?)
        } else {
            // 3.7's tasks have no name: each is `[task]`.
            ("Task".to_string(), false)
        };
        let callbacks = match py {
            Some(py) => py
                .callbacks
                .map_or_else(Vec::new, |l| self.list_callbacks(l)),
            None => self.done_callbacks(task),
        };
        let mut awaited_by = Vec::new();
        self.awaiters_of_callbacks(legacy, callbacks, 0, &mut awaited_by);
        awaited_by.sort_unstable();
        awaited_by.dedup();
        Some(TaskInfo {
            address: task,
            name,
            named,
            coro_frame: self.coroutine_frame(legacy, coro),
            awaiters: awaited_by.len(),
            awaited_by,
        })
    }

    /// The tasks whose wakeups wait on the future (or task) at `future`, into
    /// `out`: directly, or through the futures `gather` and `wait_for` put between.
    fn legacy_awaiters(&self, legacy: LegacyTasks, future: u64, hops: usize, out: &mut Vec<u64>) {
        self.awaiters_of_callbacks(legacy, self.done_callbacks(future), hops, out);
    }

    /// As [`Self::legacy_awaiters`], of a future whose done-callbacks are
    /// `callbacks`.
    fn awaiters_of_callbacks(
        &self,
        legacy: LegacyTasks,
        callbacks: Vec<u64>,
        hops: usize,
        out: &mut Vec<u64>,
    ) {
        for callback in callbacks {
            let Some(kind) = self.short_type_name(callback) else {
                continue;
            };
            if let Some(task) = self.task_of_callback(callback, &kind, false) {
                out.push(task);
                continue;
            }
            // A TaskGroup's `_on_task_done`: the group's `_parent_task` awaits
            // its tasks.
            if kind == "method" {
                let group = read_u64(&self.reader.mem, callback + METHOD_SELF).unwrap_or(0);
                if self.short_type_name(group).as_deref() == Some("TaskGroup") {
                    let [parent] = self.attributes(group, ["_parent_task"]);
                    out.extend(parent.filter(|&p| plausible_pointer(p)));
                }
                continue;
            }
            if hops >= MAX_FUTURE_HOPS {
                continue;
            }
            let held = match kind.as_str() {
                // gather's `_done_callback`: what its cells hold.
                "function" => {
                    let closure =
                        read_u64(&self.reader.mem, callback + legacy.function_closure).ok();
                    self.fields_of(&self.tuple_items(closure), CELL_REF)
                }
                // wait_for's `partial(_release_waiter, waiter)`: its arguments.
                "partial" => {
                    self.tuple_items(read_u64(&self.reader.mem, callback + PARTIAL_ARGS).ok())
                }
                _ => Vec::new(),
            };
            for object in held {
                let is_future = self
                    .short_type_name(object)
                    .is_some_and(|t| t == "_GatheringFuture" || t == "Future");
                if is_future {
                    self.legacy_awaiters(legacy, object, hops + 1, out);
                }
            }
        }
    }

    /// The done-callbacks of the future at `future`: the first, then each of the
    /// list's (callback, context) pairs'. A pure-Python future (a task, or
    /// `gather`'s where asyncio's C module is missing) keeps them in its
    /// `_callbacks` list.
    fn done_callbacks(&self, future: u64) -> Vec<u64> {
        if self.is_plain_instance(future) {
            let [callbacks] = self.attributes(future, ["_callbacks"]);
            return callbacks.map_or_else(Vec::new, |l| self.list_callbacks(l));
        }
        let mem = &self.reader.mem;
        let mut head = [0u8; FUT_CALLBACKS as usize + 8];
        if mem.read_exact(future, &mut head).is_err() {
            return Vec::new();
        }
        let (first, list) = (
            field_u64(&head, FUT_CALLBACK0).unwrap_or(0),
            field_u64(&head, FUT_CALLBACKS).unwrap_or(0),
        );
        let mut out: Vec<u64> = [first]
            .into_iter()
            .filter(|&p| plausible_pointer(p))
            .collect();
        out.extend(self.list_callbacks(list));
        out
    }

    /// The callbacks of the list of (callback, context) pairs at `list`.
    fn list_callbacks(&self, list: u64) -> Vec<u64> {
        let mut list_head = [0u8; LIST_ITEMS as usize + 8];
        if !plausible_pointer(list) || self.reader.mem.read_exact(list, &mut list_head).is_err() {
            return Vec::new();
        }
        let size = field_u64(&list_head, VAR_SIZE).unwrap_or(u64::MAX);
        let items = field_u64(&list_head, LIST_ITEMS).unwrap_or(0);
        if size > MAX_CALLBACKS {
            return Vec::new();
        }
        let pairs = self.words_at(items, size);
        self.fields_of(&pairs, self.tuple_items_at())
    }

    /// The `count` words of the array at `at`, in one read (none when they
    /// cannot be read).
    fn words_at(&self, at: u64, count: u64) -> Vec<u64> {
        let mut bytes = vec![0u8; count.min(MAX_CALLBACKS) as usize * 8];
        if !plausible_pointer(at) || self.reader.mem.read_exact(at, &mut bytes).is_err() {
            return Vec::new();
        }
        bytes
            .chunks_exact(8)
            .filter_map(|w| field_u64(w, 0).ok())
            .collect()
    }

    /// The word at `offset` in each of the objects at `objects` (those that can
    /// be objects), read together, those that can be object pointers.
    fn fields_of(&self, objects: &[u64], offset: u64) -> Vec<u64> {
        let addrs: Vec<u64> = objects
            .iter()
            .filter(|&&o| plausible_pointer(o))
            .filter_map(|o| o.checked_add(offset))
            .collect();
        let mut words = Vec::new();
        self.reader.mem.read_words(&addrs, &mut words);
        words
            .into_iter()
            .flatten()
            .filter(|&p| plausible_pointer(p))
            .collect()
    }

    /// Where a tuple's items start.
    fn tuple_items_at(&self) -> u64 {
        self.reader
            .layout
            .locals
            .map_or(TUPLE_ITEMS, |l| l.tuple_items)
    }

    /// The items of the tuple at `tuple`, at most [`MAX_CALLBACKS`].
    fn tuple_items(&self, tuple: Option<u64>) -> Vec<u64> {
        let mem = &self.reader.mem;
        let Some(tuple) = tuple.filter(|&t| plausible_pointer(t)) else {
            return Vec::new();
        };
        let size = read_u64(mem, tuple + VAR_SIZE).unwrap_or(0);
        if size > MAX_CALLBACKS {
            return Vec::new();
        }
        self.words_at(tuple + self.tuple_items_at(), size)
            .into_iter()
            .filter(|&p| plausible_pointer(p))
            .collect()
    }

    /// The tasks awaiting `first`, outermost first, each its marker frame and its
    /// coroutine's frame (where it awaits): what comes above `first`'s own marker.
    /// Where several await one task, the one at the lowest address is followed. At
    /// most [`MAX_ANCESTORS`]; a loop ends the chain.
    /// `standing` keeps, by the task awaiting `first`, what is found: the tasks
    /// of one sample that share their awaiters read them once.
    pub(super) fn legacy_prefix(
        &mut self,
        legacy: LegacyTasks,
        first: &TaskInfo,
        standing: &mut HashMap<u64, Vec<PyFrame>>,
    ) -> Vec<PyFrame> {
        let Some(&above) = first.awaited_by.first() else {
            return Vec::new();
        };
        if let Some(known) = standing.get(&above) {
            return known.clone();
        }
        let mut chain: Vec<(TaskInfo, u64)> = Vec::new();
        let mut seen = vec![first.address];
        let mut parent = first.awaited_by.first().copied();
        while let Some(task) = parent {
            if seen.contains(&task) || seen.len() > MAX_ANCESTORS {
                break;
            }
            seen.push(task);
            let Some(coro) = self.task_coroutine(legacy, task) else {
                break;
            };
            let Some(info) = self.legacy_task_info(legacy, task, coro) else {
                break;
            };
            parent = info.awaited_by.first().copied();
            chain.push((info, coro));
        }
        let mut frames = Vec::new();
        for (info, coro) in chain.iter().rev() {
            frames.push(task_marker(info));
            frames.extend(self.awaiting_coroutines(legacy, *coro).0);
        }
        standing.insert(above, frames.clone());
        frames
    }

    /// Where a waiting task stands: its coroutine's frame, then that of the
    /// coroutine it awaits, and so on (`main`, `gather_workers`), while each
    /// awaits a coroutine; at most [`MAX_AWAIT_DEPTH`]. With the object the last
    /// one awaits when it is not a coroutine (a future, a task): what the task
    /// waits on.
    pub(super) fn awaiting_coroutines(
        &mut self,
        legacy: LegacyTasks,
        coro: u64,
    ) -> (Vec<PyFrame>, Option<u64>) {
        if let Some(objects) = legacy.published {
            return match self.coroutine_frame(legacy, coro) {
                Some(frame) => self.awaited_end(objects, frame),
                None => (Vec::new(), None),
            };
        }
        let mut out = Vec::new();
        let mut coro = coro;
        for _ in 0..MAX_AWAIT_DEPTH {
            let Some(frame) = self.coroutine_frame(legacy, coro) else {
                break;
            };
            // A suspended coroutine's frame links to no caller.
            let (mut walked, _) = self.reader.frames(frame);
            if walked.len() != 1 {
                break;
            }
            out.append(&mut walked);
            match self.awaited_by_frame(legacy, coro, frame) {
                Some(next) if self.short_type_name(next).as_deref() == Some("coroutine") => {
                    coro = next
                }
                awaited => return (out, awaited),
            }
        }
        (out, None)
    }

    /// What the suspended coroutine `coro`, whose frame is at `frame`, awaits:
    /// the top of its frame's value stack, once it has started (3.8 to 3.10)
    /// or while its state says it awaits (3.11 to 3.13).
    pub(super) fn awaited_by_frame(
        &self,
        legacy: LegacyTasks,
        coro: u64,
        frame: u64,
    ) -> Option<u64> {
        let mem = &self.reader.mem;
        let int = |at: u64| -> Option<i64> {
            let mut b = [0u8; 4];
            mem.read_exact(at, &mut b).ok()?;
            Some(i64::from(i32::from_le_bytes(b)))
        };
        let slot = match legacy.stack_top {
            StackTop::Pointer(_) | StackTop::Depth(_) => {
                let super::layout::FrameLayout::Object { lasti, .. } = self.reader.layout.frame
                else {
                    return None;
                };
                if int(frame + lasti)? < 0 {
                    return None;
                }
                let valuestack = read_u64(mem, frame + FRAME_VALUESTACK).ok()?;
                let depth = match legacy.stack_top {
                    StackTop::Pointer(at) => {
                        let top = read_u64(mem, frame + at).ok()?;
                        top.checked_sub(valuestack)? / 8
                    }
                    StackTop::Depth(at) => u64::try_from(int(frame + at)?).ok()?,
                    StackTop::Index => return None,
                };
                if depth == 0 || depth > MAX_STACK_DEPTH {
                    return None;
                }
                valuestack.checked_add((depth - 1) * 8)?
            }
            StackTop::Index => {
                let state_at = coro.checked_add(legacy.gen_iframe)?.checked_sub(5)?;
                let mut state = [0u8; 1];
                mem.read_exact(state_at, &mut state).ok()?;
                if state[0] != SUSPENDED_IN_AWAIT {
                    return None;
                }
                let localsplus = self.reader.layout.locals?.frame_localsplus;
                let index =
                    u64::try_from(int(frame.checked_add(localsplus)?.checked_sub(8)?)?).ok()?;
                if index == 0 || index > MAX_STACK_DEPTH {
                    return None;
                }
                frame.checked_add(localsplus + (index - 1) * 8)?
            }
        };
        let awaited = read_u64(mem, slot).ok()?;
        plausible_pointer(awaited).then_some(awaited)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_versions_without_a_published_layout_have_one_here() {
        assert!(LegacyTasks::of(6).is_none());
        assert!(LegacyTasks::of(14).is_none());
        assert!(!LegacyTasks::of(7).unwrap().named);
        for minor in 7..=13 {
            let l = LegacyTasks::of(minor).unwrap();
            assert_eq!(l.frame_object, minor <= 10, "3.{minor}");
        }
        assert_eq!(short("_asyncio.TaskStepMethWrapper"), "TaskStepMethWrapper");
        assert_eq!(short("functools.partial"), "partial");
        assert_eq!(short("coroutine"), "coroutine");
    }
}
