//! `pyprobe top`: the hottest Python functions, as one text snapshot or as a live
//! terminal view (ratatui + crossterm).
//!
//! The view knows nothing of where its numbers come from: the session's terminal
//! loop calls a data source (`FnMut() -> Snapshot`) once per refresh and
//! [`draw`]s each. [`snapshot_between`] turns two successive reports of a growing
//! recording into a snapshot of the window between them; a live sampler can
//! build [`Snapshot`]s directly.

mod draw;
mod snapshot;
mod text;
pub use draw::{draw, draw_on, handle_key, ViewState};
pub use snapshot::{snapshot_between, sort_rows, Snapshot, TopMode, TopRow, TopSort};
pub use text::render_text;

#[cfg(test)]
mod tests;
