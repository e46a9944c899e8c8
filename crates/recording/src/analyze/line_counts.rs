//! Per-line counts of a recording, for `pyprobe report --lines FILE`: for every
//! (file, line) the samples whose innermost frame ran it (`own`), the samples
//! with it anywhere on their stack (`total`, once per sample however deep the
//! recursion), and the `line` probe's hits on it.
//!
//! Memory is bounded by the distinct lines seen, capped at [`MAX_LINES`]:
//! beyond it new lines are counted as left out, never stored.

use std::collections::HashMap;
use std::io::Read;

use crate::analyze::states::{SampleFilter, SampleTally};
use crate::recording::{EventKind, Header, RecordError, RecordingReader, StrId};

/// Most distinct (file, line) pairs kept.
pub const MAX_LINES: usize = 1 << 20;

/// What one line was seen doing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LineCount {
    /// Samples whose innermost frame was on this line.
    pub(crate) own: u64,
    /// Samples with this line anywhere on their stack.
    pub(crate) total: u64,
    /// Times the `line` probe fired on it.
    pub(crate) hits: u64,
}

/// The per-line counts of a whole recording.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct LineCounts {
    /// By file (the recording's string id) and line.
    pub(crate) lines: HashMap<(StrId, u32), LineCount>,
    /// Which samples counted (`--idle`, `--gil`).
    pub tally: SampleTally,
    /// Samples counted, in every file.
    pub samples: u64,
    /// `line` events, in every file.
    pub(crate) hits: u64,
    /// Lines not kept past [`MAX_LINES`].
    pub left_out: u64,
}

impl LineCounts {
    /// The counts of `file`, by line, in line order.
    pub fn of_file(&self, file: StrId) -> Vec<(u32, LineCount)> {
        let mut lines: Vec<(u32, LineCount)> = self
            .lines
            .iter()
            .filter(|((f, _), _)| *f == file)
            .map(|(&(_, line), &c)| (line, c))
            .collect();
        lines.sort_unstable_by_key(|&(line, _)| line);
        lines
    }

    /// Each file seen with its own samples and hits, busiest first.
    pub fn files(&self) -> Vec<(StrId, u64, u64)> {
        let mut by_file: HashMap<StrId, (u64, u64)> = HashMap::new();
        for (&(file, _), c) in &self.lines {
            let e = by_file.entry(file).or_default();
            e.0 += c.own;
            e.1 += c.hits;
        }
        let mut files: Vec<(StrId, u64, u64)> =
            by_file.into_iter().map(|(f, (o, h))| (f, o, h)).collect();
        files.sort_unstable_by(|a, b| (b.1, b.2, a.0 .0).cmp(&(a.1, a.2, b.0 .0)));
        files
    }

    fn line(&mut self, file: StrId, line: u32) -> Option<&mut LineCount> {
        let full = self.lines.len() >= MAX_LINES;
        if full && !self.lines.contains_key(&(file, line)) {
            self.left_out += 1;
            return None;
        }
        Some(self.lines.entry((file, line)).or_default())
    }

    /// Adds one event.
    /// No counts yet, for the recording `header` describes, counting the
    /// samples `filter` keeps.
    pub fn for_recording(header: &Header, filter: SampleFilter) -> Self {
        LineCounts {
            tally: SampleTally::new(filter, header),
            ..LineCounts::default()
        }
    }

    pub fn push(&mut self, kind: &EventKind) {
        match kind {
            EventKind::Sample { frames, state } => {
                if !self.tally.admit(*state) {
                    return;
                }
                self.samples += 1;
                if let Some(leaf) = frames.last() {
                    if let Some(c) = self.line(leaf.code.file, leaf.line) {
                        c.own += 1;
                    }
                }
                // Each line once per sample, however often it recurs.
                let mut seen: Vec<(StrId, u32)> = Vec::with_capacity(frames.len());
                for f in frames {
                    let key = (f.code.file, f.line);
                    if seen.contains(&key) {
                        continue;
                    }
                    seen.push(key);
                    if let Some(c) = self.line(key.0, key.1) {
                        c.total += 1;
                    }
                }
            }
            EventKind::Line { frame } => {
                self.hits += 1;
                if let Some(c) = self.line(frame.file, frame.line) {
                    c.hits += 1;
                }
            }
            _ => {}
        }
    }
}

/// Reads every event of `reader` into per-line counts, with the samples
/// `filter` keeps.
pub fn count_lines<R: Read>(
    reader: &mut RecordingReader<R>,
    filter: SampleFilter,
) -> Result<(LineCounts, Header), RecordError> {
    let header = reader.header().clone();
    let mut counts = LineCounts::for_recording(&header, filter);
    while let Some(event) = reader.next_event() {
        counts.push(&event?.kind);
    }
    Ok((counts, header))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recording::{FrameRef, SampleState, WalkedFrame};

    fn at(file: u32, line: u32) -> WalkedFrame {
        WalkedFrame {
            code: FrameRef {
                file: StrId(file),
                function: StrId(9),
                line: 1,
            },
            line,
        }
    }

    fn sample(frames: Vec<WalkedFrame>, on_cpu: bool) -> EventKind {
        EventKind::Sample {
            frames,
            state: SampleState {
                on_cpu: Some(on_cpu),
                holds_gil: None,
            },
        }
    }

    #[test]
    fn samples_count_their_innermost_line_and_every_line_on_their_stack_once() {
        let header = Header {
            mode: "sample".into(),
            ..Header::default()
        };
        let mut c = LineCounts {
            tally: SampleTally::new(SampleFilter::default(), &header),
            ..LineCounts::default()
        };
        // A recursion through line 5 of file 0, ending on line 7.
        c.push(&sample(vec![at(0, 5), at(0, 5), at(0, 7)], true));
        c.push(&sample(vec![at(0, 5), at(1, 3)], true));
        // Waiting: left out by default.
        c.push(&sample(vec![at(0, 7)], false));
        c.push(&EventKind::Line {
            frame: FrameRef {
                file: StrId(0),
                function: StrId(9),
                line: 7,
            },
        });
        assert_eq!(c.samples, 2);
        assert_eq!(c.hits, 1);
        assert_eq!(
            c.of_file(StrId(0)),
            [
                (
                    5,
                    LineCount {
                        own: 0,
                        total: 2,
                        hits: 0
                    }
                ),
                (
                    7,
                    LineCount {
                        own: 1,
                        total: 1,
                        hits: 1
                    }
                ),
            ]
        );
        assert_eq!(c.files(), [(StrId(0), 1, 1), (StrId(1), 1, 0)]);
        assert_eq!(c.tally.idle_left_out, 1);
    }
}
