//! `/proc/PID/status` and `/proc/PID/task`.

use anyhow::{Context, Result};

/// `CAP_SYS_PTRACE`, bit 19 of the capability sets.
const CAP_SYS_PTRACE: u32 = 19;
/// Task flags (field 9 of /proc/PID/stat): exiting, kernel thread.
const PF_EXITING: u64 = 0x0000_0004;
const PF_KTHREAD: u64 = 0x0020_0000;

#[derive(Debug, Clone, Default)]
pub struct ProcessStatus {
    pub name: String,
    /// Single-letter state (R, S, D, T, t, Z, X, I).
    pub state: char,
    pub(crate) tgid: i32,
    pub(crate) ppid: i32,
    /// The PID in each nested PID namespace, outermost (ours) first.
    pub(crate) ns_pids: Vec<i32>,
    /// Real user id.
    pub uid: u32,
    /// Real, effective, saved and filesystem user ids.
    pub(crate) uids: [u32; 4],
    /// Real, effective, saved and filesystem group ids.
    pub(crate) gids: [u32; 4],
    pub threads: u32,
    /// The process tracing this one (0: none).
    pub(crate) tracer_pid: i32,
    /// Effective capabilities (`CapEff`).
    pub(crate) cap_eff: u64,
    /// Seccomp mode: 0 none, 1 strict, 2 filter; `None` when the kernel does not say.
    pub(crate) seccomp: Option<u32>,
    /// Kernel threads have no user address space.
    pub kernel_thread: bool,
    /// The (leader) task is exiting: its memory is going or gone.
    pub(crate) exiting: bool,
}

impl ProcessStatus {
    pub fn read(pid: i32) -> Result<ProcessStatus> {
        let path = format!("/proc/{pid}/status");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
        let mut status = ProcessStatus::parse(&text);
        match stat_flags(pid) {
            Some(flags) => {
                status.kernel_thread = flags & PF_KTHREAD != 0;
                status.exiting = flags & PF_EXITING != 0;
            }
            // Kernel threads have no mm: `VmSize` is absent (but so it is for a
            // process whose exit released its memory).
            None => status.kernel_thread = !text.contains("\nVmSize:"),
        }
        Ok(status)
    }

    /// pyprobe's own status.
    pub(crate) fn own() -> Result<ProcessStatus> {
        Self::read(std::process::id() as i32)
    }

    pub fn parse(text: &str) -> ProcessStatus {
        let mut s = ProcessStatus::default();
        let ids = |value: &str| {
            let mut out = [0u32; 4];
            for (slot, v) in out.iter_mut().zip(value.split_whitespace()) {
                *slot = v.parse().unwrap_or(0);
            }
            out
        };
        for line in text.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match key {
                "Name" => s.name = value.to_owned(),
                "State" => s.state = value.chars().next().unwrap_or('?'),
                "Tgid" => s.tgid = value.parse().unwrap_or(0),
                "PPid" => s.ppid = value.parse().unwrap_or(0),
                "NSpid" => {
                    s.ns_pids = value
                        .split_whitespace()
                        .filter_map(|v| v.parse().ok())
                        .collect()
                }
                "Uid" => {
                    s.uids = ids(value);
                    s.uid = s.uids[0];
                }
                "Gid" => s.gids = ids(value),
                "Threads" => s.threads = value.parse().unwrap_or(0),
                "TracerPid" => s.tracer_pid = value.parse().unwrap_or(0),
                "CapEff" => s.cap_eff = u64::from_str_radix(value, 16).unwrap_or(0),
                "Seccomp" => s.seccomp = value.parse().ok(),
                _ => {}
            }
        }
        s
    }

    /// The PID as the target itself sees it, when it lives in another PID namespace.
    pub fn inner_pid(&self) -> Option<i32> {
        (self.ns_pids.len() > 1).then(|| *self.ns_pids.last().unwrap_or(&0))
    }

    /// Whether the effective capabilities hold CAP_SYS_PTRACE.
    pub(crate) fn has_cap_sys_ptrace(&self) -> bool {
        self.cap_eff & (1 << CAP_SYS_PTRACE) != 0
    }

    /// Whether a seccomp filter is installed on the process (`Seccomp: 2`).
    pub(crate) fn seccomp_filtered(&self) -> bool {
        self.seccomp == Some(2)
    }
}

