//! x86-64 general-purpose registers as they appear in SDT argument specs.
//!
//! A register operand names a *part* of a 64-bit register: `%eax` is the low
//! 32 bits of `rax`, `%ah` bits 8..15. It is modelled as a [`Register`]: the
//! 64-bit register it lives in ([`RegFamily`]), its [`RegWidth`], and whether it
//! is one of the legacy high-byte registers (`%ah`, `%bh`, `%ch`, `%dh`).

use std::fmt;

/// A full 64-bit register: `rax` ... `r15`, and `rip`.
///
/// This is what a [`RegisterFile`](super::RegisterFile) is asked for; the
/// part of it an operand uses is described by [`Register`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RegFamily {
    Rax,
    Rbx,
    Rcx,
    Rdx,
    Rsi,
    Rdi,
    Rbp,
    Rsp,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
    Rip,
}

impl RegFamily {
    /// Every family, in declaration order (`ALL[f.index()] == f`).
    pub(crate) const ALL: [RegFamily; 17] = [
        RegFamily::Rax,
        RegFamily::Rbx,
        RegFamily::Rcx,
        RegFamily::Rdx,
        RegFamily::Rsi,
        RegFamily::Rdi,
        RegFamily::Rbp,
        RegFamily::Rsp,
        RegFamily::R8,
        RegFamily::R9,
        RegFamily::R10,
        RegFamily::R11,
        RegFamily::R12,
        RegFamily::R13,
        RegFamily::R14,
        RegFamily::R15,
        RegFamily::Rip,
    ];

    /// Position in [`RegFamily::ALL`] (0..17), handy for array-backed register files.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The 64-bit name, without `%` (`"rax"`, `"r8"`, `"rip"`).
    pub fn name(self) -> &'static str {
        Register::full(self).name()
    }

    /// Names of the parts of this register, indexed by [`slot`]:
    /// 64-bit, 32-bit, 16-bit, low byte, high byte.
    const fn names(self) -> [Option<&'static str>; 5] {
        use RegFamily::*;
        match self {
            Rax => [Some("rax"), Some("eax"), Some("ax"), Some("al"), Some("ah")],
            Rbx => [Some("rbx"), Some("ebx"), Some("bx"), Some("bl"), Some("bh")],
            Rcx => [Some("rcx"), Some("ecx"), Some("cx"), Some("cl"), Some("ch")],
            Rdx => [Some("rdx"), Some("edx"), Some("dx"), Some("dl"), Some("dh")],
            Rsi => [Some("rsi"), Some("esi"), Some("si"), Some("sil"), None],
            Rdi => [Some("rdi"), Some("edi"), Some("di"), Some("dil"), None],
            Rbp => [Some("rbp"), Some("ebp"), Some("bp"), Some("bpl"), None],
            Rsp => [Some("rsp"), Some("esp"), Some("sp"), Some("spl"), None],
            R8 => [Some("r8"), Some("r8d"), Some("r8w"), Some("r8b"), None],
            R9 => [Some("r9"), Some("r9d"), Some("r9w"), Some("r9b"), None],
            R10 => [Some("r10"), Some("r10d"), Some("r10w"), Some("r10b"), None],
            R11 => [Some("r11"), Some("r11d"), Some("r11w"), Some("r11b"), None],
            R12 => [Some("r12"), Some("r12d"), Some("r12w"), Some("r12b"), None],
            R13 => [Some("r13"), Some("r13d"), Some("r13w"), Some("r13b"), None],
            R14 => [Some("r14"), Some("r14d"), Some("r14w"), Some("r14b"), None],
            R15 => [Some("r15"), Some("r15d"), Some("r15w"), Some("r15b"), None],
            Rip => [Some("rip"), None, None, None, None],
        }
    }
}

/// How many bits of its family a [`Register`] covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RegWidth {
    /// 8 bits: `%al`, `%sil`, `%r8b`, and the high bytes `%ah` ... `%dh`.
    Byte,
    /// 16 bits: `%ax`, `%r8w`.
    Word,
    /// 32 bits: `%eax`, `%r8d`.
    Dword,
    /// 64 bits: `%rax`, `%r8`, `%rip`.
    Qword,
}

impl RegWidth {
    /// Width in bytes: 1, 2, 4 or 8.
    pub const fn bytes(self) -> u8 {
        match self {
            RegWidth::Byte => 1,
            RegWidth::Word => 2,
            RegWidth::Dword => 4,
            RegWidth::Qword => 8,
        }
    }

    /// Mask of the low `bytes() * 8` bits.
    pub const fn mask(self) -> u64 {
        match self {
            RegWidth::Byte => 0xff,
            RegWidth::Word => 0xffff,
            RegWidth::Dword => 0xffff_ffff,
            RegWidth::Qword => u64::MAX,
        }
    }
}

