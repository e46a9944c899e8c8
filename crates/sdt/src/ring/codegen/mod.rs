//! Machine code for one site's trampoline, and the patch that jumps to it.
//!
//! Trampoline layout (all in the target, no calls; one system call, a `futex`
//! wait, only while the ring is full and its consumer lives):
//!
//! ```text
//! lea rsp, [rsp-136]          ; step over the red zone (lea keeps flags)
//! push rax; lahf; seto al     ; the flags into the slot below the red zone
//!                             ;   (or pushfq where there is no lahf)
//! push rcx rdx rsi rdi r8 r9 r10 r11
//! reserve a slot (format.rs protocol) -> r10 = index, r8 = slot address
//!   (ring full: wait while the consumer lives; else, or after 8 failed CAS:
//!   lock inc lost; skip to restore); prefetchw the slot 4 records on
//! rdtsc, probe id, tag, thread, nargs/masks, each argument, string prefixes
//! (stack probes) the thread's Python stack into the following slots (stack.rs)
//! mov [r8].seq, r10 + 1       ; publish
//! restore: pop in reverse, add al, 0x7f; sahf (or popfq), lea rsp, [rsp+136]
//! the displaced instructions, relocated (BlockEncoder)
//! jmp site+len                ; unless the last one was jmp/ret/call
//! ```
//!
//! Arguments are computed from the registers as they were at the site:
//! registers the trampoline pushed are read back from their stack slots,
//! `%rsp` is the current rsp plus the 208 bytes moved, and `%rip` is the
//! address after the `nop` (as in [`crate::sdt::evaluate`]). Memory
//! operands and string pointers are dereferenced directly: the trampoline
//! runs inside the target, so a bad pointer faults the target. SDT operands
//! are valid at the site by construction; only flag as strings arguments the
//! program guarantees to be NULL or a valid C string.

use std::ops::Range;

use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, IcedError};
use thiserror::Error;

use crate::ring::format::*;
use crate::ring::region::jump_patch;
use crate::ring::site::{SitePlan, Tail, PATCH_LEN};
use crate::ring::stack::{emit_capture, StackCapture};
use crate::sdt::{ArgSpec, RegFamily};

mod args;

use args::{emit_arg, emit_string_copy, gpr, slot_arg};

/// How the trampoline identifies the thread (stored in the record's `thread`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadIdSource {
    /// `mov rax, fs:[0]`: the TCB self-pointer that glibc and musl keep at
    /// `%fs:0`, equal to the fs base. Faults in a thread without TLS set up.
    #[default]
    FsSelfPointer,
    /// `rdfsbase rax`: needs the CPU feature and kernel support
    /// (`HWCAP2_FSGSBASE` in the target's auxv, Linux 5.9+); raises SIGILL otherwise.
    Rdfsbase,
}

/// Everything [`build_trampoline`] needs besides the site plan.
pub struct TrampolineParams<'a> {
    /// Written into each record's `probe` field.
    pub probe_id: u32,
    /// The site's argument specs (at most [`MAX_ARGS`]).
    pub args: &'a [ArgSpec],
    /// `string_args[i]`: capture argument `i` as a C string (missing entries are false).
    pub string_args: &'a [bool],
    /// Address of the ring header in the target; slots follow at `+ HEADER_SIZE`.
    pub ring_addr: u64,
    /// Slots in the ring (power of two, as in its header).
    pub capacity: u64,
    /// Address the trampoline code will be placed at.
    pub tramp_addr: u64,
    /// Address of the 4-byte per-process tag word (in a private mapping, so a
    /// forked child has its own copy for the engine to rewrite).
    pub tag_addr: u64,
    pub thread_id: ThreadIdSource,
    /// Runtime addresses of symbols used by `sym(...)` operands.
    pub symbols: &'a dyn Fn(&str) -> Option<u64>,
    /// Capture the thread's Python stack into continuation slots (see [`super::stack`]).
    pub stack: Option<&'a StackCapture>,
    /// How the interrupted code's flags are kept ([`FlagSave::for_this_cpu`]).
    pub flags: FlagSave,
}

/// A trampoline ready to be written at `addr`, and the site patch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trampoline {
    pub addr: u64,
    pub code: Vec<u8>,
    /// Address of the patched site.
    pub site: u64,
    /// Where a thread continues that executed the site's `nop` (it stopped at an
    /// `int3` there before the patch): the relocated displaced instructions, with
    /// every register as at the site.
    pub resume: u64,
    /// Bytes to write at `site`: `jmp rel32` to `addr`, then `int3` over the
    /// rest of the displaced bytes (never executed; a stray jump there traps
    /// instead of running half an instruction). Same length as the plan's
    /// original bytes.
    pub patch: Vec<u8>,
}

