//! The views (`flame` in every format, `calls`, `top --once`): golden outputs
//! from small hand-made recordings, and end-to-end on a real CPython.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::{python, repo, run_pyprobe};
use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::recording::{
    Event, EventKind, FrameRef, Header, RecordingWriter, SampleState, WalkedFrame,
};

const START: u64 = 1_000_000_000;

thread_local! {
    /// Each test runs on its own thread: its files go in a directory removed when
    /// the test ends.
    static DIR: tempfile::TempDir = tempfile::Builder::new()
        .prefix("pyprobe-views-")
        .tempdir()
        .unwrap();
}

fn tmp(name: &str) -> PathBuf {
    DIR.with(|d| d.path().join(name))
}

/// Writes a recording at `path`: `events` are (tid, µs from the start, kind),
/// with strings given by name and interned on the way.
struct Rec {
    writer: RecordingWriter<pyprobe_recording::recording::BackgroundWriter>,
}

impl Rec {
    fn new(path: &Path, header: Header) -> Rec {
        Rec {
            writer: RecordingWriter::create(path, &header).unwrap(),
        }
    }

    fn frame(&mut self, file: &str, function: &str, line: u32) -> FrameRef {
        FrameRef {
            file: self.writer.intern(file),
            function: self.writer.intern(function),
            line,
        }
    }

    fn at(&mut self, tid: u32, us: f64, kind: EventKind) {
        let ts_ns = START + (us * 1000.0).round() as u64;
        self.writer.write(&Event { tid, ts_ns, kind }).unwrap();
    }

    fn call(&mut self, tid: u32, us: f64, function: &str, line: u32) {
        let frame = self.frame(APP, function, line);
        self.at(tid, us, EventKind::Call { frame });
    }

    fn ret(&mut self, tid: u32, us: f64, function: &str, line: u32) {
        let frame = self.frame(APP, function, line);
        self.at(
            tid,
            us,
            EventKind::Return {
                frame,
                first_line: 0,
            },
        );
    }

    fn finish(self, end_us: u64) {
        self.writer.finish(START + end_us * 1000).unwrap();
    }
}

const APP: &str = "/app/src/main.py";
const JSON: &str = "/usr/lib/python3.9/json/__init__.py";

fn header(mode: &str, interval: u64) -> Header {
    Header {
        pid: 100,
        command_line: vec!["python3".into(), "main.py".into()],
        executable: "/usr/bin/python3.9".into(),
        python_version: "3.9.2".into(),
        mode: mode.into(),
        start_ns: START,
        sample_interval_ns: interval,
        ..Header::default()
    }
}

/// A trace-mode recording with a bit of everything: nesting, a GC pause, an
/// import, an audit event, a second thread attached mid-call (a return without
/// entry) that exits with a frame open, an entry without return popped by a
/// later return, and a frame still open at the end.
fn trace_recording(name: &str) -> PathBuf {
    let path = tmp(name);
    let mut r = Rec::new(&path, header("trace", 0));
    r.call(100, 0.0, "main", 1);
    r.call(100, 1.0, "work", 10);
    r.call(100, 2.0, "leaf", 20);
    r.at(101, 3.0, EventKind::ThreadStart { pid: 0 });
    r.ret(101, 3.0, "work", 11);
    r.call(101, 3.5, "leaf", 20);
    r.at(101, 3.7, EventKind::ThreadExit);
    r.ret(100, 4.0, "leaf", 21);
    r.at(100, 5.0, EventKind::GcStart { generation: 0 });
    r.at(100, 5.5, EventKind::GcDone { collected: 7 });
    r.ret(100, 6.0, "work", 12);
    let json = r.writer.intern("json");
    r.at(100, 6.5, EventKind::ImportStart { module: json });
    let dumps = r.frame(JSON, "dumps", 5);
    r.at(100, 7.0, EventKind::Call { frame: dumps });
    let dumps_ret = r.frame(JSON, "dumps", 9);
    r.at(
        100,
        8.0,
        EventKind::Return {
            frame: dumps_ret,
            first_line: 0,
        },
    );
    r.at(
        100,
        8.5,
        EventKind::ImportDone {
            module: json,
            found: true,
        },
    );
    let open = r.writer.intern("open");
    r.at(100, 9.0, EventKind::Audit { event: open });
    r.call(100, 9.1, "helper", 40);
    r.call(100, 9.2, "gen", 30);
    r.ret(100, 9.3, "helper", 41);
    r.finish(10);
    path
}

/// A sample-mode recording: two threads, a few stacks.
fn sample_recording(name: &str) -> PathBuf {
    let path = tmp(name);
    let mut r = Rec::new(&path, header("sample", 10_000_000));
    // The walker reads each frame's function (its first line) and current line.
    let mut walked = |function: &str, first: u32, line: u32| WalkedFrame {
        code: r.frame(APP, function, first),
        line,
    };
    let main = walked("main", 1, 5);
    let work12 = walked("work", 10, 12);
    let work13 = walked("work", 10, 13);
    let leaf = walked("leaf", 20, 21);
    let run = walked("run", 48, 50);
    for i in 0..3 {
        r.at(
            100,
            f64::from(i) * 10_000.0,
            EventKind::Sample {
                frames: vec![main, work12, leaf],
                state: SampleState::default(),
            },
        );
    }
    r.at(
        101,
        5_000.0,
        EventKind::Sample {
            frames: vec![run],
            state: SampleState::default(),
        },
    );
    r.at(
        100,
        30_000.0,
        EventKind::Sample {
            frames: vec![main, work13],
            state: SampleState::default(),
        },
    );
    r.at(
        101,
        15_000.0,
        EventKind::Sample {
            frames: vec![run],
            state: SampleState::default(),
        },
    );
    r.finish(40_000);
    path
}

