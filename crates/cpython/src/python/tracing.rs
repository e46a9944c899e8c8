//! Choosing which CPython probes to trace, and building the engine's probe set.

use std::collections::BTreeSet;

use anyhow::{bail, Result};

use super::entry_lasti::lasti_operand;
use super::probe_catalog::{
    lookup, ArgKind, ProbeGroup, PythonProbe, ENTRY_WITH_LASTI, LASTI_ARG, PROVIDER,
};
use super::version::PyVersion;
use super::walker::FrameCodeLayout;
use pyprobe_sdt::elf::FirstArgProof;
use pyprobe_sdt::probe_set::{usable_sites, GuardedArgs, Probe, ProbeSet, Site};
use pyprobe_sdt::process::objects::LoadedObject;
use pyprobe_sdt::sdt;
use pyprobe_sdt::sdt::ArgSpec;

/// The groups traced when the user does not choose, with a warning to print when
/// the version limits what they give.
pub fn default_groups(
    version: Option<PyVersion>,
    available: &BTreeSet<ProbeGroup>,
) -> (BTreeSet<ProbeGroup>, Option<String>) {
    let mut groups: BTreeSet<ProbeGroup> = available
        .iter()
        .copied()
        .filter(|g| *g != ProbeGroup::Line)
        .collect();
    let mut warning = None;
    if version.is_some_and(|v| v.is(3, 11)) && groups.contains(&ProbeGroup::Function) {
        warning = Some(
            "CPython 3.11: function__entry fires only while a tracing hook is set, so calls are counted \
             from function__return (exact counts) and times come from stacks sampled alongside; line \
             is off (incomplete, gh-98894)"
                .to_string(),
        );
    }
    if !available.contains(&ProbeGroup::Function) {
        groups.remove(&ProbeGroup::Function);
    }
    (groups, warning)
}

/// Why `--mode trace` through the probes cannot count the calls of this
/// interpreter (it has no function probes), in one sentence naming what works
/// instead (the hook engine, where `hook_would` says it serves this interpreter
/// and only an engine of probes was asked for); `None` when it can, or when the
/// user chose probe groups without function probes.
pub fn trace_refusal(
    object: &LoadedObject,
    version: Option<PyVersion>,
    requested: Option<&BTreeSet<ProbeGroup>>,
    hook_would: bool,
) -> Option<String> {
    if requested.is_some_and(|r| !r.contains(&ProbeGroup::Function)) {
        return None;
    }
    let available = available_groups(object);
    if available.contains(&ProbeGroup::Function) {
        return None;
    }
    let name = match version {
        Some(v) => format!("CPython {v} ({})", object.target_path),
        None => object.target_path.to_string(),
    };
    let why = if available.is_empty() {
        "has no SDT probes (it was built without --with-dtrace)".to_string()
    } else {
        let groups: Vec<&str> = available.iter().map(|g| g.name()).collect();
        format!(
            "has no function probes (only {}; CPython 3.12 to 3.14 never have them)",
            groups.join(", ")
        )
    };
    if hook_would {
        return Some(format!(
            "{name} {why}, so `--engine int3` and `--engine ring` cannot count its calls; \
             the hook engine can: `--engine auto` (the default) or `--engine hook`"
        ));
    }
    let instead = if available.is_empty() {
        "the default mode (or --mode sample) samples its stacks".to_string()
    } else {
        "the default mode samples its stacks and traces its other events exactly".to_string()
    };
    Some(format!(
        "{name} {why}, so `--mode trace` cannot count its calls exactly; {instead}"
    ))
}

/// Parses `--probes a,b,c`.
pub fn parse_groups(names: &[String]) -> Result<BTreeSet<ProbeGroup>> {
    names
        .iter()
        .map(|n| {
            ProbeGroup::parse(n.trim()).ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown probe group `{n}` (choose from function, gc, import, audit, line)"
                )
            })
        })
        .collect()
}

