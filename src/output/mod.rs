//! Views of a recording: each reads only the event model and the analysis.

pub mod probes;
pub mod report;
