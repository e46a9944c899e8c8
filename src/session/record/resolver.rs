//! Finding what to trace in a process image, per mode: the probe groups of the
//! interpreter's SDT notes, or nothing but the interpreter itself when sampling.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;

use anyhow::Result;

use pyprobe_cpython::python::probe_catalog::{
    ProbeGroup, ProbeKind, PythonProbe, PROBES, PROVIDER,
};
use pyprobe_cpython::python::tracing::{
    available_groups, default_groups, probe_set, trace_refusal, FrameArgs,
};
use pyprobe_cpython::python::version::{self, PyVersion};
use pyprobe_cpython::python::walker::find_interpreter_object;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::process::objects::{find_probe_object, LoadedObject};
use pyprobe_sdt::tracer::patch::check_semaphore;
use pyprobe_sdt::tracer::{NotTraceable, ProbeSet, Resolver};

/// How function stacks are seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Sampling for functions; GC, import and audit exact through their probes.
    #[default]
    Auto,
    /// Every probe hit, functions included.
    Trace,
    /// Sampling only, no probes.
    Sample,
}

impl Mode {
    /// Its name on the command line and in the recording's header.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Auto => "auto",
            Mode::Trace => "trace",
            Mode::Sample => "sample",
        }
    }
}

/// What the resolver found, shared with the event sink.
#[derive(Default)]
pub struct Chosen {
    pub version: Option<PyVersion>,
    pub groups: BTreeSet<ProbeGroup>,
    /// Meaning of each probe index of the installed set, per process.
    meanings: rustc_hash::FxHashMap<i32, Vec<&'static PythonProbe>>,
    /// Bumped whenever `meanings` changes, so a copy of one process's meanings
    /// can tell it is still current ([`MeaningCache`]).
    generation: u64,
    pub object_path: String,
    pub warning: Option<String>,
    /// The interpreter carries SDT probes (built with --with-dtrace).
    pub has_probes: bool,
    /// Per process: sites and semaphores left alone, one sentence each.
    pub refusals: rustc_hash::FxHashMap<i32, Vec<String>>,
    /// Why ring trampolines cannot capture stacks here was said already.
    pub stack_fallback_said: bool,
    /// Calls and returns come from the injected hook engine.
    pub hook: bool,
    /// Why the last process looked at was not an interpreter pyprobe reads (said
    /// when a launched command ends with nothing recorded).
    pub unreadable: Option<String>,
}

impl Chosen {
    /// Why the recording of `pid` cannot tell a generator's or coroutine's resumes
    /// from its calls, if it cannot: its entries come from `function__entry`
    /// sites of CPython 3.7 to 3.10 that do not show the frame's `f_lasti`
    /// (3.10's, or a build compiled otherwise than pyprobe knows).
    pub fn resumes_untold(&self, pid: i32) -> Option<String> {
        let before_311 = self.version.is_some_and(|v| !v.at_least(3, 11));
        let plain_entries = self
            .meanings
            .get(&pid)?
            .iter()
            .any(|m| m.kind == ProbeKind::FunctionEntry);
        (before_311 && plain_entries && !self.hook).then(|| {
            "this interpreter's function__entry probe does not show where a frame stands, \
             so the resumes of generators and coroutines are counted as calls"
                .to_string()
        })
    }

    /// The meanings of the probe set just installed in `pid`.
    pub fn set_meanings(&mut self, pid: i32, meanings: Vec<&'static PythonProbe>) {
        self.meanings.insert(pid, meanings);
        self.generation += 1;
    }

    /// What probe `probe` of `pid` stands for. A child traced under
    /// `--subprocesses` runs its parent's probe set: then it goes by `name`.
    pub fn meaning(&self, pid: i32, probe: usize, name: &str) -> Option<&'static PythonProbe> {
        self.meanings
            .get(&pid)
            .and_then(|m| m.get(probe).copied())
            .or_else(|| PROBES.iter().find(|p| p.name == name))
    }
}

