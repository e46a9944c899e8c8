//! Tests that run generated trampolines in-process.
//!
//! Each test assembles a small "site function" into an executable mapping,
//! runs it once unpatched, patches its `nop` with a jump to a trampoline
//! built by `codegen`, runs it again, and compares: the ring must hold the
//! record `sdt::evaluate` predicts, and every register, the flags and the
//! red zone must be as in the unpatched run.

use std::ffi::CStr;
use std::io;
use std::time::Instant;

use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, Code, Instruction, MemoryOperand, Register as IcedReg};

use super::codegen::{build_trampoline, FlagSave, ThreadIdSource, Trampoline, TrampolineParams};
use super::consumer::RingStack;
use super::consumer::{DrainStop, RingReader};
use super::format::{
    init_ring, ring_bytes, string_area, Slots, H_HEAD, H_TAIL, THIN_COUNT, THIN_OFF, THIN_STACKLESS,
};
use super::site::{qualify_site, SitePlan, Tail};
use super::stack::{
    frames_for, CurrentThreadState, StackCapture, StackFrame, StackRoot, MAX_STACK_SLOTS,
    PAIRS_PER_SLOT,
};
use super::BranchTargets;
use crate::sdt::{evaluate, parse_args, ArgSpec, MemoryReader, RegFamily};

const ZONE_TRAMP: usize = 0x1_0000;
const ZONE_DATA: usize = 0x2_0000;
const REGION_LEN: usize = 0x3_0000;

// Offsets inside the data zone.
const SNAP: usize = 0; // 16 registers by RegFamily index, flags, 16 red-zone qwords
const SNAP_FLAGS: usize = 16;
const SNAP_RED: usize = 17;
const SNAP_WORDS: usize = 33;
const BLOCK: usize = 0x400;
const RIPVAR: usize = 0x800;
const STR_SHORT: usize = 0x1000;
const STR_LONG: usize = 0x1100;
const STR_41: usize = 0x1300;
const TAG: usize = 0x2000;
/// Where in BLOCK a tagged pointer to STR_LONG sits.
const THROUGH_WORD: usize = 0x180;

const TAG_VALUE: u32 = 0xa5a5_0001;
const CANARY: i32 = 0x5a5a_0000;
/// CF PF AF ZF SF DF OF and the always-one bit 1.
const FLAGS_Z: i32 = 0xcd7;
const FLAGS_NZ: i32 = FLAGS_Z & !0x40;
const FRAME_SIZE: i32 = 0x100;
const ENTRY_STRINGS: &str = "8@%r13 8@%r14 -4@%eax -4@112(%rsp) 8@-8(%rbp) -1@%ah";

/// One anonymous mapping split into code, trampoline and data zones, so
/// everything is within ±2 GiB of everything else.
struct Region {
    base: *mut u8,
}

// SAFETY: the mapping is only written before threads start; threads only execute it.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

impl Region {
    fn new() -> Region {
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGION_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap: {}", io::Error::last_os_error());
        let region = Region { base: p.cast() };
        region.protect_code(false);
        region.put(STR_SHORT, b"file.py\0");
        let long: Vec<u8> = (0..300).map(|i| b'a' + (i % 26) as u8).chain([0]).collect();
        region.put(STR_LONG, &long);
        let s41: Vec<u8> = (0..41).map(|i| b'0' + (i % 10) as u8).chain([0]).collect();
        region.put(STR_41, &s41);
        let block: Vec<u8> = (0..512u32).map(|i| (i * 37 + 11) as u8).collect();
        region.put(BLOCK, &block);
        // A tagged pointer (low bit set) to the long string, for `Through` arguments.
        let tagged = region.data(STR_LONG) | 1;
        region.put(BLOCK + THROUGH_WORD, &tagged.to_le_bytes());
        region.put(RIPVAR, &0x0bad_f00d_1234_5678u64.to_le_bytes());
        region.put(TAG, &TAG_VALUE.to_le_bytes());
        region
    }

    fn addr(&self, offset: usize) -> u64 {
        self.base as u64 + offset as u64
    }

    fn data(&self, offset: usize) -> u64 {
        self.addr(ZONE_DATA + offset)
    }

    fn protect_code(&self, writable: bool) {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ | libc::PROT_EXEC
        };
        // SAFETY: the code and trampoline zones are the first ZONE_DATA bytes of our mapping.
        let rc = unsafe { libc::mprotect(self.base.cast(), ZONE_DATA, prot) };
        assert_eq!(rc, 0, "mprotect: {}", io::Error::last_os_error());
    }

    fn write_code(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= ZONE_DATA);
        self.protect_code(true);
        // SAFETY: in bounds (checked above) and writable now.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(offset), bytes.len())
        };
        self.protect_code(false);
    }

    fn code(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= ZONE_DATA);
        // SAFETY: readable code zone, in bounds.
        unsafe { std::slice::from_raw_parts(self.base.add(offset), len) }
    }

    fn put(&self, offset: usize, bytes: &[u8]) {
        assert!(ZONE_DATA + offset + bytes.len() <= REGION_LEN);
        // SAFETY: the data zone is always writable; in bounds.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.base.add(ZONE_DATA + offset),
                bytes.len(),
            )
        };
    }

    fn snapshot(&self) -> [u64; SNAP_WORDS] {
        let mut out = [0u64; SNAP_WORDS];
        for (i, w) in out.iter_mut().enumerate() {
            // SAFETY: aligned words inside the data zone.
            *w = unsafe {
                std::ptr::read_volatile(self.base.add(ZONE_DATA + SNAP + 8 * i).cast::<u64>())
            };
        }
        out
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), REGION_LEN) };
    }
}

/// A ring in its own mapping, as the engine would map the memfd.
struct Ring {
    base: *mut u8,
    len: usize,
}

// SAFETY: only accessed through atomics (reader) and the trampolines.
unsafe impl Send for Ring {}
// SAFETY: as for Send.
unsafe impl Sync for Ring {}

impl Ring {
    fn new(capacity: u64) -> Ring {
        let len = ring_bytes(capacity, Slots::Records).expect("capacity");
        // SAFETY: a fresh shared anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping is len bytes, not yet shared with anyone.
        let mem = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) };
        init_ring(mem, capacity, Slots::Records).expect("init");
        Ring {
            base: p.cast(),
            len,
        }
    }

    fn addr(&self) -> u64 {
        self.base as u64
    }

    /// Marks everything read (tail = head), as a consumer that drops records.
    fn discard(&self) {
        use std::sync::atomic::{AtomicU64, Ordering};
        // SAFETY: header words of our 8-aligned mapping.
        let (head, tail) = unsafe {
            (
                AtomicU64::from_ptr(self.base.add(H_HEAD).cast()),
                AtomicU64::from_ptr(self.base.add(H_TAIL).cast()),
            )
        };
        tail.store(head.load(Ordering::Acquire), Ordering::Release);
    }

    fn reader(&self) -> RingReader {
        // SAFETY: the mapping outlives every reader in these tests.
        unsafe { RingReader::new(self.base, self.len) }.expect("valid ring")
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn fs_base() -> u64 {
    const ARCH_GET_FS: libc::c_int = 0x1003;
    let mut base = 0u64;
    // SAFETY: arch_prctl(ARCH_GET_FS) writes one u64 through the pointer.
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_FS, &mut base as *mut u64) };
    assert_eq!(rc, 0);
    base
}

/// `mov [abs], reg` / `mov reg, [abs]` as rip-relative instructions.
fn rip_mem(addr: u64) -> MemoryOperand {
    MemoryOperand::with_base_displ(IcedReg::RIP, addr as i64)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// nop; mov rcx, [rbx+0x20]
    Load,
    /// nop; mov rdx, [rip+RIPVAR]
    RipLoad,
    /// nop; jz short taken; mov ecx, [rbx+0x20]
    Jcc8,
    /// nop; jmp rel32 far
    TailJmp,
    /// nop; call helper
    TailCall,
}

const VARIANTS: [Variant; 5] = [
    Variant::Load,
    Variant::RipLoad,
    Variant::Jcc8,
    Variant::TailJmp,
    Variant::TailCall,
];

/// Register values at the site, by RegFamily index (rbp and rsp come from the snapshot).
fn site_regs(region: &Region) -> [u64; 16] {
    let mut r = [0u64; 16];
    r[RegFamily::Rax.index()] = 0x0123_4567_ffff_9ad6;
    r[RegFamily::Rbx.index()] = region.data(BLOCK);
    r[RegFamily::Rcx.index()] = 3;
    r[RegFamily::Rdx.index()] = region.data(BLOCK + 0x80);
    r[RegFamily::Rsi.index()] = 0xfedc_ba98_7654_3210;
    r[RegFamily::Rdi.index()] = 7;
    r[RegFamily::R8.index()] = region.data(STR_41);
    r[RegFamily::R9.index()] = -2i64 as u64;
    r[RegFamily::R10.index()] = 0x7fff_ffff_ffff_ffff;
    r[RegFamily::R11.index()] = 0xdead_beef_cafe_f00d;
    r[RegFamily::R12.index()] = 0x1212_3434_5656_7878;
    r[RegFamily::R13.index()] = region.data(STR_SHORT);
    r[RegFamily::R14.index()] = region.data(STR_LONG);
    r[RegFamily::R15.index()] = 0x8000_0000_0000_0015;
    r
}

