//! `flame --format speedscope` of a traced recording, by default: each thread's
//! stacks as one *sampled* profile whose weights are the stacks' own time (or
//! calls, with `--by calls`), from the stacks every view shares (kept with a
//! large recording's views). It is written at once whatever the recording's
//! length, and its size is that of the distinct stacks, not of the calls.
//! speedscope's left-heavy and sandwich views show exactly what the flame graph
//! shows; its time-order view lists the stacks in the order first seen, not as
//! they happened: `--timeline` writes every call where it happened (see
//! [`super::speedscope`]).

use std::io::{self, Write};

use rustc_hash::FxHashMap;

use crate::analyze::folded::{FoldFrame, Folded, Measure};
use crate::output::names::{thread_name, FrameNames};
use crate::output::speedscope::json_str;

/// One profile: a thread (under its process when the recording holds several),
/// or the stacks no thread holds.
#[derive(Default)]
struct Profile {
    name: String,
    /// Each stack (frame indices, outermost first) and its weight.
    stacks: Vec<(Vec<u32>, u64)>,
    total: u64,
}

/// Writes `folded` (folded with its threads apart) as a speedscope file of
/// sampled profiles, one per thread, each stack weighted by `measure`.
pub fn write_speedscope_stacks(
    folded: &Folded,
    measure: Measure,
    names: &FrameNames<'_>,
    title: &str,
    out: &mut dyn Write,
) -> io::Result<()> {
    let mut frames: Vec<FoldFrame> = Vec::new();
    let mut frame_index: FxHashMap<FoldFrame, u32> = FxHashMap::default();
    let mut profiles: Vec<Profile> = Vec::new();
    let mut profile_index: FxHashMap<(Option<u32>, Option<u32>), usize> = FxHashMap::default();
    folded.for_each_stack(measure, |path, value| {
        // The labels at the root say whose stack it is; the rest is the stack.
        let mut process = None;
        let mut thread = None;
        let mut rest = path;
        while let Some((first, tail)) = rest.split_first() {
            match *first {
                FoldFrame::Process { pid, .. } => process = Some(pid),
                FoldFrame::Thread { tid, pid } => thread = Some((tid, pid)),
                _ => break,
            }
            rest = tail;
        }
        let key = (process, thread.map(|t| t.0));
        let at = *profile_index.entry(key).or_insert_with(|| {
            let thread_label =
                thread.map_or_else(|| "all threads".to_string(), |(t, p)| thread_name(t, p));
            // As the timeline names them: under --subprocesses, with the process.
            let name = match process {
                Some(pid) => format!("pid {pid}, {thread_label}"),
                None => thread_label,
            };
            profiles.push(Profile {
                name,
                ..Profile::default()
            });
            profiles.len() - 1
        });
        let stack = rest
            .iter()
            .map(|f| {
                *frame_index.entry(*f).or_insert_with(|| {
                    frames.push(*f);
                    frames.len() as u32 - 1
                })
            })
            .collect();
        let profile = &mut profiles[at];
        profile.total = profile.total.saturating_add(value);
        profile.stacks.push((stack, value));
    });
    profiles.sort_by(|a, b| b.total.cmp(&a.total).then_with(|| a.name.cmp(&b.name)));

    let unit = match measure {
        Measure::Time => "nanoseconds",
        Measure::Calls | Measure::Samples => "none",
    };
    write!(
        out,
        "{{\"$schema\":\"https://www.speedscope.app/file-format-schema.json\",\
         \"exporter\":\"pyprobe {}\",\"name\":{},\"activeProfileIndex\":0,\"profiles\":[",
        env!("CARGO_PKG_VERSION"),
        json_str(title)
    )?;
    let mut line = String::new();
    for (i, p) in profiles.iter().enumerate() {
        out.write_all(if i > 0 { b",\n" } else { b"\n" })?;
        write!(
            out,
            "{{\"type\":\"sampled\",\"name\":{},\"unit\":\"{unit}\",\"startValue\":0,\
             \"endValue\":{},\"samples\":[",
            json_str(&p.name),
            p.total
        )?;
        for (j, (stack, _)) in p.stacks.iter().enumerate() {
            line.clear();
            if j > 0 {
                line.push(',');
            }
            line.push('[');
            for (k, f) in stack.iter().enumerate() {
                if k > 0 {
                    line.push(',');
                }
                line.push_str(&f.to_string());
            }
            line.push(']');
            out.write_all(line.as_bytes())?;
        }
        out.write_all(b"],\"weights\":[")?;
        for (j, (_, weight)) in p.stacks.iter().enumerate() {
            if j > 0 {
                out.write_all(b",")?;
            }
            write!(out, "{weight}")?;
        }
        out.write_all(b"]}")?;
    }
    out.write_all(b"\n],\"shared\":{\"frames\":[")?;
    for (i, f) in frames.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        match f {
            FoldFrame::Python(code) | FoldFrame::PythonLine { code, .. } => write!(
                out,
                "\n{{\"name\":{},\"file\":{},\"line\":{}}}",
                json_str(&names.fold_frame(f)),
                json_str(&names.string(code.file)),
                match f {
                    FoldFrame::PythonLine { line, .. } => *line,
                    _ => code.line,
                }
            )?,
            _ => write!(out, "\n{{\"name\":{}}}", json_str(&names.fold_frame(f)))?,
        }
    }
    out.write_all(b"\n]}}\n")?;
    out.flush()
}
