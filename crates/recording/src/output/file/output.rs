//! [`Output`]: a file being written at a name the user gave, renamed over it
//! only once complete.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::check::{
    check, err, open_fifo, parent_dir, partial_in_use, partial_path, private, Destination,
    Existing, Stdout,
};

enum Inner {
    Fifo(File),
    /// A randomly named hidden file beside OUT, removed when dropped.
    Temporary(tempfile::NamedTempFile),
    /// `OUT.partial`: kept if anything was written, so a killed run leaves a
    /// readable recording there.
    Partial {
        file: File,
        path: PathBuf,
    },
}

/// An output being written. Nothing reaches OUT before [`Output::commit`].
pub struct Output {
    /// OUT as the user named it (for messages).
    shown: PathBuf,
    /// Where the result goes (links followed).
    target: PathBuf,
    /// Whether a file at OUT may be replaced (one may appear while writing).
    existing: Existing,
    inner: Option<Inner>,
}

impl Output {
    /// A view or other short output: written to a temporary file beside OUT,
    /// removed unless committed. Blocks on a FIFO until it has a reader. `stdout`:
    /// whether the command could write to `-o -` (the caller handles `-`), for the
    /// advice in errors.
    pub fn replace(path: &Path, stdout: Stdout, existing: Existing) -> io::Result<Output> {
        Self::create(path, false, stdout, existing)
    }

    /// A recording: written to `OUT.partial` (fails if that exists: an earlier
    /// run's or another recorder's), kept there if the run never ends well. A FIFO
    /// without a reader is an error.
    pub fn partial(path: &Path, existing: Existing) -> io::Result<Output> {
        Self::create(path, true, Stdout::Refused, existing)
    }

    fn create(
        path: &Path,
        partial: bool,
        stdout: Stdout,
        existing: Existing,
    ) -> io::Result<Output> {
        let target = match check(path, stdout, existing)? {
            Destination::Stdout => {
                return Err(err(
                    io::ErrorKind::InvalidInput,
                    "standard output (`-`) is not a file to create".into(),
                ))
            }
            Destination::Fifo(p) => {
                let file = open_fifo(&p, !partial)?;
                return Ok(Output {
                    shown: path.to_owned(),
                    target: p,
                    existing,
                    inner: Some(Inner::Fifo(file)),
                });
            }
            Destination::File(p) => p,
        };
        let inner = if partial {
            let temp = partial_path(&target);
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temp)
                .map_err(|e| {
                    if e.kind() == io::ErrorKind::AlreadyExists {
                        partial_in_use(&temp, path)
                    } else {
                        err(e.kind(), format!("cannot create {}: {e}", temp.display()))
                    }
                })?;
            private(&file, &temp)?;
            Inner::Partial { file, path: temp }
        } else {
            let dir = parent_dir(&target);
            let mut prefix = OsString::from(".");
            prefix.push(target.file_name().unwrap_or_default());
            prefix.push(".");
            let temp = tempfile::Builder::new()
                .prefix(&prefix)
                .suffix(".tmp")
                .tempfile_in(dir)
                .map_err(|e| {
                    err(
                        e.kind(),
                        format!(
                            "cannot create a temporary file in {} for {}: {e}",
                            dir.display(),
                            path.display()
                        ),
                    )
                })?;
            private(temp.as_file(), temp.path())?;
            Inner::Temporary(temp)
        };
        Ok(Output {
            shown: path.to_owned(),
            target,
            existing,
            inner: Some(inner),
        })
    }

    /// The file to write to.
    pub fn file(&self) -> &File {
        match self.inner.as_ref().expect("output still open") {
            Inner::Fifo(f) | Inner::Partial { file: f, .. } => f,
            Inner::Temporary(t) => t.as_file(),
        }
    }

    /// A second handle on the file (for a writer thread).
    pub fn try_clone_file(&self) -> io::Result<File> {
        self.file().try_clone()
    }

    /// Where the bytes go until the output is committed (`OUT.partial`, a
    /// temporary file, or the FIFO itself).
    pub fn writing_to(&self) -> &Path {
        match self.inner.as_ref().expect("output still open") {
            Inner::Fifo(_) => &self.target,
            Inner::Partial { path, .. } => path,
            Inner::Temporary(t) => t.path(),
        }
    }

    /// Whether the bytes go to a file renamed over OUT at the end.
    pub fn is_renamed(&self) -> bool {
        !matches!(self.inner, Some(Inner::Fifo(_)))
    }

    /// The output is complete: it becomes OUT. Without [`Existing::Replace`], a
    /// file that appeared at OUT meanwhile stays, and the output is kept beside it.
    pub fn commit(mut self) -> io::Result<()> {
        let appeared = |kept: &Path| {
            err(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} appeared while pyprobe was writing it and is left as it is; the output \
                     is in {} (pass --force to replace an existing output)",
                    self.shown.display(),
                    kept.display()
                ),
            )
        };
        match self.inner.take().expect("output still open") {
            Inner::Fifo(_) => Ok(()),
            Inner::Temporary(t) if self.existing == Existing::Replace => {
                match t.persist(&self.target) {
                    Ok(_) => Ok(()),
                    // The temporary is removed with the error's file.
                    Err(e) => Err(err(
                        e.error.kind(),
                        format!("cannot replace {}: {}", self.shown.display(), e.error),
                    )),
                }
            }
            Inner::Temporary(t) => match t.persist_noclobber(&self.target) {
                Ok(_) => Ok(()),
                Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => {
                    let kept = e.file.path().to_owned();
                    let _ = e.file.keep();
                    Err(appeared(&kept))
                }
                Err(e) => Err(err(
                    e.error.kind(),
                    format!("cannot write {}: {}", self.shown.display(), e.error),
                )),
            },
            Inner::Partial { file, path } => {
                if !still_ours(&file, &path) {
                    let at = self.rescue(&file, &path)?;
                    eprintln!(
                        "pyprobe: warning: {} was replaced or removed while pyprobe wrote it; \
                         the recording was copied from pyprobe's own file to {}, and what is at \
                         {} now was left alone",
                        path.display(),
                        at.display(),
                        path.display()
                    );
                    return Ok(());
                }
                drop(file);
                let rename_failed = |e: io::Error| {
                    err(
                        e.kind(),
                        format!(
                            "cannot rename {} to {}: {e} (the output is left in {})",
                            path.display(),
                            self.shown.display(),
                            path.display()
                        ),
                    )
                };
                if self.existing == Existing::Replace {
                    return std::fs::rename(&path, &self.target).map_err(rename_failed);
                }
                let temp = tempfile::TempPath::try_from_path(&path).map_err(rename_failed)?;
                match temp.persist_noclobber(&self.target) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let _ = e.path.keep();
                        if e.error.kind() == io::ErrorKind::AlreadyExists {
                            Err(appeared(&path))
                        } else {
                            Err(rename_failed(e.error))
                        }
                    }
                }
            }
        }
    }

    /// The run failed: keeps what a recording holds so far. It becomes OUT if no
    /// OUT exists, else stays in `OUT.partial`. Returns where it is (`None`: nothing
    /// was written, or the output was a temporary or a FIFO).
    pub fn salvage(mut self) -> Option<PathBuf> {
        match self.inner.take()? {
            Inner::Fifo(_) | Inner::Temporary(_) => None,
            Inner::Partial { file, path } => {
                let empty = file.metadata().map(|m| m.len() == 0).unwrap_or(false);
                if !empty && !still_ours(&file, &path) {
                    return self.rescue(&file, &path).ok();
                }
                drop(file);
                if empty {
                    let _ = std::fs::remove_file(&path);
                    return None;
                }
                let Ok(temp) = tempfile::TempPath::try_from_path(&path) else {
                    return Some(path);
                };
                match temp.persist_noclobber(&self.target) {
                    Ok(()) => Some(self.target.clone()),
                    Err(e) => {
                        // OUT is there (or cannot be written): leave ours beside it.
                        let _ = e.path.keep();
                        Some(path)
                    }
                }
            }
        }
    }
}

