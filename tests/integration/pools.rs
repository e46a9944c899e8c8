//! Process pools under `--subprocesses`: every worker (forked, forked from a fork
//! server, or spawned: fork and exec of python) is a process of its own in the
//! recording, sampled like the parent, with its pid and command line at the root
//! of its stacks and its functions in its own rows, shares of its own time.
//!
//! * `fixtures/python/pool.py`: workers burn CPU in `worker_burn`, the parent in
//!   `parent_spin`; the fixture prints the pids of the workers that ran tasks.
//! * black from PyPI formatting a directory with two workers.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;
use pyprobe_recording::analyze::processes::ProcessMap;
use pyprobe_recording::recording::{EventKind, RecordingReader};
use serde_json::Value;

/// What `pyprobe record --subprocesses` made of one run.
struct Run {
    recording: TempFile,
    stdout: String,
    stderr: String,
    report: Value,
}

/// A pool whose worker died waits for it for ever: a run gets this long.
const LIMIT: Duration = Duration::from_secs(120);

/// Records `python ARGS` with `--subprocesses` (and `extra`), `env` set. Fails
/// (never hangs) if it takes longer than [`LIMIT`], or if a process crashed.
fn record(py: &Python, name: &str, args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Run {
    let recording = TempFile::new(&format!("pool-{}-{name}.pyprobe", py.version));
    let started = Instant::now();
    let mut child = pyprobe()
        .args(["record", "--subprocesses", "-o", recording.path()])
        .args(extra)
        .arg("--")
        .arg(&py.launcher)
        .args(args)
        .envs(env.iter().copied())
        // A group of its own, so that pyprobe and its target can be ended together.
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run pyprobe record");
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut text);
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = read(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = read(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let ended = crate::support::wait_for(LIMIT, || matches!(child.try_wait(), Ok(Some(_))));
    if !ended {
        // SAFETY: kill(2) on the process group of our own child.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    }
    let status = child.wait().expect("wait for pyprobe");
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    eprintln!(
        "{} {name}: recorded in {:.2} s\n{stderr}",
        py.version,
        started.elapsed().as_secs_f64()
    );
    assert!(
        ended,
        "{} {name}: still running after {LIMIT:?}",
        py.version
    );
    assert_no_panic("record", stderr.as_bytes());
    assert!(status.success(), "{} {name}: record failed", py.version);
    assert!(
        !stderr.contains("was killed by"),
        "{} {name}: a traced process crashed",
        py.version
    );
    let report = report_json(recording.path());
    Run {
        recording,
        stdout,
        stderr,
        report,
    }
}

/// The pids of the workers that ran the tasks, as the fixture prints them.
fn workers(what: &str, run: &Run) -> Vec<u64> {
    run.stdout
        .trim()
        .strip_prefix("workers ")
        .unwrap_or_else(|| panic!("{what}: fixture output {:?}", run.stdout))
        .split(' ')
        .map(|p| p.parse().unwrap())
        .collect()
}

/// The report's processes by pid.
fn processes(report: &Value) -> BTreeMap<u64, &Value> {
    report["processes"]
        .as_array()
        .expect("processes in the report")
        .iter()
        .map(|p| (p["pid"].as_u64().unwrap(), p))
        .collect()
}

/// A process's functions by name, their rows summed: (exclusive share, inclusive ns).
fn functions(process: &Value) -> HashMap<String, (f64, u64)> {
    let mut out: HashMap<String, (f64, u64)> = HashMap::new();
    for f in process["functions"].as_array().unwrap() {
        let e = out
            .entry(f["function"].as_str().unwrap().to_owned())
            .or_default();
        e.0 += f["share"].as_f64().unwrap();
        e.1 += f["inclusive_ns"].as_u64().unwrap();
    }
    out
}

/// Every process's shares add up to the whole of its own time.
fn check_shares(what: &str, report: &Value) {
    for (pid, p) in processes(report) {
        let rows = p["functions"].as_array().unwrap();
        if rows.is_empty() {
            continue;
        }
        let sum: f64 = rows.iter().map(|f| f["share"].as_f64().unwrap()).sum();
        let own: u64 = rows
            .iter()
            .map(|f| f["exclusive_ns"].as_u64().unwrap())
            .sum();
        assert!(
            (sum - 1.0).abs() < 0.005 && own == p["own_ns"].as_u64().unwrap(),
            "{what}: process {pid}: shares add up to {sum}, exclusive times to {own} of {}",
            p["own_ns"]
        );
    }
}

/// The folded stacks of a recording: (outermost frame, innermost frame) per line.
fn folded(path: &str) -> Vec<(String, String)> {
    let out = pyprobe()
        .args(["flame", path, "--format", "collapsed", "-o", "-"])
        .output()
        .expect("run pyprobe flame");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let stack = l.rsplit_once(' ').unwrap().0;
            let frames: Vec<&str> = stack.split(';').collect();
            (
                frames[0].to_owned(),
                frames
                    .last()
                    .unwrap()
                    .split(" (")
                    .next()
                    .unwrap()
                    .to_owned(),
            )
        })
        .collect()
}

/// The pool fixture with `method` on `version`: two workers, each task burning
/// one second.
fn check_pool(version: &'static str, method: &str) {
    let Some(py) = python(version) else { return };
    let what = format!("{version} {method}");
    let script = fixture_script("pool.py");
    let run = record(&py, method, &[&script, method, "2", "2", "1"], &[], &[]);
    let workers = workers(&what, &run);
    assert!(!workers.is_empty(), "{what}: workers ran the tasks");
    let report = &run.report;
    let root = report["target"]["pid"].as_u64().unwrap();
    let procs = processes(report);
    assert_eq!(
        report["processes"][0]["pid"], root,
        "{what}: the recording's own process first"
    );
    // The parent spun in parent_spin, never in worker_burn.
    let parent = functions(procs[&root]);
    assert!(
        parent.contains_key("parent_spin") && !parent.contains_key("worker_burn"),
        "{what}: the parent's functions: {parent:?}"
    );
    for w in &workers {
        let p = procs
            .get(w)
            .unwrap_or_else(|| panic!("{what}: worker {w} is a process of the recording"));
        assert!(p["parent"].is_u64(), "{what}: worker {w} has a parent");
        assert!(
            procs.contains_key(&p["parent"].as_u64().unwrap()),
            "{what}: worker {w}'s parent is traced too"
        );
        let f = functions(p);
        let burn = f.get("worker_burn").map_or(0.0, |b| b.0);
        // A second of burning against the worker's start-up (a spawned worker
        // imports anew) and its wait for a task.
        assert!(
            burn >= 0.3 && !f.contains_key("parent_spin"),
            "{what}: worker {w} spent {burn:.2} of its time in worker_burn: {f:?}"
        );
        assert!(
            p["command"].as_str().unwrap().contains("python"),
            "{what}: worker {w}'s command line: {}",
            p["command"]
        );
    }
    // Its threads are the workers', not the parent's.
    for t in report["threads"].as_array().unwrap() {
        let tid = t["tid"].as_u64().unwrap();
        if workers.contains(&tid) {
            assert_eq!(t["pid"], tid, "{what}: thread {tid} leads its own process");
        }
    }
    check_shares(&what, report);
    // In the flame graph, worker_burn sits under a worker's process frame only.
    let stacks = folded(run.recording.path());
    let burning: Vec<&String> = stacks
        .iter()
        .filter(|(_, leaf)| leaf == "worker_burn")
        .map(|(root, _)| root)
        .collect();
    assert!(
        !burning.is_empty(),
        "{what}: worker_burn in the flame graph"
    );
    for r in burning {
        assert!(
            workers.iter().any(|w| r.starts_with(&format!("pid {w}: "))),
            "{what}: worker_burn under {r}, not under a worker (workers {workers:?})"
        );
    }
    assert!(
        stacks
            .iter()
            .all(|(root, _)| root.starts_with("pid ") && root.contains(": ")),
        "{what}: every stack starts at its process"
    );
    // In the Chrome trace, worker_burn runs in the workers' processes.
    let chrome = TempFile::new(&format!("pool-{version}-{method}.json"));
    let out = pyprobe()
        .args(["flame", run.recording.path(), "--format", "chrome"])
        .args(["-o", chrome.path()])
        .output()
        .expect("run pyprobe flame");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let trace: Value = serde_json::from_slice(&std::fs::read(chrome.path()).unwrap()).unwrap();
    let burning: Vec<u64> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["args"]["function"] == "worker_burn")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    assert!(
        !burning.is_empty() && burning.iter().all(|p| workers.contains(p)),
        "{what}: worker_burn slices in processes {burning:?}, workers {workers:?}"
    );
    // In speedscope, each worker's thread is named with its process.
    let out = pyprobe()
        .args(["flame", run.recording.path(), "--format", "speedscope"])
        .args(["-o", "-"])
        .output()
        .expect("run pyprobe flame");
    let profiles: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = profiles["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    for w in &workers {
        assert!(
            names
                .iter()
                .any(|n| n.starts_with(&format!("pid {w}, main thread ({w})"))),
            "{what}: worker {w} in the speedscope profiles {names:?}"
        );
    }
}

