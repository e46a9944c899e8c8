//! Round trips and hostile-input tests for the recording file.

use std::io::{self, Write};

use proptest::prelude::*;

use super::*;

fn header() -> Header {
    Header {
        pid: 4242,
        command_line: vec!["python3".into(), "app.py".into(), "--flag".into()],
        executable: "/usr/bin/python3.9".into(),
        python_version: "3.9.2".into(),
        mode: "trace".into(),
        probes: vec!["function".into(), "gc".into()],
        start_ns: 1_000,
        wall_start_unix_ns: 1_700_000_000_000_000_000,
        sample_interval_ns: 10_000_000,
        ..Header::default()
    }
}

/// One event of every kind, on two threads, with a timestamp going backwards.
fn every_kind(w: &mut RecordingWriter<impl Write>) -> Vec<Event> {
    let file = w.intern("/app/fib.py");
    let fib = w.intern("fib");
    let json = w.intern("json");
    let open = w.intern("open");
    let frame = FrameRef {
        file,
        function: fib,
        line: 3,
    };
    let command = w.intern("python3 -c work");
    let kinds = vec![
        EventKind::ThreadStart { pid: 0 },
        EventKind::ThreadStart { pid: 4243 },
        EventKind::ProcessStart {
            parent: 4242,
            command,
        },
        EventKind::Exec { command },
        EventKind::Call { frame },
        EventKind::Resume { frame },
        EventKind::Resume {
            frame: FrameRef { line: 9, ..frame },
        },
        EventKind::Line {
            frame: FrameRef { line: 4, ..frame },
        },
        EventKind::Return {
            frame,
            first_line: 0,
        },
        EventKind::Return {
            frame,
            first_line: 3,
        },
        EventKind::GcStart { generation: 2 },
        EventKind::GcDone { collected: -5 },
        EventKind::GcDone {
            collected: i64::MAX,
        },
        EventKind::ImportStart { module: json },
        EventKind::ImportDone {
            module: json,
            found: true,
        },
        EventKind::ImportDone {
            module: json,
            found: false,
        },
        EventKind::Audit { event: open },
        EventKind::Sample {
            frames: vec![
                WalkedFrame {
                    code: frame,
                    line: 3,
                },
                WalkedFrame {
                    code: frame,
                    line: 9,
                },
            ],
            state: SampleState {
                on_cpu: Some(true),
                holds_gil: Some(false),
            },
        },
        EventKind::Sample {
            frames: vec![],
            state: SampleState::default(),
        },
        EventKind::Sample {
            frames: vec![WalkedFrame {
                code: frame,
                line: 3,
            }],
            state: SampleState {
                on_cpu: Some(false),
                holds_gil: Some(true),
            },
        },
        EventKind::Sample {
            frames: vec![],
            state: SampleState {
                on_cpu: None,
                holds_gil: Some(false),
            },
        },
        EventKind::Stack {
            frames: vec![WalkedFrame {
                code: frame,
                line: 4,
            }],
        },
        EventKind::Running {
            frames: vec![WalkedFrame {
                code: FrameRef {
                    line: u32::MAX,
                    ..frame
                },
                line: 0,
            }],
        },
        EventKind::Window { exact: true },
        EventKind::Thinned {
            level: ThinLevel::Uncounted,
        },
        EventKind::AuditsCounted { count: 123_456 },
        EventKind::Lost { count: 17 },
        EventKind::ReturnType {
            function: frame,
            returned: Some(StrId(0)),
            total: 39,
        },
        EventKind::ReturnType {
            function: frame,
            returned: None,
            total: u64::MAX,
        },
        EventKind::Paused { ns: 2_500_000_000 },
        EventKind::Caveat { text: StrId(0) },
        EventKind::ThreadExit,
    ];
    let mut out = Vec::new();
    for (i, kind) in kinds.into_iter().enumerate() {
        let tid = if i % 3 == 0 { 7 } else { 8 };
        let ts_ns = if i == 8 { 900 } else { 2_000 + 10 * i as u64 };
        out.push(Event { tid, ts_ns, kind });
    }
    out.push(Event {
        tid: u32::MAX,
        ts_ns: u64::MAX,
        kind: EventKind::ThreadStart { pid: u32::MAX },
    });
    out.push(Event {
        tid: 0,
        ts_ns: 0,
        kind: EventKind::ThreadExit,
    });
    for e in &out {
        w.write(e).unwrap();
    }
    out
}