/// One process's probe meanings, copied out of [`Chosen`] for the hits that follow
/// (a hash look-up per hit was a twentieth of pyprobe's time reading a ring), and
/// copied again once `Chosen`'s meanings change.
#[derive(Default)]
pub struct MeaningCache {
    pid: i32,
    generation: u64,
    by_probe: Vec<&'static PythonProbe>,
}

impl MeaningCache {
    /// [`Chosen::meaning`], through the copy when it is current.
    pub fn meaning(
        &mut self,
        chosen: &Chosen,
        pid: i32,
        probe: usize,
        name: &str,
    ) -> Option<&'static PythonProbe> {
        if self.pid != pid || self.generation != chosen.generation {
            let Some(meanings) = chosen.meanings.get(&pid) else {
                return chosen.meaning(pid, probe, name);
            };
            self.pid = pid;
            self.generation = chosen.generation;
            self.by_probe.clone_from(meanings);
        }
        match self.by_probe.get(probe) {
            Some(meaning) => Some(*meaning),
            None => chosen.meaning(pid, probe, name),
        }
    }
}

/// Continuation slots of a stack record: one, up to 15 frames, innermost first.
/// The views show a GC's innermost frame and an audit event's innermost 8, and
/// each frame walked in the target costs (a page check, on generators a system
/// call): black's `id()` audit events, 10 to 90 frames deep, cost 2.8 µs each
/// walked whole.
const STACK_SLOTS: u8 = 1;

/// The offsets ring trampolines walk `pid`'s frames by (the frame walker's own).
fn stack_capture(pid: i32) -> Result<pyprobe_sdt::ring::StackCapture, String> {
    pyprobe_cpython::python::walker::Walker::attach(pid)
        .map_err(|e| format!("{e:#}"))?
        .stack_capture(STACK_SLOTS)
}

/// Where the interpreter's frames keep their code object, as the frame walker reads them.
fn frame_code_layout(pid: i32) -> Option<pyprobe_cpython::python::walker::FrameCodeLayout> {
    pyprobe_cpython::python::walker::Walker::attach(pid)
        .ok()?
        .frame_code_layout()
}

/// Whether the stack at a GC/import/audit hit must come from the frame walker (or
/// the ring's capture): yes, unless entries and returns are all traced, by the
/// function probes (3.11's trace returns only) or the hook (`hook`), whose calls
/// rebuild it.
pub fn needs_context_stacks(
    mode: Mode,
    version: Option<PyVersion>,
    groups: &BTreeSet<ProbeGroup>,
    hook: bool,
) -> bool {
    mode != Mode::Trace
        || returns_only(version, groups, hook)
        || !(hook || groups.contains(&ProbeGroup::Function))
}

/// Whether function calls are traced from return probes only (CPython 3.11 without
/// the hook engine, which gives entries too): trace mode then samples stacks
/// alongside, for times.
pub fn returns_only(version: Option<PyVersion>, groups: &BTreeSet<ProbeGroup>, hook: bool) -> bool {
    !hook && version.is_some_and(|v| v.is(3, 11)) && groups.contains(&ProbeGroup::Function)
}

/// Whether the stacks sampled at a tick are recorded: always, but beside an
/// exact trace (`alongside`), only where its probes give returns only.
pub fn samples_used(alongside: bool, chosen: &Chosen) -> bool {
    !alongside || returns_only(chosen.version, &chosen.groups, chosen.hook)
}

pub struct PythonResolver {
    pub mode: Mode,
    /// GC, import and audit hits may go through the ring with their stacks captured
    /// in the target (every engine but `int3`).
    pub capture_stacks: bool,
    pub requested: Option<BTreeSet<ProbeGroup>>,
    pub chosen: Rc<RefCell<Chosen>>,
    /// Whether calls may come from the injected hook engine.
    pub hook: super::HookUse,
    /// An overhead budget applies (`--max-overhead`, or the default mode's).
    pub budgeted: bool,
}