#[test]
fn pool_workers_are_processes_of_their_own_3_9() {
    check_pool("3.9", "fork");
    check_pool("3.9", "spawn");
    check_pool("3.9", "executor-fork");
}

#[test]
fn pool_workers_are_processes_of_their_own_3_11() {
    check_pool("3.11", "fork");
    check_pool("3.11", "executor-spawn");
    check_pool("3.11", "forkserver");
}

#[test]
fn pool_workers_are_processes_of_their_own_3_13() {
    check_pool("3.13", "fork");
    check_pool("3.13", "spawn");
    check_pool("3.13", "forkserver");
}

/// The hook engine follows a fork (the child keeps the hook, with a ring of its
/// own): a pool's forked workers are traced as its spawned ones are, which run a
/// new program and are hooked again; none carries the caveat of an untraced
/// child, and the tasks' calls are counted in the workers that ran them.
#[test]
fn a_hooked_traces_forked_workers_are_traced_3_11_3_13() {
    for version in ["3.11", "3.13"] {
        let Some(py) = python(version) else { continue };
        let script = fixture_script("pool.py");
        let tasks = 4;
        for method in ["fork", "spawn"] {
            let what = format!("{version} trace {method}");
            let run = record(
                &py,
                &format!("hook-{method}"),
                &[&script, method, "2", &tasks.to_string(), "0.1"],
                &["--mode", "trace"],
                &[],
            );
            let workers = workers(&what, &run);
            let caveats = run.report["caveats"].as_array().expect("caveats");
            let procs = processes(&run.report);
            let mut burns = 0;
            for w in &workers {
                let said = caveats.iter().any(|c| {
                    c["pid"] == *w
                        && c["text"]
                            .as_str()
                            .is_some_and(|t| t.contains("calls are not traced"))
                });
                assert!(!said, "{what}: worker {w}: {caveats:?}\n{}", run.stderr);
                let rows = procs
                    .get(w)
                    .and_then(|p| p["functions"].as_array())
                    .cloned()
                    .unwrap_or_default();
                let calls: u64 = rows
                    .iter()
                    .filter(|f| f["function"] == "worker_burn")
                    .map(entries)
                    .sum();
                assert!(calls > 0, "{what}: worker {w} traced: {rows:?}");
                burns += calls;
            }
            assert_eq!(burns, tasks, "{what}: every task counted once");
        }
    }
}

