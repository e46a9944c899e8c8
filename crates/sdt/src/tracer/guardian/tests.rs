//! The guardian's unit tests: ring site repairs and the ring site message.

use std::io::Read;

use super::undo::{ring_fix, RingSite, SilencedTool};

use super::*;

#[test]
fn ring_sites_get_their_original_bytes_only_over_pyprobes_own() {
    let site = RingSite {
        original: vec![0x90, 0x48, 0x8b, 0x4b, 0x20],
        patch: vec![0xe9, 1, 2, 3, 4],
    };
    // The jump: every original byte back.
    assert_eq!(ring_fix(&site.patch, &site), Some(&site.original[..]));
    // The int3 the jump was about to replace: its nop back.
    assert_eq!(
        ring_fix(&[0xcc, 0x48, 0x8b, 0x4b, 0x20], &site),
        Some(&[0x90][..])
    );
    // Restored already, or someone else's bytes: left alone.
    assert_eq!(ring_fix(&site.original, &site), None);
    assert_eq!(ring_fix(&[0xe9, 9, 9, 9, 9], &site), None);
    assert_eq!(ring_fix(&[0xcc, 0, 0, 0, 0], &site), None);
}

#[test]
fn a_ring_site_message_holds_both_byte_strings() {
    let (read_end, write_end) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
    let mut g = Guardian {
        pipe: File::from(write_end),
        guardian_pid: 0,
        control: Control::new().expect("control page"),
    };
    let original = [0x90, 0x55, 0x48, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8];
    let patch = [0xe9, 1, 2, 3, 4, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc];
    g.tell_ring_site(42, 0x1234, &original, &patch)
        .expect("told");
    // Too long for the message, or mismatched: refused, so never patched.
    assert!(g
        .tell_ring_site(42, 0x1234, &[0x90; 25], &[0xcc; 25])
        .is_err());
    assert!(g
        .tell_ring_site(42, 0x1234, &original, &patch[..5])
        .is_err());
    drop(g);
    let mut msg = Vec::new();
    File::from(read_end).read_to_end(&mut msg).expect("read");
    assert_eq!(msg.len(), MSG_LEN + RING_PAYLOAD);
    assert_eq!(msg[0], Op::RingSiteArmed as u8);
    assert_eq!(msg[13], 12);
    assert_eq!(&msg[14..26], &original);
    assert_eq!(&msg[14 + SITE_BYTES..26 + SITE_BYTES], &patch);
}

#[test]
fn a_silenced_tool_message_reads_back_as_told_and_refuses_what_does_not_fit() {
    let words = [
        (0x7000_0020, 0xaaaa),
        (0x7000_0028, 0xbbbb),
        (0x7000_0400, 0xcccc),
    ];
    let msg = tool_silenced_message(42, 0x7000_0000, (4, 16), &words).expect("fits");
    assert_eq!(msg[0], Op::ToolSilenced as u8);
    assert_eq!(&msg[1..5], &42i32.to_le_bytes());
    let addr = u64::from_le_bytes(msg[5..13].try_into().unwrap());
    let payload: &[u8; TOOL_PAYLOAD] = msg[MSG_LEN..].try_into().unwrap();
    let tool = SilencedTool::from_payload(addr, payload).expect("reads back");
    assert_eq!(tool, SilencedTool::new(4, 0x7000_0000, 16, words.to_vec()));
    // No word, too many, or no such tool: refused, so never told.
    assert!(tool_silenced_message(42, 0, (4, 16), &[]).is_err());
    assert!(tool_silenced_message(42, 0, (4, 16), &[(8, 8); TOOL_WORDS + 1]).is_err());
    assert!(tool_silenced_message(42, 0, (8, 16), &words).is_err());
    // A payload that makes no sense is dropped, not trusted.
    let mut bad = *payload;
    bad[0] = 0;
    assert_eq!(SilencedTool::from_payload(addr, &bad), None);
    bad = *payload;
    bad[2] = 0;
    assert_eq!(SilencedTool::from_payload(addr, &bad), None);
}
