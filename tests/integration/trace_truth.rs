//! Trace mode's times, stacks and rows against the target's own truth, on every
//! probe flavour: CPython 3.9 (entry and return), 3.15 (entries also at generator
//! creation), 3.11 (returns only, times sampled alongside).
//!
//! * `fixtures/python/shapes.py`: super().__init__, mutual recursion, a generator
//!   yielding from several lines, coroutines, an exception unwinding, a class
//!   body; it counts its own calls and times a few functions itself.
//! * Real programs from PyPI (docutils, pyflakes): cProfile's per-function counts,
//!   and the flame graph, the Chrome trace and the report agreeing.
//! * `fixtures/python/serve.py`: attached while frames are already running.
//! * `fixtures/python/same_names.py`: functions of one name in one file (with
//!   cells, decorated, class bodies, one never sampled), each its own row at its
//!   code object's first line.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::*;
use serde_json::Value;

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pyprobe-truth-{}-{name}", std::process::id()))
}

/// Records `python ARGS` in trace mode with `extra` record options and
/// `PYTHONPATH`; returns the recording and the program's stdout.
fn record(
    py: &Python,
    name: &str,
    args: &[&str],
    extra: &[&str],
    pythonpath: Option<&Path>,
) -> (PathBuf, String) {
    let path = tmp(&format!("{}-{name}.pyprobe", py.version));
    let mut cmd = pyprobe();
    // Recorded again at the same name when the machine disturbed a run.
    cmd.args([
        "record",
        "--mode",
        "trace",
        "--force",
        "-o",
        path.to_str().unwrap(),
    ])
    .args(extra)
    .arg("--")
    .arg(&py.launcher)
    .args(args);
    if let Some(p) = pythonpath {
        cmd.env("PYTHONPATH", p);
    }
    let out = cmd.output().expect("run pyprobe record");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("record {name} on {}: {stderr}", py.version);
    crate::support::assert_no_panic("record", &out.stderr);
    assert!(path.exists(), "{}: no recording: {stderr}", py.version);
    (path, String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a trace was disturbed by the machine rather than by pyprobe: events
/// lost (pyprobe got no CPU for longer than its ring lasts), or a thread that
/// stalled outside any Python frame (a page fault storm, pyprobe holding the
/// target to catch up) for more of its time than [`outside_frames_tolerance`]
/// allows: the share [`check_times_add_up`] then checks, so that a recording it
/// would pass is never made again.
fn disturbed(version: &str, report: &Value) -> Option<String> {
    if u(&report["lost_events"]) > 0 {
        return Some(format!("{} events lost", report["lost_events"]));
    }
    let tolerance = outside_frames_tolerance(version, report);
    report["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| {
            // As `check_times_add_up` counts it: the tracing cost left out of the
            // exclusive times is not time outside frames.
            let traced = u(&t["traced_ns"]);
            let inside = u(&t["exclusive_ns"]) + u(&t["tracing_cost_ns"]);
            traced.abs_diff(inside) as f64 > traced as f64 * tolerance
        })
        .map(|t| {
            format!(
                "thread {t} outside Python frames for over {:.0} % of its time",
                tolerance * 100.0
            )
        })
}

/// The share of a thread's traced time it may spend outside any Python frame:
/// 1 % where the probes fire, 3 % through the hook (3.11), which sees the
/// interpreter's start-up, dozens of top-level calls with C work between them.
fn outside_frames_tolerance(version: &str, report: &Value) -> f64 {
    if version == "3.11" && report["source"] != "returns_only" {
        0.03
    } else {
        0.01
    }
}

/// [`record`], then its report; recorded again (at most twice) when the machine
/// disturbed it, so that a shared, busy machine does not fail the comparisons.
fn record_clean(
    py: &Python,
    name: &str,
    args: &[&str],
    extra: &[&str],
    pythonpath: Option<&Path>,
) -> (PathBuf, String, Value) {
    let mut attempt = 1;
    loop {
        let (path, stdout) = record(py, name, args, extra, pythonpath);
        let report = report_json(path.to_str().unwrap());
        match disturbed(py.version, &report) {
            Some(why) if attempt < 3 => {
                eprintln!("NOTICE: {name} on {}: recording again: {why}", py.version);
                attempt += 1;
            }
            _ => return (path, stdout, report),
        }
    }
}

fn rows(report: &Value) -> &Vec<Value> {
    report["functions"].as_array().unwrap()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Checks that hold for every trace: inclusive ≥ exclusive on every row, and on
/// each thread the exclusive times and the tracing cost left out of them add up
/// to its traced wall time (from its first frame to its last) less the moments it
/// ran outside any Python frame (see [`outside_frames_tolerance`]).
fn check_times_add_up(version: &str, report: &Value) {
    let tolerance = outside_frames_tolerance(version, report);
    for f in rows(report) {
        assert!(
            u(&f["inclusive_ns"]) >= u(&f["exclusive_ns"]),
            "{version}: inclusive < exclusive: {f}"
        );
    }
    for t in report["threads"].as_array().unwrap() {
        let (traced, excl) = (
            u(&t["traced_ns"]),
            u(&t["exclusive_ns"]) + u(&t["tracing_cost_ns"]),
        );
        if traced > 0 {
            let gap = traced.abs_diff(excl) as f64 / traced as f64;
            assert!(
                excl <= traced && gap <= tolerance,
                "{version}: thread {t}: exclusive {excl} vs traced {traced}"
            );
        }
    }
}

fn check_no_pairing_anomalies(version: &str, report: &Value) {
    assert_eq!(report["lost_events"], 0, "{version}: events lost");
    let a = &report["anomalies"];
    for key in [
        "resyncs",
        "unpaired_entries",
        "orphan_returns",
        "depth_overflows",
        "out_of_order_events",
    ] {
        assert_eq!(
            a[key], 0,
            "{version}: {key} in {a}, lost events {}",
            report["lost_events"]
        );
    }
}

/// The one row of `shapes.py` for truth name `name` (`Class.method` or a plain
/// name), whose line lies in the function's own range (its first line on
/// versions whose entry probe passes it).
fn shapes_row<'a>(report: &'a Value, truth: &Value, name: &str, exact_line: bool) -> &'a Value {
    let function = name.rsplit('.').next().unwrap();
    let range = truth["lines"][name]
        .as_array()
        .map(|r| (u(&r[0]), u(&r[1])));
    let found: Vec<&Value> = rows(report)
        .iter()
        .filter(|f| {
            f["file"].as_str().unwrap().ends_with("shapes.py")
                && f["function"] == function
                && range.is_none_or(|(first, last)| {
                    let line = u(&f["line"]);
                    if exact_line {
                        line == first
                    } else {
                        (first..=last).contains(&line)
                    }
                })
        })
        .collect();
    assert_eq!(found.len(), 1, "{name}: one row, in {range:?}: {found:?}");
    found[0]
}

