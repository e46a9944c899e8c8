//! The profile route (CPython 3.7 to 3.11): pyprobe sets the hook as each thread's C
//! profile function, the slot `PyEval_SetProfile` fills, by writing the two fields
//! that call sets (`c_profilefunc`, and the `use_tracing` flag the eval loop tests)
//! into each thread state, with every thread of the process stopped.
//!
//! Why this is safe: those fields are only written by their own thread, holding
//! the GIL, in `PyEval_SetProfile` and around a tracing call (which recomputes the
//! flag from `c_profilefunc` as it returns); a thread stopped anywhere in those
//! ends up with its own choice or with the hook, never with a half-written state.
//! Nothing in the target is called, so no thread can be caught inside the
//! allocator or a lock. A thread whose slot holds someone else's profile function
//! (the target's own `cProfile`, `sys.setprofile`) is left alone and reported: the
//! target keeps its profiler, and pyprobe traces that thread again once the slot is
//! free. A slot holding the hook of an earlier pyprobe (idle since it left) is
//! taken over.
//!
//! Removal is the hook's own: a callback that finds `on` clear drops its thread's
//! profile function (see `crate::hook`).

use anyhow::{bail, Result};

use crate::hook::{ProfileLayout, ResumeTest, HOOK_MAGIC};
use pyprobe_sdt::process::memory::ProcessMemory;

/// Where a thread state's `use_tracing` flag is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flag {
    /// 3.7 to 3.9: an `int` in the thread state, set to 1.
    InThreadState(u64),
    /// 3.10 and 3.11: in the `CFrame` the thread state's `cframe` (at this offset)
    /// points to (the eval loop's current one, copied into the frames it calls):
    /// an `int` set to 1 (3.10), a `uint8_t` set to 255 (3.11).
    InCFrame {
        cframe: u64,
        value: u8,
        width: usize,
    },
}

/// The thread-state layout of one version (release builds, from compiling
/// against each version's headers with `Py_BUILD_CORE`, as the walker's offsets
/// are; the same values in pyenv's and Debian's builds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProfileTarget {
    pub(crate) layout: ProfileLayout,
    flag: Flag,
    /// `offsetof(PyThreadState, tracing)`: nonzero inside a tracing call.
    tracing: u64,
}

/// The profile route's layout for CPython 3.`minor`, `None` outside 3.7 to 3.11.
pub(crate) fn profile_target(minor: u32) -> Option<ProfileTarget> {
    let code_flags = match minor {
        7 => 32,
        8..=10 => 36,
        _ => 48,
    };
    let resume = match minor {
        7..=9 => ResumeTest::Lasti(104),
        10 => ResumeTest::Lasti(96),
        _ => ResumeTest::PrevInstr(56),
    };
    let (profile_func, flag, frame_via) = match minor {
        7..=9 => (56, Flag::InThreadState(48), None),
        10 => (
            56,
            Flag::InCFrame {
                cframe: 48,
                value: 1,
                width: 4,
            },
            None,
        ),
        11 => (
            64,
            Flag::InCFrame {
                cframe: 56,
                value: 255,
                width: 1,
            },
            Some(24),
        ),
        _ => return None,
    };
    Some(ProfileTarget {
        layout: ProfileLayout {
            profile_func,
            frame_via,
            frame_code: 32,
            code_flags,
            resume,
        },
        flag,
        tracing: 44,
    })
}

/// Whether `func` is the profile function of a pyprobe hook page (this one or one
/// an earlier pyprobe left): the function lies in the page's first 4 KiB.
fn is_pyprobe_hook(mem: &ProcessMemory, func: u64) -> bool {
    let mut magic = [0u8; 8];
    mem.read(func & !0xfff, &mut magic).is_ok() && &magic == HOOK_MAGIC
}

/// What a thread state's profile slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// This hook.
    Hooked,
    /// Nothing, or the hook of a pyprobe that left: the hook can go in.
    Free,
    /// The target's own profile function.
    Taken,
}

impl ProfileTarget {
    /// What the profile slot of thread state `tstate` holds (a read: safe while the
    /// target runs).
    pub(crate) fn slot(&self, mem: &ProcessMemory, tstate: u64, hook: u64) -> Result<Slot> {
        let func = mem.read_u64(tstate + self.layout.profile_func as u64)?;
        Ok(if func == hook {
            Slot::Hooked
        } else if func == 0 || is_pyprobe_hook(mem, func) {
            Slot::Free
        } else {
            Slot::Taken
        })
    }

    /// Whether thread state `tstate` can take the hook now: on 3.10 and 3.11 it has
    /// a current `CFrame` (3.11 sets it only as the interpreter starts running code).
    pub(crate) fn ready(&self, mem: &ProcessMemory, tstate: u64) -> bool {
        match self.flag {
            Flag::InThreadState(_) => true,
            Flag::InCFrame { cframe, .. } => mem.read_u64(tstate + cframe).is_ok_and(|c| c != 0),
        }
    }

    /// Makes `hook` the profile function of thread state `tstate`. Only with every
    /// thread of the process stopped.
    pub(crate) fn set(&self, mem: &mut ProcessMemory, tstate: u64, hook: u64) -> Result<()> {
        let tracing = mem.read_u64(tstate + self.tracing)? as u32 as i32;
        if !(0..=64).contains(&tracing) {
            bail!("thread state {tstate:#x} has `tracing` {tracing}: not the layout pyprobe knows");
        }
        // The flag first checked, then the function, then the flag: the eval
        // loop tests the flag, then the function.
        let flag_at = match self.flag {
            Flag::InThreadState(at) => tstate + at,
            Flag::InCFrame { cframe, .. } => {
                let at = mem.read_u64(tstate + cframe)?;
                if at == 0 {
                    bail!("thread state {tstate:#x} has no current CFrame");
                }
                at
            }
        };
        let (value, width) = match self.flag {
            Flag::InThreadState(_) => (1u8, 4usize),
            Flag::InCFrame { value, width, .. } => (value, width),
        };
        let mut now = [0u8; 4];
        mem.read(flag_at, &mut now[..width])?;
        let current = u32::from_le_bytes(now);
        if current != 0 && current != u32::from(value) {
            bail!(
                "thread state {tstate:#x}: its use_tracing flag at {flag_at:#x} holds {current}: \
                 not the layout pyprobe knows"
            );
        }
        mem.write(
            tstate + self.layout.profile_func as u64,
            &hook.to_le_bytes(),
        )?;
        // Inside a tracing call the flag is recomputed from the function as the
        // call returns (and must stay clear until then).
        if tracing == 0 {
            let mut bytes = [0u8; 4];
            bytes[0] = value;
            mem.write(flag_at, &bytes[..width])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_version_of_the_route_has_a_layout_and_no_other() {
        for minor in 7..=11 {
            assert!(profile_target(minor).is_some(), "3.{minor}");
        }
        for minor in [6, 12, 13, 14, 15] {
            assert!(profile_target(minor).is_none(), "3.{minor}");
        }
        assert_eq!(profile_target(11).unwrap().layout.frame_via, Some(24));
    }
}
