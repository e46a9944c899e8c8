//! `record --async`: a thread running an asyncio task sampled as the task's
//! logical stack, against the chains `fixtures/python/async_tasks.py` records
//! itself (tasks awaiting tasks through `gather` and `create_task`): on CPython
//! 3.14 and 3.15, which publish asyncio's layout, and on 3.7 to 3.13 (Debian's 3.9,
//! 3.11 and 3.13, and the pyenv builds this machine has), read from asyncio's own
//! objects.

use std::collections::BTreeMap;

use crate::support::*;
use serde_json::Value;

/// Frames that belong to the event loop (and the pure-Python task's own
/// `__step`, `__step_run_and_handle_result`), never to a task's logical stack.
const LOOP_FRAMES: [&str; 5] = ["_run_once", "run_forever", "Handle._run", "_run ", "__step"];

/// What a run gave: pyprobe's stderr, the program's truth, the collapsed stacks
/// (stack, count).
struct Run {
    stderr: String,
    truth: Value,
    stacks: Vec<(String, u64)>,
}

/// The event loop the fixture runs its tasks on, and how it starts them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Loop {
    Asyncio,
    /// uvloop, its compiled wheel for the version on `PYTHONPATH`.
    Uvloop,
    /// asyncio, the workers started in a `TaskGroup` (3.11+) instead of gathered.
    TaskGroup,
    /// asyncio, every task of its pure-Python class (`asyncio.tasks._PyTask`).
    PyTask,
    /// asyncio without its C module: every task and future pure-Python.
    Pure,
}

/// Records `async_tasks.py` (3 workers, 2 s) with `--async`, on `event_loop`.
fn record_async_with(py: &Python, event_loop: Loop) -> Run {
    let version = py.version;
    let name = match event_loop {
        Loop::Asyncio => "asyncio",
        Loop::Uvloop => "uvloop",
        Loop::TaskGroup => "taskgroup",
        Loop::PyTask => "pytask",
        Loop::Pure => "pure",
    };
    let path = tmp_path(&format!("async-tasks-{version}-{name}.pyprobe"));
    let mut cmd = pyprobe();
    cmd.args([
        "record", "--async", "--mode", "sample", "-r", "200", "--force", "-o",
    ])
    .arg(&path)
    .arg("--")
    .arg(&py.launcher)
    .arg(fixture_script("async_tasks.py"))
    .args(["3", "2"]);
    match event_loop {
        Loop::Uvloop => {
            cmd.arg("uvloop").env(
                "PYTHONPATH",
                pypi_compiled("uvloop", UVLOOP, version.trim_start_matches("pyenv-")),
            );
        }
        Loop::TaskGroup | Loop::PyTask | Loop::Pure => {
            cmd.arg(name);
        }
        Loop::Asyncio => {}
    }
    let out = cmd.output().expect("run pyprobe record");
    assert_no_panic("record --async", &out.stderr);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{version}: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let truth: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{version}: the program's truth ({e}): {stdout}"));
    let stacks = collapsed(&path);
    let _ = std::fs::remove_file(&path);
    Run {
        stderr,
        truth,
        stacks,
    }
}

/// The collapsed stacks of the recording at `path`: (stack, count).
fn collapsed(path: &std::path::Path) -> Vec<(String, u64)> {
    collapsed_with(path, &[])
}

/// As [`collapsed`], with `extra` arguments to `flame` (`--idle`).
fn collapsed_with(path: &std::path::Path, extra: &[&str]) -> Vec<(String, u64)> {
    let mut args = vec![
        "flame",
        path.to_str().unwrap(),
        "--format",
        "collapsed",
        "-o",
        "-",
    ];
    args.extend_from_slice(extra);
    let folded = run_pyprobe(&args);
    String::from_utf8_lossy(&folded.stdout)
        .lines()
        .filter_map(|l| {
            let (stack, count) = l.rsplit_once(' ')?;
            Some((stack.to_owned(), count.parse().ok()?))
        })
        .collect()
}

/// The frame names of a collapsed stack (`name (file:line)` each).
fn names(stack: &str) -> Vec<&str> {
    stack
        .split(';')
        .map(|f| f.rsplit_once(" (").map_or(f, |(name, _)| name))
        .collect()
}

