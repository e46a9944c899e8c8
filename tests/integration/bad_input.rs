//! Bad and hostile input: processes pyprobe cannot or must not trace, and damaged,
//! cut, foreign or empty recordings. Each gets one clear sentence (one
//! `pyprobe: error:` line naming the pid or the offset) and exit status 1, never a
//! panic.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;
use pyprobe_recording::recording::{Event, EventKind, FrameRef, Header, RecordingWriter};

// ---- processes ----------------------------------------------------------------

/// The error is one line: the whole of stderr that is not pyprobe's own notices.
fn assert_one_sentence(error: &str) {
    assert!(!error.contains('\n'), "one line: {error}");
    assert!(error.len() < 600, "short: {error}");
}

/// Launches `python -c "print(6 * 7)"` under `pyprobe` with `args` (ending in
/// `--`): it must be refused in one sentence holding `words`, before the command
/// printed anything (it does not run untraced behind the user's back).
fn assert_launch_refused(args: &[&str], python: &Path, words: &[&str]) {
    let out = pyprobe()
        .args(args)
        .arg(python)
        .args(["-c", "print(6 * 7)"])
        .output()
        .unwrap();
    let e = assert_refused_output(&out, args, words);
    assert_one_sentence(&e);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "",
        "the command did not run"
    );
}

#[test]
fn nonexistent_pid() {
    for args in [
        &["record", "-p", "999999999"][..],
        &["probes", "-p", "999999999"][..],
    ] {
        let e = assert_refused(args, &["999999999", "no process"]);
        assert_one_sentence(&e);
    }
    assert_refused(&["record", "-p", "0"], &["not a valid process id"]);
    assert_refused(&["record", "--pid=-5"], &["not a valid process id"]);
}

#[test]
fn zombie() {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id() as i32;
    assert!(
        wait_for(Duration::from_secs(5), || proc_state(pid) == Some('Z')),
        "the child is a zombie (not reaped yet)"
    );
    for cmd in ["record", "probes"] {
        assert_refused(
            &[cmd, "-p", &pid.to_string()],
            &[&pid.to_string(), "zombie"],
        );
    }
    child.wait().unwrap();
}

#[test]
fn kernel_thread() {
    // pid 2 is kthreadd on Linux (unless this runs in a PID namespace).
    let name = std::fs::read_to_string("/proc/2/status").unwrap_or_default();
    if !name.starts_with("Name:\tkthreadd") {
        eprintln!("NOTICE: skipping: pid 2 is not kthreadd here");
        return;
    }
    for cmd in ["record", "probes"] {
        assert_refused(&[cmd, "-p", "2"], &["process 2", "kernel thread"]);
    }
}

#[test]
fn not_a_python_process() {
    let sleeper = Target::spawn(Path::new("/bin/sleep"), &["30"]);
    let pid = sleeper.pid().to_string();
    // Not a CPython at all, in either mode: said so, not that it lacks probes.
    let e = assert_refused(&["record", "-p", &pid], &[&pid, "CPython"]);
    assert_one_sentence(&e);
    let e = assert_refused(
        &["record", "-p", &pid, "--mode", "trace"],
        &[&pid, "cannot be traced", "_PyRuntime", "CPython 3.7+"],
    );
    assert_one_sentence(&e);
}

/// A CPython built without `--with-dtrace` (the machine's pyenv build) in trace mode
/// with the probe engines only (the default traces it through the hook engine,
/// `hook.rs`): refused, saying what works.
#[test]
fn python_without_probes_in_trace_mode() {
    let pyenv = Path::new("/root/.pyenv/versions/3.11.7/bin/python3.11");
    let Some(python) = [pyenv, Path::new("/usr/local/bin/python3")]
        .into_iter()
        .find(|p| p.exists() && !has_sdt_notes(p))
    else {
        eprintln!("NOTICE: skipping: no CPython without SDT notes on this machine");
        return;
    };
    let mut target = Target::spawn(python, &["-c", WAITING_SCRIPT]);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let e = assert_refused(
        &["record", "-p", &pid, "--mode", "trace", "--engine", "ring"],
        &[
            &pid,
            "no CPython SDT probes",
            "--with-dtrace",
            "hook engine",
        ],
    );
    assert_one_sentence(&e);
    // Launching it: refused as soon as its interpreter is mapped, before it runs a
    // line of Python (it does not run untraced behind the user's back).
    let recording = TempFile::new("noprobes.pyprobe");
    let args = [
        "record",
        "--mode",
        "trace",
        "--engine",
        "ring",
        "-o",
        recording.path(),
        "--",
    ];
    assert_launch_refused(
        &args,
        python,
        &[
            "no SDT probes",
            "--with-dtrace",
            "`--engine auto` (the default)",
        ],
    );
}

