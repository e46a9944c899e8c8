use super::*;
use crate::analyze::folded::fold_events;
use crate::recording::{Event, EventKind, FrameRef, Header, Qualnames};

fn info(header: &Header) -> ViewInfo {
    ViewInfo {
        header: header.clone(),
        end_ns: None,
        trailer_lost: 0,
        truncated_at: None,
        qualnames: Qualnames::default(),
    }
}

fn key(name: &str, line: u32) -> StatsKey {
    StatsKey {
        file: "/app/x.py".into(),
        line,
        name: name.into(),
    }
}

/// main() calls fib(), which calls itself once, then leaf(); times in µs:
/// main 0-100, fib 10-60 (fib 20-40 inside), leaf 70-80.
#[test]
fn calls_primitive_calls_own_and_cumulative_times_and_callers() {
    let strings: Vec<String> = ["/app/x.py", "main", "fib", "leaf"]
        .map(String::from)
        .to_vec();
    let frame = |name: u32, line: u32| FrameRef {
        file: StrId(0),
        function: StrId(name),
        line,
    };
    let (main, fib, leaf) = (frame(1, 1), frame(2, 5), frame(3, 9));
    let header = Header {
        mode: "trace".into(),
        ..Header::default()
    };
    let event = |us: u64, kind: EventKind| Event {
        tid: 1,
        ts_ns: us * 1000,
        kind,
    };
    let call = |f: FrameRef| EventKind::Call { frame: f };
    let ret = |f: FrameRef| EventKind::Return {
        frame: f,
        first_line: f.line,
    };
    let events = [
        event(0, call(main)),
        event(10, call(fib)),
        event(20, call(fib)),
        event(40, ret(fib)),
        event(60, ret(fib)),
        event(70, call(leaf)),
        event(80, ret(leaf)),
        event(100, ret(main)),
    ];
    let folded = fold_events(&header, &strings, &events, Some(100_000));
    let stats = build_stats(&folded, &info(&header), &strings);
    assert!(!stats.sampled);
    let f = &stats.functions[&key("fib", 5)];
    assert_eq!((f.counts.primitive, f.counts.calls), (1, 2));
    // Own: 30 µs outer + 20 µs inner; cumulative: the outer call's 50 µs only.
    assert!((f.counts.own_s - 50e-6).abs() < 1e-12, "{f:?}");
    assert!((f.counts.cumulative_s - 50e-6).abs() < 1e-12, "{f:?}");
    let from_main = f.callers[&key("main", 1)];
    assert_eq!((from_main.primitive, from_main.calls), (1, 1));
    let from_fib = f.callers[&key("fib", 5)];
    assert_eq!((from_fib.primitive, from_fib.calls), (0, 1));
    let m = &stats.functions[&key("main", 1)];
    assert_eq!((m.counts.primitive, m.counts.calls), (1, 1));
    assert!(m.callers.is_empty(), "the outermost function has no caller");
    assert!((m.counts.cumulative_s - 100e-6).abs() < 1e-12);
    // Own times add up to the run.
    let own: f64 = stats.functions.values().map(|e| e.counts.own_s).sum();
    assert!((own - 100e-6).abs() < 1e-12, "{own}");

    let mut bytes = Vec::new();
    write_pstats(&stats, &mut bytes).unwrap();
    assert_eq!(bytes.first(), Some(&b'{'));
    assert_eq!(bytes.last(), Some(&b'0'));
}