fn stdout_of(args: &[&str]) -> String {
    let out = run_pyprobe(args);
    assert!(
        out.status.success(),
        "pyprobe {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn flame(file: &Path, extra: &[&str]) -> String {
    let mut args = vec!["flame", file.to_str().unwrap(), "-o", "-"];
    args.extend_from_slice(extra);
    stdout_of(&args)
}

/// `text` with the crate version replaced, for goldens that outlive a release.
fn unversioned(text: &str) -> String {
    text.replace(
        &format!("pyprobe {}", env!("CARGO_PKG_VERSION")),
        "pyprobe VERSION",
    )
}

#[test]
fn collapsed_by_time_golden() {
    let t = trace_recording("collapsed-time.pyprobe");
    assert_eq!(
        flame(&t, &["--format", "collapsed"]),
        "\
leaf (src/main.py:20) 200
main (src/main.py:1) 3800
main (src/main.py:1);dumps (json/__init__.py:5) 1000
main (src/main.py:1);helper (src/main.py:40) 100
main (src/main.py:1);helper (src/main.py:40);gen (src/main.py:30) 100
main (src/main.py:1);work (src/main.py:10) 2500
main (src/main.py:1);work (src/main.py:10);[gc gen 0] 500
main (src/main.py:1);work (src/main.py:10);leaf (src/main.py:20) 2000
"
    );
}

#[test]
fn collapsed_by_calls_golden() {
    let t = trace_recording("collapsed-calls.pyprobe");
    // Open frames (main; leaf on the exited thread) count no call; the return
    // without entry and the entry without return do.
    assert_eq!(
        flame(&t, &["--format", "collapsed", "--by", "calls"]),
        "\
main (src/main.py:1);dumps (json/__init__.py:5) 1
main (src/main.py:1);helper (src/main.py:40) 1
main (src/main.py:1);helper (src/main.py:40);gen (src/main.py:30) 1
main (src/main.py:1);work (src/main.py:10) 1
main (src/main.py:1);work (src/main.py:10);leaf (src/main.py:20) 1
work (src/main.py:10) 1
"
    );
    let full = flame(
        &t,
        &["--format", "collapsed", "--by", "calls", "--full-paths"],
    );
    assert!(full.starts_with(
        "main (/app/src/main.py:1);dumps (/usr/lib/python3.9/json/__init__.py:5) 1\n"
    ));
}

#[test]
fn collapsed_samples_golden() {
    let s = sample_recording("collapsed-samples.pyprobe");
    assert_eq!(
        flame(&s, &["--format", "collapsed"]),
        "\
main (src/main.py:1);work (src/main.py:10) 1
main (src/main.py:1);work (src/main.py:10);leaf (src/main.py:20) 3
run (src/main.py:48) 2
"
    );
}

#[test]
fn speedscope_evented_golden() {
    let t = trace_recording("speedscope-trace.pyprobe");
    assert_eq!(
        unversioned(&flame(&t, &["--format", "speedscope", "--timeline"])),
        r#"{"$schema":"https://www.speedscope.app/file-format-schema.json","exporter":"pyprobe VERSION","name":"pyprobe: python3 main.py","activeProfileIndex":0,"profiles":[
{"type":"evented","name":"main thread (100)","unit":"nanoseconds","startValue":0,"endValue":10000,"events":[{"type":"O","frame":0,"at":0},{"type":"O","frame":1,"at":1000},{"type":"O","frame":2,"at":2000},{"type":"C","frame":2,"at":4000},{"type":"C","frame":1,"at":6000},{"type":"O","frame":3,"at":7000},{"type":"C","frame":3,"at":8000},{"type":"O","frame":4,"at":9100},{"type":"O","frame":5,"at":9200},{"type":"C","frame":5,"at":9300},{"type":"C","frame":4,"at":9300},{"type":"C","frame":0,"at":10000}]},
{"type":"evented","name":"thread 101","unit":"nanoseconds","startValue":0,"endValue":10000,"events":[{"type":"O","frame":1,"at":3000},{"type":"C","frame":1,"at":3000},{"type":"O","frame":2,"at":3500},{"type":"C","frame":2,"at":3700}]}
],"shared":{"frames":[
{"name":"main (src/main.py:1)","file":"/app/src/main.py","line":1},
{"name":"work (src/main.py:10)","file":"/app/src/main.py","line":10},
{"name":"leaf (src/main.py:20)","file":"/app/src/main.py","line":20},
{"name":"dumps (json/__init__.py:5)","file":"/usr/lib/python3.9/json/__init__.py","line":5},
{"name":"helper (src/main.py:40)","file":"/app/src/main.py","line":40},
{"name":"gen (src/main.py:30)","file":"/app/src/main.py","line":30}
]}}
"#
    );
}

/// A trace's speedscope file by default: each thread's stacks with their own
/// time, the flame graph's numbers.
#[test]
fn speedscope_stacks_golden() {
    let t = trace_recording("speedscope-stacks.pyprobe");
    assert_eq!(
        unversioned(&flame(&t, &["--format", "speedscope"])),
        r#"{"$schema":"https://www.speedscope.app/file-format-schema.json","exporter":"pyprobe VERSION","name":"pyprobe: python3 main.py","activeProfileIndex":0,"profiles":[
{"type":"sampled","name":"main thread (100)","unit":"nanoseconds","startValue":0,"endValue":10000,"samples":[[0],[0,1],[0,1,2],[0,1,3],[0,4],[0,5],[0,5,6]],"weights":[3800,2500,2000,500,1000,100,100]},
{"type":"sampled","name":"thread 101","unit":"nanoseconds","startValue":0,"endValue":200,"samples":[[2]],"weights":[200]}
],"shared":{"frames":[
{"name":"main (src/main.py:1)","file":"/app/src/main.py","line":1},
{"name":"work (src/main.py:10)","file":"/app/src/main.py","line":10},
{"name":"leaf (src/main.py:20)","file":"/app/src/main.py","line":20},
{"name":"[gc gen 0]"},
{"name":"dumps (json/__init__.py:5)","file":"/usr/lib/python3.9/json/__init__.py","line":5},
{"name":"helper (src/main.py:40)","file":"/app/src/main.py","line":40},
{"name":"gen (src/main.py:30)","file":"/app/src/main.py","line":30}
]}}
"#
    );
}

