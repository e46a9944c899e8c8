//! The injected hook engine on interpreters with no function probes (pyenv builds of
//! CPython 3.7 to 3.13, no SDT notes; Debian's 3.11, whose entries do not fire, and
//! 3.13 and 3.14, SDT notes without function probes): `--mode trace` counts calls
//! exactly, launched and attached to, threads started after attaching included; a
//! pyprobe SIGKILLed with the hook installed leaves the target running, correct, and
//! unhooked (the target itself sees sys.monitoring tool 4 free again, or before
//! 3.12 its thread's profile function gone).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::support::*;
use pyprobe_cpython::python::walker::GONE_CODE;

/// The pyenv builds the hook serves: the profile route (3.7 to 3.11) and
/// sys.monitoring (3.12, 3.13).
pub(crate) const MINORS: [u32; 7] = [7, 8, 9, 10, 11, 12, 13];

/// The newest pyenv build of 3.`minor`, or `None` with a notice (a failure under
/// `PYPROBE_REQUIRE_PYTHONS=1`).
pub(crate) fn pyenv(minor: u32) -> Option<PathBuf> {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")))
        .unwrap_or_default();
    let prefix = format!("3.{minor}.");
    let mut found: Vec<PathBuf> = std::fs::read_dir(root.join("versions"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path().join(format!("bin/python3.{minor}")))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    let last = found.pop();
    if last.is_none() {
        missing(&format!(
            "no pyenv build of python 3.{minor} under {}",
            root.display()
        ));
    }
    last
}

/// Every interpreter the hook engine serves here: pyenv 3.7 to 3.13 (no SDT
/// notes), Debian's 3.11 (return probes only), 3.13 and 3.14 (SDT notes, no function
/// probes), and 3.15 (function probes, which `--engine hook` leaves off): calls from
/// the hook, GC, imports and audit events from the probes), each with a label.
pub(crate) fn hook_interpreters() -> Vec<(String, PathBuf)> {
    let mut pythons: Vec<(String, PathBuf)> = MINORS
        .iter()
        .filter_map(|&m| pyenv(m).map(|p| (format!("3.{m}"), p)))
        .collect();
    for minor in ["3.11", "3.13", "3.14", "3.15"] {
        if let Some(debian) = python(minor) {
            pythons.push((format!("Debian {minor}"), debian.launcher));
        }
    }
    pythons
}

/// Asks the target who holds monitoring tool 4 until the answer is `want` (at most
/// `limit`); returns how many times it asked.
pub(crate) fn wait_tool(target: &mut Target, want: &str, limit: Duration) -> usize {
    let start = Instant::now();
    let mut asked = 0;
    loop {
        target.send_line("tool");
        asked += 1;
        let line = target.wait_for_line("tool ");
        if line == format!("tool {want}") {
            return asked;
        }
        assert!(
            start.elapsed() < limit,
            "the target still answers `{line}` after {limit:?}, not `tool {want}`"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `pyprobe record --mode trace -o OUT -- COMMAND`, which must succeed: the
/// program's stdout and pyprobe's stderr.
fn trace_launched(minor: &str, out: &TempFile, command: &[&str]) -> (String, String) {
    let mut argv = vec!["record", "--mode", "trace", "-o", out.path(), "--"];
    argv.extend_from_slice(command);
    let run = run_pyprobe(&argv);
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "{minor}: {stderr}");
    (String::from_utf8_lossy(&run.stdout).into_owned(), stderr)
}

/// `PY fixtures/python/SCRIPT ARGS` under [`trace_launched`].
fn trace_fixture(
    minor: &str,
    py: &Path,
    out: &TempFile,
    script: &str,
    args: &[&str],
) -> (String, String) {
    let py = py.display().to_string();
    let script = fixture_script(script);
    let mut command = vec![py.as_str(), script.as_str()];
    command.extend_from_slice(args);
    trace_launched(minor, out, &command)
}

/// The first line of `stdout` that is a JSON object: a fixture's own counts.
fn json_line(stdout: &str) -> serde_json::Value {
    let line = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .expect("the program's counts");
    serde_json::from_str(line).expect("JSON counts")
}

#[test]
fn launched_counts_match_the_programs_own() {
    for (minor, py) in hook_interpreters() {
        let out = TempFile::new("hook-launch.pyprobe");
        let (stdout, stderr) = trace_fixture(&minor, &py, &out, "count_calls.py", &["3"]);
        assert!(stderr.contains("engine hook"), "{minor}: {stderr}");
        let own = json_line(&stdout);
        let report = report_json(out.path());
        let traced = entries_in_file(&report, "count_calls.py");
        if minor.starts_with("Debian") {
            // The probes still give the other events.
            let imports = report["imports"].as_array().map_or(0, Vec::len);
            assert!(imports > 0, "{minor}: no import events: {report}");
        }
        for (name, n) in own.as_object().expect("object") {
            assert_eq!(
                traced.get(name).copied(),
                n.as_u64(),
                "{minor}: calls of {name}: traced {traced:?}, counted {own}"
            );
        }
        assert_eq!(traced.get("main"), Some(&1), "{minor}: {traced:?}");
        assert_eq!(traced.get("<module>"), Some(&1), "{minor}: {traced:?}");
    }
}

/// Starts `hook_calls.py` under `py`, attaches `pyprobe record --mode trace -p PID
/// -o OUT` to it and waits until the hook holds tool id 4.
pub(crate) fn attach_hooked(py: &std::path::Path, out: &TempFile) -> (Target, Tracer) {
    let mut target = Target::spawn(py, &[&fixture_script("hook_calls.py")]);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let tracer = Tracer::record(out.path(), &["--mode", "trace", "-p", &pid]);
    wait_tool(&mut target, "pyprobe", Duration::from_secs(20));
    (target, tracer)
}

/// How many functions the target's `atexit` holds: the hook's exit callback
/// while it is installed, none before and after.
fn at_exit_functions(target: &mut Target) -> String {
    target.send_line("atexit");
    target.wait_for_line("atexit ")
}

#[test]
fn attached_traces_new_threads_and_raises_exactly_then_unhooks() {
    for minor in MINORS {
        let Some(py) = pyenv(minor) else { continue };
        let out = TempFile::new("hook-attach.pyprobe");
        let (mut target, tracer) = attach_hooked(&py, &out);
        assert_eq!(at_exit_functions(&mut target), "atexit 1", "3.{minor}");
        target.send_line("300 3");
        assert_eq!(target.wait_for_line("calls"), "calls f=300 g=900 worker=3");
        target.send_line("exc 7");
        assert_eq!(target.wait_for_line("raised"), "raised 7");
        tracer.signal(libc::SIGINT);
        let (status, stderr) = tracer.wait(Duration::from_secs(30));
        assert!(status.success(), "3.{minor}: {stderr}");
        // Told to go on detach: the target's next call (this very question) unhooks.
        assert_eq!(wait_tool(&mut target, "None", Duration::from_secs(5)), 1);
        assert_eq!(at_exit_functions(&mut target), "atexit 0", "3.{minor}");
        let calls = entries_in_file(&report_json(out.path()), "hook_calls.py");
        assert_eq!(calls.get("f"), Some(&300), "3.{minor}: {calls:?}");
        assert_eq!(calls.get("g"), Some(&900), "3.{minor}: {calls:?}");
        assert_eq!(calls.get("worker"), Some(&3), "3.{minor}: {calls:?}");
        assert_eq!(calls.get("h"), Some(&7), "3.{minor}: {calls:?}");
        target.send_line("50 1");
        assert_eq!(target.wait_for_line("calls"), "calls f=50 g=50 worker=1");
        let (rest, status) = target.finish();
        assert!(rest.contains("done True"), "3.{minor}: {rest}");
        assert!(status.success());
    }
}

#[test]
fn sigkilled_pyprobe_leaves_the_target_running_and_unhooked() {
    for minor in MINORS {
        let Some(py) = pyenv(minor) else { continue };
        let out = TempFile::new("hook-kill.pyprobe");
        let (mut target, tracer) = attach_hooked(&py, &out);
        target.send_line("100 2");
        assert_eq!(target.wait_for_line("calls"), "calls f=100 g=200 worker=2");
        tracer.signal(libc::SIGKILL);
        let (status, _) = tracer.wait(Duration::from_secs(10));
        assert!(!status.success());
        // The guardian clears the hook's flag; its next callback unregisters it: the
        // tool id is free, its events and callbacks gone (checked inside the target).
        wait_tool(&mut target, "None", Duration::from_secs(10));
        assert_eq!(at_exit_functions(&mut target), "atexit 0", "3.{minor}");
        target.send_line("2000 3");
        assert_eq!(
            target.wait_for_line("calls"),
            "calls f=2000 g=6000 worker=3"
        );
        target.send_line("exc 3");
        assert_eq!(target.wait_for_line("raised"), "raised 3");
        assert_eq!(wait_tool(&mut target, "None", Duration::from_secs(1)), 1);
        let (rest, status) = target.finish();
        assert!(rest.contains("done True"), "3.{minor}: {rest}");
        assert!(
            status.success(),
            "3.{minor}: the target exited with {status:?}"
        );
    }
}

#[test]
fn hook_engine_refuses_in_one_sentence_what_it_cannot_serve() {
    let Some(py) = pyenv(12) else { return };
    let py_s = py.display().to_string();
    let out = TempFile::new("hook-refused.pyprobe");
    assert_refused(
        &[
            "record",
            "--engine",
            "hook",
            "-o",
            out.path(),
            "--",
            &py_s,
            "-c",
            "pass",
        ],
        &["--mode trace"],
    );
}

/// The hook cannot be paused, so no budget can limit its calls: a budgeted trace
/// where the hook would give the calls is refused, not run many times slower
/// under a closing line that says the budget held.
#[test]
fn a_budget_is_refused_where_the_hook_would_give_the_calls() {
    let Some(py) = pyenv(13) else { return };
    let py_s = py.display().to_string();
    let out = TempFile::new("hook-budget.pyprobe");
    for engine in [&[][..], &["--engine", "hook"][..]] {
        let mut args = vec!["record", "--mode", "trace", "--max-overhead", "5"];
        args.extend_from_slice(engine);
        args.extend_from_slice(&["-o", out.path(), "--", &py_s, "-c", "print('ran')"]);
        let run = run_pyprobe(&args);
        assert_refused_output(
            &run,
            &args,
            &["--max-overhead", "hook engine", "default mode"],
        );
        assert!(
            !String::from_utf8_lossy(&run.stdout).contains("ran"),
            "refused before the program ran"
        );
    }
}

#[test]
fn a_forked_child_unhooks_itself_and_writes_nothing_to_the_parents_ring() {
    for minor in MINORS {
        let Some(py) = pyenv(minor) else { continue };
        let mut target = Target::spawn(&py, &[&fixture_script("hook_fork.py")]);
        target.wait_for_line("ready");
        let pid = target.pid().to_string();
        let out = TempFile::new("hook-fork.pyprobe");
        let tracer = Tracer::record(out.path(), &["--mode", "trace", "-p", &pid]);
        // Installed at the target's first Python code: the read below waits in C, so
        // give the installer time to be armed first.
        std::thread::sleep(Duration::from_millis(1500));
        target.send_line("");
        let first = target.wait_for_line("");
        let second = target.wait_for_line("");
        let mut lines = [first, second];
        lines.sort();
        assert_eq!(lines[0], "child 100000 None", "3.{minor}: {lines:?}");
        assert_eq!(lines[1], "parent 1000 pyprobe", "3.{minor}: {lines:?}");
        tracer.signal(libc::SIGINT);
        let (status, stderr) = tracer.wait(Duration::from_secs(30));
        assert!(status.success(), "3.{minor}: {stderr}");
        let calls = entries_in_file(&report_json(out.path()), "hook_fork.py");
        assert_eq!(calls.get("f"), Some(&1000), "3.{minor}: {calls:?}");
        let (_, status) = target.finish();
        assert!(status.success());
    }
}

#[test]
fn an_idle_main_thread_is_said_in_one_sentence_not_waited_on() {
    let Some(py) = pyenv(13) else { return };
    let script = "import sys, time\nprint('ready', flush=True)\ntime.sleep(30)\n";
    let mut target = Target::spawn(&py, &["-c", script]);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let out = TempFile::new("hook-idle.pyprobe");
    let tracer = Tracer::record(out.path(), &["--mode", "trace", "-p", &pid, "-d", "3"]);
    let (status, stderr) = tracer.wait(Duration::from_secs(30));
    assert!(status.success(), "{stderr}");
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("no thread has run Python code"))
        .collect();
    assert_eq!(said.len(), 1, "{stderr}");
    // Left as found: the target still sleeps, and is not stopped.
    assert!(matches!(proc_state(target.pid()), Some('S')));
}

#[test]
fn the_targets_own_cprofile_counts_the_same_traced_or_not() {
    // 3.12+: cProfile holds sys.monitoring's profiler id (2), the hook its own (4),
    // and both count both runs of fib. Before, a thread has one profile function:
    // cProfile takes it over from the hook (said), and gives it back when disabled,
    // so pyprobe counts the second run only.
    let script = "import cProfile, pstats, time\n\
                  def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
                  p = cProfile.Profile(); p.enable(); fib(15); time.sleep(0.5); p.disable()\n\
                  time.sleep(0.5); fib(15)\n\
                  s = pstats.Stats(p)\n\
                  print('fib', [v[1] for k, v in s.stats.items() if k[2] == 'fib'])\n";
    for minor in MINORS {
        let Some(py) = pyenv(minor) else { continue };
        let untraced = std::process::Command::new(&py)
            .args(["-c", script])
            .output()
            .expect("run python");
        let own = String::from_utf8_lossy(&untraced.stdout).into_owned();
        assert_eq!(own.trim(), "fib [1973]", "3.{minor}");
        let out = TempFile::new("hook-cprofile.pyprobe");
        let py_s = py.display().to_string();
        let (stdout, stderr) = trace_launched(&format!("3.{minor}"), &out, &[&py_s, "-c", script]);
        assert_eq!(stdout, own, "3.{minor}");
        let calls = entries_in_file(&report_json(out.path()), "<string>");
        let (want, said) = if minor >= 12 {
            (2 * 1973, 0)
        } else {
            (1973, 1)
        };
        assert_eq!(calls.get("fib"), Some(&want), "3.{minor}: {calls:?}");
        let notices = stderr
            .matches("profile function of the target's own")
            .count();
        assert_eq!(notices, said, "3.{minor}: {stderr}");
    }
}

/// The types each function of `file_suffix` returned, as the report's JSON says,
/// in the fixture's shape: {"f": {"list": 39, "raised": 2}}.
fn return_types_in_file(report: &serde_json::Value, file_suffix: &str) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for row in report["return_types"].as_array().expect("return_types") {
        if !row["file"].as_str().unwrap_or("").ends_with(file_suffix) {
            continue;
        }
        let mut types = serde_json::Map::new();
        for t in row["returned"].as_array().expect("returned") {
            types.insert(t["type"].as_str().expect("type").into(), t["count"].clone());
        }
        if row["raised"].as_u64() != Some(0) {
            types.insert("raised".into(), row["raised"].clone());
        }
        out.insert(row["function"].as_str().expect("name").into(), types.into());
    }
    out.into()
}

/// A program that execs itself is hooked again in its new image: the calls made after
/// `exec` count as exactly as those before (the old image's hook went with it).
#[test]
fn an_exec_is_hooked_afresh_and_every_call_counts() {
    for (minor, py) in hook_interpreters() {
        let out = TempFile::new("hook-exec.pyprobe");
        let (stdout, _) = trace_fixture(&minor, &py, &out, "faults.py", &["script", "0"]);
        assert!(stdout.contains("exec-child fib 233"), "{minor}: {stdout}");
        let calls = entries_in_file(&report_json(out.path()), "faults.py");
        // Before the exec: fib(16), and fib(5) in 200 threads and once more; after
        // it, fib(13). The forked child unhooks itself and counts nothing.
        let fib = |n: u64| {
            2 * [
                0u64, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597,
            ][n as usize + 1]
                - 1
        };
        assert_eq!(
            calls.get("fib"),
            Some(&(fib(16) + 201 * fib(5) + fib(13))),
            "{minor}: {calls:?}"
        );
        assert_eq!(calls.get("exec_child"), Some(&1), "{minor}: {calls:?}");
        assert_eq!(calls.get("leaf"), Some(&(201 * 20)), "{minor}: {calls:?}");
    }
}

#[test]
fn report_shows_the_types_functions_returned_and_how_often_they_raised() {
    for (minor, py) in hook_interpreters() {
        let out = TempFile::new("hook-return-types.pyprobe");
        let (stdout, stderr) = trace_fixture(&minor, &py, &out, "return_types.py", &["2000"]);
        let own = json_line(&stdout);
        let report = report_json(out.path());
        let seen = return_types_in_file(&report, "return_types.py");
        for function in ["f", "g"] {
            assert_eq!(seen[function], own[function], "{minor}: {function}: {seen}");
        }
        // The exit callback is in, though a launched interpreter is hooked while
        // it starts, when `import atexit` cannot work yet.
        assert_eq!(own["atexit"], 1, "{minor}: {stderr}");
        // The table says it in one line per function.
        let table = run_pyprobe(&["report", out.path()]);
        let text = String::from_utf8_lossy(&table.stdout);
        let f = &own["f"];
        let line = format!(
            "): tuple {}, list {}, raised {}",
            f["tuple"], f["list"], f["raised"]
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("Return types for 'f' (") && l.ends_with(&line)),
            "{minor}: no `{line}` line for f in\n{text}"
        );
    }
}

