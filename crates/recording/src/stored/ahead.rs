//! Views built before they are asked for. `pyprobe record` replays its
//! recording while it is written, so the views it writes when the target exits
//! need not read every event again. What it built is kept here for that file as
//! it was then; the first view of the file, while it is still that, takes it.

use std::fs::File;
use std::path::Path;

use super::StoredViews;
use crate::recording::{Completion, FileKey, MadeAhead};

/// The views, and how their reader ended.
static AHEAD: MadeAhead<(Box<StoredViews>, Completion)> = MadeAhead::new();

/// Keeps `views`, the views of every event of the file whose key is `key`, read
/// by a reader that ended with `completion`.
pub fn remember(key: FileKey, views: StoredViews, completion: Completion) {
    AHEAD.remember(key, (Box::new(views), completion));
}

/// The views of the recording at `path`, and how their reader ended, when they
/// were built before and the file is as it was then; taken (asked again, they
/// are not there).
pub fn take(path: &Path) -> Option<(StoredViews, Completion)> {
    let key = FileKey::of(&File::open(path).ok()?).ok()?;
    let (views, completion) = AHEAD.take_for(key)?;
    Some((*views, completion))
}

/// How many times a view took views built before instead of building them.
pub fn times_taken() -> u64 {
    AHEAD.times_used()
}
