//! Reading ahead (a reader of a file) returns exactly what reading in place
//! returns: the events, the errors, and where each leaves the reader.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::Path;

use super::*;

fn header() -> Header {
    Header {
        pid: 7,
        command_line: vec!["python3".into(), "app.py".into()],
        mode: "trace".into(),
        ..Header::default()
    }
}

/// A recording of `n` calls and returns on two threads, its strings defined a
/// few at a time between events chunks, written by `w`.
fn write_trace<W: Write>(w: &mut RecordingWriter<W>, n: u64) {
    let mut frame = None;
    for i in 0..n {
        if i % 5_000 == 0 {
            let name = w.intern(&format!("f{i}"));
            frame = Some(FrameRef {
                file: name,
                function: name,
                line: i as u32 + 1,
            });
            if i % 10_000 == 0 {
                w.flush().unwrap();
            }
        }
        let event =
            super::tests::call_or_return(frame.unwrap(), i, (i % 2) as u32 + 1, 1_000 + i * 90);
        w.write(&event).unwrap();
    }
}

/// Everything a reader's user can see, step by step, until it stops.
fn what_is_read<R: Read>(r: &mut RecordingReader<R>) -> Vec<String> {
    let mut seen = Vec::new();
    while let Some(step) = r.next_event() {
        seen.push(format!(
            "{step:?} at {} end {} #{} strings {}",
            r.bytes_read(),
            r.at_chunk_end(),
            r.events_read(),
            r.strings().len()
        ));
    }
    seen.push(format!("{:?} {:?}", r.completion(), r.qualnames()));
    seen
}

/// What each way of reading the file at `path` sees: ahead, then in place.
fn both_ways(path: &Path) -> (Vec<String>, Vec<String>) {
    let ahead = match RecordingReader::open(path) {
        Ok(mut r) => {
            assert!(r.reads_ahead(), "a reader of a file reads ahead");
            what_is_read(&mut r)
        }
        Err(e) => vec![format!("{e:?}")],
    };
    let file = File::open(path).unwrap();
    let in_place = match RecordingReader::from_reader(BufReader::new(file)) {
        Ok(mut r) => what_is_read(&mut r),
        Err(e) => vec![format!("{e:?}")],
    };
    (ahead, in_place)
}

/// The offsets where each chunk after the 12-byte prefix starts.
fn chunk_starts(bytes: &[u8]) -> Vec<usize> {
    let mut at = 12;
    let mut starts = Vec::new();
    while at + 9 <= bytes.len() {
        starts.push(at);
        at += 9 + u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
    }
    starts
}

#[test]
fn read_ahead_reads_a_compressed_recording_as_reading_in_place_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    let mut w = RecordingWriter::create(&path, &header()).unwrap();
    write_trace(&mut w, 300_000);
    w.finish(1_000 + 300_000 * 90).unwrap();
    let (ahead, in_place) = both_ways(&path);
    assert_eq!(ahead.len(), 300_001);
    assert!(ahead.last().unwrap().starts_with("Complete"));
    assert_eq!(ahead, in_place);

    // A reader dropped in the middle stops its thread.
    let mut r = RecordingReader::open(&path).unwrap();
    assert!(r.next_event().unwrap().is_ok());
    drop(r);
}

