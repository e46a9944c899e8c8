//! The ptrace engine on a program that is not Python: the C SDT fixture started
//! under the engine, every hit decoded, compared with what the fixture printed.

use std::collections::BTreeMap;

use crate::support::*;
use anyhow::Result;
use pyprobe_sdt::process::objects::find_probe_object;
use pyprobe_sdt::sdt;
use pyprobe_sdt::tracer::{
    Engine, EngineOptions, Outcome, Probe, ProbeSet, Resolver, RingUse, Site, TraceEvent,
};

struct FixtureResolver;

impl Resolver for FixtureResolver {
    fn resolve(&mut self, pid: i32) -> Result<Option<ProbeSet>> {
        let Ok(object) = find_probe_object(pid, "pyprobe_test") else {
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
            let sites = p
                .sites
                .iter()
                .map(|s| Site::new(object.runtime(s.address), sdt::parse_args(&s.args).unwrap()))
                .collect();
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
        Ok(Some(set))
    }
}

/// Through int3 stops, then through the ring engine: its trampolines compute every
/// argument form in the target, and the probes with 8 arguments (more than a ring
/// record holds) stay on int3 in the same run. One test, in a process of its own: an
/// engine waits for any child of its process, its own tracees or other tests'.
#[test]
fn engine_decodes_every_argument_of_the_c_fixture() {
    if !in_own_process(
        module_path!(),
        "engine_decodes_every_argument_of_the_c_fixture",
    ) {
        return;
    }
    decode_every_argument(RingUse::Off);
    decode_every_argument(RingUse::Auto);
}

fn decode_every_argument(ring: RingUse) {
    for binary in ["sdt_fixture_pie", "sdt_fixture_nopie", "sdt_fixture_lib"] {
        let out_file = std::env::temp_dir().join(format!(
            "pyprobe-engine-{}-{binary}.txt",
            std::process::id()
        ));
        // `exec` so the traced shell becomes the fixture: the engine re-arms after exec.
        let script = format!(
            "exec {} 3 > {}",
            fixture_binary(binary).display(),
            out_file.display()
        );
        let command = vec!["/bin/bash".to_owned(), "-c".to_owned(), script];
        let mut hits: BTreeMap<String, Vec<Vec<String>>> = BTreeMap::new();
        let mut strings = Vec::new();
        let mut installed = 0;
        let mut notices = Vec::new();
        let mut engine = Engine::launch(
            &command,
            Box::new(FixtureResolver),
            EngineOptions {
                ring,
                ..EngineOptions::default()
            },
            &mut |_| {},
        )
        .unwrap();
        let outcome = engine
            .run(&mut |event| match event {
                TraceEvent::Hit(hit) => {
                    let signed = |name: &str, i: usize| match name {
                        "consts" | "regs" => i % 2 == 0,
                        "mem" => i != 1,
                        "global" | "twosite" | "gated" => i == 0,
                        _ => false,
                    };
                    let values = hit
                        .args
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| {
                            if signed(hit.probe_name, i) {
                                (v as i64).to_string()
                            } else {
                                v.to_string()
                            }
                        })
                        .collect();
                    if let Some(s) = hit.string(0) {
                        strings.push(s.to_owned());
                    }
                    hits.entry(hit.probe_name.to_owned())
                        .or_default()
                        .push(values);
                }
                TraceEvent::Installed { sites, .. } => installed += sites,
                TraceEvent::Notice(text)
                | TraceEvent::Detail(text)
                | TraceEvent::Summarised { full: text, .. } => notices.push(text),
                _ => {}
            })
            .unwrap();
        assert_eq!(outcome, Outcome::Exited(0), "{binary}");
        if ring == RingUse::Auto {
            // consts and regs (8 arguments) stay on int3; the other 6 sites use the ring.
            assert!(
                notices
                    .iter()
                    .any(|n| n.contains("6 probe sites write to a ring")
                        && n.contains("2 stay on int3")),
                "{binary}: {notices:#?}"
            );
        }
        assert_eq!(installed, 8, "{binary}: all 8 sites armed after exec");
        let printed = std::fs::read_to_string(&out_file).unwrap();
        let _ = std::fs::remove_file(&out_file);
        let mut compared = 0;
        for line in printed.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["probe", name, values @ ..] => {
                    for hit in &hits[*name] {
                        assert_eq!(hit, values, "{binary}: {name}");
                    }
                    compared += 1;
                }
                ["string", _, ..] => {
                    let text = line.splitn(3, ' ').nth(2).unwrap();
                    assert!(
                        !strings.is_empty() && strings.iter().all(|s| s == text),
                        "{binary}: string argument"
                    );
                }
                ["fired", name, count] => {
                    let count: usize = count.parse().unwrap();
                    assert!(
                        count > 0,
                        "{binary}: {name} fired (gated: its semaphore was raised)"
                    );
                    assert_eq!(
                        hits.get(*name).map_or(0, Vec::len),
                        count,
                        "{binary}: hits of {name}"
                    );
                }
                _ => {}
            }
        }
        assert_eq!(compared, 7, "{binary}: every probe compared:\n{printed}");
    }
}

