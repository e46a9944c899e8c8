//! Records known already. Most records of a trace repeat an earlier one in all
//! that names their event: the same probe, file, function and line; only the
//! thread, the time and arguments such as a frame pointer differ. Once the
//! consumer has said what a record's event is for good (a token of its own),
//! [`RingReader::drain_known`](super::RingReader::drain_known) recognises a
//! record equal to it in the ring itself, word by word, and hands on the token:
//! nothing copied, no string measured or decoded.
//!
//! Equal means the same words where the kept record had them: the probe and
//! tag, the first [`KEY_ARGS`] arguments, the argument count with the string,
//! cut and NULL masks and the stack word, and each string's bytes up to and
//! including its NUL. Arguments past [`KEY_ARGS`] count only where the consumer
//! says they change the event ([`Token::key_args`]): an equal record must have
//! them word for word. Records carrying a stack,
//! or a string cut short (completed from the target's memory, which may
//! change), are never kept.
//!
//! A direct-mapped table: a record's place is a hash of its probe word and first
//! arguments, and keeping a record replaces what its place held (the older one
//! then takes the long way again, and is kept again).

use crate::ring::format::*;

use super::RingRecord;

/// Arguments that take part in a record's key: file, function and line for
/// CPython's function probes.
pub const KEY_ARGS: usize = 3;

/// How a consumer names a record's event for good: its token, and how many of its
/// first arguments an equal record must share (at least [`KEY_ARGS`]: more where a
/// later argument changes the event, as an entry's `f_lasti` makes it a resume).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token {
    pub token: u32,
    pub key_args: usize,
}

impl From<u32> for Token {
    fn from(token: u32) -> Token {
        Token {
            token,
            key_args: KEY_ARGS,
        }
    }
}
/// Places in the table: the functions a program calls most fit many times over.
const PLACES: usize = 4096;
/// Slot words a key is made of: the probe word and the first arguments.
pub(super) const KEY_WORDS: [usize; 1 + KEY_ARGS] = [S_PROBE, S_ARGS, S_ARGS + 8, S_ARGS + 16];

/// The records kept for one ring, each with its token.
pub struct KnownRecords {
    places: Vec<Option<Known>>,
    found: u64,
}

/// One kept record.
struct Known {
    key: [u64; 1 + KEY_ARGS],
    /// The other words a record must have: `(slot offset, mask, value)`.
    checks: Vec<(usize, u64, u64)>,
    token: u32,
}

impl Default for KnownRecords {
    fn default() -> KnownRecords {
        KnownRecords {
            places: std::iter::repeat_with(|| None).take(PLACES).collect(),
            found: 0,
        }
    }
}

impl std::fmt::Debug for KnownRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KnownRecords")
            .field("found", &self.found)
            .finish_non_exhaustive()
    }
}

impl KnownRecords {
    /// Whether `record` can be kept: no stack, every string whole.
    pub(crate) fn keepable(record: &RingRecord<'_>) -> bool {
        record.stack.is_none()
            && record.slot_word(S_NARGS) >> 32 == 0
            && (0..record.nargs).all(|i| record.string(i).is_none_or(|s| !s.truncated))
    }

    /// Keeps `record` (when [`keepable`](Self::keepable)) under `token`.
    pub(crate) fn keep(&mut self, record: &RingRecord<'_>, token: Token) {
        if !Self::keepable(record) {
            return;
        }
        let key = KEY_WORDS.map(|o| record.slot_word(o));
        let mut checks = vec![(S_NARGS, u64::MAX, record.slot_word(S_NARGS))];
        for i in KEY_ARGS..token.key_args.min(record.nargs) {
            let at = S_ARGS + 8 * i;
            checks.push((at, u64::MAX, record.slot_word(at)));
        }
        let token = token.token;
        for i in 0..record.nargs {
            let Some((start, len)) = record.string_span(i) else {
                continue;
            };
            // The string's bytes and its NUL, a word at a time.
            let end = start + len + 1;
            let mut at = start & !7;
            while at < end {
                let mut mask = 0u64;
                for byte in start.max(at)..end.min(at + 8) {
                    mask |= 0xff << (8 * (byte - at));
                }
                checks.push((at, mask, record.slot_word(at) & mask));
                at += 8;
            }
        }
        self.places[place_of(&key)] = Some(Known { key, checks, token });
    }

    /// The token of the record kept whose words `word` gives, if one is.
    #[inline]
    pub(super) fn find(&mut self, word: impl Fn(usize) -> u64) -> Option<u32> {
        let key = KEY_WORDS.map(&word);
        let known = self.places[place_of(&key)].as_ref()?;
        if known.key != key {
            return None;
        }
        for &(offset, mask, value) in &known.checks {
            if word(offset) & mask != value {
                return None;
            }
        }
        self.found += 1;
        Some(known.token)
    }

    /// Records recognised so far.
    pub fn found(&self) -> u64 {
        self.found
    }
}

