//! `pyprobe dump --locals` against every interpreter on the machine: the fixture
//! `locals.py` says how each of its locals should read (its own `repr`, a
//! container's type and length, an object's type and `id`), and pyprobe must read
//! exactly those from memory, with the target held for the read and unharmed after.

use std::collections::BTreeMap;
use std::path::Path;

use crate::support::*;
use serde_json::Value;

/// name → value as shown (`None`: unbound), of one frame of a dump.
type Shown = BTreeMap<String, Option<String>>;

fn frame_locals(dump: &Value, function_suffix: &str) -> Option<Shown> {
    let main = dump["threads"]
        .as_array()?
        .iter()
        .find(|t| t["main"].as_bool() == Some(true))?;
    let frame = main["frames"].as_array()?.iter().find(|f| {
        f["function"]
            .as_str()
            .is_some_and(|n| n == function_suffix || n.ends_with(&format!(".{function_suffix}")))
    })?;
    Some(
        frame["locals"]
            .as_array()?
            .iter()
            .map(|l| {
                (
                    l["name"].as_str().unwrap_or_default().to_owned(),
                    l["value"].as_str().map(str::to_owned),
                )
            })
            .collect(),
    )
}

fn check_locals(python: &Path, version: &str) {
    let fixture = repo().join("fixtures/python/locals.py");
    let mut target = Target::spawn(python, &[&fixture.display().to_string()]);
    let truth: Value = serde_json::from_str(&target.wait_for_line("{")).expect("the truth");
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let out = run_pyprobe(&["dump", "--locals", "--format", "json", "-p", &pid]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python {version}: {err}");
    assert!(
        !err.contains("could not be held"),
        "python {version}: the threads are held for the read: {err}"
    );
    let dump: Value = serde_json::from_slice(&out.stdout).expect("dump's JSON");
    for function in ["inner", "outer"] {
        let shown = frame_locals(&dump, function)
            .unwrap_or_else(|| panic!("python {version}: no {function}() frame:\n{dump:#}"));
        let want = truth[function].as_object().unwrap();
        let names: Vec<&String> = shown.keys().collect();
        let wanted: Vec<&String> = {
            let mut w: Vec<&String> = want.keys().collect();
            w.sort();
            w
        };
        assert_eq!(names, wanted, "python {version}: {function}()'s names");
        for (name, value) in want {
            let got = &shown[name];
            let ok = match (value.as_str(), got) {
                (None, None) => true,
                (Some(prefix @ "<int of about"), Some(g)) => g.starts_with(prefix),
                (Some(w), Some(g)) => w == g,
                _ => false,
            };
            assert!(
                ok,
                "python {version}: {function}(): {name} shown as {got:?}, the program says {value}"
            );
        }
    }
    // The text form: the same values, under their frame.
    let text = run_pyprobe(&["dump", "--locals", "-p", &pid]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("    n = 5\n") && text.contains("    later = <unbound>\n"),
        "python {version}:\n{text}"
    );
    // Held and let go: the program goes on and ends as it would.
    target.send_line("go");
    let (_, status) = target.finish();
    assert!(
        status.success(),
        "python {version}: the target after dump: {status:?}"
    );
}

#[test]
fn dump_locals_reads_what_the_program_set_on_every_interpreter() {
    let all = all_interpreters();
    assert!(!all.is_empty(), "no interpreter to test");
    for (version, python) in all {
        eprintln!("python {version}: {}", python.display());
        check_locals(&python, &version);
    }
}

/// A target another tracer holds (here a recording pyprobe): `dump --locals` does
/// not wait for it, says why the values were read running, and reads them.
#[test]
fn dump_locals_of_a_traced_target_reads_it_running_and_says_so() {
    let Some(py) = python("3.13") else { return };
    let fixture = repo().join("fixtures/python/locals.py");
    let mut target = Target::spawn(&py.launcher, &[&fixture.display().to_string()]);
    target.wait_for_line("{");
    target.wait_for_line("ready");
    let pid = target.pid();
    let recording = TempFile::new("traced-locals.pyprobe");
    let tracer = Tracer::record(
        recording.path(),
        &["--mode", "sample", "-p", &pid.to_string()],
    );
    let traced = wait_for(std::time::Duration::from_secs(10), || {
        std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
            s.lines()
                .any(|l| l == format!("TracerPid:\t{}", tracer.pid()))
        })
    });
    assert!(traced, "pyprobe record did not attach");
    // Not held, and not waited for ("still traced" would say it waited in vain).
    let out = run_pyprobe(&["dump", "--locals", "-p", &pid.to_string()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "could not be held (it is traced by process {})",
            tracer.pid()
        )),
        "{err}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("    n = 5\n"), "{text}");
    tracer.signal(libc::SIGINT);
    let (status, _) = tracer.wait(std::time::Duration::from_secs(20));
    assert!(status.success());
    target.send_line("go");
    let (_, status) = target.finish();
    assert!(status.success(), "the target after dump: {status:?}");
}
