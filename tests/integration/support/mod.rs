//! Helpers shared by the integration tests.
//!
//! * [`run`]: the test interpreters, the C fixtures, target processes that clean up
//!   after themselves, and running pyprobe (its JSON reports checked against the
//!   schema).
//! * [`traced`]: temporary files, probe sites of a live target, waiting for pyprobe
//!   to attach, a pyprobe running in the background, tests that must run alone.

pub mod run;
pub mod traced;

pub use run::*;
pub use traced::*;