/// Where both engines serve, they count the program's calls the same, and as it
/// does: on Debian's 3.9 the hook (asked for) and the SDT function probes (the
/// default there); on Debian's 3.15 the hook (the default there: a
/// `sys.monitoring` tool costs less than the probes) and the probes (asked for).
#[test]
fn the_hook_and_the_function_probes_count_the_same_calls() {
    for (minor, engines, route) in [
        ("3.9", ["hook", "auto"], "profile function"),
        ("3.15", ["auto", "ring"], "sys.monitoring"),
    ] {
        let Some(py) = python(minor) else { continue };
        let mut counted = Vec::new();
        for (i, engine) in engines.into_iter().enumerate() {
            let out = TempFile::new("hook-vs-probes.pyprobe");
            let script = fixture_script("count_calls.py");
            let launcher = py.launcher.display().to_string();
            let argv = [
                "record",
                "--mode",
                "trace",
                "--engine",
                engine,
                "-o",
                out.path(),
                "--",
                &launcher,
                &script,
                "3",
            ];
            let run = run_pyprobe(&argv);
            let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
            assert!(run.status.success(), "{minor} {engine}: {stderr}");
            let says_hook = stderr.contains(&format!("engine hook for calls ({route})"));
            assert_eq!(says_hook, i == 0, "{minor} {engine}: {stderr}");
            let own = json_line(&String::from_utf8_lossy(&run.stdout));
            let traced = entries_in_file(&report_json(out.path()), "count_calls.py");
            for (name, n) in own.as_object().expect("object") {
                assert_eq!(
                    traced.get(name).copied(),
                    n.as_u64(),
                    "{minor} {engine}: {name}"
                );
            }
            counted.push(traced);
        }
        assert_eq!(counted[0], counted[1], "{minor}");
    }
}