impl Trampoline {
    /// Code bytes.
    pub fn len(&self) -> usize {
        self.code.len()
    }

    pub fn is_empty(&self) -> bool {
        self.code.is_empty()
    }

    /// `[addr, addr + len)`: a thread whose rip lies here is running the
    /// trampoline; do not unmap or rewrite it until none is.
    pub fn range(&self) -> Range<u64> {
        self.addr..self.addr.wrapping_add(self.code.len() as u64)
    }

    pub fn contains(&self, rip: u64) -> bool {
        self.range().contains(&rip)
    }
}

/// Why no trampoline could be built.
#[derive(Debug, Error)]
pub enum CodegenError {
    #[error("probe has {0} arguments; the ring records at most {MAX_ARGS}")]
    TooManyArgs(usize),
    #[error("{0} string flags given for {1} arguments")]
    StringFlags(usize, usize),
    #[error("argument {index} ({spec}) is flagged as a string but is not an 8-byte pointer")]
    StringNotPointer { index: usize, spec: String },
    #[error("argument {index} ({spec}) has size {size}; sizes are 1, 2, 4 or 8")]
    BadSize {
        index: usize,
        spec: String,
        size: u8,
    },
    #[error("argument {index} ({spec}) has scale {scale}; scales are 1, 2, 4 or 8")]
    BadScale {
        index: usize,
        spec: String,
        scale: u8,
    },
    #[error("argument {index} ({spec}) uses symbol `{symbol}`, which the resolver does not know")]
    UnresolvedSymbol {
        index: usize,
        spec: String,
        symbol: String,
    },
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error(
        "trampoline at {tramp:#x} is more than 2 GiB from site {site:#x}; \
         place it within ±2 GiB of the code it patches"
    )]
    TooFar { site: u64, tramp: u64 },
    #[error("tag word at {tag:#x} overlaps the trampoline code {start:#x}..{end:#x}")]
    TagOverlap { tag: u64, start: u64, end: u64 },
    #[error("cannot capture stacks: {0}")]
    Stack(String),
    #[error("cannot assemble the trampoline: {0}")]
    Assemble(String),
}

impl From<IcedError> for CodegenError {
    fn from(e: IcedError) -> Self {
        CodegenError::Assemble(e.to_string())
    }
}

/// Bytes between the trampoline's rsp after its pushes and the site's rsp:
/// red zone (128) + flags (8) + nine registers (72).
const FRAME: i32 = 128 + 8 + 8 * SAVED.len() as i32;

/// Registers the trampoline uses, in push order.
const SAVED: [RegFamily; 9] = [
    RegFamily::Rax,
    RegFamily::Rcx,
    RegFamily::Rdx,
    RegFamily::Rsi,
    RegFamily::Rdi,
    RegFamily::R8,
    RegFamily::R9,
    RegFamily::R10,
    RegFamily::R11,
];

