//! `--include` / `--exclude` glob filtering on source file names, and the
//! `--min-duration` of the trace exports.

use globset::{Glob, GlobSet, GlobSetBuilder};

/// A glob that did not parse.
#[derive(Debug, thiserror::Error)]
#[error("bad glob {pattern:?}: {source}")]
pub struct FilterError {
    /// The offending glob (all of them when building the set failed).
    pub(crate) pattern: String,
    /// Why it did not parse.
    #[source]
    pub source: globset::Error,
}

/// Keeps files matching any include glob (all files when there is none) and no
/// exclude glob. A glob matches the full path or the base name, so both
/// `*/app/*` and `fib.py` work.
#[derive(Debug, Clone, Default)]
pub struct FileFilter {
    include: Option<GlobSet>,
    exclude: Option<GlobSet>,
}

impl FileFilter {
    /// Builds the filter from the command line's globs.
    pub fn new(include: &[String], exclude: &[String]) -> Result<Self, FilterError> {
        Ok(FileFilter {
            include: build(include)?,
            exclude: build(exclude)?,
        })
    }

    /// Whether the filter keeps everything.
    pub fn is_empty(&self) -> bool {
        self.include.is_none() && self.exclude.is_none()
    }

    /// Whether `file` passes.
    pub fn matches(&self, file: &str) -> bool {
        let base = file.rsplit('/').next().unwrap_or(file);
        let hit = |set: &GlobSet| set.is_match(file) || set.is_match(base);
        let included = match &self.include {
            Some(set) => hit(set),
            None => true,
        };
        included && !self.exclude.as_ref().is_some_and(hit)
    }
}

/// What the trace exports (`flame --format chrome|speedscope`) keep: functions
/// whose file passes `files`, and calls (slices) lasting at least
/// `min_duration_ns`. GC pauses and imports are slices too and go by duration;
/// instants (audit events, lost events) always stay.
#[derive(Debug, Clone, Default)]
pub struct SliceFilter {
    pub files: FileFilter,
    pub min_duration_ns: u64,
}

impl SliceFilter {
    /// Whether the filter keeps everything.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.min_duration_ns == 0
    }

    /// Whether a slice lasting `ns` is long enough.
    pub(crate) fn long_enough(&self, ns: u64) -> bool {
        ns >= self.min_duration_ns
    }
}

/// Parses a duration with its unit: `200ns`, `50us` (or `50µs`), `1.5ms`, `2s`.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "" => {
            return Err(format!(
                "`{text}` has no unit: write it as 200ns, 50us, 1ms or 2s"
            ))
        }
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}`: use ns, us, ms or s"
            ))
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration such as 200ns, 50us, 1ms or 2s"))?;
    let ns = value * scale;
    if !ns.is_finite() || ns > u64::MAX as f64 {
        return Err(format!("`{text}` is too long a duration"));
    }
    Ok(ns.round() as u64)
}

fn build(patterns: &[String]) -> Result<Option<GlobSet>, FilterError> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        let glob = Glob::new(p).map_err(|source| FilterError {
            pattern: p.clone(),
            source,
        })?;
        b.add(glob);
    }
    b.build().map(Some).map_err(|source| FilterError {
        pattern: patterns.join(","),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(inc: &[&str], exc: &[&str]) -> FileFilter {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        FileFilter::new(&v(inc), &v(exc)).unwrap()
    }

    #[test]
    fn include_and_exclude() {
        assert!(f(&[], &[]).matches("/x.py"));
        assert!(f(&[], &[]).is_empty());
        let app = f(&["/app/*"], &["*test*"]);
        assert!(app.matches("/app/fib.py"));
        assert!(app.matches("/app/sub/deep.py"));
        assert!(!app.matches("/usr/lib/python3.9/json/__init__.py"));
        assert!(!app.matches("/app/test_fib.py"));
        assert!(f(&["fib.py"], &[]).matches("/app/fib.py"));
        assert!(!f(&[], &["<frozen*"]).matches("<frozen importlib._bootstrap>"));
    }

    #[test]
    fn durations_need_a_unit() {
        assert_eq!(parse_duration("50us"), Ok(50_000));
        assert_eq!(parse_duration("50µs"), Ok(50_000));
        assert_eq!(parse_duration("1ms"), Ok(1_000_000));
        assert_eq!(parse_duration("1.5ms"), Ok(1_500_000));
        assert_eq!(parse_duration("2s"), Ok(2_000_000_000));
        assert_eq!(parse_duration("200ns"), Ok(200));
        assert_eq!(parse_duration("0us"), Ok(0));
        assert!(parse_duration("50").unwrap_err().contains("no unit"));
        assert!(parse_duration("5m").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("1.2.3ms").is_err());
        assert!(parse_duration("-1ms").is_err());
    }

    #[test]
    fn bad_glob_is_an_error() {
        let err = FileFilter::new(&["a[".to_string()], &[]).unwrap_err();
        assert!(err.to_string().contains("a["));
    }
}
