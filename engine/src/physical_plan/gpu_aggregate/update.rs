//! Adding a batch to the device tables: the program (or DataFusion) computes keys,
//! arguments and filters, the pair tables and then the group table take the rows.

use std::collections::HashMap;

use datafusion::arrow::array::{Array, AsArray, UInt32Array};
use datafusion::arrow::compute::take;
use datafusion::common::internal_datafusion_err;
use datafusion::error::Result;
use fulmen_kernels::ops::aggregate::{AccInput, Fused, GroupTable, STATUS_BYTES, UpdateWith};
use fulmen_kernels::ops::compact::selection_indices;
use fulmen_kernels::ops::expr;
use fulmen_kernels::ops::gather::gather_columns;
use fulmen_kernels::{Device, DeviceColumn, KernelError};

use super::super::device_loop::PieceError;
use super::super::gpu_stream::{Chunk, GpuMetrics};
use super::arrow_err;
use super::plan::{AggregateWork, DistinctCount, NewKeys, Source, Tables};

impl AggregateWork {
    /// Adds one batch to `tables` on the device. `Ok(false)`: the program left some row to
    /// the CPU, and nothing was added (see [`Self::update_on_cpu`]).
    pub(super) fn update(
        &self,
        tables: &mut Tables,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<bool, PieceError> {
        self.update_rows(tables, device, input, metrics, false)
    }

    /// Adds one batch to `tables`, its expressions evaluated by DataFusion (over the rows
    /// of the fused filter, which it applies first; an error it raises is the query's): for
    /// a batch the program left to the CPU.
    pub(super) fn update_on_cpu(
        &self,
        tables: &mut Tables,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<(), PieceError> {
        let batch = input.to_host(metrics)?;
        let rows = Chunk::Host(self.cpu_rows(batch).map_err(PieceError::Query)?);
        self.update_rows(tables, device, &rows, metrics, true)?;
        Ok(())
    }

    /// Adds the batch `input`, its computed columns evaluated by the device program, or by
    /// DataFusion when `on_cpu` (`input` then holds only the fused filter's rows).
    /// `Ok(false)`: the program left some row to the CPU, and nothing was added.
    fn update_rows(
        &self,
        tables: &mut Tables,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
        on_cpu: bool,
    ) -> Result<bool, PieceError> {
        let n = input.num_rows();
        let mut uploaded: HashMap<usize, DeviceColumn> = HashMap::new();
        let upload =
            |c: usize, uploaded: &mut HashMap<usize, DeviceColumn>| -> Result<(), KernelError> {
                if let std::collections::hash_map::Entry::Vacant(slot) = uploaded.entry(c) {
                    slot.insert(input.device_column(c, device, metrics)?);
                }
                Ok(())
            };
        // Keys, selection and arguments straight from the program's registers, where the
        // table can take the batch so: one kernel reading each input column once. A table
        // without groups first takes the keys of the batch's first rows (reading only the
        // key columns and what the selection needs) where that pays (`first_keys_pay`):
        // with few groups they are usually all there, and the table then tries the batch
        // fused; with many (a handful of rows a group, `GroupTable::fused_ready`) it goes
        // the ordinary way. So does a batch with keys that have no group yet, its columns
        // already up, and a table's first batch where taking its first keys does not pay.
        let first = !self.keys.is_empty() && tables.groups() == 0;
        if let (Some((registers, spec)), Some(new_keys), false) =
            (&self.registers, &self.new_keys, on_cpu)
            && tables.groups.fused_possible()
            && (!first || first_keys_pay(n, self.computed.len(), self.accumulators.len()))
        {
            let Ok(bound) = registers.bind(&input.host_view()) else {
                return Ok(false);
            };
            let key_inputs = new_keys.program.iter().flat_map(|p| &p.inputs);
            for &c in registers.inputs.iter().chain(key_inputs) {
                upload(c, &mut uploaded)?;
            }
            if first {
                let rows = n.min(FIRST_KEYS_ROWS);
                if !insert_new_keys(new_keys, tables, device, input, metrics, &uploaded, rows)? {
                    return Ok(false);
                }
            }
            if tables.groups.fused_ready() {
                let columns: Vec<&DeviceColumn> =
                    registers.inputs.iter().map(|c| &uploaded[c]).collect();
                match metrics.kernel(|| tables.groups.update_fused(&bound, &columns, n, spec))? {
                    Fused::Added => return Ok(true),
                    Fused::LeftToCpu => return Ok(false),
                    Fused::NewGroups => {}
                }
            }
        }
        // Without pair tables (which take their rows before the group table) the program's
        // success is checked in the group table's own host wait: one wait per batch.
        let status = match (&self.program, on_cpu) {
            (Some(_), false) if self.distinct.is_empty() && !self.keys.is_empty() => {
                Some(device.upload(&[0; STATUS_BYTES])?)
            }
            _ => None,
        };
        let computed: Vec<DeviceColumn> = match &self.program {
            None => Vec::new(),
            Some(_) if on_cpu => {
                let batch = input.to_host(metrics)?;
                let mut columns = Vec::with_capacity(self.computed.len());
                for e in &self.computed {
                    let array = e
                        .evaluate(&batch)
                        .and_then(|v| v.into_array(n))
                        .map_err(PieceError::Query)?;
                    columns.push(metrics.upload(device, array.as_ref())?);
                }
                columns
            }
            Some(program) => {
                let Ok(bound) = program.bind(&input.host_view()) else {
                    return Ok(false);
                };
                for &c in &program.inputs {
                    upload(c, &mut uploaded)?;
                }
                let inputs: Vec<&DeviceColumn> =
                    program.inputs.iter().map(|c| &uploaded[c]).collect();
                let outputs = match &status {
                    Some(status) => metrics
                        .kernel(|| expr::evaluate_unchecked(device, &bound, &inputs, n, status))
                        .map(Some)?,
                    None => metrics.kernel(|| expr::evaluate(device, &bound, &inputs, n))?,
                };
                let Some(outputs) = outputs else {
                    return Ok(false);
                };
                outputs
            }
        };
        let raw = self.raw();
        let distinct_sources = self
            .distinct
            .iter()
            .filter(|_| raw)
            .flat_map(|d| std::iter::once(&d.values).chain(d.filter.iter()));
        // The fused filter's rows: on the CPU, `input` holds only those.
        let rows = self
            .fused
            .as_ref()
            .filter(|_| !on_cpu)
            .map(|(_, rows)| rows);
        for source in self
            .keys
            .iter()
            .chain(rows)
            .chain(
                self.accumulators
                    .iter()
                    .flat_map(|a| std::iter::once(&a.values).chain(a.filter.iter())),
            )
            .chain(distinct_sources)
        {
            if let Source::Input(c) = source {
                upload(*c, &mut uploaded)?;
            }
        }
        let column = |s: &Source| -> Option<&DeviceColumn> {
            match s {
                Source::Input(c) => uploaded.get(c),
                Source::Computed(k) => computed.get(*k),
                Source::Rows => None,
            }
        };
        let keys: Vec<&DeviceColumn> = self.keys.iter().filter_map(column).collect();
        let inputs: Vec<AccInput<'_>> = self
            .accumulators
            .iter()
            .map(|a| AccInput {
                values: column(&a.values),
                filter: a.filter.as_ref().and_then(column),
            })
            .collect();
        // The pairs first: if an update fails after some pairs went in, the batch is redone
        // on the CPU and its partial states merged with the device's; the pairs already in
        // only repeat values the CPU's lists hold too (merging is a set union), and pairs of
        // groups that never reached the group table are dropped when they are matched.
        for (d, pairs) in self.distinct.iter().zip(&mut tables.distinct) {
            if raw {
                let values = column(&d.values).ok_or_else(|| {
                    PieceError::Query(internal_datafusion_err!("count(DISTINCT …) without values"))
                })?;
                let filter = d.filter.as_ref().and_then(column);
                metrics.kernel(|| insert_pairs(pairs, device, &keys, values, filter, n))?;
            } else {
                self.insert_merged_pairs(pairs, d, device, input, metrics)?;
            }
        }
        let with = UpdateWith {
            rows: rows.and_then(column),
            status: status.as_ref(),
        };
        Ok(metrics.kernel(|| tables.groups.update_with(&keys, &inputs, n, with))?)
    }

    /// Inserts the (group keys…, value) pairs of a batch of `count(DISTINCT …)` list
    /// states, flattened on the host.
    fn insert_merged_pairs(
        &self,
        pairs: &mut GroupTable,
        distinct: &DistinctCount,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<(), PieceError> {
        let internal = |what: &str| {
            PieceError::Query(internal_datafusion_err!("count(DISTINCT …) states: {what}"))
        };
        let Source::Input(c) = distinct.values else {
            return Err(internal("not an input column"));
        };
        let batch = input.to_host(metrics)?;
        let lists = batch
            .column(c)
            .as_list_opt::<i32>()
            .ok_or_else(|| internal("not a list"))?;
        let elements = lists.values();
        let offsets = lists.value_offsets();
        let (mut parents, mut at) = (Vec::new(), Vec::new());
        for row in 0..lists.len() {
            if lists.is_null(row) {
                continue;
            }
            for j in offsets[row] as usize..offsets[row + 1] as usize {
                if elements.is_valid(j) {
                    parents.push(row as u32);
                    at.push(j as u32);
                }
            }
        }
        let (parents, at) = (UInt32Array::from(parents), UInt32Array::from(at));
        let mut columns = Vec::with_capacity(self.keys.len() + 1);
        for key in &self.keys {
            let Source::Input(k) = key else {
                return Err(internal("a computed group key"));
            };
            let keys = take(batch.column(*k), &parents, None)
                .map_err(|e| PieceError::Query(arrow_err(e)))?;
            columns.push(metrics.upload(device, keys.as_ref())?);
        }
        let values = take(elements, &at, None).map_err(|e| PieceError::Query(arrow_err(e)))?;
        columns.push(metrics.upload(device, values.as_ref())?);
        let columns: Vec<&DeviceColumn> = columns.iter().collect();
        metrics.kernel(|| pairs.update(&columns, &[], parents.len()))?;
        Ok(())
    }
}

/// Rows of a batch whose keys a table without groups inserts before its first fused try:
/// with few groups they are usually all there, and the fused kernel finds out if not.
const FIRST_KEYS_ROWS: usize = 1 << 16;

/// Whether a table without groups takes the keys of its first batch's first rows and then
/// tries the batch fused, rather than take the batch the ordinary way (which inserts its
/// keys as it goes, and leaves the table its groups for the next batch's fused try).
/// Taking the first keys costs a host wait of its own (the insert's, before the fused
/// kernel's) and, when the groups turn out too many to go fused, a second find of every
/// row's group. Going fused spares, per row, writing and reading back the program's
/// `computed` columns, reading the `accumulators`' inputs again, and the rows' hashes and
/// group ids: about 16 bytes for each (an estimate; TPC-H Q1 at SF 0.1 measured 290 bytes
/// a row for its 3 computed columns and 8 accumulators). By the H200 model a wait costs
/// as much as some 43 MB of device memory traffic: Q1's batches of 300 000 rows take
/// their first keys, and a batch of 300 000 rows into one accumulator does not.
fn first_keys_pay(rows: usize, computed: usize, accumulators: usize) -> bool {
    let model = fulmen_kernels::cost::H200;
    let spared = rows as f64 * 16.0 * (computed + accumulators + 1) as f64;
    spared / model.hbm_bytes_per_s > model.sync_s
}

/// Inserts the groups of the new keys in the first `n` rows of the batch `input` (its
/// columns already in `uploaded`), computing only its computed keys and the fused filter's
/// predicate. `Ok(false)`: that program left a row to the CPU, and nothing was inserted.
fn insert_new_keys(
    new_keys: &NewKeys,
    tables: &mut Tables,
    device: &Device,
    input: &Chunk,
    metrics: &GpuMetrics,
    uploaded: &HashMap<usize, DeviceColumn>,
    n: usize,
) -> Result<bool, PieceError> {
    let missing = || PieceError::Query(internal_datafusion_err!("a key column not uploaded"));
    let uploaded: HashMap<usize, DeviceColumn> = uploaded
        .iter()
        .map(|(&c, column)| (c, column.prefix(n)))
        .collect();
    let (computed, status) = match &new_keys.program {
        None => (Vec::new(), None),
        Some(program) => {
            let Ok(bound) = program.bind(&input.host_view()) else {
                return Ok(false);
            };
            let inputs = program
                .inputs
                .iter()
                .map(|c| uploaded.get(c).ok_or_else(missing))
                .collect::<Result<Vec<_>, _>>()?;
            // A program bound to the whole batch: its runtime constants do not depend on
            // how many rows it runs over.
            let status = device.upload(&[0; STATUS_BYTES])?;
            let outputs =
                metrics.kernel(|| expr::evaluate_unchecked(device, &bound, &inputs, n, &status))?;
            (outputs, Some(status))
        }
    };
    let column = |s: &Source| -> Option<&DeviceColumn> {
        match s {
            Source::Input(c) => uploaded.get(c),
            Source::Computed(k) => computed.get(*k),
            Source::Rows => None,
        }
    };
    let keys = new_keys
        .keys
        .iter()
        .map(|k| column(k).ok_or_else(missing))
        .collect::<Result<Vec<_>, _>>()?;
    let with = UpdateWith {
        rows: new_keys.rows.as_ref().and_then(column),
        status: status.as_ref(),
    };
    Ok(metrics.kernel(|| tables.groups.insert_groups(&keys, n, with))?)
}

/// Inserts the pairs (group keys…, value) of a batch's rows whose value is not NULL and
/// whose FILTER (if any) is true into a `count(DISTINCT …)` table (with a FILTER, rows with
/// a NULL value are inserted too, and left out when the pairs come down).
fn insert_pairs(
    pairs: &mut GroupTable,
    device: &Device,
    keys: &[&DeviceColumn],
    values: &DeviceColumn,
    filter: Option<&DeviceColumn>,
    n: usize,
) -> Result<(), KernelError> {
    let rows = match (filter, values.validity()) {
        (Some(f), _) => Some(selection_indices(device, f.values(), f.validity(), n)?),
        (None, Some(valid)) => Some(selection_indices(device, valid, None, n)?),
        (None, None) => None,
    };
    let mut columns: Vec<&DeviceColumn> = keys.to_vec();
    columns.push(values);
    match rows {
        None => pairs.update(&columns, &[], n),
        Some(rows) => {
            let kept = gather_columns(&columns, &rows)?;
            let kept: Vec<&DeviceColumn> = kept.iter().collect();
            pairs.update(&kept, &[], rows.len())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::first_keys_pay;

    /// Taking a first batch's keys before its fused try pays for large batches of many
    /// columns (TPC-H Q1's, at SF 0.1: 300 000 rows, 3 computed columns, 8 accumulators),
    /// not for small ones or few columns.
    #[test]
    fn first_keys_pay_only_where_the_fused_pass_spares_more_than_a_wait() {
        assert!(first_keys_pay(300_000, 3, 8));
        assert!(!first_keys_pay(60_000, 3, 8));
        assert!(!first_keys_pay(300_000, 0, 1));
        assert!(!first_keys_pay(1, 8, 8));
        assert!(first_keys_pay(4 << 20, 0, 1));
    }
}
