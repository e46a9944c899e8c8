//! Deciding whether a probe site can be rewritten into a 5-byte `jmp rel32`.
//!
//! The site is a 1-byte `nop`. A `jmp rel32` needs 5 bytes, so the
//! instructions after the `nop` are *displaced*: copied (relocated) into the
//! trampoline, which runs them after recording the event. That is only
//! correct if nothing jumps into the middle of the replaced bytes and every
//! displaced instruction behaves the same at its new address.

use iced_x86::{
    Code, Decoder, DecoderError, DecoderOptions, FlowControl, Instruction, Mnemonic, OpKind,
};
use thiserror::Error;

use super::branches::{direct_target, BranchTargets};

/// Bytes the site patch (`jmp rel32`) needs.
pub(crate) const PATCH_LEN: usize = 5;
/// Most bytes a plan replaces: the `nop`, fewer than [`PATCH_LEN`] - 1 bytes
/// of whole instructions, and one more instruction (at most 15 bytes).
pub(crate) const MAX_PLAN_LEN: usize = PATCH_LEN - 1 + 15;

/// Below this, addresses are never mapped (`vm.mmap_min_addr`); a displaced
/// operand pointing there is refused because the assembler uses small
/// numbers as label ids.
const LOW_ADDRESS_LIMIT: u64 = 0x1_0000;

/// What the trampoline does after the relocated instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// Jump back to `site + len`.
    JumpBack,
    /// The last displaced instruction is an unconditional `jmp` or `ret`:
    /// control never falls through, so no jump back.
    Terminates,
    /// The last displaced instruction is a direct `call`: the trampoline
    /// pushes the original return address (`site + len`) and jumps to the
    /// callee, so the callee returns straight to the original code and no
    /// return address ever points into the trampoline.
    Call { target: u64 },
}

/// A site that can be patched, and what the patch displaces.
///
/// Built only by [`qualify_site`], so its fields are consistent.
#[derive(Debug, Clone)]
pub struct SitePlan {
    site: u64,
    original: Vec<u8>,
    displaced: Vec<Instruction>,
    tail: Tail,
}

impl SitePlan {
    /// Address of the `nop`.
    pub(crate) fn site(&self) -> u64 {
        self.site
    }

    /// Bytes replaced, from the `nop` to the end of the last displaced
    /// instruction (5 ..= 19).
    pub fn len(&self) -> usize {
        self.original.len()
    }

    /// Always false: a plan displaces at least [`PATCH_LEN`] bytes.
    pub fn is_empty(&self) -> bool {
        self.original.is_empty()
    }

    /// `site + len`: where the jump back lands.
    pub fn end(&self) -> u64 {
        self.site.wrapping_add(self.original.len() as u64)
    }

    /// The original bytes `[site, site + len)`: write them back to restore.
    pub(crate) fn original(&self) -> &[u8] {
        &self.original
    }

    /// The displaced instructions after the `nop`, with their original addresses.
    pub(crate) fn displaced(&self) -> &[Instruction] {
        &self.displaced
    }

    pub fn tail(&self) -> Tail {
        self.tail
    }
}

/// Whether a thread stopped at `rip` would be broken by patching `plan`:
/// true if `rip` is strictly inside the replaced bytes (at the `nop` itself is fine).
pub fn thread_inside(rip: u64, plan: &SitePlan) -> bool {
    rip > plan.site && rip < plan.end()
}

/// Whether two plans replace overlapping bytes (never patch both).
pub fn plans_overlap(a: &SitePlan, b: &SitePlan) -> bool {
    a.site < b.end() && b.site < a.end()
}

/// Why a site cannot be patched.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SiteRefusal {
    #[error("site {site:#x} is outside the executable segment")]
    OutsideSegment { site: u64 },
    #[error("byte at site {site:#x} is {found:#04x}, not a nop (0x90)")]
    NotNop { site: u64, found: u8 },
    #[error("the segment ends at {end:#x}, before the {PATCH_LEN} bytes the patch needs")]
    PastSegmentEnd { end: u64 },
    #[error("cannot decode the instruction at {addr:#x}")]
    Undecodable { addr: u64 },
    #[error("instruction `{text}` at {addr:#x} cannot be moved: {why}")]
    NotRelocatable {
        addr: u64,
        text: String,
        why: &'static str,
    },
    #[error(
        "`{text}` at {addr:#x} ends control flow after {covered} bytes, fewer than the \
         {PATCH_LEN} the patch needs; the bytes after it may be reached from elsewhere"
    )]
    EndsTooEarly {
        addr: u64,
        text: String,
        covered: usize,
    },
    #[error("a branch elsewhere targets {target:#x}, inside the bytes the patch replaces")]
    BranchIntoPatch { target: u64 },
}

