//! Why the kernel refused to let pyprobe trace or read a process: it lives in
//! [`crate::process::access`], beside the checks; the engine's old paths stay.

pub use crate::process::access::{
    explain_refusal, read_error, seize_error, Access, Facts, Refused,
};
