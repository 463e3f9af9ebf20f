//! Fused device stages: plan rewrites that let one GPU operator do the work of a chain.
//!
//! **A keyless aggregate over a filter** (TPC-H Q6's shape: `SELECT sum(…) FROM t WHERE p`)
//! becomes the aggregate alone over the filter's input, each argument `x` guarded as
//! `CASE WHEN p THEN x END`:
//!
//! ```text
//!   GpuAggregateExec(Partial, sum(x))           GpuAggregateExec(Partial,
//!     GpuFilterExec(p, projection)       ──▶       sum(CASE WHEN p THEN x END))
//!       input                                     input
//! ```
//!
//! On the device this is one expression program per batch (the predicate, the projected
//! values and the aggregate inputs evaluated together) feeding the accumulators, with no
//! selection indices, no compaction and no gathered columns: two launches per batch
//! instead of about ten. It is exact because the aggregates it accepts (`sum`, `avg`,
//! `min`, `max`, `count`, with or without DISTINCT) ignore NULL arguments, and a keyless
//! aggregate's answer over no rows is its answer over only NULLs. DataFusion evaluates a
//! CASE branch only on the rows that take it, so a batch redone on the CPU meets no error
//! the filter would have kept it from (on the device every branch is evaluated, and a row
//! the program leaves to the CPU sends the batch there, as before).
//!
//! **A grouped aggregate over a filter** (TPC-H Q1's shape) cannot guard its arguments:
//! rows the filter drops must not make groups. It becomes a [`GpuAggregateExec`] that takes
//! the filter in ([`GpuAggregateExec::try_fused`]): its CPU twin is the aggregate over a
//! `FilterExec` (without projection) of the filter's input, and on the device the
//! predicate is one more output of the aggregate's expression program, which selects the
//! rows the group table takes (`UpdateWith::rows`: a dropped row makes no group and
//! updates nothing). EXPLAIN shows it as `GpuAggregateExec: …, fused_filter=<predicate>`
//! over the filter's input.
//!
//! Both see through a device projection between the aggregate and the filter (Q1's
//! `l_extendedprice * (1 - l_discount)`): its expressions are inlined into the
//! aggregate's, which the one program then evaluates.
//!
//! **A join over a filter on its probe side** (TPC-H Q3's `lineitem` under
//! `l_shipdate > …`, Q4's `orders` under a semi join, Q13's under a left join) becomes a
//! [`GpuHashJoinExec::try_fused`] stage: its CPU twin is the join over the filter's own CPU
//! twin, its children the build side and the filter's input, and on the device the
//! predicate's bitmap is the probe's row mask (see `physical_plan/gpu_hash_join/fused.rs`).
//! Inner, left, left semi, left anti and right semi joins, with or without a residual
//! filter: not those that emit probe rows without a match (right, full, right anti), and
//! not, where the join assembles its output on the host, a filter over device chunks
//! (`GpuHashJoinExec::try_fused` declines it).
//!
//! Not folded: an aggregate with an ORDER BY; keyless, one with its own FILTER or no
//! argument, or another function than those above; grouped, a `count(DISTINCT …)`; and a
//! filter with a row limit pushed into it.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::aggregate::{AggregateExprBuilder, AggregateFunctionExpr};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::expressions::{CaseExpr, Column};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;

#[allow(unused_imports)] // named by the module docs
use crate::physical_plan::GpuAggregateExec;
use crate::physical_plan::GpuHashJoinExec;
use crate::physical_plan::{GpuFilterExec, GpuProjectionExec};
use datafusion::physical_plan::joins::HashJoinExec;

/// Aggregate functions that ignore NULL arguments, so that guarding each argument with the
/// filter's predicate is the filter.
const NULL_IGNORING: &[&str] = &["sum", "avg", "min", "max", "count"];

/// The device filter (and projection) under an aggregate that a fused stage takes in.
struct Chain {
    /// The filter's input: the fused stage's.
    input: Arc<dyn ExecutionPlan>,
    predicate: Arc<dyn PhysicalExpr>,
    /// For each column of the aggregate's input, its expression over `input`.
    columns: Vec<Arc<dyn PhysicalExpr>>,
}

