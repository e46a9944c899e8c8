//! A first pass made before it is asked for. `pyprobe record` plans its
//! recording while it is written (reading the file as it grows), so the views
//! it writes when the target exits read the events once, not twice. What it
//! planned is kept here for that file as it was then: a reader of the file, at
//! its first event, while the file is still that, takes it.

use std::sync::Arc;

use super::first_pass::Planned;
use crate::recording::{FileKey, MadeAhead, Qualnames, RecordingReader};

/// The first pass of one file, and the names it read to the end.
struct PlannedFile {
    planned: Planned,
    strings: Vec<String>,
    qualnames: Qualnames,
}

static AHEAD: MadeAhead<Arc<PlannedFile>> = MadeAhead::new();

/// How many times a view took a first pass made before instead of its own.
pub fn times_taken() -> u64 {
    AHEAD.times_used()
}

/// Keeps `planned`, the first pass of every event of the file whose key is `key`
/// (read to its end), with the recording's `strings` and `qualnames`.
pub fn remember(key: FileKey, planned: Planned, strings: Vec<String>, qualnames: Qualnames) {
    let file = PlannedFile {
        planned,
        strings,
        qualnames,
    };
    AHEAD.remember(key, Arc::new(file));
}

/// The first pass of `reader`'s file, when it was made before and the file is
/// as it was then; the reader, at its first event, then knows every name, as
/// after a pass of its own.
pub(crate) fn known<R: std::io::Read + std::io::Seek>(
    reader: &mut RecordingReader<R>,
) -> Option<Planned> {
    if reader.events_read() != 0 {
        return None;
    }
    let file = AHEAD.copy_for(reader.file_key()?)?;
    reader.know_names(file.strings.clone(), file.qualnames.clone());
    Some(file.planned.clone())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::analyze::first_pass::{plan_recording_reporting, FirstPass};
    use crate::analyze::SliceFilter;
    use crate::recording::{Completion, Event, EventKind, FrameRef, Header, RecordingWriter};

    /// Calls of a new function every 1,000 events, each returning at once.
    fn write_calls(w: &mut RecordingWriter<impl Write>, from: u64, n: u64) {
        for i in from..from + n {
            let name = w.intern(&format!("f{}", i / 1_000));
            let frame = FrameRef {
                file: name,
                function: name,
                line: 1,
            };
            let kind = if i % 2 == 0 {
                EventKind::Call { frame }
            } else {
                EventKind::Return {
                    frame,
                    first_line: 1,
                }
            };
            let ts_ns = 1_000 + i * 50;
            w.write(&Event {
                tid: 3,
                ts_ns,
                kind,
            })
            .unwrap();
        }
    }

    #[test]
    fn a_first_pass_made_while_the_file_grew_is_the_pass_of_the_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.pyprobe");
        let header = Header {
            mode: "trace".into(),
            ..Header::default()
        };
        let mut w = Some(RecordingWriter::create(&path, &header).unwrap());
        let mut written = 0u64;
        let mut write_more = |w: &mut Option<RecordingWriter<_>>| {
            if written < 200_000 {
                let w = w.as_mut().unwrap();
                write_calls(w, written, 20_000);
                w.flush().unwrap();
                written += 20_000;
            } else if let Some(w) = w.take() {
                w.finish(1_000 + written * 50).unwrap();
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        // The header reaches the file with the first events.
        let mut reader = loop {
            if let Ok(r) = RecordingReader::open_in_place(&path) {
                break r;
            }
            write_more(&mut w);
        };
        let filter = SliceFilter::default();
        let mut pass = FirstPass::new(reader.header(), &filter);
        let mut resumed = 0;
        loop {
            while let Some(event) = reader.events().next() {
                pass.push(&event.unwrap(), reader.strings());
            }
            match reader.completion() {
                Completion::Complete(_) => break,
                Completion::Truncated { .. } => {}
                other => panic!("{other:?}"),
            }
            write_more(&mut w);
            resumed += u32::from(reader.resume().unwrap());
            assert!(resumed < 1_000, "never read to its end");
        }
        assert!(resumed > 5, "resumed {resumed} times");
        assert_eq!(reader.events_read(), 200_000);
        let (plan, census) = pass.finish();

        let mut whole = RecordingReader::open(&path).unwrap();
        let (whole_plan, whole_census) =
            plan_recording_reporting(&mut whole, &filter, &mut |_| {}).unwrap();
        assert_eq!(census, whole_census);
        assert_eq!(format!("{plan:?}"), format!("{whole_plan:?}"));

        let key = reader.file_key().unwrap();
        let strings = reader.strings().to_vec();
        let qualnames = reader.qualnames().clone();
        remember(key, Planned { plan, census }, strings.clone(), qualnames);
        let mut fresh = RecordingReader::open(&path).unwrap();
        let kept = known(&mut fresh).expect("the pass of the file as it is");
        assert_eq!(kept.census, whole_census);
        assert_eq!(fresh.strings(), &strings[..]);
        // Taken from here, the views' first pass reads nothing.
        let mut again = RecordingReader::open(&path).unwrap();
        let (_, census) = plan_recording_reporting(&mut again, &filter, &mut |_| {}).unwrap();
        assert_eq!((census, again.events_read()), (whole_census, 0));

        // The file changed: its old pass is not taken.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"x")
            .unwrap();
        assert!(known(&mut RecordingReader::open(&path).unwrap()).is_none());
    }
}
