//! Reserving a slot from inside the target: the producer's side of the ring
//! protocol (compare-and-swap on `head`, waiting on a full ring, counting lost
//! events), and asking early for the lines of a slot about to be written.
//! Public, unlike the rest of the trampoline: the injected hook's callbacks
//! (`pyprobe_cpython::hook`) reserve their slots with the same code.

use std::ops::Range;

use iced_x86::code_asm::*;

use super::flags::extended_feature_ecx;
use super::CodegenError;
use crate::ring::format::*;

/// What a ring's slots are, as a reservation sees them, and what it asks for ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Records of [`SLOT_SIZE`] bytes; the slot [`PREFETCH_AHEAD`] records on has
    /// its first `lines` cache lines asked for.
    Records { lines: u8 },
    /// Units of [`UNIT_SIZE`] bytes ([`Slots::Units`]); the line
    /// [`PREFETCH_UNITS_AHEAD`] units on is asked for.
    Units,
}

impl Shape {
    fn slots(self) -> Slots {
        match self {
            Shape::Records { .. } => Slots::Records,
            Shape::Units => Slots::Units,
        }
    }

    /// How many slots on a producer asks for lines, and how many of that slot's.
    fn prefetch(self) -> (i32, usize) {
        match self {
            Shape::Records { lines } => (PREFETCH_AHEAD, usize::from(lines).min(SLOT_SIZE / 64)),
            Shape::Units => (PREFETCH_UNITS_AHEAD, 1),
        }
    }
}

/// Reserves a slot, and `extra` more right after it in the same CAS (a stack
/// record's continuation slots, a group's units): on success r10 = index and r8 = slot address; on
/// failure counts the event lost and jumps to `restore` (r9 = the ring on both
/// paths). A full ring is waited on while its consumer lives (see the producer
/// protocol in `format.rs`). Clobbers rax, rcx, rdx, rsi, rdi, r8-r11 and flags;
/// uses no stack. Shared with the injected hook's callbacks (`pyprobe_cpython::hook`), so
/// that every producer waits for room the same way.
///
/// With `let_go` (the addresses the semaphores pyprobe raised lie in), a
/// producer that finds the consumer dead (`alive` still 1, its heartbeat stale)
/// lowers the semaphores the header's `held` lists, within those bounds (see
/// [`emit_let_go`]), before it counts its event lost.
///
/// On success it also asks for lines a few slots on, for writing (see [`Shape`]
/// and [`emit_prefetch_ahead`]). The slots of a reservation that spans the
/// ring's end wrap to its start: only r8's slot is at hand.
pub fn emit_reserve(
    a: &mut CodeAssembler,
    ring_addr: u64,
    capacity: u64,
    extra: u32,
    shape: Shape,
    let_go: Option<&Range<u64>>,
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
    let mut stale = a.create_label();
    a.jg(if let_go.is_some() { stale } else { full })?;
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

    if let Some(bounds) = let_go {
        a.set_label(&mut stale)?;
        emit_let_go(a, bounds, full)?;
    }
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
    a.shl(rax, shape.slots().shift())?;
    a.lea(r8, ptr(r9 + rax + HEADER_SIZE as i32))?;
    emit_prefetch_ahead(a, capacity, shape)?;
    Ok(())
}

/// With r9 = the ring, found unserved though `alive` says a consumer lives: in
/// the process the header's `owner` names, swaps each `held` flag to 0, and
/// lowers by one (never below 0) each semaphore whose flag was 1 and whose
/// address lies in `bounds` (the header is pyprobe's memory, but a stray write of
/// the program's must not become one of ours outside the semaphores); counts
/// the letting go in `let_go`. After it CPython no longer reaches the sites.
/// Clobbers rax, rcx, rdx, rsi, rdi, r10, r11 and flags; keeps r8 and r9.
/// Goes on to `done`, which the caller places right after it.
fn emit_let_go(
    a: &mut CodeAssembler,
    bounds: &Range<u64>,
    done: CodeLabel,
) -> Result<(), CodegenError> {
    let mut counted = a.create_label();
    let mut next = a.create_label();
    let mut skip = a.create_label();
    let mut lower = a.create_label();
    let mut lowered = a.create_label();
    a.mov(rsi, qword_ptr(r9 + H_HELD_COUNT as i32))?;
    a.test(rsi, rsi)?;
    a.jz(done)?;
    a.cmp(rsi, MAX_HELD as i32)?;
    a.jbe(counted)?;
    a.mov(esi, MAX_HELD as u32)?;
    a.set_label(&mut counted)?;
    // Only the owner's: a forked child's semaphores are its own copies.
    a.mov(eax, libc::SYS_getpid as u32)?;
    a.syscall()?;
    a.cmp(rax, qword_ptr(r9 + H_OWNER as i32))?;
    a.jne(done)?;
    a.lea(rdi, ptr(r9 + H_HELD as i32))?;
    a.set_label(&mut next)?;
    a.xor(eax, eax)?;
    // `xchg` with memory is locked: one producer (or pyprobe) gets each 1.
    a.xchg(qword_ptr(rdi + 8), rax)?;
    a.test(rax, rax)?;
    a.jz(skip)?;
    a.mov(r10, qword_ptr(rdi))?;
    a.mov(rax, bounds.start)?;
    a.cmp(r10, rax)?;
    a.jb(skip)?;
    a.mov(rax, bounds.end.saturating_sub(2))?;
    a.cmp(r10, rax)?;
    a.ja(skip)?;
    a.movzx(eax, word_ptr(r10))?;
    a.set_label(&mut lower)?;
    a.test(eax, eax)?;
    a.jz(lowered)?;
    a.lea(edx, ptr(rax - 1))?;
    // On failure `ax` is the counter now (eax's upper half stays 0): again.
    a.lock().cmpxchg(word_ptr(r10), dx)?;
    a.jne(lower)?;
    a.set_label(&mut lowered)?;
    a.lock().inc(qword_ptr(r9 + H_LET_GO as i32))?;
    a.set_label(&mut skip)?;
    a.add(rdi, 16)?;
    a.dec(rsi)?;
    a.jnz(next)?;
    Ok(())
}

/// Records ahead of the one just reserved whose slot a producer asks for.
pub(crate) const PREFETCH_AHEAD: i32 = 4;
/// Units ahead of the one just reserved whose line a producer asks for: a few
/// lines on, each written by four records of one unit.
const PREFETCH_UNITS_AHEAD: i32 = 16;

/// With r10 = the index just reserved and r9 = the ring: `prefetchw` of the first
/// lines of the slot a few on ([`Shape::prefetch`]: the first `lines` of the
/// record [`PREFETCH_AHEAD`] on; the line of the unit [`PREFETCH_UNITS_AHEAD`]
/// on), wrapped: always inside the ring. A slot's lines were last written a lap ago and read by pyprobe since,
/// so a store to them waits for the line to come back; asked for a few records
/// early, the line is there when the record is written (fib on CPython 3.9, ring
/// never full: 100 -> 65 ns per event). A prefetch never faults and changes no
/// data. Emitted only on CPUs that have the instruction. Clobbers rax.
fn emit_prefetch_ahead(
    a: &mut CodeAssembler,
    capacity: i32,
    shape: Shape,
) -> Result<(), CodegenError> {
    let (ahead, lines) = shape.prefetch();
    if lines == 0 || !has_prefetchw() {
        return Ok(());
    }
    a.lea(rax, ptr(r10 + ahead))?;
    a.and(rax, capacity - 1)?;
    a.shl(rax, shape.slots().shift())?;
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
