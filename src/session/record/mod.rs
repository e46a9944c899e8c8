//! `pyprobe record`: attach to or start a CPython process, trace its probes through
//! the ptrace engine, and stream the events into a recording.

use std::cell::RefCell;
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{bail, Context, Result};

use pyprobe_sdt::tracer::signals;
use pyprobe_sdt::tracer::{Engine, RingUse};

use attaching::Attaching;
use recorder::Recorder;
use resolver::{Chosen, PythonResolver};
use settings::{check_attachable, Settings};

pub use events::EventBuilder;
pub use request::{HookUse, RecordRequest, Target};
pub use resolver::Mode;

mod attaching;
mod codes;
mod events;
mod finishing;
mod lines;
mod periods;
mod plan_ahead;
mod qualnames;
mod recorder;
mod repeats;
mod request;
mod resolver;
mod return_types;
mod sampler;
mod settings;
mod status;

pub fn run(request: &RecordRequest) -> Result<ExitCode> {
    let mut settings = Settings::check(request)?;
    let chosen = Rc::new(RefCell::new(Chosen::default()));
    let resolver = Box::new(PythonResolver {
        mode: settings.mode,
        capture_stacks: request.ring != RingUse::Off,
        requested: settings.requested.take(),
        chosen: chosen.clone(),
        hook: request.hook,
        budgeted: settings.budget.is_some(),
    });
    let options = settings.engine_options();
    signals::install().context("cannot install signal handlers")?;
    let attached = match &request.target {
        Some(Target::Attach(pid)) => Some(*pid),
        _ => None,
    };
    let mut attaching = Attaching::new(attached, chosen.clone(), request.verbose);
    let mut collect = |e: pyprobe_sdt::tracer::TraceEvent| attaching.collect(e);
    let (mut engine, launched) = match &request.target {
        Some(Target::Attach(pid)) => {
            check_attachable(*pid, settings.mode, request.hook)?;
            (
                Engine::attach(*pid, resolver, options, &mut collect)?,
                false,
            )
        }
        Some(Target::Launch(command)) => (
            Engine::launch(command, resolver, options, &mut collect)?,
            true,
        ),
        None => bail!("nothing to record: give -p PID or a command after --"),
    };
    let mut recorder = Recorder::start(settings, chosen, attaching, engine.root(), launched)?;
    if let Some(d) = request.duration {
        signals::set_deadline(d);
    }
    let outcome = engine.run(&mut |event| recorder.on_event(event));
    recorder.finish(engine, outcome)
}