impl PythonResolver {
    fn groups(
        &self,
        object: &LoadedObject,
        version: Option<PyVersion>,
    ) -> Result<(BTreeSet<ProbeGroup>, Option<String>)> {
        let available = available_groups(object);
        if let Some(requested) = &self.requested {
            let missing: Vec<&str> = requested.difference(&available).map(|g| g.name()).collect();
            if !missing.is_empty() {
                // Refused as untraceable: a launched command ends here, before it
                // runs untraced.
                return Err(NotTraceable(format!(
                    "{} has no probes for: {} (it has: {}); leave {} out of --probes",
                    object.target_path,
                    missing.join(", "),
                    available
                        .iter()
                        .map(|g| g.name())
                        .collect::<Vec<_>>()
                        .join(", "),
                    if missing.len() == 1 { "it" } else { "them" }
                ))
                .into());
            }
            return Ok((requested.clone(), None));
        }
        let (mut groups, warning) = default_groups(version, &available);
        if self.mode == Mode::Auto {
            // Function stacks come from sampling; the rare events stay exact.
            groups.remove(&ProbeGroup::Function);
            return Ok((groups, None));
        }
        Ok((groups, warning))
    }
}

/// What will be left alone in `pid`: what the ELF checks refused, and semaphores
/// holding more than a count now (the patcher refuses those again when it raises).
fn refusals(object: &LoadedObject, set: &ProbeSet, pid: i32) -> Vec<String> {
    let mut out: Vec<String> = set
        .refused
        .iter()
        .map(|r| format!("{}: {}", object.target_path, r.reason))
        .collect();
    let mem = ProcessMemory::new(pid);
    for probe in &set.probes {
        let Some(sem) = probe.semaphore else { continue };
        if let Ok(value) = mem.read_u16(sem) {
            if let Err(why) = check_semaphore(sem, value) {
                out.push(format!("{why}; probe {} not armed", probe.name));
            }
        }
    }
    out
}

impl Resolver for PythonResolver {
    fn event_source(
        &mut self,
    ) -> Option<Box<dyn pyprobe_sdt::tracer::engine::source::EventSource>> {
        Some(Box::new(pyprobe_cpython::hook_engine::HookBook::default()))
    }

    fn samples_used(&self, _pid: i32) -> bool {
        samples_used(
            self.mode == Mode::Trace && !self.budgeted,
            &self.chosen.borrow(),
        )
    }

    fn resolve(&mut self, pid: i32) -> Result<Option<ProbeSet>> {
        let maps = pyprobe_sdt::process::read_maps(pid)?;
        let with_probes = if self.mode == Mode::Sample {
            None
        } else {
            find_probe_object(pid, PROVIDER).ok()
        };
        let object = match with_probes {
            Some(o) => o,
            None => match find_interpreter_object(pid) {
                Ok(o) => o,
                Err(e) => {
                    self.chosen.borrow_mut().unreadable = Some(format!("{e:#}"));
                    return Ok(None);
                }
            },
        };
        if !object.is_fully_mapped(&maps) {
            return Ok(None);
        }
        let version = version::detect(&object, &ProcessMemory::new(pid));
        let use_hook = self.use_hook(&object, version)?;
        if self.mode == Mode::Trace && !use_hook {
            // An engine of probes asked for where the hook would have served.
            let hook_would = self.hook == super::HookUse::Never
                && version.is_some_and(|v| pyprobe_cpython::hook_engine::refusal(v).is_none());
            if let Some(why) = trace_refusal(&object, version, self.requested.as_ref(), hook_would)
            {
                return Err(NotTraceable(why).into());
            }
        }
        // With the hook, the probes serve every group but calls.
        let requested_before = self.requested.clone();
        if use_hook {
            if let Some(r) = self.requested.as_mut() {
                r.remove(&ProbeGroup::Function);
            }
        }
        let result = self.resolve_probes(pid, object, version, use_hook);
        self.requested = requested_before;
        result
    }
}

