//! On objects GCC builds from C here: a function with a branch it moves to a
//! `.cold` part, stripped (as Debian ships) and not.

use super::*;
use std::process::Command;

const SOURCE: &str = r#"
#include <stdio.h>
__attribute__((cold, noinline)) void report(int i) { fprintf(stderr, "bad %d\n", i); }
int hot(int n, int *v) {
    int s = 0;
    for (int i = 0; i < n; i++) {
        if (__builtin_expect(v[i] < 0, 0)) {
            report(i);
            fprintf(stderr, "value %d at %d\n", v[i], i);
            s -= v[i] * 3;
            continue;
        }
        s += v[i];
    }
    return s;
}
__attribute__((noinline)) int tail(int x) { return x * 2 + 1; }
int calls_tail(int x) { return tail(x + 3); }
"#;

/// The shared object GCC makes of [`SOURCE`] (`-s`: stripped to its dynamic
/// symbols).
fn build(stripped: bool) -> ObjectFile {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("cold.c");
    let so = dir.path().join("libcold.so");
    std::fs::write(&c, SOURCE).unwrap();
    let mut cc = Command::new("cc");
    cc.args([
        "-O2",
        "-fPIC",
        "-shared",
        "-fno-semantic-interposition",
        "-o",
    ])
    .arg(&so)
    .arg(&c);
    if stripped {
        cc.arg("-s");
    }
    let out = cc
        .output()
        .expect("cannot run cc (Debian's gcc; scripts/setup-test-machine.sh installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ObjectFile::parse(std::fs::read(&so).unwrap()).unwrap()
}

#[test]
fn a_stripped_cold_part_belongs_to_its_function() {
    let named = build(false);
    let cold = named
        .symbols
        .range_of("hot.cold")
        .expect("GCC made no hot.cold");
    let stripped = build(true);
    assert!(stripped.symbols.range_of("hot.cold").is_none());
    let hot = stripped.symbols.range_of("hot").unwrap();
    assert_eq!(function_parts(&stripped, "hot"), vec![hot, cold.clone()]);
    // Unstripped, the part has its local symbol: still the function's.
    let hot = named.symbols.range_of("hot").unwrap();
    assert_eq!(function_parts(&named, "hot"), vec![hot, cold]);
}

#[test]
fn a_tail_call_is_no_part_and_a_missing_function_has_none() {
    for object in [build(true), build(false)] {
        let caller = object.symbols.range_of("calls_tail").unwrap();
        // It jumps to tail(), another function.
        let tail = object.symbols.range_of("tail").unwrap();
        // Named as in the source, not by GCC's local alias at the same address.
        assert_eq!(object.symbols.lookup(tail.start).unwrap().0, "tail");
        assert_eq!(jumps_out(&object, &caller, |_| true), vec![tail.start]);
        assert_eq!(function_parts(&object, "calls_tail"), vec![caller]);
        assert!(function_parts(&object, "no_such_function").is_empty());
    }
}

#[test]
fn part_names_are_the_functions_cold_ones() {
    assert!(is_part_name("hot.cold", "hot"));
    assert!(is_part_name("hot.cold.1", "hot"));
    assert!(!is_part_name("hotter.cold", "hot"));
    assert!(!is_part_name("hot.part.0", "hot"));
    assert!(!is_part_name("other", "hot"));
}
