//! Every file written at a name the user gave (`-o OUT`) goes through here.
//!
//! pyprobe never removes or truncates anything it did not create in that run: the
//! output is written to a new file beside OUT and renamed over OUT only once it is
//! complete. A run that fails leaves OUT as it was. An existing OUT is replaced
//! only when the user said so (`--force`, [`Existing::Replace`]); otherwise it is
//! refused before anything starts, and a file that appears at OUT while pyprobe
//! writes is not replaced either. Only regular files are replaced; a FIFO the
//! user named is written straight into; anything else (a device, a directory, a
//! socket) is refused.
//!
//! Outputs hold another process's function names and paths: mode 0600.

use std::ffi::OsString;
use std::fs::{File, OpenOptions, Permissions};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// What OUT is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// `-`: standard output (only where the command allows it).
    Stdout,
    /// A FIFO: written straight into, nothing renamed or removed.
    Fifo(PathBuf),
    /// A regular file (existing or not), after following symbolic links: replaced
    /// by rename once complete.
    File(PathBuf),
}

/// What to do with a regular file already at OUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Refuse: it is the user's (the default).
    Keep,
    /// Replace it once the output is complete (`--force`).
    Replace,
}

/// Whether `-` may mean standard output for this command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stdout {
    Allowed,
    Refused,
}

fn err(kind: io::ErrorKind, msg: String) -> io::Error {
    io::Error::new(kind, msg)
}

/// Where to suggest writing instead of a path that is not a regular file.
fn instead(stdout: Stdout) -> &'static str {
    match stdout {
        Stdout::Allowed => "name a regular file, or `-o -` for standard output",
        Stdout::Refused => "name a regular file",
    }
}

/// The refusal of an OUT that exists.
fn exists_error(path: &Path) -> io::Error {
    err(
        io::ErrorKind::AlreadyExists,
        format!(
            "{} exists: pass --force to replace it, or choose another -o",
            path.display()
        ),
    )
}

/// Checks OUT before anything is written (or attached): what it is, and whether
/// pyprobe may replace it.
pub fn check(path: &Path, stdout: Stdout, existing: Existing) -> io::Result<Destination> {
    if path.as_os_str() == "-" {
        return match stdout {
            Stdout::Allowed => Ok(Destination::Stdout),
            Stdout::Refused => Err(err(
                io::ErrorKind::InvalidInput,
                "this command cannot write to standard output (`-o -`): name a file".into(),
            )),
        };
    }
    if path.as_os_str().is_empty() {
        return Err(err(
            io::ErrorKind::InvalidInput,
            "the output name is empty: name a file".into(),
        ));
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(Destination::File(path.to_owned()))
        }
        Err(e) => {
            return Err(err(
                e.kind(),
                format!("cannot look at output {}: {e}", path.display()),
            ))
        }
    };
    let (real, meta) = if meta.file_type().is_symlink() {
        // Replace what the link points to, not the link.
        let real = std::fs::canonicalize(path).map_err(|e| {
            err(
                e.kind(),
                format!(
                    "output {} is a symbolic link whose target cannot be used ({e}): name the file itself",
                    path.display()
                ),
            )
        })?;
        let meta = std::fs::metadata(&real).map_err(|e| {
            err(
                e.kind(),
                format!("cannot look at output {}: {e}", real.display()),
            )
        })?;
        (real, meta)
    } else {
        (path.to_owned(), meta)
    };
    let ft = meta.file_type();
    let what = if ft.is_file() {
        None
    } else if ft.is_fifo() {
        return Ok(Destination::Fifo(real));
    } else if ft.is_char_device() {
        Some("a character device")
    } else if ft.is_block_device() {
        Some("a block device")
    } else if ft.is_dir() {
        Some("a directory")
    } else if ft.is_socket() {
        Some("a socket")
    } else {
        Some("not a regular file")
    };
    if let Some(what) = what {
        return Err(err(
            io::ErrorKind::InvalidInput,
            format!(
                "output {} is {what}, not a regular file: pyprobe writes a new file and renames it \
                 over the old one, and never writes into or replaces anything else; {}",
                path.display(),
                instead(stdout)
            ),
        ));
    }
    if existing == Existing::Keep {
        return Err(exists_error(path));
    }
    if nix::unistd::access(&real, nix::unistd::AccessFlags::W_OK).is_err() {
        return Err(err(
            io::ErrorKind::PermissionDenied,
            format!(
                "output {} exists and is not writable: pyprobe replaces only a file it could \
                 write; choose another name or make it writable",
                path.display()
            ),
        ));
    }
    Ok(Destination::File(real))
}

/// The name a recording is written under until it ends: `OUT.partial`, beside OUT.
pub fn partial_path(dest: &Path) -> PathBuf {
    let mut name: OsString = dest.file_name().unwrap_or_default().to_owned();
    name.push(".partial");
    dest.with_file_name(name)
}

fn partial_in_use(partial: &Path, out: &Path) -> io::Error {
    err(
        io::ErrorKind::AlreadyExists,
        format!(
            "{} exists: another pyprobe is recording to {}, or an earlier one was stopped \
             before it ended (the file holds what it recorded); move or remove it, or choose \
             another name",
            partial.display(),
            out.display()
        ),
    )
}