/// The task flags of `pid` (field 9 of /proc/PID/stat, after the parenthesised name).
fn stat_flags(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(6)?
        .parse()
        .ok()
}

/// The scheduler state of thread `tid` of process `pid`, the letter after the name
/// in `/proc/PID/task/TID/stat`: `R` running or runnable, `S` asleep (a system call,
/// a lock), `D` waiting in the kernel (I/O), `T` stopped, `t` in a ptrace-stop, `Z`
/// zombie, ...; `None` when it cannot be read (the thread is gone). One bounded read:
/// cheap enough for every thread at every sample.
pub(crate) fn task_state(pid: i32, tid: i32) -> Option<char> {
    use std::io::Read;
    let mut file = std::fs::File::open(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    // `tid (name) S ...`: the name is at most 64 bytes, so the state is well inside.
    let mut buf = [0u8; 128];
    let mut len = 0;
    while len < buf.len() {
        match file.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    parse_stat_state(&buf[..len])
}

/// A thread's `/proc` file kept open, read afresh with one `pread` each time: for
/// looks made often (every few hits, every few milliseconds), where opening,
/// reading and closing would cost three system calls and a path lookup.
#[derive(Debug, Default)]
pub(crate) struct KeptTaskFile {
    /// The file open now, and the thread (`pid`, `tid`) it belongs to.
    open: Option<((i32, i32), std::fs::File)>,
    buf: Vec<u8>,
}

impl KeptTaskFile {
    /// At most this much of the file is read: a `stat` line is a few hundred
    /// bytes; a longer one (a hostile name) is cut.
    const MAX_LEN: usize = 4096;

    /// The start of `/proc/PID/task/TID/NAME` as it is now; `None` when the
    /// thread is gone (the next call opens afresh).
    pub fn read(&mut self, pid: i32, tid: i32, name: &str) -> Option<&[u8]> {
        use std::os::unix::fs::FileExt;
        if self.open.as_ref().map(|(who, _)| *who) != Some((pid, tid)) {
            let file = std::fs::File::open(format!("/proc/{pid}/task/{tid}/{name}")).ok();
            self.open = file.map(|f| ((pid, tid), f));
        }
        let (_, file) = self.open.as_ref()?;
        self.buf.resize(Self::MAX_LEN, 0);
        let Ok(n) = file.read_at(&mut self.buf, 0) else {
            self.open = None;
            return None;
        };
        Some(&self.buf[..n])
    }

    /// The thread's scheduler state (see [`task_state`]), from a kept `stat`.
    pub fn state(&mut self, pid: i32, tid: i32) -> Option<char> {
        parse_stat_state(self.read(pid, tid, "stat")?)
    }
}

/// The state letter of a `/proc/.../stat` line (or its start): the first character
/// after the last `)`, which closes the name (a name may hold `)` itself).
fn parse_stat_state(stat: &[u8]) -> Option<char> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let state = *stat.get(close + 2)?;
    (stat.get(close + 1) == Some(&b' ') && state.is_ascii_alphabetic()).then_some(state as char)
}

/// Field 22 of `/proc/PID/stat`: when the process started, in clock ticks.
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: count from the last ')'.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Whether thread `tid` of `pid` is gone or a zombie.
pub(crate) fn task_gone_or_zombie(pid: i32, tid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim().chars().next());
    matches!(state, None | Some('Z' | 'X'))
}

/// Whether process `pid` is on its way out or gone: reaped, a zombie, or its main
/// thread exiting (it lets its memory go before it turns zombie).
pub fn process_is_ending(pid: i32) -> bool {
    task_gone_or_zombie(pid, pid) || thread_is_ending(pid)
}

/// Whether thread `tid` is ending (or already gone): ptrace refuses to seize such a
/// thread with EPERM, and there is nothing left of it to trace.
pub(crate) fn thread_is_ending(tid: i32) -> bool {
    match stat_flags(tid) {
        Some(flags) => flags & PF_EXITING != 0,
        None => true,
    }
}

