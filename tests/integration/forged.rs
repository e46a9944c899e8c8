//! Forged and corrupt SDT notes must not steer pyprobe's writes. Each test builds
//! a forged copy of a real binary (a C SDT fixture, CPython 3.9) whose note points
//! a semaphore at other data or a probe site into the middle of an instruction,
//! traces it, and checks that the program behaves exactly as without pyprobe and
//! that pyprobe says what it refused and why.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;

use crate::support::*;
use anyhow::Result;
use iced_x86::{Decoder, DecoderOptions};
use pyprobe_sdt::elf::ElfInfo;
use pyprobe_sdt::process::objects::find_probe_object;
use pyprobe_sdt::sdt;
use pyprobe_sdt::tracer::{
    usable_sites, Engine, EngineOptions, Outcome, Probe, ProbeSet, Refusal, Resolver, RingUse,
    Site, TraceEvent,
};

const PROVIDER: &str = "pyprobe_test";

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("pyprobe-forged-")
        .tempdir()
        .unwrap()
}

/// The file offsets of the descriptors of the notes of probe `name`.
fn note_descs(data: &[u8], name: &str) -> Vec<usize> {
    let elf = goblin::elf::Elf::parse(data).unwrap();
    let sh = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".note.stapsdt"))
        .expect("a .note.stapsdt section");
    let (mut at, end) = (sh.sh_offset as usize, (sh.sh_offset + sh.sh_size) as usize);
    let word = |a: usize| u32::from_le_bytes(data[a..a + 4].try_into().unwrap()) as usize;
    let mut found = Vec::new();
    while at + 12 <= end {
        let (namesz, descsz) = (word(at), word(at + 4));
        let desc = at + 12 + namesz.next_multiple_of(4);
        let mut strings = data[desc + 24..desc + descsz].split(|&b| b == 0);
        let _provider = strings.next();
        if strings.next() == Some(name.as_bytes()) {
            found.push(desc);
        }
        at = desc + descsz.next_multiple_of(4);
    }
    assert!(!found.is_empty(), "no note for probe {name}");
    found
}

