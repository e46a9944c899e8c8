//! A recording under way: opened once the engine is attached, fed every event
//! of the engine's loop, and closed with what it says at the end.

use std::cell::RefCell;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{Context, Result};

use pyprobe_cpython::python::probe_catalog::{ProbeGroup, ProbeKind};
use pyprobe_cpython::python::walker::TickStill;
use pyprobe_recording::output::file::partial_path;
use pyprobe_recording::recording::{EventKind, Header, ThinLevel};
use pyprobe_recording::stored::ViewsOutcome;
use pyprobe_sdt::process::status::cmdline;
use pyprobe_sdt::tracer::signals::{monotonic_ns, StopReason};
use pyprobe_sdt::tracer::{Engine, Hit, Outcome, TraceEvent};

use super::attaching::Attaching;
use super::codes::{FirstLines, ReturnHit};
use super::events::{EventBuilder, NamedKind};
use super::lines::{
    armed_line, budget_line, gone_frames_line, missed_ticks_line, refusal_lines, StartLine,
};
use super::periods::Periods;
use super::plan_ahead::{self, PlanAhead};
use super::request::Target;
use super::resolver::{needs_context_stacks, samples_used, Chosen, MeaningCache, Mode};
use super::return_types::write_return_types;
use super::sampler::{Sampler, Tick};
use super::settings::{default_output, recording_in, Settings};
use super::status::Status;
use crate::session::views::FlameFormat;

pub(super) struct Recorder<'a> {
    settings: Settings<'a>,
    chosen: Rc<RefCell<Chosen>>,
    builder: EventBuilder,
    sampler: Sampler,
    start: StartLine<'a>,
    /// The root process: attached to, or started.
    pid: i32,
    launched: bool,
    /// `-o` as given, or the default name.
    output: PathBuf,
    recording_path: PathBuf,
    /// A launched command gets its start line once its interpreter is found.
    announced: bool,
    /// Under a budget: calls are traced exactly now (then no sampling).
    exact_window: bool,
    /// Over budget: GC, import and audit events go without their stacks.
    thinned: bool,
    /// The first lines of returning functions, read from their code objects.
    first_lines: FirstLines,
    /// What the probes of the process that hit last stand for.
    meanings: MeaningCache,
    status: Status,
    /// While pyprobe lets go of the target and attaches again: the stacks running
    /// when each process got its probes back, written once the pause is.
    resuming: Option<Vec<(u64, super::sampler::RunningStacks)>>,
    /// Pauses so far (count, total ns), for the closing line.
    paused: (u32, u64),
    caveats: Caveats,
    /// The first pass of the view written at the end, made meanwhile.
    plan_ahead: Option<PlanAhead>,
}

/// The caveats said so far: each written to the recording, and each text said
/// again under the closing line, where a user reads the outcome.
#[derive(Default)]
struct Caveats(Vec<String>);

impl Caveats {
    fn write(&mut self, builder: &mut EventBuilder, pid: i32, ts_ns: u64, text: String) {
        builder.write_named(pid, ts_ns, &text, NamedKind::Caveat);
        if !self.0.contains(&text) {
            self.0.push(text);
        }
    }
}

