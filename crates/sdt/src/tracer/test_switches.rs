//! Switches for tests that need pyprobe slow in one precise way (built in only with
//! the `test-switches` feature; without it every switch is off and costs nothing).
//!
//! * `PYPROBE_TEST_HOLD_RINGS=1`: nothing is read from the rings until a traced
//!   process exits, as when pyprobe is given no CPU while the program runs. The
//!   code objects of frames captured in the target may be freed by then (a
//!   module's code is, when its run ends): what pyprobe does with names it can no
//!   longer read.
//! * `PYPROBE_TEST_DIE_IN_INJECTED_CALL=N`: pyprobe kills itself (SIGKILL) once
//!   the Nth injected call has the thread's registers set, the moment a user's
//!   `kill -9` is most dangerous (the guardian's tests).

#[cfg(feature = "test-switches")]
mod on {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::OnceLock;

    static RELEASED: AtomicBool = AtomicBool::new(false);

    fn asked() -> bool {
        static ASKED: OnceLock<bool> = OnceLock::new();
        *ASKED.get_or_init(|| std::env::var_os("PYPROBE_TEST_HOLD_RINGS").is_some_and(|v| v == "1"))
    }

    pub fn rings_held() -> bool {
        asked() && !RELEASED.load(Ordering::Relaxed)
    }

    pub fn release_rings() {
        RELEASED.store(true, Ordering::Relaxed);
    }

    pub fn die_here_if_asked() {
        use std::sync::atomic::AtomicU64;
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let Some(n) = std::env::var("PYPROBE_TEST_DIE_IN_INJECTED_CALL")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        else {
            return;
        };
        if CALLS.fetch_add(1, Ordering::Relaxed) + 1 == n {
            // SAFETY: kill(2) on this very process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    }
}

#[cfg(feature = "test-switches")]
pub(crate) use on::{die_here_if_asked, release_rings, rings_held};

#[cfg(not(feature = "test-switches"))]
pub(crate) fn rings_held() -> bool {
    false
}

#[cfg(not(feature = "test-switches"))]
pub(crate) fn release_rings() {}

#[cfg(not(feature = "test-switches"))]
pub(crate) fn die_here_if_asked() {}
