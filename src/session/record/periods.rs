//! `record --format pprof --every SECONDS -o DIR`: one pprof profile per period,
//! for an agent to ship to a profile collector.
//!
//! Every event written to the recording is also written, its strings interned
//! again, to a small recording of the period alone (a hidden temporary file in
//! DIR). When the period ends, a thread of its own turns that recording into a
//! profile exactly as `pyprobe flame --format pprof` would, writes it to a
//! temporary file (mode 0600), renames it to `pyprobe-PID-YYYYMMDDTHHMMSSZ.pb.gz`
//! (the period's start, UTC) and removes the period's recording: a collector
//! watching DIR sees only whole profiles. Each period's replay starts afresh
//! (calls open when it began are timed from its start), so the ptrace thread
//! never waits for a conversion and memory stays bounded by one period.
//!
//! A period ends at the first event of the engine's loop after its end (its
//! ticks come at the sampling rate, whatever the mode), so it lasts SECONDS
//! give or take a tick; the last one ends with the recording.

use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

use anyhow::{Context, Result};

use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::output::flame::{read_folded_by_thread, FrameGrain};
use pyprobe_recording::output::pprof::{build_profile, write_gzipped};
use pyprobe_recording::recording::{
    BackgroundWriter, Event, EventKind, FrameRef, Header, RecordingReader, RecordingWriter, StrId,
};

/// A period under way: its own recording.
struct Period {
    writer: RecordingWriter<BackgroundWriter>,
    recording: PathBuf,
    /// Wall-clock start, ns since the Unix epoch: the profile's name.
    wall_ns: u64,
    /// The period's id of each of the recording's strings, once used.
    ids: Vec<Option<StrId>>,
}

/// A finished period to turn into a profile.
struct Job {
    recording: PathBuf,
    wall_ns: u64,
}

/// What the periods came to.
#[derive(Debug, Default)]
pub(super) struct PeriodsSummary {
    pub written: Vec<PathBuf>,
    pub failures: Vec<String>,
}

/// The periods of a recording: opened with it, fed its events, rotated by time.
pub(super) struct Periods {
    dir: PathBuf,
    every_ns: u64,
    pid: u32,
    header: Header,
    current: Option<Period>,
    deadline_ns: u64,
    seq: u64,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<PeriodsSummary>>,
    /// The first failure to write a period's recording: no more periods.
    failed: bool,
    /// Every qualified name given so far (file, name, line, qualified name):
    /// each period's recording holds them all.
    qualnames: Vec<(String, String, u32, String)>,
}

impl Periods {
    /// Periods of `every_ns` into `dir`, whose profiles count the samples
    /// `samples` keeps.
    pub fn new(dir: PathBuf, every_ns: u64, samples: SampleFilter) -> Periods {
        let (jobs, receive) = channel::<Job>();
        let worker_dir = dir.clone();
        let worker = pyprobe_sdt::tracer::signals::spawn_helper("pyprobe-pprof", move || {
            let mut summary = PeriodsSummary::default();
            for job in receive {
                match convert(&worker_dir, &job, samples) {
                    Ok(path) => summary.written.push(path),
                    Err(e) => {
                        eprintln!("pyprobe: {e:#}");
                        summary.failures.push(format!("{e:#}"));
                    }
                }
                let _ = std::fs::remove_file(&job.recording);
            }
            summary
        })
        .ok();
        Periods {
            dir,
            every_ns,
            pid: 0,
            header: Header::default(),
            current: None,
            deadline_ns: 0,
            seq: 0,
            jobs: worker.is_some().then_some(jobs),
            worker,
            failed: false,
            qualnames: Vec::new(),
        }
    }

    /// The recording opened with `header`: the first period starts at its start.
    pub fn begin(&mut self, header: &Header) {
        self.header = header.clone();
        self.pid = header.pid;
        self.deadline_ns = header.start_ns.saturating_add(self.every_ns);
        self.open(header.start_ns);
    }

