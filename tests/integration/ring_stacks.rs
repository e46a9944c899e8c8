//! The default mode serves GC, import and audit probes through the ring, the
//! trampoline capturing the Python stack that raised each event: the recording's
//! stacks must be the ones the frame walker reads at an `int3` stop.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::support::*;
use pyprobe_recording::recording::{EventKind, RecordingReader};

const CALLS: usize = 3000;

fn tmp_recording(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "pyprobe-ring-stacks-{}-{name}.pyprobe",
        std::process::id()
    ))
}

/// Records the audit fixture with `extra` options; returns pyprobe's stderr, the
/// fixture's stdout and the function names of the stack before each `builtins.id`
/// audit event (empty when there was none).
fn record(py: &Python, extra: &[&str], name: &str) -> (String, String, Vec<Vec<String>>) {
    let calls = CALLS.to_string();
    record_script(py, extra, name, "audit_stacks.py", &[&calls])
}

fn record_script(
    py: &Python,
    extra: &[&str],
    name: &str,
    script: &str,
    args: &[&str],
) -> (String, String, Vec<Vec<String>>) {
    let path = tmp_recording(&format!("{}-{name}", py.version));
    let out = pyprobe()
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
    let events: Vec<_> = reader.events().map(|e| e.expect("event")).collect();
    for e in events {
        match e.kind {
            EventKind::Stack { frames } => {
                let names = frames
                    .iter()
                    .map(|f| reader.string(f.code.function).into_owned())
                    .collect();
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
    (
        stderr,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stacks,
    )
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
    for (i, (r, s)) in ring.iter().zip(&stopped).enumerate() {
        assert_eq!(r, s, "{version}: stack of audit event {i}");
        assert_eq!(r, &want, "{version}: stack of audit event {i}");
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
    let (stderr, stdout, stacks) = record_script(
        &py,
        &["--max-overhead", "0"],
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