/// A small complete recording and the events in it.
fn small_recording() -> (Vec<u8>, Vec<Event>) {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    let mut events = every_kind(&mut w);
    // A second chunk whose strings come after the first chunk's events.
    w.flush().unwrap();
    let late = w.intern("late_function");
    let e = Event {
        tid: 9,
        ts_ns: 5_000,
        kind: EventKind::Call {
            frame: FrameRef {
                file: late,
                function: late,
                line: 1,
            },
        },
    };
    w.write(&e).unwrap();
    events.push(e);
    w.finish(6_000).unwrap();
    (buf, events)
}

fn read_all(bytes: &[u8]) -> Result<(RecordingReader<&[u8]>, Vec<Event>), RecordError> {
    let mut r = RecordingReader::from_reader(bytes)?;
    let events = r.events().collect::<Result<Vec<_>, _>>()?;
    Ok((r, events))
}

#[test]
fn round_trip_every_kind() {
    let (bytes, written) = small_recording();
    let (r, read) = read_all(&bytes).unwrap();
    assert_eq!(read, written);
    assert_eq!(r.header(), &header());
    assert_eq!(r.string(StrId(0)), "/app/fib.py");
    assert_eq!(r.string(StrId(5)), "late_function");
    assert_eq!(
        r.completion(),
        Completion::Complete(Trailer {
            end_ns: 6_000,
            lost_events: 17,
            events: written.len() as u64,
        })
    );
    assert_eq!(r.events_read(), written.len() as u64);
}

#[test]
fn unknown_string_id_gives_placeholder() {
    let (bytes, _) = small_recording();
    let (r, _) = read_all(&bytes).unwrap();
    assert_eq!(r.string(StrId(77)), "<unknown #77>");
}