impl PythonResolver {
    /// Whether the hook engine gives the calls of this interpreter: `--engine hook`,
    /// or `auto` in trace mode where the interpreter has no function probes and the
    /// hook serves its version. `--engine hook` on a version it does not serve is
    /// refused in one sentence.
    fn use_hook(&self, object: &LoadedObject, version: Option<PyVersion>) -> Result<bool> {
        let wants_calls = self
            .requested
            .as_ref()
            .is_none_or(|r| r.contains(&ProbeGroup::Function));
        if self.mode != Mode::Trace || !wants_calls {
            return Ok(false);
        }
        let served = version.and_then(pyprobe_cpython::hook_engine::refusal);
        let hooked = self.hook_serves(object, version, served)?;
        if hooked && self.budgeted {
            // The hook has no pause: a budget would be charged nothing for its calls
            // and say "held" over a run it slowed many times over.
            return Err(NotTraceable(format!(
                "{}: an overhead budget (--max-overhead) cannot limit the calls of the hook \
                 engine, which pyprobe cannot pause; drop --max-overhead to trace every call \
                 exactly, or use the default mode, which samples stacks within the budget",
                version.map_or_else(|| object.target_path.clone(), |v| format!("CPython {v}"))
            ))
            .into());
        }
        Ok(hooked)
    }

    /// [`use_hook`](Self::use_hook) before the budget is considered.
    fn hook_serves(
        &self,
        object: &LoadedObject,
        version: Option<PyVersion>,
        served: Option<String>,
    ) -> Result<bool> {
        match self.hook {
            super::HookUse::Never => Ok(false),
            super::HookUse::Always => match (version, served) {
                (None, _) => Err(NotTraceable(format!(
                    "{}: the CPython version is unknown, so the hook engine cannot serve it",
                    object.target_path
                ))
                .into()),
                (Some(_), Some(why)) => Err(NotTraceable(why).into()),
                (Some(_), None) => Ok(true),
            },
            // The SDT probes where entries and returns both fire (3.11's entries
            // do not), else the hook; and the hook where it is a `sys.monitoring`
            // tool (3.15 with probes), which costs less per call than the probes'
            // trampolines, unless only the probes give what was asked.
            super::HookUse::Auto => Ok(version.is_some_and(|v| {
                served.is_none()
                    && (v.is(3, 11)
                        || !available_groups(object).contains(&ProbeGroup::Function)
                        || (v.at_least(3, 12) && !self.needs_function_probes()))
            })),
        }
    }

    /// What only the function probes give: a budget can pause them (the hook
    /// cannot be paused), and they fire beside the `line` probe. (Forked children
    /// keep the hook, with a ring of their own, as they keep the probes.)
    fn needs_function_probes(&self) -> bool {
        self.budgeted
            || self
                .requested
                .as_ref()
                .is_some_and(|r| r.contains(&ProbeGroup::Line))
    }

