//! Reading one integer a kernel exports from its cubin (an ELF64 little-endian object).
//!
//! Each kernel translation unit defines `extern "C" __device__ const int flash_smem_bytes`
//! (cuda/params.h, `FLASH_EXPORT_SMEM`): the dynamic shared memory its layout needs. NVRTC keeps
//! it in `.symtab` as a 4-byte object whose section is `.nv.global.init` (the value at
//! `st_value` in that section's bytes), or `.nv.global` with no file bytes when the value is 0.
//! Every offset read here is bounds-checked: a malformed image is an error, never a panic.

use crate::error::{FlashError, Result};

/// The name of the shared-memory size every kernel exports.
pub const SMEM_SYMBOL: &str = "flash_smem_bytes";

const SHT_SYMTAB: u32 = 2;
const SHT_NOBITS: u32 = 8;
const SHN_LORESERVE: u16 = 0xff00;
const SECTION_HEADER: usize = 64;
const SYMBOL: usize = 24;

/// The value of the `int` object `name` defined in `image`.
pub fn read_i32(image: &[u8], name: &str) -> Result<i32> {
    let bad = |what: &str| FlashError::Internal(format!("cubin: {what}"));
    if image.len() < 64 || &image[..4] != b"\x7fELF" || image[4] != 2 || image[5] != 1 {
        return Err(bad("not an ELF64 little-endian image"));
    }
    let shoff = u64_at(image, 0x28)?;
    let shentsize = u16_at(image, 0x3a)? as usize;
    let shnum = u16_at(image, 0x3c)? as usize;
    if shentsize != SECTION_HEADER {
        return Err(bad("unexpected section header size"));
    }
    let section = |i: usize| -> Result<Section> {
        if i >= shnum {
            return Err(bad("section index out of range"));
        }
        let at = offset(shoff, i * SECTION_HEADER)?;
        // The header must lie inside the image before its fields' offsets are added.
        let at = at.checked_add(SECTION_HEADER).filter(|&end| end <= image.len()).map(|_| at).ok_or_else(|| bad("section header out of range"))?;
        Ok(Section {
            kind: u32_at(image, at + 4)?,
            offset: u64_at(image, at + 24)?,
            size: u64_at(image, at + 32)?,
            link: u32_at(image, at + 40)? as usize,
        })
    };
    for i in 0..shnum {
        let symtab = section(i)?;
        if symtab.kind != SHT_SYMTAB {
            continue;
        }
        let strtab = section(symtab.link)?;
        let symbols = symtab.bytes(image)?;
        let names = strtab.bytes(image)?;
        for sym in symbols.chunks_exact(SYMBOL) {
            if c_str(names, u32_at(sym, 0)? as usize) != Some(name.as_bytes()) {
                continue;
            }
            let (shndx, value, size) = (u16_at(sym, 6)?, u64_at(sym, 8)?, u64_at(sym, 16)?);
            if size != 4 || shndx == 0 || shndx >= SHN_LORESERVE {
                return Err(bad(&format!("symbol {name} is not a defined 4-byte object")));
            }
            let data = section(shndx as usize)?;
            if data.kind == SHT_NOBITS {
                return Ok(0); // zero-initialised: .nv.global holds no bytes
            }
            let at = usize::try_from(value).map_err(|_| bad("symbol value out of range"))?;
            return i32_at(data.bytes(image)?, at);
        }
    }
    Err(bad(&format!("no symbol {name} (does the kernel define it with FLASH_EXPORT_SMEM?)")))
}

/// The dynamic shared memory, in bytes, that the kernel in `cubin` declares for itself.
pub fn smem_bytes(cubin: &[u8]) -> Result<usize> {
    let n = read_i32(cubin, SMEM_SYMBOL)?;
    usize::try_from(n).map_err(|_| FlashError::Internal(format!("cubin: {SMEM_SYMBOL} = {n} is negative")))
}

struct Section {
    kind: u32,
    offset: u64,
    size: u64,
    link: usize,
}

impl Section {
    fn bytes<'a>(&self, image: &'a [u8]) -> Result<&'a [u8]> {
        let start = usize::try_from(self.offset).ok();
        let end = start.zip(usize::try_from(self.size).ok()).and_then(|(s, n)| s.checked_add(n));
        match (start, end) {
            (Some(s), Some(e)) if e <= image.len() => Ok(&image[s..e]),
            _ => Err(FlashError::Internal("cubin: section outside the image".into())),
        }
    }
}

fn offset(base: u64, add: usize) -> Result<usize> {
    usize::try_from(base)
        .ok()
        .and_then(|b| b.checked_add(add))
        .ok_or_else(|| FlashError::Internal("cubin: offset out of range".into()))
}

fn field<const N: usize>(b: &[u8], at: usize) -> Result<[u8; N]> {
    at.checked_add(N)
        .and_then(|end| b.get(at..end))
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| FlashError::Internal("cubin: truncated".into()))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16> {
    field(b, at).map(u16::from_le_bytes)
}

fn u32_at(b: &[u8], at: usize) -> Result<u32> {
    field(b, at).map(u32::from_le_bytes)
}

fn i32_at(b: &[u8], at: usize) -> Result<i32> {
    field(b, at).map(i32::from_le_bytes)
}

fn u64_at(b: &[u8], at: usize) -> Result<u64> {
    field(b, at).map(u64::from_le_bytes)
}

fn c_str(table: &[u8], at: usize) -> Option<&[u8]> {
    let rest = table.get(at..)?;
    Some(&rest[..rest.iter().position(|&c| c == 0)?])
}

#[cfg(test)]
mod tests {
    use super::*;

    // Hand-compiled by NVRTC 13 for sm_80: a trivial kernel beside
    // `extern "C" __device__ const int flash_smem_bytes = 12345;` (resp. = 0, and no such symbol).
    const SMEM_12345: &[u8] = include_bytes!("testdata/smem12345.cubin");
    const SMEM_0: &[u8] = include_bytes!("testdata/smem0.cubin");
    const NO_SYMBOL: &[u8] = include_bytes!("testdata/nosym.cubin");

    #[test]
    fn reads_the_exported_size() {
        assert_eq!(smem_bytes(SMEM_12345).unwrap(), 12345);
    }

    #[test]
    fn zero_lives_in_a_section_without_bytes() {
        assert_eq!(smem_bytes(SMEM_0).unwrap(), 0);
    }

    #[test]
    fn a_missing_symbol_is_an_internal_error() {
        let e = smem_bytes(NO_SYMBOL).unwrap_err();
        assert!(matches!(&e, FlashError::Internal(m) if m.contains(SMEM_SYMBOL)), "{e:?}");
    }

    #[test]
    fn malformed_images_are_errors_not_panics() {
        for n in 0..SMEM_12345.len() {
            let _ = smem_bytes(&SMEM_12345[..n]); // every truncation: Ok or Err, never a panic
        }
        let mut bad = SMEM_12345.to_vec();
        bad[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes()); // section headers far away
        assert!(smem_bytes(&bad).is_err());
        assert!(smem_bytes(b"not an elf at all, but long enough to have a header of sixty-four bytes").is_err());
    }
}
