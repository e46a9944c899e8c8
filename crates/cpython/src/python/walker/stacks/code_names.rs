//! Naming a frame's code object (file, function, line), and the cache of code
//! objects that spares reading one again: checked against the object on every use
//! and, for captured stacks, once per naming batch. Apart from the walk: stacks
//! captured by ring trampolines and by the hook are named here without one.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use super::{FrameError, Memory, Position, StackReader, MAX_DEPTH};
use crate::python::walker::layout::{FrameLayout, LineTable};
use crate::python::walker::lines;
use crate::python::walker::objects::{
    field_i32, field_u64, plausible_pointer, read_bytes, read_str, read_u64,
};
use crate::python::walker::PyFrame;

/// Code objects remembered; the cache is emptied when it grows past this.
const MAX_CODES: usize = 32 * 1024;
/// Lines remembered per code object.
const MAX_LINES_PER_CODE: usize = 512;

/// What the walker keeps of a code object, checked against the object on each use.
pub(super) struct CodeInfo {
    /// Pointers and first line as last read: a different value means the address now
    /// holds another code object.
    key: [u64; 5],
    file: Arc<str>,
    function: Arc<str>,
    name: Arc<str>,
    table: Option<Box<[u8]>>,
    lines: HashMap<i64, u32>,
    /// The naming batch in which the key was last checked against the target.
    checked_in: u64,
}

impl CodeInfo {
    /// The line of the instruction at byte offset `addr`, from the cache or the
    /// line table (cached, up to [`MAX_LINES_PER_CODE`] per code object).
    fn line_at(&mut self, addr: i64, first_line: u32, table: LineTable) -> u32 {
        if let Some(&line) = self.lines.get(&addr) {
            return line;
        }
        let line = self
            .table
            .as_deref()
            .and_then(|t| match table {
                LineTable::Lnotab => lines::lnotab_line(t, first_line, addr),
                LineTable::Linetable310 => lines::linetable310_line(t, first_line, addr),
                LineTable::Locations => lines::locations_line(t, first_line, addr),
            })
            .unwrap_or(first_line);
        if self.lines.len() < MAX_LINES_PER_CODE {
            self.lines.insert(addr, line);
        }
        line
    }
}

impl<M: Memory> StackReader<M> {
    /// Names frames captured elsewhere (by a ring trampoline), innermost first, as
    /// (code pointer, position): `f_lasti` up to 3.10, the instruction pointer
    /// from 3.11. Returns them outermost first, `None` where a frame cannot be
    /// named: its code object was freed (or the target is gone) before pyprobe ever
    /// read it. Each code object's header is read again and checked against the
    /// cache's key, so an address reused by another code object since the capture
    /// is named afresh; one that holds no code object any more keeps the name it had
    /// when last read.
    pub fn name_captured(&mut self, captured: &[(u64, u64)]) -> Vec<Option<PyFrame>> {
        let mut out = Vec::new();
        let mut header = vec![0u8; self.layout.code_span() as usize];
        for &(code, position) in captured.iter().take(MAX_DEPTH) {
            if !plausible_pointer(code) {
                out.push(None);
                continue;
            }
            let position = match self.layout.frame {
                FrameLayout::Object { lasti_unit, .. } => {
                    Position::Offset((position as i64).wrapping_mul(lasti_unit as i64))
                }
                FrameLayout::Interpreter { .. } => Position::Pointer {
                    ip: position,
                    tlbc_index: None,
                },
            };
            let checked = self.codes.get(&code).map(|c| c.checked_in);
            let frame = if checked == Some(self.batch) {
                self.cached_frame(code, position)
            } else if self.mem.read_exact(code, &mut header).is_ok() {
                match self.py_frame(code, &header, position) {
                    Ok(frame) => {
                        if let Some(info) = self.codes.get_mut(&code) {
                            info.checked_in = self.batch;
                        }
                        Some(frame)
                    }
                    // No code object there now, but the frame ran one there when it
                    // was captured: freed since (a module's code ends with its run;
                    // the allocator overwrites a freed block's first words). The
                    // name this address last had, if it was ever read.
                    Err(FrameError::Skip) => self.cached_frame(code, position),
                    Err(FrameError::Broken) => None,
                }
            } else {
                // The target is gone (it exited with records still in the ring): the
                // name this address last had, validated when it was read.
                self.cached_frame(code, position)
            };
            out.push(frame);
        }
        out.reverse();
        out
    }