/// `got` is within `tolerance` (a fraction) of `truth`, plus `slack_ns`.
fn close(got: u64, truth: u64, tolerance: f64, slack_ns: u64) -> bool {
    got.abs_diff(truth) as f64 <= truth as f64 * tolerance + slack_ns as f64
}

fn check_shapes(version: &'static str) {
    // One at a time: on a small machine, traces running at once make pyprobe
    // fall behind its ring and lose events.
    let _serial = crate::support::serial();
    let Some(py) = python(version) else { return };
    let script = fixture_script("shapes.py");
    let (path, stdout, report) = record_clean(&py, "shapes", &[&script, "3", "10"], &[], None);
    // 3.11's calls come from the hook engine (its entry probes do not fire).
    assert_ne!(report["source"], "returns_only", "{version}");
    let truth: Value = serde_json::from_str(stdout.trim()).expect("shapes.py printed its truth");
    check_no_pairing_anomalies(version, &report);
    check_times_add_up(version, &report);
    // 3.15 passes the line of a frame's first instruction, which has no line in
    // functions with cells (super()): their row shows a line of their own.
    // The hook names code objects: their first lines.
    let exact_line = version != "3.15";
    // A generator's or coroutine's first run is its call, each later run a resume.
    for (name, calls) in truth["calls"].as_object().unwrap() {
        let row = shapes_row(&report, &truth, name, exact_line);
        let resumes = truth["resumes"].get(name).map_or(0, u);
        assert_eq!(row["calls"], *calls, "{version}: calls of {name}");
        assert_eq!(u(&row["resumes"]), resumes, "{version}: resumes of {name}");
    }
    // Times against the functions' own clocks: a same-named callee gets its
    // whole time (it is not recursion), its caller's includes it.
    for name in ["Base.__init__", "Derived.__init__", "main"] {
        let row = shapes_row(&report, &truth, name, exact_line);
        let own = u(&truth["ns"][name]);
        let inclusive = u(&row["inclusive_ns"]);
        assert!(
            close(inclusive, own, 0.01, 200_000),
            "{version}: {name} inclusive {inclusive} ns, its own clock {own} ns"
        );
    }
    let base = shapes_row(&report, &truth, "Base.__init__", exact_line);
    let spin = shapes_row(&report, &truth, "spin", exact_line);
    assert!(u(&base["exclusive_ns"]) < u(&base["inclusive_ns"]) / 10);
    assert!(u(&spin["exclusive_ns"]) > u(&base["inclusive_ns"]));
    let _ = std::fs::remove_file(path);
}

