//! `pyprobe report --lines FILE`: the source of FILE, each line with what the
//! recording saw on it.

use crate::analyze::line_counts::LineCount;
use crate::output::terminal::{escaped, escaped_source_line};
use crate::output::units::format_ns;

/// The annotated source: a header naming what was counted, then one row per
/// line of `source` (or, when it could not be read, per line with counts):
/// own samples, total samples, own time (own × `interval_ns`) and line hits,
/// blank where zero. Lines counted beyond the end of `source` follow, marked.
pub fn render_lines(
    title: &str,
    counts: &[(u32, LineCount)],
    source: Option<&[String]>,
    interval_ns: u64,
) -> String {
    let own: u64 = counts.iter().map(|(_, c)| c.own).sum();
    let hits: u64 = counts.iter().map(|(_, c)| c.hits).sum();
    let mut out = format!(
        "{}: {own} samples with their innermost frame here{}, {hits} line hits\n",
        escaped(title),
        if interval_ns > 0 {
            format!(" ({})", format_ns(own.saturating_mul(interval_ns)))
        } else {
            String::new()
        }
    );
    out.push_str(&format!(
        "{:>6} {:>7} {:>7} {:>9} {:>9}  source\n",
        "line", "own", "total", "time", "hits"
    ));
    let blank = |v: u64| if v == 0 { String::new() } else { v.to_string() };
    let row = |out: &mut String, line: u32, c: LineCount, text: &str| {
        let time = if c.own > 0 && interval_ns > 0 {
            format_ns(c.own.saturating_mul(interval_ns))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{line:>6} {:>7} {:>7} {time:>9} {:>9}  {}\n",
            blank(c.own),
            blank(c.total),
            blank(c.hits),
            escaped_source_line(text),
        ));
    };
    let count_of = |line: u32| {
        counts
            .binary_search_by_key(&line, |&(l, _)| l)
            .map_or(LineCount::default(), |i| counts[i].1)
    };
    let shown = source.map_or(0, |s| s.len());
    if let Some(source) = source {
        for (i, text) in source.iter().enumerate() {
            let line = i as u32 + 1;
            row(&mut out, line, count_of(line), text.trim_end());
        }
    }
    for &(line, c) in counts {
        if line as usize > shown {
            let text = if source.is_some() {
                "(past the end of the file: it changed since, or is another file)"
            } else {
                ""
            };
            row(&mut out, line, c, text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_of_the_source_is_shown_with_its_counts() {
        let counts = [
            (
                2,
                LineCount {
                    own: 3,
                    total: 4,
                    hits: 0,
                },
            ),
            (
                9,
                LineCount {
                    own: 1,
                    total: 1,
                    hits: 2,
                },
            ),
        ];
        let source: Vec<String> = ["def f():", "    x = 1  ", "    return x"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let text = render_lines("app.py", &counts, Some(&source), 10_000_000);
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(
            rows[0],
            "app.py: 4 samples with their innermost frame here (40.0 ms), 2 line hits"
        );
        assert_eq!(
            rows[3],
            "     2       3       4   30.0 ms                x = 1"
        );
        assert_eq!(rows[2], format!("     1{}  def f():", " ".repeat(36)));
        assert!(rows[5].starts_with("     9       1       1   10.0 ms         2  (past the end"));
        assert_eq!(rows.len(), 6);
        // Without the source: only the lines counted.
        let bare = render_lines("app.py", &counts, None, 0);
        assert_eq!(bare.lines().count(), 4);
        assert!(bare
            .lines()
            .nth(2)
            .unwrap()
            .starts_with("     2       3       4"));
    }
}
