//! The report with every string the target chose escaped for a terminal (see
//! [`crate::output::terminal`]): the text table prints these.

use crate::analyze::{FunctionStats, Report};
use crate::output::terminal::escaped_string as esc;

fn function(f: &FunctionStats) -> FunctionStats {
    FunctionStats {
        function: esc(&f.function),
        qualname: esc(&f.qualname),
        file: esc(&f.file),
        ..f.clone()
    }
}

/// A copy of `r` whose names, paths, modules, events and command lines are
/// escaped.
pub(crate) fn escaped_report(r: &Report) -> Report {
    let mut r = r.clone();
    r.target.python = esc(&r.target.python);
    r.target.executable = esc(&r.target.executable);
    r.mode = esc(&r.mode);
    r.functions = r.functions.iter().map(function).collect();
    for g in &mut r.gc {
        for t in &mut g.triggers {
            t.function = esc(&t.function);
            t.file = esc(&t.file);
        }
    }
    for i in &mut r.imports {
        i.module = esc(&i.module);
        i.importer = i.importer.as_deref().map(esc);
    }
    for a in &mut r.audit {
        a.event = esc(&a.event);
        for s in &mut a.stacks {
            for f in &mut s.frames {
                *f = esc(f);
            }
        }
    }
    for p in &mut r.processes {
        p.command = esc(&p.command);
        p.functions = p.functions.iter().map(function).collect();
    }
    for c in &mut r.caveats {
        c.text = esc(&c.text);
    }
    for t in &mut r.return_types {
        t.file = esc(&t.file);
        t.function = esc(&t.function);
        for c in &mut t.returned {
            c.type_name = esc(&c.type_name);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::escaped_report;
    use crate::analyze::{FunctionStats, Report};

    #[test]
    fn every_row_is_escaped() {
        let row = FunctionStats {
            function: "f\x1b[2J".into(),
            qualname: "C.f\x1b[2J".into(),
            file: "/a\nb.py".into(),
            ..FunctionStats::default()
        };
        let r = Report {
            functions: vec![row],
            ..Report::default()
        };
        let e = escaped_report(&r);
        assert_eq!(e.functions[0].qualname, "C.f\\x1b[2J");
        assert_eq!(e.functions[0].file, "/a\\nb.py");
    }
}
