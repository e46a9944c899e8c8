//! Putting the hook into a stopped process: the state page, the ring, the hook page
//! with the detour beside the safe point, the jump, and the raised eval breaker.
//!
//! Runs with every thread of the process stopped, through system calls injected in
//! one of them ([`Injector`], guarded: pyprobe dying mid-call leaves the thread in the
//! spin loop for the guardian) and writes to `/proc/PID/mem`. Nothing the target
//! may still execute is ever unmapped.

use anyhow::{anyhow, bail, Context, Result};
use memmap2::MmapMut;

use crate::hook::codegen::JMP_LEN;
use crate::hook::{
    build_detour, build_hook, events_of, Detour, DetourCalls, HookCode, HookParams, HookSymbols,
    Route, STATE_LEN, STATUS_OK, ST_ARMED, ST_AT_EXIT_RETRY, ST_ON, ST_STATUS, ST_TABLES,
};
use crate::python::version::PyVersion;
use crate::python::walker::{find_interpreter_object, Walker};
use pyprobe_sdt::process::maps::read_maps;
use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::ring::format::H_ALIVE;
use pyprobe_sdt::ring::{BranchTargets, RingReader, Slots};
use pyprobe_sdt::tracer::guardian::{Guardian, Op};
use pyprobe_sdt::tracer::inject::Injector;
use pyprobe_sdt::tracer::near_map::{map_near, NearMap};
use pyprobe_sdt::tracer::ring_engine::setup::map_ring;
use pyprobe_sdt::tracer::NotTraceable;

use super::profile::{profile_target, ProfileTarget, Slot};
use super::reuse::{self, Resume, NAME_AT, RING_NAME};

// The state page's words stay clear of the name that marks it as pyprobe's.
const _: () = assert!(crate::hook::ST_CALLBACKS as u64 >= NAME_AT + RING_NAME.len() as u64);
const _: () = assert!(crate::hook::ST_AT_EXIT_TRIES as u64 + 8 <= NAME_AT);

pub use pyprobe_sdt::process::PAGE_SIZE as PAGE;
/// Slots in a hook's ring: as many as in an SDT ring (it stays mapped after
/// detaching).
/// Units of the hook's ring: the 8 MiB of the SDT engine's ring of
/// [`CAPACITY`](pyprobe_sdt::tracer::ring_engine::CAPACITY) records.
pub(crate) const UNITS: u64 = 1 << 19;
/// The hook page and the detour.
pub(crate) const REGION: u64 = 4 * PAGE;
/// Bytes of the safe point's function scanned for branches into its entry.
const SCAN: usize = 4096;
const MADV_DONTFORK: u64 = libc::MADV_DONTFORK as u64;
const MADV_WIPEONFORK: u64 = libc::MADV_WIPEONFORK as u64;

/// How to raise the eval breaker of this version.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Breaker {
    /// 3.12: `PyInterpreterState.ceval.eval_breaker` (an int) at the first offset,
    /// and `ceval.pending.calls_to_do` at the second. The breaker alone would not
    /// do: taking the GIL recomputes it from the conditions, and a thread blocked in
    /// C takes the GIL before it runs Python again. With `calls_to_do` set it stays
    /// raised until a thread runs `_Py_HandlePending`, whose `make_pending_calls`
    /// clears it and finds the queue empty (the queue and its lock are not touched).
    Interpreter(u64, u64),
    /// 3.13 to 3.15: `PyThreadState.eval_breaker` (a `uintptr_t`) at this offset; the
    /// `_PY_CALLS_TO_DO` bit is cleared by the handler when no call is queued.
    ThreadState(u64),
}