/// Builds the trampoline for `plan` (see the module docs for its layout).
pub fn build_trampoline(
    plan: &SitePlan,
    p: &TrampolineParams<'_>,
) -> Result<Trampoline, CodegenError> {
    check_capacity(p.capacity)?;
    if p.args.len() > MAX_ARGS {
        return Err(CodegenError::TooManyArgs(p.args.len()));
    }
    if p.string_args.len() > p.args.len() {
        return Err(CodegenError::StringFlags(p.string_args.len(), p.args.len()));
    }
    let is_string = |i: usize| p.string_args.get(i).copied().unwrap_or(false);
    for (index, arg) in p.args.iter().enumerate() {
        if is_string(index) && arg.size != 8 {
            return Err(CodegenError::StringNotPointer {
                index,
                spec: arg.to_string(),
            });
        }
    }
    // Check the patch distance first: no point assembling otherwise.
    let patch = patch_bytes(plan, p.tramp_addr)?;

    let mut a = CodeAssembler::new(64)?;
    let site_rip = plan.site().wrapping_add(1);
    emit_save_flags(&mut a, p.flags)?;
    let mut counted = a.create_label();
    let thinnable = p.stack.is_some() && p.probe_id < THIN_PROBES;
    if thinnable {
        // Counted only (a storm over budget): the count and nothing else, before
        // the other registers are saved, is the cheapest event there is.
        let id = p.probe_id as i32;
        let mut record = a.create_label();
        a.mov(rax, p.ring_addr)?;
        a.cmp(byte_ptr(rax + H_THIN as i32 + id), u32::from(THIN_COUNT))?;
        a.jne(record)?;
        a.lock().inc(qword_ptr(rax + H_COUNTED as i32 + 8 * id))?;
        a.jmp(counted)?;
        a.set_label(&mut record)?;
    }
    // rax, the first, is saved with the flags.
    for family in &SAVED[1..] {
        a.push(gpr(*family))?;
    }

    let mut restore = a.create_label();
    match p.stack {
        Some(stack) if thinnable => {
            // The consumer may thin this probe: record it without its stack (or
            // only count it, above; see the `thin` header field).
            let id = p.probe_id as i32;
            let mut full = a.create_label();
            a.mov(rax, p.ring_addr)?;
            a.cmp(byte_ptr(rax + H_THIN as i32 + id), u32::from(THIN_OFF))?;
            a.je(full)?;
            emit_record(&mut a, p, None, site_rip, &is_string, &mut restore)?;
            a.jmp(restore)?;
            a.set_label(&mut full)?;
            emit_record(&mut a, p, Some(stack), site_rip, &is_string, &mut restore)?;
        }
        stack => emit_record(&mut a, p, stack, site_rip, &is_string, &mut restore)?,
    }

    a.set_label(&mut restore)?;
    for family in SAVED[1..].iter().rev() {
        a.pop(gpr(*family))?;
    }
    if thinnable {
        a.set_label(&mut counted)?;
    }
    emit_restore_flags(&mut a, p.flags)?;
    let mut resume = a.create_label();
    a.set_label(&mut resume)?;
    // A label needs an instruction after it: a 1-byte nop, harmless if nothing
    // is displaced besides the site's own nop.
    a.nop()?;
    for instr in plan.displaced() {
        a.add_instruction(*instr)?;
    }
    match plan.tail() {
        Tail::JumpBack => a.jmp(plan.end())?,
        Tail::Terminates => {}
        Tail::Call { target } => {
            // Emulated `call`: push the original return address (site + len,
            // outside the patch) without touching flags, then jump.
            let ret = plan.end();
            a.lea(rsp, ptr(rsp - 8))?;
            a.mov(dword_ptr(rsp), ret as u32)?;
            a.mov(dword_ptr(rsp + 4), (ret >> 32) as u32)?;
            a.jmp(target)?;
        }
    }
    let assembled = a.assemble_options(
        p.tramp_addr,
        BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
    )?;
    let resume = assembled.label_ip(&resume)?;
    let code = assembled.inner.code_buffer;
    let end = p.tramp_addr.wrapping_add(code.len() as u64);
    if p.tag_addr < end && p.tag_addr.wrapping_add(4) > p.tramp_addr {
        return Err(CodegenError::TagOverlap {
            tag: p.tag_addr,
            start: p.tramp_addr,
            end,
        });
    }
    Ok(Trampoline {
        addr: p.tramp_addr,
        code,
        site: plan.site(),
        resume,
        patch,
    })
}

/// How a trampoline keeps the interrupted code's flags (the displaced
/// instructions after it may read them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagSave {
    /// `lahf` and `seto` into the slot `pushfq` would use, `add al, 0x7f` and
    /// `sahf` back: the six status flags, which is all the trampoline changes
    /// (it never touches DF or the system flags). About 2 ns where
    /// `pushfq`/`popfq` cost 12 (`popfq` is microcoded).
    Lahf,
    /// `pushfq`/`popfq`: for a CPU without `lahf`/`sahf` in 64-bit mode.
    Pushfq,
}

impl FlagSave {
    /// The cheaper way where this CPU has it (CPUID 0x8000_0001, ECX bit 0).
    /// pyprobe and the target it writes trampolines for run on the same machine.
    pub fn for_this_cpu() -> FlagSave {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let has = *HAS.get_or_init(|| extended_feature_ecx() & 1 != 0);
        if has {
            FlagSave::Lahf
        } else {
            FlagSave::Pushfq
        }
    }
}

/// CPUID 0x8000_0001's ECX, 0 on a CPU without the extended leaf.
fn extended_feature_ecx() -> u32 {
    use std::arch::x86_64::__cpuid;
    // The extended leaf is asked for only when the CPU says it has it.
    if __cpuid(0x8000_0000).eax >= 0x8000_0001 {
        __cpuid(0x8000_0001).ecx
    } else {
        0
    }
}

