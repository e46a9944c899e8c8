//! Stored views against the views read from the events themselves.

use std::path::Path;

use super::*;
use crate::analyze::folded::{FoldFrame, Measure};
use crate::analyze::line_counts::count_lines;
use crate::analyze::SampleFilter;
use crate::output::flame::{read_folded_by_thread, read_folded_filtered, FrameGrain};
use crate::output::report::build_report;
use crate::recording::{
    Event, EventKind, FrameRef, Header, RecordingWriter, SampleState, WalkedFrame,
};

fn header() -> Header {
    Header {
        python_version: "3.12.1".into(),
        mode: "auto".into(),
        start_ns: 1_000,
        sample_interval_ns: 1_000_000,
        ..Header::default()
    }
}

/// Two threads calling into each other's functions, a sampled stretch, a
/// frame left open at the end: every part of a fold and a report.
fn write_recording(path: &Path) {
    let mut w = RecordingWriter::create(path, &header()).unwrap();
    let file = w.intern("/app/main.py");
    let frame = |w: &mut RecordingWriter<_>, name: &str, line| FrameRef {
        file,
        function: w.intern(name),
        line,
    };
    let (main, work, leaf) = (
        frame(&mut w, "main", 1),
        frame(&mut w, "work", 10),
        frame(&mut w, "leaf", 20),
    );
    let mut ts = 2_000;
    let mut event = |w: &mut RecordingWriter<_>, tid, kind| {
        ts += 137;
        w.write(&Event {
            tid,
            ts_ns: ts,
            kind,
        })
        .unwrap();
    };
    for tid in [7, 8] {
        event(&mut w, tid, EventKind::Call { frame: main });
    }
    for round in 0..50u32 {
        let tid = if round % 3 == 0 { 8 } else { 7 };
        event(&mut w, tid, EventKind::Call { frame: work });
        if round % 2 == 0 {
            event(&mut w, tid, EventKind::Call { frame: leaf });
            event(
                &mut w,
                tid,
                EventKind::Return {
                    frame: leaf,
                    first_line: 20,
                },
            );
        }
        event(
            &mut w,
            tid,
            EventKind::Return {
                frame: work,
                first_line: 10,
            },
        );
    }
    let frames = vec![
        WalkedFrame {
            code: main,
            line: 3,
        },
        WalkedFrame {
            code: work,
            line: 12,
        },
    ];
    for _ in 0..5 {
        event(
            &mut w,
            9,
            EventKind::Sample {
                frames: frames.clone(),
                state: SampleState::default(),
            },
        );
    }
    event(
        &mut w,
        8,
        EventKind::Return {
            frame: main,
            first_line: 1,
        },
    );
    w.finish(ts + 10_000).unwrap();
}

/// Every stack with its values, for comparing two folds.
fn stacks(folded: &Folded) -> Vec<(Vec<FoldFrame>, [u64; 3])> {
    let mut out = Vec::new();
    folded.for_each_stack(Measure::Time, |path, _| out.push((path.to_vec(), [0; 3])));
    for measure in [Measure::Calls, Measure::Samples] {
        folded.for_each_stack(measure, |path, _| {
            if !out.iter().any(|(p, _)| p == path) {
                out.push((path.to_vec(), [0; 3]));
            }
        });
    }
    for (path, values) in &mut out {
        for (i, m) in [Measure::Time, Measure::Calls, Measure::Samples]
            .into_iter()
            .enumerate()
        {
            folded.for_each_stack(m, |p, v| {
                if p == path.as_slice() {
                    values[i] = v;
                }
            });
        }
    }
    out
}

fn assert_same_fold(a: &Folded, b: &Folded) {
    assert_eq!(a.tree.len(), b.tree.len());
    assert_eq!(stacks(a), stacks(b));
    assert_eq!(a.counts, b.counts);
    assert_eq!(a.counters, b.counters);
    assert_eq!(a.tally, b.tally);
}

