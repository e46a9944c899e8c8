//! Site qualification and trampoline construction on hand-made bytes and on
//! a real CPython binary.

use std::path::Path;
use std::time::Instant;

use iced_x86::{Code, Decoder, DecoderOptions, FlowControl};

use super::codegen::{build_trampoline, CodegenError, FlagSave, ThreadIdSource, TrampolineParams};
use super::site::{plans_overlap, qualify_site, thread_inside, SitePlan, SiteRefusal, Tail};
use super::BranchTargets;
use crate::sdt::parse_args;

const BASE: u64 = 0x40_1000;

fn qualify(code: &[u8]) -> Result<SitePlan, SiteRefusal> {
    qualify_at(code, BASE)
}

fn qualify_at(code: &[u8], site: u64) -> Result<SitePlan, SiteRefusal> {
    let targets = BranchTargets::scan(code, BASE);
    qualify_site(code, BASE, site, &targets)
}

fn no_symbols(_: &str) -> Option<u64> {
    None
}

fn params<'a>(
    args: &'a [crate::sdt::ArgSpec],
    strings: &'a [bool],
    tramp: u64,
) -> TrampolineParams<'a> {
    TrampolineParams {
        flags: FlagSave::for_this_cpu(),
        let_go: None,
        probe_id: 1,
        args,
        string_args: strings,
        ring_addr: 0x7f00_0000_0000,
        capacity: 1024,
        tramp_addr: tramp,
        tag_addr: tramp + 0xff0,
        thread_id: ThreadIdSource::FsSelfPointer,
        symbols: &no_symbols,
        stack: None,
    }
}

#[test]
fn plain_site_jumps_back() {
    // nop; mov rcx, [rbx+0x20]; ret
    let plan = qualify(&[0x90, 0x48, 0x8b, 0x4b, 0x20, 0xc3]).expect("qualifies");
    assert_eq!(
        (plan.len(), plan.tail(), plan.end()),
        (5, Tail::JumpBack, BASE + 5)
    );
    assert_eq!(plan.original(), &[0x90, 0x48, 0x8b, 0x4b, 0x20]);
    assert_eq!(plan.displaced().len(), 1);
    assert!(!thread_inside(BASE, &plan));
    assert!(thread_inside(BASE + 1, &plan) && thread_inside(BASE + 4, &plan));
    assert!(!thread_inside(BASE + 5, &plan));
}

#[test]
fn branch_into_the_patch_is_refused() {
    // nop; mov rcx, [rbx+0x20]; ret; jmp -7 (to site+1)
    let code = [0x90, 0x48, 0x8b, 0x4b, 0x20, 0xc3, 0xeb, 0xf9];
    assert_eq!(
        qualify(&code).err(),
        Some(SiteRefusal::BranchIntoPatch { target: BASE + 1 })
    );
    // A branch to the site itself is fine: it runs the patched jmp.
    let code = [0x90, 0x48, 0x8b, 0x4b, 0x20, 0xc3, 0xeb, 0xf8];
    assert!(qualify(&code).is_ok());
    // A branch to site + len is fine too.
    let code = [0x90, 0x48, 0x8b, 0x4b, 0x20, 0xc3, 0xeb, 0xfd];
    assert!(qualify(&code).is_ok());
}

#[test]
fn site_must_be_a_nop_inside_the_segment() {
    assert_eq!(
        qualify(&[0xcc, 0x48, 0x8b, 0x4b, 0x20]).err(),
        Some(SiteRefusal::NotNop {
            site: BASE,
            found: 0xcc
        })
    );
    assert_eq!(
        qualify_at(&[0x90; 8], BASE + 8).err(),
        Some(SiteRefusal::OutsideSegment { site: BASE + 8 })
    );
    assert_eq!(
        qualify_at(&[0x90; 8], BASE - 1).err(),
        Some(SiteRefusal::OutsideSegment { site: BASE - 1 })
    );
    let end = BASE + 3;
    for code in [
        &[0x90][..],
        &[0x90, 0x48, 0x8b][..],
        &[0x90, 0x90, 0x90][..],
    ] {
        let end = BASE + code.len() as u64;
        assert_eq!(
            qualify(code).err(),
            Some(SiteRefusal::PastSegmentEnd { end })
        );
    }
    assert!(end > BASE);
}

