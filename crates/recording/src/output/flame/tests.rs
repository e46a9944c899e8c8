use super::svg::thousands;
use super::*;
use crate::analyze::folded::FoldFrame;
use crate::output::names::{origin, Origin};
use crate::recording::{FrameRef, Header, StrId};

#[test]
fn short_paths() {
    assert_eq!(
        short_path("/usr/lib/python3.9/json/__init__.py"),
        "json/__init__.py"
    );
    assert_eq!(
        short_path("/usr/lib/python3.9/threading.py"),
        "threading.py"
    );
    assert_eq!(
        short_path("/opt/py/.pythons/3.9/usr/lib/python3.9/os.py"),
        "os.py"
    );
    assert_eq!(
        short_path("/venv/lib/python3.11/site-packages/requests/api.py"),
        "requests/api.py"
    );
    assert_eq!(
        short_path("/usr/lib/python3/dist-packages/six.py"),
        "six.py"
    );
    assert_eq!(short_path("/srv/app/fixtures/demo.py"), "fixtures/demo.py");
    assert_eq!(short_path("app/demo.py"), "app/demo.py");
    assert_eq!(short_path("/demo.py"), "/demo.py");
    assert_eq!(short_path("demo.py"), "demo.py");
    assert_eq!(
        short_path("<frozen importlib._bootstrap>"),
        "<frozen importlib._bootstrap>"
    );
    // Not the standard library: a directory merely named python3.
    assert_eq!(short_path("/home/u/python3/x/y.py"), "x/y.py");
}

#[test]
fn origins() {
    assert_eq!(
        origin("/usr/lib/python3.9/json/__init__.py"),
        Origin::Stdlib
    );
    assert_eq!(origin("<frozen importlib._bootstrap>"), Origin::Stdlib);
    assert_eq!(
        origin("/v/lib/python3.9/site-packages/x.py"),
        Origin::ThirdParty
    );
    assert_eq!(origin("/app/main.py"), Origin::App);
}

#[test]
fn names_are_safe_for_folded_stacks() {
    let strings: Vec<String> = vec!["/a/b/c.py".into(), "f;g\nh".into(), String::new()];
    let names = FrameNames::new(&strings, false);
    let f = FoldFrame::Python(FrameRef {
        file: StrId(0),
        function: StrId(1),
        line: 3,
    });
    assert_eq!(names.fold_frame(&f), "f,g h (b/c.py:3)");
    let f = FoldFrame::Python(FrameRef {
        file: StrId(9),
        function: StrId(2),
        line: 1,
    });
    assert_eq!(names.fold_frame(&f), "? (<unknown #9>:1)");
    let full = FrameNames::new(&strings, true);
    assert_eq!(full.file(StrId(0)), "/a/b/c.py");
    assert_eq!(thousands(1234567), "1,234,567");
    assert_eq!(thousands(12), "12");
}

#[test]
fn commands_are_shown_by_their_programs_name() {
    assert_eq!(
        short_command("/usr/bin/python3.11 -m black src"),
        "python3.11 -m black src"
    );
    assert_eq!(short_command("python3 app.py"), "python3 app.py");
    assert_eq!(
        short_command(
            "/p/lib64/ld-linux-x86-64.so.2 --argv0 /p/bin/python3.13 --library-path /p/lib \
             /p/usr/bin/python3.13 -c work"
        ),
        "python3.13 -c work"
    );
    assert_eq!(
        short_command("/lib64/ld-linux-x86-64.so.2 /usr/bin/python3 x.py"),
        "python3 x.py"
    );
    assert_eq!(short_command(""), "");
    let strings: Vec<String> = vec!["/usr/bin/python3 -c pass".into()];
    let header = Header {
        command_line: vec!["/usr/bin/python3".into(), "app.py".into()],
        ..Header::default()
    };
    let names = FrameNames::new(&strings, false).with_header(&header);
    assert_eq!(names.process(7, None), "pid 7: python3 app.py");
    assert_eq!(names.process(8, Some(StrId(0))), "pid 8: python3 -c pass");
    assert_eq!(FrameNames::new(&strings, false).process(9, None), "pid 9");
}