/// `offsetof(PyInterpreterState, ceval.eval_breaker)` in 3.12 release builds, from
/// compiling against the 3.12 headers with `Py_BUILD_CORE` (as scripts/gen-offsets.sh
/// does for the walker); checked against the walker's `ceval.gil` (384) from the same
/// headers below.
const EVAL_BREAKER_312: u64 = 368;
/// `offsetof(PyInterpreterState, ceval.pending.calls_to_do)` in 3.12, the same way.
const CALLS_TO_DO_312: u64 = 416;
const CEVAL_GIL_312: u64 = 384;
/// `offsetof(PyThreadState, eval_breaker)` in 3.13 to 3.15 (public `struct _ts`).
const EVAL_BREAKER_313: u64 = 24;
const CALLS_TO_DO_BIT: u64 = 1 << 2;
/// `offsetof(PyThreadState, interp)` in 3.12 to 3.15 (public `struct _ts`).
const TSTATE_INTERP: u64 = 16;

/// What [`install`] put into the process.
pub(crate) struct Installed {
    pub(crate) reader: RingReader,
    pub(crate) mapping: MmapMut,
    pub(crate) ring_addr: u64,
    pub(crate) state_addr: u64,
    pub(crate) hook: HookCode,
    /// The jump at the safe point (monitoring route).
    pub(crate) detour: Option<Detour>,
    pub(crate) breaker: Option<Breaker>,
    /// The profile route's layout.
    pub(crate) profile: Option<ProfileTarget>,
    /// Thread states whose profile slot the target's own profiler holds.
    pub(crate) taken: Vec<u64>,
    /// What became of the hooks earlier pyprobes left (said under `-v`).
    pub(crate) notes: Vec<String>,
    pub walker: Walker,
}

/// Why this interpreter cannot have the hook, in one sentence with what works
/// instead; `None` when it can.
pub fn refusal(version: PyVersion) -> Option<String> {
    let minor = u32::from(version.minor);
    if version.major == 3 && (events_of(minor).is_some() || profile_target(minor).is_some()) {
        return None;
    }
    Some(format!(
        "CPython {version}: the hook engine serves CPython 3.7 to 3.15; exact calls need \
         function probes here (a --with-dtrace build), else the default mode samples its \
         stacks"
    ))
}

/// Whether the interpreter `walker` reads is far enough into its start for the
/// hook (a launched process): it has a thread state, and on 3.12 its GIL (which
/// [`install`] checks the interpreter's layout by), on 3.10 and 3.11 a current
/// `CFrame` (which the profile route writes).
pub(crate) fn ready(walker: &mut Walker, mem: &ProcessMemory) -> bool {
    let Some(first) = walker
        .thread_state_addrs()
        .ok()
        .and_then(|t| t.first().copied())
    else {
        return false;
    };
    let minor = u32::from(walker.version().minor);
    if let Some(target) = profile_target(minor) {
        return target.ready(mem, first);
    }
    minor != 12 || ceval_312(mem, first).is_ok_and(|(gil, _)| gil != 0)
}

/// 3.12: the interpreter's `ceval.gil` pointer and `ceval.eval_breaker`, through
/// thread state `tstate`.
fn ceval_312(mem: &ProcessMemory, tstate: u64) -> Result<(u64, u32)> {
    let interp = mem.read_u64(tstate + TSTATE_INTERP)?;
    // The walker's offsets say where ceval.gil is; it points at a GIL.
    let gil = mem.read_u64(interp + CEVAL_GIL_312)?;
    let eb = mem.read_u64(interp + EVAL_BREAKER_312)? as u32;
    Ok((gil, eb))
}

