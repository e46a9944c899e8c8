//! Tracing the SystemTap (SDT) probes of a running program from outside, with
//! ptrace alone: the probe notes in its ELF objects, their argument specs, access
//! to its memory and threads, and the engine that catches every hit (an `int3`
//! breakpoint, or a trampoline appending to a ring shared with the tracer).
//!
//! Nothing here knows of Python: the probes to trace come from a
//! [`tracer::Resolver`], and events beside the probes from an
//! [`tracer::engine::source::EventSource`].

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod elf;
pub mod probe_set;
pub mod process;
pub mod ring;
pub mod sdt;
pub mod sigtrap_page;
pub mod tracer;
