//! Typed launches of the kernels in `cuda/`: the only place that calls the unsafe
//! `Device::launch`. Each wrapper checks sizes and sets up buffers so that the kernel's
//! contract (stated at the top of its `.cu` file) holds, and says so in a `SAFETY` comment.

pub mod aggregate;
pub mod compact;
pub mod concat;
pub mod expr;
pub mod gather;
pub mod hash;
pub mod hash_table;
pub mod join;
pub mod scan;
pub mod selftest;

use arrow::array::ArrayRef;
use arrow::datatypes::DataType;

use crate::column::{DeviceColumn, Layout};
use crate::device::{Arg, Device};
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// Threads per block for Fulmen's one-dimensional kernels.
pub const BLOCK: u32 = 256;

/// Row indices are u32 and `u32::MAX` marks a NULL index, so a batch holds fewer rows.
pub const MAX_ROWS: usize = u32::MAX as usize - 1;

/// An index meaning "no row": gathering it gives NULL.
pub const NULL_INDEX: u32 = u32::MAX;

/// Bytes of a status buffer, which lets a stage wait for the host once per batch: word 0 a
/// count the host needs (a table's new groups, a selection's rows), word 1 the error word of
/// an expression program queued before it ([`expr::evaluate_unchecked`]), non-zero when some
/// row met a case the program leaves to the CPU. The caller zeroes the buffer (an upload of
/// [`STATUS_BYTES`] zeros queues no wait) and reads both words with [`read_status`] (or
/// with the columns it downloads, [`download_checked`]). A stage
/// that needs more values from the same wait (the byte totals of string gathers) gives the
/// buffer more words ([`status_bytes`]) and reads them with [`read_status_words`].
pub const STATUS_BYTES: usize = 16;

/// Bytes of a status buffer with `extra` words after the two of [`STATUS_BYTES`].
pub fn status_bytes(extra: usize) -> usize {
    STATUS_BYTES + 8 * extra
}

/// The two words of a status buffer, in one host wait: `Some(word 0)` when word 1 is
/// clear, `None` when the program before left the batch to the CPU.
pub fn read_status(status: &DeviceBuffer) -> Result<Option<u64>> {
    Ok(read_status_words(status, 0)?.map(|(count, _)| count))
}

/// `columns` of `device` brought to the host with `status`'s two words, all in one host
/// wait: `None` when word 1 is set (the program before left the batch to the CPU, and the
/// values it wrote are not its answer: they are dropped). For a stage whose output goes to
/// the host, the program's check then costs no wait of its own.
pub fn download_checked(
    device: &Device,
    columns: &[&DeviceColumn],
    status: &DeviceBuffer,
) -> Result<Option<Vec<ArrayRef>>> {
    let mut words = [0u8; STATUS_BYTES];
    let arrays =
        crate::column::download_columns_with(device, columns, &mut [(status, &mut words[..])])?;
    match words[8..16].iter().all(|&b| b == 0) {
        true => Ok(Some(arrays)),
        false => Ok(None),
    }
}

/// As [`read_status`], with the `extra` words after the first two (see [`status_bytes`]),
/// all in one host wait: `Some((word 0, words 2..2 + extra))` when word 1 is clear.
pub fn read_status_words(status: &DeviceBuffer, extra: usize) -> Result<Option<(u64, Vec<u64>)>> {
    let words = status.prefix_to_host(status_bytes(extra))?;
    let word = |k: usize| -> Result<u64> {
        let bytes = words.get(8 * k..8 * k + 8).and_then(|b| b.try_into().ok());
        bytes
            .map(u64::from_le_bytes)
            .ok_or_else(|| KernelError::InvalidData("a short status read".into()))
    };
    if word(1)? != 0 {
        return Ok(None);
    }
    let rest = (2..2 + extra).map(word).collect::<Result<Vec<_>>>()?;
    Ok(Some((word(0)?, rest)))
}

/// Word `index` (8 bytes) of a device buffer: where a queued kernel leaves a count or a
/// total for the host to read later, or reads one an earlier kernel left there.
#[derive(Debug, Clone, Copy)]
pub struct Word<'a> {
    buffer: &'a DeviceBuffer,
    index: usize,
}