/// Index of the argument pyprobe adds to the function probes of CPython 3.11+:
/// the `_PyInterpreterFrame *` their site's function keeps in a register (see
/// [`probe_set`]), after the three the note lists.
pub const FRAME_ARG: usize = 3;

/// Index of the argument after [`FRAME_ARG`]: the frame's code word (the code
/// object, with the tag bits 3.14+ keep in it), read at the site. Given only
/// where the site's own code reads that word through the same register on its
/// way to the site (see [`pyprobe_sdt::elf::FirstArgProof`]), so the read cannot fault;
/// the ring's trampolines read it in the target only where no branch lands
/// between the function's start and the site ([`pyprobe_sdt::probe_set::GuardedArgs`]).
pub const CODE_ARG: usize = 4;

/// Index of the argument after [`CODE_ARG`]: the `co_firstlineno` of the code
/// object that word points to, read at the site. Given where the site's code
/// reads that code object's header through the word as far as the first line;
/// guarded as [`CODE_ARG`] is. The one answer that does not depend on the code
/// object still being there when pyprobe reads the record (a class body's code
/// object is freed as soon as the class is made).
pub const FIRST_LINE_ARG: usize = 5;

/// What [`probe_set`] adds to the function probes of CPython 3.11+.
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameArgs {
    /// Add the frame ([`FRAME_ARG`]) where the site's code shows its register.
    pub frame: bool,
    /// Where frames keep their code object, when known: add the code word
    /// ([`CODE_ARG`]) and its first line ([`FIRST_LINE_ARG`]) where the site's
    /// code proves them readable.
    pub code: Option<FrameCodeLayout>,
    /// Before 3.11: add the frame's `f_lasti` to `function__entry`
    /// ([`ENTRY_WITH_LASTI`]) where the site's code shows where it is, so that
    /// resumes are told from calls (see [`entry_lasti`](super::entry_lasti)).
    pub lasti: bool,
}

/// Whether `probe` (by name) gets the frame argument at its sites.
fn takes_frame_arg(name: &str) -> bool {
    matches!(name, "function__entry" | "function__return")
}

/// `co_firstlineno` through the code word `word` (an `8@off(%reg)` argument),
/// where the site's code read the code object at least that far.
fn first_line_arg(word: &ArgSpec, proof: &FirstArgProof, code: FrameCodeLayout) -> Option<ArgSpec> {
    let sdt::Operand::Memory(pointer) = &word.operand else {
        return None;
    };
    let needed = code.first_line.checked_add(4)? as i64;
    let read = proof
        .read_through
        .iter()
        .any(|&(w, end)| w == code.word as i64 && end >= needed);
    read.then(|| ArgSpec {
        size: 4,
        signed: true,
        operand: sdt::Operand::Through(sdt::Through {
            pointer: pointer.clone(),
            mask: !code.tag_mask,
            offset: code.first_line as i64,
        }),
    })
}

/// The probe groups an object carries.
pub fn available_groups(object: &LoadedObject) -> BTreeSet<ProbeGroup> {
    object
        .elf
        .provider_probes(PROVIDER)
        .filter_map(|p| lookup(&p.name).map(|k| k.group))
        .collect()
}

