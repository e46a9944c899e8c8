//! Thread state in every sample: whether the thread was on a CPU and whether it held
//! the GIL, and the views that count by it (on-CPU by default, `--idle`, `--gil`).
//!
//! `fixtures/python/idle.py` runs burn() (pure Python: on a CPU, holding the GIL),
//! hash_big() (hashlib on 8 MiB: on a CPU, the GIL released), nap() (time.sleep) and
//! poll() (select) in four threads; `duty.py` works 5 % and sleeps 95 % of the time in
//! one. The assertions are on shares of the samples and on presence, not on time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::support::*;
use serde_json::Value;

/// Leaf samples per function of `file`, from a report.
fn samples_in(report: &Value, file: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for f in report["functions"].as_array().unwrap() {
        if f["file"].as_str().unwrap().ends_with(file) {
            *out.entry(f["function"].as_str().unwrap().to_owned())
                .or_insert(0) += f["samples"].as_u64().unwrap();
        }
    }
    out
}

/// A function's share of the samples the report counted.
fn share(report: &Value, file: &str, function: &str) -> f64 {
    let kept = report["sample_filter"]["kept"].as_u64().unwrap();
    let n = samples_in(report, file).get(function).copied().unwrap_or(0);
    n as f64 / kept.max(1) as f64
}

fn report(recording: &str, extra: &[&str]) -> Value {
    let mut args = vec!["report", recording, "--format", "json"];
    args.extend_from_slice(extra);
    json_of(&run_pyprobe(&args))
}

