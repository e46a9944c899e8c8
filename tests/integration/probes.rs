//! `pyprobe probes`: the SDT listing of real interpreters, live processes, the
//! embedded-libpython program and the C fixtures, checked against `readelf` and
//! against the bytes in the running targets.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use crate::support::*;
use serde_json::Value;

const FUNCTION_PROBES: [&str; 3] = ["function__entry", "function__return", "line"];
const ALWAYS: [&str; 5] = [
    "gc__start",
    "gc__done",
    "import__find__load__start",
    "import__find__load__done",
    "audit",
];

/// Ground truth from binutils: (provider, name) → (site addresses, semaphore).
fn readelf_notes(path: &Path) -> BTreeMap<(String, String), (BTreeSet<u64>, u64)> {
    let out = Command::new("readelf")
        .arg("-n")
        .arg(path)
        .output()
        .expect("readelf (binutils) is needed");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut notes: BTreeMap<(String, String), (BTreeSet<u64>, u64)> = BTreeMap::new();
    let (mut provider, mut name) = (String::new(), String::new());
    for line in text.lines().map(str::trim) {
        if let Some(p) = line.strip_prefix("Provider: ") {
            provider = p.to_owned();
        } else if let Some(n) = line.strip_prefix("Name: ") {
            name = n.to_owned();
        } else if let Some(rest) = line.strip_prefix("Location: ") {
            let field = |key: &str| {
                let v = rest
                    .split(key)
                    .nth(1)
                    .unwrap()
                    .split(',')
                    .next()
                    .unwrap()
                    .trim();
                u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap()
            };
            let entry = notes.entry((provider.clone(), name.clone())).or_default();
            entry.0.insert(
                u64::from_str_radix(rest.split(',').next().unwrap().trim_start_matches("0x"), 16)
                    .unwrap(),
            );
            entry.1 = field("Semaphore: ");
        }
    }
    notes
}

fn listing_notes(object: &Value) -> BTreeMap<(String, String), (BTreeSet<u64>, u64)> {
    object["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let sites = p["sites"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["address"].as_u64().unwrap())
                .collect();
            let key = (
                p["provider"].as_str().unwrap().to_owned(),
                p["name"].as_str().unwrap().to_owned(),
            );
            (key, (sites, p["semaphore"].as_u64().unwrap_or(0)))
        })
        .collect()
}

fn assert_all_args_decode(object: &Value) {
    for probe in object["probes"].as_array().unwrap() {
        for site in probe["sites"].as_array().unwrap() {
            for arg in site["decoded"].as_array().unwrap() {
                assert_eq!(
                    arg["ok"], true,
                    "{}: {} does not decode: {}",
                    probe["name"], site["args"], arg["description"]
                );
            }
        }
    }
}

