//! `GpuAggregateExec`: DataFusion's `AggregateExec` on a GPU, in every mode (Partial,
//! PartialReduce, Final, FinalPartitioned, Single, SinglePartitioned).
//!
//! Each partition keeps one device [`GroupTable`] for its whole input: batches (coalesced
//! to `fulmen.gpu.batch_rows`) are uploaded, computed keys, arguments and `FILTER` clauses
//! run as one expression program, and the table finds or adds every row's group and
//! updates the accumulators of all aggregates in one pass. When the input ends the table's
//! keys and accumulator states come back once:
//!
//! ```text
//!   input ─▶ coalesce ─▶ upload ─▶ program (keys, args, filters) ─▶ GroupTable::update
//!                                         └─ rows left to the CPU: DataFusion evaluates
//!                                            that batch's expressions, the device goes on
//!   input ends ─▶ download keys + states ─▶ Partial output: the states
//!                                        └▶ Final output: DataFusion's own accumulators
//!                                           merge the states and evaluate (one row per
//!                                           group), so result types, avg's division and
//!                                           decimal rules are DataFusion's
//!   device error (fault, memory) ─▶ the table's consistent state so far becomes a batch of
//!       partial states, and DataFusion's AggregateExec finishes on the CPU with it and the
//!       rest of the input
//! ```
//!
//! Aggregates on the device: `count` (rows and values), `sum`, `min`, `max` and `avg` over
//! integers, floats, decimals and (min/max) dates and timestamps, and `count(DISTINCT x)`
//! over integers, decimals, dates, times and strings; any other aggregate, another DISTINCT
//! or ordered aggregate, grouping sets and group limits leave the node on the CPU with the
//! reason.
//!
//! `count(DISTINCT x)` keeps a second table of its own, keyed by (group keys…, x) and
//! without accumulators: each distinct pair is one entry. Rows with a NULL x or a false
//! `FILTER` are left out on the device (compaction); merging partial states flattens their
//! lists on the host and inserts the pairs the same way. When the input ends the pairs come
//! down and are matched to their groups by key: a partial state is the list of a group's
//! values, a final count the length of that list. The pair tables are updated before the
//! group table, and inserting a pair twice changes nothing, so an update that fails half
//! way leaves nothing a CPU redo of the batch would count twice (pairs whose group never
//! made it into the group table are dropped when they are matched).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use datafusion::arrow::array::{
    Array, ArrayData, ArrayRef, AsArray, Decimal128Array, Float64Array, Int64Array, ListArray,
    RecordBatch, UInt32Array, UInt64Array,
};
use datafusion::arrow::buffer::{Buffer, NullBuffer, OffsetBuffer};
use datafusion::arrow::compute::{cast, concat_batches, take};
use datafusion::arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::{exec_err, internal_datafusion_err};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::EmitTo;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_plan::aggregates::{
    AggregateExec, AggregateInputMode, AggregateMode, AggregateOutputMode, aggregate_expressions,
};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::filter::{FilterExec, batch_filter};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan};
use fulmen_kernels::ops::aggregate::{
    AccInput, AccOp, AccState, AccValues, GroupTable, STATUS_BYTES, UpdateWith,
};
use fulmen_kernels::ops::compact::selection_indices;
use fulmen_kernels::ops::expr;
use fulmen_kernels::ops::gather::gather_column;
use fulmen_kernels::{Device, DeviceColumn, KernelError};
use futures::{StreamExt, TryStreamExt};

use super::gpu_stream::{
    BatchOn, Chunk, ChunkStream, GpuMetrics, OperatorKind, count_batch, count_operator,
    device_error, device_for, input_chunks, make_batch,
};
use super::once::OnceExec;
use crate::gpu::compile::{CompiledExprs, Reason, compile, expr_name, is_output_type};

/// The smallest piece a batch that does not fit in device memory is split into.
const MIN_SPLIT_ROWS: usize = 4096;

/// Where a key or an aggregate input comes from in each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// An input column, uploaded as it is.
    Input(usize),
    /// An output of the operator's expression program.
    Computed(usize),
    /// No values: `count(*)` counts rows.
    Rows,
}

/// The aggregate functions the device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Func {
    Count,
    Sum,
    Min,
    Max,
    Avg,
}

/// How one state field of an aggregate is read off an accumulator.
#[derive(Debug, Clone)]
enum StateFrom {
    /// The accumulator's per-group row counts (count); NULL where 0 when the flag is set
    /// (avg's count, which DataFusion leaves NULL with its sum).
    Counts(usize, bool),
    /// Its values; NULL where no row contributed unless `zero_if_empty`.
    Values(usize, bool),
    /// The list of each group's distinct values, from a pair table.
    Distinct(usize),
}

#[derive(Debug)]
struct Accumulator {
    op: AccOp,
    values: Source,
    filter: Option<Source>,
}

/// One `count(DISTINCT x)`, counted in a table of (group keys…, x) pairs.
#[derive(Debug)]
struct DistinctCount {
    /// Raw input: x. Merging: the input column of list states.
    values: Source,
    filter: Option<Source>,
    /// x's type on the device.
    value_type: DataType,
}

/// A partition's device tables: the groups with their accumulators, and a pair table per
/// `count(DISTINCT …)`.
#[derive(Debug)]
struct Tables {
    groups: GroupTable,
    distinct: Vec<GroupTable>,
}

impl Tables {
    fn groups(&self) -> usize {
        self.groups.groups()
    }
}

