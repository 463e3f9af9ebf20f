//! Incremental windows: a windowed sink whose query aggregates over `TUMBLE` or `HOP` windows
//! keeps, per open window and group, the partial state of its aggregates (DataFusion's
//! accumulator states), adds each tick's new rows to it, and finishes a window's states only
//! when the watermark passes its end.
//!
//! Each tick's plan is split at the aggregation nearest the stream:
//!
//! ```text
//!  upper plan (HAVING, projection, ORDER BY …)          run over the states of the windows
//!        │                                              closing this tick
//!  Final aggregate  ◀── states of closing windows ◀─┐
//!                                                   │   states: one batch per tick,
//!  ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─│─  merged (PartialReduce) once they
//!  Partial aggregate ──▶ states of this tick's rows ─┘  outgrow the merged part
//!        │
//!  filters, projections, inner joins with ordinary tables
//!        │
//!  WindowExec (every window ending after the last emitted)
//!        │
//!  live table: the rows that arrived since the previous tick
//! ```
//!
//! So a tick's work follows the rows that arrived and the windows that close, not the rows
//! held, and the state is bounded by open windows × groups. A query that cannot be split
//! this way (`SESSION` windows, which merge as rows arrive; no aggregation over the window;
//! a limit, window function or outer join between the window and the aggregation; the stream
//! read twice) is run by re-reading its open windows each tick, and [`split`] says why.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use datafusion::arrow::compute::{cast, filter_record_batch, not};
use datafusion::arrow::datatypes::{DataType, Int64Type, TimeUnit};
use datafusion::common::JoinType;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, LimitOptions};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, SortMergeJoinExec,
};
use datafusion::physical_plan::{ExecutionPlan, collect};
use fulmen_engine::streaming::WindowKind;

/// How many state rows the unmerged part may reach (beside the merged part's size) before
/// the states are merged.
const MERGE_AT_LEAST: usize = 1024;

/// A tick's plan, split at the aggregation nearest the stream.
pub(crate) struct Split {
    /// The partial aggregate over the tick's new rows: its output is the group keys and the
    /// accumulators' states.
    pub lower: Arc<dyn ExecutionPlan>,
    partial: Arc<AggregateExec>,
    /// The whole plan, and its node that finishes the aggregate (replaced by a final
    /// aggregate over the states of closing windows).
    plan: Arc<dyn ExecutionPlan>,
    finish: Arc<dyn ExecutionPlan>,
    limit: Option<LimitOptions>,
    /// The group column of the partial output holding each state's window end (or start),
    /// and what is added to it to give the end, in the column's unit.
    end_column: usize,
    end_shift: i64,
}

/// Splits `plan` (one window function of `kind` over one live table), or says why not.
pub(crate) fn split(
    plan: Arc<dyn ExecutionPlan>,
    kind: WindowKind,
) -> std::result::Result<Split, String> {
    let size = match kind {
        WindowKind::Tumble { size } | WindowKind::Hop { size, .. } => size,
        WindowKind::Session { .. } => {
            return Err("SESSION windows grow and merge as rows arrive".into());
        }
    };
    let mut path = Vec::new();
    if !path_to_window(&plan, &mut path) {
        return Err("its plan has no window function".into());
    }
    // `path` runs from the root to the WindowExec; the aggregation nearest it is split.
    let Some(at) = path.iter().rposition(|p| aggregate(p).is_some()) else {
        return Err("it has no aggregation over its window".into());
    };
    for node in &path[at + 1..path.len() - 1] {
        passes_rows_through(node)?;
    }
    let lowest = aggregate(&path[at]).expect("found above");
    let (partial, finish) = match lowest.mode() {
        AggregateMode::Partial => {
            let finish = path[..at]
                .iter()
                .rev()
                .take_while(|p| aggregate(p).is_some() || is_exchange(p))
                .find(|p| {
                    aggregate(p).is_some_and(|a| {
                        matches!(
                            a.mode(),
                            AggregateMode::Final | AggregateMode::FinalPartitioned
                        )
                    })
                })
                .ok_or("its partial aggregate has no final aggregate above it")?;
            let partial = Arc::new(lowest.clone());
            (partial, Arc::clone(finish))
        }
        AggregateMode::Single | AggregateMode::SinglePartitioned => {
            let partial = AggregateExec::try_new(
                AggregateMode::Partial,
                lowest.group_expr().clone(),
                lowest.aggr_expr().to_vec(),
                lowest.filter_expr().to_vec(),
                Arc::clone(lowest.input()),
                lowest.input_schema(),
            )
            .map_err(|e| format!("its aggregate has no partial form: {e}"))?;
            (Arc::new(partial), Arc::clone(&path[at]))
        }
        other => return Err(format!("its aggregation nearest the window is {other:?}")),
    };
    let groups = partial.group_expr();
    if !groups.is_single() {
        return Err("it uses GROUPING SETS, CUBE or ROLLUP".into());
    }
    let named = |name: &str| {
        groups
            .expr()
            .iter()
            .position(|(e, _)| e.downcast_ref::<Column>().is_some_and(|c| c.name() == name))
    };
    let (end_column, end_shift) = match (named("window_end"), named("window_start")) {
        (Some(i), _) => (i, 0),
        (None, Some(i)) => {
            let unit = match partial.schema().field(i).data_type() {
                DataType::Timestamp(unit, _) => unit_nanos(*unit),
                _ => 1,
            };
            (i, size / unit)
        }
        (None, None) => {
            return Err("its aggregation does not group by window_end or window_start".into());
        }
    };
    if !matches!(
        partial.schema().field(end_column).data_type(),
        DataType::Timestamp(..)
    ) {
        return Err("its window column is not a timestamp".into());
    }
    let limit = aggregate(&finish).and_then(|a| a.limit_options());
    let split = Split {
        lower: Arc::clone(&partial) as Arc<dyn ExecutionPlan>,
        partial,
        plan,
        finish,
        limit,
        end_column,
        end_shift,
    };
    // Both plans the states go through must take them as they are.
    split
        .finished(Vec::new())
        .map_err(|e| format!("its final aggregate cannot take the states: {e}"))?;
    split
        .merger(Vec::new())
        .map_err(|e| format!("its states cannot be merged: {e}"))?;
    Ok(split)
}

