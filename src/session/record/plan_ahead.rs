//! The first pass over the recording, made while it is written: a thread of low
//! priority reads the file as it grows and plans its replay, so that the view
//! `record` writes when the target exits reads the events once, not twice.
//!
//! The thread uses only CPU nobody else wants (nice 19), so the target and the
//! engine's loop never wait for it. When the recording is finished it stops
//! where it is and hands what it has read to the session, which reads the rest
//! at its own priority (a busy machine would otherwise starve it) and keeps the
//! pass for the views ([`planned_ahead`]). Anything unexpected (the file cut
//! short, unreadable, replaced) and nothing is kept: the view then plans itself.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use pyprobe_recording::analyze::first_pass::{FirstPass, Planned};
use pyprobe_recording::analyze::planned_ahead;
use pyprobe_recording::analyze::SliceFilter;
use pyprobe_recording::recording::{Completion, RecordingReader};
use pyprobe_recording::stored::{ViewsAhead, ViewsOutcome};
use pyprobe_sdt::tracer::signals::spawn_helper;

/// How often the thread looks for what was written since.
const POLL: Duration = Duration::from_millis(50);
/// Events read between two looks at whether the recording is finished.
const EVENTS_BETWEEN_LOOKS: u32 = 4096;

/// The views' filter: none (every call counted).
fn no_filter() -> &'static SliceFilter {
    static NONE: OnceLock<SliceFilter> = OnceLock::new();
    NONE.get_or_init(SliceFilter::default)
}

/// The pass as far as it went, and the views made with it.
struct Progress {
    reader: RecordingReader<BufReader<File>>,
    pass: FirstPass<'static>,
    views: Option<ViewsAhead>,
    /// The thread's CPU time.
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

/// The CPU time of the calling thread.
fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
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
            // SAFETY: setpriority on this thread's own id; a failure leaves
            // it at the default priority.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
            }
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
    /// views of the file, if it read it whole.
    pub(super) fn finish(mut self) -> Option<Ahead> {
        let started = thread_cpu_ns();
        let Progress {
            mut reader,
            mut pass,
            views,
            cpu_ns,
        } = self.stop()?;
        let ahead = reader.events_read();
        // Resumed where the thread met the file's end, then read to the end marker.
        reader.resume().ok()?;
        if !read_available(&mut reader, &mut pass, None) {
            return None;
        }
        let Completion::Complete(_) = reader.completion() else {
            return None;
        };
        let key = reader.file_key()?;
        let (plan, census) = pass.finish();
        let strings = reader.strings().to_vec();
        let qualnames = reader.qualnames().clone();
        let events = reader.events_read();
        let planned = Planned { plan, census };
        let views = views.map(|v| v.finish(&planned, &strings, &qualnames));
        planned_ahead::remember(key, planned, strings, qualnames);
        Some(Ahead {
            events,
            planned_late: events - ahead,
            views,
            cpu_ns: cpu_ns + thread_cpu_ns().saturating_sub(started),
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
    let mut reader = loop {
        // The writer makes the file when the target's interpreter is known.
        if let Ok(reader) = RecordingReader::open_in_place(partial) {
            break reader;
        }
        if finished.load(Ordering::Acquire) {
            return None;
        }
        std::thread::park_timeout(POLL);
    };
    let mut pass = FirstPass::new(reader.header(), no_filter());
    let mut views: Option<ViewsAhead> = None;
    // Once the views cannot be the recording's, they are not begun again.
    let mut views_refuted = false;
    loop {
        if !read_available(&mut reader, &mut pass, Some(finished)) {
            return None;
        }
        match reader.completion() {
            Completion::Truncated { .. } => {}
            // Read to the end marker, or stopped for the session.
            Completion::Complete(_) | Completion::Reading => break,
            Completion::Failed { .. } => return None,
        }
        if finished.load(Ordering::Acquire) {
            break;
        }
        let planned = reader.events_read();
        if views.is_none() && !views_refuted {
            views = ViewsAhead::start(partial, &pass, planned);
        }
        if let Some(v) = views.as_mut() {
            if !v.advance(&pass, planned, finished) {
                views = None;
                views_refuted = true;
            }
        }
        if finished.load(Ordering::Acquire) {
            break;
        }
        std::thread::park_timeout(POLL);
        if !reader.resume().is_ok_and(|resumed| resumed) {
            return None;
        }
    }
    Some(Progress {
        reader,
        pass,
        views,
        cpu_ns: thread_cpu_ns(),
    })
}

/// Reads every event there is into `pass`, or until `finished` is set (looked
/// at now and then); `false` at an error.
fn read_available(
    reader: &mut RecordingReader<BufReader<File>>,
    pass: &mut FirstPass<'static>,
    finished: Option<&AtomicBool>,
) -> bool {
    let mut since_look = 0u32;
    loop {
        if let Some(finished) = finished {
            since_look += 1;
            if since_look == EVENTS_BETWEEN_LOOKS {
                since_look = 0;
                if finished.load(Ordering::Acquire) {
                    return true;
                }
            }
        }
        match reader.events().next() {
            Some(Ok(event)) => pass.push(&event, reader.strings()),
            Some(Err(_)) => return false,
            None => return true,
        }
    }
}
