//! Joining a thread's native stack with its Python stack, as py-spy's `--native`
//! does: each call of the interpreter's eval loop is replaced by the Python frames
//! it runs, the interpreter's own C functions are left out, and every other native
//! frame (an extension, a library it calls) stays where it is.

use std::sync::Arc;

/// What a native frame is, for the join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NativeKind {
    /// A call of the eval loop (`_PyEval_EvalFrameDefault`): it runs Python frames.
    Eval,
    /// Any other function of the interpreter's object: left out.
    Interpreter,
    /// A function of another object: kept.
    Other {
        /// Its symbol, demangled; `object+0xOFFSET` when it has none.
        function: Arc<str>,
        /// The object file, as the target sees it.
        object: Arc<str>,
    },
}

/// How the Python frames divide between calls of the eval loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalCalls<'a> {
    /// CPython 3.7 – 3.10: one call per Python frame.
    OnePerFrame,
    /// How many Python frames each call runs, outermost first (3.11+, where the
    /// walker sees where each call begins).
    Sizes(&'a [usize]),
    /// 3.11+ without that: one call runs a Python frame and every Python function
    /// it calls; where a new call begins is not known here.
    Unknown,
}

/// One frame of a joined stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Joined<'a, P> {
    Python(&'a P),
    Native {
        function: Arc<str>,
        object: Arc<str>,
    },
    /// The unwind stopped before the calls of the Python frames above: native
    /// frames between them and the next frame may be missing.
    Gap,
}

/// Why a thread's stacks could not be joined (its Python stack is recorded alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotJoined {
    /// No eval-loop call was found: the unwind stopped before reaching one.
    NoEvalCall,
    /// Several eval-loop calls on a version where which Python frames each runs
    /// is not known.
    Ambiguous,
}

/// Joins `native` (innermost first, as unwound) with `python` (outermost first, as
/// walked), outermost first. Native frames outside the outermost eval call (the
/// interpreter's start-up, the C library's thread entry) are left out: they are
/// below every Python frame and the same in every sample. `complete`: the unwind
/// reached the stack's root; when it did not, its eval calls are the innermost ones,
/// and the Python frames they do not run come first.
pub fn join<'a, P>(
    native: &[NativeKind],
    python: &'a [P],
    calls: EvalCalls<'_>,
    complete: bool,
) -> Result<Vec<Joined<'a, P>>, NotJoined> {
    let evals = native.iter().filter(|k| **k == NativeKind::Eval).count();
    if evals == 0 {
        return stopped_before_any_call(native, python, complete);
    }
    // How many Python frames each eval call runs, outermost first.
    let ones;
    let all = [python.len()];
    let sizes: &[usize] = match calls {
        EvalCalls::Unknown if evals > 1 || !complete => return Err(NotJoined::Ambiguous),
        EvalCalls::Unknown => &all,
        EvalCalls::OnePerFrame => {
            ones = vec![1; python.len()];
            &ones
        }
        EvalCalls::Sizes(sizes) => sizes,
    };
    let (lead, take) = takes(sizes, evals, python.len(), complete);
    let mut joined: Vec<Joined<'a, P>> = python[..lead].iter().map(Joined::Python).collect();
    if lead > 0 {
        joined.push(Joined::Gap);
    }
    let mut next_python = lead;
    let mut take = take.into_iter();
    // Outside the outermost call: the start-up, left out; but an unwind cut short
    // did not reach it, and what it found there is inside some call not found.
    let outside = |k: &&NativeKind| complete && **k != NativeKind::Eval;
    for kind in native.iter().rev().skip_while(outside) {
        match kind {
            NativeKind::Eval => {
                let n = take.next().unwrap_or(0).min(python.len() - next_python);
                joined.extend(
                    python[next_python..next_python + n]
                        .iter()
                        .map(Joined::Python),
                );
                next_python += n;
            }
            NativeKind::Interpreter => {}
            NativeKind::Other { function, object } => joined.push(Joined::Native {
                function: function.clone(),
                object: object.clone(),
            }),
        }
    }
    Ok(joined)
}

