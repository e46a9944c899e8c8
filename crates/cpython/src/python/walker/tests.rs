//! Unit tests of the walk against a fake target memory built with the real layouts:
//! the normal case, and a corrupt or hostile target (cycles, endless chains, huge
//! lengths, unreadable pointers, random bytes) that must never panic nor hang.

use std::io;
use std::time::{Duration, Instant};

use super::layout::{self, FrameLayout, FrameRoot, GilLayout, Layout};
use super::objects::MAX_CHARS;
use super::plausible_code_name;
use super::stacks::{Memory, RootShim, StackReader, MAX_DEPTH, MAX_THREADS};
use crate::python::version::PyVersion;
use pyprobe_sdt::sdt::MemoryReader;

const CODE_TYPE: u64 = 0x7700_0000;

/// A sparse memory image: regions with unmapped gaps between them.
#[derive(Default)]
struct Image {
    regions: Vec<(u64, Vec<u8>)>,
    next: u64,
}

impl MemoryReader for Image {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
        for (base, data) in &self.regions {
            let end = base + data.len() as u64;
            if address >= *base && address.saturating_add(buf.len() as u64) <= end {
                let at = (address - base) as usize;
                buf.copy_from_slice(&data[at..at + buf.len()]);
                return Ok(());
            }
        }
        Err(io::Error::new(io::ErrorKind::InvalidInput, "unmapped"))
    }
}

impl Memory for Image {}

impl Image {
    fn new() -> Image {
        Image {
            regions: Vec::new(),
            next: 0x10_0000,
        }
    }

    fn alloc(&mut self, size: u64) -> u64 {
        let at = self.next;
        self.next += size.div_ceil(16) * 16 + 64; // a gap: reading past an object fails
        self.regions.push((at, vec![0; size as usize]));
        at
    }

    fn put(&mut self, addr: u64, bytes: &[u8]) {
        for (base, data) in &mut self.regions {
            if addr >= *base && addr + bytes.len() as u64 <= *base + data.len() as u64 {
                let at = (addr - *base) as usize;
                data[at..at + bytes.len()].copy_from_slice(bytes);
                return;
            }
        }
        panic!("put outside the image at {addr:#x}");
    }

    fn u64(&mut self, addr: u64, v: u64) {
        self.put(addr, &v.to_le_bytes());
    }

    fn i32(&mut self, addr: u64, v: i32) {
        self.put(addr, &v.to_le_bytes());
    }

    fn str(&mut self, l: &Layout, s: &str) -> u64 {
        let u = &l.unicode;
        let chars: Vec<u32> = s.chars().map(u32::from).collect();
        let max = chars.iter().copied().max().unwrap_or(0);
        let (kind, ascii) = match max {
            0..=0x7f => (1u32, true),
            0x80..=0xff => (1, false),
            0x100..=0xffff => (2, false),
            _ => (4, false),
        };
        let data_at = if ascii { u.ascii_size } else { u.compact_size };
        let addr = self.alloc(data_at + (chars.len() as u64 + 1) * u64::from(kind));
        self.u64(addr + u.length, chars.len() as u64);
        let state =
            (kind << u.kind_shift) | (1 << u.compact_bit) | (u32::from(ascii) << u.ascii_bit);
        self.put(addr + u.state, &state.to_le_bytes());
        let data: Vec<u8> = chars
            .iter()
            .flat_map(|&c| c.to_le_bytes()[..kind as usize].to_vec())
            .collect();
        self.put(addr + data_at, &data);
        addr
    }

    fn bytes(&mut self, l: &Layout, data: &[u8]) -> u64 {
        let addr = self.alloc(l.bytes_ob_sval + data.len() as u64 + 1);
        self.u64(addr + l.bytes_ob_size, data.len() as u64);
        self.put(addr + l.bytes_ob_sval, data);
        addr
    }

    fn code(&mut self, l: &Layout, file: &str, name: &str, first_line: i32, table: &[u8]) -> u64 {
        let size = l.code_span().max(l.code_adaptive.unwrap_or(0) + 64);
        let addr = self.alloc(size);
        let (file, name, table) = (self.str(l, file), self.str(l, name), self.bytes(l, table));
        self.u64(addr + l.ob_type, CODE_TYPE);
        self.u64(addr + l.code_filename, file);
        self.u64(addr + l.code_name, name);
        if let Some(q) = l.code_qualname {
            self.u64(addr + q, name);
        }
        self.u64(addr + l.code_linetable, table);
        self.i32(addr + l.code_firstlineno, first_line);
        addr
    }

