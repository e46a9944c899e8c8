//! Where the eval loop's code is: its symbol, and the parts of it a compiler moved
//! out of that symbol's range.
//!
//! GCC splits a function into a hot part, named by its symbol, and parts it
//! reaches by jumps (`function.cold`, or with profile feedback most of the body),
//! each with unwind information of its own but no dynamic symbol. Debian's
//! CPython 3.14 and 3.15 keep about 1 KiB under `_PyEval_EvalFrameDefault`: the
//! dispatch loop runs in a part of 80 KiB that only the hot part jumps to. A
//! thread calling C from Python returns into that part, so both are the eval loop.
//!
//! A part is found from the symbol's own code: every direct jump out of its
//! range to code of no other function, widened to the unwind entry (FDE) that
//! covers it. Code of no other function: no symbol covers it, or only the
//! function's own local ones (`name.cold`, kept in unstripped builds); a tail
//! call lands on another function's symbol and is no part. Nothing read from the
//! object is trusted: every loop is bounded.

use std::ops::Range;

use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, UnwindSection};
use iced_x86::{Decoder, DecoderOptions, FlowControl, OpKind};

use super::object_file::ObjectFile;

/// Largest hot part decoded (the eval loop of every CPython is under 200 KiB).
const MAX_FUNCTION_BYTES: u64 = 4 << 20;
/// Most parts kept besides the symbol's.
const MAX_PARTS: usize = 16;
/// Most unwind entries read from `.eh_frame` (CPython has about 12,000).
const MAX_FDES: usize = 2_000_000;

/// The link-time ranges of `name`'s code: its symbol's, then the parts it jumps
/// to. Empty when the object has no such symbol.
pub(crate) fn function_parts(object: &ObjectFile, name: &str) -> Vec<Range<u64>> {
    let Some(hot) = object.symbols.range_of(name) else {
        return Vec::new();
    };
    let mut parts = vec![hot.clone()];
    let own = |range: &Range<u64>| {
        object
            .symbols
            .names_over(range)
            .all(|symbol| is_part_name(symbol, name))
    };
    let targets = jumps_out(object, &hot, |target| {
        own(&(target..target.saturating_add(1)))
    });
    if targets.is_empty() {
        return parts;
    }
    for fde in unwind_ranges(object) {
        if parts.len() > MAX_PARTS {
            break;
        }
        if targets.iter().any(|t| fde.contains(t))
            && !fde.contains(&hot.start)
            && own(&fde)
            && !parts.contains(&fde)
        {
            parts.push(fde);
        }
    }
    parts
}

/// Whether `symbol` names a part GCC split from `function` (`function.cold`,
/// `function.cold.1`).
fn is_part_name(symbol: &str, function: &str) -> bool {
    symbol
        .strip_prefix(function)
        .is_some_and(|rest| rest.starts_with(".cold"))
}

/// Targets of the direct jumps (not calls) in `range` that land outside it, on
/// code `own` accepts.
fn jumps_out(object: &ObjectFile, range: &Range<u64>, own: impl Fn(u64) -> bool) -> Vec<u64> {
    let (Some(text), Some(svma)) = (&object.sections.text, &object.sections.text_svma) else {
        return Vec::new();
    };
    if range.start < svma.start
        || range.end > svma.end
        || range.end.saturating_sub(range.start) > MAX_FUNCTION_BYTES
    {
        return Vec::new();
    }
    let from = (range.start - svma.start) as usize;
    let to = (range.end - svma.start) as usize;
    let Some(code) = text.get(from..to) else {
        return Vec::new();
    };
    let mut targets = Vec::new();
    let mut decoder = Decoder::with_ip(64, code, range.start, DecoderOptions::NONE);
    while decoder.can_decode() {
        let instruction = decoder.decode();
        let jump = matches!(
            instruction.flow_control(),
            FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch
        );
        if !jump || instruction.op0_kind() != OpKind::NearBranch64 {
            continue;
        }
        let target = instruction.near_branch_target();
        if !range.contains(&target)
            && svma.contains(&target)
            && !targets.contains(&target)
            && own(target)
            && targets.len() < 4 * MAX_PARTS
        {
            targets.push(target);
        }
    }
    targets
}

/// The code ranges of the object's unwind entries, link-time.
fn unwind_ranges(object: &ObjectFile) -> Vec<Range<u64>> {
    let s = &object.sections;
    let (Some(data), Some(svma)) = (&s.eh_frame, &s.eh_frame_svma) else {
        return Vec::new();
    };
    let eh_frame = EhFrame::new(data, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(svma.start);
    if let Some(text) = &s.text_svma {
        bases = bases.set_text(text.start);
    }
    let mut ranges = Vec::new();
    let mut entries = eh_frame.entries(&bases);
    while ranges.len() < MAX_FDES {
        let Ok(Some(entry)) = entries.next() else {
            break;
        };
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) =
            partial.parse(|section, bases, offset| section.cie_from_offset(bases, offset))
        else {
            continue;
        };
        let start = fde.initial_address();
        if let Some(end) = start.checked_add(fde.len()) {
            ranges.push(start..end);
        }
    }
    ranges
}

#[cfg(test)]
mod tests;
