//! `pyprobe record`: attach to or start a CPython process, trace its probes through
//! the ptrace engine, and stream the events into a recording.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{bail, Context, Result};

use crate::analyze::FileFilter;
use crate::process::memory::ProcessMemory;
use crate::process::objects::{find_probe_object, sdt_objects};
use crate::process::status::{check_inspectable, cmdline};
use crate::python::probes::{ProbeGroup, PythonProbe, PROBES, PROVIDER};
use crate::python::tracing::{available_groups, default_groups, parse_groups, probe_set};
use crate::python::version::{self, PyVersion};
use crate::record::{Event, EventKind, FrameRef, Header, RecordingWriter};
use crate::tracer::signals::{self, monotonic_ns, StopReason};
use crate::tracer::{Engine, EngineOptions, Hit, Outcome, ProbeSet, Resolver, TraceEvent};

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
}

/// What the resolver found, shared with the event sink.
#[derive(Default)]
struct Chosen {
    version: Option<PyVersion>,
    groups: BTreeSet<ProbeGroup>,
    /// Meaning of each probe index of the installed set, per process.
    meanings: HashMap<i32, Vec<&'static PythonProbe>>,
    object_path: String,
    warning: Option<String>,
}

struct PythonResolver {
    requested: Option<BTreeSet<ProbeGroup>>,
    chosen: Rc<RefCell<Chosen>>,
}

