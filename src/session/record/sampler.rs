//! The frame walker in a recording: at each engine tick, every thread's Python stack
//! as a `sample` event; at a GC, import or audit probe hit, the stack of the thread
//! that hit it, as a `stack` event just before the event it explains.
//!
//! With `--native`, a sample of a stopped thread is its native stack joined with its
//! Python stack (`pyprobe_cpython::native`); a native frame is recorded as an ordinary frame
//! named by its function, its file the object file, line 0, so the recording format
//! and every view take it as it is. A thread that cannot be unwound or joined keeps
//! its Python stack alone, counted in [`NativeCounts`].

use rustc_hash::FxHashMap;

use pyprobe_cpython::native::{join, EvalCalls, Joined, NativeUnwinder, NotJoined};
use pyprobe_cpython::python::walker::{
    PyFrame, TickStill, WaitingLimits, WaitingPlan, WaitingTasks, Walker,
};
use pyprobe_recording::recording::{EventKind, FrameRef, SampleState, WalkedFrame};
use pyprobe_sdt::ring::RingStack;

use super::events::EventBuilder;

/// Every thread's stack when tracing began, by native thread id.
pub type RunningStacks = Vec<(i32, Vec<PyFrame>)>;

#[derive(Default)]
pub struct Sampler {
    /// A walker per traced process (`--subprocesses` traces several), each for the
    /// program the process runs now.
    walkers: FxHashMap<i32, Slot>,
    /// Why the walker could not attach or read (the interpreter may still be starting).
    pub last_error: Option<String>,
    pub samples: u64,
    pub ticks: u64,
    /// Whether a walker was described on stderr already (one line, not one per
    /// process of a pool).
    described: bool,
    /// Say which layout the walker reads the interpreter with (`-v`).
    pub verbose: bool,
    /// Join native frames with the Python frames of each sample (`--native`).
    pub native: bool,
    /// Draw each thread running an asyncio task as the task's logical stack
    /// (`--async`).
    pub async_tasks: bool,
    /// Also sample every task that waits (`--async=all`).
    pub async_waiting: bool,
    /// How long a tick may spend on the waiting tasks.
    pub waiting_budget: std::time::Duration,
    /// Where the next tick begins in the list of tasks.
    pub waiting_next: usize,
    /// What the waiting tasks of the last tick that held the threads are read
    /// from once they run again: its process, its time and the plan.
    pub waiting_plan: Option<(i32, u64, WaitingPlan)>,
    /// Ticks that could not look at every task within their limits.
    pub waiting_cut_ticks: u64,
    /// Samples of running threads whose stack changed under the walk, recorded
    /// as [`TORN`] alone.
    pub torn: u64,
    /// Samples of threads that had not run since an earlier tick, whose stacks
    /// were not read again.
    pub kept: u64,
    /// Stacks captured in the target; those with frames whose code objects were
    /// freed before pyprobe read them, and those frames.
    pub captured_stacks: u64,
    pub gone_stacks: u64,
    pub gone_frames: u64,
    pub native_counts: NativeCounts,
    /// `--async=all` met asyncio's pure-Python tasks on 3.14+, whose waiting
    /// ones it cannot list.
    pub unlisted_tasks: bool,
}

/// The frame standing where an unwind stopped short of the outer Python frames'
/// eval calls: native frames there may be missing.
pub const UNWIND_STOPPED: &str = "[native unwind stopped]";

/// The one frame of a sample read while its thread ran and changed its stack
/// (`--nonblocking`, or the budget's fallback to it): its frames may come from
/// different moments, so they are not shown, but the sample still counts.
pub const TORN: &str = "[torn: read while the thread ran]";

/// How the `--native` samples went.
#[derive(Debug, Default, Clone)]
pub struct NativeCounts {
    /// Samples with native and Python frames joined.
    pub joined: u64,
    /// Of those, the samples whose unwind stopped short (marked
    /// [`UNWIND_STOPPED`] where it ended).
    pub cut_short: u64,
    /// Samples recorded with their Python stack alone, by why.
    pub not_stopped: u64,
    pub no_eval_call: u64,
    pub ambiguous: u64,
    /// Why the native unwinder could not be set up for a process (the last reason).
    pub error: Option<String>,
}

impl NativeCounts {
    /// Samples recorded without their native frames.
    pub fn alone(&self) -> u64 {
        self.not_stopped + self.no_eval_call + self.ambiguous
    }

