//! The ptrace engine. It traces SDT probes of any program and knows nothing of Python.

pub(crate) mod budget;
pub mod clock;
pub mod decode;
pub mod engine;
pub mod guardian;
pub mod inject;
pub mod launch;
pub mod near_map;
pub mod patch;
pub(crate) mod regs;
pub mod ring_engine;
pub(crate) mod safety_net;
pub mod signals;
pub(crate) mod test_switches;

pub use engine::{
    BudgetSummary, Engine, EngineOptions, Hit, NotTraceable, Outcome, PauseCause, RepeatSlot,
    Resolver, ReturnRow, RingUse, ThinLevel, TickCount, TraceEvent, STALL_NS,
};
// What the engine is asked to trace, defined below it so its callers need not import it.
pub use crate::probe_set::{usable_sites, Probe, ProbeSet, Refusal, Site};
pub use regs::Registers;
pub use signals::StopReason;
