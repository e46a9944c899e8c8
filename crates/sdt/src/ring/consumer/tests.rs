//! The reader on a heap ring filled by a model of the producer, hostile headers,
//! indices and stack records included.

use super::record::find_nul;
use super::*;
use proptest::prelude::*;

/// A heap ring, 8-aligned, standing in for the shared mapping.
struct TestRing {
    words: Vec<u64>,
}

impl TestRing {
    fn new(capacity: u64) -> TestRing {
        let len = ring_bytes(capacity, Slots::Records).expect("size");
        let mut ring = TestRing {
            words: vec![0; len / 8],
        };
        init_ring(ring.bytes(), capacity, Slots::Records).expect("init");
        ring
    }

    fn bytes(&mut self) -> &mut [u8] {
        let len = self.words.len() * 8;
        // SAFETY: a u64 buffer viewed as bytes, same length in bytes.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }

    fn reader(&mut self) -> Result<RingReader, RingError> {
        let len = self.words.len() * 8;
        // SAFETY: the buffer outlives the reader in every test below.
        unsafe { RingReader::new(self.words.as_mut_ptr().cast(), len) }
    }

    /// A Rust model of one producer (single-threaded).
    fn produce(&mut self, probe: u32, args: &[u64], strings: &[Option<&[u8]>]) -> bool {
        let bytes = self.bytes();
        let get = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8"));
        let (head, tail) = (get(bytes, H_HEAD), get(bytes, H_TAIL));
        let capacity = get(bytes, H_CAPACITY);
        if head - tail >= capacity {
            let lost = get(bytes, H_LOST) + 1;
            bytes[H_LOST..H_LOST + 8].copy_from_slice(&lost.to_le_bytes());
            return false;
        }
        bytes[H_HEAD..H_HEAD + 8].copy_from_slice(&(head + 1).to_le_bytes());
        let s = HEADER_SIZE + ((head & (capacity - 1)) as usize) * SLOT_SIZE;
        let slot = &mut bytes[s..s + SLOT_SIZE];
        slot[S_TSC..S_TSC + 8].copy_from_slice(&(100 + head).to_le_bytes());
        slot[S_PROBE..S_PROBE + 4].copy_from_slice(&probe.to_le_bytes());
        slot[S_NARGS] = args.len() as u8;
        for (i, a) in args.iter().enumerate() {
            slot[S_ARGS + 8 * i..S_ARGS + 8 * i + 8].copy_from_slice(&a.to_le_bytes());
        }
        let count = strings.iter().filter(|s| s.is_some()).count();
        let (mut mask, mut trunc, mut k) = (0u8, 0u8, 0);
        for (i, s) in strings.iter().enumerate() {
            let Some(s) = s else { continue };
            mask |= 1 << i;
            let (off, len) = string_area(k, count).expect("area");
            k += 1;
            let n = s.len().min(len - 1);
            slot[off..off + n].copy_from_slice(&s[..n]);
            slot[off + n] = 0;
            if s.len() > n {
                trunc |= 1 << i;
            }
        }
        slot[S_STRING_MASK] = mask;
        slot[S_TRUNCATED] = trunc;
        slot[S_SEQ..S_SEQ + 8].copy_from_slice(&(head + 1).to_le_bytes());
        true
    }
}

#[test]
fn drains_in_order_and_frees_slots() {
    let mut ring = TestRing::new(4);
    let long = [b'x'; 200];
    for i in 0..3u64 {
        assert!(ring.produce(7, &[i, 0, 0], &[None, Some(b"fib"), Some(&long)]));
    }
    let mut reader = ring.reader().expect("valid");
    let mut seen = Vec::new();
    let out = reader.drain(100, |r| {
        let fib = r.strings()[1].expect("string 1");
        let big = r.strings()[2].expect("string 2");
        assert_eq!(
            (fib.bytes, fib.truncated, fib.null),
            (&b"fib"[..], false, false)
        );
        assert!(big.truncated && big.bytes.len() == 83);
        assert!(r.strings()[0].is_none());
        seen.push((r.index, r.probe, r.args[0], r.nargs, r.tsc));
    });
    assert_eq!(
        out,
        Drained {
            records: 3,
            stop: DrainStop::Empty
        }
    );
    assert_eq!(seen[2], (2, 7, 2, 3, 102));
    // tail was published: the producer can fill the ring again (4 slots).
    for _ in 0..4 {
        assert!(ring.produce(1, &[], &[]));
    }
    assert!(!ring.produce(1, &[], &[]));
    assert_eq!(reader.lost(), 1);
    assert_eq!(reader.drain(2, |_| {}).stop, DrainStop::Limit);
    assert_eq!(reader.drain(9, |_| {}).records, 2);
}

#[test]
fn unpublished_slot_stops_and_can_be_skipped() {
    let mut ring = TestRing::new(8);
    assert!(ring.produce(1, &[], &[]));
    assert!(ring.produce(2, &[], &[]));
    // Unpublish slot 1 (as if its producer had not finished), then add one more.
    let s = HEADER_SIZE + SLOT_SIZE;
    ring.bytes()[s..s + 8].fill(0);
    assert!(ring.produce(3, &[], &[]));
    let mut reader = ring.reader().expect("valid");
    let out = reader.drain(10, |r| assert_eq!(r.probe, 1));
    assert_eq!(out.stop, DrainStop::Pending { index: 1 });
    assert_eq!(reader.drain(10, |_| {}).records, 0);
    assert!(reader.skip_pending());
    assert!(!reader.skip_pending());
    assert_eq!((reader.lost(), reader.skipped()), (1, 1));
    let mut probes = Vec::new();
    reader.drain(10, |r| probes.push(r.probe));
    assert_eq!(probes, [3]);
}

#[test]
fn rejects_corrupt_headers() {
    let mut ring = TestRing::new(4);
    type Check = fn(&RingError) -> bool;
    let cases: [(usize, u8, Check); 5] = [
        (H_MAGIC, b'X', |e| matches!(e, RingError::BadMagic(_))),
        (H_VERSION, 9, |e| matches!(e, RingError::BadVersion(9))),
        (H_SLOT_SIZE + 1, 2, |e| {
            matches!(e, RingError::BadSlotSize(512))
        }),
        (H_CAPACITY, 8, |e| {
            matches!(e, RingError::LengthMismatch { .. })
        }),
        (H_CAPACITY, 3, |e| matches!(e, RingError::BadCapacity(3))),
    ];
    for (offset, byte, check) in cases {
        let saved = ring.bytes()[offset];
        ring.bytes()[offset] = byte;
        let err = ring.reader().expect_err("corrupt header accepted");
        assert!(check(&err), "{offset}: {err}");
        assert!(!err.to_string().is_empty());
        ring.bytes()[offset] = saved;
    }
    assert!(ring.reader().is_ok());
    let mut small = [0u64; 8];
    // SAFETY: valid 64-byte buffer.
    let err = unsafe { RingReader::new(small.as_mut_ptr().cast(), 64) };
    assert_eq!(err.err(), Some(RingError::TooSmall(64)));
}

#[test]
fn hostile_indices_are_bounded() {
    let mut ring = TestRing::new(4);
    let mut reader = ring.reader().expect("valid");
    // head far ahead with nothing published: stops at once.
    ring.bytes()[H_HEAD..H_HEAD + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let out = reader.drain(usize::MAX, |_| {});
    assert_eq!(out.stop, DrainStop::Pending { index: 0 });
    // Slots whose seq happens to match but whose contents are garbage.
    for i in 0..4u64 {
        let s = HEADER_SIZE + (i as usize) * SLOT_SIZE;
        ring.bytes()[s..s + SLOT_SIZE].fill(0xff);
        ring.bytes()[s..s + 8].copy_from_slice(&(i + 1).to_le_bytes());
    }
    let out = reader.drain(usize::MAX, |r| {
        assert_eq!(r.nargs, MAX_ARGS);
        for s in r.strings().iter().flatten() {
            assert!(s.truncated && s.null && s.bytes.len() == 28);
        }
    });
    // One drain reads at most `capacity` records, whatever head says.
    assert_eq!(out.records, 4);
    assert_eq!(out.stop, DrainStop::Limit);
    let out = reader.drain(usize::MAX, |_| {});
    assert_eq!(out.stop, DrainStop::Pending { index: 4 });
}

proptest! {
    #[test]
    fn find_nul_agrees_with_a_byte_scan(
        bytes in proptest::collection::vec(prop::sample::select(vec![0u8, 1, 0x7f, 0x80, 0xfe, 0xff]), 0..100)
    ) {
        prop_assert_eq!(find_nul(&bytes), bytes.iter().position(|&b| b == 0));
    }

    #[test]
    fn random_headers_never_panic(header in proptest::collection::vec(any::<u8>(), 256)) {
        let mut ring = TestRing::new(4);
        ring.bytes()[..256].copy_from_slice(&header);
        if let Ok(mut reader) = ring.reader() {
            let _ = reader.drain(16, |_| {});
            let _ = reader.skip_pending();
        }
    }

    #[test]
    fn a_drained_record_is_what_decoding_its_whole_slot_gives(
        bytes in proptest::collection::vec(
            prop::sample::select(vec![0u8, 1, 2, 3, 7, 0x2f, 0x61, 0x80, 0xff]),
            SLOT_SIZE,
        ),
    ) {
        let mut ring = TestRing::new(2);
        let mut slot = [0u8; SLOT_SIZE];
        slot.copy_from_slice(&bytes);
        slot[S_SEQ..S_SEQ + 8].copy_from_slice(&1u64.to_le_bytes());
        // No stack claimed: this compares the record's own fields and strings.
        slot[S_STACK_SLOTS] = 0;
        put_slot(&mut ring, 0, 1, &[(S_TSC, &slot[S_TSC..])]);
        set_head(&mut ring, 1);
        let mut reader = ring.reader().expect("valid");
        let expected = decode(0, &slot);
        let mut differs = None;
        let out = reader.drain(1, |r| {
            if *r != expected {
                differs = Some(format!("{r:?}"));
            }
        });
        prop_assert_eq!(out.records, 1);
        prop_assert_eq!(differs, None, "decoding the whole slot gives {:?}", expected);
    }

    #[test]
    fn random_slots_decode(bytes in proptest::collection::vec(any::<u8>(), SLOT_SIZE)) {
        let mut slot = [0u8; SLOT_SIZE];
        slot.copy_from_slice(&bytes);
        let r = decode(0, &slot);
        prop_assert!(r.nargs <= MAX_ARGS);
        for s in r.strings().iter().flatten() {
            prop_assert!(s.bytes.len() <= STRINGS_LEN);
        }
    }
}

/// Writes slot `index` raw: `seq`, then `fields` as (offset, bytes).
fn put_slot(ring: &mut TestRing, index: u64, seq: u64, fields: &[(usize, &[u8])]) {
    let bytes = ring.bytes();
    let capacity = u64::from_le_bytes(bytes[H_CAPACITY..H_CAPACITY + 8].try_into().expect("8"));
    let s = HEADER_SIZE + ((index & (capacity - 1)) as usize) * SLOT_SIZE;
    for (o, b) in fields {
        bytes[s + o..s + o + b.len()].copy_from_slice(b);
    }
    bytes[s..s + 8].copy_from_slice(&seq.to_le_bytes());
}

fn set_head(ring: &mut TestRing, head: u64) {
    ring.bytes()[H_HEAD..H_HEAD + 8].copy_from_slice(&head.to_le_bytes());
}

/// A first slot claiming `slots` continuation slots and `depth` frames.
fn stack_head(ring: &mut TestRing, index: u64, slots: u8, depth: u16) {
    let meta = [
        slots,
        STACK_CAPTURED | STACK_FOUND,
        depth as u8,
        (depth >> 8) as u8,
    ];
    put_slot(ring, index, index + 1, &[(S_STACK_SLOTS, &meta)]);
}

fn continuation(ring: &mut TestRing, index: u64, owner: u64, pairs: &[(u64, u64)]) {
    let mut body = Vec::new();
    for (c, p) in pairs {
        body.extend_from_slice(&c.to_le_bytes());
        body.extend_from_slice(&p.to_le_bytes());
    }
    let owner = owner.to_le_bytes();
    put_slot(
        ring,
        index,
        continuation_seq(index),
        &[(C_OWNER, &owner), (C_PAIRS, &body)],
    );
}

#[test]
fn stack_records_are_checked_before_they_are_trusted() {
    let mut ring = TestRing::new(16);
    // 0: a good record of 1 + 2 slots, 3 frames: the first three pairs.
    stack_head(&mut ring, 0, 2, 3);
    let pairs: Vec<(u64, u64)> = (0..PAIRS_PER_SLOT as u64)
        .map(|k| (0x1000 + k, k))
        .collect();
    continuation(&mut ring, 1, 0, &pairs);
    continuation(&mut ring, 2, 0, &pairs);
    // 3: a record whose second continuation names another owner: broken, 3 slots.
    stack_head(&mut ring, 3, 2, 2);
    continuation(&mut ring, 4, 3, &pairs);
    continuation(&mut ring, 5, 99, &pairs);
    // 6: claims more slots than a record can have: broken, takes only its own.
    stack_head(&mut ring, 6, MAX_STACK_SLOTS + 1, 2);
    // 7: claims slots past what producers reserved (head is 8): broken, 1 slot.
    stack_head(&mut ring, 7, 2, 2);
    set_head(&mut ring, 8);
    let mut reader = ring.reader().expect("reader");
    let mut got = Vec::new();
    let out = reader.drain(100, |r| {
        got.push((r.index, r.stack.clone().expect("stack")))
    });
    assert_eq!(out.stop, DrainStop::Empty);
    let summary: Vec<_> = got
        .iter()
        .map(|(i, s)| (*i, s.broken, s.frames.len(), s.depth))
        .collect();
    assert_eq!(
        summary,
        [
            (0, false, 3, 3),
            (3, true, 0, 2),
            (6, true, 0, 2),
            (7, true, 0, 2)
        ]
    );
    assert_eq!(got[0].1.frames, pairs[..3]);
    assert_eq!(reader.tail(), 8);
    // A continuation slot is never read as a record of its own, even at the tail.
    continuation(&mut ring, 8, 7, &pairs);
    set_head(&mut ring, 9);
    let mut reader = ring.reader().expect("reader");
    assert_eq!(reader.tail(), 8);
    let out = reader.drain(100, |_| panic!("a continuation slot read as a record"));
    assert_eq!(out.stop, DrainStop::Pending { index: 8 });
}

#[test]
fn a_bounded_drain_leaves_what_was_stamped_later() {
    let mut ring = TestRing::new(8);
    let mut reader = ring.reader().expect("reader");
    // The model stamps slot i with 100 + i.
    for _ in 0..5 {
        assert!(ring.produce(1, &[], &[]));
    }
    reader.set_tsc_bound(102);
    let mut stamps = Vec::new();
    let out = reader.drain(100, |r| stamps.push(r.tsc));
    assert_eq!(
        (stamps.as_slice(), out.stop),
        (&[100, 101, 102][..], DrainStop::Later)
    );
    // Left in the ring, not lost: read once the bound moves on.
    reader.set_tsc_bound(u64::MAX);
    stamps.clear();
    let out = reader.drain(100, |r| stamps.push(r.tsc));
    assert_eq!(
        (stamps.as_slice(), out.stop),
        (&[103, 104][..], DrainStop::Empty)
    );
    assert_eq!(reader.lost(), 0);
}

/// The strings area is copied only for records with strings: one without, read
/// into the copy an earlier one with strings used, reads none of its strings, and
/// one with strings after it reads its own.
#[test]
fn records_without_strings_take_none_of_an_earlier_ones() {
    let mut ring = TestRing::new(8);
    assert!(ring.produce(1, &[1, 0], &[Some(b"first"), Some(b"second")]));
    assert!(ring.produce(2, &[2, 0], &[None, None]));
    assert!(ring.produce(3, &[3, 0], &[None, Some(b"third")]));
    let mut reader = ring.reader().expect("valid");
    let mut seen = Vec::new();
    // One record per drain: each is copied into the same buffer.
    for _ in 0..3 {
        reader.drain(1, |r| {
            let texts: Vec<Option<Vec<u8>>> = r.strings()[..2]
                .iter()
                .map(|s| s.map(|s| s.bytes.to_vec()))
                .collect();
            seen.push((r.probe, texts));
        });
    }
    assert_eq!(
        seen,
        [
            (1, vec![Some(b"first".to_vec()), Some(b"second".to_vec())]),
            (2, vec![None, None]),
            (3, vec![None, Some(b"third".to_vec())]),
        ]
    );
}

/// A continuation slot is read whole, whatever its bytes look like where a
/// record keeps its string mask: a code pointer with a zero there must not cut
/// the frames after it.
#[test]
fn continuation_slots_are_read_whole() {
    let mut ring = TestRing::new(8);
    let depth = PAIRS_PER_SLOT as u16;
    stack_head(&mut ring, 0, 1, depth);
    // Pair 4's code pointer sits over the record's string mask; its second byte is 0.
    let pairs: Vec<(u64, u64)> = (0..PAIRS_PER_SLOT as u64)
        .map(|k| (0x7f00_0000_0012 + (k << 16), k + 1))
        .collect();
    assert_eq!(
        pairs[4].0.to_le_bytes()[S_STRING_MASK - C_PAIRS - 64],
        0,
        "the test puts a zero at the string mask's place"
    );
    continuation(&mut ring, 1, 0, &pairs);
    set_head(&mut ring, 2);
    let mut reader = ring.reader().expect("reader");
    let mut frames = Vec::new();
    reader.drain(10, |r| frames = r.stack.clone().expect("stack").frames);
    assert_eq!(frames, pairs);
}

/// A shorter name after a longer one in the same copy buffer reads as itself, not
/// with the longer one's tail.
#[test]
fn a_shorter_string_after_a_longer_one_reads_as_itself() {
    let mut ring = TestRing::new(8);
    let long = b"/a/rather/long/path/to/some/module/file.py";
    assert!(ring.produce(1, &[1, 0], &[Some(long), Some(b"function_name")]));
    assert!(ring.produce(1, &[1, 0], &[Some(b"x.py"), Some(b"f")]));
    assert!(ring.produce(1, &[1, 0], &[Some(b""), Some(b"")]));
    let mut reader = ring.reader().expect("valid");
    let mut seen = Vec::new();
    for _ in 0..3 {
        reader.drain(1, |r| {
            let texts: Vec<Vec<u8>> = r.strings()[..2]
                .iter()
                .map(|s| s.expect("a string").bytes.to_vec())
                .collect();
            seen.push(texts);
        });
    }
    assert_eq!(
        seen,
        [
            vec![long.to_vec(), b"function_name".to_vec()],
            vec![b"x.py".to_vec(), b"f".to_vec()],
            vec![Vec::new(), Vec::new()],
        ]
    );
}

/// What a record says, but for its arguments past the key (a frame pointer):
/// what a known record must share with the one kept.
type Said = (
    u64,
    u64,
    u32,
    u64,
    u32,
    usize,
    Vec<u64>,
    Vec<Option<(Vec<u8>, bool, bool)>>,
);

fn said(r: &RingRecord<'_>) -> Said {
    let strings = (0..r.nargs)
        .map(|i| r.string(i).map(|s| (s.bytes.to_vec(), s.truncated, s.null)))
        .collect();
    let key = r.args[..r.nargs.min(KEY_ARGS)].to_vec();
    (
        r.index, r.tsc, r.tag, r.thread, r.probe, r.nargs, key, strings,
    )
}

proptest! {
    /// Draining with records kept hands on the same records as a plain drain:
    /// each known one is what its token's record said, bar index, time, tag
    /// and thread, which it gives itself.
    #[test]
    fn known_records_say_what_a_plain_drain_says(
        shapes in proptest::collection::vec((0u32..2, 0usize..3, 0usize..2, 1u64..4, any::<u64>()), 1..200),
    ) {
        let long = [b'f'; 120];
        let files: [&[u8]; 3] = [b"app.py", b"/usr/lib/python3.9/json/decoder.py", &long];
        let functions: [&[u8]; 2] = [b"fib", b"__init__"];
        let mut ring = TestRing::new(256);
        for &(probe, file, function, line, frame) in &shapes {
            let strings = [Some(files[file]), Some(functions[function])];
            prop_assert!(ring.produce(probe, &[0x10 + file as u64, 0x20 + function as u64, line, frame], &strings));
        }
        let mut plain = Vec::new();
        let mut reader = ring.reader().expect("reader");
        reader.drain(usize::MAX, |r| plain.push(said(r)));
        // Again from the start, keeping every record that can be.
        let mut ring_again = TestRing::new(256);
        for &(probe, file, function, line, frame) in &shapes {
            let strings = [Some(files[file]), Some(functions[function])];
            ring_again.produce(probe, &[0x10 + file as u64, 0x20 + function as u64, line, frame], &strings);
        }
        let mut reader = ring_again.reader().expect("reader");
        let (mut known, mut kept, mut drawn) = (KnownRecords::default(), Vec::<Said>::new(), Vec::new());
        let mut found = 0;
        reader.drain_known(usize::MAX, &mut known, |d| match d {
            Drawn::Known(k) => {
                found += 1;
                let mut s = kept[k.token as usize].clone();
                (s.0, s.1, s.2, s.3) = (k.index, k.tsc, k.tag, k.thread);
                drawn.push(s);
                None
            }
            Drawn::Record(r) => {
                drawn.push(said(r));
                kept.push(said(r));
                Some((kept.len() as u32 - 1).into())
            }
        });
        prop_assert_eq!(&drawn, &plain);
        prop_assert_eq!(known.found(), found);
        // A repeat of a record whose strings are whole is known.
        let whole = shapes.iter().filter(|s| s.1 != 2).count();
        if whole > 64 {
            prop_assert!(found > 0);
        }
    }
}

/// What a record says, whole: index, time, probe, tag, thread, every argument,
/// every string.
type SaidWhole = (u64, u64, u32, u32, u64, Vec<u64>, Vec<Option<Vec<u8>>>);

fn said_whole(r: &RingRecord<'_>) -> SaidWhole {
    let strings = (0..MAX_ARGS)
        .map(|i| r.string(i).map(|s| s.bytes.to_vec()))
        .collect();
    (
        r.index,
        r.tsc,
        r.probe,
        r.tag,
        r.thread,
        r.args.to_vec(),
        strings,
    )
}

proptest! {
    /// Draining plain records in place hands on what a plain drain does: the
    /// same records, in order, those without strings read from their words.
    #[test]
    fn fixed_records_say_what_a_plain_drain_says(
        shapes in proptest::collection::vec((0u32..4, 0usize..7, any::<bool>(), any::<u64>()), 1..200),
    ) {
        let fill = |ring: &mut TestRing| {
            for &(probe, nargs, with_string, value) in &shapes {
                let args: Vec<u64> = (0..nargs as u64).map(|i| value.rotate_left(i as u32 * 9)).collect();
                let strings: Vec<Option<&[u8]>> = match (with_string, nargs) {
                    (true, 1..) => vec![Some(b"fib".as_slice())],
                    _ => vec![],
                };
                assert!(ring.produce(probe, &args, &strings));
            }
        };
        let mut ring = TestRing::new(256);
        fill(&mut ring);
        let mut plain = Vec::new();
        let mut reader = ring.reader().expect("reader");
        reader.drain(usize::MAX, |r| plain.push(said_whole(r)));
        let mut again = TestRing::new(256);
        fill(&mut again);
        let mut reader = again.reader().expect("reader");
        let (mut drawn, mut fixed) = (Vec::new(), 0);
        let drained = reader.drain_fixed(usize::MAX, |p| match p {
            Plain::Fixed(r) => {
                fixed += 1;
                drawn.push((r.index, r.tsc, r.probe, r.tag, r.thread, r.args.to_vec(), vec![None; MAX_ARGS]));
            }
            Plain::Copied(r) => drawn.push(said_whole(r)),
        });
        prop_assert_eq!(&drawn, &plain);
        prop_assert_eq!(drained.records, shapes.len());
        prop_assert_eq!(drained.stop, DrainStop::Empty);
        let without = shapes.iter().filter(|s| !s.2 || s.1 == 0).count();
        prop_assert_eq!(fixed, without, "every record without a string is read in place");
        prop_assert_eq!(reader.tail(), shapes.len() as u64);
    }
}

#[test]
fn a_fixed_drain_stops_at_an_unpublished_slot_and_copies_stack_records() {
    let mut ring = TestRing::new(8);
    assert!(ring.produce(1, &[10, 20], &[]));
    assert!(ring.produce(2, &[30], &[]));
    // Slot 1 reserved but not published: the drain stops before it.
    put_slot(&mut ring, 1, 0, &[]);
    let mut reader = ring.reader().expect("reader");
    let mut seen = Vec::new();
    let drained = reader.drain_fixed(usize::MAX, |p| {
        if let Plain::Fixed(r) = p {
            seen.push((r.index, r.probe, r.nargs, r.args[0], r.args[1]));
        }
    });
    assert_eq!(seen, [(0, 1, 2, 10, 20)]);
    assert_eq!(drained.stop, DrainStop::Pending { index: 1 });
    // A record claiming a stack is never read in place.
    let mut ring = TestRing::new(8);
    stack_head(&mut ring, 0, 1, 2);
    continuation(&mut ring, 1, 0, &[(0x1000, 7), (0x2000, 9)]);
    set_head(&mut ring, 2);
    let mut reader = ring.reader().expect("reader");
    let (mut copied, mut fixed) = (0, 0);
    reader.drain_fixed(usize::MAX, |p| match p {
        Plain::Fixed(_) => fixed += 1,
        Plain::Copied(r) => {
            copied += 1;
            assert_eq!(r.stack.as_ref().map(|s| s.frames.len()), Some(2));
        }
    });
    assert_eq!((copied, fixed), (1, 0));
}
