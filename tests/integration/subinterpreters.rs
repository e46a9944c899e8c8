//! Subinterpreters on the `sys.monitoring` route (3.12–3.14): the hook is
//! installed in the main interpreter only, so a later attach traces the program
//! as the first did (a hook that landed in a short-lived subinterpreter once left
//! every later attach tracing nothing, saying nothing), and every recording says
//! that calls in subinterpreters are not traced.

use crate::hook::monitoring_interpreters;
use crate::support::*;

/// Attaches made one after the other to one target.
const ATTACHES: usize = 3;

#[test]
fn the_hook_stays_in_the_main_interpreter_and_subinterpreters_are_named_untraced() {
    for (label, py) in monitoring_interpreters() {
        let mut target = Target::spawn(
            &py,
            &[
                repo()
                    .join("fixtures/python/subinterpreters.py")
                    .to_str()
                    .unwrap(),
                "9",
            ],
        );
        target.wait_for_line("ready");
        let pid = target.pid().to_string();
        for attach in 0..ATTACHES {
            let path = tmp_path(&format!(
                "subinterpreters-{}-{attach}.pyprobe",
                label.replace(' ', "-")
            ));
            let out = pyprobe()
                .args(["record", "--mode", "trace", "--duration", "1.5", "--force"])
                .args(["-p", &pid, "-o"])
                .arg(&path)
                .output()
                .expect("run pyprobe");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_no_panic(&label, &out.stderr);
            assert!(out.status.success(), "{label} attach {attach}: {stderr}");
            assert!(
                stderr.contains("pyprobe: caveat: the program runs subinterpreters"),
                "{label} attach {attach}: said under the closing line: {stderr}"
            );
            let report = report_json(path.to_str().unwrap());
            let calls = entries_in_file(&report, "subinterpreters.py");
            // The main thread calls `tick` every 2 ms: about 700 in 1.5 s.
            assert!(
                calls.get("tick").copied().unwrap_or(0) > 100,
                "{label} attach {attach}: the main interpreter is traced: {calls:?}"
            );
            let caveats = report["caveats"].as_array().expect("caveats");
            assert!(
                caveats.iter().any(|c| c["text"]
                    .as_str()
                    .is_some_and(|t| t.contains("calls made in them are not traced"))),
                "{label} attach {attach}: the recording says it: {caveats:?}"
            );
            let _ = std::fs::remove_file(&path);
        }
        let (rest, status) = target.finish();
        assert!(status.success(), "{label}: {rest}");
        assert!(rest.contains("ticks "), "{label}: {rest}");
    }
}
