//! Hash aggregation on a device (`cuda/agg.cu`): a [`GroupTable`] holds the groups seen so
//! far (their keys, in first-seen order) and one accumulator per aggregate state, and takes
//! batch after batch.
//!
//! Each [`GroupTable::update`] either applies the whole batch or leaves the table as it
//! was: everything that can fail for lack of memory is allocated before the first kernel
//! that changes the table runs, and a failed change is rolled back (the new slots of the
//! batch are removed; grown accumulators are fresh copies, dropped on failure). A caller
//! can therefore always download a consistent state and finish on the CPU.

use arrow::array::{ArrayRef, new_empty_array};
use arrow::datatypes::DataType;

use super::{BLOCK, RowIndices, Word, check_rows, gather, key_descriptors, scan, words_of};

mod fused;
mod growth;
mod read;
mod update;
use crate::column::{DeviceColumn, Layout};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};
pub use fused::{
    FUSED_ROWS_PER_GROUP, Fused, FusedInput, FusedSpec, MAX_FUSED_ACCS, MAX_REGISTERS,
};

/// Group ids are below this (the kernels mark pending slots with the top bit).
pub const MAX_GROUPS: usize = 0x7FFF_FFFF - 1;

/// Dynamic shared memory a few-groups update may use per block (the default limit of a
/// launch without opting in to more).
pub const SHARED_BYTES: usize = 48 * 1024;

const EMPTY_SLOT: u64 = u64::MAX;
/// Hash slots a keyed table has at least (a power of two).
const MIN_SLOTS: u64 = 2048;
/// New groups a table's first batch is given slots for at most (twice as many slots, 16
/// MiB): a batch with more is undone and done again with room for all its rows.
const FIRST_GUESS: u64 = 1 << 20;

/// Words of one group's exact float sum (`AGG_EXACT_WORDS` in agg.cu): 68 limbs of 31 bits
/// in units of 2^-1074, and a word of NaN / infinity flags.
const EXACT_WORDS: usize = 69;

/// Pieces a limb of an exact sum may take before it must be carried: each piece is below
/// 2^31 and a limb is a signed 64-bit integer, so fewer than 2^32 of them always fit.
const EXACT_PIECES: u64 = u32::MAX as u64 - 1;

/// What an accumulator does with the values of its group (`AggOp` in agg.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccOp {
    /// Counts the rows that contribute (non-NULL value and filter true).
    Count,
    /// Wrapping 64-bit integer sum.
    SumInt,
    /// Float sum, exact: kept as a fixed-point integer wide enough for every double and
    /// rounded once, to the nearest double, when read. The result is the correctly rounded
    /// sum, whatever the order of the rows, threads, blocks and batches.
    SumFloat,
    /// Wrapping 128-bit decimal sum.
    SumDecimal,
    /// Integer minimum.
    MinInt,
    /// Integer maximum.
    MaxInt,
    /// Float minimum in IEEE total order (as DataFusion's).
    MinFloat,
    /// Float maximum in IEEE total order.
    MaxFloat,
    /// Decimal minimum.
    MinDecimal,
    /// Decimal maximum.
    MaxDecimal,
}

impl AccOp {
    fn code(self) -> u64 {
        self as u64
    }

    /// Device words of one group's state.
    fn words(self) -> usize {
        match self {
            Self::Count => 0,
            Self::SumFloat => EXACT_WORDS,
            Self::SumDecimal | Self::MinDecimal | Self::MaxDecimal => 2,
            _ => 1,
        }
    }

    /// Words of one group's state as it comes to the host (an exact sum comes rounded).
    fn host_words(self) -> usize {
        match self {
            Self::SumFloat => 1,
            other => other.words(),
        }
    }

    /// Decimal minimum and maximum update a group under a lock, so they take no part in
    /// the shared-memory strategy.
    fn locked(self) -> bool {
        matches!(self, Self::MinDecimal | Self::MaxDecimal)
    }
}

/// One accumulator's input for a batch.
#[derive(Debug, Clone, Copy)]
pub struct AccInput<'a> {
    /// The values; `None` counts rows (`count(*)`).
    pub values: Option<&'a DeviceColumn>,
    /// A boolean column: only rows where it is true contribute (`FILTER (WHERE …)`).
    pub filter: Option<&'a DeviceColumn>,
}

/// An accumulator's final state, per group.
#[derive(Debug, Clone, PartialEq)]
pub struct AccState {
    /// Rows that contributed to each group (0: the group's value is NULL).
    pub counts: Vec<u64>,
    /// The values.
    pub values: AccValues,
}

