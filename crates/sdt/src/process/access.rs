//! Whether pyprobe may trace or read a process, and when the kernel refuses, why in
//! words a user can act on: the Yama `ptrace_scope`, another user's process without
//! CAP_SYS_PTRACE, a process that is not dumpable, one that is already traced, or a
//! seccomp filter around pyprobe that blocks `ptrace` or `process_vm_readv` — and
//! what to do.

use anyhow::{Context, Result};
use nix::errno::Errno;

use crate::process::status::ProcessStatus;

/// What pyprobe tried to do when the kernel said no.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `ptrace(PTRACE_SEIZE)`: tracing.
    Trace,
    /// `process_vm_readv`: reading memory.
    Memory,
    /// Reading `/proc/PID/maps` (the same permission check as reading memory).
    Maps,
}

impl Access {
    fn verb(self) -> &'static str {
        match self {
            Access::Trace => "trace",
            Access::Memory | Access::Maps => "read the memory of",
        }
    }

    fn syscall(self) -> &'static str {
        match self {
            Access::Trace => "ptrace",
            Access::Memory | Access::Maps => "process_vm_readv",
        }
    }
}

/// The kernel refused `access` to `pid` with `errno`; its text says why and what to do.
#[derive(Debug, Clone)]
pub struct Refused {
    pub pid: i32,
    pub errno: Errno,
    pub access: Access,
    explanation: String,
}

impl Refused {
    /// Explains the refusal from what /proc says now.
    pub(crate) fn gather(pid: i32, errno: Errno, access: Access) -> Refused {
        Refused {
            pid,
            errno,
            access,
            explanation: explain_refusal(pid, errno, access, &Facts::gather(pid)),
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.explanation)
    }
}

impl std::error::Error for Refused {}

/// The error for a failed `PTRACE_SEIZE` of `pid`.
pub fn seize_error(pid: i32, e: Errno) -> anyhow::Error {
    match e {
        Errno::EPERM | Errno::EACCES | Errno::ENOSYS => {
            anyhow::Error::new(Refused::gather(pid, e, Access::Trace))
        }
        Errno::ESRCH => {
            anyhow::anyhow!("process {pid} does not exist (or exited while pyprobe was attaching)")
        }
        other => anyhow::anyhow!("cannot trace process {pid}: {other}"),
    }
}

/// The error for a refused read of `pid`'s memory (or memory map).
pub fn read_error(pid: i32, e: Errno, access: Access) -> anyhow::Error {
    anyhow::Error::new(Refused::gather(pid, e, access))
}

/// What the explanation is built from; gathered from /proc, or made up in tests.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// `/proc/sys/kernel/yama/ptrace_scope`; `None` when the kernel has no Yama.
    pub(crate) yama_scope: Option<u32>,
    /// pyprobe itself.
    pub(crate) own: ProcessStatus,
    /// The target, if its status could be read.
    pub(crate) target: Option<ProcessStatus>,
    /// The target's /proc files belong to root although it runs as another user:
    /// it is not dumpable (setuid, or `prctl(PR_SET_DUMPABLE, 0)`).
    pub(crate) target_not_dumpable: bool,
}

impl Facts {
    pub(crate) fn gather(pid: i32) -> Facts {
        use std::os::unix::fs::MetadataExt;
        let target = ProcessStatus::read(pid).ok();
        let target_not_dumpable = target.as_ref().is_some_and(|t| {
            t.uids[1] != 0
                && std::fs::metadata(format!("/proc/{pid}/environ")).is_ok_and(|m| m.uid() == 0)
        });
        Facts {
            yama_scope: std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
                .ok()
                .and_then(|s| s.trim().parse().ok()),
            own: ProcessStatus::own().unwrap_or_default(),
            target,
            target_not_dumpable,
        }
    }
}

fn user_name(uid: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        let id: u32 = f.nth(1)?.parse().ok()?;
        (id == uid).then(|| name.to_owned())
    })
}

fn describe_uid(uid: u32) -> String {
    match user_name(uid) {
        Some(name) => format!("uid {uid} ({name})"),
        None => format!("uid {uid}"),
    }
}

const CAPABILITY_FIX: &str = "give pyprobe CAP_SYS_PTRACE (run it as root or with `sudo`; in \
    Docker: `--cap-add=SYS_PTRACE`; in Kubernetes: `securityContext.capabilities.add: \
    [SYS_PTRACE]`, or `kubectl debug --profile=general`)";

