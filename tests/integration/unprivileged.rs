//! Unprivileged and containerised: pyprobe as an ordinary user with no capabilities
//! (its own child, a process of the same user, another user's process refused with
//! the EPERM explanation), a target in its own PID and mount namespaces whose binary
//! path means something else outside, and a seccomp filter around pyprobe that
//! blocks ptrace or process_vm_readv, named as such.
//!
//! The user tests need root (to switch to the user `pyprobe-test`, created if
//! missing) and `setpriv`; the namespace test needs root and `unshare`. Without them
//! they print a notice and pass.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::support::*;

const USER: &str = "pyprobe-test";

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The uid of the test user, creating it if needed; `None` (with a notice) when this
/// cannot be done here.
fn test_user() -> Option<u32> {
    static UID: OnceLock<Option<u32>> = OnceLock::new();
    *UID.get_or_init(|| {
        if !is_root() || !have("setpriv") {
            eprintln!("NOTICE: skipping: the unprivileged tests need root and setpriv");
            return None;
        }
        let uid = || {
            Command::new("id")
                .args(["-u", USER])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        };
        if uid().is_none() {
            let _ = Command::new("useradd")
                .args(["--system", "--no-create-home", "--shell", "/bin/sh", USER])
                .status();
        }
        let found = uid();
        if found.is_none() {
            eprintln!("NOTICE: skipping: cannot create the user {USER}");
        }
        found
    })
}

/// `program` run as the test user with no capabilities at all.
fn as_user(uid: u32, program: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .args([
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
        ])
        .arg(program)
        .env("HOME", "/tmp");
    cmd
}

fn pyprobe_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pyprobe"))
}

/// A directory the test user may write to, removed when dropped.
struct SharedDir(PathBuf);

