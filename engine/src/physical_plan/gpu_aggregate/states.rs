//! The device tables' groups coming down: as partial states, or as DataFusion's final
//! output.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayData, ArrayRef, AsArray, Decimal128Array, Float64Array, Int64Array, ListArray,
    RecordBatch, UInt32Array, UInt64Array,
};
use datafusion::arrow::buffer::{Buffer, NullBuffer, OffsetBuffer};
use datafusion::arrow::compute::{cast, take};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::internal_datafusion_err;
use datafusion::error::Result;
use datafusion::logical_expr::EmitTo;
use datafusion::physical_plan::aggregates::AggregateOutputMode;
use fulmen_kernels::ops::aggregate::{AccState, AccValues, GroupTable};

use super::super::gpu_stream::{GpuMetrics, make_batch};
use super::plan::{AggregateWork, StateFrom, Tables};
use super::{arrow_err, kernel_err};

impl AggregateWork {
    /// The table's groups as a batch of partial states in `schema` (keys, then each
    /// aggregate's state fields).
    pub(super) fn state_batch(
        &self,
        table: &Tables,
        schema: &SchemaRef,
        metrics: &GpuMetrics,
    ) -> Result<RecordBatch> {
        let (keys, states) = self.download(table, metrics)?;
        let mut columns = keys;
        columns.extend(states.into_iter().flatten());
        let columns = conform(columns, schema)?;
        make_batch(schema, columns, table.groups())
    }

    /// Keys (in output types) and each aggregate's state arrays.
    #[allow(clippy::type_complexity)]
    pub(super) fn download(
        &self,
        tables: &Tables,
        metrics: &GpuMetrics,
    ) -> Result<(Vec<ArrayRef>, Vec<Vec<ArrayRef>>)> {
        let table = &tables.groups;
        let start = std::time::Instant::now();
        // The keys, every accumulator's state and the distinct counts' (group, value)
        // pairs come up in one wait.
        let distinct: Vec<&GroupTable> = tables.distinct.iter().collect();
        let (keys, accs, pairs) = table.download_with(&distinct).map_err(kernel_err)?;
        metrics.d2h_time.add_duration(start.elapsed());
        let lists = pairs
            .into_iter()
            .map(|pairs| group_pairs(&keys, table.groups(), pairs))
            .collect::<Result<Vec<_>>>()?;
        let keys = keys
            .into_iter()
            .zip(&self.key_output_types)
            .map(|(k, t)| canonical_zeros(cast(&k, t)?))
            .collect::<Result<Vec<_>, _>>()
            .map_err(arrow_err)?;
        let states = self
            .states
            .iter()
            .map(|fields| {
                fields
                    .iter()
                    .map(|(from, t)| state_array(&accs, &lists, from, t))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((keys, states))
    }

    /// The operator's output from the table.
    pub(super) fn output(&self, table: &Tables, metrics: &GpuMetrics) -> Result<RecordBatch> {
        let (keys, states) = self.download(table, metrics)?;
        let groups = table.groups();
        let mut columns = keys;
        if self.cpu.mode().output_mode() == AggregateOutputMode::Partial {
            columns.extend(states.into_iter().flatten());
        } else {
            let ids: Vec<usize> = (0..groups).collect();
            for (agg, state) in self.cpu.aggr_expr().iter().zip(states) {
                if agg.is_distinct() {
                    // count(DISTINCT …): the length of each group's list of values.
                    let lists = state
                        .first()
                        .and_then(|s| s.as_list_opt::<i32>())
                        .ok_or_else(|| internal_datafusion_err!("a distinct state not a list"))?;
                    let counts = lists.offsets().windows(2).map(|w| i64::from(w[1] - w[0]));
                    columns.push(Arc::new(Int64Array::from_iter_values(counts)));
                    continue;
                }
                let mut acc = agg.create_groups_accumulator()?;
                acc.merge_batch(&state, &ids, groups)?;
                columns.push(acc.evaluate(EmitTo::All)?);
            }
        }
        let columns = conform(columns, &self.schema)?;
        make_batch(&self.schema, columns, groups)
    }
}

/// Casts columns to the field types of `schema` where they differ (string views, state
/// precisions).
fn conform(columns: Vec<ArrayRef>, schema: &SchemaRef) -> Result<Vec<ArrayRef>> {
    if columns.len() != schema.fields().len() {
        return Err(internal_datafusion_err!(
            "GpuAggregateExec made {} columns for a schema of {}",
            columns.len(),
            schema.fields().len()
        ));
    }
    columns
        .into_iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c)
            } else {
                cast(&c, f.data_type()).map_err(arrow_err)
            }
        })
        .collect()
}