/// CPython 3.14 has SDT probes but none for functions: with the probe engines only
/// (`--engine ring`; the default uses the hook engine there, `hook.rs`), `--mode
/// trace` is refused, naming the engine that works instead, attached or launched;
/// asking only for the probes it has works.
#[test]
fn python_without_function_probes_in_trace_mode() {
    let Some(py) = python("3.14") else { return };
    let mut target = Target::spawn(&py.launcher, &["-c", WAITING_SCRIPT]);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let e = assert_refused(
        &["record", "-p", &pid, "--mode", "trace", "--engine", "ring"],
        &[
            "CPython 3.14",
            "no function probes",
            "`--engine auto` (the default)",
        ],
    );
    assert_one_sentence(&e);
    let recording = TempFile::new("nofunction.pyprobe");
    let args = [
        "record",
        "--mode",
        "trace",
        "--engine",
        "ring",
        "-o",
        recording.path(),
        "--",
    ];
    assert_launch_refused(&args, &py.launcher, &["no function probes"]);
    let out = pyprobe()
        .args([
            "record",
            "--mode",
            "trace",
            "--probes",
            "gc,import",
            "-o",
            recording.path(),
        ])
        .arg("--")
        .arg(&py.launcher)
        .args(["-c", "print(6 * 7)"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42\n");
}

/// A probe group the interpreter has no probes for (3.15 has no `line` probe) is
/// refused in one sentence naming what it has, and the launched command does not
/// run untraced behind the refusal.
#[test]
fn probes_the_interpreter_lacks_are_refused_before_the_command_runs() {
    let Some(py) = python("3.15") else { return };
    let recording = TempFile::new("noline.pyprobe");
    let args = [
        "record",
        "--mode",
        "trace",
        "--probes",
        "function,line",
        "-o",
        recording.path(),
        "--",
    ];
    assert_launch_refused(
        &args,
        &py.launcher,
        &[
            "no probes for: line",
            "it has: function",
            "leave it out of --probes",
        ],
    );
}

/// Whether an ELF file, or a libpython next to it, has `.note.stapsdt` (via readelf,
/// not through pyprobe).
fn has_sdt_notes(python: &Path) -> bool {
    let mut files = vec![python.to_path_buf()];
    if let Some(lib) = python
        .parent()
        .and_then(|b| b.parent())
        .map(|p| p.join("lib"))
    {
        if let Ok(dir) = std::fs::read_dir(lib) {
            files.extend(
                dir.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().contains("libpython")),
            );
        }
    }
    files.iter().any(|f| {
        Command::new("readelf")
            .arg("-n")
            .arg(f)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("stapsdt"))
            .unwrap_or(false)
    })
}

#[test]
fn its_own_pid() {
    // `exec` keeps the shell's pid: pyprobe is asked to trace itself.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "exec {} record -p $$ --mode trace",
            env!("CARGO_BIN_EXE_pyprobe")
        ))
        .output()
        .unwrap();
    let e = assert_refused_output(&out, &["record", "-p", "$$"], &["itself"]);
    assert_one_sentence(&e);
}

