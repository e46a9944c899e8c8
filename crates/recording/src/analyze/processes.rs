//! Which process each thread of a recording belongs to, and what each process
//! ran: the recording's own process (the header's), and the children traced with
//! it under `--subprocesses` (`process_start`), each after any `exec`.
//!
//! A thread whose start the recording does not name (threads running at attach,
//! recordings of format 1 and 2) belongs to the recording's process.

use rustc_hash::FxHashMap;

use crate::recording::{Event, EventKind, Header, StrId};

/// One process of a recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ProcessInfo {
    pub pid: u32,
    /// The traced process it was forked from; `None` for the recording's own.
    pub parent: Option<u32>,
    /// Its command line now (after its last `exec`); `None`: the header's.
    pub command: Option<StrId>,
}

/// Threads to processes, as the events so far say.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ProcessMap {
    root: u32,
    of_thread: FxHashMap<u32, u32>,
    /// By pid, in order of appearance (the recording's own first).
    processes: Vec<ProcessInfo>,
    index: FxHashMap<u32, usize>,
}

impl ProcessMap {
    /// The processes of a recording described by `header`: its own, so far.
    pub fn new(header: &Header) -> Self {
        let mut map = ProcessMap {
            root: header.pid,
            ..ProcessMap::default()
        };
        map.processes.push(ProcessInfo {
            pid: header.pid,
            parent: None,
            command: None,
        });
        map.index.insert(header.pid, 0);
        map
    }

    /// Takes note of what `event` says about processes.
    pub fn push(&mut self, event: &Event) {
        let tid = event.tid;
        match event.kind {
            EventKind::ThreadStart { pid } if pid != 0 => {
                self.of_thread.insert(tid, pid);
                self.entry(pid);
            }
            EventKind::ProcessStart { parent, command } => {
                self.of_thread.insert(tid, tid);
                let p = self.entry(tid);
                p.parent = Some(parent);
                p.command = Some(command);
            }
            EventKind::Exec { command } => {
                let pid = self.pid_of(tid);
                self.entry(pid).command = Some(command);
            }
            _ => {}
        }
    }

    fn entry(&mut self, pid: u32) -> &mut ProcessInfo {
        let i = *self.index.entry(pid).or_insert_with(|| {
            self.processes.push(ProcessInfo {
                pid,
                parent: None,
                command: None,
            });
            self.processes.len() - 1
        });
        &mut self.processes[i]
    }

    /// The process of thread `tid`.
    pub fn pid_of(&self, tid: u32) -> u32 {
        self.of_thread.get(&tid).copied().unwrap_or(self.root)
    }

    /// The recording's own process.
    pub fn root(&self) -> u32 {
        self.root
    }

    /// Process `pid`, if the recording has it.
    pub(crate) fn get(&self, pid: u32) -> Option<&ProcessInfo> {
        self.index.get(&pid).map(|&i| &self.processes[i])
    }

    /// Every process seen, the recording's own first, then in order of appearance.
    pub(crate) fn all(&self) -> &[ProcessInfo] {
        &self.processes
    }

    /// Whether more than the recording's own process was traced.
    pub(crate) fn several(&self) -> bool {
        self.processes.len() > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(tid: u32, kind: EventKind) -> Event {
        Event {
            tid,
            ts_ns: 0,
            kind,
        }
    }

    #[test]
    fn threads_belong_to_their_processes() {
        let header = Header {
            pid: 10,
            ..Header::default()
        };
        let mut map = ProcessMap::new(&header);
        assert!(!map.several());
        // A thread running at attach, and one whose start names no process.
        map.push(&ev(11, EventKind::ThreadStart { pid: 0 }));
        assert_eq!((map.pid_of(12), map.pid_of(11)), (10, 10));
        map.push(&ev(
            20,
            EventKind::ProcessStart {
                parent: 10,
                command: StrId(3),
            },
        ));
        map.push(&ev(21, EventKind::ThreadStart { pid: 20 }));
        map.push(&ev(20, EventKind::Exec { command: StrId(4) }));
        assert!(map.several());
        assert_eq!((map.pid_of(20), map.pid_of(21)), (20, 20));
        let child = map.get(20).unwrap();
        assert_eq!((child.parent, child.command), (Some(10), Some(StrId(4))));
        assert_eq!(map.get(10).unwrap().command, None);
        let pids: Vec<u32> = map.all().iter().map(|p| p.pid).collect();
        assert_eq!(pids, [10, 20]);
    }
}