impl Split {
    /// The whole plan, finishing the aggregate over `states` (those of the closing windows).
    pub fn finished(&self, states: Vec<RecordBatch>) -> Result<Arc<dyn ExecutionPlan>> {
        let memory = MemorySourceConfig::try_new_exec(&[states], self.partial.schema(), None)?;
        let n = self.partial.aggr_expr().len();
        let last = AggregateExec::try_new(
            AggregateMode::Final,
            self.partial.group_expr().as_final(),
            self.partial.aggr_expr().to_vec(),
            vec![None; n],
            memory,
            self.partial.input_schema(),
        )?
        .with_limit_options(self.limit);
        if last.schema().fields() != self.finish.schema().fields() {
            return Err(DataFusionError::Internal(format!(
                "final aggregate gives {:?}, the plan expects {:?}",
                last.schema(),
                self.finish.schema()
            )));
        }
        replace(&self.plan, &self.finish, Arc::new(last))
    }

    /// A plan merging `states` into one state per group (PartialReduce).
    fn merger(&self, states: Vec<RecordBatch>) -> Result<Arc<dyn ExecutionPlan>> {
        let memory = MemorySourceConfig::try_new_exec(&[states], self.partial.schema(), None)?;
        let n = self.partial.aggr_expr().len();
        let merge = AggregateExec::try_new(
            AggregateMode::PartialReduce,
            self.partial.group_expr().as_final(),
            self.partial.aggr_expr().to_vec(),
            vec![None; n],
            memory,
            self.partial.input_schema(),
        )?;
        if merge.schema().fields() != self.partial.schema().fields() {
            return Err(DataFusionError::Internal(format!(
                "merged states are {:?}, the states {:?}",
                merge.schema(),
                self.partial.schema()
            )));
        }
        Ok(Arc::new(merge))
    }
}

/// The partial states of a sink's open windows.
#[derive(Default)]
pub(crate) struct WindowStates {
    /// One state row per group per window, in `merged`, then one batch per tick since.
    merged: Vec<RecordBatch>,
    merged_rows: usize,
    recent: Vec<RecordBatch>,
    recent_rows: usize,
}

impl WindowStates {
    /// State rows held.
    pub fn rows(&self) -> usize {
        self.merged_rows + self.recent_rows
    }

    /// Adds a tick's states.
    pub fn add(&mut self, states: Vec<RecordBatch>) {
        let rows: usize = states.iter().map(|b| b.num_rows()).sum();
        self.recent
            .extend(states.into_iter().filter(|b| b.num_rows() > 0));
        self.recent_rows += rows;
    }

    /// Merges every state into one per group and window once the unmerged ones outgrow the
    /// merged, so that each state row is merged a bounded number of times on average.
    pub async fn merge_if_due(&mut self, split: &Split, task: Arc<TaskContext>) -> Result<()> {
        if self.recent_rows <= self.merged_rows.max(MERGE_AT_LEAST) {
            return Ok(());
        }
        // Kept as they are until the merge has succeeded (a failed tick loses no state).
        let all: Vec<RecordBatch> = self.merged.iter().chain(&self.recent).cloned().collect();
        let merged = collect(split.merger(all)?, task).await?;
        self.merged_rows = merged.iter().map(|b| b.num_rows()).sum();
        self.merged = merged;
        self.recent.clear();
        self.recent_rows = 0;
        Ok(())
    }

