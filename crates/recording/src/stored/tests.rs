//! Stored views against the views read from the events themselves.

use std::path::Path;

use super::*;
use crate::analyze::folded::{FoldFrame, Measure};
use crate::analyze::line_counts::count_lines;
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
    let (kept, bytes) = save(&path, before, &reader, &views).unwrap();
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
    let (kept, _) = save(&path, before, &reader, &views).unwrap();
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
