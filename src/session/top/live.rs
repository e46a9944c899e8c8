//! The live `top` of processes: a recorder per process (`pyprobe record`, a child
//! process with its own ptrace thread) writes a recording that the view re-reads
//! at each refresh. Quitting stops each recorder with SIGINT, which detaches
//! cleanly.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::session::record::Target;
use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::output::file::partial_path;
use pyprobe_recording::output::top::{Snapshot, ViewState};

use super::snapshots::{open_live, print_snapshot, recording_source};
use super::terminal::run_tui;

/// The recorder of the live view: `pyprobe record` of `target` (`-p PID` or
/// `-- CMD`) into `recording`, sampling stacks (GC and imports exact where the
/// build has their probes).
fn recorder(exe: &Path, recording: &Path, target: &[String], rate: u32) -> Command {
    let mut command = Command::new(exe);
    command
        .args(["record", "--mode", "auto", "-r", &rate.to_string(), "-o"])
        .arg(recording)
        .args(target)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    command
}

/// Whether `pid` runs a CPython pyprobe can read, owned by this user (cheap test
/// first: a mapped file named like python, then the interpreter itself).
fn is_python_of_this_user(pid: i32) -> bool {
    let Ok(status) = pyprobe_sdt::process::ProcessStatus::read(pid) else {
        return false;
    };
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if status.kernel_thread || status.state == 'Z' || (uid != 0 && status.uid != uid) {
        return false;
    }
    // A cheap look first: a mapping named python, before the interpreter is sought.
    let named_python = pyprobe_sdt::process::maps::read_maps(pid)
        .is_ok_and(|maps| maps.iter().any(|m| m.path.contains("python")));
    named_python && pyprobe_cpython::python::walker::find_interpreter_object(pid).is_ok()
}

/// One recorder of `top --all`, and the view of its recording.
struct Watched {
    recorder: std::process::Child,
    source: Box<dyn FnMut(Option<u32>) -> Snapshot>,
}

/// The processes `top --all` watches: one recorder each.
struct AllProcesses {
    dir: tempfile::TempDir,
    exe: PathBuf,
    me: i32,
    watched: std::collections::HashMap<i32, Watched>,
    /// Processes found not to be (readable) Python, until they end.
    not_python: std::collections::HashSet<i32>,
    /// Which samples count.
    samples: SampleFilter,
    /// Samples per second of each recorder.
    rate: u32,
}

impl AllProcesses {
    /// Starts recorders for new Python processes, drops ended ones, and merges what
    /// every recording shows now.
    fn refresh(&mut self, thread: Option<u32>) -> Snapshot {
        let pids: Vec<i32> = std::fs::read_dir("/proc")
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let alive: std::collections::HashSet<i32> = pids.iter().copied().collect();
        self.watched.retain(|pid, w| {
            let ended = !alive.contains(pid) && matches!(w.recorder.try_wait(), Ok(Some(_)));
            if ended {
                let _ = w.recorder.wait();
            }
            !ended
        });
        self.not_python.retain(|pid| alive.contains(pid));
        for pid in pids {
            if pid == self.me || self.watched.contains_key(&pid) || self.not_python.contains(&pid) {
                continue;
            }
            if !is_python_of_this_user(pid) {
                self.not_python.insert(pid);
                continue;
            }
            let recording = self.dir.path().join(format!("{pid}.pyprobe"));
            // A pid used again while `top --all` runs: its own file (--force).
            let target = ["-p".to_string(), pid.to_string(), "--force".to_string()];
            let recorder = recorder(&self.exe, &recording, &target, self.rate)
                .stderr(Stdio::null())
                .spawn();
            match recorder {
                Ok(recorder) => {
                    let source = Box::new(recording_source(recording, self.samples));
                    self.watched.insert(pid, Watched { recorder, source });
                }
                Err(_) => {
                    self.not_python.insert(pid);
                }
            }
        }
        let mut merged = Snapshot {
            mode: pyprobe_recording::output::top::TopMode::Sample,
            filter: self.samples,
            ..Snapshot::default()
        };
        for w in self.watched.values_mut() {
            let s = (w.source)(thread);
            merged.rows.extend(s.rows);
            merged.threads.extend(s.threads);
            merged.window_ns = merged.window_ns.max(s.window_ns);
            merged.gc_per_s += s.gc_per_s;
            merged.imports_per_s += s.imports_per_s;
            merged.events += s.events;
            merged.samples += s.samples;
            merged.left_out += s.left_out;
            merged.state_unknown += s.state_unknown;
            merged.lost += s.lost;
        }
        merged.threads.sort_unstable();
        merged.thread = thread;
        merged.status = Some(format!("{} Python processes watched", self.watched.len()));
        merged
    }

