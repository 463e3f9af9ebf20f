//! The physical side of the window table functions: `WindowExec`, which assigns each input
//! row its windows, and the helpers that inspect or rebuild one inside a plan.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch, UInt32Array};
use datafusion::arrow::compute::{SortColumn, SortOptions};
use datafusion::arrow::compute::{concat_batches, lexsort_to_indices, take_record_batch};
use datafusion::arrow::datatypes::{
    DataType, Field, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType,
    TimestampMillisecondType, TimestampNanosecondType, TimestampSecondType,
};
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_datafusion_err, plan_err};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::Distribution;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::StreamExt;
use futures::TryStreamExt;

use super::WindowKind;

fn window_properties(
    input: &Arc<dyn ExecutionPlan>,
    schema: &SchemaRef,
    kind: WindowKind,
) -> Arc<PlanProperties> {
    let emission = match kind {
        WindowKind::Session { .. } => EmissionType::Final,
        _ => EmissionType::Incremental,
    };
    Arc::new(PlanProperties::new(
        EquivalenceProperties::new(Arc::clone(schema)),
        Partitioning::UnknownPartitioning(
            input.properties().output_partitioning().partition_count(),
        ),
        emission,
        Boundedness::Bounded,
    ))
}

/// The key column's name of a `SESSION(t, time_col, gap, key_col)` node of a plan: `None` for
/// any other node, and for a session without a key.
pub fn session_key(plan: &Arc<dyn ExecutionPlan>) -> Option<String> {
    let window = plan.downcast_ref::<WindowExec>()?;
    let key = window.key_index?;
    Some(window.input.schema().field(key).name().clone())
}

/// Where the output columns of a `TUMBLE` or `HOP` node of a plan come from: each one's
/// position among its input's columns followed by `window_start` and `window_end` (so a
/// position past the input's columns is a window bound). `None` for any other node, sessions
/// included (a row's session depends on the other rows of its key, so nothing that drops rows
/// may move below one).
pub fn fixed_window_columns(plan: &Arc<dyn ExecutionPlan>) -> Option<Vec<usize>> {
    let window = plan
        .downcast_ref::<WindowExec>()
        .filter(|w| !matches!(w.kind, WindowKind::Session { .. }))?;
    Some(match &window.projection {
        Some(p) => p.clone(),
        None => (0..window.full_schema.fields().len()).collect(),
    })
}

/// The windows of `plan` (a `TUMBLE` or `HOP` node, see [`fixed_window_columns`]) assigned to
/// the rows of `input`, whose columns from `offset` on are those of `plan`'s input (say, a
/// join of an ordinary table with it). Its output: `input`'s columns, then `window_start` and
/// `window_end`. A row lies in the same windows wherever it goes, so windowing the rows of
/// such a join gives the rows the join of the windowed rows would.
pub fn fixed_window_over(
    plan: &Arc<dyn ExecutionPlan>,
    input: Arc<dyn ExecutionPlan>,
    offset: usize,
) -> Result<Arc<dyn ExecutionPlan>> {
    let window = plan
        .downcast_ref::<WindowExec>()
        .filter(|w| !matches!(w.kind, WindowKind::Session { .. }))
        .ok_or_else(|| internal_datafusion_err!("{} is not a TUMBLE or HOP node", plan.name()))?;
    let own = window.input.schema();
    let schema = input.schema();
    for (i, field) in own.fields().iter().enumerate() {
        let moved = schema.fields().get(offset + i);
        if moved.is_none_or(|m| m.data_type() != field.data_type()) {
            return Err(internal_datafusion_err!(
                "column {} of the new input is not the window's column {}",
                offset + i,
                field.name()
            ));
        }
    }
    let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    for bound in &window.full_schema.fields()[own.fields().len()..] {
        if schema.column_with_name(bound.name()).is_some() {
            return plan_err!(
                "the window's input already has a column named {}",
                bound.name()
            );
        }
        fields.push(bound.as_ref().clone());
    }
    let full_schema = Arc::new(Schema::new(fields));
    Ok(Arc::new(WindowExec::new(
        input,
        (
            offset + window.time_index,
            window.key_index.map(|k| offset + k),
        ),
        (window.kind, window.nanos_kind),
        window.range,
        None,
        full_schema,
    )?))
}