/// Class bodies and methods made from one template, each freed before the next
/// takes its address: every call keeps its own class's name. A body's record
/// carries its name (before 3.12) and its parts cannot tell two such bodies
/// apart; a method named before is named again only after its code object's
/// qualified name was found unchanged.
#[test]
fn code_objects_made_from_one_template_at_one_address_keep_their_own_names() {
    let mut reused_somewhere = false;
    for (minor, py) in hook_interpreters() {
        let out = TempFile::new("hook-template.pyprobe");
        let (stdout, stderr) = trace_fixture(&minor, &py, &out, "template_classes.py", &["100"]);
        assert!(stderr.contains("engine hook"), "{minor}: {stderr}");
        let own = json_line(&stdout);
        reused_somewhere |= own["reused"].as_u64().unwrap_or(0) > 0;
        let traced = entries_in_file(&report_json(out.path()), "<template>");
        for (body, n) in own["bodies"].as_object().expect("bodies") {
            assert_eq!(
                traced.get(body).copied(),
                n.as_u64(),
                "{minor}: calls of class body {body}: traced {traced:?}, counted {own}"
            );
        }
        let methods = own["methods"].as_object().expect("methods");
        let total: u64 = methods.values().filter_map(|n| n.as_u64()).sum();
        if traced.contains_key("K0.m") {
            // Named by their qualified names: each its own.
            for (method, n) in methods {
                assert_eq!(
                    traced.get(method).copied(),
                    n.as_u64(),
                    "{minor}: calls of {method}: traced {traced:?}, counted {own}"
                );
            }
        } else {
            assert_eq!(traced.get("m").copied(), Some(total), "{minor}: {traced:?}");
        }
    }
    assert!(
        reused_somewhere,
        "no interpreter put a method's code object where the last one had been: nothing was tested"
    );
}