    /// Stops every recorder; SIGINT makes each detach cleanly.
    fn stop(&mut self) {
        for w in self.watched.values() {
            // SAFETY: plain kill(2) of our own child.
            unsafe { libc::kill(w.recorder.id() as i32, libc::SIGINT) };
        }
        for w in self.watched.values_mut() {
            let _ = w.recorder.wait();
        }
    }
}

/// `top --all`: every Python process this user may trace; processes that start or
/// end while it runs come and go at the next refresh.
pub(super) fn all_top(
    interval: Duration,
    limit: usize,
    once: bool,
    samples: SampleFilter,
    rate: u32,
) -> Result<ExitCode> {
    let mut all = AllProcesses {
        dir: tempfile::tempdir().context("cannot create a temporary directory")?,
        exe: std::env::current_exe().context("cannot find pyprobe's own executable")?,
        me: std::process::id() as i32,
        watched: Default::default(),
        not_python: Default::default(),
        samples,
        rate,
    };
    let shown = if once {
        all.refresh(None);
        std::thread::sleep(interval);
        let snapshot = all.refresh(None);
        print_snapshot(&snapshot, limit)
    } else {
        let state = ViewState::new(interval, limit);
        run_tui(|thread| all.refresh(thread), state).context("the terminal view failed")
    };
    all.stop();
    shown?;
    Ok(ExitCode::SUCCESS)
}

/// The live view of one process, attached to or started by its recorder.
pub(super) fn live_top(
    watch: &Target,
    interval: Duration,
    limit: usize,
    samples: SampleFilter,
    rate: u32,
) -> Result<ExitCode> {
    let target = match watch {
        Target::Attach(pid) => {
            pyprobe_sdt::process::status::check_inspectable(*pid)?;
            vec!["-p".to_string(), pid.to_string()]
        }
        Target::Launch(cmd) => std::iter::once("--".to_string())
            .chain(cmd.iter().cloned())
            .collect(),
    };
    let what = match watch {
        Target::Attach(pid) => format!("process {pid}"),
        Target::Launch(cmd) => format!("`{}`", cmd.join(" ")),
    };
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let recording = dir.path().join("top.pyprobe");
    let log_path = dir.path().join("record.log");
    let log = std::fs::File::create(&log_path).context("cannot create the recorder's log")?;
    let exe = std::env::current_exe().context("cannot find pyprobe's own executable")?;
    let mut recorder = recorder(&exe, &recording, &target, rate)
        .stderr(log)
        .spawn()
        .context("cannot start the recorder")?;
    // Wait (bounded) for the recording to appear: attach can fail (permissions).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !recording.exists() && !partial_path(&recording).exists() {
        if let Some(status) = recorder.try_wait()? {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            bail!("cannot watch {what} ({status}): {}", log.trim());
        }
        if std::time::Instant::now() > deadline {
            let _ = recorder.kill();
            bail!("{what}: the recorder did not start within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let state = ViewState::new(interval, limit);
    let shown = run_tui(recording_source(recording.clone(), samples), state);
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(recorder.id() as i32, libc::SIGINT) };
    if let Target::Launch(_) = watch {
        // The recorder waits for the command it started: end it, as quitting means.
        if let Ok(reader) = open_live(&recording) {
            let pid = reader.header().pid as i32;
            if pid > 0 {
                // SAFETY: plain kill(2) of the command the recorder started.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
    let _ = recorder.wait();
    shown.context("the terminal view failed")?;
    Ok(ExitCode::SUCCESS)
}