    /// The code object a `_PyInterpreterFrame` at `frame` runs (3.11+), and its
    /// file, `co_name` and first line (the frame's `line` is its first line too):
    /// the frame's executable read (tag bits masked), then the code object's header,
    /// checked as on every walk (a code object's type, the cache's key). `None` for
    /// any frame that cannot be read or is not running a code object, and on
    /// versions whose frames are objects (up to 3.10). Reads two small blocks: the
    /// pointer, and the header.
    pub fn frame_code(&mut self, frame: u64) -> Option<(u64, PyFrame)> {
        let FrameLayout::Interpreter {
            executable,
            tag_mask,
            ..
        } = self.layout.frame
        else {
            return None;
        };
        if !plausible_pointer(frame) {
            return None;
        }
        let word = read_u64(&self.mem, frame.checked_add(executable)?).ok()?;
        self.code_named(word & !tag_mask)
    }

    /// The interpreter frame's code word: its offset in a `_PyInterpreterFrame`
    /// and the tag bits to mask off it (3.11+; `None` where frames are objects).
    pub(crate) fn frame_code_word(&self) -> Option<(u64, u64)> {
        match self.layout.frame {
            FrameLayout::Interpreter {
                executable,
                tag_mask,
                ..
            } => Some((executable, tag_mask)),
            _ => None,
        }
    }

    /// The file, `co_name` and first line of the code object at `code` (a frame's
    /// code word, tag bits masked), checked as on every walk; see [`Self::frame_code`].
    pub(crate) fn code_named(&mut self, code: u64) -> Option<(u64, PyFrame)> {
        if !plausible_pointer(code) {
            return None;
        }
        let mut header = vec![0u8; self.layout.code_span() as usize];
        self.mem.read_exact(code, &mut header).ok()?;
        let frame = self.py_frame(code, &header, Position::Offset(-1)).ok()?;
        Some((code, frame))
    }

    /// The code object at `code` named, if it still has the `co_name` and
    /// `co_filename` pointers and first line (sign-extended) that a record saw when
    /// it ran: one read of its header, checked and named from those same bytes.
    /// The target runs meanwhile: an address freed and reused by another code
    /// object between two reads must not give the one's checks and the other's name.
    pub(crate) fn code_named_as(&mut self, code: u64, parts: [u64; 3]) -> Option<PyFrame> {
        if !plausible_pointer(code) {
            return None;
        }
        let mut header = vec![0u8; self.layout.code_span() as usize];
        self.mem.read_exact(code, &mut header).ok()?;
        let l = &self.layout;
        let seen = [
            field_u64(&header, l.code_name).ok()?,
            field_u64(&header, l.code_filename).ok()?,
            field_i32(&header, l.code_firstlineno).ok()? as i64 as u64,
        ];
        if seen != parts {
            return None;
        }
        // Read afresh: a code object and all its strings can be freed and made
        // again at the very addresses the cache knows (a function made by `exec`
        // in a loop), under another name. The record's check vouches for the name
        // string as it is now, not for the cache.
        self.codes.remove(&code);
        self.py_frame(code, &header, Position::Offset(-1)).ok()
    }

    /// Whether code object `code` (named by [`Self::frame_code`] just before, so
    /// cached) has an instruction at `line`; `None` when that cannot be told (no
    /// line table read, a format before 3.11's).
    pub fn code_has_line(&self, code: u64, line: u32) -> Option<bool> {
        let info = self.codes.get(&code)?;
        let table = info.table.as_deref()?;
        match self.layout.line_table {
            LineTable::Locations => {
                Some(lines::locations_has_line(table, info.key[4] as u32, line))
            }
            LineTable::Lnotab | LineTable::Linetable310 => None,
        }
    }

    /// The frame of `code` at `position` from the cache alone, without reading.
    fn cached_frame(&mut self, code: u64, position: Position) -> Option<PyFrame> {
        let addr = match position {
            Position::Offset(addr) => addr,
            Position::Pointer { ip, .. } => {
                let start = code + self.layout.code_adaptive.unwrap_or(0);
                (ip.wrapping_sub(start) as i64).div_euclid(2) * 2
            }
        };
        let line_table = self.layout.line_table;
        let info = self.codes.get_mut(&code)?;
        let first_line = info.key[4] as u32;
        let line = info.line_at(addr, first_line, line_table);
        Some(PyFrame {
            file: info.file.clone(),
            function: info.function.clone(),
            name: info.name.clone(),
            first_line,
            line,
        })
    }