/// The place of a key in the table.
#[inline]
fn place_of(key: &[u64; 1 + KEY_ARGS]) -> usize {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let h = key
        .iter()
        .fold(0u64, |h, &w| (h.rotate_left(5) ^ w).wrapping_mul(K));
    (h >> 52) as usize % PLACES
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::consumer::decode;

    /// A slot of `probe` with arguments file, function and line (the first two
    /// strings), and a fourth argument `extra` (a frame).
    fn slot(probe: u32, file: &[u8], function: &[u8], line: u64, extra: u64) -> [u8; SLOT_SIZE] {
        let mut s = [0xeeu8; SLOT_SIZE];
        s[..S_STRINGS].fill(0);
        s[S_PROBE..S_PROBE + 4].copy_from_slice(&probe.to_le_bytes());
        s[S_NARGS] = 4;
        s[S_STRING_MASK] = 0b11;
        for (i, a) in [0x1000u64, 0x2000, line, extra].iter().enumerate() {
            s[S_ARGS + 8 * i..S_ARGS + 8 * i + 8].copy_from_slice(&a.to_le_bytes());
        }
        for (k, text) in [file, function].into_iter().enumerate() {
            let (off, len) = string_area(k, 2).expect("area");
            let n = text.len().min(len);
            s[off..off + n].copy_from_slice(&text[..n]);
            if n < len {
                s[off + n] = 0;
            }
        }
        s
    }

    fn find(known: &mut KnownRecords, slot: &[u8; SLOT_SIZE]) -> Option<u32> {
        known.find(|o| u64::from_le_bytes(slot[o..o + 8].try_into().unwrap()))
    }

    #[test]
    fn a_record_equal_where_it_counts_is_found_with_its_token() {
        let mut known = KnownRecords::default();
        known.keep(&decode(0, &slot(0, b"app.py", b"fib", 5, 0x7000)), 7.into());
        // Another frame, time, thread and index, other bytes past the NULs.
        let mut again = slot(0, b"app.py", b"fib", 5, 0x7100);
        again[S_TSC] = 9;
        again[S_THREAD] = 3;
        let (off, _) = string_area(1, 2).unwrap();
        again[off + 4] = b'z';
        assert_eq!(find(&mut known, &again), Some(7));
        assert_eq!(known.found(), 1);
    }

    #[test]
    fn an_argument_past_the_key_counts_where_the_consumer_says_it_names_the_event() {
        // An entry whose fourth argument (f_lasti) makes it a call (-1) or a resume.
        let call = slot(0, b"app.py", b"gen", 5, u64::MAX);
        let resume = slot(0, b"app.py", b"gen", 5, 12);
        let mut known = KnownRecords::default();
        known.keep(
            &decode(0, &call),
            Token {
                token: 1,
                key_args: 4,
            },
        );
        assert_eq!(find(&mut known, &resume), None);
        assert_eq!(find(&mut known, &call), Some(1));
        // Not said: the fourth argument does not count.
        let mut known = KnownRecords::default();
        known.keep(&decode(0, &call), 2.into());
        assert_eq!(find(&mut known, &resume), Some(2));
    }

    #[test]
    fn any_difference_in_probe_tag_line_text_or_masks_is_not_found() {
        let mut known = KnownRecords::default();
        known.keep(&decode(0, &slot(0, b"app.py", b"fib", 5, 0)), 1.into());
        let mut others = vec![
            slot(1, b"app.py", b"fib", 5, 0),
            slot(0, b"app.py", b"fib", 6, 0),
            slot(0, b"app.py", b"fob", 5, 0),
            slot(0, b"app.pz", b"fib", 5, 0),
            slot(0, b"app.py", b"fibo", 5, 0),
            slot(0, b"app.py", b"fi", 5, 0),
        ];
        let mut tagged = slot(0, b"app.py", b"fib", 5, 0);
        tagged[S_TAG] = 1;
        let mut null = slot(0, b"app.py", b"fib", 5, 0);
        null[S_NULL] = 0b10;
        let mut three = slot(0, b"app.py", b"fib", 5, 0);
        three[S_NARGS] = 3;
        let mut stacked = slot(0, b"app.py", b"fib", 5, 0);
        stacked[S_NARGS + 4] = 1;
        others.extend([tagged, null, three, stacked]);
        for other in &others {
            assert_eq!(find(&mut known, other), None);
        }
        assert_eq!(known.found(), 0);
    }

    #[test]
    fn a_string_cut_short_is_never_kept() {
        let mut known = KnownRecords::default();
        let long = vec![b'x'; 200];
        let cut = slot(0, &long, b"fib", 5, 0);
        assert!(!KnownRecords::keepable(&decode(0, &cut)));
        known.keep(&decode(0, &cut), 3.into());
        assert_eq!(find(&mut known, &cut), None);
        let mut flagged = slot(0, b"app.py", b"fib", 5, 0);
        flagged[S_TRUNCATED] = 0b01;
        assert!(!KnownRecords::keepable(&decode(0, &flagged)));
    }

    #[test]
    fn keeping_a_record_replaces_the_one_in_its_place() {
        let mut known = KnownRecords::default();
        let first = slot(0, b"app.py", b"fib", 5, 0);
        known.keep(&decode(0, &first), 1.into());
        known.keep(&decode(1, &first), 2.into());
        assert_eq!(find(&mut known, &first), Some(2));
    }
}
