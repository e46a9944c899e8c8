//! Views of a recording: each reads only the event model and the analysis.
//! [`file`] is how every output named by the user is written.

pub mod calls;
pub mod chrome;
pub mod file;
pub mod flame;
pub mod probes;
pub mod report;
pub mod speedscope;
pub mod top;