impl SharedDir {
    fn new(name: &str) -> SharedDir {
        let dir = tmp_path(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        SharedDir(dir)
    }

    fn file(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn show(what: &str, out: &Output) {
    eprintln!(
        "{what}: {:?}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_test_user_has_no_capabilities() {
    let Some(uid) = test_user() else { return };
    let out = as_user(uid, Path::new("/bin/cat"))
        .arg("/proc/self/status")
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    for field in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        let line = status
            .lines()
            .find(|l| l.starts_with(field))
            .unwrap_or_else(|| panic!("{field} in {status}"));
        assert!(line.ends_with("0000000000000000"), "{line}");
    }
    assert!(status.contains(&format!("Uid:\t{uid}\t{uid}\t{uid}\t{uid}")));
}

/// `record -- CMD` as an ordinary user: it traces its own child, with exact counts.
#[test]
fn unprivileged_user_records_its_own_child() {
    let Some(uid) = test_user() else { return };
    let Some(py) = python("3.9") else { return };
    let dir = SharedDir::new("unpriv-launch");
    let recording = dir.file("run.pyprobe");
    let script = fixture_script("count_calls.py");
    let out = as_user(uid, &pyprobe_bin())
        .args(["record", "--mode", "trace", "-o", &recording, "--"])
        .arg(&py.launcher)
        .arg(&script)
        .output()
        .unwrap();
    show("record -- as user", &out);
    assert_no_panic("record as user", &out.stderr);
    assert!(out.status.success());
    let truth: std::collections::BTreeMap<String, u64> =
        serde_json::from_slice(&out.stdout).expect("the script's JSON output");
    let report = report_json(&recording);
    let calls = entries_in_file(&report, "count_calls.py");
    assert_eq!(calls.get("fib"), truth.get("fib"), "{calls:?}");
    assert_eq!(calls.get("thrower"), truth.get("thrower"), "{calls:?}");
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&recording).unwrap());
    assert_eq!(owner, uid, "the recording belongs to the user");
}

fn yama_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Attaching to a process of the same user works where the kernel allows it (no
/// Yama, or ptrace_scope 0); with Yama 1 or more the refusal names the scope.
#[test]
fn unprivileged_user_attaches_to_its_own_process() {
    let Some(uid) = test_user() else { return };
    let Some(py) = python("3.9") else { return };
    let mut cmd = as_user(uid, &py.launcher);
    cmd.arg(fixture_script("faults.py"));
    let mut target = spawn_command(cmd);
    target.wait_for_line("ready");
    let pid = target.pid();
    let (sites, sems) = sites_and_semaphores(pid);
    let dir = SharedDir::new("unpriv-attach");
    let recording = dir.file("attach.pyprobe");
    let out = as_user(uid, &pyprobe_bin())
        .args([
            "record",
            "--mode",
            "trace",
            "-p",
            &pid.to_string(),
            "-d",
            "1",
            "-o",
            &recording,
        ])
        .output()
        .unwrap();
    show("record -p as user", &out);
    assert_no_panic("record -p as user", &out.stderr);
    match yama_scope() {
        None | Some(0) => {
            eprintln!("Yama: {:?}: same-user attach is allowed", yama_scope());
            assert!(out.status.success());
            let report = report_json(&recording);
            assert!(
                entries_in_file(&report, "faults.py")
                    .get("fib")
                    .copied()
                    .unwrap_or(0)
                    > 0
            );
        }
        Some(scope) => {
            let e = assert_refused_output(&out, &["record", "-p"], &["ptrace_scope"]);
            assert!(e.contains(&scope.to_string()), "{e}");
        }
    }
    assert_restored(pid, &sites, &sems);
    target.send_line("stop");
    assert_eq!(target.wait_for_line("result"), "result 144");
    let (_, status) = target.finish();
    assert!(status.success());
}

fn spawn_command(mut cmd: Command) -> Target {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("cannot start the target");
    let stdin = child.stdin.take();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    Target {
        child,
        stdin,
        stdout,
    }
}

/// Another user's process (root's): refused with the explanation, which names the
/// owner, CAP_SYS_PTRACE and how to get it in Docker and Kubernetes.
#[test]
fn unprivileged_user_is_refused_another_users_process() {
    let Some(uid) = test_user() else { return };
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("faults.py")]);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    for args in [
        vec!["record", "-p", &pid, "-d", "1", "-o", "/tmp/never.pyprobe"],
        vec!["probes", "-p", &pid],
    ] {
        let out = as_user(uid, &pyprobe_bin()).args(&args).output().unwrap();
        show(&args.join(" "), &out);
        let e = assert_refused_output(
            &out,
            &args,
            &[
                &format!("process {pid}"),
                "uid 0",
                "CAP_SYS_PTRACE",
                "--cap-add=SYS_PTRACE",
                "capabilities.add: [SYS_PTRACE]",
                "kubectl debug --profile=general",
                "pyprobe record -- CMD",
            ],
        );
        assert!(!e.contains('\n'));
    }
    assert!(!Path::new("/tmp/never.pyprobe").exists());
    assert_eq!(ask(&mut target, "stop", "result"), "result 144");
}

fn ask(t: &mut Target, command: &str, prefix: &str) -> String {
    t.send_line(command);
    t.wait_for_line(prefix)
}

// ---- namespaces ---------------------------------------------------------------

