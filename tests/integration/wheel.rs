//! The pip/pipx wheel `scripts/build-wheel.sh` builds: installed into a fresh virtual
//! environment of each pyenv interpreter (3.7 to 3.13) by that environment's own pip,
//! and by pipx, it puts a working `pyprobe` on PATH with its man pages and shell
//! completions; that `pyprobe` records the demo under the environment's python.
//!
//! Debian's unpacked test interpreters run through a launcher script, which a
//! virtual environment cannot point at; pyenv's builds are real installations.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::hook::{pyenv, MINORS};
use crate::support::*;

/// The wheel of `scripts/build-wheel.sh` (one in `target/wheels/`), or `None` with a
/// notice; `scripts/test.sh` builds it first, and requires it.
fn built_wheel() -> Option<PathBuf> {
    let wheels: Vec<PathBuf> = std::fs::read_dir(repo().join("target/wheels"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Some(one.clone()),
        [] => {
            missing("no wheel in target/wheels: run scripts/build-wheel.sh");
            None
        }
        many => panic!("several wheels in target/wheels, expected one: {many:?}"),
    }
}

fn run(what: &str, command: &mut Command) -> Output {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {command:?} failed with {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The installed `pyprobe` says its version, records the demo run by `python`, and
/// its report names the demo's own functions.
fn check_installed(what: &str, pyprobe: &Path, python: &Path, scratch: &Path) {
    let version = run(what, Command::new(pyprobe).arg("--version"));
    let expected = format!("pyprobe {}", env!("CARGO_PKG_VERSION"));
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        expected,
        "{what}: --version"
    );
    let recording = scratch.join("demo.pyprobe");
    let demo = repo().join("fixtures/demo.py");
    run(
        what,
        Command::new(pyprobe)
            .args(["record", "--mode", "sample", "-o"])
            .arg(&recording)
            .arg("--")
            .arg(python)
            .arg(&demo)
            .args(["--seconds", "1"]),
    );
    let report = run(
        what,
        Command::new(pyprobe)
            .args(["report", "--format", "json"])
            .arg(&recording),
    );
    let doc: serde_json::Value = serde_json::from_slice(&report.stdout).expect("report JSON");
    let names: Vec<&str> = doc["functions"]
        .as_array()
        .expect("functions")
        .iter()
        .filter_map(|f| f["function"].as_str())
        .collect();
    assert!(
        names.contains(&"fib"),
        "{what}: the demo's fib is not in the report: {names:?}"
    );
}

/// What the wheel puts beside the binary, under the environment's `share/`.
fn assert_shared_files(what: &str, prefix: &Path) {
    for file in [
        "share/man/man1/pyprobe.1",
        "share/man/man1/pyprobe-record.1",
        "share/bash-completion/completions/pyprobe",
        "share/zsh/site-functions/_pyprobe",
        "share/fish/vendor_completions.d/pyprobe.fish",
    ] {
        assert!(prefix.join(file).is_file(), "{what}: no {file} installed");
    }
    run(
        what,
        Command::new("bash")
            .arg("-n")
            .arg(prefix.join("share/bash-completion/completions/pyprobe")),
    );
}

#[test]
fn the_wheel_installs_with_pip_into_every_python_3_7_and_later() {
    let Some(wheel) = built_wheel() else { return };
    let mut installed = 0;
    for minor in MINORS {
        let Some(python) = pyenv(minor) else { continue };
        let what = format!("pip, python 3.{minor}");
        let scratch = tempfile::tempdir().expect("temporary directory");
        let venv = scratch.path().join("venv");
        run(&what, Command::new(&python).args(["-m", "venv"]).arg(&venv));
        run(
            &what,
            Command::new(venv.join("bin/python"))
                .args(["-m", "pip", "install", "--quiet", "--no-index"])
                .args(["--disable-pip-version-check"])
                .arg(&wheel),
        );
        assert_shared_files(&what, &venv);
        check_installed(
            &what,
            &venv.join("bin/pyprobe"),
            &venv.join("bin/python"),
            scratch.path(),
        );
        installed += 1;
    }
    assert!(installed > 0, "no pyenv interpreter to install into");
}

#[test]
fn the_wheel_installs_with_pipx() {
    let Some(wheel) = built_wheel() else { return };
    let Some(python) = pyenv(11) else { return };
    // pipx and what it imports (the cache installs each without its dependencies).
    let pipx = std::env::join_paths([
        pypi("pipx", "1.7.1"),
        pypi("argcomplete", "3.5.1"),
        pypi("packaging", "24.1"),
        pypi("platformdirs", "4.2.2"),
        pypi("userpath", "1.9.2"),
        pypi("click", "8.1.7"),
    ])
    .expect("PYTHONPATH");
    let scratch = tempfile::tempdir().expect("temporary directory");
    let home = scratch.path().join("pipx");
    let bin = scratch.path().join("bin");
    let man = scratch.path().join("man");
    run(
        "pipx",
        Command::new(&python)
            .args(["-m", "pipx", "install"])
            .arg(&wheel)
            .env("PYTHONPATH", &pipx)
            .env("PIPX_HOME", &home)
            .env("PIPX_BIN_DIR", &bin)
            .env("PIPX_MAN_DIR", &man)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    );
    assert!(
        man.join("man1/pyprobe.1").is_file(),
        "pipx: the man page was not linked into PIPX_MAN_DIR"
    );
    check_installed("pipx", &bin.join("pyprobe"), &python, scratch.path());
}