impl<'a> Word<'a> {
    /// Word `index` of `buffer`, which must hold it.
    pub fn of(buffer: &'a DeviceBuffer, index: usize) -> Result<Self> {
        if buffer.len() < 8 * (index + 1) {
            return Err(KernelError::Unsupported(format!(
                "word {index} of a {}-byte buffer",
                buffer.len()
            )));
        }
        Ok(Self { buffer, index })
    }

    /// The word as a kernel argument: its own 8 bytes inside the buffer.
    pub(crate) fn arg(self) -> Arg {
        Arg::part(self.buffer, 8 * self.index, 8)
    }

    /// The word `k` words after this one, which the buffer must hold.
    pub fn nth(&self, k: usize) -> Result<Word<'a>> {
        Word::of(self.buffer, self.index + k)
    }
}

/// Row indices queued kernels are still writing: the first min(`*count`, `slots`) of the
/// `slots` in a buffer are real (the rest may be unwritten; a join probe's count may exceed
/// `slots`, when its matches outgrew the room it guessed), each below `bound` or
/// NULL_INDEX, their count a device [`Word`] the host has not read. Made only by the producers that queue
/// such indices (a selection's scatter, a join probe), so that the kernels queued after
/// them (a string gather's lengths) can trust every index they read.
#[derive(Debug, Clone, Copy)]
pub struct PendingIndices<'a> {
    buffer: &'a DeviceBuffer,
    slots: usize,
    bound: usize,
    count: Word<'a>,
}

impl<'a> PendingIndices<'a> {
    pub(crate) fn new(
        buffer: &'a DeviceBuffer,
        slots: usize,
        bound: usize,
        count: Word<'a>,
    ) -> Self {
        Self {
            buffer,
            slots,
            bound,
            count,
        }
    }

    /// Room for this many indices: at most this many are real.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Every real index is below this.
    pub fn bound(&self) -> usize {
        self.bound
    }
}

pub(crate) fn check_rows(n: usize) -> Result<()> {
    if n > MAX_ROWS {
        return Err(KernelError::Unsupported(format!(
            "batches of {n} rows (at most {MAX_ROWS} rows fit a device batch)"
        )));
    }
    Ok(())
}

/// Row indices on a device, each below `bound` or NULL_INDEX. Made only by kernels that
/// guarantee the bound (compaction, hash probes) or by a checked upload, so that gathers
/// can trust them.
#[derive(Debug)]
pub struct RowIndices {
    buffer: std::sync::Arc<DeviceBuffer>,
    count: usize,
    bound: usize,
    nullable: bool,
}

impl RowIndices {
    pub(crate) fn new(buffer: DeviceBuffer, count: usize, bound: usize, nullable: bool) -> Self {
        Self {
            buffer: std::sync::Arc::new(buffer),
            count,
            bound,
            nullable,
        }
    }

    /// The codes of a dictionary-encoded column as indices into its dictionary's `bound`
    /// strings (`DeviceColumn::with_dictionary` holds its caller to every code being
    /// below), none NULL.
    pub(crate) fn of_codes(
        codes: std::sync::Arc<DeviceBuffer>,
        count: usize,
        bound: usize,
    ) -> Self {
        Self {
            buffer: codes,
            count,
            bound,
            nullable: false,
        }
    }

    /// Uploads host indices, checking that each is below `bound` (or is NULL_INDEX).
    pub fn upload(device: &Device, indices: &[u32], bound: usize) -> Result<Self> {
        check_rows(indices.len())?;
        if let Some(bad) = indices
            .iter()
            .find(|&&i| i != NULL_INDEX && i as usize >= bound)
        {
            return Err(KernelError::Unsupported(format!(
                "row index {bad} of a {bound}-row column"
            )));
        }
        let bytes: Vec<u8> = indices.iter().flat_map(|i| i.to_le_bytes()).collect();
        let nullable = indices.contains(&NULL_INDEX);
        Ok(Self::new(
            device.upload(&bytes)?,
            indices.len(),
            bound,
            nullable,
        ))
    }

    /// How many indices.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Every index is below this.
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// Whether NULL_INDEX may occur.
    pub fn nullable(&self) -> bool {
        self.nullable
    }

    /// The device buffer of u32 indices.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }

    /// Copies the indices to the host (only its `len()` indices, whatever the buffer's
    /// capacity).
    pub fn to_host(&self) -> Result<Vec<u32>> {
        Self::all_to_host(&[self]).map(|mut all| all.remove(0))
    }

