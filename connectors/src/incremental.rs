//! Incremental windows: a windowed sink whose query aggregates over `TUMBLE`, `HOP` or
//! `SESSION` windows keeps, per open window and group, the partial state of its aggregates
//! (DataFusion's accumulator states), adds each tick's new rows to it, and finishes a window's
//! states only when the watermark passes its end.
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
//! held, and the state is bounded by open windows × groups. `SESSION` windows grow and merge
//! as rows arrive: a tick's rows form sessions of their own, and whenever states arrive the
//! sessions of a key that meet are widened to their union and their states merged, before
//! the watermark decides which closed. A query that cannot be split this way (no
//! aggregation over the window, or one not grouping by the window's bounds; a limit, window
//! function or outer join between the window and the aggregation; the stream read twice) is
//! run by re-reading its open windows each tick, and [`split`] says why.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Int64Array, RecordBatch};
use datafusion::arrow::compute::{
    SortColumn, cast, concat_batches, filter_record_batch, lexsort_to_indices,
};
use datafusion::arrow::datatypes::{DataType, Int64Type, SchemaRef, TimeUnit};
use datafusion::arrow::row::{RowConverter, SortField};
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
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, collect};
use fulmen_engine::streaming::{StreamScope, WindowKind, hop_panes, session_key};

mod panes;

use panes::{Panes, bounds_only_grouped};

/// How many state rows the unmerged part may reach (beside the merged part's size) before
/// the states are merged.
const MERGE_AT_LEAST: usize = 1024;

/// The scope a tick's rows are planned in: they go to every window ending after the last one
/// emitted, and to every session they form (one ending before that may be a piece of a session
/// still open: a restart's replay spreads a session's rows over ticks).
pub(crate) fn tick_scope(kind: WindowKind, emitted_up_to: Option<i64>) -> StreamScope {
    match kind {
        WindowKind::Session { .. } => StreamScope::new(None, None),
        _ => StreamScope::new(emitted_up_to, None),
    }
}

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
    /// `SESSION` windows: where the states' sessions lie, to merge those that overlap.
    sessions: Option<Sessions>,
    /// `HOP` windows kept as panes: the states are those of panes, not of windows.
    panes: Option<Panes>,
}

/// Where a `SESSION` window's states keep their sessions: the group columns holding each
/// state's session start and end, and those holding the session key (if any).
struct Sessions {
    start_column: usize,
    key_columns: Vec<usize>,
}

