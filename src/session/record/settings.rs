//! A request checked before anything is touched, and what follows from it: the
//! mode's overhead budget, the outputs, the engine's options.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::session::views::{extension, is_fifo, recording_beside, FlameFormat};
use pyprobe_cpython::python::probe_catalog::{ProbeGroup, PROVIDER};
use pyprobe_cpython::python::tracing::parse_groups;
use pyprobe_cpython::python::walker::find_interpreter_object;
use pyprobe_recording::analyze::{FileFilter, SampleFilter};
use pyprobe_recording::output::file::{
    check, check_recording, is_taken, numbered, Existing, Stdout,
};
use pyprobe_sdt::process::objects::{find_probe_object, sdt_objects};
use pyprobe_sdt::process::status::check_inspectable;
use pyprobe_sdt::tracer::EngineOptions;

use super::request::RecordRequest;
use super::resolver::Mode;

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

/// A request checked before anything is touched, and what follows from it.
pub(super) struct Settings<'a> {
    pub request: &'a RecordRequest,
    pub mode: Mode,
    /// `--include`, `--exclude`.
    pub filter: FileFilter,
    /// `--probes`, when given.
    pub requested: Option<BTreeSet<ProbeGroup>>,
    /// The slowdown allowed (fraction).
    pub budget: Option<f64>,
    pub existing: Existing,
    /// The view `-o` names, written beside the recording at the end.
    pub view: Option<FlameFormat>,
    pub interval_ns: u64,
    /// Trace mode ticks too: on CPython 3.11, whose entry probe does not fire,
    /// stacks are sampled alongside the exact return counts for times. Which
    /// version runs is known only once the probes are found, so those samples do
    /// not stop the target (elsewhere the ticks are ignored).
    pub alongside: bool,
    /// `--every`: the directory the periods' profiles go to, and their length (ns).
    pub periods: Option<(PathBuf, u64)>,
}

impl Settings<'_> {
    /// Refuses what cannot be done, before anything is attached or started.
    pub fn check(request: &RecordRequest) -> Result<Settings<'_>> {
        let mode = request.mode;
        if request.rate == 0 || request.rate > 10_000 {
            bail!(
                "-r/--rate must be between 1 and 10000 Hz (got {})",
                request.rate
            );
        }
        let filter = FileFilter::new(&request.include, &request.exclude)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let requested = if request.probes.is_empty() {
            None
        } else {
            Some(parse_groups(&request.probes)?)
        };
        if request.hook == super::HookUse::Always && mode != Mode::Trace {
            bail!("`--engine hook` traces every call exactly: use it with `--mode trace`");
        }
        if request.native && mode == Mode::Trace {
            bail!("`--native` adds native frames to sampled stacks: use it with `--mode auto` or `--mode sample`");
        }
        if request.async_tasks && mode == Mode::Trace {
            bail!(
                "`--async` draws sampled stacks as asyncio tasks see them; `--mode trace` records \
                 calls, not samples: use it with `--mode auto` or `--mode sample`"
            );
        }
        if mode == Mode::Sample && requested.is_some() {
            bail!("`--probes` needs probes: use it with `--mode trace` or `--mode auto`");
        }
        let budget = overhead_budget(request, mode)?;
        let existing = if request.force {
            Existing::Replace
        } else {
            Existing::Keep
        };
        let periods = check_periods(request)?;
        let view = match &request.output {
            Some(_) if periods.is_some() => None,
            Some(output) => check_outputs(output, existing)?,
            None => None,
        };
        if request.pprof && periods.is_none() && view != Some(FlameFormat::Pprof) {
            bail!(
                "--format pprof writes one profile when the recording ends (-o FILE.pb.gz), or \
                 one per period into a directory (--every SECONDS -o DIR)"
            );
        }
        if request.samples != SampleFilter::default()
            && view.is_none()
            && periods.is_none()
            && request.output.is_some()
        {
            eprintln!(
                "pyprobe: note: --idle and --gil choose the samples a view counts (-o x.svg, \
                 .json, .txt); a recording keeps every sample with its thread's state, for \
                 report, flame and top --from to filter"
            );
        }
        Ok(Settings {
            request,
            mode,
            filter,
            requested,
            budget,
            existing,
            view,
            interval_ns: 1_000_000_000 / u64::from(request.rate),
            alongside: mode == Mode::Trace && budget.is_none(),
            periods,
        })
    }

    pub fn engine_options(&self) -> EngineOptions {
        EngineOptions {
            subprocesses: self.request.subprocesses,
            guardian: true,
            // Under a budget, stacks are sampled while the function probes are off.
            sample_interval_ns: Some(self.interval_ns),
            blocking_samples: !self.request.nonblocking && !self.alongside,
            keep_sample_stops: self.request.native,
            max_overhead: self.budget,
            ring: self.request.ring,
        }
    }
}