/// Index into [`RegFamily::names`].
const fn slot(width: RegWidth, high_byte: bool) -> usize {
    match (width, high_byte) {
        (RegWidth::Qword, _) => 0,
        (RegWidth::Dword, _) => 1,
        (RegWidth::Word, _) => 2,
        (RegWidth::Byte, false) => 3,
        (RegWidth::Byte, true) => 4,
    }
}

/// A named register operand: (family, width, high-byte flag).
///
/// Only combinations that x86-64 actually names can be built, so every
/// `Register` has a [`name`](Register::name): `%ah` exists, `%sih` and `%eip`
/// do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Register {
    family: RegFamily,
    width: RegWidth,
    high_byte: bool,
}

impl Register {
    /// The whole 64-bit register (`%rax`, `%r8`, `%rip`).
    pub(crate) const fn full(family: RegFamily) -> Register {
        Register {
            family,
            width: RegWidth::Qword,
            high_byte: false,
        }
    }

    /// The part of `family` of the given width; `high_byte` selects bits 8..15
    /// (only with [`RegWidth::Byte`] and `rax`/`rbx`/`rcx`/`rdx`). `None` if
    /// x86-64 has no such register.
    pub fn new(family: RegFamily, width: RegWidth, high_byte: bool) -> Option<Register> {
        if high_byte && width != RegWidth::Byte {
            return None;
        }
        let reg = Register {
            family,
            width,
            high_byte,
        };
        reg.lookup_name().map(|_| reg)
    }

    /// Looks up an AT&T register name without the `%` (`"eax"`, `"r8b"`),
    /// ignoring ASCII case.
    pub(crate) fn from_name(name: &str) -> Option<Register> {
        Register::all().find(|r| r.name().eq_ignore_ascii_case(name))
    }

    /// Every nameable register, each once.
    pub(crate) fn all() -> impl Iterator<Item = Register> {
        const PARTS: [(RegWidth, bool); 5] = [
            (RegWidth::Qword, false),
            (RegWidth::Dword, false),
            (RegWidth::Word, false),
            (RegWidth::Byte, false),
            (RegWidth::Byte, true),
        ];
        RegFamily::ALL.into_iter().flat_map(|family| {
            PARTS
                .into_iter()
                .filter_map(move |(width, high)| Register::new(family, width, high))
        })
    }

    /// The 64-bit register this one is part of.
    pub(crate) const fn family(self) -> RegFamily {
        self.family
    }

    /// How many bits it covers.
    pub(crate) const fn width(self) -> RegWidth {
        self.width
    }

    /// True for `%ah`, `%bh`, `%ch`, `%dh` (bits 8..15 of the family).
    pub(crate) const fn is_high_byte(self) -> bool {
        self.high_byte
    }

    /// The AT&T name without `%` (`"eax"`).
    pub fn name(self) -> &'static str {
        // Every constructor checks the name exists; "?" is unreachable.
        self.lookup_name().unwrap_or("?")
    }

    fn lookup_name(self) -> Option<&'static str> {
        let names = self.family.names();
        names
            .get(slot(self.width, self.high_byte))
            .copied()
            .flatten()
    }

    /// This register's value, zero-extended, given the full 64-bit value of
    /// its family: `%eax` of `0x1122334455667788` is `0x55667788`, `%ah` is `0x77`.
    pub(crate) const fn extract(self, family_value: u64) -> u64 {
        if self.high_byte {
            (family_value >> 8) & 0xff
        } else {
            family_value & self.width.mask()
        }
    }
}

/// AT&T form with the `%`: `%eax`.
impl fmt::Display for Register {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.name())
    }
}

/// A set of [`RegFamily`] values: the registers an operand needs read.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RegSet(u32);

impl RegSet {
    /// The empty set.
    pub(crate) const EMPTY: RegSet = RegSet(0);

    const fn bit(family: RegFamily) -> u32 {
        1 << family.index()
    }

    /// This set with `family` added.
    pub(crate) const fn with(self, family: RegFamily) -> RegSet {
        RegSet(self.0 | RegSet::bit(family))
    }

    /// Adds `family`.
    pub fn insert(&mut self, family: RegFamily) {
        *self = self.with(family);
    }

    /// Whether `family` is in the set.
    pub const fn contains(self, family: RegFamily) -> bool {
        self.0 & RegSet::bit(family) != 0
    }

    /// Every family in either set.
    pub const fn union(self, other: RegSet) -> RegSet {
        RegSet(self.0 | other.0)
    }

    /// Whether no family is in the set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Number of families in the set.
    pub const fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    /// The families in the set, in [`RegFamily::ALL`] order.
    pub(crate) fn iter(self) -> impl Iterator<Item = RegFamily> {
        RegFamily::ALL
            .into_iter()
            .filter(move |f| self.contains(*f))
    }
}

impl FromIterator<RegFamily> for RegSet {
    fn from_iter<I: IntoIterator<Item = RegFamily>>(iter: I) -> RegSet {
        iter.into_iter().fold(RegSet::EMPTY, RegSet::with)
    }
}

