//! The ELF reader (goblin + pyprobe's SDT note and layout code) on arbitrary bytes,
//! and the stapsdt descriptor decoder on its own: errors, never a panic.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use pyprobe_sdt::elf::{parse_desc, ElfInfo};

fuzz_target!(|data: &[u8]| {
    // The descriptor decoder alone, with and without a `.stapsdt.base`.
    let base = data
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    let _ = parse_desc(data, None);
    let _ = parse_desc(data, base);

    if let Ok(info) = ElfInfo::parse(Path::new("fuzz.elf"), data) {
        for probe in &info.probes {
            for site in &probe.sites {
                let _ = info.file_offset(site.address);
                let _ = pyprobe_sdt::sdt::parse_args(&site.args);
            }
        }
        let _ = info.provider_probes("python").count();
    }
});
