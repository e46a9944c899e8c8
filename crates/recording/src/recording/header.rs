//! The recording header: what was recorded, how, and when.

use super::wire::{put_str, put_uvarint, truncate_str, Cursor};
use super::RecordError;

/// First eight bytes of every recording.
pub const MAGIC: [u8; 8] = *b"PYPROBE\0";
/// The format version this crate writes. Version 2 added the walker's first line
/// to sampled frames and the `running` event; version 3 the thread's state (on CPU,
/// holding the GIL) to each sample, and the `thinned` and `audits counted` events;
/// version 4 the processes traced with `--subprocesses` (`process_start`, `exec`,
/// and the process of each thread start); version 5 the first line of the function
/// a return belongs to, when known (`return` events of CPython 3.11+); version 6
/// calls and returns naming their frame by a number local to their chunk (see
/// `codec.rs`), and the types functions returned (`return_type` events); version 7
/// the times pyprobe let go of the target while it was stopped (`paused`); version
/// 8 the qualified names of functions (a chunk of their own); version 9 caveats;
/// version 10 the resumes of generators and coroutines apart from calls
/// (`resume`); version 11 events chunks compressed (zstd). Versions 1 to 10 are still read (the states of samples of 1 and 2 unknown, every thread of
/// 1 to 3 in the recording's own process, no first line on any return of 1 to 4,
/// no return types before 6, no qualified names before 8).
pub const FORMAT_VERSION: u32 = 11;
/// The oldest format version this crate reads.
pub const OLDEST_FORMAT_VERSION: u32 = 1;

/// Header strings and lists are capped so a header stays small and bounded.
const MAX_HEADER_STR: usize = 4096;
const MAX_HEADER_LIST: usize = 4096;

/// Describes one recording. Written once, first, by the writer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Header {
    /// Format version found in (or written to) the file prefix.
    pub format_version: u32,
    /// Process id of the target.
    pub pid: u32,
    /// The target's command line.
    pub command_line: Vec<String>,
    /// Path of the target's executable (or of the object carrying the probes).
    pub executable: String,
    /// CPython version string, e.g. `3.11.2`.
    pub python_version: String,
    /// `trace`, `sample` or `auto`.
    pub mode: String,
    /// Probe groups in use (`function`, `gc`, `import`, `audit`, `line`).
    pub probes: Vec<String>,
    /// Clock of every timestamp; always `CLOCK_MONOTONIC` today.
    pub clock: String,
    /// Monotonic time the recording started, ns.
    pub start_ns: u64,
    /// Wall-clock time the recording started, ns since the Unix epoch.
    pub wall_start_unix_ns: u64,
    /// Sampling interval in ns, 0 when not sampling.
    pub sample_interval_ns: u64,
}

impl Default for Header {
    fn default() -> Self {
        Header {
            format_version: FORMAT_VERSION,
            pid: 0,
            command_line: Vec::new(),
            executable: String::new(),
            python_version: String::new(),
            mode: "trace".to_string(),
            probes: Vec::new(),
            clock: "CLOCK_MONOTONIC".to_string(),
            start_ns: 0,
            wall_start_unix_ns: 0,
            sample_interval_ns: 0,
        }
    }
}

impl Header {
    /// Encodes the header chunk payload (the format version lives in the prefix).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        put_uvarint(&mut buf, u64::from(self.pid));
        put_list(&mut buf, &self.command_line);
        put_str(&mut buf, truncate_str(&self.executable, MAX_HEADER_STR));
        put_str(&mut buf, truncate_str(&self.python_version, MAX_HEADER_STR));
        put_str(&mut buf, truncate_str(&self.mode, MAX_HEADER_STR));
        put_list(&mut buf, &self.probes);
        put_str(&mut buf, truncate_str(&self.clock, MAX_HEADER_STR));
        put_uvarint(&mut buf, self.start_ns);
        put_uvarint(&mut buf, self.wall_start_unix_ns);
        put_uvarint(&mut buf, self.sample_interval_ns);
        buf
    }

    /// Decodes a header chunk payload. Trailing bytes are ignored so a later
    /// minor revision may append fields.
    pub(crate) fn decode(c: &mut Cursor<'_>, format_version: u32) -> Result<Self, RecordError> {
        Ok(Header {
            format_version,
            pid: c.u32v("pid")?,
            command_line: get_list(c)?,
            executable: c.string()?,
            python_version: c.string()?,
            mode: c.string()?,
            probes: get_list(c)?,
            clock: c.string()?,
            start_ns: c.uvarint()?,
            wall_start_unix_ns: c.uvarint()?,
            sample_interval_ns: c.uvarint()?,
        })
    }
}

fn put_list(buf: &mut Vec<u8>, items: &[String]) {
    let items = &items[..items.len().min(MAX_HEADER_LIST)];
    put_uvarint(buf, items.len() as u64);
    for s in items {
        put_str(buf, truncate_str(s, MAX_HEADER_STR));
    }
}

fn get_list(c: &mut Cursor<'_>) -> Result<Vec<String>, RecordError> {
    let n = c.count(1, "list")?;
    (0..n).map(|_| c.string()).collect()
}
