//! `GpuAggregateExec`: DataFusion's `AggregateExec` on a GPU, in every mode (Partial,
//! PartialReduce, Final, FinalPartitioned, Single, SinglePartitioned).
//!
//! Each partition keeps one device [`GroupTable`] for its whole input: batches (coalesced
//! to `volley.gpu.batch_rows`) are uploaded, computed keys, arguments and `FILTER` clauses
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
//! integers, floats, decimals and (min/max) dates and timestamps; any other aggregate, a
//! DISTINCT or ordered aggregate, grouping sets and group limits leave the node on the CPU
//! with the reason.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use datafusion::arrow::array::{
    Array, ArrayData, ArrayRef, Decimal128Array, Float64Array, RecordBatch, UInt64Array,
};
use datafusion::arrow::buffer::{Buffer, NullBuffer};
use datafusion::arrow::compute::{cast, concat_batches};
use datafusion::arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::common::internal_datafusion_err;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::EmitTo;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_plan::aggregates::{
    AggregateExec, AggregateInputMode, AggregateMode, AggregateOutputMode, aggregate_expressions,
};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan};
use futures::{StreamExt, TryStreamExt};
use volley_kernels::ops::aggregate::{AccInput, AccOp, AccState, AccValues, GroupTable};
use volley_kernels::ops::expr;
use volley_kernels::{Device, DeviceColumn, KernelError};

use super::gpu_stream::{
    Chunk, ChunkStream, GpuMetrics, OperatorKind, count_operator, device_for, input_chunks,
    make_batch,
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
}

#[derive(Debug)]
struct Accumulator {
    op: AccOp,
    values: Source,
    filter: Option<Source>,
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
    /// For each aggregate: its state fields, in DataFusion's order.
    states: Vec<Vec<(StateFrom, DataType)>>,
    schema: SchemaRef,
}