    /// One line: how many samples have native frames, and why the others do not.
    pub fn summary(&self) -> String {
        let mut line = format!("{} samples with native frames", self.joined);
        if self.cut_short > 0 {
            line += &format!(
                " ({} of them past a `{UNWIND_STOPPED}` marker, where the unwind could not \
                 pass a frame)",
                self.cut_short
            );
        }
        line += &format!(", {} with their Python stack alone", self.alone());
        let why: Vec<String> = [
            (self.not_stopped, "thread not stopped"),
            (
                self.no_eval_call,
                "no eval-loop call recognised in the native stack",
            ),
            (
                self.ambiguous,
                "several eval-loop calls whose Python frames the walk could not tell apart",
            ),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n}: {what}"))
        .collect();
        if !why.is_empty() {
            line += &format!(" ({})", why.join(", "));
        }
        if let Some(e) = &self.error {
            line += &format!("; {e}");
        }
        line
    }
}

/// One engine tick of one process, as the sampler takes it.
pub struct Tick<'a> {
    pub pid: i32,
    pub ts_ns: u64,
    /// Which of its threads were on a CPU (see the engine's tick).
    pub on_cpu: &'a [(i32, bool)],
    /// Every thread is held in a ptrace-stop until the sample is taken, so its
    /// registers can be read (`--native`).
    pub stopped: bool,
    /// The threads that have not run since an earlier tick.
    pub still: TickStill<'a>,
}

/// One process's walker, or when to try attaching it again.
#[derive(Default)]
struct Slot {
    walker: Option<Walker>,
    /// The native unwinder (`--native`), set up once the walker is; `None` inside
    /// when it could not be (said once, in [`NativeCounts::error`]).
    native: Option<Option<NativeUnwinder>>,
    /// Failed attaches in a row, and when the next may be tried: an attach costs
    /// about a millisecond, often with the target stopped, so retries back off.
    failures: u32,
    retry_at_ns: u64,
    /// The frames of the last tick's samples, by thread state: a thread the walker
    /// kept (it has not run since) is written with them again, not named anew.
    frames_at_tick: FxHashMap<u64, Vec<WalkedFrame>>,
}

/// Longest wait between two attempts to attach the walker.
const MAX_RETRY_NS: u64 = 50_000_000;

/// Most waiting asyncio tasks sampled at one tick (`--async=all`): a server's
/// thousands of idle connections would otherwise take the sampler's budget.
pub const MAX_WAITING_TASKS: usize = 1000;

/// Longest a tick spends reading waiting tasks (`--async=all`), and at most this
/// share of the sampling interval: pyprobe's own time (the threads are let go
/// first when the tick held them), which a busy server shares a CPU with.
pub const MAX_WAITING_BUDGET: std::time::Duration = std::time::Duration::from_millis(1);
pub const WAITING_SHARE_OF_INTERVAL: u32 = 20;

impl Sampler {
    /// The walker of `pid`, attached on first use at `now` (it fails while the
    /// interpreter is not initialised yet; a later call tries again, after 1, 2, 4 ...
    /// up to 50 ms).
    fn walker(&mut self, pid: i32, now: u64) -> Option<&mut Walker> {
        let slot = self.walkers.entry(pid).or_default();
        if slot.walker.is_none() {
            if now < slot.retry_at_ns {
                return None;
            }
            match Walker::attach(pid) {
                Ok(w) => {
                    if self.verbose && !std::mem::replace(&mut self.described, true) {
                        eprintln!("pyprobe: frame walker: {}", w.describe());
                    }
                    if self.async_tasks && !w.version().at_least(3, 7) {
                        eprintln!(
                            "pyprobe: --async: process {pid} runs CPython {}; pyprobe reads \
                             asyncio's tasks from 3.7 on, so its stacks stay as its threads \
                             run them",
                            w.version()
                        );
                    }
                    slot.walker = Some(w);
                    slot.failures = 0;
                    self.last_error = None;
                }
                Err(e) => {
                    self.last_error = Some(format!("{e:#}"));
                    let wait = (1_000_000u64 << slot.failures.min(16)).min(MAX_RETRY_NS);
                    slot.failures += 1;
                    slot.retry_at_ns = now.saturating_add(wait);
                    return None;
                }
            }
        }
        slot.walker.as_mut()
    }

    /// Makes the walker of `pid` now, while its threads still run: finding the
    /// interpreter reads its maps and ELF files, which a stop would otherwise hold
    /// (with 10,000 threads, the stacks read at attach took 400 ms). A failure here
    /// is forgotten, to be met again when the walker is needed.
    pub fn prepare(&mut self, pid: i32) {
        if self
            .walker(pid, pyprobe_sdt::tracer::signals::monotonic_ns())
            .is_none()
        {
            self.walkers.remove(&pid);
        }
    }

