//! The SIGTRAP net: a signal handler pyprobe puts in the target while it has
//! `int3`s there, so that neither the kernel nor pyprobe's death changes what the
//! program's own SIGTRAPs do.
//!
//! Why a handler at all: if pyprobe dies (SIGKILL), the kernel detaches the target
//! with the `int3`s in place, and a thread that reaches one before the guardian
//! restores it gets a SIGTRAP; at its default that kills the target. And while the
//! program ignores SIGTRAP, every `int3` the kernel reports is a forced signal, which
//! resets an ignored SIGTRAP to its default for good.
//!
//! So the page's handler tells pyprobe's traps from the program's: a trap is
//! pyprobe's when it comes from an `int3` (`si_code == SI_KERNEL`) whose address is
//! one of the sites in the page's table; it then returns, and the thread goes on past
//! the `nop` the `int3` replaced. Any other SIGTRAP gets what the program asked for,
//! as recorded in the page: its handler (a tail call with the same arguments, after
//! the reset to the default if it asked for `SA_RESETHAND`), nothing (ignored), or
//! the default action (the disposition goes back to the default and the signal is
//! raised again, so the program dies of it as it would have).
//!
//! Page layout (one page, built for the address it is mapped at):
//!
//! ```text
//! 0x000  handler code
//! 0x3f0  restorer: mov eax, 15 (rt_sigreturn); syscall
//! 0x400  MAGIC (16 bytes), VERSION (u32), padding
//! 0x420  the program's own sigaction (kernel layout: handler, flags, restorer, mask)
//! 0x440  a default sigaction (all zero)
//! 0x460  number of sites (u64), then the site addresses (u64 each)
//! ```

use iced_x86::code_asm::*;
use iced_x86::IcedError;
use thiserror::Error;

#[derive(Debug, Error)]
pub(crate) enum TrapNetError {
    #[error("assembling the SIGTRAP handler: {0}")]
    Assemble(#[from] IcedError),
    #[error("the SIGTRAP handler ({0} bytes) does not fit before its restorer")]
    TooLarge(usize),
}

pub const PAGE_SIZE: usize = crate::process::PAGE_SIZE as usize;
pub(crate) const RESTORER_OFF: usize = 0x3f0;
pub(crate) const DATA_OFF: usize = 0x400;
pub(crate) const MAGIC: &[u8; 16] = b"pyprobe-trapnet\0";
pub(crate) const VERSION: u32 = 1;
const ORIGINAL_OFF: usize = DATA_OFF + 0x20;
const DEFAULT_OFF: usize = DATA_OFF + 0x40;
const COUNT_OFF: usize = DATA_OFF + 0x60;
const SITES_OFF: usize = COUNT_OFF + 8;
/// Sites the table holds.
pub(crate) const MAX_SITES: usize = (PAGE_SIZE - SITES_OFF) / 8;

const SIGTRAP: u32 = libc::SIGTRAP as u32;
const SI_KERNEL: u32 = libc::SI_KERNEL as u32;
/// `uc_mcontext.gregs[REG_RIP]` in the x86-64 `ucontext_t`.
const UC_RIP: i32 = 168;
const SIG_IGN: u64 = 1;
pub(crate) const SA_SIGINFO: u64 = 0x4;
pub(crate) const SA_ONSTACK: u64 = 0x0800_0000;
pub(crate) const SA_RESTART: u64 = 0x1000_0000;
pub(crate) const SA_NODEFER: u64 = 0x4000_0000;
pub const SA_RESETHAND: u64 = 0x8000_0000;
pub(crate) const SA_RESTORER: u64 = 0x0400_0000;

/// A `struct sigaction` as the kernel's `rt_sigaction` reads and writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct KernelSigaction {
    pub(crate) handler: u64,
    pub(crate) flags: u64,
    pub(crate) restorer: u64,
    pub mask: u64,
}

impl KernelSigaction {
    pub(crate) const BYTES: usize = 32;

