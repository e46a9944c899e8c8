//! Native stacks (`--native`): a stopped thread's C, C++ and Rust frames, unwound
//! from outside and joined with its Python stack.
//!
//! Unwinding is `framehop`'s: DWARF CFI from each mapped object's `.eh_frame_hdr`
//! and `.eh_frame`, read from the object files of `/proc/PID/maps` (through
//! `/proc/PID/map_files`), with prologue and epilogue analysis of `.text` and frame
//! pointers where there is no CFI. It is pure Rust and reads the stack through a
//! callback, so every read is ours to bound; libunwind (py-spy's choice) would need
//! its C library and its own remote-access glue for the same.
//!
//! Names come from each object's `.symtab` and `.dynsym` (`symbols.rs`); `merge.rs`
//! joins the two stacks at the interpreter's eval-loop calls.
//!
//! Tracee safety: this module makes no ptrace request and writes nothing; it is
//! given the registers of a thread the engine holds stopped. Stack memory is read
//! with `process_vm_readv`, a page at a time, at most [`MAX_STACK_PAGES`] pages and
//! [`MAX_DEPTH`] frames per unwind; anything unreadable ends the unwind, which is
//! then marked incomplete, never a panic.

pub(crate) mod eval_parts;
pub(crate) mod merge;
pub(crate) mod object_file;
pub(crate) mod symbols;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use anyhow::{Context, Result};
use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{FrameAddress, Module, Unwinder};

use pyprobe_sdt::process::maps::{maps_len, read_maps, MapEntry};
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::process::objects::mapped_files;

pub use merge::{join, EvalCalls, Joined, NativeKind, NotJoined};
use object_file::{ObjectFile, Section};

/// Deepest native stack unwound: deeper frames are left out (the unwind is
/// incomplete, and joined from its innermost frame).
pub(crate) const MAX_DEPTH: usize = 256;
/// Most 4 KiB pages of the target's memory one unwind reads (2 MiB of stack: a
/// recursive sort with AVX-512 spills has frames of kilobytes).
pub(crate) const MAX_STACK_PAGES: usize = 512;
/// The function whose calls run Python frames, in every CPython 3.7 – 3.15.
pub(crate) const EVAL_FUNCTION: &str = "_PyEval_EvalFrameDefault";
/// How often the mappings are checked for change (a library loaded since).
const REFRESH_NS: u64 = 20_000_000;
/// Largest vDSO read (they are two to four pages).
const MAX_VDSO_BYTES: u64 = 1 << 16;

/// One thread's native stack, innermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NativeStack {
    pub frames: Vec<NativeKind>,
    /// The unwind reached the stack's root; else it stopped at an unreadable or
    /// unknown frame, or at [`MAX_DEPTH`].
    pub complete: bool,
}

/// One mapped object's code range and what is known of it.
struct Mapped {
    code: Range<u64>,
    bias: u64,
    path: Arc<str>,
    object: Arc<ObjectFile>,
    /// The interpreter's object: its frames are left out, its eval calls joined.
    interpreter: bool,
}

/// The object whose code holds `address`, of `mapped` (sorted by start).
fn mapped_in(mapped: &[Mapped], address: u64) -> Option<&Mapped> {
    let i = mapped.partition_point(|m| m.code.start <= address);
    mapped
        .get(i.checked_sub(1)?)
        .filter(|m| address < m.code.end)
}

/// Unwinds the threads of one process.
pub struct NativeUnwinder {
    pid: i32,
    mem: ProcessMemory,
    /// The interpreter's object file, as the target's maps name it.
    interpreter_path: String,
    unwinder: UnwinderX86_64<Section>,
    cache: Box<CacheX86_64>,
    mapped: Vec<Mapped>,
    /// Object files read so far, by (device, inode): read once per process.
    files: HashMap<((u32, u32), u64), Arc<ObjectFile>>,
    /// Eval-loop functions, in runtime addresses.
    eval: Vec<Range<u64>>,
    /// The eval loop's parts in the interpreter's object, link-time: found once
    /// (its unwind table is read for them), kept across refreshes.
    eval_parts: Option<Vec<Range<u64>>>,
    maps_len: usize,
    /// When the mappings' size was last compared.
    checked_ns: u64,
    /// Objects whose unwind tables could not be read, with why (said once, `-v`).
    pub unreadable: Vec<String>,
}

