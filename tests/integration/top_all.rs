//! `top --all`: every Python process this user may trace, with a PID column. Run in a
//! PID and mount namespace of its own (`unshare`, root only), so that the only Python
//! processes it can see are the two targets started for it.

use std::process::Command;

use crate::support::*;

#[test]
fn top_all_shows_every_python_process_and_leaves_them_as_they_were() {
    let (Some(py9), Some(py15)) = (python("3.9"), python("3.15")) else {
        return;
    };
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("NOTICE: skipping: unshare --pid needs root here");
        return;
    }
    let script = repo().join("fixtures/python/forever.py");
    let shell = format!(
        "sleep 60 | {py9} {script} > /tmp/pyprobe-all-a.$$ & A=$!\n\
         sleep 60 | {py15} {script} > /tmp/pyprobe-all-b.$$ & B=$!\n\
         until grep -q ready /tmp/pyprobe-all-a.$$ 2>/dev/null && grep -q ready /tmp/pyprobe-all-b.$$ 2>/dev/null; do sleep 0.1; done\n\
         rm -f /tmp/pyprobe-all-a.$$ /tmp/pyprobe-all-b.$$\n\
         {pyprobe} top --all --once --interval 2 || exit 1\n\
         for p in $(pgrep -f forever.py); do grep -q 'TracerPid:\t0' /proc/$p/status || echo \"still traced: $p\"; done\n",
        py9 = py9.launcher.display(),
        py15 = py15.launcher.display(),
        script = script.display(),
        pyprobe = env!("CARGO_BIN_EXE_pyprobe"),
    );
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "sh", "-c", &shell])
        .output()
        .expect("unshare (util-linux)");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let fib_rows: Vec<&str> = text.lines().filter(|l| l.contains(" fib ")).collect();
    assert_eq!(fib_rows.len(), 2, "one fib row per process:\n{text}");
    let pids: std::collections::BTreeSet<&str> = fib_rows
        .iter()
        .filter_map(|l| l.split_whitespace().nth(3))
        .collect();
    assert_eq!(pids.len(), 2, "two different PIDs:\n{text}");
    assert!(!text.contains("still traced"), "{text}");
}
