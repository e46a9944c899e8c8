//! What CPython's probes and structures mean. The tracer knows nothing of Python;
//! this module gives the probes their names, groups and argument meanings.

pub mod entry_lasti;
pub mod probe_catalog;
pub mod source_scopes;
pub mod tracing;
pub mod version;
pub mod walker;
