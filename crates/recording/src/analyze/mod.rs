//! Analysis of an event stream: stack reconstruction and aggregation into the
//! data behind `pyprobe report`. Pure: no I/O, no syscalls, but reading a
//! recording through its reader (`recording`, `report`).

pub(crate) mod aggregate;
mod budget;
pub mod checkpoints;
pub mod filter;
pub mod first_pass;
pub mod folded;
mod gc;
pub mod histogram;
mod imports;
pub mod line_counts;
pub(crate) mod model;
pub mod planned_ahead;
pub mod processes;
pub(crate) mod recording;
pub(crate) mod replay;
pub mod report;
mod return_types;
mod samples;
pub(crate) mod states;

#[cfg(test)]
mod tests;

pub use aggregate::Aggregator;
pub use filter::{parse_duration, FileFilter, FilterError, SliceFilter};
pub use histogram::Histogram;
pub use model::{
    Anomalies, AuditCount, Caveat, ExactWindows, FunctionSource, FunctionStats, GcStats,
    ImportStats, Pause, ProcessStats, RaisingStack, Report, ReturnTypes, Target, Thinned,
    ThreadStats, Trigger, TypeCount,
};
pub use replay::{
    plan_events, EndKind, Exit, Pairing, Plan, Planner, Replay, ReplayCounters, Step, MAX_DEPTH,
};
pub use states::{SampleFilter, SampleTally};
