//! Finding the ELF objects a process has mapped, and where they were loaded.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Result};

use super::maps::{read_maps, MapEntry};
use crate::elf::{ElfInfo, LoadSegment};

/// An ELF object mapped into a process, with its load bias.
#[derive(Debug, Clone)]
pub struct LoadedObject {
    /// The path as the target sees it.
    pub target_path: String,
    /// The path pyprobe opened it through (`/proc/PID/map_files/...` when possible).
    pub opened_path: PathBuf,
    pub elf: ElfInfo,
    /// runtime address = link-time address + bias (wrapping).
    pub bias: u64,
    /// Device and inode of the file, to recognise its mappings.
    pub dev: (u32, u32),
    pub inode: u64,
}

impl LoadedObject {
    pub fn runtime(&self, link_address: u64) -> u64 {
        link_address.wrapping_add(self.bias)
    }

    /// Whether every loadable segment is mapped from this file yet. While the dynamic
    /// loader is still mapping an object, its code may be there before its data (where
    /// the semaphores live): patching then would be undone by the next `mmap`.
    pub fn is_fully_mapped(&self, maps: &[MapEntry]) -> bool {
        // The loader first reserves the whole span with one read-only mapping of the
        // file, then maps each segment over it: a segment counts as mapped only once
        // a mapping with its permissions covers it (the end of a writable segment: its
        // start may later be made read-only for RELRO).
        self.elf.segments.iter().filter(|s| s.filesz > 0).all(|s| {
            let covered = |a: u64| {
                maps.iter().any(|m| {
                    m.dev == self.dev
                        && m.inode == self.inode
                        && m.start <= a
                        && a < m.end
                        && m.executable == s.executable
                        && (!s.writable || m.writable)
                })
            };
            let start = self.runtime(s.vaddr);
            let end = start.wrapping_add(s.filesz - 1);
            if s.writable {
                covered(end)
            } else {
                covered(start) && covered(end)
            }
        })
    }

    pub fn has_provider(&self, provider: &str) -> bool {
        self.elf.probes.iter().any(|p| p.provider == provider)
    }
}

/// Load bias of an object from one of its mappings: the mapping puts file offset
/// `entry.offset` at `entry.start`, and the PT_LOAD segment covering that offset puts it
/// at link-time address `seg.vaddr + entry.offset - seg.offset`.
pub fn load_bias(segments: &[LoadSegment], entries: &[&MapEntry]) -> Option<u64> {
    entries.iter().find_map(|e| {
        let len = e.end.saturating_sub(e.start);
        let seg = segments.iter().find(|s| {
            s.filesz > 0
                && e.offset < s.offset.saturating_add(s.filesz)
                && s.offset < e.offset.saturating_add(len)
        })?;
        Some(
            e.start
                .wrapping_sub(seg.vaddr)
                .wrapping_sub(e.offset)
                .wrapping_add(seg.offset),
        )
    })
}

/// Every distinct file mapped into `pid`, in address order, with its mappings.
pub fn mapped_files(maps: &[MapEntry]) -> Vec<Vec<&MapEntry>> {
    let mut files: Vec<Vec<&MapEntry>> = Vec::new();
    for entry in maps.iter().filter(|m| m.is_file()) {
        match files
            .iter_mut()
            .find(|f| f[0].dev == entry.dev && f[0].inode == entry.inode)
        {
            Some(f) => f.push(entry),
            None => files.push(vec![entry]),
        }
    }
    files
}

/// Opens the ELF file behind one mapped file's mappings, with its load bias.
pub fn open_object(pid: i32, entries: &[&MapEntry]) -> Option<LoadedObject> {
    let first = entries[0];
    // map_files works across mount namespaces and for deleted files; the root path
    // is the fallback where map_files is not readable.
    let candidates = [first.map_files_path(pid), first.root_path(pid)];
    let (opened_path, elf) = candidates
        .into_iter()
        .find_map(|p| read_elf(&p).map(|elf| (p, elf)))?;
    let bias = load_bias(&elf.segments, entries)?;
    Some(LoadedObject {
        target_path: first.path.clone(),
        opened_path,
        elf,
        bias,
        dev: first.dev,
        inode: first.inode,
    })
}

/// What tells one file's contents from another's without reading it: device,
/// inode, size and modification time (a file rewritten in place changes the last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileKey {
    dev: u64,
    inode: u64,
    size: u64,
    mtime_ns: i128,
}

/// Objects parsed lately, newest last. While a process starts, its maps change at
/// every library the loader maps, and each look would parse the interpreter again
/// (milliseconds for a 5 MB executable with its symbols).
static PARSED: Mutex<Vec<(FileKey, ElfInfo)>> = Mutex::new(Vec::new());
/// How many parsed objects are kept.
const PARSED_KEPT: usize = 8;

/// [`ElfInfo::read`], from [`PARSED`] when the same file was parsed before; the
/// copy returned names `path`, the path it was asked for.
fn read_elf(path: &Path) -> Option<ElfInfo> {
    let meta = std::fs::metadata(path).ok()?;
    let key = FileKey {
        dev: meta.dev(),
        inode: meta.ino(),
        size: meta.size(),
        mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
    };
    let cached = PARSED.lock().ok().and_then(|parsed| {
        parsed
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, e)| e.clone())
    });
    if let Some(mut elf) = cached {
        elf.path = path.to_owned();
        return Some(elf);
    }
    let elf = ElfInfo::read(path).ok()?;
    if let Ok(mut parsed) = PARSED.lock() {
        if parsed.len() >= PARSED_KEPT {
            parsed.remove(0);
        }
        parsed.push((key, elf.clone()));
    }
    Some(elf)
}