/// A `HOP` node of a plan as panes: a `TUMBLE` of the slide and size's greatest common
/// divisor over the same input, giving the same columns, with every pane emitted. A hopping
/// window is the union of the `size / pane` panes it spans, so an aggregate whose states
/// merge (all of DataFusion's) can be kept per pane and finished per window: each row is then
/// aggregated once, not once per window holding it. `None` for any other node, and for a
/// `HOP` whose windows do not overlap. The pane's length (nanoseconds) comes with it.
pub fn hop_panes(plan: &Arc<dyn ExecutionPlan>) -> Option<(Arc<dyn ExecutionPlan>, i64)> {
    let window = plan.downcast_ref::<WindowExec>()?;
    let (
        WindowKind::Hop { slide, size },
        WindowKind::Hop {
            slide: slide_ns,
            size: size_ns,
        },
    ) = (window.kind, window.nanos_kind)
    else {
        return None;
    };
    if size <= slide {
        return None;
    }
    let pane = gcd(slide, size);
    let per = slide_ns / slide;
    let kind = WindowKind::Tumble { size: pane };
    debug_assert_eq!(size_ns / size, per);
    let panes = WindowExec::new(
        Arc::clone(&window.input),
        (window.time_index, None),
        (kind, WindowKind::Tumble { size: pane * per }),
        (None, None),
        window.projection.clone(),
        Arc::clone(&window.full_schema),
    )
    .ok()?;
    Some((Arc::new(panes), pane * per))
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Assigns windows to its input's rows (see the module documentation).
#[derive(Debug)]
pub(super) struct WindowExec {
    input: Arc<dyn ExecutionPlan>,
    time_index: usize,
    key_index: Option<usize>,
    /// Lengths in the time column's unit.
    kind: WindowKind,
    nanos_kind: WindowKind,
    /// Emit only windows ending in `(after, up_to]` (time column units).
    range: (Option<i64>, Option<i64>),
    projection: Option<Vec<usize>>,
    full_schema: SchemaRef,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
}

impl WindowExec {
    /// Windows of `kinds` (in the time column's unit, and in nanoseconds) over `input`, whose
    /// time column and session key are at `(time_index, key_index)`; it gives `full_schema`'s
    /// columns (the input's, then the window's bounds), or those in `projection`.
    pub(super) fn new(
        input: Arc<dyn ExecutionPlan>,
        (time_index, key_index): (usize, Option<usize>),
        (kind, nanos_kind): (WindowKind, WindowKind),
        range: (Option<i64>, Option<i64>),
        projection: Option<Vec<usize>>,
        full_schema: SchemaRef,
    ) -> Result<Self> {
        let schema = match &projection {
            Some(p) => Arc::new(full_schema.project(p)?),
            None => Arc::clone(&full_schema),
        };
        Ok(Self {
            properties: window_properties(&input, &schema, kind),
            input,
            time_index,
            key_index,
            kind,
            nanos_kind,
            range,
            projection,
            full_schema,
            schema,
        })
    }
}

impl DisplayAs for WindowExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let ns = |v: i64| format!("{}ms", v / 1_000_000);
        match self.nanos_kind {
            WindowKind::Tumble { size } => write!(f, "WindowExec: tumble size={}", ns(size))?,
            WindowKind::Hop { slide, size } => {
                write!(f, "WindowExec: hop slide={} size={}", ns(slide), ns(size))?
            }
            WindowKind::Session { gap } => write!(f, "WindowExec: session gap={}", ns(gap))?,
        }
        if self.range != (None, None) {
            write!(
                f,
                ", emits windows ending in ({:?}, {:?}]",
                self.range.0, self.range.1
            )?;
        }
        Ok(())
    }
}

