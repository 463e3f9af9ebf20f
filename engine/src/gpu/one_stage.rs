//! On one device, an aggregation in one stage: DataFusion plans a GROUP BY over several
//! partitions as a partial aggregation per partition, a hash repartition of the partial
//! states on the CPU, and a final aggregation per partition (or, without keys, a final
//! aggregation over the partial states coalesced). When every partition's partial stage
//! would run on the same device, that plan brings each partition's states down, shuffles
//! them on the host and sends them up again to be merged: two group tables, a download and
//! an upload per partition, and the final stage's launches and waits, for nothing the
//! device needs. `fulmen.gpu.single_stage_aggregation` (on by default) makes it one
//! aggregation (`Single`) over all the partitions' rows:
//!
//! ```text
//!   FinalPartitioned ← RepartitionExec(hash) ← Partial ← filters/projections ← X
//!   Final            ← CoalescePartitionsExec ← Partial ← filters/projections ← X
//!     ⇒ Single ← filters/projections ← CoalescePartitionsExec ← X
//!       (X's input where X is a round-robin repartition, uncoalesced if one partition)
//!       (under a RepartitionExec with the final stage's partitioning where the parent
//!        needs its input partitioned by the keys)
//! ```
//!
//! The coalesce goes under the filters and projections (which work row by row, whatever
//! the partitions) so that the aggregation still takes them into its stage
//! (`gpu::fuse`); a GPU operator over a `CoalescePartitionsExec` of GPU operators on its
//! device takes every partition's chunks where they lie (`gpu_stream::input_chunks`). The
//! rewrite is made only where the one-stage aggregation itself would run on the device:
//! on the CPU, DataFusion's two stages use every core.

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::physical_expr::Distribution;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::union::{InterleaveExec, can_interleave};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};
use fulmen_kernels::Device;

use super::overrides::{Decision, decide, in_service};
use crate::config::FulmenConfig;

/// `plan` with each two-stage aggregation that one device would run made one stage (see
/// the module docs); as it is unless the devices in service are exactly one.
pub(super) fn one_stage_aggregations(
    plan: Arc<dyn ExecutionPlan>,
    fulmen: &FulmenConfig,
    available: &Result<Arc<Vec<Device>>, String>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let one_device = matches!(available, Ok(d) if in_service(d).is_some_and(|d| d.len() == 1));
    if !fulmen.gpu_single_stage_aggregation || !one_device {
        return Ok(plan);
    }
    rewritten(&plan, false, fulmen, available)
}

/// `node` with its two-stage aggregations made one stage, bottom up. `keyed`: whether what
/// consumes `node`'s output relies on its partitioning (a parent that needs its input
/// partitioned by keys, or one that passes its partitions on to such a parent); a one-stage
/// aggregation there gets a repartition with the final stage's partitioning over it.
fn rewritten(
    node: &Arc<dyn ExecutionPlan>,
    keyed: bool,
    fulmen: &FulmenConfig,
    available: &Result<Arc<Vec<Device>>, String>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let required = node.input_distribution_requirements();
    // Whatever is not known to end the partitioning (a node of one output partition, or a
    // repartition) is taken to pass it on.
    let passes_on =
        keyed && node.output_partitioning().partition_count() > 1 && !node.is::<RepartitionExec>();
    let mut changed = false;
    let mut children = Vec::new();
    for (i, child) in node.children().into_iter().enumerate() {
        // An interleave reads its children's partitions side by side, which it can only
        // do where they are partitioned alike by the same keys.
        let child_keyed = match required.child_distribution(i) {
            _ if node.is::<InterleaveExec>() => true,
            None | Some(Distribution::UnspecifiedDistribution) => passes_on,
            Some(Distribution::SinglePartition) => false,
            Some(_) => true,
        };
        let new = rewritten(child, child_keyed, fulmen, available)?;
        changed |= !Arc::ptr_eq(&new, child);
        children.push(new);
    }
    // An interleave whose rewritten children are not partitioned alike by hash over more
    // than one partition (a final stage of one, which gets no repartition) keeps the
    // children it had, in two stages; any other node must take its rewritten children.
    let node = match changed {
        true if node.is::<InterleaveExec>() && !can_interleave(children.iter()) => Arc::clone(node),
        true => Arc::clone(node).replace_children(children, recompute())?,
        false => Arc::clone(node),
    };
    Ok(match one_stage(&node, fulmen, available)? {
        // (A final stage of one partition met its parent's need as it is, and so does one
        // stage, whose output is one partition.)
        Some((single, partitioning @ Partitioning::Hash(_, 2..))) if keyed => {
            Arc::new(RepartitionExec::try_new(single, partitioning)?)
        }
        Some((single, _)) => single,
        None => node,
    })
}

