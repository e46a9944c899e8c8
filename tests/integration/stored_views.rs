//! The views kept beside a recording (`run.pyprobe.views`): every view read from
//! them (or replayed with the plan they keep) is the view read from the events,
//! byte for byte; they are read, not
//! rebuilt, while the recording is unchanged; and a recording replaced, or views
//! damaged, are noticed and read from the events again.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::support::*;

/// Every view of a recording that stored views serve, as (name, arguments);
/// `OUT` is replaced by an output path.
const VIEWS: &[(&str, &[&str])] = &[
    ("report.txt", &["report", "REC"]),
    ("report.json", &["report", "REC", "--format", "json"]),
    (
        "report-calls.txt",
        &["report", "REC", "--sort", "calls", "--limit", "5"],
    ),
    ("stacks.txt", &["flame", "REC", "-o", "OUT", "--force"]),
    ("flame.svg", &["flame", "REC", "-o", "OUT", "--force"]),
    ("page.html", &["flame", "REC", "-o", "OUT", "--force"]),
    ("run.prof", &["flame", "REC", "-o", "OUT", "--force"]),
    ("run.pb.gz", &["flame", "REC", "-o", "OUT", "--force"]),
    ("top.txt", &["top", "--from", "REC", "--once"]),
    ("calls.txt", &["calls", "REC"]),
    (
        "calls-fib.json",
        &["calls", "REC", "--start-at", "fib", "--format", "json"],
    ),
];

