//! What OUT is and may become: the checks before anything is written, and the
//! names beside it.

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

pub(super) fn err(kind: io::ErrorKind, msg: String) -> io::Error {
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

pub(super) fn partial_in_use(partial: &Path, out: &Path) -> io::Error {
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

/// Whether something exists at `p` (or, for a `recording`, at its `.partial`, which
/// a recorder under way or killed holds): a default name must pass over it.
pub fn is_taken(p: &Path, recording: bool) -> bool {
    std::fs::symlink_metadata(p).is_ok()
        || (recording && std::fs::symlink_metadata(partial_path(p)).is_ok())
}

/// The first name `numbered(0)`, `numbered(1)`, ... at which nothing exists (nor,
/// for a `recording`, its `.partial`): where a default output goes without
/// replacing anything.
pub fn first_free(numbered: impl Fn(u32) -> PathBuf, recording: bool) -> io::Result<PathBuf> {
    const TRIES: u32 = 10_000;
    (0..TRIES)
        .map(&numbered)
        .find(|p| !is_taken(p, recording))
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

pub(super) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Mode 0600 exactly: the umask may have taken bits away from the user.
pub(super) fn private(file: &File, path: &Path) -> io::Result<()> {
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
pub(super) fn open_fifo(path: &Path, wait_for_reader: bool) -> io::Result<File> {
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