/// Steps over the red zone and saves the flags and rax, leaving the stack as
/// `lea rsp, [rsp-128]; pushfq; push rax` would (arguments are read from those
/// slots, see [`FRAME`]).
fn emit_save_flags(a: &mut CodeAssembler, how: FlagSave) -> Result<(), CodegenError> {
    match how {
        FlagSave::Lahf => {
            // lea keeps the flags; lahf and seto only read them.
            a.lea(rsp, ptr(rsp - 136))?;
            a.push(rax)?;
            a.lahf()?;
            a.seto(al)?;
            a.mov(qword_ptr(rsp + 8), rax)?;
        }
        FlagSave::Pushfq => {
            a.lea(rsp, ptr(rsp - 128))?;
            a.pushfq()?;
            a.push(rax)?;
        }
    }
    Ok(())
}

/// Undoes [`emit_save_flags`] (every other saved register already popped).
fn emit_restore_flags(a: &mut CodeAssembler, how: FlagSave) -> Result<(), CodegenError> {
    match how {
        FlagSave::Lahf => {
            a.mov(rax, qword_ptr(rsp + 8))?;
            // al is 1 if OF was set: 1 + 0x7f overflows, 0 + 0x7f does not.
            a.add(al, 0x7f)?;
            a.sahf()?;
            a.pop(rax)?;
            a.lea(rsp, ptr(rsp + 136))?;
        }
        FlagSave::Pushfq => {
            a.pop(rax)?;
            a.popfq()?;
            a.lea(rsp, ptr(rsp + 128))?;
        }
    }
    Ok(())
}

/// Reserves a slot (with `stack`'s continuation slots), fills and publishes it;
/// jumps to `restore` when the event is lost.
fn emit_record(
    a: &mut CodeAssembler,
    p: &TrampolineParams<'_>,
    stack: Option<&StackCapture>,
    site_rip: u64,
    is_string: &dyn Fn(usize) -> bool,
    restore: &mut CodeLabel,
) -> Result<(), CodegenError> {
    let extra = stack.map_or(0, |s| u32::from(s.slots));
    let count = (0..p.args.len()).filter(|&i| is_string(i)).count();
    emit_reserve(
        a,
        p.ring_addr,
        p.capacity,
        extra,
        record_lines(count > 0),
        restore,
    )?;
    emit_header(a, p, is_string)?;
    for (index, arg) in p.args.iter().enumerate() {
        emit_arg(a, arg, index, site_rip, p.symbols)?;
        a.mov(qword_ptr(r8 + slot_arg(index)), r11)?;
    }
    let strings = (0..p.args.len()).filter(|&i| is_string(i));
    for (k, index) in strings.enumerate() {
        if let Some(area) = string_area(k, count) {
            emit_string_copy(a, index, area)?;
        }
    }
    if let Some(stack) = stack {
        emit_capture(a, stack, p.ring_addr, p.capacity)?;
    }
    // Publish: seq = index + 1, after every payload store (x86 keeps store order).
    a.lea(rax, ptr(r10 + 1))?;
    a.mov(qword_ptr(r8 + S_SEQ as i32), rax)?;
    Ok(())
}

/// `jmp rel32` from the site to `tramp`, padded with `int3` to the plan's length
/// (the form a later pyprobe recognises, see [`super::region`]).
fn patch_bytes(plan: &SitePlan, tramp: u64) -> Result<Vec<u8>, CodegenError> {
    jump_patch(plan.site(), tramp, plan.len().max(PATCH_LEN)).ok_or(CodegenError::TooFar {
        site: plan.site(),
        tramp,
    })
}

