//! Outputs named by the user (`-o OUT`): pyprobe never removes or truncates what
//! it did not create. A failing run leaves OUT as it was, an existing file is
//! replaced only with `--force` (a default name moves on to the next free one),
//! devices are refused, a FIFO is written straight into, and recordings are
//! private (0600). And what `record` says on stderr (one line at start, the
//! details with `-v`), and large trace exports announced before they are written,
//! with filters that make them smaller.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::*;
use pyprobe_recording::recording::{Event, EventKind, FrameRef, Header, RecordingWriter};

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("pyprobe-outputs-")
        .tempdir()
        .unwrap()
}

/// A small trace recording: main → work, 3 µs.
fn recording(path: &Path) {
    let header = Header {
        pid: 100,
        command_line: vec!["python3".into(), "main.py".into()],
        executable: "/usr/bin/python3.9".into(),
        python_version: "3.9.2".into(),
        mode: "trace".into(),
        start_ns: 1_000,
        ..Header::default()
    };
    let mut w = RecordingWriter::create(path, &header).unwrap();
    let file = w.intern("/app/main.py");
    let frame = |name: &str, w: &mut RecordingWriter<_>| FrameRef {
        file,
        function: w.intern(name),
        line: 1,
    };
    let main = frame("main", &mut w);
    let work = frame("work", &mut w);
    for (ts_ns, kind) in [
        (1_000, EventKind::Call { frame: main }),
        (2_000, EventKind::Call { frame: work }),
        (
            3_000,
            EventKind::Return {
                frame: work,
                first_line: 0,
            },
        ),
        (
            4_000,
            EventKind::Return {
                frame: main,
                first_line: 0,
            },
        ),
    ] {
        w.write(&Event {
            tid: 100,
            ts_ns,
            kind,
        })
        .unwrap();
    }
    w.finish(5_000).unwrap();
}

/// The names in `dir`, sorted (to see that no temporary is left behind).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// Bytes no view would write.
fn precious() -> Vec<u8> {
    (0..4096u32).map(|i| (i * 7 % 251) as u8).collect()
}

#[test]
fn a_failing_flame_leaves_an_existing_output_byte_for_byte() {
    let dir = tempdir();
    let input = dir.path().join("notes.txt");
    std::fs::write(&input, "not a recording\n").unwrap();
    for (format, name) in [
        ("svg", "out.svg"),
        ("collapsed", "out.txt"),
        ("speedscope", "out.json"),
        ("chrome", "out.json"),
    ] {
        let out = dir.path().join(name);
        std::fs::write(&out, precious()).unwrap();
        let o = run_pyprobe(&[
            "flame",
            s(&input),
            "-o",
            s(&out),
            "--format",
            format,
            "--force",
        ]);
        assert_refused_output(&o, &["flame", format], &["notes.txt"]);
        assert_eq!(
            std::fs::read(&out).unwrap(),
            precious(),
            "{format}: OUT untouched"
        );
    }
    // The default output, beside the input, is no different.
    let beside = dir.path().join("notes.svg");
    std::fs::write(&beside, precious()).unwrap();
    let o = run_pyprobe(&["flame", s(&input)]);
    assert_refused_output(&o, &["flame"], &["notes.txt"]);
    assert_eq!(std::fs::read(&beside).unwrap(), precious());
    assert_eq!(
        names(dir.path()),
        ["notes.svg", "notes.txt", "out.json", "out.svg", "out.txt"],
        "no temporary left behind"
    );
}

#[test]
fn a_successful_flame_replaces_the_output() {
    let dir = tempdir();
    let input = dir.path().join("run.pyprobe");
    recording(&input);
    let out = dir.path().join("out.txt");
    std::fs::write(&out, precious()).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
    // Without --force, refused before anything is read or written.
    let e = assert_refused(
        &["flame", s(&input), "-o", s(&out), "--format", "collapsed"],
        &["out.txt exists", "--force"],
    );
    assert!(!e.contains('\n'));
    assert_eq!(std::fs::read(&out).unwrap(), precious());
    assert_eq!(mode(&out), 0o644);
    let o = run_pyprobe(&[
        "flame",
        s(&input),
        "-o",
        s(&out),
        "--format",
        "collapsed",
        "--force",
    ]);
    assert!(o.status.success());
    let expected = run_pyprobe(&["flame", s(&input), "-o", "-", "--format", "collapsed"]);
    assert!(expected.status.success());
    assert!(!expected.stdout.is_empty());
    assert_eq!(std::fs::read(&out).unwrap(), expected.stdout);
    assert_eq!(mode(&out), 0o600, "outputs are private");
    assert_eq!(names(dir.path()), ["out.txt", "run.pyprobe"]);
}

fn assert_char_device(p: &Path, rdev: u64) {
    let meta = std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{} still exists: {e}", p.display()));
    assert!(
        meta.file_type().is_char_device(),
        "{} still a character device",
        p.display()
    );
    assert_eq!(meta.rdev(), rdev);
}