/// The device side of one aggregation.
#[derive(Debug)]
pub struct AggregateWork {
    cpu: Arc<AggregateExec>,
    keys: Vec<Source>,
    /// Key column types on the device (string views arrive as strings) and in the output.
    key_types: Vec<DataType>,
    key_output_types: Vec<DataType>,
    /// Computed keys, arguments and filters, when there are any.
    program: Option<CompiledExprs>,
    computed: Vec<Arc<dyn PhysicalExpr>>,
    accumulators: Vec<Accumulator>,
    distinct: Vec<DistinctCount>,
    /// For each aggregate: its state fields, in DataFusion's order.
    states: Vec<Vec<(StateFrom, DataType)>>,
    schema: SchemaRef,
    /// A fused stage: the predicate of the filter it takes in (the CPU twin's input is a
    /// `FilterExec` of it over the stage's input), and where its values come from, which
    /// select the rows the group table takes.
    fused: Option<(Arc<dyn PhysicalExpr>, Source)>,
}

/// The aggregate's function, and whether it is a `count(DISTINCT …)`.
fn func_of(agg: &AggregateFunctionExpr) -> Result<(Func, bool), Reason> {
    use datafusion::functions_aggregate::{average::Avg, count::Count, min_max, sum::Sum};
    // DataFusion's own functions only: another with the same name (Spark's `avg`, a user's
    // UDAF) may keep other states.
    let name = agg.fun().name().to_ascii_lowercase();
    let udf: &dyn std::any::Any = agg.fun().inner().as_ref();
    let func = if udf.is::<Count>() {
        Func::Count
    } else if udf.is::<Sum>() {
        Func::Sum
    } else if udf.is::<min_max::Min>() {
        Func::Min
    } else if udf.is::<min_max::Max>() {
        Func::Max
    } else if udf.is::<Avg>() {
        Func::Avg
    } else {
        return Err(format!("aggregate function {name} is not supported on GPU"));
    };
    if agg.is_distinct() && func != Func::Count {
        return Err(format!("{name}(DISTINCT …) is not supported on GPU"));
    }
    if !agg.order_bys().is_empty() {
        return Err(format!("{name} with ORDER BY is not supported on GPU"));
    }
    Ok((func, agg.is_distinct()))
}

/// Whether the device can count the distinct values of `t` as DataFusion does.
fn distinct_type(t: &DataType) -> Result<(), Reason> {
    match t {
        // The device groups -0.0 with 0.0 and every NaN with every other; DataFusion's
        // DISTINCT compares the bits.
        DataType::Float16 | DataType::Float32 | DataType::Float64 => Err(format!(
            "count(DISTINCT …) of {t} values is not supported on GPU (DataFusion tells -0.0 \
             from 0.0 and NaNs apart by their bits)"
        )),
        DataType::Boolean => {
            Err("count(DISTINCT …) of boolean values is not supported on GPU".into())
        }
        _ => Ok(()),
    }
}

fn is_integer_like(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Int8 | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | Date32
            | Date64
            | Time32(_)
            | Time64(_)
            | Timestamp(_, _)
            | Duration(_)
    )
}

/// The accumulator op that computes `func` (or merges its state) over values of `t`.
fn op_for(func: Func, t: &DataType) -> Result<AccOp, Reason> {
    use DataType::*;
    let op = match (func, t) {
        (Func::Count, _) => AccOp::Count,
        (Func::Sum | Func::Avg, Int64 | UInt64) => AccOp::SumInt,
        (Func::Sum | Func::Avg, Float64) => AccOp::SumFloat,
        (Func::Sum | Func::Avg, Decimal128(_, _)) => AccOp::SumDecimal,
        (Func::Min, t) if is_integer_like(t) => AccOp::MinInt,
        (Func::Max, t) if is_integer_like(t) => AccOp::MaxInt,
        (Func::Min, Float32 | Float64) => AccOp::MinFloat,
        (Func::Max, Float32 | Float64) => AccOp::MaxFloat,
        (Func::Min, Decimal128(_, _)) => AccOp::MinDecimal,
        (Func::Max, Decimal128(_, _)) => AccOp::MaxDecimal,
        (func, t) => {
            return Err(format!(
                "{} of {t} values is not supported on GPU",
                format!("{func:?}").to_lowercase()
            ));
        }
    };
    Ok(op)
}

/// Collects the expressions that need the program, and where every value comes from.
struct Sources<'a> {
    schema: &'a Schema,
    computed: Vec<Arc<dyn PhysicalExpr>>,
}

impl Sources<'_> {
    /// Where `expr`'s values come from, and their type on the device.
    fn of(&mut self, expr: &Arc<dyn PhysicalExpr>) -> Result<(Source, DataType), Reason> {
        let data_type = expr.data_type(self.schema).map_err(|e| e.to_string())?;
        if let Some(c) = expr.downcast_ref::<Column>() {
            let device = fulmen_kernels::column::device_type(&data_type, 0).map_err(|_| {
                format!(
                    "column {} of type {data_type} is not supported on GPU",
                    c.name()
                )
            })?;
            return Ok((Source::Input(c.index()), device));
        }
        if !is_output_type(&data_type) {
            return Err(format!(
                "{} gives {data_type} values, which the GPU cannot compute yet",
                expr_name(expr)
            ));
        }
        self.computed.push(Arc::clone(expr));
        Ok((Source::Computed(self.computed.len() - 1), data_type))
    }
}

