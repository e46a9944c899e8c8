//! Capturing the Python stack inside a trampoline: the thread's own frame chain,
//! walked in the target at ring speed, as (code pointer, position) pairs.
//!
//! The ring stays ignorant of Python: [`StackCapture`] is plain offsets that the
//! caller takes from the frame walker's layout. The walk:
//!
//! 1. the thread's own thread state is read where the interpreter keeps it
//!    ([`CurrentThreadState`]): a thread-local of the executable (3.12+), or the
//!    global holding the GIL holder's state (up to 3.11; GC, import and audit
//!    probes fire with the GIL held); no list of thread states is walked, so no
//!    other thread's state, which that thread may free at any time, is read;
//! 2. its `thread_id` must equal `%fs:0` (glibc's `pthread_self()`, which is what
//!    CPython stores there), or nothing is walked;
//! 3. from that thread state's innermost frame ([`StackRoot`]), up to
//!    [`MAX_WALK`] frames are followed through `back`/`previous`; frames owned by
//!    the C stack (per `owner`, 3.12+) and frames without code are skipped; the
//!    first [`frames_for`]`(slots)` others are written, and one more ends the walk
//!    (flagged truncated): what pyprobe shows of such a stack is its innermost
//!    frames, and each frame walked costs the checks below (on a deep chain of
//!    generators, whose frames lie on pages of their own, a system call each).
//!    They are the thread's own frames, alive while it runs the probe.
//!
//! Every loop has a fixed bound, so a cycle or an over-long chain ends the walk
//! (flagged truncated) rather than the target. Nothing is dereferenced besides the
//! interpreter's own thread and frame structures: code objects are named later, by
//! pyprobe, from outside.
//!
//! # Links the interpreter would not follow
//!
//! The thread state, its innermost frame (and 3.11/3.12's `cframe`) are what the
//! interpreter itself runs on at the probe: they are read as they are. A frame's
//! `back`/`previous` link is different: the interpreter follows it only when that
//! frame returns, so a program may hold garbage there meanwhile (a C extension, or
//! ctypes) and run fine. Every frame the walk moves to must therefore be 8-byte
//! aligned, in the lower half of the address space, above the first 64 KiB, and on
//! pages the kernel says are readable: a probe of each page not vouched for yet in
//! this walk (the innermost frame's pages are), by `rt_sigprocmask` with an invalid
//! `how`, which copies 8 bytes from the page before it rejects `how`: `EINVAL` if
//! the page is readable, `EFAULT` if not, and the signal mask is never changed. A
//! link that fails ends the walk, flagged ([`STACK_UNREADABLE`]). Frames of one
//! walk share few pages, so few walks make a system call at all.
//!
//! What stays out of reach: a page unmapped by another thread between the probe and
//! the read. Only a corrupted link can point at such a page (a real frame's memory
//! is alive while its thread runs the probe).
//!
//! # Record
//!
//! A record with a stack takes `1 + slots` consecutive ring slots, reserved at once.
//! In the first (the ordinary record), byte [`S_STACK_SLOTS`] holds `slots`, byte
//! [`S_STACK_FLAGS`] the flags ([`STACK_CAPTURED`], [`STACK_FOUND`],
//! [`STACK_TRUNCATED`], [`STACK_UNREADABLE`]) and the u16 at [`S_STACK_DEPTH`] the frames written. Each
//! following slot `k` holds `seq` ([`continuation_seq`] of its index), at [`C_OWNER`] the first
//! slot's index, and from [`C_PAIRS`] [`PAIRS_PER_SLOT`] pairs of u64: the code
//! pointer (tag bits masked off) and the position (`f_lasti` sign-extended up to
//! 3.10, the instruction pointer from 3.11), innermost frame first. The
//! continuation slots are published before the first one.

use iced_x86::code_asm::*;

use super::codegen::CodegenError;
use super::format::{HEADER_SIZE, SLOT_SIZE};