impl fmt::Debug for RegSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(self.iter().map(RegFamily::name))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: u64 = 0x1122_3344_5566_7788;

    fn reg(name: &str) -> Register {
        match Register::from_name(name) {
            Some(r) => r,
            None => panic!("no register {name}"),
        }
    }

    #[test]
    fn family_index_matches_all() {
        for (i, f) in RegFamily::ALL.into_iter().enumerate() {
            assert_eq!(f.index(), i);
        }
    }

    #[test]
    fn every_name_of_the_legacy_registers() {
        let table = [
            ("rax", "eax", "ax", "al", Some("ah"), RegFamily::Rax),
            ("rbx", "ebx", "bx", "bl", Some("bh"), RegFamily::Rbx),
            ("rcx", "ecx", "cx", "cl", Some("ch"), RegFamily::Rcx),
            ("rdx", "edx", "dx", "dl", Some("dh"), RegFamily::Rdx),
            ("rsi", "esi", "si", "sil", None, RegFamily::Rsi),
            ("rdi", "edi", "di", "dil", None, RegFamily::Rdi),
            ("rbp", "ebp", "bp", "bpl", None, RegFamily::Rbp),
            ("rsp", "esp", "sp", "spl", None, RegFamily::Rsp),
        ];
        for (q, d, w, b, h, family) in table {
            for (name, width) in [
                (q, RegWidth::Qword),
                (d, RegWidth::Dword),
                (w, RegWidth::Word),
                (b, RegWidth::Byte),
            ] {
                let r = reg(name);
                assert_eq!(
                    (r.family(), r.width(), r.is_high_byte()),
                    (family, width, false)
                );
                assert_eq!(r.name(), name);
            }
            if let Some(h) = h {
                let r = reg(h);
                assert_eq!(
                    (r.family(), r.width(), r.is_high_byte()),
                    (family, RegWidth::Byte, true)
                );
            }
        }
    }

    #[test]
    fn every_name_of_r8_to_r15() {
        for n in 8..=15 {
            let family = RegFamily::ALL[n];
            assert_eq!(family.name(), format!("r{n}"));
            for (suffix, width) in [
                ("", RegWidth::Qword),
                ("d", RegWidth::Dword),
                ("w", RegWidth::Word),
                ("b", RegWidth::Byte),
            ] {
                let r = reg(&format!("r{n}{suffix}"));
                assert_eq!(
                    (r.family(), r.width(), r.is_high_byte()),
                    (family, width, false)
                );
            }
        }
    }

    #[test]
    fn rip_only_in_64_bits() {
        assert_eq!(reg("rip"), Register::full(RegFamily::Rip));
        for bad in ["eip", "ip", "ipl", "r16", "r8l", "sih", "", "rax "] {
            assert_eq!(Register::from_name(bad), None, "{bad}");
        }
        assert_eq!(Register::new(RegFamily::Rip, RegWidth::Dword, false), None);
        assert_eq!(Register::new(RegFamily::Rsi, RegWidth::Byte, true), None);
        assert_eq!(Register::new(RegFamily::Rax, RegWidth::Word, true), None);
    }

    #[test]
    fn names_are_unique_and_case_insensitive() {
        let all: Vec<Register> = Register::all().collect();
        // 16 families * 4 widths + 4 high bytes + rip
        assert_eq!(all.len(), 16 * 4 + 4 + 1);
        for r in &all {
            assert_eq!(Register::from_name(r.name()), Some(*r));
            assert_eq!(Register::from_name(&r.name().to_uppercase()), Some(*r));
        }
    }

    #[test]
    fn extract_each_width() {
        assert_eq!(reg("rax").extract(V), V);
        assert_eq!(reg("eax").extract(V), 0x5566_7788);
        assert_eq!(reg("ax").extract(V), 0x7788);
        assert_eq!(reg("al").extract(V), 0x88);
        assert_eq!(reg("ah").extract(V), 0x77);
        assert_eq!(reg("r8d").extract(V), 0x5566_7788);
        assert_eq!(reg("r8w").extract(V), 0x7788);
        assert_eq!(reg("r8b").extract(V), 0x88);
        assert_eq!(reg("sil").extract(V), 0x88);
    }

    #[test]
    fn display_has_percent() {
        assert_eq!(reg("r10w").to_string(), "%r10w");
        assert_eq!(reg("dh").to_string(), "%dh");
    }

    #[test]
    fn regset_operations() {
        let mut s = RegSet::EMPTY;
        assert!(s.is_empty());
        s.insert(RegFamily::Rip);
        s.insert(RegFamily::Rax);
        s.insert(RegFamily::Rax);
        assert_eq!(s.len(), 2);
        assert!(s.contains(RegFamily::Rax) && !s.contains(RegFamily::Rbx));
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            [RegFamily::Rax, RegFamily::Rip]
        );
        let t: RegSet = [RegFamily::R15].into_iter().collect();
        assert_eq!(s.union(t).len(), 3);
        assert_eq!(format!("{:?}", s), r#"{"rax", "rip"}"#);
    }
}