#[test]
fn trailing_jmp_needs_no_jump_back() {
    // nop; jmp rel32
    let plan = qualify(&[0x90, 0xe9, 0x10, 0, 0, 0]).expect("qualifies");
    assert_eq!((plan.len(), plan.tail()), (6, Tail::Terminates));
    // nop; xor eax, eax; ret is too short (the bytes after ret are unknown).
    let err = qualify(&[0x90, 0x31, 0xc0, 0xc3, 0x90, 0x90]).err();
    assert!(
        matches!(err, Some(SiteRefusal::EndsTooEarly { covered: 4, .. })),
        "{err:?}"
    );
    // nop; mov rax, rdi; ret ends exactly at 5 bytes.
    let plan = qualify(&[0x90, 0x48, 0x89, 0xf8, 0xc3]).expect("qualifies");
    assert_eq!(plan.tail(), Tail::Terminates);
    // nop; jmp rax; ... too short.
    assert!(qualify(&[0x90, 0xff, 0xe0, 0x90, 0x90]).is_err());
    // nop; xor eax,eax; call rel32: an emulated call.
    let plan = qualify(&[0x90, 0x31, 0xc0, 0xe8, 0, 1, 0, 0]).expect("qualifies");
    assert_eq!(
        plan.tail(),
        Tail::Call {
            target: BASE + 8 + 0x100
        }
    );
}

#[test]
fn unmovable_instructions_are_refused() {
    let cases: [&[u8]; 7] = [
        &[0x90, 0x0f, 0x05, 0x90, 0x90, 0x90],             // syscall
        &[0x90, 0xcc, 0x90, 0x90, 0x90],                   // int3
        &[0x90, 0xf3, 0x0f, 0x1e, 0xfa, 0x90],             // endbr64
        &[0x90, 0xff, 0xd0, 0x90, 0x90, 0x90],             // call rax
        &[0x90, 0x0f, 0x0b, 0x90, 0x90],                   // ud2
        &[0x90, 0xc7, 0xf8, 0, 0, 0, 0],                   // xbegin
        &[0x90, 0x48, 0x8b, 0x05, 0xf9, 0xff, 0xff, 0xff], // mov rax, [rip-7]: the patch itself
    ];
    for code in cases {
        let err = qualify(code).expect_err("refused");
        assert!(
            matches!(err, SiteRefusal::NotRelocatable { .. }),
            "{code:02x?}: {err}"
        );
        assert!(err.to_string().contains("cannot be moved"));
    }
    // Undecodable bytes (0x06 is invalid in 64-bit mode).
    assert_eq!(
        qualify(&[0x90, 0x06, 0x90, 0x90, 0x90]).err(),
        Some(SiteRefusal::Undecodable { addr: BASE + 1 })
    );
}

#[test]
fn overlapping_plans() {
    let code = [0x90, 0x90, 0x48, 0x8b, 0x4b, 0x20, 0xc3, 0xc3, 0xc3];
    let a = qualify_at(&code, BASE).expect("a");
    let b = qualify_at(&code, BASE + 1).expect("b");
    assert!(plans_overlap(&a, &b) && plans_overlap(&b, &a));
    let far = [0x90, 0x48, 0x8b, 0x4b, 0x20, 0x90, 0x48, 0x8b, 0x4b, 0x20];
    let a = qualify_at(&far, BASE).expect("a");
    let b = qualify_at(&far, BASE + 5).expect("b");
    assert!(!plans_overlap(&a, &b));
}

/// Decodes a trampoline and returns its instructions.
fn decode(code: &[u8], ip: u64) -> Vec<iced_x86::Instruction> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    decoder.iter().collect()
}

#[test]
fn relocation_keeps_rip_targets_and_widens_rel8() {
    // nop; mov rdx, [rip+0x100]; jz +0x10  (rel8)
    let code = [0x90, 0x48, 0x8b, 0x15, 0, 1, 0, 0, 0x74, 0x10, 0xc3];
    let plan = qualify(&code).expect("qualifies");
    assert_eq!(plan.len(), 8, "stops once 5 bytes are covered");
    let code = [0x90, 0x74, 0x10, 0x48, 0x8b, 0x15, 0, 1, 0, 0, 0xc3];
    let plan = qualify(&code).expect("qualifies");
    assert_eq!(plan.len(), 10);
    let rip_target = BASE + 10 + 0x100;
    let jz_target = BASE + 3 + 0x10;
    let tramp_addr = BASE + 0x10_0000;
    let t = build_trampoline(&plan, &params(&[], &[], tramp_addr)).expect("builds");
    let instrs = decode(&t.code, tramp_addr);
    let load = instrs
        .iter()
        .find(|i| i.code() == Code::Mov_r64_rm64 && i.is_ip_rel_memory_operand())
        .expect("relocated load");
    assert_eq!(load.ip_rel_memory_address(), rip_target);
    let jz = instrs
        .iter()
        .find(|i| {
            i.flow_control() == FlowControl::ConditionalBranch
                && i.near_branch_target() == jz_target
        })
        .expect("relocated jz");
    assert_eq!(jz.code(), Code::Je_rel32_64, "widened to rel32");
    let last = instrs.last().expect("code");
    assert_eq!(
        (last.code(), last.near_branch_target()),
        (Code::Jmp_rel32_64, BASE + 10)
    );
    assert_eq!(t.patch[0], 0xe9);
    let rel = i32::from_le_bytes([t.patch[1], t.patch[2], t.patch[3], t.patch[4]]);
    assert_eq!(BASE + 5 + rel as u64, tramp_addr);
    assert_eq!(&t.patch[5..], &[0xcc; 5]);
    assert!(t.contains(tramp_addr) && !t.contains(tramp_addr + t.len() as u64));
}

