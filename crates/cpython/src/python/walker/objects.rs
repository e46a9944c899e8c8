//! Reading Python objects out of target memory: `str` and `bytes`, bounded.

use std::io;

use super::layout::{Layout, UnicodeLayout};
use pyprobe_sdt::sdt::MemoryReader;

/// Longest string decoded, in code points (longer ones are cut).
pub(crate) const MAX_CHARS: usize = pyprobe_sdt::process::memory::MAX_STRING;
/// Longest line table read; a longer one gives no line numbers (first line is used).
pub(crate) const MAX_TABLE: usize = 1 << 20;

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

pub(crate) fn read_u64<M: MemoryReader + ?Sized>(mem: &M, addr: u64) -> io::Result<u64> {
    let mut b = [0u8; 8];
    mem.read_exact(addr, &mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// A little-endian field of a buffer read from the target; out-of-range is an error.
pub(crate) fn field_u64(buf: &[u8], at: u64) -> io::Result<u64> {
    let at = usize::try_from(at).map_err(|_| invalid(format!("offset {at} too large")))?;
    buf.get(at..at.saturating_add(8))
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| {
            invalid(format!(
                "field at {at} is outside the {} bytes read",
                buf.len()
            ))
        })
}

pub(crate) fn field_i32(buf: &[u8], at: u64) -> io::Result<i32> {
    let at = usize::try_from(at).map_err(|_| invalid(format!("offset {at} too large")))?;
    buf.get(at..at.saturating_add(4))
        .and_then(|b| b.try_into().ok())
        .map(i32::from_le_bytes)
        .ok_or_else(|| {
            invalid(format!(
                "field at {at} is outside the {} bytes read",
                buf.len()
            ))
        })
}

pub(crate) fn field_u8(buf: &[u8], at: u64) -> io::Result<u8> {
    usize::try_from(at)
        .ok()
        .and_then(|at| buf.get(at).copied())
        .ok_or_else(|| {
            invalid(format!(
                "field at {at} is outside the {} bytes read",
                buf.len()
            ))
        })
}

/// Whether `addr` can be an object pointer (non-null, aligned, in user space).
pub(crate) fn plausible_pointer(addr: u64) -> bool {
    addr != 0 && addr % 8 == 0 && addr < (1 << 47)
}

/// Decodes a `str` object: compact ASCII, compact latin-1/UCS-2/UCS-4, or a legacy
/// (non-compact) string whose data lives elsewhere. At most [`MAX_CHARS`] code points.
pub(crate) fn read_str<M: MemoryReader + ?Sized>(
    mem: &M,
    u: &UnicodeLayout,
    addr: u64,
) -> io::Result<String> {
    if !plausible_pointer(addr) {
        return Err(invalid(format!("{addr:#x} is not a str pointer")));
    }
    let mut header = [0u8; 256];
    let header = &mut header[..u.ascii_size as usize];
    mem.read_exact(addr, header)?;
    let length = field_u64(header, u.length)? as i64;
    if length < 0 {
        return Err(invalid(format!("str at {addr:#x} has length {length}")));
    }
    let state = field_i32(header, u.state)? as u32;
    let kind = (state >> u.kind_shift) & 7;
    let compact = state >> u.compact_bit & 1 != 0;
    let ascii = state >> u.ascii_bit & 1 != 0;
    let (data, width) = match (compact, ascii) {
        (true, true) => (addr + u.ascii_size, 1),
        (true, false) => (addr + u.compact_size, kind),
        (false, _) => (read_u64(mem, addr + u.compact_size)?, kind),
    };
    if !matches!(width, 1 | 2 | 4) || (ascii && kind != 1) {
        return Err(invalid(format!(
            "str at {addr:#x} has kind {kind} (state {state:#x})"
        )));
    }
    let chars = (length as usize).min(MAX_CHARS);
    let mut bytes = vec![0u8; chars * width as usize];
    mem.read_exact(data, &mut bytes)?;
    Ok(match width {
        1 if ascii => bytes.iter().map(|&b| char::from(b & 0x7f)).collect(),
        1 => bytes.iter().map(|&b| char::from(b)).collect(),
        2 => bytes
            .chunks_exact(2)
            .map(|c| {
                char::from_u32(u32::from(u16::from_le_bytes([c[0], c[1]])))
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect(),
    })
}

/// The size of a `bytes` object.
fn bytes_size<M: MemoryReader + ?Sized>(mem: &M, layout: &Layout, addr: u64) -> io::Result<u64> {
    if !plausible_pointer(addr) {
        return Err(invalid(format!("{addr:#x} is not a bytes pointer")));
    }
    let size = read_u64(mem, addr + layout.bytes_ob_size)? as i64;
    u64::try_from(size).map_err(|_| invalid(format!("bytes at {addr:#x} has size {size}")))
}

/// The contents of a `bytes` object, refused beyond [`MAX_TABLE`] bytes.
pub(crate) fn read_bytes<M: MemoryReader + ?Sized>(
    mem: &M,
    layout: &Layout,
    addr: u64,
) -> io::Result<Vec<u8>> {
    let size = bytes_size(mem, layout, addr)?;
    if size as usize > MAX_TABLE {
        return Err(invalid(format!("bytes at {addr:#x} has size {size}")));
    }
    let mut data = vec![0u8; size as usize];
    mem.read_exact(addr + layout.bytes_ob_sval, &mut data)?;
    Ok(data)
}

/// A `bytes` object's size, and its first bytes, at most `max`.
pub(crate) fn read_bytes_prefix<M: MemoryReader + ?Sized>(
    mem: &M,
    layout: &Layout,
    addr: u64,
    max: usize,
) -> io::Result<(u64, Vec<u8>)> {
    let size = bytes_size(mem, layout, addr)?;
    let mut data = vec![0u8; size.min(max as u64) as usize];
    mem.read_exact(addr + layout.bytes_ob_sval, &mut data)?;
    Ok((size, data))
}
