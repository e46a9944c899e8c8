//! Runs the generated hook in-process: its callbacks called as the C functions
//! CPython calls (against fake code objects and return values), its installer and
//! uninstaller against fake C API functions that record what they were asked, and
//! the detour patched over a small function.

use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

use iced_x86::code_asm::*;

use super::codegen::{
    build_detour, build_hook, DetourCalls, HookCode, HookParams, HookSymbols, Route,
};
use super::units::{table_index, Decoded, UnitDecoder, GROUP_UNITS, SENT_ENTRIES};
use super::*;
use pyprobe_sdt::ring::format::{init_ring, ring_bytes};
use pyprobe_sdt::ring::{BranchTargets, RingReader, Slots};

/// The fakes below share global state: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());
static CALLS: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// `PyObject_CallMethod` fails for this method name.
static FAIL_METHOD: Mutex<Option<&'static str>> = Mutex::new(None);

static mut MONITORING: [u64; 4] = [0; 4];
static mut ATEXIT: [u64; 4] = [0; 4];
/// `PyImport_ImportModule("atexit")` fails.
static FAIL_IMPORT: Mutex<bool> = Mutex::new(false);
static mut NONE: [u64; 4] = [0; 4];
static mut RESULT: [u64; 4] = [0; 4];
/// The fake thread state `PyThreadState_Get` returns: c_profilefunc at 64.
static mut TSTATE: [u64; 16] = [0; 16];

extern "C" fn fake_thread_state_get() -> *mut c_void {
    log("PyThreadState_Get".into());
    std::ptr::addr_of_mut!(TSTATE).cast()
}

/// The fake `sys.monitoring`: who holds tool 4, and each event's callback (by the
/// event's bit). Objects: fake `str`s for tool names, fake builtin functions
/// `[refcnt, type, m_ml, 0]` made by `PyCFunction_NewEx`.
static TOOL_HOLDER: Mutex<Option<&'static str>> = Mutex::new(None);
static REGISTRY: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());
static FAKE_UNICODE_TYPE: [u64; 4] = [0; 4];
static FAKE_CFUNCTION_TYPE: [u64; 4] = [0; 4];
static mut PYPROBE_STR: [u64; 4] = [1, 0, 0, 0];
static mut OTHER_STR: [u64; 4] = [1, 0, 0, 0];

fn unicode_type_addr() -> u64 {
    FAKE_UNICODE_TYPE.as_ptr() as u64
}

fn cfunction_type_addr() -> u64 {
    FAKE_CFUNCTION_TYPE.as_ptr() as u64
}

/// A fresh fake `sys.monitoring`: tool 4 held by `holder`, no callbacks.
fn reset_monitoring(holder: Option<&'static str>) {
    *TOOL_HOLDER.lock().unwrap_or_else(|e| e.into_inner()) = holder;
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner()).clear();
    // SAFETY: the tests run one at a time (SERIAL); the hook only reads these.
    unsafe {
        (*std::ptr::addr_of_mut!(PYPROBE_STR))[1] = unicode_type_addr();
        (*std::ptr::addr_of_mut!(OTHER_STR))[1] = unicode_type_addr();
    }
}

/// The callback registered for the event of bit `bit`, if any.
fn registered(bit: u64) -> Option<u64> {
    let registry = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    registry.iter().find(|(b, _)| *b == bit).map(|&(_, o)| o)
}

/// `register_callback(4, bit, obj)`: the previous callback, or `None`.
fn register(bit: u64, obj: u64) -> u64 {
    let mut registry = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    let previous = registry
        .iter()
        .position(|(b, _)| *b == bit)
        .map(|i| registry.remove(i).1)
        .unwrap_or_else(none_addr);
    if obj != none_addr() {
        registry.push((bit, obj));
    }
    previous
}

/// # Safety
/// `s` is a NUL-terminated string.
unsafe extern "C" fn fake_compare_ascii(obj: u64, s: *const c_char) -> i32 {
    // SAFETY: per the contract above.
    let s = unsafe { CStr::from_ptr(s) }.to_string_lossy();
    let is_pyprobe = obj == std::ptr::addr_of!(PYPROBE_STR) as u64;
    i32::from(!(is_pyprobe && s == "pyprobe"))
}

fn log(s: String) {
    CALLS.lock().unwrap_or_else(|e| e.into_inner()).push(s);
}

