//! `GpuHashJoinExec`: DataFusion's `HashJoinExec` with its matching on a GPU.
//!
//! The build side (left) is collected once, its key columns are uploaded to the partition's
//! device and a [`JoinTable`] is built there. Probe batches (right, coalesced to
//! `fulmen.gpu.batch_bytes` or `_rows`, see `coalesce.rs`) upload their keys; the device
//! hashes them, finds candidate pairs in the table, keeps the pairs whose keys are equal and
//! returns them in probe order. The host then applies the residual filter (DataFusion's
//! expression, when the join has one) and gathers the output columns with Arrow's `take`,
//! per join type:
//!
//! ```text
//!   left (all) ─▶ upload keys ─▶ JoinTable::build
//!   right batch ─▶ upload keys ─▶ hash ─▶ probe ─▶ verify keys ─▶ pairs ─▶ (filter) ─▶ take
//!   right ends ─▶ build rows never matched (left, full, left anti) or matched (left semi)
//!   device error ─▶ that batch (or, for the build, the whole partition) is matched on the
//!                   host instead, with the same rules
//! ```
//!
//! Inner, left, right, full, left/right semi and left/right anti joins, on one or more
//! column keys, with NULL keys matching nothing (or, with `NullEqualsNull`, each other), in
//! CollectLeft (the build side shared by all probe partitions: the last partition to finish
//! emits the unmatched build rows) and Partitioned modes.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, RecordBatch, RecordBatchOptions, UInt32Array,
};
use datafusion::arrow::compute::{concat_batches, take};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::ScalarValue;
use datafusion::common::{JoinSide, JoinType, NullEquality, internal_datafusion_err};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::{Accumulator, Operator};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, DynamicFilterPhysicalExpr, lit};
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, Label, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties,
};
use fulmen_kernels::ops::gather;
use fulmen_kernels::ops::join::{JoinTable, Matches};
use fulmen_kernels::{Device, DeviceBuffer, DeviceColumn, KernelError};
use futures::StreamExt;

use super::coalesce::{BatchLimit, Coalescer, PartlyUploaded};
use super::gpu_stream::{
    BatchOn, Chunk, ChunkStream, Col, DeviceResident, GpuMetrics, OperatorKind, Output, Redo,
    count_batch, count_operator, device_for, input_chunks,
};
use crate::gpu::compile::Reason;

/// What a `GpuHashJoinExec` needs to know of its join.
#[derive(Debug)]
pub struct JoinWork {
    left_keys: Vec<usize>,
    right_keys: Vec<usize>,
    join_type: JoinType,
    mode: PartitionMode,
    null_equals_null: bool,
    filter: Option<JoinFilter>,
    projection: Option<Vec<usize>>,
    left_columns: usize,
    right_schema: SchemaRef,
    schema: SchemaRef,
}

fn key_columns(
    exprs: impl Iterator<Item = Arc<dyn PhysicalExpr>>,
    schema: &SchemaRef,
) -> Result<(Vec<usize>, Vec<DataType>), Reason> {
    let mut columns = Vec::new();
    let mut types = Vec::new();
    for e in exprs {
        let Some(c) = e.downcast_ref::<Column>() else {
            return Err(format!("join key {e} is not a column"));
        };
        let t = schema.field(c.index()).data_type();
        let device = fulmen_kernels::column::device_type(t, 0)
            .map_err(|_| format!("join keys of type {t} are not supported on GPU"))?;
        if !super::keyable(&device) {
            return Err(format!("{device} join keys are not supported on GPU"));
        }
        columns.push(c.index());
        types.push(device);
    }
    Ok((columns, types))
}

impl JoinWork {
    /// The join's work, or why it stays on the CPU.
    pub fn plan(plan: &Arc<dyn ExecutionPlan>) -> Result<Self, Reason> {
        let Some(join) = plan.downcast_ref::<HashJoinExec>() else {
            return Err("not a HashJoinExec".into());
        };
        let join_type = *join.join_type();
        if matches!(join_type, JoinType::LeftMark | JoinType::RightMark) {
            return Err(format!("{join_type} joins are not supported on GPU"));
        }
        if join.null_aware {
            return Err("null-aware anti joins (NOT IN) are not supported on GPU".into());
        }
        if join.fetch().is_some() {
            return Err("a join with a row limit is not supported on GPU".into());
        }
        let mode = *join.partition_mode();
        match mode {
            PartitionMode::Partitioned => {}
            PartitionMode::CollectLeft
                if join.left().output_partitioning().partition_count() == 1 => {}
            _ => return Err(format!("partition mode {mode:?} is not supported on GPU")),
        }
        let left_schema = join.left().schema();
        let right_schema = join.right().schema();
        let (left_keys, left_types) =
            key_columns(join.on().iter().map(|(l, _)| Arc::clone(l)), &left_schema)?;
        let (right_keys, right_types) =
            key_columns(join.on().iter().map(|(_, r)| Arc::clone(r)), &right_schema)?;
        if left_types != right_types {
            return Err(format!(
                "join keys of different types ({left_types:?} and {right_types:?})"
            ));
        }
        Ok(Self {
            left_keys,
            right_keys,
            join_type,
            mode,
            null_equals_null: join.null_equality() == NullEquality::NullEqualsNull,
            filter: join.filter().cloned(),
            projection: join.projection.as_ref().map(|p| p.to_vec()),
            left_columns: left_schema.fields().len(),
            right_schema,
            schema: plan.schema(),
        })
    }

