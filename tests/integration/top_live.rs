//! The live `top -p PID` view in a real terminal (a pty from util-linux `script`):
//! it shows the target's hottest function, quits on `q`, and leaves the target
//! running, untraced and without pyprobe's SIGTRAP handler.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;

/// `pyprobe top -p PID` in a pty of 30 × 120, its output read as it comes.
struct LiveTop {
    term: std::process::Child,
    keys: std::process::ChildStdin,
    output: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl LiveTop {
    fn watch(pid: i32) -> LiveTop {
        // A pty made by `script` has no size: give it one, as a terminal would.
        let top = format!(
            "stty rows 30 cols 120; exec {} top -p {pid} --interval 0.5",
            env!("CARGO_BIN_EXE_pyprobe")
        );
        let mut term = Command::new("script")
            .args(["-qfec", &top, "/dev/null"])
            .env("TERM", "xterm")
            .env("COLUMNS", "120")
            .env("LINES", "30")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("util-linux `script` is needed for a pty");
        let output = Arc::new(Mutex::new(Vec::new()));
        let mut stdout = term.stdout.take().unwrap();
        let reader = {
            let output = output.clone();
            std::thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n @ 1..) = stdout.read(&mut chunk) {
                    output.lock().unwrap().extend_from_slice(&chunk[..n]);
                }
            })
        };
        let keys = term.stdin.take().unwrap();
        LiveTop {
            term,
            keys,
            output,
            reader: Some(reader),
        }
    }

    /// What the terminal shows now (the view redraws only what changed, so the
    /// output is played through a terminal emulator).
    fn screen(&self) -> String {
        let mut terminal = vt100::Parser::new(30, 120, 0);
        terminal.process(&self.output.lock().unwrap());
        terminal.screen().contents()
    }

    /// The screen once `ready` says it is (within 20 s, for a busy machine), else the
    /// last one seen.
    fn screen_when(&self, ready: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let screen = self.screen();
            if ready(&screen) || std::time::Instant::now() > deadline {
                return screen;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn press(&mut self, key: &[u8]) {
        self.keys.write_all(key).unwrap();
        self.keys.flush().unwrap();
    }

    /// Quits with `q`; whether `top` exited successfully.
    fn quit(mut self) -> std::process::ExitStatus {
        self.press(b"q");
        let status = self.term.wait().unwrap();
        if let Some(reader) = self.reader.take() {
            reader.join().unwrap();
        }
        status
    }
}

#[test]
fn live_top_shows_the_hot_function_and_quits_cleanly() {
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(
        &py.launcher,
        &[&repo()
            .join("fixtures/python/forever.py")
            .display()
            .to_string()],
    );
    target.wait_for_line("ready");
    let pid = target.pid();
    let mut top = LiveTop::watch(pid);
    let all_threads = top.screen_when(|s| s.contains("fib"));
    assert!(
        all_threads.contains(&format!("pyprobe top: pid {pid}, CPython"))
            && all_threads.contains("fib"),
        "the hot function is shown:\n{all_threads}"
    );
    // `t`: the one thread there is, by its id (the process's, for its main thread).
    top.press(b"t");
    let one_thread =
        top.screen_when(|s| s.contains(&format!("thread {pid},")) && s.contains("fib"));
    assert!(
        one_thread.contains(&format!("pyprobe top: pid {pid}, thread {pid}, CPython"))
            && one_thread.contains("fib")
            && one_thread.contains(&format!("t thread ({pid})")),
        "`t` shows the main thread alone:\n{one_thread}"
    );
    let status = top.quit();
    assert!(status.success(), "top quit cleanly: {status:?}");
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(proc_status.contains("TracerPid:\t0"), "detached");
    let caught = proc_status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .unwrap()
        .trim();
    assert_eq!(
        u64::from_str_radix(caught, 16).unwrap() & (1 << 4),
        0,
        "no SIGTRAP handler left"
    );
    target.send_line("stop");
    assert!(target.wait_for_line("result").starts_with("result"));
}

/// `t` in the live view shows one thread at a time: each thread's view holds its own
/// function alone, as the program's own thread ids say (idle.py: burn() and
/// hash_big() on a CPU, nap() and poll() waiting, the main thread reading stdin).
#[test]
fn live_top_shows_each_thread_alone_on_t() {
    let Some(py) = python("3.11") else { return };
    let idle = repo().join("fixtures/python/idle.py");
    let mut target = Target::spawn(&py.launcher, &[&idle.display().to_string(), "wait"]);
    target.wait_for_line("ready");
    let pid = target.pid();
    let mut top = LiveTop::watch(pid);
    // The thread the title names ("pyprobe top: pid P, thread T, CPython ..."), if any.
    let thread_in = |screen: &str| -> Option<i32> {
        let title = screen.lines().next()?;
        title
            .split_once(", thread ")?
            .1
            .split(',')
            .next()?
            .parse()
            .ok()
    };
    top.screen_when(|s| s.contains(" burn "));
    // Each thread's first view is of the whole recording so far: two seconds of it.
    std::thread::sleep(Duration::from_secs(2));
    let mut views = Vec::new();
    let mut last = None;
    for _ in 0..5 {
        top.press(b"t");
        let view = top.screen_when(|s| thread_in(s).is_some_and(|t| Some(t) != last));
        last = thread_in(&view);
        views.push(view);
    }
    // Past the last thread: all of them again.
    top.press(b"t");
    let all_again = top.screen_when(|s| {
        s.lines()
            .next()
            .is_some_and(|t| t.starts_with(&format!("pyprobe top: pid {pid}, CPython")))
    });
    let status = top.quit();
    assert!(status.success(), "top quit cleanly: {status:?}");
    assert!(
        all_again.contains(" burn ") && all_again.contains(" hash_big "),
        "every thread again:\n{all_again}"
    );
    target.send_line("stop");
    let info: serde_json::Value =
        serde_json::from_str(&target.wait_for_line("{")).expect("the fixture's JSON");
    let tid_of = |f: &str| info[f]["tid"].as_u64().expect("a native thread id") as i32;
    let mut shown = Vec::new();
    for view in &views {
        let tid = thread_in(view).unwrap_or_else(|| panic!("a thread named in the title:\n{view}"));
        shown.push(tid);
        let on_cpu: Vec<&str> = ["burn", "hash_big"]
            .into_iter()
            .filter(|f| view.contains(&format!(" {f} ")))
            .collect();
        let expected: Vec<&str> = ["burn", "hash_big"]
            .into_iter()
            .filter(|f| tid_of(f) == tid)
            .collect();
        assert_eq!(on_cpu, expected, "thread {tid}'s view:\n{view}");
    }
    // The main thread and the four workers, each once, in order of id.
    let mut every: Vec<i32> = ["burn", "hash_big", "nap", "poll"]
        .into_iter()
        .map(tid_of)
        .chain([pid])
        .collect();
    every.sort_unstable();
    assert_eq!(shown, every);
}

/// `top --once -- CMD`: the command runs to its end under pyprobe, then one
/// snapshot of its whole run is printed, and `top` exits with the command's status.
#[test]
fn top_once_runs_a_command_and_shows_its_whole_run() {
    let Some(py) = python("3.9") else { return };
    let script =
        "def spin():\n    x = 0\n    for i in range(3_000_000):\n        x += i\n    return x\n\
                  print('spun', spin())\nraise SystemExit(3)\n";
    let out = pyprobe()
        .args(["top", "--once", "--"])
        .arg(&py.launcher)
        .args(["-c", script])
        .output()
        .expect("run pyprobe top");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_no_panic("top --once -- CMD", &out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "the command's own status\n{stderr}"
    );
    assert!(
        stdout.starts_with("spun "),
        "the command's output first:\n{stdout}"
    );
    let spin = stdout
        .lines()
        .find(|l| l.contains(" spin "))
        .unwrap_or_else(|| panic!("spin() in the snapshot:\n{stdout}\n{stderr}"));
    // OWN% of spin(): the loop is nearly all of the run.
    let own: f64 = spin.split_whitespace().next().unwrap().parse().unwrap();
    assert!(own > 50.0, "spin()'s own share: {spin}\n{stdout}");
    assert!(
        stderr.contains("engine auto"),
        "record's default engine:\n{stderr}"
    );
}

/// `top -r HZ` samples at the rate asked for: the snapshot's own count of samples
/// over its window matches it (a run on a CPU all along).
#[test]
fn top_samples_at_the_rate_asked_for() {
    let Some(py) = python("3.13") else { return };
    for rate in [50.0, 400.0] {
        let out = pyprobe()
            .args(["top", "--once", "-r", &rate.to_string(), "--"])
            .arg(&py.launcher)
            .arg(repo().join("fixtures/python/hot_loop.py"))
            .arg("1.5")
            .output()
            .expect("run pyprobe top");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_no_panic("top -r", &out.stderr);
        assert!(out.status.success(), "{stdout}");
        // "pyprobe top: pid N, CPython 3.13.5, sample mode, over 1.55 s: 77 samples on a CPU"
        let head = stdout
            .lines()
            .find(|l| l.starts_with("pyprobe top:"))
            .unwrap_or_else(|| panic!("no title line:\n{stdout}"));
        let (_, tail) = head.split_once(" over ").expect("window");
        let mut words = tail.split_whitespace();
        let seconds: f64 = words.next().unwrap().parse().unwrap();
        assert_eq!(words.next(), Some("s:"), "{head}");
        let samples: f64 = words.next().unwrap().parse().unwrap();
        // On a busy machine pyprobe may come too late for some ticks: it says how
        // many, and those with the samples taken are the rate asked for.
        let stderr = String::from_utf8_lossy(&out.stderr);
        let missed: f64 = stderr
            .lines()
            .find_map(|l| l.strip_prefix("pyprobe: caveat: fell behind: "))
            .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
            .unwrap_or(0.0);
        let measured = (samples + missed) / seconds;
        assert!(
            measured > rate * 0.6 && measured < rate * 1.2,
            "-r {rate}: {samples} samples (and {missed} missed) over {seconds} s\n{stdout}\n{stderr}"
        );
    }
}