#[test]
fn stored_views_are_the_views_of_the_events() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    write_recording(&path);
    let mut reader = RecordingReader::open(&path).unwrap();
    let views = StoredViews::build(&mut reader).unwrap();

    let report = build_report(&mut RecordingReader::open(&path).unwrap()).unwrap();
    assert_eq!(views.report, report);
    assert!(report.functions.iter().any(|f| f.calls == Some(50)));

    let (by_thread, _) = read_folded_by_thread(
        &mut RecordingReader::open(&path).unwrap(),
        SampleFilter::default(),
        FrameGrain::Functions,
    )
    .unwrap();
    assert_same_fold(&views.stacks, &by_thread);
    let (merged, info) = read_folded_filtered(
        &mut RecordingReader::open(&path).unwrap(),
        SampleFilter::default(),
        FrameGrain::Functions,
    )
    .unwrap();
    assert_same_fold(&views.merged_stacks(), &merged);
    assert!(merged.tree.len() < by_thread.tree.len());
    assert_eq!(views.info.end_ns, info.end_ns);
    assert_eq!(views.strings, reader.strings());

    let (lines, _) = count_lines(
        &mut RecordingReader::open(&path).unwrap(),
        SampleFilter::default(),
    )
    .unwrap();
    assert_eq!(views.lines.files(), lines.files());
    assert_eq!(views.lines.samples, lines.samples);
    assert!(lines.samples > 0);
}

#[test]
fn saved_views_load_while_the_recording_is_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    write_recording(&path);
    assert!(matches!(load(&path), Lookup::Missing));

    let before = FileState::of(&path).unwrap();
    let mut reader = RecordingReader::open(&path).unwrap();
    let views = StoredViews::build(&mut reader).unwrap();
    let (kept, bytes) = save(&path, before, reader.completion(), &views).unwrap();
    assert_eq!(kept, path_for(&path));
    assert_eq!(fs::metadata(&kept).unwrap().len(), bytes);

    let Lookup::Fresh(loaded) = load(&path) else {
        panic!("the views just saved are not found")
    };
    assert_eq!(loaded.report, views.report);
    assert_same_fold(&loaded.stacks, &views.stacks);
    assert_eq!(loaded.strings, views.strings);

    // Another recording written over it: the views are of the old one.
    std::thread::sleep(std::time::Duration::from_millis(10));
    write_recording(&path);
    let mut f = fs::OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(b"x").unwrap();
    assert!(matches!(load(&path), Lookup::Stale));
}

/// A recording in `dir` with its views kept: the recording's path and the views
/// file's.
fn recording_with_views(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let path = dir.join("run.pyprobe");
    write_recording(&path);
    let before = FileState::of(&path).unwrap();
    let mut reader = RecordingReader::open(&path).unwrap();
    let views = StoredViews::build(&mut reader).unwrap();
    let (kept, _) = save(&path, before, reader.completion(), &views).unwrap();
    (path, kept)
}

#[test]
fn a_damaged_views_file_is_unreadable_and_never_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let (path, kept) = recording_with_views(dir.path());
    let good = fs::read(&kept).unwrap();

    let mut flipped = good.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    fs::write(&kept, &flipped).unwrap();
    assert!(matches!(load(&path), Lookup::Unreadable(why) if why.contains("checksum")));

    fs::write(&kept, &good[..good.len() / 2]).unwrap();
    assert!(matches!(load(&path), Lookup::Unreadable(why) if why.contains("cut short")));

    fs::write(&kept, b"not views at all, but long enough").unwrap();
    assert!(matches!(load(&path), Lookup::Unreadable(_)));
}