/// Splits `plan` (one window function of `kind` over one live table), or says why not.
pub(crate) fn split(
    plan: Arc<dyn ExecutionPlan>,
    kind: WindowKind,
) -> std::result::Result<Split, String> {
    let Some(path) = path_to_window(&plan) else {
        return Err("its plan has not exactly one window function".into());
    };
    let window = &path[path.len() - 1];
    let (size, session_key) = match kind {
        WindowKind::Tumble { size } | WindowKind::Hop { size, .. } => (size, None),
        WindowKind::Session { .. } => (0, session_key(window)),
    };
    // `path` runs from the root to the WindowExec; the aggregation nearest it is split.
    let Some(at) = path.iter().rposition(|p| aggregate(p).is_some()) else {
        return Err("it has no aggregation over its window".into());
    };
    for node in &path[at + 1..path.len() - 1] {
        passes_rows_through(node)?;
    }
    // Below the window too (a window over a view): a tick's rows must go through as they
    // would among all the window's rows.
    rows_go_through_below(window)?;
    let lowest = aggregate(&path[at]).expect("found above");
    if lowest.mode() == &AggregateMode::Partial && lowest.limit_options().is_some() {
        return Err("its aggregation nearest the window keeps only some groups (a limit)".into());
    }
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
    let sessions = match kind {
        WindowKind::Session { .. } => {
            // A session grows and merges with others as rows arrive: its states carry both
            // bounds, and its key, so that the states of sessions that meet can be merged.
            let (Some(_), Some(start_column)) = (named("window_end"), named("window_start")) else {
                return Err(
                    "its aggregation over SESSION windows does not group by both window_start \
                     and window_end"
                        .into(),
                );
            };
            let key_columns = match &session_key {
                Some(key) => vec![named(key).ok_or_else(|| {
                    format!("its aggregation does not group by the session key '{key}'")
                })?],
                None => Vec::new(),
            };
            Some(Sessions {
                start_column,
                key_columns,
            })
        }
        _ => None,
    };
    // The group column holding each state's window end, or else its start.
    let Some(end_column) = named("window_end").or_else(|| named("window_start")) else {
        return Err("its aggregation does not group by window_end or window_start".into());
    };
    let unit = match partial.schema().field(end_column).data_type() {
        DataType::Timestamp(unit, _) => unit_nanos(*unit),
        _ => return Err("its window column is not a timestamp".into()),
    };
    let limit = aggregate(&finish).and_then(|a| a.limit_options());
    let mut lower = Arc::clone(&partial) as Arc<dyn ExecutionPlan>;
    // How far a state's end lies past its start: a window's, or a pane's.
    let mut length = size;
    let mut panes = None;
    if let (WindowKind::Hop { slide, size }, Some((pane_plan, pane))) = (kind, hop_panes(window))
        && limit.is_none()
        && bounds_only_grouped(&path[at + 1..path.len() - 1], &partial)
    {
        lower = replace(&lower, window, pane_plan)
            .map_err(|e| format!("its window cannot be cut into panes: {e}"))?;
        length = pane;
        panes = Some(Panes {
            slide,
            size,
            pane,
            start_column: named("window_start"),
            end_column: named("window_end"),
            unit,
        });
    }
    let end_shift = match named("window_end") {
        Some(_) => 0,
        None => length / unit,
    };
    let split = Split {
        lower,
        partial,
        plan,
        finish,
        limit,
        end_column,
        end_shift,
        sessions,
        panes,
    };
    Ok(split)
}

impl Split {
    /// `HOP` windows kept as panes: the pane's length (nanoseconds).
    pub fn pane(&self) -> Option<i64> {
        self.panes.as_ref().map(|p| p.pane)
    }

    /// Whether states must be merged before windows close (`SESSION` windows: sessions that
    /// meet become one), rather than only to keep the open windows' states small.
    pub fn merges_before_closing(&self) -> bool {
        self.sessions.is_some()
    }

    /// Whether both plans the states go through take them as they are (checked once, when
    /// the sink starts: every tick's plan has the same shape).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.finished(Closing::States(Vec::new()))
            .map_err(|e| format!("its final aggregate cannot take the states: {e}"))?;
        if let Some(panes) = &self.panes {
            panes
                .finish(self, &[], None, 0)
                .map_err(|e| format!("its panes cannot be finished: {e}"))?;
        }
        self.merger(Vec::new())
            .map_err(|e| format!("its states cannot be merged: {e}"))?;
        Ok(())
    }

    /// The whole plan, finishing the closing windows.
    pub fn finished(&self, closing: Closing) -> Result<Arc<dyn ExecutionPlan>> {
        let states = match closing {
            Closing::States(states) => states,
            Closing::Finished(rows) => {
                let memory = MemorySourceConfig::try_new_exec(&[rows], self.finish.schema(), None)?;
                return replace(&self.plan, &self.finish, memory);
            }
        };
        let last = self
            .over_states(AggregateMode::Final, states, &self.finish.schema())?
            .with_limit_options(self.limit);
        replace(&self.plan, &self.finish, Arc::new(last))
    }

    /// A plan merging `states` into one state per group (PartialReduce).
    fn merger(&self, states: Vec<RecordBatch>) -> Result<Arc<dyn ExecutionPlan>> {
        let schema = self.partial.schema();
        Ok(Arc::new(self.over_states(
            AggregateMode::PartialReduce,
            states,
            &schema,
        )?))
    }

    /// An aggregate in `mode` over `states`, which must give `expected`'s columns.
    fn over_states(
        &self,
        mode: AggregateMode,
        states: Vec<RecordBatch>,
        expected: &SchemaRef,
    ) -> Result<AggregateExec> {
        let memory = MemorySourceConfig::try_new_exec(&[states], self.partial.schema(), None)?;
        let n = self.partial.aggr_expr().len();
        let aggregate = AggregateExec::try_new(
            mode,
            self.partial.group_expr().as_final(),
            self.partial.aggr_expr().to_vec(),
            vec![None; n],
            memory,
            self.partial.input_schema(),
        )?;
        if aggregate.schema().fields() != expected.fields() {
            return Err(DataFusionError::Internal(format!(
                "the {mode:?} aggregate over the states gives {:?}, not {expected:?}",
                aggregate.schema()
            )));
        }
        Ok(aggregate)
    }
}

