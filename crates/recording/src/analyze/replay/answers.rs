//! What a replay asked its plan, and what the plan answered: kept when a
//! recording is replayed while it is still being written, with a plan made from
//! the events so far. The replay is the one the whole recording's plan would
//! have made exactly when every answer it used is the one that plan gives, since
//! a replay depends on nothing else but the events. [`Answers::hold_for`] checks
//! that once the recording is finished; a question answered two ways on the way
//! (two provisional plans disagreeing) settles it at once.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::hash::Hash;

use rustc_hash::FxHashMap;

use super::plan::Plan;
use super::steps::Pairing;
use crate::recording::{FrameRef, WalkedFrame};

/// The answers to questions about one thread's call events by index (which of
/// them are generator creations; the first lines returns named): the last index
/// asked, and the indices answered with a value, in order.
#[derive(Debug, Clone, Default)]
struct ByIndex {
    last_asked: u64,
    answered: Vec<(u64, u32)>,
}

impl ByIndex {
    fn note(&mut self, index: u64, answer: Option<u32>) {
        self.last_asked = self.last_asked.max(index);
        if let Some(value) = answer {
            self.answered.push((index, value));
        }
    }

    /// Whether `full` (sorted by index) holds exactly the answered indices up to
    /// the last asked.
    fn agrees(&self, full: &[(u64, u32)]) -> bool {
        let upto = full.partition_point(|(i, _)| *i <= self.last_asked);
        full[..upto] == self.answered[..]
    }
}

/// The frames a segment of a thread began with, as a plan answers.
type Seeds = Option<Vec<(FrameRef, u32)>>;

/// See the module documentation.
#[derive(Debug, Clone, Default)]
pub(crate) struct Answers {
    entry_codes: FxHashMap<FrameRef, FrameRef>,
    return_codes: FxHashMap<(FrameRef, u32), FrameRef>,
    walked_codes: FxHashMap<(FrameRef, u32), FrameRef>,
    shims: FxHashMap<FrameRef, bool>,
    event_costs: FxHashMap<u32, u64>,
    sample_weights: FxHashMap<(u32, u64), u64>,
    seeds: FxHashMap<(u32, u32), Seeds>,
    traced_from: FxHashMap<u32, Option<u64>>,
    segment_starts: FxHashMap<usize, Option<u64>>,
    pairing: Option<Pairing>,
    several_processes: Option<bool>,
    creations: FxHashMap<u32, ByIndex>,
    entry_firsts: FxHashMap<u32, ByIndex>,
    /// A question was answered two ways.
    contradicted: bool,
}

fn note<K: Hash + Eq, V: PartialEq>(
    map: &mut FxHashMap<K, V>,
    key: K,
    answer: V,
    contradicted: &mut bool,
) {
    match map.entry(key) {
        Entry::Occupied(kept) => *contradicted |= *kept.get() != answer,
        Entry::Vacant(slot) => {
            slot.insert(answer);
        }
    }
}

fn note_once<V: PartialEq>(kept: &mut Option<V>, answer: V, contradicted: &mut bool) {
    match kept {
        Some(k) => *contradicted |= *k != answer,
        None => *kept = Some(answer),
    }
}

impl Answers {
    fn entry_code(&mut self, asked: FrameRef, answer: FrameRef) {
        note(&mut self.entry_codes, asked, answer, &mut self.contradicted);
    }

    fn return_code(&mut self, asked: (FrameRef, u32), answer: FrameRef) {
        note(
            &mut self.return_codes,
            asked,
            answer,
            &mut self.contradicted,
        );
    }

    fn walked_code(&mut self, asked: &WalkedFrame, answer: FrameRef) {
        let key = (asked.code, asked.line);
        note(&mut self.walked_codes, key, answer, &mut self.contradicted);
    }

    fn shim(&mut self, asked: FrameRef, answer: bool) {
        note(&mut self.shims, asked, answer, &mut self.contradicted);
    }

    fn event_cost(&mut self, pid: u32, answer: u64) {
        note(&mut self.event_costs, pid, answer, &mut self.contradicted);
    }