    /// Whether the output can stay on the device for a GPU parent: an inner join without
    /// a residual filter (the others still assemble their output on the host).
    fn device_output(&self) -> bool {
        self.join_type == JoinType::Inner && self.filter.is_none()
    }

    /// Where each output column of an inner join comes from: (build side?, column).
    fn output_sources(&self) -> Vec<(bool, usize)> {
        let all = self.left_columns + self.right_schema.fields().len();
        let columns: Vec<usize> = match &self.projection {
            Some(p) => p.clone(),
            None => (0..all).collect(),
        };
        columns
            .into_iter()
            .map(|c| {
                if c < self.left_columns {
                    (true, c)
                } else {
                    (false, c - self.left_columns)
                }
            })
            .collect()
    }

    /// Whether build rows are emitted at the end (never matched, or matched).
    fn emits_build_rows(&self) -> bool {
        matches!(
            self.join_type,
            JoinType::Left | JoinType::Full | JoinType::LeftSemi | JoinType::LeftAnti
        )
    }

    /// The output of pairs (`None` on a side: that side is NULL) in join order, projected.
    fn output(
        &self,
        build: &RecordBatch,
        probe: Option<&RecordBatch>,
        build_rows: &UInt32Array,
        probe_rows: &UInt32Array,
    ) -> Result<RecordBatch> {
        let n = match self.join_type {
            JoinType::RightSemi | JoinType::RightAnti => probe_rows.len(),
            _ => build_rows.len(),
        };
        let take_all = |batch: &RecordBatch, rows: &UInt32Array| -> Result<Vec<ArrayRef>> {
            batch
                .columns()
                .iter()
                .map(|c| take(c.as_ref(), rows, None).map_err(arrow_err))
                .collect()
        };
        let nulls = |schema: &SchemaRef| -> Vec<ArrayRef> {
            schema
                .fields()
                .iter()
                .map(|f| datafusion::arrow::array::new_null_array(f.data_type(), n))
                .collect()
        };
        let columns: Vec<ArrayRef> = match self.join_type {
            JoinType::LeftSemi | JoinType::LeftAnti => take_all(build, build_rows)?,
            JoinType::RightSemi | JoinType::RightAnti => match probe {
                Some(p) => take_all(p, probe_rows)?,
                None => nulls(&self.right_schema),
            },
            _ => {
                let mut columns = take_all(build, build_rows)?;
                columns.extend(match probe {
                    Some(p) => take_all(p, probe_rows)?,
                    None => nulls(&self.right_schema),
                });
                columns
            }
        };
        let columns = match &self.projection {
            Some(p) => p.iter().map(|&i| Arc::clone(&columns[i])).collect(),
            None => columns,
        };
        let columns = columns
            .into_iter()
            .zip(self.schema.fields())
            .map(|(c, f)| {
                if c.data_type() == f.data_type() {
                    Ok(c)
                } else {
                    datafusion::arrow::compute::cast(&c, f.data_type()).map_err(arrow_err)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        RecordBatch::try_new_with_options(
            Arc::clone(&self.schema),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(n)),
        )
        .map_err(arrow_err)
    }

    /// Keeps the pairs the residual filter accepts (evaluated by DataFusion on the host).
    fn filter_pairs(
        &self,
        build: &RecordBatch,
        probe: &RecordBatch,
        matches: Matches,
    ) -> Result<Matches> {
        let Some(filter) = &self.filter else {
            return Ok(matches);
        };
        if matches.build.is_empty() {
            return Ok(matches);
        }
        let b = UInt32Array::from(matches.build.clone());
        let p = UInt32Array::from(matches.probe.clone());
        let columns = filter
            .column_indices()
            .iter()
            .map(|ci| {
                let (batch, rows) = match ci.side {
                    JoinSide::Left => (build, &b),
                    _ => (probe, &p),
                };
                take(batch.column(ci.index).as_ref(), rows, None).map_err(arrow_err)
            })
            .collect::<Result<Vec<_>>>()?;
        let intermediate = RecordBatch::try_new_with_options(
            Arc::clone(filter.schema()),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(b.len())),
        )
        .map_err(arrow_err)?;
        let keep = filter
            .expression()
            .evaluate(&intermediate)?
            .into_array(b.len())?;
        let keep = keep
            .as_any()
            .downcast_ref::<BooleanArray>()
            .ok_or_else(|| internal_datafusion_err!("a join filter that is not boolean"))?;
        let mut out = Matches::default();
        for i in 0..keep.len() {
            // A NULL filter result drops the pair, as SQL's ON does.
            if keep.is_valid(i) && keep.value(i) {
                out.build.push(matches.build[i]);
                out.probe.push(matches.probe[i]);
            }
        }
        Ok(out)
    }

    /// The output for one probe batch given its (filtered) matches; marks the build rows
    /// that matched in `visited`.
    fn probe_output(
        &self,
        build: &RecordBatch,
        probe: &RecordBatch,
        matches: &Matches,
        visited: &mut [bool],
    ) -> Result<Option<RecordBatch>> {
        for &b in &matches.build {
            visited[b as usize] = true;
        }
        let n = probe.num_rows();
        let matched_probe = || {
            let mut seen = vec![false; n];
            for &p in &matches.probe {
                seen[p as usize] = true;
            }
            seen
        };
        let (build_rows, probe_rows): (UInt32Array, UInt32Array) = match self.join_type {
            JoinType::Inner | JoinType::Left => (
                UInt32Array::from(matches.build.clone()),
                UInt32Array::from(matches.probe.clone()),
            ),
            JoinType::Right | JoinType::Full => {
                // In probe order, an unmatched probe row (left side NULL) where it stands,
                // as DataFusion's (which keeps the probe side's order).
                let mut b: Vec<Option<u32>> = Vec::with_capacity(matches.build.len());
                let mut p: Vec<u32> = Vec::with_capacity(matches.probe.len());
                let mut at = 0;
                for i in 0..n as u32 {
                    let start = at;
                    while at < matches.probe.len() && matches.probe[at] == i {
                        b.push(Some(matches.build[at]));
                        p.push(i);
                        at += 1;
                    }
                    if at == start {
                        b.push(None);
                        p.push(i);
                    }
                }
                (UInt32Array::from(b), UInt32Array::from(p))
            }
            JoinType::RightSemi | JoinType::RightAnti => {
                let want = self.join_type == JoinType::RightSemi;
                let seen = matched_probe();
                let p: Vec<u32> = (0..n as u32)
                    .filter(|&i| seen[i as usize] == want)
                    .collect();
                (UInt32Array::from(Vec::<u32>::new()), UInt32Array::from(p))
            }
            _ => return Ok(None),
        };
        if build_rows.is_empty() && probe_rows.is_empty() {
            return Ok(None);
        }
        if matches!(self.join_type, JoinType::RightSemi | JoinType::RightAnti) {
            return self
                .output(
                    build,
                    Some(probe),
                    &UInt32Array::from(vec![0u32; 0]),
                    &probe_rows,
                )
                .map(Some);
        }
        self.output(build, Some(probe), &build_rows, &probe_rows)
            .map(Some)
    }

    /// The build rows emitted once probing is over.
    fn final_output(&self, build: &RecordBatch, visited: &[bool]) -> Result<Option<RecordBatch>> {
        let want_matched = self.join_type == JoinType::LeftSemi;
        let rows: Vec<u32> = (0..visited.len() as u32)
            .filter(|&i| visited[i as usize] == want_matched)
            .collect();
        if rows.is_empty() {
            return Ok(None);
        }
        let rows = UInt32Array::from(rows);
        self.output(build, None, &rows, &UInt32Array::from(Vec::<u32>::new()))
            .map(Some)
    }
}

fn arrow_err(e: datafusion::arrow::error::ArrowError) -> DataFusionError {
    DataFusionError::ArrowError(Box::new(e), None)
}

/// The rows whose keys can match: every key non-NULL (or all rows, when NULL equals NULL).
fn key_validity(columns: &[ArrayRef], null_equals_null: bool) -> Option<Vec<bool>> {
    if null_equals_null || columns.iter().all(|c| c.null_count() == 0) {
        return None;
    }
    let n = columns.first().map_or(0, |c| c.len());
    Some(
        (0..n)
            .map(|i| columns.iter().all(|c| c.is_valid(i)))
            .collect(),
    )
}

fn upload_validity(
    device: &Device,
    valid: &Option<Vec<bool>>,
) -> Result<Option<DeviceBuffer>, KernelError> {
    let Some(valid) = valid else {
        return Ok(None);
    };
    let mut bytes = vec![0u8; valid.len().div_ceil(8)];
    for (i, &v) in valid.iter().enumerate() {
        if v {
            bytes[i / 8] |= 1 << (i % 8);
        }
    }
    device.upload(&bytes).map(Some)
}

/// Matching on the host, for batches (or partitions) the device could not take: the
/// same pairs in the same order as the device's.
struct HostIndex {
    converter: RowConverter,
    rows: HashMap<Vec<u8>, Vec<u32>>,
}

/// Float keys with -0.0 made 0.0 (the row format tells the two apart; joins do not).
fn canonical_keys(keys: &[ArrayRef]) -> Result<Vec<ArrayRef>> {
    keys.iter()
        .map(|k| super::gpu_aggregate::canonical_zeros(Arc::clone(k)).map_err(arrow_err))
        .collect()
}

impl HostIndex {
    fn new(keys: &[ArrayRef], null_equals_null: bool) -> Result<Self> {
        let keys = &canonical_keys(keys)?;
        let converter = RowConverter::new(
            keys.iter()
                .map(|k| SortField::new(k.data_type().clone()))
                .collect(),
        )?;
        let converted = converter.convert_columns(keys)?;
        let valid = key_validity(keys, null_equals_null);
        let mut rows: HashMap<Vec<u8>, Vec<u32>> = HashMap::new();
        for i in 0..converted.num_rows() {
            if valid.as_ref().is_none_or(|v| v[i]) {
                rows.entry(converted.row(i).as_ref().to_vec())
                    .or_default()
                    .push(i as u32);
            }
        }
        Ok(Self { converter, rows })
    }