impl Chain {
    /// The chain under `agg`: a `GpuFilterExec` without a row limit, perhaps under a
    /// `GpuProjectionExec`.
    fn under(agg: &AggregateExec) -> Option<Self> {
        let mut node = agg.input();
        let mut projected: Option<Vec<Arc<dyn PhysicalExpr>>> = None;
        if let Some(projection) = node.downcast_ref::<GpuProjectionExec>() {
            let cpu = projection.cpu().downcast_ref::<ProjectionExec>()?;
            projected = Some(cpu.expr().iter().map(|e| Arc::clone(&e.expr)).collect());
            node = cpu.input();
        }
        let filter = node
            .downcast_ref::<GpuFilterExec>()?
            .cpu()
            .downcast_ref::<FilterExec>()?;
        if filter.fetch().is_some() {
            // A row limit pushed into the filter (`… WHERE p LIMIT n` under the aggregate).
            return None;
        }
        let input = Arc::clone(filter.input());
        let schema = input.schema();
        // The filter's output: its projection of its input.
        let filtered: Vec<Arc<dyn PhysicalExpr>> = match filter.projection() {
            Some(projection) => projection
                .iter()
                .map(|&i| Arc::new(Column::new(schema.field(i).name(), i)) as _)
                .collect(),
            None => (0..schema.fields().len())
                .map(|i| Arc::new(Column::new(schema.field(i).name(), i)) as _)
                .collect(),
        };
        let columns = match projected {
            Some(exprs) => exprs
                .iter()
                .map(|e| substitute(e, &filtered))
                .collect::<Option<Vec<_>>>()?,
            None => filtered,
        };
        Some(Self {
            input,
            predicate: Arc::clone(filter.predicate()),
            columns,
        })
    }

    /// `expr` (over the aggregate's input) over the chain's input.
    fn to_input(&self, expr: &Arc<dyn PhysicalExpr>) -> Option<Arc<dyn PhysicalExpr>> {
        substitute(expr, &self.columns)
    }
}

/// `expr` with each column `i` replaced by `columns[i]`.
fn substitute(
    expr: &Arc<dyn PhysicalExpr>,
    columns: &[Arc<dyn PhysicalExpr>],
) -> Option<Arc<dyn PhysicalExpr>> {
    Arc::clone(expr)
        .transform(|e| {
            let Some(c) = e.downcast_ref::<Column>() else {
                return Ok(Transformed::no(e));
            };
            let column = columns.get(c.index()).ok_or_else(|| {
                datafusion::common::internal_datafusion_err!("column {c} past the projection")
            })?;
            Ok(Transformed::yes(Arc::clone(column)))
        })
        .data()
        .ok()
}

/// `node` (a keyless aggregate over rows, whose input is a filter placed on the device)
/// with the filter folded into its arguments; `None` where the rewrite does not apply.
pub fn fold_filter_into_aggregate(node: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    let agg = node.downcast_ref::<AggregateExec>()?;
    if !agg.group_expr().is_true_no_grouping()
        || !matches!(agg.mode(), AggregateMode::Partial | AggregateMode::Single)
        || agg.filter_expr().iter().any(Option::is_some)
        || agg.limit_options().is_some()
    {
        return None;
    }
    let chain = Chain::under(agg)?;
    let schema = chain.input.schema();
    let predicate = &chain.predicate;
    let mut aggregates = Vec::with_capacity(agg.aggr_expr().len());
    for a in agg.aggr_expr() {
        if !NULL_IGNORING.contains(&a.fun().name())
            || !a.order_bys().is_empty()
            || a.expressions().is_empty()
        {
            return None;
        }
        let args = a
            .expressions()
            .iter()
            .map(|arg| {
                let guarded = CaseExpr::try_new(
                    None,
                    vec![(Arc::clone(predicate), chain.to_input(arg)?)],
                    None,
                );
                guarded.ok().map(|c| Arc::new(c) as Arc<dyn PhysicalExpr>)
            })
            .collect::<Option<Vec<_>>>()?;
        let display = format!("{} FILTER (WHERE {predicate})", a.name());
        let alias = Some(a.name().to_string());
        aggregates.push(Arc::new(rebuilt(a, args, &schema, display, alias)?));
    }
    let folded = AggregateExec::try_new(
        *agg.mode(),
        agg.group_expr().clone(),
        aggregates,
        agg.filter_expr().to_vec(),
        Arc::clone(&chain.input),
        Arc::clone(&schema),
    )
    .ok()?;
    // The plan above reads the same columns: same names, types and nullability.
    (folded.schema() == agg.schema()).then(|| Arc::new(folded) as Arc<dyn ExecutionPlan>)
}

