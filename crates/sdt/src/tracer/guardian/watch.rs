//! The guardian watching pyprobe itself: a pyprobe stopped by a signal it cannot
//! catch (SIGSTOP, a debugger's stop) must not hold the target.
//!
//! While pyprobe is attached, a thread of the target that starts a thread, takes a
//! signal, exits or hits an `int3` waits in a tracing stop until pyprobe resumes
//! it. pyprobe lets go of the target itself when it is asked to stop by Ctrl-Z
//! (SIGTSTP, SIGTTIN, SIGTTOU: `tracer::engine::pausing`), but SIGSTOP cannot be
//! caught. So the guardian looks at pyprobe's tracing thread every [`LOOK_EVERY`]:
//! found stopped for [`STOPPED_GRACE`] without having said it let go (the
//! [`Control`] page's `paused` word), it stops the rings' producers waiting
//! (`alive` 0), asks pyprobe to let go (`release`) and continues it with SIGCONT;
//! pyprobe then detaches, says so, and stops itself again as it was asked to. If it
//! is still stopped [`RELEASE_LIMIT`] later (a debugger holds it: SIGCONT does not
//! end a tracing stop), the guardian ends it with SIGKILL and undoes its changes as
//! after any death of pyprobe. The longest a stopped pyprobe holds a thread of the
//! target is therefore about `STOPPED_GRACE` + `RELEASE_LIMIT` + one look.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::process::status::KeptTaskFile;

/// How often the guardian looks at pyprobe's state.
pub(super) const LOOK_EVERY: Duration = Duration::from_millis(25);
/// Stopped this long (a look or two) and not paused: pyprobe is asked to let go.
const STOPPED_GRACE: Duration = Duration::from_millis(50);
/// Still stopped this long after it was continued: pyprobe is ended.
const RELEASE_LIMIT: Duration = Duration::from_millis(500);

/// Words of the page pyprobe and its guardian share.
const PAUSED: usize = 0;
const RELEASE: usize = 1;
const WORDS: usize = 2;

/// A page shared by pyprobe and its guardian (`MAP_SHARED`, made before the fork).
pub(crate) struct Control {
    words: *mut AtomicU64,
}

// SAFETY: the page is only touched through atomics and stays mapped for the
// process's life (never unmapped).
unsafe impl Send for Control {}
// SAFETY: as for Send: atomics only, on a page never unmapped.
unsafe impl Sync for Control {}

impl Control {
    pub(super) fn new() -> std::io::Result<Control> {
        // SAFETY: a fresh anonymous shared mapping; never unmapped (one page per
        // guardian, a few per run at most).
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Control { words: page.cast() })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < WORDS);
        // SAFETY: `i` is inside the page, which stays mapped.
        unsafe { &*self.words.add(i) }
    }

    /// pyprobe says it holds nothing of the target (paused) or holds it again.
    pub(super) fn set_paused(&self, paused: bool) {
        self.word(PAUSED).store(u64::from(paused), Ordering::SeqCst);
    }

    fn paused(&self) -> bool {
        self.word(PAUSED).load(Ordering::SeqCst) != 0
    }

    /// How long pyprobe had been stopped (ms) when the guardian continued it to
    /// let go of the target, if it did since the last call; clears the request.
    pub(super) fn take_release(&self) -> Option<u64> {
        // A plain load first: asked once per turn of the event loop, and almost
        // never set.
        if self.word(RELEASE).load(Ordering::Relaxed) == 0 {
            return None;
        }
        match self.word(RELEASE).swap(0, Ordering::SeqCst) {
            0 => None,
            ms => Some(ms - 1),
        }
    }

    fn ask_release(&self, stopped_ms: u64) {
        self.word(RELEASE)
            .store(stopped_ms.saturating_add(1), Ordering::SeqCst);
    }
}

/// What the guardian does about pyprobe at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Nothing to do.
    Fine,
    /// Stopped while holding the target: stop the producers waiting, then ask.
    AskRelease { stopped_ms: u64 },
    /// Still stopped after it was asked: end it.
    End { state: char },
}

/// The guardian's view of pyprobe's tracing thread.
pub(super) struct Watch {
    pid: i32,
    tid: i32,
    stat: KeptTaskFile,
    stopped_since: Option<Instant>,
    asked_at: Option<Instant>,
    last_look: Option<Instant>,
}

impl Watch {
    pub(super) fn new(pid: i32, tid: i32) -> Watch {
        Watch {
            pid,
            tid,
            stat: KeptTaskFile::default(),
            stopped_since: None,
            asked_at: None,
            last_look: None,
        }
    }

    /// Looks at pyprobe, at most once per [`LOOK_EVERY`].
    pub(super) fn look(&mut self, control: &Control, now: Instant) -> Verdict {
        if self.last_look.is_some_and(|at| now - at < LOOK_EVERY) {
            return Verdict::Fine;
        }
        self.last_look = Some(now);
        let state = self.stat.state(self.pid, self.tid);
        judge(
            state,
            control.paused(),
            now,
            &mut self.stopped_since,
            &mut self.asked_at,
        )
    }