/// The target exits at every moment of the attach: before pyprobe looks, while it
/// seizes, while it installs, and while it records. pyprobe either records until the
/// exit or refuses in one sentence that says the process exited (never "a kernel
/// thread", "not permitted" or "no probes"); it never panics, and the target always
/// exits 0 (never by SIGTRAP).
#[test]
fn pid_that_exits_during_attach() {
    let Some(py) = python("3.9") else { return };
    let mut outcomes = std::collections::BTreeMap::new();
    for i in 0..40u64 {
        // The target waits 0 to ~250 ms, calls a little, then exits.
        let script = format!(
            "import sys, time\nprint('ready', flush=True)\ntime.sleep({})\n\
             fib = lambda n: n if n < 2 else fib(n - 1) + fib(n - 2)\nfib(12)\n",
            (i % 8) as f64 * 0.035
        );
        let mut target = Target::spawn(&py.launcher, &["-c", &script]);
        target.wait_for_line("ready");
        std::thread::sleep(Duration::from_millis(i % 5));
        let recording = TempFile::new(&format!("exits-{i}.pyprobe"));
        // Trace mode (ptrace and breakpoints) and auto mode (the sampler) in turn.
        let mode = if i % 2 == 0 { "trace" } else { "auto" };
        let out = run_pyprobe(&[
            "record",
            "-p",
            &target.pid().to_string(),
            "--mode",
            mode,
            "-o",
            recording.path(),
        ]);
        assert_no_panic("attach to an exiting pid", &out.stderr);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let kind = match out.status.code() {
            Some(0) => {
                assert!(stderr.contains("exited"), "{mode}: {stderr}");
                report_json(recording.path());
                "recorded until it exited"
            }
            Some(1) => {
                let e = stderr
                    .lines()
                    .find(|l| l.starts_with("pyprobe: error:"))
                    .unwrap_or_else(|| panic!("one error line: {stderr}"));
                assert_one_sentence(e);
                assert!(e.contains(&target.pid().to_string()), "names the pid: {e}");
                assert!(
                    e.contains("exit") || e.contains("zombie") || e.contains("no process"),
                    "run {i} ({mode}): says the process exited: {e}"
                );
                "refused: it exited"
            }
            other => panic!("unexpected exit {other:?}: {stderr}"),
        };
        *outcomes.entry(kind).or_insert(0) += 1;
        let (_, status) = target.finish();
        assert_eq!(
            status.code(),
            Some(0),
            "run {i}: the target exits normally: {status:?}"
        );
    }
    eprintln!("attach during exit: {outcomes:?}");
}

// ---- outputs ------------------------------------------------------------------

/// An output name pyprobe cannot write is refused before the command starts: the
/// command never runs (its marker file is not created), nothing is written.
#[test]
fn record_refuses_an_output_it_cannot_write_before_starting_the_command() {
    let Some(py) = python("3.11") else { return };
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("marker");
    let code = format!("open({:?}, 'w')", marker.to_str().unwrap());
    for name in ["x.pdf", "x", "x.pyprobe.gz", "x.svgz"] {
        let out = dir.path().join(name);
        let args = ["record", "-o", out.to_str().unwrap(), "--"];
        let run = pyprobe()
            .args(args)
            .arg(&py.launcher)
            .args(["-c", &code])
            .output()
            .unwrap();
        let e = assert_refused_output(&run, &args, &[name, ".pyprobe", ".svg", ".json", ".txt"]);
        assert_one_sentence(&e);
        assert!(!marker.exists(), "{name}: the command never ran");
        assert!(!out.exists(), "{name}: nothing written");
    }
    // Upper case is the same extension.
    let out = dir.path().join("X.SVG");
    let run = pyprobe()
        .args(["record", "-o", out.to_str().unwrap(), "--"])
        .arg(&py.launcher)
        .args(["-c", &code])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(marker.exists(), "the command ran");
    assert!(std::fs::read_to_string(&out).unwrap().starts_with("<?xml"));
    assert!(
        dir.path().join("X.pyprobe").exists(),
        "the recording beside"
    );
}

/// A process is not attached to when the output is refused: nothing in it is
/// touched (no tracer, no semaphore raised).
#[test]
fn record_refuses_an_output_it_cannot_write_before_attaching() {
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &["-c", WAITING_SCRIPT]);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("profile.pdf");
    let e = assert_refused(
        &[
            "record",
            "-p",
            &pid,
            "-d",
            "0.5",
            "-o",
            out.to_str().unwrap(),
        ],
        &["profile.pdf", ".pyprobe"],
    );
    assert_one_sentence(&e);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("TracerPid:\t0"), "never attached: {status}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// `flame -o` must fit the format: an explicit `--format` with another
