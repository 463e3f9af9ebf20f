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
//! Not folded: grouped aggregates (rows the filter drops must not make groups), aggregates
//! with their own FILTER, an ORDER BY or no argument, a filter with a row limit pushed into
//! it, and any other aggregate function.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::aggregate::{AggregateExprBuilder, AggregateFunctionExpr};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::expressions::{CaseExpr, Column};
use datafusion::physical_plan::filter::FilterExec;

use crate::physical_plan::GpuFilterExec;

/// Aggregate functions that ignore NULL arguments, so that guarding each argument with the
/// filter's predicate is the filter.
const NULL_IGNORING: &[&str] = &["sum", "avg", "min", "max", "count"];

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
    let filter = agg
        .input()
        .downcast_ref::<GpuFilterExec>()?
        .cpu()
        .downcast_ref::<FilterExec>()?;
    if filter.fetch().is_some() {
        // A row limit pushed into the filter (`… WHERE p LIMIT n` under the aggregate).
        return None;
    }
    let input = Arc::clone(filter.input());
    let schema = input.schema();
    let predicate = Arc::clone(filter.predicate());
    // The aggregate's columns are the filter's output: its projection of the input.
    let projection = filter.projection().clone();
    let to_input = |expr: &Arc<dyn PhysicalExpr>| -> Option<Arc<dyn PhysicalExpr>> {
        let Some(projection) = &projection else {
            return Some(Arc::clone(expr));
        };
        Arc::clone(expr)
            .transform(|e| {
                let Some(c) = e.downcast_ref::<Column>() else {
                    return Ok(Transformed::no(e));
                };
                let index = *projection.get(c.index()).ok_or_else(|| {
                    datafusion::common::internal_datafusion_err!("column {c} past the projection")
                })?;
                let column = Column::new(schema.field(index).name(), index);
                Ok(Transformed::yes(Arc::new(column) as Arc<dyn PhysicalExpr>))
            })
            .data()
            .ok()
    };
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
                let guarded =
                    CaseExpr::try_new(None, vec![(Arc::clone(&predicate), to_input(arg)?)], None);
                guarded.ok().map(|c| Arc::new(c) as Arc<dyn PhysicalExpr>)
            })
            .collect::<Option<Vec<_>>>()?;
        aggregates.push(Arc::new(guarded(a, args, &predicate, &schema)?));
    }
    let folded = AggregateExec::try_new(
        *agg.mode(),
        agg.group_expr().clone(),
        aggregates,
        agg.filter_expr().to_vec(),
        input,
        Arc::clone(&schema),
    )
    .ok()?;
    // The plan above reads the same columns: same names, types and nullability.
    (folded.schema() == agg.schema()).then(|| Arc::new(folded) as Arc<dyn ExecutionPlan>)
}

/// `a` over the guarded `args`, keeping its name (the state columns the plan above reads),
/// and showing the folded filter in EXPLAIN.
fn guarded(
    a: &AggregateFunctionExpr,
    args: Vec<Arc<dyn PhysicalExpr>>,
    predicate: &Arc<dyn PhysicalExpr>,
    schema: &datafusion::arrow::datatypes::SchemaRef,
) -> Option<AggregateFunctionExpr> {
    AggregateExprBuilder::new(Arc::new(a.fun().clone()), args)
        .schema(Arc::clone(schema))
        .alias(a.name())
        .human_display(format!("{} FILTER (WHERE {predicate})", a.name()))
        .human_display_alias(a.name())
        .with_distinct(a.is_distinct())
        .with_ignore_nulls(a.ignore_nulls())
        .build()
        .ok()
}
