//! `GpuHashJoinExec`: DataFusion's `HashJoinExec` with its matching on a GPU.
//!
//! The build side (left) is collected once, its key columns are uploaded to the partition's
//! device and a [`JoinTable`] is built there. (An inner join whose output stays on the
//! device, over a build side from a GPU child on the same devices, builds its table from
//! the child's chunks where they lie, concatenated on the device; a CollectLeft join builds
//! one table per device, shared by the device's partitions: see `build_side.rs`.) Probe batches (right, coalesced to
//! `fulmen.gpu.batch_bytes` or `_rows`, through the loop every GPU operator shares,
//! `device_loop.rs`) upload their keys; the device
//! hashes them, counts and writes the pairs whose hashes and keys are equal (the keys
//! compared in the probe's own passes) and returns them in probe order. The host then applies the residual filter (DataFusion's
//! expression, when the join has one) and gathers the output columns with Arrow's `take`,
//! per join type:
//!
//! ```text
//!   left (all) ─▶ upload keys ─▶ JoinTable::build
//!   right batch ─▶ upload keys ─▶ hash ─▶ probe (keys compared) ─▶ pairs ─▶ (filter) ─▶ take
//!   right ends ─▶ build rows never matched (left, full, left anti) or matched (left semi)
//!   device error ─▶ that batch (or, for the build, the whole partition) is matched on the
//!                   host instead, with the same rules
//! ```
//!
//! A join that emits no probe row without a match (inner, left, left semi, left anti,
//! right semi) may take in the device filter on its probe side (a fused stage, see
//! `fused.rs`): it probes the filter's input under the predicate's row mask (not, where
//! it assembles its output on the host, a filter over device chunks, which stays its own).
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
use fulmen_kernels::ops::RowIndices;
use fulmen_kernels::ops::gather;
use fulmen_kernels::ops::join::{JoinTable, Matches};
use fulmen_kernels::{Device, DeviceBuffer, DeviceColumn, KernelError};
use futures::StreamExt;

use super::coalesce::{BatchLimit, PartlyUploaded};
use super::device_loop::{DeviceBatches, OnDevice, PieceError, PieceWork, one_chunk, run_pieces};
use super::gpu_stream::{
    BatchOn, Chunk, ChunkStream, Col, DeviceResident, DeviceWork, GpuMetrics, OperatorKind, Output,
    Redo, count_operator, device_for, input_chunks,
};
use crate::gpu::compile::Reason;

mod build_side;
mod device_probing;
mod fused;
mod marks;
mod probe_filter;
mod run;
mod semi;
mod work;

use build_side::*;
use device_probing::*;
use fused::*;
use marks::*;
use probe_filter::*;
use run::*;
use work::*;

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
    /// A fused stage: the device filter on the probe side that the join takes in.
    fused: Option<Arc<FusedFilter>>,
}

impl GpuHashJoinExec {
    /// The GPU twin of `cpu`, or why there is none.
    pub fn try_new(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch: BatchLimit,
    ) -> Result<Self, Reason> {
        Self::planned(cpu, devices, batch, false)
    }

    /// A fused stage: the GPU twin of `cpu`, a join (of a type
    /// [`takes_in_probe_filter`](Self::takes_in_probe_filter) accepts) whose probe side is a
    /// `FilterExec` (without a row limit) that the stage takes in. Its children are the
    /// build side and the filter's input; the device evaluates the predicate and probes
    /// only the rows it keeps (see `fused.rs`).
    pub fn try_fused(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch: BatchLimit,
    ) -> Result<Self, Reason> {
        Self::planned(cpu, devices, batch, true)
    }

