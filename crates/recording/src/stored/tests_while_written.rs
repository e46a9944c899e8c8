//! Views built while the recording is written, against the views of the
//! finished file.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use super::*;
use crate::recording::{Event, EventKind, FrameRef, Header, RecordingWriter};

/// Rounds of the hot loop: some 2.8 M events, more than a process's cost per
/// event needs to be settled (the views begin only then).
const ROUNDS: u32 = 700_000;
/// Events written between two looks at the file.
const STEP: u64 = 300_000;
/// The child process of [`write_traced`] (its first thread's id), and the round
/// it starts at.
const CHILD: u32 = 40;
const CHILD_FROM: u32 = 640_000;

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
/// thread 9 calling `deco`; with `child`, a child process (`--subprocesses`)
/// in the hot loop too over the last rounds, too few for its cost per event to
/// be measured. `written` is called each [`STEP`] events, the file flushed:
/// what `record`'s planning thread sees of a recording as it grows.
fn write_traced(path: &Path, first_return: FirstReturn, child: bool, mut written: impl FnMut()) {
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
    let command = w.intern("python3 child.py");
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
        if n % STEP == 0 {
            w.flush().unwrap();
            written();
        }
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
        if child && round == CHILD_FROM {
            let parent = 0;
            event(&mut w, CHILD, EventKind::ProcessStart { parent, command });
        }
        if child && round > CHILD_FROM {
            event(&mut w, CHILD, EventKind::Call { frame: leaf });
            event(&mut w, CHILD, ret(leaf, 30));
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

/// How the planning thread reads.
#[derive(Clone, Copy, PartialEq)]
enum Reading {
    /// A look at the file each [`STEP`] events.
    AsItGrows,
    /// The same, and one more after its end marker.
    ToTheEnd,
    /// Each look replays a tenth of what was written since the last: the
    /// views are still catching up when the recording ends.
    Slowly,
}

/// What `record`'s planning thread does with the recording written at `path`,
/// reading it as `reading` says, then the session when it ends.
fn read_while_written(
    path: &Path,
    first_return: FirstReturn,
    child: bool,
    reading: Reading,
) -> Finished {
    let finished = AtomicBool::new(false);
    let mut ww: Option<WhileWritten> = None;
    let mut looks = 0;
    write_traced(path, first_return, child, || {
        let ww = ww.get_or_insert_with(|| {
            let reader = RecordingReader::open_in_place(path).unwrap();
            let ww = WhileWritten::new(path.to_path_buf(), reader).with_lag(50_000);
            match reading {
                Reading::Slowly => ww.with_catch_up_per_look(STEP / 10),
                _ => ww,
            }
        });
        if reading == Reading::Slowly {
            ww.look(&finished).unwrap();
        } else {
            while ww.look(&finished).unwrap() == Looked::Again {}
        }
        looks += 1;
    });
    assert!(looks > 5, "{looks} looks");
    let mut ww = ww.unwrap();
    if reading == Reading::ToTheEnd {
        while ww.look(&finished).unwrap() == Looked::Again {}
    }
    if first_return == FirstReturn::Soon {
        assert_eq!(
            ww.reads_once(),
            reading != Reading::Slowly,
            "whether the views caught up with the first pass"
        );
    }
    // What is left to read and replay is what the count of work done reaches.
    let events = RecordingReader::open(path).unwrap().events().count() as u64;
    let left = ww.left(events);
    let done = std::sync::atomic::AtomicU64::new(0);
    let finished = ww.finish(&done).expect("read to its end");
    let done = done.into_inner();
    assert_eq!(finished.events, events);
    match finished.views {
        Some(ViewsOutcome::Kept { .. }) => assert_eq!(done, left, "work done"),
        _ => assert!(done <= left, "{done} of {left}"),
    }
    finished
}

/// The views kept for the file at `path`, and the views of its events.
fn kept_and_built(path: &Path) -> (Vec<u8>, StoredViews) {
    let (ahead, completion) = ahead::take(path).expect("kept for the file");
    assert!(ahead::take(path).is_none(), "taken once");
    assert!(matches!(completion, Completion::Complete(_)));
    let whole = StoredViews::build(&mut RecordingReader::open(path).unwrap()).unwrap();
    (postcard::to_stdvec(&ahead).unwrap(), whole)
}

#[test]
fn views_built_while_the_recording_grew_are_byte_for_byte_the_views_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    let done = read_while_written(&path, FirstReturn::Soon, false, Reading::AsItGrows);
    let Some(ViewsOutcome::Kept { late }) = done.views else {
        panic!("not kept");
    };
    // Replayed as the file grew: what was left at the end is twice the lag and
    // the last step.
    assert!(
        late <= 2 * 50_000 + STEP,
        "{late} events replayed at the end"
    );
    assert!(
        done.planned_late <= STEP,
        "{} planned at the end",
        done.planned_late
    );
    let (ahead, whole) = kept_and_built(&path);
    // The cost per event was measured and taken away.
    assert!(whole.report.processes.iter().any(|p| p.event_cost_ns == 31));
    let deco = whole
        .report
        .functions
        .iter()
        .find(|f| f.function.ends_with("deco"))
        .expect("deco's row");
    assert_eq!((deco.line, deco.calls), (11, Some(2)));
    assert_eq!(ahead, postcard::to_stdvec(&whole).unwrap());

    // The thread's last look read to the end marker before the recording was
    // said finished: nothing is left to plan.
    let done = read_while_written(&path, FirstReturn::Soon, false, Reading::ToTheEnd);
    assert!(matches!(done.views, Some(ViewsOutcome::Kept { .. })));
    assert_eq!(done.planned_late, 0);
    let (ahead, whole) = kept_and_built(&path);
    assert_eq!(ahead, postcard::to_stdvec(&whole).unwrap());

    // Still catching up at the end: the pass reads the rest of its chunk, then
    // the views' reader reads on for both, the replay beside the pass.
    let done = read_while_written(&path, FirstReturn::Soon, false, Reading::Slowly);
    let Some(ViewsOutcome::Kept { late }) = done.views else {
        panic!(
            "not kept: {:?}",
            done.views.map(|v| matches!(v, ViewsOutcome::Refuted))
        );
    };
    assert!(late > STEP, "{late}");
    let (ahead, whole) = kept_and_built(&path);
    assert_eq!(ahead, postcard::to_stdvec(&whole).unwrap());
}

#[test]
fn views_are_dropped_when_a_later_plan_answers_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    // `deco` entered again after its row's first line was learned: the first
    // plan's answer (line 12) is contradicted on the way.
    let path = dir.path().join("later.pyprobe");
    let done = read_while_written(&path, FirstReturn::Later, false, Reading::AsItGrows);
    assert!(!matches!(done.views, Some(ViewsOutcome::Kept { .. })));
    assert!(ahead::take(&path).is_none());
    // Learned only at the end: the whole recording's plan refutes them.
    let path = dir.path().join("end.pyprobe");
    let done = read_while_written(&path, FirstReturn::AtTheEnd, false, Reading::ToTheEnd);
    assert!(matches!(done.views, Some(ViewsOutcome::Refuted)));
    assert!(ahead::take(&path).is_none());
    // The same, the rest read after the end by the pass and the views side by
    // side: refuted there, and the pass reads on to the end all the same.
    let path = dir.path().join("beside.pyprobe");
    let done = read_while_written(&path, FirstReturn::AtTheEnd, false, Reading::AsItGrows);
    assert!(matches!(done.views, Some(ViewsOutcome::Refuted)));
    assert!(done.planned_late > 0);
    assert!(ahead::take(&path).is_none());
}

/// A process whose cost per event is not measured yet when the recording ends
/// leaves the pass unable to plan: the replay beside it gives the views up
/// instead of holding every event read after, and the pass reads on.
#[test]
fn views_are_given_up_when_the_pass_cannot_plan_after_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("child.pyprobe");
    let done = read_while_written(&path, FirstReturn::Soon, true, Reading::AsItGrows);
    assert!(
        matches!(done.views, Some(ViewsOutcome::Unplanned)),
        "{:?}",
        done.views.map(|v| matches!(v, ViewsOutcome::Refuted))
    );
    assert!(done.planned_late > 0);
    assert!(ahead::take(&path).is_none());
}
