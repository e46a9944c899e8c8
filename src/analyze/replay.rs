//! The one replay of a recording's calls and returns that every view shares
//! (report, flame graph, Chrome trace, speedscope, call flow), so that they agree
//! by construction.
//!
//! A recording is read twice. The first pass ([`Planner`]) sees the whole stream
//! and decides what one pass cannot:
//! * which entries never return. CPython 3.15 fires its entry probe whenever a
//!   frame is pushed: at each call and resume, but also when a generator or
//!   coroutine is created, whose frame `RETURN_GENERATOR` hands to the new object
//!   without a return. A return pairs with the innermost frame of its function;
//!   on 3.15 the frames above it are such creations: they ran no code, so the
//!   replay leaves them out of the stacks (counted in the anomalies) and the
//!   calls they seemed to make belong to their caller;
//! * which frames were running when tracing began (attach, an exact window
//!   opening, events lost): the frame walker's stack at attach (`running`
//!   event), and the returns that find an empty stack, innermost first. They
//!   seed each thread's stack, timed from that moment;
//! * which function (code object: file, name, first line) each event belongs
//!   to. A row is one function. An entry passes the line the frame is at, which
//!   for a resuming generator is the line it yielded at, and a return passes the
//!   line it returns from: every paired return teaches that its line belongs to
//!   the function of its entry, so later resumes there go to the same row.
//!   Returns without entry (and CPython 3.11's returns-only stream) go to the
//!   function of the same file and name with the greatest known first line not
//!   after the return's line; first lines come from entries and from the frame
//!   walker (samples, stacks).
//!
//! The second pass ([`Replay`]) rebuilds each thread's stack with that plan and
//! emits [`Step`]s: frames entering and leaving, with inclusive and exclusive
//! time, and calls counted without a frame. Recursion is recognised by code
//! object on the stack, never by name: a row's inclusive time counts each
//! outermost activation once, so it is never less than its exclusive time. Each
//! thread's clock is kept monotonic (timestamps converted from the TSC can step
//! back by a few ns), so a child always nests within its parent.
//!
//! Memory is bounded by the distinct functions and lines, the threads, the stack
//! depth cap, and the generator creations (one integer each).

use rustc_hash::{FxHashMap, FxHashSet};

use super::processes::ProcessMap;
use crate::record::{Event, EventKind, FrameRef, Header, StrId, WalkedFrame};

/// Deepest stack tracked per thread; calls beyond it are counted, not timed.
pub const MAX_DEPTH: usize = 2048;

/// A function's file and name: what an entry and its return have in common.
type Name = (StrId, StrId);

/// The line a CPython 3.12+ probe passes for an instruction without location
/// (the first instruction of a function with cells, or of a class body): -1.
const NO_LINE: u32 = u32::MAX;

/// Longest chain of resume lines followed to a function's first line.
const MAX_CHAIN: usize = 64;

/// How a recording's function events pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pairing {
    /// Every entry has its return (CPython 3.6 – 3.10).
    #[default]
    Paired,
    /// Entries also fire at generator creation, without return (CPython 3.15).
    Creations,
    /// Returns only (CPython 3.11): no stacks, counts from returns.
    ReturnsOnly,
}

/// How a frame left the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndKind {
    /// Its return arrived.
    Returned,
    /// Popped by a later return of a frame below it: an entry that never
    /// returned, in a stream where every entry should. Counted as a call.
    Unpaired,
    /// Still on the stack when its thread or the recording ended: its time so
    /// far counts, the call does not.
    Open,
    /// Exact tracing stopped (overhead budget) or events were lost: its time so
    /// far counts, the call does not, and it is no anomaly.
    Cut,
}

/// A frame that left the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub tid: u32,
    /// When it left (the thread's monotonic time).
    pub ts: u64,
    /// The function: file, name, first line.
    pub code: FrameRef,
    /// Its position on the stack, 0 outermost.
    pub depth: usize,
    /// From its entry (or from when tracing began, if `seeded`) to `ts`.
    pub inclusive_ns: u64,
    /// `inclusive_ns` minus the time of its callees.
    pub exclusive_ns: u64,
    /// No other activation of the same function is below it: add `inclusive_ns`
    /// to the function's total only for these.
    pub outermost: bool,
    pub kind: EndKind,
    /// It was running when tracing began: its entry was not seen.
    pub seeded: bool,
}