/// Records `fixtures/python/SCRIPT ARGS` run by `python` with `record EXTRA`.
fn record(python: &Path, script: &str, args: &[&str], extra: &[&str], out: &TempFile) {
    let run = pyprobe()
        .args(["record", "-o", out.path()])
        .args(extra)
        .arg("--")
        .arg(python)
        .arg(fixture_script(script))
        .args(args)
        .output()
        .unwrap();
    assert_no_panic("record", &run.stderr);
    assert!(
        run.status.success(),
        "record {script}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The newest pyenv-style build of 3.12 (the GIL read through the offsets table's
/// `ceval.gil`, which no Debian test interpreter uses), if the machine has one.
fn pyenv_312() -> Option<PathBuf> {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")))?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(root.join("versions"))
        .ok()?
        .filter_map(|e| {
            let dir = e.ok()?.path();
            let name = dir.file_name()?.to_str()?.to_owned();
            let exe = dir.join("bin/python3.12");
            (name.starts_with("3.12.") && exe.exists()).then_some(exe)
        })
        .collect();
    found.sort();
    let exe = found.pop();
    if exe.is_none() {
        eprintln!("NOTICE: skipping the pyenv case: no pyenv build of 3.12 on this machine");
    }
    exe
}

/// The interpreters the views are checked on: Debian's 3.9 (GIL from
/// `gilstate.tstate_current`), 3.11 (the same, another offset), 3.13 and 3.15
/// (`_Py_DebugOffsets`), and a pyenv 3.12 without SDT probes.
fn interpreters() -> Vec<(String, PathBuf)> {
    let mut all: Vec<(String, PathBuf)> = ["3.9", "3.11", "3.13", "3.15"]
        .into_iter()
        .filter_map(|v| python(v).map(|p| (v.to_string(), p.launcher)))
        .collect();
    all.extend(pyenv_312().map(|exe| ("pyenv 3.12".to_string(), exe)));
    all
}

#[test]
fn waiting_threads_are_left_out_by_default_and_idle_brings_them_back() {
    let _one = serial();
    for (version, exe) in interpreters() {
        let out = TempFile::new(&format!("idle-{}.pyprobe", version.replace(' ', "-")));
        record(&exe, "idle.py", &["2.5"], &[], &out);
        let on_cpu = report(out.path(), &[]);
        let idle = report(out.path(), &["--idle"]);
        let gil = report(out.path(), &["--gil"]);
        let shares = |r: &Value| -> Vec<(&str, f64)> {
            ["burn", "hash_big", "nap", "poll"]
                .into_iter()
                .map(|f| (f, share(r, "idle.py", f)))
                .collect()
        };
        eprintln!(
            "{version}: on CPU {:?} {:?}\n  --idle {:?}\n  --gil {:?} {:?}",
            shares(&on_cpu),
            on_cpu["sample_filter"],
            shares(&idle),
            shares(&gil),
            gil["sample_filter"]
        );
        let f = &on_cpu["sample_filter"];
        assert_eq!(f["idle"], false);
        assert!(f["applied"].as_bool().unwrap());
        assert!(
            f["idle_left_out"].as_u64().unwrap() > 0 && f["cpu_state_unknown"] == 0,
            "{version}: {f}"
        );
        // The default: the threads at work, not the sleepers.
        let sleepers = share(&on_cpu, "idle.py", "nap") + share(&on_cpu, "idle.py", "poll");
        assert!(
            share(&on_cpu, "idle.py", "burn") >= 0.25,
            "{version}: burn on a CPU"
        );
        assert!(
            share(&on_cpu, "idle.py", "hash_big") >= 0.10,
            "{version}: hash_big on a CPU"
        );
        assert!(
            sleepers <= 0.10,
            "{version}: the sleeping threads' share of on-CPU samples: {sleepers:.3}"
        );
        // --idle: every thread, each about a fifth of the samples.
        assert_eq!(idle["sample_filter"]["idle_left_out"], 0);
        for function in ["burn", "hash_big", "nap", "poll"] {
            let s = share(&idle, "idle.py", function);
            assert!(s >= 0.10, "{version}: {function} with --idle: {s:.3}");
        }
        // --gil: the GIL holder only; hash_big runs without it.
        let g = &gil["sample_filter"];
        assert!(
            g["gil"] == true
                && g["gil_left_out"].as_u64().unwrap() > 0
                && g["gil_state_unknown"] == 0,
            "{version}: {g}"
        );
        assert!(
            share(&gil, "idle.py", "burn") >= 0.60,
            "{version}: burn with --gil"
        );
        let hash = share(&gil, "idle.py", "hash_big");
        assert!(hash <= 0.05, "{version}: hash_big with --gil: {hash:.3}");
        // A sleeper holds the GIL for a moment after each wake-up: rarely sampled so.
        let sleepers = share(&gil, "idle.py", "nap") + share(&gil, "idle.py", "poll");
        assert!(
            sleepers <= 0.10,
            "{version}: the sleepers with --gil: {sleepers:.3}"
        );
    }
}

#[test]
fn a_loop_asleep_95_percent_of_the_time_shows_its_work() {
    let _one = serial();
    // Blocking samples on 3.9, samples read while the thread runs on 3.13.
    for (version, extra) in [("3.9", &[][..]), ("3.13", &["--nonblocking"][..])] {
        let Some(py) = python(version) else { continue };
        let out = TempFile::new(&format!("duty-{version}.pyprobe"));
        record(&py.launcher, "duty.py", &["3"], extra, &out);
        let rest_share = |r: &Value| {
            let s = samples_in(r, "duty.py");
            let (work, rest) = (
                s.get("work").copied().unwrap_or(0),
                s.get("rest").copied().unwrap_or(0),
            );
            eprintln!("{version} {extra:?}: work {work}, rest {rest} samples");
            assert!(work > 0, "{version}: work sampled");
            rest as f64 / (work + rest) as f64
        };
        let on_cpu = rest_share(&report(out.path(), &[]));
        let idle = rest_share(&report(out.path(), &["--idle"]));
        // Without the filter rest() has about 95 %. A thread woken from its sleep is
        // runnable (`R`) until a CPU takes it, which a busy machine makes last.
        assert!(
            on_cpu <= 0.35,
            "{version}: rest's share on a CPU: {on_cpu:.3}"
        );
        assert!(
            idle >= 0.60,
            "{version}: rest's share with --idle: {idle:.3}"
        );
    }
}

/// Leaf samples per function in folded stacks.
fn folded_leaves(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let (stack, n) = line.rsplit_once(' ').unwrap();
        let leaf = stack.rsplit(';').next().unwrap();
        let name = leaf.split(' ').next().unwrap().to_owned();
        *out.entry(name).or_insert(0) += n.parse::<u64>().unwrap();
    }
    out
}

#[test]
fn flame_top_and_record_views_filter_the_same_way() {
    let _one = serial();
    let Some(py) = python("3.13") else { return };
    let out = TempFile::new("idle-views.pyprobe");
    let direct = TempFile::new("idle-views-direct.txt");
    // The recording `record -o x.txt` keeps beside the view.
    let _beside = TempFile::new("idle-views-direct.pyprobe");
    // A view written by record itself, with --idle.
    let run = pyprobe()
        .args(["record", "-o", direct.path(), "--idle", "--"])
        .arg(&py.launcher)
        .arg(fixture_script("idle.py"))
        .arg("2")
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let leaves = folded_leaves(&std::fs::read_to_string(direct.path()).unwrap());
    assert!(
        leaves.contains_key("nap") && leaves.contains_key("burn"),
        "{leaves:?}"
    );

    record(&py.launcher, "idle.py", &["2"], &[], &out);
    let flame = |extra: &[&str]| {
        let mut args = vec!["flame", out.path(), "-o", "-", "--format", "collapsed"];
        args.extend_from_slice(extra);
        let o = run_pyprobe(&args);
        assert!(o.status.success());
        (
            folded_leaves(&String::from_utf8(o.stdout).unwrap()),
            String::from_utf8(o.stderr).unwrap(),
        )
    };
    let (on_cpu, note) = flame(&[]);
    assert!(on_cpu.contains_key("burn"), "{on_cpu:?}");
    let total: u64 = on_cpu.values().sum();
    let sleepers = on_cpu.get("nap").unwrap_or(&0) + on_cpu.get("poll").unwrap_or(&0);
    assert!(
        sleepers as f64 <= 0.10 * total as f64,
        "sleepers in the default flame graph: {on_cpu:?}"
    );
    assert!(note.contains("idle samples left out"), "{note}");
    let (idle, _) = flame(&["--idle"]);
    assert!(idle["nap"] > 0 && idle["poll"] > 0, "{idle:?}");
    let (gil, note) = flame(&["--gil"]);
    let total: u64 = gil.values().sum();
    let others = total - gil["burn"];
    assert!(others as f64 <= 0.25 * total as f64, "{gil:?}");
    assert!(note.contains("not holding the GIL left out"), "{note}");

    // The same numbers in the report and the folded stacks.
    let r = report(out.path(), &[]);
    assert_eq!(
        samples_in(&r, "idle.py").get("burn").copied(),
        on_cpu.get("burn").copied()
    );

    // top says what it left out.
    let top = run_pyprobe(&["top", "--once", "--from", out.path()]);
    let text = String::from_utf8(top.stdout).unwrap();
    assert!(
        text.contains("samples on a CPU") && text.contains("idle left out"),
        "{text}"
    );
    // Rows: OWN% TOTAL% SAMPLES PID FUNCTION FILE:LINE.
    let own = |text: &str, function: &str| -> f64 {
        text.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|cols| cols.len() == 6 && cols[4] == function)
            .map_or(0.0, |cols| cols[0].parse().unwrap())
    };
    assert!(own(&text, "burn") >= 25.0, "{text}");
    assert!(own(&text, "nap") <= 5.0, "{text}");
    let top = run_pyprobe(&["top", "--once", "--from", out.path(), "--idle"]);
    let text = String::from_utf8(top.stdout).unwrap();
    assert!(own(&text, "nap") >= 10.0, "{text}");
}