/// Checks the site at `site` in the executable segment `text` (mapped or
/// linked at `text_addr`) and plans its patch. `targets` must come from
/// [`BranchTargets::scan`] of the same segment at the same address (plus,
/// ideally, [`BranchTargets::add_code_pointers`] over the object's data).
pub fn qualify_site(
    text: &[u8],
    text_addr: u64,
    site: u64,
    targets: &BranchTargets,
) -> Result<SitePlan, SiteRefusal> {
    let offset = site
        .checked_sub(text_addr)
        .and_then(|o| usize::try_from(o).ok())
        .filter(|&o| o < text.len())
        .ok_or(SiteRefusal::OutsideSegment { site })?;
    let found = text[offset];
    if found != 0x90 {
        return Err(SiteRefusal::NotNop { site, found });
    }
    let end = text_addr.wrapping_add(text.len() as u64);
    let code = &text[offset + 1..];
    let mut decoder = Decoder::with_ip(64, code, site.wrapping_add(1), DecoderOptions::NONE);
    let mut displaced = Vec::new();
    let mut covered = 1usize;
    let mut tail = Tail::JumpBack;
    // Every instruction is at least one byte, so PATCH_LEN rounds always suffice.
    for _ in 0..PATCH_LEN {
        if covered >= PATCH_LEN || tail != Tail::JumpBack {
            break;
        }
        if !decoder.can_decode() {
            return Err(SiteRefusal::PastSegmentEnd { end });
        }
        let start = decoder.position();
        let instr = decoder.decode();
        let addr = instr.ip();
        if instr.is_invalid() {
            return Err(if decoder.last_error() == DecoderError::NoMoreBytes {
                SiteRefusal::PastSegmentEnd { end }
            } else {
                SiteRefusal::Undecodable { addr }
            });
        }
        let bytes = code.get(start..start + instr.len()).unwrap_or_default();
        covered += instr.len();
        match classify(&instr, bytes)? {
            Kind::Plain => {}
            Kind::Terminator | Kind::Call(_) if covered < PATCH_LEN => {
                return Err(SiteRefusal::EndsTooEarly {
                    addr,
                    text: describe(&instr, bytes),
                    covered,
                });
            }
            Kind::Terminator => tail = Tail::Terminates,
            Kind::Call(target) => tail = Tail::Call { target },
        }
        displaced.push((instr, bytes));
    }
    if covered < PATCH_LEN {
        return Err(SiteRefusal::PastSegmentEnd { end });
    }
    let patch_end = site.wrapping_add(covered as u64);
    for (instr, bytes) in &displaced {
        check_operands(instr, bytes, site, patch_end)?;
    }
    if let Some(target) = targets.strictly_inside(site, patch_end) {
        return Err(SiteRefusal::BranchIntoPatch { target });
    }
    let original = text
        .get(offset..offset + covered)
        .ok_or(SiteRefusal::PastSegmentEnd { end })?;
    Ok(SitePlan {
        site,
        original: original.to_vec(),
        displaced: displaced.into_iter().map(|(i, _)| i).collect(),
        tail,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain,
    Terminator,
    Call(u64),
}

fn refuse(instr: &Instruction, bytes: &[u8], why: &'static str) -> SiteRefusal {
    SiteRefusal::NotRelocatable {
        addr: instr.ip(),
        text: describe(instr, bytes),
        why,
    }
}

/// How a displaced instruction affects control flow, or why it cannot move.
fn classify(instr: &Instruction, bytes: &[u8]) -> Result<Kind, SiteRefusal> {
    if matches!(instr.mnemonic(), Mnemonic::Endbr64 | Mnemonic::Endbr32) {
        return Err(refuse(
            instr,
            bytes,
            "endbr marks an indirect branch target inside the patch",
        ));
    }
    let near = instr.op0_kind() == OpKind::NearBranch64;
    match instr.flow_control() {
        FlowControl::Next => Ok(Kind::Plain),
        FlowControl::ConditionalBranch if near => Ok(Kind::Plain),
        FlowControl::UnconditionalBranch if near => Ok(Kind::Terminator),
        FlowControl::IndirectBranch if instr.code() == Code::Jmp_rm64 => Ok(Kind::Terminator),
        FlowControl::Return if matches!(instr.code(), Code::Retnq | Code::Retnq_imm16) => {
            Ok(Kind::Terminator)
        }
        FlowControl::Call if near => Ok(Kind::Call(instr.near_branch_target())),
        FlowControl::Call => Err(refuse(
            instr,
            bytes,
            "system call or far call: the thread would wait with rip in the trampoline",
        )),
        FlowControl::IndirectCall => Err(refuse(
            instr,
            bytes,
            "indirect call: its operand may depend on rsp, which the emulated call moves",
        )),
        FlowControl::Interrupt => Err(refuse(instr, bytes, "interrupt or trap instruction")),
        FlowControl::XbeginXabortXend => {
            Err(refuse(instr, bytes, "transactional memory instruction"))
        }
        FlowControl::Exception => Err(refuse(instr, bytes, "instruction that always faults")),
        _ => Err(refuse(instr, bytes, "far or unusual control transfer")),
    }
}

/// Refuses operands the relocation would change the meaning of.
fn check_operands(
    instr: &Instruction,
    bytes: &[u8],
    site: u64,
    patch_end: u64,
) -> Result<(), SiteRefusal> {
    let inside = |a: u64| a >= site && a < patch_end;
    if instr.is_ip_rel_memory_operand() {
        let a = instr.ip_rel_memory_address();
        if inside(a) {
            return Err(refuse(
                instr,
                bytes,
                "rip-relative operand refers to the patched bytes",
            ));
        }
        if a < LOW_ADDRESS_LIMIT {
            return Err(refuse(
                instr,
                bytes,
                "rip-relative operand refers to a low address",
            ));
        }
    }
    if let Some(target) = direct_target(instr) {
        if target < LOW_ADDRESS_LIMIT {
            return Err(refuse(instr, bytes, "branch to a low address"));
        }
        if target > site && target < patch_end {
            return Err(SiteRefusal::BranchIntoPatch { target });
        }
    }
    Ok(())
}

/// `Mnemonic [bytes]` for messages (the crate has no disassembly formatter).
fn describe(instr: &Instruction, bytes: &[u8]) -> String {
    let mut text = format!("{:?} [", instr.mnemonic());
    for (i, b) in bytes.iter().enumerate() {
        let sep = if i == 0 { "" } else { " " };
        text.push_str(&format!("{sep}{b:02x}"));
    }
    text.push(']');
    text
}
