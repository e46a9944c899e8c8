//! Low-level encoding shared by writer and reader: LEB128 varints, zigzag, and a
//! bounds-checked cursor that reports file offsets in its errors.

use super::RecordError;

/// Appends `v` as an unsigned LEB128 varint.
pub(crate) fn put_uvarint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// Maps signed to unsigned so small magnitudes stay short.
pub(crate) fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

pub(crate) fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Appends a length-prefixed byte string.
pub(crate) fn put_str(buf: &mut Vec<u8>, s: &str) {
    put_uvarint(buf, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

/// Truncates `s` to at most `max` bytes on a character boundary.
pub(crate) fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Reads a chunk payload; `base` is the payload's offset in the file so every
/// error names an absolute file offset.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    base: u64,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8], pos: usize, base: u64) -> Self {
        Cursor { buf, pos, base }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// File offset of the next byte.
    pub(crate) fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn corrupt(&self, what: impl Into<String>) -> RecordError {
        RecordError::Corrupt {
            offset: self.offset(),
            what: what.into(),
        }
    }

    pub(crate) fn u8(&mut self) -> Result<u8, RecordError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.corrupt("unexpected end of chunk"))?;
        self.pos += 1;
        Ok(b)
    }

    pub(crate) fn uvarint(&mut self) -> Result<u64, RecordError> {
        // Most values (string ids, deltas, lines) fit in one byte.
        if let Some(&b) = self.buf.get(self.pos) {
            if b < 0x80 {
                self.pos += 1;
                return Ok(u64::from(b));
            }
        }
        let start = self.offset();
        let mut value = 0u64;
        for i in 0..10 {
            let Some(&b) = self.buf.get(self.pos) else {
                return Err(RecordError::BadVarint { offset: start });
            };
            self.pos += 1;
            // The tenth byte may carry only the top bit of a u64.
            if i == 9 && b > 1 {
                return Err(RecordError::BadVarint { offset: start });
            }
            value |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(RecordError::BadVarint { offset: start })
    }

    pub(crate) fn u32v(&mut self, what: &str) -> Result<u32, RecordError> {
        let at = self.offset();
        let v = self.uvarint()?;
        u32::try_from(v).map_err(|_| RecordError::Corrupt {
            offset: at,
            what: format!("{what} {v} out of range"),
        })
    }

    pub(crate) fn ivarint(&mut self) -> Result<i64, RecordError> {
        self.uvarint().map(unzigzag)
    }

    /// A count of items that each take at least `min_item_len` bytes: checked
    /// against what is left, so a hostile count never drives an allocation.
    pub fn count(&mut self, min_item_len: usize, what: &str) -> Result<usize, RecordError> {
        let at = self.offset();
        let n = self.uvarint()?;
        let max = self.remaining() / min_item_len.max(1);
        if n > max as u64 {
            return Err(RecordError::Corrupt {
                offset: at,
                what: format!(
                    "{what} count {n} exceeds the {} bytes left",
                    self.remaining()
                ),
            });
        }
        Ok(n as usize)
    }

    pub fn bytes(&mut self, len: u64) -> Result<&'a [u8], RecordError> {
        if len > self.remaining() as u64 {
            return Err(self.corrupt(format!(
                "length {len} exceeds the {} bytes left in the chunk",
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + len as usize];
        self.pos += len as usize;
        Ok(s)
    }

    /// A length-prefixed string; invalid UTF-8 is replaced, not an error.
    pub fn string(&mut self) -> Result<String, RecordError> {
        let len = self.uvarint()?;
        let bytes = self.bytes(len)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_round_trip_and_limits() {
        for v in [0, 1, 127, 128, 300, u32::MAX as u64, u64::MAX - 1, u64::MAX] {
            let mut buf = Vec::new();
            put_uvarint(&mut buf, v);
            assert!(buf.len() <= 10);
            let mut c = Cursor::new(&buf, 0, 0);
            assert_eq!(c.uvarint().unwrap(), v);
            assert_eq!(c.remaining(), 0);
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            assert_eq!(unzigzag(zigzag(v)), v);
        }
        // Eleven continuation bytes, and a tenth byte too large.
        let long = [0xffu8; 11];
        let err = Cursor::new(&long, 0, 100).uvarint().unwrap_err();
        assert!(matches!(err, RecordError::BadVarint { offset: 100 }));
        let mut over = vec![0xffu8; 9];
        over.push(0x02);
        assert!(Cursor::new(&over, 0, 0).uvarint().is_err());
        // Runs off the end.
        assert!(Cursor::new(&[0x80], 0, 0).uvarint().is_err());
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate_str("héllo", 2), "h");
        assert_eq!(truncate_str("héllo", 3), "hé");
        assert_eq!(truncate_str("abc", 10), "abc");
    }
}
