use super::*;
use crate::analyze::folded::Folder;
use crate::analyze::replay::{plan_events, Replay};
use crate::analyze::SampleFilter;
use crate::recording::{Event, EventKind, Header, SampleState, WalkedFrame};

const FILE: StrId = StrId(0);
const MAIN: StrId = StrId(1);
const WORK: StrId = StrId(2);

fn strings() -> Vec<String> {
    vec!["/app/main.py".into(), "main".into(), "work".into()]
}

fn code(function: StrId, line: u32) -> FrameRef {
    FrameRef {
        file: FILE,
        function,
        line,
    }
}

fn sample(tid: u32, ts_ns: u64, stack: &[(StrId, u32)]) -> Event {
    Event {
        tid,
        ts_ns,
        kind: EventKind::Sample {
            frames: stack
                .iter()
                .map(|&(f, l)| WalkedFrame {
                    code: code(f, l),
                    line: l + 1,
                })
                .collect(),
            state: SampleState {
                on_cpu: Some(true),
                holds_gil: None,
            },
        },
    }
}

/// Folds `events` by thread as `pyprobe flame --format pprof` does, and builds
/// the profile.
fn profile_of(header: &Header, events: &[Event], end_ns: u64) -> (Profile, PprofTotals) {
    let strings = strings();
    let plan = plan_events(header, &strings, events);
    let mut replay = Replay::new(header, plan);
    let mut folder = Folder::for_recording(header, SampleFilter::default()).by_thread();
    let mut steps = Vec::new();
    for e in events {
        steps.clear();
        let ts = replay.push(e, &mut steps);
        folder.push(e, ts, &steps, &replay);
    }
    let folded = folder.finish(replay, Some(end_ns));
    let info = ViewInfo {
        header: header.clone(),
        end_ns: Some(end_ns),
        ..ViewInfo::default()
    };
    build_profile(&folded, &info, &strings, false)
}

fn string(p: &Profile, i: i64) -> &str {
    &p.string_table[i as usize]
}

/// Each sample's leaf function name, thread label and values.
fn rows(p: &Profile) -> Vec<(String, String, Vec<i64>)> {
    let mut rows: Vec<_> = p
        .sample
        .iter()
        .map(|s| {
            let leaf = p.location[s.location_id[0] as usize - 1].line[0].function_id;
            let f = &p.function[leaf as usize - 1];
            let thread = s
                .label
                .iter()
                .find(|l| string(p, l.key) == "thread")
                .map(|l| string(p, l.str).to_owned())
                .unwrap();
            (string(p, f.name).to_owned(), thread, s.value.clone())
        })
        .collect();
    rows.sort();
    rows
}

#[test]
fn a_sampled_recording_counts_samples_and_cpu_time_per_thread() {
    let header = Header {
        pid: 10,
        mode: "sample".into(),
        sample_interval_ns: 10_000_000,
        start_ns: 1_000,
        wall_start_unix_ns: 1_700_000_000_000_000_000,
        ..Header::default()
    };
    let events = [
        sample(10, 2_000, &[(MAIN, 1), (WORK, 5)]),
        sample(10, 3_000, &[(MAIN, 1), (WORK, 5)]),
        sample(11, 3_000, &[(MAIN, 1)]),
        sample(10, 4_000, &[(MAIN, 1)]),
    ];
    let (p, totals) = profile_of(&header, &events, 5_000);
    assert_eq!(totals.kind, ProfileKind::Sampled);
    assert_eq!(totals.values, [4, 40_000_000]);
    let types: Vec<_> = p
        .sample_type
        .iter()
        .map(|t| (string(&p, t.r#type), string(&p, t.unit)))
        .collect();
    assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
    assert_eq!(string(&p, p.default_sample_type), "cpu");
    assert_eq!(p.period, 10_000_000);
    assert_eq!(p.duration_nanos, 4_000);
    assert_eq!(p.time_nanos, 1_700_000_000_000_000_000);
    assert_eq!(
        rows(&p),
        [
            (
                "main".into(),
                "main thread (10)".into(),
                vec![1, 10_000_000]
            ),
            ("main".into(), "thread 11".into(), vec![1, 10_000_000]),
            (
                "work".into(),
                "main thread (10)".into(),
                vec![2, 20_000_000]
            ),
        ]
    );
    // Leaf first: work's samples have main under them.
    let work = p.sample.iter().find(|s| s.location_id.len() == 2).unwrap();
    let outer = &p.function[work.location_id[1] as usize - 1];
    assert_eq!(
        (string(&p, outer.name), string(&p, outer.filename)),
        ("main", "/app/main.py")
    );
    assert_eq!(p.string_table[0], "");
}

#[test]
fn a_traced_recording_counts_calls_and_exclusive_wall_time() {
    let header = Header {
        pid: 10,
        mode: "trace".into(),
        start_ns: 0,
        ..Header::default()
    };
    let at = |ts_ns, kind| Event {
        tid: 10,
        ts_ns,
        kind,
    };
    let call = |f| EventKind::Call { frame: code(f, 3) };
    let ret = |f| EventKind::Return {
        frame: code(f, 3),
        first_line: 0,
    };
    let events = [
        at(0, call(MAIN)),
        at(100, call(WORK)),
        at(400, ret(WORK)),
        at(500, call(WORK)),
        at(700, ret(WORK)),
        at(1_000, ret(MAIN)),
    ];
    let (p, totals) = profile_of(&header, &events, 1_000);
    assert_eq!(totals.kind, ProfileKind::Traced);
    // 3 calls; main's own 500 ns and work's 500 ns.
    assert_eq!(totals.values, [3, 1_000]);
    assert_eq!(string(&p, p.default_sample_type), "wall");
    assert_eq!(
        rows(&p),
        [
            ("main".into(), "main thread (10)".into(), vec![1, 500]),
            ("work".into(), "main thread (10)".into(), vec![2, 500]),
        ]
    );
}

#[test]
fn the_gzipped_profile_decodes_to_what_was_built() {
    let header = Header {
        mode: "sample".into(),
        sample_interval_ns: 1_000,
        ..Header::default()
    };
    let (p, _) = profile_of(&header, &[sample(1, 10, &[(MAIN, 1)])], 20);
    let mut gz = Vec::new();
    write_gzipped(&p, &mut gz).unwrap();
    assert_eq!(&gz[..2], &[0x1f, 0x8b]);
    let mut raw = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut raw).unwrap();
    assert_eq!(Profile::decode(&raw[..]).unwrap(), p);
}

#[test]
fn a_recording_with_neither_samples_nor_calls_is_of_its_modes_kind() {
    for (mode, kind) in [
        ("sample", ProfileKind::Sampled),
        ("auto", ProfileKind::Sampled),
        ("trace", ProfileKind::Traced),
    ] {
        let header = Header {
            mode: mode.into(),
            sample_interval_ns: 1_000,
            ..Header::default()
        };
        let idle = Event {
            tid: 1,
            ts_ns: 5,
            kind: EventKind::ThreadStart { pid: 1 },
        };
        let (p, totals) = profile_of(&header, &[idle], 10);
        assert_eq!((totals.kind, totals.values), (kind, [0, 0]), "{mode}");
        assert!(p.sample.is_empty());
    }
}