fn calls() -> Vec<String> {
    std::mem::take(&mut *CALLS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A fake string object (the hook reads its hash at +24).
static FAKE_STR: [u64; 4] = [0; 4];
/// The address of the state page's `status` word while a test watches it, and the
/// value `PySys_GetObject` (the installer's first call) found there.
static WATCH_STATUS: Mutex<(u64, u64)> = Mutex::new((0, 0));

/// Stands for `PyCode_Type`: the type of every fake code object.
static FAKE_CODE_TYPE: [u64; 4] = [0; 4];

fn code_type_addr() -> u64 {
    FAKE_CODE_TYPE.as_ptr() as u64
}

/// A fake code object: its type at 8, co_name and co_filename (the fake string)
/// at 16 and 24, co_firstlineno at 32, co_flags at 40 (`CO_OPTIMIZED`: a function's).
fn fake_code(first_line: u64) -> [u64; 6] {
    let s = FAKE_STR.as_ptr() as u64;
    [0, code_type_addr(), s, s, first_line, 1]
}

fn none_addr() -> u64 {
    std::ptr::addr_of!(NONE) as u64
}

/// # Safety
/// `name` is a NUL-terminated string (the hook's constants).
unsafe extern "C" fn fake_sys_get_object(name: *const c_char) -> *mut c_void {
    // SAFETY: per the contract above.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    log(format!("PySys_GetObject({name})"));
    let mut watch = WATCH_STATUS.lock().unwrap_or_else(|e| e.into_inner());
    if watch.0 != 0 {
        // SAFETY: the watched word is the test's live state page.
        watch.1 = unsafe { (watch.0 as *const u64).read_volatile() };
    }
    drop(watch);
    if name == "monitoring" {
        std::ptr::addr_of_mut!(MONITORING).cast()
    } else {
        std::ptr::null_mut()
    }
}

/// # Safety
/// `name` is a NUL-terminated string (the hook's constants).
unsafe extern "C" fn fake_import_module(name: *const c_char) -> *mut c_void {
    // SAFETY: per the contract above.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    log(format!("PyImport_ImportModule({name})"));
    if name == "atexit" && !*FAIL_IMPORT.lock().unwrap_or_else(|e| e.into_inner()) {
        std::ptr::addr_of_mut!(ATEXIT).cast()
    } else {
        std::ptr::null_mut()
    }
}

/// Stands in for the variadic `PyObject_CallMethod`: on x86-64 the first six
/// arguments travel in the same registers either way.
///
/// # Safety
/// `name` and `fmt` are NUL-terminated strings.
unsafe extern "C" fn fake_call_method(
    obj: *mut c_void,
    name: *const c_char,
    fmt: *const c_char,
    a1: u64,
    a2: u64,
    a3: u64,
) -> *mut c_void {
    // SAFETY: per the contract above.
    let (name, fmt) = unsafe { (CStr::from_ptr(name), CStr::from_ptr(fmt)) };
    let name = name.to_string_lossy().into_owned();
    let fmt = fmt.to_string_lossy();
    let module = if obj == std::ptr::addr_of_mut!(ATEXIT).cast() {
        "atexit."
    } else {
        assert_eq!(obj, std::ptr::addr_of_mut!(MONITORING).cast());
        ""
    };
    let args: Vec<String> = fmt
        .chars()
        .zip([a1, a2, a3])
        .map(|(c, v)| match c {
            'i' => format!("{}", v as u32),
            's' => {
                // SAFETY: an `s` argument is a string in the hook's constants.
                unsafe { CStr::from_ptr(v as *const c_char) }
                    .to_string_lossy()
                    .into_owned()
            }
            _ if v == none_addr() => "None".to_string(),
            _ => "obj".to_string(),
        })
        .collect();
    log(format!("{module}{name}({})", args.join(",")));
    let fail = *FAIL_METHOD.lock().unwrap_or_else(|e| e.into_inner());
    if fail == Some(name.as_str()) {
        return std::ptr::null_mut();
    }
    let mut holder = TOOL_HOLDER.lock().unwrap_or_else(|e| e.into_inner());
    match (module, name.as_str()) {
        ("", "use_tool_id") => *holder = Some("pyprobe"),
        ("", "free_tool_id") => *holder = None,
        ("", "get_tool") => {
            return match *holder {
                Some("pyprobe") => std::ptr::addr_of_mut!(PYPROBE_STR).cast(),
                Some(_) => std::ptr::addr_of_mut!(OTHER_STR).cast(),
                None => none_addr() as *mut c_void,
            }
        }
        ("", "register_callback") => return register(a2, a3) as *mut c_void,
        _ => {}
    }
    std::ptr::addr_of_mut!(RESULT).cast()
}

static DEFS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

extern "C" fn fake_cfunction_new_ex(def: u64, _self: u64, _module: u64) -> *mut c_void {
    DEFS.lock().unwrap_or_else(|e| e.into_inner()).push(def);
    log("PyCFunction_NewEx".into());
    // A builtin function object of its own (leaked: a test's worth).
    Box::leak(Box::new([1u64, cfunction_type_addr(), def, 0]))
        .as_mut_ptr()
        .cast()
}

extern "C" fn fake_dec_ref(_obj: *mut c_void) {
    log("Py_DecRef".into());
}

extern "C" fn fake_err_clear() {
    log("PyErr_Clear".into());
}

/// Executable memory for the hook, plus a state page and a ring.
struct Setup {
    code: *mut u8,
    len: usize,
    state: Box<[u64]>,
    ring: Vec<u64>,
    hook: HookCode,
    /// What the records sent so far, as pyprobe keeps it.
    decoder: std::cell::RefCell<UnitDecoder>,
}

/// Units of the tests' ring.
const CAP: u64 = 256;
/// Units of a first event: its thread, its code object's parts, itself.
const FIRST_UNITS: u64 = 1 + GROUP_UNITS + 1;
/// Events of one code object that fit in the ring.
const FIT: u64 = 1 + CAP - FIRST_UNITS;

fn exec_map(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

fn symbols() -> HookSymbols {
    HookSymbols {
        sys_get_object: fake_sys_get_object as *const () as usize as u64,
        import_module: fake_import_module as *const () as usize as u64,
        call_method: fake_call_method as *const () as usize as u64,
        cfunction_new_ex: fake_cfunction_new_ex as *const () as usize as u64,
        dec_ref: fake_dec_ref as *const () as usize as u64,
        err_clear: fake_err_clear as *const () as usize as u64,
        none: none_addr(),
        code_type: code_type_addr(),
        unicode_type: unicode_type_addr(),
        compare_ascii: fake_compare_ascii as *const () as usize as u64,
        cfunction_type: cfunction_type_addr(),
        thread_state_get: fake_thread_state_get as *const () as usize as u64,
    }
}

impl Setup {
    fn new() -> Setup {
        Setup::with_route(Route::Monitoring {
            events: EVENTS_312.to_vec(),
        })
    }

    fn with_route(route: Route) -> Setup {
        reset_monitoring(None);
        let len = 16 * 4096;
        let code = exec_map(len);
        let state = vec![0u64; STATE_LEN / 8].into_boxed_slice();
        let bytes = ring_bytes(CAP, Slots::Units).expect("ring size");
        let mut ring = vec![0u64; bytes / 8];
        // SAFETY: the Vec's buffer viewed as bytes.
        let mem = unsafe { std::slice::from_raw_parts_mut(ring.as_mut_ptr().cast::<u8>(), bytes) };
        init_ring(mem, CAP, Slots::Units).expect("init");
        let params = HookParams {
            addr: code as u64,
            state_addr: state.as_ptr() as u64,
            ring_addr: ring.as_ptr() as u64,
            capacity: CAP,
            symbols: symbols(),
            route,
            code_fields: [16, 24, 32],
            str_ascii_data: 48,
        };
        let hook = build_hook(&params).expect("build");
        assert!(hook.bytes.len() <= len);
        // SAFETY: the mapping is `len` bytes, writable.
        unsafe { std::ptr::copy_nonoverlapping(hook.bytes.as_ptr(), code, hook.bytes.len()) };
        Setup {
            code,
            len,
            state,
            ring,
            hook,
            decoder: Default::default(),
        }
    }

    fn set(&mut self, word: usize, v: u64) {
        self.state[word / 8] = v;
    }
    fn get(&self, word: usize) -> u64 {
        // SAFETY: reading our own state array, which the hook may have written.
        unsafe { std::ptr::read_volatile(self.state.as_ptr().add(word / 8)) }
    }

    fn callback(&self, k: usize, args: &[u64]) -> u64 {
        type Cb = unsafe extern "C" fn(u64, *const u64, isize) -> u64;
        // SAFETY: the callback was generated for the C signature of a METH_FASTCALL
        // function; the args array is valid for its length.
        unsafe {
            let f: Cb = std::mem::transmute::<usize, Cb>(self.hook.callbacks[k] as usize);
            f(0, args.as_ptr(), args.len() as isize)
        }
    }

    fn run(&self, addr: u64) {
        // SAFETY: the installer and uninstaller take no argument and return nothing.
        unsafe {
            let f: unsafe extern "C" fn() = std::mem::transmute::<usize, _>(addr as usize);
            f()
        }
    }

    fn reader(&self) -> RingReader {
        // SAFETY: the ring outlives the reader (both in this test); the hook writes
        // it through raw pointers as well.
        unsafe { RingReader::new(self.ring.as_ptr().cast_mut().cast(), self.ring.len() * 8) }
            .expect("reader")
    }

    /// The events recorded since the last look, read and decoded as pyprobe does.
    fn records(&self) -> Vec<Decoded> {
        decode_all(&mut self.reader(), &mut self.decoder.borrow_mut())
    }
}

/// Every event `reader` finds, through `decoder`.
fn decode_all(reader: &mut RingReader, decoder: &mut UnitDecoder) -> Vec<Decoded> {
    let mut got = Vec::new();
    // SAFETY: rdtsc has no preconditions on x86-64.
    let now = unsafe { core::arch::x86_64::_rdtsc() };
    reader.drain_units(usize::MAX, |_, words| {
        got.extend(decoder.decode(words, now))
    });
    got
}

/// The text an event came with: a body's (`body`) or a call's.
fn text(d: &Decoded, body: bool) -> Option<String> {
    let t = d.texts.as_ref()?;
    if body {
        t.body.clone()
    } else {
        t.call.clone()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.code.cast(), self.len) };
    }
}

fn fs_base() -> u64 {
    let mut base = 0u64;
    // SAFETY: ARCH_GET_FS writes one u64.
    unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1003, &mut base as *mut u64) };
    base
}

