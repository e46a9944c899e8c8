//! The argument evaluator against the C SDT fixture: a breakpoint on every site,
//! each hit's arguments decoded with `pyprobe_sdt::sdt`, compared with what the fixture
//! itself printed. A deliberately small ptrace loop, independent of pyprobe's engine,
//! so the decoder is checked on its own.

use std::collections::BTreeMap;

use crate::support::*;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::process::objects::find_probe_object;
use pyprobe_sdt::sdt;
use pyprobe_sdt::tracer::Registers;

/// Per probe: the decoded arguments of each hit, as the fixture prints them.
type Hits = BTreeMap<String, Vec<Vec<String>>>;

fn trace_fixture(binary: &str, iterations: u32) -> (Hits, BTreeMap<String, String>, String) {
    let mut target = Target::spawn(
        &fixture_binary(binary),
        &["--wait", &iterations.to_string()],
    );
    target.wait_for_line("pid");
    let pid = Pid::from_raw(target.pid());
    let object = find_probe_object(pid.as_raw(), "pyprobe_test").expect("fixture probes");
    let mut mem = ProcessMemory::new(pid.as_raw());

    ptrace::seize(pid, ptrace::Options::empty()).expect("seize");
    ptrace::interrupt(pid).expect("interrupt");
    assert!(matches!(
        waitpid(pid, None).unwrap(),
        WaitStatus::PtraceEvent(..) | WaitStatus::Stopped(..)
    ));

    let mut sites = BTreeMap::new();
    for probe in &object.elf.probes {
        if let Some(sem) = probe.semaphore {
            let addr = object.runtime(sem);
            let value = mem.read_u16(addr).unwrap();
            mem.write(addr, &(value + 1).to_le_bytes()).unwrap();
        }
        for site in &probe.sites {
            let addr = object.runtime(site.address);
            let mut byte = [0u8];
            mem.read(addr, &mut byte).unwrap();
            assert_eq!(byte, [0x90], "{} site is a nop", probe.name);
            mem.write(addr, &[0xcc]).unwrap();
            sites.insert(
                addr,
                (probe.name.clone(), sdt::parse_args(&site.args).unwrap()),
            );
        }
    }
    let symbols = |name: &str| object.elf.symbols.address(name).map(|a| object.runtime(a));
    ptrace::cont(pid, None).unwrap();
    target.send_line("go");

    let mut hits = Hits::new();
    let mut strings = BTreeMap::new();
    loop {
        match waitpid(pid, None).unwrap() {
            WaitStatus::Stopped(_, Signal::SIGTRAP) => {
                let regs = Registers(ptrace::getregs(pid).unwrap());
                let site = regs.0.rip - 1;
                let (name, args) = sites
                    .get(&site)
                    .unwrap_or_else(|| panic!("trap at {site:#x} is no site"));
                let values: Vec<String> = args
                    .iter()
                    .map(|a| {
                        let v = sdt::evaluate(a, &regs, &mem, &symbols).unwrap();
                        if a.signed {
                            (v as i64).to_string()
                        } else {
                            v.to_string()
                        }
                    })
                    .collect();
                if name == "str" {
                    let text = mem.read_c_string(values[0].parse().unwrap(), 256).unwrap();
                    strings.insert(name.clone(), text);
                }
                hits.entry(name.clone()).or_default().push(values);
                // rip already points after the int3, i.e. past the nop it replaced.
                ptrace::cont(pid, None).unwrap();
            }
            WaitStatus::Stopped(_, sig) => ptrace::cont(pid, sig).unwrap(),
            WaitStatus::Exited(_, code) => {
                assert_eq!(code, 0);
                break;
            }
            WaitStatus::Signaled(_, sig, _) => panic!("fixture killed by {sig}"),
            _ => ptrace::cont(pid, None).unwrap(),
        }
    }
    let stdout = target.read_rest();
    (hits, strings, stdout)
}

fn check(binary: &str) {
    let iterations = 3;
    let (hits, strings, stdout) = trace_fixture(binary, iterations);
    let mut checked = 0;
    for line in stdout.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["probe", name, values @ ..] => {
                let got = &hits[*name];
                for hit in got {
                    assert_eq!(hit, values, "{binary}: {name} decoded vs printed");
                }
                checked += 1;
            }
            ["string", name, ..] => {
                let text = line.splitn(3, ' ').nth(2).unwrap();
                assert_eq!(strings[*name], text, "{binary}: string argument");
            }
            ["fired", name, count] => {
                let count: usize = count.parse().unwrap();
                assert_eq!(
                    hits.get(*name).map_or(0, Vec::len),
                    count,
                    "{binary}: hits of {name}"
                );
                assert!(
                    count > 0,
                    "{binary}: {name} fired (gated fires because its semaphore was raised)"
                );
            }
            _ => {}
        }
    }
    assert_eq!(checked, 7, "{binary}: every probe was compared:\n{stdout}");
}

#[test]
fn decodes_every_argument_of_the_pie_fixture() {
    check("sdt_fixture_pie");
}

#[test]
fn decodes_every_argument_of_the_non_pie_fixture() {
    check("sdt_fixture_nopie");
}

#[test]
fn decodes_every_argument_of_the_shared_library_fixture() {
    check("sdt_fixture_lib");
}