    fn probe(&self, keys: &[ArrayRef], null_equals_null: bool) -> Result<Matches> {
        let keys = &canonical_keys(keys)?;
        let converted = self.converter.convert_columns(keys)?;
        let valid = key_validity(keys, null_equals_null);
        let mut out = Matches::default();
        for i in 0..converted.num_rows() {
            if valid.as_ref().is_some_and(|v| !v[i]) {
                continue;
            }
            if let Some(builds) = self.rows.get(converted.row(i).as_ref()) {
                for &b in builds {
                    out.build.push(b);
                    out.probe.push(i as u32);
                }
            }
        }
        Ok(out)
    }
}

/// The matches of a probe batch found on the host (the index is built on first use).
fn host_matches(
    host: &mut Option<HostIndex>,
    work: &JoinWork,
    build: &RecordBatch,
    probe: &RecordBatch,
) -> Result<Matches> {
    let columns = |batch: &RecordBatch, keys: &[usize]| -> Vec<ArrayRef> {
        keys.iter().map(|&c| Arc::clone(batch.column(c))).collect()
    };
    let index = match host {
        Some(index) => index,
        None => host.insert(HostIndex::new(
            &columns(build, &work.left_keys),
            work.null_equals_null,
        )?),
    };
    index.probe(&columns(probe, &work.right_keys), work.null_equals_null)
}

/// The build side shared by the partitions of a CollectLeft join, and the build rows they
/// matched; the last partition to finish emits the build rows the join type keeps.
#[derive(Debug, Default)]
struct SharedBuild {
    batch: tokio::sync::OnceCell<Result<RecordBatch, Arc<DataFusionError>>>,
    state: Mutex<(Vec<bool>, usize)>,
}

/// The dynamic filter DataFusion's planner attached to the join for its probe side's scan
/// (`DynamicFilter [ empty ]` until filled), filled here as DataFusion's `HashJoinExec`
/// fills its bounds: `key >= min AND key <= max` for every key over the build side's
/// values, once every build partition is in (`false` when no build row can match). In
/// Partitioned mode the ranges are those of all partitions together, which hold for every
/// probe partition. Not attached for joins that keep unmatched probe rows, for
/// `IS NOT DISTINCT FROM` keys (a NULL key matches) and for float keys (-0.0 matches 0.0
/// but sorts below it).
#[derive(Debug)]
struct ProbeFilter {
    filter: Arc<dyn PhysicalExpr>,
    probe_keys: Vec<Arc<dyn PhysicalExpr>>,
    builds: usize,
    state: Mutex<ProbeFilterState>,
}

#[derive(Debug, Default)]
struct ProbeFilterState {
    reported: Vec<usize>,
    /// Each key's (min, max) over the build partitions so far; `None` while none has a row
    /// that can match.
    bounds: Option<Vec<(ScalarValue, ScalarValue)>>,
    done: bool,
}

impl ProbeFilter {
    fn plan(join: &HashJoinExec, work: &JoinWork) -> Option<Self> {
        // As DataFusion decides: whether a condition on the probe side may be pushed below
        // the join (not where unmatched probe rows are kept).
        let (_, probe_pushable) = work.join_type.on_lr_is_preserved();
        if !probe_pushable || work.null_equals_null {
            return None;
        }
        let (left_schema, right_schema) = (join.left().schema(), join.right().schema());
        // The bounds are literals of the build key's type, compared with the probe key:
        // both must have one type (DataFusion's coercion gives them one; a Utf8View beside a
        // Utf8 would not compare).
        if join.on().iter().any(|(l, r)| {
            match (l.data_type(&left_schema), r.data_type(&right_schema)) {
                (Ok(t), Ok(u)) => t != u || t.is_floating() || !t.is_primitive() && !is_string(&t),
                _ => true,
            }
        }) {
            return None;
        }
        let filter = join
            .dynamic_expressions_produced()
            .into_iter()
            .find(|e| e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some())?;
        let builds = match work.mode {
            PartitionMode::CollectLeft => 1,
            _ => join.left().output_partitioning().partition_count(),
        };
        Some(Self {
            filter,
            probe_keys: join.on().iter().map(|(_, r)| Arc::clone(r)).collect(),
            builds,
            state: Mutex::default(),
        })
    }

