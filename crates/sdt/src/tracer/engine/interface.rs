//! What the engine is told (the probes to trace, its options) and what it tells
//! its caller (hits and the other trace events, how the run ended).

use anyhow::Result;
use nix::sys::signal::Signal;

use crate::probe_set::ProbeSet;
use crate::ring::{Token, KEY_ARGS};
use crate::tracer::decode::HitBuffers;
use crate::tracer::ring_engine::RingUse;
use crate::tracer::signals::StopReason;

use super::pausing::PauseCause;

/// Finds the probes to trace in a process image, once the object carrying them is
/// fully mapped. `Ok(None)`: not (yet) there.
pub trait Resolver {
    fn resolve(&mut self, pid: i32) -> Result<Option<ProbeSet>>;

    /// What serves the probe sets that ask for events beside their probes
    /// ([`ProbeSet::hook`]); asked once, when the engine starts.
    fn event_source(&mut self) -> Option<Box<dyn super::source::EventSource>> {
        None
    }

    /// Whether the stacks of a tick that does not stop `pid` are read: where they
    /// are not, the tick reads no thread's state either (in a process with 10,000
    /// threads that took 60 ms of every tick, and the rings went unread meanwhile).
    fn samples_used(&self, _pid: i32) -> bool {
        true
    }
}

/// How the budgeted probes' events (GC, import and audit: those with stacks) are
/// taken while over the overhead budget, from whole to none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ThinLevel {
    /// Each with the stack the ring captured.
    Full,
    /// Without their stacks; those counted in the target only counted.
    Stackless,
    /// As `Stackless`, and the counted ones not even counted (their probe off).
    Uncounted,
}

/// One probe hit, decoded.
#[derive(Debug)]
pub struct Hit<'a> {
    pub pid: i32,
    pub tid: i32,
    pub ts_ns: u64,
    pub probe: usize,
    pub probe_name: &'a str,
    pub args: &'a [u64],
    pub(in crate::tracer) buffers: &'a HitBuffers,
    /// The thread's stack as the ring trampoline captured it (stack probes served
    /// by the ring); `None` at an `int3` stop, where the caller can read it itself.
    pub stack: Option<&'a crate::ring::consumer::RingStack>,
    /// The thread is held at an `int3` stop for this hit (else the hit came
    /// through a ring, and the thread has gone on).
    pub stopped: bool,
    /// Where the sink says what the hit's event is for good (a ring record that
    /// could be kept; see [`repeats_as`](Self::repeats_as)).
    pub(in crate::tracer) repeat: Option<&'a RepeatSlot>,
}

/// The token a sink gives a hit whose event any equal record would have too.
#[derive(Debug, Default)]
pub struct RepeatSlot(std::cell::Cell<Option<Token>>);

impl RepeatSlot {
    pub fn token(&self) -> Option<u32> {
        self.0.get().map(|t| t.token)
    }

    /// The token with how many first arguments an equal record must share.
    pub(in crate::tracer) fn kept(&self) -> Option<Token> {
        self.0.get()
    }
}

impl<'a> Hit<'a> {
    /// A hit from an [`EventSource`](super::source::EventSource) (the thread has
    /// gone on): `(pid, tid, ts_ns)`, `(probe, probe_name)`, its arguments and
    /// strings in `buffers`, and where the sink says whether equal records repeat
    /// it.
    pub fn from_source(
        (pid, tid, ts_ns): (i32, i32, u64),
        (probe, probe_name): (usize, &'a str),
        buffers: &'a HitBuffers,
        repeat: &'a RepeatSlot,
    ) -> Hit<'a> {
        Hit {
            pid,
            tid,
            ts_ns,
            probe,
            probe_name,
            args: &buffers.args,
            buffers,
            stack: None,
            stopped: false,
            repeat: Some(repeat),
        }
    }

