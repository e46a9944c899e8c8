//! `record --native`: native frames joined with the Python stack, on real
//! interpreters calling real C: a ctypes-loaded library that calls back into
//! Python (`fixtures/native/native_calls.c`), and numpy from PyPI.

use crate::support::*;
use serde_json::Value;

/// Records `script ARGS` under `py` with `--mode sample --native`; returns the
/// script's stdout, pyprobe's stderr, and the collapsed stacks (frames, count).
fn record_native(
    py: &Python,
    script: &str,
    args: &[&str],
    env: &[(&str, &std::path::Path)],
) -> (String, String, Vec<(Vec<String>, u64)>) {
    record_native_in(py, "sample", script, args, env)
}

/// As [`record_native`], in `--mode MODE`.
fn record_native_in(
    py: &Python,
    mode: &str,
    script: &str,
    args: &[&str],
    env: &[(&str, &std::path::Path)],
) -> (String, String, Vec<(Vec<String>, u64)>) {
    let recording = TempFile::new(&format!("native-{}-{mode}-{script}.pyprobe", py.version));
    let out = pyprobe()
        .args(["record", "--mode", mode, "--native", "--force", "-o"])
        .arg(recording.path())
        .arg("--")
        .arg(&py.launcher)
        .arg(repo().join("fixtures/python").join(script))
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("{stderr}");
    assert_no_panic("record --native", &out.stderr);
    assert!(out.status.success(), "record --native failed");
    let stacks = collapsed_stacks(recording.path());
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
        stacks,
    )
}

/// Index of the first frame named `function` (a Python `name (file:line)` or a
/// native `name (object)`).
fn position(frames: &[String], function: &str) -> Option<usize> {
    frames
        .iter()
        .position(|f| f.split(" (").next() == Some(function))
}

/// The interpreter's own C functions are left out of joined stacks.
fn assert_no_interpreter_frame(version: &str, frames: &[String]) {
    let interpreter = format!("bin/python{version})");
    assert!(
        !frames.iter().any(|f| f.contains(&interpreter)),
        "{version}: an interpreter-internal frame was kept: {frames:?}"
    );
}

fn is_python(frame: &str) -> bool {
    frame.contains(".py:")
}