impl Output {
    /// Copies the recording pyprobe wrote through `file`, whose name `partial`
    /// now holds another file or none, to OUT (or, where OUT exists and may not
    /// be replaced, to a new file beside it); returns where it went.
    fn rescue(&self, file: &File, partial: &Path) -> io::Result<PathBuf> {
        use std::os::fd::AsRawFd;
        let failed = |e: io::Error| {
            err(
                e.kind(),
                format!(
                    "{} was replaced or removed while pyprobe wrote it, and its recording \
                     could not be copied to {}: {e}",
                    partial.display(),
                    self.shown.display()
                ),
            )
        };
        // Opened again through the descriptor: the name may be anyone's now.
        let mut ours = File::open(format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(failed)?;
        let mut prefix = OsString::from(".");
        prefix.push(self.target.file_name().unwrap_or_default());
        prefix.push(".");
        let mut copy = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".rescued")
            .tempfile_in(parent_dir(&self.target))
            .map_err(failed)?;
        private(copy.as_file(), copy.path())?;
        io::copy(&mut ours, copy.as_file_mut()).map_err(failed)?;
        if self.existing == Existing::Replace {
            copy.persist(&self.target).map_err(|e| failed(e.error))?;
            return Ok(self.target.clone());
        }
        match copy.persist_noclobber(&self.target) {
            Ok(_) => Ok(self.target.clone()),
            Err(e) => {
                let (_, kept) = e.file.keep().map_err(|e| failed(e.error))?;
                Ok(kept)
            }
        }
    }
}

/// Whether `path` still names the file pyprobe opened as `file`: the same inode
/// on the same device, not a file put there since (or none).
fn still_ours(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(open), Ok(named)) => open.dev() == named.dev() && open.ino() == named.ino(),
        _ => false,
    }
}

impl Drop for Output {
    /// Not committed (an error path, a panic): a temporary goes, a partial
    /// recording with anything in it stays.
    fn drop(&mut self) {
        if let Some(Inner::Partial { file, path }) = self.inner.take() {
            if file.metadata().map(|m| m.len() == 0).unwrap_or(false) && still_ours(&file, &path) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}
