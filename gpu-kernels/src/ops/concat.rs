//! Concatenation on one device (`cuda/concat.cu`): columns that arrived in several chunks
//! become one, without the host — a join's build side gathered from every partition of its
//! child is built into one hash table this way. Fixed-width values are device copies;
//! bitmaps and strings are appended by one kernel per piece, queued in order on one
//! stream (a string piece finds where its bytes start in the offsets the piece
//! before it wrote, so the host never waits for a byte count).

use std::sync::Arc;

use super::{BLOCK, MAX_ROWS};
use crate::column::{DeviceColumn, Layout};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// The rows of `pieces`, in order, as one column on `device` (where every piece must lie).
/// One piece is returned as it is (its buffers shared).
pub fn concat_columns(device: &Device, pieces: &[DeviceColumn]) -> Result<DeviceColumn> {
    let first = pieces
        .first()
        .ok_or_else(|| KernelError::InvalidData("a concatenation of no columns".into()))?;
    if let Some(dictionary) = pieces.iter().find_map(DeviceColumn::dictionary) {
        // Chunks of one dictionary join their codes; others, their strings.
        let shared = pieces
            .iter()
            .all(|p| p.dictionary().is_some_and(|d| Arc::ptr_eq(d, dictionary)));
        if shared && pieces.iter().all(|p| p.device() == device) {
            let codes: Vec<DeviceColumn> = pieces.iter().map(DeviceColumn::codes).collect();
            return Ok(first.recoded(concat_columns(device, &codes)?));
        }
        let strings = pieces
            .iter()
            .map(DeviceColumn::decoded)
            .collect::<Result<Vec<_>>>()?;
        return concat_columns(device, &strings);
    }
    for piece in pieces {
        if piece.device() != device {
            return Err(KernelError::Unsupported(format!(
                "a column on {} concatenated on {}",
                piece.device().name(),
                device.name()
            )));
        }
        if piece.data_type() != first.data_type() {
            return Err(KernelError::Unsupported(format!(
                "a {} column concatenated with a {} one",
                piece.data_type(),
                first.data_type()
            )));
        }
    }
    if pieces.len() == 1 {
        return Ok(first.clone());
    }
    let total: usize = pieces.iter().map(DeviceColumn::len).sum();
    if total > MAX_ROWS {
        return Err(KernelError::Unsupported(format!(
            "a concatenation of {total} rows (at most {MAX_ROWS} in a batch)"
        )));
    }
    if total == 0 {
        return Ok(first.prefix(0));
    }
    let validity = match pieces.iter().any(|p| p.validity().is_some()) {
        true => {
            let out = device.alloc(total.div_ceil(8))?;
            append_bits(device, pieces, |p| p.validity(), &out)?;
            Some(out)
        }
        false => None,
    };
    let (values, offsets) = match first.layout() {
        Layout::Fixed(width) => {
            let out = device.alloc(total * width)?;
            let mut at = 0;
            for piece in pieces {
                let bytes = piece.len() * width;
                if bytes > 0 {
                    device.copy_into(&out, at, piece.values(), bytes)?;
                }
                at += bytes;
            }
            (out, None)
        }
        Layout::Bits => {
            let out = device.alloc(total.div_ceil(8))?;
            append_bits(device, pieces, |p| Some(p.values()), &out)?;
            (out, None)
        }
        Layout::Var(width) => {
            let (values, offsets) = append_strings(device, pieces, width, total)?;
            (values, Some(offsets))
        }
        Layout::Dict => {
            return Err(KernelError::InvalidData(
                "dictionary codes without their dictionary".into(),
            ));
        }
    };
    Ok(DeviceColumn::from_parts(
        first.data_type().clone(),
        total,
        values,
        offsets,
        validity,
    ))
}

/// Appends each piece's bitmap (`bits` of it; none: every bit set) to `out`.
fn append_bits(
    device: &Device,
    pieces: &[DeviceColumn],
    bits: impl Fn(&DeviceColumn) -> Option<&DeviceBuffer>,
    out: &DeviceBuffer,
) -> Result<()> {
    let mut at = 0usize;
    for piece in pieces {
        let n = piece.len();
        if n == 0 {
            continue;
        }
        let src = bits(piece);
        if src.is_some_and(|b| b.len() < n.div_ceil(8)) {
            return Err(KernelError::InvalidData(format!(
                "a bitmap too short for {n} rows"
            )));
        }
        // Bytes at/8 ..= (at+n-1)/8 of `out`, one thread each.
        let bytes = ((at + n - 1) / 8 - at / 8 + 1) as u64;
        let cfg = LaunchConfig::for_items(device, bytes, BLOCK);
        // SAFETY: `src` (or null) holds at least n bits; `out` holds ceil(total/8) bytes
        // and at + n <= total; the launches are queued in order on one stream.
        unsafe {
            device.launch(
                Kernel::append_bits,
                cfg,
                &[
                    Arg::opt(src),
                    Arg::U64(n as u64),
                    Arg::buf(out),
                    Arg::U64(at as u64),
                ],
            )?;
        }
        at += n;
    }
    Ok(())
}

/// Appends each piece's strings: the bytes and the offsets of the result (offsets of
/// `width` bytes; the byte buffer is as large as the pieces' byte buffers together).
fn append_strings(
    device: &Device,
    pieces: &[DeviceColumn],
    width: usize,
    total: usize,
) -> Result<(DeviceBuffer, DeviceBuffer)> {
    let kernel = match width {
        4 => Kernel::append_string_o32,
        8 => Kernel::append_string_o64,
        other => {
            return Err(KernelError::Unsupported(format!(
                "strings with {other}-byte offsets"
            )));
        }
    };
    let cap: usize = pieces.iter().map(|p| p.values().len()).sum();
    if width == 4 && cap > i32::MAX as usize {
        return Err(KernelError::Unsupported(format!(
            "{cap} bytes of strings with 32-bit offsets"
        )));
    }
    let bytes = device.alloc(cap.max(1))?;
    let offsets = device.alloc((total + 1) * width)?;
    let mut at = 0usize;
    for piece in pieces {
        let n = piece.len();
        if n == 0 {
            continue;
        }
        let source = piece
            .offsets()
            .filter(|o| o.len() >= (n + 1) * width)
            .ok_or_else(|| {
                KernelError::InvalidData(format!(
                    "a string column of {n} rows without their offsets"
                ))
            })?;
        let piece_cap = piece.values().len();
        let cfg = LaunchConfig::for_items(device, (n as u64 + 1).max(piece_cap as u64), BLOCK);
        // SAFETY: `source` holds n + 1 offsets of `width` bytes into the piece's byte buffer
        // of `piece_cap` bytes, of which at most that many are read; the pieces before
        // wrote offsets 0..=at of `offsets` ((total + 1) entries), and at most the sum of
        // their byte buffers' sizes into `bytes`, which holds all the pieces' sizes.
        unsafe {
            device.launch(
                kernel,
                cfg,
                &[
                    Arg::buf(source),
                    Arg::buf(piece.values()),
                    Arg::U64(n as u64),
                    Arg::U64(piece_cap as u64),
                    Arg::buf(&offsets),
                    Arg::buf(&bytes),
                    Arg::U64(at as u64),
                ],
            )?;
        }
        at += n;
    }
    Ok((bytes, offsets))
}