/// [`check`] for a recording: also refuses when its `OUT.partial` exists.
pub fn check_recording(path: &Path, existing: Existing) -> io::Result<Destination> {
    let destination = check(path, Stdout::Refused, existing)?;
    if let Destination::File(real) = &destination {
        let partial = partial_path(real);
        if std::fs::symlink_metadata(&partial).is_ok() {
            return Err(partial_in_use(&partial, path));
        }
    }
    Ok(destination)
}

/// The first name `numbered(0)`, `numbered(1)`, ... at which nothing exists (nor,
/// for a `recording`, its `.partial`): where a default output goes without
/// replacing anything.
pub fn first_free(numbered: impl Fn(u32) -> PathBuf, recording: bool) -> io::Result<PathBuf> {
    let taken = |p: &Path| {
        std::fs::symlink_metadata(p).is_ok()
            || (recording && std::fs::symlink_metadata(partial_path(p)).is_ok())
    };
    const TRIES: u32 = 10_000;
    (0..TRIES)
        .map(&numbered)
        .find(|p| !taken(p))
        .ok_or_else(|| {
            err(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} and the next {TRIES} numbered names exist: name the output with -o \
                     (or pass --force to replace {})",
                    numbered(0).display(),
                    numbered(0).display()
                ),
            )
        })
}

/// `base` with `.N` before `suffix` (`run.svg`, `.svg`, 2: `run.2.svg`); `base`
/// itself for 0.
pub fn numbered(base: &Path, suffix: &str, n: u32) -> PathBuf {
    if n == 0 {
        return base.to_owned();
    }
    let name = base
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(suffix).unwrap_or(&name);
    base.with_file_name(format!("{stem}.{n}{suffix}"))
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Mode 0600 exactly: the umask may have taken bits away from the user.
fn private(file: &File, path: &Path) -> io::Result<()> {
    file.set_permissions(Permissions::from_mode(0o600))
        .map_err(|e| {
            err(
                e.kind(),
                format!("cannot make {} private (mode 0600): {e}", path.display()),
            )
        })
}

/// Opens a FIFO for writing. `wait_for_reader`: block until one opens it;
/// otherwise fail at once when nobody reads (a recorder must not stall its target).
fn open_fifo(path: &Path, wait_for_reader: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.write(true);
    if !wait_for_reader {
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ENXIO) {
            err(
                io::ErrorKind::NotConnected,
                format!(
                    "output {} is a FIFO nobody reads yet: start its reader first",
                    path.display()
                ),
            )
        } else {
            err(
                e.kind(),
                format!("cannot open FIFO {}: {e}", path.display()),
            )
        }
    })?;
    if !wait_for_reader {
        // Writes then wait for a slow reader instead of failing with EAGAIN.
        use std::os::fd::AsRawFd;
        nix::fcntl::fcntl(
            file.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
        )
        .map_err(|e| {
            err(
                io::ErrorKind::Other,
                format!("cannot set up FIFO {}: {e}", path.display()),
            )
        })?;
    }
    Ok(file)
}

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

