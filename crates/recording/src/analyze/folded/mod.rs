//! Folded stacks: every stack a recording shows, merged into one tree, with the
//! exclusive time, the calls and the samples of each stack.
//!
//! Trace mode: each thread's stack comes from the shared [`Replay`], the one the
//! report uses, so per function the flame graph's own time is the report's
//! exclusive time and its calls the report's calls. A frame's exclusive time
//! goes to the stack it ran on. A GC pause becomes a `[gc]` frame on top of the stack that
//! triggered it, its time taken out of that frame's own time; Python code run by
//! the collector (finalizers) goes under the `[gc]` frame.
//!
//! Sample mode: each sample adds one to the stack it shows.
//!
//! Memory is bounded by the number of distinct stacks (plus the per-thread depth
//! cap), never by the number of events: a stack is a node of a tree, interned by
//! (parent, frame).

mod folder;
mod tree;

pub use folder::{fold_events, Folder};
pub use tree::{FoldCounts, FoldFrame, Folded, Measure, NodeId, StackTree};

#[cfg(test)]
mod tests;
