//! `pyprobe report --lines FILE` on recordings of a real CPython running a
//! fixture whose hot line is marked, and which counts how often it ran it.

use std::path::Path;

use crate::support::{json_of, pyprobe, python, repo, run_pyprobe};

/// The line of `fixtures/python/hot_line.py` marked `# hot`.
fn hot_line(script: &Path) -> u32 {
    let text = std::fs::read_to_string(script).unwrap();
    text.lines().position(|l| l.ends_with("# hot")).unwrap() as u32 + 1
}

/// `report RECORDING --lines FILE`: per line, (own, total, hits).
fn lines_of(recording: &Path, file: &Path) -> Vec<(u32, u64, u64, u64)> {
    let out = run_pyprobe(&[
        "report",
        recording.to_str().unwrap(),
        "--lines",
        file.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let number = |cols: &[char], from: usize, to: usize| -> u64 {
        let s: String = cols[from.min(cols.len())..to.min(cols.len())]
            .iter()
            .collect();
        let s = s.trim();
        if s.is_empty() {
            0
        } else {
            s.parse().unwrap_or_else(|e| panic!("{s:?}: {e}\n{text}"))
        }
    };
    text.lines()
        .skip(2)
        .map(|l| {
            // Fixed columns: line, own, total, time, hits, then the source.
            let cols: Vec<char> = l.chars().collect();
            let line = number(&cols, 0, 6) as u32;
            (
                line,
                number(&cols, 6, 14),
                number(&cols, 14, 22),
                number(&cols, 32, 42),
            )
        })
        .collect()
}

fn record(version: &'static str, extra: &[&str], out: &Path, n: &str) -> Option<u64> {
    let py = python(version)?;
    let output = pyprobe()
        .arg("record")
        .args(extra)
        .arg("-o")
        .arg(out)
        .arg("--")
        .arg(&py.launcher)
        .arg(repo().join("fixtures/python/hot_line.py"))
        .arg(n)
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "record failed");
    Some(
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .unwrap(),
    )
}

/// Sampled: the marked line has the most samples of the file, and the file's
/// samples line by line add up to the report's samples of its functions.
#[test]
fn the_hot_line_has_the_samples() {
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("hot.pyprobe");
    if record("3.11", &["--mode", "sample"], &recording, "1000000").is_none() {
        return;
    }
    let script = repo().join("fixtures/python/hot_line.py");
    let rows = lines_of(&recording, &script);
    let hot = hot_line(&script);
    let busiest = rows.iter().max_by_key(|r| r.1).unwrap();
    assert_eq!(busiest.0, hot, "{rows:?}");
    let own: u64 = rows.iter().map(|r| r.1).sum();
    assert!(
        busiest.1 * 10 >= own * 9,
        "the hot line has 90 % of the samples: {rows:?}"
    );
    let report = json_of(&run_pyprobe(&[
        "report",
        recording.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let in_file: u64 = report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["file"].as_str() == script.to_str())
        .map(|f| f["samples"].as_u64().unwrap())
        .sum();
    assert!(own > 50, "too few samples: {own}");
    assert_eq!(own, in_file);
    // The module's call of work() is under every sample of the hot line.
    let call = rows.iter().find(|r| r.0 > hot && r.2 >= busiest.1);
    assert!(call.is_some(), "{rows:?}");
}

/// Traced with the line probe: the marked line was hit as often as the program
/// says it ran it.
#[test]
fn line_hits_are_the_times_the_program_ran_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("hits.pyprobe");
    let extra = ["--mode", "trace", "--probes", "function,line"];
    let Some(n) = record("3.9", &extra, &recording, "20000") else {
        return;
    };
    let script = repo().join("fixtures/python/hot_line.py");
    let rows = lines_of(&recording, &script);
    let hot = rows.iter().find(|r| r.0 == hot_line(&script)).unwrap();
    assert_eq!(hot.3, n, "{rows:?}");
    // Named by the end of its path, which is no file from here: the lines with
    // counts, without their text.
    let counted: Vec<_> = rows
        .iter()
        .copied()
        .filter(|r| r.1 + r.2 + r.3 > 0)
        .collect();
    assert_eq!(
        lines_of(&recording, Path::new("python/hot_line.py")),
        counted
    );
}
