//! `pyprobe record`: attach to or start a CPython process, trace its probes through
//! the ptrace engine, and stream the events into a recording.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{bail, Context, Result};

use crate::analyze::FileFilter;
use crate::output::file::{check, check_recording, Stdout};
use crate::process::objects::{find_probe_object, sdt_objects};
use crate::process::status::{check_inspectable, cmdline};
use std::collections::BTreeSet;

use crate::python::probes::{ProbeGroup, PROBES, PROVIDER};
use crate::python::tracing::parse_groups;
use crate::python::walker::find_interpreter_object;
use crate::record::{EventKind, Header};
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
}

/// The default overhead budget, in percent, where one applies.
const DEFAULT_MAX_OVERHEAD: f64 = 5.0;

/// The slowdown allowed (fraction), from `--max-overhead` and the defaults: 5 % in
/// auto mode when function or line probes are asked for on a running process.
fn overhead_budget(
    request: &RecordRequest,
    mode: Mode,
    requested: Option<&BTreeSet<ProbeGroup>>,
) -> Result<Option<f64>> {
    let costly = requested
        .is_some_and(|g| g.contains(&ProbeGroup::Function) || g.contains(&ProbeGroup::Line));
    match request.max_overhead {
        Some(p) if !(0.0..=10_000.0).contains(&p) => {
            bail!("--max-overhead must be a percentage between 0 and 10000 (got {p})")
        }
        Some(0.0) => Ok(None),
        Some(_) if mode == Mode::Sample => bail!(
            "--max-overhead limits probes, and `--mode sample` uses none: lower -r/--rate instead"
        ),
        Some(p) => Ok(Some(p / 100.0)),
        None if mode == Mode::Auto && request.pid.is_some() && costly => {
            Ok(Some(DEFAULT_MAX_OVERHEAD / 100.0))
        }
        None => Ok(None),
    }
}

mod events;
mod resolver;
mod sampler;
mod status;