impl Resolver for PythonResolver {
    fn resolve(&mut self, pid: i32) -> Result<Option<ProbeSet>> {
        let Ok(object) = find_probe_object(pid, PROVIDER) else {
            return Ok(None);
        };
        let maps = crate::process::read_maps(pid)?;
        if !object.is_fully_mapped(&maps) {
            return Ok(None);
        }
        let version = version::detect(&object, &ProcessMemory::new(pid));
        let available = available_groups(&object);
        let (groups, warning) = match &self.requested {
            Some(requested) => {
                let missing: Vec<&str> =
                    requested.difference(&available).map(|g| g.name()).collect();
                if !missing.is_empty() {
                    bail!(
                        "{} has no probes for: {} (it has: {})",
                        object.target_path,
                        missing.join(", "),
                        available
                            .iter()
                            .map(|g| g.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                (requested.clone(), None)
            }
            None => default_groups(version, &available),
        };
        let (set, meanings) = probe_set(&object, &groups)?;
        let mut chosen = self.chosen.borrow_mut();
        chosen.version = version;
        chosen.groups = groups;
        chosen.meanings.insert(pid, meanings);
        chosen.object_path = object.target_path.clone();
        chosen.warning = warning;
        Ok(Some(set))
    }
}

/// Turns probe hits into recording events, filtering as asked.
struct EventBuilder {
    /// Created once the interpreter is known (for `-- CMD`, after it has started),
    /// so the header names the right executable and Python version.
    writer: Option<RecordingWriter<std::io::BufWriter<std::fs::File>>>,
    header: Header,
    output: PathBuf,
    /// Events seen before the writer exists (thread starts only: no probe can hit).
    early: Vec<Event>,
    filter: FileFilter,
    start_at: Option<String>,
    /// Per thread: depth inside the `--start-at` function (0: outside).
    inside: HashMap<i32, u32>,
    write_error: Option<std::io::Error>,
    events: u64,
}

impl EventBuilder {
    fn write(&mut self, tid: i32, ts_ns: u64, kind: EventKind) {
        if self.write_error.is_some() {
            return;
        }
        let event = Event {
            tid: tid as u32,
            ts_ns,
            kind,
        };
        let Some(writer) = self.writer.as_mut() else {
            self.early.push(event);
            return;
        };
        match writer.write(&event) {
            Ok(()) => self.events += 1,
            Err(e) => {
                self.write_error = Some(e);
                signals::request_stop();
            }
        }
    }

    /// Creates the recording, completing the header with what is known now.
    fn open(&mut self, pid: i32, chosen: &Chosen) {
        if self.writer.is_some() || self.write_error.is_some() {
            return;
        }
        self.header.executable = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if !chosen.object_path.is_empty() {
            // Through a loader, /proc/PID/exe is the loader: name the interpreter.
            self.header.executable = chosen.object_path.clone();
        }
        self.header.python_version = chosen.version.map(|v| v.to_string()).unwrap_or_default();
        self.header.probes = chosen.groups.iter().map(|g| g.name().to_owned()).collect();
        match RecordingWriter::create(&self.output, &self.header) {
            Ok(w) => self.writer = Some(w),
            Err(e) => {
                self.write_error = Some(e);
                signals::request_stop();
                return;
            }
        }
        for event in std::mem::take(&mut self.early) {
            self.write(event.tid as i32, event.ts_ns, event.kind);
        }
    }

    fn intern(&mut self, s: &str) -> crate::record::StrId {
        match self.writer.as_mut() {
            Some(w) => w.intern(s),
            None => crate::record::StrId(0),
        }
    }

    fn frame(&mut self, hit: &Hit) -> Option<FrameRef> {
        let file = hit.string(0).unwrap_or("");
        if !self.filter.matches(file) {
            return None;
        }
        let line = hit.args.get(2).copied().unwrap_or(0) as u32;
        let file = self.intern(file);
        let function = self.intern(hit.string(1).unwrap_or(""));
        Some(FrameRef {
            file,
            function,
            line,
        })
    }

    /// Whether a function event on `tid` is inside the `--start-at` window,
    /// updating the window on entry to and return from that function.
    fn in_window(&mut self, tid: i32, function: &str, is_call: bool, is_return: bool) -> bool {
        let Some(target) = &self.start_at else {
            return true;
        };
        let depth = self.inside.entry(tid).or_insert(0);
        let matches = function == target.as_str();
        if is_call && matches {
            *depth += 1;
            return true;
        }
        if is_return && matches && *depth > 0 {
            *depth -= 1;
            return true;
        }
        *depth > 0
    }

    fn hit(&mut self, meaning: &PythonProbe, hit: &Hit) {
        let arg = |i: usize| hit.args.get(i).copied().unwrap_or(0);
        let kind = match meaning.name {
            "function__entry" | "function__return" | "line" => {
                let is_call = meaning.name == "function__entry";
                let is_return = meaning.name == "function__return";
                if !self.in_window(hit.tid, hit.string(1).unwrap_or(""), is_call, is_return) {
                    return;
                }
                let Some(frame) = self.frame(hit) else { return };
                match meaning.name {
                    "function__entry" => EventKind::Call { frame },
                    "function__return" => EventKind::Return { frame },
                    _ => EventKind::Line { frame },
                }
            }
            "gc__start" => EventKind::GcStart {
                generation: arg(0) as i64 as i32,
            },
            "gc__done" => EventKind::GcDone {
                collected: arg(0) as i64,
            },
            "import__find__load__start" => EventKind::ImportStart {
                module: self.intern(hit.string(0).unwrap_or("")),
            },
            "import__find__load__done" => EventKind::ImportDone {
                module: self.intern(hit.string(0).unwrap_or("")),
                found: arg(1) as i32 != 0,
            },
            "audit" => EventKind::Audit {
                event: self.intern(hit.string(0).unwrap_or("")),
            },
            _ => return,
        };
        self.write(hit.tid, hit.ts_ns, kind);
    }
}

fn default_output(pid: i32) -> PathBuf {
    PathBuf::from(format!("pyprobe-{pid}.pyprobe"))
}

pub fn run(request: &RecordRequest) -> Result<ExitCode> {
    match request.mode.as_str() {
        "sample" => bail!(
            "`--mode sample` needs the frame walker, which is not implemented yet in this version"
        ),
        "auto" | "trace" => {}
        other => bail!("unknown mode `{other}`"),
    }
    if let Some(out) = &request.output {
        if let Some(ext) = out.extension().and_then(|e| e.to_str()) {
            if matches!(ext, "svg" | "json" | "txt") {
                bail!("writing a view directly (`-o *.{ext}`) is not implemented yet: record to a .pyprobe file");
            }
        }
    }
    let filter =
        FileFilter::new(&request.include, &request.exclude).map_err(|e| anyhow::anyhow!("{e}"))?;
    let requested = if request.probes.is_empty() {
        None
    } else {
        Some(parse_groups(&request.probes)?)
    };
    let chosen = Rc::new(RefCell::new(Chosen::default()));
    let resolver = Box::new(PythonResolver {
        requested,
        chosen: chosen.clone(),
    });
    let options = EngineOptions {
        subprocesses: request.subprocesses,
        guardian: true,
        ..EngineOptions::default()
    };
    signals::install().context("cannot install signal handlers")?;

    let mut early = Vec::new();
    let mut collect = |e: TraceEvent| early.push(format_early(&e));
    let (engine, launched) = match (request.pid, request.command.is_empty()) {
        (Some(pid), true) => {
            check_inspectable(pid)?;
            if pid == std::process::id() as i32 {
                bail!("pyprobe cannot trace itself (pid {pid})");
            }
            if find_probe_object(pid, PROVIDER).is_err() {
                let any = sdt_objects(pid, None).map(|o| o.is_empty()).unwrap_or(true);
                bail!(
                    "process {pid} has no CPython SDT probes{}: it is not a CPython built with --with-dtrace \
                     (sampling without probes comes with the frame walker)",
                    if any { "" } else { " (it has other SDT providers)" }
                );
            }
            (Engine::attach(pid, resolver, options, &mut collect)?, false)
        }
        (None, false) => (
            Engine::launch(&request.command, resolver, options, &mut collect)?,
            true,
        ),
        (Some(_), false) => bail!("give either -p PID or a command after --, not both"),
        (None, true) => bail!("nothing to record: give -p PID or a command after --"),
    };
    let mut engine = engine;
    let pid = engine.root();
    let output = request
        .output
        .clone()
        .unwrap_or_else(|| default_output(pid));
    let header = Header {
        pid: pid as u32,
        command_line: if launched {
            request.command.clone()
        } else {
            cmdline(pid)
        },
        mode: "trace".into(),
        start_ns: monotonic_ns(),
        wall_start_unix_ns: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
        ..Header::default()
    };
    for line in early {
        eprintln!("{line}");
    }
    if !launched {
        print_start_line(&chosen.borrow(), pid, &request.mode);
    }
    let mut builder = EventBuilder {
        writer: None,
        header,
        output: output.clone(),
        early: Vec::new(),
        filter,
        start_at: request.start_at.clone(),
        inside: HashMap::new(),
        write_error: None,
        events: 0,
    };
    if !launched {
        builder.open(pid, &chosen.borrow());
    }
    if let Some(d) = request.duration {
        signals::set_deadline(d);
    }
    let mode = request.mode.clone();
    // A launched command gets its start line once its interpreter is found.
    let mut announced = false;
    let outcome = engine.run(&mut |event| match event {
        TraceEvent::Hit(hit) => {
            // A child traced under --subprocesses runs its parent's probe set: go by name.
            let meaning = chosen.borrow().meanings.get(&hit.pid).and_then(|m| m.get(hit.probe).copied())
                .or_else(|| PROBES.iter().find(|p| p.name == hit.probe_name));
            if let Some(meaning) = meaning {
                builder.hit(meaning, &hit);
            }
        }
        TraceEvent::ThreadStart { tid, ts_ns, .. } => builder.write(tid, ts_ns, EventKind::ThreadStart),
        TraceEvent::ThreadExit { tid, ts_ns, .. } => builder.write(tid, ts_ns, EventKind::ThreadExit),
        TraceEvent::Installed { pid, sites, refused } => {
            if launched && !announced {
                announced = true;
                print_start_line(&chosen.borrow(), pid, &mode);
                builder.open(pid, &chosen.borrow());
            }
            eprintln!("pyprobe: {sites} probe sites armed in process {pid}");
            for (addr, byte) in refused {
                eprintln!("pyprobe: refused site {addr:#x} in process {pid}: byte {byte:#04x} is not a nop");
            }
        }
        TraceEvent::Notice(text) => eprintln!("pyprobe: {text}"),
        TraceEvent::Tick { .. } => {}
    });
    let hits = engine.hits();
    drop(engine);
    let end_ns = monotonic_ns();
    let events = builder.events;
    let write_error = builder.write_error.take();
    let outcome = outcome?;
    let Some(writer) = builder.writer.take() else {
        let why = write_error
            .map(|e| e.to_string())
            .unwrap_or_else(|| "no CPython probes were found in the command".into());
        eprintln!("pyprobe: nothing recorded: {why}");
        return Ok(exit_code(outcome, launched, pid));
    };
    let summary = writer.finish(end_ns);
    if let Some(e) = write_error {
        eprintln!("pyprobe: writing {} failed ({e}); detached from the target, which runs on. What was written before reads back.", output.display());
        return Ok(ExitCode::from(1));
    }
    let summary = summary.with_context(|| format!("cannot finish {}", output.display()))?;
    eprintln!(
        "pyprobe: {hits} probe hits, {events} events written to {} ({} bytes){}",
        output.display(),
        summary.bytes,
        match outcome {
            Outcome::Detached(StopReason::Duration) => "; duration reached, detached".to_string(),
            Outcome::Detached(StopReason::Signal(s)) => format!("; {s} received, detached"),
            Outcome::Detached(StopReason::Internal) => "; detached".to_string(),
            Outcome::Exited(code) => format!("; target exited with status {code}"),
            Outcome::Killed(sig) => format!("; target killed by {sig}"),
        }
    );
    Ok(exit_code(outcome, launched, pid))
}

fn print_start_line(chosen: &Chosen, pid: i32, mode: &str) {
    let version = chosen
        .version
        .map(|v| v.to_string())
        .unwrap_or_else(|| "?".into());
    let groups: Vec<&str> = chosen.groups.iter().map(|g| g.name()).collect();
    let why = if mode == "auto" {
        "mode auto: tracing probes exactly (the sampler is not built yet)"
    } else {
        "mode trace: every probe hit recorded exactly"
    };
    eprintln!(
        "pyprobe: process {pid}, CPython {version} ({}): {why}; probes: {}",
        chosen.object_path,
        groups.join(",")
    );
    if let Some(w) = &chosen.warning {
        eprintln!("pyprobe: note: {w}");
    }
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
