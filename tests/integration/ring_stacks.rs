//! The default mode serves GC, import and audit probes through the ring, the
//! trampoline capturing the Python stack that raised each event: the recording's
//! stacks must be the ones the frame walker reads at an `int3` stop.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::support::*;
use pyprobe_cpython::python::walker::GONE_CODE;
use pyprobe_recording::recording::{EventKind, RecordingReader};

const CALLS: usize = 3000;

fn tmp_recording(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "pyprobe-ring-stacks-{}-{name}.pyprobe",
        std::process::id()
    ))
}

/// What a recording of a fixture holds.
struct Recorded {
    /// pyprobe's stderr.
    stderr: String,
    /// The fixture's stdout.
    stdout: String,
    /// The function names of the stack before each `builtins.id` audit event
    /// (empty when there was none).
    stacks: Vec<Vec<String>>,
    /// Stacks holding frames drawn as gone, and those frames.
    gone: (u64, u64),
}

/// Records the audit fixture with `extra` options.
fn record(py: &Python, extra: &[&str], name: &str) -> (String, String, Vec<Vec<String>>) {
    let calls = CALLS.to_string();
    let r = record_script(py, extra, &[], name, "audit_stacks.py", &[&calls]);
    (r.stderr, r.stdout, r.stacks)
}

fn record_script(
    py: &Python,
    extra: &[&str],
    env: &[(&str, &str)],
    name: &str,
    script: &str,
    args: &[&str],
) -> Recorded {
    let path = tmp_recording(&format!("{}-{name}", py.version));
    let out = pyprobe()
        .envs(env.iter().copied())
        .args(["record", "-o", path.to_str().unwrap()])
        .args(extra)
        .arg("--")
        .arg(&py.launcher)
        .arg(repo().join("fixtures/python").join(script))
        .args(args)
        .output()
        .expect("run pyprobe");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("{} {extra:?}: {stderr}", py.version);
    assert!(out.status.success(), "record failed");
    let mut reader = RecordingReader::open(&path).expect("open recording");
    let mut last_stack: HashMap<u32, Vec<String>> = HashMap::new();
    let mut stacks = Vec::new();
    let mut gone = (0, 0);
    let events: Vec<_> = reader.events().map(|e| e.expect("event")).collect();
    for e in events {
        match e.kind {
            EventKind::Stack { frames } => {
                let names: Vec<String> = frames
                    .iter()
                    .map(|f| reader.string(f.code.function).into_owned())
                    .collect();
                let gone_here = names.iter().filter(|n| *n == GONE_CODE).count() as u64;
                if gone_here > 0 {
                    gone = (gone.0 + 1, gone.1 + gone_here);
                }
                last_stack.insert(e.tid, names);
            }
            EventKind::Audit { event } => {
                let stack = last_stack.remove(&e.tid).unwrap_or_default();
                if reader.string(event) == "builtins.id" {
                    stacks.push(stack);
                }
            }
            _ => {}
        }
    }
    let _ = std::fs::remove_file(&path);
    Recorded {
        stderr,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stacks,
        gone,
    }
}

fn check(version: &'static str) {
    let Some(py) = python(version) else { return };
    // The default engine captures the stacks in the target (without a budget, so
    // that a storm of audit events is not thinned). `-v`: the start says which
    // sites go to the ring and which stay on int3.
    let (stderr, stdout, ring) = record(&py, &["--max-overhead", "0", "-v"], "ring");
    assert_eq!(stdout.trim(), CALLS.to_string());
    assert!(
        stderr.contains("probe sites write to a ring"),
        "{version}: the ring serves the sites: {stderr}"
    );
    assert!(
        !stderr.contains("need the target stopped") && !stderr.contains("stop the target (int3)"),
        "{version}: no site stays on int3 for its stack: {stderr}"
    );
    let (_, _, stopped) = record(&py, &["--engine", "int3", "--max-overhead", "0"], "int3");
    assert_eq!(
        ring.len(),
        CALLS,
        "{version}: audit events through the ring"
    );
    assert_eq!(stopped.len(), CALLS, "{version}: audit events through int3");
    let want = ["<module>", "outer", "middle", "leaf"];
    // A pyprobe not given a CPU while the program ran reads the ring after the
    // main module's code object is freed: that frame keeps its place, drawn as
    // gone, and pyprobe says so. Nothing else may differ.
    let said_gone = stderr.contains("were freed before pyprobe read them");
    for (i, (r, s)) in ring.iter().zip(&stopped).enumerate() {
        assert_eq!(s, &want, "{version}: stack of audit event {i} through int3");
        assert_eq!(r.len(), want.len(), "{version}: depth of audit event {i}");
        for (got, wanted) in r.iter().zip(want) {
            assert!(
                got == wanted || (said_gone && got == GONE_CODE),
                "{version}: stack of audit event {i}: {r:?}"
            );
        }
    }
}