    /// The walker of `pid` for reading at a probe hit, attached now if it can be
    /// (failed attaches are retried with the usual back-off).
    pub fn walker_at(&mut self, pid: i32) -> Option<&mut Walker> {
        self.walker(pid, pyprobe_sdt::tracer::signals::monotonic_ns())
    }

    /// The frames of process `pid`'s samples at the last tick (see
    /// [`Slot::frames_at_tick`]), taken out.
    fn take_frames_at_tick(&mut self, pid: i32) -> FxHashMap<u64, Vec<WalkedFrame>> {
        self.walkers
            .get_mut(&pid)
            .map(|slot| std::mem::take(&mut slot.frames_at_tick))
            .unwrap_or_default()
    }

    /// Process `pid` ran `execve` or ended: its walker read the old image.
    pub fn forget(&mut self, pid: i32) {
        self.walkers.remove(&pid);
    }

    /// Frames of process `pid` as recorded: named by `co_name`, as the function
    /// probes name them (their qualified names given apart).
    fn frames(builder: &mut EventBuilder, pid: i32, frames: &[PyFrame]) -> Vec<WalkedFrame> {
        frames
            .iter()
            .map(|f| Self::frame(builder, pid, f))
            .collect()
    }

    /// A native frame as recorded: the object file as its file, line 0.
    fn native_frame(builder: &mut EventBuilder, function: &str, object: &str) -> WalkedFrame {
        WalkedFrame {
            code: FrameRef {
                file: builder.intern(object),
                function: builder.intern(function),
                line: 0,
            },
            line: 0,
        }
    }

    fn frame(builder: &mut EventBuilder, pid: i32, f: &PyFrame) -> WalkedFrame {
        let code = FrameRef {
            file: builder.intern(&f.file),
            function: builder.intern(&f.name),
            line: f.first_line,
        };
        // The walker names a frame by `co_qualname` where there is one (3.11+).
        let qualname = builder.walker_qualifies().then_some(&*f.function);
        builder.name_code(pid, code, (&f.file, &f.name), qualname);
        WalkedFrame { code, line: f.line }
    }

    /// Takes one sample of every thread of the tick's process.
    pub fn sample(&mut self, tick: Tick, builder: &mut EventBuilder) {
        let Tick {
            pid,
            ts_ns,
            on_cpu,
            stopped,
            still: at,
        } = tick;
        self.ticks += 1;
        let on_cpu: FxHashMap<i32, bool> = on_cpu.iter().copied().collect();
        let (async_tasks, async_waiting) = (self.async_tasks, self.async_waiting);
        let limits = self.waiting_limits();
        let Some(walker) = self.walker(pid, ts_ns) else {
            return;
        };
        let read = match (async_tasks, stopped) {
            // Held: the waiting tasks are read once the threads run again
            // (`after_tick`), off the target's time.
            _ if async_waiting && stopped => walker
                .async_stacks_and_waiting_plan(false)
                .map(|(s, plan)| (s, None, Some(plan))),
            _ if async_waiting => walker
                .async_stacks_and_waiting(true, limits)
                .map(|(s, w)| (s, Some(w), None)),
            (true, _) => walker.async_stacks(!stopped).map(|s| (s, None, None)),
            (false, stopped) => walker.stacks_at_tick(!stopped, at).map(|s| (s, None, None)),
        };
        let (stacks, waiting, plan) = match read {
            Ok(s) => s,
            Err(e) => {
                self.last_error = Some(format!("{e:#}"));
                return;
            }
        };
        let one_per_frame = !walker.version().at_least(3, 11);
        self.unlisted_tasks |= async_waiting && walker.unlisted_tasks_seen();
        self.waiting_plan = plan.map(|plan| (pid, ts_ns, plan));
        // Taken out of its slot while the stacks are joined, put back after.
        let mut native = if self.native {
            self.take_native(pid)
        } else {
            None
        };
        let mut last_frames = self.take_frames_at_tick(pid);
        let mut frames_at_tick = FxHashMap::default();
        for stack in stacks {
            if stack.frames.is_empty() {
                continue;
            }
            // Running, a cut walk is nearly always the thread moving under it.
            let torn = !stopped && (stack.torn || stack.truncated);
            let frames = match native.as_mut() {
                _ if torn => {
                    self.torn += 1;
                    vec![Self::native_frame(builder, TORN, "[pyprobe]")]
                }
                Some(unwinder) => Self::joined(
                    builder,
                    pid,
                    unwinder,
                    &mut self.native_counts,
                    stack.native_tid.filter(|_| stopped),
                    &stack.frames,
                    match &stack.eval_calls {
                        _ if one_per_frame => EvalCalls::OnePerFrame,
                        Some(sizes) => EvalCalls::Sizes(sizes),
                        None => EvalCalls::Unknown,
                    },
                ),
                None => {
                    let kept = last_frames
                        .remove(&stack.thread_state)
                        .filter(|_| stack.kept);
                    self.kept += u64::from(stack.kept);
                    let frames = kept.unwrap_or_else(|| Self::frames(builder, pid, &stack.frames));
                    frames_at_tick.insert(stack.thread_state, frames.clone());
                    frames
                }
            };
            let tid = stack.native_tid.unwrap_or(pid);
            let state = SampleState {
                // Only a tid the walker knows is looked up: the fallback (the pid)
                // would give the main thread's state to another thread.
                on_cpu: stack.native_tid.and_then(|t| on_cpu.get(&t).copied()),
                holds_gil: stack.holds_gil,
            };
            builder.write(tid, ts_ns, EventKind::Sample { frames, state });
            self.samples += 1;
        }
        if let Some(unwinder) = native {
            self.put_native(pid, unwinder);
        }
        if let Some(slot) = self.walkers.get_mut(&pid) {
            slot.frames_at_tick = frames_at_tick;
        }
        if let Some(waiting) = waiting {
            self.write_waiting(pid, ts_ns, waiting, builder);
        }
    }

