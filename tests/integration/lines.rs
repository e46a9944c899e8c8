//! `pyprobe report --lines FILE` on recordings of a real CPython running a
//! fixture whose hot line is marked, and which counts how often it ran it.

use std::path::Path;

use crate::support::{json_of, python, record_script_into, repo, run_pyprobe};

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

/// Records `hot_line.py N`; returns N as the program printed it.
fn record(version: &'static str, extra: &[&str], out: &Path, n: &str) -> Option<u64> {
    let py = python(version)?;
    let stdout = record_script_into(&py, extra, out, "hot_line.py", &[n]);
    Some(stdout.trim().parse().unwrap())
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
    flame_lines_put_the_samples_on_the_hot_line(&recording, hot, busiest.1);
}

/// Collapsed stacks of `recording` (`flame` with `extra`): (frames, samples).
fn collapsed(recording: &Path, extra: &[&str]) -> Vec<(Vec<String>, u64)> {
    let mut args = vec!["flame", recording.to_str().unwrap(), "-o", "-"];
    args.extend_from_slice(&["--format", "collapsed"]);
    args.extend_from_slice(extra);
    let out = run_pyprobe(&args);
    assert!(out.status.success(), "flame {extra:?} failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (stack, n) = l.rsplit_once(' ').unwrap();
            (
                stack.split(';').map(str::to_owned).collect(),
                n.parse().unwrap(),
            )
        })
        .collect()
}

/// `flame --lines`: the frame of work() at the marked line holds the samples the
/// report's line view gives that line, under the module's frame at its call of
/// work(); the totals are those of the flame graph by function; pprof's
/// locations carry the line, as `go tool pprof -lines` shows.
fn flame_lines_put_the_samples_on_the_hot_line(recording: &Path, hot: u32, hot_samples: u64) {
    let by_function = collapsed(recording, &[]);
    let by_line = collapsed(recording, &["--lines"]);
    let total = |stacks: &[(Vec<String>, u64)]| stacks.iter().map(|s| s.1).sum::<u64>();
    assert_eq!(total(&by_line), total(&by_function));
    let hot_frame = format!(" line {hot}");
    let on_hot: u64 = by_line
        .iter()
        .filter(|(stack, _)| {
            let top = stack.last().unwrap();
            top.starts_with("work (") && top.ends_with(&hot_frame)
        })
        .map(|s| s.1)
        .sum();
    assert_eq!(on_hot, hot_samples, "{by_line:?}");
    // Every stack of work() runs under one line of the module: its call.
    let callers: std::collections::BTreeSet<&String> = by_line
        .iter()
        .filter(|(stack, _)| stack.last().unwrap().starts_with("work ("))
        .map(|(stack, _)| &stack[stack.len() - 2])
        .collect();
    assert_eq!(callers.len(), 1, "{callers:?}");
    assert!(
        callers.iter().all(|c| c.starts_with("<module> (")),
        "{callers:?}"
    );

    let pprof = recording.with_extension("lines.pb.gz");
    let out = run_pyprobe(&[
        "flame",
        recording.to_str().unwrap(),
        "--lines",
        "-o",
        pprof.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "flame --lines -o .pb.gz failed");
    let rows = crate::pprof::pprof_top(&pprof, "samples", &["-lines"]);
    let want = format!("hot_line.py:{hot}");
    let (flat, name) = &rows[0];
    assert!(
        name.starts_with("work ") && name.ends_with(&want),
        "{rows:?}"
    );
    assert_eq!(*flat, hot_samples, "{rows:?}");
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
