//! Whether the interpreter still holds pyprobe's `sys.monitoring` tool, read from
//! outside: `sys.monitoring` is the program's too, and a program that frees the
//! tool id or registers its own callback over pyprobe's stops the trace without a
//! record lost. The recording must say so (a caveat), not look whole.
//!
//! CPython 3.12 to 3.15 keep, in each interpreter's state,
//! `PyObject *monitoring_callables[8][EVENTS]` followed directly by
//! `PyObject *monitoring_tool_names[8]`. Neither offset is published before 3.15,
//! so the slots are found once the hook is in: the installer kept the function
//! object it registered for each event ([`ST_CALLBACKS`]), the interpreter state
//! holds each exactly in tool 4's row, one word per event number; the name slot
//! lies `EVENTS` rows on, and must hold the `str` "pyprobe" (which pins `EVENTS`).
//! The table of which tools want which event (`_Py_GlobalMonitors monitors`, a
//! byte per event) lies a fixed distance before the callbacks, and tells a program
//! that turned pyprobe's events off (`set_events(4, 0)`).

use pyprobe_sdt::process::memory::ProcessMemory;
use pyprobe_sdt::tracer::guardian::Guardian;

use crate::hook::{events_of, ST_CALLBACKS, TOOL_ID};
use crate::python::walker::Walker;

/// Most bytes of an interpreter's state searched (3.12 to 3.15: well under
/// 512 KiB, the main interpreter being part of `_PyRuntime`).
const SEARCH: usize = 1 << 20;
/// Bytes read at a time while searching.
const CHUNK: usize = 64 << 10;
/// The range of `_PY_MONITORING_EVENTS` tried (17 on 3.12 and 3.13, 19 on 3.14 and 3.15).
const EVENT_COUNTS: std::ops::RangeInclusive<u64> = 15..=32;
/// How far `monitors` lies before `monitoring_callables` on 3.12 to 3.15: its 15
/// or 16 bytes and two one-byte flags, rounded up to 24, then two `Py_ssize_t`
/// thread counts.
const MONITORS_BEFORE_CALLABLES: u64 = 40;
/// Bytes of `monitors` read: every ungrouped event (15 on 3.12 and 3.13, whose
/// 16th byte is a `bool` flag that never has bit 4 set; 16 on 3.14 and 3.15).
const MONITORS_READ: usize = 16;
/// Most threads a sane `sys_profiling_threads` or `sys_tracing_threads` counts.
const MOST_THREADS: u64 = 1 << 20;

/// The numbers of the events the hook's installer registers on the interpreter
/// `walker` reads, in its order (none before 3.12).
pub(super) fn monitoring_events(walker: &Walker) -> Vec<u32> {
    events_of(u32::from(walker.version().minor))
        .unwrap_or_default()
        .iter()
        .map(|&(ev, _)| ev)
        .collect()
}

/// The slots of pyprobe's tool in an interpreter's state, and what they held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ToolSlots {
    /// `monitoring_tool_names[4]`, and the `str` it held when found.
    name: (u64, u64),
    /// `monitoring_callables[4][event]`, and pyprobe's function object.
    callbacks: Vec<(u64, u64)>,
    /// `monitors.tools`, and pyprobe's events (their numbers), when the table was
    /// found where the layout puts it (each of them wanted by tool 4 when the
    /// hook had just registered them).
    monitors: Option<(u64, Vec<u32>)>,
}

/// What the program did to pyprobe's tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ToolLost {
    /// The tool id was freed (and perhaps taken by another name).
    Freed,
    /// A callback of pyprobe's was replaced or taken off.
    Replaced,
    /// The tool's events were turned off (`set_events`), its callbacks left.
    EventsOff,
}