#[test]
fn callbacks_write_one_record_each() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    s.set(ST_ON, 1);
    // A fake object whose type is at +8, and fake code objects: co_name at 16,
    // co_filename at 24, co_firstlineno (an int) at 32.
    let obj = [1u64, 0x7777_0000];
    // Fake strings: the hash at +24.
    let names: Vec<[u64; 4]> = (0..7u64).map(|k| [0, 0, 0, 0x1000 + k]).collect();
    let files: Vec<[u64; 4]> = (0..7u64).map(|k| [0, 0, 0, 0x2000 + k]).collect();
    let codes: Vec<[u64; 5]> = (0..7usize)
        .map(|k| {
            [
                0,
                code_type_addr(),
                names[k].as_ptr() as u64,
                files[k].as_ptr() as u64,
                u64::from(u32::MAX - k as u32),
            ]
        })
        .collect();
    let code_of = |k: usize| codes[k].as_ptr() as u64;
    for k in 0..EVENTS_312.len() {
        let ret = s.callback(k, &[code_of(k), 10, obj.as_ptr() as u64]);
        assert_eq!(ret, none_addr());
    }
    // PY_START with two arguments only.
    s.callback(0, &[code_of(6), 0]);
    let mut got = Vec::new();
    for r in s.records() {
        let k = names
            .iter()
            .position(|n| n.as_ptr() as u64 == r.parts[1])
            .expect("a name");
        assert_eq!(r.parts[0], code_of(k));
        assert_eq!(r.parts[2], files[k].as_ptr() as u64);
        // co_firstlineno is an int: sign-extended.
        assert_eq!(r.parts[3] as i64, -1 - k as i64);
        let check = (0x1000 + k as u64) ^ (0x2000 + k as u64).rotate_left(1);
        assert_eq!(r.parts[4], check);
        got.push((r.kind, r.thread, r.parts[0], r.ty, r.stamp))
    }
    assert_eq!(got.len(), EVENTS_312.len() + 1);
    // SAFETY: rdtsc has no preconditions on x86-64.
    let now = unsafe { core::arch::x86_64::_rdtsc() };
    for (k, &(_, kind)) in EVENTS_312.iter().enumerate() {
        let (got_kind, thread, code, ty, stamp) = got[k];
        assert_eq!(got_kind, kind);
        assert_eq!(thread, fs_base());
        assert_eq!(code, code_of(k));
        let want_ty = if kind == KIND_RETURN { 0x7777_0000 } else { 0 };
        assert_eq!(ty, want_ty, "event {k}");
        assert!(stamp > 0 && stamp <= now, "event {k}");
        assert!(k == 0 || stamp >= got[k - 1].4, "in order");
    }
    assert_eq!(got[EVENTS_312.len()].2, code_of(6));
    // Each thread, type and code object was sent once, before its first event.
    let units = 1 + 1 + 7 * GROUP_UNITS + EVENTS_312.len() as u64 + 1;
    assert_eq!(s.reader().head(), units);
    assert!(calls().is_empty(), "the hot path calls nothing");
}

/// What is sent once goes again whenever it changed: code objects that share a
/// table entry send their parts each time they take it back, and each thread its
/// `%fs` base when the one before was another's; every event is named right.
#[test]
fn parts_and_threads_are_sent_again_whenever_they_changed() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    s.set(ST_ON, 1);
    // Two code objects of one pool that share an entry: there are more code
    // objects than entries, so some do (not necessarily the first one's, which
    // depends on where the pool was allocated).
    let entry = |c: &[u64; 6]| table_index(c.as_ptr() as u64, SENT_ENTRIES);
    let pool: Vec<[u64; 6]> = (0..4 * SENT_ENTRIES as u64).map(fake_code).collect();
    let mut first_in = std::collections::HashMap::new();
    let (a, b) = pool
        .iter()
        .find_map(|c| {
            let first = *first_in.entry(entry(c)).or_insert(c);
            (first.as_ptr() != c.as_ptr()).then_some((first, c))
        })
        .expect("two code objects in one entry");
    let (a, b) = (a.as_ptr() as u64, b.as_ptr() as u64);
    let before = s.reader().head();
    for code in [a, b, a, a, b] {
        s.callback(0, &[code, 0]);
    }
    let units = s.reader().head() - before;
    // A thread unit, four parts groups (each change of the entry), five events.
    assert_eq!(units, 1 + 4 * GROUP_UNITS + 5);
    let got: Vec<_> = s
        .records()
        .iter()
        .map(|r| (r.parts[0], r.parts[3]))
        .collect();
    let line = |c: u64| pool.iter().find(|p| p.as_ptr() as u64 == c).map(|p| p[4]);
    let want: Vec<_> = [a, b, a, a, b]
        .into_iter()
        .map(|c| (c, line(c).expect("in the pool")))
        .collect();
    assert_eq!(got, want);
    // Another thread's events, between this one's.
    let here = fs_base();
    let callback = s.hook.callbacks[0] as usize;
    std::thread::scope(|scope| {
        scope.spawn(move || {
            type Cb = unsafe extern "C" fn(u64, *const u64, isize) -> u64;
            // SAFETY: as in `Setup::callback`: the hook's PY_START callback, alive
            // for the scope, called with a valid array of its length.
            unsafe {
                let f: Cb = std::mem::transmute::<usize, Cb>(callback);
                f(0, [a, 0].as_ptr(), 2)
            }
        });
    });
    s.callback(0, &[a, 0]);
    let threads: Vec<u64> = s.records().iter().map(|r| r.thread).collect();
    assert_eq!(threads.len(), 2);
    assert_ne!(threads[0], here, "the other thread's");
    assert_eq!(threads[1], here, "this one's again");
}

/// A program can fetch a callback (`register_callback` returns it) and call it with
/// anything: only a call shaped as the interpreter's, a code object first, is
/// recorded; the others return `None` and read nothing behind their arguments.
#[test]
fn callbacks_called_with_what_the_interpreter_never_passes_record_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    s.set(ST_ON, 1);
    let not_code = [1u64, 0x7777_0000, 0xdead_0000, 0xdead_0000, 0];
    let code = fake_code(0);
    for k in 0..EVENTS_312.len() {
        for args in [
            &[][..],
            &[code.as_ptr() as u64][..],
            &[0, 0][..],
            &[not_code.as_ptr() as u64, 0][..],
            &[not_code.as_ptr() as u64, 0, not_code.as_ptr() as u64][..],
        ] {
            assert_eq!(s.callback(k, args), none_addr(), "event {k}, {args:x?}");
        }
    }
    assert_eq!(s.reader().head(), 0, "nothing recorded");
    // Shaped as the interpreter's: recorded.
    assert_eq!(s.callback(0, &[code.as_ptr() as u64, 0]), none_addr());
    assert_eq!(s.records().len(), 1);
    assert!(calls().is_empty(), "the hot path calls nothing");
}

/// TSC cycles in `ms` milliseconds, roughly (for timeouts only).
fn cycles(ms: u64) -> u64 {
    ms * 3_000_000
}

#[test]
fn a_full_ring_nobody_serves_counts_the_loss_and_unhooks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    reset_monitoring(Some("pyprobe"));
    s.set(ST_ON, 1);
    let code = fake_code(0);
    for _ in 0..FIT + 2 {
        assert_eq!(s.callback(0, &[code.as_ptr() as u64, 0]), none_addr());
    }
    // No consumer: the first event that does not fit is lost and clears `on`,
    // the next one unregisters the hook instead of recording.
    assert_eq!(s.reader().lost(), 1);
    assert_eq!(s.get(ST_ON), 0);
    assert!(calls().iter().any(|c| c == "free_tool_id(4)"));
    assert_eq!(s.get(ST_STATUS), STATUS_REMOVED);
    assert_eq!(s.reader().head(), CAP);
}

