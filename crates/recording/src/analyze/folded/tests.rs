use super::*;
use crate::analyze::replay::Replay;
use crate::recording::{Event, EventKind, Header};
use crate::recording::{FrameRef, SampleState, StrId};

fn fr(function: u32, line: u32) -> FrameRef {
    FrameRef {
        file: StrId(0),
        function: StrId(function),
        line,
    }
}

fn ev(tid: u32, ts_ns: u64, kind: EventKind) -> Event {
    Event { tid, ts_ns, kind }
}

fn walked(function: u32, line: u32) -> crate::recording::WalkedFrame {
    crate::recording::WalkedFrame {
        code: fr(function, 1),
        line,
    }
}

fn fold(events: &[Event], end: Option<u64>) -> Folded {
    fold_into(Folder::new(), events, end)
}

fn fold_into(mut folder: Folder, events: &[Event], end: Option<u64>) -> Folded {
    let header = Header::default();
    let plan = crate::analyze::replay::plan_events(&header, &[], events);
    let mut replay = Replay::new(&header, plan);
    let mut steps = Vec::new();
    for e in events {
        steps.clear();
        let ts = replay.push(e, &mut steps);
        folder.push(e, ts, &steps, &replay);
    }
    folder.finish(replay, end)
}

fn stacks(f: &Folded, m: Measure) -> Vec<(Vec<u32>, u64)> {
    let mut out = Vec::new();
    f.for_each_stack(m, |path, v| {
        let names = path
            .iter()
            .map(|p| match p {
                FoldFrame::Python(fr) => fr.function.0,
                FoldFrame::PythonLine { code, line } => 10_000 * code.function.0 + line,
                FoldFrame::Gc { .. } => 99,
                FoldFrame::Process { pid, .. } => 1000 + pid,
                FoldFrame::Thread { tid, .. } => 2000 + tid,
            })
            .collect();
        out.push((names, v));
    });
    out.sort();
    out
}

#[test]
fn exclusive_time_and_calls_per_stack() {
    let folded = fold(
        &[
            ev(1, 0, EventKind::Call { frame: fr(1, 1) }),
            ev(1, 10, EventKind::Call { frame: fr(2, 5) }),
            ev(
                1,
                30,
                EventKind::Return {
                    frame: fr(2, 7),
                    first_line: 0,
                },
            ),
            ev(1, 35, EventKind::Call { frame: fr(2, 5) }),
            ev(
                1,
                40,
                EventKind::Return {
                    frame: fr(2, 6),
                    first_line: 0,
                },
            ),
            ev(
                1,
                50,
                EventKind::Return {
                    frame: fr(1, 3),
                    first_line: 0,
                },
            ),
        ],
        None,
    );
    assert_eq!(
        stacks(&folded, Measure::Time),
        vec![(vec![1], 25), (vec![1, 2], 25)]
    );
    assert_eq!(
        stacks(&folded, Measure::Calls),
        vec![(vec![1], 1), (vec![1, 2], 2)]
    );
    assert_eq!(folded.total(Measure::Time), 50);
}

#[test]
fn unpaired_streams() {
    let folded = fold(
        &[
            // Attached mid-call: a return on an empty stack, a frame running
            // when tracing began.
            ev(
                1,
                0,
                EventKind::Return {
                    frame: fr(7, 9),
                    first_line: 0,
                },
            ),
            // An entry without return (3.15 generator creation), popped by a resync.
            ev(1, 10, EventKind::Call { frame: fr(1, 1) }),
            ev(1, 20, EventKind::Call { frame: fr(2, 2) }),
            ev(
                1,
                30,
                EventKind::Return {
                    frame: fr(1, 1),
                    first_line: 0,
                },
            ),
            // Open at the end.
            ev(2, 40, EventKind::Call { frame: fr(3, 3) }),
        ],
        Some(100),
    );
    assert_eq!(
        stacks(&folded, Measure::Calls),
        vec![(vec![1], 1), (vec![1, 2], 1), (vec![7], 1)]
    );
    assert_eq!(
        stacks(&folded, Measure::Time),
        vec![(vec![1], 10), (vec![1, 2], 10), (vec![3], 60)]
    );
    assert_eq!(folded.counters.open_at_start, 1);
    assert_eq!(folded.counters.orphan_returns, 0);
    assert_eq!(folded.counters.unpaired_entries, 1);
}

#[test]
fn gc_pause_goes_on_top_of_its_stack() {
    let folded = fold(
        &[
            ev(1, 0, EventKind::Call { frame: fr(1, 1) }),
            ev(1, 10, EventKind::GcStart { generation: 0 }),
            // A finalizer run by the collector.
            ev(1, 12, EventKind::Call { frame: fr(2, 2) }),
            ev(
                1,
                16,
                EventKind::Return {
                    frame: fr(2, 2),
                    first_line: 0,
                },
            ),
            ev(1, 20, EventKind::GcDone { collected: 3 }),
            ev(
                1,
                50,
                EventKind::Return {
                    frame: fr(1, 1),
                    first_line: 0,
                },
            ),
        ],
        None,
    );
    assert_eq!(
        stacks(&folded, Measure::Time),
        vec![(vec![1], 40), (vec![1, 99], 6), (vec![1, 99, 2], 4)]
    );
    assert_eq!(folded.total(Measure::Time), 50);
    assert_eq!(folded.counts.gcs, 1);
}