impl<'a> Recorder<'a> {
    /// Opens the recording of `pid` (attached to, or `launched`), says the start
    /// line when the interpreter is known already, and writes what happened while
    /// attaching.
    pub fn start(
        mut settings: Settings<'a>,
        chosen: Rc<RefCell<Chosen>>,
        mut attaching: Attaching,
        pid: i32,
        launched: bool,
    ) -> Result<Recorder<'a>> {
        let request = settings.request;
        let output = match (&settings.periods, &request.output) {
            (Some((dir, _)), _) => recording_in(dir, pid, settings.existing)?,
            (None, Some(o)) => o.clone(),
            (None, None) => {
                settings.view = Some(FlameFormat::Svg);
                default_output(pid, settings.existing)?
            }
        };
        let recording_path = if settings.view.is_some() {
            crate::session::views::recording_beside(&output)
        } else {
            output.clone()
        };
        let header = Header {
            pid: pid as u32,
            command_line: match &request.target {
                Some(Target::Launch(command)) => command.clone(),
                _ => cmdline(pid),
            },
            mode: request.mode.name().to_owned(),
            sample_interval_ns: if settings.mode == Mode::Trace && settings.budget.is_none() {
                0
            } else {
                settings.interval_ns
            },
            start_ns: attaching.recording_start(),
            wall_start_unix_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
            ..Header::default()
        };
        let mut builder = EventBuilder::new(
            header,
            recording_path.clone(),
            settings.existing,
            std::mem::take(&mut settings.filter),
            request.start_at.clone(),
        );
        if settings.alongside {
            builder.sample_alongside(settings.interval_ns);
        }
        if let Some((dir, every_ns)) = &settings.periods {
            builder.with_periods(Periods::new(dir.clone(), *every_ns, request.samples));
        }
        let mut sampler = attaching.sampler;
        sampler.verbose = request.verbose;
        sampler.native = request.native;
        sampler.async_tasks = request.async_tasks;
        sampler.async_waiting = request.async_waiting;
        sampler.waiting_budget = super::sampler::MAX_WAITING_BUDGET.min(
            std::time::Duration::from_secs(1)
                / request.rate.max(1)
                / super::sampler::WAITING_SHARE_OF_INTERVAL,
        );
        let start = StartLine {
            mode: settings.mode,
            request,
            budget: settings.budget,
            view: settings.view.map(|_| output.clone()),
        };
        if !launched {
            builder.open(pid, &chosen.borrow());
            start.print(&chosen.borrow(), pid, &builder);
        }
        for line in attaching.lines {
            eprintln!("{line}");
        }
        for (tid, ts_ns, kind) in attaching.threads {
            builder.write(tid, ts_ns, kind);
        }
        let mut caveats = Caveats::default();
        for (pid, ts_ns, text) in attaching.caveats {
            caveats.write(&mut builder, pid, ts_ns, text);
        }
        let mut exact_window = false;
        if let Some((pid, ts_ns, exact)) = attaching.window {
            exact_window = exact;
            builder.write(pid, ts_ns, EventKind::Window { exact });
        }
        // After the window: a window starts the stacks afresh.
        if let Some((ts, stacks)) = attaching.running.take() {
            Sampler::write_running(&mut builder, ts, stacks);
        }
        let plan_ahead = (settings.view.is_some() && settings.periods.is_none())
            .then(|| PlanAhead::start(partial_path(&recording_path)))
            .flatten();
        Ok(Recorder {
            plan_ahead,
            settings,
            chosen,
            builder,
            sampler,
            start,
            pid,
            launched,
            output,
            recording_path,
            announced: false,
            exact_window,
            thinned: false,
            first_lines: FirstLines::default(),
            meanings: MeaningCache::default(),
            status: Status::new(),
            resuming: None,
            paused: (0, 0),
            caveats,
        })
    }

    /// One event of the engine's loop.
    pub fn on_event(&mut self, event: TraceEvent) {
        let verbose = self.settings.request.verbose;
        // A record drained from a ring or a hook comes in a batch that ends with
        // `RingDrained`: the clock is read and the status updated then, not per
        // record (a clock read costs as much as writing the event).
        let in_batch = match &event {
            TraceEvent::Hit(hit) => !hit.stopped,
            TraceEvent::Repeat { .. } => true,
            _ => false,
        };
        let builder = &mut self.builder;
        match event {
            TraceEvent::Hit(hit) => self.on_hit(hit),
            TraceEvent::Repeat {
                tid, ts_ns, token, ..
            } => builder.repeat(tid, ts_ns, token),
            TraceEvent::ThreadStart { pid, tid, ts_ns } => {
                builder.write(tid, ts_ns, EventKind::ThreadStart { pid: pid as u32 })
            }
            TraceEvent::ThreadExit { pid, tid, ts_ns } => {
                if tid == pid {
                    self.sampler.forget(pid);
                }
                builder.write(tid, ts_ns, EventKind::ThreadExit)
            }
            TraceEvent::ProcessStart { pid, parent, ts_ns } => {
                let parent = parent as u32;
                let command = cmdline(pid).join(" ");
                builder.write_named(pid, ts_ns, &command, NamedKind::ProcessStart { parent });
            }
            TraceEvent::Exec { pid, ts_ns } => {
                self.sampler.forget(pid);
                let command = cmdline(pid).join(" ");
                builder.write_named(pid, ts_ns, &command, NamedKind::Exec);
            }
            TraceEvent::Installed { pid, sites } if self.resuming.is_some() => {
                // Attaching again after a pause, every thread stopped: what runs now
                // is what traced calls return from (as at attach).
                if self.chosen.borrow().groups.contains(&ProbeGroup::Function) {
                    let ts = monotonic_ns();
                    let stacks = self.sampler.running(pid, ts);
                    if let Some(r) = self.resuming.as_mut() {
                        r.push((ts, stacks));
                    }
                }
                if verbose {
                    eprintln!("{}", armed_line(pid, sites));
                }
            }
            TraceEvent::Installed { pid, sites } => {
                if self.launched && !self.announced {
                    self.announced = true;
                    builder.open(pid, &self.chosen.borrow());
                    self.start.print(&self.chosen.borrow(), pid, builder);
                }
                if verbose {
                    eprintln!("{}", armed_line(pid, sites));
                }
                for line in refusal_lines(pid, &self.chosen, verbose) {
                    eprintln!("{line}");
                }
                let untold = self.chosen.borrow().resumes_untold(pid);
                if let Some(text) = untold {
                    eprintln!("pyprobe: {text}");
                    self.caveats.write(builder, pid, monotonic_ns(), text);
                }
            }
            TraceEvent::Notice(text) => eprintln!("pyprobe: {text}"),
            TraceEvent::Caveat { pid, ts_ns, text } => {
                eprintln!("pyprobe: {text}");
                self.caveats.write(builder, pid, ts_ns, text);
            }
            TraceEvent::RingDrained { pid } => self.sampler.new_naming_batch(pid),
            TraceEvent::Counted {
                pid,
                probe,
                probe_name,
                count,
                ts_ns,
            } => {
                let audit = self
                    .chosen
                    .borrow()
                    .meaning(pid, probe, probe_name)
                    .is_some_and(|m| m.kind == ProbeKind::Audit);
                if audit {
                    builder.write(pid, ts_ns, EventKind::AuditsCounted { count });
                }
            }
            TraceEvent::Thinning { pid, ts_ns, level } => {
                self.thinned = level != pyprobe_sdt::tracer::ThinLevel::Full;
                let level = match level {
                    pyprobe_sdt::tracer::ThinLevel::Full => ThinLevel::Full,
                    pyprobe_sdt::tracer::ThinLevel::Stackless => ThinLevel::Stackless,
                    pyprobe_sdt::tracer::ThinLevel::Uncounted => ThinLevel::Uncounted,
                };
                builder.write(pid, ts_ns, EventKind::Thinned { level });
            }
            TraceEvent::Summarised { short, full } => {
                eprintln!("pyprobe: {}", if verbose { full } else { short })
            }
            TraceEvent::Detail(text) => {
                if verbose {
                    eprintln!("pyprobe: {text}");
                }
            }
            TraceEvent::Lost { pid, count, ts_ns } => {
                builder.write(pid, ts_ns, EventKind::Lost { count })
            }
            TraceEvent::ReturnTypes { pid, ts_ns, rows } => {
                write_return_types(builder, pid, ts_ns, rows)
            }
            TraceEvent::Window { pid, ts_ns, exact } => {
                self.exact_window = exact;
                builder.write(pid, ts_ns, EventKind::Window { exact });
            }
            TraceEvent::Tick {
                pid,
                ts_ns,
                on_cpu,
                stopped,
                tick,
                still,
            } => self.on_tick(Tick {
                pid,
                ts_ns,
                on_cpu: &on_cpu,
                stopped,
                still: TickStill {
                    tick,
                    still: &still,
                },
            }),
            TraceEvent::TickDone { pid } => self.sampler.after_tick(pid, &mut self.builder),
            TraceEvent::Paused { .. } => {
                // What the target did before the pause is on disk before pyprobe
                // stops: should it never run again, the recording holds it.
                builder.flush_now();
                self.resuming = Some(Vec::new());
            }
            TraceEvent::Resumed { ts_ns, paused_ns } => {
                self.paused.0 += 1;
                self.paused.1 = self.paused.1.saturating_add(paused_ns);
                let at = ts_ns.saturating_sub(paused_ns);
                builder.write(self.pid, at, EventKind::Paused { ns: paused_ns });
                for (ts, stacks) in self.resuming.take().unwrap_or_default() {
                    Sampler::write_running(builder, ts, stacks);
                }
            }
        }
        if in_batch {
            return;
        }
        self.builder.rotate_periods(monotonic_ns());
        self.status.update(
            self.builder.events(),
            self.sampler.samples,
            0,
            self.builder.bytes(),
        );
    }

    /// A probe hit: its event, and before it, for a GC, an import or an audit
    /// event, the stack of the code that caused it.
    fn on_hit(&mut self, hit: Hit) {
        let Some(meaning) =
            self.meanings
                .meaning(&self.chosen.borrow(), hit.pid, hit.probe, hit.probe_name)
        else {
            return;
        };
        // Which code triggered a GC, an import or an audit event: from the walker,
        // unless every call is traced (then the rebuilt stack says it).
        let explains = meaning.kind.has_context() && {
            let now = self.chosen.borrow();
            needs_context_stacks(self.settings.mode, now.version, &now.groups, now.hook)
        };
        match hit.stack {
            // Captured by the ring trampoline, in the target, at the hit.
            Some(stack) if explains => {
                self.sampler
                    .captured(hit.pid, hit.tid, hit.ts_ns, stack, &mut self.builder)
            }
            // Held at its int3: read now, unless over budget. A ring hit without
            // stack has none.
            None if explains && hit.stopped && !self.thinned => {
                self.sampler
                    .context(hit.pid, hit.tid, hit.ts_ns, &mut self.builder)
            }
            _ => {}
        }
        // The thread was stopped before the collection or import began: it begins
        // when the thread goes on, after pyprobe's stack read.
        let opens_pause = explains && hit.stopped && meaning.kind.opens_pause();
        let ts_ns = if opens_pause {
            monotonic_ns()
        } else {
            hit.ts_ns
        };
        let (sampler, first_lines) = (&mut self.sampler, &mut self.first_lines);
        let mut name_return = |r: &ReturnHit| first_lines.of_return(r, || sampler.walker_at(r.pid));
        self.builder.hit(meaning, &hit.at(ts_ns), &mut name_return);
    }

    /// An engine tick: every thread's stack, when sampling now.
    fn on_tick(&mut self, tick: Tick) {
        let sampling = samples_used(self.settings.alongside, &self.chosen.borrow());
        if sampling && (self.announced || !self.launched) && !self.exact_window {
            let ts_ns = tick.ts_ns;
            self.sampler.sample(tick, &mut self.builder);
            self.builder.flush_if_due(ts_ns);
        }
    }

    /// Detaches (dropping `engine`), finishes the recording, says what was
    /// recorded, and writes the view `-o` named.
    pub fn finish(self, engine: Engine, outcome: Result<Outcome>) -> Result<ExitCode> {
        self.status.finish();
        let hits = engine.hits();
        let budget_summary = engine.budget_summary();
        let ticks = engine.ticks();
        drop(engine);
        let end_ns = monotonic_ns();
        let Recorder {
            settings,
            mut builder,
            sampler,
            pid,
            launched,
            output,
            recording_path,
            chosen,
            paused,
            mut caveats,
            plan_ahead,
            ..
        } = self;
        let request = settings.request;
        if let Some(periods) = builder.take_periods() {
            let summary = periods.finish(end_ns);
            if let Some((dir, every_ns)) = &settings.periods {
                eprintln!(
                    "pyprobe: wrote {} pprof profiles ({} s each) to {}{}",
                    summary.written.len(),
                    *every_ns as f64 / 1e9,
                    dir.display(),
                    match summary.failures.len() {
                        0 => String::new(),
                        n => format!("; {n} could not be written (said above)"),
                    }
                );
            }
        }
        // Kept in the recording, so that its views can say so later too. Only where
        // samples were taken: a trace's ticks that sample nothing miss nothing.
        let line = missed_ticks_line(ticks, settings.interval_ns).filter(|_| sampler.samples > 0);
        if let Some(line) = line {
            caveats.write(&mut builder, pid, end_ns, line);
        }
        let gone = gone_frames_line(
            sampler.captured_stacks,
            sampler.gone_stacks,
            sampler.gone_frames,
        );
        if let Some(line) = gone {
            caveats.write(&mut builder, pid, end_ns, line);
        }
        if sampler.unlisted_tasks {
            let line = format!(
                "--async=all: asyncio's pure-Python tasks (asyncio.tasks._PyTask) ran, and on \
                 CPython 3.14+ the waiting ones cannot be listed ({}): only their running \
                 samples are shown",
                crate::session::dump_async::PURE_PYTHON_UNLISTED
            );
            caveats.write(&mut builder, pid, end_ns, line);
        }
        let events = builder.events();
        let (opened, write_error) = builder.into_parts();
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                // The run failed: OUT is not replaced; what was recorded is kept.
                if let Some((writer, file)) = opened {
                    drop(writer);
                    if let Some(kept) = file.salvage() {
                        eprintln!(
                            "pyprobe: what was recorded before the error is in {}",
                            kept.display()
                        );
                    }
                }
                return Err(e);
            }
        };
        if settings.request.native {
            eprintln!("pyprobe: --native: {}", sampler.native_counts.summary());
        }
        if (settings.mode != Mode::Trace || sampler.ticks > 0) && sampler.samples == 0 {
            if let Some(e) = &sampler.last_error {
                eprintln!("pyprobe: no samples: {e}");
            }
        }
        let Some((writer, file)) = opened else {
            let why = write_error.map(|e| e.to_string()).unwrap_or_else(|| {
                let never = "the command never started a CPython interpreter pyprobe could read";
                match chosen.borrow().unreadable.as_deref() {
                    Some(last) => format!("{never}; the last process it looked at: {last}"),
                    None => never.into(),
                }
            });
            eprintln!("pyprobe: nothing recorded: {why}");
            return Ok(exit_code(outcome, launched, pid));
        };
        let summary = writer.finish(end_ns);
        let failure = match (write_error, &summary) {
            (Some(e), _) => Some(e.to_string()),
            (None, Err(e)) => Some(e.to_string()),
            (None, Ok(_)) => None,
        };
        if let Some(e) = failure {
            let kept = match file.salvage() {
                Some(p) => format!("What was written before reads back from {}.", p.display()),
                None => "Nothing was kept.".into(),
            };
            eprintln!(
                "pyprobe: writing {} failed ({e}); detached from the target, which runs on. {kept}",
                recording_path.display()
            );
            return Ok(ExitCode::from(1));
        }
        let summary = summary?;
        file.commit()
            .with_context(|| format!("cannot finish {}", recording_path.display()))?;
        let planned_ahead = plan_ahead.and_then(|p| p.finish(events));
        // What a sample count says of its samples stays beside it, before the hits.
        let mut samples = format!("{} samples", sampler.samples);
        if sampler.torn > 0 {
            samples.push_str(&format!(
                " ({} of them torn: read while their thread ran and changed its stack, \
                 recorded as `{}` alone)",
                sampler.torn,
                super::sampler::TORN
            ));
        }
        if sampler.waiting_cut_ticks > 0 {
            samples.push_str(&format!(
                " ({} ticks read only some of the waiting asyncio tasks, within {} tasks and \
                 {} µs a tick; the others came at the next ticks, in turn)",
                sampler.waiting_cut_ticks,
                super::sampler::MAX_WAITING_TASKS,
                sampler.waiting_budget.as_micros()
            ));
        }
        let mut what = match settings.mode {
            Mode::Trace if sampler.samples == 0 => format!("{hits} probe hits"),
            _ => format!("{samples}, {hits} probe hits"),
        };
        if summary.lost_events > 0 {
            what.push_str(&format!(
                " ({} more lost: the ring was full)",
                summary.lost_events
            ));
        }
        if paused.0 > 0 {
            what.push_str(&format!(
                "; paused {} time{} for {:.1} s in all (the target ran untraced then)",
                paused.0,
                if paused.0 == 1 { "" } else { "s" },
                paused.1 as f64 / 1e9
            ));
        }
        // As stored: events chunks are compressed on the way to the file.
        let stored = std::fs::metadata(&recording_path).map_or(summary.bytes, |m| m.len());
        eprintln!(
            "pyprobe: {what}, {events} events written to {} ({} bytes){}",
            recording_path.display(),
            stored,
            match outcome {
                Outcome::Detached(StopReason::Duration) =>
                    "; duration reached, detached".to_string(),
                Outcome::Detached(StopReason::Signal(s)) => format!("; {s} received, detached"),
                Outcome::Detached(StopReason::Internal) => "; detached".to_string(),
                Outcome::Exited(code) => format!("; target exited with status {code}"),
                Outcome::Killed(sig) => format!("; target killed by {sig}"),
            }
        );
        for text in &caveats.0 {
            eprintln!("pyprobe: caveat: {text}");
        }
        if sampler.verbose && sampler.samples > 0 {
            eprintln!(
                "pyprobe: {} of the {} samples were of threads that had not run since an \
                 earlier tick: their stacks were not read again",
                sampler.kept, sampler.samples
            );
        }
        if request.async_waiting && sampler.samples > 0 {
            eprintln!(
                "pyprobe: note: the waiting asyncio tasks are off-CPU samples: report, flame and \
                 top --from show them with --idle"
            );
        }
        if let (Some(max), Some(b)) = (settings.budget, budget_summary) {
            // Said when the budget changed what was recorded or how samples were
            // taken, or was exceeded.
            let acted = b.traced_functions
                || b.exact_fraction < 1.0
                || b.samples_unblocked
                || b.slowdown > max;
            if acted || request.verbose {
                eprintln!("pyprobe: {}", budget_line(max, &b));
            }
        }
        if request.verbose {
            let view_ns = planned_ahead.as_ref().map_or(0, |a| a.cpu_ns);
            eprintln!("pyprobe: {}", own_cpu_line(events, view_ns));
        }
        if settings.view.is_some() {
            let taken_before = pyprobe_recording::analyze::planned_ahead::times_taken();
            let views_taken_before = pyprobe_recording::stored::ahead::times_taken();
            let written = write_view(&recording_path, &output, &settings);
            if let (Some(ahead), true) = (planned_ahead, request.verbose) {
                let taken = pyprobe_recording::analyze::planned_ahead::times_taken();
                let views_taken = pyprobe_recording::stored::ahead::times_taken();
                let views_taken = views_taken > views_taken_before;
                eprintln!(
                    "pyprobe: the view's first pass over the {} events was made while \
                     they were written ({} of them read after the recording ended){}",
                    ahead.events,
                    ahead.planned_late,
                    match (taken > taken_before, views_taken) {
                        (true, _) => ", and the view took it",
                        (false, true) => "",
                        (false, false) => ", but the view did not take it",
                    }
                );
                if let Some(line) = views_ahead_line(&ahead, views_taken) {
                    eprintln!("pyprobe: {line}");
                }
            }
            match written {
                // The flame graph was pyprobe's choice, not the user's: the
                // recording is what matters, and it is written.
                Err(e) if settings.request.output.is_none() => eprintln!(
                    "pyprobe: no flame graph: {}; the recording is {}",
                    e.root_cause(),
                    recording_path.display()
                ),
                other => other?,
            }
        }
        Ok(exit_code(outcome, launched, pid))
    }
}

