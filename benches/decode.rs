//! Per-hit decoding benchmarks: parsing SDT argument specs, evaluating a parsed
//! spec against registers and memory, and the tracer's whole per-hit decode
//! (`HitBuffers::decode`).
//!
//! `cargo bench --bench decode` runs them. Throughput is in elements: for
//! `sdt_parse` an element is one argument, elsewhere one probe hit.

use std::ffi::CString;
use std::hint::black_box;
use std::io;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::sdt::{evaluate, parse_args, ArgSpec, MemoryReader, RegFamily, RegisterFile};
use pyprobe_sdt::tracer::decode::HitBuffers;
use pyprobe_sdt::tracer::{Probe, Registers, Site};

#[path = "common/mod.rs"]
mod common;

/// Where the fake stack lives, and `_PyRuntime` within it.
const STACK: u64 = 0x7ffd_1000;
const PY_RUNTIME: u64 = STACK + 0x100;

/// A stopped thread's registers. The crate's own fakes are test-only, so the
/// bench has its own: an array indexed by family, as a GETREGS copy would be.
struct Regs([u64; 17]);

impl RegisterFile for Regs {
    fn read(&self, family: RegFamily) -> u64 {
        self.0[family.index()]
    }
}

/// One mapped region of target memory; anything outside it fails to read.
struct Memory {
    start: u64,
    bytes: Vec<u8>,
}

impl MemoryReader for Memory {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
        let src = address
            .checked_sub(self.start)
            .and_then(|off| usize::try_from(off).ok())
            .and_then(|off| self.bytes.get(off..off.checked_add(buf.len())?))
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "unmapped"))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

fn symbols(name: &str) -> Option<u64> {
    (name == "_PyRuntime").then_some(PY_RUNTIME)
}

fn fake_target() -> (Regs, Memory) {
    let mut regs = [0u64; 17];
    regs[RegFamily::R13.index()] = 0x5555_5570_1a40;
    regs[RegFamily::R14.index()] = 0x5555_5570_2b80;
    regs[RegFamily::Rax.index()] = 0xffff_ffff_0000_002a;
    regs[RegFamily::Rsp.index()] = STACK;
    regs[RegFamily::Rip.index()] = 0x5555_5555_8001;
    let bytes = (0..0x200u32).map(|i| (i * 7 + 3) as u8).collect();
    (
        Regs(regs),
        Memory {
            start: STACK,
            bytes,
        },
    )
}

fn bench_parse(c: &mut Criterion) {
    let specs = [
        ("function_entry", "8@%r13 8@%r14 -4@%eax"),
        ("stack_slot", "-4@112(%rsp)"),
        ("rip_symbol", "8@_PyRuntime+16(%rip)"),
    ];
    let mut group = c.benchmark_group("sdt_parse");
    for (name, spec) in specs {
        let args = parse_args(spec).expect("a valid spec");
        group.throughput(Throughput::Elements(args.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), spec, |b, spec| {
            b.iter(|| parse_args(black_box(spec)).unwrap())
        });
    }
    group.finish();
}

/// Evaluates every argument of one hit, as the tracer does.
fn evaluate_hit(args: &[ArgSpec], regs: &Regs, mem: &Memory) -> u64 {
    args.iter()
        .map(|a| evaluate(a, regs, mem, &symbols).unwrap())
        .fold(0, u64::wrapping_add)
}

fn bench_evaluate(c: &mut Criterion) {
    let (regs, mem) = fake_target();
    let specs = [
        // Registers only: no memory read.
        ("registers_3", "8@%r13 8@%r14 -4@%eax"),
        // A register, a stack slot and a %rip-relative symbol: two memory reads
        // and a symbol lookup.
        ("mixed_3", "8@%r13 -4@112(%rsp) 8@_PyRuntime+16(%rip)"),
    ];
    let mut group = c.benchmark_group("sdt_evaluate");
    group.throughput(Throughput::Elements(1));
    for (name, spec) in specs {
        let args = parse_args(spec).expect("a valid spec");
        group.bench_function(name, |b| {
            b.iter(|| evaluate_hit(black_box(&args), &regs, &mem))
        });
    }
    group.finish();
}

/// `HitBuffers::decode` reads string arguments with `process_vm_readv`, which
/// needs a live process but no ptrace stop: the bench points it at its own pid,
/// so the measured cost is the real per-hit decode minus `PTRACE_GETREGS` and
/// the stop/resume round trip.
fn bench_hit_decode(c: &mut Criterion) {
    let file = CString::new("/srv/app/src/app/pkg3/module_17.py").unwrap();
    let function = CString::new("dispatch_request").unwrap();
    // SAFETY: user_regs_struct is plain integers; all zero is a valid value.
    let mut raw: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    raw.r13 = file.as_ptr() as u64;
    raw.r14 = function.as_ptr() as u64;
    raw.rax = 118;
    raw.rdi = 2;
    let regs = Registers(raw);
    let mem = ProcessMemory::new(std::process::id() as i32);
    let no_symbols = |_: &str| None;

    let probe = |name: &str, spec: &str, string_args: Vec<bool>| {
        let site = Site::new(0x5555_5555_8000, parse_args(spec).expect("a valid spec"));
        Probe {
            name: name.into(),
            semaphore: None,
            sites: vec![site],
            string_args,
        }
    };
    let entry = probe(
        "function__entry",
        "8@%r13 8@%r14 -4@%eax",
        vec![true, true, false],
    );
    let gc = probe("gc__start", "-4@%edi", vec![false]);

    let mut buffers = HitBuffers::default();
    buffers.decode(&entry, &entry.sites[0], &regs, &mem, &no_symbols);
    assert_eq!(
        buffers.string(0),
        Some("/srv/app/src/app/pkg3/module_17.py"),
        "process_vm_readv on our own pid failed; is it blocked here?"
    );
    assert_eq!(buffers.string(1), Some("dispatch_request"));

    let mut group = c.benchmark_group("hit_decode");
    group.throughput(Throughput::Elements(1));
    // Two string arguments: one batched process_vm_readv per hit.
    group.bench_function("function_entry_2_strings", |b| {
        b.iter(|| {
            buffers.decode(&entry, &entry.sites[0], &regs, &mem, &no_symbols);
            black_box(buffers.args[2])
        })
    });
    // No string argument: no system call, the pure part of the path.
    group.bench_function("gc_start_no_strings", |b| {
        b.iter(|| {
            buffers.decode(&gc, &gc.sites[0], &regs, &mem, &no_symbols);
            black_box(buffers.args[0])
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::short_runs();
    targets = bench_parse, bench_evaluate, bench_hit_decode
}

criterion_main!(benches);
