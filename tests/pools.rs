//! Process pools under `--subprocesses`, with `fixtures/python/pool.py`: workers
//! burn CPU in `worker_burn`, the parent in `parent_spin`; the fixture prints the
//! pids of the workers that ran tasks.

mod common;
mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use common::*;
use pyprobe::analyze::processes::ProcessMap;
use pyprobe::record::{EventKind, RecordingReader};
use serde_json::Value;
use support::{assert_no_panic, fixture_script, report_json, TempFile};

/// What `pyprobe record --subprocesses` made of one run.
struct Run {
    recording: TempFile,
    stdout: String,
    stderr: String,
    report: Value,
}

/// Records `python ARGS` with `--subprocesses` (and `extra`), `env` set.
fn record(py: &Python, name: &str, args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Run {
    let recording = TempFile::new(&format!("pool-{}-{name}.pyprobe", py.version));
    let started = Instant::now();
    let out = pyprobe()
        .args(["record", "--subprocesses", "-o", recording.path()])
        .args(extra)
        .arg("--")
        .arg(&py.launcher)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run pyprobe record");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "{} {name}: recorded in {:.2} s\n{stderr}",
        py.version,
        started.elapsed().as_secs_f64()
    );
    assert_no_panic("record", &out.stderr);
    assert!(out.status.success(), "{} {name}: record failed", py.version);
    let report = report_json(recording.path());
    Run {
        recording,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
        report,
    }
}

/// `builtins.id` audit events per process of a recording, and how many of them
/// had their stack read (a `stack` event just before: the process was stopped).
fn id_events(path: &str) -> BTreeMap<u32, (u64, u64)> {
    let mut reader = RecordingReader::open(Path::new(path)).expect("open recording");
    let mut processes = ProcessMap::new(reader.header());
    let mut stacked: HashMap<u32, bool> = HashMap::new();
    let events: Vec<_> = reader.events().map(|e| e.expect("event")).collect();
    let mut out: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for e in &events {
        processes.push(e);
        match &e.kind {
            EventKind::Stack { .. } => {
                stacked.insert(e.tid, true);
            }
            EventKind::Audit { event } => {
                let had_stack = stacked.remove(&e.tid).unwrap_or(false);
                if reader.string(*event) == "builtins.id" {
                    let n = out.entry(processes.pid_of(e.tid)).or_default();
                    n.0 += 1;
                    n.1 += u64::from(had_stack);
                }
            }
            _ => {}
        }
    }
    out
}

/// Workers raising an audit event at every one of 200,000 id() calls: each is
/// counted, and the worker is not stopped for each (the audit probe moves to
/// the ring once it has stopped the worker a thousand times in a second).
/// Before, every such event stopped the worker to read its stack: minutes.
#[test]
fn a_worker_raising_audit_events_all_the_time_is_counted_not_stopped() {
    for version in ["3.9", "3.13"] {
        let Some(py) = python(version) else { continue };
        let script = fixture_script("pool.py");
        let ids = 200_000u64;
        let run = record(
            &py,
            "ids",
            &[&script, "fork", "2", "2", "0.2", &ids.to_string()],
            &[],
            &[],
        );
        let workers: Vec<u32> = run
            .stdout
            .trim()
            .strip_prefix("workers ")
            .unwrap()
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        let counts = id_events(run.recording.path());
        let mut total = 0;
        for w in &workers {
            let (events, stacked) = counts.get(w).copied().unwrap_or_default();
            total += events;
            assert!(
                stacked <= 2_000,
                "{version}: worker {w} was stopped for {stacked} of its {events} id() audit events"
            );
        }
        // Each task ran in one worker; stray id() calls of the pool may add a few.
        // Events pyprobe could not read in time (it got no CPU for longer than a
        // ring lasts, on a crowded machine) are counted as lost, never missing.
        let lost = run.report["lost_events"].as_u64().unwrap();
        assert!(
            total + lost >= 2 * ids && total < 2 * ids + 100,
            "{version}: {total} id() audit events in the workers ({lost} lost), {} made",
            2 * ids
        );
        assert!(
            run.stderr.contains("most for audit"),
            "{version}: the move to the ring is said: {}",
            run.stderr
        );
    }
}