#[test]
fn a_character_device_is_refused_and_left_alone() {
    let dir = tempdir();
    let input = dir.path().join("run.pyprobe");
    recording(&input);
    let null_rdev = std::fs::metadata("/dev/null").unwrap().rdev();
    let e = assert_refused(
        &["flame", s(&input), "-o", "/dev/null"],
        &["/dev/null", "character device", "`-o -`"],
    );
    assert!(!e.contains('\n'));
    assert_char_device(Path::new("/dev/null"), null_rdev);

    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("NOTICE: skipping the failing render into a device node: needs root (mknod)");
        return;
    }
    // A device node of our own (what /dev/null is): a failing render must not
    // remove it, as it used to.
    let node = dir.path().join("null");
    let c = std::ffi::CString::new(s(&node)).unwrap();
    // SAFETY: mknod(2) with a valid C string.
    let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, null_rdev as libc::dev_t) };
    assert_eq!(r, 0, "mknod {}", node.display());
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "not a recording\n").unwrap();
    assert_refused(&["flame", s(&notes), "-o", s(&node)], &["character device"]);
    assert_char_device(&node, null_rdev);

    // `record` refuses it before starting anything.
    let Some(py) = python("3.9") else { return };
    let marker = dir.path().join("ran");
    let code = format!("open({:?}, 'w')", s(&marker));
    assert_refused(
        &["record", "-o", s(&node), "--", s(&py.launcher), "-c", &code],
        &["character device"],
    );
    assert!(!marker.exists(), "the command was never started");
    assert_char_device(&node, null_rdev);
}

#[test]
fn a_fifo_output_is_written_straight_into() {
    let dir = tempdir();
    let input = dir.path().join("run.pyprobe");
    recording(&input);
    let fifo = dir.path().join("view.fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: mkfifo(3) with a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let o = run_pyprobe(&["flame", s(&input), "-o", s(&fifo), "--format", "collapsed"]);
    assert!(o.status.success());
    let read = reader.join().unwrap();
    let expected = run_pyprobe(&["flame", s(&input), "-o", "-", "--format", "collapsed"]);
    assert!(!expected.stdout.is_empty());
    assert_eq!(read, expected.stdout);
    let is_fifo = || std::fs::symlink_metadata(&fifo).is_ok_and(|m| m.file_type().is_fifo());
    assert!(is_fifo());
    // An input that is no recording is refused before the FIFO is opened (a reader
    // waiting on it is not woken), and the FIFO stays where it was.
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "not a recording\n").unwrap();
    assert_refused(&["flame", s(&notes), "-o", s(&fifo)], &["notes.txt"]);
    assert!(is_fifo(), "{} still a FIFO", fifo.display());
    assert_eq!(names(dir.path()), ["notes.txt", "run.pyprobe", "view.fifo"]);
}

/// `pyprobe record -o OUT -p PID --mode trace --force` under umask 0: whatever the
/// umask, the recording is private.
fn record_under_umask_0(out: &Path, pid: i32) -> Tracer {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyprobe"));
    // SAFETY: umask(2) only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        })
    };
    Tracer::command(
        cmd,
        s(out),
        &["-p", &pid.to_string(), "--mode", "trace", "--force"],
    )
}

fn partial(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap().to_owned();
    name.push(".partial");
    out.with_file_name(name)
}

