//! What pyprobe knows of CPython: its versions and the offsets of its structures,
//! the frame walker that reads Python stacks from outside, the hook injected into
//! the interpreter for exact calls (`hook`: the code; `hook_engine`: pyprobe's side
//! of it, an event source of the SDT engine), and native stacks merged with Python's.
//!
//! A new CPython version touches this crate only (see its README).

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod hook;
pub mod hook_engine;
pub mod native;
pub mod python;
