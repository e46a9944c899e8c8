//! asyncio's pure-Python `Task` (`asyncio.tasks._PyTask`: what a program gets
//! through a task factory that makes them, and asyncio's only task where its C
//! module is missing), CPython 3.7 to 3.13.
//!
//! Its state is in its attributes (see `instances`): `_coro`, `_name` (3.8+),
//! and `_callbacks`, the (callback, context) pairs its awaiters added: the
//! `__wakeup` of a pure-Python task awaiting it, bound to that task (or a C
//! task's `task_wakeup`, or `gather`'s and a `TaskGroup`'s callbacks, as on a C
//! future). The event loop's handle calls its `__step`, bound to it, which
//! calls (from 3.12 through `__step_run_and_handle_result`) the coroutine: those
//! frames stand between the loop's and the coroutine's, and leave the logical
//! stack with the loop's.

use super::Walker;

/// What a logical stack needs of a pure-Python task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PyTask {
    /// Its coroutine (a coroutine object: a task that finished has dropped it).
    pub(super) coro: u64,
    /// Its name object (3.8+).
    pub(super) name: Option<u64>,
    /// The list of its done-callbacks' (callback, context) pairs.
    pub(super) callbacks: Option<u64>,
}

impl Walker {
    /// The task at `task`, if it is a pure-Python one still running a coroutine.
    pub(super) fn py_task(&self, task: u64) -> Option<PyTask> {
        self.is_plain_instance(task)
            .then(|| self.plain_py_task(task))
            .flatten()
    }

    /// As [`Self::py_task`], of an object already known to be a plain instance
    /// ([`Self::is_plain_instance`]): its type is not read again.
    pub(super) fn plain_py_task(&self, task: u64) -> Option<PyTask> {
        let [coro, name, callbacks] = self.attributes(task, ["_coro", "_name", "_callbacks"]);
        let coro = coro.filter(|&c| self.short_type_name(c).as_deref() == Some("coroutine"))?;
        Some(PyTask {
            coro,
            name,
            callbacks,
        })
    }
}
