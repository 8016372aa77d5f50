//! The one thing xtask reads from shared libraries: their `DT_NEEDED`
//! entries, to copy only the part of the NIXL wheel that the UCX backend
//! actually loads. Plain byte parsing of little-endian ELF64 (no unsafe).
//!
//! Format: System V ABI, ELF-64 Object File Format 1.5: the section header
//! table at `e_shoff` (`e_shnum` entries of `e_shentsize` bytes); the
//! `SHT_DYNAMIC` (6) section holds 16-byte `(d_tag, d_val)` pairs, `DT_NEEDED`
//! (1) values being offsets into the string table named by its `sh_link`.

use std::path::Path;

use crate::error::{Result, XtaskError};

const SHT_DYNAMIC: u32 = 6;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;

/// Sonames a shared library or executable needs, in file order.
///
/// # Errors
/// [`XtaskError::Io`] when unreadable; [`XtaskError::Metadata`] naming the
/// header field when the file is not a little-endian ELF64 or is truncated.
pub fn needed_libraries(path: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(path).map_err(XtaskError::io(path))?;
    parse_needed(&bytes).map_err(|(field, reason)| XtaskError::Metadata {
        field: format!("{}: {field}", path.display()),
        reason,
    })
}

type ParseResult<T> = std::result::Result<T, (&'static str, String)>;

fn parse_needed(b: &[u8]) -> ParseResult<Vec<String>> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" {
        return Err(("e_ident", "not an ELF file".into()));
    }
    if b[4] != 2 || b[5] != 1 {
        return Err((
            "e_ident",
            format!("class {} / data {}: only ELF64 little-endian", b[4], b[5]),
        ));
    }
    let shoff = u64_at(b, 0x28, "e_shoff")? as usize;
    let shentsize = u16_at(b, 0x3a, "e_shentsize")? as usize;
    let shnum = u16_at(b, 0x3c, "e_shnum")? as usize;
    let section = |i: usize| -> ParseResult<(u32, u32, usize, usize)> {
        let h = shoff + i * shentsize;
        Ok((
            u32_at(b, h + 4, "sh_type")?,
            u32_at(b, h + 40, "sh_link")?,
            u64_at(b, h + 24, "sh_offset")? as usize,
            u64_at(b, h + 32, "sh_size")? as usize,
        ))
    };
    let mut out = Vec::new();
    for i in 0..shnum {
        let (ty, link, off, size) = section(i)?;
        if ty != SHT_DYNAMIC {
            continue;
        }
        let (_, _, stroff, strsize) = section(link as usize)?;
        let strtab = b.get(stroff..stroff.saturating_add(strsize)).ok_or((
            "sh_offset",
            format!("string table {stroff}+{strsize} past end"),
        ))?;
        for e in (off..off.saturating_add(size)).step_by(16) {
            let tag = u64_at(b, e, "d_tag")?;
            if tag == DT_NULL {
                break;
            }
            if tag == DT_NEEDED {
                let at = u64_at(b, e + 8, "d_val")? as usize;
                let s = strtab
                    .get(at..)
                    .ok_or(("d_val", format!("offset {at} past string table")))?;
                let end = s.iter().position(|&c| c == 0).unwrap_or(s.len());
                out.push(String::from_utf8_lossy(&s[..end]).into_owned());
            }
        }
    }
    Ok(out)
}

fn u16_at(b: &[u8], at: usize, field: &'static str) -> ParseResult<u16> {
    b.get(at..at + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .ok_or((field, format!("offset {at} past end of file")))
}

fn u32_at(b: &[u8], at: usize, field: &'static str) -> ParseResult<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
        .ok_or((field, format!("offset {at} past end of file")))
}

fn u64_at(b: &[u8], at: usize, field: &'static str) -> ParseResult<u64> {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
        .ok_or((field, format!("offset {at} past end of file")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_needs_libc() {
        let exe = std::env::current_exe().unwrap();
        let needed = needed_libraries(&exe).unwrap();
        assert!(
            needed.iter().any(|n| n.starts_with("libc.so")),
            "{needed:?}"
        );
    }

    #[test]
    fn non_elf_and_truncated_files_are_errors_naming_the_field() {
        assert_eq!(parse_needed(b"#!/bin/sh\n").unwrap_err().0, "e_ident");
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        // Header intact, section table cut off.
        let e = parse_needed(&exe[..128]).unwrap_err();
        assert!(
            ["sh_type", "sh_link", "sh_offset", "sh_size"].contains(&e.0),
            "{e:?}"
        );
    }
}
