//! `--include` / `--exclude` glob filtering on source file names.

use globset::{Glob, GlobSet, GlobSetBuilder};

/// A glob that did not parse.
#[derive(Debug, thiserror::Error)]
#[error("bad glob {pattern:?}: {source}")]
pub struct FilterError {
    /// The offending glob (all of them when building the set failed).
    pub pattern: String,
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
    fn bad_glob_is_an_error() {
        let err = FileFilter::new(&["a[".to_string()], &[]).unwrap_err();
        assert!(err.to_string().contains("a["));
    }
}