#[test]
fn c_frames_sit_between_the_python_caller_and_the_python_callback() {
    // 3.9: one eval-loop call per Python frame; 3.11: calls shown by the frame
    // marked as each one's entry; 3.13: by the shim frame each call pushes.
    for version in ["3.9", "3.11", "3.13"] {
        let Some(py) = python(version) else { continue };
        let lib = fixture_binary("libnative_calls.so");
        let (stdout, stderr, stacks) =
            record_native(&py, "native_calls.py", &[lib.to_str().unwrap(), "3"], &[]);
        let truth: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let (mut leaf, mut leaf_joined, mut spin) = (0, 0, 0);
        for (frames, count) in &stacks {
            assert_no_interpreter_frame(version, frames);
            if let Some(at) = position(frames, "py_leaf") {
                leaf += count;
                let order = [
                    "<module>",
                    "main",
                    "call_native",
                    "native_outer",
                    "native_inner",
                ];
                let at_each: Option<Vec<usize>> =
                    order.iter().map(|f| position(frames, f)).collect();
                let Some(at_each) = at_each else { continue };
                leaf_joined += count;
                assert!(
                    at_each.windows(2).all(|w| w[0] < w[1]) && at_each[4] < at,
                    "{version}: out of order: {frames:?}"
                );
                // Only native frames (ctypes, libffi) between the Python caller and
                // the C it calls, and between the C and the Python callback.
                let between = frames[at_each[2] + 1..at_each[3]]
                    .iter()
                    .chain(&frames[at_each[4] + 1..at]);
                assert!(
                    between.clone().all(|f| !is_python(f)),
                    "{version}: {frames:?}"
                );
            }
            if let Some(at) = position(frames, "native_spin") {
                spin += count;
                assert!(position(frames, "call_spin").is_some_and(|c| c < at));
            }
        }
        // The unwind reaches the eval loop for nearly every sample.
        assert!(
            leaf_joined * 10 >= leaf * 9,
            "{version}: {leaf_joined} of {leaf} py_leaf samples have their C frames"
        );
        // The time each side took, as the fixture measured it itself.
        let leaf_s = truth["py_leaf_seconds"].as_f64().unwrap();
        let spin_s = truth["native_spin_seconds"].as_f64().unwrap();
        let measured = spin_s / (leaf_s + spin_s);
        let sampled = spin as f64 / (leaf + spin) as f64;
        assert!(
            (measured - sampled).abs() < 0.15,
            "{version}: native_spin had {sampled:.2} of the samples, {measured:.2} of the time"
        );
        assert!(truth["py_leaf_calls"].as_u64().unwrap() > 0);
        // The closing line's counts add up to the samples taken.
        let line = stderr.lines().find(|l| l.contains("--native:")).unwrap();
        let joined: u64 = line
            .split("--native: ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(joined >= leaf_joined, "{line}");
    }
}

/// Where the static function `name` of the unstripped `library` starts.
fn static_function_start(library: &std::path::Path, name: &str) -> u64 {
    let data = std::fs::read(library).unwrap();
    let elf = goblin::elf::Elf::parse(&data).unwrap();
    elf.syms
        .iter()
        .find(|s| elf.strtab.get_at(s.st_name) == Some(name))
        .unwrap_or_else(|| panic!("{name} in {}", library.display()))
        .st_value
}

/// A stripped library: a function no symbol names is named by where its unwind
/// table entry starts, one frame for every address of it. A frame whose unwind
/// table misdescribes it (as AVX-512 code that realigns the stack defeats the
/// unwinder) ends the unwind at a `[native unwind stopped]` marker under the
/// Python caller, the C frames found after it: none of its time is counted as
/// the caller's own.
#[test]
fn stripped_functions_are_named_by_their_start_and_an_unwind_stopped_is_marked() {
    let start = static_function_start(&fixture_binary("libnative_calls.so"), "hidden_spin");
    let hidden = format!("libnative_calls_stripped.so+{start:#x}");
    for version in ["3.9", "3.13"] {
        let Some(py) = python(version) else { continue };
        let lib = fixture_binary("libnative_calls_stripped.so");
        let (stdout, stderr, stacks) =
            record_native(&py, "stripped_calls.py", &[lib.to_str().unwrap(), "2"], &[]);
        let truth: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let (mut in_hidden, mut under_entry, mut opaque, mut opaque_marked) = (0, 0, 0, 0);
        for (frames, count) in &stacks {
            if let Some(at) = position(frames, "native_spin_hidden") {
                under_entry += count;
                // Whatever address the sample caught, the frame under the entry
                // is the function's start.
                if frames.get(at + 1).and_then(|f| f.split(" (").next()) == Some(&*hidden) {
                    in_hidden += count;
                }
                // (Below it, its calls: a PLT stub is named by the PLT's entry.)
                let under = frames.get(at + 1).map_or("", |f| f.as_str());
                assert!(
                    !under.starts_with("libnative_calls") || under.starts_with(&*hidden),
                    "{version}: hidden_spin named otherwise: {frames:?}"
                );
            }
            if let Some(caller) = position(frames, "call_opaque") {
                // A sample of call_opaque's own Python (timing the call) counts
                // against the share marked: its C must not be taken for it.
                opaque += count;
                let marker = position(frames, "[native unwind stopped]");
                let spin = position(frames, "native_spin");
                if marker.is_some_and(|m| m > caller) && spin > marker {
                    opaque_marked += count;
                }
            }
        }
        assert!(
            under_entry > 20 && in_hidden * 10 >= under_entry * 9,
            "{version}: {in_hidden} of {under_entry} samples under native_spin_hidden \
             named {hidden}:\n{stderr}"
        );
        assert!(
            opaque > 20 && opaque_marked * 10 >= opaque * 9,
            "{version}: {opaque_marked} of {opaque} samples of call_opaque marked where \
             the unwind stopped:\n{stderr}"
        );
        assert!(truth["opaque_seconds"].as_f64().unwrap() > 0.5);
        assert!(
            stderr.contains("past a `[native unwind stopped]` marker"),
            "{stderr}"
        );
    }
}

/// Debian's 3.14 and 3.15 run the eval loop's body outside the range of its
/// symbol (GCC moved it into a part of its own): a Python callback called from C
/// still has the C that called it (ctypes) under it. Their libffi (3.5) has
/// unwind tables the unwinder cannot pass, so the stack above ctypes is marked as
/// cut rather than shown: the Python frames that called the C come first.
#[test]
fn the_eval_loop_outside_its_symbol_is_joined() {
    for version in ["3.14", "3.15"] {
        let Some(py) = python(version) else { continue };
        let lib = fixture_binary("libnative_calls.so");
        let (_, _, stacks) =
            record_native(&py, "native_calls.py", &[lib.to_str().unwrap(), "2"], &[]);
        let (mut leaf, mut joined) = (0, 0);
        for (frames, count) in &stacks {
            assert_no_interpreter_frame(version, frames);
            assert!(
                frames.iter().all(|f| !f.ends_with(" (?)")),
                "{version}: a frame outside every object: {frames:?}"
            );
            let Some(at) = position(frames, "py_leaf") else {
                continue;
            };
            leaf += count;
            let caller = position(frames, "call_native").expect("call_native under py_leaf");
            if frames[caller + 1..at]
                .iter()
                .any(|f| f.contains("_ctypes.cpython"))
            {
                joined += count;
            }
        }
        assert!(leaf > 20, "{version}: {leaf} py_leaf samples");
        assert!(
            joined * 10 >= leaf * 9,
            "{version}: {joined} of {leaf} py_leaf samples have the ctypes frames that called it"
        );
    }
}

#[test]
fn numpy_c_frames_show_under_the_python_caller() {
    let Some(py) = python("3.13") else { return };
    let numpy = pypi_compiled("numpy", "2.2.6", "3.13");
    let (stdout, _, stacks) = record_native(
        &py,
        "numpy_sort.py",
        &["3"],
        &[("PYTHONPATH", numpy.as_path())],
    );
    let truth: Value = serde_json::from_str(stdout.trim()).unwrap();
    let (mut in_loop, mut in_numpy_c) = (0, 0);
    for (frames, count) in &stacks {
        let Some(caller) = position(frames, "sort_many") else {
            continue;
        };
        in_loop += count;
        // numpy's C under the innermost Python frame (np.sort's own Python,
        // itself called through numpy's C dispatcher).
        let innermost_python = frames.iter().rposition(|f| is_python(f)).unwrap();
        assert!(caller <= innermost_python);
        if frames[innermost_python + 1..]
            .iter()
            .any(|f| f.contains("_multiarray_umath"))
        {
            in_numpy_c += count;
            if frames[innermost_python].starts_with("sort (") {
                let dispatch = position(frames, "dispatcher_vectorcall");
                assert!(
                    dispatch.is_some_and(|d| caller < d && d < innermost_python),
                    "numpy's C dispatcher is not between sort_many and np.sort: {frames:?}"
                );
            }
        }
    }
    let measured =
        truth["sort_seconds"].as_f64().unwrap() / truth["loop_seconds"].as_f64().unwrap();
    let sampled = in_numpy_c as f64 / in_loop as f64;
    assert!(
        (measured - sampled).abs() < 0.15,
        "numpy's C code had {sampled:.2} of sort_many's samples, np.sort took {measured:.2} of its time"
    );
}

/// The count before `what` on the `--native` closing line (`0` when absent).
fn native_count(stderr: &str, what: &str) -> u64 {
    let line = stderr.lines().find(|l| l.contains("--native:")).unwrap();
    let Some(before) = line.split(what).next().filter(|b| b.len() < line.len()) else {
        return 0;
    };
    before
        .rsplit(|c: char| !c.is_ascii_digit())
        .find(|w| !w.is_empty())
        .unwrap()
        .parse()
        .unwrap()
}

/// The default mode (`auto`, under its overhead budget, GC, import and audit
/// probes traced) with `--native`, on a machine whose CPUs are all busy: the
/// first samples pay one-off work and every stop is stretched by other programs
/// taking the CPU, yet the threads stay stopped for every sample, so every
/// sample that reaches the eval loop has its native frames.
#[test]
fn native_in_the_default_mode_on_a_busy_machine() {
    let Some(py) = python("3.13") else { return };
    let lib = fixture_binary("libnative_calls.so");
    let _busy = Contention::start(&py);
    let (_, stderr, stacks) = record_native_in(
        &py,
        "auto",
        "native_calls.py",
        &[lib.to_str().unwrap(), "4"],
        &[],
    );
    assert!(stderr.contains("budget"), "no overhead budget: {stderr}");
    assert!(
        !stderr.contains("without stopping"),
        "the stops were given up: {stderr}"
    );
    assert_eq!(native_count(&stderr, "thread not stopped"), 0, "{stderr}");
    let joined = native_count(&stderr, "samples with native frames");
    let taken: u64 = stacks.iter().map(|(_, n)| n).sum();
    assert!(
        joined * 10 >= taken * 9 && taken > 50,
        "{joined} of {taken} samples have native frames: {stderr}"
    );
    let native_spin: u64 = stacks
        .iter()
        .filter(|(frames, _)| position(frames, "native_spin").is_some())
        .map(|(_, n)| n)
        .sum();
    assert!(native_spin > 0, "no sample in native_spin: {stderr}");
}

#[test]
fn native_is_refused_where_nothing_is_sampled_or_threads_run_on() {
    assert_refused(
        &["record", "--native", "--mode", "trace", "-p", "1"],
        &["--native", "--mode auto"],
    );
    // A conflict of options: refused by the argument parser (its exit code, 2).
    let out = run_pyprobe(&["record", "--native", "--nonblocking", "-p", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--nonblocking"));
}
