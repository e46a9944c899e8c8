//! What the engine is asked to trace. The types are defined in [`crate::probe_set`],
//! below the engine, so that the callers who build a set do not import the engine.

pub use crate::probe_set::{usable_sites, Probe, ProbeSet, Refusal, Site};