    fn planned(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch: BatchLimit,
        fused: bool,
    ) -> Result<Self, Reason> {
        if devices.is_empty() {
            return Err("no device".into());
        }
        let work = JoinWork::plan(&cpu)?;
        let fused = match cpu.downcast_ref::<HashJoinExec>() {
            Some(join) if fused => Some(Arc::new(FusedFilter::plan(join)?)),
            None if fused => return Err("a fused stage that is not a HashJoinExec".into()),
            _ => None,
        };
        // A join that assembles its output on the host reads host batches of its probe
        // child: a filter whose input lies on the device (a cached table's scan) stays its
        // own, reading the chunks where they lie, rather than bring them down whole.
        if let Some(filter) = &fused
            && !work.device_output()
            && super::resident_on(filter.input(), &devices).is_some()
        {
            return Err(
                "a fused filter over device chunks under a join assembled on the host".into(),
            );
        }
        let probe_filter = cpu
            .downcast_ref::<HashJoinExec>()
            .and_then(|join| ProbeFilter::plan(join, &work))
            .map(Arc::new);
        Ok(Self {
            inner: cpu,
            work: Arc::new(work),
            probe_filter,
            fused,
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

    /// The same operator (fused or not) over a new CPU twin.
    fn over(&self, inner: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
        let fused = self.fused.is_some();
        let gpu = Self::planned(inner, Arc::clone(&self.devices), self.batch, fused)
            .map_err(|reason| internal_datafusion_err!("GpuHashJoinExec: {reason}"))?;
        Ok(Arc::new(gpu))
    }

    /// Whether a join of this type may take in the device filter on its probe side (a
    /// fused stage): one that never emits a probe row without a match.
    pub fn takes_in_probe_filter(join_type: JoinType) -> bool {
        takes_in_probe_filter(join_type)
    }

    /// The predicate of the probe side's filter this stage takes in, if it is a fused stage.
    pub fn fused_filter(&self) -> Option<&Arc<dyn PhysicalExpr>> {
        self.fused.as_ref().map(|f| f.predicate())
    }
}

impl DisplayAs for GpuHashJoinExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        super::fmt_gpu_operator("GpuHashJoinExec", &self.inner, &self.devices, t, f)?;
        match self.fused_filter() {
            Some(predicate) if t == DisplayFormatType::TreeRender => {
                write!(f, "\nfused_filter={predicate}")
            }
            Some(predicate) => write!(f, ", fused_filter={predicate}"),
            None => Ok(()),
        }
    }
}

impl ExecutionPlan for GpuHashJoinExec {
    fn name(&self) -> &str {
        "GpuHashJoinExec"
    }

    delegate_to_cpu_operator!(@properties);