/// Reserves a slot, and `extra` more right after it in the same CAS (a stack
/// record's continuation slots): on success r10 = index and r8 = slot address; on
/// failure counts the event lost and jumps to `restore` (r9 = the ring on both
/// paths). A full ring is waited on while its consumer lives (see the producer
/// protocol in `format.rs`). Clobbers rax, rcx, rdx, rsi, rdi, r8-r11 and flags;
/// uses no stack. Shared with the injected hook's callbacks (`pyprobe_cpython::hook`), so
/// that every producer waits for room the same way.
///
/// On success it also asks for the first `lines` cache lines of the slot
/// [`PREFETCH_AHEAD`] records on, for writing (see [`emit_prefetch_ahead`]).
pub fn emit_reserve(
    a: &mut CodeAssembler,
    ring_addr: u64,
    capacity: u64,
    extra: u32,
    lines: u8,
    restore: &mut CodeLabel,
) -> Result<(), CodegenError> {
    check_capacity(capacity)?;
    let mut retry = a.create_label();
    let mut full = a.create_label();
    let mut reserved = a.create_label();
    let mut wait = a.create_label();
    let mut started = a.create_label();
    let mut sleep = a.create_label();
    let mut awake = a.create_label();
    let mut solo = a.create_label();
    let mut swapped = a.create_label();
    let capacity = capacity as i32; // <= 2^24, checked above
    let room = capacity - extra as i32;
    a.mov(r9, ring_addr)?;
    a.mov(ecx, RESERVE_ATTEMPTS)?;
    // r8 = the TSC at the first wait, 0 while the event has not waited (r8 is
    // kept by the futex system call, which clobbers rax, rcx and r11).
    a.xor(r8d, r8d)?;
    a.set_label(&mut retry)?;
    // tail before head: head - tail cannot underflow with an honest consumer.
    a.mov(rdx, qword_ptr(r9 + H_TAIL as i32))?;
    a.mov(rax, qword_ptr(r9 + H_HEAD as i32))?;
    a.mov(rdi, rax)?;
    a.sub(rdi, rdx)?;
    a.cmp(rdi, room)?;
    a.jae(wait)?;
    a.lea(rdx, ptr(rax + 1 + capacity - room))?;
    // One producer thread (`solo`): the same compare-and-swap without `lock`.
    a.cmp(byte_ptr(r9 + H_SOLO as i32), 0)?;
    a.jne(solo)?;
    a.lock().cmpxchg(qword_ptr(r9 + H_HEAD as i32), rdx)?;
    a.jmp(swapped)?;
    a.set_label(&mut solo)?;
    a.cmpxchg(qword_ptr(r9 + H_HEAD as i32), rdx)?;
    a.set_label(&mut swapped)?;
    a.je(reserved)?;
    a.dec(ecx)?;
    a.jnz(retry)?;
    // Contended that long: treated as full (waits while the consumer lives).
    a.jmp(wait)?;

    // Full: wait while a consumer lives, its heartbeat is fresh and patience lasts.
    a.set_label(&mut wait)?;
    a.cmp(qword_ptr(r9 + H_ALIVE as i32), 0)?;
    a.je(full)?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.test(r8, r8)?;
    a.jnz(started)?;
    a.mov(r8, rax)?;
    a.set_label(&mut started)?;
    // Signed: a heartbeat stamped on a CPU whose counter is a little ahead is fresh.
    a.mov(rdx, rax)?;
    a.sub(rdx, qword_ptr(r9 + H_HEARTBEAT as i32))?;
    a.cmp(rdx, qword_ptr(r9 + H_STALE as i32))?;
    a.jg(full)?;
    a.mov(rdx, rax)?;
    a.sub(rdx, r8)?;
    a.cmp(rdx, qword_ptr(r9 + H_PATIENCE as i32))?;
    a.ja(full)?;
    a.cmp(rdx, SPIN_CYCLES)?;
    a.jae(sleep)?;
    a.pause()?;
    a.mov(ecx, RESERVE_ATTEMPTS)?;
    a.jmp(retry)?;

    // Asleep on tail's low word until the consumer wakes us or the nap ends.
    // Raising `sleepers` before the last look pairs with the consumer's fence
    // between storing tail and reading `sleepers`: either it sees us and wakes
    // us, or we see its new tail (here, or as a changed futex word).
    a.set_label(&mut sleep)?;
    a.lock().inc(dword_ptr(r9 + H_SLEEPERS as i32))?;
    a.mov(rdx, qword_ptr(r9 + H_TAIL as i32))?;
    a.mov(rax, qword_ptr(r9 + H_HEAD as i32))?;
    a.sub(rax, rdx)?;
    a.cmp(rax, room)?;
    a.jb(awake)?;
    a.mov(eax, libc::SYS_futex as u32)?;
    a.lea(rdi, ptr(r9 + H_TAIL as i32))?;
    a.xor(esi, esi)?; // FUTEX_WAIT, shared: the consumer wakes through its own mapping
    a.mov(edx, edx)?;
    a.lea(r10, ptr(r9 + H_NAP as i32))?;
    a.syscall()?;
    a.set_label(&mut awake)?;
    a.lock().dec(dword_ptr(r9 + H_SLEEPERS as i32))?;
    a.mov(ecx, RESERVE_ATTEMPTS)?;
    a.jmp(retry)?;

    a.set_label(&mut full)?;
    emit_add_waited(a)?;
    a.lock().inc(qword_ptr(r9 + H_LOST as i32))?;
    a.jmp(*restore)?;
    a.set_label(&mut reserved)?;
    a.mov(rcx, rax)?;
    emit_add_waited(a)?;
    a.mov(r10, rcx)?;
    a.mov(rax, rcx)?;
    a.and(rax, capacity - 1)?;
    a.shl(rax, SLOT_SIZE.trailing_zeros())?;
    a.lea(r8, ptr(r9 + rax + HEADER_SIZE as i32))?;
    emit_prefetch_ahead(a, capacity, lines)?;
    Ok(())
}

