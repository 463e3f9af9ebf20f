//! The kernels a module image holds, as the driver would find them: a cubin (an ELF file
//! whose kernels each have a `.text.<name>` section) or PTX text (`.entry <name>(`).
//!
//! ```text
//! ELF64 header:   e_shoff @0x28 (u64), e_shentsize @0x3A, e_shnum @0x3C, e_shstrndx @0x3E
//! section header: sh_name @0x00 (u32, offset into the section-name table),
//!                 sh_offset @0x18 (u64), sh_size @0x20 (u64)
//! ```

/// The bytes of the module image at `image`, which `cuModuleLoadData` receives without a
/// length: an ELF file ends with the last of its headers and sections, PTX text with its
/// NUL.
///
/// # Safety
/// `image` points at a whole ELF image or a NUL-terminated PTX text.
pub unsafe fn image_bytes<'a>(image: *const u8) -> Result<&'a [u8], String> {
    // Byte by byte up to the magic's end: a PTX text may be shorter than the magic.
    for (i, &magic) in b"\x7fELF".iter().enumerate() {
        // SAFETY: bytes before this one were neither NUL nor the end of an ELF magic, so
        // the image goes on at least one more byte.
        if unsafe { *image.add(i) } != magic {
            // SAFETY: not ELF, so (per the contract) NUL-terminated text.
            let text = unsafe { std::ffi::CStr::from_ptr(image.cast()) };
            return Ok(text.to_bytes());
        }
    }
    let overflow = || "the ELF image's headers describe more than an address space".to_string();
    // SAFETY: an ELF64 header is 64 bytes.
    let header = unsafe { std::slice::from_raw_parts(image, 64) };
    let (phoff, phentsize, phnum) = (
        u64_at(header, 0x20)?,
        u16_at(header, 0x36)?,
        u16_at(header, 0x38)?,
    );
    let (shoff, shentsize, shnum) = (
        u64_at(header, 0x28)?,
        u16_at(header, 0x3A)?,
        u16_at(header, 0x3C)?,
    );
    let program_end = phoff.checked_add(phentsize * phnum).ok_or_else(overflow)?;
    let sections_end = shoff.checked_add(shentsize * shnum).ok_or_else(overflow)?;
    let mut end = 64usize.max(program_end).max(sections_end);
    // SAFETY: the section headers lie inside the image (its own header says where).
    let sections = unsafe { std::slice::from_raw_parts(image, sections_end) };
    for i in 0..shnum {
        let at = shoff + i * shentsize;
        const SHT_NOBITS: usize = 8;
        if u32_at(sections, at + 4)? != SHT_NOBITS {
            let (offset, size) = (u64_at(sections, at + 0x18)?, u64_at(sections, at + 0x20)?);
            end = end.max(offset.checked_add(size).ok_or_else(overflow)?);
        }
    }
    // SAFETY: `end` is where the last header or section of the image ends.
    Ok(unsafe { std::slice::from_raw_parts(image, end) })
}

/// The kernel names in `image`, or why it is not a module image.
pub fn kernel_names(image: &[u8]) -> Result<Vec<String>, String> {
    if image.starts_with(b"\x7fELF") {
        cubin_kernels(image)
    } else {
        ptx_kernels(image)
    }
}

/// The architecture an image was built for, as (major, minor): a cubin's `sm_XY` (the low
/// byte of its ELF `e_flags` in the layout NVRTC 12 writes, ELF ABI version 7 and below) or
/// a PTX text's `.target sm_XY`. `None` where the image does not say in a way this reads.
pub fn target(image: &[u8]) -> Option<(u32, u32)> {
    let sm = if image.starts_with(b"\x7fELF") {
        if *image.get(8)? > 7 {
            return None;
        }
        u32_at(image, 0x30).ok()? as u32 & 0xff
    } else {
        let text = std::str::from_utf8(image).ok()?;
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(".target"))?;
        let arch = line.split_whitespace().nth(1)?.trim_end_matches(',');
        arch.strip_prefix("sm_")?
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse()
            .ok()?
    };
    Some((sm / 10, sm % 10))
}