    /// The threads of `pid`, held for the last tick, run again: its waiting
    /// asyncio tasks are read now (`--async=all`), as samples of that tick.
    pub fn after_tick(&mut self, pid: i32, builder: &mut EventBuilder) {
        let Some((_, ts_ns, mut plan)) = self.waiting_plan.take_if(|(at, _, _)| *at == pid) else {
            return;
        };
        let limits = self.waiting_limits();
        let Some(walker) = self.walkers.get_mut(&pid).and_then(|s| s.walker.as_mut()) else {
            return;
        };
        let waiting = walker.waiting_of(&mut plan, limits);
        self.write_waiting(pid, ts_ns, waiting, builder);
    }

    fn waiting_limits(&self) -> WaitingLimits {
        WaitingLimits {
            max: MAX_WAITING_TASKS,
            budget: self.waiting_budget,
            start: self.waiting_next,
        }
    }

    /// Writes the samples of the waiting tasks of one tick of `pid`.
    fn write_waiting(
        &mut self,
        pid: i32,
        ts_ns: u64,
        waiting: WaitingTasks,
        builder: &mut EventBuilder,
    ) {
        self.waiting_next = waiting.next;
        if waiting.deferred > 0 {
            self.waiting_cut_ticks += 1;
        }
        for stack in waiting.stacks {
            let frames = Self::frames(builder, pid, &stack.frames);
            // A task that waits runs on no CPU and holds no GIL.
            let state = SampleState {
                on_cpu: Some(false),
                holds_gil: Some(false),
            };
            let tid = stack.native_tid.unwrap_or(pid);
            builder.write(tid, ts_ns, EventKind::Sample { frames, state });
            self.samples += 1;
        }
    }

    /// The native unwinder of `pid` (whose walker is attached), set up on first use,
    /// taken out of its slot until [`Self::put_native`] gives it back.
    fn take_native(&mut self, pid: i32) -> Option<NativeUnwinder> {
        let slot = self.walkers.get_mut(&pid)?;
        let walker = slot.walker.as_ref()?;
        if slot.native.is_none() {
            let made = NativeUnwinder::new(pid, walker.interpreter_path());
            slot.native = Some(match made {
                Ok(unwinder) => {
                    if self.verbose {
                        for why in &unwinder.unreadable {
                            eprintln!("pyprobe: --native: {why}");
                        }
                    }
                    Some(unwinder)
                }
                Err(e) => {
                    eprintln!("pyprobe: --native: {e:#}; samples keep their Python stack alone");
                    self.native_counts.error = Some(format!("{e:#}"));
                    None
                }
            });
        }
        slot.native.as_mut()?.take()
    }

    fn put_native(&mut self, pid: i32, unwinder: NativeUnwinder) {
        if let Some(slot) = self.walkers.get_mut(&pid) {
            slot.native = Some(Some(unwinder));
        }
    }