/// `node` as one aggregation over all its input's partitions, with the partitioning its
/// final stage gave, if it is a final stage over a partial one that the device would run
/// as one.
fn one_stage(
    node: &Arc<dyn ExecutionPlan>,
    fulmen: &FulmenConfig,
    available: &Result<Arc<Vec<Device>>, String>,
) -> Result<Option<(Arc<dyn ExecutionPlan>, Partitioning)>> {
    let Some(last) = node.downcast_ref::<AggregateExec>() else {
        return Ok(None);
    };
    let between = last.input();
    let paired = match last.mode() {
        AggregateMode::FinalPartitioned => between
            .downcast_ref::<RepartitionExec>()
            .is_some_and(|r| matches!(r.partitioning(), Partitioning::Hash(..))),
        AggregateMode::Final => between.is::<CoalescePartitionsExec>(),
        _ => false,
    };
    let Some(first) = paired
        .then(|| between.children().first().copied())
        .flatten()
        .and_then(|c| c.downcast_ref::<AggregateExec>())
    else {
        return Ok(None);
    };
    // A final stage whose output is ordered (over ordered partial states) may have let the
    // plan above go without a sort, which one stage over coalesced rows would not keep.
    if *first.mode() != AggregateMode::Partial
        || first.aggr_expr().len() != last.aggr_expr().len()
        || last.properties().output_ordering().is_some()
    {
        return Ok(None);
    }
    let input = coalesced_under_rows(first.input(), fulmen, available)?;
    let single = AggregateExec::try_new(
        AggregateMode::Single,
        first.group_expr().clone(),
        first.aggr_expr().to_vec(),
        first.filter_expr().to_vec(),
        input,
        first.input_schema(),
    )?
    .with_limit_options(last.limit_options());
    if single.schema().fields() != last.schema().fields() {
        return Ok(None);
    }
    let single: Arc<dyn ExecutionPlan> = Arc::new(single);
    Ok(match decide(&single, fulmen, available) {
        Decision::Gpu(_) => Some((single, last.properties().output_partitioning().clone())),
        Decision::Cpu(..) | Decision::NotApplicable => None,
    })
}

/// How a rewritten node is given its new children: its properties computed again.
fn recompute() -> ReplaceChildrenOptions {
    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute)
}

/// `plan`'s partitions coalesced into one, under the filters (without a fetch) and
/// projections at its top that work row by row on the device, or only select columns (and
/// in place of a round-robin repartition there); a filter or projection left to the CPU
/// keeps its partitions, each on a core of its own.
fn coalesced_under_rows(
    plan: &Arc<dyn ExecutionPlan>,
    fulmen: &FulmenConfig,
    available: &Result<Arc<Vec<Device>>, String>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let selects_columns = plan
        .downcast_ref::<ProjectionExec>()
        .is_some_and(|p| p.expr().iter().all(|e| e.expr.is::<Column>()));
    let row_by_row = plan.is::<ProjectionExec>()
        || plan
            .downcast_ref::<FilterExec>()
            .is_some_and(|f| f.fetch().is_none());
    let on_device = || matches!(decide(plan, fulmen, available), Decision::Gpu(_));
    match plan.children().first() {
        Some(&child) if row_by_row && (selects_columns || on_device()) => {
            let child = coalesced_under_rows(child, fulmen, available)?;
            Arc::clone(plan).replace_children(vec![child], recompute())
        }
        _ => {
            // A round-robin repartition only spread the rows over the partial stage's
            // partitions: its input, coalesced where it has more than one.
            let spread = plan
                .downcast_ref::<RepartitionExec>()
                .filter(|r| matches!(r.partitioning(), Partitioning::RoundRobinBatch(_)));
            let plan = spread.map_or(plan, |r| r.input());
            Ok(match plan.output_partitioning().partition_count() {
                1 => Arc::clone(plan),
                _ => Arc::new(CoalescePartitionsExec::new(Arc::clone(plan))),
            })
        }
    }
}