/// The engine's probe set for `groups`, and for each probe index its meaning.
///
/// With `frame_args.frame` (CPython 3.11+, whose frames are
/// `_PyInterpreterFrame`s), each function probe site whose code keeps its
/// function's argument (the frame) in a register gets that register as one more
/// argument ([`FRAME_ARG`]): recorded as a value by either engine (never followed
/// in the target), checked against the names the probe passes before pyprobe
/// relies on it. With `frame_args.code_word` too, where the site's code proves the
/// frame's code word readable, that word follows ([`CODE_ARG`]), guarded.
pub fn probe_set(
    object: &LoadedObject,
    groups: &BTreeSet<ProbeGroup>,
    frame_args: FrameArgs,
) -> Result<(ProbeSet, Vec<&'static PythonProbe>)> {
    let mut set = ProbeSet::default();
    let mut meanings = Vec::new();
    for probe in object.elf.provider_probes(PROVIDER) {
        let Some(meaning) = lookup(&probe.name) else {
            continue;
        };
        if !groups.contains(&meaning.group) {
            // Not armed: what its checks refuse is nobody's concern here.
            let usable = usable_sites(object, probe, &mut Vec::new());
            let addresses = usable.iter().map(|s| object.runtime(s.address));
            set.unarmed_sites.extend(addresses);
            set.unarmed_semaphores
                .extend(probe.semaphore.map(|s| object.runtime(s)));
            continue;
        }
        let usable = usable_sites(object, probe, &mut set.refused);
        if usable.is_empty() {
            set.unarmed_semaphores
                .extend(probe.semaphore.map(|s| object.runtime(s)));
            continue;
        }
        let mut sites = Vec::new();
        let mut with_lasti = false;
        let addr2line = (frame_args.lasti && probe.name == "function__entry")
            .then(|| object.elf.symbols.address("PyCode_Addr2Line"))
            .flatten();
        for site in usable {
            let mut args = sdt::parse_args(&site.args)?;
            let mut guarded = None;
            let lasti = addr2line
                .filter(|_| args.len() == LASTI_ARG)
                .and_then(|a| lasti_operand(&site.lead_in, site.address, a));
            if let Some(lasti) = lasti {
                args.extend(sdt::parse_args(&lasti.spec)?);
                guarded = Some(GuardedArgs {
                    from: LASTI_ARG,
                    function_start: object.runtime(lasti.load_at),
                });
                with_lasti = true;
            }
            let frame_register = site
                .first_arg
                .filter(|_| frame_args.frame && takes_frame_arg(&probe.name));
            if let Some(register) = frame_register {
                // Only where the note lists exactly what the catalog says: the
                // frame goes at a known index.
                if args.len() == FRAME_ARG {
                    args.extend(sdt::parse_args(&format!("8@{register}"))?);
                    let proof = site.first_arg_proof.as_ref();
                    let proven = proof
                        .zip(frame_args.code)
                        .filter(|(proof, code)| proof.loaded.contains(&(code.word as i64)));
                    if let Some((proof, code)) = proven {
                        let word = sdt::parse_args(&format!("8@{}({register})", code.word))?;
                        let first_line = first_line_arg(&word[0], proof, code);
                        args.extend(word);
                        args.extend(first_line);
                        guarded = Some(GuardedArgs {
                            from: CODE_ARG,
                            function_start: object.runtime(proof.function_start),
                        });
                    }
                }
            }
            for arg in &args {
                if let Some(name) = arg.operand.symbol() {
                    match object.elf.symbols.address(name) {
                        Some(a) => set.symbols.push((name.to_owned(), object.runtime(a))),
                        None => bail!(
                            "probe {} uses symbol `{name}`, which {} does not define (stripped?)",
                            probe.name,
                            object.target_path
                        ),
                    }
                }
            }
            sites.push(Site {
                address: object.runtime(site.address),
                args,
                guarded,
            });
        }
        if matches!(meaning.group, ProbeGroup::Function | ProbeGroup::Line) {
            // Hit per call or per line: what an overhead budget turns off.
            set.budgeted.push(set.probes.len());
        }
        set.probes.push(Probe {
            name: probe.name.clone(),
            semaphore: probe.semaphore.map(|s| object.runtime(s)),
            sites,
            string_args: meaning
                .args
                .iter()
                .map(|(_, k)| *k == ArgKind::String)
                .collect(),
        });
        // Sites without it pass three arguments: their entries stay calls.
        meanings.push(if with_lasti {
            &ENTRY_WITH_LASTI
        } else {
            meaning
        });
    }
    Ok((set, meanings))
}
