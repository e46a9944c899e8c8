//! Line numbers from a code object's line table, per version's format. Pure functions:
//! `addr` is the byte offset of the instruction in the bytecode (negative: the frame has
//! not started; its line is the first line, as CPython's `PyCode_Addr2Line` says).
//! `None` when the table has no line for the address (or a corrupt table makes it
//! negative). Line 0 is a line: 3.11+ put a module's `RESUME` there.

/// `co_lnotab` (3.6 – 3.9): byte pairs (address increment, signed line increment).
/// As CPython 3.9's `PyCode_Addr2Line`.
pub fn lnotab_line(table: &[u8], first_line: u32, addr: i64) -> Option<u32> {
    let mut line = i64::from(first_line);
    if addr >= 0 {
        let mut at = 0i64;
        for pair in table.chunks_exact(2) {
            at += i64::from(pair[0]);
            if at > addr {
                break;
            }
            line += i64::from(pair[1] as i8);
        }
    }
    u32::try_from(line).ok()
}

/// `co_linetable` of 3.10: byte pairs (address delta, signed line delta), a line delta
/// of -128 meaning "no line". As CPython 3.10's `_PyCode_CheckLineNumber`.
pub fn linetable310_line(table: &[u8], first_line: u32, addr: i64) -> Option<u32> {
    if addr < 0 {
        return Some(first_line);
    }
    let mut line = i64::from(first_line);
    let mut end = 0i64;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += i64::from(pair[0]);
        let delta = pair[1] as i8;
        let current = if delta == -128 {
            None
        } else {
            line += i64::from(delta);
            Some(line)
        };
        if start <= addr && addr < end {
            return current.and_then(|l| u32::try_from(l).ok());
        }
    }
    None
}

/// A 6-bit-chunk varint of the 3.11+ location table; `None` past the end. Chunks beyond
/// 32 bits are read but ignored (a corrupt table cannot overflow).
fn varint(table: &[u8], at: &mut usize) -> Option<u64> {
    let mut byte = *table.get(*at)?;
    *at += 1;
    let mut value = u64::from(byte & 63);
    let mut shift = 0u32;
    while byte & 64 != 0 {
        byte = *table.get(*at)?;
        *at += 1;
        shift += 6;
        if shift < 32 {
            value |= u64::from(byte & 63) << shift;
        }
    }
    Some(value)
}

fn signed_varint(table: &[u8], at: &mut usize) -> Option<i64> {
    let v = varint(table, at)?;
    Some(if v & 1 != 0 {
        -((v >> 1) as i64)
    } else {
        (v >> 1) as i64
    })
}

/// `co_linetable` of 3.11+ (the location table, `Objects/locations.md`): entries that
/// start with a byte with the high bit set: bits 3–6 the kind of entry, bits 0–2 its
/// length in code units minus one. As CPython's `_PyCode_CheckLineNumber` (3.11+).
pub fn locations_line(table: &[u8], first_line: u32, addr: i64) -> Option<u32> {
    if addr < 0 {
        return Some(first_line);
    }
    let mut line = i64::from(first_line);
    let mut end = 0i64;
    let mut i = 0usize;
    while i < table.len() {
        let first = table[i];
        if first & 0x80 == 0 {
            // Not an entry start: a corrupt table; resynchronise on the next one.
            i += 1;
            continue;
        }
        let code = (first >> 3) & 15;
        let delta = match code {
            // 15: no location; 0-9: short forms, same line.
            13 | 14 => {
                let mut at = i + 1;
                signed_varint(table, &mut at).unwrap_or(0)
            }
            10..=12 => i64::from(code - 10),
            _ => 0,
        };
        line += delta;
        let start = end;
        end += (i64::from(first & 7) + 1) * 2;
        if start <= addr && addr < end {
            if code == 15 {
                return None;
            }
            return u32::try_from(line).ok();
        }
        i += 1;
        while i < table.len() && table[i] & 0x80 == 0 {
            i += 1;
        }
    }
    None
}