/// What became of the views replayed while the recording was written, for `-v`.
fn views_ahead_line(ahead: &plan_ahead::Ahead, taken: bool) -> Option<String> {
    let said = match ahead.views.as_ref()? {
        ViewsOutcome::Kept { late } => format!(
            "its replay was made while they were written too ({late} events replayed after \
             the recording ended){}",
            if taken {
                ", and the view took it"
            } else {
                ", but the view did not take it"
            }
        ),
        ViewsOutcome::Refuted => "its replay made while they were written was dropped: the plan \
                             of the whole recording answered otherwise than the plans made \
                             on the way"
            .into(),
        ViewsOutcome::Unread => "its replay made while they were written was dropped: the \
                            recording could not be read to its end"
            .into(),
        ViewsOutcome::Unplanned => "its replay made while they were written was dropped: after \
                               the recording ended, its first pass could not plan for long (a \
                               process whose cost per event was still being measured)"
            .into(),
    };
    Some(said)
}

/// The view `-o` named, beside which the recording stays, so other views can be
/// made later.
fn write_view(
    recording_path: &std::path::Path,
    output: &std::path::Path,
    settings: &Settings,
) -> Result<()> {
    // --async=all's waiting tasks are off-CPU samples: its view is the
    // wall-clock one, where they show.
    let samples = pyprobe_recording::analyze::SampleFilter {
        idle: settings.request.samples.idle || settings.request.async_waiting,
        ..settings.request.samples
    };
    crate::session::views::write_view_for_extension(
        recording_path,
        output,
        samples,
        settings.existing,
    )
    .with_context(|| format!("cannot write {}", output.display()))?;
    let open = match settings.view {
        Some(FlameFormat::Svg) => ": open it in a web browser",
        Some(FlameFormat::Speedscope) => ": open it at https://www.speedscope.app",
        _ => "",
    };
    eprintln!(
        "pyprobe: wrote {}{open} (the recording, for report, flame and top --from, is {})",
        output.display(),
        recording_path.display()
    );
    Ok(())
}