const SET_REGS: [(RegFamily, AsmRegister64); 14] = [
    (RegFamily::Rax, rax),
    (RegFamily::Rbx, rbx),
    (RegFamily::Rcx, rcx),
    (RegFamily::Rdx, rdx),
    (RegFamily::Rsi, rsi),
    (RegFamily::Rdi, rdi),
    (RegFamily::R8, r8),
    (RegFamily::R9, r9),
    (RegFamily::R10, r10),
    (RegFamily::R11, r11),
    (RegFamily::R12, r12),
    (RegFamily::R13, r13),
    (RegFamily::R14, r14),
    (RegFamily::R15, r15),
];

const SNAP_REGS: [(RegFamily, IcedReg); 16] = [
    (RegFamily::Rax, IcedReg::RAX),
    (RegFamily::Rbx, IcedReg::RBX),
    (RegFamily::Rcx, IcedReg::RCX),
    (RegFamily::Rdx, IcedReg::RDX),
    (RegFamily::Rsi, IcedReg::RSI),
    (RegFamily::Rdi, IcedReg::RDI),
    (RegFamily::Rbp, IcedReg::RBP),
    (RegFamily::Rsp, IcedReg::RSP),
    (RegFamily::R8, IcedReg::R8),
    (RegFamily::R9, IcedReg::R9),
    (RegFamily::R10, IcedReg::R10),
    (RegFamily::R11, IcedReg::R11),
    (RegFamily::R12, IcedReg::R12),
    (RegFamily::R13, IcedReg::R13),
    (RegFamily::R14, IcedReg::R14),
    (RegFamily::R15, IcedReg::R15),
];

/// A site function in the region: `extern "C" fn()`.
struct SiteFn {
    entry: u64,
    site: u64,
    len: usize,
}

impl SiteFn {
    fn call(&self) {
        // SAFETY: `entry` is a function we assembled with the C ABI: it saves
        // and restores callee-saved registers, clears DF and returns.
        let f: extern "C" fn() = unsafe { std::mem::transmute(self.entry as usize) };
        f();
    }
}

/// Assembles `a` at the start of `region`, writes it there and returns the site
/// function, its site being the address of label `site`.
fn place_site_fn(region: &Region, a: &mut CodeAssembler, site: &CodeLabel) -> SiteFn {
    let entry = region.addr(0);
    let result = a
        .assemble_options(entry, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)
        .expect("assemble");
    let site = result.label_ip(site).expect("site label");
    let code = result.inner.code_buffer;
    region.write_code(0, &code);
    SiteFn {
        entry,
        site,
        len: code.len(),
    }
}

fn assemble_site_fn(region: &Region, variant: Variant, flags: i32) -> SiteFn {
    let mut a = CodeAssembler::new(64).expect("asm");
    let step = |r: Result<(), IcedError>| r.expect("assemble");
    let regs = site_regs(region);
    let mut site = a.create_label();
    let mut after = a.create_label();
    let mut helper = a.create_label();
    for r in [rbx, rbp, r12, r13, r14, r15] {
        step(a.push(r));
    }
    step(a.sub(rsp, FRAME_SIZE));
    step(a.lea(rbp, ptr(rsp + 0x80)));
    step(a.mov(qword_ptr(rbp - 8), -12345));
    step(a.mov(dword_ptr(rsp + 112), -7));
    step(a.push(flags));
    step(a.popfq());
    // From here on only mov/lea: the flags stay as set.
    for i in 0..16 {
        step(a.mov(qword_ptr(rsp - 8 * (i + 1)), CANARY + i));
    }
    for (family, reg) in SET_REGS {
        step(a.mov(reg, regs[family.index()]));
    }
    step(a.set_label(&mut site));
    step(a.nop());
    match variant {
        Variant::Load => step(a.mov(rcx, qword_ptr(rbx + 0x20))),
        Variant::RipLoad => {
            let load = Instruction::with2(
                Code::Mov_r64_rm64,
                IcedReg::RDX,
                rip_mem(region.data(RIPVAR)),
            );
            step(a.add_instruction(load.expect("instr")));
        }
        Variant::Jcc8 => {
            let mut taken = a.create_label();
            step(a.jz(taken));
            step(a.mov(ecx, dword_ptr(rbx + 0x20)));
            step(a.jmp(after));
            step(a.set_label(&mut taken));
            step(a.mov(r12, 0x777u64));
            step(a.jmp(after));
        }
        Variant::TailJmp => {
            let mut far = a.create_label();
            step(a.jmp(far));
            step(a.db(&[0xcc; 200]));
            step(a.set_label(&mut far));
            step(a.mov(r12, 0x4242u64));
        }
        Variant::TailCall => step(a.call(helper)),
    }
    step(a.set_label(&mut after));
    for (family, reg) in SNAP_REGS {
        let addr = region.data(SNAP + 8 * family.index());
        let store = Instruction::with2(Code::Mov_rm64_r64, rip_mem(addr), reg);
        step(a.add_instruction(store.expect("instr")));
    }
    for i in 0..16 {
        step(a.mov(rax, qword_ptr(rsp - 8 * (i + 1))));
        let addr = region.data(SNAP + 8 * (SNAP_RED + i as usize));
        let store = Instruction::with2(Code::Mov_rm64_r64, rip_mem(addr), IcedReg::RAX);
        step(a.add_instruction(store.expect("instr")));
    }
    step(a.pushfq());
    step(a.pop(rax));
    let store = Instruction::with2(
        Code::Mov_rm64_r64,
        rip_mem(region.data(SNAP + 8 * SNAP_FLAGS)),
        IcedReg::RAX,
    );
    step(a.add_instruction(store.expect("instr")));
    step(a.cld());
    step(a.add(rsp, FRAME_SIZE));
    for r in [r15, r14, r13, r12, rbp, rbx] {
        step(a.pop(r));
    }
    step(a.ret());
    step(a.set_label(&mut helper));
    step(a.mov(r12, 0x5151u64));
    step(a.ret());
    place_site_fn(region, &mut a, &site)
}

fn plan_for(region: &Region, f: &SiteFn) -> SitePlan {
    let text = region.code(0, f.len);
    let targets = BranchTargets::scan(text, region.addr(0));
    qualify_site(text, region.addr(0), f.site, &targets).expect("site qualifies")
}

struct Probe {
    args: Vec<ArgSpec>,
    strings: Vec<bool>,
}

fn probe(spec: &str, strings: &[bool]) -> Probe {
    Probe {
        args: parse_args(spec).expect("spec"),
        strings: strings.to_vec(),
    }
}

fn symbols_for(region: &Region) -> impl Fn(&str) -> Option<u64> + '_ {
    move |name: &str| (name == "blk").then(|| region.data(BLOCK))
}

fn install(
    region: &Region,
    plan: &SitePlan,
    p: &Probe,
    ring: &Ring,
    capacity: u64,
    thread_id: ThreadIdSource,
) -> Trampoline {
    let flags = FlagSave::for_this_cpu();
    install_with(region, plan, p, ring, capacity, thread_id, flags, None)
}

#[allow(clippy::too_many_arguments)]
fn install_with(
    region: &Region,
    plan: &SitePlan,
    p: &Probe,
    ring: &Ring,
    capacity: u64,
    thread_id: ThreadIdSource,
    flags: FlagSave,
    let_go: Option<std::ops::Range<u64>>,
) -> Trampoline {
    let symbols = symbols_for(region);
    let params = TrampolineParams {
        flags,
        let_go,
        probe_id: 0x1234_5678,
        args: &p.args,
        string_args: &p.strings,
        ring_addr: ring.addr(),
        capacity,
        tramp_addr: region.addr(ZONE_TRAMP),
        tag_addr: region.data(TAG),
        thread_id,
        symbols: &symbols,
        stack: None,
    };
    let tramp = build_trampoline(plan, &params).expect("trampoline");
    assert!(tramp.len() < 0x1000, "trampoline is {} bytes", tramp.len());
    assert_eq!(tramp.patch.len(), plan.len());
    region.write_code(ZONE_TRAMP, &tramp.code);
    let site_off = (plan.site() - region.addr(0)) as usize;
    region.write_code(site_off, &tramp.patch);
    tramp
}

fn restore(region: &Region, plan: &SitePlan) {
    region.write_code((plan.site() - region.addr(0)) as usize, plan.original());
}

/// Memory as the site saw it: the frame cells the site function wrote,
/// anything else read directly (only valid pointers are used).
struct SiteMemory {
    rsp: u64,
    rbp: u64,
}

