//! Which sampled stacks a view counts, by what their thread was doing when the
//! stack was read: on a CPU or waiting, holding the GIL or not.
//!
//! By default only samples of threads on a CPU count, so a thread sleeping in
//! `select` or `time.sleep` does not take the profile over (py-spy does the same);
//! `--idle` counts the waiting threads too, and `--gil` only the thread holding the
//! GIL. A sample whose state was not recorded (recordings before format 3) counts
//! as on a CPU, and one whose GIL state is unknown is kept by `--gil`: neither is
//! guessed, and the views say how many there were.
//!
//! Only samples are filtered. Calls traced exactly, and the samples that time them
//! in a trace-mode recording (CPython 3.11, whose entries do not fire), count
//! whatever the thread was doing: they measure wall time.

use crate::recording::{Header, SampleState};

/// `--idle` and `--gil`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SampleFilter {
    /// Count the samples of waiting threads too.
    pub idle: bool,
    /// Count only the samples of the thread holding the GIL.
    pub gil: bool,
}

impl SampleFilter {
    /// What it keeps, in a few words.
    pub(crate) fn describe(&self) -> &'static str {
        match (self.idle, self.gil) {
            (false, false) => "threads on a CPU (the default)",
            (true, false) => "every thread, on a CPU or waiting (--idle)",
            (false, true) => "the thread holding the GIL, on a CPU (--gil)",
            (true, true) => "the thread holding the GIL, on a CPU or waiting (--gil --idle)",
        }
    }
}

/// What a [`SampleFilter`] did over a recording.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SampleTally {
    pub filter: SampleFilter,
    /// Whether the filter applied: not to a trace-mode recording, whose samples time
    /// its exact calls.
    pub(crate) applied: bool,
    /// Samples seen.
    pub samples: u64,
    /// Samples counted.
    pub kept: u64,
    /// Left out: their thread was waiting (and `--idle` was not given).
    pub(crate) idle_left_out: u64,
    /// Left out by `--gil`: their thread did not hold the GIL.
    pub(crate) gil_left_out: u64,
    /// Counted, their thread's CPU state unknown (not recorded): taken as on a CPU.
    pub cpu_unknown: u64,
    /// Counted, whether their thread held the GIL unknown.
    pub(crate) gil_unknown: u64,
}

impl SampleTally {
    /// A tally of `filter` over the recording `header` describes.
    pub fn new(filter: SampleFilter, header: &Header) -> Self {
        SampleTally {
            filter,
            applied: header.mode != "trace",
            ..SampleTally::default()
        }
    }

    /// Whether a sample of a thread in `state` counts; tallies it either way.
    pub(crate) fn admit(&mut self, state: SampleState) -> bool {
        self.samples += 1;
        if self.applied {
            if !self.filter.idle && state.on_cpu == Some(false) {
                self.idle_left_out += 1;
                return false;
            }
            if self.filter.gil && state.holds_gil == Some(false) {
                self.gil_left_out += 1;
                return false;
            }
        }
        self.kept += 1;
        if state.on_cpu.is_none() {
            self.cpu_unknown += 1;
        }
        if state.holds_gil.is_none() {
            self.gil_unknown += 1;
        }
        true
    }

    /// Samples left out.
    pub fn left_out(&self) -> u64 {
        self.idle_left_out + self.gil_left_out
    }

    /// What a reader should know, one line each: which filter applied, what it left
    /// out, and what it could not tell. Empty without samples.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.samples == 0 {
            return notes;
        }
        if !self.applied {
            notes.push(format!(
                "samples: all {} counted, whatever their thread was doing (trace mode: they \
                 time the exact calls)",
                self.samples
            ));
            return notes;
        }
        let mut line = format!("samples: {}", self.filter.describe());
        if self.filter.idle {
            line.push_str(&format!("; {} counted", self.kept));
        } else {
            line.push_str(&format!(
                "; idle samples left out: {} of {}; --idle includes them",
                self.idle_left_out, self.samples
            ));
        }
        if self.filter.gil {
            line.push_str(&format!(
                "; samples of threads not holding the GIL left out: {} of {}",
                self.gil_left_out, self.samples
            ));
        }
        notes.push(line);
        if self.cpu_unknown > 0 {
            notes.push(format!(
                "note: {} of the samples counted have no thread state (recorded before pyprobe \
                 recorded it): counted as on a CPU",
                self.cpu_unknown
            ));
        }
        if self.filter.gil && self.gil_unknown > 0 {
            notes.push(format!(
                "note: whether the thread held the GIL is unknown for {} of the samples counted \
                 (not readable in this CPython, or not recorded): kept",
                self.gil_unknown
            ));
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(on_cpu: Option<bool>, holds_gil: Option<bool>) -> SampleState {
        SampleState { on_cpu, holds_gil }
    }

    fn tally(idle: bool, gil: bool, mode: &str) -> SampleTally {
        let header = Header {
            mode: mode.into(),
            ..Header::default()
        };
        let mut t = SampleTally::new(SampleFilter { idle, gil }, &header);
        for s in [
            state(Some(true), Some(true)),
            state(Some(true), Some(false)),
            state(Some(false), Some(false)),
            state(Some(false), Some(true)),
            state(None, None),
        ] {
            t.admit(s);
        }
        t
    }

    #[test]
    fn default_keeps_on_cpu_and_unknown() {
        let t = tally(false, false, "sample");
        assert_eq!(
            (t.samples, t.kept, t.idle_left_out, t.gil_left_out),
            (5, 3, 2, 0)
        );
        assert_eq!(t.cpu_unknown, 1);
        let notes = t.notes();
        assert!(notes[0].contains("idle samples left out: 2 of 5; --idle includes them"));
        assert!(notes[1].contains("1 of the samples counted have no thread state"));
    }

    #[test]
    fn idle_keeps_everything_and_gil_only_the_holder() {
        let t = tally(true, false, "auto");
        assert_eq!((t.kept, t.left_out()), (5, 0));
        let t = tally(false, true, "auto");
        // On CPU holding it, and the unknown one.
        assert_eq!((t.kept, t.idle_left_out, t.gil_left_out), (2, 2, 1));
        assert!(t.notes().iter().any(|n| n.contains("GIL is unknown for 1")));
        let t = tally(true, true, "auto");
        assert_eq!((t.kept, t.idle_left_out, t.gil_left_out), (3, 0, 2));
    }

    #[test]
    fn trace_mode_samples_are_not_filtered() {
        let t = tally(false, true, "trace");
        assert_eq!((t.kept, t.left_out()), (5, 0));
        assert!(t.notes()[0].contains("trace mode"));
        assert!(tally(false, false, "sample").applied);
        assert!(SampleTally::default().notes().is_empty());
    }
}