#[test]
fn a_full_ring_is_waited_on_until_the_consumer_makes_room() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    s.set(ST_ON, 1);
    let mut reader = s.reader();
    reader.serve(cycles(60_000), u64::MAX);
    // Each code object's event takes its parts' units too: three laps of the ring.
    let codes: Vec<[u64; 6]> = (0..3 * CAP / GROUP_UNITS).map(fake_code).collect();
    let mut decoder = UnitDecoder::default();
    let done = std::sync::atomic::AtomicBool::new(false);
    let got = std::thread::scope(|scope| {
        let consumer = scope.spawn(|| {
            let (mut got, mut sleepers) = (Vec::new(), 0u32);
            loop {
                let last = done.load(std::sync::atomic::Ordering::Acquire);
                sleepers = sleepers.max(reader.sleepers());
                let events = decode_all(&mut reader, &mut decoder);
                got.extend(events.iter().map(|r| r.parts[3]));
                if last {
                    return (got, sleepers, reader);
                }
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
        });
        for code in &codes {
            s.callback(0, &[code.as_ptr() as u64, 0]);
        }
        done.store(true, std::sync::atomic::Ordering::Release);
        consumer.join().expect("consumer")
    });
    let (got, sleepers, reader) = got;
    assert_eq!(
        got,
        (0..3 * CAP / GROUP_UNITS).collect::<Vec<u64>>(),
        "every event, in order"
    );
    assert_eq!(reader.lost(), 0);
    assert!(sleepers > 0, "the callback slept on the futex");
    assert_eq!(reader.sleepers(), 0);
    assert_eq!(s.get(ST_ON), 1);
}

#[test]
fn a_consumer_that_leaves_or_goes_silent_ends_the_wait_and_the_hook() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let code = fake_code(0);
    let event = |s: &Setup| s.callback(0, &[code.as_ptr() as u64, 0]);
    // Under a budget's short patience: lost, but the hook stays.
    let mut s = Setup::new();
    s.set(ST_ON, 1);
    s.reader().serve(cycles(60_000), 1000);
    for _ in 0..=FIT {
        event(&s);
    }
    assert_eq!((s.reader().lost(), s.get(ST_ON)), (1, 1));
    // Silent for longer than `stale`: lost, and the hook goes.
    s.reader().serve(cycles(20), u64::MAX);
    let t = std::time::Instant::now();
    event(&s);
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!((s.reader().lost(), s.get(ST_ON)), (2, 0));
    // Left while a callback waits (another thread here): it goes on at once.
    let mut s = Setup::new();
    s.set(ST_ON, 1);
    let reader = s.reader();
    reader.serve(cycles(60_000), u64::MAX);
    for _ in 0..FIT {
        event(&s);
    }
    let returned = std::sync::atomic::AtomicBool::new(false);
    let (leaving, flag) = (s.reader(), &returned);
    std::thread::scope(|scope| {
        let leaver = scope.spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let waited = !flag.load(std::sync::atomic::Ordering::Acquire);
            leaving.leave();
            waited
        });
        event(&s);
        returned.store(true, std::sync::atomic::Ordering::Release);
        assert!(leaver.join().expect("leaver"), "waits while served");
    });
    assert_eq!((reader.lost(), reader.sleepers(), s.get(ST_ON)), (1, 0, 0));
}

#[test]
fn callback_with_on_clear_uninstalls_once() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    reset_monitoring(Some("pyprobe"));
    calls();
    s.set(ST_STATUS, STATUS_OK);
    assert_eq!(s.callback(3, &[1, 2, none_addr()]), none_addr());
    let log = calls();
    let mut want = vec![
        "PySys_GetObject(monitoring)".to_string(),
        "get_tool(4)".into(),
        "Py_DecRef".into(),
    ];
    for &(ev, _) in &EVENTS_312 {
        want.push(format!("register_callback(4,{},None)", 1u32 << ev));
        want.push("Py_DecRef".into());
    }
    want.push("set_events(4,0)".into());
    want.push("Py_DecRef".into());
    want.push("free_tool_id(4)".into());
    want.push("Py_DecRef".into());
    want.push("PyErr_Clear".into());
    assert_eq!(log, want);
    assert_eq!(s.get(ST_GONE), 1);
    assert_eq!(s.get(ST_STATUS), STATUS_REMOVED);
    // Once only, and nothing recorded.
    s.callback(0, &[1, 0]);
    assert!(calls().is_empty());
    assert_eq!(s.reader().head(), 0);
}

#[test]
fn installer_registers_every_callback() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new();
    calls();
    DEFS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    *WATCH_STATUS.lock().unwrap_or_else(|e| e.into_inner()) =
        (s.state.as_ptr() as u64 + ST_STATUS as u64, 0);
    s.run(s.hook.installer.expect("monitoring route"));
    let (_, seen) = std::mem::take(&mut *WATCH_STATUS.lock().unwrap_or_else(|e| e.into_inner()));
    // Said before its first call: a thread outside the page with `status` 0 has
    // not begun to install (what re-attaching relies on).
    assert_eq!(seen, STATUS_RUNNING);
    let log = calls();
    let mask: u32 = EVENTS_312.iter().map(|&(e, _)| 1 << e).sum();
    assert_eq!(log[0], "PySys_GetObject(monitoring)");
    assert_eq!(log[1], "use_tool_id(4,pyprobe)");
    let registers: Vec<&String> = log.iter().filter(|l| l.starts_with("register")).collect();
    assert_eq!(registers.len(), EVENTS_312.len());
    for (r, &(ev, _)) in registers.iter().zip(&EVENTS_312) {
        assert_eq!(**r, format!("register_callback(4,{},obj)", 1u32 << ev));
    }
    // set_events, then the exit callback registered with atexit, both kept.
    let set = log
        .iter()
        .position(|l| *l == format!("set_events(4,{mask})"));
    let tail: Vec<&str> = log[set.expect("set_events") + 1..]
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        tail,
        [
            "Py_DecRef",
            "PyImport_ImportModule(atexit)",
            "PyCFunction_NewEx",
            "atexit.register(obj)",
            "Py_DecRef"
        ]
    );
    assert!(!log.contains(&"PyErr_Clear".to_string()));
    assert_eq!(s.get(ST_STATUS), STATUS_OK);
    assert_eq!(s.get(ST_AT_EXIT_MODULE), std::ptr::addr_of!(ATEXIT) as u64);
    assert_ne!(s.get(ST_AT_EXIT), 0);
    // The function object registered for each event, kept in the state page.
    for (k, &(ev, _)) in EVENTS_312.iter().enumerate() {
        let kept = s.get(ST_CALLBACKS + 8 * k);
        assert_ne!(kept, 0);
        assert_eq!(Some(kept), registered(1 << ev), "event {ev}");
    }
    // Each method definition names a callback, METH_FASTCALL; the last the exit
    // callback, METH_NOARGS.
    let mut defs = std::mem::take(&mut *DEFS.lock().unwrap_or_else(|e| e.into_inner()));
    let exit_def = defs.pop().expect("the exit callback's definition");
    // SAFETY: the definition lies in the hook page, 32 bytes.
    let words = unsafe { std::slice::from_raw_parts(exit_def as *const u64, 4) };
    assert_eq!((words[1], words[2]), (s.hook.at_exit, 0x04));
    assert_eq!(defs.len(), EVENTS_312.len());
    for (def, cb) in defs.iter().zip(&s.hook.callbacks) {
        // SAFETY: the definition lies in the hook page, 32 bytes.
        let words = unsafe { std::slice::from_raw_parts(*def as *const u64, 4) };
        assert_eq!(words[1], *cb);
        assert_eq!(words[2], 0x80);
        // SAFETY: ml_name points at a C string in the page.
        let name = unsafe { CStr::from_ptr(words[0] as *const c_char) };
        assert_eq!(name.to_str(), Ok("pyprobe_hook"));
    }
}