/// The objects in `pid` that carry SDT notes. Objects whose path looks like Python
/// (the interpreter, `libpython*.so`) are checked first; the rest only if
/// `provider` is not found among those.
pub fn sdt_objects(pid: i32, provider: Option<&str>) -> Result<Vec<LoadedObject>> {
    let maps = read_maps(pid)?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let files = mapped_files(&maps);
    let looks_pythonic = |f: &Vec<&MapEntry>| {
        let p = &f[0].path;
        p.contains("python") || exe.as_ref().is_some_and(|e| e.as_os_str() == p.as_str())
    };
    let mut found: Vec<LoadedObject> = Vec::new();
    for pass in [true, false] {
        for f in files.iter().filter(|f| looks_pythonic(f) == pass) {
            if let Some(obj) = open_object(pid, f) {
                if !obj.elf.probes.is_empty() {
                    found.push(obj);
                }
            }
        }
        if let Some(p) = provider {
            if found.iter().any(|o| o.has_provider(p)) {
                break;
            }
        }
    }
    Ok(found)
}

/// The object in `pid` that carries `provider`'s probes (e.g. the python binary,
/// `libpython3.X.so`, or an interpreter started through the dynamic loader).
pub fn find_probe_object(pid: i32, provider: &str) -> Result<LoadedObject> {
    let objects = sdt_objects(pid, Some(provider))?;
    match objects.into_iter().find(|o| o.has_provider(provider)) {
        Some(o) => Ok(o),
        None => bail!(
            "process {pid} has no mapped object with SDT probes of provider '{provider}' \
             (is it a CPython built with --with-dtrace? `pyprobe probes -p {pid}` lists what it has)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(start: u64, end: u64, offset: u64, x: bool) -> MapEntry {
        MapEntry {
            start,
            end,
            readable: true,
            writable: false,
            executable: x,
            shared: false,
            offset,
            dev: (1, 1),
            inode: 5,
            path: "/usr/bin/python3".into(),
        }
    }

    #[test]
    fn bias_of_pie_and_fixed_objects() {
        let segs = [
            LoadSegment {
                vaddr: 0,
                memsz: 0x6b000,
                offset: 0,
                filesz: 0x6b000,
                executable: false,
                writable: false,
            },
            LoadSegment {
                vaddr: 0x6b000,
                memsz: 0x2b0000,
                offset: 0x6b000,
                filesz: 0x2b0000,
                executable: true,
                writable: false,
            },
        ];
        let text = entry(0x55d0c0a6b000, 0x55d0c0d1c000, 0x6b000, true);
        assert_eq!(load_bias(&segs, &[&text]), Some(0x55d0c0a00000));

        let fixed = [LoadSegment {
            vaddr: 0x400000,
            memsz: 0x1000,
            offset: 0,
            filesz: 0x1000,
            executable: true,
            writable: false,
        }];
        let e = entry(0x400000, 0x401000, 0, true);
        assert_eq!(load_bias(&fixed, &[&e]), Some(0));
    }

    #[test]
    fn segment_starting_mid_page() {
        // A data segment at file offset 0x2de10 mapped from the page at 0x2d000.
        let segs = [LoadSegment {
            vaddr: 0x22de10,
            memsz: 0x500,
            offset: 0x2de10,
            filesz: 0x300,
            executable: false,
            writable: false,
        }];
        let e = entry(0x7f0000022d000, 0x7f0000022f000, 0x2d000, false);
        let bias = load_bias(&segs, &[&e]).unwrap();
        assert_eq!(0x22de10u64.wrapping_add(bias), 0x7f0000022de10);
    }

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .join("fixtures/build")
            .join(name)
    }

    #[test]
    fn a_file_parsed_again_comes_from_the_cache_and_a_rewritten_one_does_not() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::copy(fixture("sdt_fixture_pie"), &a).expect("copy the fixture");
        std::fs::hard_link(&a, &b).expect("hard link");
        let first = read_elf(&a).expect("parsed");
        assert!(first.position_independent && !first.probes.is_empty());
        // The same file by another name: the copy names the path asked for.
        let again = read_elf(&b).expect("cached");
        assert_eq!(again.path, b);
        assert_eq!(again.probes.len(), first.probes.len());
        // Rewritten in place (same inode, another size): parsed anew.
        let size = |n: &str| std::fs::metadata(fixture(n)).expect("fixture").len();
        assert_ne!(size("sdt_fixture_pie"), size("sdt_fixture_nopie"));
        std::fs::write(
            &a,
            std::fs::read(fixture("sdt_fixture_nopie")).expect("read"),
        )
        .expect("rewrite");
        let rewritten = read_elf(&a).expect("parsed");
        assert!(
            !rewritten.position_independent,
            "a stale parse was returned"
        );
        assert!(read_elf(&dir.path().join("missing")).is_none());
    }
}