    fn sample_weight(&mut self, asked: (u32, u64), answer: u64) {
        note(
            &mut self.sample_weights,
            asked,
            answer,
            &mut self.contradicted,
        );
    }

    fn seeds(&mut self, asked: (u32, u32), answer: Option<&Vec<(FrameRef, u32)>>) {
        let answer = answer.cloned();
        note(&mut self.seeds, asked, answer, &mut self.contradicted);
    }

    fn traced_from(&mut self, pid: u32, answer: Option<u64>) {
        note(&mut self.traced_from, pid, answer, &mut self.contradicted);
    }

    fn segment_start(&mut self, index: usize, answer: Option<u64>) {
        note(
            &mut self.segment_starts,
            index,
            answer,
            &mut self.contradicted,
        );
    }

    fn pairing(&mut self, answer: Pairing) {
        note_once(&mut self.pairing, answer, &mut self.contradicted);
    }

    fn several_processes(&mut self, answer: bool) {
        note_once(&mut self.several_processes, answer, &mut self.contradicted);
    }

    fn creation(&mut self, tid: u32, index: u64, answer: bool) {
        let list = self.creations.entry(tid).or_default();
        list.note(index, answer.then_some(0));
    }

    fn entry_first(&mut self, tid: u32, index: u64, answer: Option<u32>) {
        self.entry_firsts
            .entry(tid)
            .or_default()
            .note(index, answer);
    }

    /// Whether `plan` (with no answers kept of its own) gives every answer kept.
    fn hold_for(&self, plan: &Plan) -> bool {
        if self.contradicted {
            return false;
        }
        let held = self.pairing.is_none_or(|p| p == plan.pairing())
            && self
                .several_processes
                .is_none_or(|s| s == plan.several_processes())
            && self
                .entry_codes
                .iter()
                .all(|(asked, answer)| plan.entry_code(asked) == *answer)
            && self
                .return_codes
                .iter()
                .all(|((f, first), answer)| plan.return_code(f, *first) == *answer)
            && self.walked_codes.iter().all(|(&(code, line), answer)| {
                plan.walked_code(&WalkedFrame { code, line }) == *answer
            })
            && self.shims.iter().all(|(f, &a)| plan.is_shim(f) == a)
            && self
                .event_costs
                .iter()
                .all(|(&pid, &a)| plan.event_cost(pid) == a)
            && self
                .sample_weights
                .iter()
                .all(|(&(tid, nominal), &a)| plan.sample_weight(tid, nominal) == a)
            && self
                .seeds
                .iter()
                .all(|(&(tid, segment), a)| plan.seeds_of(tid, segment) == a.as_ref())
            && self
                .traced_from
                .iter()
                .all(|(&pid, &a)| plan.traced_from(pid) == a)
            && self
                .segment_starts
                .iter()
                .all(|(&i, &a)| plan.segment_start(i) == a);
        held && self.creations.iter().all(|(tid, asked)| {
            let full: Vec<(u64, u32)> = plan
                .creations_of(*tid)
                .iter()
                .map(|&index| (index, 0))
                .collect();
            asked.agrees(&full)
        }) && self
            .entry_firsts
            .iter()
            .all(|(tid, asked)| asked.agrees(plan.entry_firsts_of(*tid)))
    }
}

/// A replay's plan, and, while it is provisional, the answers it gave: every
/// question the replay asks its plan goes through here.
#[derive(Clone, Default)]
pub(super) struct AskedPlan {
    plan: Plan,
    /// `None` for the plan of a whole recording. A `RefCell` since views ask
    /// through a shared replay; one thread asks.
    answers: Option<Box<RefCell<Answers>>>,
}

impl AskedPlan {
    /// The plan of a whole recording.
    pub(super) fn whole(plan: Plan) -> Self {
        AskedPlan {
            plan,
            answers: None,
        }
    }

    /// A provisional plan, which keeps its answers.
    pub(super) fn provisional(plan: Plan) -> Self {
        let mut asked = AskedPlan::whole(plan);
        asked.keep(Answers::default());
        asked
    }