#[test]
fn installer_reports_the_step_that_failed() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new();
    calls();
    *FAIL_METHOD.lock().unwrap_or_else(|e| e.into_inner()) = Some("use_tool_id");
    s.run(s.hook.installer.expect("monitoring route"));
    *FAIL_METHOD.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let log = calls();
    assert_eq!(s.get(ST_STATUS), STATUS_FAILED + 2);
    assert!(failed_step(s.get(ST_STATUS)).is_some_and(|w| w.contains("in use")));
    assert!(!log.iter().any(|l| l.starts_with("register")));
    assert_eq!(log.last().map(String::as_str), Some("PyErr_Clear"));

    // A failure after the id was taken gives it back.
    *FAIL_METHOD.lock().unwrap_or_else(|e| e.into_inner()) = Some("set_events");
    s.run(s.hook.installer.expect("monitoring route"));
    *FAIL_METHOD.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let log = calls();
    assert_eq!(s.get(ST_STATUS), STATUS_FAILED + 5);
    assert!(log.iter().any(|l| l == "free_tool_id(4)"));
}

/// Installed, then told to go: the uninstaller takes off only its own callbacks,
/// and gives back tool 4 only while it is still pyprobe's with none of the
/// program's callbacks on it.
#[test]
fn the_uninstaller_leaves_what_the_program_took() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bits: Vec<u64> = EVENTS_312.iter().map(|&(ev, _)| 1u64 << ev).collect();
    let uninstall = |s: &mut Setup| {
        calls();
        s.set(ST_GONE, 0);
        s.run(s.hook.uninstaller);
        calls()
    };
    // The program freed tool 4 and took it for itself: nothing is touched.
    let mut s = Setup::new();
    s.run(s.hook.installer.expect("monitoring route"));
    let ours: Vec<Option<u64>> = bits.iter().map(|&b| registered(b)).collect();
    assert!(ours.iter().all(Option::is_some));
    *TOOL_HOLDER.lock().unwrap_or_else(|e| e.into_inner()) = Some("mine");
    let log = uninstall(&mut s);
    assert_eq!(
        log[..3],
        ["PySys_GetObject(monitoring)", "get_tool(4)", "Py_DecRef"]
    );
    let touched = |l: &String| {
        ["register_callback", "set_events", "free_tool_id"]
            .iter()
            .any(|m| l.starts_with(m))
    };
    assert!(!log.iter().any(touched), "{log:?}");
    assert_eq!(
        bits.iter().map(|&b| registered(b)).collect::<Vec<_>>(),
        ours
    );
    assert_eq!(*TOOL_HOLDER.lock().unwrap(), Some("mine"));

    // Still pyprobe's, but the program put its own callback on one event: pyprobe's
    // come off, the program's is put back, events and id stay.
    let mut s = Setup::new();
    s.run(s.hook.installer.expect("monitoring route"));
    let theirs = [1u64, cfunction_type_addr(), 0x1234, 0];
    register(bits[2], theirs.as_ptr() as u64);
    let log = uninstall(&mut s);
    for (k, &b) in bits.iter().enumerate() {
        let want = (k == 2).then_some(theirs.as_ptr() as u64);
        assert_eq!(registered(b), want, "event {k}");
    }
    assert!(!log.iter().any(|l| l.starts_with("set_events")), "{log:?}");
    assert!(
        !log.iter().any(|l| l.starts_with("free_tool_id")),
        "{log:?}"
    );
    assert_eq!(*TOOL_HOLDER.lock().unwrap(), Some("pyprobe"));

    // All pyprobe's: every callback off, events off, the id given back.
    let mut s = Setup::new();
    s.run(s.hook.installer.expect("monitoring route"));
    let log = uninstall(&mut s);
    assert!(bits.iter().all(|&b| registered(b).is_none()));
    assert!(log.iter().any(|l| l == "set_events(4,0)"), "{log:?}");
    assert_eq!(*TOOL_HOLDER.lock().unwrap(), None);
}

static INSTALLS: Mutex<u32> = Mutex::new(0);
extern "C" fn fake_installer() {
    *INSTALLS.lock().unwrap_or_else(|e| e.into_inner()) += 1;
}

/// The interpreter the calling thread runs: the main one (1) unless set.
static CURRENT_INTERPRETER: Mutex<u64> = Mutex::new(1);
extern "C" fn fake_interpreter_get() -> u64 {
    *CURRENT_INTERPRETER
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}
extern "C" fn fake_interpreter_main() -> u64 {
    1
}

fn fake_detour_calls() -> DetourCalls {
    DetourCalls {
        installer: fake_installer as *const () as usize as u64,
        interpreter_get: fake_interpreter_get as *const () as usize as u64,
        interpreter_main: fake_interpreter_main as *const () as usize as u64,
    }
}

#[test]
fn detour_runs_the_installer_once_and_the_function_unchanged() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let region = exec_map(8192);
    let func = region as u64;
    // rax = rdi * 2 + rsi, through a prologue of pushes (like _Py_HandlePending's).
    let mut a = CodeAssembler::new(64).expect("asm");
    a.push(r15).expect("asm");
    a.push(r14).expect("asm");
    a.push(r13).expect("asm");
    a.mov(r15, rdi).expect("asm");
    a.lea(rax, ptr(rsi + r15 * 2)).expect("asm");
    a.pop(r13).expect("asm");
    a.pop(r14).expect("asm");
    a.pop(r15).expect("asm");
    a.ret().expect("asm");
    let code = a.assemble(func).expect("assemble");
    // SAFETY: the mapping is writable and large enough.
    unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), region, code.len()) };
    type F = unsafe extern "C" fn(u64, u64) -> u64;
    // SAFETY: the code above is such a function.
    let f: F = unsafe { std::mem::transmute::<usize, F>(func as usize) };
    // SAFETY: as above.
    assert_eq!(unsafe { f(20, 2) }, 42);

    let state = Box::new([0u64; 8]);
    let detour_addr = func + 4096;
    let targets = BranchTargets::scan(&code, func);
    let d = build_detour(
        detour_addr,
        func,
        &code,
        &targets,
        state.as_ptr() as u64,
        fake_detour_calls(),
    )
    .expect("detour");
    assert_eq!(d.original.len(), 6);
    assert_eq!(d.patch.len(), 6);
    // SAFETY: writing the detour and the patch into our own mapping.
    unsafe {
        std::ptr::copy_nonoverlapping(d.code.as_ptr(), detour_addr as *mut u8, d.code.len());
        std::ptr::copy_nonoverlapping(d.patch.as_ptr(), region, d.patch.len());
    }
    *INSTALLS.lock().unwrap_or_else(|e| e.into_inner()) = 0;
    // Not armed: the function only.
    // SAFETY: the patched function keeps its contract.
    assert_eq!(unsafe { f(5, 1) }, 11);
    assert_eq!(*INSTALLS.lock().unwrap_or_else(|e| e.into_inner()), 0);
    let state_ptr = state.as_ptr() as *mut u64;
    // SAFETY: our own state array.
    unsafe { std::ptr::write_volatile(state_ptr.add(ST_ARMED / 8), 1) };
    // Armed, on a thread of a subinterpreter: the function only, still armed.
    *CURRENT_INTERPRETER
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = 2;
    for i in 0..3u64 {
        // SAFETY: as above.
        assert_eq!(unsafe { f(i, 3) }, 2 * i + 3);
    }
    *CURRENT_INTERPRETER
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = 1;
    assert_eq!(*INSTALLS.lock().unwrap_or_else(|e| e.into_inner()), 0);
    assert_eq!(state[ST_ARMED / 8], 1);
    // On a thread of the main interpreter: installed once.
    for i in 0..3u64 {
        // SAFETY: as above.
        assert_eq!(unsafe { f(i, 7) }, 2 * i + 7);
    }
    assert_eq!(*INSTALLS.lock().unwrap_or_else(|e| e.into_inner()), 1);
    assert_eq!(state[ST_ARMED / 8], 2);
    // SAFETY: our own mapping.
    unsafe { libc::munmap(region.cast(), 8192) };
}

