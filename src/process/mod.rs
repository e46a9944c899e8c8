//! A live process seen through `/proc`: its mappings, the objects it has loaded,
//! its threads and status, and its memory.

pub mod maps;
pub mod memory;
pub mod objects;
pub mod status;

pub use maps::{read_maps, MapEntry};
pub use objects::{find_probe_object, LoadedObject};
pub use status::ProcessStatus;