fn func_of(agg: &AggregateFunctionExpr) -> Result<Func, Reason> {
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
    if agg.is_distinct() {
        return Err(format!("{name}(DISTINCT …) is not supported on GPU"));
    }
    if !agg.order_bys().is_empty() {
        return Err(format!("{name} with ORDER BY is not supported on GPU"));
    }
    Ok(func)
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
            let device = volley_kernels::column::device_type(&data_type, 0).map_err(|_| {
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

impl AggregateWork {
    /// The device side of `plan`, or why it stays on the CPU.
    pub fn plan(plan: &Arc<dyn ExecutionPlan>) -> Result<Self, Reason> {
        let Some(cpu) = plan.downcast_ref::<AggregateExec>() else {
            return Err("not an AggregateExec".into());
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
            if t == DataType::Boolean {
                return Err("grouping by a boolean is not supported on GPU".into());
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
        let mut states = Vec::new();
        for (k, agg) in cpu.aggr_expr().iter().enumerate() {
            let func = func_of(agg)?;
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
                    "{} keeps {} state fields, Volley expected {}",
                    agg.name(),
                    state_types.len(),
                    state.len()
                ));
            }
            if mode.output_mode() == AggregateOutputMode::Final
                && !agg.groups_accumulator_supported()
            {
                return Err(format!(
                    "{} has no groups accumulator to finish with",
                    agg.name()
                ));
            }
            states.push(state.into_iter().zip(state_types).collect());
        }
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
            states,
            schema: output_schema,
        })
    }

    fn new_table(&self, device: &Device) -> Result<GroupTable, KernelError> {
        let ops: Vec<AccOp> = self.accumulators.iter().map(|a| a.op).collect();
        GroupTable::new(device, &self.key_types, &ops)
    }

    /// Adds one batch to `table`. `Ok(false)`: the program left some row to the CPU, and
    /// DataFusion evaluated the batch's expressions instead (an error it raises is the
    /// query's).
    fn update(
        &self,
        table: &mut GroupTable,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
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
        let mut on_device = true;
        let computed: Vec<DeviceColumn> = match &self.program {
            None => Vec::new(),
            Some(program) => {
                let outputs = match program.bind(&input.host_view()) {
                    Ok(bound) => {
                        for &c in &program.inputs {
                            upload(c, &mut uploaded)?;
                        }
                        let inputs: Vec<&DeviceColumn> =
                            program.inputs.iter().map(|c| &uploaded[c]).collect();
                        metrics.kernel(|| expr::evaluate(device, &bound, &inputs, n))?
                    }
                    Err(_) => None,
                };
                match outputs {
                    Some(outputs) => outputs,
                    None => {
                        on_device = false;
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
                }
            }
        };
        for source in self.keys.iter().chain(
            self.accumulators
                .iter()
                .flat_map(|a| std::iter::once(&a.values).chain(a.filter.iter())),
        ) {
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
        metrics.kernel(|| table.update(&keys, &inputs, n))?;
        Ok(on_device)
    }

    /// The table's groups as a batch of partial states in `schema` (keys, then each
    /// aggregate's state fields).
    fn state_batch(
        &self,
        table: &GroupTable,
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
        table: &GroupTable,
        metrics: &GpuMetrics,
    ) -> Result<(Vec<ArrayRef>, Vec<Vec<ArrayRef>>)> {
        let start = std::time::Instant::now();
        let keys = table.keys().map_err(kernel_err)?;
        let accs: Vec<AccState> = (0..self.accumulators.len())
            .map(|k| table.state(k))
            .collect::<Result<_, _>>()
            .map_err(kernel_err)?;
        metrics.d2h_time.add_duration(start.elapsed());
        metrics.d2h_bytes.add(table.result_bytes());
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
                    .map(|(from, t)| state_array(&accs, from, t))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((keys, states))
    }

    /// The operator's output from the table.
    fn output(&self, table: &GroupTable, metrics: &GpuMetrics) -> Result<RecordBatch> {
        let (keys, states) = self.download(table, metrics)?;
        let groups = table.groups();
        let mut columns = keys;
        if self.cpu.mode().output_mode() == AggregateOutputMode::Partial {
            columns.extend(states.into_iter().flatten());
        } else {
            let ids: Vec<usize> = (0..groups).collect();
            for (agg, state) in self.cpu.aggr_expr().iter().zip(states) {
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

/// One state field of `t` from the accumulators' states.
fn state_array(accs: &[AccState], from: &StateFrom, t: &DataType) -> Result<ArrayRef> {
    match from {
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
        if devices.is_empty() {
            return Err("no device".into());
        }
        let work = AggregateWork::plan(&cpu)?;
        Ok(Self {
            inner: cpu,
            work: Arc::new(work),
            devices,
            batch_rows,
            metrics: ExecutionPlanMetricsSet::new(),
            executed: AtomicBool::new(false),
        })
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
        super::fmt_gpu_operator("GpuAggregateExec", &self.inner, &self.devices, t, f)
    }
}

impl ExecutionPlan for GpuAggregateExec {
    fn name(&self) -> &str {
        "GpuAggregateExec"
    }

    delegate_to_cpu_operator!("GpuAggregateExec");

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("GpuAggregateExec without a device"))?;
        let input = input_chunks(
            self.work.cpu.input(),
            partition,
            Arc::clone(&context),
            &self.devices,
        )?;
        let metrics = GpuMetrics::new(&self.metrics, partition, &device);
        let extra = ExtraMetrics::new(&self.metrics, partition, &device);
        count_operator(&self.executed, OperatorKind::Aggregate);
        super::gpu_stream::count_partition();
        let run = Run {
            work: Arc::clone(&self.work),
            device,
            batch_rows: self.batch_rows,
            context,
            metrics,
            extra,
        };
        let stream = futures::stream::once(run.execute(input)).try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            stream,
        )))
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
        let mut table: Option<GroupTable> = None;
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
            None => match self.work.new_table(&self.device) {
                Ok(t) => t,
                Err(e) => {
                    log::warn!("{}: aggregating on the CPU: {e}", self.device);
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
                // Downloading failed: the state is still on the device, intact.
                log::warn!(
                    "{}: retrying the download of an aggregation: {e}",
                    self.device
                );
                self.work.output(&table, &self.metrics)?
            }
        };
        self.extra.groups.add(table.groups());
        self.extra
            .shared_memory_batches
            .add(table.shared_updates as usize);
        self.extra
            .global_table_batches
            .add(table.global_updates as usize);
        drop(table);
        let batch_size = self.context.session_config().batch_size().max(1);
        let mut batches = Vec::new();
        let mut at = 0;
        while at < out.num_rows() {
            let len = batch_size.min(out.num_rows() - at);
            batches.push(Ok(out.slice(at, len)));
            at += len;
        }
        self.metrics.baseline.record_output(out.num_rows());
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
        table: &mut Option<GroupTable>,
        pending: &mut Vec<Chunk>,
        pending_rows: &mut usize,
    ) -> Result<(), UpdateError> {
        if *pending_rows == 0 {
            pending.clear();
            return Ok(());
        }
        let table = match table {
            Some(table) => table,
            None => table.insert(self.work.new_table(&self.device)?),
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
                    if on_device {
                        self.metrics.gpu_batches.add(1);
                    } else {
                        self.metrics.cpu_batches.add(1);
                    }
                    super::gpu_stream::count_batch(on_device);
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
        table: Option<GroupTable>,
        rest: Vec<Chunk>,
        input: ChunkStream,
    ) -> Result<SendableRecordBatchStream> {
        match error {
            UpdateError::Query(e) => Err(e),
            UpdateError::Device(e) => {
                log::warn!(
                    "{}: the aggregation continues on the CPU after: {e}",
                    self.device
                );
                self.fallback(table, rest, input)
            }
        }
    }

    /// Finishes on the CPU with DataFusion's AggregateExec: the device's groups so far (as
    /// partial states), the batches not yet added, and the rest of the input.
    fn fallback(
        self,
        table: Option<GroupTable>,
        rest: Vec<Chunk>,
        input: ChunkStream,
    ) -> Result<SendableRecordBatchStream> {
        self.extra.cpu_fallback.add(1);
        self.metrics.cpu_batches.add(rest.len().max(1));
        super::gpu_stream::count_batch(false);
        let cpu = &self.work.cpu;
        let input_schema = cpu.input().schema();
        // What is left of the input, on the host (device chunks come down).
        let metrics = self.metrics.clone();
        let to_host =
            move |chunk: Result<Chunk>| chunk.and_then(|c| c.to_host(&metrics).map_err(kernel_err));
        let remaining: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&input_schema),
            futures::stream::iter(rest.into_iter().map(Ok))
                .chain(input)
                .map(to_host),
        ));
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
        // The device's groups as a batch of partial states in `schema` (none without a
        // table; an error downloading them is retried once, then is the query's).
        let states = |schema: &SchemaRef| -> Result<Vec<RecordBatch>> {
            match &table {
                None => Ok(Vec::new()),
                Some(t) => {
                    let batch = self
                        .work
                        .state_batch(t, schema, &self.metrics)
                        .or_else(|_| self.work.state_batch(t, schema, &self.metrics))?;
                    Ok(vec![batch])
                }
            }
        };
        let ctx = Arc::clone(&self.context);
        let plan: Arc<dyn ExecutionPlan> = match mode.input_mode() {
            AggregateInputMode::Partial => {
                // The states merge with the input's, which has their schema.
                let saved = states(&input_schema)?;
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
                let saved = states(&partial_schema)?;
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
        drop(table);
        plan.execute(0, ctx)
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
