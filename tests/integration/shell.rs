//! `pyprobe completions` and `pyprobe man`, as a user's shell and `man` take them.

use std::io::Write;
use std::process::{Command, Stdio};

use crate::support::*;

#[test]
fn bash_completions_parse_and_complete_the_subcommands() {
    let out = run_pyprobe(&["completions", "bash"]);
    assert!(out.status.success());
    let script = String::from_utf8(out.stdout).expect("UTF-8 completions");
    let mut bash = Command::new("bash")
        .arg("-n")
        .stdin(Stdio::piped())
        .spawn()
        .expect("bash");
    bash.stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("write the script to bash");
    assert!(bash.wait().expect("bash").success(), "bash -n refused it");
    for sub in [
        "record", "report", "flame", "calls", "top", "dump", "probes",
    ] {
        assert!(script.contains(sub), "no completion for {sub}");
    }
    assert!(
        script.contains("--max-overhead"),
        "record's options are missing"
    );
}

#[test]
fn every_shell_clap_knows_gets_completions() {
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let out = run_pyprobe(&["completions", shell]);
        assert!(out.status.success(), "{shell}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("max-overhead"),
            "{shell}: record's options are missing"
        );
    }
    assert!(!run_pyprobe(&["completions", "tcsh"]).status.success());
}

#[test]
fn man_writes_a_page_per_subcommand() {
    let out = run_pyprobe(&["man"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(".ie \\n(.g .ds Aq"));
    assert!(String::from_utf8_lossy(&out.stdout).contains(".TH pyprobe 1"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let pages = dir.path().join("man1");
    let out = run_pyprobe(&["man", "--dir", pages.to_str().expect("UTF-8 path")]);
    assert!(out.status.success());
    for name in [
        "pyprobe",
        "pyprobe-record",
        "pyprobe-report",
        "pyprobe-dump",
    ] {
        let page = std::fs::read_to_string(pages.join(format!("{name}.1")))
            .unwrap_or_else(|e| panic!("{name}.1: {e}"));
        assert!(
            page.contains(&format!(".TH {name} 1")),
            "{name}.1 has no title"
        );
    }
    let record = std::fs::read_to_string(pages.join("pyprobe-record.1")).expect("record page");
    assert!(
        record.contains("max\\-overhead"),
        "record's page lacks its options"
    );
}
