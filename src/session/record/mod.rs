//! `pyprobe record`: attach to or start a CPython process, trace its probes through
//! the ptrace engine, and stream the events into a recording.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{bail, Context, Result};

use crate::analyze::{FileFilter, SampleFilter};
use crate::output::file::{check, check_recording, first_free, numbered, Existing, Stdout};
use crate::process::objects::{find_probe_object, sdt_objects};
use crate::process::status::{check_inspectable, cmdline};
use crate::session::views::{extension, is_fifo, FlameFormat};

use crate::python::probes::{ProbeGroup, PROVIDER};
use crate::python::tracing::parse_groups;
use crate::python::walker::find_interpreter_object;
use crate::record::{EventKind, Header, ThinLevel};
use crate::tracer::signals::{self, monotonic_ns, StopReason};
use crate::tracer::{Engine, EngineOptions, Outcome, RingUse, TraceEvent};

use events::{EventBuilder, NamedKind};
use resolver::{needs_context_stacks, returns_only, Chosen, Mode, PythonResolver, CONTEXT_PROBES};
use sampler::Sampler;

/// Probes whose event opens a pause that a later probe closes.
const OPENING_PROBES: [&str; 2] = ["gc__start", "import__find__load__start"];

/// What `pyprobe record` was asked to do (the CLI maps its flags onto this).
#[derive(Debug, Clone, Default)]
pub struct RecordRequest {
    pub pid: Option<i32>,
    pub command: Vec<String>,
    pub output: Option<PathBuf>,
    /// Replace existing outputs (`--force`).
    pub force: bool,
    /// Say the site-level details at start (`-v`).
    pub verbose: bool,
    pub duration: Option<f64>,
    pub mode: String,
    pub probes: Vec<String>,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    pub start_at: Option<String>,
    pub subprocesses: bool,
    /// Sampling rate in Hz (modes auto and sample).
    pub rate: u32,
    /// Sample without stopping the threads.
    pub nonblocking: bool,
    /// `--max-overhead` as given, in percent (`None`: the default for the mode).
    pub max_overhead: Option<f64>,
    /// `--engine`: whether probe sites move to the ring (no stop per hit).
    pub ring: RingUse,
    /// Which samples a view written directly (`-o x.svg`) counts.
    pub samples: SampleFilter,
}

/// The default overhead budget, in percent, where one applies.
const DEFAULT_MAX_OVERHEAD: f64 = 5.0;

/// The slowdown allowed (fraction), from `--max-overhead` and the default: 5 % in
/// auto mode, where nothing asked for is exact but what the budget allows.
fn overhead_budget(request: &RecordRequest, mode: Mode) -> Result<Option<f64>> {
    match request.max_overhead {
        Some(p) if !(0.0..=10_000.0).contains(&p) => {
            bail!("--max-overhead must be a percentage between 0 and 10000 (got {p})")
        }
        Some(0.0) => Ok(None),
        Some(_) if mode == Mode::Sample => bail!(
            "--max-overhead limits probes, and `--mode sample` uses none: lower -r/--rate instead"
        ),
        Some(p) => Ok(Some(p / 100.0)),
        None if mode == Mode::Auto => Ok(Some(DEFAULT_MAX_OVERHEAD / 100.0)),
        None => Ok(None),
    }
}

mod events;
mod resolver;
mod sampler;
mod status;

