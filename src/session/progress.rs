//! The progress bar of long work on a recording (reading it for every view,
//! finishing its views after the target ended): one look for all of them.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar on stderr, redrawn at most four times a second, of `len` units of work,
/// headed by `message`, with its share done and the time left.
pub(crate) fn bar(len: u64, message: String) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr_with_hz(4));
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {percent}% ({eta} left)")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(message);
    bar
}
