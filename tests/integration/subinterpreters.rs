//! Subinterpreters on the `sys.monitoring` route (3.12–3.15): the hook is
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
            assert!(
                has_caveat(&report, "calls made in them are not traced"),
                "{label} attach {attach}: the recording says it: {}",
                report["caveats"]
            );
            let _ = std::fs::remove_file(&path);
        }
        let (rest, status) = target.finish();
        assert!(status.success(), "{label}: {rest}");
        assert!(rest.contains("ticks "), "{label}: {rest}");
    }
}

/// A launched program that makes a subinterpreter, ends it at once and exits:
/// between two of pyprobe's looks at the interpreters. The recording says that
/// calls in subinterpreters are not traced all the same (pyprobe counts those
/// made, not those running when it looks).
#[test]
fn a_subinterpreter_that_came_and_went_between_two_looks_is_said() {
    const SCRIPT: &str = "
try:
    import _interpreters as interpreters
except ImportError:
    import _xxsubinterpreters as interpreters
def f():
    return 1
for _ in range(100):
    f()
interpreters.destroy(interpreters.create())
for _ in range(100):
    f()
print('made 1')
";
    for (label, py) in monitoring_interpreters() {
        let path = tmp_path(&format!(
            "subinterpreter-came-and-went-{}.pyprobe",
            label.replace(' ', "-")
        ));
        let out = pyprobe()
            .args(["record", "--mode", "trace", "--force", "-o"])
            .arg(&path)
            .arg("--")
            .arg(&py)
            .args(["-c", SCRIPT])
            .output()
            .expect("run pyprobe");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_no_panic(&label, &out.stderr);
        assert!(out.status.success(), "{label}: {stderr}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "made 1\n", "{label}");
        let report = report_json(path.to_str().unwrap());
        assert!(
            has_caveat(
                &report,
                "(1 made so far): calls made in them are not traced"
            ),
            "{label}: the recording says it: {}\n{stderr}",
            report["caveats"]
        );
        let _ = std::fs::remove_file(&path);
    }
}

/// Whether one of the report's caveats holds `text`.
fn has_caveat(report: &serde_json::Value, text: &str) -> bool {
    report["caveats"]
        .as_array()
        .expect("caveats")
        .iter()
        .any(|c| c["text"].as_str().is_some_and(|t| t.contains(text)))
}