impl Exit {
    /// When it entered (or tracing began).
    pub fn start_ns(&self) -> u64 {
        self.ts.saturating_sub(self.inclusive_ns)
    }

    /// Whether it counts as a call.
    pub fn is_call(&self) -> bool {
        matches!(self.kind, EndKind::Returned | EndKind::Unpaired)
    }
}

/// What the replay made of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A frame was pushed at `depth` (0 outermost).
    Enter {
        tid: u32,
        ts: u64,
        code: FrameRef,
        depth: usize,
        /// Running when tracing began (from the frame walker or a return that
        /// found an empty stack): `ts` is when tracing began.
        seeded: bool,
    },
    Exit(Exit),
    /// A finished call without a frame: its entry was not seen (a return
    /// without entry, a call beyond the depth cap, CPython 3.11). Counted, not
    /// timed.
    Untimed {
        tid: u32,
        ts: u64,
        code: FrameRef,
    },
}

/// Irregularities met while pairing events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayCounters {
    /// Returns that matched a frame below the top: the frames above were popped.
    pub resyncs: u64,
    /// Frames popped by a resync (entries without return).
    pub unpaired_entries: u64,
    /// Returns without an entry that no seed explains (CPython 3.15's
    /// `generator.throw()` resumes a frame without entry; events lost).
    pub orphan_returns: u64,
    /// Calls not tracked because the stack was [`MAX_DEPTH`] deep.
    pub depth_overflows: u64,
    /// Frames still open when their thread or the recording ended.
    pub open_at_end: u64,
    /// Frames running when tracing began, seeded onto the stacks.
    pub open_at_start: u64,
    /// Entries at a generator's or coroutine's creation (CPython 3.15), left out.
    pub generator_creations: u64,
    /// Returns of the interpreter's own shim frames (CPython 3.15's `__init__`
    /// cleanup after `CALL_ALLOC_AND_ENTER_INIT`), left out.
    pub shim_returns: u64,
}

/// Per-thread totals of the replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThreadTime {
    /// When its first frame started and its last frame ended (monotonic time):
    /// the traced wall time is `last - first`.
    pub first_ns: Option<u64>,
    pub last_ns: u64,
    /// Sum of the exclusive times of its frames.
    pub exclusive_ns: u64,
}

impl ThreadTime {
    /// From its first frame's start to its last frame's end.
    pub fn wall_ns(&self) -> u64 {
        self.first_ns.map_or(0, |f| self.last_ns.saturating_sub(f))
    }
}

/// What the first pass found; see the module documentation.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pairing: Pairing,
    /// Per thread: indices (among the thread's call events) of generator creations.
    creations: FxHashMap<u32, Vec<u64>>,
    /// Per (thread, segment): frames running when the segment began that the
    /// walker did not report, found as returns on an empty stack: outermost first,
    /// as (file, name, line returned from).
    seeds: FxHashMap<(u32, u32), Vec<FrameRef>>,
    /// Start of each segment after the first (a cut: lost events, a window).
    segment_starts: Vec<u64>,
    /// (file, name, line) → the entry line of a frame that returned at that line.
    resumes: FxHashMap<(StrId, StrId, u32), u32>,
    /// Known first lines per function name, sorted: from entries and the walker.
    first_lines: FxHashMap<Name, Vec<u32>>,
    /// First lines the frame walker read, sorted.
    walked: FxHashMap<Name, Vec<u32>>,
    /// Smallest line a frame entered without line (-1) returned from.
    unknown_min: FxHashMap<Name, u32>,
    /// Smallest line of returns without entry, per function name.
    orphan_min: FxHashMap<Name, u32>,
    /// Smallest current line of walked frames of format 1 (first line unknown).
    walked_min: FxHashMap<Name, u32>,
    /// Names of module code (entered at line 0 on CPython 3.12+).
    modules: FxHashSet<Name>,
    /// Names of the interpreter's shim code objects.
    shims: FxHashSet<Name>,
    /// Per thread: first and last sample time, and samples.
    sampled: FxHashMap<u32, (u64, u64, u64)>,
    /// Call and return events of the recording.
    pub calls: u64,
    pub returns: u64,
    /// Sample events.
    pub samples: u64,
    /// Every process of the recording, as its last event left them.
    pub processes: ProcessMap,
}