#[test]
fn summary_counts_and_caps() {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    let long = "é".repeat(MAX_STRING_LEN); // 2 bytes each: twice the cap
    let a = w.intern(&long);
    assert_eq!(w.intern(&long), a, "interning is idempotent");
    let b = w.intern("b");
    assert_eq!((a, b), (StrId(0), StrId(1)));
    let frames: Vec<WalkedFrame> = (0..MAX_SAMPLE_FRAMES as u32 + 10)
        .map(|line| WalkedFrame {
            code: FrameRef {
                file: b,
                function: b,
                line: 1,
            },
            line,
        })
        .collect();
    w.write(&Event {
        tid: 1,
        ts_ns: 1,
        kind: EventKind::Sample {
            frames: frames.clone(),
            state: SampleState::default(),
        },
    })
    .unwrap();
    let s = w.finish(2).unwrap();
    assert_eq!(s.events, 1);
    assert_eq!(s.strings, 2);
    assert_eq!(s.truncated_strings, 1);
    assert_eq!(s.truncated_samples, 1);
    assert_eq!(s.bytes, buf.len() as u64);
    let (r, events) = read_all(&buf).unwrap();
    assert_eq!(r.string(a).len(), MAX_STRING_LEN);
    match &events[0].kind {
        // The innermost frames are kept.
        EventKind::Sample { frames: kept, .. } => assert_eq!(kept[..], frames[10..]),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn writer_rejects_uninterned_ids() {
    let mut w = RecordingWriter::new(Vec::new(), &header()).unwrap();
    let err = w
        .write(&Event {
            tid: 1,
            ts_ns: 1,
            kind: EventKind::Audit { event: StrId(3) },
        })
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn many_events_span_many_chunks() {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    let n = 200_000u64;
    let mut frames = Vec::new();
    for i in 0..n {
        if i % 1000 == 0 {
            let f = w.intern(&format!("f{i}"));
            frames.push(FrameRef {
                file: f,
                function: f,
                line: i as u32,
            });
        }
        let frame = *frames.last().unwrap();
        let kind = if i % 2 == 0 {
            EventKind::Call { frame }
        } else {
            EventKind::Return {
                frame,
                first_line: 0,
            }
        };
        w.write(&Event {
            tid: (i % 3) as u32,
            ts_ns: i * 100,
            kind,
        })
        .unwrap();
    }
    let s = w.finish(n * 100).unwrap();
    assert!(s.chunks > 4, "expected several chunks, got {}", s.chunks);
    let mut r = RecordingReader::from_reader(&buf[..]).unwrap();
    let mut count = 0u64;
    for (i, e) in r.events().enumerate() {
        let e = e.unwrap();
        assert_eq!(e.ts_ns, i as u64 * 100);
        count += 1;
    }
    assert_eq!(count, n);
    assert!(matches!(r.completion(), Completion::Complete(t) if t.events == n));
    assert_eq!(r.string(frames[199].function), "f199000");
}

/// Calls and returns written with what a hint remembers are byte for byte the
/// ones written plainly: over many chunks, more frames than fit a compact tag,
/// returns with and without a first line, other kinds and threads between.
#[test]
fn hinted_writes_are_byte_for_byte_the_plain_ones() {
    let (mut plain, mut hinted) = (Vec::new(), Vec::new());
    let mut p = RecordingWriter::new(&mut plain, &header()).unwrap();
    let mut h = RecordingWriter::new(&mut hinted, &header()).unwrap();
    let mut hints: std::collections::HashMap<(u32, u32, u8), FrameNumberHint> =
        std::collections::HashMap::new();
    let file = (p.intern("/app/deep.py"), h.intern("/app/deep.py"));
    let n = 300_000u64;
    let mut reused = 0u64;
    for i in 0..n {
        let which = (i * 7919 % 61) as u32;
        let kind = match i % 5 {
            0 | 2 => EventKind::Call {
                frame: FrameRef {
                    file: file.0,
                    function: file.0,
                    line: which,
                },
            },
            1 | 3 => EventKind::Return {
                frame: FrameRef {
                    file: file.0,
                    function: file.0,
                    line: which,
                },
                first_line: if which % 3 == 0 { 0 } else { which + 1 },
            },
            _ if i % 1000 == 4 => EventKind::GcStart { generation: 2 },
            _ if i % 10 == 9 => EventKind::Resume {
                frame: FrameRef {
                    file: file.0,
                    function: file.0,
                    line: which,
                },
            },
            _ => EventKind::Call {
                frame: FrameRef {
                    file: file.0,
                    function: file.0,
                    line: 100 + (i % 3) as u32,
                },
            },
        };
        let event = Event {
            tid: u32::from(i % 11 == 0),
            ts_ns: 1_000 + i * 37 - (i % 4) * 50,
            kind,
        };
        p.write(&event).unwrap();
        let key = match &event.kind {
            EventKind::Call { frame } => Some((frame.line, 0, 0)),
            EventKind::Resume { frame } => Some((frame.line, 0, 2)),
            EventKind::Return { frame, first_line } => Some((frame.line, *first_line, 1)),
            _ => None,
        };
        match key {
            Some(key) => {
                let hint = hints.entry(key).or_default();
                let before = *hint;
                h.write_hinted(&event, hint).unwrap();
                reused += u64::from(before == *hint && before != FrameNumberHint::default());
            }
            None => h.write(&event).unwrap(),
        }
    }
    let (sp, sh) = (p.finish(n * 40).unwrap(), h.finish(n * 40).unwrap());
    assert!(sp.chunks > 3, "several chunks: {}", sp.chunks);
    assert_eq!(sp, sh);
    assert!(plain == hinted, "the same bytes");
    // Most were written from the hint, not looked up.
    assert!(reused > n / 2, "{reused} of {n} from the hint");
    let (_, events) = read_all(&hinted).unwrap();
    assert_eq!(events.len() as u64, n);
}

#[test]
fn truncated_at_every_byte_reads_a_prefix() {
    let (bytes, written) = small_recording();
    let header_end = {
        let mut buf = Vec::new();
        RecordingWriter::new(&mut buf, &header()).unwrap();
        buf.len()
    };
    for len in 0..bytes.len() {
        let cut = &bytes[..len];
        match RecordingReader::from_reader(cut) {
            Ok(mut r) => {
                assert!(len >= header_end, "header accepted at {len}");
                let read: Vec<Event> = r.events().map(|e| e.unwrap()).collect();
                assert_eq!(read[..], written[..read.len()], "cut at {len}");
                match r.completion() {
                    Completion::Truncated { offset } => assert!(offset <= len as u64),
                    other => panic!("cut at {len}: {other:?}"),
                }
            }
            Err(RecordError::Empty) => assert_eq!(len, 0),
            Err(RecordError::TruncatedHeader { offset }) => {
                assert!(len < header_end && offset <= len as u64)
            }
            Err(e) => panic!("cut at {len}: {e}"),
        }
    }
}

#[test]
fn flipped_payload_bytes_are_checksum_errors() {
    let (bytes, _) = small_recording();
    // Walk the chunks to find each payload.
    let mut at = 12usize;
    let mut chunks = Vec::new();
    while at + 9 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
        chunks.push((at, len));
        at += 9 + len;
    }
    assert_eq!(at, bytes.len());
    for &(start, len) in &chunks {
        for i in start + 9..start + 9 + len {
            let mut bad = bytes.clone();
            bad[i] ^= 0x41;
            let err = match read_all(&bad) {
                Err(e) => e,
                Ok(_) => panic!("flip at {i} not detected"),
            };
            match err {
                RecordError::Checksum { offset, .. } => assert_eq!(offset, start as u64),
                e => panic!("flip at {i}: {e}"),
            }
            assert!(err_message(&bad).contains(&format!("offset {start}")));
        }
    }
    // Flips anywhere, framing bytes included, never panic. (The kind byte is
    // outside the checksum, so those flips may surface as other errors.)
    for i in 0..bytes.len() {
        for bit in [0x01u8, 0x80] {
            let mut bad = bytes.clone();
            bad[i] ^= bit;
            if let Ok(mut r) = RecordingReader::from_reader(&bad[..]) {
                for e in r.events() {
                    let _ = e;
                }
                assert_ne!(r.completion(), Completion::Reading);
            }
        }
    }
}

fn err_message(bytes: &[u8]) -> String {
    match read_all(bytes) {
        Err(e) => e.to_string(),
        Ok(_) => String::new(),
    }
}

#[test]
fn empty_foreign_and_future_files() {
    assert!(matches!(
        RecordingReader::from_reader(&b""[..]),
        Err(RecordError::Empty)
    ));
    let foreign = RecordingReader::from_reader(&b"\x7fELF\x02\x01\x01\0rest of it"[..]);
    let msg = foreign.err().unwrap().to_string();
    assert!(msg.contains("not a pyprobe recording"), "{msg}");
    assert!(msg.contains("offset 0"), "{msg}");
    assert!(matches!(
        RecordingReader::from_reader(&b"PYP"[..]),
        Err(RecordError::TruncatedHeader { offset: 3 })
    ));
    let mut future = MAGIC.to_vec();
    future.extend_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let err = RecordingReader::from_reader(&future[..]).err().unwrap();
    assert!(matches!(
        err,
        RecordError::UnsupportedVersion { version } if version == FORMAT_VERSION + 1
    ));
    assert!(err.to_string().contains("offset 8"));
    // Magic and version only.
    let mut bare = MAGIC.to_vec();
    bare.extend_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        RecordingReader::from_reader(&bare[..]),
        Err(RecordError::TruncatedHeader { offset: 12 })
    ));
}

