//! Gather by an index column (`cuda/gather.cu`): `out[i] = column[indices[i]]`, where an
//! index of [`NULL_INDEX`](super::NULL_INDEX) gives NULL.

use super::{BLOCK, RowIndices, scan};
use crate::column::{DeviceColumn, Layout};
use crate::device::{Arg, LaunchConfig};
use crate::kernels::Kernel;
use crate::{KernelError, Result};

/// Gathers the rows of `column` at `indices`; NULL_INDEX gives NULL (outer joins), and the
/// result then has a validity bitmap.
pub fn gather_column(column: &DeviceColumn, indices: &RowIndices) -> Result<DeviceColumn> {
    if indices.bound() > column.len() {
        return Err(KernelError::Unsupported(format!(
            "indices into {} rows used on a column of {}",
            indices.bound(),
            column.len()
        )));
    }
    let count = indices.len();
    let null_indices = indices.nullable();
    let indices = indices.buffer();
    let device = column.device();
    let cfg = LaunchConfig::for_items(device, count as u64, BLOCK);
    let bitmap_cfg = LaunchConfig::for_items(device, count.div_ceil(8) as u64, BLOCK);
    let n = Arg::U64(count as u64);
    // Every index is below column.len() or NULL_INDEX (RowIndices guarantees it, and the
    // bound was checked above), so the kernels read column buffers only at existing rows.
    let validity = if column.validity().is_some() || null_indices {
        let out = device.alloc(count.div_ceil(8))?;
        // SAFETY: the validity bitmap (or null) covers column.len() rows; `out` holds
        // ceil(count/8) bytes, one thread per byte.
        unsafe {
            device.launch(
                Kernel::gather_validity,
                bitmap_cfg,
                &[
                    Arg::opt(column.validity()),
                    Arg::buf(indices),
                    n,
                    Arg::buf(&out),
                ],
            )?;
        }
        Some(out)
    } else {
        None
    };
    let (values, offsets) = match column.layout() {
        Layout::Fixed(width) => {
            let kernel = match width {
                1 => Kernel::gather_fixed_1,
                2 => Kernel::gather_fixed_2,
                4 => Kernel::gather_fixed_4,
                8 => Kernel::gather_fixed_8,
                16 => Kernel::gather_fixed_16,
                other => {
                    return Err(KernelError::Unsupported(format!(
                        "gathering {other}-byte values"
                    )));
                }
            };
            let out = device.alloc(count * width)?;
            // SAFETY: `values` holds column.len() values of `width` bytes; `out` holds
            // `count` of them; the kernel's element type has exactly `width` bytes.
            unsafe {
                device.launch(
                    kernel,
                    cfg,
                    &[
                        Arg::buf(column.values()),
                        Arg::buf(indices),
                        n,
                        Arg::buf(&out),
                    ],
                )?;
            }
            (out, None)
        }
        Layout::Bits => {
            let out = device.alloc(count.div_ceil(8))?;
            // SAFETY: gathering bits is gathering a bitmap: the values bitmap covers
            // column.len() rows and `out` holds ceil(count/8) bytes.
            unsafe {
                device.launch(
                    Kernel::gather_validity,
                    bitmap_cfg,
                    &[
                        Arg::buf(column.values()),
                        Arg::buf(indices),
                        n,
                        Arg::buf(&out),
                    ],
                )?;
            }
            (out, None)
        }
        Layout::Var(width) => {
            let offsets = column.offsets().ok_or_else(|| {
                KernelError::InvalidData("a string column without offsets".into())
            })?;
            let (lengths_kernel, copy_kernel) = if width == 4 {
                (
                    Kernel::gather_string_lengths_o32,
                    Kernel::gather_string_copy_o32,
                )
            } else {
                (
                    Kernel::gather_string_lengths_o64,
                    Kernel::gather_string_copy_o64,
                )
            };
            let lengths = device.alloc(count * 8)?;
            // SAFETY: `offsets` holds column.len() + 1 offsets of `width` bytes; `lengths`
            // holds `count` u64.
            unsafe {
                device.launch(
                    lengths_kernel,
                    cfg,
                    &[Arg::buf(offsets), Arg::buf(indices), n, Arg::buf(&lengths)],
                )?;
            }
            let (starts, total) = scan::exclusive_scan(device, &lengths, count)?;
            if width == 4 && total > i32::MAX as u64 {
                return Err(KernelError::Unsupported(format!(
                    "a string column of {total} bytes in 32-bit offsets"
                )));
            }
            let out_bytes = device.alloc(total as usize)?;
            let out_offsets = device.alloc((count + 1) * width)?;
            if count == 0 {
                out_offsets.write(0, &vec![0u8; width])?;
            }
            // SAFETY: `starts` holds the exclusive scan of the lengths, so each row's bytes
            // land inside `out_bytes` (total bytes); `out_offsets` holds count + 1 offsets,
            // the last written by the kernel's final row.
            unsafe {
                device.launch(
                    copy_kernel,
                    cfg,
                    &[
                        Arg::buf(offsets),
                        Arg::buf(column.values()),
                        Arg::buf(indices),
                        n,
                        Arg::buf(&starts),
                        Arg::buf(&out_offsets),
                        Arg::buf(&out_bytes),
                    ],
                )?;
            }
            (out_bytes, Some(out_offsets))
        }
    };
    Ok(DeviceColumn::from_parts(
        column.data_type().clone(),
        count,
        values,
        offsets,
        validity,
    ))
}
