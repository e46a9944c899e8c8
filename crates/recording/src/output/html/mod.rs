//! `pyprobe report --format html`: one self-contained page (nothing fetched
//! when it is viewed) with an interactive flame graph (zoom, search by name or
//! `file:line`, inverted, by thread or process), the hot spots, GC pauses,
//! imports, audit events, return types and a per-line heatmap of the hottest
//! files. The page's script and style are this module's own files, embedded
//! at build time; the data is one JSON document in the page.

mod data;

use std::io::{self, Write};

pub use data::{SourceFile, MAX_NODES};

use crate::analyze::folded::{Folded, Measure};
use crate::output::names::FrameNames;
use data::PageData;

const TEMPLATE: &str = include_str!("page.html");
const STYLE: &str = include_str!("page.css");
const SCRIPT: &str = include_str!("page.js");

/// What the page shows besides its stack tree.
pub struct HtmlPage<'a> {
    /// Its title (the target's command line).
    pub title: &'a str,
    /// Under the title: mode, duration, what the width means.
    pub subtitle: &'a str,
    /// The report's JSON document, as `report --format json` writes it.
    pub report_json: &'a str,
    /// The sampling interval (0 when traced).
    pub sample_interval_ns: u64,
    /// The hottest files' source and per-line counts.
    pub sources: &'a [SourceFile],
}

/// HTML text with `&`, `<`, `>` and quotes escaped.
fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// JSON safe inside a `<script>` element: `<` only ever appears inside JSON
/// strings, where `\u003c` means the same, so no `</script>` or `<!--` from a
/// hostile name can end the element.
fn script_safe_json(json: &str) -> String {
    json.replace('<', "\\u003c")
}

/// Writes the page for `folded` (stacks kept apart by thread, see
/// [`read_folded_by_thread`](crate::output::flame::read_folded_by_thread)),
/// its frames' widths in `measure`.
pub fn write_html<W: Write>(
    folded: &Folded,
    measure: Measure,
    names: &FrameNames<'_>,
    page: &HtmlPage<'_>,
    mut out: W,
) -> io::Result<()> {
    let report: serde_json::Value = serde_json::from_str(page.report_json)
        .map_err(|e| io::Error::other(format!("the report's JSON does not parse: {e}")))?;
    let data = PageData::new(page, folded, measure, names, report);
    let json = serde_json::to_string(&data).map_err(io::Error::other)?;
    let (head, tail) = TEMPLATE
        .split_once("{{DATA}}")
        .ok_or_else(|| io::Error::other("the page template has no data slot"))?;
    // The title goes in last, so no text of it is taken for a slot.
    let head = head
        .replace("{{STYLE}}", STYLE)
        .replace("{{TITLE}}", &escape_html(page.title));
    let tail = tail.replace("{{SCRIPT}}", SCRIPT);
    out.write_all(head.as_bytes())?;
    out.write_all(script_safe_json(&json).as_bytes())?;
    out.write_all(tail.as_bytes())?;
    out.flush()
}

#[cfg(test)]
mod tests;
