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
//!
//! Here: the trampoline as a whole and its record. The slot reservation, which
//! the hook's callbacks share, is in `reserve`; saving the interrupted code's
//! flags in `flags`; the arguments in `args`.

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
mod flags;
mod reserve;

use args::{emit_arg, emit_string_copy, gpr, slot_arg};
pub use flags::FlagSave;
use flags::{emit_restore_flags, emit_save_flags};
pub use reserve::{emit_reserve, record_lines, Shape};
#[cfg(test)]
pub(crate) use reserve::{has_prefetchw, PREFETCH_AHEAD};

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
    pub(crate) probe_id: u32,
    /// The site's argument specs (at most [`MAX_ARGS`]).
    pub args: &'a [ArgSpec],
    /// `string_args[i]`: capture argument `i` as a C string (missing entries are false).
    pub string_args: &'a [bool],
    /// Address of the ring header in the target; slots follow at `+ HEADER_SIZE`.
    pub(crate) ring_addr: u64,
    /// Slots in the ring (power of two, as in its header).
    pub(crate) capacity: u64,
    /// Address the trampoline code will be placed at.
    pub(crate) tramp_addr: u64,
    /// Address of the 4-byte per-process tag word (in a private mapping, so a
    /// forked child has its own copy for the engine to rewrite).
    pub(crate) tag_addr: u64,
    pub(crate) thread_id: ThreadIdSource,
    /// Runtime addresses of symbols used by `sym(...)` operands.
    pub symbols: &'a dyn Fn(&str) -> Option<u64>,
    /// Capture the thread's Python stack into continuation slots (see [`super::stack`]).
    pub stack: Option<&'a StackCapture>,
    /// How the interrupted code's flags are kept ([`FlagSave::for_this_cpu`]).
    pub(crate) flags: FlagSave,
    /// Where the semaphores pyprobe raised lie: a producer that finds pyprobe
    /// dead lowers those its ring lists (see `held` in the ring format).
    pub(crate) let_go: Option<Range<u64>>,
}

/// A trampoline ready to be written at `addr`, and the site patch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trampoline {
    pub(crate) addr: u64,
    pub code: Vec<u8>,
    /// Address of the patched site.
    pub(crate) site: u64,
    /// Where a thread continues that executed the site's `nop` (it stopped at an
    /// `int3` there before the patch): the relocated displaced instructions, with
    /// every register as at the site.
    pub(crate) resume: u64,
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
        Shape::Records {
            lines: record_lines(count > 0),
        },
        p.let_go.as_ref(),
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