    /// The states of windows ending in `(after, up_to]` (nanoseconds), and what is left.
    pub fn closing(
        &self,
        split: &Split,
        after: Option<i64>,
        up_to: i64,
    ) -> Result<(Vec<RecordBatch>, WindowStates)> {
        let mut closing = Vec::new();
        let mut left = WindowStates::default();
        for (batch, merged) in self
            .merged
            .iter()
            .map(|b| (b, true))
            .chain(self.recent.iter().map(|b| (b, false)))
        {
            let ends = window_ends(batch, split)?;
            let mask: BooleanArray = ends
                .iter()
                .map(|end| Some(end.is_some_and(|e| after.is_none_or(|a| e > a) && e <= up_to)))
                .collect();
            if mask.true_count() > 0 {
                closing.push(filter_record_batch(batch, &mask)?);
            }
            let kept = filter_record_batch(batch, &not(&mask)?)?;
            if kept.num_rows() > 0 {
                let (batches, rows) = if merged {
                    (&mut left.merged, &mut left.merged_rows)
                } else {
                    (&mut left.recent, &mut left.recent_rows)
                };
                *rows += kept.num_rows();
                batches.push(kept);
            }
        }
        Ok((closing, left))
    }
}

/// Each state row's window end, in nanoseconds.
fn window_ends(batch: &RecordBatch, split: &Split) -> Result<Vec<Option<i64>>> {
    let column = batch.column(split.end_column);
    let DataType::Timestamp(unit, _) = column.data_type() else {
        return Err(DataFusionError::Internal(
            "window column is not a timestamp".into(),
        ));
    };
    let per = unit_nanos(*unit);
    let raw = cast(column, &DataType::Int64)?;
    Ok(raw
        .as_primitive::<Int64Type>()
        .iter()
        .map(|v| v.map(|v| v.saturating_add(split.end_shift).saturating_mul(per)))
        .collect())
}

fn unit_nanos(unit: TimeUnit) -> i64 {
    match unit {
        TimeUnit::Second => 1_000_000_000,
        TimeUnit::Millisecond => 1_000_000,
        TimeUnit::Microsecond => 1_000,
        TimeUnit::Nanosecond => 1,
    }
}

fn aggregate(plan: &Arc<dyn ExecutionPlan>) -> Option<&AggregateExec> {
    plan.downcast_ref::<AggregateExec>()
}

fn is_window(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.name() == "WindowExec"
}

/// Nodes that move batches between partitions without changing the rows.
fn is_exchange(plan: &Arc<dyn ExecutionPlan>) -> bool {
    matches!(
        plan.name(),
        "RepartitionExec" | "CoalescePartitionsExec" | "CoalesceBatchesExec"
    )
}

/// Pushes the path from `plan` to its one WindowExec onto `path`; false (with `path` as it
/// was) when there is none, or more than one.
fn path_to_window(plan: &Arc<dyn ExecutionPlan>, path: &mut Vec<Arc<dyn ExecutionPlan>>) -> bool {
    fn windows(plan: &Arc<dyn ExecutionPlan>) -> usize {
        usize::from(is_window(plan)) + plan.children().into_iter().map(windows).sum::<usize>()
    }
    if windows(plan) != 1 {
        return false;
    }
    let mut node = Arc::clone(plan);
    loop {
        path.push(Arc::clone(&node));
        if is_window(&node) {
            return true;
        }
        let next = node
            .children()
            .into_iter()
            .find(|c| windows(c) == 1)
            .map(Arc::clone);
        match next {
            Some(child) => node = child,
            None => return false,
        }
    }
}

/// Fails unless `node`, between the window and its aggregation, gives each input row's
/// output independently of the other rows of the stream: then the rows of a tick go through
/// it as they would inside the whole window.
fn passes_rows_through(node: &Arc<dyn ExecutionPlan>) -> std::result::Result<(), String> {
    let name = node.name();
    if is_exchange(node) || matches!(name, "ProjectionExec" | "FilterExec") {
        return Ok(());
    }
    let join_type = if let Some(j) = node.downcast_ref::<HashJoinExec>() {
        Some(*j.join_type())
    } else if let Some(j) = node.downcast_ref::<NestedLoopJoinExec>() {
        Some(*j.join_type())
    } else if let Some(j) = node.downcast_ref::<SortMergeJoinExec>() {
        Some(j.join_type())
    } else if node.downcast_ref::<CrossJoinExec>().is_some() {
        Some(JoinType::Inner)
    } else {
        None
    };
    match join_type {
        // An inner join of new rows with an ordinary table gives exactly the new joined
        // rows; the other side holds no live rows (the stream is read once).
        Some(JoinType::Inner) => Ok(()),
        Some(other) => Err(format!(
            "a {other} join lies between its window and its aggregation"
        )),
        None => Err(format!(
            "{name} lies between its window and its aggregation"
        )),
    }
}

/// `plan` with `target` (a node of it, by identity) replaced by `with`.
fn replace(
    plan: &Arc<dyn ExecutionPlan>,
    target: &Arc<dyn ExecutionPlan>,
    with: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    if Arc::ptr_eq(plan, target) {
        return Ok(with);
    }
    let children = plan.children();
    if children.is_empty() {
        return Ok(Arc::clone(plan));
    }
    let mut changed = false;
    let mut new = Vec::with_capacity(children.len());
    for child in children {
        let replaced = replace(child, target, Arc::clone(&with))?;
        changed |= !Arc::ptr_eq(&replaced, child);
        new.push(replaced);
    }
    if changed {
        Arc::clone(plan).replace_children(
            new,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    } else {
        Ok(Arc::clone(plan))
    }
}
