//! Helpers shared by the integration tests.
//!
//! * [`run`]: the test interpreters, the C fixtures, target processes that clean up
//!   after themselves, and running pyprobe (its JSON reports checked against the
//!   schema).
//! * [`browser`]: a headless Chromium driven through the DevTools protocol.
//! * [`traced`]: temporary files, probe sites of a live target, waiting for pyprobe
//!   to attach, a pyprobe running in the background, tests that must run alone.

pub mod browser;
pub mod run;
pub mod traced;

pub use run::*;
pub use traced::*;
