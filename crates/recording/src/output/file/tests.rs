use std::io;
use std::path::Path;

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

/// A `.partial` replaced while pyprobe writes (by the target, or anyone who can
/// write the directory) is never renamed into place as the recording: what
/// pyprobe wrote is copied from its own descriptor, the other file left alone.
#[test]
fn a_replaced_partial_is_not_published_as_the_recording() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.pyprobe");
    let o = Output::partial(&out, Existing::Keep).unwrap();
    o.file().write_all(b"pyprobe's").unwrap();
    std::fs::remove_file(partial_path(&out)).unwrap();
    std::fs::write(partial_path(&out), b"forged").unwrap();
    o.commit().unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), b"pyprobe's");
    assert_eq!(std::fs::read(partial_path(&out)).unwrap(), b"forged");
    assert_eq!(mode(&out), 0o600);
    // Removed, and OUT made meanwhile: the copy goes beside OUT, which stays.
    let out = dir.path().join("second.pyprobe");
    let o = Output::partial(&out, Existing::Keep).unwrap();
    o.file().write_all(b"second").unwrap();
    std::fs::remove_file(partial_path(&out)).unwrap();
    std::fs::write(&out, b"someone's").unwrap();
    let kept = o.salvage().unwrap();
    assert_ne!(kept, out);
    assert_eq!(std::fs::read(kept).unwrap(), b"second");
    assert_eq!(std::fs::read(&out).unwrap(), b"someone's");
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
