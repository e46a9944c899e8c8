//! pyprobe: profile and trace a live CPython process from outside, with nothing but ptrace.
//!
//! Data flows one way: target process → events → recording → views.

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod analyze;
pub mod elf;
pub mod hook;
pub mod native;
pub mod output;
pub mod probe_set;
pub mod process;
pub mod python;
pub mod recording;
pub mod ring;
pub mod sdt;
pub mod session;
pub mod tracer;
