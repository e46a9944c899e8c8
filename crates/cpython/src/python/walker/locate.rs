//! Finding the interpreter in a live process: the mapped object that defines
//! `_PyRuntime` (or has a `.PyRuntime` section), its load bias, and its version.

use anyhow::{bail, Result};

use super::layout::DEBUG_COOKIE;
use crate::python::version::{self, PyVersion};
use pyprobe_sdt::process::maps::MapEntry;
use pyprobe_sdt::process::objects::{self, mapped_files, LoadedObject};
use pyprobe_sdt::process::read_maps;
use pyprobe_sdt::sdt::MemoryReader;

/// The object carrying the interpreter, and where `_PyRuntime` is in the process.
pub(crate) struct Interpreter {
    pub(crate) object: LoadedObject,
    /// Runtime address of `_PyRuntime`.
    pub(crate) runtime: u64,
    pub version: PyVersion,
    /// How the version was found, for messages.
    pub(crate) version_from: &'static str,
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// How likely a mapped file is to be the interpreter: lower is tried first. Extension
/// modules (`*.cpython-311-x86_64-linux-gnu.so`) never define `_PyRuntime`.
fn rank(path: &str, exe: Option<&str>) -> u8 {
    let name = base_name(path);
    if name.contains(".cpython-") {
        return 9;
    }
    if name.starts_with("libpython") {
        0
    } else if exe == Some(path) || name.starts_with("python") {
        1
    } else if path.contains("python") {
        2
    } else {
        3
    }
}

/// The object behind one mapped file, if it defines `_PyRuntime`.
fn open_object(pid: i32, entries: &[&MapEntry]) -> Option<LoadedObject> {
    objects::open_object(pid, entries)
        .filter(|o| o.elf.py_runtime.is_some() || o.elf.py_runtime_section.is_some())
}

/// The mapped object of `pid` that defines `_PyRuntime`: the executable, a
/// `libpython3.X.so`, a python binary run through the dynamic loader, or any other
/// object (an embedding program) as a last resort.
pub fn find_interpreter_object(pid: i32) -> Result<LoadedObject> {
    let maps = read_maps(pid)?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned());
    let mut files = mapped_files(&maps);
    files.retain(|f| rank(&f[0].path, exe.as_deref()) < 9);
    files.sort_by_key(|f| rank(&f[0].path, exe.as_deref()));
    for f in &files {
        if let Some(object) = open_object(pid, f) {
            return Ok(object);
        }
    }
    if let Some(v) = maps.iter().find_map(|m| version_in_path(&m.path)) {
        if !v.at_least(3, 7) {
            bail!(
                "process {pid} runs python {v}, which the frame walker does not support \
                 (it needs 3.7+: _PyRuntime)"
            );
        }
    }
    // An exiting process has let its memory go before it turns zombie.
    if pyprobe_sdt::process::status::process_is_ending(pid) {
        bail!("process {pid} exited while pyprobe was looking for its interpreter");
    }
    bail!(
        "process {pid} has no mapped object defining _PyRuntime: is it a CPython 3.7+ \
         process (or was its interpreter stripped of symbols)?"
    )
}

/// `python3.X` anywhere in a path: `/usr/lib/python3.9/lib-dynload/...`, `python3.9`.
fn version_in_path(path: &str) -> Option<PyVersion> {
    path.split('/').find_map(|part| {
        let at = part.find("python3.")?;
        let minor: String = part[at + "python3.".len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        Some(PyVersion {
            major: 3,
            minor: minor.parse().ok()?,
            micro: None,
        })
    })
}

/// The interpreter's version: `Py_Version` (3.11+), else the `_Py_DebugOffsets`
/// version (3.13+), else the object's file name, else a `python3.X` directory or file
/// among the process's mappings (`lib/python3.9/lib-dynload/...`).
pub(crate) fn detect_version<M: MemoryReader + ?Sized>(
    object: &LoadedObject,
    mem: &M,
    runtime: u64,
    maps: &[MapEntry],
) -> Option<(PyVersion, &'static str)> {
    if let Some(sym) = object.elf.py_version_symbol {
        let mut b = [0u8; 4];
        if mem.read_exact(object.runtime(sym), &mut b).is_ok() {
            if let Some(v) = version::from_hex(u32::from_le_bytes(b)) {
                return Some((v, "Py_Version"));
            }
        }
    }
    let mut head = [0u8; 16];
    if mem.read_exact(runtime, &mut head).is_ok() && &head[..8] == DEBUG_COOKIE {
        let hex = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default());
        if let Some(v) = version::from_hex(hex as u32) {
            return Some((v, "_Py_DebugOffsets"));
        }
    }
    if let Some(v) = version::from_file_name(&object.target_path) {
        return Some((v, "file name"));
    }
    maps.iter()
        .find_map(|m| version_in_path(&m.path))
        .map(|v| (v, "mapped paths"))
}

/// Locates the interpreter of `pid` and its version.
pub(crate) fn locate<M: MemoryReader + ?Sized>(pid: i32, mem: &M) -> Result<Interpreter> {
    let object = find_interpreter_object(pid)?;
    let link = match (object.elf.py_runtime, object.elf.py_runtime_section) {
        (Some(sym), _) => sym,
        (None, Some((addr, _))) => addr,
        (None, None) => bail!("{} has no _PyRuntime", object.target_path),
    };
    let runtime = object.runtime(link);
    let maps = read_maps(pid)?;
    let Some((version, version_from)) = detect_version(&object, mem, runtime, &maps) else {
        bail!(
            "cannot tell which CPython version {} is (no Py_Version symbol, no \
             _Py_DebugOffsets, no version in its name or its mapped files)",
            object.target_path
        );
    };
    Ok(Interpreter {
        object,
        runtime,
        version,
        version_from,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_in_paths_and_ranks() {
        let v = |p| version_in_path(p).map(|v| v.to_string());
        assert_eq!(
            v("/home/app/.pyenv/versions/3.9.18/lib/python3.9/lib-dynload/_heapq.cpython-39-x86_64-linux-gnu.so"),
            Some("3.9".into())
        );
        assert_eq!(v("/usr/bin/python3.12"), Some("3.12".into()));
        assert_eq!(v("/usr/lib/libc.so.6"), None);
        assert_eq!(rank("/usr/lib/libpython3.11.so.1.0", None), 0);
        assert_eq!(rank("/x/python3.13", None), 1);
        assert_eq!(rank("/x/ld.so", Some("/x/ld.so")), 1);
        assert_eq!(
            rank(
                "/usr/lib/python3.11/lib-dynload/_json.cpython-311-x86_64-linux-gnu.so",
                None
            ),
            9
        );
        assert_eq!(rank("/usr/lib/libc.so.6", None), 3);
    }
}