/// The calls of each function in `<churn>` by its `co_name` (the last part of a
/// qualified name), and the calls counted under no name at all.
fn churn_counts(report: &serde_json::Value) -> (BTreeMap<String, u64>, u64) {
    let mut by_name = BTreeMap::new();
    for (function, n) in entries_in_file(report, "<churn>") {
        let name = function.rsplit('.').next().unwrap_or(&function).to_owned();
        *by_name.entry(name).or_insert(0) += n;
    }
    let gone = entries_in_file(report, GONE_CODE).values().sum();
    (by_name, gone)
}

/// Code objects made and dropped in a loop (functions made by `exec` under seven
/// names in turn, lambdas, classes made in functions), with no pause: a code
/// object and the strings under it are freed and made again, often at the very
/// same addresses, before pyprobe reads the records. No call may be counted under
/// another function: each function's calls are at most the program's own, and
/// what is missing is counted under the gone name. And since the records carry
/// the names (the SDT ring's always, the hook's at the first call of each code
/// object's parts), every call keeps its own, however late pyprobe reads.
///
/// Before the fix, 3.12 counted `<module>` bodies as `Local` or `make` in every
/// run tried, and 3.11 one function's calls under another in some: the code cache
/// was trusted on pointers that the new object had again, and a name's text was
/// read after its check, while the target ran on.
#[test]
fn code_objects_made_and_dropped_in_a_loop_are_never_counted_under_another_name() {
    let mut pythons = hook_interpreters();
    for minor in ["3.9", "3.15"] {
        if let Some(py) = python(minor) {
            pythons.push((format!("Debian {minor} (ring)"), py.launcher));
        }
    }
    for (label, py) in pythons {
        for round in 0..3 {
            let out = TempFile::new("code-churn.pyprobe");
            let (stdout, stderr) = trace_fixture(&label, &py, &out, "code_churn.py", &["1000"]);
            let own: BTreeMap<String, u64> =
                serde_json::from_value(json_line(&stdout)).expect("own counts");
            let (traced, gone) = churn_counts(&report_json(out.path()));
            for (name, &n) in &traced {
                let counted = own.get(name).copied().unwrap_or(0);
                assert!(
                    n <= counted,
                    "{label} run {round}: {n} calls of {name}, the program made {counted}: \
                     traced {traced:?}, own {own:?}\n{stderr}"
                );
            }
            let (sum_traced, sum_own) = (traced.values().sum::<u64>(), own.values().sum::<u64>());
            assert!(
                sum_traced + gone >= sum_own,
                "{label} run {round}: {sum_traced} named and {gone} gone of {sum_own} calls"
            );
            // None missing either: the records carry the names.
            assert_eq!(traced, own, "{label} run {round}: {gone} gone");
        }
    }
}