    fn resolve_probes(
        &mut self,
        pid: i32,
        object: LoadedObject,
        version: Option<PyVersion>,
        use_hook: bool,
    ) -> Result<Option<ProbeSet>> {
        let has_probes = object.has_provider(PROVIDER);
        let (set, meanings, groups, warning) = if has_probes && self.mode != Mode::Sample {
            let (mut groups, warning) = self.groups(&object, version)?;
            if use_hook {
                groups.remove(&ProbeGroup::Function);
            }
            let frame = version.is_some_and(|v| v.at_least(3, 11))
                && groups.contains(&ProbeGroup::Function);
            let frame_args = FrameArgs {
                frame,
                code: frame.then(|| frame_code_layout(pid)).flatten(),
                lasti: version.is_some_and(|v| !v.at_least(3, 11))
                    && groups.contains(&ProbeGroup::Function),
            };
            let (mut set, meanings) = probe_set(&object, &groups, frame_args)?;
            let refusals = refusals(&object, &set, pid);
            self.chosen.borrow_mut().refusals.insert(pid, refusals);
            if needs_context_stacks(self.mode, version, &groups, use_hook) {
                let context: Vec<usize> = meanings
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.kind.has_context())
                    .map(|(i, _)| i)
                    .collect();
                let capture = if self.capture_stacks {
                    stack_capture(pid)
                } else {
                    Err("--engine int3".to_string())
                };
                match capture {
                    // The ring's trampolines capture the stack at these hits themselves.
                    Ok(capture) => {
                        set.stack_capture = Some(capture);
                        // Over budget an audit storm is counted, not recorded: it
                        // opens nothing that a later probe closes (GC, imports do).
                        set.count_when_thin = context
                            .iter()
                            .copied()
                            .filter(|&i| meanings[i].kind == ProbeKind::Audit)
                            .collect();
                        set.stack_probes = context;
                    }
                    // The frame walker reads the stack at these hits: they must stop.
                    // Over budget an audit storm's stops go first.
                    Err(why) => {
                        set.count_when_thin = context
                            .iter()
                            .copied()
                            .filter(|&i| meanings[i].kind == ProbeKind::Audit)
                            .collect();
                        let mut chosen = self.chosen.borrow_mut();
                        if self.capture_stacks
                            && !std::mem::replace(&mut chosen.stack_fallback_said, true)
                        {
                            eprintln!(
                                "pyprobe: GC, import and audit hits stop the target (int3) \
                                 for their stacks: the ring cannot capture them here: {why}"
                            );
                        }
                        set.needs_stop = context;
                    }
                }
            }
            (set, meanings, groups, warning)
        } else {
            (ProbeSet::default(), Vec::new(), BTreeSet::new(), None)
        };
        let (mut set, mut groups) = (set, groups);
        if use_hook {
            set.hook = true;
            groups.insert(ProbeGroup::Function);
        }
        let mut chosen = self.chosen.borrow_mut();
        chosen.version = version;
        chosen.groups = groups;
        chosen.set_meanings(pid, meanings);
        chosen.object_path = object.target_path.clone();
        chosen.warning = warning;
        chosen.has_probes = has_probes;
        chosen.hook = use_hook;
        Ok(Some(set))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn probe(name: &str) -> &'static PythonProbe {
        PROBES
            .iter()
            .find(|p| p.name == name)
            .expect("catalog probe")
    }

    /// The copy answers as `Chosen` does, and follows a process's new probe set
    /// (after an exec) and a second process.
    #[test]
    fn meaning_cache_follows_the_chosen_meanings() {
        let mut chosen = Chosen::default();
        let mut cache = MeaningCache::default();
        let mut named = |chosen: &Chosen, pid: i32, probe: usize, name: &str| {
            cache.meaning(chosen, pid, probe, name).map(|p| p.name)
        };
        let (entry, gc) = (probe("function__entry"), probe("gc__start"));
        chosen.set_meanings(10, vec![entry, gc]);
        assert_eq!(named(&chosen, 10, 1, "x"), Some("gc__start"));
        assert_eq!(named(&chosen, 10, 0, "x"), Some("function__entry"));
        // The same process, another probe set: probe 0 means something else now.
        chosen.set_meanings(10, vec![gc]);
        assert_eq!(named(&chosen, 10, 0, "x"), Some("gc__start"));
        // Past the set, or a process without one: by the probe's name.
        assert_eq!(
            named(&chosen, 10, 5, "function__entry"),
            Some("function__entry")
        );
        assert_eq!(named(&chosen, 11, 0, "gc__start"), Some("gc__start"));
        assert_eq!(named(&chosen, 11, 0, "no__such"), None);
        chosen.set_meanings(11, vec![entry]);
        assert_eq!(named(&chosen, 11, 0, "x"), Some("function__entry"));
        assert_eq!(named(&chosen, 10, 0, "x"), Some("gc__start"));
    }
}