fn default_output(pid: i32) -> PathBuf {
    PathBuf::from(format!("pyprobe-{pid}.pyprobe"))
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
    let budget = overhead_budget(request, mode, requested.as_ref())?;
    if let Some(output) = &request.output {
        // Before anything is attached or started.
        check_outputs(output)?;
    }
    let chosen = Rc::new(RefCell::new(Chosen::default()));
    let resolver = Box::new(PythonResolver {
        mode,
        capture_stacks: request.ring == RingUse::Required,
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
    let mut collect = |e: TraceEvent| match e {
        TraceEvent::Window { pid, ts_ns, exact } => early_window = Some((pid, ts_ns, exact)),
        TraceEvent::Installed { pid, .. } => {
            if request.pid == Some(pid)
                && running.is_none()
                && chosen.borrow().groups.contains(&ProbeGroup::Function)
            {
                let ts = monotonic_ns();
                running = Some((ts, sampler.running(pid, ts)));
            }
            early.push(format_early(&e));
            early.extend(refusal_lines(pid, &chosen));
        }
        other => early.push(format_early(&other)),
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
    let output = request
        .output
        .clone()
        .unwrap_or_else(|| default_output(pid));
    let recording_path = if is_view(&output) {
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
    for line in early {
        eprintln!("{line}");
    }
    let mut builder = EventBuilder::new(
        header,
        recording_path.clone(),
        filter,
        request.start_at.clone(),
    );
    if alongside {
        builder.sample_alongside(interval_ns);
    }
    let start_line =
        |chosen: &Chosen, pid: i32| print_start_line(chosen, pid, mode, request, budget);
    // Under a budget: `exact_window` says whether calls are traced exactly now
    // (then no sampling).
    if !launched {
        start_line(&chosen.borrow(), pid);
        builder.open(pid, &chosen.borrow());
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
    let mut status = status::Status::new();
    let outcome = engine.run(&mut |event| {
        match event {
            TraceEvent::Hit(hit) => {
                // A child traced under --subprocesses runs its parent's probe set: go by name.
                let meaning = chosen
                    .borrow()
                    .meanings
                    .get(&hit.pid)
                    .and_then(|m| m.get(hit.probe).copied())
                    .or_else(|| PROBES.iter().find(|p| p.name == hit.probe_name));
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
                        // Read now, the thread held at its int3. A ring hit without
                        // stack (a probe too frequent to stop for) has none.
                        None if explains && hit.stopped => {
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
                    start_line(&chosen.borrow(), pid);
                    builder.open(pid, &chosen.borrow());
                }
                if sites > 0 {
                    eprintln!("pyprobe: {sites} probe sites armed in process {pid}");
                }
                for line in refusal_lines(pid, &chosen) {
                    eprintln!("{line}");
                }
            }
            TraceEvent::Notice(text) => eprintln!("pyprobe: {text}"),
            TraceEvent::Lost { pid, count, ts_ns } => {
                builder.write(pid, ts_ns, EventKind::Lost { count })
            }
            TraceEvent::Window { pid, ts_ns, exact } => {
                exact_window = exact;
                builder.write(pid, ts_ns, EventKind::Window { exact });
            }
            TraceEvent::Tick { pid, ts_ns, .. } => {
                let sampling = !alongside || {
                    let now = chosen.borrow();
                    returns_only(now.version, &now.groups)
                };
                if sampling && (announced || !launched) && !exact_window {
                    sampler.sample(pid, ts_ns, &mut builder);
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
        let sampled = if b.blocking_samples == 0 {
            String::new()
        } else {
            format!(
                " ({} samples stopped the target, {} µs each on average{})",
                b.blocking_samples,
                b.sample_mean_ns / 1000,
                if b.samples_unblocked {
                    "; then sampled without stopping it"
                } else {
                    ""
                }
            )
        };
        eprintln!(
            "pyprobe: overhead budget {}%: calls traced exactly {:.1}% of the time, in {} \
             window{}; sampled in between{sampled}",
            max * 100.0,
            b.exact_fraction * 100.0,
            b.windows,
            if b.windows == 1 { "" } else { "s" }
        );
    }
    if is_view(&output) {
        // The recording stays beside the view, so other views can be made later.
        crate::session::views::write_view_for_extension(&recording_path, &output)
            .with_context(|| format!("cannot write {}", output.display()))?;
        eprintln!(
            "pyprobe: wrote {} (recording kept in {})",
            output.display(),
            recording_path.display()
        );
    }
    Ok(exit_code(outcome, launched, pid))
}

/// Refuses outputs that cannot be written (a device, a directory, a recording
/// under way at the same name).
fn check_outputs(output: &Path) -> Result<()> {
    let recording = if is_view(output) {
        check(output, Stdout::Refused)?;
        output.with_extension("pyprobe")
    } else {
        output.to_owned()
    };
    check_recording(&recording)?;
    Ok(())
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

fn is_view(path: &std::path::Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("svg" | "json" | "txt")
    )
}

fn print_start_line(
    chosen: &Chosen,
    pid: i32,
    mode: Mode,
    request: &RecordRequest,
    budget: Option<f64>,
) {
    let version = chosen
        .version
        .map(|v| v.to_string())
        .unwrap_or_else(|| "?".into());
    let groups: Vec<&str> = chosen.groups.iter().map(|g| g.name()).collect();
    let how = if request.nonblocking {
        "without stopping the threads"
    } else {
        "stopping the threads briefly"
    };
    let rate = request.rate;
    let why = match mode {
        Mode::Trace if returns_only(chosen.version, &chosen.groups) => format!(
            "mode trace: every probe hit recorded exactly; this CPython's function probes give \
             returns only, so stacks are also sampled at {rate} Hz, without stopping the threads, \
             for times"
        ),
        Mode::Trace => "mode trace: every probe hit recorded exactly".to_string(),
        Mode::Sample => format!("mode sample: stacks sampled at {rate} Hz, {how}"),
        Mode::Auto if chosen.has_probes => format!(
            "mode auto: function stacks sampled at {rate} Hz, {how}; {} exact through their probes \
             (`--mode trace` for exact calls)",
            if groups.is_empty() { "no events".to_string() } else { groups.join(", ") }
        ),
        Mode::Auto => format!(
            "mode auto: stacks sampled at {rate} Hz, {how}; this CPython has no SDT probes \
             (built without --with-dtrace), so no exact events"
        ),
    };
    eprintln!(
        "pyprobe: process {pid}{}, CPython {version} ({}): {why}",
        crate::process::status::ns_pid_note(pid),
        chosen.object_path
    );
    if mode == Mode::Trace {
        eprintln!("pyprobe: probes: {}", groups.join(","));
    }
    if let Some(w) = &chosen.warning {
        eprintln!("pyprobe: note: {w}");
    }
    if let Some(max) = budget {
        let costly = chosen.groups.contains(&ProbeGroup::Function)
            || chosen.groups.contains(&ProbeGroup::Line);
        if costly {
            eprintln!(
                "pyprobe: overhead budget {}% (--max-overhead): above it, function probes go off and \
                 stacks are sampled at {} Hz until the budget allows an exact window again",
                max * 100.0,
                request.rate
            );
        } else if chosen.has_probes {
            eprintln!(
                "pyprobe: overhead budget {}%: nothing to limit, no function or line probes are on",
                max * 100.0
            );
        }
    }
}

/// What the resolver left alone in `pid` (forged or corrupt notes, odd
/// semaphores), one line each; sites holding something else than their `nop` are
/// reported by the engine, with why.
fn refusal_lines(pid: i32, chosen: &RefCell<Chosen>) -> Vec<String> {
    chosen
        .borrow_mut()
        .refusals
        .remove(&pid)
        .unwrap_or_default()
        .into_iter()
        .map(|why| format!("pyprobe: process {pid}: {why}"))
        .collect()
}

fn format_early(event: &TraceEvent) -> String {
    match event {
        TraceEvent::Installed { pid, sites, .. } => {
            format!("pyprobe: {sites} probe sites armed in process {pid}")
        }
        TraceEvent::Notice(t) => format!("pyprobe: {t}"),
        other => format!("pyprobe: {other:?}"),
    }
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