/// uvloop's release with wheels for 3.9 to 3.14 (none for 3.15 yet).
const UVLOOP: &str = "0.23.0";

fn check_logical_stacks(version: &'static str) {
    check_logical_stacks_on(version, Loop::Asyncio);
}

fn check_logical_stacks_on(version: &'static str, event_loop: Loop) {
    let Some(py) = python(version) else { return };
    check_logical_stacks_with(&py, event_loop);
}

fn check_logical_stacks_with(py: &Python, event_loop: Loop) {
    let _serial = serial();
    let version = py.version;
    let Run {
        stderr,
        truth,
        stacks,
    } = record_async_with(py, event_loop);
    // The chains the program recorded: fetch-K under worker-K under main's task.
    let expected: Vec<Vec<String>> = truth["chains"]
        .as_object()
        .unwrap()
        .values()
        .map(|chain| {
            let tasks: Vec<&str> = chain
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
                .collect();
            // asyncio's own `Task-N` names are left out of the markers, so that
            // the samples of many unnamed tasks add up.
            assert!(tasks[0].starts_with("Task-"), "{version}: {chain}");
            // An awaiting task stands in each coroutine down to the await on
            // the next task: main in gather_workers, worker in wait_for.
            // CPython 3.7's tasks have no names: every marker is `[task]`.
            let marker = |name: &str| match version.ends_with("3.7") {
                true => "[task]".to_string(),
                false => format!("[task {name}]"),
            };
            vec![
                "[task]".into(),
                "main".into(),
                "gather_workers".into(),
                marker(tasks[1]),
                "worker".into(),
                "wait_for".into(),
                marker(tasks[2]),
                "fetch".into(),
                "crunch".into(),
            ]
        })
        .collect();
    assert_eq!(expected.len(), 3, "{version}: {truth}");
    let mut by_chain: BTreeMap<usize, u64> = BTreeMap::new();
    let (mut crunching, mut whole) = (0u64, 0u64);
    for (stack, count) in &stacks {
        let mut frames = names(stack);
        // The group's own frames between `gather_workers` and the workers
        // (`TaskGroup.__aexit__`, and `TaskGroup._aexit` from 3.13) stand where
        // `gather` has none: a whole chain has them.
        let group_shown = frames.contains(&"TaskGroup.__aexit__");
        if event_loop == Loop::TaskGroup {
            frames.retain(|f| !f.starts_with("TaskGroup."));
        }
        let whole_chain =
            |e: &Vec<String>| frames == *e && (event_loop != Loop::TaskGroup || group_shown);
        if frames.iter().any(|f| f.starts_with("[task ")) {
            assert!(
                !LOOP_FRAMES.iter().any(|l| stack.contains(l)),
                "{version}: the loop's frames in a task's stack: {stack}"
            );
        }
        if frames.last() != Some(&"crunch") {
            continue;
        }
        crunching += count;
        if let Some(i) = expected.iter().position(whole_chain) {
            whole += count;
            *by_chain.entry(i).or_default() += count;
        }
    }
    assert!(
        crunching > 100,
        "{version}: {crunching} samples in crunch: {stderr}"
    );
    assert!(
        whole * 100 >= crunching * 95,
        "{version}: {whole} of {crunching} samples in crunch carry their task's whole chain: \
         {:?}",
        stacks
            .iter()
            .filter(|(s, _)| s.contains("crunch ("))
            .collect::<Vec<_>>()
    );
    // Each task's work is seen under its own chain (3.7's three chains read alike).
    let chains = if version.ends_with("3.7") { 1 } else { 3 };
    assert_eq!(by_chain.len(), chains, "{version}: {by_chain:?}");
    eprintln!("{version}: {whole} of {crunching} samples in crunch with the whole chain");
}

#[test]
fn logical_stacks_of_tasks_awaiting_tasks_on_3_14() {
    check_logical_stacks("3.14");
}

#[test]
fn logical_stacks_of_tasks_awaiting_tasks_on_3_15() {
    check_logical_stacks("3.15");
}