/// The ring engine on a C program whose main thread fires a probe alone, then
/// whose threads fire it all at once: while the program has one thread its
/// trampolines reserve slots without `lock`, and from its first `clone` on with
/// it. Every `(thread, i)` the program fired is recorded once, none twice, none
/// lost. One test, in a process of its own (see above).
#[test]
fn ring_records_every_hit_once_as_a_program_goes_from_one_thread_to_many() {
    if !in_own_process(
        module_path!(),
        "ring_records_every_hit_once_as_a_program_goes_from_one_thread_to_many",
    ) {
        return;
    }
    const SOLO: usize = 20_000;
    const THREADS: usize = 4;
    const HITS: usize = 100_000;
    let command = [
        fixture_binary("sdt_threads").display().to_string(),
        SOLO.to_string(),
        THREADS.to_string(),
        HITS.to_string(),
    ];
    let mut seen = vec![Vec::new(); THREADS + 1];
    seen[0] = vec![0u32; SOLO];
    for fired in &mut seen[1..] {
        *fired = vec![0u32; HITS];
    }
    let (mut strays, mut lost, mut notices) = (0, 0, Vec::new());
    let mut engine = Engine::launch(
        &command,
        Box::new(FixtureResolver),
        EngineOptions {
            ring: RingUse::Required,
            ..EngineOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    let outcome = engine
        .run(&mut |event| match event {
            TraceEvent::Hit(hit) if hit.probe_name == "tick" => {
                let slot = hit.args.first().zip(hit.args.get(1)).and_then(|(&t, &i)| {
                    seen.get_mut(usize::try_from(t).ok()?)?
                        .get_mut(usize::try_from(i).ok()?)
                });
                match slot {
                    Some(count) => *count += 1,
                    None => strays += 1,
                }
            }
            TraceEvent::Lost { count, .. } => lost += count,
            TraceEvent::Notice(text) | TraceEvent::Detail(text) => notices.push(text),
            _ => {}
        })
        .unwrap();
    assert_eq!(outcome, Outcome::Exited(0));
    assert!(
        notices
            .iter()
            .any(|n| n.contains("probe sites write to a ring") && n.contains(", 0 stay on int3")),
        "every site (one per loop) is on the ring: {notices:#?}"
    );
    assert!(
        notices
            .iter()
            .any(|n| n.contains("one thread: its records reserve")),
        "the ring starts with the main thread alone: {notices:#?}"
    );
    assert_eq!(
        (strays, lost),
        (0, 0),
        "hits with arguments never fired, lost"
    );
    for (thread, fired) in seen.iter().enumerate() {
        let missing = fired.iter().filter(|&&n| n == 0).count();
        let twice = fired.iter().filter(|&&n| n > 1).count();
        assert_eq!(
            (missing, twice),
            (0, 0),
            "thread {thread}: hits missing, recorded more than once"
        );
    }
}
