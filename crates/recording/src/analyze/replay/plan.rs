//! The first pass: what one pass over the calls and returns cannot decide
//! (entries that never return, frames running when tracing began, which
//! function each event belongs to).

use rustc_hash::{FxHashMap, FxHashSet};

use super::cost::CostMeter;
use super::steps::{Name, Pairing, MAX_CHAIN, MAX_DEPTH, NO_LINE};
use crate::analyze::processes::ProcessMap;
use crate::recording::{Event, EventKind, FrameRef, Header, StrId, WalkedFrame};

/// What the first pass found; see the module documentation.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    pub(super) pairing: Pairing,
    /// Per thread: indices (among the thread's call events) of generator creations.
    pub(super) creations: FxHashMap<u32, Vec<u64>>,
    /// Per (thread, segment): frames running when the segment began that the
    /// walker did not report, found as returns on an empty stack: outermost first,
    /// as (file, name, line returned from) and the first line the return named (0:
    /// none).
    pub(super) seeds: FxHashMap<(u32, u32), Vec<(FrameRef, u32)>>,
    /// Start of each segment after the first (a cut: lost events, a window).
    pub(super) segment_starts: Vec<u64>,
    /// Per process: its first call or return, when its calls began to be traced
    /// (the engine installed; the recording began earlier).
    pub(super) traced_from: FxHashMap<u32, u64>,
    /// (file, name, line) → the entry line of a frame that returned at that line.
    pub(super) resumes: FxHashMap<(StrId, StrId, u32), u32>,
    /// (file, name, entry line) → the first line of the function, named by the
    /// return of a frame entered at that line (CPython 3.11+ returns read it from
    /// the code object): a decorated function entered at its `def` line, a
    /// generator resumed at a line, belong to that function.
    pub(super) code_lines: FxHashMap<(StrId, StrId, u32), u32>,
    /// Per thread: (index among its call events, first line) of entries without
    /// line (-1: CPython 3.15's functions with cells) whose return named its
    /// function's first line, by index. Two such functions of one name in one file
    /// are told apart only this way.
    pub(super) entry_firsts: FxHashMap<u32, Vec<(u64, u32)>>,
    /// Known first lines per function name, sorted: from entries and the walker.
    pub(super) first_lines: FxHashMap<Name, Vec<u32>>,
    /// First lines read from code objects, sorted: by the frame walker, or
    /// named by returns.
    pub(super) walked: FxHashMap<Name, Vec<u32>>,
    /// Smallest line a frame entered without line (-1) returned from.
    pub(super) unknown_min: FxHashMap<Name, u32>,
    /// Smallest line of returns without entry, per function name.
    pub(super) orphan_min: FxHashMap<Name, u32>,
    /// Smallest current line of walked frames of format 1 (first line unknown).
    pub(super) walked_min: FxHashMap<Name, u32>,
    /// Names of module code (entered at line 0 on CPython 3.12+).
    pub(super) modules: FxHashSet<Name>,
    /// Names of the interpreter's shim code objects.
    pub(super) shims: FxHashSet<Name>,
    /// Per thread: first and last sample time, and samples.
    pub(super) sampled: FxHashMap<u32, (u64, u64, u64)>,
    /// Call and return events of the recording.
    pub calls: u64,
    pub returns: u64,
    /// Sample events.
    pub samples: u64,
    /// Every process of the recording, as its last event left them.
    pub processes: ProcessMap,
    /// Per process: what tracing cost a thread per call or return event (see
    /// [`cost`](super::cost)), where the gaps between them tell it.
    pub(super) event_costs: FxHashMap<u32, u64>,
}

impl Plan {
    /// What tracing cost a thread of process `pid` per call or return event
    /// (0: not known).
    pub(crate) fn event_cost(&self, pid: u32) -> u64 {
        self.event_costs.get(&pid).copied().unwrap_or(0)
    }

    /// How the recording's function events pair.
    pub(crate) fn pairing(&self) -> Pairing {
        self.pairing
    }

    /// Whether the recording holds more than its own process.
    pub(crate) fn several_processes(&self) -> bool {
        self.processes.several()
    }

    /// The frames found running on thread `tid` when segment `segment` began.
    pub(super) fn seeds_of(&self, tid: u32, segment: u32) -> Option<&Vec<(FrameRef, u32)>> {
        self.seeds.get(&(tid, segment))
    }

    /// When the calls of process `pid` began to be traced.
    pub(super) fn traced_from(&self, pid: u32) -> Option<u64> {
        self.traced_from.get(&pid).copied()
    }

    /// When segment `index + 1` began.
    pub(super) fn segment_start(&self, index: usize) -> Option<u64> {
        self.segment_starts.get(index).copied()
    }

    /// Thread `tid`'s generator creations, by index among its call events.
    pub(super) fn creations_of(&self, tid: u32) -> &[u64] {
        self.creations.get(&tid).map_or(&[], Vec::as_slice)
    }

    /// Thread `tid`'s entries without line whose return named a first line.
    pub(super) fn entry_firsts_of(&self, tid: u32) -> &[(u64, u32)] {
        self.entry_firsts.get(&tid).map_or(&[], Vec::as_slice)
    }

    pub(super) fn is_creation(&self, tid: u32, index: u64, cursor: &mut usize) -> bool {
        let list = self.creations_of(tid);
        while *cursor < list.len() && list[*cursor] < index {
            *cursor += 1;
        }
        list.get(*cursor) == Some(&index)
    }