/// GROUP BY puts -0.0 and 0.0 in one group and shows it as 0.0, as DataFusion does.
pub(crate) fn canonical_zeros(
    array: ArrayRef,
) -> Result<ArrayRef, datafusion::arrow::error::ArrowError> {
    Ok(match array.data_type() {
        DataType::Float64 => {
            let a = datafusion::arrow::array::AsArray::as_primitive::<
                datafusion::arrow::datatypes::Float64Type,
            >(&array);
            Arc::new(
                a.unary::<_, datafusion::arrow::datatypes::Float64Type>(|v| {
                    if v == 0.0 { 0.0 } else { v }
                }),
            )
        }
        DataType::Float32 => {
            let a = datafusion::arrow::array::AsArray::as_primitive::<
                datafusion::arrow::datatypes::Float32Type,
            >(&array);
            Arc::new(
                a.unary::<_, datafusion::arrow::datatypes::Float32Type>(|v| {
                    if v == 0.0 { 0.0 } else { v }
                }),
            )
        }
        _ => array,
    })
}

/// The pairs (group keys…, x) of a `count(DISTINCT x)` table, found in the `groups`
/// groups of `keys` (as the device holds both): each group's distinct non-NULL values, one
/// group after the other, and where each group's begin. Pairs whose keys are no group's
/// (inserted by an update of the batch that then failed) are left out.
fn group_pairs(
    keys: &[ArrayRef],
    groups: usize,
    mut pairs: Vec<ArrayRef>,
) -> Result<(OffsetBuffer<i32>, ArrayRef)> {
    let values = pairs
        .pop()
        .ok_or_else(|| internal_datafusion_err!("a pair table without values"))?;
    let group: Vec<Option<usize>> = if keys.is_empty() {
        vec![Some(0); values.len()]
    } else {
        let fields = keys
            .iter()
            .map(|k| SortField::new(k.data_type().clone()))
            .collect();
        let converter = RowConverter::new(fields)?;
        let lookup = |columns: &[ArrayRef]| -> Result<Vec<ArrayRef>> {
            columns
                .iter()
                .map(|c| canonical_zeros(Arc::clone(c)))
                .collect::<Result<_, _>>()
                .map_err(arrow_err)
        };
        let group_rows = converter.convert_columns(&lookup(keys)?)?;
        let index: HashMap<_, usize> = group_rows.iter().enumerate().map(|(g, r)| (r, g)).collect();
        if index.len() != groups {
            return Err(internal_datafusion_err!(
                "{groups} groups whose keys make {} distinct rows",
                index.len()
            ));
        }
        let pair_rows = converter.convert_columns(&lookup(&pairs)?)?;
        pair_rows.iter().map(|r| index.get(&r).copied()).collect()
    };
    let mut ends = vec![0usize; groups];
    for (i, g) in group.iter().enumerate() {
        if let Some(g) = g
            && values.is_valid(i)
        {
            ends[*g] += 1;
        }
    }
    let mut starts = Vec::with_capacity(groups + 1);
    let mut total = 0;
    starts.push(0i32);
    for count in &mut ends {
        let start = total;
        total += *count;
        *count = start;
        starts.push(i32::try_from(total).map_err(|_| {
            internal_datafusion_err!("more than 2^31 distinct values in one partition")
        })?);
    }
    // `ends` now holds where each group's next value goes.
    let mut order = vec![0u32; total];
    for (i, g) in group.iter().enumerate() {
        if let Some(g) = g
            && values.is_valid(i)
        {
            order[ends[*g]] = i as u32;
            ends[*g] += 1;
        }
    }
    let values = take(values.as_ref(), &UInt32Array::from(order), None).map_err(arrow_err)?;
    Ok((OffsetBuffer::new(starts.into()), values))
}