/// Workers started in a `TaskGroup`: each stands under the group's parent task.
#[test]
fn logical_stacks_of_tasks_in_a_task_group_on_3_11_3_13_and_3_14() {
    for version in ["3.11", "3.13", "3.14"] {
        check_logical_stacks_on(version, Loop::TaskGroup);
    }
}

/// uvloop runs asyncio's own C tasks on a Cython loop: the same chains (before
/// 3.14, no `Handle._run` frame shows the running task: asyncio's current tasks
/// do).
#[test]
fn logical_stacks_of_tasks_on_uvloop_3_9_to_3_14() {
    for version in ["3.9", "3.11", "3.13", "3.14"] {
        check_logical_stacks_on(version, Loop::Uvloop);
    }
    for py in legacy_pyenv_builds() {
        if ["3.10", "3.12"].iter().any(|v| py.version.ends_with(v)) {
            check_logical_stacks_with(&py, Loop::Uvloop);
        }
    }
}

/// Every task of asyncio's pure-Python class, made by a task factory: the
/// same chains, read from the tasks' attributes, without their `__step` frames.
/// From 3.14 such a task is not the thread state's current task, and its
/// awaiters' done-callbacks are tuples with a cached hash before their items.
#[test]
fn logical_stacks_of_pure_python_tasks_on_3_7_to_3_15() {
    for version in ["3.9", "3.11", "3.13", "3.14", "3.15"] {
        check_logical_stacks_on(version, Loop::PyTask);
    }
    for py in legacy_pyenv_builds() {
        check_logical_stacks_with(&py, Loop::PyTask);
    }
}

/// asyncio without its C module (as where `_asyncio` is missing): `gather`'s
/// future is pure-Python too, and keeps its done-callbacks in an attribute.
#[test]
fn logical_stacks_without_asyncio_s_c_module_on_3_9_to_3_15() {
    for version in ["3.9", "3.11", "3.13", "3.14", "3.15"] {
        check_logical_stacks_on(version, Loop::Pure);
    }
}

#[test]
fn logical_stacks_of_tasks_awaiting_tasks_on_3_13() {
    check_logical_stacks("3.13");
}

#[test]
fn logical_stacks_of_tasks_awaiting_tasks_on_3_11() {
    check_logical_stacks("3.11");
}

#[test]
fn logical_stacks_of_tasks_awaiting_tasks_on_3_9() {
    check_logical_stacks("3.9");
}

/// The pyenv builds this machine has (3.7, 3.8, 3.10, 3.12: the minor versions
/// Debian's do not cover).
#[test]
fn logical_stacks_of_tasks_awaiting_tasks_on_pyenv_builds() {
    for py in legacy_pyenv_builds() {
        check_logical_stacks_with(&py, Loop::Asyncio);
        if py.version.ends_with("3.12") {
            check_logical_stacks_with(&py, Loop::TaskGroup);
        }
    }
}