/// Audit events per process of a recording: `builtins.id` events recorded, and
/// audit events counted without being recorded (over the overhead budget).
fn audit_events(path: &str) -> BTreeMap<u32, (u64, u64)> {
    let mut reader = RecordingReader::open(Path::new(path)).expect("open recording");
    let mut processes = ProcessMap::new(reader.header());
    let events: Vec<_> = reader.events().map(|e| e.expect("event")).collect();
    let mut out: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for e in &events {
        processes.push(e);
        let n = match &e.kind {
            EventKind::Audit { event } if reader.string(*event) == "builtins.id" => (1, 0),
            EventKind::AuditsCounted { count } => (0, *count),
            _ => continue,
        };
        let p = out.entry(processes.pid_of(e.tid)).or_default();
        p.0 += n.0;
        p.1 += n.1;
    }
    out
}

/// Four forked workers raising an audit event at each of 100,000 id() calls:
/// each worker gets a ring of its own, where its GC, import and audit probes go
/// (none stays on an int3 that would stop it at each event), and every event is
/// accounted for, in the worker that raised it. Before, a forked child's ring
/// sites were turned back into int3s and each of these events stopped it.
#[test]
fn forked_workers_get_rings_of_their_own_and_every_event_counts() {
    // Several runs: a worker set up as it forks races with the others.
    for version in ["3.9", "3.13", "3.9", "3.13"] {
        let Some(py) = python(version) else { continue };
        let script = fixture_script("pool.py");
        let (pool, ids) = (4u64, 100_000u64);
        let run = record(
            &py,
            "ids",
            &[
                &script,
                "fork",
                &pool.to_string(),
                &pool.to_string(),
                "0.2",
                &ids.to_string(),
            ],
            &["-v"],
            &[],
        );
        let workers: Vec<u32> = run
            .stdout
            .trim()
            .strip_prefix("workers ")
            .unwrap()
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        for w in &workers {
            let ring = format!("ring engine in process {w}: ");
            let line = run
                .stderr
                .lines()
                .find(|l| l.contains(&ring))
                .unwrap_or_else(|| panic!("{version}: worker {w} has no ring: {}", run.stderr));
            assert!(
                line.ends_with(" 0 stay on int3"),
                "{version}: worker {w}: {line}"
            );
        }
        let counts = audit_events(run.recording.path());
        let (mut recorded, mut counted) = (0, 0);
        for w in &workers {
            let (r, c) = counts.get(w).copied().unwrap_or_default();
            recorded += r;
            counted += c;
        }
        // Each task ran in one worker. Counted events are every audit event, a
        // few of other names among them; events pyprobe could not read in time
        // (it got no CPU for longer than a ring lasts) are counted as lost; over
        // the overhead budget, audit events may go uncounted for a while, which
        // the report says.
        let lost = run.report["lost_events"].as_u64().unwrap();
        let uncounted = run.report["thinned"]["uncounted_ns"].as_u64().unwrap_or(0);
        let total = recorded + counted;
        assert!(
            (total + lost >= pool * ids || uncounted > 0) && total < pool * ids + 1_000,
            "{version}: {recorded} id() audit events recorded and {counted} counted in the \
             workers ({lost} lost, {uncounted} ns uncounted), {} made",
            pool * ids
        );
    }
}

