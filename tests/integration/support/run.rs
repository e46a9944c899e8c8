//! Shared helpers of the integration tests: the test interpreters, the C fixtures,
//! target processes that clean up after themselves, and running pyprobe.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};

pub const VERSIONS: [&str; 5] = ["3.9", "3.11", "3.13", "3.14", "3.15"];

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One Debian test interpreter, as fetched by `scripts/fetch-pythons.sh`.
#[derive(Debug, Clone)]
pub struct Python {
    pub version: &'static str,
    /// The launcher that runs it (sets PYTHONHOME, or goes through the unpacked loader).
    pub launcher: PathBuf,
    /// The ELF file carrying the probes.
    pub binary: PathBuf,
}

/// The interpreter of `version`, or `None` with a printed notice when it has not been
/// fetched. Under `PYPROBE_REQUIRE_PYTHONS=1` (as in `scripts/test.sh`) a missing
/// interpreter fails the test instead: CI never passes by skipping.
pub fn python(version: &'static str) -> Option<Python> {
    let launcher = repo().join(".pythons/bin").join(format!("python{version}"));
    let unpacked = repo().join(format!(".pythons/{version}/usr/bin/python{version}"));
    let binary = if unpacked.exists() {
        unpacked
    } else {
        PathBuf::from(format!("/usr/bin/python{version}"))
    };
    if launcher.exists() && binary.exists() {
        return Some(Python {
            version,
            launcher,
            binary,
        });
    }
    missing(&format!(
        "python {version} is not fetched: run scripts/fetch-pythons.sh {version}"
    ));
    None
}

/// Something a test needs is missing (`msg` says what, and how to get it): a
/// failure under `PYPROBE_REQUIRE_PYTHONS=1` (as in `scripts/test.sh`: CI never
/// passes by skipping), else a printed notice, and the caller skips.
pub fn missing(msg: &str) {
    if std::env::var_os("PYPROBE_REQUIRE_PYTHONS").is_some() {
        panic!("{msg}");
    }
    eprintln!("NOTICE: skipping: {msg}");
}

/// A C fixture or test program built by `scripts/build-fixtures.sh`.
pub fn fixture_binary(name: &str) -> PathBuf {
    let path = repo().join("fixtures/build").join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/build-fixtures.sh",
        path.display()
    );
    path
}

pub fn pyprobe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pyprobe"))
}

/// Runs pyprobe with `args`. A `report ... --format json` that succeeds has its
/// document checked against `docs/report.schema.json`.
pub fn run_pyprobe(args: &[&str]) -> Output {
    let out = pyprobe().args(args).output().expect("cannot run pyprobe");
    eprintln!(
        "pyprobe {}: status {:?}\nstderr: {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && is_json_report(args) {
        assert_report_schema(&serde_json::from_slice(&out.stdout).expect("report JSON"));
    }
    out
}

/// Whether `args` ask for `pyprobe report --format json`.
pub fn is_json_report(args: &[&str]) -> bool {
    args.first() == Some(&"report")
        && (args.windows(2).any(|w| w == ["--format", "json"]) || args.contains(&"--format=json"))
}

/// The validator of `docs/report.schema.json`, compiled once.
fn report_schema() -> &'static jsonschema::Validator {
    static SCHEMA: std::sync::OnceLock<jsonschema::Validator> = std::sync::OnceLock::new();
    SCHEMA.get_or_init(|| {
        let path = repo().join("docs/report.schema.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let schema: serde_json::Value = serde_json::from_str(&text).expect("schema is JSON");
        jsonschema::draft202012::new(&schema).expect("a valid draft 2020-12 schema")
    })
}