/// `record -- CMD` exits with the command's status; a detached command is waited for.
fn exit_code(outcome: Outcome, launched: bool, pid: i32) -> ExitCode {
    if !launched {
        return ExitCode::SUCCESS;
    }
    let status = match outcome {
        Outcome::Exited(code) => code,
        Outcome::Killed(sig) => 128 + sig as i32,
        Outcome::Detached(_) => wait_for_child(pid),
    };
    ExitCode::from(status.clamp(0, 255) as u8)
}

fn wait_for_child(pid: i32) -> i32 {
    use nix::sys::wait::{waitpid, WaitStatus};
    loop {
        match waitpid(nix::unistd::Pid::from_raw(pid), None) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return 1,
        }
    }
}

/// What pyprobe's own threads took of the machine while recording (`-v`): its
/// CPU time, and per event written. The target's is not in it, and the view's
/// passes (`view_ns`: made while the events were written, then the rest) are
/// told apart.
fn own_cpu_line(events: u64, view_ns: u64) -> String {
    let cpu_ns = pyprobe_sdt::tracer::clock::process_cpu_ns().saturating_sub(view_ns);
    let per_event = match events {
        0 => String::new(),
        n => format!(", {} ns per event written", cpu_ns / n),
    };
    let view = match view_ns {
        0 => String::new(),
        n => format!(
            "; {:.2} s more on the view's passes (on idle CPU while the events were \
             written, then the rest)",
            n as f64 / 1e9
        ),
    };
    format!(
        "pyprobe itself used {:.2} s of CPU (attach and recording, all its threads){per_event}{view}",
        cpu_ns as f64 / 1e9
    )
}