/// extension is refused; without `--format` the extension chooses it.
#[test]
fn flame_refuses_an_output_named_for_another_format() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("run.pyprobe");
    small_recording(&rec);
    let rec = rec.to_str().unwrap();
    let at = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    for (format, name, words) in [
        (
            "chrome",
            "x.svg",
            &["x.svg", "--format chrome", ".json"][..],
        ),
        ("svg", "x.json", &["x.json", "--format svg", ".svg"][..]),
        (
            "speedscope",
            "x.txt",
            &["x.txt", "--format speedscope", ".json"][..],
        ),
        (
            "collapsed",
            "x.svg",
            &["x.svg", "--format collapsed", ".txt"][..],
        ),
    ] {
        let e = assert_refused(&["flame", rec, "-o", &at(name), "--format", format], words);
        assert_one_sentence(&e);
        assert!(!dir.path().join(name).exists(), "{format} {name}");
    }
    let e = assert_refused(&["flame", rec, "-o", &at("x.pdf")], &["x.pdf", "--format"]);
    assert_one_sentence(&e);
    // The extension chooses: .json is speedscope, .txt collapsed stacks.
    let out = run_pyprobe(&["flame", rec, "-o", &at("chosen.json")]);
    assert!(out.status.success());
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(at("chosen.json")).unwrap()).unwrap();
    assert!(
        doc["$schema"].as_str().unwrap().contains("speedscope"),
        "{doc}"
    );
    let out = run_pyprobe(&["flame", rec, "-o", &at("chosen.txt")]);
    assert!(out.status.success());
    let folded = std::fs::read_to_string(at("chosen.txt")).unwrap();
    assert!(folded.lines().all(|l| l
        .rsplit_once(' ')
        .is_some_and(|(_, n)| n.parse::<u64>().is_ok())));
    let out = run_pyprobe(&["flame", rec, "-o", &at("trace.json"), "--format", "chrome"]);
    assert!(out.status.success());
    // The filters belong to the trace exports.
    let e = assert_refused(
        &["flame", rec, "-o", &at("f.svg"), "--min-duration", "1ms"],
        &["--min-duration", "chrome"],
    );
    assert_one_sentence(&e);
    // A duration without its unit is a usage error.
    let out = run_pyprobe(&[
        "flame",
        rec,
        "-o",
        &at("c.json"),
        "--format",
        "chrome",
        "--min-duration",
        "5",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no unit"));
    assert!(!dir.path().join("c.json").exists());
}

/// A trace recording of a few calls: main → work, twice.
fn small_recording(path: &Path) {
    let header = Header {
        pid: 42,
        command_line: vec!["python3".into(), "app.py".into()],
        executable: "/usr/bin/python3.9".into(),
        python_version: "3.9.2".into(),
        mode: "trace".into(),
        ..Header::default()
    };
    let mut w = RecordingWriter::create(path, &header).unwrap();
    let file = w.intern("/app/app.py");
    let main = FrameRef {
        file,
        function: w.intern("main"),
        line: 1,
    };
    let work = FrameRef {
        file,
        function: w.intern("work"),
        line: 5,
    };
    let mut ts = 1_000;
    let mut event = |kind| {
        ts += 1_000;
        w.write(&Event {
            tid: 42,
            ts_ns: ts,
            kind,
        })
        .unwrap();
    };
    event(EventKind::Call { frame: main });
    for _ in 0..2 {
        event(EventKind::Call { frame: work });
        event(EventKind::Return {
            frame: work,
            first_line: 0,
        });
    }
    event(EventKind::Return {
        frame: main,
        first_line: 0,
    });
    w.finish(ts + 1_000).unwrap();
}

// ---- recordings ---------------------------------------------------------------

/// A recording with a header, strings, several event chunks and a trailer
/// (~1.5 MB), written by the library's own writer.
fn multi_chunk_recording(path: &Path) -> Vec<u8> {
    let header = Header {
        pid: 42,
        command_line: vec!["python3".into(), "app.py".into()],
        executable: "/usr/bin/python3.9".into(),
        python_version: "3.9.2".into(),
        ..Header::default()
    };
    let mut w = RecordingWriter::create(path, &header).unwrap();
    let file = w.intern("/app/app.py");
    let names: Vec<_> = (0..50).map(|i| w.intern(&format!("f{i}"))).collect();
    let mut ts = 1_000;
    for i in 0..200_000u32 {
        let frame = FrameRef {
            file,
            function: names[(i % 50) as usize],
            line: i % 50 + 1,
        };
        for kind in [
            EventKind::Call { frame },
            EventKind::Return {
                frame,
                first_line: 0,
            },
        ] {
            ts += 7;
            w.write(&Event {
                tid: 1 + i % 3,
                ts_ns: ts,
                kind,
            })
            .unwrap();
        }
    }
    w.finish(ts + 1).unwrap();
    std::fs::read(path).unwrap()
}

/// Offsets where chunks start (after the 12-byte prefix), from the chunk headers.
fn chunk_offsets(bytes: &[u8]) -> Vec<usize> {
    let mut offsets = Vec::new();
    let mut at = 12;
    while at + 9 <= bytes.len() {
        offsets.push(at);
        let len = u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
        at += 9 + len;
    }
    offsets
}

fn report(path: &str) -> std::process::Output {
    let out = pyprobe()
        .args(["report", path, "--format", "json"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_no_panic(&format!("report {path}"), &out.stderr);
    if out.status.success() {
        assert_report_schema(&serde_json::from_slice(&out.stdout).expect("report JSON"));
    }
    out
}

fn error_line(out: &std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit status 1: {stderr}");
    let e = stderr
        .lines()
        .find(|l| l.starts_with("pyprobe: error:"))
        .unwrap_or_else(|| panic!("an error line: {stderr}"))
        .to_owned();
    assert_one_sentence(&e);
    e
}

#[test]
fn empty_foreign_and_missing_files() {
    let empty = TempFile::new("empty.pyprobe");
    std::fs::write(empty.as_path(), b"").unwrap();
    let e = error_line(&report(empty.path()));
    assert!(e.contains("empty file") && e.contains("offset 0"), "{e}");

    for foreign in [env!("CARGO_BIN_EXE_pyprobe"), "/etc/passwd"] {
        let e = error_line(&report(foreign));
        assert!(
            e.contains("not a pyprobe recording") && e.contains("offset 0"),
            "{e}"
        );
    }
    let text = TempFile::new("text.pyprobe");
    std::fs::write(text.as_path(), b"PYPRO").unwrap();
    let e = error_line(&report(text.path()));
    assert!(e.contains("offset 5"), "a magic cut short: {e}");

    let e = error_line(&report("/nonexistent/run.pyprobe"));
    assert!(e.contains("/nonexistent/run.pyprobe"), "{e}");
    // Said once, not once per link of the error's chain.
    assert_eq!(e.matches("No such file or directory").count(), 1, "{e}");

    // A view of a file that is no recording says so, not that it cannot write.
    let foreign = TempFile::new("notes.txt");
    std::fs::write(foreign.as_path(), b"shopping list\n").unwrap();
    let e = error_line(&run_pyprobe(&["flame", foreign.path()]));
    assert!(
        e.contains("not a pyprobe recording") && !e.contains("cannot write"),
        "{e}"
    );
    let e = error_line(&report("/tmp"));
    assert!(e.contains("/tmp"), "a directory: {e}");
}

#[test]
fn wrong_version_and_absurd_chunk_length() {
    let file = TempFile::new("versions.pyprobe");
    let good = multi_chunk_recording(file.as_path());

    let mut v = good.clone();
    v[8..12].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(file.as_path(), &v).unwrap();
    let e = error_line(&report(file.path()));
    assert!(e.contains("version 99") && e.contains("offset 8"), "{e}");

    let mut v = good.clone();
    v[13..17].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(file.as_path(), &v).unwrap();
    let e = error_line(&report(file.path()));
    assert!(e.contains("absurd") && e.contains("offset 12"), "{e}");
}

/// Cut at every byte of the first chunks and at every chunk boundary (±1) of the
/// rest: inside the header it is an error naming the offset; after it, the report
/// reads every whole chunk and notes where the recording was cut short.
#[test]
fn truncated_recordings() {
    let file = TempFile::new("whole.pyprobe");
    let good = multi_chunk_recording(file.as_path());
    let chunks = chunk_offsets(&good);
    assert!(chunks.len() >= 5, "header, strings, events..., trailer");
    let header_end = chunks[1];
    let mut cuts: Vec<usize> = (1..header_end + 40).collect();
    for &c in &chunks[2..] {
        cuts.extend([c - 1, c, c + 1, c + 9]);
    }
    cuts.push(good.len() - 1);
    let cut = TempFile::new("cut.pyprobe");
    let mut events_seen = Vec::new();
    for &n in &cuts {
        std::fs::write(cut.as_path(), &good[..n]).unwrap();
        let out = report(cut.path());
        let stderr = String::from_utf8_lossy(&out.stderr);
        if n < header_end {
            let e = error_line(&out);
            assert!(
                e.contains(&format!("offset {}", n.min(12)))
                    || e.contains("offset 12")
                    || e.contains(&format!("offset {n}")),
                "cut at {n}: {e}"
            );
        } else {
            assert!(out.status.success(), "cut at {n}: {stderr}");
            let whole_before = chunks.iter().rev().find(|&&c| c <= n).copied().unwrap();
            assert!(
                stderr.contains("cut short")
                    && stderr.contains(&format!("before offset {whole_before}")),
                "cut at {n}: notes the cut at chunk {whole_before}: {stderr}"
            );
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let calls: u64 = report["functions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f["calls"].as_u64().unwrap_or(0))
                .sum();
            events_seen.push((n, calls));
        }
    }
    // More file, never fewer calls.
    assert!(
        events_seen.windows(2).all(|w| w[0].1 <= w[1].1),
        "{events_seen:?}"
    );
    assert!(events_seen.last().unwrap().1 > 0);
}

/// Flip a byte in each chunk's header and payload: checksum or length errors that
/// name the chunk's offset, or (a flipped kind byte) a clear complaint; never a panic.
#[test]
fn corrupt_recordings() {
    let file = TempFile::new("corrupt-src.pyprobe");
    let good = multi_chunk_recording(file.as_path());
    let chunks = chunk_offsets(&good);
    let bad = TempFile::new("corrupt.pyprobe");
    // The header, the strings, the first and last event chunks, and the trailer.
    let n = chunks.len();
    let picked = [
        chunks[0],
        chunks[1],
        chunks[2],
        chunks[n - 2],
        chunks[n - 1],
    ];
    for &c in &picked {
        let len = u32::from_le_bytes(good[c + 1..c + 5].try_into().unwrap()) as usize;
        for (what, at) in [
            ("kind", c),
            ("length", c + 2),
            ("checksum", c + 6),
            ("payload start", c + 9),
            ("payload middle", c + 9 + len / 2),
        ] {
            if at >= good.len() || (what.starts_with("payload") && len == 0) {
                continue;
            }
            let mut v = good.clone();
            v[at] ^= 0x5a;
            std::fs::write(bad.as_path(), &v).unwrap();
            let out = report(bad.path());
            let stderr = String::from_utf8_lossy(&out.stderr);
            if out.status.success() {
                // Only a length that now runs past the end reads as a cut recording.
                assert!(
                    stderr.contains("cut short"),
                    "{what} of chunk {c} flipped, read without a word: {stderr}"
                );
                continue;
            }
            let e = error_line(&out);
            assert!(
                e.contains("offset"),
                "{what} of chunk {c} flipped: error names an offset: {e}"
            );
            if what != "length" {
                assert!(
                    e.contains(&format!("offset {c}")) || e.contains("offset 12"),
                    "{what} of chunk {c} flipped: names the chunk: {e}"
                );
            }
        }
    }
}

/// Garbage after the magic and version: a chunk header with a valid checksum but
/// nonsense inside (absurd counts, bad varints, unknown kinds).
#[test]
fn checksummed_nonsense() {
    let bad = TempFile::new("nonsense.pyprobe");
    let prefix = {
        let mut p = b"PYPROBE\0".to_vec();
        p.extend_from_slice(&1u32.to_le_bytes());
        p
    };
    let chunk = |kind: u8, payload: &[u8]| {
        let mut c = vec![kind];
        c.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        c.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        c.extend_from_slice(payload);
        c
    };
    let header = {
        // A valid header: take it from a real recording.
        let file = TempFile::new("nonsense-src.pyprobe");
        let good = multi_chunk_recording(file.as_path());
        let chunks = chunk_offsets(&good);
        good[chunks[0]..chunks[1]].to_vec()
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("header kind is an events chunk", chunk(3, &[0; 10])),
        ("header payload of 0xff", chunk(1, &[0xff; 64])),
        (
            "unknown chunk kind",
            [header.clone(), chunk(77, &[1, 2, 3])].concat(),
        ),
        (
            "strings chunk claiming 2^60 strings",
            [
                header.clone(),
                chunk(2, &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x10]),
            ]
            .concat(),
        ),
        (
            "events chunk of 0xff",
            [header.clone(), chunk(3, &[0xff; 300])].concat(),
        ),
        (
            "events chunk with an unknown event kind",
            [header.clone(), chunk(3, &[200, 1, 1, 1, 1])].concat(),
        ),
        (
            "trailer of a bad varint",
            [header.clone(), chunk(4, &[0xff; 11])].concat(),
        ),
    ];
    for (what, bytes) in cases {
        let mut v = prefix.clone();
        v.extend_from_slice(&bytes);
        std::fs::write(bad.as_path(), &v).unwrap();
        let out = report(bad.path());
        let e = error_line(&out);
        assert!(e.contains("offset"), "{what}: names an offset: {e}");
    }
}
