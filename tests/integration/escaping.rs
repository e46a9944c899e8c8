//! Names the target chose reach the terminal escaped: `fixtures/python/
//! evil_names.py` gives a function a name with escape sequences and a file name
//! with a newline; `report`, `calls`-free sampled views and `dump` must print
//! them as `\x1b`, `\n`, never raw.

use std::time::Duration;

use crate::support::*;

/// The raw bytes that must never be printed, and what must be printed instead.
fn assert_escaped(what: &str, text: &str) {
    assert!(!text.contains('\x1b'), "{what}: a raw ESC in:\n{text:?}");
    assert!(!text.contains('\x07'), "{what}: a raw BEL in:\n{text:?}");
    assert!(
        !text.lines().any(|l| l.starts_with("pyprobe: all good")),
        "{what}: a forged line in:\n{text}"
    );
    assert!(
        text.contains("evil\\x1b]0;pwned\\x07\\x1b[2J"),
        "{what}: the name is not shown escaped in:\n{text}"
    );
}

#[test]
fn report_and_dump_show_the_targets_names_escaped() {
    let Some(py) = python("3.13") else { return };
    let path = std::env::temp_dir().join(format!("pyprobe-evil-{}.pyprobe", std::process::id()));
    record_script_into(&py, &["--force"], &path, "evil_names.py", &["1"]);
    let table = run_pyprobe(&["report", path.to_str().unwrap()]);
    assert!(table.status.success());
    assert_escaped("report", &String::from_utf8_lossy(&table.stdout));
    let _ = std::fs::remove_file(&path);

    let mut target = Target::spawn(
        &py.launcher,
        &[
            repo()
                .join("fixtures/python/evil_names.py")
                .to_str()
                .unwrap(),
            "30",
        ],
    );
    target.wait_for_line("ready");
    // The renamed function runs from here on.
    std::thread::sleep(Duration::from_millis(200));
    let dump = run_pyprobe(&["dump", "-p", &target.pid().to_string()]);
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    assert_escaped("dump", &String::from_utf8_lossy(&dump.stdout));
}