/// Byte of the first slot holding the number of continuation slots.
pub(crate) const S_STACK_SLOTS: usize = 84;
/// Byte of the first slot holding the stack flags.
pub(crate) const S_STACK_FLAGS: usize = 85;
/// u16 of the first slot holding the number of frames written.
pub(crate) const S_STACK_DEPTH: usize = 86;
/// The trampoline ran a stack capture (even if it found nothing).
pub(crate) const STACK_CAPTURED: u8 = 1;
/// The thread's thread state was found.
pub(crate) const STACK_FOUND: u8 = 2;
/// The walk hit its bound with frames left (a cycle or a very deep stack).
pub(crate) const STACK_TRUNCATED: u8 = 4;
/// The walk stopped at a link that was not a readable frame (see the module's
/// documentation); [`STACK_TRUNCATED`] is set with it.
pub(crate) const STACK_UNREADABLE: u8 = 8;
/// A continuation slot's `seq` is its index + 1 with this bit set: never taken for
/// a record of its own (e.g. after its first slot was skipped as stuck).
pub(crate) const CONT_SEQ_BIT: u64 = 1 << 63;

/// The `seq` of the continuation slot at `index` once written.
pub(crate) const fn continuation_seq(index: u64) -> u64 {
    index.wrapping_add(1) | CONT_SEQ_BIT
}

/// Continuation slot: the index of the record's first slot.
pub(crate) const C_OWNER: usize = 8;
/// Continuation slot: where the pairs start.
pub(crate) const C_PAIRS: usize = 16;
/// (code, position) pairs per continuation slot.
pub(crate) const PAIRS_PER_SLOT: usize = (SLOT_SIZE - C_PAIRS) / 16;
/// Most continuation slots per record.
pub const MAX_STACK_SLOTS: u8 = 4;
/// Most frames a record can carry.
pub const MAX_STACK_FRAMES: usize = MAX_STACK_SLOTS as usize * PAIRS_PER_SLOT;
/// Frames followed (shims included) before the walk gives up.
pub(crate) const MAX_WALK: u32 = 1024;

/// Frames carried by a record with `slots` continuation slots.
pub(crate) const fn frames_for(slots: u8) -> usize {
    slots as usize * PAIRS_PER_SLOT
}

/// Where a thread reads its own `PyThreadState *`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CurrentThreadState {
    /// `%fs:offset`: a thread-local of the executable (`_Py_tss_tstate`, 3.12+).
    ThreadLocal(i32),
    /// The runtime address of a global holding the GIL holder's thread state
    /// (`_PyRuntime.gilstate.tstate_current`, up to 3.11).
    GilHolder(u64),
}

/// Where a thread state keeps its innermost frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StackRoot {
    /// A pointer field of the thread state (3.9/3.10 `frame`, 3.13+ `current_frame`).
    Direct(u64),
    /// `tstate->[pointer]->[field]` (3.11/3.12 `cframe->current_frame`).
    Indirect { pointer: u64, field: u64 },
}

/// A frame's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackFrame {
    /// The next (outer) frame: `f_back` or `previous`.
    pub back: u64,
    /// The code object: `f_code`, `f_executable`.
    pub code: u64,
    /// The position: `f_lasti` (4 bytes, sign-extended) or the instruction pointer (8).
    pub position: u64,
    /// 4 or 8.
    pub position_size: u8,
    /// `owner` byte, and the first owner value that marks a C-stack shim (skipped).
    pub owner: Option<(u64, u8)>,
    /// Tag bits of the code pointer, masked off (3.14+ stack references).
    pub code_tag_mask: u64,
}

/// Offsets the trampoline walks by, taken from the frame walker's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackCapture {
    /// Where the thread finds its thread state.
    pub current: CurrentThreadState,
    /// `PyThreadState.thread_id`: the thread's `pthread_t`.
    pub tstate_thread_id: u64,
    pub root: StackRoot,
    pub frame: StackFrame,
    /// Continuation slots per record, 1 ..= [`MAX_STACK_SLOTS`].
    pub slots: u8,
}