    /// Copies several index lists to the host in one host wait.
    pub fn all_to_host(lists: &[&RowIndices]) -> Result<Vec<Vec<u32>>> {
        Ok(Self::all_to_host_with(lists, &[])?.0)
    }

    /// [`Self::all_to_host`], and `columns` of the same device downloaded in the same wait
    /// (a join's pairs and the probe rows they index).
    pub fn all_to_host_with(
        lists: &[&RowIndices],
        columns: &[&DeviceColumn],
    ) -> Result<(Vec<Vec<u32>>, Vec<ArrayRef>)> {
        let Some(first) = lists.first() else {
            return Ok((Vec::new(), crate::column::download_columns(columns)?));
        };
        let device = first.buffer.device();
        if lists.iter().any(|l| l.buffer.device() != device) {
            let lists = lists.iter().map(|l| l.to_host()).collect::<Result<_>>()?;
            return Ok((lists, crate::column::download_columns(columns)?));
        }
        let mut bytes: Vec<Vec<u8>> = lists.iter().map(|l| vec![0u8; l.count * 4]).collect();
        let arrays;
        {
            let mut reads: Vec<(&DeviceBuffer, &mut [u8])> = lists
                .iter()
                .zip(bytes.iter_mut())
                .map(|(l, b)| (&*l.buffer, b.as_mut_slice()))
                .collect();
            arrays = match columns.is_empty() {
                true => {
                    device.read_many(&mut reads)?;
                    Vec::new()
                }
                false => crate::column::download_columns_with(device, columns, &mut reads)?,
            };
        }
        let lists = bytes.iter().map(|b| u32s_of(b)).collect();
        Ok((lists, arrays))
    }
}

/// Little-endian 32-bit words of `bytes` (a trailing part word left out).
pub(crate) fn u32s_of(bytes: &[u8]) -> Vec<u32> {
    (bytes.chunks_exact(4))
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Little-endian 64-bit words of `bytes` (a trailing part word left out).
pub(crate) fn words_of(bytes: &[u8]) -> Vec<u64> {
    (bytes.chunks_exact(8))
        .map(|w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
        .collect()
}

/// How the kernels compare a key column (`KeyKind` in fulmen.cuh). Floats compare bit for
/// bit after -0.0 becomes 0.0: DataFusion's GROUP BY, joins, INTERSECT and EXCEPT all put
/// the two zeros together, and a NaN meets a NaN of the same bits.
fn key_kind(column: &DeviceColumn) -> Result<u64> {
    Ok(match (column.data_type(), column.layout()) {
        // Half floats would compare by their bits (-0.0 apart from 0.0).
        (DataType::Float16, _) => {
            return Err(KernelError::Unsupported("comparing Float16 keys".into()));
        }
        (DataType::Float32, _) => 5,
        (DataType::Float64, _) => 6,
        (_, Layout::Fixed(1)) => 0,
        (_, Layout::Fixed(2)) => 1,
        (_, Layout::Fixed(4)) => 2,
        (_, Layout::Fixed(8)) => 3,
        (_, Layout::Fixed(16)) => 4,
        (_, Layout::Var(4)) => 7,
        (_, Layout::Var(8)) => 8,
        // Compared by the strings the codes stand for.
        (_, Layout::Dict) => 9,
        (other, _) => {
            return Err(KernelError::Unsupported(format!("comparing {other} keys")));
        }
    })
}

/// A key column as the kernels read it (`KeyCol` in fulmen.cuh).
pub(crate) fn key_descriptor(column: &DeviceColumn) -> Result<[u64; 4]> {
    Ok([
        column.values().addr(),
        column.validity().map_or(0, DeviceBuffer::addr),
        match column.dictionary() {
            Some(d) => d.header().addr(),
            None => column.offsets().map_or(0, DeviceBuffer::addr),
        },
        key_kind(column)?,
    ])
}

/// The descriptors of key columns, uploaded (a table of `KeyCol`).
pub(crate) fn key_descriptors(device: &Device, columns: &[&DeviceColumn]) -> Result<DeviceBuffer> {
    let mut words = Vec::with_capacity(columns.len() * 4 + 1);
    for column in columns {
        words.extend(key_descriptor(column)?);
    }
    if words.is_empty() {
        words.push(0);
    }
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    device.upload(&bytes)
}