/// Plain events chunks, cut and damaged everywhere that matters: chunk
/// boundaries, inside chunks, and payloads whose checksum was made right again
/// so that decoding fails in the middle of a chunk.
#[test]
fn read_ahead_stops_where_reading_in_place_stops() {
    let mut bytes = Vec::new();
    let mut w = RecordingWriter::new(&mut bytes, &header()).unwrap();
    write_trace(&mut w, 40_000);
    w.finish(1_000 + 40_000 * 90).unwrap();
    let starts = chunk_starts(&bytes);
    assert!(starts.len() > 6, "{} chunks", starts.len());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.pyprobe");
    let check = |bytes: &[u8], what: &str| {
        std::fs::write(&path, bytes).unwrap();
        let (ahead, in_place) = both_ways(&path);
        assert_eq!(ahead, in_place, "{what}");
    };
    check(&bytes, "whole");
    for &start in &starts {
        for cut in [start, start + 1, start + 9, start + 40] {
            check(&bytes[..cut.min(bytes.len())], &format!("cut at {cut}"));
        }
    }
    for (i, &start) in starts.iter().enumerate().skip(1) {
        let len = u32::from_le_bytes(bytes[start + 1..start + 5].try_into().unwrap()) as usize;
        let payload = start + 9..start + 9 + len;
        for at in [payload.start, payload.start + len / 2, payload.end - 1] {
            let mut bad = bytes.clone();
            bad[at] = 0xff;
            let crc = crc32fast::hash(&bad[payload.clone()]);
            bad[start + 5..start + 9].copy_from_slice(&crc.to_le_bytes());
            check(&bad, &format!("chunk {i} byte {at} made 0xff"));
            bad[start + 5] ^= 1;
            check(&bad, &format!("chunk {i} with a bad checksum"));
        }
        let mut bad = bytes.clone();
        bad[start] = 0x7e;
        check(&bad, &format!("chunk {i} of an unknown kind"));
    }
}

#[test]
fn read_ahead_starts_again_after_a_rewind_and_a_seek() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    let mut w = RecordingWriter::create(&path, &header()).unwrap();
    write_trace(&mut w, 100_000);
    w.finish(1_000 + 100_000 * 90).unwrap();
    let mut r = RecordingReader::open(&path).unwrap();
    let all: Vec<Event> = r.events().map(Result::unwrap).collect();
    let mut r = RecordingReader::open(&path).unwrap();
    let mut boundary = None;
    for _ in 0..60_000 {
        r.next_event().unwrap().unwrap();
        if r.at_chunk_end() && r.events_read() > 20_000 && boundary.is_none() {
            boundary = Some((r.bytes_read(), r.events_read()));
        }
    }
    r.rewind().unwrap();
    let again: Vec<Event> = r.events().map(Result::unwrap).collect();
    assert_eq!(again, all);
    let (offset, before) = boundary.expect("a chunk boundary in the first 60,000 events");
    r.seek_to_chunk(offset, before).unwrap();
    let rest: Vec<Event> = r.events().map(Result::unwrap).collect();
    assert_eq!(rest[..], all[before as usize..]);
    assert!(matches!(r.completion(), Completion::Complete(_)));
}

/// A reader in place that goes on reading ahead from a chunk end, knowing the
/// whole recording's names, returns what it would have returned itself: the
/// events, where each leaves it, and how the file ends.
#[test]
fn going_on_reading_ahead_from_a_chunk_end_reads_what_reading_in_place_would() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.pyprobe");
    let mut w = RecordingWriter::create(&path, &header()).unwrap();
    write_trace(&mut w, 300_000);
    w.finish(1_000 + 300_000 * 90).unwrap();
    let whole = what_is_read(&mut RecordingReader::open_in_place(&path).unwrap());
    let mut names = RecordingReader::open(&path).unwrap();
    while names.next_event().is_some() {}

    let mut switched = 0;
    for stop_after in [1, 12_345, 150_000, 299_999] {
        let mut r = RecordingReader::open_in_place(&path).unwrap();
        let mut seen = Vec::new();
        for _ in 0..stop_after {
            r.next_event().unwrap().unwrap();
        }
        // Up to the chunk's end in place, as `record`'s views do.
        while !r.at_chunk_end() {
            r.next_event().unwrap().unwrap();
        }
        let read = r.events_read() as usize;
        if r.completion() == Completion::Reading {
            let mut ahead = r
                .go_on_reading_ahead(names.strings().to_vec(), names.qualnames().clone())
                .unwrap();
            assert!(ahead.reads_ahead());
            seen.extend(what_is_read(&mut ahead));
            switched += 1;
        } else {
            seen.extend(what_is_read(&mut r));
        }
        // The lines after the switch, but for the strings read so far, which
        // the reader ahead knows from the start.
        let strip = |l: &String| l.split(" strings ").next().unwrap().to_owned();
        let expected: Vec<String> = whole[read..].iter().map(strip).collect();
        let got: Vec<String> = seen.iter().map(strip).collect();
        assert_eq!(got, expected, "went on after {read} events");
    }
    assert!(switched >= 3, "{switched}");
}