/// Installs the hook in `pid` (every thread stopped, `tid` at a clean stop; `rips`:
/// every thread's instruction pointer; `walker`: one already attached to it, if any).
pub(crate) fn install(
    pid: i32,
    tid: i32,
    mem: &mut ProcessMemory,
    rips: &[u64],
    walker: Option<Walker>,
    guard: Option<&mut Guardian>,
) -> Result<Installed> {
    let mut walker = match walker {
        Some(w) => w,
        None => Walker::attach(pid)?,
    };
    let version = walker.version();
    if let Some(why) = refusal(version) {
        return Err(NotTraceable(why).into());
    }
    if walker.free_threaded() {
        // The hook reads `str` objects by the default build's layout.
        return Err(NotTraceable(format!(
            "CPython {version} is a free-threaded build, which the hook engine is not built \
             for; the default mode samples its stacks"
        ))
        .into());
    }
    let object = find_interpreter_object(pid)?;
    let sym = |name: &str| {
        object
            .elf
            .symbols
            .address(name)
            .map(|a| object.runtime(a))
            .ok_or_else(|| {
                NotTraceable(format!(
                    "{} does not define `{name}` (stripped?), which the hook engine needs; the \
                     default mode samples its stacks",
                    object.target_path
                ))
            })
    };
    let symbols = HookSymbols {
        sys_get_object: sym("PySys_GetObject")?,
        import_module: sym("PyImport_ImportModule")?,
        call_method: sym("PyObject_CallMethod")?,
        cfunction_new_ex: sym("PyCFunction_NewEx")?,
        dec_ref: sym("Py_DecRef")?,
        err_clear: sym("PyErr_Clear")?,
        none: sym("_Py_NoneStruct")?,
        code_type: sym("PyCode_Type")?,
        unicode_type: sym("PyUnicode_Type")?,
        compare_ascii: sym("PyUnicode_CompareWithASCIIString")?,
        cfunction_type: sym("PyCFunction_Type")?,
        thread_state_get: sym("PyThreadState_Get")?,
    };
    let tstates = walker.thread_state_addrs()?;
    if tstates.is_empty() {
        bail!("process {pid} has no Python thread state yet");
    }
    let minor = u32::from(version.minor);
    let plan = match (events_of(minor), profile_target(minor)) {
        (Some(events), _) => {
            let site = sym("_Py_HandlePending")?;
            let interpreters = [
                sym("PyInterpreterState_Get")?,
                sym("PyInterpreterState_Main")?,
            ];
            let mut text = vec![0u8; SCAN];
            if mem.read(site, &mut text).is_err() {
                text.truncate(64);
                mem.read(site, &mut text)
                    .with_context(|| format!("reading _Py_HandlePending at {site:#x}"))?;
            }
            let breaker = match version.minor {
                12 => {
                    let (gil, eb) = ceval_312(mem, tstates[0])?;
                    if gil == 0 || eb > 0xff {
                        bail!(
                            "CPython {version}: its interpreter state does not have the 3.12 layout \
                             the hook engine knows (ceval.gil {gil:#x}, eval_breaker {eb:#x})"
                        );
                    }
                    Breaker::Interpreter(EVAL_BREAKER_312, CALLS_TO_DO_312)
                }
                _ => Breaker::ThreadState(EVAL_BREAKER_313),
            };
            Plan::Monitoring {
                events,
                site,
                text,
                breaker,
                interpreters,
            }
        }
        (None, Some(target)) => Plan::Profile(target),
        (None, None) => {
            return Err(NotTraceable(format!("CPython {version}: no hook route known")).into())
        }
    };

    let inj = Injector::find(pid, tid, mem)?.guarded(guard.as_deref(), mem);
    let route = match &plan {
        Plan::Monitoring { events, .. } => Route::Monitoring {
            events: events.to_vec(),
        },
        Plan::Profile(target) => Route::Profile(target.layout),
    };
    // The hook page for these three addresses, with the detour after it on the
    // monitoring route (within rel32 reach of the safe point).
    let build =
        |addr: u64, state_addr: u64, ring_addr: u64| -> Result<(HookCode, Option<Detour>)> {
            let hook = build_hook(&HookParams {
                addr,
                state_addr,
                ring_addr,
                capacity: UNITS,
                symbols,
                route: route.clone(),
                code_fields: walker.code_field_offsets().map(|o| o as u32),
                str_ascii_data: ascii_data(minor),
            })?;
            let detour = match (&plan, hook.installer) {
                (
                    Plan::Monitoring {
                        site,
                        text,
                        interpreters: [interpreter_get, interpreter_main],
                        ..
                    },
                    Some(installer),
                ) => {
                    let detour_addr = (addr + hook.bytes.len() as u64 + 15) & !15;
                    let targets = BranchTargets::scan(text, *site);
                    let calls = DetourCalls {
                        installer,
                        interpreter_get: *interpreter_get,
                        interpreter_main: *interpreter_main,
                    };
                    let detour =
                        build_detour(detour_addr, *site, text, &targets, state_addr, calls)?;
                    if detour_addr + detour.code.len() as u64 > addr + REGION {
                        bail!("the hook does not fit its {REGION} bytes");
                    }
                    Some(detour)
                }
                _ => None,
            };
            if hook.bytes.len() as u64 > REGION {
                bail!("the hook does not fit its {REGION} bytes");
            }
            Ok((hook, detour))
        };
    let (earlier, mut notes) = reuse::find(mem, &read_maps(pid)?, rips);
    let mut again = None;
    for e in earlier {
        match build(e.addr, e.state_addr, e.ring_addr) {
            Ok((hook, detour)) if same_code(mem, &hook, detour.as_ref()) => {
                again = Some((e, hook, detour));
                break;
            }
            Ok(_) => notes.push(format!(
                "the earlier hook at {:#x}: built otherwise (another pyprobe version)",
                e.addr
            )),
            Err(why) => notes.push(format!("the earlier hook at {:#x}: {why:#}", e.addr)),
        }
    }
    const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;
    const ANON: i32 = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let (state_addr, ring_addr, mut mapping, hook, detour, resume) = match again {
        Some((e, hook, detour)) => {
            // Nothing is written into the page: its bytes are what was built.
            let (ring_addr, mapping) = hook_ring(pid, &inj, e.state_addr, Some(e.ring_addr))?;
            if e.resume == Resume::Afresh {
                mem.write(e.state_addr, &[0u8; NAME_AT as usize])?;
            }
            // This pyprobe has been sent nothing yet (every thread is stopped,
            // none inside the page).
            mem.write(
                e.state_addr + ST_TABLES as u64,
                &vec![0u8; STATE_LEN - ST_TABLES],
            )?;
            notes.push(format!(
                "the hook page ({:#x}), state page and ring of an earlier pyprobe are used again \
                 ({}; the ring replaced by a new one where it stood)",
                e.addr,
                match e.resume {
                    Resume::Registered => "its hook still in, resumed",
                    Resume::Afresh => "its hook out, put in afresh",
                }
            ));
            (e.state_addr, ring_addr, mapping, hook, detour, e.resume)
        }
        None => {
            // The state pages: a forked child sees them all zero, so its
            // callbacks uninstall.
            let state_addr = inj.mmap(0, STATE_LEN as u64, RW, ANON, -1)?;
            inj.call(
                "madvise(MADV_WIPEONFORK)",
                libc::SYS_madvise,
                [state_addr, STATE_LEN as u64, MADV_WIPEONFORK, 0, 0, 0],
            )
            .context("the hook needs MADV_WIPEONFORK (Linux 4.14+) so that a forked child never writes into the parent's ring")?;
            mem.write(state_addr + NAME_AT, RING_NAME)?;
            let (ring_addr, mapping) = hook_ring(pid, &inj, state_addr, None)?;
            let addr = match &plan {
                Plan::Monitoring { site, .. } => place_near(pid, &inj, *site)?,
                Plan::Profile(_) => inj.mmap(
                    0,
                    REGION,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                )?,
            };
            let (hook, detour) = build(addr, state_addr, ring_addr)?;
            mem.write(addr, &hook.bytes)?;
            if let Some(d) = &detour {
                mem.write(d.addr, &d.code)?;
            }
            (state_addr, ring_addr, mapping, hook, detour, Resume::Afresh)
        }
    };
    // SAFETY: the mapping lives as long as the reader (both in the HookProc).
    let reader = unsafe { RingReader::new(mapping.as_mut_ptr(), mapping.len()) }
        .map_err(|e| anyhow!("{e}"))?;
    // A hook still in needs no installer: its detour stays out.
    let detour = detour.filter(|_| resume == Resume::Afresh);
    mem.write(state_addr + ST_ON as u64, &1u64.to_le_bytes())?;
    // The guardian clears `on` if pyprobe dies (the callbacks then uninstall), and
    // puts the safe point's bytes back; first it clears the ring's `alive`, so
    // that a callback waiting for room goes on at once.
    if let Some(g) = guard {
        tell_guardian(g, pid, ring_addr, state_addr)?;
        if let Some(d) = &detour {
            g.tell_ring_site(pid, d.site, &d.original, &d.patch)?;
        }
    }
    let mut taken = Vec::new();
    match &plan {
        Plan::Monitoring { .. } if resume == Resume::Registered => {}
        Plan::Monitoring { breaker, .. } => {
            let Some(d) = &detour else {
                bail!("the monitoring route has no detour");
            };
            mem.write(state_addr + ST_ARMED as u64, &1u64.to_le_bytes())?;
            if let Some(&rip) = rips.iter().find(|&&r| d.splits(r)) {
                bail!("a thread stands at {rip:#x}, inside the entry of _Py_HandlePending");
            }
            let mut now = vec![0u8; d.original.len()];
            mem.read(d.site, &mut now)?;
            if now != d.original {
                bail!("_Py_HandlePending changed while the hook was being built");
            }
            debug_assert!(d.patch.len() >= JMP_LEN);
            mem.write(d.site, &d.patch)?;
            raise(mem, &tstates, *breaker)?;
        }
        Plan::Profile(target) => {
            let cb = hook.callbacks[0];
            if cb & !0xfff != hook.addr {
                bail!("the hook's profile function at {cb:#x} is not in its first page");
            }
            // The exit callback is registered by the first event (GIL held); a hook
            // still in has its own.
            if resume == Resume::Afresh {
                mem.write(state_addr + ST_AT_EXIT_RETRY as u64, &1u64.to_le_bytes())?;
            }
            taken = set_profiles(mem, target, &tstates, cb)?;
            mem.write(state_addr + ST_STATUS as u64, &STATUS_OK.to_le_bytes())?;
        }
    }
    Ok(Installed {
        reader,
        mapping,
        ring_addr,
        state_addr,
        hook,
        detour,
        breaker: match plan {
            Plan::Monitoring { breaker, .. } => Some(breaker),
            Plan::Profile(_) => None,
        },
        profile: match plan {
            Plan::Profile(target) => Some(target),
            Plan::Monitoring { .. } => None,
        },
        taken,
        notes,
        walker,
    })
}