/// Every interpreter the walker reads (Debian's and pyenv's 3.7+).
fn every_interpreter() -> Vec<(String, PathBuf)> {
    let mut all: Vec<(String, PathBuf)> = VERSIONS
        .iter()
        .filter_map(|v| python(v).map(|p| (v.to_string(), p.launcher)))
        .collect();
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")));
    if let Some(Ok(dir)) = root.map(|r| std::fs::read_dir(r.join("versions"))) {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let mut parts = name.split('.');
            let (Some("3"), Some(minor)) = (parts.next(), parts.next()) else {
                continue;
            };
            let exe = e.path().join(format!("bin/python3.{minor}"));
            if minor.parse::<u32>().is_ok_and(|m| m >= 7) && exe.exists() {
                all.push((format!("pyenv {name}"), exe));
            }
        }
    }
    all
}

#[test]
fn the_walker_sees_which_thread_holds_the_gil() {
    let _one = serial();
    for (version, exe) in every_interpreter() {
        let mut target = Target::spawn(&exe, &[&fixture_script("idle.py"), "wait"]);
        target.wait_for_line("ready");
        let pid = target.pid().to_string();
        // Under load the hand-offs between burn and hash_big leave moments when
        // nobody holds the GIL, so read until burn was seen holding it 5 times.
        let mut burn_held = 0;
        let mut reads = 0;
        while burn_held < 5 && reads < 40 {
            reads += 1;
            let dump = json_of(&run_pyprobe(&["dump", "-p", &pid, "--format", "json"]));
            let threads = dump["threads"].as_array().unwrap();
            let leaf = |t: &Value| {
                t["frames"]
                    .as_array()
                    .and_then(|f| f.last())
                    .map(|f| f["function"].as_str().unwrap().to_owned())
                    .unwrap_or_default()
            };
            let holders: Vec<String> = threads
                .iter()
                .filter(|t| {
                    assert!(t["holds_gil"].is_boolean(), "{version}: known: {t}");
                    t["holds_gil"] == true
                })
                .map(leaf)
                .collect();
            assert!(
                holders.len() <= 1,
                "{version}: one GIL, held by {holders:?}"
            );
            for t in threads {
                let f = leaf(t);
                if f.ends_with("nap") || f.ends_with("poll") {
                    assert_eq!(t["holds_gil"], false, "{version}: {f} sleeps without it");
                }
            }
            burn_held += holders.iter().filter(|h| h.ends_with("burn")).count();
        }
        assert!(
            burn_held >= 5,
            "{version}: burn, spinning in Python, held the GIL in {burn_held} of {reads} reads"
        );
        target.send_line("");
        let (rest, status) = target.finish();
        assert!(
            status.success() && rest.contains("burn"),
            "{version}: {rest}"
        );
    }
}