impl Plan {
    /// How the recording's function events pair.
    pub fn pairing(&self) -> Pairing {
        self.pairing
    }

    fn is_creation(&self, tid: u32, index: u64, cursor: &mut usize) -> bool {
        let Some(list) = self.creations.get(&tid) else {
            return false;
        };
        while *cursor < list.len() && list[*cursor] < index {
            *cursor += 1;
        }
        list.get(*cursor) == Some(&index)
    }

    /// The first line of the function an entry at `line` belongs to.
    fn entry_line(&self, file: StrId, function: StrId, line: u32) -> u32 {
        let name = (file, function);
        if line == 0 && self.modules.contains(&name) {
            // Module code starts at line 0 on 3.12+; its first line is 1.
            return 1;
        }
        let mut l = line;
        let mut lowest = line;
        for _ in 0..MAX_CHAIN {
            match self.resumes.get(&(file, function, l)) {
                Some(&p) if p != l && p != line => {
                    l = p;
                    lowest = lowest.min(l);
                }
                Some(&p) if p == line && p != l => {
                    // A cycle of resume lines (attached mid-generator): the lowest.
                    l = lowest;
                    break;
                }
                _ => break,
            }
        }
        match l {
            // Module code starts at line 1, whatever its first instruction says.
            NO_LINE if self.modules.contains(&name) => 1,
            NO_LINE => self.unknown_line(name),
            l => l,
        }
    }

    /// A first line for a function whose entries carry no line (-1): the walker's
    /// greatest first line not after its returns, else its first return's line.
    fn unknown_line(&self, name: Name) -> u32 {
        let min = self.unknown_min.get(&name).copied();
        if let (Some(walked), Some(m)) = (self.walked.get(&name), min) {
            if let Some(l) = enclosing(walked, m) {
                return l;
            }
        }
        if let Some(m) = min {
            return m;
        }
        match self.first_lines.get(&name).map(Vec::as_slice) {
            Some([only]) => *only,
            _ => 0,
        }
    }

    /// The first line of the function a return without entry at `line` belongs to.
    fn return_line(&self, file: StrId, function: StrId, line: u32) -> u32 {
        if line != NO_LINE && self.resumes.contains_key(&(file, function, line)) {
            return self.entry_line(file, function, line);
        }
        let name = (file, function);
        if let Some(l) = self
            .first_lines
            .get(&name)
            .and_then(|lines| enclosing(lines, line))
        {
            return l;
        }
        // Unknown: one row per file and name.
        self.orphan_min.get(&name).copied().unwrap_or(line)
    }

    /// The function (file, name, first line) of an entry.
    pub fn entry_code(&self, f: &FrameRef) -> FrameRef {
        FrameRef {
            line: self.entry_line(f.file, f.function, f.line),
            ..*f
        }
    }

    /// The function of a return whose entry was not seen.
    pub fn return_code(&self, f: &FrameRef) -> FrameRef {
        FrameRef {
            line: self.return_line(f.file, f.function, f.line),
            ..*f
        }
    }

    /// The function of a frame the walker read.
    pub fn walked_code(&self, w: &WalkedFrame) -> FrameRef {
        if w.code.line != 0 {
            return w.code;
        }
        // Format 1: no first line; the enclosing known one, else one row per name.
        let name = (w.code.file, w.code.function);
        let line = self
            .first_lines
            .get(&name)
            .and_then(|lines| enclosing(lines, w.line))
            .or_else(|| self.walked_min.get(&name).copied())
            .unwrap_or(w.line);
        FrameRef { line, ..w.code }
    }

    /// The time one sample of thread `tid` stands for: the time between its first
    /// and last sample over the samples taken in between (a busy tracer takes
    /// them late), else `nominal`.
    pub fn sample_weight(&self, tid: u32, nominal: u64) -> u64 {
        match self.sampled.get(&tid) {
            Some(&(first, last, n)) if n >= 3 && last > first => (last - first) / (n - 1),
            _ => nominal,
        }
    }

