//! CPython's SDT probes (provider `python`): names, argument meanings, groups.
//!
//! From CPython's `Include/pydtrace.d`; see the "Instrumenting CPython with DTrace
//! and SystemTap" how-to.

use serde::Serialize;

pub const PROVIDER: &str = "python";

/// How an argument is to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgKind {
    /// A pointer to a NUL-terminated UTF-8 string in the target.
    String,
    /// An integer, taken as is.
    Integer,
    /// A pointer pyprobe does not follow.
    Pointer,
}

/// Probe groups, as chosen with `record --probes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeGroup {
    Function,
    Line,
    Gc,
    Import,
    Audit,
}

impl ProbeGroup {
    pub(crate) const ALL: [ProbeGroup; 5] = [
        ProbeGroup::Function,
        ProbeGroup::Gc,
        ProbeGroup::Import,
        ProbeGroup::Audit,
        ProbeGroup::Line,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ProbeGroup::Function => "function",
            ProbeGroup::Line => "line",
            ProbeGroup::Gc => "gc",
            ProbeGroup::Import => "import",
            ProbeGroup::Audit => "audit",
        }
    }

    pub fn parse(name: &str) -> Option<ProbeGroup> {
        ProbeGroup::ALL.into_iter().find(|g| g.name() == name)
    }
}

/// Which probe it is, for code that runs at every hit (an enum compares in one
/// instruction; the names compare byte by byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeKind {
    /// An entry that may be a call or a resume: the probe does not tell.
    FunctionEntry,
    /// An entry whose site passes the frame's last instruction too (see
    /// [`ENTRY_WITH_LASTI`]): -1, a call; else a resume.
    FunctionEntryWithLasti,
    /// A generator or coroutine entered again (the hook engine's resumes).
    FunctionResume,
    FunctionReturn,
    Line,
    GcStart,
    GcDone,
    ImportStart,
    ImportDone,
    Audit,
}

impl ProbeKind {
    /// Probes at whose hits the Python stack says what caused them: what
    /// triggered a GC, an import or an audit event.
    pub fn has_context(self) -> bool {
        matches!(
            self,
            ProbeKind::GcStart | ProbeKind::ImportStart | ProbeKind::Audit
        )
    }

    /// Probes that open a pause (a collection, an import) closed by another.
    pub fn opens_pause(self) -> bool {
        matches!(self, ProbeKind::GcStart | ProbeKind::ImportStart)
    }
}

/// One known CPython probe.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PythonProbe {
    pub name: &'static str,
    pub kind: ProbeKind,
    pub(crate) group: ProbeGroup,
    pub args: &'static [(&'static str, ArgKind)],
}

use ArgKind::{Integer, Pointer, String as Str};

pub const PROBES: &[PythonProbe] = &[
    PythonProbe {
        name: "function__entry",
        kind: ProbeKind::FunctionEntry,
        group: ProbeGroup::Function,
        args: &[("filename", Str), ("funcname", Str), ("lineno", Integer)],
    },
    // Not a CPython probe: the name the hook engine gives the entries that
    // resume a generator or coroutine (sys.monitoring's PY_RESUME and PY_THROW,
    // a profile function's call into a frame that ran before).
    PythonProbe {
        name: "function__resume",
        kind: ProbeKind::FunctionResume,
        group: ProbeGroup::Function,
        args: &[("filename", Str), ("funcname", Str), ("lineno", Integer)],
    },
    PythonProbe {
        name: "function__return",
        kind: ProbeKind::FunctionReturn,
        group: ProbeGroup::Function,
        args: &[("filename", Str), ("funcname", Str), ("lineno", Integer)],
    },
    PythonProbe {
        name: "line",
        kind: ProbeKind::Line,
        group: ProbeGroup::Line,
        args: &[("filename", Str), ("funcname", Str), ("lineno", Integer)],
    },
    PythonProbe {
        name: "gc__start",
        kind: ProbeKind::GcStart,
        group: ProbeGroup::Gc,
        args: &[("generation", Integer)],
    },
    PythonProbe {
        name: "gc__done",
        kind: ProbeKind::GcDone,
        group: ProbeGroup::Gc,
        args: &[("collected", Integer)],
    },
    PythonProbe {
        name: "import__find__load__start",
        kind: ProbeKind::ImportStart,
        group: ProbeGroup::Import,
        args: &[("modulename", Str)],
    },
    PythonProbe {
        name: "import__find__load__done",
        kind: ProbeKind::ImportDone,
        group: ProbeGroup::Import,
        args: &[("modulename", Str), ("found", Integer)],
    },
    PythonProbe {
        name: "audit",
        kind: ProbeKind::Audit,
        group: ProbeGroup::Audit,
        args: &[("event", Str), ("args", Pointer)],
    },
];

/// `function__entry` at a site that also passes the frame's `f_lasti` (CPython 3.7 to
/// 3.9, whose entry computes its line from it; see
/// [`tracing::probe_set`](crate::python::tracing::probe_set)): -1 before the frame
/// first ran, so the entry is a call; else the generator or coroutine resumes.
pub static ENTRY_WITH_LASTI: PythonProbe = PythonProbe {
    name: "function__entry",
    kind: ProbeKind::FunctionEntryWithLasti,
    group: ProbeGroup::Function,
    args: &[
        ("filename", Str),
        ("funcname", Str),
        ("lineno", Integer),
        ("lasti", Integer),
    ],
};

/// Where [`ENTRY_WITH_LASTI`] passes the frame's last instruction.
pub const LASTI_ARG: usize = 3;

/// The meaning of a `python` probe, if pyprobe knows it.
pub fn lookup(name: &str) -> Option<&'static PythonProbe> {
    PROBES.iter().find(|p| p.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_group_has_a_probe_and_parses_back() {
        for g in ProbeGroup::ALL {
            assert!(PROBES.iter().any(|p| p.group == g));
            assert_eq!(ProbeGroup::parse(g.name()), Some(g));
        }
        assert_eq!(lookup("gc__done").map(|p| p.args.len()), Some(1));
        assert!(lookup("nope").is_none());
    }
}