    pub(crate) fn to_bytes(self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (i, v) in [self.handler, self.flags, self.restorer, self.mask]
            .iter()
            .enumerate()
        {
            out[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    pub(crate) fn from_bytes(bytes: &[u8; 32]) -> KernelSigaction {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        KernelSigaction {
            handler: word(0),
            flags: word(1),
            restorer: word(2),
            mask: word(3),
        }
    }

    pub(crate) fn is_handler(&self) -> bool {
        self.handler > SIG_IGN
    }
}

/// The page for address `page`: the program's own disposition `original` and
/// pyprobe's `sites` (the first [`MAX_SITES`]).
pub(crate) fn build_page(
    page: u64,
    original: KernelSigaction,
    sites: &[u64],
) -> Result<Vec<u8>, TrapNetError> {
    let code = handler_code(page)?;
    if code.len() > RESTORER_OFF {
        return Err(TrapNetError::TooLarge(code.len()));
    }
    let mut out = vec![0xccu8; PAGE_SIZE];
    out[..code.len()].copy_from_slice(&code);
    // mov eax, 15; syscall
    out[RESTORER_OFF..RESTORER_OFF + 7].copy_from_slice(&[0xb8, 0x0f, 0, 0, 0, 0x0f, 0x05]);
    out[DATA_OFF..].fill(0);
    out[DATA_OFF..DATA_OFF + 16].copy_from_slice(MAGIC);
    out[DATA_OFF + 16..DATA_OFF + 20].copy_from_slice(&VERSION.to_le_bytes());
    out[ORIGINAL_OFF..ORIGINAL_OFF + 32].copy_from_slice(&original.to_bytes());
    let n = sites.len().min(MAX_SITES);
    out[COUNT_OFF..COUNT_OFF + 8].copy_from_slice(&(n as u64).to_le_bytes());
    for (i, s) in sites.iter().take(n).enumerate() {
        out[SITES_OFF + i * 8..SITES_OFF + i * 8 + 8].copy_from_slice(&s.to_le_bytes());
    }
    Ok(out)
}

/// The sigaction that makes the page at `page` the SIGTRAP handler, standing in
/// for `original`: its flags that shape delivery (alternate stack, restart, no
/// deferral) and its mask are kept, so its handler runs as it asked to.
pub(crate) fn net_action(page: u64, original: KernelSigaction) -> KernelSigaction {
    let own_handler = original.is_handler();
    let kept = if own_handler {
        original.flags & (SA_ONSTACK | SA_RESTART | SA_NODEFER)
    } else {
        SA_RESTART
    };
    let restorer = if own_handler && original.flags & SA_RESTORER != 0 {
        original.restorer
    } else {
        page + RESTORER_OFF as u64
    };
    KernelSigaction {
        handler: page,
        flags: SA_SIGINFO | SA_RESTORER | kept,
        restorer,
        mask: if own_handler { original.mask } else { 0 },
    }
}

/// Reads a page built by [`build_page`]: its recorded original disposition, or
/// `None` when `bytes` is not such a page.
pub(crate) fn parse_page(bytes: &[u8]) -> Option<KernelSigaction> {
    if bytes.len() < PAGE_SIZE || &bytes[DATA_OFF..DATA_OFF + 16] != MAGIC {
        return None;
    }
    let version = u32::from_le_bytes(bytes[DATA_OFF + 16..DATA_OFF + 20].try_into().ok()?);
    if version != VERSION {
        return None;
    }
    let original: &[u8; 32] = bytes[ORIGINAL_OFF..ORIGINAL_OFF + 32].try_into().ok()?;
    Some(KernelSigaction::from_bytes(original))
}

fn handler_code(page: u64) -> Result<Vec<u8>, IcedError> {
    let data = page + DATA_OFF as u64;
    let mut a = CodeAssembler::new(64)?;
    let mut not_ours = a.create_label();
    let mut next = a.create_label();
    let mut scan = a.create_label();
    let mut done = a.create_label();
    let mut default = a.create_label();
    let mut tail = a.create_label();

    // rdi = signal, rsi = siginfo, rdx = ucontext. Everything may be clobbered:
    // rt_sigreturn restores the interrupted registers from the frame.
    a.cmp(dword_ptr(rsi + 8), SI_KERNEL)?;
    a.jne(not_ours)?;
    a.mov(rax, qword_ptr(rdx + UC_RIP))?;
    a.dec(rax)?;
    a.mov(rcx, data)?;
    a.mov(r8, qword_ptr(rcx + (COUNT_OFF - DATA_OFF) as i32))?;
    a.mov(r9, MAX_SITES as u64)?;
    a.cmp(r8, r9)?;
    a.cmova(r8, r9)?;
    a.xor(r9, r9)?;
    a.set_label(&mut scan)?;
    a.cmp(r9, r8)?;
    a.jae(not_ours)?;
    a.cmp(rax, qword_ptr(rcx + r9 * 8 + (SITES_OFF - DATA_OFF) as i32))?;
    a.je(done)?;
    a.set_label(&mut next)?;
    a.inc(r9)?;
    a.jmp(scan)?;
    a.set_label(&mut done)?;
    a.ret()?;

    // The program's own SIGTRAP.
    a.set_label(&mut not_ours)?;
    a.mov(rcx, data)?;
    a.mov(rax, qword_ptr(rcx + (ORIGINAL_OFF - DATA_OFF) as i32))?;
    a.cmp(rax, SIG_IGN as i32)?;
    a.je(done)?;
    a.test(rax, rax)?;
    a.je(default)?;
    a.mov(r8, qword_ptr(rcx + (ORIGINAL_OFF - DATA_OFF + 8) as i32))?;
    a.bt(r8, 31)?; // SA_RESETHAND
    a.jae(tail)?;
    a.push(rdi)?;
    a.push(rsi)?;
    a.push(rdx)?;
    reset_to_default(&mut a, data)?;
    a.pop(rdx)?;
    a.pop(rsi)?;
    a.pop(rdi)?;
    a.mov(rcx, data)?;
    a.mov(rax, qword_ptr(rcx + (ORIGINAL_OFF - DATA_OFF) as i32))?;
    a.set_label(&mut tail)?;
    a.jmp(rax)?;

    // Default action: back to SIG_DFL, raise it again; it is delivered when the
    // handler returns (SIGTRAP is blocked in it) and ends the process.
    a.set_label(&mut default)?;
    reset_to_default(&mut a, data)?;
    a.mov(eax, libc::SYS_getpid as u32)?;
    a.syscall()?;
    a.mov(r12, rax)?;
    a.mov(eax, libc::SYS_gettid as u32)?;
    a.syscall()?;
    a.mov(rsi, rax)?;
    a.mov(rdi, r12)?;
    a.mov(edx, SIGTRAP)?;
    a.mov(eax, libc::SYS_tgkill as u32)?;
    a.syscall()?;
    a.ret()?;
    a.assemble(page)
}

/// `rt_sigaction(SIGTRAP, &default, NULL, 8)`.
fn reset_to_default(a: &mut CodeAssembler, data: u64) -> Result<(), IcedError> {
    a.mov(edi, SIGTRAP)?;
    a.mov(rsi, data + (DEFAULT_OFF - DATA_OFF) as u64)?;
    a.xor(edx, edx)?;
    a.mov(r10d, 8u32)?;
    a.mov(eax, libc::SYS_rt_sigaction as u32)?;
    a.syscall()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Runs the page in a forked child of the test process: the child maps it at a
    //! fixed address, installs it the way pyprobe does, and reports by exit code.

    use super::*;

    const SIG_DFL: u64 = 0;

    fn page_addr() -> u64 {
        0x7e5a_0000_0000
    }

    /// In a child: map the page with `original` and the site list `sites`
    /// (relative to the code buffer, an executable mapping of `int3; ret` at +0
    /// and `nop; ret` elsewhere), run `body`, exit with what it returns.
    fn in_child(original: KernelSigaction, body: fn(u64) -> i32) -> i32 {
        // Everything that allocates happens before the fork (the test harness runs
        // other threads); the child only makes raw system calls and runs the code.
        // SAFETY: fresh private mappings, written before the fork.
        let (code, bytes) = unsafe {
            let code = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as *mut u8;
            assert_ne!(code as *mut libc::c_void, libc::MAP_FAILED);
            // +0: int3; ret (a site)   +16: int3; ret (not a site)
            *code = 0xcc;
            *code.add(1) = 0xc3;
            *code.add(16) = 0xcc;
            *code.add(17) = 0xc3;
            let bytes = build_page(page_addr(), original, &[code as u64]).unwrap();
            (code, bytes)
        };
        let orig = original.to_bytes();
        let net = net_action(page_addr(), original).to_bytes();
        // SAFETY: see above; the child ends with _exit.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0);
            if pid == 0 {
                let page = libc::mmap(
                    page_addr() as *mut libc::c_void,
                    PAGE_SIZE,
                    libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                ) as *mut u8;
                if page as u64 != page_addr() {
                    libc::_exit(90);
                }
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), page, PAGE_SIZE);
                if original.handler != SIG_DFL {
                    libc::syscall(libc::SYS_rt_sigaction, 5, orig.as_ptr(), 0, 8);
                }
                if libc::syscall(libc::SYS_rt_sigaction, 5, net.as_ptr(), 0, 8) != 0 {
                    libc::_exit(92);
                }
                libc::_exit(body(code as u64));
            }
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            libc::munmap(code as *mut libc::c_void, 4096);
            if libc::WIFSIGNALED(status) {
                -libc::WTERMSIG(status)
            } else {
                libc::WEXITSTATUS(status)
            }
        }
    }

