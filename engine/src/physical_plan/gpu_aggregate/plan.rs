//! Planning an aggregation for the device: where each key and argument comes from, the
//! accumulators, and the states they give DataFusion.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::error::Result;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::{
    AggregateExec, AggregateInputMode, AggregateOutputMode, aggregate_expressions,
};
use datafusion::physical_plan::filter::{FilterExec, batch_filter};
use fulmen_kernels::ops::aggregate::{
    AccOp, FusedInput, FusedSpec, GroupTable, MAX_FUSED_ACCS, MAX_REGISTERS,
};
use fulmen_kernels::{Device, KernelError};

use crate::gpu::compile::{
    CompiledExprs, Reason, compile, compile_registers, expr_name, is_output_type,
};

/// Where a key or an aggregate input comes from in each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// An input column, uploaded as it is.
    Input(usize),
    /// An output of the operator's expression program.
    Computed(usize),
    /// No values: `count(*)` counts rows.
    Rows,
}

/// The aggregate functions the device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Func {
    Count,
    Sum,
    Min,
    Max,
    Avg,
}

/// How one state field of an aggregate is read off an accumulator.
#[derive(Debug, Clone)]
pub(super) enum StateFrom {
    /// The accumulator's per-group row counts (count); NULL where 0 when the flag is set
    /// (avg's count, which DataFusion leaves NULL with its sum).
    Counts(usize, bool),
    /// Its values; NULL where no row contributed unless `zero_if_empty`.
    Values(usize, bool),
    /// The list of each group's distinct values, from a pair table.
    Distinct(usize),
}

#[derive(Debug)]
pub(super) struct Accumulator {
    pub(super) op: AccOp,
    pub(super) values: Source,
    pub(super) filter: Option<Source>,
}

/// One `count(DISTINCT x)`, counted in a table of (group keys…, x) pairs.
#[derive(Debug)]
pub(super) struct DistinctCount {
    /// Raw input: x. Merging: the input column of list states.
    pub(super) values: Source,
    pub(super) filter: Option<Source>,
    /// x's type on the device.
    pub(super) value_type: DataType,
}

/// A partition's device tables: the groups with their accumulators, and a pair table per
/// `count(DISTINCT …)`.
#[derive(Debug)]
pub(super) struct Tables {
    pub(super) groups: GroupTable,
    pub(super) distinct: Vec<GroupTable>,
}

impl Tables {
    pub(super) fn groups(&self) -> usize {
        self.groups.groups()
    }
}

