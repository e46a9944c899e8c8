//! Why the kernel refused to let pyprobe trace a process, in words a user can act on.

use nix::errno::Errno;

pub fn seize_error(pid: i32, e: Errno) -> anyhow::Error {
    match e {
        Errno::EPERM => {
            let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok());
            let why = match scope {
                Some(1) => "Yama ptrace_scope is 1: only a parent may trace its children. Start the program \
                            under pyprobe (`pyprobe record -- CMD`), run pyprobe with CAP_SYS_PTRACE, or set \
                            kernel.yama.ptrace_scope=0"
                    .to_string(),
                Some(2) => "Yama ptrace_scope is 2: only processes with CAP_SYS_PTRACE may trace".to_string(),
                Some(3) => "Yama ptrace_scope is 3: ptrace is disabled on this machine".to_string(),
                _ => "the process belongs to another user, or pyprobe lacks CAP_SYS_PTRACE (in Docker: \
                      --cap-add=SYS_PTRACE; in Kubernetes: securityContext.capabilities.add: [SYS_PTRACE] \
                      or `kubectl debug --profile=general`), or it is already being traced"
                    .to_string(),
            };
            anyhow::anyhow!("not permitted to trace process {pid}: {why}")
        }
        Errno::ESRCH => {
            anyhow::anyhow!("process {pid} does not exist (or exited while pyprobe was attaching)")
        }
        other => anyhow::anyhow!("cannot trace process {pid}: {other}"),
    }
}
