//! Stream compaction (`cuda/compact.cu`): a boolean selection → the indices of the rows it
//! keeps, in order → columns gathered at those indices.

use super::{BLOCK, PendingIndices, RowIndices, Word, check_rows, gather, scan};
use crate::column::{DeviceBatch, DeviceColumn, Layout};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// The indices of the rows a selection keeps, in row order.
/// Row i is kept when bit i of `values` is set and, if `validity` is given, bit i of it
/// too: a NULL predicate keeps no row, as in SQL. One host wait, for the count.
pub fn selection_indices(
    device: &Device,
    values: &DeviceBuffer,
    validity: Option<&DeviceBuffer>,
    n: usize,
) -> Result<RowIndices> {
    check_selection(values, validity, n)?;
    let out = device.alloc((n * 4).max(1))?;
    if n == 0 {
        return Ok(RowIndices::new(out, 0, n, false));
    }
    // Written by the launch (n > 0), so not zeroed.
    let total = device.alloc(8)?;
    compact(device, values, validity, n, &out, Word::of(&total, 0)?)?;
    let total = total.read_u64(0)?;
    if total > n as u64 {
        return Err(KernelError::InvalidData(format!(
            "a selection of {n} rows kept {total}"
        )));
    }
    Ok(RowIndices::new(out, total as usize, n, false))
}

/// A selection compacted on the device whose count the host has not read yet: its indices
/// fill the start of a buffer of `n` (the most a selection of `n` rows keeps), so nothing
/// waited for the count before the scatter was queued.
#[derive(Debug)]
pub struct QueuedSelection {
    indices: DeviceBuffer,
    n: usize,
    /// The status buffer whose word 0 receives the count.
    status: u64,
}

impl QueuedSelection {
    /// The indices, given the count the host read from word 0 of the status buffer (see
    /// [`selection_indices_queued`]).
    pub fn with_count(self, count: u64) -> Result<RowIndices> {
        if count > self.n as u64 {
            return Err(KernelError::InvalidData(format!(
                "a selection of {} rows kept {count}",
                self.n
            )));
        }
        Ok(RowIndices::new(self.indices, count as usize, self.n, false))
    }

    /// The indices while the scatter may still be writing them, for kernels queued
    /// before the host reads the count: `status` is the buffer given to
    /// [`selection_indices_queued`].
    pub fn pending<'a>(&'a self, status: &'a DeviceBuffer) -> Result<PendingIndices<'a>> {
        if status.addr() != self.status {
            return Err(KernelError::Unsupported(
                "a selection's indices read with another status buffer than its count's".into(),
            ));
        }
        Ok(PendingIndices::new(
            &self.indices,
            self.n,
            self.n,
            Word::of(status, 0)?,
        ))
    }
}

/// Queues the same compaction as [`selection_indices`] without a host wait: the count
/// goes to word 0 of `status` (a [`STATUS_BYTES`](super::STATUS_BYTES) buffer the caller
/// zeroed, whose word 1 an expression program before it may set), which the caller reads
/// with [`read_status`](super::read_status) (or, with more words after the two,
/// [`read_status_words`](super::read_status_words)) in its one wait for the batch.
pub fn selection_indices_queued(
    device: &Device,
    values: &DeviceBuffer,
    validity: Option<&DeviceBuffer>,
    n: usize,
    status: &DeviceBuffer,
) -> Result<QueuedSelection> {
    check_selection(values, validity, n)?;
    if status.len() < super::STATUS_BYTES {
        return Err(KernelError::Unsupported(
            "a status buffer too short for a selection's count".into(),
        ));
    }
    let count = Word::of(status, 0)?;
    let indices = device.alloc((n * 4).max(1))?;
    if n > 0 {
        compact(device, values, validity, n, &indices, count)?;
    }
    Ok(QueuedSelection {
        indices,
        n,
        status: status.addr(),
    })
}