    fn is_shim(&self, f: &FrameRef) -> bool {
        f.line == NO_LINE && self.shims.contains(&(f.file, f.function))
    }
}

/// The greatest line in `sorted` not after `line`.
fn enclosing(sorted: &[u32], line: u32) -> Option<u32> {
    let i = sorted.partition_point(|&l| l <= line);
    i.checked_sub(1).map(|i| sorted[i])
}

fn insert_sorted(lines: &mut Vec<u32>, line: u32) {
    if let Err(i) = lines.binary_search(&line) {
        lines.insert(i, line);
    }
}

/// Whether `version` (`3.15.2`) is at least `major.minor`.
fn version_at_least(version: &str, major: u32, minor: u32) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(a), Some(b)) => (a, b) >= (major, minor),
        _ => false,
    }
}

fn is_311(version: &str) -> bool {
    version == "3.11" || version.starts_with("3.11.")
}

#[derive(Clone, Copy)]
struct PlanFrame {
    name: Name,
    line: u32,
    /// Index among the thread's call events; `None` for a seeded frame.
    index: Option<u64>,
}

#[derive(Default)]
struct PlanThread {
    stack: Vec<PlanFrame>,
    overflow: u64,
    calls: u64,
    /// Returns that found an empty stack in the current segment, innermost first.
    bottom: Vec<FrameRef>,
    segment: u32,
}

/// The first pass: feed it every event with [`push`](Self::push), then
/// [`finish`](Self::finish).
pub struct Planner {
    creations_possible: bool,
    is_311: bool,
    version_known: bool,
    threads: FxHashMap<u32, PlanThread>,
    segment: u32,
    entry_lines: FxHashSet<(StrId, StrId, u32)>,
    plan: Plan,
}

impl Planner {
    /// Plans a recording described by `header`.
    pub fn new(header: &Header) -> Self {
        Planner {
            creations_possible: version_at_least(&header.python_version, 3, 15),
            is_311: is_311(&header.python_version),
            version_known: !header.python_version.is_empty(),
            threads: FxHashMap::default(),
            segment: 0,
            entry_lines: FxHashSet::default(),
            plan: Plan {
                processes: ProcessMap::new(header),
                ..Plan::default()
            },
        }
    }

    fn thread(threads: &mut FxHashMap<u32, PlanThread>, segment: u32, tid: u32) -> &mut PlanThread {
        let t = threads.entry(tid).or_default();
        if t.segment != segment {
            t.segment = segment;
            t.bottom.clear();
        }
        t
    }

    fn flush_bottom(plan: &mut Plan, tid: u32, t: &mut PlanThread) {
        if !t.bottom.is_empty() {
            let mut seeds = std::mem::take(&mut t.bottom);
            seeds.reverse();
            plan.seeds.insert((tid, t.segment), seeds);
        }
    }

    fn walked(&mut self, frames: &[WalkedFrame]) {
        for w in frames {
            let name = (w.code.file, w.code.function);
            if w.code.line != 0 {
                insert_sorted(self.plan.walked.entry(name).or_default(), w.code.line);
            } else {
                let m = self.plan.walked_min.entry(name).or_insert(w.line);
                *m = (*m).min(w.line);
            }
        }
    }