/// The values of an accumulator, per group.
#[derive(Debug, Clone, PartialEq)]
pub enum AccValues {
    /// `Count` keeps none.
    None,
    /// Integer sums, minima and maxima.
    Int(Vec<i64>),
    /// Float sums, minima and maxima.
    Float(Vec<f64>),
    /// Decimal sums, minima and maxima (unscaled).
    Decimal(Vec<i128>),
}

/// How the kernels read an input column (`AggIn` in agg.cuh).
fn input_kind(column: &DeviceColumn) -> Result<u64> {
    input_kind_of(column.data_type())
}

/// How the kernels read values of `data_type` (`AggIn` in agg.cuh), from a column or from
/// a register of a fused program.
fn input_kind_of(data_type: &DataType) -> Result<u64> {
    use DataType::*;
    Ok(match data_type {
        Int8 => 0,
        Int16 => 1,
        Int32 | Date32 | Time32(_) => 2,
        // UInt64 only feeds sums (count states), which wrap the same either way.
        Int64 | UInt64 | Date64 | Time64(_) | Timestamp(_, _) | Duration(_) => 3,
        UInt8 => 4,
        UInt16 => 5,
        UInt32 => 6,
        Float32 => 7,
        Float64 => 8,
        // Narrow decimals are 64-bit integers on the device (and in a fused program's
        // registers they fit 64 bits): read as such, sign-extended by the decimal ops.
        Decimal128(p, _) if *p <= crate::column::NARROW_DECIMAL_PRECISION => 3,
        Decimal128(_, _) => 9,
        other => {
            return Err(KernelError::Unsupported(format!(
                "aggregating {other} values"
            )));
        }
    })
}

const INPUT_NONE: u64 = 10;

fn upload_words(device: &Device, words: &[u64]) -> Result<DeviceBuffer> {
    let bytes: Vec<u8> = if words.is_empty() {
        vec![0; 8]
    } else {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    };
    device.upload(&bytes)
}

pub(crate) fn fill_u64(
    device: &Device,
    buffer: &DeviceBuffer,
    words: usize,
    value: u64,
) -> Result<()> {
    if buffer.len() < words * 8 {
        return Err(KernelError::Unsupported(format!(
            "filling {words} words of a {} byte buffer",
            buffer.len()
        )));
    }
    // SAFETY: `buffer` holds `words` u64 (checked).
    unsafe {
        device.launch(
            Kernel::agg_fill_u64,
            LaunchConfig::for_items(device, words as u64, BLOCK),
            &[Arg::buf(buffer), Arg::U64(words as u64), Arg::U64(value)],
        )
    }
}

/// One accumulator's device state, sized for `GroupTable::group_capacity` groups.
#[derive(Debug)]
struct Acc {
    op: AccOp,
    state: Option<DeviceBuffer>,
    counts: DeviceBuffer,
}

/// Device buffers for `capacity` groups: new ones, the first `keep` groups copied from
/// the old ones, the rest at their identity.
#[derive(Debug)]
struct Grown {
    accs: Vec<Acc>,
    group_hashes: Option<DeviceBuffer>,
    locks: Option<DeviceBuffer>,
    capacity: usize,
}

/// Bytes of the status buffer [`UpdateWith::status`] names (see [`super::STATUS_BYTES`]):
/// word 0 the table's own count of new groups, word 1 the upstream work's error word.
pub use super::STATUS_BYTES;

/// Rows of a keyed batch: `agg.cu` numbers a pending group PENDING | row (bit 31), which
/// must never read as its SKIP id (all ones).
const MAX_KEYED_ROWS: usize = 0x7FFF_FFFF;

/// What a batch's [`GroupTable::update_with`] also depends on.
#[derive(Debug, Default, Clone, Copy)]
pub struct UpdateWith<'a> {
    /// The rows the aggregation takes (true and valid); `None`: every row. Rows it drops
    /// make no group and update no accumulator: a filter fused into the aggregation.
    pub rows: Option<&'a DeviceColumn>,
    /// A buffer of [`STATUS_BYTES`] whose word 1 was zeroed before the upstream work it
    /// watches was queued, and which that work sets when its outputs are not to be used
    /// (an expression program whose error word it is,
    /// [`super::expr::evaluate_unchecked`]). The table reads it with its own count of new
    /// groups (word 0, which it zeroes itself) in one host wait, so a fused stage waits
    /// once.
    pub status: Option<&'a DeviceBuffer>,
}