    /// Adds build partition `partition`'s key ranges; the last partition fills the filter.
    fn report(&self, partition: usize, build: &RecordBatch, keys: &[usize]) -> Result<()> {
        let bounds = key_bounds(build, keys)?;
        let mut state = self
            .state
            .lock()
            .map_err(|_| internal_datafusion_err!("a poisoned dynamic filter"))?;
        if state.done || state.reported.contains(&partition) {
            return Ok(());
        }
        state.reported.push(partition);
        state.bounds = match (state.bounds.take(), bounds) {
            (None, b) | (b, None) => b,
            (Some(a), Some(b)) => Some(
                a.into_iter()
                    .zip(b)
                    .map(|((lo_a, hi_a), (lo_b, hi_b))| {
                        let lo = if lo_b < lo_a { lo_b } else { lo_a };
                        let hi = if hi_b > hi_a { hi_b } else { hi_a };
                        (lo, hi)
                    })
                    .collect(),
            ),
        };
        if state.reported.len() < self.builds {
            return Ok(());
        }
        state.done = true;
        let predicate = match &state.bounds {
            None => lit(false),
            Some(bounds) => self
                .probe_keys
                .iter()
                .zip(bounds)
                .map(|(key, (lo, hi))| {
                    let at_least: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
                        Arc::clone(key),
                        Operator::GtEq,
                        lit(lo.clone()),
                    ));
                    let at_most: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
                        Arc::clone(key),
                        Operator::LtEq,
                        lit(hi.clone()),
                    ));
                    Arc::new(BinaryExpr::new(at_least, Operator::And, at_most))
                        as Arc<dyn PhysicalExpr>
                })
                .reduce(|a, b| Arc::new(BinaryExpr::new(a, Operator::And, b)))
                .unwrap_or_else(|| lit(true)),
        };
        let dynamic = self
            .filter
            .downcast_ref::<DynamicFilterPhysicalExpr>()
            .ok_or_else(|| internal_datafusion_err!("not a dynamic filter"))?;
        dynamic.update(predicate)?;
        dynamic.mark_complete();
        Ok(())
    }
}

fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// Each key column's (min, max) over its non-NULL values in `build`; `None` when some key
/// has none (no row of the batch can match then).
fn key_bounds(
    build: &RecordBatch,
    keys: &[usize],
) -> Result<Option<Vec<(ScalarValue, ScalarValue)>>> {
    let mut bounds = Vec::with_capacity(keys.len());
    for &k in keys {
        let column = build.column(k);
        let mut lo = MinAccumulator::try_new(column.data_type())?;
        let mut hi = MaxAccumulator::try_new(column.data_type())?;
        lo.update_batch(std::slice::from_ref(column))?;
        hi.update_batch(std::slice::from_ref(column))?;
        let (lo, hi) = (lo.evaluate()?, hi.evaluate()?);
        if lo.is_null() || hi.is_null() {
            return Ok(None);
        }
        bounds.push((lo, hi));
    }
    Ok(Some(bounds))
}

/// A hash join whose matching runs on a GPU.
#[derive(Debug)]
pub struct GpuHashJoinExec {
    inner: Arc<dyn ExecutionPlan>,
    work: Arc<JoinWork>,
    devices: Arc<Vec<Device>>,
    batch: BatchLimit,
    metrics: ExecutionPlanMetricsSet,
    executed: AtomicBool,
    shared: Arc<SharedBuild>,
    probe_filter: Option<Arc<ProbeFilter>>,
}

impl GpuHashJoinExec {
    /// The GPU twin of `cpu`, or why there is none.
    pub fn try_new(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch: BatchLimit,
    ) -> Result<Self, Reason> {
        if devices.is_empty() {
            return Err("no device".into());
        }
        let work = JoinWork::plan(&cpu)?;
        let probe_filter = cpu
            .downcast_ref::<HashJoinExec>()
            .and_then(|join| ProbeFilter::plan(join, &work))
            .map(Arc::new);
        Ok(Self {
            inner: cpu,
            work: Arc::new(work),
            probe_filter,
            devices,
            batch,
            metrics: ExecutionPlanMetricsSet::new(),
            executed: AtomicBool::new(false),
            shared: Arc::new(SharedBuild::default()),
        })
    }

    /// The devices its partitions run on.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The join type.
    pub fn join_type(&self) -> JoinType {
        self.work.join_type
    }

    /// Whether a residual filter runs (on the host) over the matched pairs.
    pub fn has_filter(&self) -> bool {
        self.work.filter.is_some()
    }
}

impl DisplayAs for GpuHashJoinExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        super::fmt_gpu_operator("GpuHashJoinExec", &self.inner, &self.devices, t, f)
    }
}

impl ExecutionPlan for GpuHashJoinExec {
    fn name(&self) -> &str {
        "GpuHashJoinExec"
    }

    delegate_to_cpu_operator!("GpuHashJoinExec");

    /// A fresh join for executing the plan again: DataFusion's reset drops the
    /// HashJoinExec's dynamic filter (a plan that is run again must not fill it twice), so
    /// the GPU join built on it fills none either; the collected build side goes too.
    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        let inner = Arc::clone(&self.inner).reset_state()?;
        let gpu = Self::try_new(inner, Arc::clone(&self.devices), self.batch)
            .map_err(|reason| internal_datafusion_err!("GpuHashJoinExec: {reason}"))?;
        Ok(Arc::new(gpu))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let (run, right) = self.run(partition, &context)?;
        let work = run.metrics.work();
        let probe = right.execute(partition, context)?;
        let schema = self.schema();
        let stream = futures::stream::once(run.start(probe)).flat_map(|r| match r {
            Ok(s) => s,
            Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
        });
        Ok(work.batches(schema, stream))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}

impl GpuHashJoinExec {
    fn run(
        &self,
        partition: usize,
        context: &Arc<TaskContext>,
    ) -> Result<(JoinRun, Arc<dyn ExecutionPlan>)> {
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("GpuHashJoinExec without a device"))?;
        let children = self.inner.children();
        let (left, right) = (Arc::clone(children[0]), Arc::clone(children[1]));
        let probe_partitions = right.output_partitioning().partition_count();
        let metrics = GpuMetrics::new(&self.metrics, partition, &device, context);
        let label = || Label::new("device", device.to_string());
        let extra = JoinMetrics {
            build_rows: MetricBuilder::new(&self.metrics)
                .with_label(label())
                .counter("build_rows", partition),
            cpu_fallback: MetricBuilder::new(&self.metrics)
                .with_label(label())
                .counter("cpu_fallback", partition),
        };
        count_operator(&self.executed, OperatorKind::Join);
        super::gpu_stream::count_partition();
        let run = JoinRun {
            work: Arc::clone(&self.work),
            device,
            batch: self.batch,
            metrics,
            extra,
            shared: (self.work.mode == PartitionMode::CollectLeft)
                .then(|| (Arc::clone(&self.shared), probe_partitions)),
            probe_filter: self.probe_filter.clone().filter(|_| {
                context
                    .session_config()
                    .options()
                    .optimizer
                    .enable_join_dynamic_filter_pushdown
            }),
            left,
            partition,
            context: Arc::clone(context),
        };
        Ok((run, right))
    }
}

