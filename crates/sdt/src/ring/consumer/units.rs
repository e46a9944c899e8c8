//! Draining a ring of [`Slots::Units`]: groups of 16-byte units, each published
//! by its first word, handed on as words and zeroed behind the reader.

use std::sync::atomic::Ordering;

use super::{DrainStop, Drained, RingReader};
use crate::ring::format::*;

/// Words of the longest group.
const MAX_GROUP_WORDS: usize = 2 * MAX_GROUP_UNITS;

/// Units a group is read this many ahead of are asked for (four cache lines on).
const PREFETCH_UNITS: u64 = 16;

impl RingReader {
    /// Reads up to `max` published groups of a ring of units, in order, calling
    /// `f` with the index of each and its words (two a unit, the first word
    /// first). Every unit read has its first word zeroed before `tail` moves past
    /// it (once, at the end, as [`drain`](Self::drain) does). Stops at a group not
    /// yet published, or one that claims more units than were reserved (a
    /// hostile or broken producer: it is left where it is, as unpublished).
    /// Reads nothing from a ring of records.
    pub fn drain_units<F: FnMut(u64, &[u64])>(&mut self, max: usize, mut f: F) -> Drained {
        let (head, budget) = self.begin_reading(max, Slots::Units);
        let mut words = [0u64; MAX_GROUP_WORDS];
        let mut groups = 0;
        let mut stop = None;
        while groups < budget {
            let index = self.tail;
            if index >= head {
                stop = Some(DrainStop::Empty);
                break;
            }
            let ahead = index.wrapping_add(PREFETCH_UNITS);
            if ahead < head {
                self.prefetch_unit(ahead);
            }
            let first = self.word(self.slot_offset(index)).load(Ordering::Acquire);
            let units = group_units(first);
            if first == 0 || head.wrapping_sub(index) < units {
                stop = Some(DrainStop::Pending { index });
                break;
            }
            for k in 0..units {
                let at = self.slot_offset(index.wrapping_add(k));
                let w = 2 * k as usize;
                words[w] = self.word(at).load(Ordering::Relaxed);
                words[w + 1] = self.word(at + 8).load(Ordering::Relaxed);
                // Zeroed before `tail` passes it: no first word left behind can
                // look published a lap later.
                self.word(at).store(0, Ordering::Relaxed);
            }
            words[0] = first;
            self.tail = index.wrapping_add(units);
            groups += 1;
            f(index, &words[..2 * units as usize]);
        }
        self.end_reading(groups, stop, head)
    }

