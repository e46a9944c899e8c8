//! pyprobe: profile and trace a live CPython process from outside, with nothing but ptrace.
//!
//! Data flows one way: target process → events → recording → views. This crate is
//! the command line and the sessions that join the others: `pyprobe_sdt` (the
//! ptrace engine), `pyprobe_cpython` (what is known of CPython) and
//! `pyprobe_recording` (the file and its views).

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod session;