impl DeviceResident for GpuHashJoinExec {
    fn execute_chunks(&self, partition: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        if !self.work.device_output() {
            let batches = self.execute(partition, context)?;
            return Ok(Box::pin(batches.map(|b| b.map(Chunk::Host))));
        }
        let (run, right) = self.run(partition, &context)?;
        let work = run.metrics.work();
        // The probe side straight from a GPU child on the same devices, when it is one.
        let probe = input_chunks(&right, partition, context, &self.devices)?;
        let stream = futures::stream::once(run.start_device(probe)).flat_map(|r| match r {
            Ok(s) => s,
            Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
        });
        Ok(work.chunks(Box::pin(stream)))
    }

    fn resident_devices(&self) -> &Arc<Vec<Device>> {
        &self.devices
    }
}

#[derive(Debug, Clone)]
struct JoinMetrics {
    build_rows: Count,
    /// 1 when the build side did not fit on the device and the partition matched on the
    /// host.
    cpu_fallback: Count,
}

struct JoinRun {
    work: Arc<JoinWork>,
    device: Device,
    batch: BatchLimit,
    metrics: GpuMetrics,
    extra: JoinMetrics,
    shared: Option<(Arc<SharedBuild>, usize)>,
    probe_filter: Option<Arc<ProbeFilter>>,
    left: Arc<dyn ExecutionPlan>,
    partition: usize,
    context: Arc<TaskContext>,
}

/// Reports a build side to the probe filter; a failure only costs the pruning.
fn fill_probe_filter(
    filter: Option<&ProbeFilter>,
    partition: usize,
    build: &RecordBatch,
    keys: &[usize],
) {
    if let Some(filter) = filter
        && let Err(e) = filter.report(partition, build, keys)
    {
        log::warn!("the probe side's dynamic filter stays empty: {e}");
    }
}

type BatchStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<RecordBatch>> + Send>>;

async fn collect_side(
    plan: &Arc<dyn ExecutionPlan>,
    partition: usize,
    context: Arc<TaskContext>,
) -> Result<RecordBatch> {
    let mut stream = plan.execute(partition, context)?;
    let mut batches = Vec::new();
    while let Some(b) = stream.next().await {
        batches.push(b?);
    }
    concat_batches(&plan.schema(), &batches).map_err(arrow_err)
}

/// A partition's state while it probes.
struct Probing {
    run: JoinRun,
    build: RecordBatch,
    table: Option<JoinTable>,
    host: Option<HostIndex>,
    visited: Vec<bool>,
    probe: SendableRecordBatchStream,
    /// Probe batches waiting to make up a device batch, sized by their key columns (only
    /// those go to the device).
    pending: Coalescer<PartlyUploaded>,
    done: bool,
}

impl JoinRun {
    async fn start(self, probe: SendableRecordBatchStream) -> Result<BatchStream> {
        let build = self.build_side().await?;
        // An empty build side matches nothing: no device work.
        let table = if build.num_rows() == 0 {
            None
        } else {
            match self.build_table(&build) {
                Ok(t) => Some(t),
                Err(e) => {
                    self.metrics.recover(&e, "matching the join on the host")?;
                    self.extra.cpu_fallback.add(1);
                    None
                }
            }
        };
        let visited = vec![false; build.num_rows()];
        let pending = Coalescer::new(self.batch);
        let state = Probing {
            run: self,
            build,
            table,
            host: None,
            visited,
            probe,
            pending,
            done: false,
        };
        Ok(Box::pin(futures::stream::try_unfold(
            state,
            |mut state| async move {
                loop {
                    if state.done {
                        return Ok(None);
                    }
                    if let Some(batch) = state.step().await? {
                        return Ok(Some((batch, state)));
                    }
                }
            },
        )))
    }

    /// The build side, collected once (shared by the partitions of a CollectLeft join).
    async fn build_side(&self) -> Result<RecordBatch> {
        let build = match &self.shared {
            Some((shared, _)) => {
                let left = Arc::clone(&self.left);
                let context = Arc::clone(&self.context);
                let filter = self.probe_filter.clone();
                let keys = self.work.left_keys.clone();
                shared
                    .batch
                    .get_or_init(|| async move {
                        let build = collect_side(&left, 0, context).await.map_err(Arc::new)?;
                        fill_probe_filter(filter.as_deref(), 0, &build, &keys);
                        Ok(build)
                    })
                    .await
                    .clone()
                    .map_err(DataFusionError::Shared)?
            }
            None => {
                let build =
                    collect_side(&self.left, self.partition, Arc::clone(&self.context)).await?;
                let filter = self.probe_filter.as_deref();
                fill_probe_filter(filter, self.partition, &build, &self.work.left_keys);
                build
            }
        };
        self.extra.build_rows.add(build.num_rows());
        Ok(build)
    }