#[test]
fn a_recording_replaces_out_only_when_it_ends_and_is_private() {
    let Some(py) = python("3.9") else { return };
    let dir = tempdir();
    let out = dir.path().join("run.pyprobe");
    std::fs::write(&out, precious()).unwrap();
    let mut t = Target::spawn(&py.launcher, &[&fixture_script("faults.py")]);
    t.wait_for_line("ready");
    let pid = t.pid();

    // Killed while recording: OUT is as it was; what was recorded is readable
    // in OUT.partial.
    let tracer = record_under_umask_0(&out, pid);
    let started = wait_for(Duration::from_secs(20), || {
        std::fs::metadata(partial(&out)).is_ok_and(|m| m.len() > 0)
    });
    assert!(started, "recording into {}", partial(&out).display());
    // The start line follows the recording's header by microseconds: a loaded
    // machine may stall pyprobe between the two.
    std::thread::sleep(Duration::from_millis(200));
    t.send_line("ping");
    t.wait_for_line("pong");
    assert_eq!(
        std::fs::read(&out).unwrap(),
        precious(),
        "OUT untouched while recording"
    );
    assert_eq!(mode(&partial(&out)), 0o600);
    tracer.signal(libc::SIGKILL);
    let (status, stderr) = tracer.wait(Duration::from_secs(20));
    assert_eq!(status.code(), None, "killed");
    assert!(
        stderr.contains("run.pyprobe.partial"),
        "the start says where: {stderr}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), precious());
    let report = run_pyprobe(&["report", s(&partial(&out)), "--format", "json"]);
    assert_no_panic("report of the partial recording", &report.stderr);
    assert!(report.status.success(), "the partial recording reads back");
    assert!(String::from_utf8_lossy(&report.stderr).contains("cut short"));

    // Its partial is left for the user: a new recording to OUT is refused, and
    // neither is touched.
    let held = std::fs::read(partial(&out)).unwrap();
    assert_refused(
        &[
            "record",
            "-o",
            s(&out),
            "-p",
            &pid.to_string(),
            "--mode",
            "trace",
            "--force",
        ],
        &["run.pyprobe.partial exists"],
    );
    assert_eq!(std::fs::read(partial(&out)).unwrap(), held);
    assert_eq!(std::fs::read(&out).unwrap(), precious());
    std::fs::remove_file(partial(&out)).unwrap();

    // A run that ends well replaces OUT, private, and leaves nothing else.
    let tracer = record_under_umask_0(&out, pid);
    assert!(wait_for(Duration::from_secs(20), || partial(&out).exists()));
    t.send_line("ping");
    t.wait_for_line("pong");
    tracer.signal(libc::SIGINT);
    let (status, _) = tracer.wait(Duration::from_secs(30));
    assert!(status.success());
    assert_eq!(mode(&out), 0o600, "recordings are private");
    assert_eq!(names(dir.path()), ["run.pyprobe"]);
    report_json(s(&out));
    t.send_line("stop");
    assert_eq!(t.wait_for_line("result"), "result 144");
}

/// `record -o OUT` with OUT there: refused before the command starts, OUT as it
/// was; `--force` replaces it. A view's recording beside it counts as well.
#[test]
fn record_keeps_an_existing_output_unless_forced() {
    let Some(py) = python("3.11") else { return };
    let dir = tempdir();
    let out = dir.path().join("run.pyprobe");
    std::fs::write(&out, precious()).unwrap();
    let marker = dir.path().join("ran");
    let code = format!("open({:?}, 'w')", s(&marker));
    let record = |out: &Path, extra: &[&str]| {
        pyprobe()
            .args(["record", "-o", s(out)])
            .args(extra)
            .arg("--")
            .arg(&py.launcher)
            .args(["-c", &code])
            .output()
            .unwrap()
    };
    let o = record(&out, &[]);
    let e = assert_refused_output(
        &o,
        &["record", "-o", "run.pyprobe"],
        &["run.pyprobe exists", "--force"],
    );
    assert!(!e.contains('\n'));
    assert!(!marker.exists(), "the command never ran");
    assert_eq!(std::fs::read(&out).unwrap(), precious());

    let o = record(&out, &["--force"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(marker.exists(), "the command ran");
    report_json(s(&out));
    std::fs::remove_file(&marker).unwrap();

    // `-o view.svg` writes view.pyprobe too: an existing one is refused alike.
    let view = dir.path().join("view.svg");
    let beside = dir.path().join("view.pyprobe");
    std::fs::write(&beside, precious()).unwrap();
    let o = record(&view, &[]);
    assert_refused_output(
        &o,
        &["record", "-o", "view.svg"],
        &["view.pyprobe exists", "view.svg"],
    );
    assert!(!marker.exists(), "the command never ran");
    assert!(!view.exists());
    assert_eq!(std::fs::read(&beside).unwrap(), precious());
    let o = record(&view, &["--force"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read_to_string(&view).unwrap().starts_with("<?xml"));
    report_json(s(&beside));
    assert_eq!(
        names(dir.path()),
        ["ran", "run.pyprobe", "view.pyprobe", "view.svg"]
    );
}

/// Without -o, pyprobe writes the flame graph pyprobe-PID.svg and keeps the
/// recording beside it; the default names move on to the next free pair rather than
/// replace a file, and say where they wrote; `--force` replaces the default name.
#[test]
fn default_names_never_replace_a_file() {
    let Some(py) = python("3.11") else { return };
    let dir = tempdir();
    let mut target = Target::spawn(&py.launcher, &["-c", WAITING_SCRIPT]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let taken = dir.path().join(format!("pyprobe-{pid}.pyprobe"));
    std::fs::write(&taken, precious()).unwrap();
    // An interrupted recording's partial holds the next name too.
    let held = dir.path().join(format!("pyprobe-{pid}.1.pyprobe.partial"));
    std::fs::write(&held, precious()).unwrap();
    let o = pyprobe()
        .current_dir(dir.path())
        // --idle: the target waits; its samples make the flame graph.
        .args(["record", "-p", &pid.to_string(), "-d", "0.3", "--idle"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    // The flame graph, what a user looks at first, with its recording beside it.
    let written = dir.path().join(format!("pyprobe-{pid}.2.pyprobe"));
    let graph = dir.path().join(format!("pyprobe-{pid}.2.svg"));
    assert!(
        stderr.contains(&format!("written to pyprobe-{pid}.2.pyprobe"))
            && stderr.contains(&format!(
                "wrote pyprobe-{pid}.2.svg: open it in a web browser"
            )),
        "says where: {stderr}"
    );
    report_json(s(&written));
    assert!(std::fs::read_to_string(&graph)
        .unwrap()
        .starts_with("<?xml"));
    assert_eq!(std::fs::read(&taken).unwrap(), precious());
    assert_eq!(std::fs::read(&held).unwrap(), precious());
    drop(target);

    // `flame` beside its recording: run.svg is there, run.1.svg is written.
    let input = dir.path().join("run.pyprobe");
    recording(&input);
    let svg = dir.path().join("run.svg");
    std::fs::write(&svg, precious()).unwrap();
    let o = run_pyprobe(&["flame", s(&input)]);
    assert!(o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    let next = dir.path().join("run.1.svg");
    assert!(
        stderr.contains(s(&next)) && stderr.contains("--force"),
        "says where, and why: {stderr}"
    );
    assert!(std::fs::read_to_string(&next).unwrap().starts_with("<?xml"));
    assert_eq!(std::fs::read(&svg).unwrap(), precious());
    let o = run_pyprobe(&["flame", s(&input), "--force"]);
    assert!(o.status.success());
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<?xml"));
    assert!(!dir.path().join("run.2.svg").exists());
}

/// The stderr of a plain `record -- CMD`: one line at start saying what is
/// traced and how, then the closing summary, and nothing else.
#[test]
fn record_says_one_line_at_start() {
    let Some(py) = python("3.11") else { return };
    let dir = tempdir();
    let out = dir.path().join("run.pyprobe");
    let o = pyprobe()
        .args(["record", "-o", s(&out), "--"])
        .arg(&py.launcher)
        .args(["-c", "import time; time.sleep(0.2)"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    // On a busy machine a stop for a sample lasts long enough (pyprobe waits for
    // a CPU while the target is stopped) that a 0.2 s run may exceed the budget:
    // the budget's own closing line may follow. And pyprobe, given no CPU in
    // time, may read the stacks of start-up's events after the code that ran
    // once is freed (`site`'s `.pth` lines): that caveat may follow. Nothing else.
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("pyprobe: overhead budget 5% exceeded: "))
        .filter(|l| {
            !(l.starts_with("pyprobe: caveat: ")
                && l.contains("code objects were freed before pyprobe read them"))
        })
        .collect();
    assert_eq!(lines.len(), 2, "a start line and a summary:\n{stderr}");
    let start = lines[0];
    let header = report_json(s(&out));
    let pid = header["target"]["pid"]
        .as_u64()
        .expect("the pid in the report");
    for word in [
        &format!("pyprobe: process {pid} (python3.11 -c import time;"),
        "CPython 3.11",
        "mode auto",
        "stacks sampled at 100 Hz",
        "gc, import, audit exact",
        "engine auto",
        &format!("writing {}.partial ({} when done)", s(&out), s(&out)),
    ] {
        assert!(
            start.contains(word),
            "the start line says {word:?}: {start}"
        );
    }
    assert!(
        lines[1].starts_with("pyprobe: ") && lines[1].contains("events written to"),
        "{}",
        lines[1]
    );
    // No internal event printed raw.
    assert!(
        !stderr.contains('{') && !stderr.contains("ThreadStart"),
        "{stderr}"
    );
}

/// `-v` adds the site-level details: each process's sites armed, which go to the
/// ring and which stay on int3 and why, and the frame walker's layout.
#[test]
fn record_verbose_says_the_sites() {
    let Some(py) = python("3.11") else { return };
    let dir = tempdir();
    let out = dir.path().join("run.pyprobe");
    let run = |extra: &[&str]| {
        let o = pyprobe()
            .args(["record", "-o", s(&out), "--force"])
            .args(extra)
            .arg("--")
            .arg(&py.launcher)
            .args(["-c", "import time; time.sleep(0.2)"])
            .output()
            .unwrap();
        assert!(o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    // How many sites each engine serves (which stay on int3, and why, depends on
    // what the ring can capture for this interpreter).
    let details = [
        "probe sites armed in process",
        "probe sites write to a ring",
        "stay on int3",
        "frame walker: python 3.11",
        "interpreter: ",
    ];
    let verbose = run(&["-v"]);
    for d in details {
        assert!(verbose.contains(d), "-v says {d:?}:\n{verbose}");
    }
    let plain = run(&[]);
    for d in details {
        assert!(!plain.contains(d), "without -v, no {d:?}:\n{plain}");
    }
}

/// `-v` says, for each engine's ring, how long the target waited for room in it:
/// a time within the run (the ring engine on 3.9, the hook on 3.13).
/// `record -v --mode trace` of fib(22) on `py` into `out`.
fn record_fib_verbose(py: &Python, out: &Path) -> std::process::Output {
    pyprobe()
        .args(["record", "-v", "--mode", "trace", "-o", s(out), "--"])
        .arg(&py.launcher)
        .arg(repo().join("benches/workloads/fib.py"))
        .arg("22")
        .output()
        .unwrap()
}

#[test]
fn record_verbose_says_how_long_the_target_waited_for_the_ring() {
    for (version, engine) in [("3.9", "ring"), ("3.13", "hook")] {
        let Some(py) = python(version) else { continue };
        let dir = tempdir();
        let out = dir.path().join("run.pyprobe");
        let started = std::time::Instant::now();
        let o = record_fib_verbose(&py, &out);
        let wall_ms = started.elapsed().as_secs_f64() * 1e3;
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{version}: {stderr}");
        let said = format!("{engine} engine in process ");
        let line = stderr
            .lines()
            .find(|l| l.contains(&said) && l.contains("the target waited"))
            .unwrap_or_else(|| panic!("{version}: no waited line for the {engine}:\n{stderr}"));
        let ms: f64 = line
            .split("waited ")
            .nth(1)
            .and_then(|rest| rest.split(" ms").next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{version}: no time in {line:?}"));
        assert!(
            (0.0..=wall_ms).contains(&ms),
            "{version}: {ms} ms of a {wall_ms:.0} ms run"
        );
    }
}

#[test]
fn record_verbose_says_what_pyprobe_itself_used() {
    let Some(py) = ["3.13", "3.11", "3.9"].into_iter().find_map(python) else {
        return;
    };
    let children_cpu = || {
        let u =
            nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN).unwrap();
        let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
        secs(u.user_time()) + secs(u.system_time())
    };
    let dir = tempdir();
    let out = dir.path().join("run.pyprobe");
    let before = children_cpu();
    let o = record_fib_verbose(&py, &out);
    // pyprobe and the target it waited for, and whatever other tests ran meanwhile.
    let at_most = children_cpu() - before;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("pyprobe itself used"))
        .unwrap_or_else(|| panic!("no line of pyprobe's own CPU:\n{stderr}"));
    let number_after = |text: &str, after: &str| -> f64 {
        text.split(after)
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no number after {after:?} in {text:?}"))
    };
    let cpu = number_after(line, "used ");
    assert!(
        cpu > 0.0 && cpu <= at_most + 0.01,
        "{cpu} s of at most {at_most} s: {line}"
    );
    let events = stderr
        .lines()
        .find_map(|l| {
            l.split(" events written")
                .next()
                .filter(|_| l.contains(" events written"))
        })
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no events written in:\n{stderr}"));
    let per_event = number_after(line, "s of CPU (attach and recording, all its threads), ");
    // The per-event figure is the total over the events (the total is rounded
    // to 10 ms as said).
    let implied = cpu * 1e9 / events;
    assert!(
        (per_event - implied).abs() <= 0.006e9 / events + 1.0,
        "{per_event} ns per event against {implied}: {line}"
    );
}

/// A trace recording of `calls` short calls (10 µs each) and two long ones
/// (2 ms each) under `main`, in files `/app/main.py` (main, long) and
/// `/usr/lib/python3.9/json/encoder.py` (the short ones).
fn many_calls(path: &Path, calls: u32) {
    let header = Header {
        pid: 100,
        command_line: vec!["python3".into(), "main.py".into()],
        executable: "/usr/bin/python3.9".into(),
        python_version: "3.9.2".into(),
        mode: "trace".into(),
        start_ns: 1_000,
        ..Header::default()
    };
    let mut w = RecordingWriter::create(path, &header).unwrap();
    let app = w.intern("/app/main.py");
    let lib = w.intern("/usr/lib/python3.9/json/encoder.py");
    let main = FrameRef {
        file: app,
        function: w.intern("main"),
        line: 1,
    };
    let long = FrameRef {
        file: app,
        function: w.intern("long"),
        line: 10,
    };
    let short = FrameRef {
        file: lib,
        function: w.intern("encode"),
        line: 20,
    };
    let mut ts = 1_000;
    let mut write = |ts: u64, kind| {
        w.write(&Event {
            tid: 100,
            ts_ns: ts,
            kind,
        })
        .unwrap()
    };
    write(ts, EventKind::Call { frame: main });
    for i in 0..calls {
        let (frame, ns) = if i % (calls / 2).max(1) == 1 {
            (long, 2_000_000)
        } else {
            (short, 10_000)
        };
        ts += 1_000;
        write(ts, EventKind::Call { frame });
        ts += ns;
        write(
            ts,
            EventKind::Return {
                frame,
                first_line: 0,
            },
        );
    }
    ts += 1_000;
    write(
        ts,
        EventKind::Return {
            frame: main,
            first_line: 0,
        },
    );
    w.finish(ts + 1_000).unwrap();
}

/// The slices of a Chrome trace (`ph: X`, category python), and the open events
/// of a speedscope file, which must nest on each thread.
fn chrome_calls(json: &[u8]) -> Vec<serde_json::Value> {
    let doc: serde_json::Value = serde_json::from_slice(json).unwrap();
    doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "python")
        .cloned()
        .collect()
}

fn speedscope_opens(json: &[u8]) -> usize {
    let doc: serde_json::Value = serde_json::from_slice(json).unwrap();
    let mut opens = 0;
    for p in doc["profiles"].as_array().unwrap() {
        let mut stack = Vec::new();
        let mut last = 0;
        for e in p["events"].as_array().unwrap() {
            let at = e["at"].as_u64().unwrap();
            assert!(at >= last, "times go forward: {e}");
            last = at;
            if e["type"] == "O" {
                opens += 1;
                stack.push(e["frame"].clone());
            } else {
                assert_eq!(stack.pop().as_ref(), Some(&e["frame"]), "nested: {e}");
            }
        }
        assert!(stack.is_empty(), "balanced");
    }
    opens
}

/// A traced recording's speedscope file, by default: each thread's stacks
/// weighted by their own time (or calls), the report's numbers, whatever the
/// number of calls.
#[test]
fn a_traced_speedscope_file_holds_the_reports_stacks() {
    let dir = tempdir();
    let input = dir.path().join("calls.pyprobe");
    many_calls(&input, 1000);
    let export = |extra: &[&str]| {
        let mut args = vec!["flame", s(&input), "-o", "-", "--format", "speedscope"];
        args.extend_from_slice(extra);
        let o = run_pyprobe(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("--timeline writes every call"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let report: serde_json::Value =
        serde_json::from_slice(&run_pyprobe(&["report", s(&input), "--format", "json"]).stdout)
            .unwrap();
    // Own time and calls per function, by the innermost frame of each stack.
    let per_leaf = |doc: &serde_json::Value| {
        let frames = doc["shared"]["frames"].as_array().unwrap();
        let mut by_leaf: std::collections::BTreeMap<String, u64> = Default::default();
        let profiles = doc["profiles"].as_array().unwrap();
        assert_eq!(profiles.len(), 1, "one thread");
        let p = &profiles[0];
        assert_eq!(p["type"], "sampled");
        let weights = p["weights"].as_array().unwrap();
        for (stack, w) in p["samples"].as_array().unwrap().iter().zip(weights) {
            let leaf = stack.as_array().unwrap().last().unwrap().as_u64().unwrap();
            let name = frames[leaf as usize]["name"].as_str().unwrap();
            let function = name.split(' ').next().unwrap().to_string();
            *by_leaf.entry(function).or_default() += w.as_u64().unwrap();
        }
        let total: u64 = by_leaf.values().sum();
        assert_eq!(p["endValue"].as_u64(), Some(total));
        by_leaf
    };
    let timed = export(&[]);
    assert_eq!(timed["profiles"][0]["unit"], "nanoseconds");
    let counted = export(&["--by", "calls"]);
    assert_eq!(counted["profiles"][0]["unit"], "none");
    let (own, calls) = (per_leaf(&timed), per_leaf(&counted));
    for f in report["functions"].as_array().unwrap() {
        let name = f["function"].as_str().unwrap();
        assert_eq!(own.get(name).copied(), f["exclusive_ns"].as_u64(), "{name}");
        assert_eq!(calls.get(name).copied(), f["calls"].as_u64(), "{name}");
    }
    assert_eq!(calls.values().sum::<u64>(), 1001);
}

#[test]
fn min_duration_include_and_exclude_drop_calls_from_trace_exports() {
    let dir = tempdir();
    let input = dir.path().join("calls.pyprobe");
    many_calls(&input, 1000);
    let export = |format: &str, extra: &[&str]| {
        let mut args = vec!["flame", s(&input), "-o", "-", "--format", format];
        args.extend_from_slice(extra);
        let o = run_pyprobe(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    // Everything: main and its 1000 calls.
    let all = chrome_calls(&export("chrome", &[]));
    assert_eq!(all.len(), 1001);
    assert_eq!(
        speedscope_opens(&export("speedscope", &["--timeline"])),
        1001
    );
    // 1 ms: main and the two long calls.
    let long = chrome_calls(&export("chrome", &["--min-duration", "1ms"]));
    assert_eq!(long.len(), 3, "{long:?}");
    assert!(long.iter().all(|e| e["dur"].as_f64().unwrap() >= 1000.0));
    assert_eq!(
        speedscope_opens(&export("speedscope", &["--min-duration", "1ms"])),
        3
    );
    // 10 µs keeps them all (it is at least), 11 µs does not.
    assert_eq!(
        chrome_calls(&export("chrome", &["--min-duration", "10us"])).len(),
        1001
    );
    assert_eq!(
        chrome_calls(&export("chrome", &["--min-duration", "11us"])).len(),
        3
    );
    // By file: the library's calls, or all but them.
    let lib = chrome_calls(&export("chrome", &["--include", "*/json/*"]));
    assert_eq!(lib.len(), 998);
    assert!(lib.iter().all(|e| e["args"]["function"] == "encode"));
    let app = chrome_calls(&export("chrome", &["--exclude", "*/json/*"]));
    assert_eq!(app.len(), 3);
    assert_eq!(
        speedscope_opens(&export("speedscope", &["--exclude", "*/json/*"])),
        3
    );
    assert_eq!(
        speedscope_opens(&export("speedscope", &["--include", "*/json/*"])),
        998
    );
}

/// A Chrome trace (or speedscope file) of every call estimated above the
/// threshold (200 MB; `PYPROBE_LARGE_VIEW_BYTES` in tests) keeps only the calls
/// long enough to fit, and says which; with `--all` it keeps them all and is
/// announced, with its size and events and the filters that shrink it, before it
/// is written; the estimate follows the filters given.
#[test]
fn a_large_trace_export_keeps_the_longer_calls_or_is_announced_with_all() {
    let dir = tempdir();
    let input = dir.path().join("calls.pyprobe");
    many_calls(&input, 20_000);
    let export = |format: &str, limit: Option<&str>, extra: &[&str]| {
        let out = dir.path().join(format!("{format}.json"));
        let mut cmd = pyprobe();
        cmd.args([
            "flame",
            s(&input),
            "-o",
            s(&out),
            "--force",
            "--format",
            format,
        ])
        .args(extra);
        match limit {
            Some(l) => cmd.env("PYPROBE_LARGE_VIEW_BYTES", l),
            None => cmd.env_remove("PYPROBE_LARGE_VIEW_BYTES"),
        };
        let o = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{stderr}");
        let size = std::fs::metadata(&out).unwrap().len();
        (stderr, size)
    };
    // The default threshold is far above this recording.
    let (stderr, chrome_size) = export("chrome", None, &[]);
    assert!(!stderr.contains("warning"), "{stderr}");
    assert!(chrome_size > 2_000_000, "{chrome_size}");

    // Past the threshold, the longest calls that fit: every slice kept at
    // least as long as the cut said, the file within the threshold.
    let (stderr, size) = export("chrome", Some("1000000"), &[]);
    let note = stderr
        .lines()
        .find(|l| l.starts_with("pyprobe: note: a Chrome trace of every call would be about"))
        .unwrap_or_else(|| panic!("a note: {stderr}"));
    assert!(
        note.contains("(of 20,001)") && note.contains("--all"),
        "{note}"
    );
    let cut = note.split(" calls of ").nth(1).unwrap();
    let (value, unit) = {
        let mut words = cut.split(' ');
        (
            words.next().unwrap().parse::<f64>().unwrap(),
            words.next().unwrap(),
        )
    };
    let cut_us = match unit {
        "ns" => value / 1e3,
        "µs" => value,
        "ms" => value * 1e3,
        other => panic!("a duration unit, not {other:?}: {note}"),
    };
    let kept = chrome_calls(&std::fs::read(dir.path().join("chrome.json")).unwrap());
    assert!(!kept.is_empty() && kept.len() < 20_001, "{}", kept.len());
    assert!(
        kept.iter()
            .all(|e| e["dur"].as_f64().unwrap() >= cut_us * 0.999),
        "every slice at least {cut_us} µs"
    );
    assert!(size <= 1_000_000, "{size} bytes");

    let (stderr, _) = export("chrome", Some("1000000"), &["--all"]);
    let warning = stderr
        .lines()
        .find(|l| l.starts_with("pyprobe: warning: the Chrome trace will be about"))
        .unwrap_or_else(|| panic!("a warning: {stderr}"));
    for word in [
        "20001 calls",
        "of the recording's 40002 events",
        "--min-duration",
        "--include",
        "--exclude",
    ] {
        assert!(warning.contains(word), "{word:?}: {warning}");
    }
    // Before a byte is written: the warning comes before the line saying it was.
    let at = |what: &str| stderr.find(what).unwrap();
    assert!(at("warning") < at("wrote the Chrome trace"), "{stderr}");
    // "about N MB": within a factor of two of what was written.
    let about: Vec<&str> = warning
        .split("about ")
        .nth(1)
        .unwrap()
        .splitn(3, ' ')
        .collect();
    let unit = match about[1] {
        "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        other => panic!("a size unit, not {other:?}: {warning}"),
    };
    let estimate = about[0].parse::<f64>().unwrap() * unit;
    let ratio = estimate / chrome_size as f64;
    assert!(
        (0.5..2.0).contains(&ratio),
        "estimate {estimate} for {chrome_size} bytes"
    );

    // Filtered down to the long calls, it is small again: no warning.
    let (stderr, _) = export("chrome", Some("1000000"), &["--min-duration", "1ms"]);
    assert!(!stderr.contains("warning"), "{stderr}");

    // Speedscope alike.
    let (stderr, size) = export("speedscope", Some("100000"), &["--all"]);
    assert!(
        stderr.contains("pyprobe: warning: the speedscope file will be about"),
        "{stderr}"
    );
    let (stderr, cut_size) = export("speedscope", Some("100000"), &["--timeline"]);
    assert!(
        stderr.contains("pyprobe: note: a speedscope file of every call would be about"),
        "{stderr}"
    );
    assert!(cut_size < size, "{cut_size} of {size} bytes");
    let (stderr, _) = export("speedscope", Some(&(size * 3).to_string()), &["--timeline"]);
    assert!(!stderr.contains("warning"), "{stderr}");
}

/// A process that only waits (every sample off a CPU) recorded straight to an
/// SVG: `record` draws its waiting samples and says so, instead of failing after
/// the recording was made (`flame` on the same recording still needs --idle).
#[test]
fn record_draws_a_run_that_only_waited() {
    let Some(py) = python("3.11") else { return };
    let dir = tempdir();
    let svg = dir.path().join("idle.svg");
    // Records half a second of a process that only sleeps to `out`; the view says
    // it counted the waiting. A process of its own each time: one attached
    // before may be caught on a CPU, waking from the detach. Without stopping
    // the thread: each stop wakes a sleeper, which on a loaded machine can still
    // wait for a CPU to go back to sleep at the next tick, and be seen runnable.
    // (The view's note is what this test is about, not the stops.)
    let record_to = |out: &std::path::Path| {
        let mut target = Target::spawn(
            &py.launcher,
            &[
                "-c",
                "import time; print('ready', flush=True); time.sleep(60)",
            ],
        );
        target.wait_for_line("ready");
        let pid = target.pid().to_string();
        let run = run_pyprobe(&[
            "record",
            "--mode",
            "sample",
            "--nonblocking",
            "-p",
            &pid,
            "-d",
            "0.5",
            "-o",
            s(out),
        ]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{stderr}");
        assert!(stderr.contains("found its thread waiting"), "{stderr}");
    };
    record_to(&svg);
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(
        drawn.starts_with("<?xml") && drawn.contains("sleep"),
        "{drawn}"
    );
    let recording = svg.with_extension("pyprobe");
    let flame = run_pyprobe(&["flame", s(&recording), "-o", "-"]);
    assert!(
        !flame.status.success(),
        "flame without --idle draws nothing"
    );
    let idle = run_pyprobe(&["flame", s(&recording), "--idle", "-o", "-"]);
    assert!(idle.status.success());

    // The HTML page alike: its graph holds the waiting samples, and says so.
    let page = dir.path().join("idle-page.html");
    record_to(&page);
    let html = std::fs::read_to_string(&page).unwrap();
    let data = html
        .split_once("id=\"pyprobe-data\">")
        .and_then(|(_, rest)| rest.split_once("</script>"))
        .map(|(json, _)| json)
        .expect("the page's data");
    let data: serde_json::Value = serde_json::from_str(data).unwrap();
    let counted: u64 = data["nodes"]["value"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert!(counted > 0, "the page draws the waiting samples");
    assert!(
        data["frames"]["name"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == "<module>"),
        "{}",
        data["frames"]
    );
}

/// The target replaces the recording's `.partial` while it is written (it can
/// write the directory): pyprobe does not rename the target's file into place
/// as its recording; OUT holds what pyprobe wrote, the other file is left alone.
#[test]
fn a_partial_replaced_by_the_target_is_not_published() {
    let Some(py) = python("3.13") else { return };
    let dir = tempdir();
    let out = dir.path().join("run.pyprobe");
    let partial = dir.path().join("run.pyprobe.partial");
    let code = "import os, sys, time\n\
                p = sys.argv[1]\n\
                while not os.path.exists(p): time.sleep(0.01)\n\
                time.sleep(0.3)\n\
                os.remove(p)\n\
                open(p, 'w').write('forged')\n\
                time.sleep(0.3)\n\
                print('replaced', flush=True)\n";
    let done = pyprobe()
        .args(["record", "-o", out.to_str().unwrap(), "--"])
        .arg(&py.launcher)
        .args(["-c", code, partial.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&done.stdout).contains("replaced"));
    assert!(stderr.contains("was replaced or removed"), "{stderr}");
    assert_eq!(std::fs::read(&partial).unwrap(), b"forged");
    let report = run_pyprobe(&["report", out.to_str().unwrap(), "--format", "json"]);
    assert!(report.status.success(), "OUT is not pyprobe's recording");
}
