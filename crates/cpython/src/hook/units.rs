//! The hook's compact records, as the callbacks write them into a ring of units
//! ([`Slots::Units`](pyprobe_sdt::ring::Slots)) and as pyprobe reads them back.
//!
//! An event is one unit of 16 bytes: its kind and time in the first word, its
//! code object in the second. What does not change from event to event is sent
//! once, in units of its own before the event, and remembered on both sides:
//!
//! | first word's kind | second word | what the reader remembers |
//! | --- | --- | --- |
//! | [`U_THREAD`] | the thread's `%fs` base | the thread of the events after it |
//! | [`U_TYPE`] (`aux`: entry + 1) | a type object | entry `aux - 1` of the types table |
//! | [`U_PARTS`], a group of [`GROUP_UNITS`] | the code object | its parts, in the sent table, and their text |
//! | [`U_BODY`], a group of [`GROUP_UNITS`] | the code object | its parts and text, for the next event only |
//! | 1 + a record kind (call, return, raise, resume) | the code object | nothing: an event |
//!
//! First word: bits 0..4 the kind (never 0: that is what publishes it), 4..8
//! the group's units less one, 8..16 `aux` (an event's returned type: its
//! entry in the types table + 1, or 0), 16..64 an event's time-stamp counter, its
//! low 48 bits. A group's units after the first hold, as words: the `co_name`
//! and `co_filename` pointers, the first line and the strings' identity check
//! (see `codegen::record`), then from byte [`TEXT_AT`] the text "NAME\x01FILE",
//! NUL-terminated (empty when it does not fit or is not compact ASCII).
//!
//! The types table and the sent table (the parts last sent for a code object,
//! by [`table_index`] of its address) live in the hook's state pages and in the
//! reader alike; both start empty at each attach (pyprobe clears the hook's,
//! every thread stopped). The callbacks run with the GIL held, one at a time
//! (the hook engine refuses free-threaded builds), so the order of the units in
//! the ring is the order in which the tables changed, and a reader that reads
//! every unit in order knows what the hook knew. A unit lost (the ring full
//! while nobody serves it) leaves the hook's table unchanged too: it is written
//! only once its unit was reserved.

use crate::hook::{KIND_CALL, KIND_RESUME};

/// Kinds of the units that are not events (an event's is its record kind + 1).
pub(crate) const U_THREAD: u64 = 5;
pub(crate) const U_TYPE: u64 = 6;
pub(crate) const U_PARTS: u64 = 7;
pub(crate) const U_BODY: u64 = 8;
/// Units of a parts or body group (a fixed length: the hook reserves them at once).
pub(crate) const GROUP_UNITS: u64 = 16;
/// Where in a group its text starts, in bytes, and its longest text.
pub(crate) const TEXT_AT: usize = 48;
pub(crate) const TEXT_MAX: usize = GROUP_UNITS as usize * 16 - TEXT_AT - 1;
/// The first word's fields.
pub(crate) const AUX_SHIFT: u32 = 8;
pub(crate) const STAMP_SHIFT: u32 = 16;
const STAMP_BITS: u32 = 64 - STAMP_SHIFT;
/// Entries of the types table (an event's `aux` holds one + 1, in 8 bits).
pub(crate) const TYPE_ENTRIES: usize = 64;
/// Entries of the sent table: a program's hot code objects, with few of them
/// sharing an entry (black on 3.15: 0.4 % of its events find their entry holding
/// another code object's parts, against 9.7 % with 64 entries).
pub(crate) const SENT_ENTRIES: usize = 1024;
/// Words of a sent table entry: code object, name and file pointers, first line,
/// identity check, and one unused (an entry is 48 bytes).
pub(crate) const SENT_WORDS: usize = 6;

/// The entry of an object at `addr` in a table of `entries` (a power of two; the
/// hook computes the same). Objects are 16-byte aligned and some hundred bytes apart.
pub(crate) const fn table_index(addr: u64, entries: usize) -> usize {
    (((addr >> 4) ^ (addr >> 10)) as usize) & (entries - 1)
}

/// One event, as the reader rebuilds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decoded {
    /// A record kind: call, return, raise or resume, never another.
    pub(crate) kind: u32,
    /// The `%fs` base of its thread (0: none said yet).
    pub(crate) thread: u64,
    /// Code object, `co_name`, `co_filename`, first line, identity check: those
    /// last sent for this code object; only the code object when none were.
    pub(crate) parts: [u64; 5],
    /// The returned object's type (0: none).
    pub(crate) ty: u64,
    pub(crate) stamp: u64,
    /// The texts sent with it, if any (few events have any: boxed, so that an
    /// event stays small).
    pub(crate) texts: Option<Box<Texts>>,
}

/// The texts an event came with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Texts {
    /// A body's name and file, sent with this event (before 3.12).
    pub(crate) body: Option<String>,
    /// A call's name and file: the text sent with its parts, given to the first
    /// call after they were sent.
    pub(crate) call: Option<String>,
}