    /// Adds one event; `strings` is the recording's string table so far.
    pub fn push(&mut self, event: &Event, strings: &[String]) {
        let tid = event.tid;
        self.plan.processes.push(event);
        match &event.kind {
            EventKind::Call { frame } => {
                self.plan.calls += 1;
                let name = (frame.file, frame.function);
                if (frame.line == 0 || frame.line == NO_LINE) && !self.plan.modules.contains(&name)
                {
                    let module = strings.get(frame.function.0 as usize);
                    if module.is_some_and(|s| s == "<module>") {
                        self.plan.modules.insert(name);
                    }
                }
                self.entry_lines
                    .insert((frame.file, frame.function, frame.line));
                let t = Self::thread(&mut self.threads, self.segment, tid);
                let index = t.calls;
                t.calls += 1;
                if t.stack.len() >= MAX_DEPTH {
                    t.overflow += 1;
                } else {
                    t.stack.push(PlanFrame {
                        name,
                        line: frame.line,
                        index: Some(index),
                    });
                }
            }
            EventKind::Return { frame } => {
                self.plan.returns += 1;
                let name = (frame.file, frame.function);
                if frame.line == NO_LINE && is_shim(strings, frame) {
                    self.plan.shims.insert(name);
                    return;
                }
                if self.is_311 {
                    // Returns only: each may be a function's row of last resort.
                    let m = self.plan.orphan_min.entry(name).or_insert(frame.line);
                    *m = (*m).min(frame.line);
                }
                let creations_possible = self.creations_possible;
                let t = Self::thread(&mut self.threads, self.segment, tid);
                if t.overflow > 0 {
                    t.overflow -= 1;
                    return;
                }
                let Some(i) = t.stack.iter().rposition(|f| f.name == name) else {
                    if t.stack.is_empty() && t.bottom.len() < MAX_DEPTH {
                        t.bottom.push(*frame);
                    } else {
                        let m = self.plan.orphan_min.entry(name).or_insert(frame.line);
                        *m = (*m).min(frame.line);
                    }
                    return;
                };
                for above in t.stack.drain(i + 1..) {
                    if let (true, Some(index)) = (creations_possible, above.index) {
                        self.plan.creations.entry(tid).or_default().push(index);
                    }
                }
                let Some(f) = t.stack.pop() else { return };
                if f.line == NO_LINE {
                    let m = self.plan.unknown_min.entry(name).or_insert(frame.line);
                    *m = (*m).min(frame.line);
                }
                if frame.line != f.line && frame.line != NO_LINE {
                    self.plan
                        .resumes
                        .entry((frame.file, frame.function, frame.line))
                        .or_insert(f.line);
                }
            }
            EventKind::ThreadExit => {
                let t = Self::thread(&mut self.threads, self.segment, tid);
                t.stack.clear();
                t.overflow = 0;
            }
            EventKind::Exec { .. } => {
                // The old program's frames are gone with its image.
                let pid = self.plan.processes.pid_of(tid);
                for (&t_id, t) in self.threads.iter_mut() {
                    if self.plan.processes.pid_of(t_id) == pid {
                        t.stack.clear();
                        t.overflow = 0;
                    }
                }
            }
            EventKind::Running { frames } => {
                self.walked(frames);
                let t = Self::thread(&mut self.threads, self.segment, tid);
                t.stack.clear();
                t.overflow = 0;
                t.stack
                    .extend(frames.iter().take(MAX_DEPTH).map(|w| PlanFrame {
                        name: (w.code.file, w.code.function),
                        line: if w.code.line != 0 {
                            w.code.line
                        } else {
                            w.line
                        },
                        index: None,
                    }));
            }
            EventKind::Sample { frames, .. } => {
                self.plan.samples += 1;
                let ts = event.ts_ns;
                let s = self.plan.sampled.entry(tid).or_insert((ts, ts, 0));
                s.0 = s.0.min(ts);
                s.1 = s.1.max(ts);
                s.2 += 1;
                self.walked(frames);
            }
            EventKind::Stack { frames } => self.walked(frames),
            EventKind::Lost { .. } | EventKind::Window { .. } => {
                // The calls and returns around here are unknown (lost, or not
                // traced): every stack starts over.
                for (&t_id, t) in self.threads.iter_mut() {
                    if t.segment == self.segment {
                        Self::flush_bottom(&mut self.plan, t_id, t);
                    }
                    t.stack.clear();
                    t.overflow = 0;
                }
                self.segment += 1;
                self.plan.segment_starts.push(event.ts_ns);
            }
            _ => {}
        }
    }