impl Drop for Output {
    /// Not committed (an error path, a panic): a temporary goes, a partial
    /// recording with anything in it stays.
    fn drop(&mut self) {
        if let Some(Inner::Partial { file, path }) = self.inner.take() {
            if file.metadata().map(|m| m.len() == 0).unwrap_or(false) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o777
    }

    #[test]
    fn replace_leaves_out_alone_until_commit() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("view.svg");
        std::fs::write(&out, b"old").unwrap();
        let o = Output::replace(&out, Stdout::Allowed, Existing::Replace).unwrap();
        o.file().write_all(b"new").unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"old");
        drop(o);
        assert_eq!(std::fs::read(&out).unwrap(), b"old");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "temporary removed"
        );
        let o = Output::replace(&out, Stdout::Allowed, Existing::Replace).unwrap();
        o.file().write_all(b"new").unwrap();
        o.commit().unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"new");
        assert_eq!(mode(&out), 0o600);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn partial_is_kept_or_published_when_the_run_fails() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run.pyprobe");
        // Nothing there: what was written becomes OUT.
        let o = Output::partial(&out, Existing::Replace).unwrap();
        assert_eq!(o.writing_to(), partial_path(&out));
        o.file().write_all(b"chunks").unwrap();
        assert_eq!(o.salvage(), Some(out.clone()));
        assert_eq!(std::fs::read(&out).unwrap(), b"chunks");
        // OUT exists: it stays, the partial stays beside it.
        let o = Output::partial(&out, Existing::Replace).unwrap();
        o.file().write_all(b"more").unwrap();
        assert_eq!(o.salvage(), Some(partial_path(&out)));
        assert_eq!(std::fs::read(&out).unwrap(), b"chunks");
        assert_eq!(std::fs::read(partial_path(&out)).unwrap(), b"more");
        // A partial that exists is never truncated.
        let e = Output::partial(&out, Existing::Replace).err().unwrap();
        assert!(e.to_string().contains("run.pyprobe.partial exists"), "{e}");
        assert_eq!(std::fs::read(partial_path(&out)).unwrap(), b"more");
        std::fs::remove_file(partial_path(&out)).unwrap();
        // Nothing written: nothing left.
        drop(Output::partial(&out, Existing::Replace).unwrap());
        assert!(!partial_path(&out).exists());
    }

    #[test]
    fn partial_is_private_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("r.pyprobe");
        let o = Output::partial(&out, Existing::Replace).unwrap();
        assert_eq!(mode(o.writing_to()), 0o600);
        o.file().write_all(b"x").unwrap();
        o.commit().unwrap();
        assert_eq!(mode(&out), 0o600);
    }

    #[test]
    fn what_is_not_a_regular_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = check(dir.path(), Stdout::Allowed, Existing::Replace).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        assert!(e.to_string().contains("`-o -`"), "{e}");
        let e = check(Path::new("/dev/null"), Stdout::Refused, Existing::Replace).unwrap_err();
        assert!(e.to_string().contains("is a character device"), "{e}");
        assert!(!e.to_string().contains("`-o -`"), "{e}");
        assert_eq!(
            check(Path::new("-"), Stdout::Allowed, Existing::Keep).unwrap(),
            Destination::Stdout
        );
        assert!(check(Path::new("-"), Stdout::Refused, Existing::Keep).is_err());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/dev/null", &link).unwrap();
        let e = check(&link, Stdout::Allowed, Existing::Replace).unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn a_link_to_a_file_replaces_the_file_not_the_link() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.txt");
        std::fs::write(&real, b"old").unwrap();
        let link = dir.path().join("link.txt");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let o = Output::replace(&link, Stdout::Allowed, Existing::Replace).unwrap();
        o.file().write_all(b"new").unwrap();
        o.commit().unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&real).unwrap(), b"new");
    }

    #[test]
    fn an_existing_output_is_kept_unless_replacing_was_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("view.svg");
        std::fs::write(&out, b"old").unwrap();
        let e = Output::replace(&out, Stdout::Allowed, Existing::Keep)
            .err()
            .unwrap();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert!(e.to_string().contains("view.svg exists"), "{e}");
        assert!(e.to_string().contains("--force"), "{e}");
        let e = Output::partial(&out, Existing::Keep).err().unwrap();
        assert!(e.to_string().contains("--force"), "{e}");
        // Through a link too.
        let link = dir.path().join("link.svg");
        std::os::unix::fs::symlink(&out, &link).unwrap();
        let e = check(&link, Stdout::Allowed, Existing::Keep).unwrap_err();
        assert!(e.to_string().contains("link.svg exists"), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_file_that_appears_while_writing_is_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("view.svg");
        let o = Output::replace(&out, Stdout::Allowed, Existing::Keep).unwrap();
        o.file().write_all(b"new").unwrap();
        std::fs::write(&out, b"theirs").unwrap();
        let kept = o.writing_to().to_owned();
        let e = o.commit().unwrap_err();
        assert!(e.to_string().contains("appeared"), "{e}");
        assert!(e.to_string().contains(&*kept.to_string_lossy()), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"theirs");
        assert_eq!(std::fs::read(&kept).unwrap(), b"new", "the output is kept");

        let rec = dir.path().join("run.pyprobe");
        let o = Output::partial(&rec, Existing::Keep).unwrap();
        o.file().write_all(b"chunks").unwrap();
        std::fs::write(&rec, b"theirs").unwrap();
        let e = o.commit().unwrap_err();
        assert!(e.to_string().contains("run.pyprobe.partial"), "{e}");
        assert_eq!(std::fs::read(&rec).unwrap(), b"theirs");
        assert_eq!(std::fs::read(partial_path(&rec)).unwrap(), b"chunks");

        // Nothing there: committed as usual.
        let fresh = dir.path().join("fresh.pyprobe");
        let o = Output::partial(&fresh, Existing::Keep).unwrap();
        o.file().write_all(b"x").unwrap();
        o.commit().unwrap();
        assert_eq!(std::fs::read(&fresh).unwrap(), b"x");
        assert!(!partial_path(&fresh).exists());
    }

    #[test]
    fn the_first_free_name_skips_files_and_partial_recordings() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("pyprobe-7.pyprobe");
        let name = |n| numbered(&base, ".pyprobe", n);
        assert_eq!(first_free(name, true).unwrap(), base);
        std::fs::write(&base, b"").unwrap();
        assert_eq!(
            first_free(name, true).unwrap(),
            dir.path().join("pyprobe-7.1.pyprobe")
        );
        std::fs::write(partial_path(&dir.path().join("pyprobe-7.1.pyprobe")), b"").unwrap();
        assert_eq!(
            first_free(name, true).unwrap(),
            dir.path().join("pyprobe-7.2.pyprobe")
        );
        assert_eq!(
            first_free(name, false).unwrap(),
            dir.path().join("pyprobe-7.1.pyprobe"),
            "a view has no partial"
        );
        let view = dir.path().join("run.trace.json");
        assert_eq!(
            numbered(&view, ".trace.json", 3),
            dir.path().join("run.3.trace.json")
        );
    }
}