    /// A frame running `code` at code unit `unit` (byte offset 2*unit), linked to `back`.
    fn frame(&mut self, l: &Layout, code: u64, unit: i64, back: u64) -> u64 {
        let addr = self.alloc(l.frame_span());
        match l.frame {
            FrameLayout::Object {
                back: b,
                code: c,
                lasti,
                lasti_unit,
                executing: (at, runs),
            } => {
                self.u64(addr + b, back);
                self.u64(addr + c, code);
                self.put(addr + at, &[runs]);
                self.i32(addr + lasti, (unit * 2 / lasti_unit as i64) as i32);
            }
            FrameLayout::Interpreter {
                previous,
                executable,
                instr_ptr,
                ..
            } => {
                self.u64(addr + previous, back);
                self.u64(addr + executable, code);
                let start = code + l.code_adaptive.unwrap_or(0);
                self.u64(addr + instr_ptr, start.wrapping_add((unit * 2) as u64));
            }
        }
        addr
    }

    /// `_PyRuntime` → one interpreter → thread states (one per innermost frame).
    fn runtime(&mut self, l: &Layout, innermost: &[u64]) -> (u64, Vec<u64>) {
        let (current, ceval_gil) = match l.gil {
            Some(GilLayout::RuntimeCurrent { tstate_current }) => (tstate_current, 0),
            Some(GilLayout::Interpreter { ceval_gil, .. }) => (0, ceval_gil),
            None => (0, 0),
        };
        let runtime = self.alloc(l.runtime_interpreters_head.max(current) + 8);
        let interp = self.alloc(l.interp_next.max(l.interp_threads_head).max(ceval_gil) + 8);
        self.u64(runtime + l.runtime_interpreters_head, interp);
        // As CPython: each new thread state becomes the head of the list.
        let mut tstates = Vec::new();
        let mut head = 0;
        for (i, &frame) in innermost.iter().enumerate() {
            let t = self.alloc(l.tstate_span());
            self.u64(t + l.tstate_next, head);
            self.u64(t + l.tstate_thread_id, 0x7f00_0000_0000 + i as u64);
            if let Some(n) = l.tstate_native_thread_id {
                self.i32(t + n, 1000 + i as i32);
            }
            match l.tstate_frame {
                FrameRoot::Direct(o) => self.u64(t + o, frame),
                FrameRoot::CFrame {
                    cframe,
                    current_frame,
                } => {
                    let cf = self.alloc(current_frame + 8);
                    self.u64(cf + current_frame, frame);
                    self.u64(t + cframe, cf);
                }
            }
            head = t;
            tstates.push(t);
        }
        self.u64(interp + l.interp_threads_head, head);
        (runtime, tstates)
    }
}

fn v(minor: u8) -> PyVersion {
    PyVersion {
        major: 3,
        minor,
        micro: None,
    }
}