/// A stopped sample wakes a thread asleep in a system call (the interrupt cuts
/// the call short, and it is restarted when the thread runs on): until it runs
/// and sleeps again the kernel shows it runnable, which on a loaded machine can
/// last to the next tick. Such a thread is stopped out of its wait, its
/// registers say so, and it is counted waiting: with every CPU busy, threads
/// that sleep for the whole run (`deep_sleepers.py`) are never counted on a CPU.
#[test]
fn sleepers_woken_by_the_last_sample_are_not_counted_on_a_cpu_under_load() {
    const SLEEPERS: [&str; 4] = ["wait_on_event", "sleep_long", "select_on_pipe", "read_pipe"];
    let _one = serial();
    for version in ["3.11", "3.15"] {
        let Some(py) = python(version) else { continue };
        let out = TempFile::new(&format!("deep-sleepers-{version}.pyprobe"));
        let busy = Contention::start(&py);
        record(&py.launcher, "deep_sleepers.py", &["3"], &[], &out);
        drop(busy);
        let (mut sleeping, mut working, mut total) = (0, 0, 0);
        for (frames, count) in collapsed_stacks(out.path()) {
            let has = |name: &str| frames.iter().any(|f| f.starts_with(&format!("{name} (")));
            total += count;
            if SLEEPERS.iter().any(|s| has(s)) {
                sleeping += count;
            } else if has("work") {
                working += count;
            }
        }
        let filter = &report(out.path(), &[])["sample_filter"];
        eprintln!(
            "{version}: on a CPU: {working} in work, {sleeping} asleep, of {total}; {filter}"
        );
        assert!(working >= 100, "{version}: {working} samples in work");
        assert!(
            filter["idle_left_out"].as_u64().unwrap() >= working,
            "{version}: the sleepers' samples are left out as idle: {filter}"
        );
        // Their start, before they sleep, may be caught: a sample or two.
        assert!(
            sleeping * 100 <= total,
            "{version}: {sleeping} of {total} on-CPU samples in threads asleep all along"
        );
    }
}

