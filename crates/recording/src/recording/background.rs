//! A file written by a thread of its own. The event loop hands whole buffers over
//! and goes on: a write that stalls (dirty-page throttling can hold one for
//! milliseconds) then delays the recording, not the draining of a ring or the
//! resumption of a stopped target.
//!
//! A recording's writer compresses its events chunks there too (see `compress`).
//!
//! Errors come back on a later call: the first `write`, `flush` or drop after the
//! failure. `flush` waits until everything handed over so far is written.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::compress::ChunkCompressor;

/// Bytes gathered before they are handed to the writer thread.
const HANDOFF_BYTES: usize = 256 * 1024;
/// Buffers queued for the writer thread before `write` waits for it (about 4 MiB).
const QUEUE_DEPTH: usize = 16;

enum Job {
    Write(Vec<u8>),
    /// Answered once every earlier buffer is written.
    Sync(SyncSender<()>),
}

/// The first failure of the writer thread: its kind and message (an `io::Error`
/// cannot be cloned, and every later call must report it).
type Failure = Arc<Mutex<Option<(io::ErrorKind, String)>>>;

/// A [`Write`] that writes through a thread of its own.
pub struct BackgroundWriter {
    pending: Vec<u8>,
    jobs: Option<SyncSender<Job>>,
    worker: Option<JoinHandle<()>>,
    failure: Failure,
    /// Bytes the thread has written to `out`.
    written: Arc<AtomicU64>,
}

impl BackgroundWriter {
    /// Starts the writer thread of a recording over `out`: what is written must
    /// be a recording's bytes, whose events chunks the thread compresses.
    pub fn new<W: Write + Send + 'static>(out: W) -> io::Result<BackgroundWriter> {
        Self::start(out, Some(ChunkCompressor::new()))
    }

    /// Starts a writer thread that writes the bytes as they are.
    pub fn plain<W: Write + Send + 'static>(out: W) -> io::Result<BackgroundWriter> {
        Self::start(out, None)
    }

    fn start<W: Write + Send + 'static>(
        out: W,
        compressor: Option<ChunkCompressor>,
    ) -> io::Result<BackgroundWriter> {
        let (jobs, queue) = sync_channel(QUEUE_DEPTH);
        let failure = Failure::default();
        let written = Arc::new(AtomicU64::new(0));
        let (seen, count) = (Arc::clone(&failure), Arc::clone(&written));
        let worker = spawn_without_signals("pyprobe-writer", move || {
            write_jobs(out, queue, compressor, seen, &count)
        })?;
        Ok(BackgroundWriter {
            pending: Vec::with_capacity(HANDOFF_BYTES),
            jobs: Some(jobs),
            worker: Some(worker),
            failure,
            written,
        })
    }

    /// Bytes written to the output so far (after compression): those handed
    /// over and not written yet are not counted.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    fn check(&self) -> io::Result<()> {
        match &*self.failure.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((kind, message)) => Err(io::Error::new(*kind, message.clone())),
            None => Ok(()),
        }
    }

    fn send(&self, job: Job) -> io::Result<()> {
        let gone = || io::Error::other("the recording's writer thread has ended");
        self.jobs
            .as_ref()
            .ok_or_else(gone)?
            .send(job)
            .map_err(|_| gone())
    }

    fn hand_off(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let full = std::mem::replace(&mut self.pending, Vec::with_capacity(HANDOFF_BYTES));
        self.send(Job::Write(full))
    }
}

fn write_jobs<W: Write>(
    mut out: W,
    queue: Receiver<Job>,
    mut compressor: Option<ChunkCompressor>,
    failure: Failure,
    written: &AtomicU64,
) {
    let mut failed = false;
    let mut packed = Vec::new();
    for job in queue {
        match job {
            Job::Write(buf) if !failed => {
                let bytes = match compressor.as_mut() {
                    Some(c) => {
                        packed.clear();
                        c.feed(&buf, &mut packed);
                        &packed
                    }
                    None => &buf,
                };
                match out.write_all(bytes).and_then(|()| out.flush()) {
                    Ok(()) => {
                        written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    }
                    Err(e) => {
                        failed = true;
                        *failure.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((e.kind(), e.to_string()));
                    }
                }
            }
            Job::Write(_) => {}
            Job::Sync(done) => {
                debug_assert!(
                    compressor.as_ref().is_none_or(|c| !c.holds_part()),
                    "a recording's writer hands whole chunks over before a flush"
                );
                let _ = done.send(());
            }
        }
    }
}

impl Write for BackgroundWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.check()?;
        self.pending.extend_from_slice(buf);
        if self.pending.len() >= HANDOFF_BYTES {
            self.hand_off()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.check()?;
        self.hand_off()?;
        let (done, wait) = sync_channel(1);
        self.send(Job::Sync(done))?;
        let _ = wait.recv();
        self.check()
    }
}

impl Drop for BackgroundWriter {
    /// Writes what is pending and waits for the thread (what was handed over is
    /// never left unwritten).
    fn drop(&mut self) {
        let _ = self.hand_off();
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// Starts a thread that takes none of the process's signals (they are for the
/// tracer's own thread): it inherits its creator's mask, so every signal is
/// blocked around the spawn.
pub(super) fn spawn_without_signals<F>(name: &str, f: F) -> io::Result<JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow};
    let mut old = SigSet::empty();
    let blocked = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&SigSet::all()), Some(&mut old));
    let spawned = std::thread::Builder::new().name(name.into()).spawn(f);
    if blocked.is_ok() {
        let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
    }
    spawned
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shared bytes that accept `room` bytes, then fail like a full disk.
    #[derive(Clone)]
    struct Disk {
        bytes: Arc<Mutex<Vec<u8>>>,
        room: usize,
    }

    impl Write for Disk {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            let mut bytes = self.bytes.lock().unwrap();
            let n = data.len().min(self.room - bytes.len());
            if n == 0 {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            bytes.extend_from_slice(&data[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn disk(room: usize) -> Disk {
        Disk {
            bytes: Arc::default(),
            room,
        }
    }

    #[test]
    fn everything_written_arrives_in_order_by_flush_and_by_drop() {
        let d = disk(usize::MAX);
        let mut w = BackgroundWriter::plain(d.clone()).unwrap();
        let expected: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        for part in expected.chunks(7_919) {
            w.write_all(part).unwrap();
        }
        w.flush().unwrap();
        assert_eq!(*d.bytes.lock().unwrap(), expected);
        w.write_all(b"tail").unwrap();
        drop(w);
        assert!(d.bytes.lock().unwrap().ends_with(b"tail"));
    }

    #[test]
    fn a_failed_write_is_reported_on_later_calls() {
        let d = disk(1000);
        let mut w = BackgroundWriter::plain(d.clone()).unwrap();
        w.write_all(&[7u8; 4000]).unwrap();
        let err = w.flush().unwrap_err();
        assert!(err.to_string().contains("No space left"), "{err}");
        assert!(w.write_all(b"more").is_err());
        assert!(w.flush().is_err());
        assert_eq!(d.bytes.lock().unwrap().len(), 1000);
    }
}
