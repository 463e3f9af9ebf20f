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

use super::{BLOCK, RowIndices, Word, check_rows, gather, hash, key_descriptors, scan};

mod fused;
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

fn fill_u64(device: &Device, buffer: &DeviceBuffer, words: usize, value: u64) -> Result<()> {
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
    new_per_row: u64,
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
            new_per_row: 0,
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
        let grown = table.grown(if keyed { 1024 } else { 1 })?;
        table.install(grown);
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

    fn grown(&self, capacity: usize) -> Result<Grown> {
        let device = &self.device;
        let keep = self.groups.min(self.group_capacity);
        let mut accs = Vec::with_capacity(self.accs.len());
        for acc in &self.accs {
            let counts = device.alloc(capacity * 8)?;
            fill_u64(device, &counts, capacity, 0)?;
            if keep > 0 {
                copy_prefix(device, &counts, &acc.counts, keep * 8)?;
            }
            let words = acc.op.words();
            let state = if words > 0 {
                let state = device.alloc(capacity * words * 8)?;
                // SAFETY: `state` holds `capacity` groups of `words` words.
                unsafe {
                    device.launch(
                        Kernel::agg_init_state,
                        LaunchConfig::for_items(device, capacity as u64, BLOCK),
                        &[
                            Arg::buf(&state),
                            Arg::U64(acc.op.code()),
                            Arg::U64(0),
                            Arg::U64(capacity as u64),
                        ],
                    )?;
                }
                if let (Some(old), true) = (&acc.state, keep > 0) {
                    copy_prefix(device, &state, old, keep * words * 8)?;
                }
                Some(state)
            } else {
                None
            };
            accs.push(Acc {
                op: acc.op,
                state,
                counts,
            });
        }
        let group_hashes = if self.keyed {
            let buffer = device.alloc(capacity * 8)?;
            if let (Some(old), true) = (&self.group_hashes, keep > 0) {
                copy_prefix(device, &buffer, old, keep * 8)?;
            }
            Some(buffer)
        } else {
            None
        };
        let locks = if self.accs.iter().any(|a| a.op.locked()) {
            let buffer = device.alloc(capacity.div_ceil(2) * 8)?;
            fill_u64(device, &buffer, capacity.div_ceil(2), 0)?;
            Some(buffer)
        } else {
            None
        };
        Ok(Grown {
            accs,
            group_hashes,
            locks,
            capacity,
        })
    }

    fn install(&mut self, grown: Grown) {
        self.accs = grown.accs;
        self.group_hashes = grown.group_hashes;
        self.locks = grown.locks;
        self.group_capacity = grown.capacity;
    }

    /// New, empty slots for `capacity` entries with the committed groups inserted.
    fn rebuilt_slots(&self, capacity: u64) -> Result<DeviceBuffer> {
        let device = &self.device;
        let slots = device.alloc(capacity as usize * 8)?;
        fill_u64(device, &slots, capacity as usize, EMPTY_SLOT)?;
        if self.groups > 0 {
            let hashes = self
                .group_hashes
                .as_ref()
                .ok_or_else(|| KernelError::InvalidData("a keyed table without hashes".into()))?;
            // SAFETY: `slots` holds `capacity` (a power of two above twice the groups)
            // empty slots, so every insert finds one; `hashes` holds `groups` u64.
            unsafe {
                device.launch(
                    Kernel::agg_rehash,
                    LaunchConfig::for_items(device, self.groups as u64, BLOCK),
                    &[
                        Arg::buf(&slots),
                        Arg::U64(capacity - 1),
                        Arg::buf(hashes),
                        Arg::U64(self.groups as u64),
                    ],
                )?;
            }
        }
        Ok(slots)
    }

    /// Removes the slots of groups numbered `g0` and above (and pending ones), retrying
    /// once: the table is only consistent again once this has run.
    fn rollback(&self, g0: usize) -> Result<()> {
        let (Some(slots), device) = (&self.slots, &self.device) else {
            return Ok(());
        };
        let run = || {
            // SAFETY: `slots` holds `capacity` u64.
            unsafe {
                device.launch(
                    Kernel::agg_rollback,
                    LaunchConfig::for_items(device, self.capacity, BLOCK),
                    &[
                        Arg::buf(slots),
                        Arg::U64(self.capacity),
                        Arg::U64(g0 as u64),
                    ],
                )
            }
        };
        run().or_else(|_| run())
    }

    /// Adds a batch of `n` rows: its key columns (in the table's key types) and each
    /// accumulator's input, in the order of the table's accumulators.
    pub fn update(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: &[AccInput<'_>],
        n: usize,
    ) -> Result<()> {
        self.update_with(keys, inputs, n, UpdateWith::default())
            .map(|_| ())
    }

    /// [`update`](Self::update), taking only the rows `with.rows` selects and, when
    /// `with.status` is given, first checking in the same host wait as its own that the
    /// upstream work it names succeeded. `Ok(false)`: the status word was set, and the table
    /// is as it was.
    pub fn update_with(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: &[AccInput<'_>],
        n: usize,
        with: UpdateWith<'_>,
    ) -> Result<bool> {
        self.add_batch(keys, Some(inputs), n, with)
    }

    /// Inserts the groups of a batch's keys (of the rows `with.rows` selects) that the
    /// table does not have yet, and updates no accumulator: what a batch with new keys
    /// does before [`update_fused`](Self::update_fused) adds its values. With
    /// `with.status`, `Ok(false)`: the upstream work failed, and the table is as it was.
    pub fn insert_groups(
        &mut self,
        keys: &[&DeviceColumn],
        n: usize,
        with: UpdateWith<'_>,
    ) -> Result<bool> {
        if !self.keyed {
            return Err(KernelError::Unsupported(
                "inserting groups into a table without keys".into(),
            ));
        }
        self.add_batch(keys, None, n, with)
    }

    /// Adds a batch: inserts its new groups and, with `inputs`, updates the accumulators.
    fn add_batch(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: Option<&[AccInput<'_>]>,
        n: usize,
        with: UpdateWith<'_>,
    ) -> Result<bool> {
        if inputs.is_some() {
            // An ordinary batch: one fewer to go before the next fused try.
            self.fused_skips = self.fused_skips.saturating_sub(1);
        }
        check_rows(n)?;
        self.rows_seen += n as u64;
        if let Some(rows) = with.rows
            && (rows.layout() != Layout::Bits || rows.len() != n || rows.device() != &self.device)
        {
            return Err(KernelError::Unsupported(
                "a row selection that is not a boolean column of the batch's rows".into(),
            ));
        }
        if with.status.is_some_and(|s| s.len() < STATUS_BYTES) {
            return Err(KernelError::Unsupported(format!(
                "a status buffer of fewer than {STATUS_BYTES} bytes"
            )));
        }
        if inputs.is_some_and(|inputs| inputs.len() != self.accs.len()) {
            return Err(KernelError::Unsupported(format!(
                "{} accumulator inputs for {} accumulators",
                inputs.map_or(0, <[_]>::len),
                self.accs.len()
            )));
        }
        for input in inputs.unwrap_or_default() {
            for column in input.values.iter().chain(input.filter.iter()) {
                if column.len() != n || column.device() != &self.device {
                    return Err(KernelError::Unsupported(
                        "an aggregate input of another length or device".into(),
                    ));
                }
            }
            if input.filter.is_some_and(|f| f.layout() != Layout::Bits) {
                return Err(KernelError::Unsupported("a non-boolean filter".into()));
            }
        }
        if n == 0 {
            return Ok(true);
        }
        if !self.keyed {
            if with.rows.is_some() {
                return Err(KernelError::Unsupported(
                    "a row selection for an aggregation without keys".into(),
                ));
            }
            if let Some(status) = with.status
                && status.read_u64(1)? != 0
            {
                return Ok(false);
            }
            let inputs = inputs.unwrap_or_default();
            self.carry_exact_sums(n)?;
            let descriptors = self.accumulator_descriptors(&self.accs, inputs)?;
            let reached = reached_by(&self.accs, inputs);
            let shared =
                self.launch_update(&descriptors, &reached, None, n, 1, self.locks.as_ref())?;
            self.count_update(shared);
            return Ok(true);
        }
        if n >= MAX_KEYED_ROWS {
            return Err(KernelError::Unsupported(format!(
                "keyed batches of {n} rows (fewer than 2^31 - 1 rows fit)"
            )));
        }
        if keys.len() != self.key_types.len()
            || keys
                .iter()
                .zip(&self.key_types)
                .any(|(k, t)| k.value_type() != t || k.len() != n || k.device() != &self.device)
        {
            return Err(KernelError::Unsupported(
                "group keys of other types, lengths or devices than the table's".into(),
            ));
        }
        if self.groups + n > MAX_GROUPS {
            return Err(KernelError::Unsupported(format!(
                "more than {MAX_GROUPS} groups"
            )));
        }
        let device = self.device.clone();
        let g0 = self.groups;
        let cfg = LaunchConfig::for_items(&device, n as u64, BLOCK);
        let hashes = hash::hash_columns(&device, keys)?;
        let batch_desc = key_descriptors(&device, keys)?;
        let mut store_desc = Vec::new();
        for chunk in &self.chunks {
            for key in chunk {
                store_desc.extend(super::key_descriptor(key)?);
            }
        }
        let store_desc = upload_words(&device, &store_desc)?;
        let mut starts = self.starts.clone();
        starts.push(g0 as u64);
        let starts = upload_words(&device, &starts)?;
        // Carrying changes no sum, so it goes first: nothing is pending yet should it fail.
        self.carry_exact_sums(n)?;
        let refs = device.alloc(n * 4)?;
        // The count of new groups (word 0, zeroed here before every attempt, so that no
        // caller's value can pass for "no new group"), and word 1, the upstream status the
        // caller zeroed.
        let own_status;
        let inserted = match with.status {
            Some(status) => status,
            None => {
                own_status = device.alloc(8)?;
                &own_status
            }
        };
        let wait_count = || -> Result<Option<u64>> {
            if with.status.is_none() {
                return inserted.read_u64(0).map(Some);
            }
            super::read_status(inserted)
        };
        // Room for the groups there are and, with an eighth to spare, as many new ones per
        // row as the last batch brought: a batch that brings more than there is room for
        // is undone and done again, which costs another wait.
        let expected = (n as u64).saturating_mul(self.new_per_row) / 1024;
        let expected = (expected + expected / 8).min(n as u64);
        let inserted_count = loop {
            let wanted = ((g0 as u64 + expected) * 2).max(2048).next_power_of_two();
            if self.slots.is_none() || self.capacity < wanted {
                let slots = self.rebuilt_slots(wanted)?;
                self.slots = Some(slots);
                self.capacity = wanted;
            }
            let slots = self.slots.as_ref().expect("slots were just built");
            let limit = self.capacity / 2 - g0 as u64;
            inserted.write(0, &0u64.to_le_bytes())?;
            // SAFETY: `slots` holds `capacity` u64 (mask capacity - 1) with fewer than
            // capacity / 2 used, and inserts stop at `limit` more, so a free slot always
            // remains; `hashes` and `refs` hold n rows; the descriptors point at key
            // columns of n rows (batch) and of the committed chunks, whose `starts` give
            // every committed group id a chunk; `inserted` holds one u64 (zeroed just
            // before); `rows`, when given, is a boolean column of n rows (checked), its
            // values and validity ceil(n/8) bytes or more.
            unsafe {
                device.launch(
                    Kernel::agg_find_or_insert,
                    cfg,
                    &[
                        Arg::buf(slots),
                        Arg::U64(self.capacity - 1),
                        Arg::buf(&hashes),
                        Arg::U64(n as u64),
                        Arg::buf(&batch_desc),
                        Arg::buf(&store_desc),
                        Arg::buf(&starts),
                        Arg::U32(self.chunks.len() as u32),
                        Arg::U32(keys.len() as u32),
                        Arg::U64(limit),
                        Arg::buf(inserted),
                        Arg::buf(&refs),
                        Arg::opt(with.rows.map(DeviceColumn::values)),
                        Arg::opt(with.rows.and_then(DeviceColumn::validity)),
                    ],
                )
            }
            .inspect_err(|_| {
                let _ = self.rollback(g0);
            })?;
            let count = match wait_count() {
                Ok(Some(count)) => count,
                Ok(None) => {
                    // The upstream work failed: its outputs (these keys) are not to be used.
                    self.rollback(g0)?;
                    return Ok(false);
                }
                Err(e) => {
                    let _ = self.rollback(g0);
                    return Err(e);
                }
            };
            if count <= limit {
                break count;
            }
            // Too many new keys for the table: undo, grow for the worst case, retry.
            self.rollback(g0)?;
            let grown = ((g0 + n) as u64 * 2).next_power_of_two();
            let slots = self.rebuilt_slots(grown)?;
            self.slots = Some(slots);
            self.capacity = grown;
        };
        self.new_per_row = (inserted_count.saturating_mul(1024)).div_ceil(n.max(1) as u64);
        if inserted_count == 0 {
            // No new group: every ref is a committed group id (or SKIP), the table's slots
            // are unchanged, and the accumulators are updated by the refs at once.
            let Some(inputs) = inputs else {
                return Ok(true);
            };
            let descriptors = self.accumulator_descriptors(&self.accs, inputs)?;
            let reached = reached_by(&self.accs, inputs);
            let shared = self.launch_update(
                &descriptors,
                &reached,
                Some(&refs),
                n,
                g0,
                self.locks.as_ref(),
            )?;
            self.count_update(shared);
            return Ok(true);
        }
        // From here until the commit the table holds pending slots: any failure rolls
        // them back before returning.
        let result = self.commit_batch(keys, inputs, n, &hashes, &refs);
        if let Err(e) = result {
            // A failed rollback is the error to report (the table is no longer as it was),
            // unless the device is gone: then the rollback fails only for that, and the
            // first error says why.
            return Err(match self.rollback(g0) {
                Err(rollback) if !e.device_gone() => rollback,
                _ => e,
            });
        }
        result.map(|()| true)
    }

    fn commit_batch(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: Option<&[AccInput<'_>]>,
        n: usize,
        hashes: &DeviceBuffer,
        refs: &DeviceBuffer,
    ) -> Result<()> {
        let device = self.device.clone();
        let g0 = self.groups;
        let cfg = LaunchConfig::for_items(&device, n as u64, BLOCK);
        let first = device.alloc(n.div_ceil(2) * 8)?;
        fill_u64(&device, &first, n.div_ceil(2), u64::MAX)?;
        let flags = device.alloc(n * 8)?;
        // SAFETY: `refs` holds n u32 ids, each committed or PENDING | row < n; `first`
        // holds n u32 and `flags` n u64.
        unsafe {
            device.launch(
                Kernel::agg_first_rows,
                cfg,
                &[Arg::buf(refs), Arg::U64(n as u64), Arg::buf(&first)],
            )?;
            device.launch(
                Kernel::agg_leader_flags,
                cfg,
                &[
                    Arg::buf(refs),
                    Arg::buf(&first),
                    Arg::U64(n as u64),
                    Arg::buf(&flags),
                ],
            )?;
        }
        // One wait for the count of new groups and the byte totals of their string keys
        // together: the keys' lengths at the leader rows are queued over the flags.
        let strings: Vec<usize> = (0..keys.len())
            .filter(|&k| keys[k].offsets().is_some())
            .collect();
        // n > 0 here (a batch adds groups), so every scan writes its total: no zeroing.
        let totals = device.alloc(8 * (1 + strings.len()))?;
        let ranks = scan::exclusive_scan_queued(&device, &flags, n, Word::of(&totals, 0)?)?;
        let mut starts: Vec<Option<gather::QueuedStarts>> = (0..keys.len()).map(|_| None).collect();
        for (w, &k) in strings.iter().enumerate() {
            starts[k] = Some(gather::queue_flagged_string_starts(
                keys[k],
                &flags,
                Word::of(&totals, 1 + w)?,
            )?);
        }
        let words: Vec<u64> = totals
            .to_host()?
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
            .collect();
        if words.len() != 1 + strings.len() {
            return Err(KernelError::InvalidData(
                "a short read of new groups".into(),
            ));
        }
        let word = |w: usize| words[w];
        let new = word(0) as usize;
        if new > n {
            return Err(KernelError::InvalidData(format!(
                "{new} new groups in a batch of {n} rows"
            )));
        }
        let mut byte_totals = vec![0u64; keys.len()];
        for (w, &k) in strings.iter().enumerate() {
            byte_totals[k] = word(1 + w);
        }
        let total = g0 + new;
        let grown = if total > self.group_capacity {
            Some(self.grown(total.max(self.group_capacity * 2))?)
        } else {
            None
        };
        let group_hashes = grown
            .as_ref()
            .map_or(self.group_hashes.as_ref(), |g| g.group_hashes.as_ref())
            .ok_or_else(|| KernelError::InvalidData("a keyed table without hashes".into()))?;
        let gids = device.alloc(n * 4)?;
        let leaders = device.alloc(new.max(1) * 4)?;
        // SAFETY: ranks are the exclusive scan of the 0/1 flags, so leader ranks are
        // below `new`, and g0 + rank < total <= the hashes' capacity; every pending id's
        // `first` row is a leader (it set its own flag).
        unsafe {
            device.launch(
                Kernel::agg_resolve,
                cfg,
                &[
                    Arg::buf(refs),
                    Arg::buf(&first),
                    Arg::buf(&ranks),
                    Arg::buf(&flags),
                    Arg::buf(hashes),
                    Arg::U64(n as u64),
                    Arg::U64(g0 as u64),
                    Arg::buf(&gids),
                    Arg::buf(&leaders),
                    Arg::buf(group_hashes),
                ],
            )?;
        }
        let leaders = RowIndices::new(leaders, new, n, false);
        let chunk = keys
            .iter()
            .zip(starts)
            .zip(byte_totals)
            .map(|((k, started), total)| match started {
                Some(started) => gather::gather_column_started(k, &leaders, started, total),
                None => gather::gather_column(k, &leaders),
            })
            .collect::<Result<Vec<_>>>()?;
        let accs = grown.as_ref().map_or(&self.accs, |g| &g.accs);
        let descriptors = inputs
            .map(|inputs| self.accumulator_descriptors(accs, inputs))
            .transpose()?;
        let slots = self
            .slots
            .as_ref()
            .ok_or_else(|| KernelError::InvalidData("a keyed table without slots".into()))?;
        // The changes: slots first (undone by a rollback), then the accumulators in one
        // launch (which either runs or not; grown accumulators are copies until installed).
        // SAFETY: `slots` holds `capacity` u64; pending ids index `first` (n rows).
        unsafe {
            device.launch(
                Kernel::agg_fix_slots,
                LaunchConfig::for_items(&device, self.capacity, BLOCK),
                &[
                    Arg::buf(slots),
                    Arg::U64(self.capacity),
                    Arg::buf(&first),
                    Arg::buf(&ranks),
                    Arg::U64(g0 as u64),
                ],
            )?;
        }
        if let (Some(descriptors), Some(inputs)) = (&descriptors, inputs) {
            let locks = grown
                .as_ref()
                .map_or(self.locks.as_ref(), |g| g.locks.as_ref());
            let reached = reached_by(grown.as_ref().map_or(&self.accs, |g| &g.accs), inputs);
            let shared = self.launch_update(descriptors, &reached, Some(&gids), n, total, locks)?;
            self.count_update(shared);
        }
        if let Some(grown) = grown {
            self.install(grown);
        }
        if new > 0 {
            self.chunks.push(chunk);
            self.starts.push(g0 as u64);
        }
        self.groups = total;
        Ok(())
    }

    fn accumulator_descriptors(
        &self,
        accs: &[Acc],
        inputs: &[AccInput<'_>],
    ) -> Result<DeviceBuffer> {
        let mut words = Vec::with_capacity(accs.len() * 8);
        for (acc, input) in accs.iter().zip(inputs) {
            let kind = match input.values {
                // A count reads only the validity, whatever the type.
                Some(_) if acc.op == AccOp::Count => INPUT_NONE,
                Some(values) => input_kind(values)?,
                None if acc.op == AccOp::Count => INPUT_NONE,
                None => {
                    return Err(KernelError::Unsupported(
                        "an accumulator other than count without values".into(),
                    ));
                }
            };
            let decimal_op = matches!(
                acc.op,
                AccOp::SumDecimal | AccOp::MinDecimal | AccOp::MaxDecimal
            );
            let decimal = input
                .values
                .is_some_and(|v| matches!(v.data_type(), DataType::Decimal128(..)));
            if decimal && !decimal_op && acc.op != AccOp::Count {
                return Err(KernelError::Unsupported(format!(
                    "{:?} of decimal values",
                    acc.op
                )));
            }
            words.extend([
                acc.op.code(),
                kind,
                input.values.map_or(0, |c| c.values().addr()),
                input
                    .values
                    .and_then(DeviceColumn::validity)
                    .map_or(0, DeviceBuffer::addr),
                input.filter.map_or(0, |c| c.values().addr()),
                input
                    .filter
                    .and_then(DeviceColumn::validity)
                    .map_or(0, DeviceBuffer::addr),
                acc.state.as_ref().map_or(0, DeviceBuffer::addr),
                acc.counts.addr(),
            ]);
        }
        upload_words(&self.device, &words)
    }

    /// Runs `agg_update`; says whether it used per-block shared-memory tables.
    fn launch_update(
        &self,
        descriptors: &DeviceBuffer,
        reached: &[&DeviceBuffer],
        gids: Option<&DeviceBuffer>,
        n: usize,
        groups: usize,
        locks: Option<&DeviceBuffer>,
    ) -> Result<bool> {
        let device = &self.device;
        let per_group: usize = self.accs.iter().map(|a| (1 + a.op.words()) * 8).sum();
        let shared = groups * per_group;
        let use_shared =
            !self.accs.iter().any(|a| a.op.locked()) && shared <= SHARED_BYTES && groups <= 4096;
        let mut cfg = LaunchConfig::for_items(device, n as u64, BLOCK);
        if use_shared {
            cfg.shared_bytes = shared.max(8) as u32;
        }
        // SAFETY: every descriptor's input columns hold n rows of its input kind (checked
        // by the caller) and its state and counts hold at least `groups` groups; every gid
        // is below `groups` or SKIP (a row the kernel leaves out); `locks` holds a u32 per
        // group when a locked op is present; the shared tables of `shared` bytes fit the launch's dynamic shared memory.
        unsafe {
            device.launch_reaching(
                Kernel::agg_update,
                cfg,
                &[
                    Arg::buf(descriptors),
                    Arg::U32(self.accs.len() as u32),
                    Arg::opt(gids),
                    Arg::U64(n as u64),
                    Arg::opt(locks),
                    Arg::U64(groups as u64),
                    Arg::U32(u32::from(use_shared)),
                ],
                reached,
            )?;
        }
        Ok(use_shared)
    }

    /// Carries the limbs of the exact float sums when `n` more rows could overflow one.
    /// Carrying changes no sum, so a table stays as it was should the update then fail.
    fn carry_exact_sums(&mut self, n: usize) -> Result<()> {
        if !self.accs.iter().any(|a| a.op == AccOp::SumFloat) {
            return Ok(());
        }
        if self.uncarried_rows + n as u64 > self.carry_interval {
            for acc in self.accs.iter().filter(|a| a.op == AccOp::SumFloat) {
                let state = acc.state.as_ref().ok_or_else(|| {
                    KernelError::InvalidData("an exact sum without a state".into())
                })?;
                // SAFETY: `state` holds EXACT_WORDS words for each of `group_capacity` groups.
                unsafe {
                    self.device.launch(
                        Kernel::agg_exact_normalize,
                        LaunchConfig::for_items(&self.device, self.group_capacity as u64, BLOCK),
                        &[Arg::buf(state), Arg::U64(self.group_capacity as u64)],
                    )?;
                }
            }
            self.uncarried_rows = 0;
        }
        self.uncarried_rows += n as u64;
        Ok(())
    }

    /// Carries the exact sums' limbs before any update that would take them past `rows`
    /// uncarried rows (for tests: the real interval is 2^32 rows).
    #[doc(hidden)]
    pub fn carry_exact_sums_every(&mut self, rows: u64) {
        self.carry_interval = rows.min(EXACT_PIECES);
    }

    fn count_update(&mut self, shared: bool) {
        if shared {
            self.shared_updates += 1;
        } else {
            self.global_updates += 1;
        }
    }

    /// The key columns of the groups, in group order (first seen first).
    pub fn keys(&self) -> Result<Vec<ArrayRef>> {
        Ok(self.read(true, &[])?.0)
    }

    /// Accumulator `k`'s state for every group.
    pub fn state(&self, k: usize) -> Result<AccState> {
        let mut states = self.read(false, &[k])?.1;
        Ok(states.remove(0))
    }

    /// The key columns and every accumulator's state, all in one host wait (one per
    /// 16 MiB of staging past that): what a finished aggregation brings up.
    pub fn download(&self) -> Result<(Vec<ArrayRef>, Vec<AccState>)> {
        let all: Vec<usize> = (0..self.accs.len()).collect();
        self.read(true, &all)
    }

    /// The key columns (when `with_keys`) and the states of accumulators `ks`, read in one
    /// wait. Only the groups' part of each buffer comes down, not its spare capacity.
    fn read(&self, with_keys: bool, ks: &[usize]) -> Result<(Vec<ArrayRef>, Vec<AccState>)> {
        let g = self.groups;
        let accs = ks
            .iter()
            .map(|&k| {
                self.accs
                    .get(k)
                    .ok_or_else(|| KernelError::Unsupported(format!("accumulator {k}")))
            })
            .collect::<Result<Vec<&Acc>>>()?;
        // An exact float sum is rounded on the device first; the rounding is queued and
        // read with the rest.
        let rounded = accs
            .iter()
            .map(|acc| match (&acc.state, acc.op) {
                (Some(state), AccOp::SumFloat) if g > 0 => {
                    let rounded = self.device.alloc(g * 8)?;
                    // SAFETY: `state` holds EXACT_WORDS words for each of at least `g`
                    // groups, `rounded` a u64 for each.
                    unsafe {
                        self.device.launch(
                            Kernel::agg_exact_finish,
                            LaunchConfig::for_items(&self.device, g as u64, BLOCK),
                            &[Arg::buf(state), Arg::U64(g as u64), Arg::buf(&rounded)],
                        )?;
                    }
                    Ok(Some(rounded))
                }
                _ => Ok(None),
            })
            .collect::<Result<Vec<Option<DeviceBuffer>>>>()?;
        // Where each accumulator's words come from (the rounding, else the state), and
        // how many bytes of them: its groups' words as they come to the host.
        let sources: Vec<Option<(&DeviceBuffer, usize)>> = accs
            .iter()
            .zip(&rounded)
            .map(|(acc, rounded)| {
                rounded
                    .as_ref()
                    .or(acc.state.as_ref())
                    .map(|b| (b, (g * acc.op.host_words() * 8).min(b.len())))
            })
            .collect();
        let mut counts: Vec<Vec<u8>> = accs
            .iter()
            .map(|acc| vec![0u8; (g * 8).min(acc.counts.len())])
            .collect();
        let mut words: Vec<Vec<u8>> = sources
            .iter()
            .map(|s| vec![0u8; s.map_or(0, |(_, len)| len)])
            .collect();
        let columns: Vec<&DeviceColumn> = if with_keys {
            (0..self.key_types.len())
                .flat_map(|k| self.chunks.iter().map(move |chunk| &chunk[k]))
                .collect()
        } else {
            Vec::new()
        };
        let arrays = {
            let mut extra: Vec<(&DeviceBuffer, &mut [u8])> = Vec::new();
            for ((acc, source), (counts, words)) in accs
                .iter()
                .zip(&sources)
                .zip(counts.iter_mut().zip(words.iter_mut()))
            {
                if !counts.is_empty() {
                    extra.push((&acc.counts, counts.as_mut_slice()));
                }
                if let Some((buffer, _)) = source.filter(|(_, len)| *len > 0) {
                    extra.push((buffer, words.as_mut_slice()));
                }
            }
            crate::column::download_columns_with(&self.device, &columns, &mut extra)?
        };
        let keys = if with_keys {
            let mut arrays = arrays.into_iter();
            (0..self.key_types.len())
                .map(|k| {
                    let parts: Vec<ArrayRef> = arrays.by_ref().take(self.chunks.len()).collect();
                    if parts.is_empty() {
                        return Ok(new_empty_array(&self.key_types[k]));
                    }
                    // Chunks of dictionary-encoded keys come down as dictionaries: every
                    // chunk in the table's key type.
                    let parts = parts
                        .into_iter()
                        .map(|a| match a.data_type() == &self.key_types[k] {
                            true => Ok(a),
                            false => arrow::compute::cast(&a, &self.key_types[k])
                                .map_err(|e| KernelError::InvalidData(e.to_string())),
                        })
                        .collect::<Result<Vec<ArrayRef>>>()?;
                    let refs: Vec<&dyn arrow::array::Array> =
                        parts.iter().map(|a| a.as_ref()).collect();
                    arrow::compute::concat(&refs)
                        .map_err(|e| KernelError::InvalidData(e.to_string()))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let states = accs
            .iter()
            .zip(counts.iter().zip(&words))
            .map(|(acc, (counts, words))| AccState {
                counts: words_of(counts, g),
                values: acc_values(acc, words, g),
            })
            .collect();
        Ok((keys, states))
    }
}

/// An accumulator's values from the words read for `g` groups (an exact float sum's
/// already rounded on the device).
fn acc_values(acc: &Acc, bytes: &[u8], g: usize) -> AccValues {
    if acc.state.is_none() {
        return AccValues::None;
    }
    match acc.op {
        AccOp::Count => AccValues::None,
        AccOp::SumFloat => {
            AccValues::Float(words_of(bytes, g).into_iter().map(f64::from_bits).collect())
        }
        AccOp::SumInt | AccOp::MinInt | AccOp::MaxInt => {
            AccValues::Int(words_of(bytes, g).iter().map(|&w| w as i64).collect())
        }
        AccOp::MinFloat | AccOp::MaxFloat => AccValues::Float(
            words_of(bytes, g)
                .iter()
                .map(|&w| f64::from_bits(if w >> 63 == 1 { w & !(1 << 63) } else { !w }))
                .collect(),
        ),
        AccOp::SumDecimal | AccOp::MinDecimal | AccOp::MaxDecimal => AccValues::Decimal(
            words_of(bytes, g * 2)
                .chunks_exact(2)
                .map(|p| ((p[1] as u128) << 64 | p[0] as u128) as i128)
                .collect(),
        ),
    }
}

fn words_of(bytes: &[u8], count: usize) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .take(count)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

/// Copies the first `len` bytes of `src` into `dst`.
fn copy_prefix(device: &Device, dst: &DeviceBuffer, src: &DeviceBuffer, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // The pool rounds sizes up, so `src` may be longer than `len`; copy through a view of
    // exactly `len` bytes when it is.
    if src.len() <= dst.len() {
        return device.copy(dst, src);
    }
    let bytes = src.to_host()?;
    dst.write(0, &bytes[..len])
}

/// The buffers `agg_update` reaches through the accumulator descriptors of `accs` over
/// `inputs`: each input's values, validity and filter, each accumulator's state and counts.
fn reached_by<'a>(accs: &'a [Acc], inputs: &'a [AccInput<'a>]) -> Vec<&'a DeviceBuffer> {
    let mut reached = Vec::new();
    for (acc, input) in accs.iter().zip(inputs) {
        for column in input.values.iter().chain(&input.filter) {
            reached.push(column.values());
            reached.extend(column.validity());
        }
        reached.extend(acc.state.as_ref());
        reached.push(&acc.counts);
    }
    reached
}