/// Threads that have not run since an earlier tick are not read again: their
/// stacks are those read then. `sleep_phases.py` keeps 300 threads waiting on an
/// event, while one sleeps in turn in phase_a() and, four calls deeper, in
/// phase_b(). With `--idle`, the waiting threads' samples are all in idle_wait,
/// and the phaser's split between its phases as its own clock says: a stack kept
/// past a run of its thread would draw one phase where the other was.
#[test]
fn threads_that_have_not_run_since_the_last_tick_keep_their_stacks() {
    for version in ["3.9", "3.13", "3.15"] {
        let Some(py) = python(version) else { continue };
        let out = TempFile::new(&format!("sleep-phases-{version}.pyprobe"));
        let run = pyprobe()
            .args(["record", "-v", "-o", out.path()])
            .arg("--")
            .arg(&py.launcher)
            .arg(fixture_script("sleep_phases.py"))
            .args(["300", "3"])
            .output()
            .unwrap();
        assert_no_panic("record", &run.stderr);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{version}: {stderr}");
        let spent: Value = serde_json::from_slice(&run.stdout).unwrap();
        let spent_a = spent["phase_a"].as_f64().unwrap();
        let spent_b = spent["phase_b"].as_f64().unwrap();
        let folded = run_pyprobe(&[
            "flame",
            out.path(),
            "--idle",
            "--format",
            "collapsed",
            "-o",
            "-",
        ]);
        let (mut waiting, mut in_a, mut in_b, mut phaser) = (0u64, 0u64, 0u64, 0u64);
        for line in String::from_utf8_lossy(&folded.stdout).lines() {
            let (stack, count) = line.rsplit_once(' ').unwrap();
            let count: u64 = count.parse().unwrap();
            let names: Vec<&str> = stack
                .split(';')
                .map(|f| f.split(" (").next().unwrap())
                .collect();
            let at = |name: &str| names.iter().position(|n| *n == name);
            if at("idle_wait").is_some() {
                waiting += count;
            } else if let Some(p) = at("phaser") {
                phaser += count;
                // Only the loop's own frame may be a leaf outside the phases (between
                // them, a sample of its bookkeeping).
                match &names[p + 1..] {
                    ["phase_a"] => in_a += count,
                    ["phase_b", "descend", "descend", "descend", "descend"] => in_b += count,
                    [] => {}
                    other => panic!("{version}: the phaser at {other:?} ({stack})"),
                }
            }
        }
        let sampled = (in_a + in_b) as f64;
        assert!(sampled > 100.0, "{version}: {in_a} + {in_b} phase samples");
        let (share, truth) = (in_a as f64 / sampled, spent_a / (spent_a + spent_b));
        assert!(
            (share - truth).abs() < 0.15,
            "{version}: phase_a has {share:.2} of the phaser's samples, {truth:.2} of its time"
        );
        assert!(
            phaser - in_a - in_b < phaser / 10,
            "{version}: {phaser} {in_a} {in_b}"
        );
        assert!(
            waiting > 100 * 300,
            "{version}: {waiting} samples of the waiting threads"
        );
        // The waiting threads were not read again at every tick, where the kernel
        // keeps the counts that tell (its scheduler statistics).
        let kept = stderr
            .lines()
            .filter(|l| l.contains("samples were of threads that had not run"))
            .find_map(|l| {
                let (kept, rest) = l.strip_prefix("pyprobe: ")?.split_once(" of the ")?;
                let all = rest.split(' ').next()?;
                Some((kept.parse::<u64>().ok()?, all.parse::<u64>().ok()?))
            })
            .unwrap_or_else(|| panic!("{version}: no line of kept samples: {stderr}"));
        if schedstat_kept() {
            assert!(
                kept.0 * 2 > kept.1,
                "{version}: {} of {} samples kept",
                kept.0,
                kept.1
            );
        }
    }
}

/// Whether this kernel keeps scheduler statistics per thread (`schedstat`).
fn schedstat_kept() -> bool {
    let text = std::fs::read_to_string("/proc/self/schedstat").unwrap_or_default();
    let switched: u64 = text
        .split_whitespace()
        .nth(2)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0);
    if switched == 0 {
        eprintln!("NOTICE: this kernel keeps no scheduler statistics: no stack is kept");
    }
    switched > 0
}