/// Writes the note field at `desc + field` (0: site, 16: semaphore).
fn put(data: &mut [u8], at: usize, value: u64) {
    data[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

/// A copy of `original` named `name` in `dir`, edited by `edit`.
fn forge(original: &Path, dir: &Path, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut data = std::fs::read(original).unwrap();
    edit(&mut data);
    let path = dir.join(name);
    std::fs::write(&path, &data).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Builds the probe set of the fixture the way pyprobe does: only what the ELF
/// checks let through; what they refused is kept for the test to see.
struct FixtureResolver {
    refused: Rc<RefCell<Vec<Refusal>>>,
}

impl Resolver for FixtureResolver {
    fn resolve(&mut self, pid: i32) -> Result<Option<ProbeSet>> {
        let Ok(object) = find_probe_object(pid, PROVIDER) else {
            return Ok(None);
        };
        if !object.is_fully_mapped(&pyprobe_sdt::process::read_maps(pid)?) {
            return Ok(None);
        }
        let mut set = ProbeSet::default();
        for name in ["g32", "g64"] {
            if let Some(a) = object.elf.symbols.address(name) {
                set.symbols.push((name.to_owned(), object.runtime(a)));
            }
        }
        for p in &object.elf.probes {
            let sites: Vec<Site> = usable_sites(&object, p, &mut set.refused)
                .into_iter()
                .map(|s| Site::new(object.runtime(s.address), sdt::parse_args(&s.args).unwrap()))
                .collect();
            if sites.is_empty() {
                continue;
            }
            set.probes.push(Probe {
                name: p.name.clone(),
                semaphore: p.semaphore.map(|s| object.runtime(s)),
                sites,
                string_args: if p.name == "str" {
                    vec![true, false]
                } else {
                    vec![]
                },
            });
        }
        self.refused
            .borrow_mut()
            .extend(set.refused.iter().cloned());
        Ok(Some(set))
    }
}

/// What a traced run of the fixture gave.
struct Traced {
    outcome: Outcome,
    printed: String,
    sites: usize,
    hits: BTreeMap<String, usize>,
    refused: Vec<Refusal>,
}

fn engine_options() -> EngineOptions {
    EngineOptions {
        ring: RingUse::Off,
        ..EngineOptions::default()
    }
}

/// Runs `binary 3` under the engine; its output goes to a file. Callers run in a
/// process of their own ([`in_own_process`]): an engine waits for any child of its
/// process, and would reap a pyprobe another test runs.
fn trace(binary: &Path) -> Traced {
    let out_file = binary.with_extension("out");
    let script = format!("exec {} 3 > {}", binary.display(), out_file.display());
    let command = vec!["/bin/bash".to_owned(), "-c".to_owned(), script];
    let refused = Rc::new(RefCell::new(Vec::new()));
    let resolver = FixtureResolver {
        refused: refused.clone(),
    };
    let mut engine =
        Engine::launch(&command, Box::new(resolver), engine_options(), &mut |_| {}).unwrap();
    let mut sites = 0;
    let mut hits = BTreeMap::new();
    let outcome = engine
        .run(&mut |event| match event {
            TraceEvent::Hit(hit) => *hits.entry(hit.probe_name.to_owned()).or_insert(0) += 1,
            TraceEvent::Installed { sites: n, .. } => sites += n,
            _ => {}
        })
        .unwrap();
    drop(engine);
    let printed = std::fs::read_to_string(&out_file).unwrap();
    let refused = refused.borrow().clone();
    Traced {
        outcome,
        printed,
        sites,
        hits,
        refused,
    }
}

/// The fixture's output, run after run the same but for its pid and the
/// address of its string (`probe str`), which moves with ASLR.
fn comparable(printed: &str) -> Vec<&str> {
    printed
        .lines()
        .filter(|l| !l.starts_with("pid ") && !l.starts_with("probe str "))
        .collect()
}

fn untraced(binary: &Path) -> String {
    let out = Command::new(binary).arg("3").output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

fn fixtures() -> [&'static str; 2] {
    ["sdt_fixture_pie", "sdt_fixture_nopie"]
}

/// The semaphore of `gated` pointed at the fixture's global `g32`, which it
/// prints: raising that "semaphore" would change what it prints.
#[test]
fn a_semaphore_pointing_at_other_data_is_never_raised() {
    if !in_own_process(
        module_path!(),
        "a_semaphore_pointing_at_other_data_is_never_raised",
    ) {
        return;
    }
    let dir = tempdir();
    for name in fixtures() {
        let original = fixture_binary(name);
        let forged = forge(&original, dir.path(), name, |data| {
            let info = ElfInfo::parse(&original, data).unwrap();
            let g32 = info.symbols.address("g32").expect("g32 in .symtab");
            for desc in note_descs(data, "gated") {
                put(data, desc + 16, g32);
            }
        });
        let t = trace(&forged);
        assert_eq!(t.outcome, Outcome::Exited(0), "{name}");
        assert_eq!(
            comparable(&t.printed),
            comparable(&untraced(&forged)),
            "{name}: the fixture's output (its g32 among it) is unchanged"
        );
        assert!(t.printed.contains("probe global -123456 "), "{}", t.printed);
        assert_eq!(t.sites, 7, "{name}: every site but gated's armed");
        assert_eq!(t.hits.get("gated"), None);
        assert_eq!(
            t.hits.get("consts"),
            Some(&3),
            "{name}: the other probes work"
        );
        assert!(
            t.refused.iter().any(|r| r.probe == "gated"
                && r.reason.contains("outside the .probes section")
                && r.reason.contains("not armed")),
            "{name}: {:?}",
            t.refused
        );
        let listing = run_pyprobe(&["probes", forged.to_str().unwrap(), "--format", "json"]);
        assert!(listing.status.success());
        let listing = String::from_utf8_lossy(&listing.stdout);
        assert!(
            listing.contains("outside the .probes section"),
            "`pyprobe probes` says why: {listing}"
        );
    }
}

/// The first byte 0x90 inside (not at the start of) an instruction of the
/// fixture's `sdt_fire_all`, which runs straight through at every iteration:
/// an `int3` there changes the instruction.
fn nop_byte_inside_an_instruction(data: &[u8]) -> u64 {
    let elf = goblin::elf::Elf::parse(data).unwrap();
    let f = elf
        .syms
        .iter()
        .find(|s| elf.strtab.get_at(s.st_name) == Some("sdt_fire_all"))
        .expect("sdt_fire_all in .symtab");
    let text = elf
        .program_headers
        .iter()
        .find(|ph| ph.p_flags & 1 != 0 && ph.vm_range().contains(&(f.st_value as usize)))
        .unwrap();
    let offset = (f.st_value - text.p_vaddr + text.p_offset) as usize;
    let code = &data[offset..offset + f.st_size as usize];
    let mut decoder = Decoder::with_ip(64, code, f.st_value, DecoderOptions::NONE);
    for instr in &mut decoder {
        let start = (instr.ip() - f.st_value) as usize;
        let bytes = &code[start..start + instr.len()];
        if let Some(i) = bytes.iter().skip(1).position(|&b| b == 0x90) {
            return instr.ip() + 1 + i as u64;
        }
    }
    panic!("sdt_fire_all has no instruction with a 0x90 byte inside: rebuild the fixtures with gcc -O2 (scripts/build-fixtures.sh)");
}

#[test]
fn a_site_inside_an_instruction_is_never_written() {
    if !in_own_process(
        module_path!(),
        "a_site_inside_an_instruction_is_never_written",
    ) {
        return;
    }
    let dir = tempdir();
    for name in fixtures() {
        let original = fixture_binary(name);
        let mut pc = 0;
        let forged = forge(&original, dir.path(), name, |data| {
            pc = nop_byte_inside_an_instruction(data);
            for desc in note_descs(data, "consts") {
                put(data, desc, pc);
            }
        });
        let t = trace(&forged);
        assert_eq!(
            t.outcome,
            Outcome::Exited(0),
            "{name}: the fixture exits normally"
        );
        // `gated` fires only while traced: its semaphore is raised then.
        let without_gated = |text: &str| -> Vec<String> {
            comparable(text)
                .into_iter()
                .filter(|l| !l.starts_with("fired gated"))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(
            without_gated(&t.printed),
            without_gated(&untraced(&forged)),
            "{name}: output unchanged"
        );
        assert!(t.printed.contains("fired gated 3"), "{}", t.printed);
        assert_eq!(t.sites, 7, "{name}");
        assert_eq!(t.hits.get("consts"), None);
        assert_eq!(t.hits.get("regs"), Some(&3));
        let why = format!("site {pc:#x} refused: it is inside the");
        assert!(
            t.refused.iter().any(|r| r.reason.contains(&why)),
            "{name}: {:?}",
            t.refused
        );
    }
}

/// A semaphore holding more than a count of tracers when pyprobe would raise it
/// (here the real one, set to 2000 behind its back) is left alone, and its
/// probe not armed.
#[test]
fn a_semaphore_holding_more_than_a_count_is_left_alone() {
    if !in_own_process(
        module_path!(),
        "a_semaphore_holding_more_than_a_count_is_left_alone",
    ) {
        return;
    }
    let mut t = Target::spawn(&fixture_binary("sdt_fixture_pie"), &["--wait", "1"]);
    t.wait_for_line("pid");
    let pid = t.pid();
    let object = find_probe_object(pid, PROVIDER).unwrap();
    let gated = object
        .elf
        .probes
        .iter()
        .find(|p| p.name == "gated")
        .unwrap();
    let sem = object.runtime(gated.semaphore.unwrap());
    {
        use std::os::unix::fs::FileExt;
        let mem = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .unwrap();
        mem.write_all_at(&2000u16.to_le_bytes(), sem).unwrap();
    }
    let refused = Rc::new(RefCell::new(Vec::new()));
    let resolver = FixtureResolver { refused };
    let mut sites = 0;
    let mut engine = Engine::attach(pid, Box::new(resolver), engine_options(), &mut |e| {
        if let TraceEvent::Installed { sites: n, .. } = e {
            sites += n;
        }
    })
    .unwrap();
    assert_eq!(
        read_target_memory(pid, sem, 2),
        2000u16.to_le_bytes(),
        "not raised"
    );
    t.send_line("go");
    let mut hits = BTreeMap::new();
    let outcome = engine
        .run(&mut |event| {
            if let TraceEvent::Hit(hit) = event {
                *hits.entry(hit.probe_name.to_owned()).or_insert(0) += 1;
            }
        })
        .unwrap();
    drop(engine);
    // The engine reaped the target: its status is the outcome.
    let printed = t.read_rest();
    assert_eq!(outcome, Outcome::Exited(0));
    assert!(printed.contains("fired gated 1"), "{printed}");
    assert_eq!(sites, 7, "gated's site not armed");
    assert_eq!(hits.get("gated"), None);
    assert_eq!(hits.get("consts"), Some(&1));
}

/// CPython 3.9 with `function__entry`'s semaphore pointed at the `tp_name` of
/// `int`'s type: raising it once made `type(1).__name__` read 'nt'.
#[test]
fn a_forged_python_runs_as_without_pyprobe() {
    let Some(py) = python("3.9") else { return };
    let dir = tempdir();
    let forged = forge(&py.binary, dir.path(), "python3.9", |data| {
        let info = ElfInfo::parse(&py.binary, data).unwrap();
        let int_type = info.symbols.address("PyLong_Type").expect("PyLong_Type");
        // tp_name follows the object header (refcount, type, size).
        for desc in note_descs(data, "function__entry") {
            put(data, desc + 16, int_type + 24);
        }
    });
    let usr = py.binary.parent().unwrap().parent().unwrap();
    let recording = dir.path().join("run.pyprobe");
    let out = pyprobe()
        // `-v`: each probe refused, and why.
        .args(["record", "-v", "--mode", "trace", "-o"])
        .arg(&recording)
        .arg("--")
        .arg(&forged)
        .args(["-c", "print(type(1).__name__)"])
        .env("PYTHONHOME", usr)
        .env("LD_LIBRARY_PATH", usr.join("lib/x86_64-linux-gnu"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert_no_panic("record of a forged python", &out.stderr);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "int\n");
    assert!(out.status.success());
    assert!(
        stderr.contains("outside the .probes section")
            && stderr.contains("probe function__entry not armed"),
        "pyprobe says what it refused: {stderr}"
    );
    // The other probes were traced: returns are counted.
    let report = report_json(recording.to_str().unwrap());
    assert!(report["functions"]
        .as_array()
        .is_some_and(|f| !f.is_empty()));
}
