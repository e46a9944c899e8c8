//! Commands that join the parts: pick what to read or trace, drive it, hand the
//! result to a view.

pub mod dump;
mod dump_async;
pub mod probes;
mod progress;
pub mod record;
pub mod report;
pub mod report_lines;
pub mod top;
pub mod views;