impl ToolLost {
    /// The caveat the recording gets.
    pub(super) fn caveat(self) -> String {
        match self {
            ToolLost::Freed => format!(
                "the program freed sys.monitoring tool {TOOL_ID}, which pyprobe's hook held \
                 (free_tool_id), or took every callback of it off: calls made after that are not \
                 traced"
            ),
            ToolLost::Replaced => format!(
                "the program replaced a callback of pyprobe's sys.monitoring tool {TOOL_ID} \
                 (register_callback): calls made while it was off are not traced"
            ),
            ToolLost::EventsOff => format!(
                "the program turned off events of pyprobe's sys.monitoring tool {TOOL_ID} \
                 (set_events): calls made while they were off are not traced"
            ),
        }
    }
}

/// What a first look at the interpreter's state found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum FirstLook {
    /// The tool is pyprobe's, its slots known.
    Held(ToolSlots),
    /// The program took it already (it may act as soon as the installer is done).
    Lost(ToolLost),
    /// The slots cannot be told for sure: nothing will be said.
    Unknown,
}

impl ToolSlots {
    /// Looks for the slots in the state of interpreter `interp`, the hook
    /// installed there with the events `events` (their numbers, in the
    /// installer's order), its state page at `state_addr`. The search is by value,
    /// so it does not depend on the layout; the layout only pins the name slot.
    pub(super) fn look(
        mem: &ProcessMemory,
        walker: &Walker,
        interp: u64,
        state_addr: u64,
        events: &[u32],
    ) -> FirstLook {
        let functions: Option<Vec<u64>> = (0..events.len())
            .map(|k| {
                mem.read_u64(state_addr + (ST_CALLBACKS + 8 * k) as u64)
                    .ok()
            })
            .collect();
        match functions {
            Some(functions) => Self::look_for(mem, walker, interp, &functions, events),
            None => FirstLook::Unknown,
        }
    }

    /// [`ToolSlots::look`] for the function objects `functions` the installer
    /// registered, one per event of `events` (a forked child's state page holds
    /// none: its parent's words tell them).
    pub(super) fn look_for(
        mem: &ProcessMemory,
        walker: &Walker,
        interp: u64,
        functions: &[u64],
        events: &[u32],
    ) -> FirstLook {
        if functions.is_empty() || functions.contains(&0) {
            return FirstLook::Unknown;
        }
        let Some(found) = search(mem, interp, functions) else {
            return FirstLook::Unknown;
        };
        // (event, slot, function) of each callback the interpreter still holds.
        let held: Vec<(u64, u64, u64)> = events
            .iter()
            .zip(&found)
            .zip(functions)
            .filter_map(|((&ev, slot), &f)| slot.map(|s| (u64::from(ev), s, f)))
            .collect();
        // None held: the program freed the tool (3.13+ clears its callbacks) or
        // registered over each.
        let Some(&(first_event, first_slot, _)) = held.first() else {
            return FirstLook::Lost(ToolLost::Freed);
        };
        // One row: each event's slot one word per event number from the first's.
        let in_row = held.iter().all(|&(ev, slot, _)| {
            slot.wrapping_sub(first_slot) == ev.wrapping_sub(first_event).wrapping_mul(8)
        });
        let Some(last_event) = events.iter().max().map(|&e| u64::from(e)) else {
            return FirstLook::Unknown;
        };
        if !in_row {
            return FirstLook::Unknown;
        }
        let tool = u64::from(TOOL_ID);
        let name = EVENT_COUNTS
            .filter(|&count| count > last_event)
            .find_map(|count| {
                let row = first_slot.checked_sub(first_event * 8)?;
                let table = row.checked_sub(tool * count * 8)?;
                if table < interp {
                    return None;
                }
                let slot = table + 8 * count * 8 + tool * 8;
                let value = mem.read_u64(slot).ok()?;
                (walker.read_str(value).as_deref() == Some("pyprobe"))
                    .then_some(((slot, value), table))
            });
        match name {
            Some((name, table)) if held.len() == events.len() => FirstLook::Held(ToolSlots {
                name,
                callbacks: held.into_iter().map(|(_, slot, f)| (slot, f)).collect(),
                monitors: monitors_at(mem, table, events, ungrouped_events(walker)),
            }),
            Some(_) => FirstLook::Lost(ToolLost::Replaced),
            // Callbacks in place, no slot naming the tool "pyprobe": the id was
            // freed (3.12 leaves the callbacks) and perhaps taken by another name.
            None => FirstLook::Lost(ToolLost::Freed),
        }
    }