/// A target in its own PID and mount namespaces, whose interpreter lives on a tmpfs
/// mounted only there; outside, the same path holds a decoy file. pyprobe must read
/// the real binary through /proc/PID/map_files, and report the in-namespace pid.
#[test]
fn target_in_other_pid_and_mount_namespace() {
    if !is_root() || !have("unshare") {
        eprintln!("NOTICE: skipping: the namespace test needs root and unshare");
        return;
    }
    let Some(py) = python("3.9") else { return };
    let dir = tmp_path("ns-root");
    std::fs::create_dir_all(&dir).unwrap();
    let inside = dir.join("python3.9");
    std::fs::write(&inside, b"a decoy: not the interpreter the target runs\n").unwrap();
    let home = py.binary.parent().unwrap().parent().unwrap(); // .../usr
    let script = format!(
        "mount -t tmpfs none '{d}' && cp '{bin}' '{d}/python3.9' && \
         PYTHONHOME='{home}' LD_LIBRARY_PATH='{home}/lib/x86_64-linux-gnu' \
         exec '{d}/python3.9' '{fixture}'",
        d = dir.display(),
        bin = py.binary.display(),
        home = home.display(),
        fixture = fixture_script("faults.py"),
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "sh", "-c", &script]);
    let mut target = spawn_command(cmd);
    target.wait_for_line("ready");
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", target.pid())).unwrap();
    let pid: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let nspid = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .unwrap()
        .split_whitespace()
        .map(|v| v.parse::<i32>().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(nspid, [pid, 1], "host pid and pid 1 inside");
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
        inside,
        "the target runs a path that outside holds the decoy"
    );

    let listing = json_of(&run_pyprobe(&[
        "probes",
        "-p",
        &pid.to_string(),
        "--format",
        "json",
    ]));
    assert_eq!(listing["ns_pid"], 1, "probes -p reports NSpid: {listing}");
    let objects = listing["objects"].as_array().unwrap();
    assert!(
        objects
            .iter()
            .any(|o| o["probes"].as_array().is_some_and(|p| !p.is_empty())),
        "the probes were read from the real binary: {listing}"
    );
    let (sites, sems) = sites_and_semaphores(pid);
    let recording = TempFile::new("ns.pyprobe");
    let out = run_pyprobe(&[
        "record",
        "-p",
        &pid.to_string(),
        "-d",
        "1",
        "--mode",
        "trace",
        "-o",
        recording.path(),
    ]);
    assert_no_panic("record in a namespace", &out.stderr);
    assert!(out.status.success());
    assert_restored(pid, &sites, &sems);
    let report = report_json(recording.path());
    assert!(
        entries_in_file(&report, "faults.py")
            .get("fib")
            .copied()
            .unwrap_or(0)
            > 0
    );
    assert_eq!(ask(&mut target, "stop", "result"), "result 144");
    let (_, st) = target.finish();
    assert!(st.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The start line of `record -p` names the in-namespace pid too.
#[test]
fn record_start_line_names_the_namespace_pid() {
    if !is_root() || !have("unshare") {
        eprintln!("NOTICE: skipping: the namespace test needs root and unshare");
        return;
    }
    let Some(py) = python("3.9") else { return };
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc"])
        .arg(&py.launcher)
        .arg(fixture_script("faults.py"));
    let mut target = spawn_command(cmd);
    target.wait_for_line("ready");
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", target.pid())).unwrap();
    let pid: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    let recording = TempFile::new("ns-line.pyprobe");
    let out = run_pyprobe(&[
        "record",
        "-p",
        &pid.to_string(),
        "-d",
        "0.2",
        "-o",
        recording.path(),
    ]);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let start = stderr
        .lines()
        .find(|l| l.starts_with(&format!("pyprobe: process {pid}")))
        .unwrap_or_else(|| panic!("a start line: {stderr}"));
    assert!(
        start.contains("pid 1 in its own PID namespace"),
        "the start line gives the in-namespace pid: {start}"
    );
    assert_eq!(ask(&mut target, "stop", "result"), "result 144");
}

// ---- seccomp ------------------------------------------------------------------

const SYS_PTRACE: u32 = 101;
const SYS_PROCESS_VM_READV: u32 = 310;

/// A seccomp filter that makes `syscalls` fail with `errno` and allows the rest.
fn deny_filter(syscalls: &[u32], errno: u32) -> Vec<libc::sock_filter> {
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    let stmt = |code, k| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let jeq = |k, jt: usize, jf: usize| libc::sock_filter {
        code: JEQ_K,
        jt: jt as u8,
        jf: jf as u8,
        k,
    };
    let mut prog = vec![
        stmt(LD_W_ABS, 4), // seccomp_data.arch
        jeq(AUDIT_ARCH_X86_64, 1, 0),
        stmt(RET_K, libc::SECCOMP_RET_ALLOW),
        stmt(LD_W_ABS, 0), // seccomp_data.nr
    ];
    for (i, &nr) in syscalls.iter().enumerate() {
        prog.push(jeq(nr, syscalls.len() - i, 0));
    }
    prog.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    prog.push(stmt(RET_K, libc::SECCOMP_RET_ERRNO | errno));
    prog
}

/// pyprobe run under `filter`.
fn pyprobe_filtered(filter: Vec<libc::sock_filter>) -> Command {
    let mut cmd = pyprobe();
    // SAFETY: the closure runs in the forked child before exec and only calls prctl
    // with data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let prog = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_ptr() as *mut libc::sock_filter,
            };
            if libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .collect()
}