fn with_chunk(kind: u8, payload: &[u8], len_override: Option<u32>) -> Vec<u8> {
    let mut buf = Vec::new();
    RecordingWriter::new(&mut buf, &header()).unwrap();
    buf.push(kind);
    let len = len_override.unwrap_or(payload.len() as u32);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    buf.extend_from_slice(payload);
    buf
}

#[test]
fn absurd_length_bad_varint_and_unknown_kind_name_offsets() {
    let base = with_chunk(kind::EVENTS, &[], None).len() as u64 - 9;
    let err = read_all(&with_chunk(kind::EVENTS, &[], Some(u32::MAX)))
        .err()
        .unwrap();
    assert!(matches!(err, RecordError::ChunkTooLong { offset, .. } if offset == base));
    assert!(err.to_string().contains(&format!("offset {base}")));

    // Event tag, then a thread-id varint that never ends.
    let err = read_all(&with_chunk(kind::EVENTS, &[0, 0xff, 0xff], None))
        .err()
        .unwrap();
    assert!(matches!(err, RecordError::BadVarint { offset } if offset == base + 10));
    assert_eq!(
        err.to_string(),
        format!("bad varint at offset {}", base + 10)
    );

    let err = read_all(&with_chunk(99, &[1, 2, 3], None)).err().unwrap();
    assert!(matches!(err, RecordError::Corrupt { offset, .. } if offset == base));

    // A string count larger than the chunk could hold.
    let err = read_all(&with_chunk(kind::STRINGS, &[0x7f, 0, 0], None))
        .err()
        .unwrap();
    assert!(matches!(err, RecordError::Corrupt { .. }), "{err}");
}