#[test]
fn codegen_refuses_bad_requests() {
    let plan = qualify(&[0x90, 0x48, 0x8b, 0x4b, 0x20, 0xc3]).expect("qualifies");
    let args = parse_args("8@%rax -4@%eax 8@sym(%rip) 1@%al 1@%bl 1@%cl 1@%dl").expect("spec");
    let near = BASE + 0x1000;
    fn refused(
        plan: &SitePlan,
        args: &[crate::sdt::ArgSpec],
        strings: &[bool],
        tramp: u64,
        edit: &dyn Fn(&mut TrampolineParams<'_>),
    ) -> CodegenError {
        let mut p = params(args, strings, tramp);
        edit(&mut p);
        build_trampoline(plan, &p).expect_err("refused")
    }
    let err = |args, strings, tramp, edit: &dyn Fn(&mut TrampolineParams<'_>)| {
        refused(&plan, args, strings, tramp, edit)
    };
    let none = |_: &mut TrampolineParams<'_>| {};
    assert!(matches!(
        err(&args, &[], near, &none),
        CodegenError::TooManyArgs(7)
    ));
    assert!(matches!(
        err(&args[..2], &[false, true], near, &none),
        CodegenError::StringNotPointer { index: 1, .. }
    ));
    assert!(matches!(
        err(&args[..1], &[true, true], near, &none),
        CodegenError::StringFlags(2, 1)
    ));
    assert!(matches!(
        err(&args[..3], &[], near, &none),
        CodegenError::UnresolvedSymbol { index: 2, .. }
    ));
    assert!(matches!(
        err(&args[..1], &[], BASE + (3 << 30), &none),
        CodegenError::TooFar { .. }
    ));
    assert!(matches!(
        err(&args[..1], &[], near, &|p| p.capacity = 1000),
        CodegenError::Ring(_)
    ));
    assert!(matches!(
        err(&args[..1], &[], near, &|p| p.tag_addr = near + 8),
        CodegenError::TagOverlap { .. }
    ));
    let mut bad = args[0].clone();
    bad.size = 3;
    assert!(matches!(
        err(std::slice::from_ref(&bad), &[], near, &none),
        CodegenError::BadSize { size: 3, .. }
    ));
    // Symbols resolve through the caller's resolver.
    let resolve = |n: &str| (n == "sym").then_some(0x7000_0000u64);
    let mut p = params(&args[..3], &[], near);
    p.symbols = &resolve;
    assert!(build_trampoline(&plan, &p).is_ok());
}

/// The CPython 3.9 build shipped in `.pythons` (skipped when absent).
#[test]
fn python39_sites() {
    let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .join(".pythons/3.9/usr/bin/python3.9");
    if !path.exists() {
        eprintln!(
            "note: {} not present; real-binary site test skipped",
            path.display()
        );
        return;
    }
    let info = crate::elf::ElfInfo::read(&path).expect("elf");
    let data = std::fs::read(&path).expect("read");
    let seg = info
        .segments
        .iter()
        .find(|s| s.executable)
        .expect("executable segment");
    let start = usize::try_from(seg.offset).expect("offset");
    let text = &data[start..start + usize::try_from(seg.filesz).expect("size")];
    let t0 = Instant::now();
    let mut targets = BranchTargets::scan(text, seg.vaddr);
    let scan_time = t0.elapsed();
    let branch_targets = targets.len();
    let t0 = Instant::now();
    let code = seg.vaddr..seg.vaddr + seg.memsz;
    for s in info.segments.iter().filter(|s| !s.executable) {
        let (off, len) = (s.offset as usize, s.filesz as usize);
        if let Some(bytes) = data.get(off..off + len) {
            targets.add_code_pointers(bytes, s.vaddr, code.clone());
        }
    }
    eprintln!(
        "scan of {} KiB of code: {branch_targets} branch targets in {scan_time:?}; \
         {} more from code pointers in data in {:?}",
        text.len() / 1024,
        targets.len() - branch_targets,
        t0.elapsed()
    );
    let symbols = |name: &str| info.symbols.address(name);
    let mut qualified = Vec::new();
    for probe in info.provider_probes("python") {
        for site in &probe.sites {
            match qualify_site(text, seg.vaddr, site.address, &targets) {
                Ok(plan) => {
                    let args = parse_args(&site.args).expect("spec");
                    let mut p = params(&args, &[], seg.vaddr + seg.memsz + 0x1000);
                    p.symbols = &symbols;
                    let t = build_trampoline(&plan, &p).expect("trampoline builds");
                    eprintln!(
                        "{:28} {:#x}: qualifies, {} bytes displaced, {:?}, trampoline {} bytes",
                        probe.name,
                        site.address,
                        plan.len(),
                        plan.tail(),
                        t.len()
                    );
                    qualified.push((probe.name.clone(), plan.len(), plan.tail()));
                }
                Err(e) => eprintln!("{:28} {:#x}: refused: {e}", probe.name, site.address),
            }
        }
    }
    let find = |name: &str| qualified.iter().find(|q| q.0 == name).map(|q| (q.1, q.2));
    // function__entry: nop; mov 0x20(%rbx),%rcx.  function__return: nop; jmp rel32.
    assert_eq!(find("function__entry"), Some((5, Tail::JumpBack)));
    assert_eq!(find("function__return"), Some((6, Tail::Terminates)));
}

/// A trampoline asks for the lines of the slot `PREFETCH_AHEAD` records on, for
/// writing: the index masked into the ring (the wrap stays inside it), one
/// `prefetchw` per line its records write (two for the fixed part, four with
/// strings), or none on a CPU without the instruction.
#[test]
fn trampolines_prefetch_a_slot_ahead_inside_the_ring() {
    use super::codegen::{has_prefetchw, PREFETCH_AHEAD};
    use super::format::{HEADER_SIZE, SLOT_SIZE};
    use iced_x86::{Mnemonic, OpKind, Register};

    let plan = qualify(&[0x90, 0x48, 0x8b, 0x4b, 0x20, 0xc3]).expect("qualifies");
    let args = parse_args("8@%rdi 8@%rsi -4@%edx").expect("specs");
    let tramp = BASE + 0x1000;
    for (strings, lines) in [
        (&[true, true, false][..], 4),
        (&[false, false, false][..], 2),
    ] {
        let built = build_trampoline(&plan, &params(&args, strings, tramp)).expect("builds");
        let code = decode(&built.code, tramp);
        let at: Vec<usize> = (0..code.len())
            .filter(|&i| code[i].mnemonic() == Mnemonic::Prefetchw)
            .collect();
        if !has_prefetchw() {
            assert!(at.is_empty(), "no prefetchw on this CPU");
            continue;
        }
        assert_eq!(at.len(), lines, "strings {strings:?}");
        for (line, &i) in at.iter().enumerate() {
            let p = &code[i];
            assert_eq!(
                (p.memory_base(), p.memory_index()),
                (Register::R9, Register::RAX)
            );
            assert_eq!(p.memory_index_scale(), 1);
            assert_eq!(p.memory_displacement64(), (HEADER_SIZE + 64 * line) as u64);
        }
        // rax = ((r10 + AHEAD) & (capacity - 1)) << log2(SLOT_SIZE), just before.
        let first = at[0];
        assert!(first >= 3);
        let (lea, and, shl) = (&code[first - 3], &code[first - 2], &code[first - 1]);
        assert_eq!(
            (lea.mnemonic(), lea.op0_register()),
            (Mnemonic::Lea, Register::RAX)
        );
        assert_eq!(
            (lea.memory_base(), lea.memory_displacement64()),
            (Register::R10, PREFETCH_AHEAD as u64)
        );
        assert_eq!(
            (and.mnemonic(), and.op0_register()),
            (Mnemonic::And, Register::RAX)
        );
        assert_eq!(and.op1_kind(), OpKind::Immediate32to64);
        assert_eq!(and.immediate64(), 1024 - 1);
        assert_eq!(
            (shl.mnemonic(), u32::from(shl.immediate8())),
            (Mnemonic::Shl, SLOT_SIZE.trailing_zeros())
        );
    }
}