/// Tells the guardian, should pyprobe die, to clear the `alive` word of the hook's
/// ring in `pid` (a callback waiting for room goes on at once), then its `on` word
/// (the callbacks then uninstall).
pub(super) fn tell_guardian(
    g: &mut Guardian,
    pid: i32,
    ring_addr: u64,
    state_addr: u64,
) -> Result<()> {
    g.tell(Op::RingServed, pid, ring_addr + H_ALIVE as u64)
        .map_err(|e| anyhow!("telling the guardian about the hook's ring: {e}"))?;
    g.tell_ring_site(
        pid,
        state_addr + ST_ON as u64,
        &0u64.to_le_bytes(),
        &1u64.to_le_bytes(),
    )?;
    Ok(())
}

/// Whether the process holds `hook` (and `detour`) byte for byte where they go.
fn same_code(mem: &ProcessMemory, hook: &HookCode, detour: Option<&Detour>) -> bool {
    let holds = |at: u64, code: &[u8]| {
        let mut now = vec![0u8; code.len()];
        mem.read(at, &mut now).is_ok() && now == code
    };
    holds(hook.addr, &hook.bytes) && detour.is_none_or(|d| holds(d.addr, &d.code))
}

/// Makes the hook's ring in `pid` (see `tracer::ring_engine::setup::map_ring`), at
/// `over` when given (an earlier ring of the same length), named by the state
/// page's marker; a forked child does not get it.
pub(super) fn hook_ring(
    pid: i32,
    inj: &Injector,
    state_addr: u64,
    over: Option<u64>,
) -> Result<(u64, MmapMut)> {
    let (ring_addr, mapping) = map_ring(inj, pid, state_addr + NAME_AT, over, UNITS, Slots::Units)?;
    let bytes = mapping.len() as u64;
    inj.call(
        "madvise(MADV_DONTFORK)",
        libc::SYS_madvise,
        [ring_addr, bytes, MADV_DONTFORK, 0, 0, 0],
    )?;
    Ok((ring_addr, mapping))
}

