//! `pyprobe calls`: the call flow of a recording, one line per call and return.

use std::io::{self, BufWriter};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};

use pyprobe_recording::output::calls::{write_calls_with_plan, CallsOptions};
use pyprobe_recording::output::flame::ViewError;

use super::reading::{note_cut_short, open};
use super::stored::kept_replay;

/// What `pyprobe calls` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct CallsRequest {
    pub file: PathBuf,
    pub start_at: Option<String>,
    pub thread: Option<u32>,
    pub max_depth: Option<usize>,
    pub json: bool,
    pub full_paths: bool,
}

/// `pyprobe calls FILE`.
pub fn calls(request: &CallsRequest) -> Result<ExitCode> {
    let file = &request.file;
    let mut reader = open(file)?;
    let options = CallsOptions {
        start_at: request.start_at.clone(),
        thread: request.thread,
        max_depth: request.max_depth,
        json: request.json,
        full_paths: request.full_paths,
    };
    let stdout = io::stdout();
    let out = BufWriter::new(stdout.lock());
    // A large recording's replay, kept with its views: the flow starts at
    // once, and after one function reads only the parts holding its calls.
    let kept = kept_replay(file);
    let summary = match write_calls_with_plan(&mut reader, kept, &options, out) {
        Ok(s) => s,
        Err(ViewError::Io(e)) if e.kind() == io::ErrorKind::BrokenPipe => {
            return Ok(ExitCode::SUCCESS)
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", file.display())),
    };
    note_cut_short(&reader, file);
    if summary.entries + summary.returns == 0 {
        if summary.samples > 0 {
            eprintln!(
                "pyprobe: note: {} holds samples, not calls: there is no call flow (see `pyprobe flame` and `pyprobe report`)",
                file.display()
            );
        } else {
            eprintln!(
                "pyprobe: note: {} holds no call or return events",
                file.display()
            );
        }
    } else if let Some(f) = &request.start_at {
        if summary.start_at_calls == 0 {
            eprintln!("pyprobe: note: no call of `{f}` in {}", file.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