    /// The plan.
    pub fn finish(mut self) -> Plan {
        let segment = self.segment;
        for (&tid, t) in self.threads.iter_mut() {
            if t.segment == segment {
                Self::flush_bottom(&mut self.plan, tid, t);
            }
        }
        for list in self.plan.creations.values_mut() {
            list.sort_unstable();
        }
        let plan = &mut self.plan;
        plan.pairing = match (plan.calls, plan.returns) {
            // 3.11's entry probe fires only while a tracing hook is set: a few.
            (c, r) if self.is_311 && c.saturating_mul(2) < r => Pairing::ReturnsOnly,
            _ if self.creations_possible => Pairing::Creations,
            // Returns alone from an interpreter of unknown version: as 3.11. A
            // known one whose entries all return (attached to a loop that only
            // returned meanwhile) pairs as usual.
            (0, r) if r > 0 && !self.version_known => Pairing::ReturnsOnly,
            _ => Pairing::Paired,
        };
        // Known first lines: entries (through their resume lines) and the walker.
        // 3.11's few entries fire when an exception is thrown into a generator,
        // at the line it is suspended at: no first line.
        let mut first_lines: FxHashMap<Name, Vec<u32>> = plan.walked.clone();
        if plan.pairing == Pairing::ReturnsOnly {
            plan.resumes.clear();
        } else {
            for &(file, function, line) in &self.entry_lines {
                let first = plan.entry_line(file, function, line);
                insert_sorted(first_lines.entry((file, function)).or_default(), first);
            }
        }
        plan.first_lines = first_lines;
        self.plan
    }
}

/// CPython 3.15's shim code objects (`_Py_InitCleanup`): file and name `__init__`.
fn is_shim(strings: &[String], f: &FrameRef) -> bool {
    let s = |id: StrId| strings.get(id.0 as usize).map(String::as_str);
    s(f.file) == Some("__init__") && s(f.function) == Some("__init__")
}

struct OpenFrame {
    code: FrameRef,
    name: Name,
    start: u64,
    child: u64,
    seeded: bool,
}

#[derive(Default)]
struct ReplayThread {
    frames: Vec<OpenFrame>,
    /// Activations of each function (code object) on the stack.
    active: FxHashMap<FrameRef, u32>,
    overflow: u64,
    calls: u64,
    creation_cursor: usize,
    /// The segment whose seeds are on the stack.
    seeded: Option<u32>,
    /// When its thread-start event came: nothing of it ran before.
    started: Option<u64>,
    /// Its monotonic clock.
    clock: u64,
    time: ThreadTime,
}

/// The second pass; see the module documentation.
pub struct Replay {
    plan: Plan,
    threads: FxHashMap<u32, ReplayThread>,
    segment: u32,
    header_start: u64,
    counters: ReplayCounters,
    /// The processes as the events so far say.
    processes: ProcessMap,
}

impl Replay {
    /// Replays a recording described by `header` with the first pass's `plan`.
    pub fn new(header: &Header, plan: Plan) -> Self {
        Replay {
            plan,
            threads: FxHashMap::default(),
            segment: 0,
            header_start: header.start_ns,
            counters: ReplayCounters::default(),
            processes: ProcessMap::new(header),
        }
    }

    /// The process of thread `tid` at the event being replayed.
    pub fn process_of(&self, tid: u32) -> u32 {
        self.processes.pid_of(tid)
    }

    /// The processes as the events so far say (commands as of now).
    pub fn processes(&self) -> &ProcessMap {
        &self.processes
    }

    /// Whether the recording holds more than its own process (known from the
    /// first pass, so from the first event on).
    pub fn several_processes(&self) -> bool {
        self.plan.processes.several()
    }

    /// The plan it replays.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Pairing irregularities so far.
    pub fn counters(&self) -> ReplayCounters {
        self.counters
    }

    /// The function of a frame the walker read.
    pub fn walked_code(&self, w: &WalkedFrame) -> FrameRef {
        self.plan.walked_code(w)
    }

    /// Per-thread totals, by thread id.
    pub fn thread_times(&self) -> Vec<(u32, ThreadTime)> {
        let mut v: Vec<(u32, ThreadTime)> =
            self.threads.iter().map(|(&t, r)| (t, r.time)).collect();
        v.sort_unstable_by_key(|(t, _)| *t);
        v
    }