/// What a tick's closing windows are finished from.
pub(crate) enum Closing {
    /// Their states, for the final aggregate.
    States(Vec<RecordBatch>),
    /// The final aggregate's output itself (`HOP` windows kept as panes).
    Finished(Vec<RecordBatch>),
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
    /// The earliest end of a window held (nanoseconds): when the watermark reaches it, a
    /// window can close.
    /// Windows ending at or before `after` were emitted.
    pub fn earliest_end(&self, split: &Split, after: Option<i64>) -> Result<Option<i64>> {
        earliest_end(self.merged.iter().chain(&self.recent), split, after)
    }

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
    /// Sessions are merged whenever states arrive: a session's state may have to join
    /// another's before the watermark decides whether it closed.
    pub async fn merge_if_due(&mut self, split: &Split, task: Arc<TaskContext>) -> Result<()> {
        let due = match split.sessions {
            Some(_) => self.recent_rows > 0,
            None => self.recent_rows > self.merged_rows.max(MERGE_AT_LEAST),
        };
        if !due {
            return Ok(());
        }
        // Kept as they are until the merge has succeeded (a failed tick loses no state).
        let mut all: Vec<RecordBatch> = self.merged.iter().chain(&self.recent).cloned().collect();
        if let Some(sessions) = &split.sessions {
            all = vec![sessions.widen(&all, split)?];
        }
        let merged = collect(split.merger(all)?, task).await?;
        self.merged_rows = merged.iter().map(|b| b.num_rows()).sum();
        self.merged = merged;
        self.recent.clear();
        self.recent_rows = 0;
        Ok(())
    }

    /// The states of windows ending in `(after, up_to]` (nanoseconds), and those of windows
    /// still open. States of windows ending at or before `after` were emitted already (a
    /// restart's replay rebuilds pieces of them) and are dropped.
    pub fn closing(
        &self,
        split: &Split,
        after: Option<i64>,
        up_to: i64,
    ) -> Result<(Closing, WindowStates)> {
        let mut closing = Vec::new();
        let mut left = WindowStates::default();
        if let Some(panes) = &split.panes {
            for (batch, merged) in self.batches() {
                let (closes, open) = panes.closing_and_open(batch, split, after, up_to)?;
                let closes = BooleanArray::from(closes);
                if closes.true_count() > 0 {
                    closing.push(filter_record_batch(batch, &closes)?);
                }
                left.keep(
                    filter_record_batch(batch, &BooleanArray::from(open))?,
                    merged,
                );
            }
            let finished = panes.finish(split, &closing, after, up_to)?;
            return Ok((Closing::Finished(finished), left));
        }
        for (batch, merged) in self.batches() {
            let ends = window_ends(batch, split)?;
            let mask: BooleanArray = ends
                .iter()
                .map(|end| Some(end.is_some_and(|e| after.is_none_or(|a| e > a) && e <= up_to)))
                .collect();
            if mask.true_count() > 0 {
                closing.push(filter_record_batch(batch, &mask)?);
            }
            let open: BooleanArray = ends
                .iter()
                .map(|end| Some(end.is_some_and(|e| e > up_to)))
                .collect();
            left.keep(filter_record_batch(batch, &open)?, merged);
        }
        Ok((Closing::States(closing), left))
    }

    /// Every batch of states, and whether it is among the merged ones.
    fn batches(&self) -> impl Iterator<Item = (&RecordBatch, bool)> {
        self.merged
            .iter()
            .map(|b| (b, true))
            .chain(self.recent.iter().map(|b| (b, false)))
    }

