//! Sampling through the frame walker in `pyprobe record`: accuracy against the
//! target's own measurement, and `--mode auto` (samples plus exact GC events).

use crate::support::*;
use serde_json::Value;

#[test]
fn auto_mode_samples_functions_and_keeps_gc_exact() {
    let Some(py) = python("3.9") else { return };
    let (stdout, report) = record_script(&py, &[], "gc_import_audit.py", &[]);
    let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
    let gen2 = report["gc"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["generation"] == 2)
        .unwrap();
    assert!(gen2["collections"].as_u64().unwrap() >= truth["collects"]["2"].as_u64().unwrap());
    assert!(report["audit"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["event"] == "open"));
    // Functions come from samples, not from probes.
    assert!(report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["calls"].is_null()));
}

#[test]
fn gc_collections_are_attributed_to_the_function_that_triggered_them() {
    // Auto mode on 3.9 and 3.15 (the walker's stack at each gc__start hit), and trace
    // mode on 3.9 (the stack rebuilt from calls and returns).
    for (version, mode) in [("3.9", "auto"), ("3.15", "auto"), ("3.9", "trace")] {
        let Some(py) = python(version) else { continue };
        // The budget off: what is checked is whom a GC's stack names. Over budget
        // (a loaded machine) auto mode records GCs without their stacks, which
        // the budget's own tests check.
        let (stdout, report) = record_script(
            &py,
            &["--mode", mode, "--max-overhead", "0"],
            "gc_triggers.py",
            &[],
        );
        let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
        for function in ["alloc_a", "alloc_b"] {
            let attributed: u64 = report["gc"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|g| g["triggers"].as_array().unwrap())
                .filter(|t| t["function"] == function)
                .map(|t| t["count"].as_u64().unwrap())
                .sum();
            assert_eq!(
                attributed,
                truth[function].as_u64().unwrap(),
                "{version} {mode}: collections started in {function}"
            );
        }
    }
}

/// `--nonblocking` reads stacks while their threads run: coroutines suspending
/// (a suspended coroutine's frame loses its caller) and recursion changing depth
/// at every call tear the stacks read. A torn stack is recorded as the one frame
/// `[torn: ...]`, counted on the closing line, never as frames rooted at an inner
/// frame: every stack of the program's own frames is whole, from `<module>` to
/// the running function. Up to 3.10 (Debian's 3.9, pyenv's 3.7 and 3.10), whose
/// frames are objects of their own, a walk also meets freed frames.
#[test]
fn nonblocking_stacks_read_while_they_change_are_whole_or_marked_torn() {
    let mut pythons: Vec<(String, std::path::PathBuf)> = ["3.9", "3.11", "3.13", "3.15"]
        .into_iter()
        .filter_map(|v| Some((v.to_string(), python(v)?.launcher)))
        .collect();
    pythons.extend(
        pyenv_builds()
            .into_iter()
            .filter(|(v, _)| v == "3.7" || v == "3.10")
            .map(|(v, exe)| (format!("pyenv-{v}"), exe)),
    );
    for (version, launcher) in pythons {
        let recording = TempFile::new(&format!("torn-{version}.pyprobe"));
        let out = pyprobe()
            .args(["record", "--mode", "sample", "--nonblocking", "-r", "500"])
            .arg("-o")
            .arg(recording.path())
            .arg("--")
            .arg(&launcher)
            .arg(repo().join("fixtures/python/async_churn.py"))
            .arg("3")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_no_panic("record --nonblocking", &out.stderr);
        assert!(out.status.success(), "{version}: {stderr}");
        let said_torn: u64 = stderr
            .split(" of them torn")
            .next()
            .filter(|before| before.len() < stderr.len())
            .and_then(|before| before.rsplit('(').next())
            .map_or(0, |n| n.parse().unwrap());
        let (mut torn, mut whole, mut inner_roots) = (0u64, 0u64, Vec::new());
        for (frames, count) in collapsed_stacks(recording.path()) {
            let root = &frames[0];
            if root.starts_with("[torn") {
                assert_eq!(frames.len(), 1, "{version}: torn with frames: {frames:?}");
                torn += count;
            } else if root.starts_with("<module> ") {
                whole += count;
            } else if root.contains("async_churn.py") || root.contains("asyncio/") {
                // The program's frames and the event loop's all run under its
                // `<module>`: rooted there, the stack was cut.
                inner_roots.push(frames);
            }
            // Else the interpreter's start-up, before the program's `<module>`
            // (codec search, site's imports), called from C: whole stacks.
        }
        assert!(
            inner_roots.is_empty(),
            "{version}: stacks rooted at an inner frame: {inner_roots:#?}\n{stderr}"
        );
        // Idle samples are left out of the views by default, never torn ones.
        assert_eq!(torn, said_torn, "{version}: {stderr}");
        // How many tear depends on the machine (half of them, at worst, on 3.11).
        assert!(whole > 0, "{version}: {whole} whole, {torn} torn\n{stderr}");
    }
}