/// A location table (3.11+) of "no columns" entries: (code units, line delta).
fn locations(entries: &[(u8, i64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(units, delta) in entries {
        out.push(0x80 | (13 << 3) | (units - 1));
        let mut u = if delta < 0 {
            ((-delta) << 1) | 1
        } else {
            delta << 1
        } as u64;
        loop {
            let chunk = (u & 63) as u8;
            u >>= 6;
            if u == 0 {
                out.push(chunk);
                break;
            }
            out.push(chunk | 64);
        }
    }
    out
}

/// A three-deep stack in one thread and a one-deep one in another.
fn sample_image(minor: u8) -> (Image, Layout, u64) {
    let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
    let mut img = Image::new();
    let table = match layout.line_table {
        layout::LineTable::Locations => locations(&[(2, 1), (2, 1), (4, 3)]),
        layout::LineTable::Lnotab => vec![0, 1, 4, 1, 4, 3],
        layout::LineTable::Linetable310 => vec![4, 1, 4, 1, 8, 3],
    };
    // Lines: units 0-1 → first+1, units 2-3 → first+2, units 4-7 → first+5.
    let module = img.code(&layout, "/app/main.py", "<module>", 1, &table);
    let outer = img.code(&layout, "/app/main.py", "outer_é", 10, &table);
    let inner = img.code(&layout, "/app/中間.py", "inner_𠀀", 20, &table);
    let f0 = img.frame(&layout, module, 0, 0);
    let f1 = img.frame(&layout, outer, 2, f0);
    let f2 = img.frame(&layout, inner, 5, f1);
    let g0 = img.frame(&layout, module, 3, 0);
    let (runtime, _) = img.runtime(&layout, &[f2, g0]);
    (img, layout, runtime)
}

#[test]
fn walks_threads_frames_and_lines_on_every_layout() {
    for minor in 7..=12 {
        let (img, layout, runtime) = sample_image(minor);
        let mut reader = StackReader::new(img, layout.clone(), runtime, Some(CODE_TYPE));
        let tstates = reader.thread_states().unwrap();
        assert_eq!(tstates.len(), 2, "3.{minor}");
        let main = reader.thread(tstates[0].0, &tstates[0].1, false);
        assert!(!main.truncated, "3.{minor}");
        let got: Vec<(String, String, u32, u32)> = main
            .frames
            .iter()
            .map(|f| {
                (
                    f.file.to_string(),
                    f.function.to_string(),
                    f.first_line,
                    f.line,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("/app/main.py".into(), "<module>".into(), 1, 2),
                ("/app/main.py".into(), "outer_é".into(), 10, 12),
                ("/app/中間.py".into(), "inner_𠀀".into(), 20, 25),
            ],
            "3.{minor}"
        );
        assert_eq!(main.thread_id, 0x7f00_0000_0000);
        assert_eq!(
            main.native_id,
            layout.tstate_native_thread_id.map(|_| 1000),
            "3.{minor}"
        );
        let second = reader.thread(tstates[1].0, &tstates[1].1, false);
        assert_eq!(second.frames.len(), 1);
        assert_eq!(second.frames[0].line, 3);
        assert_eq!(reader.cached_codes(), 3);
    }
}

/// CPython 3.11 marks the outermost frame of each call of the eval loop
/// (`is_entry`): the walk says how many frames each call runs.
#[test]
fn eval_calls_on_3_11_come_from_the_frames_marked_as_entries() {
    let (layout, _) = layout::from_offsets_file(v(11)).unwrap();
    let FrameLayout::Interpreter {
        entry_flag: Some(is_entry),
        ..
    } = layout.frame
    else {
        panic!("3.11's layout has no is_entry offset")
    };
    let mut img = Image::new();
    let table = locations(&[(8, 0)]);
    let code = img.code(&layout, "/a.py", "f", 5, &table);
    // Outermost first: a call running three frames, then one running two (Python
    // called back from C).
    let mut next = 0;
    for entry in [true, false, false, true, false] {
        let f = img.frame(&layout, code, 0, next);
        img.put(f + is_entry, &[u8::from(entry)]);
        next = f;
    }
    let mut reader = StackReader::new(img, layout, 0, Some(CODE_TYPE));
    let (walked, truncated) = reader.frames(next);
    assert!(!truncated);
    assert_eq!(walked.len(), 5);
    assert_eq!(reader.last_eval_calls(), Some(vec![3, 2]));
}

/// Whether the stack of a thread whose innermost frame is the last of `chain`
/// (outermost first: code or a shim, and the frame's owner) is torn when read
/// running, on 3.`minor`.
fn torn_when_running(minor: u8, chain: &[(bool, u8, bool)]) -> (bool, bool) {
    let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
    let FrameLayout::Interpreter {
        owner, entry_flag, ..
    } = layout.frame
    else {
        unreachable!()
    };
    let mut img = Image::new();
    let table = locations(&[(8, 0)]);
    let code = img.code(&layout, "/a.py", "f", 5, &table);
    let mut next = 0;
    for &(python, owned_by, entry) in chain {
        let f = img.frame(&layout, if python { code } else { 0 }, 0, next);
        img.put(f + owner, &[owned_by]);
        if let Some(at) = entry_flag {
            img.put(f + at, &[u8::from(entry)]);
        }
        next = f;
    }
    let (runtime, _) = img.runtime(&layout, &[next]);
    let mut reader = StackReader::new(img, layout, runtime, Some(CODE_TYPE));
    let tstates = reader.thread_states().unwrap();
    let stopped = reader.thread(tstates[0].0, &tstates[0].1, false);
    let running = reader.thread(tstates[0].0, &tstates[0].1, true);
    assert_eq!(stopped.frames, running.frames);
    (stopped.torn, running.torn)
}

/// A stack read while its thread runs is torn when its walk does not end where a
/// thread's stack ends: on a shim (3.12+) or a frame marked as a call's entry
/// (3.11), below a frame the thread owns. A walk that follows a frame popped and
/// reused meanwhile, or a suspended coroutine's, whose caller link is cleared,
/// ends elsewhere; drawn, it would be a stack rooted at an inner frame.
#[test]
fn a_walk_that_ends_off_its_root_is_torn_when_read_running() {
    const THREAD: u8 = 0;
    const GENERATOR: u8 = 1;
    const CSTACK: u8 = 3;
    // (python, owner, is_entry), outermost first.
    let whole_3_12 = [
        (false, CSTACK, false),
        (true, THREAD, false),
        (true, THREAD, false),
    ];
    assert_eq!(torn_when_running(12, &whole_3_12), (false, false));
    let off_root_3_12 = [(true, THREAD, false), (true, THREAD, false)];
    assert_eq!(torn_when_running(12, &off_root_3_12), (false, true));
    let coroutine_3_12 = [(false, CSTACK, false), (true, GENERATOR, false)];
    assert_eq!(torn_when_running(12, &coroutine_3_12), (false, true));
    let whole_3_11 = [(true, THREAD, true), (true, THREAD, false)];
    assert_eq!(torn_when_running(11, &whole_3_11), (false, false));
    let not_an_entry_3_11 = [(true, THREAD, false), (true, THREAD, false)];
    assert_eq!(torn_when_running(11, &not_an_entry_3_11), (false, true));
    let coroutine_3_11 = [(true, GENERATOR, true), (true, THREAD, false)];
    assert_eq!(torn_when_running(11, &coroutine_3_11), (false, true));
}

/// Up to 3.10 a stack read while its thread runs is torn when it ends on a frame
/// that does not say it runs (`f_executing`, `f_state`): a suspended
/// coroutine's, or a freed one's. The innermost frame need not say so: a
/// profile function sees it before it runs and as it returns.
#[test]
fn a_walk_that_ends_on_a_frame_that_does_not_run_is_torn_up_to_3_10() {
    for minor in [7, 8, 9, 10] {
        let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
        let FrameLayout::Object {
            executing: (at, runs),
            ..
        } = layout.frame
        else {
            unreachable!()
        };
        // (outermost runs, innermost runs) -> (torn stopped, torn running).
        let torn = |outer_runs: bool, inner_runs: bool| {
            let mut img = Image::new();
            let table = locations(&[(8, 0)]);
            let code = img.code(&layout, "/a.py", "f", 5, &table);
            let mark = |r: bool| if r { runs } else { runs ^ 1 };
            let root = img.frame(&layout, code, 0, 0);
            img.put(root + at, &[mark(outer_runs)]);
            let top = img.frame(&layout, code, 0, root);
            img.put(top + at, &[mark(inner_runs)]);
            let (runtime, _) = img.runtime(&layout, &[top]);
            let mut reader = StackReader::new(img, layout.clone(), runtime, Some(CODE_TYPE));
            let tstates = reader.thread_states().unwrap();
            let stopped = reader.thread(tstates[0].0, &tstates[0].1, false);
            let running = reader.thread(tstates[0].0, &tstates[0].1, true);
            assert_eq!(running.frames.len(), 2, "3.{minor}");
            (stopped.torn, running.torn)
        };
        assert_eq!(torn(true, true), (false, false), "3.{minor}");
        assert_eq!(torn(true, false), (false, false), "3.{minor}: hooked");
        assert_eq!(torn(false, true), (false, true), "3.{minor}");
    }
}

/// Up to 3.10 a running walk that ends on a frame the thread's stack was not
/// seen to begin with is torn until a second walk ends there too: a frame read
/// while the interpreter reuses it can pass for a root (its new `f_executing`
/// beside the cleared caller link it had in the free list), and a stack drawn
/// from it would be rooted at an inner frame.
#[test]
fn a_running_walk_up_to_3_10_begins_only_where_a_walk_confirmed() {
    for minor in [7, 9, 10] {
        let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
        let FrameLayout::Object { back, .. } = layout.frame else {
            unreachable!()
        };
        let mut img = Image::new();
        let table = locations(&[(8, 0)]);
        let code = img.code(&layout, "/a.py", "f", 5, &table);
        let root = img.frame(&layout, code, 0, 0);
        let middle = img.frame(&layout, code, 0, root);
        let top = img.frame(&layout, code, 0, middle);
        // A frame that reads as running with no caller: a reused one.
        let reused = img.frame(&layout, code, 0, 0);
        let (runtime, _) = img.runtime(&layout, &[top]);
        let mut reader = StackReader::new(img, layout.clone(), runtime, Some(CODE_TYPE));
        let tstates = reader.thread_states().unwrap();
        let (t, buf) = (tstates[0].0, tstates[0].1.clone());
        let walk = |reader: &mut StackReader<Image>, running: bool| {
            let raw = reader.thread(t, &buf, running);
            (raw.frames.len(), raw.torn)
        };
        // A first look, stopped: the stack begins at `root`.
        assert_eq!(walk(&mut reader, false), (3, false), "3.{minor}");
        assert_eq!(walk(&mut reader, true), (3, false), "3.{minor}");
        // The walk now ends on the reused frame: torn, then, seen twice, whole.
        reader.mem.u64(middle + back, reused);
        assert_eq!(walk(&mut reader, true), (3, true), "3.{minor}");
        assert_eq!(walk(&mut reader, true), (3, false), "3.{minor}");
        // Back to `root`: a new beginning again, confirmed the same way.
        reader.mem.u64(middle + back, root);
        assert_eq!(walk(&mut reader, true), (3, true), "3.{minor}");
        assert_eq!(walk(&mut reader, true), (3, false), "3.{minor}");
        // A stopped walk is whole at once.
        reader.mem.u64(middle + back, reused);
        assert_eq!(walk(&mut reader, false), (3, false), "3.{minor}");
        assert_eq!(walk(&mut reader, true), (3, false), "3.{minor}");
    }
}

/// What the shim at the root of a stack holds as its code, in [`torn_at_root`].
#[derive(Clone, Copy)]
enum ShimHolds {
    Code,
    TheObject,
    Else,
}

/// Whether the stack `[shim, f]` of a thread (3.12's layout) read running is torn:
/// the shim holding `holds`, the reader checking roots as `root_shim`, and with
/// `base_is_shim`, the thread's base frame (3.15+) being the shim or another frame.
fn torn_at_root(holds: ShimHolds, root_shim: RootShim, base_is_shim: Option<bool>) -> bool {
    const CSTACK: u8 = 3;
    const NONE: u64 = 0x7800_0000;
    let (mut layout, _) = layout::from_offsets_file(v(12)).unwrap();
    let base_at = layout.tstate_span();
    layout.tstate_base_frame = base_is_shim.map(|_| base_at);
    let FrameLayout::Interpreter { owner, .. } = layout.frame else {
        unreachable!()
    };
    let mut img = Image::new();
    let table = locations(&[(8, 0)]);
    let code = img.code(&layout, "/a.py", "f", 5, &table);
    let trampoline = img.code(&layout, "/t.py", "<trampoline>", 1, &table);
    let not_code = img.alloc(64);
    let held = match (holds, root_shim) {
        (ShimHolds::Code, _) => trampoline,
        (ShimHolds::TheObject, RootShim::Object(object)) => object,
        (ShimHolds::TheObject, _) => NONE,
        (ShimHolds::Else, _) => not_code,
    };
    let shim = img.frame(&layout, held, 0, 0);
    img.put(shim + owner, &[CSTACK]);
    let f = img.frame(&layout, code, 0, shim);
    let (runtime, tstates) = img.runtime(&layout, &[f]);
    if let Some(is_shim) = base_is_shim {
        img.u64(tstates[0] + base_at, if is_shim { shim } else { f });
    }
    let mut reader = StackReader::new(img, layout, runtime, Some(CODE_TYPE));
    reader.set_root_shim(root_shim);
    let threads = reader.thread_states().unwrap();
    let stopped = reader.thread(threads[0].0, &threads[0].1, false);
    let running = reader.thread(threads[0].0, &threads[0].1, true);
    assert_eq!(stopped.frames.len(), 1);
    assert!(!stopped.torn);
    running.torn
}

/// A thread read while it runs can be followed into C stack its eval loop has
/// left: a stale shim whose caller link reads as 0 looks like the thread's root.
/// The root shim must hold what the interpreter puts there (`None` from 3.13,
/// the trampoline code object on 3.12), and from 3.15 be the thread's base frame.
#[test]
fn a_walk_ending_on_a_stale_shim_or_off_the_base_frame_is_torn_when_read_running() {
    use ShimHolds::{Code, Else, TheObject};
    let none = RootShim::Object(0x7800_0000);
    assert!(!torn_at_root(Else, RootShim::Unchecked, None));
    assert!(!torn_at_root(Code, RootShim::CodeObject, None));
    assert!(torn_at_root(Else, RootShim::CodeObject, None));
    assert!(torn_at_root(TheObject, RootShim::CodeObject, None));
    assert!(!torn_at_root(TheObject, none, None));
    assert!(torn_at_root(Code, none, None));
    assert!(!torn_at_root(TheObject, none, Some(true)));
    assert!(torn_at_root(TheObject, none, Some(false)));
}

#[test]
fn shim_frames_and_non_code_objects_are_skipped() {
    let (layout, _) = layout::from_offsets_file(v(12)).unwrap();
    let FrameLayout::Interpreter { owner, .. } = layout.frame else {
        unreachable!()
    };
    let mut img = Image::new();
    let table = locations(&[(8, 0)]);
    let code = img.code(&layout, "/a.py", "f", 5, &table);
    let not_code = img.code(&layout, "/a.py", "g", 5, &table);
    img.u64(not_code + layout.ob_type, 0x1234_5678);
    let f0 = img.frame(&layout, code, 0, 0);
    let shim = img.frame(&layout, code, 0, f0);
    img.put(shim + owner, &[3]); // FRAME_OWNED_BY_CSTACK
    let f2 = img.frame(&layout, not_code, 0, shim);
    let f3 = img.frame(&layout, code, 1, f2);
    let mut reader = StackReader::new(img, layout, 0, Some(CODE_TYPE));
    let (frames, truncated) = reader.frames(f3);
    assert!(!truncated);
    assert_eq!(frames.len(), 2);
    assert!(frames.iter().all(|f| &*f.function == "f"));
}

#[test]
fn tagged_executable_is_masked() {
    let (mut layout, _) = layout::from_offsets_file(v(12)).unwrap();
    if let FrameLayout::Interpreter { tag_mask, .. } = &mut layout.frame {
        *tag_mask = 3;
    }
    let FrameLayout::Interpreter { executable, .. } = layout.frame else {
        unreachable!()
    };
    let mut img = Image::new();
    let code = img.code(&layout, "/a.py", "tagged", 5, &locations(&[(8, 0)]));
    let f = img.frame(&layout, code, 0, 0);
    img.u64(f + executable, code | 1);
    let mut reader = StackReader::new(img, layout, 0, Some(CODE_TYPE));
    let (frames, truncated) = reader.frames(f);
    assert!(!truncated);
    assert_eq!(&*frames[0].function, "tagged");
}

#[test]
fn cycles_and_endless_chains_are_bounded() {
    for minor in [9, 11, 12] {
        let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
        let back = match layout.frame {
            FrameLayout::Object { back, .. } => back,
            FrameLayout::Interpreter { previous, .. } => previous,
        };
        let mut img = Image::new();
        let code = img.code(&layout, "/a.py", "f", 5, &[]);
        // A frame that is its own caller.
        let selfish = img.frame(&layout, code, 0, 0);
        img.u64(selfish + back, selfish);
        // A 3000-deep chain of distinct frames.
        let mut deep = 0;
        for _ in 0..3000 {
            deep = img.frame(&layout, code, 0, deep);
        }
        // A thread list that loops.
        let (runtime, tstates) = img.runtime(&layout, &[selfish, deep]);
        img.u64(tstates[0] + layout.tstate_next, tstates[1]);
        let mut reader = StackReader::new(img, layout, runtime, Some(CODE_TYPE));
        let (frames, truncated) = reader.frames(selfish);
        assert!(truncated);
        assert_eq!(frames.len(), 1);
        let (frames, truncated) = reader.frames(deep);
        assert!(truncated);
        assert_eq!(frames.len(), MAX_DEPTH);
        assert_eq!(reader.thread_states().unwrap().len(), 2);
    }
}

#[test]
fn gil_holder_is_read_or_unknown() {
    for minor in 7..=12 {
        let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
        let mut img = Image::new();
        let (runtime, tstates) = img.runtime(&layout, &[0, 0]);
        let mut head = [0u8; 8];
        img.read_exact(runtime + layout.runtime_interpreters_head, &mut head)
            .unwrap();
        let interp = u64::from_le_bytes(head);
        // Held by the second thread state, then by none.
        // Bytes to write, where.
        type Writes = Vec<(u64, Vec<u8>)>;
        let (held, free): (Writes, Writes) = match layout.gil.unwrap() {
            GilLayout::RuntimeCurrent { tstate_current } => (
                vec![(runtime + tstate_current, tstates[1].to_le_bytes().to_vec())],
                vec![(runtime + tstate_current, 0u64.to_le_bytes().to_vec())],
            ),
            GilLayout::Interpreter {
                ceval_gil,
                last_holder,
                locked,
            } => {
                let gil = img.alloc(last_holder.max(locked) + 8);
                img.u64(interp + ceval_gil, gil);
                (
                    vec![
                        (gil + last_holder, tstates[1].to_le_bytes().to_vec()),
                        (gil + locked, 1i32.to_le_bytes().to_vec()),
                    ],
                    // Released: `last_holder` stays, `locked` goes to 0.
                    vec![(gil + locked, 0i32.to_le_bytes().to_vec())],
                )
            }
        };
        for (at, bytes) in &held {
            img.put(*at, bytes);
        }
        let mut reader = StackReader::new(img, layout.clone(), runtime, Some(CODE_TYPE));
        assert_eq!(reader.gil_holders(), Some(vec![tstates[1]]), "3.{minor}");
        for (at, bytes) in &free {
            reader.mem.put(*at, bytes);
        }
        assert_eq!(reader.gil_holders(), Some(vec![]), "3.{minor}");
        // Unknown, not guessed: no offsets, or a GIL pointer that cannot be one.
        if let Some(GilLayout::Interpreter { ceval_gil, .. }) = layout.gil {
            reader.mem.u64(interp + ceval_gil, 3);
            assert_eq!(reader.gil_holders(), None, "3.{minor}");
        }
        reader.layout.gil = None;
        assert_eq!(reader.gil_holders(), None, "3.{minor}");
    }
}

#[test]
fn huge_lengths_and_bad_pointers_are_refused() {
    let (layout, _) = layout::from_offsets_file(v(11)).unwrap();
    let mut img = Image::new();
    let long_name = "x".repeat(5000);
    let code = img.code(&layout, "/a.py", &long_name, 7, &locations(&[(8, 0)]));
    let f_long = img.frame(&layout, code, 0, 0);
    // A name claiming 2^40 characters, a line table claiming 2^40 bytes.
    let liar = img.code(&layout, "/b.py", "liar", 9, &[]);
    let name = img.str(&layout, "liar");
    img.u64(name + layout.unicode.length, 1 << 40);
    img.u64(liar + layout.code_name, name);
    img.u64(liar + layout.code_qualname.unwrap(), name);
    let table = img.bytes(&layout, &[]);
    img.u64(table + layout.bytes_ob_size, 1 << 40);
    img.u64(liar + layout.code_linetable, table);
    let f_liar = img.frame(&layout, liar, 0, 0);
    // A frame whose code pointer goes nowhere, and one whose caller goes nowhere.
    let f_lost = img.frame(&layout, 0xdead_0000, 0, 0);
    let f_orphan = img.frame(&layout, code, 0, 0x5555_0000);
    let mut reader = StackReader::new(img, layout, 0, Some(CODE_TYPE));

    let (frames, _) = reader.frames(f_long);
    assert_eq!(frames[0].function.chars().count(), MAX_CHARS);
    // The cut name reads at most MAX_CHARS; the huge table costs only the line.
    let (frames, truncated) = reader.frames(f_liar);
    assert!(truncated || frames.len() == 1);
    if let Some(f) = frames.first() {
        assert_eq!(f.line, 9);
    }
    let (frames, truncated) = reader.frames(f_lost);
    assert!(truncated && frames.is_empty());
    let (frames, truncated) = reader.frames(f_orphan);
    assert!(truncated);
    assert_eq!(frames.len(), 1);
    let (frames, truncated) = reader.frames(0x1234);
    assert!(truncated && frames.is_empty());
}

#[test]
fn code_cache_notices_a_reused_address() {
    let (layout, _) = layout::from_offsets_file(v(11)).unwrap();
    let mut img = Image::new();
    let code = img.code(&layout, "/a.py", "before", 1, &[]);
    let f = img.frame(&layout, code, 0, 0);
    let after = img.str(&layout, "after");
    let mut reader = StackReader::new(img, layout.clone(), 0, Some(CODE_TYPE));
    assert_eq!(&*reader.frames(f).0[0].function, "before");
    reader.mem.u64(code + layout.code_qualname.unwrap(), after);
    // Each sample is a batch of its own: a code object is read once per batch.
    reader.new_naming_batch();
    assert_eq!(&*reader.frames(f).0[0].function, "after");
}

/// Memory where every address reads as bytes derived from the address: pointers lead
/// to more garbage, some of it self-similar. The walk must end quickly every time.
struct Garbage(u64);

impl MemoryReader for Garbage {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> io::Result<()> {
        if address % 4096 == 4088 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "unmapped"));
        }
        for (i, b) in buf.iter_mut().enumerate() {
            let mut x = (address.wrapping_add(i as u64) / 8) ^ self.0;
            x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            x ^= x >> 29;
            // Mostly plausible, aligned pointers into a small space, so chains go on.
            let word = 0x10_0000 + (x % 4096) * 8;
            *b = word.to_le_bytes()[(address.wrapping_add(i as u64) % 8) as usize];
        }
        Ok(())
    }
}

