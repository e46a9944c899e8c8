//! The one replay of a recording's calls and returns that every view shares
//! (report, flame graph, Chrome trace, speedscope, call flow), so that they agree
//! by construction.
//!
//! A recording is read twice. The first pass ([`Planner`]) sees the whole stream
//! and decides what one pass cannot:
//! * which entries never return. CPython 3.15 fires its entry probe whenever a
//!   frame is pushed: at each call and resume, but also when a generator or
//!   coroutine is created, whose frame `RETURN_GENERATOR` hands to the new object
//!   without a return. A return pairs with the innermost frame of its function;
//!   on 3.15 the frames above it are such creations: they ran no code, so the
//!   replay leaves them out of the stacks (counted in the anomalies) and the
//!   calls they seemed to make belong to their caller;
//! * which frames were running when tracing began (attach, an exact window
//!   opening, events lost): the frame walker's stack at attach (`running`
//!   event), and the returns that find an empty stack, innermost first. They
//!   seed each thread's stack, timed from that moment;
//! * which function (code object: file, name, first line) each event belongs
//!   to. A row is one function. An entry passes the line the frame is at, which
//!   for a resuming generator is the line it yielded at, and a return passes the
//!   line it returns from: every paired return teaches that its line belongs to
//!   the function of its entry, so later resumes there go to the same row.
//!   Returns without entry (and CPython 3.11's returns-only stream) go to the
//!   function of the same file and name with the greatest known first line not
//!   after the return's line; first lines come from entries and from the frame
//!   walker (samples, stacks).
//!
//! The second pass ([`Replay`]) rebuilds each thread's stack with that plan and
//! emits [`Step`]s: frames entering and leaving, with inclusive and exclusive
//! time, and calls counted without a frame. Recursion is recognised by code
//! object on the stack, never by name: a row's inclusive time counts each
//! outermost activation once, so it is never less than its exclusive time. Each
//! thread's clock is kept monotonic (timestamps converted from the TSC can step
//! back by a few ns), so a child always nests within its parent.
//!
//! Memory is bounded by the distinct functions and lines, the threads, the stack
//! depth cap, and the generator creations (one integer each).

mod answers;
mod cost;
mod plan;
mod rebuild;
mod steps;
pub use plan::{plan_events, Plan, Planner};
pub use rebuild::Replay;
pub use steps::{EndKind, Exit, Pairing, ReplayCounters, Step, ThreadTime, MAX_DEPTH};