/// Plans a `count(DISTINCT …)` of `args`: x itself on raw input; when merging, the input
/// column of list states (flattened on the host, so the group keys must be input columns).
fn distinct_count(
    args: &[Arc<dyn PhysicalExpr>],
    filter: Option<Source>,
    raw: bool,
    sources: &mut Sources,
    keys: &[Source],
) -> Result<DistinctCount, Reason> {
    let [arg] = args else {
        return Err("count(DISTINCT …) of several arguments is not supported on GPU".into());
    };
    if raw {
        let (values, value_type) = sources.of(arg)?;
        distinct_type(&value_type)?;
        return Ok(DistinctCount {
            values,
            filter,
            value_type,
        });
    }
    let Some(column) = arg.downcast_ref::<Column>() else {
        return Err(format!(
            "count(DISTINCT …) states from {} are not supported on GPU",
            expr_name(arg)
        ));
    };
    if keys.iter().any(|k| !matches!(k, Source::Input(_))) {
        return Err(
            "merging count(DISTINCT …) states under computed group keys is not supported on GPU"
                .into(),
        );
    }
    let t = arg.data_type(sources.schema).map_err(|e| e.to_string())?;
    let DataType::List(item) = &t else {
        return Err(format!(
            "count(DISTINCT …) states of type {t} are not supported on GPU"
        ));
    };
    distinct_type(item.data_type())?;
    let value_type = fulmen_kernels::column::device_type(item.data_type(), 0).map_err(|_| {
        format!(
            "count(DISTINCT …) of {} values is not supported on GPU",
            item.data_type()
        )
    })?;
    Ok(DistinctCount {
        values: Source::Input(column.index()),
        filter: None,
        value_type,
    })
}

impl AggregateWork {
    /// The device side of `plan`, or why it stays on the CPU. `fused`: `plan`'s input is a
    /// `FilterExec` the device stage takes in.
    pub fn plan(plan: &Arc<dyn ExecutionPlan>, fused: bool) -> Result<Self, Reason> {
        let Some(cpu) = plan.downcast_ref::<AggregateExec>() else {
            return Err("not an AggregateExec".into());
        };
        let predicate = match cpu.input().downcast_ref::<FilterExec>() {
            Some(filter) if fused => {
                if filter.projection().is_some() || filter.fetch().is_some() {
                    return Err("a fused filter with a projection or a row limit".into());
                }
                if cpu.group_expr().is_true_no_grouping() {
                    return Err("a fused filter in an aggregation without keys".into());
                }
                Some(Arc::clone(filter.predicate()))
            }
            None if fused => return Err("a fused stage without a FilterExec".into()),
            _ => None,
        };
        let group_by = cpu.group_expr();
        if group_by.has_grouping_set() {
            return Err("GROUPING SETS, ROLLUP and CUBE are not supported on GPU".into());
        }
        if cpu.limit_options().is_some() {
            return Err(
                "a group limit (LIMIT pushed into the aggregation) is not supported on GPU".into(),
            );
        }
        let input_schema = cpu.input().schema();
        let mut sources = Sources {
            schema: &input_schema,
            computed: Vec::new(),
        };
        let mut keys = Vec::new();
        let mut key_types = Vec::new();
        for (expr, _) in group_by.expr() {
            let (source, t) = sources.of(expr)?;
            if !super::keyable(&t) {
                return Err(format!("grouping by a {t} is not supported on GPU"));
            }
            keys.push(source);
            key_types.push(t);
        }
        let output_schema = plan.schema();
        let key_output_types = output_schema.fields()[..keys.len()]
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        let mode = *cpu.mode();
        let raw = mode.input_mode() == AggregateInputMode::Raw;
        let inputs =
            aggregate_expressions(cpu.aggr_expr(), &mode, keys.len()).map_err(|e| e.to_string())?;
        let mut accumulators = Vec::new();
        let mut distinct = Vec::new();
        let mut states = Vec::new();
        for (k, agg) in cpu.aggr_expr().iter().enumerate() {
            let (func, is_distinct) = func_of(agg)?;
            let fields = agg.state_fields().map_err(|e| e.to_string())?;
            let state_types: Vec<DataType> = fields.iter().map(|f| f.data_type().clone()).collect();
            let filter = match cpu.filter_expr().get(k) {
                Some(Some(f)) if raw => Some(sources.of(f)?.0),
                _ => None,
            };
            let args = &inputs[k];
            let mut add = |op: AccOp, values: Source| {
                accumulators.push(Accumulator { op, values, filter });
                accumulators.len() - 1
            };
            let state: Vec<StateFrom> = match (func, raw) {
                _ if is_distinct => {
                    let count = distinct_count(args, filter, raw, &mut sources, &keys)?;
                    distinct.push(count);
                    vec![StateFrom::Distinct(distinct.len() - 1)]
                }
                (Func::Count, true) => {
                    if args.len() != 1 {
                        return Err("count of several arguments is not supported on GPU".into());
                    }
                    let values = match args[0].downcast_ref::<Literal>() {
                        Some(l) if !l.value().is_null() => Source::Rows,
                        _ => sources.of(&args[0])?.0,
                    };
                    vec![StateFrom::Counts(add(AccOp::Count, values), false)]
                }
                (Func::Avg, true) => {
                    let (values, t) = sources.of(&args[0])?;
                    if matches!(t, DataType::Decimal128(..))
                        && !matches!(state_types.get(1), Some(DataType::Decimal128(..)))
                    {
                        // Wide decimals: DataFusion sums them in 256 bits; the device's
                        // 128-bit sum would wrap.
                        return Err(format!(
                            "avg of {t} values is not supported on GPU (DataFusion sums them \
                             as {})",
                            state_types.get(1).map_or("?".into(), |t| t.to_string())
                        ));
                    }
                    let acc = add(op_for(func, &t)?, values);
                    vec![StateFrom::Counts(acc, true), StateFrom::Values(acc, false)]
                }
                (_, true) => {
                    let (values, t) = sources.of(&args[0])?;
                    vec![StateFrom::Values(add(op_for(func, &t)?, values), false)]
                }
                // Merging states: counts add up, sums add up, minima and maxima combine.
                (_, false) => {
                    if args.len() != state_types.len() {
                        return Err(format!(
                            "{} state columns for {} state fields",
                            args.len(),
                            state_types.len()
                        ));
                    }
                    let mut from = Vec::new();
                    for (arg, t) in args.iter().zip(&state_types) {
                        let (values, device_type) = sources.of(arg)?;
                        let merge = match func {
                            Func::Count | Func::Avg
                                if matches!(t, DataType::Int64 | DataType::UInt64) =>
                            {
                                // count states add up and are never NULL; avg's count is
                                // NULL where its sum is
                                let acc = add(AccOp::SumInt, values);
                                from.push(StateFrom::Values(acc, func == Func::Count));
                                continue;
                            }
                            Func::Avg => Func::Sum,
                            other => other,
                        };
                        from.push(StateFrom::Values(
                            add(op_for(merge, &device_type)?, values),
                            false,
                        ));
                    }
                    from
                }
            };
            if state.len() != state_types.len() {
                return Err(format!(
                    "{} keeps {} state fields, Fulmen expected {}",
                    agg.name(),
                    state_types.len(),
                    state.len()
                ));
            }
            if mode.output_mode() == AggregateOutputMode::Final
                && !is_distinct
                && !agg.groups_accumulator_supported()
            {
                return Err(format!(
                    "{} has no groups accumulator to finish with",
                    agg.name()
                ));
            }
            states.push(state.into_iter().zip(state_types).collect());
        }
        let fused = match predicate {
            Some(predicate) => {
                if !raw || !distinct.is_empty() {
                    return Err(
                        "a fused filter under a merge of states or a count(DISTINCT …)".into(),
                    );
                }
                let (rows, t) = sources.of(&predicate)?;
                if t != DataType::Boolean {
                    return Err(format!("a filter predicate of type {t}"));
                }
                Some((predicate, rows))
            }
            None => None,
        };
        let computed = sources.computed;
        let program = if computed.is_empty() {
            None
        } else {
            Some(compile(&computed, &input_schema)?)
        };
        let cpu = Arc::new(cpu.clone());
        Ok(Self {
            cpu,
            keys,
            key_types,
            key_output_types,
            program,
            computed,
            accumulators,
            distinct,
            states,
            schema: output_schema,
            fused,
        })
    }

