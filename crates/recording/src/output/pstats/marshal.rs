//! The few `marshal` encodings a pstats file needs, written so that `marshal.load`
//! of every CPython 3 reads them: dicts, tuples, ints, floats and str, without the
//! reference flag of later versions.

/// Writes marshal values into a buffer.
#[derive(Default)]
pub(crate) struct Marshal {
    pub(crate) out: Vec<u8>,
}

impl Marshal {
    /// Opens a dict: key and value pairs follow, then [`Self::end_dict`].
    pub(crate) fn dict(&mut self) {
        self.out.push(b'{');
    }

    pub(crate) fn end_dict(&mut self) {
        // TYPE_NULL ends a dict.
        self.out.push(b'0');
    }

    /// Opens a tuple of `len` items, which follow.
    pub(crate) fn tuple(&mut self, len: u32) {
        self.out.push(b'(');
        self.out.extend_from_slice(&len.to_le_bytes());
    }

    pub(crate) fn int(&mut self, v: u64) {
        match i32::try_from(v) {
            Ok(small) => {
                self.out.push(b'i');
                self.out.extend_from_slice(&small.to_le_bytes());
            }
            Err(_) => {
                // TYPE_LONG: a count of 15-bit digits, least significant first.
                let mut digits = Vec::new();
                let mut rest = v;
                while rest > 0 {
                    digits.push((rest & 0x7fff) as u16);
                    rest >>= 15;
                }
                self.out.push(b'l');
                self.out
                    .extend_from_slice(&(digits.len() as i32).to_le_bytes());
                for d in digits {
                    self.out.extend_from_slice(&d.to_le_bytes());
                }
            }
        }
    }

    pub(crate) fn float(&mut self, v: f64) {
        // TYPE_BINARY_FLOAT.
        self.out.push(b'g');
        self.out.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn str(&mut self, s: &str) {
        // TYPE_UNICODE: UTF-8, its length in bytes first.
        self.out.push(b'u');
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes CPython's `marshal.dumps` gives for the same values, version 2
    /// (before references): `{('a', 1): (2**40, 0.5)}`.
    #[test]
    fn encodes_as_marshal_does() {
        let mut m = Marshal::default();
        m.dict();
        m.tuple(2);
        m.str("a");
        m.int(1);
        m.tuple(2);
        m.int(1 << 40);
        m.float(0.5);
        m.end_dict();
        let mut want = b"{(\x02\x00\x00\x00u\x01\x00\x00\x00ai\x01\x00\x00\x00".to_vec();
        want.extend_from_slice(b"(\x02\x00\x00\x00l\x03\x00\x00\x00\x00\x00\x00\x00\x00\x04");
        want.extend_from_slice(b"g\x00\x00\x00\x00\x00\x00\xe0?0");
        assert_eq!(m.out, want);
    }
}