    fn call(addr: u64) {
        // SAFETY: the child's code buffer holds `int3; ret` at these addresses.
        unsafe {
            let f: extern "C" fn() = std::mem::transmute(addr as usize);
            f();
        }
    }

    static mut HITS: i32 = 0;
    extern "C" fn count(_: i32) {
        // SAFETY: single-threaded child.
        unsafe { HITS += 1 };
    }

    #[test]
    fn its_own_trap_is_swallowed_whatever_the_program_set() {
        for original in [
            KernelSigaction::default(),
            KernelSigaction {
                handler: SIG_IGN,
                ..Default::default()
            },
            KernelSigaction {
                handler: count as *const () as usize as u64,
                ..Default::default()
            },
        ] {
            let code = in_child(original, |code| {
                call(code);
                call(code);
                // SAFETY: single-threaded child.
                unsafe { HITS }
            });
            assert_eq!(code, 0, "{original:?}: the program saw pyprobe's traps");
        }
    }

    #[test]
    fn the_programs_own_traps_get_its_own_disposition() {
        let handler = KernelSigaction {
            handler: count as *const () as usize as u64,
            ..Default::default()
        };
        // Its handler runs for its own raise and for an int3 that is not a site.
        let code = in_child(handler, |code| {
            // SAFETY: raising a signal the child handles.
            unsafe { libc::raise(5) };
            call(code + 16);
            call(code);
            // SAFETY: single-threaded child.
            unsafe { HITS }
        });
        assert_eq!(code, 2);
        // Ignored: survives its own raise.
        let ignored = KernelSigaction {
            handler: SIG_IGN,
            ..Default::default()
        };
        assert_eq!(
            in_child(ignored, |_| {
                // SAFETY: raising an ignored signal.
                unsafe { libc::raise(5) };
                7
            }),
            7
        );
        // Default: dies of its own SIGTRAP, as without the net.
        assert_eq!(
            in_child(KernelSigaction::default(), |_| {
                // SAFETY: raising SIGTRAP at its default.
                unsafe { libc::raise(5) };
                7
            }),
            -5
        );
        // SA_RESETHAND: the first one runs the handler, the second kills.
        let once = KernelSigaction {
            handler: count as *const () as usize as u64,
            flags: SA_RESETHAND,
            ..Default::default()
        };
        assert_eq!(
            in_child(once, |_| {
                // SAFETY: raising SIGTRAP, handled once.
                unsafe { libc::raise(5) };
                // SAFETY: single-threaded child.
                if unsafe { HITS } != 1 {
                    return 3;
                }
                // SAFETY: now at its default.
                unsafe { libc::raise(5) };
                7
            }),
            -5
        );
    }