    /// What the program has done to the tool since it was found, if anything
    /// (an unreadable slot tells nothing). The name is read, not only its
    /// pointer: a name the program gives the freed id may take the freed
    /// "pyprobe" string's address.
    pub(super) fn lost(&self, mem: &ProcessMemory, walker: &Walker) -> Option<ToolLost> {
        let holds = |(slot, value): (u64, u64)| mem.read_u64(slot).map_or(true, |v| v == value);
        let named = match mem.read_u64(self.name.0) {
            Ok(value) => walker.read_str(value).as_deref() == Some("pyprobe"),
            Err(_) => true,
        };
        if !named {
            return Some(ToolLost::Freed);
        }
        if !self.callbacks.iter().all(|&c| holds(c)) {
            return Some(ToolLost::Replaced);
        }
        let (at, events) = self.monitors.as_ref()?;
        let wanted = read_monitors(mem, *at)?;
        events
            .iter()
            .any(|&ev| !wants(&wanted, ev))
            .then_some(ToolLost::EventsOff)
    }

    /// Tells the guardian the words that hold the tool, when its events are off:
    /// should pyprobe die, the guardian frees it (see [`ToolSlots::free_silenced`]).
    pub(super) fn tell_guardian(&self, pid: i32, guardian: &mut Guardian) -> std::io::Result<()> {
        let Some((at, _)) = &self.monitors else {
            return Ok(());
        };
        let words: Vec<(u64, u64)> = self
            .callbacks
            .iter()
            .copied()
            .chain(std::iter::once(self.name))
            .collect();
        guardian.tell_tool_silenced(pid, *at, (TOOL_ID as u8, MONITORS_READ as u8), &words)
    }

    /// Gives the tool id back from outside (every thread stopped) when the
    /// program turned every event of it off while pyprobe still holds it, with
    /// its callbacks: the hook gives the id back from a callback, which then never
    /// runs again. As `free_tool_id` does, the callbacks and the name are cleared,
    /// but their references are left (a stopped thread may be about to use one),
    /// so a few small objects leak. Returns whether it did.
    pub(super) fn free_silenced(&self, mem: &mut ProcessMemory, walker: &Walker) -> bool {
        let Some((at, _)) = &self.monitors else {
            return false;
        };
        let silenced =
            read_monitors(mem, *at).is_some_and(|w| (0..w.len() as u32).all(|ev| !wants(&w, ev)));
        if !silenced || self.lost(mem, walker) != Some(ToolLost::EventsOff) {
            return false;
        }
        let zero = 0u64.to_le_bytes();
        let cleared = self
            .callbacks
            .iter()
            .all(|&(slot, _)| mem.write(slot, &zero).is_ok());
        cleared && mem.write(self.name.0, &zero).is_ok()
    }
}

/// `monitors.tools` of the interpreter whose callback table starts at `table`, if
/// it reads as one: the two thread counts after it plausible, and tool 4 wanting
/// each of `events` (just registered), or, the program having turned them off
/// before this first look, none at all, the table's shape then checked instead:
/// `ungrouped` event bytes, the two `bool`s after them, zero padding to 24 bytes.
fn monitors_at(
    mem: &ProcessMemory,
    table: u64,
    events: &[u32],
    ungrouped: usize,
) -> Option<(u64, Vec<u32>)> {
    let at = table.checked_sub(MONITORS_BEFORE_CALLABLES)?;
    let wanted = read_monitors(mem, at)?;
    let counts_sane = [24, 32]
        .iter()
        .all(|&off| mem.read_u64(at + off).is_ok_and(|n| n < MOST_THREADS));
    let all_wanted = events.iter().all(|&ev| wants(&wanted, ev));
    (counts_sane && (all_wanted || silenced_table(mem, at, ungrouped)))
        .then(|| (at, events.to_vec()))
}