/// Copies of black's own sources, for black to reformat.
fn black_input(black: &Path, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pyprobe-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..2 {
        for f in ["linegen.py", "trans.py"] {
            std::fs::copy(black.join("black").join(f), dir.join(format!("{i}_{f}"))).unwrap();
        }
    }
    dir
}

/// black, from PyPI, formatting four files with two workers: the formatting is
/// in the workers' rows, not the parent's, and the output is black's own.
#[test]
fn black_with_workers() {
    let _serial = crate::support::serial();
    let version = "3.11";
    let Some(py) = python(version) else { return };
    let dirs = [
        pypi_pure("black", "24.8.0"),
        pypi("click", "8.1.7"),
        pypi("mypy_extensions", "1.0.0"),
        pypi("packaging", "24.1"),
        pypi("pathspec", "0.12.1"),
        pypi("platformdirs", "4.2.2"),
    ];
    let pythonpath = std::env::join_paths(&dirs).unwrap();
    let pythonpath = pythonpath.to_str().unwrap();
    let cache = std::env::temp_dir().join(format!("pyprobe-{}-black-cache", std::process::id()));
    let args = |dir: &Path| -> Vec<String> {
        ["-m", "black", "-l", "60", "-W", "2", dir.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    // Untraced first, for its output and its time.
    let input = black_input(&dirs[0], "black-untraced");
    let _ = std::fs::remove_dir_all(&cache);
    let started = Instant::now();
    let untraced = Command::new(&py.launcher)
        .args(args(&input))
        .env("PYTHONPATH", pythonpath)
        .env("BLACK_CACHE_DIR", &cache)
        .output()
        .unwrap();
    let untraced_s = started.elapsed().as_secs_f64();
    let untraced_err = String::from_utf8_lossy(&untraced.stderr).into_owned();
    assert!(untraced.status.success(), "black: {untraced_err}");
    assert!(
        untraced_err.contains("4 files reformatted"),
        "{untraced_err}"
    );

    let input = black_input(&dirs[0], "black-traced");
    let _ = std::fs::remove_dir_all(&cache);
    let started = Instant::now();
    let args = args(&input);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cache_s = cache.to_str().unwrap();
    let run = record(
        &py,
        "black",
        &args,
        &[],
        &[("PYTHONPATH", pythonpath), ("BLACK_CACHE_DIR", cache_s)],
    );
    let traced_s = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&cache);
    let _ = std::fs::remove_dir_all(&input);
    eprintln!(
        "black with 2 workers on {version}: {untraced_s:.2} s untraced, {traced_s:.2} s traced"
    );
    assert!(run.stderr.contains("4 files reformatted"), "{}", run.stderr);

    let report = &run.report;
    let root = report["target"]["pid"].as_u64().unwrap();
    let procs = processes(report);
    let formatting = "format_file_in_place";
    let parent = functions(procs[&root]);
    assert!(
        !parent.contains_key(formatting),
        "the parent formats nothing itself: {parent:?}"
    );
    let formatters: Vec<u64> = procs
        .iter()
        .filter(|(_, p)| functions(p).contains_key(formatting))
        .map(|(&pid, _)| pid)
        .collect();
    assert!(
        !formatters.is_empty() && formatters.len() <= 2,
        "black's two workers format: {formatters:?} of {:?}",
        procs.keys().collect::<Vec<_>>()
    );
    for w in &formatters {
        assert_eq!(
            procs[w]["parent"], root,
            "worker {w} is a child of black's process"
        );
    }
    check_shares("black", report);
}

/// `record -p PARENT --subprocesses`: the workers a pool forked before pyprobe
/// came are traced too (as py-spy's `--subprocesses` does), each a process of
/// its own in the report with its samples in its own function, and they run on,
/// unharmed, once pyprobe is gone.
#[test]
fn attached_with_subprocesses_the_existing_workers_are_traced() {
    for version in ["3.9", "3.13"] {
        let Some(py) = python(version) else { continue };
        let code = "import os, sys, time\n\
                    def worker_burn(seconds):\n\
                    \x20   end = time.monotonic() + seconds\n\
                    \x20   n = 0\n\
                    \x20   while time.monotonic() < end:\n\
                    \x20       n += 1\n\
                    \x20   return n\n\
                    pids = []\n\
                    for _ in range(2):\n\
                    \x20   pid = os.fork()\n\
                    \x20   if pid == 0:\n\
                    \x20       os._exit(0 if worker_burn(6) > 0 else 1)\n\
                    \x20   pids.append(pid)\n\
                    print('workers', *pids, flush=True)\n\
                    ok = all(os.waitpid(p, 0)[1] == 0 for p in pids)\n\
                    print('done', ok, flush=True)\n";
        let mut target = Target::spawn(&py.launcher, &["-c", code]);
        let line = target.wait_for_line("workers");
        let workers: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|p| p.parse().unwrap())
            .collect();
        let recording = TempFile::new(&format!("attached-pool-{version}.pyprobe"));
        let tracer = Tracer::record(
            recording.path(),
            &["-p", &target.pid().to_string(), "--subprocesses", "-d", "2"],
        );
        let (status, stderr) = tracer.wait(Duration::from_secs(60));
        assert!(status.success(), "{version}: {stderr}");
        let report = report_json(recording.path());
        let found = processes(&report);
        for worker in &workers {
            let process = found
                .get(worker)
                .unwrap_or_else(|| panic!("{version}: worker {worker} not traced: {stderr}"));
            let (share, _) = functions(process)
                .get("worker_burn")
                .copied()
                .unwrap_or_else(|| panic!("{version}: no worker_burn in {worker}: {process}"));
            assert!(
                share > 0.5,
                "{version}: worker_burn's share {share} in {worker}"
            );
        }
        let (rest, status) = target.finish();
        assert!(rest.contains("done True"), "{version}: {rest}");
        assert!(status.success(), "{version}: {status:?}");
    }
}