/// What a parts or body group carried: an entry of the reader's sent table
/// (its text kept until a call takes it), or a body's, for the event after it.
#[derive(Debug, Clone, Default)]
struct Sent {
    parts: [u64; 5],
    text: Option<String>,
}

/// The reader's side: the same tables as the hook's, rebuilt unit by unit.
#[derive(Debug, Clone)]
pub(crate) struct UnitDecoder {
    thread: u64,
    types: [u64; TYPE_ENTRIES],
    sent: Vec<Sent>,
    body: Option<Sent>,
}

impl Default for UnitDecoder {
    fn default() -> UnitDecoder {
        UnitDecoder {
            thread: 0,
            types: [0; TYPE_ENTRIES],
            sent: vec![Sent::default(); SENT_ENTRIES],
            body: None,
        }
    }
}

impl UnitDecoder {
    /// Takes one group (its words, as the ring held them); returns the event it
    /// is, if it is one. `now` is a time-stamp counter read before the group was:
    /// an event's time is the value whose low bits it carries nearest below it.
    /// Words a hostile target wrote decode as something (an unknown kind or a
    /// group of the wrong length is passed over), never as a panic.
    #[inline]
    pub(crate) fn decode(&mut self, words: &[u64], now: u64) -> Option<Decoded> {
        let (&first, &code) = (words.first()?, words.get(1)?);
        let kind = first & 0xf;
        if !(1..=4).contains(&kind) {
            self.take_other(words);
            return None;
        }
        // An event: most come with nothing sent before them.
        let kind = kind as u32 - 1;
        let aux = ((first >> AUX_SHIFT) & 0xff) as usize;
        let ty = aux
            .checked_sub(1)
            .map_or(0, |e| self.types[e & (TYPE_ENTRIES - 1)]);
        let mut decoded = Decoded {
            kind,
            thread: self.thread,
            parts: [code, 0, 0, 0, 0],
            ty,
            stamp: widen_stamp(first >> STAMP_SHIFT, now),
            texts: None,
        };
        if self.body.is_some() {
            self.with_body(&mut decoded);
            return Some(decoded);
        }
        let sent = &mut self.sent[table_index(code, SENT_ENTRIES)];
        if sent.parts[0] == code {
            decoded.parts = sent.parts;
            if kind == KIND_CALL && sent.text.is_some() {
                decoded.texts = Some(Box::new(Texts {
                    body: None,
                    call: sent.text.take(),
                }));
            }
        }
        debug_assert!(kind <= KIND_RESUME);
        Some(decoded)
    }

    /// A unit that is not an event: what it says is remembered.
    #[cold]
    fn take_other(&mut self, words: &[u64]) {
        let (first, second) = (words[0], words[1]);
        let aux = (first >> AUX_SHIFT) & 0xff;
        match first & 0xf {
            U_THREAD => self.thread = second,
            U_TYPE => {
                if let Some(entry) = (aux as usize).checked_sub(1) {
                    self.types[entry & (TYPE_ENTRIES - 1)] = second;
                }
            }
            kind @ (U_PARTS | U_BODY) if words.len() == 2 * GROUP_UNITS as usize => {
                let sent = Sent {
                    parts: [second, words[2], words[3], words[4], words[5]],
                    text: group_text(words),
                };
                if kind == U_BODY {
                    self.body = Some(sent);
                } else {
                    self.sent[table_index(second, SENT_ENTRIES)] = sent;
                }
            }
            _ => {}
        }
    }

    /// The event right after a body group: the body's parts and text, if it is
    /// the same code object.
    #[cold]
    fn with_body(&mut self, decoded: &mut Decoded) {
        if let Some(body) = self.body.take().filter(|b| b.parts[0] == decoded.parts[0]) {
            decoded.parts = body.parts;
            decoded.texts = Some(Box::new(Texts {
                body: body.text,
                call: None,
            }));
        }
    }
}

/// The group's text: its bytes from [`TEXT_AT`] to the first NUL (none: no text,
/// also when empty).
fn group_text(words: &[u64]) -> Option<String> {
    let bytes: Vec<u8> = words
        .iter()
        .skip(TEXT_AT / 8)
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let end = bytes.iter().position(|&b| b == 0)?;
    (end > 0).then(|| String::from_utf8_lossy(&bytes[..end]).into_owned())
}