    /// The plan whose batches the device takes: the aggregate's input, or the fused
    /// filter's.
    fn device_input(&self) -> &Arc<dyn ExecutionPlan> {
        let input = self.cpu.input();
        match (&self.fused, input.children().first()) {
            (Some(_), Some(filter_input)) => filter_input,
            _ => input,
        }
    }

    /// `batch` (of the device input) as the CPU aggregate's input: the fused filter's rows.
    fn cpu_rows(&self, batch: RecordBatch) -> Result<RecordBatch> {
        match &self.fused {
            Some((predicate, _)) => batch_filter(&batch, predicate),
            None => Ok(batch),
        }
    }

    fn new_tables(&self, device: &Device) -> Result<Tables, KernelError> {
        let ops: Vec<AccOp> = self.accumulators.iter().map(|a| a.op).collect();
        let groups = GroupTable::new(device, &self.key_types, &ops)?;
        let distinct = self
            .distinct
            .iter()
            .map(|d| {
                let mut types = self.key_types.clone();
                types.push(d.value_type.clone());
                GroupTable::new(device, &types, &[])
            })
            .collect::<Result<_, _>>()?;
        Ok(Tables { groups, distinct })
    }

    /// Adds one batch to `table`. `Ok(false)`: the program left some row to the CPU, and
    /// DataFusion evaluated the batch's expressions instead (over the rows of the fused
    /// filter, which it applied first; an error it raises is the query's).
    fn update(
        &self,
        tables: &mut Tables,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<bool, UpdateError> {
        if self.update_rows(tables, device, input, metrics, false)? {
            return Ok(true);
        }
        let batch = input.to_host(metrics)?;
        let rows = Chunk::Host(self.cpu_rows(batch).map_err(UpdateError::Query)?);
        self.update_rows(tables, device, &rows, metrics, true)?;
        Ok(false)
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
    ) -> Result<bool, UpdateError> {
        let n = input.num_rows();
        let mut uploaded: HashMap<usize, DeviceColumn> = HashMap::new();
        let upload =
            |c: usize, uploaded: &mut HashMap<usize, DeviceColumn>| -> Result<(), KernelError> {
                if let std::collections::hash_map::Entry::Vacant(slot) = uploaded.entry(c) {
                    slot.insert(input.device_column(c, device, metrics)?);
                }
                Ok(())
            };
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
                        .map_err(UpdateError::Query)?;
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
                    UpdateError::Query(internal_datafusion_err!("count(DISTINCT …) without values"))
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

    /// Whether the input is rows (not partial states).
    fn raw(&self) -> bool {
        self.cpu.mode().input_mode() == AggregateInputMode::Raw
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
    ) -> Result<(), UpdateError> {
        let internal = |what: &str| {
            UpdateError::Query(internal_datafusion_err!("count(DISTINCT …) states: {what}"))
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
                .map_err(|e| UpdateError::Query(arrow_err(e)))?;
            columns.push(metrics.upload(device, keys.as_ref())?);
        }
        let values = take(elements, &at, None).map_err(|e| UpdateError::Query(arrow_err(e)))?;
        columns.push(metrics.upload(device, values.as_ref())?);
        let columns: Vec<&DeviceColumn> = columns.iter().collect();
        metrics.kernel(|| pairs.update(&columns, &[], parents.len()))?;
        Ok(())
    }

    /// The table's groups as a batch of partial states in `schema` (keys, then each
    /// aggregate's state fields).
    fn state_batch(
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
    fn download(
        &self,
        tables: &Tables,
        metrics: &GpuMetrics,
    ) -> Result<(Vec<ArrayRef>, Vec<Vec<ArrayRef>>)> {
        let table = &tables.groups;
        let start = std::time::Instant::now();
        let keys = table.keys().map_err(kernel_err)?;
        let accs: Vec<AccState> = (0..self.accumulators.len())
            .map(|k| table.state(k))
            .collect::<Result<_, _>>()
            .map_err(kernel_err)?;
        let pairs: Vec<Vec<ArrayRef>> = tables
            .distinct
            .iter()
            .map(GroupTable::keys)
            .collect::<Result<_, _>>()
            .map_err(kernel_err)?;
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
    fn output(&self, table: &Tables, metrics: &GpuMetrics) -> Result<RecordBatch> {
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

/// Why a batch could not be added on the device.
enum UpdateError {
    /// The device failed (fault, memory): finish on the CPU.
    Device(KernelError),
    /// DataFusion's own evaluation failed: the query fails as it would on the CPU.
    Query(DataFusionError),
}

impl From<KernelError> for UpdateError {
    fn from(e: KernelError) -> Self {
        Self::Device(e)
    }
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
            let kept = columns
                .iter()
                .map(|c| gather_column(c, &rows))
                .collect::<Result<Vec<_>, _>>()?;
            let kept: Vec<&DeviceColumn> = kept.iter().collect();
            pairs.update(&kept, &[], rows.len())
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn kernel_err(e: KernelError) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

fn arrow_err(e: datafusion::arrow::error::ArrowError) -> DataFusionError {
    DataFusionError::ArrowError(Box::new(e), None)
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

/// An aggregation on a GPU: the CPU `AggregateExec` it replaces (for its plan properties,
/// display, and the CPU fallback) and the device work.
#[derive(Debug)]
pub struct GpuAggregateExec {
    inner: Arc<dyn ExecutionPlan>,
    work: Arc<AggregateWork>,
    devices: Arc<Vec<Device>>,
    batch_rows: usize,
    metrics: ExecutionPlanMetricsSet,
    executed: AtomicBool,
}

impl GpuAggregateExec {
    /// The GPU twin of `cpu`, or why there is none.
    pub fn try_new(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch_rows: usize,
    ) -> Result<Self, Reason> {
        Self::planned(cpu, devices, batch_rows, false)
    }

    /// A fused stage: the GPU twin of `cpu`, a grouped aggregate over rows whose input is a
    /// `FilterExec` (without projection or row limit) that the stage takes in. Its child is
    /// the filter's input; the device evaluates the predicate in the aggregate's program
    /// and its group table takes only the rows it keeps (see `gpu/fuse.rs`).
    pub fn try_fused(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch_rows: usize,
    ) -> Result<Self, Reason> {
        Self::planned(cpu, devices, batch_rows, true)
    }

    fn planned(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch_rows: usize,
        fused: bool,
    ) -> Result<Self, Reason> {
        if devices.is_empty() {
            return Err("no device".into());
        }
        let work = AggregateWork::plan(&cpu, fused)?;
        Ok(Self {
            inner: cpu,
            work: Arc::new(work),
            devices,
            batch_rows,
            metrics: ExecutionPlanMetricsSet::new(),
            executed: AtomicBool::new(false),
        })
    }

    /// The predicate of the filter this stage takes in, if it is a fused stage.
    pub fn fused_filter(&self) -> Option<&Arc<dyn PhysicalExpr>> {
        self.work.fused.as_ref().map(|(p, _)| p)
    }

    /// The devices its partitions run on.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The mode of the aggregation.
    pub fn mode(&self) -> AggregateMode {
        *self.work.cpu.mode()
    }
}

impl DisplayAs for GpuAggregateExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        super::fmt_gpu_operator("GpuAggregateExec", &self.inner, &self.devices, t, f)?;
        match self.fused_filter() {
            Some(predicate) if t == DisplayFormatType::TreeRender => {
                write!(f, "\nfused_filter={predicate}")
            }
            Some(predicate) => write!(f, ", fused_filter={predicate}"),
            None => Ok(()),
        }
    }
}

impl ExecutionPlan for GpuAggregateExec {
    fn name(&self) -> &str {
        "GpuAggregateExec"
    }

    delegate_to_cpu_operator!(@properties);

    /// A fused stage's child is its filter's input; otherwise the CPU twin's children.
    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        if self.work.fused.is_some() {
            return vec![self.work.device_input()];
        }
        self.inner.children()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        use datafusion::physical_plan::execution_plan::{
            ChildrenPropertiesMode, ReplaceChildrenOptions,
        };
        let recompute = || ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        let fused = self.work.fused.is_some();
        let children = match self.inner.children().first() {
            // The fused filter over the new child.
            Some(&filter) if fused => {
                vec![Arc::clone(filter).replace_children(children, recompute())?]
            }
            _ => children,
        };
        let inner = Arc::clone(&self.inner).replace_children(children, recompute())?;
        let gpu = Self::planned(inner, Arc::clone(&self.devices), self.batch_rows, fused)
            .map_err(|reason| internal_datafusion_err!("GpuAggregateExec: {reason}"))?;
        Ok(Arc::new(gpu))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("GpuAggregateExec without a device"))?;
        let input = input_chunks(
            self.work.device_input(),
            partition,
            Arc::clone(&context),
            &self.devices,
        )?;
        let metrics = GpuMetrics::new(&self.metrics, partition, &device, &context);
        let work = metrics.work();
        let extra = ExtraMetrics::new(&self.metrics, partition, &device);
        count_operator(&self.executed, OperatorKind::Aggregate);
        super::gpu_stream::count_partition();
        let merging = self.work.cpu.mode().input_mode() == AggregateInputMode::Partial;
        let run = Run {
            work: Arc::clone(&self.work),
            device,
            partition,
            retained: merging.then(|| std::sync::Mutex::new(Vec::new())),
            batch_rows: self.batch_rows,
            context,
            metrics,
            extra,
        };
        let stream = futures::stream::once(run.execute(input)).try_flatten();
        Ok(work.batches(self.schema(), stream))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}

/// Metrics only an aggregation has.
#[derive(Debug, Clone)]
struct ExtraMetrics {
    /// Groups at the end.
    groups: Count,
    /// Distinct (group keys…, value) pairs of the `count(DISTINCT …)` aggregates at the end.
    distinct_pairs: Count,
    /// Batches whose accumulators went through per-block shared-memory tables.
    shared_memory_batches: Count,
    /// Batches whose accumulators were updated in the global table.
    global_table_batches: Count,
    /// Device batches split in halves because they did not fit in device memory.
    split_batches: Count,
    /// 1 when the device gave up (fault, memory) and DataFusion finished on the CPU.
    cpu_fallback: Count,
    /// Spills to disk: the device keeps its state in device memory and never spills
    /// (the name DataFusion's AggregateExec reports it under).
    #[allow(dead_code)]
    spill_count: Count,
}

impl ExtraMetrics {
    fn new(set: &ExecutionPlanMetricsSet, partition: usize, device: &Device) -> Self {
        let builder = || {
            MetricBuilder::new(set).with_label(datafusion::physical_plan::metrics::Label::new(
                "device",
                device.to_string(),
            ))
        };
        Self {
            groups: builder().counter("groups", partition),
            distinct_pairs: builder().counter("distinct_pairs", partition),
            shared_memory_batches: builder().counter("shared_memory_batches", partition),
            global_table_batches: builder().counter("global_table_batches", partition),
            split_batches: builder().counter("split_batches", partition),
            cpu_fallback: builder().counter("cpu_fallback", partition),
            spill_count: MetricBuilder::new(set).spill_count(partition),
        }
    }
}

/// One partition's run.
struct Run {
    work: Arc<AggregateWork>,
    device: Device,
    partition: usize,
    /// Merging partial states: the chunks already added to the device table, so that the
    /// groups can be merged again on the CPU should the device be lost with them (partial
    /// states are few next to raw rows; raw input is read again instead).
    retained: Option<std::sync::Mutex<Vec<Chunk>>>,
    batch_rows: usize,
    context: Arc<TaskContext>,
    metrics: GpuMetrics,
    extra: ExtraMetrics,
}

impl Run {
    async fn execute(self, mut input: ChunkStream) -> Result<SendableRecordBatchStream> {
        let schema = self.work.schema.clone();
        // The device table comes with the first rows: a partition without input costs the
        // device nothing (unless the aggregate has no GROUP BY, whose one row it computes).
        let mut table: Option<Tables> = None;
        // Host batches wait here to make up a device batch; a device chunk (from a GPU
        // child) is added as it is.
        let mut pending: Vec<Chunk> = Vec::new();
        let mut pending_rows = 0;
        loop {
            let Some(chunk) = input.next().await else {
                if let Err(e) = self.flush(&mut table, &mut pending, &mut pending_rows) {
                    return self.handle(e, table, pending, input);
                }
                break;
            };
            let chunk = chunk?;
            // A device chunk, or a schema change (metadata, nullability), starts a new
            // device batch.
            let alone = matches!(chunk, Chunk::Device(..));
            if (alone
                || pending
                    .first()
                    .is_some_and(|p| p.schema() != chunk.schema()))
                && let Err(e) = self.flush(&mut table, &mut pending, &mut pending_rows)
            {
                pending.push(chunk);
                return self.handle(e, table, pending, input);
            }
            pending_rows += chunk.num_rows();
            pending.push(chunk);
            if (alone || pending_rows >= self.batch_rows)
                && let Err(e) = self.flush(&mut table, &mut pending, &mut pending_rows)
            {
                return self.handle(e, table, pending, input);
            }
        }
        let table = match table {
            Some(t) => t,
            None if !self.work.keys.is_empty() => {
                self.metrics.baseline.done();
                return Ok(Box::pin(RecordBatchStreamAdapter::new(
                    schema,
                    futures::stream::empty(),
                )));
            }
            None => match self.work.new_tables(&self.device) {
                Ok(t) => t,
                Err(e) => {
                    self.metrics.recover(&e, "aggregating on the CPU")?;
                    return self.fallback(None, Vec::new(), input);
                }
            },
        };
        let timer = self.metrics.baseline.elapsed_compute().timer();
        let out = self.work.output(&table, &self.metrics);
        timer.done();
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                // Downloading failed: the state is still on the device, intact, unless
                // the device is gone.
                let Some(device_error) = device_error(&e) else {
                    return Err(e);
                };
                if device_error.device_gone() {
                    self.metrics
                        .recover(device_error, "computing the groups on the CPU")?;
                    let lost = device_error.to_string();
                    drop(table);
                    return self.recompute(&lost, Vec::new(), input);
                }
                self.metrics
                    .recover(device_error, "retrying the download of an aggregation")?;
                match self.work.output(&table, &self.metrics) {
                    Ok(out) => out,
                    Err(e) => match super::gpu_stream::device_error(&e) {
                        Some(lost) if lost.device_gone() => {
                            let lost = lost.to_string();
                            drop(table);
                            return self.recompute(&lost, Vec::new(), input);
                        }
                        _ => return Err(e),
                    },
                }
            }
        };
        self.extra.groups.add(table.groups());
        self.extra
            .distinct_pairs
            .add(table.distinct.iter().map(GroupTable::groups).sum());
        self.extra
            .shared_memory_batches
            .add(table.groups.shared_updates as usize);
        self.extra
            .global_table_batches
            .add(table.groups.global_updates as usize);
        drop(table);
        let batch_size = self.context.session_config().batch_size().max(1);
        let mut batches = Vec::new();
        let mut at = 0;
        while at < out.num_rows() {
            let len = batch_size.min(out.num_rows() - at);
            batches.push(Ok(out.slice(at, len)));
            at += len;
        }
        // Rows and bytes of the whole output, and the batches it is cut into.
        if !batches.is_empty() {
            self.metrics.record_batch(&out);
            self.metrics
                .baseline
                .output_batches()
                .add(batches.len() - 1);
        }
        self.metrics.baseline.done();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            schema,
            futures::stream::iter(batches),
        )))
    }