    /// Where `code`'s bytecode starts: inside the object (`co_code_adaptive`), or in a
    /// free-threaded 3.14+ build, the thread-local copy `co_tlbc[tlbc_index]`.
    fn bytecode_start(&self, code: u64, tlbc_index: Option<i32>) -> io::Result<u64> {
        let adaptive = code + self.layout.code_adaptive.unwrap_or(0);
        let (
            Some(index),
            FrameLayout::Interpreter {
                tlbc: Some((_, co_tlbc)),
                ..
            },
        ) = (tlbc_index, self.layout.frame)
        else {
            return Ok(adaptive);
        };
        if index <= 0 {
            return Ok(adaptive);
        }
        // _PyCodeArray { Py_ssize_t size; char *entries[]; }
        let array = read_u64(&self.mem, code + co_tlbc)?;
        if !plausible_pointer(array) {
            return Ok(adaptive);
        }
        let size = read_u64(&self.mem, array)?;
        if (index as u64) >= size.min(1 << 16) {
            return Ok(adaptive);
        }
        read_u64(&self.mem, array + 8 + 8 * index as u64)
    }

    /// The frame of code object `code` (whose header bytes are `header`) at `position`.
    pub(super) fn py_frame(
        &mut self,
        code: u64,
        header: &[u8],
        position: Position,
    ) -> Result<PyFrame, FrameError> {
        let l = &self.layout;
        let get = |o: u64| field_u64(header, o).map_err(|_| FrameError::Broken);
        if !self.has_code_type(get(l.ob_type)?) {
            return Err(FrameError::Skip);
        }
        let addr = match position {
            Position::Offset(addr) => addr,
            Position::Pointer { ip, tlbc_index } => {
                let start = self
                    .bytecode_start(code, tlbc_index)
                    .map_err(|_| FrameError::Broken)?;
                // Code units are 2 bytes: the instruction's offset, in bytes.
                (ip.wrapping_sub(start) as i64).div_euclid(2) * 2
            }
        };
        let l = &self.layout;
        let first_line = field_i32(header, l.code_firstlineno)
            .map_err(|_| FrameError::Broken)?
            .max(0) as u32;
        let key = [
            get(l.code_filename)?,
            get(l.code_name)?,
            l.code_qualname.map(get).transpose()?.unwrap_or(0),
            get(l.code_linetable)?,
            u64::from(first_line),
        ];
        let cached = self.codes.get(&code).is_some_and(|c| c.key == key);
        if !cached {
            let info = self.code_info(key)?;
            if self.codes.len() >= MAX_CODES {
                self.codes.clear();
            }
            self.codes.insert(code, info);
        }
        let line_table = self.layout.line_table;
        let info = self.codes.get_mut(&code).ok_or(FrameError::Broken)?;
        let line = info.line_at(addr, first_line, line_table);
        Ok(PyFrame {
            file: info.file.clone(),
            function: info.function.clone(),
            name: info.name.clone(),
            first_line,
            line,
        })
    }

    fn code_info(&self, key: [u64; 5]) -> Result<CodeInfo, FrameError> {
        let [filename, name, qualname, linetable, _] = key;
        let u = &self.layout.unicode;
        let file = read_str(&self.mem, u, filename).map_err(|_| FrameError::Broken)?;
        let name = read_str(&self.mem, u, name).map_err(|_| FrameError::Broken)?;
        let function = if qualname != 0 {
            read_str(&self.mem, u, qualname).map_err(|_| FrameError::Broken)?
        } else {
            name.clone()
        };
        // A table that cannot be read costs the line numbers, not the frame.
        let table = read_bytes(&self.mem, &self.layout, linetable)
            .ok()
            .map(Vec::into_boxed_slice);
        Ok(CodeInfo {
            key,
            file: file.into(),
            function: function.into(),
            name: name.into(),
            table,
            lines: HashMap::new(),
            checked_in: 0,
        })
    }

    /// How many code objects are cached.
    #[cfg(test)]
    pub(crate) fn cached_codes(&self) -> usize {
        self.codes.len()
    }
}