#[test]
fn audit_stacks_through_the_ring_3_9() {
    check("3.9");
}

#[test]
fn audit_stacks_through_the_ring_3_11() {
    check("3.11");
}

#[test]
fn audit_stacks_through_the_ring_3_13() {
    check("3.13");
}

#[test]
fn audit_stacks_through_the_ring_3_14() {
    check("3.14");
}

#[test]
fn audit_stacks_through_the_ring_3_15() {
    check("3.15");
}

/// A pyprobe that reads the ring only once the program has ended (held by a test
/// switch, as when it is given no CPU meanwhile) finds the main module's code
/// object freed: that frame keeps its place in every stack, drawn as gone, the
/// others are named, and the closing caveat counts exactly the stacks and frames
/// drawn so.
fn names_read_late(version: &'static str) {
    let Some(py) = python(version) else { return };
    let calls = CALLS.to_string();
    let r = record_script(
        &py,
        // Sampled once a second: a sample would name `<module>` while it runs.
        &["--max-overhead", "0", "-r", "1"],
        &[("PYPROBE_TEST_HOLD_RINGS", "1")],
        "late",
        "audit_stacks.py",
        &[&calls],
    );
    assert_eq!(r.stdout.trim(), calls, "{version}: {}", r.stderr);
    assert_eq!(r.stacks.len(), CALLS, "{version}: audit events");
    for (i, stack) in r.stacks.iter().enumerate() {
        assert_eq!(
            stack,
            &[GONE_CODE, "outer", "middle", "leaf"],
            "{version}: stack of audit event {i}"
        );
    }
    let (stacks, frames) = r.gone;
    assert!(
        stacks >= CALLS as u64,
        "{version}: {stacks} stacks with gone frames"
    );
    let caveat = format!(
        "stacks captured with events held {frames} frames whose code objects were freed \
         before pyprobe read them"
    );
    let said = r.stderr.lines().find(|l| l.contains(&caveat)).unwrap_or("");
    assert!(
        said.starts_with(&format!("pyprobe: caveat: {stacks} of the ")),
        "{version}: {stacks} stacks: {}",
        r.stderr
    );
}

#[test]
#[cfg_attr(
    not(feature = "test-switches"),
    ignore = "pyprobe must be built with --features test-switches"
)]
fn names_read_after_their_code_is_freed_are_drawn_as_gone_3_14() {
    names_read_late("3.14");
}

#[test]
#[cfg_attr(
    not(feature = "test-switches"),
    ignore = "pyprobe must be built with --features test-switches"
)]
fn names_read_after_their_code_is_freed_are_drawn_as_gone_3_15() {
    names_read_late("3.15");
}

