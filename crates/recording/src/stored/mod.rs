//! What the views of a recording need, computed in one pass over its events and
//! kept beside it (`run.pyprobe` → `run.pyprobe.views`): the report, and every
//! stack by thread. A view reads it instead of the events when it belongs to the
//! recording as the recording is now (same size, modification time and
//! trailer, written by this pyprobe), so a large recording opens at once after
//! its first view.
//!
//! The file is as hostile as a recording: its payload is checksummed, its size
//! bounded, and what it holds checked as it is read (a stack tree must be one).
//! Any doubt and it is rebuilt from the events, which stay the truth.

use std::fs::{self, File};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

use crate::analyze::checkpoints::{CheckpointBuilder, Checkpoints};
use crate::analyze::folded::Folded;
use crate::analyze::line_counts::LineCounts;
use crate::analyze::replay::Replay;
use crate::analyze::{Report, SliceFilter};
use crate::output::flame::ViewInfo;
use crate::output::{plan_recording_reporting, Planned, PROGRESS_EVENTS};
use crate::recording::{Completion, RecordError, RecordingReader};

pub mod ahead;
mod building;
mod side_by_side;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_while_written;
mod while_written;

pub use building::ViewsBuilder;
pub use while_written::{Finished, Looked, ViewsOutcome, WhileWritten};

/// Added to the recording's file name.
pub const SUFFIX: &str = ".views";
const MAGIC: [u8; 8] = *b"PYPVIEWS";
/// Bumped whenever what is stored changes: any stored type's fields included.
const STORE_VERSION: u32 = 6;
/// Magic, version, checksum and payload length.
const PREFIX_LEN: usize = 8 + 4 + 4 + 8;
/// Largest views file read: far above what a tree bounded by the views' own
/// limits takes.
const MAX_BYTES: u64 = 1 << 30;

/// The state of a recording's file: its size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileState {
    len: u64,
    modified: (u64, u32),
}

impl FileState {
    /// The state of the file at `path` now.
    pub fn of(path: &Path) -> io::Result<FileState> {
        let meta = fs::metadata(path)?;
        let modified = meta
            .modified()?
            .duration_since(UNIX_EPOCH)
            .map(|d| (d.as_secs(), d.subsec_nanos()))
            .unwrap_or((0, 0));
        Ok(FileState {
            len: meta.len(),
            modified,
        })
    }

    /// The file's size.
    pub fn bytes(&self) -> u64 {
        self.len
    }
}

/// What ties stored views to one state of one recording.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Identity {
    /// The pyprobe that built them: another may fold differently.
    built_by: String,
    file: FileState,
    /// The trailer's end, lost events and events.
    trailer: (u64, u64, u64),
}

impl Identity {
    fn new(file: FileState, trailer: (u64, u64, u64)) -> Identity {
        Identity {
            built_by: env!("CARGO_PKG_VERSION").into(),
            file,
            trailer,
        }
    }
}

/// The views of one recording, with the default sample filter (threads on a
/// CPU) and functions as frames.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredViews {
    /// The recording's string table, read to the end.
    pub strings: Vec<String>,
    /// Its header, end and qualified names.
    pub info: ViewInfo,
    /// Every stack, under its thread's frame.
    pub stacks: Folded,
    /// The report of every thread.
    pub report: Report,
    /// Samples and hits per source line, for heatmaps.
    pub lines: LineCounts,
    /// The replay's plan and the census of every call (its first pass), for the
    /// views that replay the events in order (`calls`, the trace exports).
    pub planned: Planned,
    /// Where that replay can be taken up, and where each function is entered.
    pub checkpoints: Checkpoints,
}

impl StoredViews {
    /// Reads every event of `reader` once into the report and the stacks by thread.
    pub fn build<R: Read + Seek>(
        reader: &mut RecordingReader<R>,
    ) -> Result<StoredViews, RecordError> {
        Self::build_reporting(reader, &mut |_, _| {})
    }

    /// As [`build`](Self::build), calling `progress` now and then with the pass
    /// (0: the plan, 1: the replay) and how far into the file it has read.
    pub fn build_reporting<R: Read + Seek>(
        reader: &mut RecordingReader<R>,
        progress: &mut dyn FnMut(u32, u64),
    ) -> Result<StoredViews, RecordError> {
        Self::build_checkpointed(reader, progress, CheckpointBuilder::default())
    }

    fn build_checkpointed<R: Read + Seek>(
        reader: &mut RecordingReader<R>,
        progress: &mut dyn FnMut(u32, u64),
        checkpoints: CheckpointBuilder,
    ) -> Result<StoredViews, RecordError> {
        let (plan, census) =
            plan_recording_reporting(reader, &SliceFilter::default(), &mut |read| {
                progress(0, read)
            })?;
        let planned = Planned {
            plan: plan.clone(),
            census,
        };
        let header = reader.header().clone();
        let mut views = ViewsBuilder::new(&header, Replay::new(&header, plan), checkpoints);
        while let Some(event) = reader.next_event() {
            views.push(reader, &event?);
            if views.events() % PROGRESS_EVENTS == 0 {
                progress(1, reader.bytes_read());
            }
        }
        Ok(views.finish(reader, planned))
    }

