use super::SourceScopes;

const SOURCE: &str = r#"import os

class Outer:
    """A class.

    def not_this(self):  (inside a docstring)
    """

    def method(self):
        return [x for x in range(3)]

    @staticmethod
    @other(
        "arg",
    )
    def decorated():
        pass

    class Inner:
        async def deep(self, a=(
            1,
        )):
            yield a
            if a:
                yield 2

def top(x):
    def helper(y):  # a comment ( not a bracket
        s = "a string with a (bracket"
        return lambda: y
    if x:
        def conditional():
            pass
    return helper

	# a tab-indented comment
key = lambda v: v
"#;

fn q(name: &str, line: u32) -> Option<(String, u32)> {
    SourceScopes::parse(SOURCE).qualname(name, line)
}

#[test]
fn methods_are_named_by_their_class() {
    assert_eq!(q("method", 9), Some(("Outer.method".into(), 9)));
    assert_eq!(q("deep", 20), Some(("Outer.Inner.deep".into(), 20)));
}

#[test]
fn a_decorated_function_is_found_from_its_first_decorator() {
    assert_eq!(q("decorated", 12), Some(("Outer.decorated".into(), 12)));
    assert_eq!(q("decorated", 16), Some(("Outer.decorated".into(), 12)));
}

#[test]
fn nested_functions_name_their_locals() {
    assert_eq!(q("helper", 28), Some(("top.<locals>.helper".into(), 28)));
    assert_eq!(
        q("conditional", 32),
        Some(("top.<locals>.conditional".into(), 32))
    );
    assert_eq!(
        q("<lambda>", 30),
        Some(("top.<locals>.helper.<locals>.<lambda>".into(), 30))
    );
    assert_eq!(
        q("<listcomp>", 10),
        Some(("Outer.method.<locals>.<listcomp>".into(), 10))
    );
}

#[test]
fn a_generator_resumed_inside_its_body_is_still_named() {
    assert_eq!(q("deep", 23), Some(("Outer.Inner.deep".into(), 20)));
    assert_eq!(q("deep", 25), Some(("Outer.Inner.deep".into(), 20)));
}

#[test]
fn module_level_names_and_mismatches_give_nothing() {
    // Already the bare name.
    assert_eq!(q("top", 27), None);
    assert_eq!(q("<lambda>", 38), None);
    assert_eq!(q("<module>", 1), None);
    // The line holds another function (the file changed): no guess.
    assert_eq!(q("method", 27), None);
    assert_eq!(q("not_this", 6), None);
    // Out of the file.
    assert_eq!(q("method", 0), None);
    assert_eq!(q("method", 10_000), None);
    // A probe passing no line (-1 as an unsigned line) costs no scan.
    assert_eq!(q("method", u32::MAX), None);
}

#[test]
fn hostile_text_does_not_panic() {
    for text in [
        "",
        "\\",
        "'''",
        "def",
        "class  :",
        "@\n@\n@",
        "(((\n)))))",
        "\t\t\tdef é(): pass",
    ] {
        let s = SourceScopes::parse(text);
        for line in 0..5 {
            let _ = s.qualname("é", line);
            let _ = s.qualname("<lambda>", line);
        }
    }
}
