//! `pyprobe report`: a JSON document (a stable interface) or a
//! text table.

mod json;
mod source_lines;
mod table;
mod terminal_safe;

#[cfg(test)]
mod tests;

pub use crate::analyze::report::{
    build_report, build_report_filtered, build_thread_report, exact_fraction, ReportOptions,
    SortKey,
};
pub use crate::output::units::format_ns;
pub use json::render_json;
pub use source_lines::render_lines;
pub use table::{render_table, render_table_paths};