/// One field of `/proc/TID/status`, its value trimmed; for the callers that need
/// one value often (at each thread creation, each stopped thread) without parsing
/// the whole file.
fn status_field(tid: i32, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// The process (thread group) thread `tid` belongs to.
pub(crate) fn tgid_of(tid: i32) -> Option<i32> {
    status_field(tid, "Tgid")?.parse().ok()
}

/// The process tracing `tid`, 0 for none.
pub fn tracer_of(tid: i32) -> Option<i32> {
    status_field(tid, "TracerPid")?.parse().ok()
}

/// A signal set of thread `tid`: `SigPnd` (pending for it) or `SigBlk` (blocked).
pub(crate) fn signal_set(tid: i32, name: &str) -> Option<u64> {
    u64::from_str_radix(&status_field(tid, name)?, 16).ok()
}

/// Whether SIGTRAP is pending for thread `tid`.
pub(crate) fn sigtrap_pending(tid: i32) -> bool {
    signal_set(tid, "SigPnd").is_some_and(|mask| mask & (1 << (libc::SIGTRAP - 1)) != 0)
}

/// Whether thread `tid` is traced by this process.
pub(crate) fn traced_by_us(tid: i32) -> bool {
    tracer_of(tid) == Some(std::process::id() as i32)
}

/// `" (pid N in its own PID namespace)"` when `pid` lives in a nested PID namespace,
/// else an empty string: for start lines that name a process.
pub fn ns_pid_note(pid: i32) -> String {
    ProcessStatus::read(pid)
        .ok()
        .and_then(|s| s.inner_pid())
        .map(|n| format!(" (pid {n} in its own PID namespace)"))
        .unwrap_or_default()
}

/// Thread ids of a process, from `/proc/PID/task`.
pub(crate) fn thread_ids(pid: i32) -> Result<Vec<i32>> {
    let dir = format!("/proc/{pid}/task");
    let mut tids: Vec<i32> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot list {dir}"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    Ok(tids)
}

/// The processes descending from `pid` now (children, their children, ...),
/// parents before their children, at most `limit`: from `/proc/PID/task/TID/children`,
/// or where the kernel lacks it, from every process's parent in `/proc`.
pub(crate) fn descendants(pid: i32, limit: usize) -> Vec<(i32, i32)> {
    let mut out: Vec<(i32, i32)> = Vec::new();
    let mut scan: Option<Vec<(i32, i32)>> = None;
    let mut next = 0;
    let mut parents = vec![pid];
    while next < parents.len() && out.len() < limit {
        let parent = parents[next];
        next += 1;
        let children = children_of(parent).unwrap_or_else(|| {
            let all = scan.get_or_insert_with(parent_links);
            all.iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c)
                .collect()
        });
        for child in children {
            if child != pid && !out.iter().any(|(c, _)| *c == child) && out.len() < limit {
                out.push((child, parent));
                parents.push(child);
            }
        }
    }
    out
}

/// The children of every thread of `pid` (`None`: the kernel does not list them).
fn children_of(pid: i32) -> Option<Vec<i32>> {
    let mut found = Vec::new();
    for tid in thread_ids(pid).ok()? {
        let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/children")).ok()?;
        found.extend(
            text.split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok()),
        );
    }
    Some(found)
}

