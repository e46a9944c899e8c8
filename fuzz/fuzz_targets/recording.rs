//! The recording reader on arbitrary bytes: open, read every event, and build the
//! report from it. Errors, never a panic, a hang or unbounded memory.
//!
//! Input whose first byte is odd is taken as is. Otherwise the bytes after it are
//! cut into chunks (kind byte, u16 length, payload), framed with a correct length and
//! CRC-32 after a valid magic and version, so the fuzzer reaches the payload
//! decoders (header, strings, events, trailer) and the analysis behind the report.
#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;
use pyprobe_recording::recording::{RecordingReader, FORMAT_VERSION, MAGIC};

fn framed(mut rest: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    while rest.len() >= 3 {
        let kind = rest[0];
        let len = usize::from(u16::from_le_bytes([rest[1], rest[2]]));
        rest = &rest[3..];
        let payload = &rest[..len.min(rest.len())];
        rest = &rest[payload.len()..];
        out.push(kind);
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32(payload).to_le_bytes());
        out.extend_from_slice(payload);
    }
    out
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fuzz_target!(|data: &[u8]| {
    let bytes = match data.split_first() {
        Some((first, rest)) if first & 1 == 0 => framed(rest),
        _ => data.to_vec(),
    };
    // Every event, one by one.
    if let Ok(mut reader) = RecordingReader::from_reader(Cursor::new(&bytes)) {
        let mut n = 0u64;
        for event in reader.events() {
            n += 1;
            if event.is_err() {
                break;
            }
        }
        assert!(n <= bytes.len() as u64 + 1, "more events than bytes");
        let _ = reader.completion();
    }
    // The report over the same bytes (stack reconstruction, aggregation).
    if let Ok(mut reader) = RecordingReader::from_reader(Cursor::new(&bytes)) {
        let _ = pyprobe_recording::output::report::build_report(&mut reader);
    }
});
