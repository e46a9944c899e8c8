//! `/proc/PID/maps`.

use std::path::PathBuf;

use anyhow::{Context, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntry {
    pub start: u64,
    pub end: u64,
    pub(crate) readable: bool,
    pub writable: bool,
    pub executable: bool,
    /// `s` rather than `p`: a shared mapping (writes reach the object, and every
    /// process mapping it).
    pub(crate) shared: bool,
    pub offset: u64,
    /// (major, minor) device and inode of the backing file; inode 0 for anonymous maps.
    pub dev: (u32, u32),
    pub inode: u64,
    /// The path as the target sees it (may be in another mount namespace, may end in
    /// " (deleted)"); empty for anonymous maps.
    pub path: String,
}

impl MapEntry {
    pub(crate) fn is_file(&self) -> bool {
        self.inode != 0 && self.path.starts_with('/')
    }

    /// The file, opened through the target's own view: `/proc/PID/map_files/START-END`
    /// works across mount namespaces and for deleted files.
    pub fn map_files_path(&self, pid: i32) -> PathBuf {
        PathBuf::from(format!(
            "/proc/{pid}/map_files/{:x}-{:x}",
            self.start, self.end
        ))
    }

    /// Fallback when `map_files` is not readable: the path under the target's root.
    pub fn root_path(&self, pid: i32) -> PathBuf {
        PathBuf::from(format!("/proc/{pid}/root{}", self.path))
    }
}

pub fn read_maps(pid: i32) -> Result<Vec<MapEntry>> {
    let path = format!("/proc/{pid}/maps");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    Ok(parse_maps(&text))
}

/// The size in bytes of `/proc/PID/maps` (0 when unreadable): a cheap sign that
/// the mappings changed.
pub fn maps_len(pid: i32) -> usize {
    std::fs::read(format!("/proc/{pid}/maps"))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// Parses the text of a maps file; lines that do not parse are skipped.
pub(crate) fn parse_maps(text: &str) -> Vec<MapEntry> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MapEntry> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?.as_bytes();
    let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
    let dev = fields.next()?;
    let inode = fields.next()?.parse().ok()?;
    let path = fields.next().unwrap_or("").trim_start().to_owned();
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    if perms.len() < 4 {
        return None;
    }
    Some(MapEntry {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        readable: perms[0] == b'r',
        writable: perms[1] == b'w',
        executable: perms[2] == b'x',
        shared: perms[3] == b's',
        offset,
        dev: (
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        ),
        inode,
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_file_anonymous_and_special_lines() {
        let text = "\
55d0c0a00000-55d0c0a6b000 r--p 00000000 fd:01 1314 /usr/bin/python3.11
55d0c0a6b000-55d0c0d1c000 r-xp 0006b000 fd:01 1314 /usr/bin/python3.11
7f00aa000000-7f00aa021000 rw-p 00000000 00:00 0 
7ffd3c1e3000-7ffd3c204000 rw-p 00000000 00:00 0                          [stack]
7f00ab000000-7f00ab001000 r-xp 00002000 08:02 77 /tmp/a b (deleted)
7f00ac000000-7f00ac801000 rw-s 00000000 00:01 2052 /memfd:pyprobe-ring (deleted)
garbage line
";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 6);
        assert!(maps[5].shared && !maps[2].shared);
        assert_eq!(maps[1].offset, 0x6b000);
        assert!(maps[1].executable && maps[1].is_file());
        assert_eq!(maps[1].dev, (0xfd, 1));
        assert!(!maps[2].is_file());
        assert_eq!(maps[3].path, "[stack]");
        assert_eq!(maps[4].path, "/tmp/a b (deleted)");
    }
}