/// A program that fetches pyprobe's monitoring callback (`register_callback` hands
/// it out, as tools that chain callbacks rely on) and calls it with what the
/// interpreter never passes (no arguments, a non-code first argument) gets `None`
/// back and runs on; the calls it makes afterwards are counted exactly.
#[test]
fn a_program_calling_the_hooks_callback_with_odd_arguments_runs_on() {
    for (label, py) in monitoring_interpreters() {
        let (out, path) =
            trace_monitoring_fixture(&label, &py, &[], "borrow_callback.py", &["1000"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "builtin_function_or_method None None None None None None\n1000\n",
            "{label}: {stderr}"
        );
        assert!(
            out.status.success() && stderr.contains("target exited with status 0"),
            "{label}: {stderr}"
        );
        let report = report_json(path.to_str().unwrap());
        let calls = entries_in_file(&report, "borrow_callback.py");
        assert_eq!(calls.get("work"), Some(&1000), "{label}: {calls:?}");
        // The callback put back at once: the trace is whole.
        assert_eq!(report["caveats"], serde_json::json!([]), "{label}");
        let _ = std::fs::remove_file(&path);
    }
}

/// The interpreters whose hook is a `sys.monitoring` tool: pyenv 3.12 and 3.13,
/// Debian's 3.13, 3.14 and 3.15, each with a label.
pub(crate) fn monitoring_interpreters() -> Vec<(String, PathBuf)> {
    let mut pythons: Vec<(String, PathBuf)> = [12, 13]
        .iter()
        .filter_map(|&m| pyenv(m).map(|p| (format!("3.{m}"), p)))
        .collect();
    for minor in ["3.13", "3.14", "3.15"] {
        if let Some(debian) = python(minor) {
            pythons.push((format!("Debian {minor}"), debian.launcher));
        }
    }
    pythons
}

/// A program that frees tool 4 while pyprobe holds it and takes it for itself keeps
/// it, its events and its callback when pyprobe leaves: every start of its own
/// function is still counted by its own callback after pyprobe's detach.
#[test]
fn a_program_that_takes_tool_4_keeps_it_when_pyprobe_leaves() {
    for (label, py) in monitoring_interpreters() {
        let (out, path) = trace_monitoring_fixture(&label, &py, &[], "takes_tool.py", &["2.5"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_no_panic(&label, &out.stderr);
        assert!(out.status.success(), "{label}: {stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let said: Vec<&str> = stdout.split_whitespace().collect();
        assert_eq!(said.len(), 3, "{label}: {stdout} {stderr}");
        assert_eq!(said[0], "mine", "{label}: tool 4 after the detach");
        assert!(said[1] != "0", "{label}: {stdout}");
        assert_eq!(
            said[1], said[2],
            "{label}: calls and the program's own count of starts"
        );
        // The trace stopped when the program freed the tool: said, and kept.
        assert_caveat(
            &label,
            &stderr,
            &path,
            "the program freed sys.monitoring tool 4",
        );
        let _ = std::fs::remove_file(&path);
    }
}

/// A program that registers its own callback over pyprobe's cuts the trace short
/// without a record lost: pyprobe says so under the closing line and in the
/// recording, and the program's callback sees every start it should.
#[test]
fn a_program_replacing_the_hooks_callback_is_said_to_cut_the_trace_short() {
    for (label, py) in monitoring_interpreters() {
        let (out, path) =
            trace_monitoring_fixture(&label, &py, &[], "replaces_callback.py", &["1000"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "replaced 1000 1000\n",
            "{label}: {stderr}"
        );
        assert_caveat(
            &label,
            &stderr,
            &path,
            "the program replaced a callback of pyprobe's sys.monitoring tool 4",
        );
        let _ = std::fs::remove_file(&path);
    }
}

/// A program that turns every event of pyprobe's tool off leaves the hook's
/// callbacks no way to run, so no way to give the tool back: pyprobe says the
/// trace was cut short, and gives tool 4 back itself when it leaves, so that the
/// program can take it.
#[test]
fn a_program_turning_the_hooks_events_off_is_said_and_gets_tool_4_back() {
    for (label, py) in monitoring_interpreters() {
        let (out, path) = trace_monitoring_fixture(&label, &py, &[], "silences_tool.py", &["1000"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_no_panic(&label, &out.stderr);
        assert!(out.status.success(), "{label}: {stderr}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "None mine\n",
            "{label}: who held tool 4 after the detach, and whether the program took it\n{stderr}"
        );
        assert_caveat(
            &label,
            &stderr,
            &path,
            "the program turned off events of pyprobe's sys.monitoring tool 4",
        );
        // The hook's backlog of the calls before is read at the detach, and the
        // SDT ring's records after it with it, with the one a thread stopped
        // inside a trampoline was writing: nothing is counted lost.
        let lost = report_json(path.to_str().unwrap())["lost_events"].as_u64();
        assert_eq!(lost, Some(0), "{label}: {stderr}");
        let _ = std::fs::remove_file(&path);
    }
}

/// The same program, pyprobe attached with `-p` and killed (SIGKILL, its whole
/// process group) after it saw the events turned off: the hook will never run
/// again to give the tool back, so pyprobe's guardian does, and the program can
/// take tool 4.
#[test]
fn a_program_turning_the_hooks_events_off_gets_tool_4_back_when_pyprobe_is_killed() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    for (label, py) in monitoring_interpreters() {
        let script = fixture_script("silences_tool.py");
        let mut target = Target::spawn(&py, &[&script, "1000", "stdin"]);
        target.wait_for_line("ready");
        let out = TempFile::new("silenced-killed.pyprobe");
        let mut tracer = pyprobe()
            .args(["record", "--mode", "trace", "--force", "-o", out.path()])
            .args(["-p", &target.pid().to_string()])
            .process_group(0)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run pyprobe");
        // pyprobe's lines, and its guardian's, as they come.
        let (lines, said) = std::sync::mpsc::channel::<String>();
        let stderr = tracer.stderr.take().expect("piped stderr");
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let _ = lines.send(line);
            }
        });
        target.wait_for_line("silenced");
        let mut heard = String::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !heard.contains("the program turned off events") && Instant::now() < deadline {
            if let Ok(line) = said.recv_timeout(Duration::from_millis(100)) {
                heard.push_str(&line);
                heard.push('\n');
            }
        }
        assert!(
            heard.contains("the program turned off events"),
            "{label}: pyprobe did not see the events turned off:\n{heard}"
        );
        // SAFETY: plain kill(2) of the process group pyprobe leads.
        unsafe { libc::kill(-(tracer.id() as i32), libc::SIGKILL) };
        let _ = tracer.wait();
        target.send_line("go on");
        let answer = target.wait_for_line("");
        let _ = reader.join();
        heard.extend(said.try_iter().map(|l| l + "\n"));
        assert_eq!(
            answer, "None mine",
            "{label}: who held tool 4 after pyprobe was killed, and whether the program took \
             it; pyprobe and its guardian said:\n{heard}"
        );
        assert!(
            heard.contains("pyprobe guardian: process")
                && heard.contains("gave sys.monitoring tool 4 back"),
            "{label}: {heard}"
        );
    }
}

/// `pyprobe record --mode trace EXTRA -o PATH -- PY fixtures/python/SCRIPT ARGS`
/// with the recording's path (a name of its own per script and `label`); pyprobe
/// must not panic.
fn trace_monitoring_fixture(
    label: &str,
    py: &Path,
    extra: &[&str],
    script: &str,
    args: &[&str],
) -> (std::process::Output, PathBuf) {
    let path = tmp_path(&format!("{script}-{}.pyprobe", label.replace(' ', "-")));
    let out = pyprobe()
        .args(["record", "--mode", "trace", "--force"])
        .args(extra)
        .arg("-o")
        .arg(&path)
        .arg("--")
        .arg(py)
        .arg(repo().join("fixtures/python").join(script))
        .args(args)
        .output()
        .expect("run pyprobe");
    assert_no_panic(label, &out.stderr);
    (out, path)
}

/// Asserts that pyprobe said a caveat starting with `text` under its closing line
/// (`stderr`) and kept it in the recording at `path`.
fn assert_caveat(label: &str, stderr: &str, path: &Path, text: &str) {
    assert!(
        stderr.contains(&format!("pyprobe: caveat: {text}")),
        "{label}: {stderr}"
    );
    let report = report_json(path.to_str().unwrap());
    assert!(
        report["caveats"]
            .as_array()
            .expect("caveats")
            .iter()
            .any(|c| c["text"].as_str().is_some_and(|t| t.starts_with(text))),
        "{label}: {}",
        report["caveats"]
    );
}
