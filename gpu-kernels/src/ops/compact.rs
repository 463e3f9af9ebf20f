//! Stream compaction (`cuda/compact.cu`): a boolean selection → the indices of the rows it
//! keeps, in order → columns gathered at those indices.

use super::{BLOCK, RowIndices, check_rows, gather, scan};
use crate::column::{DeviceBatch, DeviceColumn, Layout};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// The indices of the rows a selection keeps, in row order.
/// Row i is kept when bit i of `values` is set and, if `validity` is given, bit i of it
/// too: a NULL predicate keeps no row, as in SQL.
pub fn selection_indices(
    device: &Device,
    values: &DeviceBuffer,
    validity: Option<&DeviceBuffer>,
    n: usize,
) -> Result<RowIndices> {
    check_rows(n)?;
    let bitmap = n.div_ceil(8);
    if values.len() < bitmap || validity.is_some_and(|v| v.len() < bitmap) {
        return Err(KernelError::Unsupported(format!(
            "a selection of {n} rows needs {bitmap} bitmap bytes"
        )));
    }
    let words = n.div_ceil(32);
    let counts = device.alloc(words * 8)?;
    let cfg = LaunchConfig::for_items(device, words as u64, BLOCK);
    // SAFETY: the bitmaps hold ceil(n/8) bytes (checked; the kernel reads no further) and
    // `counts` holds one u64 per 32-row word.
    unsafe {
        device.launch(
            Kernel::select_word_counts,
            cfg,
            &[
                Arg::buf(values),
                Arg::opt(validity),
                Arg::U64(n as u64),
                Arg::buf(&counts),
            ],
        )?;
    }
    let (offsets, total) = scan::exclusive_scan(device, &counts, words)?;
    let out = device.alloc(total as usize * 4)?;
    // SAFETY: as above; `offsets` holds one u64 per word and `out` the total count of u32
    // indices the scan returned, which is exactly what the scatter writes.
    unsafe {
        device.launch(
            Kernel::select_scatter,
            cfg,
            &[
                Arg::buf(values),
                Arg::opt(validity),
                Arg::U64(n as u64),
                Arg::buf(&offsets),
                Arg::buf(&out),
            ],
        )?;
    }
    Ok(RowIndices::new(out, total as usize, n, false))
}

/// Keeps the rows of `batch` where the boolean column `predicate` is true.
pub fn filter_batch(batch: &DeviceBatch, predicate: &DeviceColumn) -> Result<DeviceBatch> {
    if predicate.layout() != Layout::Bits || predicate.len() != batch.num_rows() {
        return Err(KernelError::Unsupported(
            "a filter predicate must be a boolean column of the batch's length".into(),
        ));
    }
    let device = predicate.device();
    let indices = selection_indices(
        device,
        predicate.values(),
        predicate.validity(),
        predicate.len(),
    )?;
    let columns = batch
        .columns()
        .iter()
        .map(|c| gather::gather_column(c, &indices))
        .collect::<Result<Vec<_>>>()?;
    DeviceBatch::try_new(batch.schema().clone(), columns, indices.len())
}
