//! The ptrace engine on a program that is not Python: the C SDT fixture started
//! under the engine, every hit decoded, compared with what the fixture printed.

use std::collections::BTreeMap;

use crate::support::*;
use anyhow::Result;
use pyprobe::process::objects::find_probe_object;
use pyprobe::sdt;
use pyprobe::tracer::{
    Engine, EngineOptions, Outcome, Probe, ProbeSet, Resolver, RingUse, Site, TraceEvent,
};

struct FixtureResolver;

impl Resolver for FixtureResolver {
    fn resolve(&mut self, pid: i32) -> Result<Option<ProbeSet>> {
        let Ok(object) = find_probe_object(pid, "pyprobe_test") else {
            return Ok(None);
        };
        if !object.is_fully_mapped(&pyprobe::process::read_maps(pid)?) {
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