/// `sizeof(PyASCIIObject)` of CPython 3.`minor`: where a compact ASCII `str`'s text
/// starts (3.12 dropped its `wstr`).
pub(crate) fn ascii_data(minor: u32) -> i32 {
    if minor >= 12 {
        40
    } else {
        48
    }
}

/// How the hook goes into this interpreter.
enum Plan {
    /// 3.12+: the detour at `_Py_HandlePending` (`text`: its first bytes) runs the
    /// installer, which registers with `sys.monitoring`.
    Monitoring {
        events: &'static [(u32, u32)],
        site: u64,
        text: Vec<u8>,
        breaker: Breaker,
        /// `PyInterpreterState_Get` and `PyInterpreterState_Main`, which the
        /// detour calls.
        interpreters: [u64; 2],
    },
    /// 3.7 to 3.11: pyprobe sets each thread's profile function.
    Profile(ProfileTarget),
}

/// Sets the profile function `cb` in every thread state of `tstates` whose slot is
/// free (every thread stopped). Returns the thread states whose slot the target's
/// own profiler holds. A thread state that does not read as one is an error when
/// it is the only one; others are skipped (one may be half made or freed).
pub(crate) fn set_profiles(
    mem: &mut ProcessMemory,
    target: &ProfileTarget,
    tstates: &[u64],
    cb: u64,
) -> Result<Vec<u64>> {
    let mut taken = Vec::new();
    let mut first_error = None;
    let mut set = 0;
    for &t in tstates {
        let done = match target.slot(mem, t, cb) {
            Ok(Slot::Hooked) => Ok(true),
            Ok(Slot::Taken) => {
                taken.push(t);
                Ok(false)
            }
            Ok(Slot::Free) => target.set(mem, t, cb).map(|()| true),
            Err(e) => Err(e),
        };
        match done {
            Ok(true) => set += 1,
            Ok(false) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if set == 0 && taken.is_empty() => {
            Err(e.context("setting the hook as profile function"))
        }
        _ => Ok(taken),
    }
}

/// Sends the eval loop of every thread state to `_Py_HandlePending` at its next
/// check. Only with every thread stopped: the word is also updated by the
/// interpreter's own atomic operations, and a read-modify-write from outside must
/// not race them.
pub(crate) fn raise(mem: &mut ProcessMemory, tstates: &[u64], breaker: Breaker) -> Result<()> {
    match breaker {
        Breaker::Interpreter(offset, calls_to_do) => {
            let mut interps: Vec<u64> = tstates
                .iter()
                .filter_map(|&t| mem.read_u64(t + TSTATE_INTERP).ok())
                .filter(|&i| i != 0)
                .collect();
            interps.sort_unstable();
            interps.dedup();
            for interp in interps {
                mem.write(interp + calls_to_do, &1u32.to_le_bytes())?;
                let mut word = [0u8; 4];
                mem.read(interp + offset, &mut word)?;
                let v = u32::from_le_bytes(word) | 1;
                mem.write(interp + offset, &v.to_le_bytes())?;
            }
        }
        Breaker::ThreadState(offset) => {
            for &t in tstates {
                let v = mem.read_u64(t + offset)? | CALLS_TO_DO_BIT;
                mem.write(t + offset, &v.to_le_bytes())?;
            }
        }
    }
    Ok(())
}

/// Maps the hook's region (read and execute; pyprobe writes it through
/// `/proc/PID/mem`) in a free gap within rel32 reach of `site`.
fn place_near(pid: i32, inj: &Injector, site: u64) -> Result<u64> {
    let maps = read_maps(pid)?;
    let want = NearMap {
        code: site..site,
        size: REGION,
        prot: libc::PROT_READ | libc::PROT_EXEC,
        code_name: "_Py_HandlePending",
        what: "the hook",
    };
    map_near(inj, &maps, &want)
}
