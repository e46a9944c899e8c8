//! `flame --format pstats` read back by `pstats.Stats` of each test interpreter: its
//! call counts are the fixture's own, the report's, and cProfile's for the same
//! program; callers as cProfile has them; a sampled recording's times without calls.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::support::*;
use serde_json::Value;

/// `pstats.Stats(FILE)` loaded by `python`: per function name (of `script`'s file
/// only), its calls, primitive calls, Python callers' names and whether a C function
/// called it too; and the total own time.
fn load_pstats(python: &Path, file: &Path, script: &str) -> (BTreeMap<String, Value>, f64) {
    let code = r#"
import json, pstats, sys
s = pstats.Stats(sys.argv[1])
rows = {}
for (file, line, name), (cc, nc, tt, ct, callers) in s.stats.items():
    if file.endswith(sys.argv[2]):
        row = rows.setdefault(name, {"calls": 0, "primitive": 0, "callers": [], "via_c": False})
        row["calls"] += nc
        row["primitive"] += cc
        row["callers"] = sorted(set(row["callers"]) | {c[2] for c in callers if c[0] != "~"})
        # Called by a C function (sum(), list()): cProfile names it, pyprobe traces
        # Python calls only, so the Python caller below it stands in.
        row["via_c"] = row["via_c"] or any(c[0] == "~" for c in callers)
print(json.dumps({"rows": rows, "total": s.total_tt}))
"#;
    let out = Command::new(python)
        .args(["-c", code])
        .arg(file)
        .arg(script)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{} could not load {}: {}",
        python.display(),
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["rows"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    (rows, v["total"].as_f64().unwrap())
}

fn flame_pstats(recording: &Path) -> (std::path::PathBuf, String) {
    let out = recording.with_extension("prof");
    let run = run_pyprobe(&[
        "flame",
        recording.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "flame -o X.prof failed");
    (out, String::from_utf8_lossy(&run.stderr).into_owned())
}

/// Traced count_calls.py on every Debian interpreter: each function's calls in the
/// pstats file are what the program counted, what the report says, and what
/// cProfile says of the same program (main thread: cProfile profiles no other).
#[test]
fn pstats_calls_are_the_programs_the_reports_and_cprofiles() {
    let dir = tempfile::tempdir().unwrap();
    for version in VERSIONS {
        let Some(py) = python(version) else { continue };
        let recording = dir.path().join(format!("calls-{version}.pyprobe"));
        let stdout = record_script_into(
            &py,
            &["--mode", "trace"],
            &recording,
            "count_calls.py",
            &["3"],
        );
        let own: BTreeMap<String, u64> = serde_json::from_str(stdout.trim()).unwrap();
        let (prof, _) = flame_pstats(&recording);
        let (rows, total) = load_pstats(&py.launcher, &prof, "count_calls.py");
        assert!(total > 0.0, "python {version}: total time {total}");
        let report = json_of(&run_pyprobe(&[
            "report",
            recording.to_str().unwrap(),
            "--format",
            "json",
            "--limit",
            "0",
        ]));
        for (name, count) in &own {
            let row = rows
                .get(name)
                .unwrap_or_else(|| panic!("python {version}: no {name} in the pstats file"));
            assert_eq!(
                row["calls"].as_u64(),
                Some(*count),
                "python {version}: {name}"
            );
            let reported: u64 = report["functions"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|f| {
                    f["file"]
                        .as_str()
                        .is_some_and(|p| p.ends_with("count_calls.py"))
                        && f["function"].as_str() == Some(name)
                })
                .map(entries)
                .sum();
            assert_eq!(reported, *count, "python {version}: the report's {name}");
        }
        // Recursion: fib's first calls are primitive, and fib calls itself.
        assert_eq!(
            rows["fib"]["primitive"].as_u64(),
            Some(3),
            "python {version}"
        );
        assert_eq!(rows["fib"]["callers"], serde_json::json!(["fib", "main"]));

        // cProfile of the same program, with the same interpreter.
        let cprofile = dir.path().join(format!("cprofile-{version}.prof"));
        let script = repo().join("fixtures/python/count_calls.py");
        let ran = Command::new(&py.launcher)
            .args(["-m", "cProfile", "-o"])
            .arg(&cprofile)
            .arg(&script)
            .arg("3")
            .output()
            .unwrap();
        assert!(
            ran.status.success(),
            "{}",
            String::from_utf8_lossy(&ran.stderr)
        );
        let (theirs, _) = load_pstats(&py.launcher, &cprofile, "count_calls.py");
        for (name, row) in &theirs {
            if ["worker", "leaf"].contains(&name.as_str()) {
                continue; // other threads: cProfile does not see them
            }
            let ours = &rows[name];
            assert_eq!(ours["calls"], row["calls"], "python {version}: {name}");
            assert_eq!(
                ours["primitive"], row["primitive"],
                "python {version}: {name}"
            );
            if row["via_c"] == Value::Bool(false) {
                assert_eq!(ours["callers"], row["callers"], "python {version}: {name}");
            }
        }
    }
}

/// A sampled recording gives times and no calls, and says so.
#[test]
fn a_sampled_pstats_file_has_times_and_no_calls() {
    let Some(py) = python("3.13") else { return };
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("shares.pyprobe");
    record_script_into(&py, &["--mode", "sample"], &recording, "shares.py", &["1"]);
    let (prof, said) = flame_pstats(&recording);
    assert!(said.contains("times are estimates"), "{said}");
    let (rows, total) = load_pstats(&py.launcher, &prof, "shares.py");
    assert!(total > 0.5, "about a second sampled: {total}");
    assert!(rows.contains_key("spin"), "{rows:?}");
    assert!(
        rows.values().all(|r| r["calls"].as_u64() == Some(0)),
        "{rows:?}"
    );
}