    /// The same hit, stamped at `ts_ns`.
    pub fn at(&self, ts_ns: u64) -> Hit<'a> {
        Hit {
            pid: self.pid,
            tid: self.tid,
            ts_ns,
            probe: self.probe,
            probe_name: self.probe_name,
            args: self.args,
            buffers: self.buffers,
            stack: self.stack,
            stopped: self.stopped,
            repeat: self.repeat,
        }
    }

    /// Whether a record equal to this hit's may come again as
    /// [`TraceEvent::Repeat`] once the sink gives the hit a token.
    pub fn may_repeat(&self) -> bool {
        self.repeat.is_some()
    }

    /// Says that the event of this hit is the event of any record equal to it
    /// (from a ring: same probe, tag, first three arguments and strings, later
    /// arguments, thread and time aside; from a hook: the same frame entered or
    /// left), and names it `token`: such records come as [`TraceEvent::Repeat`]
    /// with that token from now on. Only for events those later arguments
    /// cannot change.
    pub fn repeats_as(&self, token: u32) {
        self.repeats_as_keyed(token, KEY_ARGS);
    }

    /// As [`repeats_as`](Self::repeats_as), for an event the first `key_args`
    /// arguments name (more than three: a later one changes it, as an entry's
    /// `f_lasti` makes it a resume): an equal record has those too.
    pub fn repeats_as_keyed(&self, token: u32, key_args: usize) {
        if let Some(slot) = self.repeat {
            slot.0.set(Some(Token {
                token,
                key_args: key_args.max(KEY_ARGS),
            }));
        }
    }

    /// String argument `i`: the text read at its pointer (bounded), if it is a
    /// string argument and could be read.
    pub fn string(&self, i: usize) -> Option<&str> {
        self.buffers.string(i)
    }

    /// Equal for two hits exactly when their string arguments are the same (see
    /// [`HitBuffers::stamp`]); 0 never matches.
    pub fn strings_stamp(&self) -> u64 {
        self.buffers.stamp()
    }
}

/// A resolver's "this process cannot be traced as asked", found when the object
/// with its probes is mapped: a launched command ends there, before it runs.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotTraceable(pub String);