impl StackCapture {
    /// The offsets as displacements, or why they cannot be.
    fn check(&self, capacity: u64) -> Result<(), CodegenError> {
        let bad = |what: &str| Err(CodegenError::Stack(what.to_string()));
        if self.slots == 0 || self.slots > MAX_STACK_SLOTS {
            return bad("continuation slots out of range");
        }
        if u64::from(self.slots) >= capacity {
            return bad("the ring is too small for a stack record");
        }
        if !matches!(self.frame.position_size, 4 | 8) {
            return bad("position size is neither 4 nor 8");
        }
        let root = match self.root {
            StackRoot::Direct(o) => [o, 0],
            StackRoot::Indirect { pointer, field } => [pointer, field],
        };
        let offsets = [
            self.tstate_thread_id,
            self.frame.back,
            self.frame.code,
            self.frame.position,
            self.frame.owner.map_or(0, |o| o.0),
        ];
        if offsets.iter().chain(root.iter()).any(|&o| o > 1 << 20) {
            return bad("a structure offset is implausibly large");
        }
        if i32::try_from(!self.frame.code_tag_mask as i64).is_err() {
            return bad("code tag mask does not fit an immediate");
        }
        if matches!(self.current, CurrentThreadState::GilHolder(0)) {
            return bad("no address for the current thread state");
        }
        if self.frame.span() > 4096 {
            return bad("a frame's fields span more than a page");
        }
        if !page_probe_works() {
            return bad(
                "this kernel does not tell readable pages from others the way the walk \
                 checks frames (rt_sigprocmask with an invalid how)",
            );
        }
        Ok(())
    }
}

impl StackFrame {
    /// Bytes of a frame the walk reads: from its start to the end of its last field.
    fn span(&self) -> u64 {
        [
            self.back + 8,
            self.code + 8,
            self.position + u64::from(self.position_size),
            self.owner.map_or(0, |(o, _)| o + 1),
        ]
        .into_iter()
        .max()
        .unwrap_or(8)
    }
}

/// Lowest address a frame may have (`vm.mmap_min_addr` is 64 KiB by default).
const LOWEST_FRAME: i32 = 0x1_0000;
/// Frames above this are not user-space addresses on x86-64 (4-level paging; a
/// 5-level kernel maps user memory this high only when asked to).
const USER_TOP_SHIFT: u32 = 47;
const PAGE_MASK: i32 = -4096;

/// `rt_sigprocmask(how = -1, page, NULL, 8)`: EINVAL (readable) or EFAULT.
pub(crate) const PROBE_HOW: i32 = -1;

/// Whether this kernel answers the page probe as the walk expects: `EINVAL` for a
/// readable page, `EFAULT` for an unmapped or inaccessible one. Asked of pyprobe's
/// own process (the target runs on the same kernel); without it, no capture is
/// built.
pub(crate) fn page_probe_works() -> bool {
    static WORKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WORKS.get_or_init(|| {
        let probe = |addr: *const libc::c_void| {
            // SAFETY: with an invalid `how` the kernel only reads 8 bytes at `addr`
            // (or fails to) and changes nothing.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_rt_sigprocmask,
                    PROBE_HOW,
                    addr,
                    std::ptr::null_mut::<libc::c_void>(),
                    8usize,
                )
            };
            (r, std::io::Error::last_os_error().raw_os_error())
        };
        let readable = 0u64;
        let (r, e) = probe(std::ptr::addr_of!(readable).cast());
        if r != -1 || e != Some(libc::EINVAL) {
            return false;
        }
        // SAFETY: a fresh private page, inaccessible; unmapped after the probe.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return false;
        }
        let (r, e) = probe(page);
        // SAFETY: the page mapped above, used no more.
        unsafe { libc::munmap(page, 4096) };
        r == -1 && e == Some(libc::EFAULT)
    })
}

fn d(o: u64) -> i32 {
    // Checked by StackCapture::check.
    o as i32
}

