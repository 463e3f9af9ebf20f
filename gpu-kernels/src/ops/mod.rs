//! Typed launches of the kernels in `cuda/`: the only place that calls the unsafe
//! `Device::launch`. Each wrapper checks sizes and sets up buffers so that the kernel's
//! contract (stated at the top of its `.cu` file) holds, and says so in a `SAFETY` comment.

pub mod aggregate;
pub mod compact;
pub mod expr;
pub mod gather;
pub mod hash;
pub mod hash_table;
pub mod join;
pub mod scan;
pub mod selftest;

use arrow::datatypes::DataType;

use crate::column::{DeviceColumn, Layout};
use crate::device::Device;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// Threads per block for Fulmen's one-dimensional kernels.
pub const BLOCK: u32 = 256;

/// Row indices are u32 and `u32::MAX` marks a NULL index, so a batch holds fewer rows.
pub const MAX_ROWS: usize = u32::MAX as usize - 1;

/// An index meaning "no row": gathering it gives NULL.
pub const NULL_INDEX: u32 = u32::MAX;

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
    buffer: DeviceBuffer,
    count: usize,
    bound: usize,
    nullable: bool,
}

impl RowIndices {
    pub(crate) fn new(buffer: DeviceBuffer, count: usize, bound: usize, nullable: bool) -> Self {
        Self {
            buffer,
            count,
            bound,
            nullable,
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

    /// Copies the indices to the host.
    pub fn to_host(&self) -> Result<Vec<u32>> {
        let bytes = self.buffer.to_host()?;
        Ok(bytes[..self.count * 4]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
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
        column.offsets().map_or(0, DeviceBuffer::addr),
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