/// What the engine reports, in order.
#[derive(Debug)]
pub enum TraceEvent<'a> {
    Hit(Hit<'a>),
    /// A ring record equal to an earlier hit the sink named `token` (see
    /// [`Hit::repeats_as`]): the same event, on thread `tid` at `ts_ns`.
    Repeat {
        pid: i32,
        tid: i32,
        ts_ns: u64,
        token: u32,
    },
    /// Probes were installed in `pid` (at attach, after start-up or after an exec).
    Installed {
        pid: i32,
        sites: usize,
    },
    ThreadStart {
        pid: i32,
        tid: i32,
        ts_ns: u64,
    },
    ThreadExit {
        pid: i32,
        tid: i32,
        ts_ns: u64,
    },
    /// A forked child of traced process `parent` is traced (`--subprocesses`): a
    /// process of its own, its leader `pid` its first thread.
    ProcessStart {
        pid: i32,
        parent: i32,
        ts_ns: u64,
    },
    /// Process `pid` ran `execve`: a new program (its command line is new), the old
    /// image and every thread but the leader gone.
    Exec {
        pid: i32,
        ts_ns: u64,
    },
    /// Something the user should know (a child cleaned, a signal, a fallback ...).
    Notice(String),
    /// The trace of `pid` is incomplete from `ts_ns` on, or its counts cannot be
    /// trusted, for the reason `text` says: kept in the recording, not only said.
    Caveat {
        pid: i32,
        ts_ns: u64,
        text: String,
    },
    /// Over the overhead budget, GC, import and audit events go as `level` says
    /// until further notice: thinned, the sink must not read stacks at stops.
    Thinning {
        pid: i32,
        ts_ns: u64,
        level: ThinLevel,
    },
    /// `count` hits of probe `probe` of `pid` were counted in the target instead of
    /// recorded (thinned to stay within the overhead budget): no arguments, no stack.
    Counted {
        pid: i32,
        probe: usize,
        probe_name: &'a str,
        count: u64,
        ts_ns: u64,
    },
    /// One drain of `pid`'s ring is over: the hits it gave came before.
    RingDrained {
        pid: i32,
    },
    /// A site-level fact for whoever asks for details (`record -v`): how many
    /// sites went to the ring, which stay on int3 and why.
    Detail(String),
    /// A notice in two lengths: `short` says what changes for the user (e.g. how
    /// many sites are not traced), `full` also names each site and why (`-v`).
    Summarised {
        short: String,
        full: String,
    },
    /// `count` probe hits of `pid` were dropped (its ring was full).
    Lost {
        pid: i32,
        count: u64,
        ts_ns: u64,
    },
    /// pyprobe let go of every traced process (see [`PauseCause`]): nothing of
    /// what they do is seen until [`TraceEvent::Resumed`].
    Paused {
        ts_ns: u64,
        cause: PauseCause,
    },
    /// pyprobe attached again after a pause of `paused_ns`: stacks are read anew.
    Resumed {
        ts_ns: u64,
        paused_ns: u64,
    },
    /// Time to take a sample of process `pid`; `stopped`: every thread is held in a
    /// ptrace-stop until the sink returns. `on_cpu`: whether each of its threads was on
    /// a CPU, read from the kernel before anything was stopped (a thread missing was
    /// not readable). `tick`: this tick's number, counted up from 1. `still`: the
    /// threads (tid, tick) that have not run since the look of that earlier tick,
    /// sorted: their stacks are those read at any tick since.
    Tick {
        pid: i32,
        ts_ns: u64,
        stopped: bool,
        on_cpu: Vec<(i32, bool)>,
        tick: u64,
        still: Vec<(i32, u64)>,
    },
    /// The threads of process `pid`, held for its [`TraceEvent::Tick`], run again:
    /// what a sample may read with them running (asyncio's waiting tasks) is
    /// read now, off the target's time.
    TickDone {
        pid: i32,
    },
    /// The overhead budget turned the budgeted probes on (`exact`) or off, in every
    /// traced process.
    Window {
        pid: i32,
        ts_ns: u64,
        exact: bool,
    },
    /// Running totals of what functions of `pid` returned, by type (the hook
    /// engine's), for the rows that changed since the last such event: now and
    /// then, and at the end.
    ReturnTypes {
        pid: i32,
        ts_ns: u64,
        rows: &'a [ReturnRow],
    },
}

/// How often one function returned objects of one type, so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReturnRow {
    pub file: std::sync::Arc<str>,
    /// As the function's entries name it.
    pub function: std::sync::Arc<str>,
    pub first_line: u32,
    /// The type's name; `None`: frames left by an exception.
    pub returned: Option<std::sync::Arc<str>>,
    pub total: u64,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct EngineOptions {
    /// Trace forked children too (else they are cleaned and released).
    pub subprocesses: bool,
    /// Emit a [`TraceEvent::Tick`] about every this many ns, uniformly jittered by
    /// ±50 % so that a periodic target cannot fall into lock-step with sampling.
    pub sample_interval_ns: Option<u64>,
    /// Stop every thread during a tick (consistent stacks) instead of reading them
    /// while they run.
    pub blocking_samples: bool,
    /// Never give up stopping for samples, whatever they cost (`--native`: native
    /// stacks are read from stopped threads only).
    pub keep_sample_stops: bool,
    /// Start a guardian process that undoes the patches if pyprobe is killed.
    pub guardian: bool,
    /// Slowdown allowed (0.05 for 5 %): above it the budgeted probes go off for a
    /// while (see `budget`). Ticks should be on to sample meanwhile.
    pub max_overhead: Option<f64>,
    /// Whether qualifying sites move to the ring engine (trampolines, no stop).
    pub ring: RingUse,
}

/// How the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The target process exited with this code.
    Exited(i32),
    /// The target was killed by this signal.
    Killed(Signal),
    /// pyprobe left before the target ended; the target runs on.
    Detached(StopReason),
}