impl NativeUnwinder {
    /// Reads the mappings of `pid` and the unwind tables of each object with code;
    /// `interpreter_path` is the object the frame walker found the runtime in.
    pub fn new(pid: i32, interpreter_path: &str) -> Result<NativeUnwinder> {
        let mut unwinder = NativeUnwinder {
            pid,
            mem: ProcessMemory::new(pid),
            interpreter_path: interpreter_path.to_owned(),
            unwinder: UnwinderX86_64::new(),
            cache: Box::new(CacheX86_64::new()),
            mapped: Vec::new(),
            files: HashMap::new(),
            eval: Vec::new(),
            eval_parts: None,
            maps_len: 0,
            checked_ns: 0,
            unreadable: Vec::new(),
        };
        unwinder.refresh()?;
        if unwinder.eval.is_empty() {
            anyhow::bail!(
                "pid {pid}: {interpreter_path} has no symbol {EVAL_FUNCTION}: native frames \
                 cannot be joined with the Python stack (is the interpreter stripped of its \
                 dynamic symbols?)"
            );
        }
        Ok(unwinder)
    }

    /// Reads the mappings again and the objects mapped since.
    fn refresh(&mut self) -> Result<()> {
        let pid = self.pid;
        let maps =
            read_maps(pid).with_context(|| format!("pid {pid}: cannot read its mappings"))?;
        self.maps_len = maps_len(pid);
        for module in self.mapped.drain(..) {
            self.unwinder.remove_module(module.code.start);
        }
        self.eval.clear();
        for entries in mapped_files(&maps) {
            let code: Vec<_> = entries.iter().filter(|e| e.executable).collect();
            let (Some(first), Some(last)) = (code.first(), code.last()) else {
                continue;
            };
            let range = first.start..last.end;
            let key = (entries[0].dev, entries[0].inode);
            let object = match self.files.get(&key) {
                Some(o) => o.clone(),
                None => match ObjectFile::open(pid, &entries) {
                    Ok(o) => {
                        let o = Arc::new(o);
                        self.files.insert(key, o.clone());
                        o
                    }
                    Err(e) => {
                        self.unreadable.push(format!("{e:#}"));
                        continue;
                    }
                },
            };
            let Some(bias) = object.bias(&entries) else {
                continue;
            };
            let path: Arc<str> = entries[0].path.as_str().into();
            let interpreter = *path == *self.interpreter_path;
            if interpreter {
                let parts = self
                    .eval_parts
                    .get_or_insert_with(|| eval_parts::function_parts(&object, EVAL_FUNCTION));
                for r in parts.iter() {
                    self.eval
                        .push(r.start.wrapping_add(bias)..r.end.wrapping_add(bias));
                }
            }
            self.unwinder.add_module(Module::new(
                path.to_string(),
                range.clone(),
                bias,
                object.sections.clone(),
            ));
            self.mapped.push(Mapped {
                code: range,
                bias,
                path,
                object,
                interpreter,
            });
        }
        if let Some(vdso) = maps.iter().find(|m| m.path == "[vdso]") {
            self.add_vdso(vdso);
        }
        self.mapped.sort_by_key(|m| m.code.start);
        Ok(())
    }

    /// The kernel's vDSO (`clock_gettime`, `gettimeofday`): an ELF image with no
    /// file, read from the target's memory (a few pages, capped).
    fn add_vdso(&mut self, vdso: &MapEntry) {
        let len = vdso.end.saturating_sub(vdso.start);
        if len == 0 || len > MAX_VDSO_BYTES {
            return;
        }
        let mut bytes = vec![0u8; len as usize];
        if self.mem.read(vdso.start, &mut bytes).is_err() {
            return;
        }
        let Ok(object) = ObjectFile::parse(bytes) else {
            return;
        };
        let Some(bias) = object.bias(&[vdso]) else {
            return;
        };
        let path: Arc<str> = "[vdso]".into();
        self.unwinder.add_module(Module::new(
            path.to_string(),
            vdso.start..vdso.end,
            bias,
            object.sections.clone(),
        ));
        self.mapped.push(Mapped {
            code: vdso.start..vdso.end,
            bias,
            path,
            object: Arc::new(object),
            interpreter: false,
        });
    }

    fn mapped_at(&self, address: u64) -> Option<&Mapped> {
        mapped_in(&self.mapped, address)
    }

    /// The native stack of a thread stopped with registers `regs`.
    pub fn stack(&mut self, regs: &libc::user_regs_struct) -> NativeStack {
        // Libraries come and go (dlopen maps one in several steps): the mappings
        // are looked at again every REFRESH_NS, and read again when they changed.
        let now = pyprobe_sdt::tracer::clock::monotonic_ns();
        if now.saturating_sub(self.checked_ns) > REFRESH_NS {
            self.checked_ns = now;
            if maps_len(self.pid) != self.maps_len {
                let _ = self.refresh();
            }
        }
        let (addresses, complete) = self.unwind(regs);
        self.name(&addresses, complete)
    }