    /// Processes the pending input batches as one device batch. When the device runs out
    /// of memory for it, the batch is split in halves (down to `MIN_SPLIT_ROWS`), each
    /// added on its own. On error, `pending` holds what was not added (the table is as it
    /// was before those rows).
    fn flush(
        &self,
        table: &mut Option<Tables>,
        pending: &mut Vec<Chunk>,
        pending_rows: &mut usize,
    ) -> Result<(), UpdateError> {
        if *pending_rows == 0 {
            pending.clear();
            return Ok(());
        }
        let table = match table {
            Some(table) => table,
            None => table.insert(self.work.new_tables(&self.device)?),
        };
        let chunk = match pending.len() {
            0 => return Ok(()),
            1 => pending[0].clone(),
            _ => {
                let batches = pending
                    .iter()
                    .map(|c| c.to_host(&self.metrics))
                    .collect::<Result<Vec<_>, _>>()?;
                Chunk::Host(
                    concat_batches(&batches[0].schema(), batches.iter())
                        .map_err(|e| UpdateError::Query(arrow_err(e)))?,
                )
            }
        };
        let mut pieces = std::collections::VecDeque::from([chunk]);
        while let Some(piece) = pieces.pop_front() {
            let timer = self.metrics.baseline.elapsed_compute().timer();
            let outcome = self.work.update(table, &self.device, &piece, &self.metrics);
            timer.done();
            match (outcome, &piece) {
                (Ok(on_device), _) => {
                    let on = if on_device {
                        BatchOn::Device
                    } else {
                        BatchOn::Rule
                    };
                    count_batch(&self.metrics, on);
                    if let Some(retained) = &self.retained {
                        lock(retained).push(piece.clone());
                    }
                }
                (
                    Err(UpdateError::Device(KernelError::OutOfDeviceMemory { .. })),
                    Chunk::Host(b),
                ) if b.num_rows() >= 2 * MIN_SPLIT_ROWS => {
                    let half = b.num_rows() / 2;
                    self.extra.split_batches.add(1);
                    pieces.push_front(Chunk::Host(b.slice(half, b.num_rows() - half)));
                    pieces.push_front(Chunk::Host(b.slice(0, half)));
                }
                (Err(e), _) => {
                    pieces.push_front(piece);
                    *pending = pieces.into_iter().collect();
                    *pending_rows = pending.iter().map(Chunk::num_rows).sum();
                    return Err(e);
                }
            }
        }
        pending.clear();
        *pending_rows = 0;
        Ok(())
    }

