//! `pyprobe probes`: the SDT probes of one or more objects, as a table or JSON.

use std::fmt::Write as _;

use serde::Serialize;

use crate::output::terminal::{escaped, escaped_string};

/// Everything `pyprobe probes` shows.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeListing {
    /// The process inspected, for `-p`.
    pub pid: Option<i32>,
    /// The PID inside the target's own PID namespace, when it differs.
    pub ns_pid: Option<i32>,
    pub objects: Vec<ObjectProbes>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ObjectProbes {
    /// The path as the target sees it (or as given on the command line).
    pub path: String,
    pub build_id: Option<String>,
    /// Runtime minus link-time addresses; present for a live process.
    pub load_bias: Option<u64>,
    pub probes: Vec<ProbeRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProbeRow {
    pub provider: String,
    pub name: String,
    /// Address of the 2-byte semaphore (runtime for a live process).
    pub semaphore: Option<u64>,
    /// Why pyprobe would leave the semaphore, and so the whole probe, alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    pub sites: Vec<SiteRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SiteRow {
    /// Address of the site (runtime for a live process, else link-time).
    pub address: u64,
    /// The argument spec as written in the note.
    pub args: String,
    /// One entry per argument: its decoded form, or why it does not parse.
    pub decoded: Vec<DecodedArg>,
    /// Why pyprobe would never write this site (link-time addresses).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DecodedArg {
    /// The argument's meaning where known (e.g. `filename` for `python:function__entry`).
    pub name: Option<String>,
    /// e.g. `i32 in %eax`, `u64 at 112(%rsp)`; or an error message.
    pub description: String,
    pub ok: bool,
}

pub fn render_json(listing: &ProbeListing) -> String {
    serde_json::to_string_pretty(listing).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

pub fn render_table(listing: &ProbeListing) -> String {
    let mut out = String::new();
    if let Some(pid) = listing.pid {
        let _ = write!(out, "process {pid}");
        if let Some(inner) = listing.ns_pid {
            let _ = write!(out, " (pid {inner} in its own namespace)");
        }
        out.push('\n');
    }
    for object in &listing.objects {
        let sites: usize = object.probes.iter().map(|p| p.sites.len()).sum();
        let _ = writeln!(
            out,
            "{}: {} probes, {} sites",
            escaped(&object.path),
            object.probes.len(),
            sites
        );
        if let Some(id) = &object.build_id {
            let _ = writeln!(out, "  build id   {id}");
        }
        if let Some(bias) = object.load_bias {
            let _ = writeln!(out, "  load bias  {bias:#x}");
        }
        let _ = writeln!(
            out,
            "  {:<34} {:>18} {:>18}  ARGUMENTS",
            "PROBE", "SITE", "SEMAPHORE"
        );
        for probe in &object.probes {
            let semaphore = probe
                .semaphore
                .map(|s| format!("{s:#x}"))
                .unwrap_or_else(|| "-".into());
            // Note strings are the binary's: shown escaped.
            let label = escaped_string(&format!("{}:{}", probe.provider, probe.name));
            for (i, site) in probe.sites.iter().enumerate() {
                let (label, semaphore) = if i == 0 {
                    (label.as_str(), semaphore.as_str())
                } else {
                    ("", "")
                };
                let args = site
                    .decoded
                    .iter()
                    .map(|a| match &a.name {
                        Some(n) => format!("{n}={}", a.description),
                        None => a.description.clone(),
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                let args = escaped(&args);
                let _ = writeln!(
                    out,
                    "  {label:<34} {:>18} {semaphore:>18}  {}",
                    format!("{:#x}", site.address),
                    escaped(&site.args)
                );
                if !args.is_empty() {
                    let _ = writeln!(out, "  {:<34} {:>18} {:>18}    {args}", "", "", "");
                }
                let refused = site
                    .refused
                    .as_ref()
                    .or(probe.refused.as_ref().filter(|_| i == 0));
                if let Some(why) = refused {
                    let why = escaped(why);
                    let _ = writeln!(out, "  {:<34} {:>18} {:>18}    {why}", "", "", "");
                }
            }
        }
    }
    if listing.objects.is_empty() {
        out.push_str("no SDT probes found\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binarys_note_strings_are_shown_escaped() {
        let listing = ProbeListing {
            pid: None,
            ns_pid: None,
            objects: vec![ObjectProbes {
                path: "/tmp/lib\x1b[2J.so".into(),
                build_id: None,
                load_bias: None,
                probes: vec![ProbeRow {
                    provider: "python\x1b]0;pwned\x07".into(),
                    name: "gc__start\nforged line".into(),
                    semaphore: None,
                    refused: None,
                    sites: vec![SiteRow {
                        address: 0x1000,
                        args: "8@%rax\r".into(),
                        decoded: Vec::new(),
                        refused: Some("why\x1b".into()),
                    }],
                }],
            }],
        };
        let text = render_table(&listing);
        assert!(!text.contains(['\x1b', '\x07', '\r']), "{text:?}");
        assert!(!text.lines().any(|l| l.starts_with("forged")), "{text}");
        assert!(
            text.contains("python\\x1b]0;pwned\\x07:gc__start\\nforged line"),
            "{text}"
        );
    }
}
