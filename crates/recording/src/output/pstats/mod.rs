//! `pstats`: a recording as cProfile's `.prof` file (a marshalled dict), which
//! `python -m pstats`, `pstats.Stats`, snakeviz, tuna and gprof2dot read.
//!
//! Each function is keyed as cProfile keys it, `(co_filename, co_firstlineno,
//! co_name)`, with `(primitive calls, calls, own time, cumulative time, callers)`;
//! each caller entry holds the same four numbers for the calls made from that
//! caller. A call is primitive when no other activation of the same function is
//! below it on the stack, and only those add to the cumulative time, as cProfile
//! counts them. A GC pause is a function of its own, `('~', 0, '<gc collection,
//! generation N>')`, called by the code that triggered it (cProfile would have
//! charged its time to that code).
//!
//! The numbers are the flame graph's folded stacks: a traced recording gives the
//! exact calls and their times; a sampled one estimated times (samples × the
//! sampling interval) and no calls (0), which the command says.

mod marshal;

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use crate::analyze::folded::{FoldFrame, Folded, Measure, NodeId};
use crate::output::flame::{is_sampled, ViewInfo};
use crate::recording::{or_unnamed, StrId};
use marshal::Marshal;

/// A function as pstats keys it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StatsKey {
    pub file: String,
    pub line: u32,
    pub name: String,
}

/// The four numbers of a function, or of its calls from one caller.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StatsCounts {
    /// Primitive calls: not below another activation of the function.
    pub primitive: u64,
    pub calls: u64,
    /// Own time, seconds.
    pub own_s: f64,
    /// Time with its callees, of primitive calls only, seconds.
    pub cumulative_s: f64,
}

impl StatsCounts {
    fn add(&mut self, primitive: bool, calls: u64, own_ns: u64, subtree_ns: u64) {
        self.calls += calls;
        self.own_s += own_ns as f64 / 1e9;
        if primitive {
            self.primitive += calls;
            self.cumulative_s += subtree_ns as f64 / 1e9;
        }
    }
}

/// One function's entry.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StatsEntry {
    pub counts: StatsCounts,
    pub callers: BTreeMap<StatsKey, StatsCounts>,
}

/// Every function of a recording, as pstats holds them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub functions: BTreeMap<StatsKey, StatsEntry>,
    /// Times are estimated from samples, and calls unknown (0).
    pub sampled: bool,
}

/// The stats of `folded` (stacks of a recording whose strings are
/// `recording_strings`, described by `info`).
pub fn build_stats(folded: &Folded, info: &ViewInfo, recording_strings: &[String]) -> Stats {
    let sampled = is_sampled(folded, &info.header);
    // CPython 3.11's return-only traces are timed by the samples taken alongside.
    let by_samples = sampled || folded.counts.returns_only;
    let interval = info.header.sample_interval_ns;
    let tree = &folded.tree;
    let n = tree.len();
    let own: Vec<u64> = (0..n as NodeId)
        .map(|node| {
            if by_samples {
                folded
                    .value(node, Measure::Samples)
                    .saturating_mul(interval)
            } else {
                folded.value(node, Measure::Time)
            }
        })
        .collect();
    let mut subtree = own.clone();
    for node in (1..n).rev() {
        let parent = tree.parent(node as NodeId) as usize;
        subtree[parent] = subtree[parent].saturating_add(subtree[node]);
    }
    let string = |id: StrId| {
        recording_strings
            .get(id.0 as usize)
            .map_or("?", String::as_str)
    };
    let key_of = |frame: FoldFrame| -> Option<StatsKey> {
        match frame {
            FoldFrame::Python(code) | FoldFrame::PythonLine { code, .. } => Some(StatsKey {
                file: string(code.file).to_owned(),
                line: code.line,
                // cProfile names a function by `co_name`, as recordings do.
                name: or_unnamed(string(code.function)).to_owned(),
            }),
            FoldFrame::Gc { generation } => Some(StatsKey {
                file: "~".into(),
                line: 0,
                name: format!("<gc collection, generation {generation}>"),
            }),
            // Labels of where stacks ran, not functions.
            FoldFrame::Process { .. } | FoldFrame::Thread { .. } => None,
        }
    };
    // Each node's key, and the node of its nearest keyed ancestor (its caller).
    let mut keys: Vec<Option<u32>> = vec![None; n];
    let mut caller_node: Vec<Option<NodeId>> = vec![None; n];
    let mut interned: HashMap<StatsKey, u32> = HashMap::new();
    let mut key_list: Vec<StatsKey> = Vec::new();
    for node in 1..n as NodeId {
        if let Some(key) = tree.frame(node).and_then(key_of) {
            let next = key_list.len() as u32;
            let id = *interned.entry(key.clone()).or_insert_with(|| {
                key_list.push(key);
                next
            });
            keys[node as usize] = Some(id);
        }
        let parent = tree.parent(node);
        caller_node[node as usize] = if keys[parent as usize].is_some() {
            Some(parent)
        } else {
            caller_node[parent as usize]
        };
    }
    let mut functions: BTreeMap<StatsKey, StatsEntry> = BTreeMap::new();
    for node in 1..n as NodeId {
        let Some(id) = keys[node as usize] else {
            continue;
        };
        // Primitive: no keyed ancestor of the same function.
        let mut primitive = true;
        let mut up = caller_node[node as usize];
        while let Some(a) = up {
            if keys[a as usize] == Some(id) {
                primitive = false;
                break;
            }
            up = caller_node[a as usize];
        }
        let calls = if sampled {
            0
        } else {
            folded.value(node, Measure::Calls)
        };
        let (own_ns, sub_ns) = (own[node as usize], subtree[node as usize]);
        if calls == 0 && sub_ns == 0 {
            continue;
        }
        let entry = functions.entry(key_list[id as usize].clone()).or_default();
        entry.counts.add(primitive, calls, own_ns, sub_ns);
        if let Some(caller) = caller_node[node as usize].and_then(|c| keys[c as usize]) {
            entry
                .callers
                .entry(key_list[caller as usize].clone())
                .or_default()
                .add(primitive, calls, own_ns, sub_ns);
        }
    }
    Stats { functions, sampled }
}

/// Writes `stats` as cProfile's `.prof` (what `pstats.Stats` loads).
pub fn write_pstats(stats: &Stats, out: &mut dyn Write) -> io::Result<()> {
    let mut m = Marshal::default();
    let key = |m: &mut Marshal, k: &StatsKey| {
        m.tuple(3);
        m.str(&k.file);
        m.int(u64::from(k.line));
        m.str(&k.name);
    };
    let counts = |m: &mut Marshal, c: &StatsCounts| {
        m.int(c.primitive);
        m.int(c.calls);
        m.float(c.own_s);
        m.float(c.cumulative_s);
    };
    m.dict();
    for (k, entry) in &stats.functions {
        key(&mut m, k);
        m.tuple(5);
        counts(&mut m, &entry.counts);
        m.dict();
        for (caller, c) in &entry.callers {
            key(&mut m, caller);
            m.tuple(4);
            counts(&mut m, c);
        }
        m.end_dict();
    }
    m.end_dict();
    out.write_all(&m.out)
}

#[cfg(test)]
mod tests;
