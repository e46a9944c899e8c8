//! `pyprobe flame`: flame graphs (SVG through `inferno`) and folded stacks.
//!
//! Also the naming shared by every view (`names`): frames are called
//! `function (file:line)`, with file paths shortened (standard-library and
//! site-packages prefixes stripped, else the last two path components) unless
//! full paths are asked for.

mod folded_stacks;
mod svg;
pub use crate::output::names::{short_command, short_path, FrameNames};
pub use folded_stacks::{
    choose_measure, collapsed_lines, is_sampled, read_folded, read_folded_by_thread,
    read_folded_filtered, write_collapsed, By, FrameGrain, ViewError, ViewInfo,
};
pub use svg::{default_title, subtitle, thousands, write_svg, SvgOptions};

#[cfg(test)]
mod tests;
