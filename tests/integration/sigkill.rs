//! pyprobe killed with SIGKILL while tracing a hot call loop: the guardian and the
//! SIGTRAP safety net must keep the target alive and correct, every time.

use std::process::Command;
use std::time::Duration;

use crate::support::*;

fn random_ms(seed: &mut u64, lo: u64, hi: u64) -> u64 {
    // xorshift: a random moment per run without a dependency.
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    lo + *seed % (hi - lo)
}

#[test]
fn the_target_survives_pyprobe_being_killed_50_times_of_50() {
    let Some(py) = python("3.9") else { return };
    let script = repo().join("fixtures/python/hot_loop.py");
    let mut seed = std::process::id() as u64 | 1;
    let mut survived = 0;
    let mut restored_lines = 0;
    let runs = 50;
    for run in 0..runs {
        let target = Command::new(&py.launcher)
            .arg(&script)
            .arg("1.2")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = target.id() as i32;
        std::thread::sleep(Duration::from_millis(150));
        let out_path = std::env::temp_dir().join(format!(
            "pyprobe-sigkill-{}-{run}.pyprobe",
            std::process::id()
        ));
        let tracer = pyprobe()
            .args([
                "record",
                "-p",
                &pid.to_string(),
                "--mode",
                "trace",
                "-o",
                out_path.to_str().unwrap(),
            ])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(random_ms(&mut seed, 100, 800)));
        unsafe { libc::kill(tracer.id() as i32, libc::SIGKILL) };
        let tracer_out = tracer.wait_with_output().unwrap();
        let out = target.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let ok = out.status.success() && stdout.trim() == "done True";
        if ok {
            survived += 1;
        } else {
            eprintln!("run {run}: target {:?}, output {stdout:?}", out.status);
        }
        if String::from_utf8_lossy(&tracer_out.stderr)
            .contains("pyprobe guardian: pyprobe died; restored")
        {
            restored_lines += 1;
        }
        // Killed, pyprobe leaves what it recorded in OUT.partial.
        let mut partial = out_path.clone().into_os_string();
        partial.push(".partial");
        let _ = std::fs::remove_file(partial);
        let _ = std::fs::remove_file(out_path);
    }
    eprintln!(
        "survived {survived}/{runs}; the guardian reported restoring in {restored_lines} runs"
    );
    assert_eq!(
        survived, runs,
        "the target must survive every SIGKILL of pyprobe"
    );
}