    /// The frames of thread `tid`: its native stack joined with `python`, or
    /// `python` alone when the thread is not held stopped (`tid` is `None`) or the
    /// stacks cannot be joined.
    #[allow(clippy::too_many_arguments)]
    fn joined(
        builder: &mut EventBuilder,
        pid: i32,
        unwinder: &mut NativeUnwinder,
        counts: &mut NativeCounts,
        tid: Option<i32>,
        python: &[PyFrame],
        calls: EvalCalls<'_>,
    ) -> Vec<WalkedFrame> {
        let Some(regs) = tid.and_then(pyprobe_cpython::native::registers) else {
            counts.not_stopped += 1;
            return Self::frames(builder, pid, python);
        };
        let native = unwinder.stack(&regs);
        match join(&native.frames, python, calls, native.complete) {
            Ok(joined) => {
                counts.joined += 1;
                counts.cut_short += u64::from(joined.iter().any(|f| matches!(f, Joined::Gap)));
                joined
                    .into_iter()
                    .map(|frame| match frame {
                        Joined::Python(f) => Self::frame(builder, pid, f),
                        Joined::Native { function, object } => {
                            Self::native_frame(builder, &function, &object)
                        }
                        Joined::Gap => Self::native_frame(builder, UNWIND_STOPPED, "[native]"),
                    })
                    .collect()
            }
            Err(why) => {
                match why {
                    NotJoined::NoEvalCall => counts.no_eval_call += 1,
                    NotJoined::Ambiguous => counts.ambiguous += 1,
                }
                Self::frames(builder, pid, python)
            }
        }
    }

    /// Records every thread's Python stack as the frames running when tracing
    /// begins (call it with the threads stopped, before any probe can hit).
    pub fn running(&mut self, pid: i32, ts_ns: u64) -> RunningStacks {
        let Some(walker) = self.walker(pid, ts_ns) else {
            return Vec::new();
        };
        match walker.stacks() {
            Ok(stacks) => stacks
                .into_iter()
                .filter(|s| !s.frames.is_empty())
                .map(|s| (s.native_tid.unwrap_or(pid), s.frames))
                .collect(),
            Err(e) => {
                self.last_error = Some(format!("{e:#}"));
                Vec::new()
            }
        }
    }

    /// Writes stacks taken by [`running`](Self::running) as `running` events.
    pub fn write_running(builder: &mut EventBuilder, ts_ns: u64, stacks: Vec<(i32, Vec<PyFrame>)>) {
        for (tid, frames) in stacks {
            // A thread's /proc entry shows its process's root and cwd.
            let frames = Self::frames(builder, tid, &frames);
            builder.write(tid, ts_ns, EventKind::Running { frames });
        }
    }

    /// The stacks captured so far in `pid` are named: code objects are checked again.
    pub fn new_naming_batch(&mut self, pid: i32) {
        if let Some(walker) = self.walkers.get_mut(&pid).and_then(|s| s.walker.as_mut()) {
            walker.new_naming_batch();
        }
    }

    /// Records a stack the ring trampoline captured at thread `tid`'s hit, named
    /// through the walker's code-object cache, as the context of the event about to
    /// be written for it: the same `stack` event as [`Sampler::context`] writes.
    pub fn captured(
        &mut self,
        pid: i32,
        tid: i32,
        ts_ns: u64,
        stack: &RingStack,
        builder: &mut EventBuilder,
    ) {
        let Some(walker) = self.walker(pid, ts_ns) else {
            return;
        };
        let named = walker.name_captured(&stack.frames);
        // The gone-frames share is of stacks named: one with no walker is not written.
        self.captured_stacks += 1;
        let gone = named.iter().filter(|f| f.is_none()).count() as u64;
        if gone > 0 {
            self.gone_stacks += 1;
            self.gone_frames += gone;
        }
        // A frame pyprobe cannot name keeps its place, so the stack keeps its shape.
        let frames: Vec<PyFrame> = named
            .into_iter()
            .map(|f| f.unwrap_or_else(PyFrame::gone))
            .collect();
        if !frames.is_empty() {
            let frames = Self::frames(builder, pid, &frames);
            builder.write(tid, ts_ns, EventKind::Stack { frames });
        }
    }

    /// Records the Python stack of thread `tid` (stopped at a probe hit) as the
    /// context of the event about to be written for it.
    pub fn context(&mut self, pid: i32, tid: i32, ts_ns: u64, builder: &mut EventBuilder) {
        let Some(walker) = self.walker(pid, ts_ns) else {
            return;
        };
        if let Ok(Some(stack)) = walker.thread_stack(tid) {
            if !stack.frames.is_empty() {
                let frames = Self::frames(builder, pid, &stack.frames);
                builder.write(tid, ts_ns, EventKind::Stack { frames });
            }
        }
    }
}