/// The device side of one aggregation.
#[derive(Debug)]
pub struct AggregateWork {
    pub(super) cpu: Arc<AggregateExec>,
    pub(super) keys: Vec<Source>,
    /// Key column types on the device (string views arrive as strings) and in the output.
    pub(super) key_types: Vec<DataType>,
    pub(super) key_output_types: Vec<DataType>,
    /// Computed keys, arguments and filters, when there are any.
    pub(super) program: Option<CompiledExprs>,
    /// The program whose registers feed the group table directly
    /// (`GroupTable::update_fused`), where the device can hold every key and argument in
    /// registers and no `count(DISTINCT …)` needs its pair tables.
    pub(super) registers: Option<(CompiledExprs, FusedSpec)>,
    /// With `registers`: how a batch with new keys inserts them first
    /// (`GroupTable::insert_groups`), reading only what the keys and the selection need.
    pub(super) new_keys: Option<NewKeys>,
    pub(super) computed: Vec<Arc<dyn PhysicalExpr>>,
    pub(super) accumulators: Vec<Accumulator>,
    pub(super) distinct: Vec<DistinctCount>,
    /// For each aggregate: its state fields, in DataFusion's order.
    pub(super) states: Vec<Vec<(StateFrom, DataType)>>,
    pub(super) schema: SchemaRef,
    /// A fused stage: the predicate of the filter it takes in (the CPU twin's input is a
    /// `FilterExec` of it over the stage's input), and where its values come from, which
    /// select the rows the group table takes.
    pub(super) fused: Option<(Arc<dyn PhysicalExpr>, Source)>,
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

/// Whether the device holds values of `t` as integers whose minimum and maximum its
/// integer accumulators (`MinInt`, `MaxInt`) reduce.
pub(crate) fn is_integer_like(t: &DataType) -> bool {
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

/// The program that feeds a group table straight from its registers
/// (`GroupTable::update_fused`): a register for each key, the fused filter's rows, and each
/// accumulator's values and filter (a source used twice is one register; an input column is
/// loaded as it is, a computed one computed). `None` where one of them cannot live in a
/// register: such an aggregation adds every batch the ordinary way.
fn register_program(
    keys: &[Source],
    rows: Option<Source>,
    accumulators: &[Accumulator],
    computed: &[Arc<dyn PhysicalExpr>],
    schema: &Schema,
) -> Option<(CompiledExprs, FusedSpec)> {
    let mut sources: Vec<Source> = Vec::new();
    let mut register = |source: Source| -> Option<usize> {
        if source == Source::Rows {
            return None;
        }
        Some(match sources.iter().position(|&s| s == source) {
            Some(k) => k,
            None => {
                sources.push(source);
                sources.len() - 1
            }
        })
    };
    let keys: Vec<usize> = keys.iter().map(|&k| register(k)).collect::<Option<_>>()?;
    let rows = rows.and_then(&mut register);
    let accs = accumulators
        .iter()
        .map(|a| FusedInput {
            value: register(a.values),
            filter: a.filter.and_then(&mut register),
        })
        .collect();
    if sources.len() > MAX_REGISTERS || accumulators.len() > MAX_FUSED_ACCS {
        return None;
    }
    let exprs = sources
        .iter()
        .map(|source| match *source {
            Source::Input(c) => {
                let column: Arc<dyn PhysicalExpr> =
                    Arc::new(Column::new(schema.fields().get(c)?.name(), c));
                Some(column)
            }
            Source::Computed(k) => computed.get(k).cloned(),
            Source::Rows => None,
        })
        .collect::<Option<Vec<_>>>()?;
    let compiled = compile_registers(&exprs, schema).ok()?;
    Some((compiled, FusedSpec { keys, rows, accs }))
}

/// Where a batch's keys and row selection come from when its new keys are inserted alone:
/// input columns, or outputs of a program computing only those (`Source::Computed(k)` is
/// output k of `program`).
#[derive(Debug)]
pub(super) struct NewKeys {
    pub(super) program: Option<CompiledExprs>,
    pub(super) keys: Vec<Source>,
    pub(super) rows: Option<Source>,
}

/// The [`NewKeys`] of an aggregation, or `None` where its computed keys or predicate do not
/// compile alone (they always do where the whole program did).
fn key_program(
    keys: &[Source],
    rows: Option<Source>,
    computed: &[Arc<dyn PhysicalExpr>],
    schema: &Schema,
) -> Option<NewKeys> {
    let mut exprs: Vec<Arc<dyn PhysicalExpr>> = Vec::new();
    let mut own = |source: Source| -> Option<Source> {
        Some(match source {
            Source::Computed(k) => {
                exprs.push(Arc::clone(computed.get(k)?));
                Source::Computed(exprs.len() - 1)
            }
            other => other,
        })
    };
    let keys = keys.iter().map(|&k| own(k)).collect::<Option<Vec<_>>>()?;
    let rows = match rows {
        Some(rows) => Some(own(rows)?),
        None => None,
    };
    let program = match exprs.is_empty() {
        true => None,
        false => Some(compile(&exprs, schema).ok()?),
    };
    Some(NewKeys {
        program,
        keys,
        rows,
    })
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
            if !super::super::keyable(&t) {
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
        let rows = fused.as_ref().map(|(_, rows)| *rows);
        let (registers, new_keys) = match distinct.is_empty() {
            true => (
                register_program(&keys, rows, &accumulators, &computed, &input_schema),
                key_program(&keys, rows, &computed, &input_schema),
            ),
            false => (None, None),
        };
        let (registers, new_keys) = match (registers, new_keys) {
            (Some(registers), Some(new_keys)) => (Some(registers), Some(new_keys)),
            _ => (None, None),
        };
        let cpu = Arc::new(cpu.clone());
        Ok(Self {
            cpu,
            keys,
            key_types,
            key_output_types,
            program,
            registers,
            new_keys,
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
    pub(super) fn device_input(&self) -> &Arc<dyn ExecutionPlan> {
        let input = self.cpu.input();
        match (&self.fused, input.children().first()) {
            (Some(_), Some(filter_input)) => filter_input,
            _ => input,
        }
    }

    /// `batch` (of the device input) as the CPU aggregate's input: the fused filter's rows.
    pub(super) fn cpu_rows(&self, batch: RecordBatch) -> Result<RecordBatch> {
        match &self.fused {
            Some((predicate, _)) => batch_filter(&batch, predicate),
            None => Ok(batch),
        }
    }

    pub(super) fn new_tables(&self, device: &Device) -> Result<Tables, KernelError> {
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

    /// Whether the input is rows (not partial states).
    pub(super) fn raw(&self) -> bool {
        self.cpu.mode().input_mode() == AggregateInputMode::Raw
    }
}