    /// The functions on `tid`'s stack, outermost first.
    pub fn stack(&self, tid: u32) -> impl Iterator<Item = FrameRef> + '_ {
        self.threads
            .get(&tid)
            .into_iter()
            .flat_map(|t| t.frames.iter().map(|f| f.code))
    }

    /// Depth of `tid`'s stack.
    pub fn depth(&self, tid: u32) -> usize {
        self.threads.get(&tid).map_or(0, |t| t.frames.len())
    }

    /// Threads with a stack, in id order.
    pub fn thread_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.threads.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Adds one event; the steps it causes go to `out`. Returns the event's time
    /// on its thread's monotonic clock.
    pub fn push(&mut self, event: &Event, out: &mut Vec<Step>) -> u64 {
        let tid = event.tid;
        self.processes.push(event);
        let returns_only = self.plan.pairing == Pairing::ReturnsOnly;
        let t = self.threads.entry(tid).or_default();
        if matches!(
            event.kind,
            EventKind::Sample { .. } | EventKind::Thinned { .. } | EventKind::AuditsCounted { .. }
        ) {
            // Written when pyprobe looks (a sample) or decides (markers, on whichever
            // thread): what the thread did before, read from a ring afterwards (a
            // record still being written when the sample was taken), keeps its
            // own time.
            return t.clock.max(event.ts_ns);
        }
        t.clock = t.clock.max(event.ts_ns);
        let ts = t.clock;
        match &event.kind {
            EventKind::Call { frame } => {
                let index = t.calls;
                t.calls += 1;
                if returns_only {
                    return ts;
                }
                if self.plan.is_creation(tid, index, &mut t.creation_cursor) {
                    self.counters.generator_creations += 1;
                    return ts;
                }
                self.seed(tid, ts, out);
                let t = self.threads.entry(tid).or_default();
                if t.frames.len() >= MAX_DEPTH {
                    t.overflow += 1;
                    self.counters.depth_overflows += 1;
                    return ts;
                }
                let code = self.plan.entry_code(frame);
                push_frame(t, tid, code, (frame.file, frame.function), ts, false, out);
            }
            EventKind::Return { frame } => {
                if self.plan.is_shim(frame) {
                    self.counters.shim_returns += 1;
                    return ts;
                }
                if returns_only {
                    out.push(Step::Untimed {
                        tid,
                        ts,
                        code: self.plan.return_code(frame),
                    });
                    return ts;
                }
                self.seed(tid, ts, out);
                let t = self.threads.entry(tid).or_default();
                if t.overflow > 0 {
                    // The innermost calls were dropped at the cap: this is one.
                    t.overflow -= 1;
                    out.push(Step::Untimed {
                        tid,
                        ts,
                        code: self.plan.return_code(frame),
                    });
                    return ts;
                }
                let name = (frame.file, frame.function);
                match t.frames.iter().rposition(|f| f.name == name) {
                    Some(i) => {
                        if i + 1 < t.frames.len() {
                            self.counters.resyncs += 1;
                            while t.frames.len() > i + 1 {
                                self.counters.unpaired_entries += 1;
                                pop_frame(t, tid, ts, EndKind::Unpaired, out);
                            }
                        }
                        pop_frame(t, tid, ts, EndKind::Returned, out);
                    }
                    None => {
                        self.counters.orphan_returns += 1;
                        out.push(Step::Untimed {
                            tid,
                            ts,
                            code: self.plan.return_code(frame),
                        });
                    }
                }
            }
            EventKind::ThreadExit => {
                self.close(tid, ts, EndKind::Open, out);
            }
            EventKind::ThreadStart { .. } => t.started = Some(ts),
            EventKind::Exec { .. } => {
                // The old program's frames ended with its image: times counted.
                let pid = self.processes.pid_of(tid);
                for id in self.thread_ids() {
                    if self.processes.pid_of(id) == pid {
                        let at = self.threads.get(&id).map_or(ts, |t| t.clock.max(ts));
                        self.close(id, at, EndKind::Cut, out);
                    }
                }
            }
            EventKind::Running { frames } if !returns_only => {
                // Tracing begins on this thread: what the walker saw is running.
                self.close(tid, ts, EndKind::Cut, out);
                self.seed(tid, ts, out);
                let t = self.threads.entry(tid).or_default();
                for w in frames {
                    if t.frames.len() >= MAX_DEPTH {
                        break;
                    }
                    self.counters.open_at_start += 1;
                    let code = self.plan.walked_code(w);
                    push_frame(t, tid, code, (w.code.file, w.code.function), ts, true, out);
                }
            }
            EventKind::Lost { .. } | EventKind::Window { .. } => {
                for id in self.thread_ids() {
                    let at = self.threads.get(&id).map_or(ts, |t| t.clock.max(ts));
                    self.close(id, at, EndKind::Cut, out);
                }
                self.segment += 1;
            }
            _ => {}
        }
        ts
    }

    /// Pushes the frames that were running on `tid` when the current segment
    /// began, once per segment.
    fn seed(&mut self, tid: u32, ts: u64, out: &mut Vec<Step>) {
        let segment = self.segment;
        let t = self.threads.entry(tid).or_default();
        if t.seeded == Some(segment) {
            return;
        }
        t.seeded = Some(segment);
        let Some(seeds) = self.plan.seeds.get(&(tid, segment)) else {
            return;
        };
        let start = match segment {
            0 => match t.started {
                Some(started) => started.min(ts),
                None if self.header_start != 0 => self.header_start.min(ts),
                None => ts,
            },
            s => self
                .plan
                .segment_starts
                .get(s as usize - 1)
                .copied()
                .unwrap_or(ts)
                .min(ts),
        };
        for f in seeds {
            if t.frames.len() >= MAX_DEPTH {
                break;
            }
            self.counters.open_at_start += 1;
            let code = self.plan.return_code(f);
            push_frame(t, tid, code, (f.file, f.function), start, true, out);
        }
    }

    fn close(&mut self, tid: u32, ts: u64, kind: EndKind, out: &mut Vec<Step>) {
        let Some(t) = self.threads.get_mut(&tid) else {
            return;
        };
        while !t.frames.is_empty() {
            if kind == EndKind::Open {
                self.counters.open_at_end += 1;
            }
            pop_frame(t, tid, ts, kind, out);
        }
        t.overflow = 0;
    }

    /// The recording ended at `end_ns`: every open frame ends there (or at its
    /// thread's last event, if later), in thread-id order.
    pub fn finish(&mut self, end_ns: u64, out: &mut Vec<Step>) {
        for tid in self.thread_ids() {
            let at = self
                .threads
                .get(&tid)
                .map_or(end_ns, |t| t.clock.max(end_ns));
            self.close(tid, at, EndKind::Open, out);
        }
    }
}