    /// Keeps `states` among the merged ones or the recent ones.
    fn keep(&mut self, states: RecordBatch, merged: bool) {
        if states.num_rows() == 0 {
            return;
        }
        let (batches, rows) = if merged {
            (&mut self.merged, &mut self.merged_rows)
        } else {
            (&mut self.recent, &mut self.recent_rows)
        };
        *rows += states.num_rows();
        batches.push(states);
    }
}

impl WindowStates {
    /// `SESSION` windows: the earliest start of a session held (nanoseconds).
    pub fn earliest_start(&self, split: &Split) -> Result<Option<i64>> {
        let Some(sessions) = &split.sessions else {
            return Ok(None);
        };
        let mut earliest = None;
        for batch in self.merged.iter().chain(&self.recent) {
            let column = batch.column(sessions.start_column);
            for start in nanos(column, 0)?.into_iter().flatten() {
                earliest = Some(earliest.map_or(start, |e: i64| e.min(start)));
            }
        }
        Ok(earliest)
    }
}

impl Sessions {
    /// `states` as one batch, each session widened to the union of the sessions of its key
    /// that meet it. A row closer than the gap to a session joins it, and a session ends
    /// a gap after its last row, so two sessions of a key meet when one starts before the
    /// other ends; merging the states of those that meet gives the sessions of all their
    /// rows together.
    fn widen(&self, states: &[RecordBatch], split: &Split) -> Result<RecordBatch> {
        let schema = split.partial.schema();
        let batch = concat_batches(&schema, states)?;
        let start_column = batch.column(self.start_column);
        let end_column = batch.column(split.end_column);
        let raw = |column: &ArrayRef| -> Result<Vec<i64>> {
            let values = cast(column, &DataType::Int64)?;
            Ok(values.as_primitive::<Int64Type>().values().to_vec())
        };
        let (starts, ends) = (raw(start_column)?, raw(end_column)?);
        let keys: Vec<ArrayRef> = self
            .key_columns
            .iter()
            .map(|&k| Arc::clone(batch.column(k)))
            .collect();
        let mut order: Vec<SortColumn> = keys
            .iter()
            .map(|k| SortColumn {
                values: Arc::clone(k),
                options: None,
            })
            .collect();
        order.push(SortColumn {
            values: Arc::clone(start_column),
            options: None,
        });
        let order = lexsort_to_indices(&order, None)?;
        let rows = if keys.is_empty() {
            None
        } else {
            let fields = keys
                .iter()
                .map(|k| SortField::new(k.data_type().clone()))
                .collect();
            Some(RowConverter::new(fields)?.convert_columns(&keys)?)
        };
        let (mut new_starts, mut new_ends) = (starts.clone(), ends.clone());
        let mut run: Vec<usize> = Vec::new();
        let (mut run_start, mut run_end) = (0, 0);
        let mut previous: Option<usize> = None;
        for row in order.values().iter().map(|&r| r as usize) {
            let same_key = match (&rows, previous) {
                (_, None) => false,
                (None, Some(_)) => true,
                (Some(rows), Some(p)) => rows.row(row) == rows.row(p),
            };
            if same_key && starts[row] < run_end {
                run_end = run_end.max(ends[row]);
            } else {
                for r in run.drain(..) {
                    (new_starts[r], new_ends[r]) = (run_start, run_end);
                }
                (run_start, run_end) = (starts[row], ends[row]);
            }
            run.push(row);
            previous = Some(row);
        }
        for r in run {
            (new_starts[r], new_ends[r]) = (run_start, run_end);
        }
        let mut columns = batch.columns().to_vec();
        for (index, values) in [
            (self.start_column, new_starts),
            (split.end_column, new_ends),
        ] {
            let array: ArrayRef = Arc::new(Int64Array::from(values));
            columns[index] = cast(&array, batch.column(index).data_type())?;
        }
        Ok(RecordBatch::try_new(schema, columns)?)
    }
}

