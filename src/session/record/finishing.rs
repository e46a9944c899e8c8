//! Progress while the views are finished after the target ended. The pass that
//! builds them while the recording is written runs only on idle CPU: where the
//! target and the engine kept every CPU busy (a call-heavy program traced on a
//! small machine), most of it is left for the end, tens of seconds on hundreds
//! of millions of events. The user is told what pyprobe is doing then, and how
//! far it is: a bar on a terminal, one line otherwise.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Scope;
use std::time::Duration;

/// Below this much work left (events to read and replay), the end comes within
/// about a second: nothing is said.
const SAY_FROM: u64 = 8_000_000;
/// How often the bar is redrawn.
const TICK: Duration = Duration::from_millis(250);

/// Shows the progress of `left` units of work (an event read or replayed, of a
/// recording of `events`), counted in `done`, until `stop` is set; nothing when
/// there is little left.
pub(super) fn show<'scope>(
    scope: &'scope Scope<'scope, '_>,
    events: u64,
    left: u64,
    done: &'scope AtomicU64,
    stop: &'scope AtomicBool,
) {
    if left < SAY_FROM {
        return;
    }
    let head = format!(
        "pyprobe: the target has ended; finishing the views of its {:.1} M events",
        events as f64 / 1e6
    );
    if !std::io::stderr().is_terminal() {
        // Each event is read into the first pass, then replayed.
        let share = left as f64 * 50.0 / events.max(1) as f64;
        eprintln!(
            "{head}, {share:.0}% of the work left: it is done during the run only on idle \
             CPU, and the target and pyprobe kept the CPUs busy"
        );
        return;
    }
    let bar = crate::session::progress::bar(left, head);
    scope.spawn(move || {
        while !stop.load(Ordering::Acquire) {
            bar.set_position(done.load(Ordering::Relaxed).min(left));
            std::thread::sleep(TICK);
        }
        bar.finish_and_clear();
    });
}