/// An unwind with no eval call. Cut short inside native code it could not pass
/// (AVX-512 code that realigns the stack, a library without unwind tables), what
/// it found runs under the innermost Python frame, past a gap: its samples are
/// not that frame's own time. Complete, or with nothing but the interpreter's own
/// frames, there is nothing to join.
fn stopped_before_any_call<'a, P>(
    native: &[NativeKind],
    python: &'a [P],
    complete: bool,
) -> Result<Vec<Joined<'a, P>>, NotJoined> {
    let other = |kind: &NativeKind| match kind {
        NativeKind::Other { function, object } => Some(Joined::Native {
            function: function.clone(),
            object: object.clone(),
        }),
        _ => None,
    };
    if complete || !native.iter().any(|k| matches!(k, NativeKind::Other { .. })) {
        return Err(NotJoined::NoEvalCall);
    }
    let mut joined: Vec<Joined<'a, P>> = python.iter().map(Joined::Python).collect();
    joined.push(Joined::Gap);
    joined.extend(native.iter().rev().filter_map(other));
    Ok(joined)
}

/// How many Python frames come before the first eval call (`lead`) and how many
/// each of the `evals` calls runs, outermost first, for `python` frames divided
/// into calls as `sizes` says. A complete unwind pairs calls from the outermost,
/// the innermost taking what is left (a stack caught between a call and its
/// frames' push differs there); an unwind cut short found the innermost calls, so
/// it pairs from the innermost and the frames of the calls not found lead.
fn takes(sizes: &[usize], evals: usize, python: usize, complete: bool) -> (usize, Vec<usize>) {
    let groups = sizes.len();
    let mut take: Vec<usize>;
    let lead;
    if complete {
        lead = 0;
        take = (0..evals)
            .map(|i| sizes.get(i).copied().unwrap_or(0))
            .collect();
        let before_last: usize = take[..evals - 1].iter().sum();
        take[evals - 1] = python.saturating_sub(before_last);
    } else {
        let skipped = groups.saturating_sub(evals);
        lead = sizes[..skipped].iter().sum::<usize>().min(python);
        take = (0..evals)
            .map(|i| {
                (groups + i)
                    .checked_sub(evals)
                    .and_then(|g| sizes.get(g))
                    .copied()
                    .unwrap_or(0)
            })
            .collect();
    }
    (lead, take)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn other(name: &str) -> NativeKind {
        NativeKind::Other {
            function: name.into(),
            object: "/lib/libx.so".into(),
        }
    }

    fn names(joined: &[Joined<'_, &str>]) -> Vec<String> {
        joined
            .iter()
            .map(|j| match j {
                Joined::Python(p) => format!("py:{p}"),
                Joined::Native { function, .. } => format!("c:{function}"),
                Joined::Gap => "gap".into(),
            })
            .collect()
    }

    #[test]
    fn each_eval_call_becomes_its_python_frame_and_extensions_stay_between() {
        use NativeKind::*;
        // Innermost first: a leaf in C called back into Python from an extension.
        let native = [
            other("clock_nanosleep"),
            Interpreter, // the builtin's C implementation
            Eval,        // py_leaf
            Interpreter, // _PyFunction_Vectorcall
            other("native_inner"),
            other("native_outer"),
            Interpreter,
            Eval, // call_native
            Eval, // <module>
            Interpreter,
            other("__libc_start_main"),
        ];
        let python = ["<module>", "call_native", "py_leaf"];
        let joined = join(&native, &python, EvalCalls::OnePerFrame, true).unwrap();
        assert_eq!(
            names(&joined),
            [
                "py:<module>",
                "py:call_native",
                "c:native_outer",
                "c:native_inner",
                "py:py_leaf",
                "c:clock_nanosleep"
            ]
        );
    }

    #[test]
    fn a_call_not_yet_running_its_frame_takes_none_and_extra_frames_go_innermost() {
        use NativeKind::*;
        let python = ["a", "b"];
        let native = [Eval, other("x"), Eval, Eval];
        let joined = join(&native, &python, EvalCalls::OnePerFrame, true).unwrap();
        assert_eq!(names(&joined), ["py:a", "py:b", "c:x"]);
        let native = [Eval];
        let joined = join(&native, &python, EvalCalls::OnePerFrame, true).unwrap();
        assert_eq!(names(&joined), ["py:a", "py:b"]);
    }

    #[test]
    fn without_eval_calls_or_with_several_of_unknown_extent_nothing_is_joined() {
        use NativeKind::*;
        let python = ["a", "b"];
        assert_eq!(
            join(
                &[other("x"), Interpreter],
                &python,
                EvalCalls::OnePerFrame,
                true
            ),
            Err(NotJoined::NoEvalCall)
        );
        assert_eq!(
            join(&[Eval, other("x"), Eval], &python, EvalCalls::Unknown, true),
            Err(NotJoined::Ambiguous)
        );
        let joined = join(
            &[other("y"), Eval, Interpreter],
            &python,
            EvalCalls::Unknown,
            true,
        )
        .unwrap();
        assert_eq!(names(&joined), ["py:a", "py:b", "c:y"]);
        // One call, but the unwind stopped: it may be the innermost of several.
        assert_eq!(
            join(&[other("y"), Eval], &python, EvalCalls::Unknown, false),
            Err(NotJoined::Ambiguous)
        );
    }

    #[test]
    fn on_3_12_each_call_runs_the_frames_its_entry_shim_says() {
        use NativeKind::*;
        // main -> call_native (one call), C, then py_leaf -> helper (another call).
        let python = ["main", "call_native", "py_leaf", "helper"];
        let native = [Eval, other("native_inner"), Interpreter, Eval, Interpreter];
        let joined = join(&native, &python, EvalCalls::Sizes(&[2, 2]), true).unwrap();
        assert_eq!(
            names(&joined),
            [
                "py:main",
                "py:call_native",
                "c:native_inner",
                "py:py_leaf",
                "py:helper"
            ]
        );
        // Cut short below the C frame: the first call's frames lead.
        let native = [Eval, other("native_inner")];
        let joined = join(&native, &python, EvalCalls::Sizes(&[2, 2]), false).unwrap();
        assert_eq!(
            names(&joined),
            [
                "py:main",
                "py:call_native",
                "gap",
                "c:native_inner",
                "py:py_leaf",
                "py:helper"
            ]
        );
        // A call just entered (its shim pushed, no frame yet) runs none.
        let native = [Eval, other("x"), Eval];
        let joined = join(&native, &python[..2], EvalCalls::Sizes(&[2, 0]), true).unwrap();
        assert_eq!(names(&joined), ["py:main", "py:call_native", "c:x"]);
    }

    #[test]
    fn an_unwind_stopped_before_any_call_hangs_its_frames_under_the_innermost_past_a_gap() {
        use NativeKind::*;
        let python = ["a", "sort"];
        // numpy's sort, then AVX-512 code the unwinder could not pass.
        let native = [other("avx512_qsort"), other("npy_quicksort")];
        let joined = join(&native, &python, EvalCalls::OnePerFrame, false).unwrap();
        assert_eq!(
            names(&joined),
            [
                "py:a",
                "py:sort",
                "gap",
                "c:npy_quicksort",
                "c:avx512_qsort"
            ]
        );
        // Only the interpreter's own frames found: nothing to hang there.
        assert_eq!(
            join(&[Interpreter], &python, EvalCalls::Unknown, false),
            Err(NotJoined::NoEvalCall)
        );
    }

    #[test]
    fn an_unwind_cut_short_joins_its_calls_with_the_innermost_python_frames() {
        use NativeKind::*;
        let python = ["a", "b", "c"];
        // Only c's and b's calls were reached, with an extension between them.
        let native = [other("leaf"), Eval, other("ext"), Eval, Interpreter];
        let joined = join(&native, &python, EvalCalls::OnePerFrame, false).unwrap();
        assert_eq!(
            names(&joined),
            ["py:a", "gap", "py:b", "c:ext", "py:c", "c:leaf"]
        );
    }
}