#[test]
fn speedscope_sampled_golden() {
    let s = sample_recording("speedscope-sample.pyprobe");
    assert_eq!(
        unversioned(&flame(&s, &["--format", "speedscope"])),
        r#"{"$schema":"https://www.speedscope.app/file-format-schema.json","exporter":"pyprobe VERSION","name":"pyprobe: python3 main.py","activeProfileIndex":0,"profiles":[
{"type":"sampled","name":"main thread (100) (sampled)","unit":"nanoseconds","startValue":0,"endValue":40000000,"samples":[[0,1,2],[0,1,2],[0,1,2],[0,1]],"weights":[10000000,10000000,10000000,10000000]},
{"type":"sampled","name":"thread 101 (sampled)","unit":"nanoseconds","startValue":0,"endValue":20000000,"samples":[[3],[3]],"weights":[10000000,10000000]}
],"shared":{"frames":[
{"name":"main (src/main.py:1)","file":"/app/src/main.py","line":1},
{"name":"work (src/main.py:10)","file":"/app/src/main.py","line":10},
{"name":"leaf (src/main.py:20)","file":"/app/src/main.py","line":20},
{"name":"run (src/main.py:48)","file":"/app/src/main.py","line":48}
]}}
"#
    );
}

#[test]
fn speedscope_spilled_to_disk_is_identical() {
    use pyprobe_recording::output::speedscope::{write_speedscope, SpeedscopeOptions};
    use pyprobe_recording::recording::RecordingReader;
    let t = trace_recording("speedscope-spill.pyprobe");
    let render = |limit: usize| {
        let mut reader = RecordingReader::open(&t).unwrap();
        let mut out = Vec::new();
        let options = SpeedscopeOptions {
            spool_limit: limit,
            ..SpeedscopeOptions::default()
        };
        write_speedscope(&mut reader, &options, |_| None, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    };
    assert_eq!(render(16), render(1 << 20));
}

#[test]
fn chrome_trace_golden() {
    let t = trace_recording("chrome.pyprobe");
    assert_eq!(
        unversioned(&flame(&t, &["--format", "chrome"])),
        r#"{"traceEvents":[
{"name":"process_name","ph":"M","pid":100,"tid":100,"args":{"name":"python3 main.py (pid 100)"}},
{"name":"thread_name","ph":"M","pid":100,"tid":100,"args":{"name":"main thread (100)"}},
{"name":"thread_sort_index","ph":"M","pid":100,"tid":100,"args":{"sort_index":0}},
{"name":"thread_name","ph":"M","pid":100,"tid":101,"args":{"name":"thread 101"}},
{"name":"thread_sort_index","ph":"M","pid":100,"tid":101,"args":{"sort_index":1}},
{"name":"work (src/main.py:10)","cat":"python","ph":"X","ts":3.000,"dur":0.000,"pid":100,"tid":101,"args":{"function":"work","file":"/app/src/main.py","line":10,"start":"running when tracing began"}},
{"name":"leaf (src/main.py:20)","cat":"python","ph":"X","ts":3.500,"dur":0.200,"pid":100,"tid":101,"args":{"function":"leaf","file":"/app/src/main.py","line":20,"end":"still running at the end"}},
{"name":"leaf (src/main.py:20)","cat":"python","ph":"X","ts":2.000,"dur":2.000,"pid":100,"tid":100,"args":{"function":"leaf","file":"/app/src/main.py","line":20}},
{"name":"gc (generation 0)","cat":"gc","ph":"X","ts":5.000,"dur":0.500,"pid":100,"tid":100,"args":{"generation":0,"collected":7}},
{"name":"work (src/main.py:10)","cat":"python","ph":"X","ts":1.000,"dur":5.000,"pid":100,"tid":100,"args":{"function":"work","file":"/app/src/main.py","line":10}},
{"name":"dumps (json/__init__.py:5)","cat":"python","ph":"X","ts":7.000,"dur":1.000,"pid":100,"tid":100,"args":{"function":"dumps","file":"/usr/lib/python3.9/json/__init__.py","line":5}},
{"name":"import json","cat":"import","ph":"X","ts":6.500,"dur":2.000,"pid":100,"tid":100,"args":{"module":"json","found":true}},
{"name":"audit open","cat":"audit","ph":"i","s":"t","ts":9.000,"pid":100,"tid":100},
{"name":"gen (src/main.py:30)","cat":"python","ph":"X","ts":9.200,"dur":0.100,"pid":100,"tid":100,"args":{"function":"gen","file":"/app/src/main.py","line":30,"end":"no return (popped by a later return)"}},
{"name":"helper (src/main.py:40)","cat":"python","ph":"X","ts":9.100,"dur":0.200,"pid":100,"tid":100,"args":{"function":"helper","file":"/app/src/main.py","line":40}},
{"name":"main (src/main.py:1)","cat":"python","ph":"X","ts":0.000,"dur":10.000,"pid":100,"tid":100,"args":{"function":"main","file":"/app/src/main.py","line":1,"end":"still running at the end"}}
],"displayTimeUnit":"ns","otherData":{"exporter":"pyprobe VERSION","pid":100,"python":"3.9.2","mode":"trace","truncated":false}}
"#
    );
}

