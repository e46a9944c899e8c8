//! Qualified names of functions (`Class.method`, `outer.<locals>.inner`), kept
//! beside the events: a function stays keyed by its file, `co_name` and first
//! line, as the probes name it, and views show its qualified name when the
//! recording knows one.
//!
//! Written as chunks of their own (kind [`kind::QUALNAMES`](super::kind)), each
//! after the strings it names and before the events that use them: a count, then
//! per function its file, name and first line (string ids, a line), and the
//! qualified name's string id.

use rustc_hash::FxHashMap;

use super::wire::{put_uvarint, Cursor};
use super::{FrameRef, RecordError, StrId};

/// What every view shows for a function whose name is empty (read from a code
/// object the target was freeing, or made with an empty `co_name`), so the
/// report, the flame graph and the exports name it alike.
pub const UNNAMED: &str = "?";

/// `name`, or [`UNNAMED`] when it is empty.
pub fn or_unnamed(name: &str) -> &str {
    if name.is_empty() {
        UNNAMED
    } else {
        name
    }
}

/// Most qualified names a reader keeps; past it, later ones are ignored (a
/// hostile file cannot grow memory without bound).
pub const MAX_QUALNAMES: usize = 1 << 22;

/// The qualified names a recording holds.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Qualnames {
    exact: FxHashMap<FrameRef, StrId>,
    /// By file and name alone, for a frame whose line is not its first (a
    /// generator resumed, on 3.9): `None` when two functions of one name in one
    /// file have different qualified names.
    by_name: FxHashMap<(StrId, StrId), Option<StrId>>,
}

impl Qualnames {
    pub(crate) fn insert(&mut self, code: FrameRef, qualname: StrId) {
        if self.exact.len() >= MAX_QUALNAMES {
            return;
        }
        self.exact.insert(code, qualname);
        self.by_name
            .entry((code.file, code.function))
            .and_modify(|q| {
                if *q != Some(qualname) {
                    *q = None;
                }
            })
            .or_insert(Some(qualname));
    }

    /// The qualified name of the function `code` names (file, name, first line).
    pub(crate) fn get(&self, code: &FrameRef) -> Option<StrId> {
        self.exact
            .get(code)
            .copied()
            .or_else(|| self.by_name.get(&(code.file, code.function)).copied()?)
    }

    /// The name views show for function `code`: its qualified name when known,
    /// else its name.
    pub(crate) fn shown(&self, code: &FrameRef) -> StrId {
        self.get(code).unwrap_or(code.function)
    }

    pub fn len(&self) -> usize {
        self.exact.len()
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty()
    }
}

/// Appends one entry to a pending chunk payload.
pub(crate) fn put_entry(buf: &mut Vec<u8>, code: &FrameRef, qualname: StrId) {
    put_uvarint(buf, u64::from(code.file.0));
    put_uvarint(buf, u64::from(code.function.0));
    put_uvarint(buf, u64::from(code.line));
    put_uvarint(buf, u64::from(qualname.0));
}

/// Reads a chunk's entries into `into`; ids must be below `strings`.
pub(crate) fn read_chunk(
    c: &mut Cursor<'_>,
    strings: usize,
    into: &mut Qualnames,
) -> Result<(), RecordError> {
    // An entry is at least four one-byte varints.
    let n = c.count(4, "qualified name")?;
    for _ in 0..n {
        let at = c.offset();
        let code = FrameRef {
            file: StrId(c.u32v("string id")?),
            function: StrId(c.u32v("string id")?),
            line: c.u32v("line")?,
        };
        let qualname = StrId(c.u32v("string id")?);
        if [code.file, code.function, qualname]
            .iter()
            .any(|id| id.0 as usize >= strings)
        {
            return Err(RecordError::Corrupt {
                offset: at,
                what: "qualified name refers to a string not yet defined".into(),
            });
        }
        into.insert(code, qualname);
    }
    Ok(())
}