/// Emits the capture. On entry r8 = the first slot, r10 = its index; the
/// continuation slots `r10 + 1 ..= r10 + slots` are reserved. Uses rax, rcx, rdx,
/// rsi, rdi, r9, r11; leaves r8 and r10.
pub(super) fn emit_capture(
    a: &mut CodeAssembler,
    c: &StackCapture,
    ring_addr: u64,
    capacity: u64,
) -> Result<(), CodegenError> {
    c.check(capacity)?;
    let mask = (capacity - 1) as u32;
    let slots_base = ring_addr.wrapping_add(HEADER_SIZE as u64);
    let cap = frames_for(c.slots) as u32;
    let shift = SLOT_SIZE.trailing_zeros();
    let mut walk = a.create_label();
    let mut room = a.create_label();
    let mut next_frame = a.create_label();
    let mut cut = a.create_label();
    let mut walked = a.create_label();
    let mut finish = a.create_label();

    let mut unreadable = a.create_label();
    let span = c.frame.span() as i32;

    // Two pages vouched for in this walk, below the saved registers; freed at `finish`.
    a.lea(rsp, ptr(rsp - 16))?;
    a.mov(qword_ptr(rsp), 0)?;
    a.mov(qword_ptr(rsp + 8), 0)?;
    let meta = u32::from(c.slots) | u32::from(STACK_CAPTURED) << 8;
    a.mov(dword_ptr(r8 + S_STACK_SLOTS as i32), meta)?;
    // This thread's own thread state, if its thread_id is this thread's pthread_self().
    match c.current {
        CurrentThreadState::ThreadLocal(offset) => {
            a.mov(rsi, qword_ptr(i64::from(offset) as u64).fs())?
        }
        CurrentThreadState::GilHolder(address) => {
            a.mov(rsi, address)?;
            a.mov(rsi, qword_ptr(rsi))?;
        }
    }
    a.test(rsi, rsi)?;
    a.jz(finish)?;
    a.mov(rdx, qword_ptr(0u64).fs())?;
    a.cmp(qword_ptr(rsi + d(c.tstate_thread_id)), rdx)?;
    a.jne(finish)?;
    a.or(byte_ptr(r8 + S_STACK_FLAGS as i32), u32::from(STACK_FOUND))?;
    match c.root {
        StackRoot::Direct(o) => a.mov(rsi, qword_ptr(rsi + d(o)))?,
        StackRoot::Indirect { pointer, field } => {
            a.mov(rsi, qword_ptr(rsi + d(pointer)))?;
            a.test(rsi, rsi)?;
            a.jz(finish)?;
            a.mov(rsi, qword_ptr(rsi + d(field)))?;
        }
    }
    // The innermost frame is the one the interpreter runs: its pages are vouched for.
    a.mov(rax, rsi)?;
    a.and(rax, PAGE_MASK)?;
    a.mov(qword_ptr(rsp), rax)?;
    a.lea(rax, ptr(rsi + (span - 1)))?;
    a.and(rax, PAGE_MASK)?;
    a.mov(qword_ptr(rsp + 8), rax)?;
    // rsi = frame, edx = frames written, ecx = walk budget, r9 = continuation slot
    // index, rdi = where the next pair goes, r11d = pairs left in that slot.
    a.xor(edx, edx)?;
    a.mov(r9, r10)?;
    a.xor(r11d, r11d)?;
    a.xor(edi, edi)?;
    a.mov(ecx, MAX_WALK)?;
    a.set_label(&mut walk)?;
    a.test(rsi, rsi)?;
    a.jz(walked)?;
    a.dec(ecx)?;
    a.jz(cut)?;
    // A frame only where one can be: aligned, in user space, on readable pages.
    a.test(sil, 7)?;
    a.jnz(unreadable)?;
    a.mov(rax, rsi)?;
    a.shr(rax, USER_TOP_SHIFT)?;
    a.jnz(unreadable)?;
    a.cmp(rsi, LOWEST_FRAME)?;
    a.jb(unreadable)?;
    a.mov(rax, rsi)?;
    a.and(rax, PAGE_MASK)?;
    emit_page_check(a, unreadable)?;
    a.lea(rax, ptr(rsi + (span - 1)))?;
    a.and(rax, PAGE_MASK)?;
    emit_page_check(a, unreadable)?;
    if let Some((owner, first_shim)) = c.frame.owner {
        a.movzx(eax, byte_ptr(rsi + d(owner)))?;
        a.cmp(eax, u32::from(first_shim))?;
        a.jae(next_frame)?;
    }
    a.mov(rax, qword_ptr(rsi + d(c.frame.code)))?;
    a.test(rax, rax)?;
    a.jz(next_frame)?;
    // A frame past the slots' room: the stack is deeper than the record carries.
    a.cmp(edx, cap)?;
    a.jae(cut)?;
    a.test(r11d, r11d)?;
    a.jnz(room)?;
    a.inc(r9)?;
    a.mov(eax, r9d)?;
    a.and(eax, mask)?;
    a.shl(rax, shift)?;
    a.mov(rdi, slots_base + C_PAIRS as u64)?;
    a.add(rdi, rax)?;
    a.mov(r11d, PAIRS_PER_SLOT as u32)?;
    a.set_label(&mut room)?;
    a.mov(rax, qword_ptr(rsi + d(c.frame.code)))?;
    if c.frame.code_tag_mask != 0 {
        a.and(rax, !c.frame.code_tag_mask as i64 as i32)?;
    }
    a.mov(qword_ptr(rdi), rax)?;
    if c.frame.position_size == 4 {
        a.movsxd(rax, dword_ptr(rsi + d(c.frame.position)))?;
    } else {
        a.mov(rax, qword_ptr(rsi + d(c.frame.position)))?;
    }
    a.mov(qword_ptr(rdi + 8), rax)?;
    a.add(rdi, 16)?;
    a.dec(r11d)?;
    a.inc(edx)?;
    a.set_label(&mut next_frame)?;
    a.mov(rsi, qword_ptr(rsi + d(c.frame.back)))?;
    a.jmp(walk)?;
    a.set_label(&mut unreadable)?;
    a.or(
        byte_ptr(r8 + S_STACK_FLAGS as i32),
        u32::from(STACK_UNREADABLE),
    )?;
    a.set_label(&mut cut)?;
    a.or(
        byte_ptr(r8 + S_STACK_FLAGS as i32),
        u32::from(STACK_TRUNCATED),
    )?;
    a.set_label(&mut walked)?;
    a.mov(word_ptr(r8 + S_STACK_DEPTH as i32), dx)?;

    // Every continuation slot gets its owner and seq, used or not, before the
    // first slot is published.
    a.set_label(&mut finish)?;
    a.lea(rsp, ptr(rsp + 16))?;
    for k in 1..=u32::from(c.slots) {
        a.lea(rax, ptr(r10 + k as i32))?;
        a.mov(edi, eax)?;
        a.and(edi, mask)?;
        a.shl(rdi, shift)?;
        a.mov(rcx, slots_base)?;
        a.add(rdi, rcx)?;
        a.mov(qword_ptr(rdi + C_OWNER as i32), r10)?;
        a.inc(rax)?;
        a.bts(rax, 63)?;
        a.mov(qword_ptr(rdi), rax)?;
    }
    Ok(())
}