/// Records ahead of the one just reserved whose slot a producer asks for.
pub(crate) const PREFETCH_AHEAD: i32 = 4;

/// With r10 = the index just reserved and r9 = the ring: `prefetchw` of the first
/// `lines` cache lines of slot `r10 + PREFETCH_AHEAD` (wrapped: always inside the
/// ring). A slot's lines were last written a lap ago and read by pyprobe since,
/// so a store to them waits for the line to come back; asked for a few records
/// early, the line is there when the record is written (fib on CPython 3.9, ring
/// never full: 100 -> 65 ns per event). A prefetch never faults and changes no
/// data. Emitted only on CPUs that have the instruction. Clobbers rax.
fn emit_prefetch_ahead(
    a: &mut CodeAssembler,
    capacity: i32,
    lines: u8,
) -> Result<(), CodegenError> {
    if lines == 0 || !has_prefetchw() {
        return Ok(());
    }
    a.lea(rax, ptr(r10 + PREFETCH_AHEAD))?;
    a.and(rax, capacity - 1)?;
    a.shl(rax, SLOT_SIZE.trailing_zeros())?;
    let lines = usize::from(lines).min(SLOT_SIZE / 64);
    for line in 0..lines {
        a.prefetchw(byte_ptr(r9 + rax + (HEADER_SIZE + 64 * line) as i32))?;
    }
    Ok(())
}

/// Whether this CPU has `prefetchw` (CPUID 0x8000_0001, ECX bit 8). pyprobe and
/// the target it writes trampolines for run on the same machine.
pub(crate) fn has_prefetchw() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| extended_feature_ecx() & (1 << 8) != 0)
}

/// Cache lines a record's first slot is written in: the fixed part, and with
/// string arguments the string areas after it (to the slot's end).
pub fn record_lines(has_strings: bool) -> u8 {
    let written = if has_strings { SLOT_SIZE } else { S_STRINGS };
    written.div_ceil(64) as u8
}

/// If this event waited for room (r8, the TSC at its first wait, is set), adds
/// the cycles it waited to the header's `waited`: the target's time lost to a
/// full ring, which pyprobe charges to the overhead budget. Clobbers rax and rdx.
fn emit_add_waited(a: &mut CodeAssembler) -> Result<(), CodegenError> {
    let mut done = a.create_label();
    a.test(r8, r8)?;
    a.jz(done)?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.sub(rax, r8)?;
    a.lock().add(qword_ptr(r9 + H_WAITED as i32), rax)?;
    a.set_label(&mut done)?;
    Ok(())
}

/// tsc, probe, tag, thread, nargs and masks.
fn emit_header(
    a: &mut CodeAssembler,
    p: &TrampolineParams<'_>,
    is_string: &dyn Fn(usize) -> bool,
) -> Result<(), CodegenError> {
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(qword_ptr(r8 + S_TSC as i32), rax)?;
    a.mov(dword_ptr(r8 + S_PROBE as i32), p.probe_id)?;
    a.mov(rax, p.tag_addr)?;
    a.mov(eax, dword_ptr(rax))?;
    a.mov(dword_ptr(r8 + S_TAG as i32), eax)?;
    match p.thread_id {
        ThreadIdSource::FsSelfPointer => a.mov(rax, qword_ptr(0u64).fs())?,
        ThreadIdSource::Rdfsbase => a.rdfsbase(rax)?,
    }
    a.mov(qword_ptr(r8 + S_THREAD as i32), rax)?;
    let mask = (0..p.args.len())
        .filter(|&i| is_string(i))
        .fold(0u32, |m, i| m | 1 << i);
    // One 8-byte store covers nargs, string mask, and zeroes the truncated
    // and null masks and the reserved word (the slot holds an old record).
    let meta = p.args.len() as u32 | mask << 8;
    a.mov(qword_ptr(r8 + S_NARGS as i32), meta as i32)?;
    Ok(())
}
