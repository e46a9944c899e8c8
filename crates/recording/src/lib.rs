//! pyprobe recordings: the file format (`recording`), what is computed from them
//! (`analyze`) and every view of them (`output`). No process is touched here:
//! benches and fuzzers use this crate alone.

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod analyze;
pub mod output;
pub mod recording;
pub mod stored;