#[test]
fn seccomp_filter_blocking_ptrace_or_process_vm_readv_is_named() {
    let Some(py) = python("3.9") else { return };
    let mut target = Target::spawn(&py.launcher, &[&fixture_script("faults.py")]);
    target.wait_for_line("ready");
    let pid = target.pid().to_string();
    let cases: [(&str, &[u32], i32, &[&str]); 4] = [
        (
            "ptrace and process_vm_readv refused with EPERM",
            &[SYS_PTRACE, SYS_PROCESS_VM_READV],
            libc::EPERM,
            &["seccomp filter", "Seccomp: 2", "process_vm_readv"],
        ),
        (
            "process_vm_readv refused with ENOSYS",
            &[SYS_PROCESS_VM_READV],
            libc::ENOSYS,
            &["process_vm_readv", "ENOSYS", "seccomp filter"],
        ),
        (
            "ptrace refused with EPERM",
            &[SYS_PTRACE],
            libc::EPERM,
            &[
                "not permitted to trace",
                "seccomp filter",
                "ptrace",
                "seccomp=unconfined",
            ],
        ),
        (
            "ptrace refused with ENOSYS",
            &[SYS_PTRACE],
            libc::ENOSYS,
            &["ptrace system call", "ENOSYS", "seccomp filter"],
        ),
    ];
    for (what, syscalls, errno, words) in cases {
        let out = pyprobe_filtered(deny_filter(syscalls, errno as u32))
            .args([
                "record",
                "-p",
                &pid,
                "--mode",
                "trace",
                "-o",
                "/tmp/never.pyprobe",
            ])
            .output()
            .unwrap();
        show(what, &out);
        assert_refused_output(&out, &["record", "-p", what], words);
    }
    assert_eq!(
        ask(&mut target, "ping", "pong"),
        "pong 1",
        "the target runs on"
    );

    // Launching under a filter that refuses ptrace: refused, and the command that
    // was started for it does not stay behind, stopped.
    // Output to files, not pipes: a command left behind would hold a pipe open.
    let marker = format!("pyprobe-seccomp-marker-{}", std::process::id());
    let stdout = TempFile::new("seccomp-launch.out");
    let stderr = TempFile::new("seccomp-launch.err");
    let mut child = pyprobe_filtered(deny_filter(&[SYS_PTRACE], libc::EPERM as u32))
        .args(["record", "-o", "/tmp/never.pyprobe", "--"])
        .arg(&py.launcher)
        .args(["-c", "import sys; print(sys.argv)", &marker])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(stdout.as_path()).unwrap())
        .stderr(std::fs::File::create(stderr.as_path()).unwrap())
        .spawn()
        .unwrap();
    let ended = wait_for(Duration::from_secs(20), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !ended {
        let _ = child.kill();
    }
    let out = Output {
        status: child.wait().unwrap(),
        stdout: std::fs::read(stdout.as_path()).unwrap(),
        stderr: std::fs::read(stderr.as_path()).unwrap(),
    };
    show("record -- under seccomp", &out);
    assert!(ended, "pyprobe ends");
    wait_for(Duration::from_secs(3), || {
        processes_with(&marker).is_empty()
    });
    let left = processes_with(&marker);
    let states: Vec<Option<char>> = left.iter().map(|&p| proc_state(p)).collect();
    for &p in &left {
        // SAFETY: kill(2) of a process this test started (through pyprobe).
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert_refused_output(&out, &["record", "--"], &["seccomp filter", "ptrace"]);
    assert!(
        left.is_empty(),
        "the command pyprobe forked but could not trace is left behind: {left:?} {states:?}"
    );
    assert!(!Path::new("/tmp/never.pyprobe").exists());
}
