//! pprof profiles (`flame --format pprof`, `record --format pprof --every`) read
//! back by Go's own `go tool pprof`, their totals checked against the report of
//! the same recording and against what the fixture counts itself.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::{json_of, python, record_script_into, run_pyprobe};

fn tmp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("pyprobe-pprof-")
        .tempdir()
        .unwrap()
}

/// `go tool pprof ARGS`: its standard output. `-symbolize=none` keeps Python's
/// `<module>` names whole (pprof's local demangler strips `<...>`).
fn go_pprof(args: &[&str], file: &Path) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof", "-symbolize=none"])
        .args(args)
        .arg(file)
        .output()
        .expect("cannot run `go tool pprof`: install Go (Debian's golang-go; scripts/setup-test-machine.sh does)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "go tool pprof {args:?} {} failed: {}\n{stdout}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The total `-top` says for `sample_index`: `... of 1234 total` (`1234ns` for
/// nanoseconds, shown in ns).
fn pprof_total(file: &Path, sample_index: &str) -> u64 {
    let index = format!("-sample_index={sample_index}");
    let top = go_pprof(&["-top", &index, "-unit=ns"], file);
    let line = top
        .lines()
        .find(|l| l.starts_with("Showing nodes accounting for"))
        .unwrap_or_else(|| panic!("no totals in go tool pprof -top:\n{top}"));
    let total = line
        .rsplit(" of ")
        .next()
        .and_then(|t| t.strip_suffix(" total"))
        .unwrap_or_else(|| panic!("cannot read the total of {line:?}"));
    total
        .trim_end_matches("ns")
        .parse()
        .unwrap_or_else(|e| panic!("cannot read the total of {line:?}: {e}"))
}

/// The rows of `go tool pprof -top` for `sample_index` (and `more` options):
/// (flat, function), by flat value, largest first.
pub(crate) fn pprof_top(file: &Path, sample_index: &str, more: &[&str]) -> Vec<(u64, String)> {
    let index = format!("-sample_index={sample_index}");
    let mut args = vec!["-top", "-nodecount=1000", &index, "-unit=ns"];
    args.extend_from_slice(more);
    let top = go_pprof(&args, file);
    top.lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .skip(1)
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let flat = cols[0].trim_end_matches("ns").parse().unwrap();
            (flat, cols[5..].join(" "))
        })
        .collect()
}

/// `pyprobe record ... -o OUT -- python SCRIPT ARGS`: the script's stdout.
fn record(
    version: &'static str,
    extra: &[&str],
    out: &Path,
    script: &str,
    args: &[&str],
) -> Option<String> {
    let py = python(version)?;
    Some(record_script_into(&py, extra, out, script, args))
}

fn report_of(recording: &Path) -> serde_json::Value {
    json_of(&run_pyprobe(&[
        "report",
        recording.to_str().unwrap(),
        "--format",
        "json",
    ]))
}

fn flame_pprof(recording: &Path) -> PathBuf {
    let out = recording.with_extension("pb.gz");
    let status = run_pyprobe(&[
        "flame",
        recording.to_str().unwrap(),
        "--format",
        "pprof",
        "-o",
        out.to_str().unwrap(),
    ])
    .status;
    assert!(status.success(), "flame --format pprof failed");
    out
}

fn sum(report: &serde_json::Value, field: &str) -> u64 {
    report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f[field].as_u64().unwrap_or(0))
        .sum()
}

/// A sampled recording: pprof's samples are the report's counted samples, its
/// CPU time their exclusive time, and spin(), where shares.py burns its time,
/// is on top.
#[test]
fn a_sampled_profile_totals_what_the_report_says() {
    let dir = tmp_dir();
    let recording = dir.path().join("shares.pyprobe");
    if record(
        "3.11",
        &["--mode", "sample"],
        &recording,
        "shares.py",
        &["2"],
    )
    .is_none()
    {
        return;
    }
    let report = report_of(&recording);
    let pprof = flame_pprof(&recording);

    let kept = report["sample_filter"]["kept"].as_u64().unwrap();
    assert!(kept > 50, "too few samples to say anything: {kept}");
    assert_eq!(pprof_total(&pprof, "samples"), kept);
    assert_eq!(sum(&report, "samples"), kept);
    assert_eq!(pprof_total(&pprof, "cpu"), sum(&report, "exclusive_ns"));
    let top = pprof_top(&pprof, "cpu", &[]);
    assert_eq!(top[0].1, "spin", "{top:?}");

    // Every sample names its thread and process.
    let pid = report["target"]["pid"].as_u64().unwrap();
    let tags = go_pprof(&["-tags"], &pprof);
    let labels: Vec<&str> = tags
        .lines()
        .filter_map(|l| l.split_once("): ").map(|(_, v)| v.trim()))
        .collect();
    assert_eq!(
        labels,
        [pid.to_string(), format!("main thread ({pid})")],
        "{tags}"
    );
}

