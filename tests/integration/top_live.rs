//! The live `top -p PID` view in a real terminal (a pty from util-linux `script`):
//! it shows the target's hottest function, quits on `q`, and leaves the target
//! running, untraced and without pyprobe's SIGTRAP handler.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;

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
    std::thread::sleep(Duration::from_secs(4));
    term.stdin.as_mut().unwrap().write_all(b"q").unwrap();
    term.stdin.as_mut().unwrap().flush().unwrap();
    let mut screen = String::new();
    term.stdout
        .take()
        .unwrap()
        .read_to_string(&mut screen)
        .unwrap();
    let status = term.wait().unwrap();
    assert!(status.success(), "top quit cleanly: {status:?}");
    assert!(
        screen.contains("fib"),
        "the hot function is shown:\n{screen}"
    );
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
            .find_map(|l| l.strip_prefix("pyprobe: fell behind: "))
            .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
            .unwrap_or(0.0);
        let measured = (samples + missed) / seconds;
        assert!(
            measured > rate * 0.6 && measured < rate * 1.2,
            "-r {rate}: {samples} samples (and {missed} missed) over {seconds} s\n{stdout}\n{stderr}"
        );
    }
}
