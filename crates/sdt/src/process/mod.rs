//! A live process seen through `/proc`: its mappings, the objects it has loaded,
//! its threads and status, its memory, and whether pyprobe may trace or read it.

pub mod access;
pub mod hold;
pub mod maps;
pub mod memory;
pub mod objects;
pub mod status;
pub mod task_looks;

pub use maps::{read_maps, MapEntry};
pub use objects::{find_probe_object, LoadedObject};
pub use status::ProcessStatus;

/// The page size of x86-64 Linux: the unit of every mapping pyprobe makes or
/// looks for in a target.
pub const PAGE_SIZE: u64 = 4096;
