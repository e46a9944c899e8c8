//! `pyprobe probes [-p PID | PATH]`: list SDT probes with their decoded argument specs.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};

use pyprobe_cpython::python;
use pyprobe_recording::output::probes::{
    render_json, render_table, DecodedArg, ObjectProbes, ProbeListing, ProbeRow, SiteRow,
};
use pyprobe_sdt::elf::{ElfInfo, SdtProbe};
use pyprobe_sdt::process::{objects, ProcessStatus};
use pyprobe_sdt::sdt;

pub struct ProbesRequest {
    pub pid: Option<i32>,
    pub path: Option<PathBuf>,
    pub provider: Option<String>,
    pub json: bool,
}

pub fn run(request: &ProbesRequest) -> Result<ExitCode> {
    let listing = match (request.pid, &request.path) {
        (Some(pid), _) => listing_for_process(pid, request.provider.as_deref())?,
        (None, Some(path)) => listing_for_file(path, request.provider.as_deref())?,
        (None, None) => bail!("give a PATH or -p PID"),
    };
    let text = if request.json {
        render_json(&listing) + "\n"
    } else {
        render_table(&listing)
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("cannot write to standard output")?;
    Ok(ExitCode::SUCCESS)
}

pub fn listing_for_file(path: &std::path::Path, provider: Option<&str>) -> Result<ProbeListing> {
    let elf = ElfInfo::read(path)?;
    Ok(ProbeListing {
        pid: None,
        ns_pid: None,
        objects: vec![object_probes(
            path.display().to_string(),
            &elf,
            None,
            provider,
        )],
    })
}

pub fn listing_for_process(pid: i32, provider: Option<&str>) -> Result<ProbeListing> {
    let status = pyprobe_sdt::process::status::check_inspectable(pid)?;
    // Default for a live process: the python provider when present, else all.
    let wanted = provider.unwrap_or(python::probe_catalog::PROVIDER);
    let found = objects::sdt_objects(pid, Some(wanted))?;
    let has_wanted = found.iter().any(|o| o.has_provider(wanted));
    let filter = match (provider, has_wanted) {
        (Some(p), _) => Some(p),
        (None, true) => Some(python::probe_catalog::PROVIDER),
        (None, false) => None,
    };
    let objects = found
        .iter()
        .filter(|o| filter.is_none_or(|p| o.has_provider(p)))
        .map(|o| object_probes(o.target_path.clone(), &o.elf, Some(o.bias), filter))
        .collect();
    Ok(ProbeListing {
        pid: Some(pid),
        ns_pid: ProcessStatus::inner_pid(&status),
        objects,
    })
}

fn object_probes(
    path: String,
    elf: &ElfInfo,
    bias: Option<u64>,
    provider: Option<&str>,
) -> ObjectProbes {
    let at = |addr: u64| bias.map_or(addr, |b| addr.wrapping_add(b));
    let probes = elf
        .probes
        .iter()
        .filter(|p| provider.is_none_or(|want| p.provider == want))
        .map(|p: &SdtProbe| ProbeRow {
            provider: p.provider.clone(),
            name: p.name.clone(),
            semaphore: p.semaphore.map(at),
            refused: p.semaphore_refused.clone(),
            sites: p
                .sites
                .iter()
                .map(|s| SiteRow {
                    address: at(s.address),
                    args: s.args.clone(),
                    decoded: decode_args(p, &s.args),
                    refused: s.refused.clone(),
                })
                .collect(),
        })
        .collect();
    ObjectProbes {
        path,
        build_id: elf.build_id.clone(),
        load_bias: bias,
        probes,
    }
}

/// Describes each argument of a site: its width and signedness, where it lives, and
/// for CPython's own probes, what it means.
fn decode_args(probe: &SdtProbe, args: &str) -> Vec<DecodedArg> {
    let meaning = (probe.provider == python::probe_catalog::PROVIDER)
        .then(|| python::probe_catalog::lookup(&probe.name))
        .flatten();
    match sdt::parse_args(args) {
        Ok(specs) => specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let known = meaning.and_then(|m| m.args.get(i));
                let ty = match known {
                    Some((_, python::probe_catalog::ArgKind::String)) => "char*".to_owned(),
                    Some((_, python::probe_catalog::ArgKind::Pointer)) => "void*".to_owned(),
                    _ => format!(
                        "{}{}",
                        if spec.signed { 'i' } else { 'u' },
                        u32::from(spec.size) * 8
                    ),
                };
                let place = match &spec.operand {
                    sdt::Operand::Register(r) => format!("in {r}"),
                    // Show the constant as the probe delivers it: truncated to its
                    // size, then sign- or zero-extended.
                    sdt::Operand::Immediate(_) => {
                        match sdt::evaluate(spec, &|_| 0, &NoMemory, &|_| None) {
                            Ok(v) if spec.signed => format!("= {}", v as i64),
                            Ok(v) => format!("= {v}"),
                            Err(e) => format!("= ? ({e})"),
                        }
                    }
                    sdt::Operand::Memory(m) => format!("at {m}"),
                    sdt::Operand::Through(_) => format!("at {}", spec.operand),
                };
                DecodedArg {
                    name: known.map(|(n, _)| (*n).to_owned()),
                    description: format!("{ty} {place}"),
                    ok: true,
                }
            })
            .collect(),
        Err(e) => vec![DecodedArg {
            name: None,
            description: format!("unparsable: {e}"),
            ok: false,
        }],
    }
}

/// Constants need no memory; anything else reading it here is a bug, reported as such.
struct NoMemory;

impl sdt::MemoryReader for NoMemory {
    fn read_exact(&self, address: u64, _: &mut [u8]) -> std::io::Result<()> {
        Err(std::io::Error::other(format!(
            "no memory to read at {address:#x} when listing"
        )))
    }
}