    /// Asks for the cache line of unit `index` ahead of its read.
    #[inline]
    fn prefetch_unit(&self, index: u64) {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let at = self.slot_offset(index);
        // SAFETY: `at` is a unit's offset, inside the mapping (contract of `new`);
        // a prefetch reads nothing into the program and cannot fault.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(self.base.add(at).cast::<i8>()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A heap ring of `capacity` units, 8-aligned, standing in for the mapping.
    struct UnitRing {
        words: Vec<u64>,
    }

    impl UnitRing {
        fn new(capacity: u64) -> UnitRing {
            let len = ring_bytes(capacity, Slots::Units).expect("size");
            let mut ring = UnitRing {
                words: vec![0; len / 8],
            };
            // SAFETY: the u64 buffer viewed as its bytes.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(ring.words.as_mut_ptr().cast(), len) };
            init_ring(bytes, capacity, Slots::Units).expect("init");
            ring
        }

        fn reader(&mut self) -> RingReader {
            let len = self.words.len() * 8;
            // SAFETY: the buffer outlives the reader in each test.
            unsafe { RingReader::new(self.words.as_mut_ptr().cast(), len) }.expect("reader")
        }

        /// The producer's side: reserves `units`, writes `payload` into each
        /// unit's words (the first word last), and publishes the group unless
        /// `publish` is false.
        fn produce(&mut self, units: u64, tag: u64, publish: bool) -> u64 {
            let capacity = self.words[H_CAPACITY / 8];
            let head = self.words[H_HEAD / 8];
            self.words[H_HEAD / 8] = head + units;
            for k in (0..units).rev() {
                let at = (HEADER_SIZE + (((head + k) & (capacity - 1)) as usize) * UNIT_SIZE) / 8;
                self.words[at + 1] = tag * 100 + k;
                if k > 0 {
                    // A continuation unit's first word is the producer's own.
                    self.words[at] = u64::MAX;
                } else if publish {
                    self.words[at] = 1 | group_len_bits(units) | tag << 8;
                }
            }
            head
        }
    }

    fn drained(reader: &mut RingReader, max: usize) -> (Vec<(u64, Vec<u64>)>, DrainStop) {
        let mut got = Vec::new();
        let d = reader.drain_units(max, |index, words| got.push((index, words.to_vec())));
        assert_eq!(d.records, got.len());
        (got, d.stop)
    }

    #[test]
    fn groups_come_whole_in_order_and_are_zeroed_behind_the_reader() {
        let mut ring = UnitRing::new(16);
        ring.produce(1, 1, true);
        ring.produce(3, 2, true);
        let mut reader = ring.reader();
        let (got, stop) = drained(&mut reader, 10);
        assert_eq!(stop, DrainStop::Empty);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], (0, vec![1 | 1 << 8, 100]));
        assert_eq!(
            got[1],
            (
                1,
                vec![1 | 2 << 4 | 2 << 8, 200, u64::MAX, 201, u64::MAX, 202]
            )
        );
        assert_eq!(reader.tail(), 4);
        assert_eq!(ring.words[H_TAIL / 8], 4, "tail published");
        for unit in 0..4 {
            assert_eq!(
                ring.words[(HEADER_SIZE + unit * UNIT_SIZE) / 8],
                0,
                "unit {unit}"
            );
        }
    }

    #[test]
    fn a_group_spanning_the_ring_s_end_wraps_and_an_unpublished_one_waits() {
        let mut ring = UnitRing::new(8);
        let mut reader = ring.reader();
        for tag in 1..=5 {
            ring.produce(1, tag, true);
        }
        assert_eq!(drained(&mut reader, 10).0.len(), 5);
        // Units 5, 6, 7 and 0: across the end.
        ring.produce(4, 6, true);
        ring.produce(2, 7, false);
        let (got, stop) = drained(&mut reader, 10);
        assert_eq!(
            got,
            [(
                5,
                vec![
                    1 | 3 << 4 | 6 << 8,
                    600,
                    u64::MAX,
                    601,
                    u64::MAX,
                    602,
                    u64::MAX,
                    603
                ]
            )]
        );
        assert_eq!(stop, DrainStop::Pending { index: 9 });
        assert_eq!(reader.tail(), 9);
        // Published later: read then (unit 9 is slot 1).
        let at = (HEADER_SIZE + UNIT_SIZE) / 8;
        ring.words[at] = 1 | 1 << 4;
        assert_eq!(drained(&mut reader, 10).0.len(), 1);
        assert_eq!(reader.tail(), 11);
    }

    #[test]
    fn a_group_claiming_more_than_was_reserved_is_not_read() {
        let mut ring = UnitRing::new(16);
        let mut reader = ring.reader();
        ring.produce(2, 1, true);
        // Claims 16 units where 2 were reserved.
        ring.words[HEADER_SIZE / 8] = 1 | 15 << 4;
        let (got, stop) = drained(&mut reader, 10);
        assert!(got.is_empty());
        assert_eq!((stop, reader.tail()), (DrainStop::Pending { index: 0 }, 0));
    }

    #[test]
    fn each_reader_reads_only_its_own_kind_of_ring() {
        let mut units = UnitRing::new(8);
        units.produce(1, 1, true);
        let mut reader = units.reader();
        assert_eq!(reader.drain(10, |_| {}).records, 0);
        assert_eq!(reader.drain_fixed(10, |_| {}).records, 0);
        assert!(!reader.skip_pending());
        assert_eq!(reader.tail(), 0);
        assert_eq!(drained(&mut reader, 10).0.len(), 1);

        let len = ring_bytes(4, Slots::Records).expect("size");
        let mut words = vec![0u64; len / 8];
        // SAFETY: the u64 buffer viewed as its bytes; it outlives the reader.
        let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), len) };
        init_ring(bytes, 4, Slots::Records).expect("init");
        // SAFETY: as above.
        let mut records =
            unsafe { RingReader::new(words.as_mut_ptr().cast(), len) }.expect("reader");
        words[H_HEAD / 8] = 1;
        assert_eq!(drained(&mut records, 10).0.len(), 0);
    }
}