const LAUNCH_FIX: &str = "or start the program under pyprobe (`pyprobe record -- CMD ARGS`)";

const SECCOMP_FIX: &str = "run pyprobe without that filter (Docker: `--security-opt \
    seccomp=unconfined`, or a profile that allows ptrace and process_vm_readv; Kubernetes: \
    `securityContext.seccompProfile.type: Unconfined`)";

/// One line: why the kernel refused `access` to `pid` with `e`, and what to do.
pub fn explain_refusal(pid: i32, e: Errno, access: Access, facts: &Facts) -> String {
    let own_pid = std::process::id() as i32;
    let head = match &facts.target {
        // `record -- CMD`: the child has not run the command yet and still bears
        // pyprobe's name.
        Some(t) if t.ppid == own_pid && t.ppid != 0 => format!(
            "not permitted to {} the command pyprobe started (process {pid})",
            access.verb()
        ),
        Some(t) => format!(
            "not permitted to {} process {pid} ({})",
            access.verb(),
            t.name
        ),
        None => format!("not permitted to {} process {pid}", access.verb()),
    };
    // The kernel refuses to attach to a task that is exiting (EPERM): say that.
    let gone = match &facts.target {
        None => true,
        Some(t) => t.exiting || t.state == 'Z' || t.state == 'X',
    };
    if gone && e != Errno::ENOSYS {
        return format!("process {pid} exited while pyprobe was attaching");
    }
    let seccomp = facts.own.seccomp_filtered();
    if e == Errno::ENOSYS {
        return if seccomp {
            format!(
                "{head}: the {} system call is refused with ENOSYS by a seccomp filter around \
                 pyprobe (Seccomp: 2 in /proc/self/status). To fix: {SECCOMP_FIX}",
                access.syscall()
            )
        } else {
            format!(
                "{head}: the {} system call is not available (ENOSYS): this kernel was built \
                 without it, or a sandbox refuses it",
                access.syscall()
            )
        };
    }
    if let Some(t) = &facts.target {
        if t.tracer_pid != 0 && t.tracer_pid != own_pid && access == Access::Trace {
            let tracer = ProcessStatus::read(t.tracer_pid)
                .map(|s| format!(" ({})", s.name))
                .unwrap_or_default();
            return format!(
                "{head}: it is already being traced by process {}{tracer}, and a process has \
                 only one tracer. To fix: end or detach that debugger or profiler first",
                t.tracer_pid
            );
        }
    }
    let cap = facts.own.has_cap_sys_ptrace();
    let euid = facts.own.uids[1];
    let mut why: Vec<String> = Vec::new();
    let mut fixes: Vec<String> = Vec::new();
    match facts.yama_scope {
        Some(3) => {
            return format!(
                "{head}: Yama ptrace_scope is 3 (no attach): ptrace is disabled on this machine \
                 for every process and user until it reboots. To fix: reboot with \
                 kernel.yama.ptrace_scope set to 0, 1 or 2"
            )
        }
        Some(2) if !cap => {
            why.push(
                "Yama ptrace_scope is 2 (admin-only): only a process with CAP_SYS_PTRACE may \
                 trace or read another"
                    .into(),
            );
            fixes.push(CAPABILITY_FIX.into());
        }
        Some(1) if !cap => {
            why.push(
                "Yama ptrace_scope is 1 (restricted): a process may trace only its own \
                 descendants, unless it has CAP_SYS_PTRACE"
                    .into(),
            );
            fixes.push(LAUNCH_FIX.trim_start_matches("or ").into());
            fixes.push(CAPABILITY_FIX.into());
            fixes.push("set `sysctl kernel.yama.ptrace_scope=0`".into());
        }
        _ => {}
    }
    if let Some(t) = &facts.target {
        let foreign = t.uids[..3].iter().any(|&u| u != euid);
        if foreign && !cap {
            why.push(format!(
                "it belongs to {} and pyprobe runs as {} without CAP_SYS_PTRACE",
                describe_uid(t.uids[1]),
                describe_uid(euid)
            ));
            if !fixes.iter().any(|f| f == CAPABILITY_FIX) {
                fixes.push(format!(
                    "run pyprobe as {} or {CAPABILITY_FIX}",
                    user_name(t.uids[1]).unwrap_or_else(|| format!("uid {}", t.uids[1]))
                ));
            }
        } else if facts.target_not_dumpable && !cap {
            why.push(
                "it is not dumpable (a setuid or setgid program, or one that called \
                 prctl(PR_SET_DUMPABLE, 0)), so only CAP_SYS_PTRACE may trace it"
                    .into(),
            );
            fixes.push(CAPABILITY_FIX.into());
        }
    }
    if seccomp {
        why.push(format!(
            "pyprobe runs under a seccomp filter (Seccomp: 2 in /proc/self/status), which may \
             refuse {} (container runtimes' default profiles often do)",
            access.syscall()
        ));
        fixes.push(SECCOMP_FIX.into());
    }
    if why.is_empty() {
        why.push(format!(
            "the kernel said {e} although pyprobe {} and the target's owner and Yama allow it: \
             a security module (AppArmor, SELinux) or a user namespace boundary may forbid it",
            if cap {
                "has CAP_SYS_PTRACE"
            } else {
                "runs as the same user"
            }
        ));
        fixes.push(CAPABILITY_FIX.into());
    }
    if !fixes.iter().any(|f| f.contains("pyprobe record --")) {
        fixes.push(LAUNCH_FIX.into());
    }
    format!("{head}: {}. To fix: {}", why.join("; "), fixes.join("; "))
}