/// Where `doc` departs from `docs/report.schema.json`: one line per error, none
/// when it conforms.
pub fn report_schema_errors(doc: &serde_json::Value) -> Vec<String> {
    report_schema()
        .iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Fails unless `doc` conforms to `docs/report.schema.json` (a report field added
/// without the schema's update fails here).
pub fn assert_report_schema(doc: &serde_json::Value) {
    let errors = report_schema_errors(doc);
    assert!(
        errors.is_empty(),
        "the report departs from docs/report.schema.json:\n{}",
        errors.join("\n")
    );
}

pub fn json_of(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "pyprobe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("pyprobe printed invalid JSON")
}

/// A running target process, killed when dropped.
pub struct Target {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub stdout: BufReader<ChildStdout>,
}

impl Target {
    /// Starts `program args`, with stdin and stdout piped.
    pub fn spawn(program: &Path, args: &[&str]) -> Target {
        // A process group of its own: job-control stops (SIGTSTP) then work as in a
        // shell, whatever group the test runner itself was started in (an orphaned
        // group discards them).
        let mut child = Command::new(program)
            .process_group(0)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        Target {
            child,
            stdin,
            stdout,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Reads stdout lines until one starts with `prefix`; returns it.
    pub fn wait_for_line(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .stdout
                .read_line(&mut line)
                .expect("reading target stdout");
            assert!(
                n > 0,
                "target ended before printing a line starting with {prefix:?}"
            );
            if line.starts_with(prefix) {
                return line.trim_end().to_owned();
            }
        }
    }

    pub fn send_line(&mut self, text: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{text}").expect("writing target stdin");
        stdin.flush().expect("flushing target stdin");
    }

    /// Closes stdin and reads the rest of stdout (for a target already reaped by a
    /// test's own `waitpid`).
    pub fn read_rest(&mut self) -> String {
        drop(self.stdin.take());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).expect("reading target stdout");
        rest
    }

    /// Closes stdin and collects the rest of stdout and the exit status.
    pub fn finish(mut self) -> (String, std::process::ExitStatus) {
        drop(self.stdin.take());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).expect("reading target stdout");
        let status = self.child.wait().expect("waiting for target");
        (rest, status)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Python target that prints `ready` once started and then waits on stdin.
pub const WAITING_SCRIPT: &str = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n";

/// Reads `len` bytes of a live process's memory (the tests' own ground truth, not
/// through pyprobe).
pub fn read_target_memory(pid: i32, addr: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open /proc/PID/mem");
    let mut buf = vec![0u8; len];
    mem.read_exact_at(&mut buf, addr)
        .unwrap_or_else(|e| panic!("read {len} bytes at {addr:#x} of {pid}: {e}"));
    buf
}

/// Records `fixtures/python/SCRIPT ARGS` under `py` with `pyprobe record EXTRA`;
/// returns the script's stdout and the report JSON.
pub fn record_script(
    py: &Python,
    extra: &[&str],
    script: &str,
    args: &[&str],
) -> (String, serde_json::Value) {
    // A fresh path for each call: tests running at once record the same script.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out_path = std::env::temp_dir().join(format!(
        "pyprobe-sample-{}-{n}-{}-{script}.pyprobe",
        std::process::id(),
        py.version
    ));
    let stdout = record_script_into(py, extra, &out_path, script, args);
    let report = json_of(&run_pyprobe(&[
        "report",
        out_path.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let _ = std::fs::remove_file(out_path);
    (stdout, report)
}

/// `pyprobe record EXTRA -o OUT -- python fixtures/python/SCRIPT ARGS`, which must
/// succeed (its stderr is shown); returns the script's stdout.
pub fn record_script_into(
    py: &Python,
    extra: &[&str],
    out: &Path,
    script: &str,
    args: &[&str],
) -> String {
    let output = pyprobe()
        .arg("record")
        .args(extra)
        .arg("-o")
        .arg(out)
        .arg("--")
        .arg(&py.launcher)
        .arg(repo().join("fixtures/python").join(script))
        .args(args)
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "record failed");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A pure-Python program from PyPI, installed once into a git-ignored cache
/// (`target/pypi/NAME-VERSION`) by the machine's `python3.11 -m pip`; returns the
/// folder to put on `PYTHONPATH`. Pure wheels run under every test interpreter.
pub fn pypi(name: &str, version: &str) -> PathBuf {
    pypi_install(name, version, &[])
}

/// As [`pypi`], but the pure-Python wheel even where a compiled one exists
/// (black ships compiled wheels, whose functions no Python frame shows).
pub fn pypi_pure(name: &str, version: &str) -> PathBuf {
    pypi_install(
        name,
        version,
        &[
            "--only-binary=:all:",
            "--platform",
            "any",
            "--implementation",
            "py",
        ],
    )
}

/// As [`pypi`], but the compiled wheel for CPython `python` ("3.13"), whichever
/// interpreter installs it: packages with C extensions (numpy).
pub fn pypi_compiled(name: &str, version: &str, python: &str) -> PathBuf {
    let abi = format!("cp{}", python.replace('.', ""));
    pypi_install_in(
        &format!("{name}-{version}-{abi}"),
        name,
        version,
        &[
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--abi",
            &abi,
            "--platform",
            "manylinux2014_x86_64",
        ],
    )
}

fn pypi_install(name: &str, version: &str, pip_args: &[&str]) -> PathBuf {
    pypi_install_in(&format!("{name}-{version}"), name, version, pip_args)
}

/// As [`pypi_pure`], with the pure-Python wheels of its dependencies too (their
/// newest), for a program that needs them (aiohttp: multidict, yarl, ...).
pub fn pypi_pure_with_deps(name: &str, version: &str) -> PathBuf {
    pypi_install_in(
        &format!("{name}-{version}-with-deps"),
        name,
        version,
        &[
            "--with-deps",
            "--only-binary=:all:",
            "--platform",
            "any",
            "--implementation",
            "py",
        ],
    )
}

fn pypi_install_in(folder: &str, name: &str, version: &str, pip_args: &[&str]) -> PathBuf {
    let dir = repo().join("target/pypi").join(folder);
    if dir.join(".complete").exists() {
        return dir;
    }
    // Installed beside, then renamed: tests running at once never see half of it.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = repo()
        .join("target/pypi")
        .join(format!(".{name}-{version}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    // `--with-deps` is ours: pip is told `--no-deps` unless it is given.
    let with_deps = pip_args.contains(&"--with-deps");
    let out = Command::new("python3.11")
        .args(["-m", "pip", "install", "--quiet"])
        .args((!with_deps).then_some("--no-deps"))
        .args(pip_args.iter().filter(|a| **a != "--with-deps"))
        .arg("--target")
        .arg(&partial)
        .arg(format!("{name}=={version}"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3.11 -m pip to install {name}: {e}"));
    assert!(
        out.status.success(),
        "installing {name}=={version} from PyPI failed (python3.11 -m pip; Debian: python3-pip): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(partial.join(".complete"), b"").unwrap();
    if std::fs::rename(&partial, &dir).is_err() {
        // Another test installed it meanwhile.
        let _ = std::fs::remove_dir_all(&partial);
    }
    assert!(
        dir.join(".complete").exists(),
        "{} installed",
        dir.display()
    );
    dir
}

/// pyenv-style builds (`$PYENV_ROOT/versions/X.Y.Z`, usually `--enable-shared`: the
/// interpreter is in `libpython3.X.so`, without SDT notes), each one present.
pub fn pyenv_builds() -> Vec<(String, PathBuf)> {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")))
        .unwrap_or_else(|| PathBuf::from("/root/.pyenv"));
    let mut builds: Vec<(String, PathBuf)> = std::fs::read_dir(root.join("versions"))
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let dir = e.ok()?.path();
            let name = dir.file_name()?.to_str()?.to_owned();
            let mut parts = name.split('.');
            let (major, minor) = (parts.next()?, parts.next()?);
            let exe = dir.join(format!("bin/python{major}.{minor}"));
            exe.exists().then_some((format!("{major}.{minor}"), exe))
        })
        .collect();
    builds.sort();
    builds
}

/// A pyenv-style build of `version` (`X.Y`, from [`pyenv_builds`]) as a test
/// interpreter, named `pyenv-X.Y`: its launcher and its binary are its executable.
pub fn pyenv_python(version: &str, exe: PathBuf) -> Python {
    Python {
        version: Box::leak(format!("pyenv-{version}").into_boxed_str()),
        launcher: exe.clone(),
        binary: exe,
    }
}

/// Every interpreter to run library-level checks on: Debian's and pyenv's.
pub fn all_interpreters() -> Vec<(String, PathBuf)> {
    let mut all: Vec<(String, PathBuf)> = VERSIONS
        .iter()
        .filter_map(|v| python(v).map(|p| (v.to_string(), p.launcher)))
        .collect();
    all.extend(pyenv_builds().into_iter().filter(|(v, _)| {
        v.starts_with("3.") && v[2..].parse::<u32>().is_ok_and(|minor| minor >= 7)
    }));
    all
}
