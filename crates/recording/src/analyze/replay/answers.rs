//! What a replay asked its plan, and what the plan answered: kept when a
//! recording is replayed while it is still being written, with a plan made from
//! the events so far. The replay is the one the whole recording's plan would
//! have made exactly when every answer it used is the one that plan gives, since
//! a replay depends on nothing else but the events. [`Answers::hold_for`] checks
//! that once the recording is finished; a question answered two ways on the way
//! (two provisional plans disagreeing) settles it at once.

use std::collections::hash_map::Entry;
use std::hash::Hash;
use std::sync::Mutex;

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
    pub(super) fn entry_code(&mut self, asked: FrameRef, answer: FrameRef) {
        note(&mut self.entry_codes, asked, answer, &mut self.contradicted);
    }

    pub(super) fn return_code(&mut self, asked: (FrameRef, u32), answer: FrameRef) {
        note(
            &mut self.return_codes,
            asked,
            answer,
            &mut self.contradicted,
        );
    }

    pub(super) fn walked_code(&mut self, asked: &WalkedFrame, answer: FrameRef) {
        let key = (asked.code, asked.line);
        note(&mut self.walked_codes, key, answer, &mut self.contradicted);
    }

    pub(super) fn shim(&mut self, asked: FrameRef, answer: bool) {
        note(&mut self.shims, asked, answer, &mut self.contradicted);
    }

    pub(super) fn event_cost(&mut self, pid: u32, answer: u64) {
        note(&mut self.event_costs, pid, answer, &mut self.contradicted);
    }

    pub(super) fn sample_weight(&mut self, asked: (u32, u64), answer: u64) {
        note(
            &mut self.sample_weights,
            asked,
            answer,
            &mut self.contradicted,
        );
    }

    pub(super) fn seeds(&mut self, asked: (u32, u32), answer: Option<&Vec<(FrameRef, u32)>>) {
        let answer = answer.cloned();
        note(&mut self.seeds, asked, answer, &mut self.contradicted);
    }

    pub(super) fn traced_from(&mut self, pid: u32, answer: Option<u64>) {
        note(&mut self.traced_from, pid, answer, &mut self.contradicted);
    }

    pub(super) fn segment_start(&mut self, index: usize, answer: Option<u64>) {
        note(
            &mut self.segment_starts,
            index,
            answer,
            &mut self.contradicted,
        );
    }

    pub(super) fn pairing(&mut self, answer: Pairing) {
        note_once(&mut self.pairing, answer, &mut self.contradicted);
    }

    pub(super) fn several_processes(&mut self, answer: bool) {
        note_once(&mut self.several_processes, answer, &mut self.contradicted);
    }

    pub(super) fn creation(&mut self, tid: u32, index: u64, answer: bool) {
        let list = self.creations.entry(tid).or_default();
        list.note(index, answer.then_some(0));
    }

    pub(super) fn entry_first(&mut self, tid: u32, index: u64, answer: Option<u32>) {
        self.entry_firsts
            .entry(tid)
            .or_default()
            .note(index, answer);
    }

    /// Whether a question was answered two ways.
    pub(super) fn contradicted(&self) -> bool {
        self.contradicted
    }

    /// Whether `plan` (with no answers kept of its own) gives every answer kept.
    pub(super) fn hold_for(&self, plan: &Plan) -> bool {
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

/// The answers a provisional plan keeps (none for a plan of a whole recording).
/// Behind a lock because a plan is shared between threads, though only the one
/// replaying asks it questions.
#[derive(Debug, Default)]
pub(super) struct KeptAnswers(Option<Box<Mutex<Answers>>>);

impl KeptAnswers {
    pub(super) fn new(answers: Answers) -> Self {
        KeptAnswers(Some(Box::new(Mutex::new(answers))))
    }

    pub(super) fn take(&mut self) -> Option<Answers> {
        let kept = self.0.take()?;
        Some(kept.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// Calls `note` with the answers, when they are kept.
    #[inline]
    pub(super) fn note(&self, note: impl FnOnce(&mut Answers)) {
        if let Some(kept) = &self.0 {
            note(&mut kept.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }
}

impl Clone for KeptAnswers {
    fn clone(&self) -> Self {
        let copy = self.0.as_ref().map(|kept| {
            let answers = kept.lock().unwrap_or_else(|e| e.into_inner()).clone();
            Box::new(Mutex::new(answers))
        });
        KeptAnswers(copy)
    }
}