/// `node` (a grouped aggregate over rows, whose input is a filter placed on the device) as
/// the aggregate over a CPU `FilterExec` (no projection) of the filter's input, its
/// expressions over that input: the CPU twin of a [`GpuAggregateExec::try_fused`] stage.
/// `None` where the rewrite does not apply.
pub fn fold_filter_into_grouped_aggregate(
    node: &Arc<dyn ExecutionPlan>,
) -> Option<Arc<dyn ExecutionPlan>> {
    let agg = node.downcast_ref::<AggregateExec>()?;
    let group_by = agg.group_expr();
    if group_by.is_true_no_grouping()
        || group_by.has_grouping_set()
        || !matches!(
            agg.mode(),
            AggregateMode::Partial | AggregateMode::Single | AggregateMode::SinglePartitioned
        )
        || agg.limit_options().is_some()
        || agg.aggr_expr().iter().any(|a| a.is_distinct())
    {
        return None;
    }
    let chain = Chain::under(agg)?;
    let schema = chain.input.schema();
    let keys = group_by
        .expr()
        .iter()
        .map(|(e, name)| Some((chain.to_input(e)?, name.clone())))
        .collect::<Option<Vec<_>>>()?;
    let aggregates = agg
        .aggr_expr()
        .iter()
        .map(|a| {
            let args = a
                .expressions()
                .iter()
                .map(|e| chain.to_input(e))
                .collect::<Option<Vec<_>>>()?;
            // Shown as it was: the filter is the stage's (`fused_filter=…`), not the
            // aggregate's.
            let display = a.human_display().unwrap_or(a.name()).to_string();
            let alias = a.human_display_alias().map(str::to_string);
            rebuilt(a, args, &schema, display, alias).map(Arc::new)
        })
        .collect::<Option<Vec<_>>>()?;
    let filters = agg
        .filter_expr()
        .iter()
        .map(|f| match f {
            Some(f) => chain.to_input(f).map(Some),
            None => Some(None),
        })
        .collect::<Option<Vec<_>>>()?;
    let filter =
        FilterExec::try_new(Arc::clone(&chain.predicate), Arc::clone(&chain.input)).ok()?;
    let folded = AggregateExec::try_new(
        *agg.mode(),
        PhysicalGroupBy::new_single(keys),
        aggregates,
        filters,
        Arc::new(filter),
        Arc::clone(&schema),
    )
    .ok()?;
    (folded.schema() == agg.schema()).then(|| Arc::new(folded) as Arc<dyn ExecutionPlan>)
}

/// `a` over `args`, keeping its name (the state columns the plan above reads), shown in
/// EXPLAIN as `display` (`as alias` where one is given).
fn rebuilt(
    a: &AggregateFunctionExpr,
    args: Vec<Arc<dyn PhysicalExpr>>,
    schema: &datafusion::arrow::datatypes::SchemaRef,
    display: String,
    alias: Option<String>,
) -> Option<AggregateFunctionExpr> {
    if !a.order_bys().is_empty() {
        return None;
    }
    let mut builder = AggregateExprBuilder::new(Arc::new(a.fun().clone()), args)
        .schema(Arc::clone(schema))
        .alias(a.name())
        .human_display(display);
    if let Some(alias) = alias {
        builder = builder.human_display_alias(alias);
    }
    builder
        .with_distinct(a.is_distinct())
        .with_ignore_nulls(a.ignore_nulls())
        .build()
        .ok()
}

/// `node` (a hash join of a type that takes the filter in, whose probe side is a filter
/// placed on the device) over the filter's CPU twin, for a [`GpuHashJoinExec::try_fused`]
/// stage to take the filter in; `None` where the rewrite does not apply.
pub fn fold_filter_into_join(node: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    let join = node.downcast_ref::<HashJoinExec>()?;
    if !GpuHashJoinExec::takes_in_probe_filter(*join.join_type()) {
        return None;
    }
    let filter = join.right().downcast_ref::<GpuFilterExec>()?.cpu();
    if filter.fetch().is_some() {
        return None;
    }
    let children = vec![Arc::clone(join.left()), Arc::clone(filter)];
    use datafusion::physical_plan::execution_plan::{
        ChildrenPropertiesMode, ReplaceChildrenOptions,
    };
    let recompute = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
    let folded = Arc::clone(node)
        .replace_children(children, recompute)
        .ok()?;
    (folded.schema() == node.schema()).then_some(folded)
}