#[test]
fn disk_full_propagates_and_leaves_a_readable_prefix() {
    /// Accepts `room` bytes, then fails like a full disk.
    struct Full<'a> {
        buf: &'a mut Vec<u8>,
        room: usize,
    }
    impl Write for Full<'_> {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            let n = data.len().min(self.room - self.buf.len());
            if n == 0 {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            self.buf.extend_from_slice(&data[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    for room in [200usize, 100_000, 300_000] {
        let mut buf = Vec::new();
        let result = (|| -> io::Result<u64> {
            let mut w = RecordingWriter::new(
                Full {
                    buf: &mut buf,
                    room,
                },
                &header(),
            )?;
            let f = w.intern("f");
            let frame = FrameRef {
                file: f,
                function: f,
                line: 1,
            };
            for i in 0..1_000_000u64 {
                w.write(&Event {
                    tid: 1,
                    ts_ns: i,
                    kind: EventKind::Call { frame },
                })?;
            }
            w.finish(0).map(|s| s.events)
        })();
        let err = result.unwrap_err();
        assert!(
            err.to_string().contains("writing the recording failed"),
            "{err}"
        );
        assert!(err.to_string().contains("No space left"), "{err}");
        let mut r = RecordingReader::from_reader(&buf[..]).unwrap();
        let n = r.events().collect::<Result<Vec<_>, _>>().unwrap().len();
        assert!(matches!(r.completion(), Completion::Truncated { .. }));
        // The first events chunk is ~256 KiB: it fits only in the largest room.
        assert_eq!(n > 0, room > 256 * 1024);
    }
}

#[test]
fn dropped_writer_keeps_its_events() {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    let written = every_kind(&mut w);
    drop(w);
    let mut r = RecordingReader::from_reader(&buf[..]).unwrap();
    let read: Vec<Event> = r.events().map(|e| e.unwrap()).collect();
    assert_eq!(read, written);
    assert!(matches!(r.completion(), Completion::Truncated { .. }));
}

#[test]
fn file_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    let mut w = RecordingWriter::create(&path, &header()).unwrap();
    let written = every_kind(&mut w);
    w.finish(10).unwrap();
    let mut r = RecordingReader::open(&path).unwrap();
    let read: Vec<Event> = r.events().map(|e| e.unwrap()).collect();
    assert_eq!(read, written);
    let missing = RecordingReader::open(&dir.path().join("nope"))
        .err()
        .unwrap();
    assert!(missing.to_string().contains("offset 0"));
}

proptest! {
    #[test]
    fn random_bytes_after_magic_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&tail);
        if let Ok(mut r) = RecordingReader::from_reader(&bytes[..]) {
            for e in r.events() { let _ = e; }
            let _ = r.completion();
        }
    }

    #[test]
    fn random_chunks_after_a_valid_header_never_panic(
        chunks in proptest::collection::vec((1u8..=4, proptest::collection::vec(any::<u8>(), 0..256)), 0..8)
    ) {
        let mut bytes = Vec::new();
        RecordingWriter::new(&mut bytes, &header()).unwrap();
        // Valid framing and checksums, so the payload decoders see the garbage.
        for (kind, payload) in &chunks {
            bytes.push(*kind);
            bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
            bytes.extend_from_slice(payload);
        }
        let mut r = RecordingReader::from_reader(&bytes[..]).unwrap();
        for e in r.events() { let _ = e; }
        let _ = r.completion();
    }

    #[test]
    fn mutated_recordings_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let (mut bytes, _) = small_recording();
        let n = bytes.len();
        for (at, val) in flips {
            bytes[at % n] = val;
        }
        if let Ok(mut r) = RecordingReader::from_reader(&bytes[..]) {
            for e in r.events() { let _ = e; }
        }
    }
}