impl SiteMemory {
    fn byte(&self, addr: u64) -> io::Result<u8> {
        let cell = |base: u64, bytes: &[u8]| {
            addr.checked_sub(base)
                .and_then(|o| bytes.get(o as usize).copied())
        };
        if let Some(b) = cell(self.rsp.wrapping_add(112), &(-7i32).to_le_bytes()) {
            return Ok(b);
        }
        if let Some(b) = cell(self.rbp.wrapping_sub(8), &(-12345i64).to_le_bytes()) {
            return Ok(b);
        }
        for i in 0..16u64 {
            let value = i64::from(CANARY) + i as i64;
            if let Some(b) = cell(self.rsp - 8 * (i + 1), &value.to_le_bytes()) {
                return Ok(b);
            }
        }
        if addr >= self.rsp - 4096 && addr < self.rsp + 4096 {
            return Err(io::Error::other("unknown stack byte"));
        }
        // SAFETY: the specs only point at our region and data.
        Ok(unsafe { std::ptr::read_volatile(addr as *const u8) })
    }
}

impl MemoryReader for SiteMemory {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.byte(address.wrapping_add(i as u64))?;
        }
        Ok(())
    }
}

/// The expected argument values, from `sdt::evaluate` on the site's registers.
fn expected_args(region: &Region, f: &SiteFn, p: &Probe, snap: &[u64; SNAP_WORDS]) -> Vec<u64> {
    let mut regs = site_regs(region);
    regs[RegFamily::Rsp.index()] = snap[RegFamily::Rsp.index()];
    regs[RegFamily::Rbp.index()] = snap[RegFamily::Rbp.index()];
    let rip = f.site + 1;
    let file = move |fam: RegFamily| {
        if fam == RegFamily::Rip {
            rip
        } else {
            regs[fam.index()]
        }
    };
    let mem = SiteMemory {
        rsp: snap[RegFamily::Rsp.index()],
        rbp: snap[RegFamily::Rbp.index()],
    };
    let symbols = symbols_for(region);
    p.args
        .iter()
        .map(|a| evaluate(a, &file, &mem, &symbols).expect("evaluates"))
        .collect()
}

/// Drains `ring`, checking every record against the expectation; returns their tscs.
fn check_records(reader: &mut RingReader, p: &Probe, want: &[u64], thread: u64) -> Vec<u64> {
    let nstrings = p.strings.iter().filter(|&&s| s).count();
    let mut tscs = Vec::new();
    let out = reader.drain(usize::MAX, |r| {
        assert_eq!(r.probe, 0x1234_5678);
        assert_eq!(r.tag, TAG_VALUE);
        assert_eq!(r.thread, thread);
        assert_eq!(r.nargs, p.args.len());
        for (i, w) in want.iter().enumerate() {
            assert_eq!(
                r.args[i], *w,
                "arg {i} ({}): {:#x} vs {w:#x}",
                p.args[i], r.args[i]
            );
        }
        let mut k = 0;
        for (i, s) in r.strings().iter().enumerate() {
            let flagged = p.strings.get(i).copied().unwrap_or(false);
            assert_eq!(s.is_some(), flagged, "string flag {i}");
            let Some(s) = s else { continue };
            let (_, area) = string_area(k, nstrings).expect("area");
            k += 1;
            if want[i] == 0 {
                assert!(s.null && s.bytes.is_empty() && !s.truncated);
                continue;
            }
            // SAFETY: flagged arguments point at our NUL-terminated strings.
            let full = unsafe { CStr::from_ptr(want[i] as *const libc::c_char) }.to_bytes();
            let n = full.len().min(area - 1);
            assert_eq!(s.bytes, &full[..n], "string {i}");
            assert_eq!(s.truncated, full.len() > area - 1, "truncated {i}");
            assert!(!s.null);
        }
        tscs.push(r.tsc);
    });
    assert_eq!(out.stop, DrainStop::Empty);
    tscs
}

fn spec_text(p: &Probe) -> String {
    let args: Vec<String> = p.args.iter().map(ToString::to_string).collect();
    args.join(" ")
}

fn probes() -> Vec<Probe> {
    vec![
        probe(ENTRY_STRINGS, &[true, true]),
        probe("8@%rax 8@%rcx 8@%rdx 8@%rsi 8@%rdi 8@%r8", &[]),
        probe("8@%r9 8@%r10 8@%r11 -1@$5 8@%rsp 8@%rip", &[]),
        probe(
            "8@0x20(%rbx) -4@8(%rdx,%rcx,8) 8@(%r8) -2@%si 4@%r11d 1@%dil",
            &[],
        ),
        probe(
            "8@blk+16(%rip) 8@16(%rip) 8@-16(%rsp) 2@%r9w -8@%r12 1@%bh",
            &[],
        ),
        probe(
            "-1@$5 8@$0 8@%r13 8@%r14 8@%r8 -8@$-9",
            &[false, true, true, true, true, false],
        ),
        probe("-2@%r10w -1@%ch 1@%dh -4@%esp 8@%r15 -1@%r9b", &[]),
        probe("", &[]),
        through_probe(),
    ]
}

/// The word at `THROUGH_WORD(%rbx)`, then fields of what it points to, tag bit
/// masked: the arguments pyprobe adds for a frame's code object.
fn through_probe() -> Probe {
    let mut p = probe(&format!("8@{THROUGH_WORD}(%rbx)"), &[]);
    let crate::sdt::Operand::Memory(pointer) = p.args[0].operand.clone() else {
        unreachable!("a memory operand");
    };
    for (size, signed, offset) in [(4, true, 40), (8, false, 0), (1, false, 299)] {
        p.args.push(ArgSpec {
            size,
            signed,
            operand: crate::sdt::Operand::Through(crate::sdt::Through {
                pointer: pointer.clone(),
                mask: !1,
                offset,
            }),
        });
    }
    p
}

/// Runs one site function unpatched and patched, and checks everything.
fn run_case(variant: Variant, flags: i32, p: &Probe, thread_id: ThreadIdSource) {
    run_case_with(variant, flags, p, thread_id, FlagSave::for_this_cpu());
}

fn run_case_with(
    variant: Variant,
    flags: i32,
    p: &Probe,
    thread_id: ThreadIdSource,
    flag_save: FlagSave,
) {
    let region = Region::new();
    let f = assemble_site_fn(&region, variant, flags);
    f.call();
    let before = region.snapshot();
    // The canaries are what the function wrote (the call variant's callee
    // overwrites the first with its return address, patched or not).
    for i in 1..16 {
        assert_eq!(before[SNAP_RED + i], (CANARY + i as i32) as u64);
    }
    let plan = plan_for(&region, &f);
    let ring = Ring::new(16);
    let tramp = install_with(&region, &plan, p, &ring, 16, thread_id, flag_save, None);
    let want = expected_args(&region, &f, p, &before);
    let mut reader = ring.reader();
    for round in 0..3 {
        region.put(SNAP, &[0u8; SNAP_WORDS * 8]);
        f.call();
        let after = region.snapshot();
        for (i, (x, y)) in before.iter().zip(after.iter()).enumerate() {
            assert_eq!(
                x,
                y,
                "{variant:?} {}: snapshot word {i} differs",
                spec_text(p)
            );
        }
        let tscs = check_records(&mut reader, p, &want, fs_base());
        assert_eq!(tscs.len(), 1, "round {round}");
    }
    // Several calls, then one drain: tsc non-decreasing on one thread. These
    // reserve without `lock`, as the only thread of a process does.
    reader.set_solo(true);
    for _ in 0..5 {
        f.call();
    }
    let tscs = check_records(&mut reader, p, &want, fs_base());
    assert_eq!(tscs.len(), 5);
    assert!(tscs.windows(2).all(|w| w[0] <= w[1]), "{tscs:?}");
    assert_eq!(reader.lost(), 0);
    // A thread that stopped at an int3 on the site before the patch continues at
    // `resume`: the displaced code with the site's registers, and no record.
    let mut to_resume = vec![0xe9];
    let rel = tramp.resume as i64 - (plan.site() as i64 + 5);
    to_resume.extend_from_slice(&(rel as i32).to_le_bytes());
    to_resume.resize(plan.len(), 0xcc);
    region.write_code((plan.site() - region.addr(0)) as usize, &to_resume);
    region.put(SNAP, &[0u8; SNAP_WORDS * 8]);
    f.call();
    assert_eq!(region.snapshot(), before, "{variant:?}: resumed run");
    assert_eq!(reader.drain(10, |_| {}).records, 0);
    // Restored: no more records, same behaviour.
    restore(&region, &plan);
    f.call();
    assert_eq!(region.snapshot(), before);
    assert_eq!(reader.drain(10, |_| {}).records, 0);
}

#[test]
fn every_variant_and_probe_shape() {
    for variant in VARIANTS {
        for p in probes() {
            run_case(variant, FLAGS_Z, &p, ThreadIdSource::FsSelfPointer);
        }
    }
    // Both directions of the displaced rel8 jcc.
    for p in probes() {
        run_case(Variant::Jcc8, FLAGS_NZ, &p, ThreadIdSource::FsSelfPointer);
    }
}

