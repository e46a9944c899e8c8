//! `/proc/PID/status` and `/proc/PID/task`.

use anyhow::{Context, Result};

#[derive(Debug, Clone, Default)]
pub struct ProcessStatus {
    pub name: String,
    /// Single-letter state (R, S, D, T, t, Z, X, I).
    pub state: char,
    pub tgid: i32,
    /// The PID in each nested PID namespace, outermost (ours) first.
    pub ns_pids: Vec<i32>,
    pub uid: u32,
    pub threads: u32,
    /// Kernel threads have no user address space.
    pub kernel_thread: bool,
}

impl ProcessStatus {
    pub fn read(pid: i32) -> Result<ProcessStatus> {
        let path = format!("/proc/{pid}/status");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
        let mut status = ProcessStatus::parse(&text);
        // Kernel threads have an empty /proc/PID/cmdline and no mm: `VmSize` is absent.
        status.kernel_thread = !text.contains("\nVmSize:");
        Ok(status)
    }

    pub fn parse(text: &str) -> ProcessStatus {
        let mut s = ProcessStatus::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match key {
                "Name" => s.name = value.to_owned(),
                "State" => s.state = value.chars().next().unwrap_or('?'),
                "Tgid" => s.tgid = value.parse().unwrap_or(0),
                "NSpid" => {
                    s.ns_pids = value
                        .split_whitespace()
                        .filter_map(|v| v.parse().ok())
                        .collect()
                }
                "Uid" => {
                    s.uid = value
                        .split_whitespace()
                        .next()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0)
                }
                "Threads" => s.threads = value.parse().unwrap_or(0),
                _ => {}
            }
        }
        s
    }

    /// The PID as the target itself sees it, when it lives in another PID namespace.
    pub fn inner_pid(&self) -> Option<i32> {
        (self.ns_pids.len() > 1).then(|| *self.ns_pids.last().unwrap_or(&0))
    }
}

/// Thread ids of a process, from `/proc/PID/task`.
pub fn thread_ids(pid: i32) -> Result<Vec<i32>> {
    let dir = format!("/proc/{pid}/task");
    let mut tids: Vec<i32> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot list {dir}"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    Ok(tids)
}

/// The command line of a process (NUL-separated in `/proc/PID/cmdline`).
pub fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| {
            bytes
                .split(|&b| b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Checks that `pid` is a user process pyprobe could read, with one clear sentence
/// when it is not.
pub fn check_inspectable(pid: i32) -> Result<ProcessStatus> {
    if pid <= 0 {
        anyhow::bail!("{pid} is not a valid process id");
    }
    let status = match ProcessStatus::read(pid) {
        Ok(s) => s,
        Err(_) => {
            anyhow::bail!("no process with pid {pid} exists (or it is not visible from here)")
        }
    };
    if status.state == 'Z' {
        anyhow::bail!(
            "process {pid} ({}) is a zombie: it has exited and has no memory to read",
            status.name
        );
    }
    if status.kernel_thread {
        anyhow::bail!(
            "process {pid} ({}) is a kernel thread, not a user program",
            status.name
        );
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_namespaced_pid() {
        let s = ProcessStatus::parse("Name:\tpython3\nState:\tS (sleeping)\nTgid:\t4242\nNSpid:\t4242\t7\nUid:\t1000\t1000\t1000\t1000\nThreads:\t3\n");
        assert_eq!(s.name, "python3");
        assert_eq!(s.state, 'S');
        assert_eq!(s.ns_pids, vec![4242, 7]);
        assert_eq!(s.inner_pid(), Some(7));
        assert_eq!((s.uid, s.threads), (1000, 3));
    }
}