/// The groups of an aggregation and their accumulators, on one device.
#[derive(Debug)]
pub struct GroupTable {
    device: Device,
    keyed: bool,
    groups: usize,
    group_capacity: usize,
    slots: Option<DeviceBuffer>,
    capacity: u64,
    /// New groups per row of the last batch, in 1/1024ths: the slots are sized by it.
    /// `None` before the first: that batch's rows are taken to be new groups, up to
    /// [`FIRST_GUESS`] of them and one per 256 bytes of device memory left, so that a
    /// batch of many groups is not inserted twice (the first time into too few slots, then
    /// undone).
    new_per_row: Option<u64>,
    /// Row hash of each group (to rebuild the slots when the table grows).
    group_hashes: Option<DeviceBuffer>,
    /// Key columns of the groups, one chunk per batch that added groups, and the first
    /// group id of each chunk.
    chunks: Vec<Vec<DeviceColumn>>,
    starts: Vec<u64>,
    key_types: Vec<DataType>,
    accs: Vec<Acc>,
    locks: Option<DeviceBuffer>,
    /// How many batches used per-block shared-memory tables (few groups) and how many the
    /// global table (many groups).
    pub shared_updates: u64,
    /// See `shared_updates`.
    pub global_updates: u64,
    /// Rows added to the exact float sums since their limbs were last carried.
    uncarried_rows: u64,
    /// Rows after which they are carried (EXACT_PIECES; less in tests of the carrying).
    carry_interval: u64,
    /// The per-batch deltas of fused updates (`fused.rs`), sized for the groups there were.
    deltas: Option<fused::Deltas>,
    /// Batches to go the ordinary way before the next fused try, and how many the next
    /// fused try that meets new keys sets (see `fused_ready`).
    fused_skips: u32,
    fused_backoff: u32,
    /// Rows of the batches added (or whose keys were inserted) so far.
    rows_seen: u64,
    /// Batches added by the fused kernel, which evaluates their program in registers
    /// ([`update_fused`](Self::update_fused)).
    pub fused_updates: u64,
}

impl GroupTable {
    /// An empty table grouping by keys of `key_types` (none: one group, as an aggregate
    /// without GROUP BY has even over no rows) with these accumulators.
    pub fn new(device: &Device, key_types: &[DataType], ops: &[AccOp]) -> Result<Self> {
        let keyed = !key_types.is_empty();
        let mut table = Self {
            device: device.clone(),
            keyed,
            groups: if keyed { 0 } else { 1 },
            group_capacity: 0,
            slots: None,
            capacity: 0,
            new_per_row: None,
            group_hashes: None,
            chunks: Vec::new(),
            starts: Vec::new(),
            key_types: key_types.to_vec(),
            accs: ops
                .iter()
                .map(|&op| {
                    Ok(Acc {
                        op,
                        state: None,
                        counts: device.alloc(8)?,
                    })
                })
                .collect::<Result<_>>()?,
            locks: None,
            shared_updates: 0,
            global_updates: 0,
            uncarried_rows: 0,
            carry_interval: EXACT_PIECES,
            deltas: None,
            fused_skips: 0,
            fused_backoff: 1,
            rows_seen: 0,
            fused_updates: 0,
        };
        // A keyed table's first slots are set empty with its accumulators, in one launch
        // (its first batch, which has no count of new groups per row yet, wants no more).
        let slots = match keyed {
            true => Some(device.alloc(MIN_SLOTS as usize * 8)?),
            false => None,
        };
        let grown = table.grown(
            if keyed { 1024 } else { 1 },
            slots.as_ref().map(|s| (s, MIN_SLOTS)),
        )?;
        table.install(grown);
        if let Some(slots) = slots {
            table.slots = Some(slots);
            table.capacity = MIN_SLOTS;
        }
        Ok(table)
    }

    /// Groups so far.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Bytes the keys and states of the groups occupy: what [`keys`](Self::keys) and
    /// [`state`](Self::state) of every accumulator bring to the host.
    pub fn result_bytes(&self) -> usize {
        let keys: usize = self
            .chunks
            .iter()
            .flatten()
            .map(DeviceColumn::device_bytes)
            .sum();
        let states: usize = self.accs.iter().map(|a| (1 + a.op.host_words()) * 8).sum();
        keys + states * self.groups
    }

    /// Device bytes the table holds.
    pub fn device_bytes(&self) -> usize {
        let accs: usize = self
            .accs
            .iter()
            .map(|a| a.counts.len() + a.state.as_ref().map_or(0, DeviceBuffer::len))
            .sum();
        let keys: usize = self
            .chunks
            .iter()
            .flatten()
            .map(DeviceColumn::device_bytes)
            .sum();
        accs + keys
            + self.slots.as_ref().map_or(0, DeviceBuffer::len)
            + self.group_hashes.as_ref().map_or(0, DeviceBuffer::len)
            + self.locks.as_ref().map_or(0, DeviceBuffer::len)
    }
}