/// Both ways of keeping the flags give the code after the site every status
/// flag as it was, each set and each clear (and DF, set in `FLAGS_Z`, untouched).
#[test]
fn both_ways_of_keeping_the_flags() {
    let mut ways = vec![FlagSave::Pushfq];
    if FlagSave::for_this_cpu() == FlagSave::Lahf {
        ways.push(FlagSave::Lahf);
    } else {
        eprintln!("note: no lahf/sahf in 64-bit mode here; that way not run");
    }
    // Reserved bit 1 is always set; OF alone; all six and DF.
    let all_clear = 0x2;
    let overflow_only = 0x802;
    for way in ways {
        for flags in [FLAGS_Z, FLAGS_NZ, all_clear, overflow_only] {
            for variant in [Variant::Jcc8, Variant::Load] {
                let p = probe(ENTRY_STRINGS, &[true, true]);
                run_case_with(variant, flags, &p, ThreadIdSource::FsSelfPointer, way);
            }
        }
    }
}

#[test]
fn plans_of_the_variants() {
    let region = Region::new();
    let cases = [
        (Variant::Load, 5, Tail::JumpBack),
        (Variant::RipLoad, 8, Tail::JumpBack),
        (Variant::Jcc8, 6, Tail::JumpBack),
        (Variant::TailJmp, 6, Tail::Terminates),
    ];
    for (variant, len, tail) in cases {
        let f = assemble_site_fn(&region, variant, FLAGS_Z);
        let plan = plan_for(&region, &f);
        assert_eq!((plan.len(), plan.tail()), (len, tail), "{variant:?}");
    }
    let f = assemble_site_fn(&region, Variant::TailCall, FLAGS_Z);
    let plan = plan_for(&region, &f);
    assert_eq!(plan.len(), 6);
    assert!(matches!(plan.tail(), Tail::Call { .. }));
}

#[test]
fn rdfsbase_thread_id_when_available() {
    const HWCAP2_FSGSBASE: u64 = 1 << 1;
    // SAFETY: getauxval has no preconditions.
    let hwcap2 = unsafe { libc::getauxval(libc::AT_HWCAP2) };
    if hwcap2 & HWCAP2_FSGSBASE == 0 {
        eprintln!("note: FSGSBASE not enabled here; rdfsbase variant not run");
        return;
    }
    run_case(
        Variant::Load,
        FLAGS_Z,
        &probe(ENTRY_STRINGS, &[true, true]),
        ThreadIdSource::Rdfsbase,
    );
}

#[test]
fn full_ring_counts_lost() {
    let region = Region::new();
    let f = assemble_site_fn(&region, Variant::Load, FLAGS_Z);
    let plan = plan_for(&region, &f);
    let ring = Ring::new(4);
    install(
        &region,
        &plan,
        &probe(ENTRY_STRINGS, &[true, true]),
        &ring,
        4,
        ThreadIdSource::FsSelfPointer,
    );
    for _ in 0..10 {
        f.call();
    }
    let mut reader = ring.reader();
    let mut indices = Vec::new();
    reader.drain(100, |r| indices.push(r.index));
    assert_eq!(indices, [0, 1, 2, 3]);
    assert_eq!(reader.lost(), 6);
    // Draining freed the slots: the next call is recorded again.
    f.call();
    assert_eq!(reader.drain(100, |_| {}).records, 1);
    assert_eq!(reader.lost(), 6);
}

/// A ring of 4 slots, served by a consumer that looks only every few
/// milliseconds: the producer spins, then sleeps on the futex until woken or its
/// nap ends; every record arrives, in order, and the wait is counted.
#[test]
fn a_producer_sleeps_until_a_slow_consumer_frees_room() {
    let (region, f, plan, ring) = identity_in_ring(4);
    let done = std::sync::atomic::AtomicBool::new(false);
    ring.reader().serve(u64::MAX, u64::MAX);
    let (values, sleepers_seen) = std::thread::scope(|s| {
        let consumer = s.spawn(|| {
            let mut reader = ring.reader();
            let (mut values, mut sleepers_seen) = (Vec::new(), 0u32);
            loop {
                let last = done.load(std::sync::atomic::Ordering::Acquire);
                sleepers_seen = sleepers_seen.max(reader.sleepers());
                reader.drain(usize::MAX, |r| values.push(r.args[0]));
                if last {
                    return (values, sleepers_seen);
                }
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
        });
        for n in 0..40 {
            assert_eq!(call_identity(f.entry, n), n);
        }
        done.store(true, std::sync::atomic::Ordering::Release);
        consumer.join().expect("consumer")
    });
    restore(&region, &plan);
    let reader = ring.reader();
    assert_eq!(values, (0..40).collect::<Vec<u64>>());
    assert_eq!(reader.lost(), 0);
    assert!(sleepers_seen > 0, "the producer slept on the futex");
    assert_eq!(reader.sleepers(), 0, "every sleeper woke and said so");
    assert!(reader.waited_cycles() > 0);
}

/// A producer waiting in a full ring stops waiting when its consumer leaves (as
/// pyprobe does when it detaches, and its guardian when it dies), and does not
/// start waiting for a consumer whose heartbeat is stale.
#[test]
fn a_consumer_that_leaves_or_goes_silent_ends_the_wait() {
    let (region, f, plan, ring) = identity_in_ring(4);
    let reader = ring.reader();
    reader.serve(u64::MAX, u64::MAX);
    for n in 0..4 {
        call_identity(f.entry, n);
    }
    let returned = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            call_identity(f.entry, 4);
            returned.store(true, std::sync::atomic::Ordering::Release);
        });
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert!(
            !returned.load(std::sync::atomic::Ordering::Acquire),
            "waits while the consumer is alive"
        );
        reader.leave();
    });
    assert_eq!(reader.lost(), 1);
    assert_eq!(reader.sleepers(), 0);
    // Served again, but its heartbeat goes stale (1 µs at any clock rate):
    // the producer gives up at once.
    reader.serve(1000, u64::MAX);
    std::thread::sleep(std::time::Duration::from_millis(1));
    call_identity(f.entry, 5);
    assert_eq!(reader.lost(), 2);
    // A live consumer, but a patience of 1000 cycles: lost after a short wait.
    reader.serve(u64::MAX, 1000);
    call_identity(f.entry, 6);
    assert_eq!(reader.lost(), 3);
    restore(&region, &plan);
}

/// Where the let-go test keeps its semaphores (in the data zone).
const SEMS: usize = 0x2100;

fn semaphore(region: &Region, k: usize) -> u16 {
    // SAFETY: an aligned u16 inside the data zone.
    unsafe { std::ptr::read_volatile((region.data(SEMS) as *const u16).add(k)) }
}

/// pyprobe and its guardian both dead (`alive` still 1, the heartbeat stale):
/// the producer lowers each semaphore the ring lists as pyprobe's, once, never
/// below 0, only within the bounds its code was built with and only in the
/// owner process; not when a consumer left (`alive` 0: it lowers them itself).
#[test]
fn a_producer_lets_go_of_the_semaphores_of_a_dead_consumer() {
    let region = Region::new();
    let f = assemble_identity(&region);
    let plan = plan_for(&region, &f);
    let ring = Ring::new(4);
    // Semaphores: pyprobe's alone (0); pyprobe's and two other tracers' (1);
    // another tracer's alone (2); one outside the bounds (4: a listing a stray
    // write of the program's made).
    region.put(SEMS, &[1, 0, 3, 0, 1, 0, 0, 0, 1, 0]);
    let sem = |k: usize| region.data(SEMS) + 2 * k as u64;
    let bounds = sem(0)..sem(2) + 2;
    install_with(
        &region,
        &plan,
        &probe("8@%rdi", &[]),
        &ring,
        4,
        ThreadIdSource::FsSelfPointer,
        FlagSave::for_this_cpu(),
        Some(bounds),
    );
    let reader = ring.reader();
    let me = std::process::id();
    reader.hold_semaphores(me, &[sem(0), sem(1), sem(4)], &[]);
    reader.serve(u64::MAX, u64::MAX);
    for n in 0..4 {
        call_identity(f.entry, n);
    }
    // A consumer that left: lost, nothing lowered.
    reader.leave();
    call_identity(f.entry, 4);
    assert_eq!(reader.lost(), 1);
    assert_eq!((semaphore(&region, 0), semaphore(&region, 1)), (1, 3));
    assert_eq!(reader.let_go_count(), 0);
    // Another process's listing: nothing lowered.
    reader.hold_semaphores(me + 1, &[sem(0), sem(1), sem(4)], &[]);
    reader.serve(1000, u64::MAX);
    std::thread::sleep(std::time::Duration::from_millis(1));
    call_identity(f.entry, 5);
    assert_eq!((semaphore(&region, 0), semaphore(&region, 1)), (1, 3));
    // Ours, the heartbeat stale: each listed raise undone once; one listed as
    // not raised now (a budget's pause) is left.
    reader.hold_semaphores(me, &[sem(0), sem(1), sem(4)], &[sem(2)]);
    reader.serve(1000, u64::MAX);
    std::thread::sleep(std::time::Duration::from_millis(1));
    call_identity(f.entry, 6);
    assert_eq!(
        (
            semaphore(&region, 0),
            semaphore(&region, 1),
            semaphore(&region, 4)
        ),
        (0, 2, 1),
        "lowered once each, the one out of bounds left"
    );
    assert_eq!(semaphore(&region, 2), 1, "not pyprobe's now: left");
    assert_eq!(reader.let_go_count(), 2);
    assert_eq!(reader.is_held(sem(0)), Some(false));
    assert_eq!(reader.take_held(sem(1)), Some(false));
    call_identity(f.entry, 7);
    assert_eq!((semaphore(&region, 0), semaphore(&region, 1)), (0, 2));
    // Raised again by pyprobe and given back: lowered again, and never below 0.
    region.put(SEMS, &[0, 0]);
    reader.set_held(sem(0));
    call_identity(f.entry, 8);
    assert_eq!(semaphore(&region, 0), 0);
    assert_eq!(reader.let_go_count(), 3);
    assert_eq!(reader.lost(), 5);
    restore(&region, &plan);
}

