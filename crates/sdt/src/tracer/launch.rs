//! Starting a command under pyprobe: fork, stop before exec so the parent can seize
//! it, then exec.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use nix::sys::signal::{raise, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{execv, fork, ForkResult, Pid};

/// Finds `program` the way a shell would (a path with `/` as is, else along `PATH`).
pub(crate) fn find_program(program: &str) -> Result<PathBuf> {
    let is_exec = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        if is_exec(&p) {
            return Ok(p);
        }
        bail!("cannot run {program}: no such executable file");
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(program);
        if is_exec(&candidate) {
            return Ok(candidate);
        }
    }
    bail!("cannot run {program}: not found in PATH")
}

/// Forks a child that stops itself (SIGSTOP) and, once continued, execs `path`.
/// Returns when the child is in that stop.
pub(crate) fn spawn_stopped(path: &CString, argv: &[CString]) -> Result<Pid> {
    // SAFETY: the child only calls async-signal-safe functions (raise, execv, _exit)
    // on data prepared before the fork.
    match unsafe { fork() }? {
        ForkResult::Child => {
            let _ = raise(Signal::SIGSTOP);
            let _ = execv(path, argv);
            // SAFETY: leave the forked child without running the parent's destructors.
            unsafe { libc::_exit(127) }
        }
        ForkResult::Parent { child } => loop {
            match waitpid(child, Some(WaitPidFlag::WUNTRACED)) {
                Ok(WaitStatus::Stopped(_, Signal::SIGSTOP)) => return Ok(child),
                Ok(WaitStatus::Exited(_, code)) => {
                    bail!("the command exited with {code} before it started")
                }
                Ok(other) => bail!("the command did not start as expected: {other:?}"),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => bail!("waiting for the command to start: {e}"),
            }
        },
    }
}