fn read<const N: usize>(bytes: &[u8], at: usize) -> Result<[u8; N], String> {
    bytes
        .get(at..at.saturating_add(N))
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| format!("the ELF image ends before byte {}", at + N))
}

fn u16_at(bytes: &[u8], at: usize) -> Result<usize, String> {
    read::<2>(bytes, at).map(|b| u16::from_le_bytes(b) as usize)
}

fn u32_at(bytes: &[u8], at: usize) -> Result<usize, String> {
    read::<4>(bytes, at).map(|b| u32::from_le_bytes(b) as usize)
}

fn u64_at(bytes: &[u8], at: usize) -> Result<usize, String> {
    read::<8>(bytes, at).map(|b| u64::from_le_bytes(b) as usize)
}

fn cubin_kernels(elf: &[u8]) -> Result<Vec<String>, String> {
    // EI_CLASS 2: 64-bit; EI_DATA 1: little-endian (what NVRTC writes).
    if elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF image".into());
    }
    let (shoff, shentsize) = (u64_at(elf, 0x28)?, u16_at(elf, 0x3A)?);
    let (shnum, shstrndx) = (u16_at(elf, 0x3C)?, u16_at(elf, 0x3E)?);
    if shentsize < 0x28 || shstrndx >= shnum {
        return Err("the ELF image has no section-name table".into());
    }
    let section = |i: usize| -> Result<(usize, usize, usize), String> {
        let at = shoff.saturating_add(i * shentsize);
        Ok((
            u32_at(elf, at)?,
            u64_at(elf, at + 0x18)?,
            u64_at(elf, at + 0x20)?,
        ))
    };
    let (_, names_at, names_len) = section(shstrndx)?;
    let names = elf
        .get(names_at..names_at.saturating_add(names_len))
        .ok_or("the section-name table lies outside the image")?;
    let mut kernels = Vec::new();
    for i in 0..shnum {
        let (name_at, _, _) = section(i)?;
        let name = names
            .get(name_at..)
            .and_then(|rest| rest.split(|&b| b == 0).next())
            .ok_or("a section name lies outside its table")?;
        if let Some(kernel) = name.strip_prefix(b".text.") {
            kernels.push(String::from_utf8_lossy(kernel).into_owned());
        }
    }
    Ok(kernels)
}

fn ptx_kernels(ptx: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(ptx).map_err(|_| "neither ELF nor PTX text")?;
    let text = text.trim_end_matches('\0');
    if !text.contains(".version") {
        return Err("neither ELF nor PTX text".into());
    }
    Ok(text
        .lines()
        .filter_map(|line| {
            let rest = line.trim_start().split(".entry").nth(1)?;
            let name = rest.trim_start().split(['(', ' ']).next()?;
            (!name.is_empty()).then(|| name.to_string())
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_entries_are_found() {
        let ptx =
            b".version 8.0\n.target sm_90\n.visible .entry gather_fixed_4(\n.param .u64 a\n)\n\
                    .visible .entry agg_update (\n";
        assert_eq!(
            kernel_names(ptx).unwrap(),
            vec!["gather_fixed_4".to_string(), "agg_update".to_string()]
        );
        assert!(kernel_names(b"hello").is_err());
        assert!(kernel_names(b"\x7fELF\x02\x01").is_err());
    }

    #[test]
    fn targets_are_read_from_ptx_and_cubins() {
        assert_eq!(target(b".version 8.8\n.target sm_80\n"), Some((8, 0)));
        assert_eq!(target(b".version 8.8\n.target sm_90a\n"), Some((9, 0)));
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[8] = 7;
        elf[0x30..0x34].copy_from_slice(&0x005a_055au32.to_le_bytes());
        assert_eq!(target(&elf), Some((9, 0)));
        elf[8] = 8;
        assert_eq!(target(&elf), None);
    }
}