    #[test]
    fn a_page_reads_back_and_garbage_does_not() {
        let original = KernelSigaction {
            handler: 0x1234,
            flags: SA_SIGINFO | SA_RESTORER,
            restorer: 0x5678,
            mask: 1 << 4,
        };
        let page = build_page(page_addr(), original, &[1, 2, 3]).unwrap();
        assert_eq!(parse_page(&page), Some(original));
        assert_eq!(parse_page(&page[..100]), None);
        assert_eq!(parse_page(&vec![0u8; PAGE_SIZE]), None);
        let mut other = page.clone();
        other[DATA_OFF + 16] = 9;
        assert_eq!(parse_page(&other), None);
    }

    #[test]
    fn the_net_keeps_the_programs_delivery_flags_and_restorer() {
        let original = KernelSigaction {
            handler: 0x1234,
            flags: SA_SIGINFO | SA_RESTORER | SA_ONSTACK | SA_RESETHAND,
            restorer: 0x5678,
            mask: 1 << 9,
        };
        let net = net_action(page_addr(), original);
        assert_eq!(net.handler, page_addr());
        assert_eq!(net.restorer, 0x5678);
        assert_eq!(net.mask, 1 << 9);
        assert_eq!(net.flags & SA_ONSTACK, SA_ONSTACK);
        // Reset is emulated by the handler, never by the kernel: the net must stay.
        assert_eq!(net.flags & SA_RESETHAND, 0);
        let default = net_action(page_addr(), KernelSigaction::default());
        assert_eq!(default.restorer, page_addr() + RESTORER_OFF as u64);
    }
}