#[test]
fn a_stack_tree_must_be_a_tree() {
    let mut reader = {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.pyprobe");
        write_recording(&path);
        RecordingReader::open(&path).unwrap()
    };
    let views = StoredViews::build(&mut reader).unwrap();
    let bytes = postcard::to_stdvec(&views.stacks.tree).unwrap();
    assert!(postcard::from_bytes::<crate::analyze::folded::StackTree>(&bytes).is_ok());
    // The same nodes as plain (parent, frame) pairs, then a node naming itself,
    // or a later node, as its parent.
    let nodes: Vec<(u32, Option<FoldFrame>)> = postcard::from_bytes(&bytes).unwrap();
    for bad_parent in [nodes.len() as u32 - 1, nodes.len() as u32 + 5] {
        let mut bad = nodes.clone();
        let last = bad.len() - 1;
        bad[last].0 = bad_parent;
        let bytes = postcard::to_stdvec(&bad).unwrap();
        assert!(postcard::from_bytes::<crate::analyze::folded::StackTree>(&bytes).is_err());
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// A views file damaged where its checksum cannot tell (the checksum made
    /// again over the damage) is refused or read, never a panic, and what is
    /// read draws.
    #[test]
    fn views_damaged_under_a_good_checksum_never_panic(
        flips in proptest::collection::vec((proptest::prelude::any::<u32>(), 1u8..=255), 1..8)
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (path, kept) = recording_with_views(dir.path());
        let mut bytes = fs::read(&kept).unwrap();
        let payload_len = bytes.len() - PREFIX_LEN;
        for (at, xor) in flips {
            bytes[PREFIX_LEN + at as usize % payload_len] ^= xor;
        }
        let crc = crc32fast::hash(&bytes[PREFIX_LEN..]);
        bytes[12..16].copy_from_slice(&crc.to_le_bytes());
        fs::write(&kept, &bytes).unwrap();
        if let Lookup::Fresh(views) = load(&path) {
            let merged = views.merged_stacks();
            let names = crate::output::names::FrameNames::new(&views.strings, false);
            let mut out = Vec::new();
            let _ = crate::output::flame::write_collapsed(&merged, Measure::Time, &names, &mut out);
            let _ = crate::output::report::render_json(&views.report);
            let _ = crate::output::report::render_table_paths(&views.report, 120, false);
            let _ = crate::output::top::snapshot_between(None, &views.report);
        }
    }
}

/// A recording of many chunks on two threads: a frame running when tracing
/// began (returned from at the end), a hot loop everywhere, and `rare` entered
/// in a few places, once for longer than a chunk. CPython 3.15: `rare` makes
/// a generator (an entry that never returns), which only the count of each
/// thread's entries so far tells from a call.
fn write_long_recording(path: &Path) {
    let header = Header {
        python_version: "3.15.0".into(),
        ..header()
    };
    // Stored uncompressed: its chunks keep the bytes that space the checkpoints
    // the tests count on.
    let out = crate::recording::BackgroundWriter::plain(std::fs::File::create(path).unwrap());
    let mut w = RecordingWriter::new(out.unwrap(), &header).unwrap();
    let file = w.intern("/app/long.py");
    let frame = |w: &mut RecordingWriter<_>, name: &str, line| FrameRef {
        file,
        function: w.intern(name),
        line,
    };
    let (outer, main, work, leaf, rare, made) = (
        frame(&mut w, "outer", 1),
        frame(&mut w, "main", 5),
        frame(&mut w, "work", 10),
        frame(&mut w, "leaf", 20),
        frame(&mut w, "rare", 30),
        frame(&mut w, "made", 40),
    );
    let mut ts = 2_000;
    let mut event = |w: &mut RecordingWriter<_>, tid, kind| {
        ts += 97;
        w.write(&Event {
            tid,
            ts_ns: ts,
            kind,
        })
        .unwrap();
    };
    let ret = |frame: FrameRef| EventKind::Return {
        frame,
        first_line: frame.line,
    };
    for tid in [7, 8] {
        event(&mut w, tid, EventKind::Call { frame: main });
    }
    for round in 0..300_000u32 {
        let tid = if (round / 1000) % 2 == 0 { 7 } else { 8 };
        if [40_000, 170_000, 290_000].contains(&round) {
            event(&mut w, tid, EventKind::Call { frame: rare });
            event(&mut w, tid, EventKind::Call { frame: rare });
            event(&mut w, tid, EventKind::Call { frame: made });
            event(
                &mut w,
                tid,
                EventKind::Return {
                    frame: rare,
                    first_line: 30,
                },
            );
            event(&mut w, tid, ret(rare));
        }
        // A call of `rare` on thread 9 open across many chunks.
        if round == 100_000 {
            event(&mut w, 9, EventKind::Call { frame: rare });
        }
        if (100_000..160_000).contains(&round) && round % 500 == 0 {
            event(&mut w, 9, EventKind::Call { frame: leaf });
            event(&mut w, 9, ret(leaf));
        }
        if round == 160_000 {
            event(&mut w, 9, ret(rare));
        }
        event(&mut w, tid, EventKind::Call { frame: work });
        event(&mut w, tid, EventKind::Call { frame: leaf });
        event(&mut w, tid, ret(leaf));
        event(&mut w, tid, ret(work));
    }
    for tid in [7, 8] {
        event(&mut w, tid, ret(main));
    }
    event(&mut w, 8, ret(outer));
    w.finish(ts + 10).unwrap();
}

/// A file that counts the bytes read from it.
struct Counting {
    file: std::fs::File,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl std::io::Read for Counting {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

impl std::io::Seek for Counting {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        self.file.seek(to)
    }
}

#[test]
fn the_call_flow_from_checkpoints_is_the_flow_of_every_event() {
    use crate::output::calls::{write_calls, write_calls_with_plan, CallsOptions, KeptReplay};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.pyprobe");
    write_long_recording(&path);
    let size = std::fs::metadata(&path).unwrap().len();
    let views = StoredViews::build_checkpointed(
        &mut RecordingReader::open(&path).unwrap(),
        &mut |_, _| {},
        CheckpointBuilder::every(1),
    )
    .unwrap();
    assert!(
        views.checkpoints.intervals() > 8,
        "{} intervals in {size} bytes",
        views.checkpoints.intervals()
    );
    let cases = [
        ("rare", None, None, false),
        ("long.py:rare", Some(9), None, false),
        ("rare", None, Some(1), true),
        ("outer", None, None, false),
        ("main", Some(7), Some(2), false),
        ("nowhere", None, None, false),
    ];
    for (start_at, thread, max_depth, json) in cases {
        let options = CallsOptions {
            start_at: Some(start_at.into()),
            thread,
            max_depth,
            json,
            full_paths: false,
        };
        let mut every = Vec::new();
        let full = write_calls(
            &mut RecordingReader::open(&path).unwrap(),
            &options,
            &mut every,
        )
        .unwrap();
        let read = std::rc::Rc::new(std::cell::Cell::new(0));
        let input = Counting {
            file: std::fs::File::open(&path).unwrap(),
            read: read.clone(),
        };
        let kept = KeptReplay {
            plan: views.planned.plan.clone(),
            checkpoints: views.checkpoints.clone(),
            strings: views.strings.clone(),
            qualnames: views.info.qualnames.clone(),
        };
        let mut from_kept = Vec::new();
        let part = write_calls_with_plan(
            &mut RecordingReader::from_reader(input).unwrap(),
            Some(kept),
            &options,
            &mut from_kept,
        )
        .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&every),
            String::from_utf8_lossy(&from_kept),
            "--start-at {start_at}"
        );
        assert_eq!(full, part, "--start-at {start_at}");
        if start_at == "rare" && max_depth.is_none() {
            let text = String::from_utf8_lossy(&every);
            assert_eq!(text.matches("(creates a generator").count(), 3, "{text}");
        }
        if start_at.ends_with("rare") || start_at == "nowhere" {
            assert!(
                read.get() < size / 2,
                "--start-at {start_at} read {} of {size} bytes",
                read.get()
            );
        }
    }
}