/// The default output: the flame graph `pyprobe-PID.svg`, what a user wants to look
/// at first, with the recording beside it as `pyprobe-PID.pyprobe`; with `--force`
/// not given and either taken, the first `pyprobe-PID.N.svg` free with its recording.
pub(super) fn default_output(pid: i32, existing: Existing) -> Result<PathBuf> {
    let base = PathBuf::from(format!("pyprobe-{pid}.svg"));
    match existing {
        Existing::Replace => Ok(base),
        Existing::Keep => {
            let recording = PathBuf::from(format!("pyprobe-{pid}.pyprobe"));
            (0..10_000)
                .map(|n| (numbered(&base, ".svg", n), n))
                .find(|(svg, n)| {
                    !is_taken(svg, true) && !is_taken(&numbered(&recording, ".pyprobe", *n), true)
                })
                .map(|(svg, _)| svg)
                .context("cannot find a free name for the flame graph and its recording")
        }
    }
}

/// Shortest and longest `--every`, in seconds.
const MIN_PERIOD_S: f64 = 1.0;
const MAX_PERIOD_S: f64 = 86_400.0;

/// `--every SECONDS -o DIR`: the directory (made if missing, mode 0700) and the
/// period in ns; refused without `--format pprof` or a directory.
fn check_periods(request: &RecordRequest) -> Result<Option<(PathBuf, u64)>> {
    let Some(every) = request.every else {
        return Ok(None);
    };
    if !request.pprof {
        bail!("--every rotates pprof profiles: give --format pprof too");
    }
    if !(MIN_PERIOD_S..=MAX_PERIOD_S).contains(&every) {
        bail!("--every must be between {MIN_PERIOD_S} and {MAX_PERIOD_S} seconds (got {every})");
    }
    let Some(dir) = &request.output else {
        bail!("--every writes one profile per period into a directory: name it with -o DIR");
    };
    if !dir.exists() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create the directory {}", dir.display()))?;
    }
    if !dir.is_dir() {
        bail!(
            "{} is not a directory: --every writes one profile per period into the directory -o names",
            dir.display()
        );
    }
    Ok(Some((dir.clone(), (every * 1e9) as u64)))
}

/// The recording beside the periods' profiles: `DIR/pyprobe-PID.pyprobe`, or
/// the first numbered name free unless `existing` allows replacing it.
pub(super) fn recording_in(dir: &Path, pid: i32, existing: Existing) -> Result<PathBuf> {
    let base = dir.join(format!("pyprobe-{pid}.pyprobe"));
    match existing {
        Existing::Replace => Ok(base),
        Existing::Keep => Ok(pyprobe_recording::output::file::first_free(
            |n| numbered(&base, ".pyprobe", n),
            true,
        )?),
    }
}

/// Refuses, with one clear sentence, a process this mode cannot record.
pub(super) fn check_attachable(pid: i32, mode: Mode, hook: super::HookUse) -> Result<()> {
    check_inspectable(pid)?;
    if pid == std::process::id() as i32 {
        bail!("pyprobe cannot trace itself (pid {pid})");
    }
    // The hook engine needs no probes: where it serves the interpreter (or is asked
    // for, and the resolver says why not), no probes is no refusal.
    let servable = || {
        find_interpreter_object(pid)
            .ok()
            .and_then(|o| {
                pyprobe_cpython::python::version::detect(
                    &o,
                    &pyprobe_sdt::process::memory::ProcessMemory::new(pid),
                )
            })
            .is_some_and(|v| pyprobe_cpython::hook_engine::refusal(v).is_none())
    };
    let hook_use = hook;
    let hook = mode == Mode::Trace
        && match hook {
            super::HookUse::Never => false,
            super::HookUse::Always => true,
            super::HookUse::Auto => servable(),
        };
    if mode == Mode::Trace && !hook && find_probe_object(pid, PROVIDER).is_err() {
        check_inspectable(pid)?; // it may have exited meanwhile: say so, not "no probes"
                                 // No interpreter mapped at all (not Python, or still starting): that, not
                                 // how the interpreter was built, is what to say.
        find_interpreter_object(pid).with_context(|| format!("process {pid} cannot be traced"))?;
        let others = sdt_objects(pid, None)
            .map(|o| !o.is_empty())
            .unwrap_or(false);
        let instead = if hook_use == super::HookUse::Never && servable() {
            "without `--engine ring` or `int3`, the hook engine traces its calls exactly"
        } else {
            "`--mode sample` reads its stacks instead"
        };
        bail!(
            "process {pid} has no CPython SDT probes{}: it is not a CPython built with --with-dtrace, \
             so `--mode trace` cannot work with the probe engines; {instead}",
            if others { " (it has other SDT providers)" } else { "" }
        );
    }
    if mode != Mode::Trace || hook {
        find_interpreter_object(pid).with_context(|| format!("process {pid} cannot be sampled"))?;
    }
    Ok(())
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
            recording_beside(output)
        }
        None if extension(output).as_deref() == Some("pyprobe") || is_fifo(output) => {
            output.to_owned()
        }
        None => bail!(
            "pyprobe record cannot write {}: name the output .pyprobe (a recording), .svg \
             (flame graph), .json (speedscope), .txt (collapsed stacks), .pb.gz (pprof), .prof (pstats) or .html (report page)",
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
