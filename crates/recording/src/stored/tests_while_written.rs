//! Views built while the recording is written, against the views of the
//! finished file.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use super::*;
use crate::analyze::first_pass::FirstPass;
use crate::recording::{Event, EventKind, FrameRef, Header, RecordingWriter};

/// Rounds of the hot loop: some 2.8 M events, more than a process's cost per
/// event needs to be settled (the views begin only then).
const ROUNDS: u32 = 700_000;
/// Events the first pass reads between two looks of the views.
const STEP: u64 = 300_000;

/// When the first call of the decorated function `deco` (entered at its `def`
/// line, 12; its code object's first line is 11) returns, which is when the
/// plan learns the first line of its row.
#[derive(Clone, Copy, PartialEq)]
enum FirstReturn {
    /// At once.
    Soon,
    /// After the views' first plan was made, before `deco` is entered again.
    Later,
    /// When the recording ends.
    AtTheEnd,
}

/// A traced CPython 3.13 recording: two threads in a hot loop under `main`,
/// with gaps of two lengths (the cost per event a replay takes away), and
/// thread 9 calling `deco`.
fn write_traced(path: &Path, first_return: FirstReturn) {
    let header = Header {
        python_version: "3.13.5".into(),
        mode: "trace".into(),
        start_ns: 1_000,
        ..Header::default()
    };
    let mut w = RecordingWriter::create(path, &header).unwrap();
    let file = w.intern("/app/hot.py");
    let frame = |w: &mut RecordingWriter<_>, name: &str, line| FrameRef {
        file,
        function: w.intern(name),
        line,
    };
    let (main, work, leaf, deco) = (
        frame(&mut w, "main", 5),
        frame(&mut w, "work", 20),
        frame(&mut w, "leaf", 30),
        frame(&mut w, "deco", 12),
    );
    let mut ts = 2_000u64;
    let mut n = 0u64;
    let mut event = |w: &mut RecordingWriter<_>, tid, kind| {
        n += 1;
        ts += if n % 50 == 0 { 31 } else { 97 };
        w.write(&Event {
            tid,
            ts_ns: ts,
            kind,
        })
        .unwrap();
    };
    let ret = |frame: FrameRef, first_line| EventKind::Return { frame, first_line };
    for tid in [7, 8] {
        event(&mut w, tid, EventKind::Call { frame: main });
    }
    event(&mut w, 9, EventKind::Call { frame: deco });
    for round in 0..ROUNDS {
        let returns_now = match first_return {
            FirstReturn::Soon => round == 10,
            FirstReturn::Later => round == 600_000,
            FirstReturn::AtTheEnd => false,
        };
        if returns_now {
            event(&mut w, 9, ret(deco, 11));
        }
        if round == 620_000 && first_return != FirstReturn::AtTheEnd {
            event(&mut w, 9, EventKind::Call { frame: deco });
            event(&mut w, 9, ret(deco, 11));
        }
        let tid = if (round / 1000) % 2 == 0 { 7 } else { 8 };
        event(&mut w, tid, EventKind::Call { frame: work });
        event(&mut w, tid, EventKind::Call { frame: leaf });
        event(&mut w, tid, ret(leaf, 30));
        event(&mut w, tid, ret(work, 20));
    }
    if first_return == FirstReturn::AtTheEnd {
        event(&mut w, 9, ret(deco, 11));
    }
    for tid in [7, 8] {
        event(&mut w, tid, ret(main, 5));
    }
    w.finish(ts + 10).unwrap();
}

/// What `record`'s planning thread does, with the file growing by [`STEP`]
/// events between two looks: the views it builds, what became of them, and
/// whether they were dropped on the way.
fn build_while_written(path: &Path) -> (Option<ViewsOutcome>, bool) {
    let mut reader = RecordingReader::open_in_place(path).unwrap();
    let filter = SliceFilter::default();
    let mut pass = FirstPass::new(reader.header(), &filter);
    let finished = AtomicBool::new(false);
    let mut views: Option<ViewsAhead> = None;
    let mut dropped = false;
    loop {
        let mut read = 0;
        while read < STEP {
            let Some(event) = reader.events().next() else {
                break;
            };
            pass.push(&event.unwrap(), reader.strings());
            read += 1;
        }
        if read < STEP {
            break;
        }
        let planned = reader.events_read();
        if views.is_none() && !dropped {
            views = ViewsAhead::start(path, &pass, planned).map(|v| v.with_lag(100_000));
        }
        if let Some(v) = views.as_mut() {
            if !v.advance(&pass, planned, &finished) {
                views = None;
                dropped = true;
            }
        }
    }
    assert!(matches!(reader.completion(), Completion::Complete(_)));
    let (plan, census) = pass.finish();
    let planned = Planned { plan, census };
    let outcome = views.map(|v| v.finish(&planned, reader.strings(), reader.qualnames()));
    (outcome, dropped)
}

#[test]
fn views_built_while_the_recording_grew_are_byte_for_byte_the_views_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    write_traced(&path, FirstReturn::Soon);
    let (outcome, dropped) = build_while_written(&path);
    let Some(ViewsOutcome::Kept { late }) = outcome else {
        panic!("not kept (dropped on the way: {dropped})");
    };
    // Replayed as the file grew: what was left at the end is the lag and the
    // last step.
    assert!(
        late <= 100_000 + 2 * STEP,
        "{late} events replayed at the end"
    );
    let (ahead, completion) = ahead::take(&path).expect("kept for the file");
    assert!(ahead::take(&path).is_none(), "taken once");
    assert!(matches!(completion, Completion::Complete(_)));

    let whole = StoredViews::build(&mut RecordingReader::open(&path).unwrap()).unwrap();
    // The cost per event was measured and taken away.
    assert!(whole.report.processes.iter().any(|p| p.event_cost_ns == 31));
    let deco = whole
        .report
        .functions
        .iter()
        .find(|f| f.function.ends_with("deco"))
        .expect("deco's row");
    assert_eq!((deco.line, deco.calls), (11, Some(2)));
    assert_eq!(
        postcard::to_stdvec(&ahead).unwrap(),
        postcard::to_stdvec(&whole).unwrap()
    );
}

#[test]
fn views_are_dropped_when_a_later_plan_answers_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    // `deco` entered again after its row's first line was learned: the first
    // plan's answer (line 12) is contradicted on the way.
    let path = dir.path().join("later.pyprobe");
    write_traced(&path, FirstReturn::Later);
    let (outcome, dropped) = build_while_written(&path);
    assert!(dropped && outcome.is_none());
    // Learned only at the end: the whole recording's plan refutes them.
    let path = dir.path().join("end.pyprobe");
    write_traced(&path, FirstReturn::AtTheEnd);
    let (outcome, dropped) = build_while_written(&path);
    assert!(!dropped && matches!(outcome, Some(ViewsOutcome::Refuted)));
    assert!(ahead::take(&path).is_none());
}
