//! Looks at many threads' scheduler state, each thread's `/proc` files kept open;
//! a sampling tick's look can also tell that a thread has not run since an
//! earlier tick, without the costly `stat` read, so that its stack need not be
//! read again.

use rustc_hash::FxHashMap;

use super::status::{task_state, KeptTaskFile};

/// What a tick's look found of a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TickLook {
    /// Its state letter, read now (see [`task_state`]).
    Read(char),
    /// It has not run since the look of tick `since`, which read it asleep in
    /// `state` (`S` or `D`): its state and its stack are what they were then.
    Still { state: char, since: u64 },
}

impl TickLook {
    pub fn state(self) -> char {
        match self {
            TickLook::Read(state) | TickLook::Still { state, .. } => state,
        }
    }
}

/// A thread's run time (ns) and how often it was put on a CPU, from its
/// `schedstat`. Both only grow; a thread switched in raises the count at once,
/// and one switched out adds to its run time, so two equal readings a thread was
/// asleep between (not on a CPU) show that it did not run in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ran {
    run_ns: u64,
    switched_in: u64,
}

/// `RUN_NS WAIT_NS SWITCHED_IN`; `None` for a kernel without scheduler statistics
/// (it writes `0 0 0`: a thread that exists has been switched in at least once).
fn parse_schedstat(text: &[u8]) -> Option<Ran> {
    let text = std::str::from_utf8(text).ok()?;
    let mut fields = text.split_ascii_whitespace().map(|f| f.parse::<u64>().ok());
    let run_ns = fields.next()??;
    let _waited = fields.next()??;
    let switched_in = fields.next()??;
    (switched_in > 0).then_some(Ran {
        run_ns,
        switched_in,
    })
}

/// One thread's kept files, and what its last tick look that read it asleep saw.
#[derive(Debug, Default)]
struct KeptTask {
    stat: KeptTaskFile,
    schedstat: KeptTaskFile,
    /// From that look: the thread's `schedstat`, its state, and the tick.
    asleep: Option<(Ran, char, u64)>,
}

/// The `/proc` files of many threads kept open (see [`KeptTaskFile`]), up to a
/// quarter of the descriptors pyprobe may open; a thread past that has its file
/// opened at each look. A sample of 1,000 threads read them all: opening and
/// closing each was a quarter of the sampler's time.
#[derive(Debug, Default)]
pub(crate) struct KeptTaskStates {
    tasks: FxHashMap<i32, KeptTask>,
    /// How many threads' files may be kept (`None` until first asked).
    most: Option<usize>,
}

impl KeptTaskStates {
    /// Most threads' files kept, whatever the limit.
    const MOST: usize = 8_192;

    /// The kept files of thread `tid`, unless too many are open.
    fn kept(&mut self, tid: i32) -> Option<&mut KeptTask> {
        let most = *self.most.get_or_insert_with(|| {
            let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map_or(1024, |(soft, _)| soft);
            // Two files a thread: its `stat` and its `schedstat`.
            usize::try_from(soft / 8)
                .unwrap_or(Self::MOST)
                .min(Self::MOST)
        });
        if self.tasks.len() < most || self.tasks.contains_key(&tid) {
            return Some(self.tasks.entry(tid).or_default());
        }
        None
    }

    /// The scheduler state of thread `tid` of process `pid` (see [`task_state`]).
    pub fn state(&mut self, pid: i32, tid: i32) -> Option<char> {
        match self.kept(tid) {
            Some(task) => task.stat.state(pid, tid),
            None => task_state(pid, tid),
        }
    }

    /// The look of sampling tick `tick` (ticks counted up) at thread `tid` of
    /// process `pid`: [`TickLook::Still`] when it has not run since an earlier
    /// tick's look read it asleep, else its state read now. Only these looks
    /// keep what they saw, so `since` is always a tick's.
    pub fn tick_look(&mut self, pid: i32, tid: i32, tick: u64) -> Option<TickLook> {
        let Some(task) = self.kept(tid) else {
            return task_state(pid, tid).map(TickLook::Read);
        };
        // Read before the state: a thread seen asleep after this reading has not
        // run between the two, so a later equal reading covers the whole time.
        let ran = task
            .schedstat
            .read(pid, tid, "schedstat")
            .and_then(parse_schedstat);
        if let (Some(now), Some((then, state, since))) = (ran, task.asleep) {
            if now == then {
                return Some(TickLook::Still { state, since });
            }
        }
        let state = task.stat.state(pid, tid);
        task.asleep = match (ran, state) {
            (Some(now), Some(s @ ('S' | 'D'))) => Some((now, s, tick)),
            _ => None,
        };
        state.map(TickLook::Read)
    }

    /// Closes the files of the threads `alive` says are gone.
    pub fn keep_only(&mut self, alive: impl Fn(i32) -> bool) {
        self.tasks.retain(|&tid, _| alive(tid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_gives_run_time_and_switches_or_nothing_without_statistics() {
        assert_eq!(
            parse_schedstat(b"97913640 963700 97\n"),
            Some(Ran {
                run_ns: 97_913_640,
                switched_in: 97
            })
        );
        assert_eq!(parse_schedstat(b"0 0 0\n"), None);
        assert_eq!(parse_schedstat(b"12 34"), None);
        assert_eq!(parse_schedstat(b"x 1 2\n"), None);
        assert_eq!(parse_schedstat(b""), None);
    }

    /// A thread asleep in a pipe read: still from the second tick on, as long as
    /// it does not run; read afresh at the tick after it ran.
    #[test]
    fn a_sleeping_thread_is_still_until_it_runs() {
        use std::io::Write;
        let (reader, mut writer) = std::io::pipe().unwrap();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let sleeper = std::thread::spawn(move || {
            use std::io::Read;
            tid_tx.send(nix::unistd::gettid().as_raw()).unwrap();
            let mut reader = reader;
            let mut byte = [0u8; 1];
            let mut got = 0;
            while got < 2 {
                got += reader.read(&mut byte).unwrap();
            }
        });
        let pid = std::process::id() as i32;
        let tid = tid_rx.recv().unwrap();
        let own = std::fs::read(format!("/proc/{pid}/task/{tid}/schedstat")).unwrap_or_default();
        if parse_schedstat(&own).is_none() {
            eprintln!("this kernel keeps no scheduler statistics: no look is ever still");
            writer.write_all(b"xy").unwrap();
            sleeper.join().unwrap();
            return;
        }
        let mut looks = KeptTaskStates::default();
        // Asleep once the kernel says so.
        let mut tick = 0;
        let first = loop {
            tick += 1;
            assert!(tick < 10_000, "the thread never fell asleep");
            let look = looks.tick_look(pid, tid, tick).unwrap();
            if look == TickLook::Read('S') {
                break tick;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        for t in first + 1..first + 4 {
            assert_eq!(
                looks.tick_look(pid, tid, t),
                Some(TickLook::Still {
                    state: 'S',
                    since: first
                })
            );
        }
        // Woken: it reads the byte and sleeps again, having run.
        writer.write_all(b"x").unwrap();
        let woke_at = first + 4;
        let mut t = woke_at;
        loop {
            let look = looks.tick_look(pid, tid, t).unwrap();
            if let TickLook::Read(_) = look {
                break;
            }
            assert!(t < woke_at + 10_000, "the thread never ran");
            std::thread::sleep(std::time::Duration::from_millis(1));
            t += 1;
        }
        writer.write_all(b"y").unwrap();
        sleeper.join().unwrap();
    }
}
