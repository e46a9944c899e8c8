//! Which CPython a process runs: from the `Py_Version` symbol (3.11+) read in the
//! target, else from the object's file name (`python3.9`, `libpython3.11.so.1.0`).

use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::process::objects::LoadedObject;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PyVersion {
    pub(crate) major: u8,
    pub(crate) minor: u8,
    /// Micro version when known (from `Py_Version`).
    pub(crate) micro: Option<u8>,
}

impl PyVersion {
    pub fn is(&self, major: u8, minor: u8) -> bool {
        self.major == major && self.minor == minor
    }

    pub fn at_least(&self, major: u8, minor: u8) -> bool {
        (self.major, self.minor) >= (major, minor)
    }
}

impl std::fmt::Display for PyVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.micro {
            Some(micro) => write!(f, "{}.{}.{micro}", self.major, self.minor),
            None => write!(f, "{}.{}", self.major, self.minor),
        }
    }
}

/// `Py_Version` is `PY_VERSION_HEX`: 0xMMmmuuRS.
pub(crate) fn from_hex(hex: u32) -> Option<PyVersion> {
    let major = (hex >> 24) as u8;
    let minor = (hex >> 16) as u8;
    let micro = (hex >> 8) as u8;
    (major == 3 && minor < 100).then_some(PyVersion {
        major,
        minor,
        micro: Some(micro),
    })
}

/// `python3.11`, `libpython3.11.so.1.0`, `python3.9d`: the first `pythonX.Y` in the name.
pub(crate) fn from_file_name(path: &str) -> Option<PyVersion> {
    let name = path.rsplit('/').next()?;
    let at = name.find("python")? + "python".len();
    let rest = &name[at..];
    let (major, rest) = rest.split_once('.')?;
    let minor: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some(PyVersion {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
        micro: None,
    })
}

/// The version of the interpreter in `object`, loaded in a live process.
pub fn detect(object: &LoadedObject, mem: &ProcessMemory) -> Option<PyVersion> {
    object
        .elf
        .py_version_symbol
        .and_then(|sym| {
            let mut b = [0u8; 4];
            mem.read(object.runtime(sym), &mut b).ok()?;
            from_hex(u32::from_le_bytes(b))
        })
        .or_else(|| from_file_name(&object.target_path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_hex_and_names() {
        assert_eq!(from_hex(0x030b02f0).unwrap().to_string(), "3.11.2");
        assert!(from_hex(0x02070000).is_none());
        assert_eq!(
            from_file_name("/usr/bin/python3.9").unwrap().to_string(),
            "3.9"
        );
        assert_eq!(
            from_file_name("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")
                .unwrap()
                .to_string(),
            "3.11"
        );
        assert_eq!(
            from_file_name("/opt/py/bin/python3.15d")
                .unwrap()
                .to_string(),
            "3.15"
        );
        assert!(from_file_name("/usr/bin/perl").is_none());
    }
}
