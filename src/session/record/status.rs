//! The one-line live status of `pyprobe record` on a terminal: elapsed time, events
//! or samples, their rate, lost events, output size. Silent when stderr is not a
//! terminal (logs and pipes get only the start and end lines).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct Status {
    bar: Option<ProgressBar>,
    started: Instant,
    last: Instant,
}

impl Status {
    pub fn new() -> Status {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(4));
            bar.set_style(
                ProgressStyle::with_template("{spinner} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar
        });
        let now = Instant::now();
        Status {
            bar,
            started: now,
            last: now,
        }
    }

    /// Updates the line, at most four times a second (cheap to call on every event).
    pub fn update(&mut self, events: u64, samples: u64, lost: u64, bytes: u64) {
        let Some(bar) = &self.bar else { return };
        let now = Instant::now();
        if now.duration_since(self.last) < Duration::from_millis(250) {
            return;
        }
        self.last = now;
        let elapsed = now.duration_since(self.started).as_secs_f64().max(0.001);
        let what = if samples > 0 {
            format!("{samples} samples, ")
        } else {
            String::new()
        };
        bar.set_message(format!(
            "recording {:.1} s: {what}{events} events ({:.0}/s), {lost} lost, {}",
            elapsed,
            events as f64 / elapsed,
            human_bytes(bytes)
        ));
        bar.tick();
    }

    /// Clears the line before the end summary is printed.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn human_bytes(n: u64) -> String {
    match n {
        0..=9_999 => format!("{n} B"),
        10_000..=9_999_999 => format!("{:.1} kB", n as f64 / 1e3),
        _ => format!("{:.1} MB", n as f64 / 1e6),
    }
}
