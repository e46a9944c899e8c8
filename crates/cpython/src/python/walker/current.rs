//! Where a thread finds its own `PyThreadState`, for code running inside the target
//! (the ring's trampolines): learnt from the interpreter's own accessor.
//!
//! CPython exports a one-instruction function that returns the current thread
//! state: `PyThreadState_GetUnchecked` (3.13+) or `_PyThreadState_UncheckedGet`
//! (3.7 – 3.12). Its instruction says where the pointer lives:
//! * `mov rax, fs:[d]`: a thread-local of the executable (`_Py_tss_tstate`, 3.12+),
//!   each thread's own: always the calling thread's live state;
//! * `mov rax, [rip + d]`: a global (`_PyRuntime.gilstate.tstate_current`, up to
//!   3.11), the state of the thread holding the GIL. GC, import and audit probes
//!   fire with the GIL held, so it is the calling thread's; the trampoline still
//!   checks its `thread_id` against `pthread_self()` before walking anything.
//!
//! Nothing else is accepted: a shared `libpython` reaches its thread-locals through
//! `__tls_get_addr`, which a trampoline cannot call; the ring then does without
//! stacks and says why. The bytes come from the target and are checked like any
//! other: the offset must lie in the executable's static TLS block, the global in
//! one of the object's writable segments.

use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};

use pyprobe_sdt::process::objects::LoadedObject;
use pyprobe_sdt::ring::CurrentThreadState;
use pyprobe_sdt::sdt::MemoryReader;

/// The accessors, newest name first.
const ACCESSORS: [&str; 2] = ["PyThreadState_GetUnchecked", "_PyThreadState_UncheckedGet"];

/// Bytes read at the accessor: `endbr64`, one `mov`, `ret`.
const CODE_BYTES: usize = 24;

/// The location the accessor at `code` (linked at `ip`) reads, unchecked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Accessor {
    /// `mov rax, fs:[offset]`.
    ThreadLocal(i64),
    /// `mov rax, [address]` (RIP-relative, resolved against `ip`).
    Global(u64),
}

/// Decodes `[endbr64] mov rax, <memory>; ret` at `ip`.
pub(crate) fn decode_accessor(code: &[u8], ip: u64) -> Result<Accessor, String> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut next = || -> Result<Instruction, String> {
        if !decoder.can_decode() {
            return Err("the accessor ends before its `ret`".into());
        }
        let insn = decoder.decode();
        if insn.is_invalid() {
            return Err(format!("undecodable instruction at {:#x}", insn.ip()));
        }
        Ok(insn)
    };
    let mut load = next()?;
    if load.code() == Code::Endbr64 {
        load = next()?;
    }
    if next()?.mnemonic() != Mnemonic::Ret {
        return Err("the accessor is not a single load then `ret`".into());
    }
    let loads_rax = load.mnemonic() == Mnemonic::Mov
        && load.op0_kind() == OpKind::Register
        && load.op0_register() == Register::RAX
        && load.op1_kind() == OpKind::Memory
        && load.memory_index() == Register::None;
    if !loads_rax {
        return Err(format!(
            "the accessor does `{:?}`, not a load into rax",
            load.code()
        ));
    }
    match (load.segment_prefix(), load.memory_base()) {
        (Register::FS, Register::None) => {
            Ok(Accessor::ThreadLocal(load.memory_displacement64() as i64))
        }
        (Register::None, Register::RIP) => Ok(Accessor::Global(load.ip_rel_memory_address())),
        _ => Err(format!(
            "the accessor does `{:?}`: neither a thread-local of the executable nor a global",
            load.code()
        )),
    }
}

/// Where `object`'s threads find their own thread state, checked against the object.
pub(crate) fn current_thread_state(
    object: &LoadedObject,
    mem: &impl MemoryReader,
) -> Result<CurrentThreadState, String> {
    let (name, link) = ACCESSORS
        .iter()
        .find_map(|n| object.elf.symbols.address(n).map(|a| (*n, a)))
        .ok_or_else(|| {
            format!(
                "{} exports no thread-state accessor ({})",
                object.target_path,
                ACCESSORS.join(", ")
            )
        })?;
    let at = object.runtime(link);
    let mut code = [0u8; CODE_BYTES];
    mem.read_exact(at, &mut code)
        .map_err(|e| format!("cannot read {name} at {at:#x}: {e}"))?;
    let accessor = decode_accessor(&code, at).map_err(|e| format!("{name} at {at:#x}: {e}"))?;
    check(object, accessor).map_err(|e| format!("{name} at {at:#x}: {e}"))
}

fn check(object: &LoadedObject, accessor: Accessor) -> Result<CurrentThreadState, String> {
    match accessor {
        Accessor::ThreadLocal(offset) => {
            let size = object.elf.executable_tls_size.ok_or_else(|| {
                "reads a thread-local, but the object is not an executable with static TLS"
                    .to_string()
            })?;
            let in_block = offset <= -8 && offset.unsigned_abs() <= size;
            match i32::try_from(offset) {
                Ok(o) if in_block => Ok(CurrentThreadState::ThreadLocal(o)),
                _ => Err(format!(
                    "reads %fs:{offset:#x}, outside the executable's TLS block of {size} bytes"
                )),
            }
        }
        Accessor::Global(address) => {
            let link = address.wrapping_sub(object.bias);
            let writable = object
                .elf
                .segments
                .iter()
                .any(|s| s.writable && s.contains_vaddr(link) && link - s.vaddr <= s.memsz - 8);
            if writable {
                Ok(CurrentThreadState::GilHolder(address))
            } else {
                Err(format!(
                    "reads {address:#x}, outside the object's writable segments"
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessors_as_cpython_builds_them_are_decoded() {
        // 3.13: endbr64; mov rax, fs:[-0x18]; ret
        let tls = [
            0xf3, 0x0f, 0x1e, 0xfa, 0x64, 0x48, 0x8b, 0x04, 0x25, 0xe8, 0xff, 0xff, 0xff, 0xc3,
        ];
        assert_eq!(
            decode_accessor(&tls, 0x682510),
            Ok(Accessor::ThreadLocal(-0x18))
        );
        // 3.9: mov rax, [rip + 0x33cb41]; ret
        let global = [0x48, 0x8b, 0x05, 0x41, 0xcb, 0x33, 0x00, 0xc3];
        assert_eq!(
            decode_accessor(&global, 0x5fdab0),
            Ok(Accessor::Global(0x93a5f8))
        );
    }

    #[test]
    fn anything_else_is_refused() {
        let cases: [&[u8]; 5] = [
            // mov rax, [rip + d]; then more code instead of ret
            &[0x48, 0x8b, 0x05, 0x41, 0xcb, 0x33, 0x00, 0x48, 0x85, 0xc0],
            // mov rax, fs:[rax] (initial-exec through a register)
            &[0x64, 0x48, 0x8b, 0x00, 0xc3],
            // mov rcx, [rip + d]; ret
            &[0x48, 0x8b, 0x0d, 0x41, 0xcb, 0x33, 0x00, 0xc3],
            // call __tls_get_addr
            &[0xe8, 0x00, 0x00, 0x00, 0x00, 0xc3],
            // cut short
            &[0x48, 0x8b, 0x05, 0x41],
        ];
        for code in cases {
            assert!(decode_accessor(code, 0x1000).is_err(), "{code:x?}");
        }
    }
}