#[test]
fn detour_refuses_a_jump_at_the_entry() {
    let code = [0xeb, 0x00, 0x90, 0x90, 0x90, 0x90, 0xc3];
    let targets = BranchTargets::scan(&code, 0x1000);
    assert!(build_detour(0x2000, 0x1000, &code, &targets, 0, fake_detour_calls()).is_err());
    // A branch back into the displaced bytes.
    let code = [0x55, 0x53, 0x41, 0x54, 0x90, 0x90, 0xeb, 0xf9, 0xc3];
    let targets = BranchTargets::scan(&code, 0x1000);
    assert!(matches!(
        build_detour(0x2000, 0x1000, &code, &targets, 0, fake_detour_calls()),
        Err(HookError::BranchInside { .. })
    ));
}

#[test]
fn the_uninstaller_unregisters_the_exit_callback_and_a_failed_import_is_no_failure() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new();
    s.run(s.hook.installer.expect("monitoring route"));
    calls();
    s.run(s.hook.uninstaller);
    let log = calls();
    let at = log.iter().position(|l| l == "atexit.unregister(obj)");
    assert!(at.is_some(), "{log:?}");
    // Its result, the function and the module given back; the error state cleared.
    let after: Vec<&str> = log[at.unwrap_or(0) + 1..]
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        after,
        ["Py_DecRef", "Py_DecRef", "Py_DecRef", "PyErr_Clear"]
    );
    assert_eq!((s.get(ST_AT_EXIT), s.get(ST_AT_EXIT_MODULE)), (0, 0));

    *FAIL_IMPORT.lock().unwrap_or_else(|e| e.into_inner()) = true;
    let s = Setup::new();
    calls();
    s.run(s.hook.installer.expect("monitoring route"));
    *FAIL_IMPORT.lock().unwrap_or_else(|e| e.into_inner()) = false;
    let log = calls();
    assert_eq!(s.get(ST_STATUS), STATUS_OK);
    assert_eq!(s.get(ST_AT_EXIT), 0);
    assert_eq!(log.last().map(String::as_str), Some("PyErr_Clear"));
    // Tried again later.
    assert_eq!(
        (s.get(ST_AT_EXIT_RETRY), s.get(ST_AT_EXIT_TRIES)),
        (u64::from(AT_EXIT_RETRY_EVENTS), 1)
    );
}

/// An exit callback `atexit` could not take at install (a launched interpreter is
/// still starting) is registered by a later event, which records as any other.
#[test]
fn a_failed_exit_registration_is_tried_again_by_later_events_then_given_up() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    *FAIL_IMPORT.lock().unwrap_or_else(|e| e.into_inner()) = true;
    s.run(s.hook.installer.expect("monitoring route"));
    *FAIL_IMPORT.lock().unwrap_or_else(|e| e.into_inner()) = false;
    s.set(ST_ON, 1);
    // Two events to the next try instead of AT_EXIT_RETRY_EVENTS.
    s.set(ST_AT_EXIT_RETRY, 2);
    calls();
    let ret_k = EVENTS_312
        .iter()
        .position(|&(_, kind)| kind == KIND_RETURN)
        .expect("a return event");
    let obj = [1u64, 0x7777_0000];
    let strings = [[0u64; 4]; 2];
    let code = [
        0u64,
        code_type_addr(),
        strings[0].as_ptr() as u64,
        strings[1].as_ptr() as u64,
        12,
    ];
    let code_addr = code.as_ptr() as u64;
    s.callback(ret_k, &[code_addr, 10, obj.as_ptr() as u64]);
    assert!(calls().is_empty(), "not yet");
    assert_eq!(s.get(ST_AT_EXIT), 0);
    s.callback(ret_k, &[code_addr, 10, obj.as_ptr() as u64]);
    assert_eq!(
        calls(),
        [
            "PyImport_ImportModule(atexit)",
            "PyCFunction_NewEx",
            "atexit.register(obj)",
            "Py_DecRef"
        ]
    );
    assert_ne!(s.get(ST_AT_EXIT), 0);
    assert_eq!(s.get(ST_AT_EXIT_RETRY), 0);
    // Both events recorded whole: the try kept the callback's arguments.
    let got: Vec<_> = s
        .records()
        .iter()
        .map(|r| (r.parts[0], r.ty, r.parts[3]))
        .collect();
    assert_eq!(got, [(code_addr, 0x7777_0000, 12); 2]);
    s.callback(ret_k, &[code_addr, 10, obj.as_ptr() as u64]);
    assert!(calls().is_empty(), "registered: no more tries");

    // A registration that keeps failing is given up after AT_EXIT_MAX_TRIES.
    let mut s = Setup::new();
    *FAIL_IMPORT.lock().unwrap_or_else(|e| e.into_inner()) = true;
    s.run(s.hook.installer.expect("monitoring route"));
    s.set(ST_ON, 1);
    s.set(ST_AT_EXIT_TRIES, u64::from(AT_EXIT_MAX_TRIES) - 1);
    s.set(ST_AT_EXIT_RETRY, 1);
    calls();
    s.callback(0, &[code_addr, 0]);
    assert_eq!(
        calls(),
        ["PyImport_ImportModule(atexit)", "PyErr_Clear"],
        "the last try"
    );
    assert_eq!(
        (s.get(ST_AT_EXIT_RETRY), s.get(ST_AT_EXIT_TRIES)),
        (0, u64::from(AT_EXIT_MAX_TRIES))
    );
    s.callback(0, &[code_addr, 0]);
    *FAIL_IMPORT.lock().unwrap_or_else(|e| e.into_inner()) = false;
    assert!(calls().is_empty(), "given up");
}

/// The exit callback: at once when `on` is clear or nobody serves the ring; else
/// asleep until the consumer has finished with the records up to the head it found
/// (copying them out is not enough).
#[test]
fn the_exit_callback_waits_for_pyprobe_to_read_what_was_written() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    let at_exit = |s: &Setup| {
        type Cb = unsafe extern "C" fn(u64, u64) -> u64;
        // SAFETY: generated for the C signature of a METH_NOARGS function.
        let f: Cb = unsafe { std::mem::transmute::<usize, Cb>(s.hook.at_exit as usize) };
        // SAFETY: it reads the state page and the ring, both alive.
        unsafe { f(0, 0) }
    };
    assert_eq!(at_exit(&s), none_addr(), "on clear: nothing to wait for");
    s.set(ST_ON, 1);
    let code = fake_code(0);
    for _ in 0..3 {
        s.callback(0, &[code.as_ptr() as u64, 0]);
    }
    // Nobody serves the ring (alive 0): no wait.
    let t = std::time::Instant::now();
    at_exit(&s);
    assert!(t.elapsed() < std::time::Duration::from_millis(500));
    // Served: the callback sleeps until the records are read.
    let mut reader = s.reader();
    reader.serve(cycles(60_000), u64::MAX);
    let read = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = &mut reader;
        let read = &read;
        scope.spawn(move || {
            // Copied out is not done with: the names are read after.
            let drained = reader.drain_units(100, |_, _| {});
            // Its thread, its code object's parts, three events.
            assert_eq!(drained.records, 5);
            std::thread::sleep(std::time::Duration::from_millis(100));
            read.store(true, std::sync::atomic::Ordering::Release);
            reader.mark_finished();
        });
        let t = std::time::Instant::now();
        at_exit(&s);
        assert!(
            read.load(std::sync::atomic::Ordering::Acquire),
            "returned before the read"
        );
        assert!(t.elapsed() >= std::time::Duration::from_millis(100));
    });
}

