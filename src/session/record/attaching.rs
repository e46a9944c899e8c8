//! What the engine reports while attaching or starting, before the recording
//! exists: kept, to be said and written once it does.

use std::cell::RefCell;
use std::rc::Rc;

use pyprobe_cpython::python::probe_catalog::ProbeGroup;
use pyprobe_recording::recording::EventKind;
use pyprobe_sdt::tracer::signals::monotonic_ns;
use pyprobe_sdt::tracer::TraceEvent;

use super::lines::{armed_line, refusal_lines};
use super::resolver::Chosen;
use super::sampler::{RunningStacks, Sampler};

/// The events and lines of the attach, in order.
pub(super) struct Attaching {
    /// The process attached to (`-p`), not a started command.
    attached: Option<i32>,
    chosen: Rc<RefCell<Chosen>>,
    verbose: bool,
    pub sampler: Sampler,
    /// Lines for stderr, said once the start line is.
    pub lines: Vec<String>,
    /// A budget's first window opens while attaching, before the recording does.
    pub window: Option<(i32, u64, bool)>,
    /// The stacks running when the probes went in at attach (every thread is
    /// stopped then): frames whose entries the recording will never see.
    pub running: Option<(u64, RunningStacks)>,
    /// Threads that started or ended while attaching.
    pub threads: Vec<(i32, u64, EventKind)>,
    /// Caveats said while attaching: (process, time, text).
    pub caveats: Vec<(i32, u64, String)>,
}

impl Attaching {
    pub fn new(attached: Option<i32>, chosen: Rc<RefCell<Chosen>>, verbose: bool) -> Attaching {
        let mut sampler = Sampler::default();
        if let Some(pid) = attached {
            sampler.prepare(pid);
        }
        Attaching {
            attached,
            chosen,
            verbose,
            sampler,
            lines: Vec::new(),
            window: None,
            running: None,
            threads: Vec::new(),
            caveats: Vec::new(),
        }
    }

    pub fn collect(&mut self, e: TraceEvent) {
        match e {
            TraceEvent::Window { pid, ts_ns, exact } => self.window = Some((pid, ts_ns, exact)),
            TraceEvent::Installed { pid, sites } => {
                if self.attached == Some(pid)
                    && self.running.is_none()
                    && self.chosen.borrow().groups.contains(&ProbeGroup::Function)
                {
                    let ts = monotonic_ns();
                    self.running = Some((ts, self.sampler.running(pid, ts)));
                }
                if self.verbose {
                    self.lines.push(armed_line(pid, sites));
                }
                self.lines
                    .extend(refusal_lines(pid, &self.chosen, self.verbose));
            }
            TraceEvent::ThreadStart { pid, tid, ts_ns } => {
                self.threads
                    .push((tid, ts_ns, EventKind::ThreadStart { pid: pid as u32 }))
            }
            TraceEvent::ThreadExit { tid, ts_ns, .. } => {
                self.threads.push((tid, ts_ns, EventKind::ThreadExit))
            }
            TraceEvent::Notice(text) => self.lines.push(format!("pyprobe: {text}")),
            TraceEvent::Caveat { pid, ts_ns, text } => {
                self.lines.push(format!("pyprobe: {text}"));
                self.caveats.push((pid, ts_ns, text));
            }
            TraceEvent::Summarised { short, full } => self.lines.push(format!(
                "pyprobe: {}",
                if self.verbose { full } else { short }
            )),
            TraceEvent::Detail(text) if self.verbose => self.lines.push(format!("pyprobe: {text}")),
            // Nothing is hit, sampled or lost before the probes are in and the
            // target runs again.
            TraceEvent::Detail(_)
            | TraceEvent::Hit(_)
            | TraceEvent::Repeat { .. }
            | TraceEvent::Lost { .. }
            | TraceEvent::Counted { .. }
            | TraceEvent::RingDrained { .. }
            | TraceEvent::Thinning { .. }
            | TraceEvent::ProcessStart { .. }
            | TraceEvent::Exec { .. }
            | TraceEvent::Tick { .. }
            | TraceEvent::TickDone { .. }
            | TraceEvent::ReturnTypes { .. }
            // Pauses are made by the event loop, once the recording is open.
            | TraceEvent::Paused { .. }
            | TraceEvent::Resumed { .. } => {}
        }
    }

    /// When the recording starts: when the probes went in at attach (the stacks
    /// read then are running from that moment; a budget's first window opens then
    /// too), else now.
    pub fn recording_start(&mut self) -> u64 {
        let now = monotonic_ns();
        match (self.running.as_mut(), self.window) {
            (Some((ts, _)), Some((_, window, _))) => {
                // Tracing began with the window; the stacks were read just before.
                *ts = window.max(*ts);
                *ts
            }
            (Some((ts, _)), None) => *ts,
            (None, _) => now,
        }
    }
}