/// With rax = a page address and the walk's two vouched-for pages at `[rsp]` and
/// `[rsp + 8]`: falls through if the page is one of them or the kernel reads 8
/// bytes of it (it becomes `[rsp]`, the older one `[rsp + 8]`), else jumps to
/// `unreadable`. Changes rax and flags only (the system call's registers are saved).
fn emit_page_check(a: &mut CodeAssembler, unreadable: CodeLabel) -> Result<(), CodegenError> {
    let mut vouched = a.create_label();
    a.cmp(rax, qword_ptr(rsp))?;
    a.je(vouched)?;
    a.cmp(rax, qword_ptr(rsp + 8))?;
    a.je(vouched)?;
    a.push(rax)?;
    for r in [rcx, rdx, rsi, rdi, r10, r11] {
        a.push(r)?;
    }
    a.mov(rsi, rax)?;
    a.mov(edi, PROBE_HOW as u32)?;
    a.xor(edx, edx)?;
    a.mov(r10d, 8)?;
    a.mov(eax, libc::SYS_rt_sigprocmask as u32)?;
    a.syscall()?;
    for r in [r11, r10, rdi, rsi, rdx, rcx] {
        a.pop(r)?;
    }
    a.cmp(rax, -libc::EINVAL)?;
    a.pop(rax)?; // the page; pop keeps the flags
    a.jne(unreadable)?;
    a.xchg(qword_ptr(rsp), rax)?;
    a.mov(qword_ptr(rsp + 8), rax)?;
    a.set_label(&mut vouched)?;
    Ok(())
}