    /// An inner join whose output stays on the device: the build side's keys and output
    /// columns go up once, each probe chunk's matches are gathered there.
    async fn start_device(self, probe: ChunkStream) -> Result<ChunkStream> {
        let build = self.build_side().await?;
        let mut table = None;
        let mut build_columns = HashMap::new();
        if build.num_rows() > 0 {
            let on_device = self.build_table(&build).and_then(|t| {
                for (from_build, c) in self.work.output_sources() {
                    if from_build && !build_columns.contains_key(&c) {
                        let column = self
                            .metrics
                            .upload(&self.device, build.column(c).as_ref())?;
                        build_columns.insert(c, column);
                    }
                }
                Ok(t)
            });
            match on_device {
                Ok(t) => table = Some(t),
                Err(e) => {
                    self.metrics.recover(&e, "matching the join on the host")?;
                    self.extra.cpu_fallback.add(1);
                    build_columns.clear();
                }
            }
        }
        let pending = Coalescer::new(self.batch);
        let state = DeviceProbing {
            run: self,
            build,
            table,
            build_columns,
            host: None,
            probe,
            pending,
            held: None,
        };
        Ok(Box::pin(futures::stream::try_unfold(
            state,
            |mut state| async move {
                while let Some(chunk) = state.next_batch().await? {
                    if let Some(out) = state.step(chunk)? {
                        return Ok(Some((out, state)));
                    }
                }
                state.run.metrics.baseline.done();
                Ok(None)
            },
        )))
    }

    fn build_table(&self, build: &RecordBatch) -> Result<JoinTable, KernelError> {
        let keys: Vec<ArrayRef> = self
            .work
            .left_keys
            .iter()
            .map(|&c| Arc::clone(build.column(c)))
            .collect();
        let valid = key_validity(&keys, self.work.null_equals_null);
        let columns = keys
            .iter()
            .map(|k| self.metrics.upload(&self.device, k.as_ref()))
            .collect::<Result<Vec<DeviceColumn>, _>>()?;
        let valid = upload_validity(&self.device, &valid)?;
        self.metrics.kernel(|| {
            JoinTable::build(
                &self.device,
                columns,
                valid.as_ref(),
                build.num_rows(),
                self.work.null_equals_null,
            )
        })
    }

    fn device_matches(
        &self,
        table: &JoinTable,
        probe: &RecordBatch,
    ) -> Result<Matches, KernelError> {
        let keys: Vec<ArrayRef> = self
            .work
            .right_keys
            .iter()
            .map(|&c| Arc::clone(probe.column(c)))
            .collect();
        let valid = key_validity(&keys, self.work.null_equals_null);
        let columns = keys
            .iter()
            .map(|k| self.metrics.upload(&self.device, k.as_ref()))
            .collect::<Result<Vec<DeviceColumn>, _>>()?;
        let valid = upload_validity(&self.device, &valid)?;
        let refs: Vec<&DeviceColumn> = columns.iter().collect();
        let matches = self
            .metrics
            .kernel(|| table.probe(&refs, valid.as_ref(), probe.num_rows()))?;
        Ok(matches)
    }
}

impl Probing {
    /// One step: the output of the next device batch, or of the end (`None`: nothing to
    /// emit yet).
    async fn step(&mut self) -> Result<Option<RecordBatch>> {
        // Every probe batch has the join's right schema (they are concatenated into one),
        // so only the limit closes a device batch.
        while !self.pending.is_full() {
            match self.probe.next().await {
                Some(batch) => self
                    .pending
                    .push(PartlyUploaded::new(batch?, &self.run.work.right_keys)),
                None => break,
            }
        }
        if self.pending.is_empty() {
            self.done = true;
            return self.finish();
        }
        let pending: Vec<RecordBatch> = self.pending.take().into_iter().map(|p| p.batch).collect();
        let probe = concat_batches(&self.run.work.right_schema, &pending).map_err(arrow_err)?;
        let elapsed = self.run.metrics.baseline.elapsed_compute().clone();
        let timer = elapsed.timer();
        let matches = self.matches(&probe)?;
        let matches = self.run.work.filter_pairs(&self.build, &probe, matches)?;
        let out = self
            .run
            .work
            .probe_output(&self.build, &probe, &matches, &mut self.visited);
        timer.done();
        let out = out?;
        if let Some(b) = &out {
            self.run.metrics.record_batch(b);
        }
        Ok(out)
    }

    fn matches(&mut self, probe: &RecordBatch) -> Result<Matches> {
        if self.build.num_rows() == 0 || probe.num_rows() == 0 {
            return Ok(Matches::default());
        }
        if let Some(table) = &self.table {
            match self.run.device_matches(table, probe) {
                Ok(m) => {
                    count_batch(&self.run.metrics, BatchOn::Device);
                    return Ok(m);
                }
                Err(e) => self
                    .run
                    .metrics
                    .recover(&e, "matching a batch on the host")?,
            }
        }
        count_batch(&self.run.metrics, BatchOn::Fallback);
        host_matches(&mut self.host, &self.run.work, &self.build, probe)
    }

    /// The build rows the join type emits once this partition (or, for CollectLeft, the
    /// last partition) has probed everything.
    fn finish(&mut self) -> Result<Option<RecordBatch>> {
        let work = &self.run.work;
        if !work.emits_build_rows() {
            return Ok(None);
        }
        let visited = match &self.run.shared {
            None => std::mem::take(&mut self.visited),
            Some((shared, partitions)) => {
                let mut state = shared.state.lock().unwrap_or_else(|p| p.into_inner());
                let (seen, finished) = &mut *state;
                if seen.len() < self.visited.len() {
                    seen.resize(self.visited.len(), false);
                }
                for (s, v) in seen.iter_mut().zip(&self.visited) {
                    *s |= *v;
                }
                *finished += 1;
                if *finished < *partitions {
                    return Ok(None);
                }
                std::mem::take(seen)
            }
        };
        let out = work.final_output(&self.build, &visited)?;
        if let Some(b) = &out {
            self.run.metrics.record_batch(b);
        }
        Ok(out)
    }
}