/// The closing line of an overhead budget: what it cost the target, and what it
/// left out to hold.
fn budget_line(max: f64, b: &crate::tracer::BudgetSummary) -> String {
    let sampled = if b.blocking_samples == 0 {
        String::new()
    } else {
        format!(
            "; {} samples stopped it, {} µs each on average{}",
            b.blocking_samples,
            b.sample_mean_ns / 1000,
            if b.samples_unblocked {
                ", then sampling went on without stopping it"
            } else {
                ""
            }
        )
    };
    let held = if b.slowdown <= max {
        "held"
    } else {
        "exceeded"
    };
    let kept = if b.traced_functions {
        format!(
            "calls traced exactly {:.1}% of the time, in {} window{}, sampled in between",
            b.exact_fraction * 100.0,
            b.windows,
            if b.windows == 1 { "" } else { "s" }
        )
    } else {
        format!(
            "stacks of GC, import and audit events recorded {:.1}% of the time",
            b.exact_fraction * 100.0
        )
    };
    let setup = if b.setup_ns > 0 {
        format!(
            " (and {:.1} ms once, to set up the ring)",
            b.setup_ns as f64 / 1e6
        )
    } else {
        String::new()
    };
    format!(
        "overhead budget {}% {held}: the target was stopped for pyprobe {:.2}% of its run \
         time{setup}; {kept}{sampled}",
        max * 100.0,
        b.slowdown * 100.0
    )
}

/// The recording's default name: `pyprobe-PID.pyprobe`, or with `--force` not
/// given and that taken, the first free `pyprobe-PID.N.pyprobe`.
fn default_output(pid: i32, existing: Existing) -> Result<PathBuf> {
    let base = PathBuf::from(format!("pyprobe-{pid}.pyprobe"));
    match existing {
        Existing::Replace => Ok(base),
        Existing::Keep => first_free(|n| numbered(&base, ".pyprobe", n), true)
            .context("cannot find a free name for the recording"),
    }
}

fn parse_mode(mode: &str) -> Result<Mode> {
    Ok(match mode {
        "auto" => Mode::Auto,
        "trace" => Mode::Trace,
        "sample" => Mode::Sample,
        other => bail!("unknown mode `{other}` (auto, trace or sample)"),
    })
}

/// Refuses, with one clear sentence, a process this mode cannot record.
fn check_attachable(pid: i32, mode: Mode) -> Result<()> {
    check_inspectable(pid)?;
    if pid == std::process::id() as i32 {
        bail!("pyprobe cannot trace itself (pid {pid})");
    }
    if mode == Mode::Trace && find_probe_object(pid, PROVIDER).is_err() {
        check_inspectable(pid)?; // it may have exited meanwhile: say so, not "no probes"
        let others = sdt_objects(pid, None)
            .map(|o| !o.is_empty())
            .unwrap_or(false);
        bail!(
            "process {pid} has no CPython SDT probes{}: it is not a CPython built with --with-dtrace, \
             so `--mode trace` cannot work; `--mode sample` reads its stacks instead",
            if others { " (it has other SDT providers)" } else { "" }
        );
    }
    if mode != Mode::Trace {
        find_interpreter_object(pid).with_context(|| format!("process {pid} cannot be sampled"))?;
    }
    Ok(())
}