impl ExecutionPlan for WindowExec {
    fn name(&self) -> &str {
        "WindowExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    /// Sessions need every row of a key in one partition (all rows, without a key).
    fn required_input_distribution(&self) -> Vec<Distribution> {
        match (self.kind, self.key_index) {
            (WindowKind::Session { .. }, Some(key)) => {
                let name = self.input.schema().field(key).name().clone();
                vec![Distribution::KeyPartitioned(vec![Arc::new(Column::new(
                    &name, key,
                ))])]
            }
            (WindowKind::Session { .. }, None) => vec![Distribution::SinglePartition],
            _ => vec![Distribution::UnspecifiedDistribution],
        }
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = children
            .pop()
            .filter(|_| children.is_empty())
            .ok_or_else(|| internal_datafusion_err!("WindowExec has one child"))?;
        Ok(Arc::new(WindowExec::new(
            input,
            (self.time_index, self.key_index),
            (self.kind, self.nanos_kind),
            self.range,
            self.projection.clone(),
            Arc::clone(&self.full_schema),
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let assign = Assign {
            time_index: self.time_index,
            key_index: self.key_index,
            kind: self.kind,
            range: self.range,
            projection: self.projection.clone(),
            full_schema: Arc::clone(&self.full_schema),
        };
        let stream: SendableRecordBatchStream = match self.kind {
            WindowKind::Session { gap } => {
                let input_schema = input.schema();
                let all = input.try_collect::<Vec<_>>();
                let stream = futures::stream::once(async move {
                    let batches = all.await?;
                    let batch = concat_batches(&input_schema, &batches)?;
                    assign.sessions(&batch, gap)
                });
                Box::pin(RecordBatchStreamAdapter::new(
                    Arc::clone(&self.schema),
                    stream,
                ))
            }
            _ => {
                let stream = input.map(move |batch| assign.fixed(&batch?));
                Box::pin(RecordBatchStreamAdapter::new(
                    Arc::clone(&self.schema),
                    stream,
                ))
            }
        };
        Ok(stream)
    }
}

struct Assign {
    time_index: usize,
    key_index: Option<usize>,
    kind: WindowKind,
    range: (Option<i64>, Option<i64>),
    projection: Option<Vec<usize>>,
    full_schema: SchemaRef,
}

impl Assign {
    fn emits(&self, end: i64) -> bool {
        self.range.0.is_none_or(|after| end > after) && self.range.1.is_none_or(|up| end <= up)
    }

    /// Tumbling and hopping windows: each row, once per window holding it.
    fn fixed(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let times = timestamps(batch.column(self.time_index))?;
        let (slide, size) = match self.kind {
            WindowKind::Tumble { size } => (size, size),
            WindowKind::Hop { slide, size } => (slide, size),
            WindowKind::Session { .. } => unreachable!("sessions are assigned by sessions()"),
        };
        let mut rows = Vec::with_capacity(times.len());
        let mut starts = Vec::with_capacity(times.len());
        for (row, t) in times.iter().enumerate() {
            let Some(t) = *t else { continue };
            let mut start = t.div_euclid(slide) * slide;
            while start > t.saturating_sub(size) {
                let end = start.saturating_add(size);
                if self.emits(end) {
                    rows.push(row as u32);
                    starts.push(start);
                }
                start -= slide;
            }
        }
        self.finish(
            batch,
            rows,
            starts.iter().map(|&s| (s, s.saturating_add(size))),
        )
    }

    /// Session windows over the whole input (per key when there is one).
    fn sessions(&self, batch: &RecordBatch, gap: i64) -> Result<RecordBatch> {
        let time = batch.column(self.time_index);
        let mut sort = Vec::new();
        let keys = match self.key_index {
            Some(k) => {
                sort.push(SortColumn {
                    values: Arc::clone(batch.column(k)),
                    options: None,
                });
                let converter =
                    RowConverter::new(vec![SortField::new(batch.column(k).data_type().clone())])?;
                Some(converter.convert_columns(&[Arc::clone(batch.column(k))])?)
            }
            None => None,
        };
        sort.push(SortColumn {
            values: Arc::clone(time),
            options: Some(SortOptions::default()),
        });
        let order = lexsort_to_indices(&sort, None)?;
        let times = timestamps(time)?;
        // Runs of rows in time order that form one session: (first, last) positions in `order`.
        let mut sessions: Vec<(usize, usize)> = Vec::new();
        let mut prev: Option<(usize, i64)> = None;
        for (pos, row) in order.values().iter().enumerate() {
            let row = *row as usize;
            let Some(t) = times[row] else { continue };
            let same_key = match (&keys, prev) {
                (Some(k), Some((p, _))) => k.row(row) == k.row(order.value(p) as usize),
                _ => true,
            };
            match (prev, sessions.last_mut()) {
                (Some((_, last_t)), Some(session)) if same_key && t - last_t < gap => {
                    session.1 = pos;
                }
                _ => sessions.push((pos, pos)),
            }
            prev = Some((pos, t));
        }
        let mut rows = Vec::new();
        let mut bounds = Vec::new();
        for (first, last) in sessions {
            let start = times[order.value(first) as usize].unwrap_or_default();
            let end = times[order.value(last) as usize]
                .unwrap_or_default()
                .saturating_add(gap);
            if !self.emits(end) {
                continue;
            }
            for pos in first..=last {
                let row = order.value(pos);
                if times[row as usize].is_some() {
                    rows.push(row);
                    bounds.push((start, end));
                }
            }
        }
        self.finish(batch, rows, bounds.into_iter())
    }

    fn finish(
        &self,
        batch: &RecordBatch,
        rows: Vec<u32>,
        bounds: impl Iterator<Item = (i64, i64)>,
    ) -> Result<RecordBatch> {
        let indices = UInt32Array::from(rows);
        let taken = take_record_batch(batch, &indices)?;
        let (starts, ends): (Vec<i64>, Vec<i64>) = bounds.unzip();
        let time_type = batch.column(self.time_index).data_type();
        let mut columns: Vec<ArrayRef> = taken.columns().to_vec();
        for values in [starts, ends] {
            let array: ArrayRef = Arc::new(Int64Array::from(values));
            columns.push(datafusion::arrow::compute::cast(&array, time_type)?);
        }
        let full = RecordBatch::try_new(Arc::clone(&self.full_schema), columns)?;
        match &self.projection {
            Some(p) => Ok(full.project(p)?),
            None => Ok(full),
        }
    }
}

/// A timestamp column's values in its own unit.
fn timestamps(array: &ArrayRef) -> Result<Vec<Option<i64>>> {
    let values: Vec<Option<i64>> = match array.data_type() {
        DataType::Timestamp(TimeUnit::Second, _) => {
            array.as_primitive::<TimestampSecondType>().iter().collect()
        }
        DataType::Timestamp(TimeUnit::Millisecond, _) => array
            .as_primitive::<TimestampMillisecondType>()
            .iter()
            .collect(),
        DataType::Timestamp(TimeUnit::Microsecond, _) => array
            .as_primitive::<TimestampMicrosecondType>()
            .iter()
            .collect(),
        DataType::Timestamp(TimeUnit::Nanosecond, _) => array
            .as_primitive::<TimestampNanosecondType>()
            .iter()
            .collect(),
        other => {
            return Err(DataFusionError::Execution(format!(
                "window time column is {other}, not a timestamp"
            )));
        }
    };
    Ok(values)
}
