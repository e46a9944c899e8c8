//! The first pass over the recording, made while it is written: a thread of low
//! priority reads the file as it grows and plans its replay, so that the view
//! `record` writes when the target exits reads the events once, not twice.
//!
//! The thread uses only CPU nobody else wants (`SCHED_IDLE`), so the target and
//! the engine's loop never wait for it. When the recording is finished it stops
//! where it is and hands what it has read to the session, which reads the rest
//! at its own priority (a busy machine would otherwise starve it) and keeps the
//! pass for the views ([`planned_ahead`]). Anything unexpected (the file cut
//! short, unreadable, replaced) and nothing is kept: the view then plans itself.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use pyprobe_recording::analyze::planned_ahead;
use pyprobe_recording::recording::RecordingReader;
use pyprobe_recording::stored::{Finished, Looked, ViewsOutcome, WhileWritten};
use pyprobe_sdt::tracer::clock::{process_cpu_ns, thread_cpu_ns};
use pyprobe_sdt::tracer::signals::spawn_helper;

/// How often the thread looks for what was written since.
const POLL: Duration = Duration::from_millis(50);

/// What the thread read, and its CPU time.
struct Progress {
    read: WhileWritten,
    cpu_ns: u64,
}

/// What the thread did before the view was written, for `-v`.
pub(super) struct Ahead {
    /// Events of the recording.
    pub(super) events: u64,
    /// Of those, the ones the first pass read after the recording ended.
    pub(super) planned_late: u64,
    /// What became of the views built meanwhile, if any were begun.
    pub(super) views: Option<ViewsOutcome>,
    /// CPU time spent on them: in the thread, and at the end.
    pub(super) cpu_ns: u64,
}

/// Puts the calling thread in `SCHED_IDLE`: it runs on a CPU nothing else
/// wants, and any thread of the target or of pyprobe's engine that wakes takes
/// the CPU from it at once (a niced thread keeps it for the rest of its
/// slice). It never leaves it: the session reads what is left at the end.
/// Where that is refused, nice 19.
fn run_only_when_idle() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: both act on the calling thread (id 0, and its own id) with
    // arguments that live through the call; a failure changes nothing.
    unsafe {
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
        }
    }
}

/// The planning thread of one recording.
pub(super) struct PlanAhead {
    finished: Arc<AtomicBool>,
    thread: Option<JoinHandle<Option<Progress>>>,
}

impl PlanAhead {
    /// Starts planning the recording being written to `partial`; `None` when no
    /// thread can be made (the view plans itself).
    pub(super) fn start(partial: PathBuf) -> Option<PlanAhead> {
        let finished = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&finished);
        // Blocking pyprobe's signals: they must interrupt the engine's loop.
        let thread = spawn_helper("pyprobe-plan", move || {
            run_only_when_idle();
            plan_while_written(&partial, &seen)
        })
        .ok()?;
        Some(PlanAhead {
            finished,
            thread: Some(thread),
        })
    }

    /// The recording is finished (its end marker written): reads what is left
    /// here and keeps the pass, and the views if they are the file's, for the
    /// views of the file, if it read it whole. `events`: the recording's, for
    /// the progress shown when much is left (see `finishing`).
    pub(super) fn finish(mut self, events: u64) -> Option<Ahead> {
        // The rest is read here, and by the threads that decode it ahead.
        let started = process_cpu_ns();
        let Progress { read, cpu_ns } = self.stop()?;
        let left = read.left(events);
        let (done, stop) = (AtomicU64::new(0), AtomicBool::new(false));
        let finished = std::thread::scope(|scope| {
            super::finishing::show(scope, events, left, &done, &stop);
            let finished = read.finish(&done);
            stop.store(true, Ordering::Release);
            finished
        });
        let Finished {
            key,
            planned,
            strings,
            qualnames,
            events,
            planned_late,
            views,
        } = finished?;
        planned_ahead::remember(key, planned, strings, qualnames);
        Some(Ahead {
            events,
            planned_late,
            views,
            cpu_ns: cpu_ns + process_cpu_ns().saturating_sub(started),
        })
    }

    fn stop(&mut self) -> Option<Progress> {
        self.finished.store(true, Ordering::Release);
        let thread = self.thread.take()?;
        thread.thread().unpark();
        thread.join().ok().flatten()
    }
}

impl Drop for PlanAhead {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: the events written so far, again and again, until the session
/// says the recording is finished; `None` when it cannot be read.
fn plan_while_written(partial: &std::path::Path, finished: &AtomicBool) -> Option<Progress> {
    let reader = loop {
        // The writer makes the file when the target's interpreter is known.
        if let Ok(reader) = RecordingReader::open_in_place(partial) {
            break reader;
        }
        if finished.load(Ordering::Acquire) {
            return None;
        }
        std::thread::park_timeout(POLL);
    };
    let mut read = WhileWritten::new(partial.to_path_buf(), reader);
    loop {
        if finished.load(Ordering::Acquire) {
            break;
        }
        match read.look(finished).ok()? {
            Looked::Again => {}
            Looked::Later => std::thread::park_timeout(POLL),
            Looked::Finished => break,
        }
    }
    Some(Progress {
        read,
        cpu_ns: thread_cpu_ns(),
    })
}