#[test]
fn async_with_trace_mode_is_refused_in_one_sentence() {
    let out = run_pyprobe(&["record", "--async", "--mode", "trace", "--", "true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("`--async` draws sampled stacks"),
        "{stderr}"
    );
}

/// An aiohttp server (pure-Python wheels) attached with `-p` while a client loads
/// it: no request fails, and the handlers' samples stand under their request
/// tasks, not under the event loop.
fn check_aiohttp_server(version: &'static str) {
    check_aiohttp_server_with(version, &["--async"]);
}

fn check_aiohttp_server_with(version: &'static str, flags: &[&str]) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let site = pypi_pure_with_deps("aiohttp", "3.14.5");
    let mut server = std::process::Command::new(&py.launcher)
        .arg(fixture_script("aiohttp_server.py"))
        .arg("8")
        .env("PYTHONPATH", &site)
        .env("AIOHTTP_NO_EXTENSIONS", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the server");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(server.stdout.take().unwrap()));
    let ready = lines.next().and_then(Result::ok).unwrap_or_default();
    let port = ready
        .strip_prefix("ready ")
        .unwrap_or_else(|| panic!("{ready:?}"));
    let load = std::process::Command::new(&py.launcher)
        .arg(fixture_script("http_load.py"))
        .args([port, "5", "4", "/items", "/slow"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the load");
    std::thread::sleep(std::time::Duration::from_secs(1));
    let path = tmp_path(&format!("aiohttp-{version}.pyprobe"));
    let pid = server.id().to_string();
    let out = pyprobe()
        .args(["record", "-p", &pid, "-d", "2", "--force"])
        .args(flags)
        .arg("-o")
        .arg(&path)
        .output()
        .expect("run pyprobe");
    assert_no_panic("record -p --async", &out.stderr);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{version}: {stderr}");
    let load = load.wait_with_output().expect("the load's end");
    let counts = String::from_utf8_lossy(&load.stdout);
    assert!(
        counts.starts_with("ok ") && counts.trim_end().ends_with(" failed 0"),
        "{version}: {counts}"
    );
    assert!(server.wait().expect("the server's end").success());
    let stacks = collapsed(&path);
    let (mut handling, mut under_tasks) = (0u64, 0u64);
    for (stack, count) in &stacks {
        let count = *count;
        if stack.contains(";items (") || stack.contains(";slow (") {
            handling += count;
            if stack.starts_with("[task] (<asyncio>);RequestHandler.") {
                under_tasks += count;
            }
        }
        if stack.contains("[task") {
            assert!(
                !LOOP_FRAMES.iter().any(|l| stack.contains(l)),
                "{version}: the loop's frames in a task's stack: {stack}"
            );
        }
    }
    assert!(
        handling > 20,
        "{version}: {handling} samples in the handlers: {stacks:?}"
    );
    assert!(
        under_tasks * 100 >= handling * 95,
        "{version}: {under_tasks} of {handling} handler samples under their task: {stacks:?}"
    );
    if flags.contains(&"--async=all") {
        // What the server waits on: the slow handler's task, in its pause.
        let wall = collapsed_with(&path, &["--idle"]);
        let pausing = wall
            .iter()
            .filter(|(stack, _)| {
                let frames = names(stack);
                frames.starts_with(&["[task]", "RequestHandler.start"])
                    && frames.contains(&"slow")
                    && frames.ends_with(&["sleep", "[sleep]"])
            })
            .count();
        assert!(
            pausing > 0,
            "{version}: no slow handler seen waiting: {wall:?}"
        );
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn an_aiohttp_server_under_load_shows_its_handlers_under_their_tasks_3_14() {
    check_aiohttp_server("3.14");
}

/// `--async=all` on a server under load: no failed request, and the handlers
/// waiting are seen, each under the connection's task.
#[test]
fn an_aiohttp_server_under_load_with_async_all_shows_what_it_waits_on_3_14() {
    check_aiohttp_server_with("3.14", &["--async=all"]);
}

/// Before 3.14 the waiting tasks come from asyncio's own registry, read after
/// each tick lets the threads go: the default mode keeps stopping them, and the
/// handlers' chains stay whole.
#[test]
fn an_aiohttp_server_under_load_with_async_all_shows_what_it_waits_on_3_11() {
    check_aiohttp_server_with("3.11", &["--async=all"]);
}

/// Before 3.14 the running tasks are read from asyncio's own objects.
#[test]
fn an_aiohttp_server_under_load_shows_its_handlers_under_their_tasks_3_13() {
    check_aiohttp_server("3.13");
}

#[test]
fn an_aiohttp_server_under_load_shows_its_handlers_under_their_tasks_3_11() {
    check_aiohttp_server("3.11");
}

#[test]
fn an_aiohttp_server_under_load_shows_its_handlers_under_their_tasks_3_15() {
    check_aiohttp_server("3.15");
}

/// `dump --async` of `async_tasks.py` while it runs: its seven tasks, each under
/// the task that awaits it (through `gather`'s future for the workers), at most
/// one running, the waiting ones at the line they await on.
/// The functions of a task's frames in a `dump --async` JSON, outermost first.
fn functions(task: &Value) -> Vec<&str> {
    task["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["function"].as_str().unwrap())
        .collect()
}

fn check_dump_async(version: &'static str) {
    let Some(py) = python(version) else { return };
    check_dump_async_with(&py);
}

fn check_dump_async_with(py: &Python) {
    check_dump_async_of(py, &[]);
}

/// As [`check_dump_async_with`], every task of asyncio's pure-Python class.
fn check_dump_async_of_pure_python_tasks(py: &Python) {
    check_dump_async_of(py, &["pytask"]);
}

/// From 3.14 asyncio's pure-Python tasks (made by a task factory, or every task
/// where asyncio's C module is missing) are not in the lists pyprobe reads:
/// `dump --async` says so, and the running one stands with its whole chain in
/// its thread's stack.
#[test]
fn dump_async_of_pure_python_tasks_on_3_14_and_3_15_says_they_are_not_listed() {
    let cases = ["3.14", "3.15"]
        .into_iter()
        .flat_map(|v| [(v, "pytask"), (v, "pure")]);
    for (version, kind) in cases {
        let Some(py) = python(version) else { continue };
        let _serial = serial();
        let script = fixture_script("async_tasks.py");
        let mut target = Target::spawn(&py.launcher, &[&script, "3", "3", kind]);
        target.wait_for_line("ready");
        std::thread::sleep(std::time::Duration::from_millis(300));
        // The thread is between two tasks now and then (the loop's own work):
        // a few dumps, until one finds a task running.
        let mut found = None;
        for _ in 0..5 {
            let out = run_pyprobe(&["dump", "-p", &target.pid().to_string(), "--async"]);
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "{version} {kind}: {stderr}");
            if stderr.contains("pure-Python tasks (asyncio.tasks._PyTask) are not listed") {
                found = Some((String::from_utf8_lossy(&out.stdout).into_owned(), stderr));
                break;
            }
        }
        // Dumped: ended here, not after its run (it would hold the other tests up).
        drop(target);
        let (stdout, stderr) =
            found.unwrap_or_else(|| panic!("{version} {kind}: no note in 5 dumps"));
        assert!(
            stderr.contains("those running now (1)"),
            "{version} {kind}: {stderr}"
        );
        // The crunching fetch task under its worker under main's task.
        let markers: Vec<&str> = stdout
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("[task"))
            .collect();
        assert!(
            markers.len() == 3
                && markers[0] == "[task]"
                && markers[1].starts_with("[task worker-")
                && markers[2].starts_with("[task fetch-"),
            "{version} {kind}: {stdout}"
        );
    }
}

/// `--async=all` of pure-Python tasks on 3.14: the waiting ones cannot be
/// listed, and the recording says so; with asyncio's C tasks it does not.
#[test]
fn async_all_of_pure_python_tasks_on_3_14_says_the_waiting_ones_are_missing() {
    let Some(py) = python("3.14") else { return };
    let _serial = serial();
    for (extra, said) in [(&["pytask"][..], true), (&[][..], false)] {
        let out = TempFile::new("async-all-pytask-3.14.pyprobe");
        let run = pyprobe()
            .args([
                "record",
                "--async=all",
                "--mode",
                "sample",
                "-o",
                out.path(),
            ])
            .arg("--")
            .arg(&py.launcher)
            .arg(fixture_script("async_tasks.py"))
            .args(["3", "1"])
            .args(extra)
            .output()
            .expect("run pyprobe");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{extra:?}: {stderr}");
        assert_eq!(
            stderr.contains("the waiting ones cannot be listed"),
            said,
            "{extra:?}: {stderr}"
        );
    }
}

/// asyncio without its C module before 3.14: every task is listed from
/// asyncio's registry, each under its awaiter (`gather`'s future pure-Python).
#[test]
fn dump_async_lists_every_task_without_asyncio_s_c_module_before_3_14() {
    for version in ["3.9", "3.13"] {
        if let Some(py) = python(version) {
            check_dump_async_of(&py, &["pure"]);
        }
    }
}

/// `dump --async` of the fixture run with `extra` arguments.
fn check_dump_async_of(py: &Python, extra: &[&str]) {
    let _serial = serial();
    let version = py.version;
    let script = fixture_script("async_tasks.py");
    let mut args = vec![script.as_str(), "3", "4"];
    args.extend_from_slice(extra);
    let mut target = Target::spawn(&py.launcher, &args);
    target.wait_for_line("ready");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let pid = target.pid().to_string();
    let out = run_pyprobe(&["dump", "-p", &pid, "--async", "--format", "json"]);
    let text = run_pyprobe(&["dump", "-p", &pid, "--async"]);
    // Dumped: ended here, not after its run (it would hold the other tests up).
    drop(target);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump: Value = serde_json::from_slice(&out.stdout).expect("dump's JSON");
    let tasks = dump["asyncio_tasks"].as_array().expect("asyncio_tasks");
    assert_eq!(tasks.len(), 7, "{version}: {tasks:?}");
    check_task_tree(version, tasks);
    let running = tasks.iter().filter(|t| t["running"] == true).count();
    assert!(running <= 1, "{version}: {running} running");
    if version.ends_with("3.7") {
        // 3.7's tasks have no names: the tree's shape is all there is.
        return;
    }
    let by_name: BTreeMap<&str, &Value> = tasks
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t))
        .collect();
    let address = |name: &str| by_name[name]["address"].clone();
    let main = tasks
        .iter()
        .find(|t| t["named_by_program"] == false)
        .expect("main's task, named by asyncio");
    assert!(main["awaited_by"].is_null(), "{main}");
    for k in 0..3 {
        let (worker, fetch) = (format!("worker-{k}"), format!("fetch-{k}"));
        assert_eq!(
            by_name[worker.as_str()]["awaited_by"],
            main["address"],
            "{worker}"
        );
        assert_eq!(
            by_name[fetch.as_str()]["awaited_by"],
            address(&worker),
            "{fetch}"
        );
        let frames = by_name[fetch.as_str()]["frames"].as_array().unwrap();
        assert_eq!(frames[0]["function"], "fetch", "{fetch}: {frames:?}");
        // A waiting task stands in each coroutine it awaits through.
        assert_eq!(
            functions(by_name[worker.as_str()]),
            ["worker", "wait_for"],
            "{worker}"
        );
    }
    assert_eq!(functions(main), ["main", "gather_workers"], "{main}");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("\n    worker-0 (") && text.contains("\n      fetch-0 ("),
        "{version}: {text}"
    );
}

/// The shape of the fixture's tasks, names aside: main's task awaited by none,
/// in `gather_workers`; three workers under it, each in `wait_for`; one fetch
/// task under each worker.
fn check_task_tree(version: &str, tasks: &[Value]) {
    let roots: Vec<&Value> = tasks.iter().filter(|t| t["awaited_by"].is_null()).collect();
    assert_eq!(roots.len(), 1, "{version}: {tasks:?}");
    assert_eq!(functions(roots[0]), ["main", "gather_workers"], "{version}");
    let under = |parent: &Value| -> Vec<&Value> {
        tasks
            .iter()
            .filter(|t| t["awaited_by"] == parent["address"])
            .collect()
    };
    let workers = under(roots[0]);
    assert_eq!(workers.len(), 3, "{version}: {tasks:?}");
    for worker in workers {
        if worker["running"] == false {
            assert_eq!(functions(worker), ["worker", "wait_for"], "{version}");
        }
        let fetches = under(worker);
        assert_eq!(fetches.len(), 1, "{version}: {worker}");
        assert_eq!(functions(fetches[0])[0], "fetch", "{version}");
    }
}

/// Before 3.14, every task is read from asyncio's own registry: Debian's 3.9,
/// 3.11 and 3.13, and the pyenv builds this machine has.
#[test]
fn dump_async_lists_every_task_under_its_awaiter_before_3_14() {
    before_3_14(check_dump_async_with);
}

/// The pure-Python tasks, read from their attributes, before 3.14.
#[test]
fn dump_async_lists_every_pure_python_task_under_its_awaiter_before_3_14() {
    before_3_14(check_dump_async_of_pure_python_tasks);
}

/// Runs `check` with Debian's 3.9, 3.11 and 3.13 and the pyenv builds of the
/// versions they do not cover.
fn before_3_14(check: fn(&Python)) {
    for version in ["3.9", "3.11", "3.13"] {
        if let Some(py) = python(version) {
            check(&py);
        }
    }
    for py in legacy_pyenv_builds() {
        check(&py);
    }
}

/// The pyenv builds of the versions Debian's do not cover (3.7, 3.8, 3.10, 3.12).
fn legacy_pyenv_builds() -> Vec<Python> {
    pyenv_builds()
        .into_iter()
        .filter(|(version, _)| ["3.7", "3.8", "3.10", "3.12"].contains(&version.as_str()))
        .map(|(version, exe)| pyenv_python(&version, exe))
        .collect()
}

#[test]
fn dump_async_lists_every_task_under_its_awaiter_on_3_14() {
    check_dump_async("3.14");
}

#[test]
fn dump_async_lists_every_task_under_its_awaiter_on_3_15() {
    check_dump_async("3.15");
}

/// `--async=all` on the fixture: at each tick, besides the thread running a task,
/// every task that waits is a sample of its own, off-CPU, ending in what it awaits:
/// main in `gather_workers` on gather's future, each worker in `wait_for` on its
/// fetch task, each fetch (between rounds) in `asyncio.sleep`. The chains are the
/// ones the program recorded; the default (on-CPU) view leaves them out.
fn check_async_all(version: &'static str) {
    let Some(py) = python(version) else { return };
    check_async_all_with(&py);
}

fn check_async_all_with(py: &Python) {
    check_async_all_of(py, &[]);
}

/// As [`check_async_all_with`], every task of asyncio's pure-Python class (a
/// worker awaits its fetch task through the generator of the task's
/// `__await__`: still `[awaiting Task]`).
fn check_async_all_of_pure_python_tasks(py: &Python) {
    check_async_all_of(py, &["pytask"]);
}

/// `record --async=all` of the fixture run with `extra` arguments.
fn check_async_all_of(py: &Python, extra: &[&str]) {
    let _serial = serial();
    let version = py.version;
    // 3.7's tasks have no names: every marker is `[task]`.
    let marker = |name: &str| match version.ends_with("3.7") {
        true => "[task]".to_string(),
        false => format!("[task {name}]"),
    };
    let path = tmp_path(&format!("async-all-{version}{}.pyprobe", extra.concat()));
    let out = pyprobe()
        .args([
            "record",
            "--async=all",
            "--mode",
            "sample",
            "-r",
            "200",
            "--force",
            "-o",
        ])
        .arg(&path)
        .arg("--")
        .arg(&py.launcher)
        .arg(fixture_script("async_tasks.py"))
        .args(["3", "2"])
        .args(extra)
        .output()
        .expect("run pyprobe record");
    assert_no_panic("record --async=all", &out.stderr);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{version}: {stderr}");
    assert!(
        stderr.contains("off-CPU samples") && stderr.contains("--idle"),
        "{version}: how to see them is said: {stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let truth: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{version}: the program's truth ({e}): {stdout}"));
    let stacks = collapsed_with(&path, &["--idle"]);
    let on_cpu = collapsed(&path);
    let _ = std::fs::remove_file(&path);
    let count = |expected: &[String]| -> u64 {
        stacks
            .iter()
            .filter(|(s, _)| names(s) == expected)
            .map(|(_, n)| n)
            .sum()
    };
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let main_waits = count(&strings(&[
        "[task]",
        "main",
        "gather_workers",
        "[awaiting _GatheringFuture]",
    ]));
    // A tick reads the tasks it has time for (before 3.14, from asyncio's own
    // objects, fewer): main is seen waiting in a tick of four at the least.
    assert!(
        main_waits > 50,
        "{version}: main waited in {main_waits} samples: {stacks:?}"
    );
    // 3.7's three workers read alike (no names): their samples add up.
    let alike = if version.ends_with("3.7") { 3 } else { 1 };
    for chain in truth["chains"].as_object().unwrap().values() {
        let (worker, fetch) = (chain[1].as_str().unwrap(), chain[2].as_str().unwrap());
        let head = [
            "[task]".to_string(),
            "main".into(),
            "gather_workers".into(),
            marker(worker),
            "worker".into(),
            "wait_for".into(),
        ];
        let mut waits = head.to_vec();
        waits.push("[awaiting Task]".into());
        let worker_waits = count(&waits);
        // Each worker waits as long as main does, less the ticks before it began
        // (a tick cut short by its time budget takes the next tasks first at the
        // next tick: a few either way).
        assert!(
            worker_waits * 100 >= main_waits * alike * 90
                && worker_waits * 100 <= main_waits * alike * 110,
            "{version}: {worker} waited in {worker_waits} samples, main in {main_waits}"
        );
        let mut sleeps = head.to_vec();
        sleeps.extend(strings(&[&marker(fetch), "fetch", "sleep", "[sleep]"]));
        assert!(
            count(&sleeps) > 0,
            "{version}: {fetch} never seen between rounds: {stacks:?}"
        );
    }
    for (stack, _) in &stacks {
        if stack.contains("[awaiting") || stack.contains("[sleep]") {
            assert!(
                !LOOP_FRAMES.iter().any(|l| stack.contains(l)),
                "{version}: the loop's frames in a waiting task's stack: {stack}"
            );
        }
    }
    // Off-CPU: the default view has none of them.
    assert!(
        on_cpu
            .iter()
            .all(|(s, _)| !s.contains("[awaiting") && !s.contains("[sleep]")),
        "{on_cpu:?}"
    );
}

#[test]
fn async_all_samples_every_waiting_task_on_3_14() {
    check_async_all("3.14");
}

#[test]
fn async_all_samples_every_waiting_task_on_3_15() {
    check_async_all("3.15");
}

/// Before 3.14, the waiting tasks are read from asyncio's own registry.
#[test]
fn async_all_samples_every_waiting_task_before_3_14() {
    before_3_14(check_async_all_with);
}

#[test]
fn async_all_samples_every_waiting_pure_python_task_before_3_14() {
    before_3_14(check_async_all_of_pure_python_tasks);
}

/// `dump --async` of a process with 30,001 tasks: the threads are held for a
/// bounded time, the tasks past it read with the process running, and every
/// task is listed under its awaiter (each leaf under its parent, through
/// `gather`'s future).
fn check_dump_async_of_many_tasks(version: &'static str) {
    let _serial = serial();
    let Some(py) = python(version) else { return };
    let parents = 10_000;
    let mut target = std::process::Command::new(&py.launcher)
        .arg(fixture_script("many_tasks.py"))
        .arg(parents.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the target");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(target.stdout.take().unwrap()));
    assert_eq!(lines.next().and_then(Result::ok).as_deref(), Some("ready"));
    let pid = target.id().to_string();
    let out = run_pyprobe(&["dump", "-p", &pid, "--async", "--format", "json"]);
    let _ = target.kill();
    let _ = target.wait();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{version}: {stderr}");
    assert!(
        stderr.contains("asyncio tasks read while its threads were held")
            && stderr.contains("with it running"),
        "{version}: the hold is bounded and says so: {stderr}"
    );
    let dump: Value = serde_json::from_slice(&out.stdout).expect("dump's JSON");
    let tasks = dump["asyncio_tasks"].as_array().expect("asyncio_tasks");
    assert_eq!(tasks.len(), parents * 3 + 1, "{version}");
    let children: BTreeMap<String, usize> =
        tasks.iter().fold(BTreeMap::new(), |mut by_parent, t| {
            *by_parent.entry(t["awaited_by"].to_string()).or_default() += 1;
            by_parent
        });
    // main's task awaits the parents; each parent its two leaves; none awaits main.
    let main = tasks
        .iter()
        .find(|t| functions(t).first() == Some(&"main"))
        .expect("main's task");
    assert_eq!(children[&main["address"].to_string()], parents, "{version}");
    assert_eq!(children["null"], 1, "{version}");
    let leaves_placed = tasks
        .iter()
        .filter(|t| functions(t).first() == Some(&"parent"))
        .all(|p| children.get(&p["address"].to_string()) == Some(&2));
    assert!(
        leaves_placed,
        "{version}: every parent awaits its two leaves"
    );
}

#[test]
fn dump_async_of_30_001_tasks_holds_the_threads_briefly_and_lists_them_all() {
    for version in ["3.13", "3.14"] {
        check_dump_async_of_many_tasks(version);
    }
}