#[test]
fn format_1_samples_read_with_their_first_line_unknown() {
    use super::codec::EventDecoder;
    use super::wire::Cursor;
    // Tag 8 (a format-1 sample), thread 5, time 100, one frame: file 1,
    // function 2, current line 40.
    let payload = [8u8, 5, 100, 1, 1, 2, 40];
    let mut c = Cursor::new(&payload, 0, 0);
    let event = EventDecoder::default().decode(&mut c).unwrap();
    assert_eq!(
        event.kind,
        EventKind::Sample {
            frames: vec![WalkedFrame {
                code: FrameRef {
                    file: StrId(1),
                    function: StrId(2),
                    line: 0
                },
                line: 40
            }],
            state: SampleState::default(),
        }
    );
    // A whole format-1 file (no samples) reads too.
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    w.write(&Event {
        tid: 1,
        ts_ns: 1,
        kind: EventKind::ThreadStart { pid: 0 },
    })
    .unwrap();
    w.finish(2).unwrap();
    buf[8..12].copy_from_slice(&1u32.to_le_bytes());
    let (r, events) = read_all(&buf).unwrap();
    assert_eq!(r.header().format_version, 1);
    assert_eq!(events.len(), 1);
}

#[test]
fn format_2_samples_read_with_their_state_unknown() {
    use super::codec::EventDecoder;
    use super::wire::Cursor;
    // Tag 14 (a format-2 sample), thread 5, time 100, one frame: file 1, function
    // 2, first line 30, current line 40.
    let payload = [14u8, 5, 100, 1, 1, 2, 30, 40];
    let mut c = Cursor::new(&payload, 0, 0);
    let event = EventDecoder::default().decode(&mut c).unwrap();
    let EventKind::Sample { frames, state } = event.kind else {
        panic!("not a sample: {event:?}");
    };
    assert_eq!(
        (frames.len(), frames[0].code.line, frames[0].line),
        (1, 30, 40)
    );
    assert_eq!(state, SampleState::default());
    // A whole format-2 file reads too.
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    w.write(&Event {
        tid: 1,
        ts_ns: 1,
        kind: EventKind::ThreadStart { pid: 0 },
    })
    .unwrap();
    w.finish(2).unwrap();
    buf[8..12].copy_from_slice(&2u32.to_le_bytes());
    let (r, events) = read_all(&buf).unwrap();
    assert_eq!(r.header().format_version, 2);
    assert_eq!(events.len(), 1);
}

#[test]
fn sample_states_round_trip_and_bad_ones_are_corrupt() {
    use super::codec::EventDecoder;
    use super::wire::Cursor;
    let states = [None, Some(true), Some(false)];
    for on_cpu in states {
        for holds_gil in states {
            let state = SampleState { on_cpu, holds_gil };
            let mut buf = Vec::new();
            let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
            w.write(&Event {
                tid: 3,
                ts_ns: 7,
                kind: EventKind::Sample {
                    frames: vec![],
                    state,
                },
            })
            .unwrap();
            w.finish(8).unwrap();
            let (_, events) = read_all(&buf).unwrap();
            assert_eq!(
                events[0].kind,
                EventKind::Sample {
                    frames: vec![],
                    state
                }
            );
        }
    }
    // Tag 17, thread 5, time 100, then a state byte: 3 is no value, nor any high bit.
    for bad in [0x03u8, 0x0c, 0x10, 0x80] {
        let payload = [17u8, 5, 100, bad, 0];
        let err = EventDecoder::default()
            .decode(&mut Cursor::new(&payload, 0, 0))
            .unwrap_err();
        assert!(err.to_string().contains("sample state"), "{bad:#x}: {err}");
    }
}

/// Recordings of format 3 have thread starts without their process: they read
/// as the recording's own process (pid 0), with no process events.
#[test]
fn format_3_thread_starts_read_without_a_process() {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    // A format-3 writer wrote tag 9 with no payload, as ThreadStart { pid: 0 } is.
    w.write(&Event {
        tid: 5,
        ts_ns: 1,
        kind: EventKind::ThreadStart { pid: 0 },
    })
    .unwrap();
    w.finish(2).unwrap();
    buf[8..12].copy_from_slice(&3u32.to_le_bytes());
    let (r, events) = read_all(&buf).unwrap();
    assert_eq!(r.header().format_version, 3);
    assert_eq!(events[0].kind, EventKind::ThreadStart { pid: 0 });
}