fn python_probe_names(object: &Value) -> BTreeSet<String> {
    object["probes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["provider"] == "python")
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The probes each Debian build of a CPython version is known to carry.
fn check_version_probes(version: &str, names: &BTreeSet<String>, object: &Value) {
    for name in ALWAYS {
        assert!(
            names.contains(name),
            "{version}: {name} missing from {names:?}"
        );
    }
    let has_function = matches!(version, "3.9" | "3.11" | "3.15");
    for name in ["function__entry", "function__return"] {
        assert_eq!(
            names.contains(name),
            has_function,
            "{version}: {name} presence"
        );
    }
    if matches!(version, "3.13" | "3.14") {
        for name in FUNCTION_PROBES {
            assert!(!names.contains(name), "{version} must not have {name}");
        }
    }
    if version == "3.9" {
        assert_eq!(names.len(), 8, "3.9 has the 8 classic probes: {names:?}");
    }
    // Newer compilers inline the audit probe: several sites share one semaphore.
    let audit = object["probes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "audit")
        .unwrap();
    let expected_audit_sites = match version {
        "3.14" => 5,
        "3.15" => 4,
        _ => 1,
    };
    assert_eq!(
        audit["sites"].as_array().unwrap().len(),
        expected_audit_sites,
        "{version}: audit sites"
    );
    // Every CPython probe is gated by a semaphore.
    for probe in object["probes"].as_array().unwrap() {
        assert!(
            probe["semaphore"].as_u64().is_some(),
            "{version}: {} has no semaphore",
            probe["name"]
        );
    }
}

#[test]
fn lists_the_probes_of_each_interpreter_file() {
    for version in VERSIONS {
        let Some(py) = python(version) else { continue };
        let listing = json_of(&run_pyprobe(&[
            "probes",
            py.binary.to_str().unwrap(),
            "--format",
            "json",
        ]));
        let object = &listing["objects"][0];
        assert_eq!(
            listing_notes(object),
            readelf_notes(&py.binary),
            "{version}: listing differs from readelf"
        );
        assert_all_args_decode(object);
        check_version_probes(version, &python_probe_names(object), object);
        assert!(
            object["build_id"].as_str().is_some_and(|id| id.len() == 40),
            "{version}: build id"
        );
    }
}

/// Checks a live listing against the target itself: every site holds the `nop` the
/// note promised, every semaphore reads 0 (nobody traces it), and runtime addresses
/// are the link-time ones shifted by one load bias.
fn check_live_object(
    pid: i32,
    live: &Value,
    file_notes: &BTreeMap<(String, String), (BTreeSet<u64>, u64)>,
) {
    let bias = live["load_bias"]
        .as_u64()
        .expect("a live object has a load bias");
    let live_notes = listing_notes(live);
    assert_eq!(live_notes.len(), file_notes.len());
    for (key, (sites, semaphore)) in &live_notes {
        let (file_sites, file_semaphore) = &file_notes[key];
        let shifted: BTreeSet<u64> = file_sites.iter().map(|a| a.wrapping_add(bias)).collect();
        assert_eq!(
            sites, &shifted,
            "{key:?}: runtime sites are link-time sites + bias"
        );
        for &site in sites {
            assert_eq!(
                read_target_memory(pid, site, 1),
                [0x90],
                "{key:?}: no nop at runtime site {site:#x}"
            );
        }
        if *file_semaphore != 0 {
            assert_eq!(*semaphore, file_semaphore.wrapping_add(bias));
            assert_eq!(
                read_target_memory(pid, *semaphore, 2),
                [0, 0],
                "{key:?}: semaphore"
            );
        }
    }
}

#[test]
fn lists_the_probes_of_each_live_interpreter() {
    for version in VERSIONS {
        let Some(py) = python(version) else { continue };
        let mut target = Target::spawn(&py.launcher, &["-c", WAITING_SCRIPT]);
        target.wait_for_line("ready");
        let pid = target.pid();
        let listing = json_of(&run_pyprobe(&[
            "probes",
            "-p",
            &pid.to_string(),
            "--format",
            "json",
        ]));
        assert_eq!(listing["pid"], pid);
        let objects = listing["objects"].as_array().unwrap();
        assert_eq!(
            objects.len(),
            1,
            "{version}: exactly the interpreter carries python probes"
        );
        let path = objects[0]["path"].as_str().unwrap();
        assert_eq!(
            Path::new(path),
            py.binary.canonicalize().unwrap(),
            "{version}: object path"
        );
        check_live_object(pid, &objects[0], &readelf_notes(&py.binary));
        check_version_probes(version, &python_probe_names(&objects[0]), &objects[0]);
        let (_, status) = target.finish();
        assert!(status.success());
    }
}

#[test]
fn finds_probes_in_libpython_of_an_embedding_program() {
    let embed = fixture_binary("embed_python3.11");
    let mut target = Target::spawn(&embed, &["-c", WAITING_SCRIPT]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let listing = json_of(&run_pyprobe(&[
        "probes",
        "-p",
        &pid.to_string(),
        "--format",
        "json",
    ]));
    let objects = listing["objects"].as_array().unwrap();
    assert_eq!(objects.len(), 1);
    let path = objects[0]["path"].as_str().unwrap();
    assert!(
        path.contains("libpython3.11.so"),
        "probes live in libpython: {path}"
    );
    assert_ne!(
        objects[0]["load_bias"].as_u64(),
        Some(0),
        "a shared library loads at a random address"
    );
    check_live_object(pid, &objects[0], &readelf_notes(Path::new(path)));
    assert!(python_probe_names(&objects[0]).contains("function__entry"));
}

const FIXTURE_PROBES: [&str; 7] = ["consts", "regs", "mem", "global", "twosite", "str", "gated"];

#[test]
fn lists_the_c_fixture_probes_in_every_build() {
    for (binary, object) in [
        ("sdt_fixture_pie", "sdt_fixture_pie"),
        ("sdt_fixture_nopie", "sdt_fixture_nopie"),
        ("sdt_fixture_lib", "libsdt_fixture.so"),
    ] {
        let object_path = fixture_binary(object);
        let file = json_of(&run_pyprobe(&[
            "probes",
            object_path.to_str().unwrap(),
            "--format",
            "json",
        ]));
        let notes = listing_notes(&file["objects"][0]);
        assert_eq!(notes, readelf_notes(&object_path), "{object}");
        assert_all_args_decode(&file["objects"][0]);
        let names: BTreeSet<&str> = notes.keys().map(|(_, n)| n.as_str()).collect();
        assert_eq!(names, FIXTURE_PROBES.into_iter().collect(), "{object}");
        assert_eq!(
            notes[&("pyprobe_test".into(), "twosite".into())].0.len(),
            2,
            "twosite has two sites"
        );
        assert_ne!(
            notes[&("pyprobe_test".into(), "gated".into())].1,
            0,
            "gated has a semaphore"
        );

        let mut target = Target::spawn(&fixture_binary(binary), &["--wait", "1"]);
        target.wait_for_line("pid");
        let pid = target.pid();
        let live = json_of(&run_pyprobe(&[
            "probes",
            "-p",
            &pid.to_string(),
            "--provider",
            "pyprobe_test",
            "--format",
            "json",
        ]));
        let objects = live["objects"].as_array().unwrap();
        assert_eq!(objects.len(), 1, "{binary}");
        assert!(
            objects[0]["path"].as_str().unwrap().ends_with(object),
            "{binary}: {}",
            objects[0]["path"]
        );
        check_live_object(pid, &objects[0], &readelf_notes(&object_path));
        if binary == "sdt_fixture_nopie" {
            assert_eq!(
                objects[0]["load_bias"], 0,
                "a fixed-address executable has no bias"
            );
        }
    }
}

#[test]
fn table_output_names_probes_and_decoded_arguments() {
    let Some(py) = python("3.9") else { return };
    let out = run_pyprobe(&["probes", py.binary.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("python:function__entry"), "{text}");
    assert!(
        text.contains("filename="),
        "CPython argument meanings are shown: {text}"
    );
}

#[test]
fn clear_errors_for_bad_targets() {
    let missing = run_pyprobe(&["probes", "/nonexistent/python"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/python"));

    let not_elf = run_pyprobe(&["probes", concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")]);
    assert_eq!(not_elf.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&not_elf.stderr).contains("not an ELF file"));

    let no_pid = run_pyprobe(&["probes", "-p", "999999999"]);
    assert_eq!(no_pid.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&no_pid.stderr).contains("no process with pid 999999999"));

    let usage = run_pyprobe(&["probes"]);
    assert_eq!(usage.status.code(), Some(2), "usage errors exit 2");
}
