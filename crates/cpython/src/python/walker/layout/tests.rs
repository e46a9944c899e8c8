//! The layout from the embedded offsets files, and from forged `_Py_DebugOffsets`.

use std::collections::BTreeMap;

use super::debug_offsets::{debug_minor, parse_debug_offsets, DebugFile};
use super::*;

fn v(minor: u8) -> PyVersion {
    PyVersion {
        major: 3,
        minor,
        micro: None,
    }
}

#[test]
fn every_embedded_file_parses() {
    for minor in 7..=12 {
        let (layout, source) = from_offsets_file(v(minor)).unwrap();
        assert!(source.to_string().contains(&format!("3.{minor}.json")));
        assert_eq!(layout.code_qualname.is_some(), minor >= 11);
        assert_eq!(layout.tstate_native_thread_id.is_some(), minor >= 11);
        match layout.gil {
            Some(GilLayout::RuntimeCurrent { tstate_current }) => {
                assert!(minor <= 11 && tstate_current > 0)
            }
            Some(GilLayout::Interpreter {
                last_holder,
                locked,
                ..
            }) => assert!(minor == 12 && last_holder != locked),
            None => panic!("3.{minor}: no GIL offsets"),
        }
        let locals = layout.locals.expect("locals' offsets");
        assert_eq!(
            matches!(locals.names, LocalNames::LocalsPlus { .. }),
            minor >= 11,
            "3.{minor}"
        );
        assert_eq!(locals.long_tagged, minor >= 12, "3.{minor}");
        assert_eq!((locals.object_head, locals.tuple_items), (16, 24));
    }
    for minor in 13..=15 {
        assert!(debug_offsets_size(v(minor)).unwrap() > 100);
        assert!(from_offsets_file(v(minor)).is_err());
    }
    assert_eq!(known_minors("debug_offsets"), vec![13, 14, 15]);
    assert!(from_offsets_file(v(6)).is_err());
    assert!(from_offsets_file(v(16)).is_err());
    // A newer target tries the newest known _Py_DebugOffsets layout.
    assert_eq!(debug_minor(v(16)).unwrap(), (15, true));
}

/// A synthetic `_Py_DebugOffsets` block for the 3.13 positions file.
fn block_313(edit: impl Fn(&mut BTreeMap<&str, u64>)) -> Vec<u8> {
    let f: DebugFile = serde_json::from_str(file_text(13).unwrap()).unwrap();
    let mut values: BTreeMap<&str, u64> = BTreeMap::new();
    for (k, val) in [
        ("version", 0x030d05f0),
        ("free_threaded", 0),
        ("runtime_state.size", 100_000),
        ("runtime_state.interpreters_head", 632),
        ("interpreter_state.size", 200_000),
        ("interpreter_state.next", 8),
        ("interpreter_state.threads_head", 7000),
        ("interpreter_state.ceval_gil", 7100),
        ("interpreter_state.gil_runtime_state", 7200),
        ("interpreter_state.gil_runtime_state_locked", 7216),
        ("interpreter_state.gil_runtime_state_holder", 7208),
        ("thread_state.size", 400),
        ("thread_state.next", 8),
        ("thread_state.interp", 16),
        ("thread_state.current_frame", 72),
        ("thread_state.thread_id", 144),
        ("thread_state.native_thread_id", 152),
        ("interpreter_frame.size", 80),
        ("interpreter_frame.previous", 8),
        ("interpreter_frame.executable", 0),
        ("interpreter_frame.instr_ptr", 56),
        ("interpreter_frame.owner", 70),
        ("code_object.size", 208),
        ("code_object.filename", 112),
        ("code_object.name", 120),
        ("code_object.qualname", 128),
        ("code_object.linetable", 136),
        ("code_object.firstlineno", 68),
        ("code_object.co_code_adaptive", 200),
        ("pyobject.size", 16),
        ("pyobject.ob_type", 8),
        ("bytes_object.size", 40),
        ("bytes_object.ob_size", 16),
        ("bytes_object.ob_sval", 32),
        ("unicode_object.size", 56),
        ("unicode_object.state", 32),
        ("unicode_object.length", 16),
        ("unicode_object.asciiobject_size", 40),
        ("interpreter_frame.localsplus", 72),
        ("code_object.localsplusnames", 96),
        ("code_object.localspluskinds", 104),
        ("tuple_object.ob_item", 24),
    ] {
        values.insert(k, val);
    }
    edit(&mut values);
    let mut block = vec![0u8; f.debug_offsets["size"] as usize];
    block[..8].copy_from_slice(DEBUG_COOKIE);
    for (k, val) in values {
        let at = f.debug_offsets[k] as usize;
        block[at..at + 8].copy_from_slice(&val.to_le_bytes());
    }
    block
}

