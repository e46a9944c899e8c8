//! Function names of one ELF object by address: its `.symtab` and `.dynsym`
//! functions, sorted, looked up by binary search; C++ and Rust names demangled.

use goblin::elf::sym::STT_FUNC;
use goblin::elf::Elf;

/// Longest symbol name kept: a hostile or huge mangled name is cut, not copied whole.
const MAX_NAME: usize = 512;

#[derive(Debug, Default)]
pub(crate) struct FunctionSymbols {
    /// (start, end, name) in link-time addresses, sorted by start.
    functions: Vec<(u64, u64, Box<str>)>,
}

impl FunctionSymbols {
    pub(crate) fn from_elf(elf: &Elf) -> FunctionSymbols {
        let mut functions = Vec::new();
        let tables = [(&elf.syms, &elf.strtab), (&elf.dynsyms, &elf.dynstrtab)];
        for (syms, strtab) in tables {
            for sym in syms.iter() {
                if sym.st_shndx == 0 || sym.st_type() != STT_FUNC || sym.st_value == 0 {
                    continue;
                }
                let Some(name) = strtab.get_at(sym.st_name).filter(|n| !n.is_empty()) else {
                    continue;
                };
                // Of the names at one address, the one the source gave it:
                // global before local (`tail` before `tail.localalias`), then
                // without a compiler's suffix.
                let rank = (
                    sym.st_bind() == goblin::elf::sym::STB_LOCAL,
                    name.contains('.'),
                );
                let end = sym.st_value.saturating_add(sym.st_size);
                functions.push((sym.st_value, end, rank, name));
            }
        }
        functions.sort_by_key(|&(start, end, rank, _)| (start, std::cmp::Reverse(end), rank));
        functions.dedup_by_key(|f| f.0);
        // A sizeless symbol (`_init`, a label) names its own address only: stretched
        // to the next symbol it would name the PLT stubs after it.
        let sorted = functions
            .into_iter()
            .map(|(start, end, _, name)| {
                (
                    start,
                    end.max(start.saturating_add(1)),
                    demangle(name).into(),
                )
            })
            .collect();
        FunctionSymbols { functions: sorted }
    }

    /// The function containing link-time address `address`, and where it starts.
    pub fn lookup(&self, address: u64) -> Option<(&str, u64)> {
        let i = self.functions.partition_point(|f| f.0 <= address);
        let (start, end, name) = self.functions.get(i.checked_sub(1)?)?;
        (address < *end).then_some((&**name, *start))
    }

    /// The range of the function named exactly `name`.
    pub(crate) fn range_of(&self, name: &str) -> Option<std::ops::Range<u64>> {
        self.functions
            .iter()
            .find(|f| &*f.2 == name)
            .map(|f| f.0..f.1)
    }

    /// The names of the functions that overlap `range`: the one covering its
    /// start, then those starting inside it.
    pub(crate) fn names_over(&self, range: &std::ops::Range<u64>) -> impl Iterator<Item = &str> {
        let covering = self.lookup(range.start).map(|(name, _)| name);
        let from = self.functions.partition_point(|f| f.0 <= range.start);
        let end = range.end;
        let inside = self.functions[from..]
            .iter()
            .take_while(move |f| f.0 < end)
            .map(|f| &*f.2);
        covering.into_iter().chain(inside)
    }
}

/// A Rust (`_R`, legacy `_ZN..E` with a hash) or C++ (`_Z`) name as written in the
/// source, without the Rust hash; other names as they are.
pub(crate) fn demangle(name: &str) -> String {
    let name = cut(name);
    if let Ok(rust) = rustc_demangle::try_demangle(name) {
        return cut(&format!("{rust:#}")).to_owned();
    }
    if name.starts_with("_Z") {
        if let Ok(symbol) = cpp_demangle::Symbol::new(name) {
            let options = cpp_demangle::DemangleOptions::new().no_params();
            if let Ok(text) = symbol.demangle(&options) {
                return cut(&text).to_owned();
            }
        }
    }
    name.to_owned()
}

/// `text` cut to at most [`MAX_NAME`] bytes, at a character boundary.
fn cut(text: &str) -> &str {
    if text.len() <= MAX_NAME {
        return text;
    }
    let mut end = MAX_NAME;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_demangled_for_rust_and_cpp_and_kept_for_c() {
        assert_eq!(
            demangle("_ZN4core3fmt5write17h0123456789abcdefE"),
            "core::fmt::write"
        );
        // A function template keeps its return type, which the mangling carries.
        assert_eq!(demangle("_ZN5numpy4sortIiEEvPT_l"), "void numpy::sort<int>");
        assert_eq!(demangle("_ZN5numpy9quicksortEPvl"), "numpy::quicksort");
        assert_eq!(demangle("PyObject_Call"), "PyObject_Call");
        // Not valid mangling: kept as it is rather than failing.
        assert_eq!(demangle("_Z$$$"), "_Z$$$");
    }

    #[test]
    fn an_endless_name_is_cut_at_a_character_boundary() {
        let name = "é".repeat(400);
        let kept = demangle(&name);
        assert!(kept.len() <= MAX_NAME && name.starts_with(&kept));
    }

    #[test]
    fn lookup_finds_the_enclosing_function_only() {
        let symbols = FunctionSymbols {
            functions: vec![(0x100, 0x180, "a".into()), (0x200, 0x210, "b".into())],
        };
        assert_eq!(symbols.lookup(0x100), Some(("a", 0x100)));
        assert_eq!(symbols.lookup(0x17f), Some(("a", 0x100)));
        assert_eq!(symbols.lookup(0x180), None);
        assert_eq!(symbols.lookup(0x20f), Some(("b", 0x200)));
        assert_eq!(symbols.lookup(0xff), None);
        assert_eq!(symbols.range_of("b"), Some(0x200..0x210));
    }
}