/// `extern "C" fn(n: u64) -> u64 { n }` whose site is `nop; mov rax, rdi; ret`.
fn assemble_identity(region: &Region) -> SiteFn {
    let mut a = CodeAssembler::new(64).expect("asm");
    a.nop().expect("nop");
    a.mov(rax, rdi).expect("mov");
    a.ret().expect("ret");
    let entry = region.addr(0);
    let code = a.assemble(entry).expect("assemble");
    region.write_code(0, &code);
    SiteFn {
        entry,
        site: entry,
        len: code.len(),
    }
}

/// The identity function with its site patched to record `%rdi` into a fresh
/// ring of `capacity` slots.
fn identity_in_ring(capacity: u64) -> (Region, SiteFn, SitePlan, Ring) {
    identity_recording(capacity, &probe("8@%rdi", &[]))
}

/// The identity function with its site patched to record probe `p` into a fresh
/// ring of `capacity` slots.
fn identity_recording(capacity: u64, p: &Probe) -> (Region, SiteFn, SitePlan, Ring) {
    let region = Region::new();
    let f = assemble_identity(&region);
    let plan = plan_for(&region, &f);
    let ring = Ring::new(capacity);
    install(
        &region,
        &plan,
        p,
        &ring,
        capacity,
        ThreadIdSource::FsSelfPointer,
    );
    (region, f, plan, ring)
}

fn call_identity(entry: u64, n: u64) -> u64 {
    // SAFETY: assembled by `assemble_identity` with the C ABI.
    let f: extern "C" fn(u64) -> u64 = unsafe { std::mem::transmute(entry as usize) };
    f(n)
}

const THREADS: u64 = 4;
const PER_THREAD: u64 = 10_000;

/// Runs the producers; with `pause`, each yields every 64 calls so a
/// consumer on this 2-core budget gets to run while they produce.
fn run_producers(entry: u64, pause: bool) -> Vec<u64> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(move || {
                    for n in 0..PER_THREAD {
                        assert_eq!(call_identity(entry, n), n);
                        if pause && n % 64 == 63 {
                            std::thread::yield_now();
                        }
                    }
                    fs_base()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("producer"))
            .collect()
    })
}

#[test]
fn concurrent_producers_each_record_once() {
    let region = Region::new();
    let f = assemble_identity(&region);
    let plan = plan_for(&region, &f);
    assert_eq!((plan.len(), plan.tail()), (5, Tail::Terminates));
    let capacity = 1 << 16;
    let ring = Ring::new(capacity);
    install(
        &region,
        &plan,
        &probe("8@%rdi", &[]),
        &ring,
        capacity,
        ThreadIdSource::FsSelfPointer,
    );
    let threads = run_producers(f.entry, false);
    let mut reader = ring.reader();
    let mut seen: std::collections::HashMap<u64, Vec<u64>> = Default::default();
    let mut expected_index = 0;
    let out = reader.drain(usize::MAX, |r| {
        assert_eq!(r.index, expected_index);
        expected_index += 1;
        seen.entry(r.thread).or_default().push(r.args[0]);
    });
    assert_eq!(out.stop, DrainStop::Empty);
    let lost = reader.lost();
    eprintln!("concurrent producers: {} records, {lost} lost", out.records);
    assert_eq!(out.records as u64 + lost, THREADS * PER_THREAD);
    assert_eq!(reader.head(), out.records as u64);
    for t in &threads {
        let ns = seen.get(t).expect("records from every thread");
        // One thread's events are reserved in its program order; none twice.
        assert!(ns.windows(2).all(|w| w[0] < w[1]));
        assert!(ns.iter().all(|&n| n < PER_THREAD));
    }
    assert_eq!(seen.len(), THREADS as usize);
    // With 64k slots nothing is full; only 8 failed CAS in a row lose one, which
    // a loaded machine makes more likely: a bound, not an exact count.
    assert!(lost <= THREADS * PER_THREAD / 100, "lost {lost}");
}

#[test]
fn concurrent_producers_with_a_draining_consumer() {
    let capacity = 256;
    let (_region, f, _plan, ring) = identity_in_ring(capacity);
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut seen: std::collections::HashMap<u64, Vec<u64>> = Default::default();
    let mut records = 0u64;
    ring.reader().serve(u64::MAX, u64::MAX);
    std::thread::scope(|s| {
        let consumer = s.spawn(|| {
            let mut reader = ring.reader();
            let mut out = Vec::new();
            let mut step = || {
                reader.drain(usize::MAX, |r| out.push((r.thread, r.args[0])));
            };
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                step();
                std::thread::yield_now();
            }
            step();
            out
        });
        run_producers(f.entry, true);
        done.store(true, std::sync::atomic::Ordering::Release);
        for (thread, n) in consumer.join().expect("consumer") {
            seen.entry(thread).or_default().push(n);
            records += 1;
        }
    });
    let lost = ring.reader().lost();
    eprintln!("with a concurrent consumer (256 slots): {records} records, {lost} lost");
    // A consumer serves the ring: producers wait for room, none is lost.
    assert_eq!((records, lost), (THREADS * PER_THREAD, 0));
    // The consumer ran while the ring lapped: slots were reused.
    assert!(records > capacity, "only {records} records");
    for ns in seen.values() {
        assert!(ns.windows(2).all(|w| w[0] < w[1]));
    }
}

/// The identity function (`%rdi` in, `%rax` out) with its site recording the six
/// argument registers as C strings: six 28-byte areas.
fn six_strings_in_ring(capacity: u64) -> (Region, SiteFn, Ring, Probe) {
    let p = probe("8@%rdi 8@%rsi 8@%rdx 8@%rcx 8@%r8 8@%r9", &[true; 6]);
    let (region, f, _, ring) = identity_recording(capacity, &p);
    (region, f, ring, p)
}

fn call_six(entry: u64, s: [u64; 6]) {
    // SAFETY: the identity function of `assemble_identity`, C ABI; it reads only %rdi.
    let f: extern "C" fn(u64, u64, u64, u64, u64, u64) -> u64 =
        unsafe { std::mem::transmute(entry as usize) };
    f(s[0], s[1], s[2], s[3], s[4], s[5]);
}

/// The string copy reads eight bytes at a time once aligned: every start
/// alignment and every length around the word and area boundaries must give
/// exactly the bytes and the truncation flag of a byte-by-byte copy.
#[test]
fn string_prefixes_are_exact_at_every_alignment_and_length() {
    let (_region, f, ring, p) = six_strings_in_ring(1 << 12);
    let mut reader = ring.reader();
    // 8-aligned backing store; strings start at offsets 0..8 within it, and the
    // bytes after each string's NUL are not zero (a copy must stop at the NUL).
    let mut store = [0u64; 64];
    for len in (0..=40).chain([55, 56, 57, 63, 64, 65, 100]) {
        for align in 0..8usize {
            store.fill(u64::MAX);
            let bytes: &mut [u8] = as_bytes(&mut store);
            for (i, b) in bytes[align..align + len].iter_mut().enumerate() {
                *b = b'a' + ((i * 7 + align) % 26) as u8;
            }
            bytes[align + len] = 0;
            let ptr = bytes[align..].as_ptr() as u64;
            // The same string through all six areas.
            call_six(f.entry, [ptr; 6]);
            check_records(&mut reader, &p, &[ptr; 6], fs_base());
        }
    }
}