/// Calls and returns of format 6 number their frames per chunk: many frames
/// (more than fit a compact tag), returns with and without a first line, and
/// threads interleaving all read back as written, across chunks.
#[test]
fn numbered_frames_round_trip_across_chunks() {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    let file = w.intern("f.py");
    let names: Vec<StrId> = (0..40).map(|i| w.intern(&format!("fn{i}"))).collect();
    let mut written = Vec::new();
    for i in 0..2000u64 {
        let function = names[(i * 7 % 40) as usize];
        let frame = FrameRef {
            file,
            function,
            line: (i % 3) as u32,
        };
        let kind = match i % 4 {
            0 => EventKind::Call { frame },
            1 => EventKind::Return {
                frame,
                first_line: 0,
            },
            2 => EventKind::Resume { frame },
            _ => EventKind::Return {
                frame,
                first_line: 9,
            },
        };
        let event = Event {
            tid: 1 + (i % 2) as u32,
            ts_ns: 1_000 + i * 150 - (i % 2) * 40,
            kind,
        };
        w.write(&event).unwrap();
        written.push(event);
        if i % 700 == 0 {
            w.flush().unwrap();
        }
    }
    let summary = w.finish(1_000_000).unwrap();
    assert!(summary.chunks > 4, "{summary:?}");
    let (_, events) = read_all(&buf).unwrap();
    assert_eq!(events, written);
}

/// A call or return of one frame repeated costs a tag byte and its time delta
/// (one byte up to 63 ns).
#[test]
fn repeated_calls_take_two_bytes_each() {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    let frame = FrameRef {
        file: w.intern("fib.py"),
        function: w.intern("fib"),
        line: 6,
    };
    w.flush().unwrap();
    let before = w.summary().bytes;
    for i in 0..10_000u64 {
        w.write(&call_or_return(frame, i, 1, i * 50)).unwrap();
    }
    w.flush().unwrap();
    let bytes = w.summary().bytes - before;
    // 10,000 events of two bytes, and one chunk header and two frames spelled out.
    assert!((20_000..20_040).contains(&bytes), "{bytes} bytes");
}

/// A frame number the chunk never gave is corrupt, named at its offset.
#[test]
fn unknown_frame_numbers_are_corrupt() {
    use super::codec::EventDecoder;
    use super::wire::Cursor;
    // Thread 5, time 100: a compact call of frame 3; then a numbered return of 40.
    for (payload, at) in [
        (&[0x40u8 | 3 << 1, 5, 100][..], 1000),
        (&[35, 5, 100, 40], 1003),
    ] {
        let err = EventDecoder::default()
            .decode(&mut Cursor::new(payload, 0, 1000))
            .unwrap_err();
        assert!(err.to_string().contains("frame number"), "{err}");
        assert!(err.to_string().contains(&format!("offset {at}:")), "{err}");
    }
}

/// Recordings of format 5 spelled every call and return out: they still read.
#[test]
fn format_5_calls_and_returns_still_read() {
    let mut bytes = Vec::new();
    let mut w = RecordingWriter::new(&mut bytes, &header()).unwrap();
    let (file, function) = (w.intern("f.py"), w.intern("g"));
    drop(w);
    bytes[8..12].copy_from_slice(&5u32.to_le_bytes());
    // Tag 0 (call), thread 5, time 100, frame (0, 1, 3); then a return of the same
    // thread (tag 23 | SAME_TID), +10 ns (zigzag 20), frame (0, 1, 4), first line 3.
    let payload = [0u8, 5, 100, 0, 1, 3, 23 | 0x80, 20, 0, 1, 4, 3];
    bytes.push(kind::EVENTS);
    bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    let (r, events) = read_all(&bytes).unwrap();
    assert_eq!(r.header().format_version, 5);
    let frame = |line| FrameRef {
        file,
        function,
        line,
    };
    assert_eq!(
        events,
        vec![
            Event {
                tid: 5,
                ts_ns: 100,
                kind: EventKind::Call { frame: frame(3) }
            },
            Event {
                tid: 5,
                ts_ns: 110,
                kind: EventKind::Return {
                    frame: frame(4),
                    first_line: 3
                }
            },
        ]
    );
}