/// Reads the target's memory map and one byte of its first mapping through
/// `process_vm_readv`: the kernel refuses both exactly when it would refuse
/// pyprobe's reads later (another user, Yama, a seccomp filter), so say why now.
pub(crate) fn check_readable(pid: i32) -> Result<()> {
    let maps = match std::fs::read_to_string(format!("/proc/{pid}/maps")) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(read_error(pid, nix::errno::Errno::EACCES, Access::Maps));
        }
        Err(e)
            if e.raw_os_error() == Some(libc::ESRCH)
                || e.kind() == std::io::ErrorKind::NotFound =>
        {
            anyhow::bail!("process {pid} exited while pyprobe was looking at it")
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read /proc/{pid}/maps")),
    };
    // The first readable mapping that is ordinary memory ([vvar] and [vsyscall] are not
    // readable through process_vm_readv).
    let start = maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let range = fields.next()?;
        let perms = fields.next()?;
        let name = line.split_whitespace().nth(5).unwrap_or("");
        if !perms.starts_with('r') || name == "[vvar]" || name == "[vsyscall]" {
            return None;
        }
        u64::from_str_radix(range.split('-').next()?, 16).ok()
    });
    let Some(start) = start else {
        return Ok(());
    };
    let mut byte = [0u8; 1];
    let local = [std::io::IoSliceMut::new(&mut byte)];
    let remote = [nix::sys::uio::RemoteIoVec {
        base: start as usize,
        len: 1,
    }];
    let mut local = local;
    match nix::sys::uio::process_vm_readv(nix::unistd::Pid::from_raw(pid), &mut local, &remote) {
        Ok(_) => Ok(()),
        Err(e @ (nix::errno::Errno::EPERM | nix::errno::Errno::ENOSYS)) => {
            Err(read_error(pid, e, Access::Memory))
        }
        Err(nix::errno::Errno::ESRCH) => {
            anyhow::bail!("process {pid} exited while pyprobe was looking at it")
        }
        // EFAULT and the like: the mapping changed under us; later reads will tell.
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(uid: u32, cap: bool, seccomp: u32) -> ProcessStatus {
        ProcessStatus {
            name: "x".into(),
            uids: [uid; 4],
            gids: [uid; 4],
            cap_eff: if cap { 1 << 19 } else { 0 },
            seccomp: Some(seccomp),
            ..ProcessStatus::default()
        }
    }

    fn facts(yama: Option<u32>, own: ProcessStatus, target: ProcessStatus) -> Facts {
        Facts {
            yama_scope: yama,
            own,
            target: Some(ProcessStatus {
                name: "python3".into(),
                ..target
            }),
            target_not_dumpable: false,
        }
    }

    #[test]
    fn another_users_process_without_the_capability() {
        let f = facts(None, status(1000, false, 0), status(0, false, 0));
        let m = explain_refusal(42, Errno::EPERM, Access::Trace, &f);
        assert!(m.starts_with("not permitted to trace process 42 (python3): it belongs to uid 0"));
        for w in [
            "CAP_SYS_PTRACE",
            "--cap-add=SYS_PTRACE",
            "capabilities.add: [SYS_PTRACE]",
            "kubectl debug --profile=general",
            "pyprobe record -- CMD",
        ] {
            assert!(m.contains(w), "{w} in {m}");
        }
        assert!(!m.contains("seccomp") && !m.contains('\n'));
    }

    #[test]
    fn yama_scopes() {
        let same = || facts(Some(1), status(1000, false, 0), status(1000, false, 0));
        let m = explain_refusal(7, Errno::EPERM, Access::Trace, &same());
        assert!(m.contains("ptrace_scope is 1 (restricted)") && m.contains("ptrace_scope=0"));
        assert!(m.contains("pyprobe record -- CMD"));
        let mut f = same();
        f.yama_scope = Some(2);
        let m = explain_refusal(7, Errno::EPERM, Access::Memory, &f);
        assert!(m.contains("not permitted to read the memory of process 7"));
        assert!(m.contains("ptrace_scope is 2 (admin-only)") && m.contains("SYS_PTRACE"));
        f.yama_scope = Some(3);
        let m = explain_refusal(7, Errno::EPERM, Access::Trace, &f);
        assert!(m.contains("ptrace_scope is 3 (no attach)") && m.contains("reboot"));
        // With the capability, scopes 1 and 2 are no reason.
        let f = facts(Some(1), status(1000, true, 0), status(1000, false, 0));
        assert!(!explain_refusal(7, Errno::EPERM, Access::Trace, &f).contains("ptrace_scope is"));
    }

    #[test]
    fn seccomp_filters() {
        let f = facts(None, status(0, true, 2), status(0, false, 0));
        let m = explain_refusal(9, Errno::EPERM, Access::Memory, &f);
        assert!(
            m.contains("seccomp filter") && m.contains("process_vm_readv"),
            "{m}"
        );
        assert!(m.contains("seccomp=unconfined"), "{m}");
        let m = explain_refusal(9, Errno::ENOSYS, Access::Trace, &f);
        assert!(m.contains("ptrace system call is refused with ENOSYS by a seccomp filter"));
        let f = facts(None, status(0, true, 0), status(0, false, 0));
        let m = explain_refusal(9, Errno::ENOSYS, Access::Trace, &f);
        assert!(m.contains("not available (ENOSYS)") && !m.contains("seccomp filter"));
    }

    #[test]
    fn already_traced_and_not_dumpable() {
        let mut target = status(1000, false, 0);
        target.tracer_pid = 999_999_999;
        let f = facts(None, status(1000, false, 0), target);
        let m = explain_refusal(5, Errno::EPERM, Access::Trace, &f);
        assert!(
            m.contains("already being traced by process 999999999"),
            "{m}"
        );
        let mut f = facts(None, status(1000, false, 0), status(1000, false, 0));
        f.target_not_dumpable = true;
        let m = explain_refusal(5, Errno::EPERM, Access::Trace, &f);
        assert!(
            m.contains("not dumpable") && m.contains("CAP_SYS_PTRACE"),
            "{m}"
        );
    }

    #[test]
    fn a_target_exiting_meanwhile_is_named_as_such() {
        let mut target = status(0, false, 0);
        target.exiting = true;
        let f = facts(None, status(1000, false, 0), target);
        let m = explain_refusal(5, Errno::EPERM, Access::Trace, &f);
        assert_eq!(m, "process 5 exited while pyprobe was attaching");
        let mut f = facts(None, status(1000, false, 0), status(0, false, 0));
        f.target = None;
        let m = explain_refusal(5, Errno::EPERM, Access::Memory, &f);
        assert_eq!(m, "process 5 exited while pyprobe was attaching");
    }

    #[test]
    fn unexplained_refusal_still_says_what_to_try() {
        let f = facts(None, status(1000, false, 0), status(1000, false, 0));
        let m = explain_refusal(5, Errno::EPERM, Access::Trace, &f);
        assert!(
            m.contains("security module") && m.contains("SYS_PTRACE"),
            "{m}"
        );
    }
}