    /// A fused stage's statistics: its twin filter's over the probe child's, then the
    /// join's.
    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<datafusion::physical_plan::Statistics>],
        args: &datafusion::physical_plan::StatisticsArgs,
    ) -> Result<Arc<datafusion::physical_plan::Statistics>> {
        match (&self.fused, input_stats) {
            (Some(fused), [build, probe]) => {
                let filtered =
                    (fused.filter).statistics_from_inputs(std::slice::from_ref(probe), args)?;
                self.inner
                    .statistics_from_inputs(&[Arc::clone(build), filtered], args)
            }
            _ => self.inner.statistics_from_inputs(input_stats, args),
        }
    }

    /// A fused stage's children are the build side and its filter's input; otherwise the
    /// CPU twin's children.
    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        match &self.fused {
            Some(fused) => vec![self.inner.children()[0], fused.input()],
            None => self.inner.children(),
        }
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        use datafusion::physical_plan::execution_plan::{
            ChildrenPropertiesMode, ReplaceChildrenOptions,
        };
        let recompute = || ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        let children = match (&self.fused, <[_; 2]>::try_from(children)) {
            // The fused filter over the new probe child.
            (Some(fused), Ok([build, probe])) => {
                let filter =
                    Arc::clone(&fused.filter).replace_children(vec![probe], recompute())?;
                vec![build, filter]
            }
            (_, Ok(two)) => two.to_vec(),
            (_, Err(other)) => other,
        };
        let inner = Arc::clone(&self.inner).replace_children(children, recompute())?;
        self.over(inner)
    }

    /// A fresh join for executing the plan again: DataFusion's reset drops the
    /// HashJoinExec's dynamic filter (a plan that is run again must not fill it twice), so
    /// the GPU join built on it fills none either; the collected build side goes too.
    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        let inner = Arc::clone(&self.inner).reset_state()?;
        self.over(inner)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        // A fused stage whose output may stay on the device probes and gathers there (as
        // does an inner join over probe rows on the device, and a semi or anti join over
        // build rows there, `semi.rs`); one that assembles its output on the host matches
        // its input's batches under the filter's mask (`Probing`).
        if (self.fused.is_some() && self.work.device_output())
            || self.probes_resident_rows()
            || self.build_rows_resident()
        {
            let (stream, work, metrics) = self.device_stream(partition, context, true)?;
            // Only the joined rows come down; a chunk whose device was lost is made again
            // on the CPU from its inputs.
            let batches = stream.map(move |chunk| chunk.and_then(|c| c.host_for_cpu(&metrics)));
            return Ok(work.batches(self.schema(), batches));
        }
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
        let children = self.children();
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
            device_builds: MetricBuilder::new(&self.metrics)
                .with_label(label())
                .counter("device_builds", partition),
            host_takes: MetricBuilder::new(&self.metrics)
                .with_label(label())
                .counter("host_takes", partition),
            probe_takes: MetricBuilder::new(&self.metrics)
                .with_label(label())
                .counter("probe_takes", partition),
            mark_reads: MetricBuilder::new(&self.metrics)
                .with_label(label())
                .counter("mark_reads", partition),
        };
        count_operator(&self.executed, OperatorKind::Join);
        super::gpu_stream::count_partition();
        let run = JoinRun {
            work: Arc::clone(&self.work),
            devices: Arc::clone(&self.devices),
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
            fused: self.fused.clone(),
            left,
            partition,
            context: Arc::clone(context),
        };
        Ok((run, right))
    }

    /// Whether a join whose output goes to the host still matches and gathers on the
    /// device: an inner join without a residual filter whose probe side is a GPU operator
    /// on the same devices, and whose output is the narrower (see
    /// [`JoinWork::output_narrower_on_device`]). Its probe rows then stay on the device and
    /// only the joined rows come down (on the host they would come down whole, their keys
    /// go up again and the matched pairs come down).
    fn probes_resident_rows(&self) -> bool {
        self.work.device_output()
            && self.work.output_narrower_on_device()
            && super::resident_on(self.inner.children()[1], &self.devices).is_some()
    }

    /// Whether a left semi or anti join without a residual filter keeps its build rows on
    /// the device (see `semi.rs`): when its build child is a GPU scan, filter or
    /// projection on the same devices (alone, or under DataFusion's
    /// `CoalescePartitionsExec` for CollectLeft), whose rows lie there already. Not over a
    /// GPU join, directly or under GPU filters and projections: an inner join made to
    /// leave its output on the device uploads every column it outputs where its host output
    /// would upload keys and bring pairs down, and over TPC-H's three such semi joins (Q2,
    /// Q18, Q20) that cost more than it saved (in the H200 model at SF 1, 19.8 -> 22.2 ms
    /// from host; uploads 555 -> 630 MB). And the matches marked are numbered in the order
    /// the device made the build rows, which a join's CPU redo (after a device fault) need
    /// not keep for a probe row of more than 64 matches; scans, filters and projections
    /// keep their rows' order.
    fn build_rows_resident(&self) -> bool {
        use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
        let left = self.inner.children()[0];
        let child = match left.downcast_ref::<CoalescePartitionsExec>() {
            Some(c) if self.work.mode == PartitionMode::CollectLeft && c.fetch().is_none() => {
                c.input()
            }
            _ => left,
        };
        self.work.build_rows_on_device()
            && !over_a_gpu_join(child)
            && super::resident_on(child, &self.devices).is_some()
    }

    /// A partition's output as device chunks, the operator's counted work, and its metrics:
    /// build side and probe rows taken where they lie (see `build_side.rs`).
    fn device_stream(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
        to_host: bool,
    ) -> Result<(ChunkStream, DeviceWork, GpuMetrics)> {
        let (run, right) = self.run(partition, &context)?;
        let (work, metrics) = (run.metrics.work(), run.metrics.clone());
        // The probe side straight from a GPU child on the same devices, when it is one.
        let probe = input_chunks(&right, partition, context, &self.devices)?;
        let stream =
            futures::stream::once(run.start_device(probe, to_host)).flat_map(|r| match r {
                Ok(s) => s,
                Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
            });
        Ok((Box::pin(stream), work, metrics))
    }
}

/// Whether `plan` is a GPU join, or GPU filters and projections (and DataFusion's
/// `CooperativeExec`) over one: whose device rows a join made.
fn over_a_gpu_join(plan: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::physical_plan::coop::CooperativeExec;
    if plan.is::<GpuHashJoinExec>() {
        return true;
    }
    let passes = plan.is::<super::GpuFilterExec>()
        || plan.is::<super::GpuProjectionExec>()
        || plan.is::<CooperativeExec>();
    passes && plan.children().first().is_some_and(|c| over_a_gpu_join(c))
}

impl DeviceResident for GpuHashJoinExec {
    fn execute_chunks(&self, partition: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        if !self.work.device_output() && !self.build_rows_resident() {
            let batches = self.execute(partition, context)?;
            return Ok(Box::pin(batches.map(|b| b.map(Chunk::Host))));
        }
        let (stream, work, _) = self.device_stream(partition, context, false)?;
        Ok(work.chunks(stream))
    }

    fn resident_devices(&self) -> &Arc<Vec<Device>> {
        &self.devices
    }
}