/// A frame whose link to its caller holds garbage (an unmapped address) while it
/// runs: the interpreter never follows that link before the frame returns, and the
/// program runs fine untraced. The stacks captured in the target for its audit
/// events end at that link (the walk checks every frame it moves to) instead of
/// faulting the target; with the link put back, stacks are whole again.
fn garbage_link(version: &'static str) {
    let Some(py) = python(version) else { return };
    const WINDOWS: usize = 20;
    const PER_WINDOW: usize = 50;
    let (windows, per_window) = (WINDOWS.to_string(), PER_WINDOW.to_string());
    let args = [windows.as_str(), per_window.as_str()];
    let untraced = std::process::Command::new(&py.launcher)
        .arg(repo().join("fixtures/python/bad_link.py"))
        .args(args)
        .output()
        .expect("run the fixture");
    let expected = format!("{} {}", WINDOWS * PER_WINDOW, WINDOWS * PER_WINDOW);
    assert!(
        untraced.status.success(),
        "{version}: untraced: {untraced:?}"
    );
    assert_eq!(String::from_utf8_lossy(&untraced.stdout).trim(), expected);
    // Without a budget, so that every audit event gets its stack.
    let Recorded {
        stderr,
        stdout,
        stacks,
        ..
    } = record_script(
        &py,
        &["--max-overhead", "0"],
        &[],
        "bad-link",
        "bad_link.py",
        &args,
    );
    assert_eq!(stdout.trim(), expected, "{version}: {stderr}");
    assert!(
        stderr.contains("target exited with status 0"),
        "{version}: {stderr}"
    );
    // The fixture's own id() calls that find the link are not leaf()'s.
    let stacks: Vec<_> = stacks
        .into_iter()
        .filter(|s| s.last().is_some_and(|f| f == "leaf"))
        .collect();
    let calls = WINDOWS * PER_WINDOW;
    assert_eq!(stacks.len(), 2 * calls, "{version}: audit events");
    for (i, stack) in stacks.iter().enumerate() {
        let want: &[&str] = if i < calls {
            &["middle", "leaf"]
        } else {
            &["<module>", "intact", "leaf"]
        };
        assert_eq!(stack, want, "{version}: stack of audit event {i}");
    }
}

#[test]
fn a_garbage_frame_link_ends_the_captured_stack_not_the_target_3_9() {
    garbage_link("3.9");
}

#[test]
fn a_garbage_frame_link_ends_the_captured_stack_not_the_target_3_11() {
    garbage_link("3.11");
}

#[test]
fn a_garbage_frame_link_ends_the_captured_stack_not_the_target_3_13() {
    garbage_link("3.13");
}

#[test]
fn a_garbage_frame_link_ends_the_captured_stack_not_the_target_3_14() {
    garbage_link("3.14");
}

#[test]
fn a_garbage_frame_link_ends_the_captured_stack_not_the_target_3_15() {
    garbage_link("3.15");
}

/// In trace mode through the hook engine every call is traced, so the stack of a
/// GC, import or audit event is the traced call stack, named from the calls
/// themselves: nothing is captured in the target, and a pyprobe that reads the
/// rings only once the program has ended (held by a test switch) still names the
/// main module's frame, freed by then. On 3.11 the trampolines used to capture
/// these stacks (its function probes trace returns only), and that frame was
/// drawn as gone.
#[test]
#[cfg_attr(
    not(feature = "test-switches"),
    ignore = "pyprobe must be built with --features test-switches"
)]
fn trace_mode_event_stacks_are_the_traced_calls_3_11() {
    // 3.12+ named them from the calls already; only the capture is gone there.
    let version = "3.11";
    let Some(py) = python(version) else { return };
    let calls = CALLS.to_string();
    let path = tmp_recording(&format!("{version}-traced-stacks"));
    let script = repo().join("fixtures/python/audit_stacks.py");
    let out = pyprobe()
        .env("PYPROBE_TEST_HOLD_RINGS", "1")
        .args([
            "record",
            "--mode",
            "trace",
            "-o",
            path.to_str().unwrap(),
            "--",
        ])
        .arg(&py.launcher)
        .arg(&script)
        .arg(&calls)
        .output()
        .expect("run pyprobe");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{version}: {stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        calls,
        "{version}"
    );
    let report = report_json(path.to_str().unwrap());
    let _ = std::fs::remove_file(&path);
    let audit = report["audit"].as_array().expect("audit");
    let ids = audit
        .iter()
        .find(|a| a["event"] == "builtins.id")
        .unwrap_or_else(|| panic!("{version}: no builtins.id: {audit:?}"));
    assert_eq!(ids["count"], CALLS as u64, "{version}");
    let stacks = ids["stacks"].as_array().unwrap();
    let want: Vec<String> = [("<module>", 1), ("outer", 18), ("middle", 14), ("leaf", 9)]
        .iter()
        .map(|(f, l)| format!("{f} ({}:{l})", script.display()))
        .collect();
    assert_eq!(stacks.len(), 1, "{version}: {stacks:?}");
    assert_eq!(stacks[0]["frames"], serde_json::json!(want), "{version}");
    let caveats = report["caveats"].as_array().unwrap();
    assert!(
        !caveats.iter().any(|c| c["text"]
            .as_str()
            .is_some_and(|t| t.contains("were freed before pyprobe read them"))),
        "{version}: {caveats:?}"
    );
}