/// Whether some instruction of a 3.11+ location table is at `line`: the same walk
/// as [`locations_line`], over the whole table. A corrupt table answers, never panics.
pub(crate) fn locations_has_line(table: &[u8], first_line: u32, line: u32) -> bool {
    let mut current = i64::from(first_line);
    let mut i = 0usize;
    while i < table.len() {
        let first = table[i];
        if first & 0x80 == 0 {
            i += 1;
            continue;
        }
        let code = (first >> 3) & 15;
        current += match code {
            13 | 14 => {
                let mut at = i + 1;
                signed_varint(table, &mut at).unwrap_or(0)
            }
            10..=12 => i64::from(code - 10),
            _ => 0,
        };
        if code != 15 && current == i64::from(line) {
            return true;
        }
        i += 1;
        while i < table.len() && table[i] & 0x80 == 0 {
            i += 1;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lnotab() {
        // line 10 at 0; +6 bytes → line 11; +4 bytes → line 9 (negative delta); +200 → 14
        let table = [0, 0, 6, 1, 4, 0xfe, 200, 5];
        assert_eq!(lnotab_line(&table, 10, -1), Some(10));
        assert_eq!(lnotab_line(&table, 10, 0), Some(10));
        assert_eq!(lnotab_line(&table, 10, 5), Some(10));
        assert_eq!(lnotab_line(&table, 10, 6), Some(11));
        assert_eq!(lnotab_line(&table, 10, 10), Some(9));
        assert_eq!(lnotab_line(&table, 10, 209), Some(9));
        assert_eq!(lnotab_line(&table, 10, 210), Some(14));
        assert_eq!(lnotab_line(&table, 10, 100_000), Some(14));
        assert_eq!(lnotab_line(&[], 3, 50), Some(3));
        // An odd trailing byte is ignored.
        assert_eq!(lnotab_line(&[4, 1, 9], 3, 50), Some(4));
    }

    #[test]
    fn linetable_310() {
        // [0,4) line 2, [4,10) no line, [10,10) +3 (empty), [10,14) line 5+(-1)=4
        let table = [4, 1, 6, 0x80, 0, 3, 4, 0xff];
        assert_eq!(linetable310_line(&table, 1, -2), Some(1));
        assert_eq!(linetable310_line(&table, 1, 0), Some(2));
        assert_eq!(linetable310_line(&table, 1, 3), Some(2));
        assert_eq!(linetable310_line(&table, 1, 4), None);
        assert_eq!(linetable310_line(&table, 1, 10), Some(4));
        assert_eq!(linetable310_line(&table, 1, 13), Some(4));
        assert_eq!(linetable310_line(&table, 1, 14), None);
    }

    /// A 3.11 location table starting at line 20: lines 20, 21, 20, none, 20, 90.
    const LOCATIONS_311: [u8; 16] = [
        // no columns (13), 1 code unit, line delta +0 (svarint 0)
        0x80 | (13 << 3),
        0,
        // one-line form (11: +1), 3 code units, two column bytes
        0x80 | (11 << 3) | 2,
        4,
        9,
        // long form (14): 2 units, line delta -1 (svarint 3), end line, cols
        0x80 | (14 << 3) | 1,
        3,
        0,
        1,
        1,
        // no location (15), 1 unit
        0x80 | (15 << 3),
        // short form (0-9): same line, 1 unit, one column byte
        0x80 | (2 << 3),
        7,
        // no columns, +70 (svarint 140 = 0b10_001100: two chunks)
        0x80 | (13 << 3),
        140 & 63 | 64,
        140 >> 6,
    ];

    #[test]
    fn locations_311() {
        let table = LOCATIONS_311;
        let line = |addr| locations_line(&table, 20, addr);
        assert_eq!(line(-2), Some(20));
        assert_eq!(line(0), Some(20));
        assert_eq!(line(1), Some(20));
        assert_eq!(line(2), Some(21));
        assert_eq!(line(7), Some(21));
        assert_eq!(line(8), Some(20));
        assert_eq!(line(11), Some(20));
        assert_eq!(line(12), None);
        assert_eq!(line(14), Some(20));
        assert_eq!(line(16), Some(90));
        assert_eq!(line(18), None);
    }

    #[test]
    fn location_tables_say_which_lines_they_hold() {
        let table = LOCATIONS_311;
        for line in [20, 21, 90] {
            assert!(locations_has_line(&table, 20, line), "{line}");
        }
        for line in [19, 22, 89, 91] {
            assert!(!locations_has_line(&table, 20, line), "{line}");
        }
        assert!(!locations_has_line(&[], 20, 20));
    }

    #[test]
    fn corrupt_tables_never_panic() {
        let mut x = 0x1234_5678u32;
        for len in 0..300 {
            let table: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            for addr in [-4, 0, 2, 100, 1 << 40] {
                let _ = lnotab_line(&table, 1, addr);
                let _ = linetable310_line(&table, 1, addr);
                let _ = locations_line(&table, 1, addr);
            }
            let _ = locations_has_line(&table, 1, 7);
        }
        // Endless continuation bits.
        let table = [0x80 | (14 << 3), 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f];
        assert_eq!(locations_line(&table, 1, 0), Some(1));
    }
}
