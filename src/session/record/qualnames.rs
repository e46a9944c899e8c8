//! Which qualified name (`Class.method`) each function of the recording gets.
//!
//! From 3.11 the frame walker and the hook read `co_qualname`, and their answer
//! is final. Otherwise (before 3.11, and for names the function probes pass:
//! 3.15's entries, 3.11's returns) the name is read from the function's source
//! file, as the target sees it (`/proc/PID/root`, relative paths from
//! `/proc/PID/cwd`), when the function is first seen. Nothing is read from the
//! target's memory for it.

use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use rustc_hash::FxHashSet;

use pyprobe_cpython::python::source_scopes::{SourceScopes, MAX_SOURCE_BYTES};
use pyprobe_recording::recording::FrameRef;

/// Most source files kept scanned; past it the cache starts over.
const MAX_FILES: usize = 512;
/// Most functions remembered as named; past it they may be named again.
const MAX_NAMED: usize = 1 << 20;

/// Functions already given their name, and the source files read.
#[derive(Default)]
pub struct CodeNames {
    /// Functions (file, name, line ids) already looked at.
    seen: FxHashSet<FrameRef>,
    /// Scanned source files by path as pyprobe opens them.
    sources: HashMap<PathBuf, Option<Arc<SourceScopes>>>,
    /// The interpreter has `co_qualname` (3.11+): what the walker reads is final.
    interpreter_has_qualnames: bool,
}

impl CodeNames {
    pub fn interpreter_has_qualnames(&mut self, yes: bool) {
        self.interpreter_has_qualnames = yes;
    }

    /// Whether the frame walker's names are qualified names (3.11+).
    pub fn walker_qualifies(&self) -> bool {
        self.interpreter_has_qualnames
    }

    /// Whether `code` is met for the first time (then it is remembered).
    pub fn first_sight(&mut self, code: FrameRef) -> bool {
        if self.seen.len() >= MAX_NAMED {
            self.seen.clear();
        }
        self.seen.insert(code)
    }

    /// The qualified name of function `name` at `line` of `file` in process
    /// `pid`, and the line its code starts at, from the source; `None` when
    /// the file cannot be read or shows no such function there.
    pub fn in_source(
        &mut self,
        pid: i32,
        file: &str,
        name: &str,
        line: u32,
    ) -> Option<(String, u32)> {
        let sources = &mut self.sources;
        // A `..` could climb out of the target's root (a chroot, a container)
        // into pyprobe's: such a name is not followed.
        if file.is_empty()
            || file.starts_with('<')
            || name.is_empty()
            || file.split('/').any(|part| part == "..")
        {
            return None;
        }
        let path = if file.starts_with('/') {
            PathBuf::from(format!("/proc/{pid}/root{file}"))
        } else {
            PathBuf::from(format!("/proc/{pid}/cwd/{file}"))
        };
        if sources.len() >= MAX_FILES && !sources.contains_key(&path) {
            sources.clear();
        }
        let scopes = sources
            .entry(path)
            .or_insert_with_key(|path| scan(path).map(Arc::new))
            .clone()?;
        scopes.qualname(name, line)
    }
}

/// Reads and scans one source file, if it is a regular file of bounded size.
fn scan(path: &std::path::Path) -> Option<SourceScopes> {
    use std::os::unix::fs::OpenOptionsExt;
    // Never block on what the target names: a FIFO is not opened, and the open
    // does not wait even if the path became one meanwhile.
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > MAX_SOURCE_BYTES as u64 {
        return None;
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_SOURCE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .ok()?;
    if bytes.len() > MAX_SOURCE_BYTES {
        return None;
    }
    Some(SourceScopes::parse(&String::from_utf8_lossy(&bytes)))
}

#[cfg(test)]
mod tests {
    use super::CodeNames;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("pyprobe-qn-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn names_come_from_the_file_as_the_process_sees_it() {
        let dir = temp_dir("plain");
        let file = dir.join("shapes.py");
        std::fs::write(&file, "class Circle:\n    def area(self):\n        pass\n").unwrap();
        let pid = std::process::id() as i32;
        let mut names = CodeNames::default();
        let path = file.to_str().unwrap();
        assert_eq!(
            names.in_source(pid, path, "area", 2),
            Some(("Circle.area".into(), 2))
        );
        // Climbing with `..` is refused, even to the same file.
        let own = dir.file_name().unwrap().to_str().unwrap();
        let climbing = format!("{}/../{own}/shapes.py", dir.display());
        assert!(std::path::Path::new(&climbing).exists());
        assert_eq!(names.in_source(pid, &climbing, "area", 2), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_fifo_named_as_source_is_not_opened() {
        let dir = temp_dir("fifo");
        let fifo = dir.join("app.py");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let mut names = CodeNames::default();
        // Would block for ever if it were opened for reading.
        let got = names.in_source(std::process::id() as i32, fifo.to_str().unwrap(), "f", 1);
        assert_eq!(got, None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