/// One state field of `t` from the accumulators' states and the distinct counts' lists.
fn state_array(
    accs: &[AccState],
    lists: &[(OffsetBuffer<i32>, ArrayRef)],
    from: &StateFrom,
    t: &DataType,
) -> Result<ArrayRef> {
    match from {
        StateFrom::Distinct(d) => {
            let (offsets, values) = &lists[*d];
            let DataType::List(item) = t else {
                return Err(internal_datafusion_err!("a distinct state of type {t}"));
            };
            let values = cast(values, item.data_type()).map_err(arrow_err)?;
            Ok(Arc::new(
                ListArray::try_new(Arc::clone(item), offsets.clone(), values, None)
                    .map_err(arrow_err)?,
            ))
        }
        StateFrom::Counts(k, null_if_zero) => {
            let counts = &accs[*k].counts;
            let nulls = null_if_zero
                .then(|| NullBuffer::from(counts.iter().map(|&c| c > 0).collect::<Vec<_>>()));
            let array: ArrayRef = Arc::new(UInt64Array::new(counts.clone().into(), nulls));
            cast(&array, t).map_err(arrow_err)
        }
        StateFrom::Values(k, zero_if_empty) => {
            let acc = &accs[*k];
            let nulls = (!zero_if_empty)
                .then(|| NullBuffer::from(acc.counts.iter().map(|&c| c > 0).collect::<Vec<_>>()));
            values_array(&acc.values, nulls, t)
        }
    }
}

/// An array of type `t` from accumulator values (integers narrowed to `t`'s width, which
/// they came from).
fn values_array(values: &AccValues, nulls: Option<NullBuffer>, t: &DataType) -> Result<ArrayRef> {
    let array: ArrayRef = match values {
        AccValues::None => {
            return Err(internal_datafusion_err!(
                "a state from an accumulator without values"
            ));
        }
        AccValues::Int(v) => {
            let width = t.primitive_width().ok_or_else(|| {
                internal_datafusion_err!("integer state of non-primitive type {t}")
            })?;
            let mut bytes = Vec::with_capacity(v.len() * width);
            for x in v {
                bytes.extend_from_slice(&x.to_le_bytes()[..width]);
            }
            let data = ArrayData::builder(t.clone())
                .len(v.len())
                .add_buffer(Buffer::from_slice_ref(&bytes))
                .nulls(nulls)
                .build()
                .map_err(arrow_err)?;
            return Ok(datafusion::arrow::array::make_array(data));
        }
        AccValues::Float(v) => {
            let a = Float64Array::new(v.clone().into(), nulls);
            if t == &DataType::Float64 {
                return Ok(Arc::new(a));
            }
            Arc::new(a)
        }
        AccValues::Decimal(v) => {
            let a = Decimal128Array::new(v.clone().into(), nulls);
            if let DataType::Decimal128(p, s) = t {
                return Ok(Arc::new(
                    a.with_precision_and_scale(*p, *s).map_err(arrow_err)?,
                ));
            }
            Arc::new(a)
        }
    };
    cast(&array, t).map_err(arrow_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_states_narrow_to_their_type() {
        let values = AccValues::Int(vec![-1, 7, 300]);
        let nulls = Some(NullBuffer::from(vec![true, false, true]));
        let a = values_array(&values, nulls, &DataType::Int16).unwrap();
        let a = a
            .as_any()
            .downcast_ref::<datafusion::arrow::array::Int16Array>()
            .unwrap();
        assert_eq!(
            a.iter().collect::<Vec<_>>(),
            vec![Some(-1), None, Some(300)]
        );
        let d = values_array(&AccValues::Int(vec![19000]), None, &DataType::Date32).unwrap();
        assert_eq!(d.data_type(), &DataType::Date32);
    }
}