/// A traced recording (function probes only, so no GC pause moves time between
/// frames): pprof's calls are the report's, and fib()'s the count the fixture
/// kept itself; its wall time is the report's exclusive time.
#[test]
fn a_traced_profile_counts_the_calls_the_program_made() {
    let dir = tmp_dir();
    let recording = dir.path().join("counts.pyprobe");
    let extra = ["--mode", "trace", "--probes", "function"];
    let Some(stdout) = record("3.9", &extra, &recording, "count_calls.py", &["3"]) else {
        return;
    };
    let truth: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let report = report_of(&recording);
    let pprof = flame_pprof(&recording);

    // pprof counts every entry, as cProfile does: calls and resumes.
    assert_eq!(
        pprof_total(&pprof, "calls"),
        sum(&report, "calls") + sum(&report, "resumes")
    );
    assert_eq!(pprof_total(&pprof, "wall"), sum(&report, "exclusive_ns"));
    let top = pprof_top(&pprof, "calls", &[]);
    assert_eq!(
        top[0],
        (truth["fib"].as_u64().unwrap(), "fib".to_owned()),
        "{top:?}"
    );
    let leaf = top.iter().find(|(_, f)| f == "leaf").unwrap();
    assert_eq!(leaf.0, truth["leaf"].as_u64().unwrap());
    // worker() and its leaf() calls ran on two threads of their own.
    let workers = pprof_top(&pprof, "calls", &["-tagignore=thread=main thread"]);
    let calls = |name: &str| workers.iter().find(|(_, f)| f == name).map(|r| r.0);
    assert_eq!(calls("worker"), truth["worker"].as_u64(), "{workers:?}");
    assert_eq!(calls("leaf"), truth["leaf"].as_u64(), "{workers:?}");
    assert_eq!(calls("fib"), None, "{workers:?}");
    let tags = go_pprof(&["-tags"], &pprof);
    let threads = tags.lines().filter(|l| l.contains("): thread ")).count();
    assert_eq!(threads, 2, "{tags}");
}

/// `record --format pprof --every 1 -o DIR` on a program running about 3.5 s:
/// one whole profile per period (named with the pid and the period's UTC start,
/// mode 0600, no temporary file left), each read by go tool pprof, their samples
/// adding up to the whole recording's, which is kept beside them.
#[test]
fn rotated_profiles_add_up_to_the_whole_recording() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tmp_dir();
    let dir = tmp.path().join("profiles");
    let extra = ["--mode", "sample", "--format", "pprof", "--every", "1"];
    if record("3.11", &extra, &dir, "shares.py", &["3.5"]).is_none() {
        return;
    }
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let recording = names
        .iter()
        .find(|n| n.ends_with(".pyprobe"))
        .unwrap_or_else(|| panic!("no recording kept in {names:?}"));
    let pid = recording
        .strip_prefix("pyprobe-")
        .and_then(|n| n.strip_suffix(".pyprobe"))
        .unwrap();
    let profiles: Vec<&String> = names.iter().filter(|n| n.ends_with(".pb.gz")).collect();
    assert_eq!(
        profiles.len() + 1,
        names.len(),
        "only profiles and the recording: {names:?}"
    );
    // 3.5 s of the program and its start: 4 periods, more on a slow start.
    assert!((4..=6).contains(&profiles.len()), "{names:?}");

    let report = report_of(&dir.join(recording));
    let mut samples = 0;
    let mut previous_stamp = String::new();
    for (i, name) in profiles.iter().enumerate() {
        // pyprobe-PID-YYYYMMDDTHHMMSSZ.pb.gz (.N.pb.gz for a second period
        // starting within the same second, which a late tick can make).
        let stamp = name
            .strip_prefix(&format!("pyprobe-{pid}-"))
            .and_then(|n| n.strip_suffix(".pb.gz"))
            .map(|n| n.split('.').next().unwrap())
            .unwrap_or_else(|| panic!("{name} is not named for pid {pid}"));
        assert!(
            stamp.len() == 16 && stamp.as_bytes()[8] == b'T' && stamp.ends_with('Z'),
            "{name}"
        );
        assert!(stamp >= previous_stamp.as_str(), "{profiles:?}");
        previous_stamp = stamp.to_owned();
        let path = dir.join(name);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{name}");
        let n = pprof_total(&path, "samples");
        // The program burns CPU throughout; the last period may be a moment.
        assert!(n > 0 || i + 1 == profiles.len(), "{name} holds no samples");
        samples += n;
    }
    assert_eq!(samples, report["sample_filter"]["kept"].as_u64().unwrap());
}

/// Traced, the periods' calls add up to the whole recording's: each period's
/// replay counts a call where it returns, the calls under way when a period
/// begins included.
#[test]
fn rotated_traced_profiles_add_up_to_the_whole_recording() {
    let tmp = tmp_dir();
    let dir = tmp.path().join("profiles");
    let extra = ["--mode", "trace", "--format", "pprof", "--every", "1"];
    if record("3.9", &extra, &dir, "hot_loop.py", &["2.5"]).is_none() {
        return;
    }
    let mut profiles = Vec::new();
    let mut recording = None;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        match path.to_string_lossy() {
            p if p.ends_with(".pb.gz") => profiles.push(path),
            p if p.ends_with(".pyprobe") => recording = Some(path),
            _ => panic!("{} in {}", path.display(), dir.display()),
        }
    }
    assert!(profiles.len() >= 3, "{profiles:?}");
    let report = report_of(&recording.expect("the recording is kept"));
    let f_calls = |top: &[(u64, String)]| top.iter().find(|(_, f)| f == "f").map_or(0, |r| r.0);
    let (mut calls, mut f) = (0, 0);
    for p in &profiles {
        calls += pprof_total(p, "calls");
        f += f_calls(&pprof_top(p, "calls", &[]));
    }
    assert_eq!(calls, sum(&report, "calls") + sum(&report, "resumes"));
    let f_report = report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["function"] == "f")
        .and_then(|r| r["calls"].as_u64())
        .unwrap();
    assert!(f_report > 100_000, "{f_report}");
    assert_eq!(f, f_report);
}
