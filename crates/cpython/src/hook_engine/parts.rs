//! The key a record's code object is known by: what the hook read of it.

use std::hash::{Hash, Hasher};

/// What the hook read of a record's code object when it ran: its address, its
/// `co_name` and `co_filename` pointers, its first line and the strings' identity
/// check (see `drain::name_code`). Every record is looked up by it, several times:
/// compared word by word, with no call to `memcmp`, and hashed by the two words
/// that set code objects apart.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CodeParts(pub(super) [u64; 5]);

impl CodeParts {
    /// The code object's address.
    pub(super) fn code(&self) -> u64 {
        self.0[0]
    }
}

impl PartialEq for CodeParts {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (&self.0, &other.0);
        ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4])) == 0
    }
}

impl Eq for CodeParts {}

impl Hash for CodeParts {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Equal parts have equal words, so hashing two of them agrees with `eq`.
        state.write_u64(self.0[0] ^ self.0[4].rotate_left(29));
    }
}

#[cfg(test)]
mod tests {
    use super::CodeParts;
    use rustc_hash::FxHashSet;

    #[test]
    fn parts_are_equal_only_when_every_word_is() {
        let a = CodeParts([0x7f00_1000, 0x7f00_2000, 0x7f00_3000, 12, 0xdead_beef]);
        assert_eq!(a, a.clone());
        for i in 0..5 {
            let mut b = a;
            b.0[i] ^= 1 << (i * 7);
            assert_ne!(a, b, "word {i}");
        }
        // Parts differing only in words the hash leaves out still come apart.
        let mut b = a;
        b.0[2] = 0x7f00_4000;
        let set: FxHashSet<CodeParts> = [a, b].into_iter().collect();
        assert_eq!(set.len(), 2);
        assert!(set.contains(&a) && set.contains(&b));
    }
}