/// Existing workers with threads of their own (a threaded server's workers):
/// with `-p` and `--subprocesses`, each thread running at attach is in its own
/// process, as the fixture's children name them, not in the recording's; the
/// parent, which only waits, has none of their work.
#[test]
fn attached_with_subprocesses_each_existing_thread_is_in_its_own_process() {
    for version in ["3.9", "3.13"] {
        let Some(py) = python(version) else { continue };
        let script = fixture_script("threaded_children.py");
        let mut target = Target::spawn(&py.launcher, &[&script, "2", "3", "4"]);
        let mut truth: BTreeMap<u64, u64> = BTreeMap::new();
        for _ in 0..2 {
            let line = target.wait_for_line("child");
            let ids: Vec<u64> = line
                .split_whitespace()
                .skip(1)
                .map(|p| p.parse().unwrap())
                .collect();
            for &tid in &ids {
                truth.insert(tid, ids[0]);
            }
        }
        target.wait_for_line("ready");
        let recording = TempFile::new(&format!("threaded-children-{version}.pyprobe"));
        let tracer = Tracer::record(
            recording.path(),
            &["-p", &target.pid().to_string(), "--subprocesses", "-d", "1"],
        );
        let (status, stderr) = tracer.wait(Duration::from_secs(60));
        assert!(status.success(), "{version}: {stderr}");
        let report = report_json(recording.path());
        let threads: BTreeMap<u64, u64> = report["threads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["tid"].as_u64().unwrap(), t["pid"].as_u64().unwrap()))
            .collect();
        for (tid, pid) in &truth {
            assert_eq!(
                threads.get(tid),
                Some(pid),
                "{version}: thread {tid} of process {pid}: {threads:?}"
            );
        }
        let root = processes(&report)[&(target.pid() as u64)];
        assert!(
            !functions(root).contains_key("child_burn"),
            "{version}: the parent has its children's work: {root}"
        );
        let (rest, status) = target.finish();
        assert!(rest.contains("done"), "{version}: {rest}");
        assert!(status.success(), "{version}: {status:?}");
    }
}