fn push_frame(
    t: &mut ReplayThread,
    tid: u32,
    code: FrameRef,
    name: Name,
    ts: u64,
    seeded: bool,
    out: &mut Vec<Step>,
) {
    let depth = t.frames.len();
    t.frames.push(OpenFrame {
        code,
        name,
        start: ts,
        child: 0,
        seeded,
    });
    *t.active.entry(code).or_insert(0) += 1;
    if t.time.first_ns.is_none() {
        t.time.first_ns = Some(ts);
    }
    out.push(Step::Enter {
        tid,
        ts,
        code,
        depth,
        seeded,
    });
}

fn pop_frame(t: &mut ReplayThread, tid: u32, ts: u64, kind: EndKind, out: &mut Vec<Step>) {
    let Some(f) = t.frames.pop() else {
        return;
    };
    let inclusive_ns = ts.saturating_sub(f.start);
    let exclusive_ns = inclusive_ns.saturating_sub(f.child);
    let outermost = match t.active.get_mut(&f.code) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        _ => {
            t.active.remove(&f.code);
            true
        }
    };
    if let Some(parent) = t.frames.last_mut() {
        parent.child = parent.child.saturating_add(inclusive_ns);
    }
    t.time.exclusive_ns = t.time.exclusive_ns.saturating_add(exclusive_ns);
    t.time.last_ns = t.time.last_ns.max(ts);
    out.push(Step::Exit(Exit {
        tid,
        ts,
        code: f.code,
        depth: t.frames.len(),
        inclusive_ns,
        exclusive_ns,
        outermost,
        kind,
        seeded: f.seeded,
    }));
}

/// The plan of events held in memory (tests, benchmarks); `strings` is the
/// recording's string table.
pub fn plan_events<'a>(
    header: &Header,
    strings: &[String],
    events: impl IntoIterator<Item = &'a Event>,
) -> Plan {
    let mut planner = Planner::new(header);
    for e in events {
        planner.push(e, strings);
    }
    planner.finish()
}