#[test]
fn qualified_names_round_trip_and_name_a_resumed_frame_by_its_file_and_name() {
    let mut buf = Vec::new();
    let mut w = RecordingWriter::new(&mut buf, &header()).unwrap();
    let file = w.intern("/app/shapes.py");
    let area = w.intern("area");
    let init = w.intern("__init__");
    let code = |function, line| FrameRef {
        file,
        function,
        line,
    };
    let circle = w.intern("Circle.area");
    w.name_code(&code(area, 10), circle);
    // Ids never interned are dropped, not written.
    w.name_code(&code(area, 11), StrId(999));
    w.write(&Event {
        tid: 1,
        ts_ns: 5,
        kind: EventKind::Call {
            frame: code(area, 10),
        },
    })
    .unwrap();
    // Two `__init__` of one file with different classes: no guess by name.
    let a = w.intern("A.__init__");
    let b = w.intern("B.__init__");
    w.name_code(&code(init, 20), a);
    w.name_code(&code(init, 30), b);
    w.finish(9).unwrap();

    let (r, _) = read_all(&buf).unwrap();
    let q = r.qualnames();
    assert_eq!(q.len(), 3);
    assert_eq!(q.get(&code(area, 10)), Some(circle));
    assert_eq!(q.get(&code(area, 14)), Some(circle), "a line of its body");
    assert_eq!(q.get(&code(init, 30)), Some(b));
    assert_eq!(q.get(&code(init, 25)), None);
}

#[test]
fn a_qualified_name_naming_an_undefined_string_is_corruption() {
    let mut payload = Vec::new();
    wire::put_uvarint(&mut payload, 1);
    for v in [0u64, 1, 3, 7] {
        wire::put_uvarint(&mut payload, v);
    }
    let e = err_message(&with_chunk(kind::QUALNAMES, &payload, None));
    assert!(e.contains("qualified name refers to a string"), "{e}");
}

/// A recording written through its background writer stores its events chunks
/// compressed (format 11) and reads back the same events; a compressed chunk
/// that is no zstd frame, or lies about its size, is named corrupt at its offset.
#[test]
fn compressed_events_chunks_read_back_and_bad_ones_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fib.pyprobe");
    let mut w = RecordingWriter::create(&path, &header()).unwrap();
    let frame = FrameRef {
        file: w.intern("/app/fib.py"),
        function: w.intern("fib"),
        line: 3,
    };
    let mut written = Vec::new();
    for i in 0..200_000u64 {
        let event = call_or_return(frame, i, 7, 1_000 + i * 150 + i % 3);
        w.write(&event).unwrap();
        written.push(event);
    }
    let summary = w.finish(1_000 + 200_000 * 150).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    // About a byte an event stored, from nearly three handed over.
    assert!(
        bytes.len() as u64 * 2 < summary.bytes,
        "{} of {}",
        bytes.len(),
        summary.bytes
    );
    let (_, read) = read_all(&bytes).unwrap();
    assert_eq!(read, written);

    let base = with_chunk(kind::EVENTS_ZSTD, &[], None).len() as u64 - 9;
    let err = read_all(&with_chunk(kind::EVENTS_ZSTD, b"no zstd frame", None))
        .err()
        .unwrap();
    assert!(
        matches!(&err, RecordError::Corrupt { offset, what } if *offset == base && what.contains("no zstd frame")),
        "{err}"
    );
    let mut lying = zstd::bulk::compress(&[0u8; 64], 1).unwrap();
    // A frame this small says its size in one byte, after the magic and the
    // descriptor: claiming 200 bytes fails, never reads past the 64 it holds.
    assert_eq!(lying[5], 64);
    lying[5] = 200;
    assert!(read_all(&with_chunk(kind::EVENTS_ZSTD, &lying, None)).is_err());
}

/// The `i`-th event of a fib-like trace of `frame` on thread `tid`: calls at even
/// `i`, returns (at the function's first line) at odd.
pub(super) fn call_or_return(frame: FrameRef, i: u64, tid: u32, ts_ns: u64) -> Event {
    let kind = if i % 2 == 0 {
        EventKind::Call { frame }
    } else {
        EventKind::Return {
            frame,
            first_line: frame.line,
        }
    };
    Event { tid, ts_ns, kind }
}