/// The bytes of `words`.
fn as_bytes(words: &mut [u64]) -> &mut [u8] {
    let len = words.len() * 8;
    // SAFETY: u64s viewed as their bytes: same memory, same length in bytes,
    // u8 has no alignment or validity requirement; the borrow is carried over.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

/// A string whose NUL is the last readable byte before an unmapped page: the
/// copy must not read past that page, whatever the string's alignment.
#[test]
fn a_string_ending_at_the_edge_of_a_mapping_is_copied_without_a_fault() {
    let (_region, f, ring, p) = six_strings_in_ring(1 << 12);
    let mut reader = ring.reader();
    let page = 4096usize;
    // SAFETY: a fresh private mapping of two pages; the second is made inaccessible.
    let mem = unsafe {
        let m = libc::mmap(
            std::ptr::null_mut(),
            2 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(m, libc::MAP_FAILED);
        assert_eq!(
            libc::mprotect(m.cast::<u8>().add(page).cast(), page, libc::PROT_NONE),
            0
        );
        m.cast::<u8>()
    };
    for len in 0..=40usize {
        // SAFETY: [edge - len - 1, edge) lies in the first, readable page.
        let ptr = unsafe {
            let edge = mem.add(page);
            let start = edge.sub(len + 1);
            for i in 0..len {
                *start.add(i) = b'A' + (i % 26) as u8;
            }
            *edge.sub(1) = 0;
            start as u64
        };
        call_six(f.entry, [ptr; 6]);
        check_records(&mut reader, &p, &[ptr; 6], fs_base());
    }
    // SAFETY: our own mapping, no longer used.
    unsafe { libc::munmap(mem.cast(), 2 * page) };
}

/// Site function for timing: saves r13/r14, loads them with string
/// pointers like CPython's function__entry, and returns.
fn assemble_timed(region: &Region) -> SiteFn {
    let mut a = CodeAssembler::new(64).expect("asm");
    let step = |r: Result<(), IcedError>| r.expect("assemble");
    let mut site = a.create_label();
    step(a.push(r13));
    step(a.push(r14));
    step(a.mov(r13, region.data(STR_41)));
    step(a.mov(r14, region.data(STR_SHORT)));
    step(a.mov(eax, 42u32));
    step(a.set_label(&mut site));
    step(a.nop());
    step(a.mov(rcx, qword_ptr(rsp)));
    step(a.pop(r14));
    step(a.pop(r13));
    step(a.ret());
    place_site_fn(region, &mut a, &site)
}

/// Not an assertion: prints ns per event. Run with `--nocapture`.
#[test]
fn measure_ns_per_event() {
    const CALLS: u64 = 10_000_000;
    const BATCH: u64 = 50_000;
    let time = |f: &SiteFn, ring: Option<&Ring>| {
        let mut total = std::time::Duration::ZERO;
        for _ in 0..CALLS / BATCH {
            let start = Instant::now();
            for _ in 0..BATCH {
                f.call();
            }
            total += start.elapsed();
            if let Some(ring) = ring {
                // Discard between timed batches: only the producer is measured.
                ring.discard();
            }
        }
        total.as_nanos() as f64 / CALLS as f64
    };
    for (name, strings) in [
        ("3 args, no strings", vec![]),
        ("3 args, 2 strings (41 and 7 bytes)", vec![true, true]),
    ] {
        let region = Region::new();
        let f = assemble_timed(&region);
        let base = time(&f, None);
        let plan = plan_for(&region, &f);
        let capacity = 1 << 16;
        let ring = Ring::new(capacity);
        let p = probe("8@%r13 8@%r14 -4@%eax", &strings);
        let tramp = install(
            &region,
            &plan,
            &p,
            &ring,
            capacity,
            ThreadIdSource::FsSelfPointer,
        );
        let patched = time(&f, Some(&ring));
        let lost = ring.reader().lost();
        // The same with a consumer draining on the other CPU, as pyprobe does.
        let pin = |cpu: usize| {
            let mut set = nix::sched::CpuSet::new();
            let _ = set.set(cpu);
            let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
        };
        let stop = std::sync::atomic::AtomicBool::new(false);
        let crossed = std::thread::scope(|s| {
            s.spawn(|| {
                pin(0);
                let mut reader = ring.reader();
                reader.serve(u64::MAX / 4, u64::MAX);
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    reader.drain(1024, |r| n = n.wrapping_add(r.args[2]));
                }
                n
            });
            pin(1);
            let start = Instant::now();
            for _ in 0..CALLS {
                f.call();
            }
            let t = start.elapsed().as_nanos() as f64 / CALLS as f64;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            t
        });
        let lost_crossed = ring.reader().lost() - lost;
        let waited = ring.reader().waited_cycles();
        eprintln!("ring trampoline, {name}, consumer on another CPU: {:.1} ns/event, {lost_crossed} lost, {waited} cycles waited", crossed - base);
        eprintln!(
            "ring trampoline, {name}: {:.1} ns/call unpatched, {:.1} ns/call patched, \
             {:.1} ns/event ({} code bytes, {lost} lost)",
            base,
            patched,
            patched - base,
            tramp.len()
        );
    }
}

// ---------------------------------------------------------------------------------
// Stack capture against a fake interpreter laid out in the data zone.
// ---------------------------------------------------------------------------------

/// The fake interpreter's "current thread state" global.
const FAKE_CURRENT: usize = 0x3000;
const FAKE_TSTATES: usize = 0x3200; // tstates, 0x40 apart
const FAKE_FRAMES: usize = 0x4000; // frames, 0x20 apart (up to 0x400 of them)
const FRAME_STRIDE: usize = 0x20;

/// Offsets of the fake structures: tstate {thread_id 24, frame 32, cframe 40},
/// cframe {current 8}, frame {back 0, code 8, position 16, owner 24}.
fn fake_capture(region: &Region, root: StackRoot, slots: u8) -> StackCapture {
    fake_capture_from(
        CurrentThreadState::GilHolder(region.data(FAKE_CURRENT)),
        root,
        slots,
    )
}

fn fake_capture_from(current: CurrentThreadState, root: StackRoot, slots: u8) -> StackCapture {
    StackCapture {
        current,
        tstate_thread_id: 24,
        root,
        frame: StackFrame {
            back: 0,
            code: 8,
            position: 16,
            position_size: 8,
            owner: Some((24, 3)),
            code_tag_mask: 1,
        },
        slots,
    }
}

fn put_u64(region: &Region, offset: usize, value: u64) {
    region.put(offset, &value.to_le_bytes());
}

fn frame_at(k: usize) -> usize {
    FAKE_FRAMES + k * FRAME_STRIDE
}

/// Frame `k`: back, code, position, owner.
fn put_frame(region: &Region, k: usize, back: u64, code: u64, position: u64, owner: u8) {
    put_u64(region, frame_at(k), back);
    put_u64(region, frame_at(k) + 8, code);
    put_u64(region, frame_at(k) + 16, position);
    put_u64(region, frame_at(k) + 24, u64::from(owner));
}

/// The current thread state (the global) is tstate 0, whose `thread_id` is `ours`
/// and whose frame root is `frame` (also written behind the `cframe` pointer).
fn put_threads(region: &Region, ours: u64, frame: u64) {
    let tstate = |i: usize| FAKE_TSTATES + 0x40 * i;
    put_u64(region, FAKE_CURRENT, region.data(tstate(0)));
    put_u64(region, tstate(0) + 24, ours);
    put_u64(region, tstate(0) + 32, frame);
    // cframe at tstate(1): its current_frame (+8) is the frame.
    put_u64(region, tstate(0) + 40, region.data(tstate(1)));
    put_u64(region, tstate(1) + 8, frame);
}

/// Runs the site function once patched with a stack-capturing trampoline, checks
/// registers, flags and red zone are untouched, and returns the record's stack.
fn capture_once(
    region: &Region,
    f: &SiteFn,
    ring: &Ring,
    capacity: u64,
    c: &StackCapture,
) -> RingStack {
    let stacks = capture_runs(region, f, ring, capacity, c, 1);
    stacks.into_iter().next().expect("one record")
}

fn capture_runs(
    region: &Region,
    f: &SiteFn,
    ring: &Ring,
    capacity: u64,
    c: &StackCapture,
    runs: usize,
) -> Vec<RingStack> {
    let plan = plan_for(region, f);
    restore(region, &plan);
    region.put(SNAP, &[0u8; SNAP_WORDS * 8]);
    f.call();
    let before = region.snapshot();
    let p = probe(ENTRY_STRINGS, &[true, true]);
    let symbols = symbols_for(region);
    let params = TrampolineParams {
        flags: FlagSave::for_this_cpu(),
        let_go: None,
        probe_id: 0x1234_5678,
        args: &p.args,
        string_args: &p.strings,
        ring_addr: ring.addr(),
        capacity,
        tramp_addr: region.addr(ZONE_TRAMP),
        tag_addr: region.data(TAG),
        thread_id: ThreadIdSource::FsSelfPointer,
        symbols: &symbols,
        stack: Some(c),
    };
    let tramp = build_trampoline(&plan, &params).expect("trampoline");
    assert!(tramp.len() < 0x1000, "trampoline is {} bytes", tramp.len());
    region.write_code(ZONE_TRAMP, &tramp.code);
    region.write_code((plan.site() - region.addr(0)) as usize, &tramp.patch);
    let want = expected_args(region, f, &p, &before);
    let mut reader = ring.reader();
    let mut out = Vec::new();
    for _ in 0..runs {
        region.put(SNAP, &[0u8; SNAP_WORDS * 8]);
        f.call();
        assert_eq!(
            region.snapshot(),
            before,
            "the trampoline changed the site's state"
        );
        reader.drain(usize::MAX, |r| {
            assert_eq!(r.args[..r.nargs], want[..]);
            out.push(r.stack.clone().expect("a stack record"));
        });
    }
    assert_eq!(reader.lost(), 0);
    assert_eq!(reader.head(), reader.tail(), "every slot consumed");
    restore(region, &plan);
    out
}

thread_local! {
    /// Stands for CPython's `_Py_tss_tstate`.
    static FAKE_TSS_TSTATE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[test]
fn stack_capture_walks_a_fake_interpreter() {
    let region = Region::new();
    let f = assemble_site_fn(&region, Variant::Load, FLAGS_Z);
    let ring = Ring::new(16);
    // One capture from the thread state's `frame` root, with `slots` slots.
    let capture_direct = |slots| {
        capture_once(
            &region,
            &f,
            &ring,
            16,
            &fake_capture(&region, StackRoot::Direct(32), slots),
        )
    };
    let me = fs_base();
    let code = |k: u64| 0x7000_0000_0000 + k * 0x100;
    // 0: code 1 -> 1: a shim (owner 3) -> 2: no code -> 3: tagged code 4 -> end.
    put_frame(&region, 0, region.data(frame_at(1)), code(1), 11, 0);
    put_frame(&region, 1, region.data(frame_at(2)), code(2), 22, 3);
    put_frame(&region, 2, region.data(frame_at(3)), 0, 33, 0);
    put_frame(&region, 3, 0, code(4) | 1, 44, 1);
    put_threads(&region, me, region.data(frame_at(0)));
    for root in [
        StackRoot::Direct(32),
        StackRoot::Indirect {
            pointer: 40,
            field: 8,
        },
    ] {
        let s = capture_once(&region, &f, &ring, 16, &fake_capture(&region, root, 1));
        assert!(s.found && !s.truncated && !s.broken, "{root:?}: {s:?}");
        assert_eq!(s.depth, 2);
        assert_eq!(s.frames, [(code(1), 11), (code(4), 44)], "{root:?}");
    }

    // A NULL frame root: found, no frames. A NULL cframe: the same.
    put_threads(&region, me, 0);
    let s = capture_direct(1);
    assert!(
        s.found && s.frames.is_empty() && s.depth == 0 && !s.truncated,
        "{s:?}"
    );
    put_u64(&region, FAKE_TSTATES + 40, 0);
    let indirect = StackRoot::Indirect {
        pointer: 40,
        field: 8,
    };
    let s = capture_once(&region, &f, &ring, 16, &fake_capture(&region, indirect, 1));
    assert!(s.found && s.frames.is_empty() && s.depth == 0, "{s:?}");

    // The current thread state is another thread's: nothing is walked.
    put_threads(&region, me ^ 0x40, region.data(frame_at(0)));
    let s = capture_direct(1);
    assert!(!s.found && s.frames.is_empty() && s.depth == 0, "{s:?}");
    // No current thread state at all.
    put_u64(&region, FAKE_CURRENT, 0);
    let s = capture_direct(1);
    assert!(!s.found && s.frames.is_empty(), "{s:?}");

    // The thread state read from a thread-local of this (test) executable.
    put_threads(&region, me, region.data(frame_at(0)));
    let tstate = region.data(FAKE_TSTATES);
    FAKE_TSS_TSTATE.with(|t| t.set(tstate));
    let offset = FAKE_TSS_TSTATE.with(|t| t.as_ptr() as u64).wrapping_sub(me) as i64;
    let offset = i32::try_from(offset).expect("static TLS is near the thread pointer");
    let from_tls = fake_capture_from(
        CurrentThreadState::ThreadLocal(offset),
        StackRoot::Direct(32),
        1,
    );
    let s = capture_once(&region, &f, &ring, 16, &from_tls);
    assert!(s.found && s.depth == 2, "{s:?}");
    FAKE_TSS_TSTATE.with(|t| t.set(0));
    let s = capture_once(&region, &f, &ring, 16, &from_tls);
    assert!(!s.found && s.frames.is_empty(), "{s:?}");

    // A cycle of two frames: the walk stops once the slots are full, flagged.
    put_frame(&region, 0, region.data(frame_at(1)), code(1), 1, 0);
    put_frame(&region, 1, region.data(frame_at(0)), code(2), 2, 0);
    put_threads(&region, me, region.data(frame_at(0)));
    let s = capture_direct(2);
    assert!(s.found && s.truncated && !s.broken, "{s:?}");
    assert_eq!(s.depth, 2 * PAIRS_PER_SLOT);
    assert_eq!(s.frames.len(), 2 * PAIRS_PER_SLOT);
    assert!(s.frames.iter().enumerate().all(|(i, &(c, p))| {
        (c, p)
            == if i % 2 == 0 {
                (code(1), 1)
            } else {
                (code(2), 2)
            }
    }));

    // A cycle of two frames without code (never written): the walk stops at its
    // bound, flagged.
    put_frame(&region, 0, region.data(frame_at(1)), 0, 1, 0);
    put_frame(&region, 1, region.data(frame_at(0)), 0, 2, 0);
    let s = capture_direct(2);
    assert!(s.found && s.truncated && s.frames.is_empty(), "{s:?}");
    assert_eq!(s.depth, 0);

    // An over-long chain (100 frames, room for 15 or 60): the innermost are kept,
    // and the walk goes no further than the frame after them.
    for k in 0..100 {
        let back = if k == 99 {
            0
        } else {
            region.data(frame_at(k + 1))
        };
        put_frame(&region, k, back, code(k as u64), k as u64, 0);
    }
    for slots in [1, MAX_STACK_SLOTS] {
        let s = capture_direct(slots);
        let kept = frames_for(slots);
        assert!(s.found && s.truncated && s.depth == kept, "{s:?}");
        assert_eq!(s.frames.len(), kept);
        assert!(s
            .frames
            .iter()
            .enumerate()
            .all(|(k, &f)| f == (code(k as u64), k as u64)));
    }

    // Records of 1 + 2 slots wrapping around a ring of 8, many times.
    let ring8 = Ring::new(8);
    for k in 0..5 {
        let back = if k == 4 {
            0
        } else {
            region.data(frame_at(k + 1))
        };
        put_frame(&region, k, back, code(k as u64), k as u64, 0);
    }
    let stacks = capture_runs(
        &region,
        &f,
        &ring8,
        8,
        &fake_capture(&region, StackRoot::Direct(32), 2),
        11,
    );
    assert_eq!(stacks.len(), 11);
    for s in stacks {
        assert_eq!(s.depth, 5);
        assert_eq!(
            s.frames,
            (0..5u64).map(|k| (code(k), k)).collect::<Vec<_>>()
        );
    }
}

/// A page mapped with `prot`: its address.
fn page_with(prot: libc::c_int) -> u64 {
    // SAFETY: a fresh private anonymous page; never dereferenced by the test.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    page as u64
}

/// A frame's link to memory that cannot hold a frame (the program's own garbage,
/// which the interpreter follows only when the frame returns) ends the walk,
/// flagged, and never faults the thread; links to readable pages elsewhere are
/// followed.
#[test]
fn stack_capture_stops_at_links_that_are_not_readable_frames() {
    assert!(super::stack::page_probe_works());
    let region = Region::new();
    let f = assemble_site_fn(&region, Variant::Load, FLAGS_Z);
    let ring = Ring::new(16);
    let me = fs_base();
    let code = |k: u64| 0x7000_0000_0000 + k * 0x100;
    // A frame on a page of its own (readable: the walk probes it), whose own
    // link is the bad one.
    let elsewhere = page_with(libc::PROT_READ | libc::PROT_WRITE);
    let none = page_with(libc::PROT_NONE);
    let unmapped = page_before_a_hole() + 4096;
    for (what, bad) in [
        ("unmapped", unmapped + 64),
        ("inaccessible", none),
        ("misaligned", region.data(frame_at(3)) + 4),
        ("not a user address", 0xffff_8000_0000_1000),
        ("in the first 64 KiB", 0x8000),
        ("straddling into an unmapped page", unmapped - 16),
    ] {
        put_frame(&region, 0, region.data(frame_at(1)), code(1), 11, 0);
        put_frame(&region, 1, elsewhere, code(2), 22, 0);
        // SAFETY: the page mapped read-write above; a frame {back, code, position, owner}.
        unsafe {
            let frame = elsewhere as *mut u64;
            frame.write(bad);
            frame.add(1).write(code(3));
            frame.add(2).write(33);
            frame.add(3).write(0);
        }
        put_threads(&region, me, region.data(frame_at(0)));
        let s = capture_once(
            &region,
            &f,
            &ring,
            16,
            &fake_capture(&region, StackRoot::Direct(32), 1),
        );
        assert!(
            s.found && s.unreadable && s.truncated && !s.broken,
            "{what}: {s:?}"
        );
        assert_eq!(
            s.frames,
            [(code(1), 11), (code(2), 22), (code(3), 33)],
            "{what}"
        );
    }
    // SAFETY: the pages mapped above.
    unsafe {
        libc::munmap(elsewhere as *mut libc::c_void, 4096);
        libc::munmap(none as *mut libc::c_void, 4096);
        libc::munmap((unmapped - 4096) as *mut libc::c_void, 4096);
    }
}

/// A readable page whose next page stays unmapped while the test runs: far below
/// where the kernel places mappings (a page unmapped in the usual place could be
/// mapped again at once by a test running beside this one).
fn page_before_a_hole() -> u64 {
    for k in 0..64u64 {
        let at = 0x4000_0000_0000 + (k << 30);
        // SAFETY: a private anonymous page where nothing is mapped (the kernel
        // refuses to replace a mapping: MAP_FIXED_NOREPLACE).
        let page = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            continue;
        }
        // The next page must be unmapped (mincore fails there); nothing else asks
        // for this range.
        let mut resident = [0u8];
        // SAFETY: mincore only reports on the pages.
        let hole = unsafe {
            libc::mincore(
                (page as u64 + 4096) as *mut libc::c_void,
                4096,
                resident.as_mut_ptr(),
            )
        } != 0;
        if hole {
            return page as u64;
        }
        // SAFETY: the page just mapped.
        unsafe { libc::munmap(page, 4096) };
    }
    panic!("no page with a hole after it");
}

#[test]
fn stack_records_that_do_not_fit_are_lost_whole() {
    let region = Region::new();
    let f = assemble_site_fn(&region, Variant::Load, FLAGS_Z);
    put_threads(&region, fs_base(), 0);
    let plan = plan_for(&region, &f);
    let ring = Ring::new(4);
    let p = probe("", &[]);
    let symbols = symbols_for(&region);
    let capture = fake_capture(&region, StackRoot::Direct(32), 3);
    let params = TrampolineParams {
        flags: FlagSave::for_this_cpu(),
        let_go: None,
        probe_id: 1,
        args: &p.args,
        string_args: &p.strings,
        ring_addr: ring.addr(),
        capacity: 4,
        tramp_addr: region.addr(ZONE_TRAMP),
        tag_addr: region.data(TAG),
        thread_id: ThreadIdSource::FsSelfPointer,
        symbols: &symbols,
        stack: Some(&capture),
    };
    let tramp = build_trampoline(&plan, &params).expect("trampoline");
    region.write_code(ZONE_TRAMP, &tramp.code);
    region.write_code((plan.site() - region.addr(0)) as usize, &tramp.patch);
    // Each record takes all 4 slots: with no consumer serving the ring, the
    // second is lost at once, whole, without waiting.
    f.call();
    f.call();
    let mut reader = ring.reader();
    assert_eq!(reader.drain(10, |r| assert!(r.stack.is_some())).records, 1);
    assert_eq!(reader.lost(), 1);
    assert_eq!(reader.waited_cycles(), 0);
    f.call();
    assert_eq!(reader.drain(10, |_| {}).records, 1);
    restore(&region, &plan);
    // A ring of 4 slots cannot hold a record of 1 + 4.
    let too_big = fake_capture(&region, StackRoot::Direct(32), 4);
    let params = TrampolineParams {
        stack: Some(&too_big),
        ..params
    };
    assert!(build_trampoline(&plan, &params).is_err());
}

#[test]
fn a_stack_record_waits_for_room_instead_of_being_lost() {
    let region = Region::new();
    let f = assemble_site_fn(&region, Variant::Load, FLAGS_Z);
    put_threads(&region, fs_base(), 0);
    let plan = plan_for(&region, &f);
    // Room for 4 records of 1 + 1 slots; the consumer drains every 50 µs.
    let ring = Ring::new(8);
    let p = probe("", &[]);
    let symbols = symbols_for(&region);
    let capture = fake_capture(&region, StackRoot::Direct(32), 1);
    let params = TrampolineParams {
        flags: FlagSave::for_this_cpu(),
        let_go: None,
        probe_id: 1,
        args: &p.args,
        string_args: &p.strings,
        ring_addr: ring.addr(),
        capacity: 8,
        tramp_addr: region.addr(ZONE_TRAMP),
        tag_addr: region.data(TAG),
        thread_id: ThreadIdSource::FsSelfPointer,
        symbols: &symbols,
        stack: Some(&capture),
    };
    let tramp = build_trampoline(&plan, &params).expect("trampoline");
    region.write_code(ZONE_TRAMP, &tramp.code);
    region.write_code((plan.site() - region.addr(0)) as usize, &tramp.patch);
    let done = std::sync::atomic::AtomicBool::new(false);
    ring.reader().serve(u64::MAX, u64::MAX);
    let records = std::thread::scope(|s| {
        let consumer = s.spawn(|| {
            let mut reader = ring.reader();
            let mut n = 0;
            loop {
                let last = done.load(std::sync::atomic::Ordering::Acquire);
                n += reader
                    .drain(usize::MAX, |r| assert!(r.stack.is_some()))
                    .records;
                if last {
                    return (n, reader.lost());
                }
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        });
        for _ in 0..40 {
            f.call();
        }
        done.store(true, std::sync::atomic::Ordering::Release);
        consumer.join().expect("consumer")
    });
    restore(&region, &plan);
    assert_eq!(records, (40, 0), "(records, lost)");
    // 40 records through room for 4: the producer waited, and counted it.
    assert!(ring.reader().waited_cycles() > 0);
}

#[test]
fn a_thin_ring_records_stack_probes_without_their_stack() {
    let region = Region::new();
    let f = assemble_site_fn(&region, Variant::Load, FLAGS_Z);
    put_frame(&region, 0, 0, 0x7000_0000_0100, 7, 0);
    put_threads(&region, fs_base(), region.data(frame_at(0)));
    let plan = plan_for(&region, &f);
    restore(&region, &plan);
    region.put(SNAP, &[0u8; SNAP_WORDS * 8]);
    f.call();
    let before = region.snapshot();
    let ring = Ring::new(16);
    let p = probe(ENTRY_STRINGS, &[true, true]);
    let symbols = symbols_for(&region);
    let capture = fake_capture(&region, StackRoot::Direct(32), 2);
    let params = TrampolineParams {
        flags: FlagSave::for_this_cpu(),
        let_go: None,
        probe_id: 9,
        args: &p.args,
        string_args: &p.strings,
        ring_addr: ring.addr(),
        capacity: 16,
        tramp_addr: region.addr(ZONE_TRAMP),
        tag_addr: region.data(TAG),
        thread_id: ThreadIdSource::FsSelfPointer,
        symbols: &symbols,
        stack: Some(&capture),
    };
    let tramp = build_trampoline(&plan, &params).expect("trampoline");
    region.write_code(ZONE_TRAMP, &tramp.code);
    region.write_code((plan.site() - region.addr(0)) as usize, &tramp.patch);
    let want = expected_args(&region, &f, &p, &before);
    let mut reader = ring.reader();
    for mode in [
        THIN_STACKLESS,
        THIN_OFF,
        THIN_COUNT,
        THIN_STACKLESS,
        THIN_COUNT,
    ] {
        reader.set_thin(9, mode);
        assert_eq!(reader.thin(9), mode);
        let (head, counted) = (reader.head(), reader.counted(9));
        region.put(SNAP, &[0u8; SNAP_WORDS * 8]);
        f.call();
        assert_eq!(region.snapshot(), before, "thin {mode}: the site's state");
        // Stackless: one slot; with the stack 1 + 2 slots; counted: none.
        let slots = [3, 1, 0][usize::from(mode)];
        assert_eq!(reader.head() - head, slots, "thin {mode}");
        assert_eq!(
            reader.counted(9) - counted,
            u64::from(mode == THIN_COUNT),
            "thin {mode}"
        );
        let mut seen = 0;
        reader.drain(usize::MAX, |r| {
            seen += 1;
            assert_eq!(r.args[..r.nargs], want[..], "thin {mode}");
            match (&r.stack, mode) {
                (None, THIN_STACKLESS) => {}
                (Some(s), THIN_OFF) => assert_eq!(s.frames, [(0x7000_0000_0100, 7)]),
                (s, _) => panic!("thin {mode}: stack {s:?}"),
            }
        });
        assert_eq!(seen, u64::from(mode != THIN_COUNT));
    }
    assert_eq!(reader.counted(9), 2);
    assert_eq!(reader.lost(), 0);
    restore(&region, &plan);
}