#[test]
fn walk_in_name_order_and_prune_narrow_stacks() {
    let folded = fold(
        &[
            ev(1, 0, EventKind::Call { frame: fr(3, 1) }),
            ev(1, 10, EventKind::Call { frame: fr(2, 1) }),
            ev(
                1,
                11,
                EventKind::Return {
                    frame: fr(2, 1),
                    first_line: 0,
                },
            ),
            ev(1, 20, EventKind::Call { frame: fr(1, 1) }),
            ev(1, 60, EventKind::Call { frame: fr(4, 1) }),
            ev(
                1,
                62,
                EventKind::Return {
                    frame: fr(4, 1),
                    first_line: 0,
                },
            ),
            ev(
                1,
                70,
                EventKind::Return {
                    frame: fr(1, 1),
                    first_line: 0,
                },
            ),
            ev(
                1,
                100,
                EventKind::Return {
                    frame: fr(3, 1),
                    first_line: 0,
                },
            ),
            ev(2, 100, EventKind::Call { frame: fr(5, 1) }),
            ev(
                2,
                101,
                EventKind::Return {
                    frame: fr(5, 1),
                    first_line: 0,
                },
            ),
        ],
        None,
    );
    let name = |f: &FoldFrame| match f {
        FoldFrame::Python(p) => format!("f{}", p.function.0),
        FoldFrame::PythonLine { code, line } => format!("f{}@{line}", code.function.0),
        FoldFrame::Gc { .. } => "gc".into(),
        FoldFrame::Process { pid, .. } => format!("p{pid}"),
        FoldFrame::Thread { tid, .. } => format!("t{tid}"),
    };
    let walk = |min_total| {
        let mut out = Vec::new();
        folded.walk_named(Measure::Time, min_total, name, |path, v| {
            out.push(format!("{} {v}", path.join(";")));
        });
        out
    };
    assert_eq!(
        walk(1),
        vec!["f3 49", "f3;f1 48", "f3;f1;f4 2", "f3;f2 1", "f5 1"]
    );
    // Stacks under 5 fold into their parent; outermost ones stay.
    assert_eq!(walk(5), vec!["f3 50", "f3;f1 50", "f5 1"]);
    let total: u64 = walk(5)
        .iter()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
        .sum();
    assert_eq!(total, folded.total(Measure::Time));
}

#[test]
fn samples_count_per_stack() {
    let folded = fold(
        &[
            ev(
                1,
                0,
                EventKind::Sample {
                    frames: vec![walked(1, 4), walked(2, 8)],
                    state: SampleState::default(),
                },
            ),
            ev(
                1,
                1,
                EventKind::Sample {
                    frames: vec![walked(1, 4), walked(2, 8)],
                    state: SampleState::default(),
                },
            ),
            ev(
                1,
                2,
                EventKind::Sample {
                    frames: vec![walked(1, 4)],
                    state: SampleState::default(),
                },
            ),
            ev(
                1,
                3,
                EventKind::Sample {
                    frames: vec![],
                    state: SampleState::default(),
                },
            ),
        ],
        None,
    );
    assert_eq!(
        stacks(&folded, Measure::Samples),
        vec![(vec![1], 1), (vec![1, 2], 2)]
    );
    assert_eq!(folded.counts.samples, 4);
}

#[test]
fn by_line_a_sampled_frame_is_its_function_at_the_line_it_ran() {
    let sample = |ts, frames| {
        ev(
            1,
            ts,
            EventKind::Sample {
                frames,
                state: SampleState::default(),
            },
        )
    };
    let events = [
        sample(0, vec![walked(1, 4), walked(2, 8)]),
        sample(1, vec![walked(1, 4), walked(2, 9)]),
        sample(2, vec![walked(1, 4), walked(2, 9)]),
        // A native frame has no line: it stays a function.
        sample(3, vec![walked(1, 4), walked(3, 0)]),
    ];
    let lines = fold_into(Folder::new().by_line(), &events, None);
    assert_eq!(
        stacks(&lines, Measure::Samples),
        vec![
            (vec![10_004, 3], 1),
            (vec![10_004, 20_008], 1),
            (vec![10_004, 20_009], 2),
        ]
    );
    // Without it, the same samples by function: the totals agree.
    assert_eq!(
        stacks(&fold(&events, None), Measure::Samples),
        vec![(vec![1, 2], 3), (vec![1, 3], 1)]
    );
}