fn parse_313(block: &[u8]) -> Result<Layout> {
    let f: DebugFile = serde_json::from_str(file_text(13).unwrap()).unwrap();
    parse_debug_offsets(block, &f, 13, v(13), false).map(|(l, _)| l)
}

#[test]
fn locals_offsets_are_optional_and_checked() {
    let layout = parse_313(&block_313(|_| {})).unwrap();
    let locals = layout.locals.expect("locals");
    assert_eq!(locals.frame_localsplus, 72);
    assert_eq!(
        locals.names,
        LocalNames::LocalsPlus {
            names: 96,
            kinds: 104
        }
    );
    // Implausible or outside their structure: no locals, the stacks still read.
    for (field, value) in [
        ("tuple_object.ob_item", 1 << 20),
        ("interpreter_frame.localsplus", 80),
        ("code_object.localsplusnames", 5000),
    ] {
        let layout = parse_313(&block_313(|m| {
            m.insert(field, value);
        }))
        .unwrap();
        assert_eq!(layout.locals, None, "{field} = {value}");
    }
}

#[test]
fn debug_offsets_are_read_and_checked() {
    let layout = parse_313(&block_313(|_| {})).unwrap();
    assert_eq!(layout.runtime_interpreters_head, 632);
    assert_eq!(layout.tstate_frame, FrameRoot::Direct(72));
    assert_eq!(layout.tstate_native_thread_id, Some(152));
    assert_eq!(layout.code_adaptive, Some(200));
    assert_eq!(layout.unicode.ascii_size, 40);
    assert_eq!(
        layout.gil,
        Some(GilLayout::Interpreter {
            ceval_gil: 7100,
            last_holder: 8,
            locked: 16
        })
    );
    // GIL offsets that make no sense leave the GIL state unknown, the rest usable.
    for (field, value) in [
        ("interpreter_state.gil_runtime_state_locked", 7100),
        ("interpreter_state.gil_runtime_state_holder", 1 << 30),
        ("interpreter_state.ceval_gil", 300_000),
    ] {
        let layout = parse_313(&block_313(|m| {
            m.insert(field, value);
        }))
        .unwrap();
        assert_eq!(layout.gil, None, "{field} = {value}");
    }
    let free_threaded = parse_313(&block_313(|m| {
        m.insert("free_threaded", 1);
    }))
    .unwrap();
    assert_eq!(free_threaded.gil, None);
    // 3.13t has no per-thread bytecode to say so: the hook refuses it from this.
    assert!(free_threaded.free_threaded);
    assert!(!parse_313(&block_313(|_| {})).unwrap().free_threaded);

    let mut bad_cookie = block_313(|_| {});
    bad_cookie[0] = b'y';
    assert!(parse_313(&bad_cookie)
        .unwrap_err()
        .to_string()
        .contains("cookie"));
    let wrong_version = block_313(|m| {
        m.insert("version", 0x030e00f0);
    });
    assert!(parse_313(&wrong_version).is_err());
    let outside = block_313(|m| {
        m.insert("thread_state.native_thread_id", 500);
    });
    assert!(parse_313(&outside)
        .unwrap_err()
        .to_string()
        .contains("outside"));
    let huge = block_313(|m| {
        m.insert("interpreter_frame.size", 1 << 40);
    });
    assert!(parse_313(&huge).is_err());
    let ft = block_313(|m| {
        m.insert("free_threaded", 7);
    });
    assert!(parse_313(&ft).is_err());
    assert!(parse_313(&[0u8; 16]).is_err());
}
