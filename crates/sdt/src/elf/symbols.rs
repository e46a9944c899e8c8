//! Defined symbols by name (`.symtab` when present, else `.dynsym`).

use std::collections::HashMap;

use goblin::elf::sym::{STT_FUNC, STT_NOTYPE, STT_OBJECT};
use goblin::elf::Elf;

#[derive(Debug, Clone, Default)]
pub struct SymbolTable {
    by_name: HashMap<String, u64>,
}

impl SymbolTable {
    pub(super) fn from_elf(elf: &Elf) -> SymbolTable {
        let mut by_name = HashMap::new();
        let tables = [(&elf.dynsyms, &elf.dynstrtab), (&elf.syms, &elf.strtab)];
        for (syms, strtab) in tables {
            for sym in syms.iter() {
                let kind = sym.st_type();
                if sym.st_shndx == 0 || !matches!(kind, STT_OBJECT | STT_FUNC | STT_NOTYPE) {
                    continue;
                }
                if let Some(name) = strtab.get_at(sym.st_name) {
                    if !name.is_empty() {
                        by_name.entry(name.to_owned()).or_insert(sym.st_value);
                    }
                }
            }
        }
        SymbolTable { by_name }
    }

    /// Link-time address of a defined symbol.
    pub fn address(&self, name: &str) -> Option<u64> {
        self.by_name.get(name).copied()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}