    /// Keeps `answers` and the answers every question of the replay gets from
    /// this plan alike (asked at every event, they are noted once here).
    fn keep(&mut self, mut answers: Answers) {
        answers.pairing(self.plan.pairing());
        answers.several_processes(self.plan.several_processes());
        self.answers = Some(Box::new(RefCell::new(answers)));
    }

    fn take_answers(&mut self) -> Option<Answers> {
        self.answers.take().map(|a| a.into_inner())
    }

    pub(super) fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Goes on with `plan`, a provisional plan of more events; `false` when a
    /// question was already answered two ways.
    pub(super) fn replan(&mut self, plan: Plan) -> bool {
        let answers = self.take_answers().unwrap_or_default();
        self.plan = plan;
        self.keep(answers);
        !self.contradicted()
    }

    /// Goes on with `plan`, the whole recording's, if it gives every answer
    /// kept; `false` (and nothing changes) otherwise.
    pub(super) fn settle(&mut self, plan: Plan) -> bool {
        if let Some(answers) = self.take_answers() {
            if !answers.hold_for(&plan) {
                self.answers = Some(Box::new(RefCell::new(answers)));
                return false;
            }
        }
        *self = AskedPlan::whole(plan);
        true
    }

    pub(super) fn contradicted(&self) -> bool {
        self.answers
            .as_ref()
            .is_some_and(|a| a.try_borrow().map_or(true, |a| a.contradicted))
    }

    #[inline]
    fn noted<T>(&self, answer: T, note: impl FnOnce(&mut Answers, &T)) -> T {
        if let Some(kept) = &self.answers {
            if let Ok(mut kept) = kept.try_borrow_mut() {
                note(&mut kept, &answer);
            }
        }
        answer
    }

    pub(super) fn event_cost(&self, pid: u32) -> u64 {
        self.noted(self.plan.event_cost(pid), |a, &c| a.event_cost(pid, c))
    }

    pub(super) fn is_creation(&self, tid: u32, index: u64, cursor: &mut usize) -> bool {
        let created = self.plan.is_creation(tid, index, cursor);
        self.noted(created, |a, &c| a.creation(tid, index, c))
    }

    pub(super) fn entry_first(&self, tid: u32, index: u64, cursor: &mut usize) -> Option<u32> {
        let first = self.plan.entry_first(tid, index, cursor);
        self.noted(first, |a, &f| a.entry_first(tid, index, f))
    }

    pub(super) fn entry_code(&self, f: &FrameRef) -> FrameRef {
        self.noted(self.plan.entry_code(f), |a, &c| a.entry_code(*f, c))
    }

    pub(super) fn return_code(&self, f: &FrameRef, first_line: u32) -> FrameRef {
        let code = self.plan.return_code(f, first_line);
        self.noted(code, |a, &c| a.return_code((*f, first_line), c))
    }

    pub(super) fn walked_code(&self, w: &WalkedFrame) -> FrameRef {
        if w.code.line != 0 {
            // The code object's own first line: nothing is asked of the plan.
            return w.code;
        }
        self.noted(self.plan.walked_code(w), |a, &c| a.walked_code(w, c))
    }

    pub(super) fn is_shim(&self, f: &FrameRef) -> bool {
        self.noted(self.plan.is_shim(f), |a, &s| a.shim(*f, s))
    }

    pub(super) fn sample_weight(&self, tid: u32, nominal: u64) -> u64 {
        let weight = self.plan.sample_weight(tid, nominal);
        self.noted(weight, |a, &w| a.sample_weight((tid, nominal), w))
    }

    pub(super) fn seeds_of(&self, tid: u32, segment: u32) -> Option<&Vec<(FrameRef, u32)>> {
        self.noted(self.plan.seeds_of(tid, segment), |a, s| {
            a.seeds((tid, segment), *s)
        })
    }

    pub(super) fn traced_from(&self, pid: u32) -> Option<u64> {
        self.noted(self.plan.traced_from(pid), |a, &t| a.traced_from(pid, t))
    }

    pub(super) fn segment_start(&self, index: usize) -> Option<u64> {
        self.noted(self.plan.segment_start(index), |a, &s| {
            a.segment_start(index, s)
        })
    }
}
