//! `pyprobe report RECORDING --lines FILE`: the source of FILE, read from disk,
//! with the samples and line hits the recording has for each of its lines.

use std::io::{Read, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};

use crate::session::views::open;
use pyprobe_recording::analyze::line_counts::count_lines;
use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::output::report::render_lines;
use pyprobe_recording::recording::StrId;

/// Largest source file read: a bigger one is shown without its text.
const MAX_SOURCE_BYTES: u64 = 64 << 20;

/// Which of the recording's files `wanted` names: the same path, the same file
/// once links are resolved, or, for a relative `wanted`, the one path that ends
/// with it.
fn choose_file(names: &[(StrId, &str)], wanted: &Path) -> Result<StrId, Vec<String>> {
    let real = std::fs::canonicalize(wanted).ok();
    let text = wanted.to_string_lossy();
    let same = |name: &str| {
        name == text
            || real.as_deref().is_some_and(|r| {
                Path::new(name) == r || std::fs::canonicalize(name).is_ok_and(|n| n == r)
            })
    };
    let mut found: Vec<(StrId, &str)> = names.iter().copied().filter(|(_, n)| same(n)).collect();
    if found.is_empty() && wanted.is_relative() {
        let tail = format!("/{}", text.trim_start_matches("./"));
        found = names
            .iter()
            .copied()
            .filter(|(_, n)| n.ends_with(&tail))
            .collect();
    }
    match found.as_slice() {
        [(id, _)] => Ok(*id),
        _ => Err(found.iter().map(|(_, n)| n.to_string()).collect()),
    }
}

/// The text of `path`, line by line, or why it cannot be read (it is larger
/// than `max_bytes`, among others).
pub(crate) fn read_source(path: &Path, max_bytes: u64) -> std::io::Result<Vec<String>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(max_bytes + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(std::io::Error::other(format!(
            "larger than {} KiB",
            max_bytes >> 10
        )));
    }
    Ok(String::from_utf8_lossy(&bytes)
        .lines()
        .map(str::to_owned)
        .collect())
}

/// `pyprobe report RECORDING --lines FILE`.
pub fn report_lines(recording: &Path, file: &Path, samples: SampleFilter) -> Result<ExitCode> {
    let mut reader = open(recording)?;
    let (counts, header) = count_lines(&mut reader, samples)
        .with_context(|| format!("cannot read {}", recording.display()))?;
    crate::session::views::note_cut_short(&reader, recording);
    let strings = reader.strings();
    let files = counts.files();
    let names: Vec<(StrId, &str)> = files
        .iter()
        .map(|&(id, ..)| (id, strings.get(id.0 as usize).map_or("?", String::as_str)))
        .collect();
    let chosen = match choose_file(&names, file) {
        Ok(id) => id,
        Err(several) if !several.is_empty() => bail!(
            "{} names several files of {}: {}; give the path as the recording has it",
            file.display(),
            recording.display(),
            several.join(", ")
        ),
        Err(_) => {
            let busiest: Vec<&str> = names.iter().take(5).map(|(_, n)| *n).collect();
            bail!(
                "{} has no sample or line event in {}{}",
                file.display(),
                recording.display(),
                if busiest.is_empty() {
                    " (it has none in any file)".to_string()
                } else {
                    format!("; its busiest files: {}", busiest.join(", "))
                }
            )
        }
    };
    let source = match read_source(file, MAX_SOURCE_BYTES) {
        Ok(lines) => Some(lines),
        Err(e) => {
            eprintln!(
                "pyprobe: cannot read {} ({e}): only the lines with counts are shown, without their text",
                file.display()
            );
            None
        }
    };
    if counts.left_out > 0 {
        eprintln!(
            "pyprobe: note: {} events were on lines past the {} kept",
            counts.left_out,
            pyprobe_recording::analyze::line_counts::MAX_LINES
        );
    }
    let name = strings.get(chosen.0 as usize).map_or("?", String::as_str);
    let title = format!("{name} in {}", recording.display());
    let text = render_lines(
        &title,
        &counts.of_file(chosen),
        source.as_deref(),
        header.sample_interval_ns,
    );
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("cannot write to standard output")?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_found_by_its_path_or_the_end_of_it() {
        let names = [
            (StrId(0), "/srv/app/main.py"),
            (StrId(1), "/srv/lib/util.py"),
            (StrId(2), "/srv/app/util.py"),
        ];
        assert_eq!(
            choose_file(&names, Path::new("/srv/app/main.py")),
            Ok(StrId(0))
        );
        assert_eq!(choose_file(&names, Path::new("main.py")), Ok(StrId(0)));
        assert_eq!(choose_file(&names, Path::new("lib/util.py")), Ok(StrId(1)));
        assert_eq!(
            choose_file(&names, Path::new("util.py")),
            Err(vec!["/srv/lib/util.py".into(), "/srv/app/util.py".into()])
        );
        assert_eq!(choose_file(&names, Path::new("ain.py")), Err(vec![]));
        assert_eq!(
            choose_file(&names, Path::new("/elsewhere/main.py")),
            Err(vec![])
        );
    }
}