#[test]
fn chrome_trace_of_samples_golden() {
    let s = sample_recording("chrome-samples.pyprobe");
    let text = unversioned(&flame(&s, &["--format", "chrome"]));
    let slices: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("\"ph\":\"X\""))
        .collect();
    // On a track of its own per thread (1 << 30 | tid), a sampled function
    // lasts from the first sample showing it to the first that does not (or
    // one interval after the last sample).
    assert!(text.contains(r#"{"name":"thread_name","ph":"M","pid":100,"tid":1073741924,"args":{"name":"main thread (100), sampled"}}"#));
    assert_eq!(
        slices,
        [
            r#"{"name":"leaf (src/main.py)","cat":"sampled","ph":"X","ts":0.000,"dur":30000.000,"pid":100,"tid":1073741924,"args":{"function":"leaf","file":"/app/src/main.py","line":20}},"#,
            r#"{"name":"work (src/main.py)","cat":"sampled","ph":"X","ts":0.000,"dur":40000.000,"pid":100,"tid":1073741924,"args":{"function":"work","file":"/app/src/main.py","line":10}},"#,
            r#"{"name":"main (src/main.py)","cat":"sampled","ph":"X","ts":0.000,"dur":40000.000,"pid":100,"tid":1073741924,"args":{"function":"main","file":"/app/src/main.py","line":1}},"#,
            r#"{"name":"run (src/main.py)","cat":"sampled","ph":"X","ts":5000.000,"dur":20000.000,"pid":100,"tid":1073741925,"args":{"function":"run","file":"/app/src/main.py","line":48}}"#,
        ]
    );
}

/// Frame names (the `<title>` of each `<g>`) and the texts of a flame graph SVG,
/// which must be well-formed XML.
fn svg_texts(svg: &str) -> (Vec<String>, Vec<String>) {
    // inferno's SVG has a DOCTYPE.
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..roxmltree::ParsingOptions::default()
    };
    let doc =
        roxmltree::Document::parse_with_options(svg, options).expect("the SVG is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let titles = doc
        .descendants()
        .filter(|n| n.has_tag_name("title"))
        .filter_map(|n| n.text().map(str::to_owned))
        .collect();
    let texts = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(str::to_owned))
        .collect();
    (titles, texts)
}

#[test]
fn svg_from_a_trace_recording() {
    let t = trace_recording("svg-trace.pyprobe");
    let svg = flame(&t, &[]);
    let (titles, texts) = svg_texts(&svg);
    for frame in [
        "main (src/main.py:1)",
        "work (src/main.py:10)",
        "leaf (src/main.py:20)",
        "dumps (json/__init__.py:5)",
        "[gc gen 0]",
    ] {
        assert!(
            titles.iter().any(|t| t.starts_with(&format!("{frame} ("))),
            "{frame} in {titles:?}"
        );
    }
    assert!(
        titles.iter().any(|t| t.starts_with("all (10 µs, 100%)")),
        "{titles:?}"
    );
    assert!(
        texts.contains(&"pyprobe: python3 main.py".to_string()),
        "{texts:?}"
    );
    assert!(
        texts.contains(
            &"pid 100, CPython 3.9.2, trace mode, 10.0 µs, 19 events; width: own time".to_string()
        ),
        "{texts:?}"
    );

    let svg = flame(
        &t,
        &["--by", "calls", "--title", "Calls <&> more", "--full-paths"],
    );
    let (titles, texts) = svg_texts(&svg);
    assert!(texts.contains(&"Calls <&> more".to_string()), "{texts:?}");
    assert!(
        texts.iter().any(|t| t.ends_with("; width: calls")),
        "{texts:?}"
    );
    assert!(
        titles.iter().any(|t| t.starts_with("all (6 calls, 100%)")),
        "{titles:?}"
    );
    assert!(titles
        .iter()
        .any(|t| t.starts_with("work (/app/src/main.py:10) (")));
}

#[test]
fn svg_from_a_sample_recording() {
    let s = sample_recording("svg-sample.pyprobe");
    let (titles, texts) = svg_texts(&flame(&s, &[]));
    assert!(
        titles
            .iter()
            .any(|t| t.starts_with("all (6 samples, 100%)")),
        "{titles:?}"
    );
    assert!(titles
        .iter()
        .any(|t| t.starts_with("leaf (src/main.py:20) (3 samples, 50.00%)")));
    assert!(
        texts.contains(
            &"pid 100, CPython 3.9.2, sample mode, 40.0 ms, 6 samples every 10.0 ms, thread state not recorded; width: samples"
                .to_string()
        ),
        "{texts:?}"
    );
    // Calls cannot be counted from samples: a note, and samples as width.
    let out = run_pyprobe(&["flame", s.to_str().unwrap(), "-o", "-", "--by", "calls"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no call counts"));
}

#[test]
fn flame_writes_beside_the_recording_by_default() {
    let t = trace_recording("default-out.pyprobe");
    let out = run_pyprobe(&["flame", t.to_str().unwrap()]);
    assert!(out.status.success());
    let svg = t.with_file_name("default-out.svg");
    assert!(String::from_utf8_lossy(&out.stderr).contains(svg.to_str().unwrap()));
    svg_texts(&std::fs::read_to_string(&svg).unwrap());
    let out = run_pyprobe(&["flame", t.to_str().unwrap(), "--format", "chrome"]);
    assert!(out.status.success());
    let chrome = t.with_file_name("default-out.trace.json");
    let _: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chrome).unwrap()).unwrap();
}