    /// The stacks of every thread merged, as a flame graph shows them.
    pub fn merged_stacks(&self) -> Folded {
        self.stacks.without_threads()
    }
}

/// Where the views of the recording at `recording` are kept.
pub fn path_for(recording: &Path) -> PathBuf {
    let mut name = recording.as_os_str().to_owned();
    name.push(SUFFIX);
    PathBuf::from(name)
}

/// What was found beside a recording.
#[derive(Debug)]
pub enum Lookup {
    /// Views of the recording as it is now.
    Fresh(Box<StoredViews>),
    /// None kept.
    Missing,
    /// Views of another state of the recording, or of another pyprobe.
    Stale,
    /// A file that is not views this pyprobe can read, and why.
    Unreadable(String),
}

/// The views kept beside the recording at `recording`, if they belong to it as
/// it is now. Only a finished recording's views are kept.
pub fn load(recording: &Path) -> Lookup {
    let path = path_for(recording);
    let mut file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Lookup::Missing,
        Err(e) => return Lookup::Unreadable(e.to_string()),
    };
    let mut bytes = Vec::new();
    if let Err(e) = (&mut file).take(MAX_BYTES + 1).read_to_end(&mut bytes) {
        return Lookup::Unreadable(e.to_string());
    }
    match decode(&bytes) {
        Ok((identity, views)) => match FileState::of(recording) {
            Ok(now) if Identity::new(now, identity.trailer) == identity => {
                Lookup::Fresh(Box::new(views))
            }
            _ => Lookup::Stale,
        },
        Err(Why::Stale) => Lookup::Stale,
        Err(Why::Bad(why)) => Lookup::Unreadable(why),
    }
}

enum Why {
    /// Written by another version of the store.
    Stale,
    Bad(String),
}

fn decode(bytes: &[u8]) -> Result<(Identity, StoredViews), Why> {
    if bytes.len() as u64 > MAX_BYTES {
        return Err(Why::Bad(format!("larger than {MAX_BYTES} bytes")));
    }
    if bytes.len() < PREFIX_LEN || bytes[..8] != MAGIC {
        return Err(Why::Bad("not a pyprobe views file".into()));
    }
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    if word(8) != STORE_VERSION {
        return Err(Why::Stale);
    }
    let checksum = word(12);
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[16..24]);
    let payload = &bytes[PREFIX_LEN..];
    if u64::from_le_bytes(len) != payload.len() as u64 {
        return Err(Why::Bad(format!(
            "cut short: {} bytes of payload, {} announced",
            payload.len(),
            u64::from_le_bytes(len)
        )));
    }
    if crc32fast::hash(payload) != checksum {
        return Err(Why::Bad("its checksum does not match its contents".into()));
    }
    postcard::from_bytes(payload).map_err(|e| Why::Bad(format!("cannot decode it: {e}")))
}

fn encode(identity: &Identity, views: &StoredViews) -> Result<Vec<u8>, postcard::Error> {
    let payload = postcard::to_stdvec(&(identity, views))?;
    let mut bytes = Vec::with_capacity(PREFIX_LEN + payload.len());
    bytes.extend_from_slice(&MAGIC);
    bytes.extend_from_slice(&STORE_VERSION.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    Ok(bytes)
}

/// Why views were not kept.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The recording has no trailer: it may still grow.
    #[error("the recording is not finished (it has no end marker)")]
    Unfinished,
    /// The recording changed while it was read.
    #[error("the recording changed while it was read")]
    Changed,
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("cannot encode them: {0}")]
    Encode(#[from] postcard::Error),
}

/// Keeps `views`, read from a reader of the recording at `recording` that ended
/// with `completion`, beside it; the recording was in state `before` when the
/// reader opened it. Returns where, and how many bytes. Written whole or not at
/// all (a temporary file renamed), and only if the recording is as it was.
pub fn save(
    recording: &Path,
    before: FileState,
    completion: Completion,
    views: &StoredViews,
) -> Result<(PathBuf, u64), SaveError> {
    let Completion::Complete(t) = completion else {
        return Err(SaveError::Unfinished);
    };
    let identity = Identity::new(before, (t.end_ns, t.lost_events, t.events));
    let bytes = encode(&identity, views)?;
    let path = path_for(recording);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".pyprobe-views")
        .tempfile_in(&dir)?;
    tmp.write_all(&bytes)?;
    if FileState::of(recording)? != before {
        return Err(SaveError::Changed);
    }
    tmp.persist(&path).map_err(|e| e.error)?;
    Ok((path, bytes.len() as u64))
}
