//! What `pyprobe record` makes of its recording before it is asked for (the
//! first pass, the views), kept for that file as it then was: a view of the
//! file, while the file is still that, uses it instead of reading the events.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::FileKey;

/// One file's `T`: the recording this process wrote last.
pub(crate) struct MadeAhead<T> {
    kept: Mutex<Option<(FileKey, T)>>,
    used: AtomicU64,
}

impl<T> MadeAhead<T> {
    pub(crate) const fn new() -> Self {
        MadeAhead {
            kept: Mutex::new(None),
            used: AtomicU64::new(0),
        }
    }

    /// Keeps `made`, made of the file whose key is `key` (replacing any other).
    pub(crate) fn remember(&self, key: FileKey, made: T) {
        if let Ok(mut kept) = self.kept.lock() {
            *kept = Some((key, made));
        }
    }

    /// A copy of what was made of the file whose key is `key`, if it is still
    /// as it was then.
    pub(crate) fn copy_for(&self, key: FileKey) -> Option<T>
    where
        T: Clone,
    {
        let kept = self.kept.lock().ok()?;
        let made = kept.as_ref().filter(|(k, _)| *k == key)?.1.clone();
        self.used.fetch_add(1, Ordering::Relaxed);
        Some(made)
    }

    /// What was made of the file whose key is `key`, if it is still as it was
    /// then; taken out (asked again, it is not there).
    pub(crate) fn take_for(&self, key: FileKey) -> Option<T> {
        let mut kept = self.kept.lock().ok()?;
        if kept.as_ref().is_none_or(|(k, _)| *k != key) {
            return None;
        }
        let (_, made) = kept.take()?;
        self.used.fetch_add(1, Ordering::Relaxed);
        Some(made)
    }

    /// How many times a view used it.
    pub(crate) fn times_used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }
}
