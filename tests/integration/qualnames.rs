//! Qualified names (`Class.method`) against the program's own: `co_qualname` on
//! 3.11+, read from the source before 3.11.
//!
//! * `fixtures/python/qualnames.py` prints its functions' qualified names; every
//!   row of the report for one of them must carry it, in trace mode (probes,
//!   hook) and in the default mode (samples), on every test interpreter and on
//!   pyenv's 3.7, 3.8 and 3.10 (hook, names from source).
//! * The source scan against `co_qualname` of every code object of CPython's
//!   own standard library, compiled by 3.13.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use crate::hook::pyenv;
use crate::support::*;
use pyprobe_cpython::python::source_scopes::SourceScopes;
use serde_json::Value;

/// (file, name, first line) → qualified name.
type Truth = BTreeMap<(String, String, u64), String>;

fn truth_of(stdout: &str) -> Truth {
    let line = stdout
        .lines()
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON from the fixture: {stdout}"));
    let doc: Value = serde_json::from_str(line).unwrap();
    doc["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let s = |i: usize| f[i].as_str().unwrap().to_owned();
            ((s(0), s(1), f[2].as_u64().unwrap()), s(3))
        })
        .collect()
}

/// Checks every row of `report` that is one of `truth`'s functions; returns
/// the qualified names checked.
fn check(label: &str, report: &Value, truth: &Truth) -> BTreeSet<String> {
    let mut checked = BTreeSet::new();
    let rows = report["functions"].as_array().unwrap();
    for row in rows {
        let key = (
            row["file"].as_str().unwrap().to_owned(),
            row["function"].as_str().unwrap().to_owned(),
            row["line"].as_u64().unwrap(),
        );
        if let Some(want) = truth.get(&key) {
            assert_eq!(
                row["qualname"].as_str(),
                Some(want.as_str()),
                "{label}: {key:?}"
            );
            checked.insert(want.clone());
        }
    }
    checked
}

/// The methods and nested functions every trace must name.
const TRACED: [&str; 8] = [
    "Circle.area",
    "Circle.Inner.area",
    "Square.area",
    "Circle.Inner.decorated",
    "Square.parts",
    "Circle.make",
    "outer.<locals>.helper",
    "outer.<locals>.nested.<locals>.deepest",
];

fn python_at(version: &'static str, launcher: PathBuf) -> Python {
    Python {
        version,
        binary: launcher.clone(),
        launcher,
    }
}

/// Every interpreter to check, by label.
fn interpreters() -> Vec<Python> {
    let mut all: Vec<Python> = VERSIONS.iter().filter_map(|v| python(v)).collect();
    for (minor, version) in [(7, "3.7"), (8, "3.8"), (10, "3.10")] {
        if let Some(p) = pyenv(minor) {
            all.push(python_at(version, p));
        }
    }
    all
}

#[test]
fn traced_functions_carry_the_programs_own_qualified_names() {
    for py in interpreters() {
        let (stdout, report) = record_script(&py, &["--mode", "trace"], "qualnames.py", &["0.5"]);
        let truth = truth_of(&stdout);
        let checked = check(&format!("trace, {}", py.version), &report, &truth);
        for name in TRACED {
            assert!(
                checked.contains(name),
                "{}: no row named {name} (checked {checked:?})",
                py.version
            );
        }
    }
}

#[test]
fn sampled_functions_carry_the_programs_own_qualified_names() {
    for version in ["3.9", "3.13", "3.15"] {
        let Some(py) = python(version) else { continue };
        let (stdout, report) = record_script(&py, &["-r", "200"], "qualnames.py", &["1.5"]);
        let truth = truth_of(&stdout);
        let checked = check(&format!("default mode, {version}"), &report, &truth);
        let methods = checked.iter().filter(|q| q.contains('.')).count();
        assert!(
            methods >= 3,
            "{version}: only {methods} qualified names sampled: {checked:?}"
        );
    }
}

#[test]
fn source_scan_agrees_with_co_qualname_across_the_standard_library() {
    let Some(py) = python("3.13") else { return };
    let lib = repo().join(".pythons/3.13/usr/lib/python3.13");
    let out = Command::new(&py.launcher)
        .arg(repo().join("fixtures/python/code_qualnames.py"))
        .arg(&lib)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (mut agree, mut wrong, mut missed) = (0usize, Vec::new(), 0usize);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let doc: Value = serde_json::from_str(line).unwrap();
        let file = doc["file"].as_str().unwrap();
        let text = String::from_utf8_lossy(&std::fs::read(file).unwrap()).into_owned();
        let scopes = SourceScopes::parse(&text);
        for c in doc["codes"].as_array().unwrap() {
            let (name, line, want) = (
                c[0].as_str().unwrap(),
                c[1].as_u64().unwrap() as u32,
                c[2].as_str().unwrap(),
            );
            let got = scopes.qualname(name, line).map(|(q, _)| q);
            match got.as_deref() {
                Some(q) if q == want => agree += 1,
                None if want == name => agree += 1,
                // Nothing said: views show the bare name, which is not wrong.
                None => missed += 1,
                Some(q) => wrong.push(format!("{file}:{line} {name}: {q}, not {want}")),
            }
        }
    }
    eprintln!(
        "source scan: {agree} agree, {missed} left bare, {} wrong",
        wrong.len()
    );
    assert!(agree > 15_000, "only {agree} code objects compared");
    assert!(wrong.is_empty(), "wrong names:\n{}", wrong.join("\n"));
    // A lambda or comprehension on a line holding another is left bare.
    assert!(
        missed * 100 <= agree,
        "{missed} of {agree} left without their qualified name"
    );
}
