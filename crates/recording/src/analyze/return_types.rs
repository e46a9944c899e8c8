//! What each function returned, by type: the latest running total of every
//! (process, function, type) that `return_type` events carry, summed over
//! processes per function.

use std::collections::HashMap;

use super::model::{ReturnTypes, TypeCount};
use crate::recording::{FrameRef, StrId};

/// The totals seen so far.
#[derive(Debug, Default)]
pub(crate) struct ReturnTypeTracker {
    /// (process, function, type or `None` for raised) → its running total.
    totals: HashMap<(u32, FrameRef, Option<StrId>), u64>,
}

impl ReturnTypeTracker {
    /// A running total: totals only grow, so the largest seen is the latest (a
    /// recording is read in order, but this holds whatever the order).
    pub fn record(&mut self, pid: u32, function: FrameRef, returned: Option<StrId>, total: u64) {
        let t = self.totals.entry((pid, function, returned)).or_insert(0);
        *t = (*t).max(total);
    }

    /// One row per function, most returns first; types most frequent first.
    pub fn finish(self, mut name: impl FnMut(StrId) -> String) -> Vec<ReturnTypes> {
        let mut per_function: HashMap<FrameRef, (HashMap<Option<StrId>, u64>, u64)> =
            HashMap::new();
        for ((_, function, returned), total) in self.totals {
            let (types, raised) = per_function.entry(function).or_default();
            match returned {
                Some(_) => *types.entry(returned).or_insert(0) += total,
                None => *raised += total,
            }
        }
        let mut rows: Vec<ReturnTypes> = per_function
            .into_iter()
            .map(|(f, (types, raised))| {
                let mut returned: Vec<TypeCount> = types
                    .into_iter()
                    .filter_map(|(ty, count)| {
                        ty.map(|t| TypeCount {
                            type_name: name(t),
                            count,
                        })
                    })
                    .collect();
                returned.sort_by(|a, b| {
                    b.count
                        .cmp(&a.count)
                        .then_with(|| a.type_name.cmp(&b.type_name))
                });
                ReturnTypes {
                    file: name(f.file),
                    function: name(f.function),
                    line: f.line,
                    returned,
                    raised,
                }
            })
            .collect();
        rows.sort_by(|a, b| {
            b.total()
                .cmp(&a.total())
                .then_with(|| a.function.cmp(&b.function))
                .then_with(|| a.file.cmp(&b.file))
                .then(a.line.cmp(&b.line))
        });
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_totals_summed_over_processes_raised_apart() {
        let f = FrameRef {
            file: StrId(1),
            function: StrId(2),
            line: 7,
        };
        let g = FrameRef { line: 9, ..f };
        let mut t = ReturnTypeTracker::default();
        // Process 10 said twice (the later total replaces the earlier), 11 once.
        t.record(10, f, Some(StrId(3)), 5);
        t.record(10, f, Some(StrId(3)), 39);
        t.record(11, f, Some(StrId(3)), 1);
        t.record(10, f, Some(StrId(4)), 39);
        t.record(10, f, None, 2);
        t.record(10, g, Some(StrId(4)), 1);
        let names = ["", "a.py", "f", "list", "tuple"];
        let rows = t.finish(|id| names[id.0 as usize].to_string());
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].line, rows[0].raised, rows[0].total()), (7, 2, 81));
        let types: Vec<(&str, u64)> = rows[0]
            .returned
            .iter()
            .map(|c| (c.type_name.as_str(), c.count))
            .collect();
        assert_eq!(types, [("list", 40), ("tuple", 39)]);
        assert_eq!((rows[1].line, rows[1].total()), (9, 1));
    }
}