/// (pid, parent pid) of every process in `/proc`.
fn parent_links() -> Vec<(i32, i32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|p| Some((p, ProcessStatus::read(p).ok()?.ppid)))
        .collect()
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
/// when it is not: no such process, a zombie, a kernel thread, or a process whose
/// memory the kernel will not let pyprobe read (and why: see `access`).
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
    if status.state == 'Z' || status.state == 'X' {
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
    if status.exiting {
        anyhow::bail!(
            "process {pid} ({}) is exiting: it has no memory left to read",
            status.name
        );
    }
    super::access::check_readable(pid)?;
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

    #[test]
    fn parses_credentials_tracer_and_seccomp() {
        let s = ProcessStatus::parse(
            "Name:\tpyprobe\nPPid:\t1\nTracerPid:\t77\nUid:\t1000\t0\t1000\t0\nGid:\t5\t6\t7\t8\n\
             CapEff:\t00000000a80425fb\nSeccomp:\t2\nSeccomp_filters:\t1\n",
        );
        assert_eq!((s.ppid, s.tracer_pid), (1, 77));
        assert_eq!((s.uids, s.gids), ([1000, 0, 1000, 0], [5, 6, 7, 8]));
        assert!(s.seccomp_filtered());
        // 0xa80c25fb has bit 19 (0x80000) clear: Docker's default set.
        assert!(!s.has_cap_sys_ptrace());
        let root = ProcessStatus::parse("CapEff:\t000001ffffffffff\nSeccomp:\t0\n");
        assert!(root.has_cap_sys_ptrace() && !root.seccomp_filtered());
        assert_eq!(ProcessStatus::parse("Name:\tx\n").seccomp, None);
    }

    #[test]
    fn descendants_are_found_parents_first() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 5 & sleep 5 & wait"])
            .spawn()
            .unwrap();
        let me = std::process::id() as i32;
        let shell = child.id() as i32;
        let mut found = Vec::new();
        for _ in 0..200 {
            found = descendants(me, 64);
            if found.iter().filter(|(_, p)| *p == shell).count() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let limited = descendants(me, 1).len();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(limited, 1);
        let shell_at = found.iter().position(|(c, _)| *c == shell).unwrap();
        assert!(
            found
                .iter()
                .enumerate()
                .all(|(i, (_, p))| *p != shell || i > shell_at),
            "{found:?}"
        );
        assert_eq!(
            found.iter().filter(|(_, p)| *p == shell).count(),
            2,
            "{found:?}"
        );
    }

    #[test]
    fn kernel_threads_and_exiting_tasks_by_their_flags() {
        // pid 2 is kthreadd where this is not a PID namespace of its own.
        if std::fs::read_to_string("/proc/2/comm").is_ok_and(|c| c.trim() == "kthreadd") {
            let k = ProcessStatus::read(2).unwrap();
            assert!(k.kernel_thread && !k.exiting);
        }
        let me = ProcessStatus::read(std::process::id() as i32).unwrap();
        assert!(!me.kernel_thread && !me.exiting);
    }

    #[test]
    fn stat_state_is_read_after_the_name() {
        assert_eq!(parse_stat_state(b"12 (python3) S 1 12 12 0"), Some('S'));
        assert_eq!(parse_stat_state(b"12 (a) b) (c) R 1 12"), Some('R'));
        assert_eq!(parse_stat_state(b"12 (python3"), None);
        assert_eq!(parse_stat_state(b"12 (x)"), None);
        assert_eq!(parse_stat_state(b"12 (x) 7"), None);
        let me = std::process::id() as i32;
        // SAFETY: gettid cannot fail.
        let tid = unsafe { libc::gettid() };
        // This thread runs while it reads its own state.
        assert_eq!(task_state(me, tid), Some('R'));
        assert_eq!(task_state(me, i32::MAX), None);
    }

    #[test]
    fn a_kept_file_follows_its_thread_and_reopens_for_another() {
        let me = std::process::id() as i32;
        // SAFETY: gettid cannot fail.
        let tid = unsafe { libc::gettid() };
        let mut kept = KeptTaskFile::default();
        assert_eq!(kept.state(me, tid), Some('R'));
        // A sleeping thread, read through the same kept file (reopened for it).
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || {
            // SAFETY: gettid cannot fail.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = done_rx.recv();
        });
        let other = rx.recv().unwrap();
        let mut state = None;
        for _ in 0..1000 {
            state = kept.state(me, other);
            if state == Some('S') {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(state, Some('S'));
        done_tx.send(()).unwrap();
        sleeper.join().unwrap();
        // Gone: nothing, and the next look opens afresh. (A joined thread's task may
        // outlive the join by a moment: the kernel clears its tid for the joiner
        // before it has left /proc.)
        let mut gone = kept.state(me, other);
        for _ in 0..1000 {
            if gone.is_none() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
            gone = kept.state(me, other);
        }
        assert_eq!(gone, None);
        assert_eq!(kept.state(me, tid), Some('R'));
        assert_eq!(kept.state(me, i32::MAX), None);
    }

    #[test]
    fn own_process_is_inspectable() {
        let me = check_inspectable(std::process::id() as i32).unwrap();
        assert_eq!(me.tgid, std::process::id() as i32);
        assert!(!me.kernel_thread);
        assert_eq!(ns_pid_note(std::process::id() as i32), "");
    }
}