    fn open(&mut self, start_ns: u64) {
        if self.failed || self.jobs.is_none() {
            return;
        }
        let header = Header {
            start_ns,
            wall_start_unix_ns: self
                .header
                .wall_start_unix_ns
                .saturating_add(start_ns.saturating_sub(self.header.start_ns)),
            ..self.header.clone()
        };
        self.seq += 1;
        let recording = self
            .dir
            .join(format!(".pyprobe-{}-period-{}.tmp", self.pid, self.seq));
        match create_private(&recording)
            .and_then(|file| RecordingWriter::new(BackgroundWriter::new(file)?, &header))
        {
            Ok(mut writer) => {
                for (file, name, line, qualname) in &self.qualnames {
                    let code = FrameRef {
                        file: writer.intern(file),
                        function: writer.intern(name),
                        line: *line,
                    };
                    let q = writer.intern(qualname);
                    writer.name_code(&code, q);
                }
                self.current = Some(Period {
                    writer,
                    recording,
                    wall_ns: header.wall_start_unix_ns,
                    ids: Vec::new(),
                })
            }
            Err(e) => self.fail(&recording, &e),
        }
    }

    fn fail(&mut self, path: &Path, e: &io::Error) {
        self.failed = true;
        self.current = None;
        let _ = std::fs::remove_file(path);
        eprintln!(
            "pyprobe: no more pprof periods: cannot write {}: {e}; the recording goes on",
            path.display()
        );
    }

    /// Adds `event` of the recording, whose strings are `strings` (by id).
    pub fn write(&mut self, event: &Event, strings: &[String]) {
        let Some(period) = self.current.as_mut() else {
            return;
        };
        let mut event = event.clone();
        remap_strings(&mut event.kind, |id| period.id(id, strings));
        if let Err(e) = period.writer.write(&event) {
            let path = period.recording.clone();
            self.fail(&path, &e);
        }
    }

    /// Gives function `code` of the recording (ids of `strings`) its qualified
    /// name, in this period and the next ones.
    pub fn name_code(&mut self, code: &FrameRef, qualname: StrId, strings: &[String]) {
        let text = |id: StrId| strings.get(id.0 as usize).cloned().unwrap_or_default();
        self.qualnames.push((
            text(code.file),
            text(code.function),
            code.line,
            text(qualname),
        ));
        if let Some(period) = self.current.as_mut() {
            let mine = FrameRef {
                file: period.id(code.file, strings),
                function: period.id(code.function, strings),
                line: code.line,
            };
            let q = period.id(qualname, strings);
            period.writer.name_code(&mine, q);
        }
    }

    /// Ends the period under way if `now_ns` is past its end, and starts the next.
    pub fn rotate_if_due(&mut self, now_ns: u64) {
        if now_ns < self.deadline_ns || self.current.is_none() {
            return;
        }
        // The next end on the grid: no drift, and a stall skips whole periods.
        while self.deadline_ns <= now_ns {
            self.deadline_ns = self.deadline_ns.saturating_add(self.every_ns);
        }
        self.close(now_ns);
        self.open(now_ns);
    }

    /// Finishes the period under way at `end_ns` and hands it to the worker.
    fn close(&mut self, end_ns: u64) {
        let Some(period) = self.current.take() else {
            return;
        };
        let recording = period.recording.clone();
        match period.writer.finish(end_ns) {
            Ok(_) => {
                let job = Job {
                    recording,
                    wall_ns: period.wall_ns,
                };
                if let Some(jobs) = &self.jobs {
                    let _ = jobs.send(job);
                }
            }
            Err(e) => self.fail(&recording, &e),
        }
    }

    /// Ends the last period with the recording, and waits for every profile.
    pub fn finish(mut self, end_ns: u64) -> PeriodsSummary {
        self.close(end_ns);
        drop(self.jobs.take());
        self.worker
            .take()
            .and_then(|w| w.join().ok())
            .unwrap_or_default()
    }
}