#[test]
fn view_chosen_by_extension() {
    use pyprobe::session::views::write_view_for_extension;
    use pyprobe_recording::output::file::Existing;
    let t = trace_recording("by-extension.pyprobe");
    let svg = tmp("by-extension.svg");
    assert!(write_view_for_extension(&t, &svg, SampleFilter::default(), Existing::Keep).unwrap());
    svg_texts(&std::fs::read_to_string(&svg).unwrap());
    let json = tmp("by-extension.json");
    assert!(write_view_for_extension(&t, &json, SampleFilter::default(), Existing::Keep).unwrap());
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // A trace's speedscope file: each thread's stacks (--timeline: its calls).
    assert_eq!(doc["profiles"][0]["type"], "sampled");
    let txt = tmp("by-extension.txt");
    assert!(write_view_for_extension(&t, &txt, SampleFilter::default(), Existing::Keep).unwrap());
    assert_eq!(
        std::fs::read_to_string(&txt).unwrap(),
        flame(&t, &["--format", "collapsed"])
    );
    let other = tmp("by-extension.pyprobe2");
    assert!(
        !write_view_for_extension(&t, &other, SampleFilter::default(), Existing::Keep).unwrap()
    );
    assert!(!other.exists());
}

#[test]
fn empty_and_cut_short_recordings() {
    let empty = tmp("empty.pyprobe");
    Rec::new(&empty, header("trace", 0)).finish(5);
    let out = run_pyprobe(&[
        "flame",
        empty.to_str().unwrap(),
        "-o",
        tmp("empty.svg").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to draw"));
    assert!(
        !tmp("empty.svg").exists(),
        "no half-written output left behind"
    );
    // Every other format has a valid empty document.
    assert_eq!(flame(&empty, &["--format", "collapsed"]), "");
    let doc: serde_json::Value =
        serde_json::from_str(&flame(&empty, &["--format", "speedscope"])).unwrap();
    assert_eq!(doc["profiles"].as_array().unwrap().len(), 0);
    let doc: serde_json::Value =
        serde_json::from_str(&flame(&empty, &["--format", "chrome"])).unwrap();
    assert_eq!(doc["traceEvents"].as_array().unwrap().len(), 1);

    // A recording whose writer never finished reads back whole up to its last chunk.
    let cut = tmp("cut.pyprobe");
    {
        let mut r = Rec::new(&cut, header("trace", 0));
        r.call(100, 0.0, "main", 1);
        r.call(100, 1.0, "work", 10);
        r.ret(100, 3.0, "work", 12);
        drop(r);
    }
    let out = run_pyprobe(&[
        "flame",
        cut.to_str().unwrap(),
        "-o",
        "-",
        "--format",
        "collapsed",
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cut short"));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "main (src/main.py:1) 1000\nmain (src/main.py:1);work (src/main.py:10) 2000\n"
    );

    let out = run_pyprobe(&["flame", tmp("missing.pyprobe").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

#[test]
fn calls_text_golden() {
    let t = trace_recording("calls.pyprobe");
    assert_eq!(
        stdout_of(&["calls", t.to_str().unwrap()]),
        "      TIME(µs)      TID  FLOW
         0.000      100  -> src/main.py:main:1
         1.000      100    -> src/main.py:work:10
         2.000      100      -> src/main.py:leaf:20
         3.000      101  -> src/main.py:work:10  (running when tracing began)
         3.000      101  <- src/main.py:work:11  [0 ns]
         3.500      101  -> src/main.py:leaf:20
         4.000      100      <- src/main.py:leaf:21  [2.00 µs]
         6.000      100    <- src/main.py:work:12  [5.00 µs, own 3.00 µs]
         7.000      100    -> json/__init__.py:dumps:5
         8.000      100    <- json/__init__.py:dumps:9  [1.00 µs]
         9.100      100    -> src/main.py:helper:40
         9.200      100      -> src/main.py:gen:30
         9.300      100    <- src/main.py:helper:41  [200 ns, own 100 ns]  (also ends 1 frame(s) whose return never came)
"
    );
}

/// A coroutine entered twice, a call then a resume: the flow marks the resume,
/// the report counts it apart (a column of its own), the flame graph counts both
/// entries, as cProfile would.
#[test]
fn a_resume_is_marked_in_the_flow_and_counted_apart_in_the_report() {
    let path = tmp("resumes.pyprobe");
    let mut r = Rec::new(&path, header("trace", 0));
    r.call(100, 0.0, "main", 1);
    r.call(100, 1.0, "co", 30);
    r.ret(100, 2.0, "co", 31);
    let co = r.frame(APP, "co", 31);
    r.at(100, 3.0, EventKind::Resume { frame: co });
    r.ret(100, 4.5, "co", 32);
    r.ret(100, 5.0, "main", 2);
    r.finish(6);
    let f = path.to_str().unwrap();
    let flow = stdout_of(&["calls", f]);
    assert!(
        flow.contains("    -> src/main.py:co:30\n")
            && flow.contains("    -> src/main.py:co:31  (resumes)\n"),
        "{flow}"
    );
    let json = stdout_of(&["calls", f, "--format", "json"]);
    assert_eq!(json.matches("\"resume\":true").count(), 1, "{json}");
    let table = stdout_of(&["report", f]);
    assert!(
        table.contains("     calls     resumes  inclusive"),
        "{table}"
    );
    let row = table.lines().find(|l| l.contains(" co ")).unwrap();
    assert!(
        row.starts_with("         1           1    2.50 µs"),
        "{row}"
    );
    let report = crate::support::report_json(f);
    let co = report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["function"] == "co")
        .unwrap();
    assert_eq!((&co["calls"], &co["resumes"]), (&1.into(), &1.into()));
    let collapsed = stdout_of(&[
        "flame",
        f,
        "--format",
        "collapsed",
        "--by",
        "calls",
        "-o",
        "-",
    ]);
    assert!(
        collapsed
            .lines()
            .any(|l| l.ends_with(";co (src/main.py:30) 2")),
        "{collapsed}"
    );
}

#[test]
fn calls_filters() {
    let t = trace_recording("calls-filters.pyprobe");
    let f = t.to_str().unwrap();
    assert_eq!(
        stdout_of(&["calls", f, "--start-at", "work"]),
        "      TIME(µs)      TID  FLOW
         1.000      100  -> src/main.py:work:10
         2.000      100    -> src/main.py:leaf:20
         3.000      101  -> src/main.py:work:10  (running when tracing began)
         3.000      101  <- src/main.py:work:11  [0 ns]
         4.000      100    <- src/main.py:leaf:21  [2.00 µs]
         6.000      100  <- src/main.py:work:12  [5.00 µs, own 3.00 µs]
"
    );
    assert_eq!(
        stdout_of(&["calls", f, "--start-at", "main.py:work", "--max-depth", "1"]),
        "      TIME(µs)      TID  FLOW
         1.000      100  -> src/main.py:work:10
         3.000      101  -> src/main.py:work:10  (running when tracing began)
         3.000      101  <- src/main.py:work:11  [0 ns]
         6.000      100  <- src/main.py:work:12  [5.00 µs, own 3.00 µs]
"
    );
    assert_eq!(
        stdout_of(&["calls", f, "--thread", "101", "--full-paths"]),
        "      TIME(µs)      TID  FLOW
         3.000      101  -> /app/src/main.py:work:10  (running when tracing began)
         3.000      101  <- /app/src/main.py:work:11  [0 ns]
         3.500      101  -> /app/src/main.py:leaf:20
"
    );
    let out = run_pyprobe(&["calls", f, "--start-at", "nowhere"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no call of `nowhere`"));
    let s = sample_recording("calls-samples.pyprobe");
    let out = run_pyprobe(&["calls", s.to_str().unwrap()]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds samples, not calls"));
}

#[test]
fn calls_json_golden() {
    let t = trace_recording("calls-json.pyprobe");
    let text = stdout_of(&[
        "calls",
        t.to_str().unwrap(),
        "--format",
        "json",
        "--max-depth",
        "2",
    ]);
    assert_eq!(
        text,
        r#"[
{"ts_us":0.000,"tid":100,"event":"call","depth":0,"function":"main","qualname":"main","file":"/app/src/main.py","line":1},
{"ts_us":1.000,"tid":100,"event":"call","depth":1,"function":"work","qualname":"work","file":"/app/src/main.py","line":10},
{"ts_us":3.000,"tid":101,"event":"call","depth":0,"function":"work","qualname":"work","file":"/app/src/main.py","line":10,"running_when_tracing_began":true},
{"ts_us":3.000,"tid":101,"event":"return","depth":0,"function":"work","qualname":"work","file":"/app/src/main.py","line":11,"inclusive_ns":0,"exclusive_ns":0},
{"ts_us":3.500,"tid":101,"event":"call","depth":0,"function":"leaf","qualname":"leaf","file":"/app/src/main.py","line":20},
{"ts_us":6.000,"tid":100,"event":"return","depth":1,"function":"work","qualname":"work","file":"/app/src/main.py","line":12,"inclusive_ns":5000,"exclusive_ns":3000},
{"ts_us":7.000,"tid":100,"event":"call","depth":1,"function":"dumps","qualname":"dumps","file":"/usr/lib/python3.9/json/__init__.py","line":5},
{"ts_us":8.000,"tid":100,"event":"return","depth":1,"function":"dumps","qualname":"dumps","file":"/usr/lib/python3.9/json/__init__.py","line":9,"inclusive_ns":1000,"exclusive_ns":1000},
{"ts_us":9.100,"tid":100,"event":"call","depth":1,"function":"helper","qualname":"helper","file":"/app/src/main.py","line":40},
{"ts_us":9.300,"tid":100,"event":"return","depth":1,"function":"helper","qualname":"helper","file":"/app/src/main.py","line":41,"popped_without_return":1,"inclusive_ns":200,"exclusive_ns":100}
]
"#
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 10);
}

#[test]
fn top_once_from_a_recording() {
    let t = trace_recording("top.pyprobe");
    let text = stdout_of(&["top", "--once", "--from", t.to_str().unwrap()]);
    assert_eq!(
        text,
        "\
pyprobe top: pid 100, CPython 3.9.2, trace mode, over 10.0 µs: 19 events
GC 100000/s (5.0% of the time), imports 100000/s
CALLS/S  OWN%  TOTAL%      OWN  PID  FUNCTION  FILE:LINE
 200000  30.0    50.0  3.00 µs  100  work      src/main.py:10
 100000  22.0    22.0  2.20 µs  100  leaf      src/main.py:20
 100000  10.0    10.0  1.00 µs  100  dumps     json/__init__.py:5
 100000   1.0     1.0   100 ns  100  gen       src/main.py:30
 100000   1.0     2.0   100 ns  100  helper    src/main.py:40
   0.00  38.0   100.0  3.80 µs  100  main      src/main.py:1
"
    );
    let s = sample_recording("top-sample.pyprobe");
    let text = stdout_of(&[
        "top",
        "--once",
        "--limit",
        "2",
        "--from",
        s.to_str().unwrap(),
    ]);
    assert_eq!(
        text,
        "\
pyprobe top: pid 100, CPython 3.9.2, sample mode, over 40.0 ms: 6 samples (thread state not recorded)
GC 0.00/s (0.0% of the time), imports 0.00/s
OWN%  TOTAL%  SAMPLES  PID  FUNCTION  FILE:LINE
50.0    50.0        3  100  leaf      src/main.py:20
33.3    33.3        2  100  run       src/main.py:48
"
    );
}

/// The JSON report of the trace recording and of the sample recording, whole, as
/// snapshots: every field a consumer reads, reviewed when it changes. Both are
/// built here, so the report is the same on every run; the crate version is
/// redacted, so that a release does not change them.
#[test]
fn report_json_snapshots() {
    let trace = trace_recording("snapshot-trace.pyprobe");
    let sample = sample_recording("snapshot-sample.pyprobe");
    for (name, file) in [("report_json_trace", trace), ("report_json_sample", sample)] {
        let text = stdout_of(&["report", file.to_str().unwrap(), "--format", "json"]);
        let report: serde_json::Value = serde_json::from_str(&text).unwrap();
        insta::assert_json_snapshot!(name, report, { ".pyprobe_version" => "[version]" });
    }
}

#[test]
fn top_without_a_source_says_so() {
    let out = run_pyprobe(&["top", "--once"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to watch"));
}

// End to end: a real CPython traced, every view rendered and checked against
// the fixture's own counts.

fn record_fixture(version: &'static str, script: &str, name: &str) -> Option<(PathBuf, String)> {
    let py = python(version)?;
    let path = tmp(name);
    let out = Command::new(env!("CARGO_BIN_EXE_pyprobe"))
        .args([
            "record",
            "--mode",
            "trace",
            "-o",
            path.to_str().unwrap(),
            "--",
        ])
        .arg(&py.launcher)
        .arg(repo().join("fixtures/python").join(script))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "record failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some((path, String::from_utf8(out.stdout).unwrap()))
}

/// The leaf function of a folded line, and the line's value.
fn leaf_of(line: &str) -> (&str, u64) {
    let (stack, value) = line.rsplit_once(' ').unwrap();
    let leaf = stack.rsplit(';').next().unwrap();
    (leaf, value.parse().unwrap())
}

#[test]
fn every_view_of_a_real_recording() {
    let Some((rec, stdout)) = record_fixture("3.9", "count_calls.py", "count_calls.pyprobe") else {
        return;
    };
    let truth: BTreeMap<String, u64> = serde_json::from_str(stdout.trim()).unwrap();
    let f = rec.to_str().unwrap();

    // Collapsed by calls: per function of the fixture, the stacks ending in it
    // add up to its own count.
    let collapsed = flame(&rec, &["--format", "collapsed", "--by", "calls"]);
    let mut counted: HashMap<String, u64> = HashMap::new();
    for line in collapsed.lines() {
        let (leaf, value) = leaf_of(line);
        if let Some((function, place)) = leaf.rsplit_once(" (") {
            if place.starts_with("python/count_calls.py:") {
                // Shown qualified (`Shape.area`); the fixture counts by name.
                let name = function.rsplit('.').next().unwrap_or(function);
                *counted.entry(name.to_string()).or_default() += value;
            }
        }
    }
    for (function, expected) in &truth {
        assert_eq!(
            counted.get(function),
            Some(expected),
            "calls of {function}: {counted:?}"
        );
    }
    // The same totals as the report.
    let report = crate::support::json_of(&run_pyprobe(&["report", f, "--format", "json"]));
    let report_calls: u64 = report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(crate::support::entries)
        .sum();
    let folded_calls: u64 = collapsed.lines().map(|l| leaf_of(l).1).sum();
    assert_eq!(folded_calls, report_calls);
    // Recursion shows as a tower: fib under fib.
    assert!(collapsed.contains("fib (python/count_calls.py:21);fib (python/count_calls.py:21)"));

    // By time: the stacks add up to no more than the threads' time.
    let by_time = flame(&rec, &["--format", "collapsed"]);
    assert!(by_time.lines().count() > 10);

    // SVG: well-formed, with the fixture's functions (by calls: by time, the
    // cheapest ones are narrower than a pixel when nothing stops the target).
    let (titles, _) = svg_texts(&flame(&rec, &["--by", "calls"]));
    for function in [
        "main", "fib", "catcher", "thrower", "worker", "leaf", "squares",
    ] {
        assert!(
            titles
                .iter()
                .any(|t| t.starts_with(&format!("{function} (python/count_calls.py:"))),
            "{function} in the SVG"
        );
    }

    // speedscope: parses, every profile's events balance and nest.
    let profiles = check_speedscope(&flame(&rec, &["--format", "speedscope"]));
    assert!(profiles >= 3, "main and two worker threads");

    // Chrome trace: parses, slices nest per thread, imports are there.
    let cats = check_chrome(&flame(&rec, &["--format", "chrome"]));
    assert!(cats.get("python").copied().unwrap_or(0) > 100);
    assert!(cats.contains_key("import"), "{cats:?}");

    // The call flow inside `catcher` begins with catcher's call.
    let flow = stdout_of(&["calls", f, "--start-at", "catcher"]);
    let mut lines = flow.lines().skip(1);
    let first = lines.next().unwrap();
    assert!(
        first.ends_with("-> python/count_calls.py:catcher:56"),
        "{first}"
    );
    let body: Vec<&str> = flow.lines().skip(1).collect();
    assert_eq!(
        body.iter()
            .filter(|l| l.contains("-> python/count_calls.py:catcher:"))
            .count() as u64,
        truth["catcher"]
    );
    assert_eq!(
        body.iter()
            .filter(|l| l.contains("-> python/count_calls.py:thrower:"))
            .count() as u64,
        truth["thrower"]
    );
    assert!(
        body.iter().all(|l| !l.contains(":fib:")),
        "nothing from outside catcher"
    );

    // top --once on the recording: the most-called function first.
    let top = stdout_of(&["top", "--once", "--from", f]);
    let first_row = top.lines().nth(3).unwrap();
    assert!(first_row.contains(" fib "), "{top}");
}

/// Checks a speedscope document: it parses, frame indices are in the table,
/// evented profiles balance (each close is the innermost open frame, time goes
/// forward, nothing left open), sampled ones have a weight per sample. Returns
/// the number of profiles.
fn check_speedscope(text: &str) -> usize {
    let doc: serde_json::Value = serde_json::from_str(text).expect("speedscope JSON parses");
    let frames = doc["shared"]["frames"].as_array().unwrap().len() as u64;
    let profiles = doc["profiles"].as_array().unwrap();
    for p in profiles {
        match p["type"].as_str().unwrap() {
            "evented" => {
                let mut stack = Vec::new();
                let mut last = 0;
                for e in p["events"].as_array().unwrap() {
                    let at = e["at"].as_u64().unwrap();
                    assert!(at >= last, "time goes forward");
                    last = at;
                    let frame = e["frame"].as_u64().unwrap();
                    assert!(frame < frames);
                    match e["type"].as_str().unwrap() {
                        "O" => stack.push(frame),
                        "C" => assert_eq!(stack.pop(), Some(frame), "closes the innermost frame"),
                        other => panic!("event type {other}"),
                    }
                }
                assert!(stack.is_empty(), "every opened frame is closed");
                assert!(last <= p["endValue"].as_u64().unwrap());
            }
            "sampled" => {
                let samples = p["samples"].as_array().unwrap();
                assert_eq!(samples.len(), p["weights"].as_array().unwrap().len());
                for s in samples {
                    assert!(s
                        .as_array()
                        .unwrap()
                        .iter()
                        .all(|f| f.as_u64().unwrap() < frames));
                }
            }
            other => panic!("profile type {other}"),
        }
    }
    profiles.len()
}

/// Checks a Chrome trace: it parses, and per thread its slices nest (none
/// overlaps its parent partly). Returns the slices per category.
fn check_chrome(text: &str) -> HashMap<String, usize> {
    let doc: serde_json::Value = serde_json::from_str(text).expect("Chrome trace JSON parses");
    let events = doc["traceEvents"].as_array().unwrap();
    let mut slices: HashMap<u64, Vec<(f64, f64)>> = HashMap::new();
    let mut named = std::collections::HashSet::new();
    let mut cats: HashMap<String, usize> = HashMap::new();
    for e in events {
        match e["ph"].as_str().unwrap() {
            "X" => {
                let ts = e["ts"].as_f64().unwrap();
                let dur = e["dur"].as_f64().unwrap();
                assert!(dur >= 0.0);
                slices
                    .entry(e["tid"].as_u64().unwrap())
                    .or_default()
                    .push((ts, ts + dur));
                *cats.entry(e["cat"].as_str().unwrap().into()).or_default() += 1;
            }
            "M" if e["name"] == "thread_name" => {
                named.insert(e["tid"].as_u64().unwrap());
            }
            _ => {}
        }
    }
    for (tid, mut xs) in slices {
        assert!(named.contains(&tid), "thread {tid} has a name");
        xs.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut open: Vec<f64> = Vec::new();
        for (start, end) in xs {
            while open.last().is_some_and(|&e| e <= start + 1e-6) {
                open.pop();
            }
            if let Some(&outer) = open.last() {
                assert!(
                    end <= outer + 1e-6,
                    "thread {tid}: slice overlaps its parent"
                );
            }
            open.push(end);
        }
    }
    cats
}

#[test]
fn every_view_of_a_sampled_recording() {
    let Some(py) = python("3.13") else { return };
    let rec = tmp("sampled-demo.pyprobe");
    let out = Command::new(env!("CARGO_BIN_EXE_pyprobe"))
        .args([
            "record",
            "--mode",
            "sample",
            "-r",
            "200",
            "-o",
            rec.to_str().unwrap(),
            "--",
        ])
        .arg(&py.launcher)
        .arg(repo().join("fixtures/demo.py"))
        .args(["--seconds", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "record failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f = rec.to_str().unwrap();
    let report = crate::support::json_of(&run_pyprobe(&["report", f, "--format", "json"]));
    assert_eq!(report["mode"], "sample");
    // Every non-empty sample has one leaf: the report's leaf counts add up to
    // the samples, and so must the folded stacks.
    let samples: u64 = report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["samples"].as_u64().unwrap())
        .sum();
    assert!(samples > 20, "{samples} samples");
    let collapsed = flame(&rec, &["--format", "collapsed"]);
    let folded: u64 = collapsed.lines().map(|l| leaf_of(l).1).sum();
    assert_eq!(folded, samples);
    assert!(collapsed
        .lines()
        .any(|l| l.contains("fib (") && l.contains("main (")));

    let (titles, texts) = svg_texts(&flame(&rec, &[]));
    assert!(titles
        .iter()
        .any(|t| t.starts_with(&format!("all ({samples} samples, 100%)"))));
    assert!(titles
        .iter()
        .any(|t| t.starts_with("fib (fixtures/demo.py:")));
    assert!(
        texts
            .iter()
            .any(|t| t.contains("sample mode") && t.contains("samples every 5.00 ms")),
        "{texts:?}"
    );

    assert!(check_speedscope(&flame(&rec, &["--format", "speedscope"])) >= 1);
    let cats = check_chrome(&flame(&rec, &["--format", "chrome"]));
    assert!(cats.get("sampled").copied().unwrap_or(0) > 5, "{cats:?}");

    let top = stdout_of(&["top", "--once", "--from", f]);
    assert!(top.contains("sample mode"), "{top}");
}

#[test]
fn top_once_on_a_live_process_shows_its_hottest_function_first() {
    for version in ["3.9", "3.13"] {
        let Some(py) = python(version) else { continue };
        let mut target = crate::support::Target::spawn(
            &py.launcher,
            &[repo().join("fixtures/python/forever.py").to_str().unwrap()],
        );
        target.wait_for_line("ready");
        let pid = target.pid().to_string();
        let text = stdout_of(&["top", "--once", "-p", &pid, "--interval", "0.5"]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].contains(&format!("pid {pid}")),
            "{version}: {text}"
        );
        assert!(
            lines[2].trim_start().starts_with("OWN%"),
            "{version}: {text}"
        );
        assert!(
            lines[3].contains(" fib ") && lines[3].contains("forever.py:"),
            "{version}: fib is the hottest: {text}"
        );
        // The target ran on, untouched.
        target.send_line("stop");
        let (rest, status) = target.finish();
        assert!(status.success(), "{version}: {status:?}");
        assert!(rest.contains("result "), "{version}: {rest}");
    }
}
