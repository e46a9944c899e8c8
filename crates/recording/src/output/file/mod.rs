//! Every file written at a name the user gave (`-o OUT`) goes through here.
//!
//! pyprobe never removes or truncates anything it did not create in that run: the
//! output is written to a new file beside OUT and renamed over OUT only once it is
//! complete. A run that fails leaves OUT as it was. An existing OUT is replaced
//! only when the user said so (`--force`, [`Existing::Replace`]); otherwise it is
//! refused before anything starts, and a file that appears at OUT while pyprobe
//! writes is not replaced either. Only regular files are replaced; a FIFO the
//! user named is written straight into; anything else (a device, a directory, a
//! socket) is refused.
//!
//! Outputs hold another process's function names and paths: mode 0600.

mod check;
mod output;
pub use check::{
    check, check_recording, first_free, is_taken, numbered, partial_path, Destination, Existing,
    Stdout,
};
pub use output::Output;

#[cfg(test)]
mod tests;