    /// Asks pyprobe to let go and continues it.
    pub(super) fn ask(&self, control: &Control, stopped_ms: u64) {
        control.ask_release(stopped_ms);
        // SAFETY: plain kill(2).
        unsafe { libc::kill(self.pid, libc::SIGCONT) };
    }

    pub(super) fn end(&self) {
        // SAFETY: plain kill(2).
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
    }

    pub(super) fn pid(&self) -> i32 {
        self.pid
    }
}

/// The rule, apart from `/proc` so that it can be tested: `state` is the tracing
/// thread's scheduler state (`T` stopped by a signal, `t` in a tracing stop).
fn judge(
    state: Option<char>,
    paused: bool,
    now: Instant,
    stopped_since: &mut Option<Instant>,
    asked_at: &mut Option<Instant>,
) -> Verdict {
    let stopped = matches!(state, Some('T' | 't'));
    if paused || !stopped {
        // Let go (paused), running (continued, it is letting go: a starved
        // pyprobe is not a stopped one), or gone (the pipe's end says so).
        *stopped_since = None;
        *asked_at = None;
        return Verdict::Fine;
    }
    let since = *stopped_since.get_or_insert(now);
    match *asked_at {
        None if now - since >= STOPPED_GRACE => {
            *asked_at = Some(now);
            Verdict::AskRelease {
                stopped_ms: (now - since).as_millis() as u64,
            }
        }
        Some(at) if now - at >= RELEASE_LIMIT => {
            *asked_at = None;
            Verdict::End {
                state: state.unwrap_or('?'),
            }
        }
        _ => Verdict::Fine,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_pyprobe_is_asked_then_ended_a_paused_or_running_one_never() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (mut since, mut asked) = (None, None);
        // Running, sleeping, or paused after letting go: nothing.
        for (state, paused) in [(Some('R'), false), (Some('S'), false), (Some('T'), true)] {
            assert_eq!(
                judge(state, paused, at(0), &mut since, &mut asked),
                Verdict::Fine
            );
        }
        // Stopped: a grace first, then asked once.
        assert_eq!(
            judge(Some('T'), false, at(100), &mut since, &mut asked),
            Verdict::Fine
        );
        assert_eq!(
            judge(Some('T'), false, at(160), &mut since, &mut asked),
            Verdict::AskRelease { stopped_ms: 60 }
        );
        assert_eq!(
            judge(Some('T'), false, at(200), &mut since, &mut asked),
            Verdict::Fine
        );
        // It let go and stopped itself: left alone, however long.
        assert_eq!(
            judge(Some('T'), true, at(5000), &mut since, &mut asked),
            Verdict::Fine
        );
        // Continued by the user, then held by a debugger: asked, then ended.
        assert_eq!(
            judge(Some('t'), false, at(6000), &mut since, &mut asked),
            Verdict::Fine
        );
        assert_eq!(
            judge(Some('t'), false, at(6060), &mut since, &mut asked),
            Verdict::AskRelease { stopped_ms: 60 }
        );
        assert_eq!(
            judge(Some('t'), false, at(6400), &mut since, &mut asked),
            Verdict::Fine
        );
        assert_eq!(
            judge(Some('t'), false, at(6600), &mut since, &mut asked),
            Verdict::End { state: 't' }
        );
    }

    #[test]
    fn a_pyprobe_that_runs_after_being_asked_is_not_ended() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (mut since, mut asked) = (None, None);
        judge(Some('T'), false, at(0), &mut since, &mut asked);
        assert!(matches!(
            judge(Some('T'), false, at(60), &mut since, &mut asked),
            Verdict::AskRelease { .. }
        ));
        // Continued, it is letting go (slowly: a starved pyprobe is not a stopped one).
        for ms in [100, 600, 2000] {
            assert_eq!(
                judge(Some('R'), false, at(ms), &mut since, &mut asked),
                Verdict::Fine
            );
        }
        // Stopped again before it let go: a grace again, then asked again.
        assert_eq!(
            judge(Some('T'), false, at(3000), &mut since, &mut asked),
            Verdict::Fine
        );
        assert!(matches!(
            judge(Some('T'), false, at(3060), &mut since, &mut asked),
            Verdict::AskRelease { .. }
        ));
    }

    #[test]
    fn the_release_request_is_taken_once() {
        let control = Control::new().expect("page");
        assert_eq!(control.take_release(), None);
        control.ask_release(0);
        assert_eq!(control.take_release(), Some(0));
        assert_eq!(control.take_release(), None);
        control.ask_release(75);
        assert_eq!(control.take_release(), Some(75));
        control.set_paused(true);
        assert!(control.paused());
        control.set_paused(false);
        assert!(!control.paused());
    }
}