/// The earliest window end (nanoseconds) of `states`. A pane's windows ending at or before
/// `after` were emitted and do not count.
pub(crate) fn earliest_end<'a>(
    states: impl IntoIterator<Item = &'a RecordBatch>,
    split: &Split,
    after: Option<i64>,
) -> Result<Option<i64>> {
    let mut earliest: Option<i64> = None;
    for batch in states {
        let ends = window_ends(batch, split)?.into_iter().flatten();
        let ends: Box<dyn Iterator<Item = i64>> = match &split.panes {
            Some(panes) => Box::new(ends.filter_map(|end| {
                panes
                    .windows(end, after)
                    .map(|(first, _)| first + panes.size)
            })),
            None => Box::new(ends),
        };
        if let Some(end) = ends.min() {
            earliest = Some(earliest.map_or(end, |e| e.min(end)));
        }
    }
    Ok(earliest)
}

/// Each state row's window end, in nanoseconds.
fn window_ends(batch: &RecordBatch, split: &Split) -> Result<Vec<Option<i64>>> {
    let column = batch.column(split.end_column);
    nanos(column, split.end_shift)
}

/// A window column's values plus `shift` (in its unit), in nanoseconds.
fn nanos(column: &ArrayRef, shift: i64) -> Result<Vec<Option<i64>>> {
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
        .map(|v| v.map(|v| v.saturating_add(shift).saturating_mul(per)))
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

pub(crate) fn is_window(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.name() == "WindowExec"
}

/// Nodes that move batches between partitions without changing the rows.
fn is_exchange(plan: &Arc<dyn ExecutionPlan>) -> bool {
    matches!(
        plan.name(),
        "RepartitionExec" | "CoalescePartitionsExec" | "CoalesceBatchesExec"
    )
}

/// The path from `plan` to its one WindowExec (`None` when it has none, or more than one).
fn path_to_window(plan: &Arc<dyn ExecutionPlan>) -> Option<Vec<Arc<dyn ExecutionPlan>>> {
    fn walk(
        node: &Arc<dyn ExecutionPlan>,
        path: &mut Vec<Arc<dyn ExecutionPlan>>,
        found: &mut Vec<Vec<Arc<dyn ExecutionPlan>>>,
    ) {
        path.push(Arc::clone(node));
        if is_window(node) {
            found.push(path.clone());
        }
        for child in node.children() {
            walk(child, path, found);
        }
        path.pop();
    }
    let mut found = Vec::new();
    walk(plan, &mut Vec::new(), &mut found);
    if found.len() == 1 { found.pop() } else { None }
}

/// Fails unless `node`, between the live table and the window or between the window and its
/// aggregation, gives each input row's output independently of the other rows of the stream
/// (and does not rename the window's bounds): then the rows of a tick go through it as they
/// would among all the window's rows.
fn passes_rows_through(node: &Arc<dyn ExecutionPlan>) -> std::result::Result<(), String> {
    let name = node.name();
    if node.fetch().is_some() {
        return Err(format!(
            "{name} with a limit lies between the stream and its aggregation"
        ));
    }
    // The window's bounds are found by name: nothing on the way may give that name to
    // anything else.
    for bound in ["window_start", "window_end"] {
        let named = node
            .schema()
            .fields()
            .iter()
            .filter(|f| f.name() == bound)
            .count();
        let renamed = node.downcast_ref::<ProjectionExec>().is_some_and(|p| {
            p.expr().iter().any(|e| {
                e.alias == bound
                    && e.expr
                        .downcast_ref::<Column>()
                        .is_none_or(|c| c.name() != bound)
            })
        });
        if named > 1 || renamed {
            return Err(format!(
                "{name} between the stream and its aggregation makes another column {bound}"
            ));
        }
    }
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
            "a {other} join lies between the stream and its aggregation"
        )),
        None => Err(format!(
            "{name} lies between the stream and its aggregation"
        )),
    }
}

/// [`passes_rows_through`] for every node below `plan` but the leaves.
fn rows_go_through_below(plan: &Arc<dyn ExecutionPlan>) -> std::result::Result<(), String> {
    for child in plan.children() {
        if !child.children().is_empty() {
            passes_rows_through(child)?;
        }
        rows_go_through_below(child)?;
    }
    Ok(())
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

#[cfg(test)]
mod tests;