pub fn run(request: &RecordRequest) -> Result<ExitCode> {
    let mode = parse_mode(&request.mode)?;
    if request.rate == 0 || request.rate > 10_000 {
        bail!(
            "-r/--rate must be between 1 and 10000 Hz (got {})",
            request.rate
        );
    }
    let filter =
        FileFilter::new(&request.include, &request.exclude).map_err(|e| anyhow::anyhow!("{e}"))?;
    let requested = if request.probes.is_empty() {
        None
    } else {
        Some(parse_groups(&request.probes)?)
    };
    if mode == Mode::Sample && requested.is_some() {
        bail!("`--probes` needs probes: use it with `--mode trace` or `--mode auto`");
    }
    let budget = overhead_budget(request, mode)?;
    let existing = if request.force {
        Existing::Replace
    } else {
        Existing::Keep
    };
    let view = match &request.output {
        // Before anything is attached or started.
        Some(output) => check_outputs(output, existing)?,
        None => None,
    };
    if request.samples != SampleFilter::default() && view.is_none() {
        eprintln!(
            "pyprobe: note: --idle and --gil choose the samples a view counts (-o x.svg, .json, \
             .txt); a recording keeps every sample with its thread's state, for report, flame \
             and top --from to filter"
        );
    }
    let chosen = Rc::new(RefCell::new(Chosen::default()));
    let resolver = Box::new(PythonResolver {
        mode,
        capture_stacks: request.ring != RingUse::Off,
        requested,
        chosen: chosen.clone(),
    });
    let interval_ns = 1_000_000_000 / u64::from(request.rate);
    // Trace mode ticks too: on CPython 3.11, whose entry probe does not fire, stacks
    // are sampled alongside the exact return counts for times. Which version runs
    // is known only once the probes are found, so those samples do not stop the
    // target (elsewhere the ticks are ignored).
    let alongside = mode == Mode::Trace && budget.is_none();
    let options = EngineOptions {
        subprocesses: request.subprocesses,
        guardian: true,
        // Under a budget, stacks are sampled while the function probes are off.
        sample_interval_ns: Some(interval_ns),
        blocking_samples: !request.nonblocking && !alongside,
        max_overhead: budget,
        ring: request.ring,
    };
    signals::install().context("cannot install signal handlers")?;

    let mut early = Vec::new();
    // A budget's first window opens while attaching, before the recording does.
    let mut early_window = None;
    let mut sampler = Sampler::default();
    // The stacks running when the probes went in at attach (every thread is
    // stopped then): frames whose entries the recording will never see.
    let mut running = None;
    // Threads that started or ended while attaching: recorded once the
    // recording exists.
    let mut early_threads = Vec::new();
    let verbose = request.verbose;
    let mut collect = |e: TraceEvent| match e {
        TraceEvent::Window { pid, ts_ns, exact } => early_window = Some((pid, ts_ns, exact)),
        TraceEvent::Installed { pid, sites } => {
            if request.pid == Some(pid)
                && running.is_none()
                && chosen.borrow().groups.contains(&ProbeGroup::Function)
            {
                let ts = monotonic_ns();
                running = Some((ts, sampler.running(pid, ts)));
            }
            if verbose {
                early.push(armed_line(pid, sites));
            }
            early.extend(refusal_lines(pid, &chosen, verbose));
        }
        TraceEvent::ThreadStart { pid, tid, ts_ns } => {
            early_threads.push((tid, ts_ns, EventKind::ThreadStart { pid: pid as u32 }))
        }
        TraceEvent::ThreadExit { tid, ts_ns, .. } => {
            early_threads.push((tid, ts_ns, EventKind::ThreadExit))
        }
        TraceEvent::Notice(text) => early.push(format!("pyprobe: {text}")),
        TraceEvent::Summarised { short, full } => {
            early.push(format!("pyprobe: {}", if verbose { full } else { short }))
        }
        TraceEvent::Detail(text) if verbose => early.push(format!("pyprobe: {text}")),
        // Nothing is hit, sampled or lost before the probes are in and the
        // target runs again.
        TraceEvent::Detail(_)
        | TraceEvent::Hit(_)
        | TraceEvent::Lost { .. }
        | TraceEvent::Counted { .. }
        | TraceEvent::RingDrained { .. }
        | TraceEvent::Thinning { .. }
        | TraceEvent::ProcessStart { .. }
        | TraceEvent::Exec { .. }
        | TraceEvent::Tick { .. } => {}
    };
    let (mut engine, launched) = match (request.pid, request.command.is_empty()) {
        (Some(pid), true) => {
            check_attachable(pid, mode)?;
            (Engine::attach(pid, resolver, options, &mut collect)?, false)
        }
        (None, false) => (
            Engine::launch(&request.command, resolver, options, &mut collect)?,
            true,
        ),
        (Some(_), false) => bail!("give either -p PID or a command after --, not both"),
        (None, true) => bail!("nothing to record: give -p PID or a command after --"),
    };
    let pid = engine.root();
    let output = match &request.output {
        Some(o) => o.clone(),
        None => default_output(pid, existing)?,
    };
    let recording_path = if view.is_some() {
        output.with_extension("pyprobe")
    } else {
        output.clone()
    };
    let header = Header {
        pid: pid as u32,
        command_line: if launched {
            request.command.clone()
        } else {
            cmdline(pid)
        },
        mode: request.mode.clone(),
        sample_interval_ns: if mode == Mode::Trace && budget.is_none() {
            0
        } else {
            interval_ns
        },
        start_ns: recording_start(&mut running, early_window),
        wall_start_unix_ns: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
        ..Header::default()
    };
    let mut builder = EventBuilder::new(
        header,
        recording_path.clone(),
        existing,
        filter,
        request.start_at.clone(),
    );
    if alongside {
        builder.sample_alongside(interval_ns);
    }
    sampler.verbose = request.verbose;
    let start = StartLine {
        mode,
        request,
        budget,
        view: view.map(|_| output.as_path()),
        launched,
    };
    // Under a budget: `exact_window` says whether calls are traced exactly now
    // (then no sampling).
    if !launched {
        builder.open(pid, &chosen.borrow());
        start.print(&chosen.borrow(), pid, &builder);
    }
    for line in early {
        eprintln!("{line}");
    }
    for (tid, ts_ns, kind) in early_threads {
        builder.write(tid, ts_ns, kind);
    }
    let mut exact_window = false;
    if let Some((pid, ts_ns, exact)) = early_window {
        exact_window = exact;
        builder.write(pid, ts_ns, EventKind::Window { exact });
    }
    // After the window: a window starts the stacks afresh.
    if let Some((ts, stacks)) = running.take() {
        Sampler::write_running(&mut builder, ts, stacks);
    }
    if let Some(d) = request.duration {
        signals::set_deadline(d);
    }
    // A launched command gets its start line once its interpreter is found.
    let mut announced = false;
    // Over budget: GC, import and audit events go without their stacks.
    let mut thinned = false;
    let mut status = status::Status::new();
    let outcome = engine.run(&mut |event| {
        match event {
            TraceEvent::Hit(hit) => {
                let meaning = chosen.borrow().meaning(hit.pid, hit.probe, hit.probe_name);
                if let Some(meaning) = meaning {
                    // Which code triggered a GC, an import or an audit event: from the
                    // walker, unless every call is traced (then the rebuilt stack says it).
                    let explains = CONTEXT_PROBES.contains(&meaning.name) && {
                        let now = chosen.borrow();
                        needs_context_stacks(mode, now.version, &now.groups)
                    };
                    match hit.stack {
                        // Captured by the ring trampoline, in the target, at the hit.
                        Some(stack) if explains => {
                            sampler.captured(hit.pid, hit.tid, hit.ts_ns, stack, &mut builder)
                        }
                        // Held at its int3: read now, unless over budget. A ring
                        // hit without stack has none.
                        None if explains && hit.stopped && !thinned => {
                            sampler.context(hit.pid, hit.tid, hit.ts_ns, &mut builder)
                        }
                        _ => {}
                    }
                    // The thread was stopped before the collection or import began:
                    // it begins when the thread goes on, after pyprobe's stack read.
                    let opens_pause =
                        explains && hit.stopped && OPENING_PROBES.contains(&meaning.name);
                    let ts_ns = if opens_pause {
                        monotonic_ns()
                    } else {
                        hit.ts_ns
                    };
                    builder.hit(meaning, &hit.at(ts_ns));
                }
            }
            TraceEvent::ThreadStart { pid, tid, ts_ns } => {
                builder.write(tid, ts_ns, EventKind::ThreadStart { pid: pid as u32 })
            }
            TraceEvent::ThreadExit { pid, tid, ts_ns } => {
                if tid == pid {
                    sampler.forget(pid);
                }
                builder.write(tid, ts_ns, EventKind::ThreadExit)
            }
            TraceEvent::ProcessStart { pid, parent, ts_ns } => {
                let parent = parent as u32;
                let command = cmdline(pid).join(" ");
                builder.write_named(pid, ts_ns, &command, NamedKind::ProcessStart { parent });
            }
            TraceEvent::Exec { pid, ts_ns } => {
                sampler.forget(pid);
                let command = cmdline(pid).join(" ");
                builder.write_named(pid, ts_ns, &command, NamedKind::Exec);
            }
            TraceEvent::Installed { pid, sites } => {
                if launched && !announced {
                    announced = true;
                    builder.open(pid, &chosen.borrow());
                    start.print(&chosen.borrow(), pid, &builder);
                }
                if request.verbose {
                    eprintln!("{}", armed_line(pid, sites));
                }
                for line in refusal_lines(pid, &chosen, request.verbose) {
                    eprintln!("{line}");
                }
            }
            TraceEvent::Notice(text) => eprintln!("pyprobe: {text}"),
            TraceEvent::RingDrained { pid } => sampler.new_naming_batch(pid),
            TraceEvent::Counted {
                pid,
                probe,
                probe_name,
                count,
                ts_ns,
            } => {
                let audit = chosen
                    .borrow()
                    .meaning(pid, probe, probe_name)
                    .is_some_and(|m| m.name == "audit");
                if audit {
                    builder.write(pid, ts_ns, EventKind::AuditsCounted { count });
                }
            }
            TraceEvent::Thinning { pid, ts_ns, level } => {
                thinned = level != ThinLevel::Full;
                builder.write(pid, ts_ns, EventKind::Thinned { level });
            }
            TraceEvent::Summarised { short, full } => {
                eprintln!("pyprobe: {}", if request.verbose { full } else { short })
            }
            TraceEvent::Detail(text) => {
                if request.verbose {
                    eprintln!("pyprobe: {text}");
                }
            }
            TraceEvent::Lost { pid, count, ts_ns } => {
                builder.write(pid, ts_ns, EventKind::Lost { count })
            }
            TraceEvent::Window { pid, ts_ns, exact } => {
                exact_window = exact;
                builder.write(pid, ts_ns, EventKind::Window { exact });
            }
            TraceEvent::Tick {
                pid, ts_ns, on_cpu, ..
            } => {
                let sampling = !alongside || {
                    let now = chosen.borrow();
                    returns_only(now.version, &now.groups)
                };
                if sampling && (announced || !launched) && !exact_window {
                    sampler.sample(pid, ts_ns, &on_cpu, &mut builder);
                    builder.flush_if_due(ts_ns);
                }
            }
        }
        status.update(builder.events(), sampler.samples, 0, builder.bytes());
    });
    status.finish();
    let hits = engine.hits();
    let budget_summary = engine.budget_summary();
    drop(engine);
    let end_ns = monotonic_ns();
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
    if (mode != Mode::Trace || sampler.ticks > 0) && sampler.samples == 0 {
        if let Some(e) = &sampler.last_error {
            eprintln!("pyprobe: no samples: {e}");
        }
    }
    let Some((writer, file)) = opened else {
        let why = write_error.map(|e| e.to_string()).unwrap_or_else(|| {
            "the command never started a CPython interpreter pyprobe could read".into()
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
    let mut what = match mode {
        Mode::Trace if sampler.samples == 0 => format!("{hits} probe hits"),
        _ => format!("{} samples, {hits} probe hits", sampler.samples),
    };
    if summary.lost_events > 0 {
        what.push_str(&format!(
            " ({} more lost: the ring was full)",
            summary.lost_events
        ));
    }
    eprintln!(
        "pyprobe: {what}, {events} events written to {} ({} bytes){}",
        recording_path.display(),
        summary.bytes,
        match outcome {
            Outcome::Detached(StopReason::Duration) => "; duration reached, detached".to_string(),
            Outcome::Detached(StopReason::Signal(s)) => format!("; {s} received, detached"),
            Outcome::Detached(StopReason::Internal) => "; detached".to_string(),
            Outcome::Exited(code) => format!("; target exited with status {code}"),
            Outcome::Killed(sig) => format!("; target killed by {sig}"),
        }
    );
    if let (Some(max), Some(b)) = (budget, budget_summary) {
        // Said when the budget changed what was recorded, or was exceeded.
        let acted = b.traced_functions || b.exact_fraction < 1.0 || b.slowdown > max;
        if acted || request.verbose {
            eprintln!("pyprobe: {}", budget_line(max, &b));
        }
    }
    if view.is_some() {
        // The recording stays beside the view, so other views can be made later.
        crate::session::views::write_view_for_extension(
            &recording_path,
            &output,
            request.samples,
            existing,
        )
        .with_context(|| format!("cannot write {}", output.display()))?;
        eprintln!(
            "pyprobe: wrote {} (recording kept in {})",
            output.display(),
            recording_path.display()
        );
    }
    Ok(exit_code(outcome, launched, pid))
}

/// Refuses, before anything is attached or started, an output pyprobe cannot or
/// must not write: a name whose extension is no format it writes, an existing
/// file (without `--force`), a device, a directory, a recording under way at the
/// same name. Returns the view's format when OUT names a view (the recording
/// then goes beside it, as OUT.pyprobe).
fn check_outputs(output: &Path, existing: Existing) -> Result<Option<FlameFormat>> {
    // What OUT is first (a device, a directory): its name is beside the point.
    check(output, Stdout::Refused, Existing::Replace)?;
    let view = FlameFormat::for_extension(output);
    let recording = match view {
        Some(_) => {
            check(output, Stdout::Refused, existing)?;
            output.with_extension("pyprobe")
        }
        None if extension(output).as_deref() == Some("pyprobe") || is_fifo(output) => {
            output.to_owned()
        }
        None => bail!(
            "pyprobe record cannot write {}: name the output .pyprobe (a recording), .svg \
             (flame graph), .json (speedscope) or .txt (collapsed stacks)",
            output.display()
        ),
    };
    check_recording(&recording, existing).map_err(|e| {
        if view.is_some() && e.kind() == std::io::ErrorKind::AlreadyExists {
            anyhow::anyhow!("{e} (the recording kept beside {})", output.display())
        } else {
            e.into()
        }
    })?;
    Ok(view)
}

/// When the recording starts: when the probes went in at attach (the stacks read
/// then are running from that moment; a budget's first window opens then too),
/// else now.
fn recording_start(
    running: &mut Option<(u64, sampler::RunningStacks)>,
    early_window: Option<(i32, u64, bool)>,
) -> u64 {
    let now = monotonic_ns();
    match (running.as_mut(), early_window) {
        (Some((ts, _)), Some((_, window, _))) => {
            // Tracing began with the window; the stacks were read just before.
            *ts = window.max(*ts);
            *ts
        }
        (Some((ts, _)), None) => *ts,
        (None, _) => now,
    }
}

/// The line that says, once the interpreter is known, what is traced and how:
/// the process, its CPython, the mode, the sampling rate, the probes and their
/// engine, and where the recording goes.
struct StartLine<'a> {
    mode: Mode,
    request: &'a RecordRequest,
    budget: Option<f64>,
    /// The view written at the end, when -o names one.
    view: Option<&'a Path>,
    launched: bool,
}

/// At most this many characters of the target's command line in the start line.
const COMMAND_CHARS: usize = 48;

impl StartLine<'_> {
    fn print(&self, chosen: &Chosen, pid: i32, builder: &EventBuilder) {
        eprintln!("{}", self.text(chosen, pid, builder));
        if self.request.verbose {
            eprintln!("pyprobe: interpreter: {}", chosen.object_path);
            if let Some(w) = &chosen.warning {
                eprintln!("pyprobe: note: {w}");
            }
        }
    }

    fn text(&self, chosen: &Chosen, pid: i32, builder: &EventBuilder) -> String {
        let request = self.request;
        let version = chosen
            .version
            .map(|v| v.to_string())
            .unwrap_or_else(|| "?".into());
        let argv = if self.launched {
            request.command.clone()
        } else {
            cmdline(pid)
        };
        // The program by its name, not its directory.
        let command = argv
            .iter()
            .enumerate()
            .map(|(i, a)| match i {
                0 => a.rsplit('/').next().unwrap_or(a),
                _ => a.as_str(),
            })
            .collect::<Vec<_>>()
            .join(" ");
        let command = if command.chars().count() > COMMAND_CHARS {
            let cut: String = command.chars().take(COMMAND_CHARS - 1).collect();
            format!("{cut}…")
        } else {
            command
        };
        let groups: Vec<&str> = chosen.groups.iter().map(|g| g.name()).collect();
        let rate = request.rate;
        let sampled = format!(
            "stacks sampled at {rate} Hz{}",
            if request.nonblocking {
                " without stopping the threads"
            } else {
                ", stopping the threads briefly"
            }
        );
        let engine = match request.ring {
            RingUse::Auto => "engine auto: ring, else int3",
            RingUse::Required => "engine ring",
            RingUse::Off => "engine int3",
        };
        let what = match self.mode {
            Mode::Trace if returns_only(chosen.version, &chosen.groups) => {
                let others: Vec<&str> = groups
                    .iter()
                    .copied()
                    .filter(|g| *g != "function")
                    .collect();
                let others = if others.is_empty() {
                    String::new()
                } else {
                    format!(", {}", others.join(", "))
                };
                format!(
                    "mode trace: function returns (this CPython's entries do not fire){others} \
                     exact ({engine}); times from stacks sampled at {rate} Hz without stopping \
                     the threads"
                )
            }
            Mode::Trace => format!("mode trace: {} exact ({engine})", groups.join(", ")),
            Mode::Sample => format!("mode sample: {sampled}"),
            Mode::Auto if chosen.has_probes && !groups.is_empty() => {
                format!(
                    "mode auto: {sampled}; {} exact ({engine})",
                    groups.join(", ")
                )
            }
            Mode::Auto if chosen.has_probes => format!("mode auto: {sampled}"),
            Mode::Auto => format!(
                "mode auto: {sampled}; no exact events: this CPython has no SDT probes (built \
                 without --with-dtrace)"
            ),
        };
        let budget = match self.budget {
            Some(max)
                if chosen.groups.contains(&ProbeGroup::Function)
                    || chosen.groups.contains(&ProbeGroup::Line) =>
            {
                format!(
                    "; overhead budget {}%: above it, function probes go off and stacks are \
                     sampled",
                    max * 100.0
                )
            }
            Some(max) if chosen.has_probes => format!(
                "; overhead budget {}%: above it, GC, import and audit events go without their \
                 stacks",
                max * 100.0
            ),
            _ => String::new(),
        };
        let into = match (builder.writing_to(), self.view) {
            (None, _) => String::new(),
            (Some((writing, final_name)), view) => {
                let recording = if writing == final_name {
                    format!("{}", final_name.display())
                } else {
                    format!("{} ({} when done)", writing.display(), final_name.display())
                };
                match view {
                    Some(v) => format!("; writing {recording}, then {}", v.display()),
                    None => format!("; writing {recording}"),
                }
            }
        };
        format!(
            "pyprobe: process {pid}{} ({command}), CPython {version}: {what}{budget}{into}",
            crate::process::status::ns_pid_note(pid),
        )
    }
}

fn armed_line(pid: i32, sites: usize) -> String {
    format!("pyprobe: {sites} probe sites armed in process {pid}")
}

/// What the resolver left alone in `pid` (forged or corrupt notes, odd
/// semaphores): one line each with `verbose`, else one line saying how many.
/// Sites holding something else than their `nop` are reported by the engine.
fn refusal_lines(pid: i32, chosen: &RefCell<Chosen>, verbose: bool) -> Vec<String> {
    let refusals = chosen
        .borrow_mut()
        .refusals
        .remove(&pid)
        .unwrap_or_default();
    if refusals.is_empty() {
        return Vec::new();
    }
    if !verbose {
        return vec![format!(
            "pyprobe: process {pid}: {} probe note{} or semaphore{} failed pyprobe's checks and \
             {} left alone, not traced (-v says which and why)",
            refusals.len(),
            if refusals.len() == 1 { "" } else { "s" },
            if refusals.len() == 1 { "" } else { "s" },
            if refusals.len() == 1 { "is" } else { "are" }
        )];
    }
    refusals
        .into_iter()
        .map(|why| format!("pyprobe: process {pid}: {why}"))
        .collect()
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