/// The full counter value whose low [`STAMP_BITS`] bits are `low`, nearest to
/// `now` (a record is read after it is written, or a little before `now` was read
/// when read in the same drain).
fn widen_stamp(low: u64, now: u64) -> u64 {
    let span = 1u64 << STAMP_BITS;
    let candidate = (now & !(span - 1)) | (low & (span - 1));
    if candidate > now.saturating_add(span / 2) {
        candidate.wrapping_sub(span)
    } else if candidate.saturating_add(span / 2) < now {
        candidate.wrapping_add(span)
    } else {
        candidate
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hook::KIND_RETURN;
    use pyprobe_sdt::ring::format::group_len_bits;

    fn event(kind: u32, aux: u64, stamp: u64, code: u64) -> [u64; 2] {
        [
            u64::from(kind + 1) | aux << AUX_SHIFT | stamp << STAMP_SHIFT,
            code,
        ]
    }

    fn group(kind: u64, parts: [u64; 5], text: &str) -> Vec<u64> {
        let mut bytes = vec![0u8; GROUP_UNITS as usize * 16];
        bytes[..8].copy_from_slice(&(kind | group_len_bits(GROUP_UNITS)).to_le_bytes());
        for (k, w) in parts.iter().enumerate() {
            bytes[8 + 8 * k..16 + 8 * k].copy_from_slice(&w.to_le_bytes());
        }
        bytes[TEXT_AT..TEXT_AT + text.len()].copy_from_slice(text.as_bytes());
        bytes
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn events_take_the_thread_type_and_parts_sent_before_them() {
        let mut d = UnitDecoder::default();
        let code = 0x7f00_0000_1230;
        let parts = [code, 0x5000, 0x6000, 42, 0xabc];
        let now = 0x1234_5678_9abc_def0;
        assert_eq!(d.decode(&[U_THREAD, 0x7fff_0740], now), None);
        assert_eq!(d.decode(&group(U_PARTS, parts, "f\x01a.py"), now), None);
        let ty = 0x9_0000;
        let entry = table_index(ty, TYPE_ENTRIES) as u64;
        assert_eq!(
            d.decode(&[U_TYPE | (entry + 1) << AUX_SHIFT, ty], now),
            None
        );
        let stamp = now & ((1 << 48) - 1);
        let call = d.decode(&event(KIND_CALL, 0, stamp - 10, code), now);
        let call = call.expect("an event");
        assert_eq!(call.kind, KIND_CALL);
        assert_eq!(call.thread, 0x7fff_0740);
        assert_eq!(call.parts, parts);
        assert_eq!(call.stamp, now - 10);
        assert_eq!(
            call.texts.and_then(|t| t.call).as_deref(),
            Some("f\x01a.py")
        );
        assert_eq!(call.ty, 0);
        // The text goes with the first call only; a return has the type.
        let ret = d.decode(&event(KIND_RETURN, entry + 1, stamp - 5, code), now);
        let ret = ret.expect("an event");
        assert_eq!((ret.parts, ret.ty, ret.texts), (parts, ty, None));
        let again = d.decode(&event(KIND_CALL, 0, stamp, code), now).unwrap();
        assert_eq!(again.texts, None);
        // A code object never sent: its address alone.
        let other = d
            .decode(&event(KIND_CALL, 0, stamp, code + 16), now)
            .unwrap();
        assert_eq!(other.parts, [code + 16, 0, 0, 0, 0]);
    }

    #[test]
    fn a_body_s_parts_and_text_go_with_the_next_event_only() {
        let mut d = UnitDecoder::default();
        let code = 0x7f00_0000_4560;
        let parts = [code, 0x5000, 0x6000, 1, 0xdef];
        assert_eq!(
            d.decode(&group(U_BODY, parts, "<module>\x01m.py"), 1 << 20),
            None
        );
        let first = d.decode(&event(KIND_CALL, 0, 5, code), 1 << 20).unwrap();
        assert_eq!(first.parts, parts);
        assert_eq!(
            first.texts.and_then(|t| t.body).as_deref(),
            Some("<module>\x01m.py")
        );
        let next = d.decode(&event(KIND_RETURN, 0, 6, code), 1 << 20).unwrap();
        assert_eq!((next.parts, next.texts), ([code, 0, 0, 0, 0], None));
    }

    #[test]
    fn a_stamp_is_widened_to_the_value_nearest_now() {
        let span = 1u64 << 48;
        assert_eq!(widen_stamp(100, 3 * span + 200), 3 * span + 100);
        // Written before the counter's low bits wrapped, read after.
        assert_eq!(widen_stamp(span - 5, 3 * span + 10), 3 * span - 5);
        // Written a little after `now` was read.
        assert_eq!(widen_stamp(15, 3 * span + 10), 3 * span + 15);
        assert_eq!(widen_stamp(5, 3 * span - 10), 3 * span + 5);
    }

    #[test]
    fn hostile_words_decode_as_nothing_or_as_something() {
        let mut d = UnitDecoder::default();
        for words in [
            vec![],
            vec![U_PARTS],
            vec![U_PARTS, 1, 2, 3],
            vec![0xf, 1],
            vec![0, 1],
            vec![U_TYPE, 7],
            vec![U_BODY | 0xff00, 1],
        ] {
            assert_eq!(d.decode(&words, u64::MAX), None, "{words:x?}");
        }
        let any = d.decode(&[!0xf | 2, 1], 0).expect("an event");
        assert_eq!(any.kind, KIND_RETURN);
    }
}
