//! The frame walker and `pyprobe dump` against real interpreters: Debian's 3.9, 3.11,
//! 3.13, 3.14 and 3.15, and every pyenv-style build on the machine. The fixture
//! `sleeper.py` prints the stacks it is in (files, functions, first and current lines,
//! native thread ids); pyprobe must see exactly those.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::*;
use pyprobe_cpython::python::walker::{lines, ThreadStack, Walker};
use serde_json::{json, Value};

fn fixture(name: &str) -> String {
    repo()
        .join("fixtures/python")
        .join(name)
        .display()
        .to_string()
}

/// (file, function, first line, line) per frame, outermost first.
type Frames = Vec<(String, String, u64, u64)>;

struct Expected {
    main_tid: Option<i64>,
    main: Frames,
    worker_tid: Option<i64>,
    worker: Frames,
}

fn frames_of(value: &Value) -> Frames {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f[0].as_str().unwrap().to_owned(),
                f[1].as_str().unwrap().to_owned(),
                f[2].as_u64().unwrap(),
                f[3].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Starts the sleeper under `python` and reads what it expects.
fn start_sleeper(python: &Path) -> (Target, Expected) {
    let mut target = Target::spawn(python, &[&fixture("sleeper.py")]);
    let line = target.wait_for_line("expect ");
    let v: Value = serde_json::from_str(&line["expect ".len()..]).unwrap();
    let expected = Expected {
        main_tid: v["main"]["tid"].as_i64(),
        main: frames_of(&v["main"]["frames"]),
        worker_tid: v["worker"]["tid"].as_i64(),
        worker: frames_of(&v["worker"]["frames"]),
    };
    (target, expected)
}

fn dump_frames(thread: &Value) -> Frames {
    thread["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["file"].as_str().unwrap().to_owned(),
                f["function"].as_str().unwrap().to_owned(),
                f["first_line"].as_u64().unwrap(),
                f["line"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Whether a `dump --format json` shows the sleeper's two stacks exactly.
fn matches(dump: &Value, want: &Expected) -> Result<(), String> {
    let threads = dump["threads"].as_array().ok_or("no threads")?;
    if threads.len() != 2 {
        return Err(format!("{} threads", threads.len()));
    }
    let (main, worker) = (&threads[0], &threads[1]);
    if dump_frames(main) != want.main {
        return Err(format!("main stack {:?}", dump_frames(main)));
    }
    let got = dump_frames(worker);
    if got.len() < want.worker.len() || got[got.len() - want.worker.len()..] != want.worker[..] {
        return Err(format!("worker stack {got:?}"));
    }
    // Above the worker's own frames: threading's bootstrap.
    let bootstrap = &got[..got.len() - want.worker.len()];
    if bootstrap.is_empty() || !bootstrap.iter().all(|f| f.0.ends_with("/threading.py")) {
        return Err(format!("worker's outer frames {bootstrap:?}"));
    }
    if main["truncated"] != false || worker["truncated"] != false {
        return Err("a stack is flagged truncated".into());
    }
    Ok(())
}

/// Dumps until the sleeper's stacks are seen (it may still be printing), or fails.
fn dump_until_matching(pid: i32, want: &Expected) -> (Value, String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = pyprobe()
            .args(["dump", "-v", "-p", &pid.to_string(), "--format", "json"])
            .output()
            .expect("run pyprobe");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "pyprobe dump failed: {stderr}");
        let dump: Value = serde_json::from_slice(&out.stdout).expect("dump JSON");
        match matches(&dump, want) {
            Ok(()) => return (dump, stderr),
            Err(why) if Instant::now() > deadline => {
                panic!("dump never showed the expected stacks: {why}\n{dump:#}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn live_tids(pid: i32) -> Vec<i64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The whole check for one interpreter; `layout` is what stderr must name.
fn check_dump(python: &Path, version: &str, layout: &str) {
    let (mut target, want) = start_sleeper(python);
    let pid = target.pid();
    let (dump, stderr) = dump_until_matching(pid, &want);
    assert!(
        stderr.contains(&format!("python {version}")) && stderr.contains(layout),
        "stderr should name {version} and {layout}: {stderr}"
    );
    assert_eq!(dump["pid"], pid);
    assert!(dump["python"].as_str().unwrap().starts_with(version));
    let threads = dump["threads"].as_array().unwrap();
    let (main_tid, worker_tid) = (
        threads[0]["native_tid"].as_i64(),
        threads[1]["native_tid"].as_i64(),
    );
    // Native ids: as the fixture printed them (3.8+ has threading.get_native_id), else
    // at least the process's own and a live task of it.
    assert_eq!(main_tid, Some(pid as i64), "main thread tid");
    assert_eq!(
        (&threads[0]["main"], &threads[1]["main"]),
        (&json!(true), &json!(false))
    );
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
    assert_eq!(threads[0]["name"], comm.trim_end());
    match (want.main_tid, want.worker_tid) {
        (Some(m), Some(w)) => {
            assert_eq!(main_tid, Some(m));
            assert_eq!(worker_tid, Some(w));
        }
        _ => assert!(live_tids(pid).contains(&worker_tid.expect("worker tid"))),
    }
    // The text format: like a traceback, innermost last; with `--full-paths`, the
    // files as the interpreter names them; and nothing on stderr without `-v`.
    let out = pyprobe()
        .args(["dump", "-p", &pid.to_string(), "--full-paths"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
    let text = String::from_utf8_lossy(&out.stdout);
    let main_block = text.split("\n\n").next().unwrap();
    let expected_lines: Vec<String> = want
        .main
        .iter()
        .map(|(file, function, _, line)| format!("  File \"{file}\", line {line}, in {function}"))
        .collect();
    let got_lines: Vec<&str> = main_block.lines().skip(1).collect();
    assert_eq!(got_lines, expected_lines, "text dump:\n{text}");
    assert!(
        main_block.starts_with(&format!("Thread tid {pid}, the main thread, ident ")),
        "{main_block}"
    );
    // By default, short paths: the standard library's files by their own name.
    let short = run_pyprobe(&["dump", "-p", &pid.to_string()]);
    let short = String::from_utf8_lossy(&short.stdout);
    assert!(!short.contains(".pythons/"), "{short}");
    assert!(short.contains("File \"threading.py\""), "{short}");
    target.send_line("");
    let (rest, status) = target.finish();
    assert!(status.success() && rest.contains("done"), "target: {rest}");
}

fn debian(version: &'static str, layout: &str) {
    if let Some(py) = python(version) {
        check_dump(&py.launcher, version, layout);
    }
}

#[test]
fn dump_debian_3_9() {
    debian("3.9", "offsets table offsets/3.9.json");
}

#[test]
fn dump_debian_3_11() {
    debian("3.11", "offsets table offsets/3.11.json");
}

#[test]
fn dump_debian_3_13() {
    debian("3.13", "_Py_DebugOffsets read from the target");
}

#[test]
fn dump_debian_3_14() {
    debian("3.14", "_Py_DebugOffsets read from the target");
}

#[test]
fn dump_debian_3_15() {
    debian("3.15", "_Py_DebugOffsets read from the target");
}

#[test]
fn dump_pyenv_builds() {
    let builds = pyenv_builds();
    if builds.is_empty() {
        eprintln!(
            "NOTICE: skipping: no pyenv-style builds ($PYENV_ROOT/versions/*) on this machine"
        );
        return;
    }
    for (version, exe) in builds {
        let minor: u32 = version.split('.').nth(1).unwrap().parse().unwrap();
        let shared = exe
            .parent()
            .and_then(|b| b.parent())
            .map(|d| d.join("lib"))
            .and_then(|lib| std::fs::read_dir(lib).ok())
            .is_some_and(|mut d| {
                d.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("libpython")))
            });
        eprintln!(
            "pyenv build {} ({})",
            exe.display(),
            if shared { "shared libpython" } else { "static" }
        );
        if !version.starts_with("3.") || minor < 7 {
            // No _PyRuntime before 3.7: a clear refusal, not a crash.
            if version.starts_with("3.") {
                let mut target = Target::spawn(&exe, &["-c", WAITING_SCRIPT]);
                target.wait_for_line("ready");
                let out = run_pyprobe(&["dump", "-p", &target.pid().to_string()]);
                assert_eq!(out.status.code(), Some(1));
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    err.contains("does not support") && err.contains("3.7+"),
                    "{err}"
                );
                // Launched: the program runs as it would, and the closing line says
                // which interpreter could not be read.
                let recording = TempFile::new(&format!("old-{version}.pyprobe"));
                let out = run_pyprobe(&[
                    "record",
                    "--mode",
                    "trace",
                    "-o",
                    recording.path(),
                    "--",
                    exe.to_str().unwrap(),
                    "-c",
                    "print('ran')",
                ]);
                let err = String::from_utf8_lossy(&out.stderr);
                assert_eq!(out.status.code(), Some(0), "{err}");
                assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ran");
                assert!(
                    err.contains("nothing recorded") && err.contains(&format!("python {version}")),
                    "names the interpreter it could not read: {err}"
                );
            } else {
                eprintln!(
                    "NOTICE: skipping python {version} ({}): not Python 3",
                    exe.display()
                );
            }
            continue;
        }
        let layout = if minor >= 13 {
            "_Py_DebugOffsets read from the target".to_owned()
        } else {
            format!("offsets table offsets/{version}.json")
        };
        check_dump(&exe, &version, &layout);
    }
}

/// The library API: `stacks()`, `thread_stack(tid)`, and the cost of a full read.
#[test]
fn walker_api_and_cost() {
    for (version, python) in all_interpreters() {
        let (_target, want) = start_sleeper(&python);
        let pid = _target.pid();
        let mut walker = Walker::attach(pid).unwrap();
        assert!(walker.version().to_string().starts_with(&version));
        let deadline = Instant::now() + Duration::from_secs(10);
        let stacks: Vec<ThreadStack> = loop {
            let stacks = walker.stacks().unwrap();
            let main: Frames = stacks[0]
                .frames
                .iter()
                .map(|f| {
                    (
                        f.file.to_string(),
                        f.function.to_string(),
                        u64::from(f.first_line),
                        u64::from(f.line),
                    )
                })
                .collect();
            if main == want.main && stacks.len() == 2 {
                break stacks;
            }
            assert!(Instant::now() < deadline, "{version}: {stacks:#?}");
            std::thread::sleep(Duration::from_millis(50));
        };
        let worker_tid = stacks[1].native_tid.expect("worker tid");
        let one = walker
            .thread_stack(worker_tid)
            .unwrap()
            .expect("worker by tid");
        assert_eq!(one.frames, stacks[1].frames);
        assert_eq!(one.thread_state, stacks[1].thread_state);
        assert!(walker.thread_stack(i32::MAX).unwrap().is_none());

        let rounds = 2000;
        let start = Instant::now();
        for _ in 0..rounds {
            let s = walker.stacks().unwrap();
            assert_eq!(s.len(), 2);
        }
        let per = start.elapsed() / rounds;
        let frames: usize = stacks.iter().map(|s| s.frames.len()).sum();
        let start = Instant::now();
        for _ in 0..rounds {
            walker
                .thread_stack(pid)
                .unwrap()
                .expect("main thread by tid");
        }
        let per_main = start.elapsed() / rounds;
        let build = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        eprintln!(
            "python {version}: {per:?} per stacks() ({} threads, {frames} frames), \
             {per_main:?} per thread_stack() of the main thread ({} frames); {build} build",
            stacks.len(),
            stacks[0].frames.len(),
        );
    }
}

/// The line-table decoders give, for every instruction of thousands of real code
/// objects, the line the interpreter itself gives.
#[test]
fn line_tables_match_the_interpreter() {
    for (version, python) in all_interpreters() {
        let minor: u32 = version.split('.').nth(1).unwrap().parse().unwrap();
        let out = std::process::Command::new(&python)
            .arg(fixture("line_tables.py"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (mut codes, mut checked) = (0, 0);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            let first = v["first"].as_u64().unwrap() as u32;
            let table: Vec<u8> = (0..v["table"].as_str().unwrap().len() / 2)
                .map(|i| {
                    u8::from_str_radix(&v["table"].as_str().unwrap()[2 * i..2 * i + 2], 16).unwrap()
                })
                .collect();
            for pair in v["lines"].as_array().unwrap() {
                let addr = pair[0].as_i64().unwrap();
                let want = pair[1].as_u64().map(|l| l as u32);
                let got = match minor {
                    ..=9 => lines::lnotab_line(&table, first, addr),
                    10 => lines::linetable310_line(&table, first, addr),
                    _ => lines::locations_line(&table, first, addr),
                };
                assert_eq!(got, want, "python {version}: offset {addr} of {line}");
                checked += 1;
            }
            codes += 1;
        }
        assert!(codes > 500, "{version}: only {codes} code objects");
        eprintln!("python {version}: {codes} code objects, {checked} offsets: all lines match");
    }
}

/// A target that corrupts its own frame chain (3.9: a frame made its own caller, with
/// ctypes) gets a cut stack, flagged, not a hang or a crash.
#[test]
fn corrupt_frame_chain_is_cut_not_followed() {
    let Some(py) = python("3.9") else { return };
    let offsets: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("crates/cpython/offsets/3.9.json")).unwrap(),
    )
    .unwrap();
    let back = offsets["frame_object"]["back"].as_u64().unwrap();
    let script = format!(
        "import ctypes, sys, threading, time\n\
         def loop_forever():\n\
         \x20   f = sys._getframe()\n\
         \x20   ctypes.c_void_p.from_address(id(f) + {back}).value = id(f)\n\
         \x20   print('ready', flush=True)\n\
         \x20   time.sleep(3600)\n\
         def caller():\n\
         \x20   loop_forever()\n\
         threading.Thread(target=caller, daemon=True).start()\n\
         sys.stdin.readline()\n"
    );
    let mut target = Target::spawn(&py.launcher, &["-c", &script]);
    target.wait_for_line("ready");
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let out = run_pyprobe(&["dump", "-p", &target.pid().to_string(), "--format", "json"]);
    assert!(start.elapsed() < Duration::from_secs(10));
    let dump = json_of(&out);
    let threads = dump["threads"].as_array().unwrap();
    let looped = threads
        .iter()
        .find(|t| {
            t["frames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["function"] == "loop_forever")
        })
        .expect("the corrupted thread");
    assert_eq!(looped["truncated"], true);
    assert_eq!(looped["frames"].as_array().unwrap().len(), 1);
    // The main thread is untouched.
    assert_eq!(threads[0]["truncated"], false);
}

/// The python process `unshare -pf` started: the child whose NSpid has two ids.
fn namespaced_child(unshare: i32) -> Option<i32> {
    let children =
        std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children")).ok()?;
    children.split_whitespace().find_map(|c| {
        let pid: i32 = c.parse().ok()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
        (nspid.split_whitespace().count() == 2).then_some(pid)
    })
}

/// A target in its own PID namespace records tids pyprobe cannot see as such
/// (its main thread is 1 there): dump reports them as pyprobe sees them.
#[test]
fn tids_are_translated_out_of_a_pid_namespace() {
    let unshare = Path::new("/usr/bin/unshare");
    if !unshare.exists() {
        eprintln!("NOTICE: skipping: no /usr/bin/unshare");
        return;
    }
    for version in ["3.9", "3.11"] {
        let Some(py) = python(version) else { continue };
        let sleeper = fixture("sleeper.py");
        let launcher = py.launcher.display().to_string();
        let mut target = Target::spawn(
            unshare,
            &[
                "--pid",
                "--fork",
                "--mount-proc",
                "--kill-child",
                &launcher,
                &sleeper,
            ],
        );
        let mut line = String::new();
        let n = std::io::BufRead::read_line(&mut target.stdout, &mut line).unwrap_or(0);
        if n == 0 || !line.starts_with("expect ") {
            eprintln!("NOTICE: skipping: cannot make a PID namespace here (unshare: {line:?})");
            return;
        }
        let v: Value = serde_json::from_str(&line["expect ".len()..]).unwrap();
        let inner_main = v["main"]["tid"].as_i64();
        let inner_worker = v["worker"]["tid"].as_i64();
        assert_eq!(
            inner_main,
            Some(1),
            "the fixture runs as pid 1 of its namespace"
        );
        let pid = namespaced_child(target.pid()).expect("the namespaced python");
        let want = Expected {
            main_tid: None,
            main: frames_of(&v["main"]["frames"]),
            worker_tid: None,
            worker: frames_of(&v["worker"]["frames"]),
        };
        let (dump, _) = dump_until_matching(pid, &want);
        let threads = dump["threads"].as_array().unwrap();
        assert_eq!(
            threads[0]["native_tid"].as_i64(),
            Some(pid as i64),
            "{version}"
        );
        let worker = threads[1]["native_tid"].as_i64().expect("worker tid");
        let status = std::fs::read_to_string(format!("/proc/{pid}/task/{worker}/status")).unwrap();
        let nspid = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .unwrap();
        assert_eq!(
            nspid.split_whitespace().last().and_then(|t| t.parse().ok()),
            inner_worker,
            "{version}: worker {worker} should be the fixture's {inner_worker:?} inside"
        );
    }
}

#[test]
fn dump_refuses_what_is_not_python() {
    let mut target = Target::spawn(Path::new("/bin/sleep"), &["30"]);
    let out = run_pyprobe(&["dump", "-p", &target.pid().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("_PyRuntime"));
    let _ = target.child.kill();
    let out = run_pyprobe(&["dump", "-p", "999999999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no process"));
}