/// The profile route's layout of the tests: c_profilefunc at 64 of the fake thread
/// state, the code object at +32 of the frame (3.7 to 3.10) or of the interpreter
/// frame at +24 (3.11); `f_lasti` at +16 of the frame, `prev_instr` at +8 of the
/// interpreter frame.
fn profile_setup(via: Option<i32>) -> Setup {
    Setup::with_route(Route::Profile(ProfileLayout {
        profile_func: 64,
        frame_via: via,
        frame_code: 32,
        code_flags: 40,
        resume: match via {
            None => ResumeTest::Lasti(16),
            Some(_) => ResumeTest::PrevInstr(8),
        },
    }))
}

impl Setup {
    fn profile(&self, frame: u64, what: i32, arg: u64) -> i32 {
        type Cb = unsafe extern "C" fn(u64, u64, i32, u64) -> i32;
        // SAFETY: generated for the C signature of a `Py_tracefunc`; the frame and
        // argument point at live fakes.
        unsafe {
            let f: Cb = std::mem::transmute::<usize, Cb>(self.hook.callbacks[0] as usize);
            f(0, frame, what, arg)
        }
    }
}

#[test]
fn the_profile_function_records_calls_returns_and_raises_and_nothing_else() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for via in [None, Some(24)] {
        let mut s = profile_setup(via);
        assert!(s.hook.installer.is_none());
        assert_eq!(s.hook.callbacks.len(), 1);
        s.set(ST_ON, 1);
        let code = fake_code(7);
        // The frame: f_code at +32 (f_lasti -1), or f_frame at +24 pointing at an
        // interpreter frame whose f_code is at +32 (standing at `RESUME 0`).
        let resume_0 = [151u16];
        let iframe = [0, resume_0.as_ptr() as u64, 0, 0, code.as_ptr() as u64];
        let frame: [u64; 5] = match via {
            None => [0, 0, u64::from(u32::MAX), 0, code.as_ptr() as u64],
            Some(_) => [0, 0, 0, iframe.as_ptr() as u64, 0],
        };
        let f = frame.as_ptr() as u64;
        let obj = [1u64, 0x7777_0000];
        let none = none_addr();
        assert_eq!(s.profile(f, 0, none), 0); // PyTrace_CALL
        assert_eq!(s.profile(f, 4, none), 0); // PyTrace_C_CALL: not recorded
        assert_eq!(s.profile(f, 6, none), 0); // PyTrace_C_RETURN: not recorded
        assert_eq!(s.profile(f, 3, obj.as_ptr() as u64), 0); // PyTrace_RETURN
        assert_eq!(s.profile(f, 3, 0), 0); // left by an exception
        let got: Vec<_> = s
            .records()
            .iter()
            .map(|r| (r.kind, r.parts[0], r.ty, r.parts[3]))
            .collect();
        let c = code.as_ptr() as u64;
        assert_eq!(
            got,
            [
                (KIND_CALL, c, 0, 7),
                (KIND_RETURN, c, 0x7777_0000, 7),
                (KIND_RAISE, c, 0, 7)
            ],
            "{via:?}"
        );
    }
}

#[test]
fn the_profile_function_tells_a_resume_from_a_call_by_where_the_frame_stands() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let code = fake_code(7);
    let c = code.as_ptr() as u64;
    // 3.7 to 3.10: f_lasti (at +16) -1 before the frame first ran.
    let mut s = profile_setup(None);
    s.set(ST_ON, 1);
    for (lasti, kind) in [(-1i32, KIND_CALL), (0, KIND_RESUME), (24, KIND_RESUME)] {
        let frame: [u64; 5] = [0, 0, u64::from(lasti as u32), 0, c];
        assert_eq!(s.profile(frame.as_ptr() as u64, 0, none_addr()), 0);
        let got: Vec<_> = s.records().iter().map(|r| (r.kind, r.parts[0])).collect();
        assert_eq!(got, [(kind, c)], "f_lasti {lasti}");
    }
    // 3.11: the code unit at prev_instr (+8 of the interpreter frame): RESUME 0
    // and RESUME_QUICK 0 start the frame; YIELD_VALUE (86), SEND (123), RESUME 1
    // and RETURN_GENERATOR (75: a throw into a generator not started) do not.
    let mut s = profile_setup(Some(24));
    s.set(ST_ON, 1);
    let units: [(u16, u32); 6] = [
        (151, KIND_CALL),
        (150, KIND_CALL),
        (86, KIND_RESUME),
        (123, KIND_RESUME),
        (151 | 1 << 8, KIND_RESUME),
        (75, KIND_RESUME),
    ];
    for (unit, kind) in units {
        let at = [unit];
        let iframe = [0, at.as_ptr() as u64, 0, 0, c];
        let frame: [u64; 5] = [0, 0, 0, iframe.as_ptr() as u64, 0];
        assert_eq!(s.profile(frame.as_ptr() as u64, 0, none_addr()), 0);
        let got: Vec<_> = s.records().iter().map(|r| (r.kind, r.parts[0])).collect();
        assert_eq!(got, [(kind, c)], "code unit {unit:#x}");
    }
}

#[test]
fn a_profile_function_told_to_go_drops_itself_in_each_thread_and_unregisters_once() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = profile_setup(None);
    s.set(ST_ON, 1);
    s.set(ST_AT_EXIT_RETRY, 1);
    calls();
    let code = fake_code(3);
    let frame = [0, 0, 0, 0, code.as_ptr() as u64];
    // The first event registers the exit callback.
    s.profile(frame.as_ptr() as u64, 0, 0);
    assert_ne!(s.get(ST_AT_EXIT), 0);
    calls();
    // SAFETY: the test's own fake thread state; the tests run one at a time.
    let slot = |v: Option<u64>| unsafe {
        let p = std::ptr::addr_of_mut!(TSTATE).cast::<u64>().add(8);
        if let Some(v) = v {
            p.write_volatile(v);
        }
        p.read_volatile()
    };
    slot(Some(s.hook.callbacks[0]));
    s.set(ST_ON, 0);
    assert_eq!(s.profile(frame.as_ptr() as u64, 0, 0), 0);
    assert_eq!(slot(None), 0, "the thread's profile function is cleared");
    // `gone` is taken and the uninstaller run before any other call: a thread
    // found outside the page with `gone` clear has not begun to leave.
    assert_eq!(
        calls(),
        [
            "atexit.unregister(obj)",
            "Py_DecRef",
            "Py_DecRef",
            "Py_DecRef",
            "PyErr_Clear",
            "PyThreadState_Get"
        ]
    );
    assert_eq!(s.get(ST_STATUS), STATUS_REMOVED);
    // Another thread: it drops its own, and nothing is unregistered twice.
    slot(Some(s.hook.callbacks[0]));
    s.profile(frame.as_ptr() as u64, 3, 0);
    assert_eq!(slot(None), 0);
    assert_eq!(calls(), ["PyThreadState_Get"]);
    assert_eq!(
        s.reader().head(),
        FIRST_UNITS,
        "only the first event was recorded"
    );
}