fn check_selection(values: &DeviceBuffer, validity: Option<&DeviceBuffer>, n: usize) -> Result<()> {
    check_rows(n)?;
    let bitmap = n.div_ceil(8);
    if values.len() < bitmap || validity.is_some_and(|v| v.len() < bitmap) {
        return Err(KernelError::Unsupported(format!(
            "a selection of {n} rows needs {bitmap} bitmap bytes"
        )));
    }
    Ok(())
}

/// Writes the indices of the kept rows of the selection of `n` (> 0) rows at the start of
/// `out` (which holds n u32), and their count to the word `count`: one launch
/// (`select_compact`, chained by the look-back) up to `LOOKBACK_TILES` tiles of
/// `TILE` 32-row words (512 Mi rows), three past that.
fn compact(
    device: &Device,
    values: &DeviceBuffer,
    validity: Option<&DeviceBuffer>,
    n: usize,
    out: &DeviceBuffer,
    count: Word<'_>,
) -> Result<()> {
    let words = n.div_ceil(32);
    if out.len() < n * 4 {
        return Err(KernelError::Unsupported(format!(
            "a selection of {n} rows into {} bytes",
            out.len()
        )));
    }
    let tiles = (words as u64).div_ceil(scan::TILE);
    let one_pass = scan::one_pass(device, tiles, |cfg, state, epoch| {
        // SAFETY: the bitmaps hold ceil(n/8) bytes (checked by `check_selection`; the
        // kernel reads no further); `out` holds n u32 (checked), at least the kept rows;
        // `count` is one u64; the look-back state and epoch are `one_pass`'s, a block of
        // SCAN_THREADS per tile of the ceil(n/32) words; the arguments follow compact.cu.
        unsafe {
            device.launch(
                Kernel::select_compact,
                cfg,
                &[
                    Arg::buf(values),
                    Arg::opt(validity),
                    Arg::U64(n as u64),
                    state,
                    Arg::U64(scan::LOOKBACK_TILES),
                    Arg::U64(epoch),
                    Arg::buf(out),
                    count.arg(),
                ],
            )
        }
    })?;
    if !one_pass {
        let counts = word_counts(device, values, validity, n)?;
        let offsets = scan::exclusive_scan_queued(device, &counts, words, count)?;
        scatter(device, values, validity, n, &offsets, out)?;
    }
    Ok(())
}

/// The kept rows of each 32-row word, one u64 per word.
fn word_counts(
    device: &Device,
    values: &DeviceBuffer,
    validity: Option<&DeviceBuffer>,
    n: usize,
) -> Result<DeviceBuffer> {
    let words = n.div_ceil(32);
    let counts = device.alloc(words * 8)?;
    let cfg = LaunchConfig::for_items(device, words as u64, BLOCK);
    // SAFETY: the bitmaps hold ceil(n/8) bytes (checked by `check_selection`; the kernel
    // reads no further) and `counts` holds one u64 per 32-row word.
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
    Ok(counts)
}

/// Writes the index of every kept row at its word's offset plus its rank in the word.
fn scatter(
    device: &Device,
    values: &DeviceBuffer,
    validity: Option<&DeviceBuffer>,
    n: usize,
    offsets: &DeviceBuffer,
    out: &DeviceBuffer,
) -> Result<()> {
    let words = n.div_ceil(32);
    let cfg = LaunchConfig::for_items(device, words as u64, BLOCK);
    // SAFETY: as in `word_counts`; `offsets` holds one u64 per word, the exclusive scan of
    // the word counts, so the indices written number the kept rows, and `out` holds at
    // least that many u32 (the total for `selection_indices`, n for the queued form).
    unsafe {
        device.launch(
            Kernel::select_scatter,
            cfg,
            &[
                Arg::buf(values),
                Arg::opt(validity),
                Arg::U64(n as u64),
                Arg::buf(offsets),
                Arg::buf(out),
            ],
        )?;
    }
    Ok(())
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
    let columns: Vec<&DeviceColumn> = batch.columns().iter().collect();
    let columns = gather::gather_columns(&columns, &indices)?;
    DeviceBatch::try_new(batch.schema().clone(), columns, indices.len())
}
