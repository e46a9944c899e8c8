//! Views of a recording: each reads only the event model and the analysis.

pub mod calls;
pub mod chrome;
pub mod flame;
pub mod probes;
pub mod report;
pub mod speedscope;
pub mod top;