impl Memory for Garbage {}

#[test]
fn random_memory_never_panics_nor_hangs() {
    for minor in 7..=12 {
        let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
        for seed in 0..20u64 {
            let start = Instant::now();
            let mut reader = StackReader::new(Garbage(seed), layout.clone(), 0x10_0000, None);
            if let Ok(tstates) = reader.thread_states() {
                assert!(tstates.len() <= MAX_THREADS);
                for (t, buf) in tstates.into_iter().take(64) {
                    let thread = reader.thread(t, &buf, seed % 2 == 0);
                    assert!(thread.frames.len() <= MAX_DEPTH);
                }
            }
            assert!(start.elapsed() < Duration::from_secs(20));
        }
    }
}

/// Locals read from random memory: bounded lists, never a panic nor a hang, on every
/// layout (slots, names and kinds, and each value's type, length and digits are the
/// target's to forge).
#[test]
fn locals_of_random_memory_never_panic_nor_hang() {
    for minor in 7..=12 {
        let (layout, _) = layout::from_offsets_file(v(minor)).unwrap();
        for seed in 0..20u64 {
            let start = Instant::now();
            let reader = StackReader::new(Garbage(seed), layout.clone(), 0x10_0000, None);
            for i in 0..64u64 {
                let frame = 0x10_0000 + i * 0x1234 * 8;
                let code = 0x20_0000 + i * 0x777 * 8;
                let locals =
                    reader.frame_locals(frame, code, &mut super::locals::LocalNamesCache::new());
                assert!(locals.len() <= super::locals::MAX_LOCALS);
                for local in locals {
                    let shown = local.value.unwrap_or_default();
                    assert!(shown.chars().count() < 400, "{shown}");
                }
            }
            assert!(start.elapsed() < Duration::from_secs(20));
        }
    }
}