#[test]
fn before_3_12_the_exit_callback_returns_a_new_reference_to_none() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = profile_setup(None);
    type Cb = unsafe extern "C" fn(u64, u64) -> u64;
    // SAFETY: generated for the C signature of a METH_NOARGS function; it reads the
    // state page (on clear: no wait) and writes the fake None's refcount.
    let f: Cb = unsafe { std::mem::transmute::<usize, Cb>(s.hook.at_exit as usize) };
    // SAFETY: the fake None lives for the whole test binary.
    let refs = || unsafe { std::ptr::addr_of!(NONE).cast::<u64>().read_volatile() };
    let before = refs();
    // SAFETY: see above.
    assert_eq!(unsafe { f(0, 0) }, none_addr());
    assert_eq!(refs(), before + 1);
}

/// A fake compact ASCII `str` (3.7 to 3.11 layout): length at 16, hash at 24, the
/// state byte at 32 (compact and ascii), the text from 48.
fn fake_ascii(text: &str, hash: u64) -> Vec<u64> {
    let mut words = vec![0u64; 6 + text.len() / 8 + 1];
    words[2] = text.len() as u64;
    words[3] = hash;
    words[4] = 0x60;
    // SAFETY: the text goes into the words' own bytes, within their length.
    unsafe {
        let bytes = words.as_mut_ptr().cast::<u8>().add(48);
        std::ptr::copy_nonoverlapping(text.as_ptr(), bytes, text.len());
    }
    words
}

#[test]
fn a_body_s_record_carries_its_name_and_file_and_a_function_s_does_not() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = profile_setup(None);
    s.set(ST_ON, 1);
    let name = fake_ascii("<module>", 0x1234);
    let file = fake_ascii("/srv/app/mod.py", 0x5678);
    let long = "x".repeat(300);
    let long_name = fake_ascii(&long, 7);
    let long_file = fake_ascii(&format!("/srv/{}.py", "y".repeat(200)), 0x9abc);
    // A file name not hashed yet: its length and first 8 bytes identify it.
    let unhashed = fake_ascii("/srv/app/unhashed.py", u64::MAX);
    let code = |name: &Vec<u64>, file: &Vec<u64>, flags: u64| {
        [0, 0, name.as_ptr() as u64, file.as_ptr() as u64, 1, flags]
    };
    let codes = [
        code(&name, &file, 0),
        code(&name, &file, 1),
        code(&long_name, &file, 0),
        code(&name, &long_file, 0),
        code(&name, &unhashed, 1),
    ];
    for c in &codes {
        let frame = [0, 0, 0, 0, c.as_ptr() as u64];
        s.profile(frame.as_ptr() as u64, 0, 0);
    }
    let got: Vec<_> = s
        .records()
        .iter()
        .map(|r| (text(r, true), r.parts[4]))
        .collect();
    let file_only = 0x5678u64.rotate_left(1);
    assert_eq!(
        got[0],
        (Some("<module>\x01/srv/app/mod.py".into()), file_only)
    );
    assert_eq!(got[1], (None, 0x1234 ^ file_only));
    // A name longer than the area: nothing copied, both identities kept.
    assert_eq!(got[2], (None, 7 ^ file_only));
    // A file that does not fit beside the name: the name alone.
    assert_eq!(got[3], (Some("<module>".into()), 0x9abcu64.rotate_left(1)));
    let head = u64::from_le_bytes(*b"/srv/app");
    let identity = ("/srv/app/unhashed.py".len() as u64) ^ head;
    assert_eq!(got[4], (None, 0x1234 ^ identity.rotate_left(1)));
}

#[test]
fn a_function_s_call_carries_its_name_the_first_time_its_parts_are_met() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = profile_setup(None);
    s.set(ST_ON, 1);
    let gen1 = fake_ascii("gen1", 0x1111);
    let gen2 = fake_ascii("gen2", 0x2222);
    let file = fake_ascii("<churn>", 0x5678);
    let code = |name: &Vec<u64>| [0, 0, name.as_ptr() as u64, file.as_ptr() as u64, 2, 1];
    // Three code objects in table entries of their own (the hook's index).
    let entry = |c: &[u64; 6]| table_index(c.as_ptr() as u64, SENT_ENTRIES);
    let pool: Vec<[u64; 6]> = (0..64)
        .map(|i| code(if i % 2 == 0 { &gen1 } else { &gen2 }))
        .collect();
    let first = &pool[0];
    let again_elsewhere = pool
        .iter()
        .step_by(2)
        .find(|c| entry(c) != entry(first))
        .expect("another entry");
    let renamed = pool
        .iter()
        .skip(1)
        .step_by(2)
        .find(|c| entry(c) != entry(first) && entry(c) != entry(again_elsewhere))
        .expect("a third entry");
    // (code object, what, f_lasti): a call, its return, a resume, calls again.
    let events: [(&[u64; 6], i32, i32); 7] = [
        (first, 0, -1),
        (first, 3, 0),
        (first, 0, 10),
        (first, 0, -1),
        (again_elsewhere, 0, -1),
        (renamed, 0, -1),
        (first, 0, -1),
    ];
    let run = |s: &mut Setup, events: &[(&[u64; 6], i32, i32)]| {
        let mut got = Vec::new();
        for &(c, what, lasti) in events {
            let frame = [0, 0, u64::from(lasti as u32), 0, c.as_ptr() as u64];
            let arg = [1u64, 0x7777_0000];
            s.profile(frame.as_ptr() as u64, what, arg.as_ptr() as u64);
        }
        got.extend(s.records().iter().map(|r| (r.kind, text(r, false))));
        got
    };
    let got = run(&mut s, &events);
    let carried = Some("gen1\x01<churn>".to_string());
    assert_eq!(
        got,
        [
            (KIND_CALL, carried.clone()),
            (KIND_RETURN, None),
            (KIND_RESUME, None),
            // The same parts again: named already.
            (KIND_CALL, None),
            // Another code object (address), with the same name: its parts differ.
            (KIND_CALL, carried.clone()),
            // Another name.
            (KIND_CALL, Some("gen2\x01<churn>".to_string())),
            (KIND_CALL, None),
        ]
    );
    // A new pyprobe empties the table: it has been sent nothing.
    for word in (ST_TABLES..STATE_LEN).step_by(8) {
        s.set(word, 0);
    }
    *s.decoder.borrow_mut() = UnitDecoder::default();
    assert_eq!(run(&mut s, &events[..1]), [(KIND_CALL, carried)]);
}

#[test]
fn through_sys_monitoring_a_call_carries_its_name_the_first_time_its_parts_are_met() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::new();
    s.set(ST_ON, 1);
    let name = fake_ascii("<module>", 0x1111);
    let file = fake_ascii("<frozen getpath>", 0x5678);
    let code = [
        0,
        code_type_addr(),
        name.as_ptr() as u64,
        file.as_ptr() as u64,
        1,
    ];
    let c = code.as_ptr() as u64;
    // PY_START, PY_RESUME, PY_RETURN, PY_START again: a body as any code object
    // (its qualified name is read from the target's memory while it lives).
    for k in [0, 1, 3, 0] {
        s.callback(k, &[c, 0, none_addr()]);
    }
    let got: Vec<_> = s
        .records()
        .iter()
        .map(|r| (r.kind, text(r, false), text(r, true).is_some()))
        .collect();
    assert_eq!(
        got,
        [
            (
                KIND_CALL,
                Some("<module>\x01<frozen getpath>".into()),
                false
            ),
            (KIND_RESUME, None, false),
            (KIND_RETURN, None, false),
            (KIND_CALL, None, false),
        ]
    );
}