/// The calls and resumes of `shapes.py`'s generator and coroutines against the
/// program's own counts, on the interpreters `check_shapes` does not trace:
/// Debian's 3.13 and 3.14 (the hook through `sys.monitoring`) and the pyenv-style
/// builds this machine has (3.7 to 3.11 through the hook's profile function).
#[test]
fn calls_and_resumes_are_the_programs_own_through_the_hook_everywhere() {
    let _serial = crate::support::serial();
    let script = fixture_script("shapes.py");
    let mut pythons: Vec<Python> = ["3.13", "3.14"].into_iter().filter_map(python).collect();
    for (version, exe) in pyenv_builds() {
        // The frame walker, and so pyprobe, starts at 3.7.
        let minor: u32 = version
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .unwrap_or(0);
        if version.starts_with("3.") && minor >= 7 {
            pythons.push(pyenv_python(&version, exe));
        }
    }
    for py in &pythons {
        let (path, stdout) = record(py, "resumes", &[&script, "2", "1"], &[], None);
        let truth: Value = serde_json::from_str(stdout.trim()).expect("shapes.py printed");
        let report = report_json(path.to_str().unwrap());
        for name in ["numbers", "leaf", "gather_leaves", "main"] {
            let row = shapes_row(&report, &truth, name, true);
            let want = (
                u(&truth["calls"][name]),
                truth["resumes"].get(name).map_or(0, u),
            );
            let got = (u(&row["calls"]), u(&row["resumes"]));
            assert_eq!(got, want, "{}: calls and resumes of {name}", py.version);
        }
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn shapes_on_3_9_counts_rows_and_times() {
    check_shapes("3.9");
}

#[test]
fn shapes_on_3_15_counts_rows_and_times() {
    check_shapes("3.15");
}

#[test]
fn shapes_on_3_11_through_the_hook_counts_rows_and_times() {
    check_shapes("3.11");
}

#[test]
fn shapes_on_3_11_through_the_return_probes_counts_exact_times_sampled() {
    // One at a time: on a small machine, traces running at once make pyprobe
    // fall behind its ring and lose events.
    let _serial = crate::support::serial();
    let Some(py) = python("3.11") else { return };
    let script = fixture_script("shapes.py");
    let (path, stdout) = record(
        &py,
        "shapes",
        &[&script, "3", "40"],
        &["-r", "1000", "--engine", "ring"],
        None,
    );
    let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
    let report = report_json(path.to_str().unwrap());
    assert_eq!(report["source"], "returns_only");
    assert!(u(&report["sample_interval_ns"]) > 0, "labelled as sampled");
    for f in rows(&report) {
        assert!(u(&f["inclusive_ns"]) >= u(&f["exclusive_ns"]), "{f}");
    }
    // Rows are functions, not return lines: at the walker's first line where
    // sampled, else one per name at a line of its own.
    // Returns cannot tell a resume from a call: each return or yield is one.
    let sampled = ["Base.__init__", "Derived.__init__", "main", "spin"];
    for (name, calls) in truth["calls"].as_object().unwrap() {
        let row = shapes_row(&report, &truth, name, sampled.contains(&name.as_str()));
        let entries = u(calls) + truth["resumes"].get(name).map_or(0, u);
        assert_eq!(u(&row["calls"]), entries, "calls of {name}");
        assert_eq!(u(&row["resumes"]), 0, "resumes of {name}");
    }
    // Sampled times: statistically close to the functions' own clocks.
    for name in ["Base.__init__", "Derived.__init__", "main"] {
        let row = shapes_row(&report, &truth, name, true);
        let own = u(&truth["ns"][name]);
        let inclusive = u(&row["inclusive_ns"]);
        assert!(
            close(inclusive, own, 0.35, 0),
            "{name}: sampled inclusive {inclusive} ns, its own clock {own} ns"
        );
    }
    // The flame graph shows the sampled stacks, not GC bars alone.
    let folded = stdout_lines(&[
        "flame",
        path.to_str().unwrap(),
        "--format",
        "collapsed",
        "-o",
        "-",
    ]);
    assert!(
        folded
            .iter()
            .any(|l| l.contains("main (") && l.contains("__init__ (") && l.contains("spin (")),
        "{folded:?}"
    );
    let _ = std::fs::remove_file(path);
}

/// `same_names.py` traced on `version`: every function it counted is one row, at
/// its code object's first line (co_firstlineno, what the frame walker gives
/// sampled frames), with its calls; no other row of those names in that file.
/// Returns the report.
///
/// Through `int3` a return's frame is read while the thread is held; through the
/// ring the trampoline reads the frame's code word at the site itself (the
/// interpreters' own code proves that read safe there): every function is named.
fn check_same_names(version: &'static str, engine: &str, extra: &[&str]) -> Option<Value> {
    // One at a time: on a small machine, traces running at once make pyprobe
    // fall behind its ring and lose events.
    let _serial = crate::support::serial();
    let py = python(version)?;
    let script = fixture_script("same_names.py");
    let mut options = vec!["--engine", engine];
    options.extend_from_slice(extra);
    let (path, stdout) = record(&py, "same-names", &[&script, "300"], &options, None);
    let truth: Value = serde_json::from_str(stdout.trim()).expect("same_names.py printed");
    let report = report_json(path.to_str().unwrap());
    let mut ours: BTreeMap<(String, u64), u64> = BTreeMap::new();
    for f in rows(&report) {
        if f["file"].as_str().unwrap().ends_with("same_names.py") {
            let key = (f["function"].as_str().unwrap().to_owned(), u(&f["line"]));
            *ours.entry(key).or_default() += u(&f["calls"]);
        }
    }
    let mut want: BTreeMap<(String, u64), u64> = BTreeMap::new();
    for f in truth["functions"].as_array().unwrap() {
        let key = (f[0].as_str().unwrap().to_owned(), u(&f[1]));
        want.insert(key, u(&f[2]));
    }
    for ((name, first), calls) in &want {
        assert_eq!(
            ours.get(&(name.clone(), *first)),
            Some(calls),
            "{version}: {name} at line {first}: {calls} calls; rows: {ours:?}"
        );
    }
    for (name, line) in ours.keys() {
        assert!(
            !want.keys().any(|(n, _)| n == name) || want.contains_key(&(name.clone(), *line)),
            "{version}: a row of {name} at line {line}, not a first line of it: {ours:?}"
        );
    }
    let _ = std::fs::remove_file(path);
    Some(report)
}

#[test]
fn same_named_functions_with_cells_are_rows_of_their_own_on_3_15() {
    // Two `__init__`s calling super(), two `Node` class bodies and two `outer`s
    // keeping closures have cells: 3.15's entry probe passes no line for them.
    // Two decorated `handler`s: it passes their `def` lines.
    check_same_names("3.15", "int3", &[]);
}

#[test]
fn same_named_functions_are_rows_of_their_own_through_the_ring_on_3_15() {
    check_same_names("3.15", "ring", &[]);
}

#[test]
fn same_named_functions_are_rows_of_their_own_through_the_ring_on_3_11() {
    check_same_names("3.11", "ring", &[]);
}

#[test]
fn a_function_never_sampled_keeps_its_own_row_on_3_11() {
    // Returns only, times sampled alongside: the second `work` (quick, after the
    // first in the file) is meant never to be sampled, so no first line of its
    // own is known but the one its returns name. Sampling cannot promise that:
    // a sample taken while a return of it is held at its probe names it. Such a
    // run still checks every row; the premise is tried again, at most 4 times.
    let mut seen = Vec::new();
    for _ in 0..4 {
        let Some(report) = check_same_names("3.11", "int3", &[]) else {
            return;
        };
        let works: Vec<(u64, u64)> = rows(&report)
            .iter()
            .filter(|f| {
                f["file"].as_str().unwrap().ends_with("same_names.py") && f["function"] == "work"
            })
            .map(|f| (u(&f["calls"]), u(&f["samples"])))
            .collect();
        assert!(
            works
                .iter()
                .any(|&(calls, samples)| calls == 1 && samples > 0),
            "the spinning work is sampled: {works:?}"
        );
        if works.contains(&(5, 0)) {
            return;
        }
        seen.push(works);
    }
    panic!("the quick work was sampled in every run: {seen:?}");
}

fn stdout_lines(args: &[&str]) -> Vec<String> {
    let out = run_pyprobe(args);
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Per flame graph frame (`function (file:line)`, full paths): own value, the
/// GC pauses it triggered added back (the flame graph shows them above it).
fn flame_by_frame(path: &Path, by: &str) -> (HashMap<String, u64>, usize) {
    let lines = stdout_lines(&[
        "flame",
        path.to_str().unwrap(),
        "--format",
        "collapsed",
        "--full-paths",
        "--by",
        by,
        "-o",
        "-",
    ]);
    let mut own: HashMap<String, u64> = HashMap::new();
    let mut depth = 0;
    for line in &lines {
        let (stack, value) = line.rsplit_once(' ').unwrap();
        let value: u64 = value.parse().unwrap();
        let frames: Vec<&str> = stack.split(';').collect();
        depth = depth.max(frames.len());
        let mut leaf = frames.len() - 1;
        if frames[leaf].starts_with("[gc gen") {
            if leaf == 0 {
                continue;
            }
            leaf -= 1;
        }
        *own.entry(frames[leaf].to_owned()).or_default() += value;
    }
    (own, depth)
}

/// Chrome trace slices nest on every thread: none ends after its parent.
fn check_chrome_nests(path: &Path) {
    let out = run_pyprobe(&[
        "flame",
        path.to_str().unwrap(),
        "--format",
        "chrome",
        "-o",
        "-",
    ]);
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Times in ns: the trace writes µs with three exact decimals.
    let ns = |v: &Value| (v.as_f64().unwrap() * 1000.0).round() as u64;
    let mut by_tid: BTreeMap<u64, Vec<(u64, u64, String)>> = BTreeMap::new();
    for e in doc["traceEvents"].as_array().unwrap() {
        if e["ph"] == "X" {
            let ts = ns(&e["ts"]);
            by_tid.entry(u(&e["tid"])).or_default().push((
                ts,
                ts + ns(&e["dur"]),
                e["name"].as_str().unwrap().to_owned(),
            ));
        }
    }
    let mut overlaps = Vec::new();
    for slices in by_tid.values_mut() {
        slices.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut open: Vec<(u64, u64, String)> = Vec::new();
        for s in slices.iter() {
            while open.last().is_some_and(|p| p.1 <= s.0) {
                open.pop();
            }
            if let Some(p) = open.last() {
                if s.1 > p.1 {
                    overlaps.push(format!(
                        "{} [{}, {}] ends after its parent {} [{}, {}]",
                        s.2, s.0, s.1, p.2, p.0, p.1
                    ));
                }
            }
            open.push(s.clone());
        }
    }
    assert!(
        overlaps.is_empty(),
        "{} slices overlap: {:?}",
        overlaps.len(),
        &overlaps[..overlaps.len().min(5)]
    );
}

/// cProfile's counts of the same program, for functions of files under `root`:
/// (file, first line, name) → (calls, throws).
fn cprofile_counts(
    py: &Python,
    pythonpath: &Path,
    args: &[&str],
    root: &Path,
) -> BTreeMap<(String, u64, String), (u64, u64)> {
    let out_path = tmp(&format!("{}-cprofile.json", py.version));
    let out = Command::new(&py.launcher)
        .arg(fixture_script("cprofile_counts.py"))
        .arg(&out_path)
        .args(args)
        .env("PYTHONPATH", pythonpath)
        .output()
        .unwrap();
    assert!(
        out_path.exists(),
        "cProfile run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<(String, u64, String, u64, u64)> =
        serde_json::from_slice(&std::fs::read(&out_path).unwrap()).unwrap();
    let _ = std::fs::remove_file(out_path);
    let root = root.to_str().unwrap();
    rows.into_iter()
        .filter(|r| r.0.starts_with(root))
        .map(|(file, line, name, calls, throws)| ((file, line, name), (calls, throws)))
        .collect()
}

/// A real program from PyPI traced on `version`: no pairing anomaly, times that
/// add up, the flame graph's own time and calls equal to the report's exclusive
/// time and calls per function, Chrome slices nested, and cProfile's counts.
fn check_real_program(
    version: &'static str,
    name: &str,
    pkg_version: &str,
    args: &[&str],
    extra: &[&str],
) {
    // One at a time: on a small machine, traces running at once make pyprobe
    // fall behind its ring and lose events.
    let _serial = crate::support::serial();
    let Some(py) = python(version) else { return };
    let site = pypi(name, pkg_version);
    let args: Vec<String> = args
        .iter()
        .map(|a| a.replace("{site}", site.to_str().unwrap()))
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let args = &args[..];
    let (path, _, report) = record_clean(&py, name, args, extra, Some(&site));
    check_no_pairing_anomalies(version, &report);
    check_times_add_up(version, &report);

    // One replay: per function, the flame graph's own time and calls are the
    // report's exclusive time and calls. On 3.11 its time is samples: the
    // report's samples (those whose leaf the function is).
    let sampled = report["source"] == "returns_only";
    if sampled {
        assert!(
            u(&report["sample_interval_ns"]) > 0,
            "{version}: sampled alongside"
        );
    }
    let (time, depth) = flame_by_frame(&path, "time");
    let (calls, _) = flame_by_frame(&path, "calls");
    let mut checked = 0;
    for f in rows(&report) {
        // As the flame graph names it: no line when none is known.
        let frame = match u(&f["line"]) {
            0 => format!(
                "{} ({})",
                f["qualname"].as_str().unwrap(),
                f["file"].as_str().unwrap()
            ),
            line => format!(
                "{} ({}:{line})",
                f["qualname"].as_str().unwrap(),
                f["file"].as_str().unwrap()
            ),
        };
        if frame.contains(';') {
            continue;
        }
        let own = if sampled {
            &f["samples"]
        } else {
            &f["exclusive_ns"]
        };
        assert_eq!(
            time.get(&frame).copied().unwrap_or(0),
            u(own),
            "{version} {name}: flame time of {frame}"
        );
        assert_eq!(
            calls.get(&frame).copied().unwrap_or(0),
            entries(f),
            "{version} {name}: flame calls of {frame}"
        );
        checked += 1;
    }
    assert!(checked > 100, "{checked} functions compared");
    assert!(depth < 200, "{version} {name}: stacks {depth} deep");
    check_chrome_nests(&path);

    // cProfile counts a generator's every resume as a call: pyprobe's calls and
    // resumes together.
    let package = site.join(name);
    let truth = cprofile_counts(&py, &site, args, &package);
    assert!(truth.len() > 100, "{} cProfile rows", truth.len());
    let mut ours: BTreeMap<(String, u64, String), u64> = BTreeMap::new();
    for f in rows(&report) {
        let file = f["file"].as_str().unwrap();
        if file.starts_with(package.to_str().unwrap()) {
            let key = (
                file.to_owned(),
                u(&f["line"]),
                f["function"].as_str().unwrap().to_owned(),
            );
            *ours.entry(key).or_default() += entries(f);
        }
    }
    if version == "3.9" || (version == "3.11" && !sampled) {
        // Same rows (file, first line, name), same counts (3.11: the hook, a profile
        // function as cProfile is).
        let truth: BTreeMap<_, u64> = truth.iter().map(|(k, v)| (k.clone(), v.0)).collect();
        let diff: Vec<_> = truth
            .iter()
            .filter(|(k, v)| ours.get(*k) != Some(v))
            .map(|(k, v)| (k, v, ours.get(k)))
            .chain(
                ours.iter()
                    .filter(|(k, _)| !truth.contains_key(*k))
                    .map(|(k, v)| (k, v, None)),
            )
            .collect();
        assert!(
            diff.is_empty(),
            "{name} on {version}: rows differing from cProfile: {diff:?}"
        );
    } else {
        // 3.15 passes a def line (decorated functions) or none (functions with
        // cells) where cProfile has co_firstlineno, 3.11 only returns (rows then
        // come from the walker's samples): compare per file and name, rows never
        // more than cProfile's. On 3.15 a throw into a generator runs no entry
        // probe and may fire no return: cProfile may count up to that many more.
        let mut want: BTreeMap<(String, String), (u64, u64, usize)> = BTreeMap::new();
        for ((file, _, function), (calls, throws)) in &truth {
            let e = want.entry((file.clone(), function.clone())).or_default();
            e.0 += calls;
            e.1 += throws;
            e.2 += 1;
        }
        let mut got: BTreeMap<(String, String), (u64, usize)> = BTreeMap::new();
        for ((file, _, function), calls) in &ours {
            let e = got.entry((file.clone(), function.clone())).or_default();
            e.0 += calls;
            e.1 += 1;
        }
        for (key, &(calls, throws, rows)) in &want {
            let (ours, our_rows) = got.get(key).copied().unwrap_or_default();
            assert!(
                ours <= calls && ours + throws >= calls,
                "{name} on {version}: {key:?}: {ours} calls, cProfile {calls} ({throws} throws)"
            );
            assert!(
                our_rows <= rows,
                "{name} on {version}: {key:?}: {our_rows} rows, cProfile {rows}"
            );
        }
        assert!(
            got.keys().all(|k| want.contains_key(k)),
            "functions cProfile never saw"
        );
        // Every row is one of cProfile's, at its first line (co_firstlineno: read
        // through the frame at the return's site, by either engine).
        for (key, &calls) in &ours {
            let &(want, throws) = truth.get(key).unwrap_or_else(|| {
                panic!("{name} on {version}: a row cProfile does not have: {key:?}")
            });
            assert!(
                calls <= want && calls + throws >= want,
                "{name} on {version}: {key:?}: {calls} calls, cProfile {want} ({throws} throws)"
            );
        }
    }
    let _ = std::fs::remove_file(path);
}

const DOCUTILS: (&str, &str) = ("docutils", "0.21.2");
const PYFLAKES: (&str, &str) = ("pyflakes", "3.2.0");

fn docutils_args() -> Vec<String> {
    vec![
        "-m".into(),
        "docutils".into(),
        fixture_script("sample.rst"),
        tmp("sample.html").display().to_string(),
    ]
}

fn pyflakes_args() -> Vec<String> {
    // pyflakes checks its own checker module (`{site}`: where it is installed).
    vec![
        "-m".into(),
        "pyflakes".into(),
        "{site}/pyflakes/checker.py".into(),
    ]
}

fn check_program(version: &'static str, (name, v): (&str, &str), args: Vec<String>) {
    check_program_with(version, (name, v), args, &[]);
}

fn check_program_with(
    version: &'static str,
    (name, v): (&str, &str),
    args: Vec<String>,
    extra: &[&str],
) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    check_real_program(version, name, v, &args, extra);
}

#[test]
fn docutils_on_3_9_agrees_with_cprofile_and_itself() {
    check_program("3.9", DOCUTILS, docutils_args());
}

#[test]
fn docutils_on_3_15_agrees_with_cprofile_and_itself() {
    check_program("3.15", DOCUTILS, docutils_args());
}

#[test]
fn docutils_on_3_11_through_the_hook_agrees_with_cprofile_and_itself() {
    check_program("3.11", DOCUTILS, docutils_args());
}

#[test]
fn docutils_on_3_11_through_the_return_probes_agrees_with_cprofile_and_itself() {
    check_program_with("3.11", DOCUTILS, docutils_args(), &["--engine", "ring"]);
}

#[test]
fn pyflakes_on_3_11_through_the_hook_agrees_with_cprofile_and_itself() {
    check_program("3.11", PYFLAKES, pyflakes_args());
}

#[test]
fn pyflakes_on_3_11_through_the_return_probes_agrees_with_cprofile_and_itself() {
    check_program_with("3.11", PYFLAKES, pyflakes_args(), &["--engine", "ring"]);
}

#[test]
fn pyflakes_on_3_9_agrees_with_cprofile_and_itself() {
    check_program("3.9", PYFLAKES, pyflakes_args());
}

#[test]
fn pyflakes_on_3_15_agrees_with_cprofile_and_itself() {
    check_program("3.15", PYFLAKES, pyflakes_args());
}

fn check_attach_with_open_frames(version: &'static str) {
    // One at a time: on a small machine, traces running at once make pyprobe
    // fall behind its ring and lose events.
    let _serial = crate::support::serial();
    let Some(py) = python(version) else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("serve.py")]);
    target.wait_for_line("ready");
    // handle() is running when pyprobe attaches, and serve() never returns.
    target.send_line("1500");
    std::thread::sleep(Duration::from_millis(100));
    let path = tmp(&format!("{version}-attach.pyprobe"));
    let (_, sems) = sites_and_semaphores(target.pid());
    let tracer = Tracer::record(
        path.to_str().unwrap(),
        &[
            "-p",
            &target.pid().to_string(),
            "--mode",
            "trace",
            "-d",
            "3",
        ],
    );
    wait_until_traced(target.pid(), &sems);
    let first = target.wait_for_line("done");
    target.send_line("200");
    let second = target.wait_for_line("done");
    let (status, _) = tracer.wait(Duration::from_secs(30));
    assert!(status.success());
    let field = |line: &str, i: usize| -> u64 { line.split(' ').nth(i).unwrap().parse().unwrap() };
    let (serve_line, handle_line) = (field(&first, 1), field(&first, 2));
    let (first_ns, second_ns) = (field(&first, 3), field(&second, 3));

    let report = report_json(path.to_str().unwrap());
    check_no_pairing_anomalies(version, &report);
    check_times_add_up(version, &report);
    let row = |function: &str, line: u64| {
        rows(&report)
            .iter()
            .find(|f| f["function"] == function && u(&f["line"]) == line)
            .unwrap_or_else(|| panic!("{version}: no {function}:{line} in {report}"))
    };
    // serve: running from attach to the end, never returned.
    let serve = row("serve", serve_line);
    assert_eq!(serve["calls"], 0, "{version}: {serve}");
    let traced = u(&report["threads"][0]["traced_ns"]);
    assert!(
        u(&serve["inclusive_ns"]) + 1_000_000 >= traced,
        "{version}: {serve} over {traced}"
    );
    // handle: the request running at attach (from attach to its return) and the
    // whole second one.
    let handle = row("handle", handle_line);
    assert_eq!(handle["calls"], 2, "{version}: {handle}");
    let inclusive = u(&handle["inclusive_ns"]);
    assert!(
        inclusive > second_ns && inclusive < first_ns + second_ns,
        "{version}: handle {inclusive} ns; requests took {first_ns} and {second_ns} ns"
    );
    let a = &report["anomalies"];
    assert!(u(&a["open_at_start"]) >= 3, "{version}: {a}");
    assert!(u(&a["open_at_end"]) >= 2, "{version}: {a}");
    // The flame graph holds the server loop and the request under it.
    let folded = stdout_lines(&[
        "flame",
        path.to_str().unwrap(),
        "--format",
        "collapsed",
        "-o",
        "-",
    ]);
    assert!(
        folded
            .iter()
            .any(|l| l.contains(";serve (") && l.contains(";handle (") && l.contains(";work (")),
        "{version}: {folded:?}"
    );
    check_chrome_nests(&path);
    let _ = std::fs::remove_file(path);
}

#[test]
fn attach_sees_frames_already_running_3_9() {
    check_attach_with_open_frames("3.9");
}

#[test]
fn attach_sees_frames_already_running_3_15() {
    check_attach_with_open_frames("3.15");
}