/// Runs `args` with views kept from `store_from` bytes on (`None`: never).
fn pyprobe_storing(store_from: Option<u64>, args: &[String]) -> Output {
    let limit = store_from.map_or_else(|| u64::MAX.to_string(), |b| b.to_string());
    let out = pyprobe()
        .env("PYPROBE_STORE_VIEWS_BYTES", limit)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pyprobe {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every view of `recording`, its bytes and what was said on stderr.
fn views(recording: &Path, store_from: Option<u64>, dir: &Path) -> Vec<(Vec<u8>, String)> {
    VIEWS
        .iter()
        .map(|(name, args)| {
            let out_path = dir.join(name);
            let args: Vec<String> = args
                .iter()
                .map(|a| match *a {
                    "REC" => recording.display().to_string(),
                    "OUT" => out_path.display().to_string(),
                    a => a.to_string(),
                })
                .collect();
            let out = pyprobe_storing(store_from, &args);
            let bytes = if args.contains(&"-o".to_string()) {
                std::fs::read(&out_path).unwrap()
            } else {
                out.stdout
            };
            // The page's run date is the recording's: it is the same in both.
            (bytes, String::from_utf8_lossy(&out.stderr).into_owned())
        })
        .collect()
}

fn assert_same_views(recording: &Path, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let kept = dir_of(recording).join(format!(
        "{}.views",
        recording.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&kept);
    let direct = views(recording, None, dir.path());
    assert!(!kept.exists(), "views kept for a recording below the size");

    let building = views(recording, Some(0), dir.path());
    assert!(kept.exists(), "{what}: no views kept at {}", kept.display());
    assert!(
        building[0].1.contains("once for every view"),
        "{what}: the first view does not say it keeps the views: {}",
        building[0].1
    );
    let reading = views(recording, Some(0), dir.path());
    for (i, (name, _)) in VIEWS.iter().enumerate() {
        assert!(
            direct[i].0 == building[i].0 && direct[i].0 == reading[i].0,
            "{what}: {name} read from the kept views differs from {name} read from the events"
        );
        assert!(
            !reading[i].1.contains("reading"),
            "{what}: {name} read the events again: {}",
            reading[i].1
        );
    }
    assert!(!direct[0].0.is_empty());
}

fn dir_of(path: &Path) -> &Path {
    path.parent().unwrap()
}

#[test]
fn kept_views_are_the_views_of_the_events_traced_and_sampled() {
    let dir = tempfile::tempdir().unwrap();
    for (version, mode) in [("3.13", "trace"), ("3.9", "trace"), ("3.14", "sample")] {
        let Some(py) = python(version) else { continue };
        let recording = dir.path().join(format!("demo-{version}-{mode}.pyprobe"));
        record_script_into(
            &py,
            &["--mode", mode],
            &recording,
            "../demo.py",
            &["--seconds", "0.5"],
        );
        assert_same_views(&recording, &format!("{mode} on {version}"));
    }
}

#[test]
fn kept_views_of_a_replaced_recording_or_damaged_are_not_used() {
    let Some(py) = python("3.13") else { return };
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("run.pyprobe");
    let kept = dir.path().join("run.pyprobe.views");
    let report = |store: Option<u64>| {
        let args = [
            "report".to_string(),
            recording.display().to_string(),
            "--format".into(),
            "json".into(),
        ];
        let out = pyprobe_storing(store, &args);
        (
            out.stdout,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    record_script_into(
        &py,
        &["--mode", "trace"],
        &recording,
        "../demo.py",
        &["--seconds", "0.5"],
    );
    report(Some(0));
    assert!(kept.exists());

    // Another run recorded over it.
    std::fs::remove_file(&recording).unwrap();
    record_script_into(
        &py,
        &["--mode", "trace"],
        &recording,
        "../demo.py",
        &["--seconds", "0.7"],
    );
    let (stored, said) = report(Some(0));
    assert!(
        said.contains("another state"),
        "a replaced recording not noticed: {said}"
    );
    assert_eq!(
        stored,
        report(None).0,
        "the views of the old recording were used"
    );
    let (again, said) = report(Some(0));
    assert_eq!(again, stored);
    assert!(!said.contains("reading"), "rebuilt views not kept: {said}");

    // Damaged views: said, and the events read.
    let mut bytes = std::fs::read(&kept).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&kept, &bytes).unwrap();
    let (damaged, said) = report(Some(0));
    assert!(
        said.contains("unreadable") && said.contains("checksum"),
        "{said}"
    );
    assert_eq!(damaged, stored);

    // Views that cannot be kept (the directory read-only) are said, not fatal.
    std::fs::remove_file(&kept).unwrap();
    let ro = tempfile::tempdir().unwrap();
    let moved = ro.path().join("run.pyprobe");
    std::fs::copy(&recording, &moved).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(ro.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    let out = pyprobe_storing(
        Some(0),
        &[
            "report".into(),
            moved.display().to_string(),
            "--format".into(),
            "json".into(),
        ],
    );
    std::fs::set_permissions(ro.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    // Root writes anywhere: only a user the mode binds sees the refusal.
    if !ro.path().join("run.pyprobe.views").exists() {
        assert!(said.contains("cannot keep the views"), "{said}");
    }
    assert_eq!(out.stdout, stored);
}

/// `pyprobe record -v --mode trace -o svg` of the fixture `script` (a path in
/// the repository, then its arguments) under `python`, with views kept from
/// `store_from` bytes (`None`: never); what it said, once it succeeded.
fn record_svg(python: &Path, svg: &Path, store_from: Option<u64>, script: &[&str]) -> String {
    let out = pyprobe()
        .env(
            "PYPROBE_STORE_VIEWS_BYTES",
            store_from.unwrap_or(u64::MAX).to_string(),
        )
        .args(["record", "-v", "--mode", "trace", "-o"])
        .arg(svg)
        .arg("--")
        .arg(python)
        .arg(repo().join(script[0]))
        .args(&script[1..])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{said}");
    said
}

/// The flame graph `pyprobe flame` draws later from `recording` (views kept from
/// `store_from` bytes), beside it as `later.svg`.
fn flame_later(recording: &Path, store_from: Option<u64>) -> PathBuf {
    let later = recording.with_file_name("later.svg");
    let args = [
        "flame".to_string(),
        recording.display().to_string(),
        "-o".into(),
        later.display().to_string(),
        "--force".into(),
    ];
    pyprobe_storing(store_from, &args);
    later
}

/// `record -o run.svg` plans its recording while it is written: the flame graph
/// it writes when the target exits takes that first pass instead of reading the
/// events twice, and is the flame graph `flame` draws from the recording later,
/// byte for byte: for a recording whose views are kept, and one below the size.
#[test]
fn the_view_written_at_the_end_takes_the_first_pass_made_while_recording() {
    let dir = tempfile::tempdir().unwrap();
    for (version, store_from) in [("3.13", "0"), ("3.9", "0"), ("3.13", "none")] {
        let Some(py) = python(version) else { continue };
        let svg = dir.path().join(format!("run-{version}-{store_from}.svg"));
        let said = record_svg(
            &py.launcher,
            &svg,
            store_from.parse().ok(),
            &["fixtures/demo.py", "--seconds", "0.5"],
        );
        assert!(
            said.contains("was made while they were written") && said.contains("the view took it"),
            "{version}, views kept from {store_from} bytes: the first pass was not made while \
             recording, or not taken: {said}"
        );
        let recording = dir
            .path()
            .join(format!("run-{version}-{store_from}.pyprobe"));
        let _ = std::fs::remove_file(
            dir.path()
                .join(format!("run-{version}-{store_from}.pyprobe.views")),
        );
        let later = flame_later(&recording, None);
        assert!(
            std::fs::read(&svg).unwrap() == std::fs::read(&later).unwrap(),
            "{version}: the flame graph written at the end is not the one its events give"
        );
    }
}

/// A traced recording long enough (millions of events) for `record` to replay
/// it while it is written: the views kept beside it when the target exits are
/// the ones built on the way, and they are byte for byte the views a reading of
/// the finished file builds, as is the flame graph drawn from them. The replay
/// runs only on a CPU nothing else wants: the target sleeps after its burst of
/// calls, and the test runs alone (`scripts/test.sh`).
#[test]
fn the_views_kept_at_the_end_were_replayed_while_recording() {
    let dir = tempfile::tempdir().unwrap();
    // Views kept from 0 bytes, and never: a recording below the size gets no
    // views file, but the views built while recording still draw its graph.
    for (version, store_from) in [("3.13", Some(0)), ("3.9", Some(0)), ("3.13", None)] {
        let Some(py) = python(version) else { continue };
        let name = format!("hot-{version}-{}", store_from.is_some());
        let svg = dir.path().join(format!("{name}.svg"));
        let said = record_svg(
            &py.launcher,
            &svg,
            store_from,
            &["fixtures/python/burst_then_idle.py", "1.0", "2.0"],
        );
        assert!(
            said.contains("its replay was made while they were written too")
                && said.contains("after the recording ended), and the view took it"),
            "{name}: the views were not replayed while recording, or not taken: {said}"
        );
        let recording = dir.path().join(format!("{name}.pyprobe"));
        let kept = dir.path().join(format!("{name}.pyprobe.views"));
        if store_from.is_some() {
            let built_ahead = std::fs::read(&kept).expect("the views kept");
            std::fs::remove_file(&kept).unwrap();
            flame_later(&recording, store_from);
            assert!(
                std::fs::read(&kept).unwrap() == built_ahead,
                "{name}: the views built while recording are not those of its events"
            );
        } else {
            assert!(
                !kept.exists(),
                "{name}: views kept beside a small recording"
            );
        }
        // Drawn from the events alone (no views kept).
        let later = flame_later(&recording, None);
        assert!(
            std::fs::read(&svg).unwrap() == std::fs::read(&later).unwrap(),
            "{name}: the flame graph written at the end is not the one its events give"
        );
    }
}