    fn handle(
        self,
        error: UpdateError,
        table: Option<Tables>,
        rest: Vec<Chunk>,
        input: ChunkStream,
    ) -> Result<SendableRecordBatchStream> {
        match error {
            UpdateError::Query(e) => Err(e),
            UpdateError::Device(e) => {
                self.metrics
                    .recover(&e, "the aggregation continues on the CPU")?;
                self.fallback(table, rest, input)
            }
        }
    }

    /// The device was lost with this partition's groups. Merging partial states, the CPU
    /// merges again what the device had been given (retained), then the rest; over raw
    /// input, DataFusion's AggregateExec computes the partition again from its input,
    /// executed anew (GPU operators in it find the device quarantined and run on the CPU),
    /// where that input can be read a second time. Otherwise the query fails with an error
    /// that says so: never a wrong answer.
    fn recompute(
        mut self,
        lost: &str,
        rest: Vec<Chunk>,
        input: ChunkStream,
    ) -> Result<SendableRecordBatchStream> {
        log::warn!(
            "{}: the aggregation's groups were lost with the device ({lost}); partition {} \
             is computed on the CPU",
            self.device,
            self.partition
        );
        if let Some(retained) = self.retained.take() {
            let mut again = retained.into_inner().unwrap_or_else(|p| p.into_inner());
            again.extend(rest);
            return self.fallback(None, again, input);
        }
        drop((rest, input));
        if !super::re_executable(self.work.cpu.input()) {
            return exec_err!(
                "{}: the device was lost with this aggregation's groups ({lost}), and its input \
                 cannot be read a second time; the device is quarantined, so the query runs on \
                 the CPU when it is run again",
                self.device
            );
        }
        self.extra.cpu_fallback.add(1);
        count_batch(&self.metrics, BatchOn::Fallback);
        let cpu: Arc<dyn ExecutionPlan> = Arc::clone(&self.work.cpu) as _;
        cpu.execute(self.partition, Arc::clone(&self.context))
    }