/// A partition of an inner join whose output stays on the device.
struct DeviceProbing {
    run: JoinRun,
    build: RecordBatch,
    table: Option<JoinTable>,
    /// Build-side output columns on the device.
    build_columns: HashMap<usize, DeviceColumn>,
    host: Option<HostIndex>,
    probe: ChunkStream,
    /// Host probe chunks waiting to make up a device batch (a device chunk goes alone), and
    /// a chunk that closed the last one.
    pending: Coalescer<Chunk>,
    held: Option<Chunk>,
}

impl DeviceProbing {
    /// The next device batch of probe rows: host chunks coalesced (see `coalesce.rs`), a
    /// device chunk as it is; `None` once the probe side has ended.
    async fn next_batch(&mut self) -> Result<Option<Chunk>> {
        loop {
            if let Some(held) = self.held.take() {
                self.pending.push(held);
            }
            if self.pending.is_full() {
                break;
            }
            match self.probe.next().await {
                Some(chunk) => {
                    let chunk = chunk?;
                    if self.pending.closes_before(&chunk) {
                        self.held = Some(chunk);
                        break;
                    }
                    self.pending.push(chunk);
                }
                None => break,
            }
        }
        let mut waiting = self.pending.take();
        if waiting.len() <= 1 {
            return Ok(waiting.pop());
        }
        let batches = waiting
            .iter()
            .map(|c| match c {
                Chunk::Host(b) => Ok(b.clone()),
                Chunk::Device(..) => Err(internal_datafusion_err!(
                    "a device chunk was coalesced with others"
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let probe = concat_batches(&batches[0].schema(), &batches).map_err(arrow_err)?;
        Ok(Some(Chunk::Host(probe)))
    }

    /// The output for one probe chunk (`None`: nothing matched).
    fn step(&mut self, chunk: Chunk) -> Result<Option<Chunk>> {
        if self.build.num_rows() == 0 || chunk.num_rows() == 0 {
            return Ok(None);
        }
        let elapsed = self.run.metrics.baseline.elapsed_compute().clone();
        let _timer = elapsed.timer();
        if let Some(table) = &self.table {
            match self.on_device(table, &chunk) {
                Ok(out) => {
                    count_batch(&self.run.metrics, BatchOn::Device);
                    if let Some(out) = &out {
                        self.run.metrics.record_chunk(out);
                    }
                    return Ok(out);
                }
                Err(e) => self
                    .run
                    .metrics
                    .recover(&e, "matching a batch on the host")?,
            }
        }
        count_batch(&self.run.metrics, BatchOn::Fallback);
        let probe = chunk.host_for_cpu(&self.run.metrics)?;
        let out = host_probe(&mut self.host, &self.run.work, &self.build, &probe)?;
        if let Some(out) = &out {
            self.run.metrics.record_batch(out);
        }
        Ok(out.map(Chunk::Host))
    }

    fn on_device(&self, table: &JoinTable, chunk: &Chunk) -> Result<Option<Chunk>, KernelError> {
        let run = &self.run;
        let (device, metrics) = (&run.device, &run.metrics);
        let n = chunk.num_rows();
        let mut probe_columns: HashMap<usize, DeviceColumn> = HashMap::new();
        for &c in &run.work.right_keys {
            if let std::collections::hash_map::Entry::Vacant(slot) = probe_columns.entry(c) {
                slot.insert(chunk.device_column(c, device, metrics)?);
            }
        }
        let keys: Vec<&DeviceColumn> = run
            .work
            .right_keys
            .iter()
            .map(|c| &probe_columns[c])
            .collect();
        // NULL probe keys need no validity here: the verification rejects them.
        let Some((build_rows, probe_rows)) =
            metrics.kernel(|| table.probe_on_device(&keys, None, n))?
        else {
            return Ok(None);
        };
        let rows = build_rows.len();
        let mut columns = Vec::new();
        for (from_build, c) in run.work.output_sources() {
            let column = if from_build {
                let source = self.build_columns.get(&c).ok_or_else(|| {
                    KernelError::InvalidData(format!("build column {c} is not on the device"))
                })?;
                metrics.kernel(|| gather::gather_column(source, &build_rows))?
            } else {
                if let std::collections::hash_map::Entry::Vacant(slot) = probe_columns.entry(c) {
                    slot.insert(chunk.device_column(c, device, metrics)?);
                }
                metrics.kernel(|| gather::gather_column(&probe_columns[&c], &probe_rows))?
            };
            columns.push(Col::Device(column));
        }
        let (work, build, probe) = (Arc::clone(&run.work), self.build.clone(), chunk.lineage());
        let redo = Redo::new(move || {
            let probe = probe.run()?;
            let out = host_probe(&mut None, &work, &build, &probe)?;
            Ok(out.unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(&work.schema))))
        });
        Output { columns, rows }
            .to_device(&run.work.schema, device, metrics, redo)
            .map(Some)
    }
}

/// An inner join's output for one probe batch, matched on the host.
fn host_probe(
    host: &mut Option<HostIndex>,
    work: &JoinWork,
    build: &RecordBatch,
    probe: &RecordBatch,
) -> Result<Option<RecordBatch>> {
    let matches = host_matches(host, work, build, probe)?;
    let mut visited = vec![false; build.num_rows()];
    work.probe_output(build, probe, &matches, &mut visited)
}
