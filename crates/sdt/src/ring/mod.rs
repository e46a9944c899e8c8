//! Probe sites that write to a shared ring instead of stopping the target.
//!
//! The int3 engine stops the target at every probe hit. The ring engine
//! rewrites a probe site (a 1-byte `nop`) into a `jmp rel32` to a trampoline
//! injected into the target; the trampoline appends a record to a ring
//! buffer shared with pyprobe (a memfd mapped in both processes) and
//! continues, without a system call or a context switch.
//!
//! This module is the pure core, testable in-process:
//!
//! * [`format`]: the ring's shared-memory format and producer protocol;
//! * [`consumer`]: [`RingReader`], which validates and drains a ring;
//! * [`branches`]: [`BranchTargets`], direct branch targets of a segment;
//! * [`site`]: [`qualify_site`], whether and how a site can be patched;
//! * [`codegen`]: [`build_trampoline`], the trampoline's machine code and the site patch;
//! * [`stack`]: [`StackCapture`], the Python stack walked by a trampoline;
//! * [`region`]: [`RegionHeader`], the header of a trampoline region, which
//!   lets a later pyprobe recognise and undo the jumps of one that died.
//!
//! Injecting the trampolines, mapping the ring and patching sites through
//! ptrace is the engine's job. What it must hold to:
//!
//! * **Placement.** A trampoline must lie within ±2 GiB of its site (the
//!   patch is a `jmp rel32`) and of every rip-relative operand it displaces
//!   (`build_trampoline` fails otherwise): map its page next to the object's
//!   text. Trampolines are 200-400 bytes; pack several per page, 16-byte
//!   aligned, after building each at its final address (the code is
//!   position-dependent). The tag word (`tag_addr`, 4 bytes) must be in a
//!   private mapping (a fork gives the child its own copy: write the child's
//!   pid there before it runs) and outside the code.
//! * **Ring.** A memfd mapped `MAP_SHARED` in both processes, formatted with
//!   [`init_ring`] (or [`init_zeroed_ring`] on a new memfd) before the target can see it; `ring_addr` is its address
//!   in the target.
//! * **Patching.** With every thread stopped: re-read the site and check it
//!   still equals [`SitePlan::original`]; refuse if any thread's rip is
//!   strictly inside the replaced bytes ([`thread_inside`]) or two plans
//!   overlap ([`plans_overlap`]); then write [`Trampoline::patch`] (as long
//!   as the plan, not just 5 bytes).
//! * **Restoring.** With every thread stopped, check the site holds the
//!   patch, write the original bytes back. Threads already inside a
//!   trampoline ([`Trampoline::contains`]) finish it and jump back to
//!   `site + len`, an instruction boundary of the original code, so restoring
//!   under them is safe; unmapping is not. A thread *entering* the site
//!   while it is rewritten is not safe whatever the order of the writes: the
//!   jump's displacement is bytes 1-4, so rewriting them under the `0xe9`
//!   sends it to a torn address, and changing the first byte first (to the
//!   `nop`, or an `int3` whose handler resumes at `site + 1`) runs the
//!   displacement as code. Hence every thread stopped, for any rewrite.
//! * **Header.** A region starts on a page with a [`RegionHeader`] listing
//!   each site it serves and the original bytes, so a pyprobe that finds a
//!   jump left at a site by one that died can check it is pyprobe's and undo
//!   it. Write it before the first site jumps to the region. A thread interrupted by a signal
//!   inside a trampoline keeps that rip in its signal frame, where ptrace
//!   does not show it: unless that can be ruled out, leave trampoline pages
//!   and the ring mapped in the target after detaching. Attaching again may
//!   use them again, never changing a byte of a trampoline a thread may have
//!   entered (`tracer::ring_engine::reuse`).
//! * **Python stacks.** A trampoline built with a [`StackCapture`] reads its own
//!   thread's state where the interpreter keeps it (a thread-local, or the GIL
//!   holder's global checked against `pthread_self()`) and walks that thread's
//!   own frame chain (NULL-checked, bounded; see [`stack`]): give it only the
//!   offsets of the layout the frame walker uses for this very interpreter, and
//!   only for probes that fire with the GIL held (GC, import, audit). It never
//!   reads another thread's state, which that thread could free meanwhile.
//! * **Stack.** A trampoline uses 80 bytes below the red zone (208 bytes
//!   below the site's rsp), and dereferences memory operands and string
//!   pointers directly: a bad pointer faults the target, where the int3
//!   engine would only fail a read.

pub(crate) mod branches;
pub mod codegen;
pub(crate) mod consumer;
pub mod format;
pub mod lost;
pub(crate) mod region;
pub(crate) mod site;
pub mod stack;

#[cfg(test)]
mod tests_exec;
#[cfg(test)]
mod tests_site;

pub use branches::BranchTargets;
pub use codegen::{
    build_trampoline, CodegenError, FlagSave, ThreadIdSource, Trampoline, TrampolineParams,
};
pub use consumer::{
    DrainStop, Drained, Drawn, FixedRecord, KnownRecord, KnownRecords, Plain, RingReader,
    RingRecord, RingStack, RingString, Token, KEY_ARGS,
};
pub use format::{init_ring, init_zeroed_ring, ring_bytes, RingError, Slots};
pub use lost::{LostCounter, LostReading};
pub use region::{RegionError, RegionHeader, RegionSite};
pub use site::{plans_overlap, qualify_site, thread_inside, SitePlan, SiteRefusal, Tail};
pub use stack::{CurrentThreadState, StackCapture, StackFrame, StackRoot};