    /// Finishes on the CPU with DataFusion's AggregateExec: the device's groups so far (as
    /// partial states), the batches not yet added, and the rest of the input.
    fn fallback(
        self,
        table: Option<Tables>,
        rest: Vec<Chunk>,
        input: ChunkStream,
    ) -> Result<SendableRecordBatchStream> {
        if table.is_some()
            && let Some(reason) = self.device.quarantined()
        {
            // The groups went with the device.
            drop(table);
            return self.recompute(&reason, rest, input);
        }
        let cpu = Arc::clone(&self.work.cpu);
        let input_schema = cpu.input().schema();
        let mode = *cpu.mode();
        let raw_input = cpu.input_schema();
        let aggregate = |mode: AggregateMode,
                         group_by,
                         filters,
                         input: Arc<dyn ExecutionPlan>|
         -> Result<Arc<dyn ExecutionPlan>> {
            Ok(Arc::new(AggregateExec::try_new(
                mode,
                group_by,
                cpu.aggr_expr().to_vec(),
                filters,
                input,
                Arc::clone(&raw_input),
            )?))
        };
        let no_filters = vec![None; cpu.aggr_expr().len()];
        // The device's groups, as partial states of the schema the CPU merges them in.
        let state_schema = match mode.input_mode() {
            AggregateInputMode::Partial => Arc::clone(&input_schema),
            AggregateInputMode::Raw => aggregate(
                AggregateMode::Partial,
                cpu.group_expr().clone(),
                cpu.filter_expr().to_vec(),
                Arc::new(EmptyExec::new(Arc::clone(&input_schema))),
            )?
            .schema(),
        };
        let saved = match table
            .as_ref()
            .map(|t| self.download_states(t, &state_schema))
        {
            None => Vec::new(),
            Some(Ok(Ok(batch))) => vec![batch],
            Some(Ok(Err(lost))) => {
                drop(table);
                return self.recompute(&lost, rest, input);
            }
            Some(Err(e)) => return Err(e),
        };
        drop(table);
        self.extra.cpu_fallback.add(1);
        for _ in 0..rest.len().max(1) {
            count_batch(&self.metrics, BatchOn::Fallback);
        }
        // What is left of the input, on the host (device chunks come down).
        let metrics = self.metrics.clone();
        let work = Arc::clone(&self.work);
        let to_host = move |chunk: Result<Chunk>| {
            chunk
                .and_then(|c| c.host_for_cpu(&metrics))
                .and_then(|b| work.cpu_rows(b))
        };
        let remaining: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&input_schema),
            futures::stream::iter(rest.into_iter().map(Ok))
                .chain(input)
                .map(to_host),
        ));
        let ctx = Arc::clone(&self.context);
        let plan: Arc<dyn ExecutionPlan> = match mode.input_mode() {
            AggregateInputMode::Partial => {
                // The states merge with the input's, which has their schema.
                let merged: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
                    Arc::clone(&input_schema),
                    futures::stream::iter(saved.into_iter().map(Ok)).chain(remaining),
                ));
                aggregate(
                    mode,
                    cpu.group_expr().clone(),
                    no_filters,
                    Arc::new(OnceExec::new(merged)),
                )?
            }
            AggregateInputMode::Raw => {
                let partial = aggregate(
                    AggregateMode::Partial,
                    cpu.group_expr().clone(),
                    cpu.filter_expr().to_vec(),
                    Arc::new(OnceExec::new(remaining)),
                )?;
                let partial_schema = partial.schema();
                let partial_stream = partial.execute(0, Arc::clone(&ctx))?;
                let merged: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
                    Arc::clone(&partial_schema),
                    futures::stream::iter(saved.into_iter().map(Ok)).chain(partial_stream),
                ));
                if mode.output_mode() == AggregateOutputMode::Partial {
                    // Partial output: the states as they are, then the CPU's.
                    return Ok(merged);
                }
                aggregate(
                    AggregateMode::Final,
                    cpu.group_expr().as_final(),
                    no_filters,
                    Arc::new(OnceExec::new(merged)),
                )?
            }
        };
        plan.execute(0, ctx)
    }

    /// The device's groups as a batch of partial states in `schema`: `Ok(Err(why))` when
    /// the device is gone with them. Another download error is retried once (the groups
    /// are still on the device), then is the query's.
    fn download_states(
        &self,
        table: &Tables,
        schema: &SchemaRef,
    ) -> Result<std::result::Result<RecordBatch, String>> {
        let first = match self.work.state_batch(table, schema, &self.metrics) {
            Ok(batch) => return Ok(Ok(batch)),
            Err(e) => e,
        };
        let Some(error) = device_error(&first) else {
            return Err(first);
        };
        self.metrics
            .recover(error, "retrying the download of the groups")?;
        if error.device_gone() {
            return Ok(Err(error.to_string()));
        }
        match self.work.state_batch(table, schema, &self.metrics) {
            Ok(batch) => Ok(Ok(batch)),
            Err(e) => match device_error(&e) {
                Some(error) if error.device_gone() => Ok(Err(error.to_string())),
                _ => Err(e),
            },
        }
    }
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