    /// The first line the return of the entry with index `index` (among thread
    /// `tid`'s call events) named, for an entry without line; `cursor` walks the
    /// thread's list (indices asked in increasing order).
    pub(super) fn entry_first(&self, tid: u32, index: u64, cursor: &mut usize) -> Option<u32> {
        let list = self.entry_firsts_of(tid);
        while *cursor < list.len() && list[*cursor].0 < index {
            *cursor += 1;
        }
        list.get(*cursor)
            .filter(|(i, _)| *i == index)
            .map(|(_, first)| *first)
    }

    /// The first line of the function an entry at `line` belongs to.
    pub(super) fn entry_line(&self, file: StrId, function: StrId, line: u32) -> u32 {
        let name = (file, function);
        if let Some(&first) = self.code_lines.get(&(file, function, line)) {
            return first;
        }
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
        if let Some(&first) = self.code_lines.get(&(file, function, l)) {
            return first;
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
    pub(super) fn unknown_line(&self, name: Name) -> u32 {
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

    /// The first line of the function a return without entry at `line` belongs to,
    /// `first_line` when the return named it.
    pub(super) fn return_line(
        &self,
        file: StrId,
        function: StrId,
        line: u32,
        first_line: u32,
    ) -> u32 {
        if first_line != 0 {
            return first_line;
        }
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
    pub(crate) fn entry_code(&self, f: &FrameRef) -> FrameRef {
        FrameRef {
            line: self.entry_line(f.file, f.function, f.line),
            ..*f
        }
    }

    /// The function of a return whose entry was not seen; `first_line` is the
    /// one the return named (0: none).
    pub(crate) fn return_code(&self, f: &FrameRef, first_line: u32) -> FrameRef {
        FrameRef {
            line: self.return_line(f.file, f.function, f.line, first_line),
            ..*f
        }
    }

    /// The function of a frame the walker read.
    pub(crate) fn walked_code(&self, w: &WalkedFrame) -> FrameRef {
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
    pub(crate) fn sample_weight(&self, tid: u32, nominal: u64) -> u64 {
        match self.sampled.get(&tid) {
            Some(&(first, last, n)) if n >= 3 && last > first => (last - first) / (n - 1),
            _ => nominal,
        }
    }

    pub(super) fn is_shim(&self, f: &FrameRef) -> bool {
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

#[derive(Default, Clone)]
struct PlanThread {
    stack: Vec<PlanFrame>,
    overflow: u64,
    calls: u64,
    /// Returns that found an empty stack in the current segment, innermost first,
    /// with the first line each named.
    bottom: Vec<(FrameRef, u32)>,
    segment: u32,
}

/// The first pass: feed it every event with [`push`](Self::push), then
/// [`finish`](Self::finish).
#[derive(Clone)]
pub struct Planner {
    creations_possible: bool,
    is_311: bool,
    version_known: bool,
    threads: FxHashMap<u32, PlanThread>,
    segment: u32,
    entry_lines: FxHashSet<(StrId, StrId, u32)>,
    costs: CostMeter,
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
            costs: CostMeter::default(),
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
        if let EventKind::Call { .. } | EventKind::Resume { .. } | EventKind::Return { .. } =
            &event.kind
        {
            let pid = self.plan.processes.pid_of(tid);
            self.plan.traced_from.entry(pid).or_insert(event.ts_ns);
            self.costs.event(pid, tid, event.ts_ns);
        }
        match &event.kind {
            EventKind::Call { frame } | EventKind::Resume { frame } => {
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
            EventKind::Return { frame, first_line } => {
                self.plan.returns += 1;
                let name = (frame.file, frame.function);
                if frame.line == NO_LINE && is_shim(strings, frame) {
                    self.plan.shims.insert(name);
                    return;
                }
                let first_line = *first_line;
                if first_line != 0 {
                    insert_sorted(self.plan.walked.entry(name).or_default(), first_line);
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
                        t.bottom.push((*frame, first_line));
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
                if first_line != 0 {
                    match (f.line, f.index) {
                        (NO_LINE, Some(index)) => self
                            .plan
                            .entry_firsts
                            .entry(tid)
                            .or_default()
                            .push((index, first_line)),
                        (NO_LINE, None) => {}
                        (line, _) => {
                            self.plan
                                .code_lines
                                .entry((frame.file, frame.function, line))
                                .or_insert(first_line);
                        }
                    }
                }
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
            EventKind::Lost { .. } | EventKind::Window { .. } | EventKind::Paused { .. } => {
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
                self.costs.cut();
            }
            _ => {}
        }
    }

    /// The plan of the events so far, as if the recording ended here: a
    /// provisional plan for a replay made while the recording is written.
    pub fn provisional(&self) -> Plan {
        self.clone().finish()
    }

    /// Whether calls were traced, and every process with calls traced so far
    /// has its cost per event settled ([`cost`](super::cost)): until then, a
    /// provisional plan's cannot be the recording's.
    pub fn costs_settled(&self) -> bool {
        let traced = &self.plan.traced_from;
        !traced.is_empty() && traced.keys().all(|&pid| self.costs.settled(pid))
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
        for list in self.plan.entry_firsts.values_mut() {
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
        if plan.pairing != Pairing::ReturnsOnly {
            plan.event_costs = self.costs.finish();
        }
        self.plan
    }
}

/// CPython 3.15's shim code objects (`_Py_InitCleanup`): file and name `__init__`.
fn is_shim(strings: &[String], f: &FrameRef) -> bool {
    let s = |id: StrId| strings.get(id.0 as usize).map(String::as_str);
    s(f.file) == Some("__init__") && s(f.function) == Some("__init__")
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