impl Period {
    /// The period's id of the recording's string `id`.
    fn id(&mut self, id: StrId, strings: &[String]) -> StrId {
        let i = id.0 as usize;
        if let Some(Some(mine)) = self.ids.get(i) {
            return *mine;
        }
        let text = strings.get(i).map_or("?", String::as_str);
        let mine = self.writer.intern(text);
        if self.ids.len() <= i {
            self.ids.resize(i + 1, None);
        }
        self.ids[i] = Some(mine);
        mine
    }
}

/// Replaces every string id `kind` holds by `f`'s.
fn remap_strings(kind: &mut EventKind, mut f: impl FnMut(StrId) -> StrId) {
    let mut frame = |fr: &mut FrameRef| {
        fr.file = f(fr.file);
        fr.function = f(fr.function);
    };
    match kind {
        EventKind::Call { frame: fr }
        | EventKind::Resume { frame: fr }
        | EventKind::Return { frame: fr, .. }
        | EventKind::Line { frame: fr } => frame(fr),
        EventKind::Sample { frames, .. }
        | EventKind::Stack { frames }
        | EventKind::Running { frames } => {
            for w in frames {
                frame(&mut w.code);
            }
        }
        EventKind::ImportStart { module } | EventKind::ImportDone { module, .. } => {
            *module = f(*module)
        }
        EventKind::Audit { event } => *event = f(*event),
        EventKind::ReturnType {
            function, returned, ..
        } => {
            frame(function);
            if let Some(t) = returned {
                *t = f(*t);
            }
        }
        EventKind::ProcessStart { command, .. }
        | EventKind::Exec { command }
        | EventKind::Caveat { text: command } => *command = f(*command),
        EventKind::GcStart { .. }
        | EventKind::GcDone { .. }
        | EventKind::ThreadStart { .. }
        | EventKind::ThreadExit
        | EventKind::Window { .. }
        | EventKind::Thinned { .. }
        | EventKind::AuditsCounted { .. }
        | EventKind::Lost { .. }
        | EventKind::Paused { .. } => {}
    }
}

/// A new file only this user may read (never one that exists).
fn create_private(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// `20261130T220417Z`: `wall_ns` (since the Unix epoch) in UTC, for file names.
fn utc_stamp(wall_ns: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(wall_ns / 1_000_000_000);
    humantime::format_rfc3339_seconds(t)
        .to_string()
        .replace(['-', ':'], "")
}

/// The profile of the period recorded in `job`, written into `dir` under its
/// name by way of a temporary file (mode 0600), never over an existing file.
fn convert(dir: &Path, job: &Job, samples: SampleFilter) -> Result<PathBuf> {
    let what = || {
        format!(
            "cannot make the pprof profile of {}",
            job.recording.display()
        )
    };
    let mut reader = RecordingReader::open(&job.recording).with_context(what)?;
    let (folded, info) =
        read_folded_by_thread(&mut reader, samples, FrameGrain::Functions).with_context(what)?;
    let (profile, _) = build_profile(&folded, &info, reader.strings(), samples.idle);
    let mut temp = tempfile::Builder::new()
        .prefix(".pyprobe-")
        .suffix(".pb.gz.tmp")
        .tempfile_in(dir)
        .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
    let written = {
        let mut out = BufWriter::new(temp.as_file_mut());
        write_gzipped(&profile, &mut out).and_then(|()| out.flush())
    };
    written
        .and_then(|()| temp.as_file().sync_all())
        .with_context(|| format!("cannot write {}", temp.path().display()))?;
    let stem = format!("pyprobe-{}-{}", info.header.pid, utc_stamp(job.wall_ns));
    for n in 0..1000 {
        let name = match n {
            0 => format!("{stem}.pb.gz"),
            n => format!("{stem}.{n}.pb.gz"),
        };
        let path = dir.join(name);
        match temp.persist_noclobber(&path) {
            Ok(_) => return Ok(path),
            Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => temp = e.file,
            Err(e) => {
                return Err(e.error).with_context(|| format!("cannot write {}", path.display()))
            }
        }
    }
    anyhow::bail!(
        "{stem}.pb.gz and its 999 numbered names are taken in {}",
        dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_utc_and_safe_in_file_names() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(1_796_076_257_999_999_999), "20261130T220417Z");
    }
}