/// Whether the 24 bytes at `at` read as a `monitors` table in which tool 4 wants
/// no event: `ungrouped` bytes of tool masks (bit 4 clear in each), two `bool`s,
/// then zeros.
fn silenced_table(mem: &ProcessMemory, at: u64, ungrouped: usize) -> bool {
    let mut bytes = [0u8; 24];
    if ungrouped + 2 > bytes.len() || mem.read(at, &mut bytes).is_err() {
        return false;
    }
    let (masks, rest) = bytes.split_at(ungrouped);
    masks.iter().all(|&m| m & (1 << TOOL_ID) == 0)
        && rest[..2].iter().all(|&b| b <= 1)
        && rest[2..].iter().all(|&b| b == 0)
}

/// `_PY_MONITORING_UNGROUPED_EVENTS`: 15 on 3.12 and 3.13, 16 on 3.14 and 3.15.
fn ungrouped_events(walker: &Walker) -> usize {
    if walker.version().minor >= 14 {
        16
    } else {
        15
    }
}

fn read_monitors(mem: &ProcessMemory, at: u64) -> Option<[u8; MONITORS_READ]> {
    let mut bytes = [0u8; MONITORS_READ];
    mem.read(at, &mut bytes).ok().map(|()| bytes)
}

/// Whether tool 4 wants event `ev` in a `monitors.tools` table.
fn wants(tools: &[u8; MONITORS_READ], ev: u32) -> bool {
    tools
        .get(ev as usize)
        .is_some_and(|&mask| mask & (1 << TOOL_ID) != 0)
}

/// The address of the first word equal to each of `values` in the `SEARCH`
/// bytes from `start` (read until unreadable); `None` when not even the first
/// chunk can be read.
fn search(mem: &ProcessMemory, start: u64, values: &[u64]) -> Option<Vec<Option<u64>>> {
    let mut found: Vec<Option<u64>> = vec![None; values.len()];
    let mut left = values.len();
    let mut buf = vec![0u8; CHUNK];
    let mut at = start & !7;
    let end = start.saturating_add(SEARCH as u64);
    while at < end && left > 0 {
        // A chunk running past the mapping is read again a page at a time, up to
        // the first page that cannot be read.
        let read = match mem.read(at, &mut buf) {
            Ok(()) => CHUNK,
            Err(_) => readable_prefix(mem, at, &mut buf),
        };
        for (i, word) in buf[..read].chunks_exact(8).enumerate() {
            let word = u64::from_le_bytes(word.try_into().unwrap_or_default());
            if let Some(k) = values.iter().position(|&v| v == word) {
                if found[k].is_none() {
                    found[k] = Some(at + 8 * i as u64);
                    left -= 1;
                }
            }
        }
        if read == 0 && at == start & !7 {
            return None;
        }
        if read < CHUNK {
            break;
        }
        at += CHUNK as u64;
    }
    Some(found)
}

/// Reads `buf` from `at` a page at a time; returns how many bytes could be read.
fn readable_prefix(mem: &ProcessMemory, at: u64, buf: &mut [u8]) -> usize {
    let page = pyprobe_sdt::process::PAGE_SIZE as usize;
    // The first piece ends at a page boundary.
    let mut done = 0;
    while done < buf.len() {
        let addr = at + done as u64;
        let piece = (page - (addr as usize % page)).min(buf.len() - done);
        if mem.read(addr, &mut buf[done..done + piece]).is_err() {
            break;
        }
        done += piece;
    }
    done
}