#[test]
fn a_thread_list_read_again_follows_its_links_as_they_are_now() {
    let (layout, _) = layout::from_offsets_file(v(12)).unwrap();
    let mut img = Image::new();
    let code = img.code(&layout, "/a.py", "f", 1, &[]);
    let frames: Vec<u64> = (0..3).map(|_| img.frame(&layout, code, 0, 0)).collect();
    let (runtime, t) = img.runtime(&layout, &frames);
    let mut reader = StackReader::new(img, layout.clone(), runtime, Some(CODE_TYPE));
    let addrs = |r: &StackReader<Image>| -> Vec<u64> {
        r.thread_states()
            .unwrap()
            .into_iter()
            .map(|(a, _)| a)
            .collect()
    };
    assert_eq!(addrs(&reader), vec![t[0], t[1], t[2]]);
    // The middle thread ends: the newest now leads to the oldest.
    reader.mem.u64(t[2] + layout.tstate_next, t[0]);
    assert_eq!(addrs(&reader), vec![t[0], t[2]]);
    // Its state is read afresh each time, not kept.
    let native = layout
        .tstate_native_thread_id
        .unwrap_or(layout.tstate_thread_id);
    reader.mem.u64(t[0] + native, 4242);
    let (_, oldest) = reader.thread_states().unwrap().swap_remove(0);
    assert_eq!(
        oldest[native as usize..native as usize + 8],
        4242u64.to_le_bytes()
    );
    // A loop in the list read last time ends the list, as on a first read.
    reader.mem.u64(t[0] + layout.tstate_next, t[2]);
    assert_eq!(addrs(&reader), vec![t[0], t[2]]);
}

#[test]
fn only_what_a_code_object_can_be_called_passes_for_its_name() {
    for name in [
        "gen3",
        "_private",
        "Local",
        "<module>",
        "<lambda>",
        "<genexpr>",
        "héllo",
    ] {
        assert!(plausible_code_name(name), "{name}");
    }
    // Freed memory partly written over: a name's bytes with other bytes in them.
    for name in [
        "",
        "\0en5\0ltins__",
        "3abc",
        "a b",
        "<>",
        "<mod\0ule>",
        "x\u{1}",
    ] {
        assert!(!plausible_code_name(name), "{name:?}");
    }
}