    fn unwind(&mut self, regs: &libc::user_regs_struct) -> (Vec<FrameAddress>, bool) {
        let mut pages = StackPages::new(&self.mem);
        let mut read = |addr: u64| pages.read_u64(addr);
        let start = UnwindRegsX86_64::new(regs.rip, regs.rsp, regs.rbp);
        let mapped = &self.mapped;
        let mut frames = self
            .unwinder
            .iter_frames(regs.rip, start, &mut *self.cache, &mut read);
        let mut addresses = Vec::new();
        loop {
            if addresses.len() == MAX_DEPTH {
                return (addresses, false);
            }
            match frames.next() {
                // A return address outside every mapped object is an unwind gone
                // wrong (a stack word taken for one), not a frame.
                Ok(Some(a))
                    if !addresses.is_empty()
                        && mapped_in(mapped, a.address_for_lookup()).is_none() =>
                {
                    return (addresses, false)
                }
                Ok(Some(a)) => addresses.push(a),
                Ok(None) => return (addresses, true),
                Err(_) => return (addresses, false),
            }
        }
    }

    fn name(&self, addresses: &[FrameAddress], complete: bool) -> NativeStack {
        let frames = addresses
            .iter()
            .map(|a| {
                let address = a.address_for_lookup();
                let Some(m) = self.mapped_at(address) else {
                    return NativeKind::Other {
                        function: format!("{:#x}", a.address()).into(),
                        object: "?".into(),
                    };
                };
                if m.interpreter {
                    return if self.eval.iter().any(|r| r.contains(&address)) {
                        NativeKind::Eval
                    } else {
                        NativeKind::Interpreter
                    };
                }
                let svma = address.wrapping_sub(m.bias);
                let function = match m.object.symbols.lookup(svma) {
                    Some((name, _)) => name.into(),
                    None => {
                        // Stripped: named by where its function starts, so that
                        // its samples add up in one frame; else by the address.
                        let file = m.path.rsplit('/').next().unwrap_or(&m.path);
                        let at = m.object.function_start(svma).unwrap_or(svma);
                        format!("{file}+{at:#x}").into()
                    }
                };
                NativeKind::Other {
                    function,
                    object: m.path.clone(),
                }
            })
            .collect();
        NativeStack { frames, complete }
    }
}

/// Reads of the target's memory for one unwind, a page at a time and at most
/// [`MAX_STACK_PAGES`] pages: the few words an unwind reads per frame cost one
/// system call per page rather than one each.
struct StackPages<'m> {
    mem: &'m ProcessMemory,
    /// Each page read, by address; `None`: unreadable.
    pages: rustc_hash::FxHashMap<u64, Option<Box<[u8; 4096]>>>,
}

impl<'m> StackPages<'m> {
    fn new(mem: &'m ProcessMemory) -> Self {
        StackPages {
            mem,
            pages: Default::default(),
        }
    }

    fn read_u64(&mut self, addr: u64) -> Result<u64, ()> {
        if addr % 8 != 0 {
            // CFI only saves registers at aligned slots; a misaligned address is
            // a wrong rule or a corrupt stack.
            return Err(());
        }
        let base = addr & !4095;
        if !self.pages.contains_key(&base) && self.pages.len() >= MAX_STACK_PAGES {
            return Err(());
        }
        let mem = self.mem;
        let page = self.pages.entry(base).or_insert_with(|| {
            let mut buf = Box::new([0u8; 4096]);
            mem.read(base, &mut buf[..]).ok().map(|()| buf)
        });
        let offset = (addr - base) as usize;
        let bytes = page.as_ref().ok_or(())?.get(offset..offset + 8).ok_or(())?;
        Ok(u64::from_le_bytes(bytes.try_into().map_err(|_| ())?))
    }
}

/// The registers of thread `tid`, which the engine holds in a ptrace-stop (a
/// sampling tick's); `None` when it is not stopped for us (the kernel refuses).
/// Call it only on the engine's thread: ptrace requests belong to the thread that
/// attached.
pub fn registers(tid: i32) -> Option<libc::user_regs_struct> {
    nix::sys::ptrace::getregs(nix::unistd::Pid::from_raw(tid)).ok()
}
