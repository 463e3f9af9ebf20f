//! `GpuAggregateExec`: DataFusion's `AggregateExec` on a GPU, in every mode (Partial,
//! PartialReduce, Final, FinalPartitioned, Single, SinglePartitioned).
//!
//! This file holds the operator and a partition's run (its input goes through the loop every
//! GPU operator shares, `device_loop.rs`: coalescing batches, splitting those that do not
//! fit; this file finishes on the CPU when the loop stops at a device failure); `plan.rs`
//! plans the device work, `update.rs` adds a batch to the device tables and `states.rs`
//! brings their groups down.
//!
//! Each partition keeps one device [`GroupTable`] for its whole input: batches (coalesced
//! to `fulmen.gpu.batch_bytes` or `_rows`, see `device_loop.rs`) are uploaded, computed keys,
//! arguments and `FILTER` clauses run as one expression program, and the table finds or
//! adds every row's group and updates the accumulators of all aggregates in one pass. When
//! the input ends the table's keys and accumulator states come back once:
//!
//! ```text
//!   input ─▶ coalesce ─▶ upload ─▶ program (keys, args, filters,  ─▶ GroupTable::update
//!                                    a fused filter's predicate)
//!                                         └─ rows left to the CPU: DataFusion evaluates
//!                                            that batch's expressions (over the rows of
//!                                            the fused filter, applied first), the
//!                                            device table takes them and goes on
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
//! integers, floats, decimals and (min/max) dates and timestamps, and `count(DISTINCT x)`
//! over integers, decimals, dates, times and strings; any other aggregate, another DISTINCT
//! or ordered aggregate, grouping sets and group limits leave the node on the CPU with the
//! reason.
//!
//! `count(DISTINCT x)` keeps a second table of its own, keyed by (group keys…, x) and
//! without accumulators: each distinct pair is one entry. Rows with a NULL x or a false
//! `FILTER` are left out on the device (compaction); merging partial states flattens their
//! lists on the host and inserts the pairs the same way. When the input ends the pairs come
//! down and are matched to their groups by key: a partial state is the list of a group's
//! values, a final count the length of that list. The pair tables are updated before the
//! group table, and inserting a pair twice changes nothing, so an update that fails half
//! way leaves nothing a CPU redo of the batch would count twice (pairs whose group never
//! made it into the group table are dropped when they are matched).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{exec_err, internal_datafusion_err};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::{
    AggregateExec, AggregateInputMode, AggregateMode, AggregateOutputMode,
};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan};
use fulmen_kernels::ops::aggregate::GroupTable;
use fulmen_kernels::{Device, KernelError};
use futures::{StreamExt, TryStreamExt};

use super::coalesce::BatchLimit;
use super::device_loop::{
    DeviceBatches, OnDevice, PieceError, PieceWork, Stopped, one_chunk, run_pieces,
};
use super::gpu_stream::{
    BatchOn, Chunk, ChunkStream, GpuMetrics, OperatorKind, count_batch, count_operator,
    device_error, device_for, input_chunks,
};
use super::once::OnceExec;
use crate::gpu::compile::Reason;

mod plan;
mod states;
mod update;

pub use plan::AggregateWork;
pub(crate) use plan::is_integer_like;
use plan::*;
pub(crate) use states::canonical_zeros;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn kernel_err(e: KernelError) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

fn arrow_err(e: datafusion::arrow::error::ArrowError) -> DataFusionError {
    DataFusionError::ArrowError(Box::new(e), None)
}

/// An aggregation on a GPU: the CPU `AggregateExec` it replaces (for its plan properties,
/// display, and the CPU fallback) and the device work.
#[derive(Debug)]
pub struct GpuAggregateExec {
    inner: Arc<dyn ExecutionPlan>,
    work: Arc<AggregateWork>,
    devices: Arc<Vec<Device>>,
    batch: BatchLimit,
    metrics: ExecutionPlanMetricsSet,
    executed: AtomicBool,
}

impl GpuAggregateExec {
    /// The GPU twin of `cpu`, or why there is none.
    pub fn try_new(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch: BatchLimit,
    ) -> Result<Self, Reason> {
        Self::planned(cpu, devices, batch, false)
    }

    /// A fused stage: the GPU twin of `cpu`, a grouped aggregate over rows whose input is a
    /// `FilterExec` (without projection or row limit) that the stage takes in. Its child is
    /// the filter's input; the device evaluates the predicate in the aggregate's program
    /// and its group table takes only the rows it keeps (see `gpu/fuse.rs`).
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
        let work = AggregateWork::plan(&cpu, fused)?;
        Ok(Self {
            inner: cpu,
            work: Arc::new(work),
            devices,
            batch,
            metrics: ExecutionPlanMetricsSet::new(),
            executed: AtomicBool::new(false),
        })
    }

    /// The predicate of the filter this stage takes in, if it is a fused stage.
    pub fn fused_filter(&self) -> Option<&Arc<dyn PhysicalExpr>> {
        self.work.fused.as_ref().map(|(p, _)| p)
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
        super::fmt_gpu_operator("GpuAggregateExec", &self.inner, &self.devices, t, f)?;
        match self.fused_filter() {
            Some(predicate) if t == DisplayFormatType::TreeRender => {
                write!(f, "\nfused_filter={predicate}")
            }
            Some(predicate) => write!(f, ", fused_filter={predicate}"),
            None => Ok(()),
        }
    }
}

impl ExecutionPlan for GpuAggregateExec {
    fn name(&self) -> &str {
        "GpuAggregateExec"
    }

    delegate_to_cpu_operator!(@properties);

    /// A fused stage's statistics: its twin filter's over the child's, then the aggregate's.
    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<datafusion::physical_plan::Statistics>],
        args: &datafusion::physical_plan::StatisticsArgs,
    ) -> Result<Arc<datafusion::physical_plan::Statistics>> {
        match self.inner.children().first() {
            Some(filter) if self.work.fused.is_some() => {
                let filtered = filter.statistics_from_inputs(input_stats, args)?;
                self.inner.statistics_from_inputs(&[filtered], args)
            }
            _ => self.inner.statistics_from_inputs(input_stats, args),
        }
    }

    /// A fused stage's child is its filter's input; otherwise the CPU twin's children.
    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        if self.work.fused.is_some() {
            return vec![self.work.device_input()];
        }
        self.inner.children()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        use datafusion::physical_plan::execution_plan::{
            ChildrenPropertiesMode, ReplaceChildrenOptions,
        };
        let recompute = || ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        let fused = self.work.fused.is_some();
        let children = match self.inner.children().first() {
            // The fused filter over the new child.
            Some(&filter) if fused => {
                vec![Arc::clone(filter).replace_children(children, recompute())?]
            }
            _ => children,
        };
        let inner = Arc::clone(&self.inner).replace_children(children, recompute())?;
        let gpu = Self::planned(inner, Arc::clone(&self.devices), self.batch, fused)
            .map_err(|reason| internal_datafusion_err!("GpuAggregateExec: {reason}"))?;
        Ok(Arc::new(gpu))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("GpuAggregateExec without a device"))?;
        let input = input_chunks(
            self.work.device_input(),
            partition,
            Arc::clone(&context),
            &self.devices,
        )?;
        let metrics = GpuMetrics::new(&self.metrics, partition, &device, &context);
        let work = metrics.work();
        let extra = ExtraMetrics::new(&self.metrics, partition, &device);
        count_operator(&self.executed, OperatorKind::Aggregate);
        super::gpu_stream::count_partition();
        let merging = self.work.cpu.mode().input_mode() == AggregateInputMode::Partial;
        let run = Run {
            work: Arc::clone(&self.work),
            device,
            partition,
            retained: merging.then(|| std::sync::Mutex::new(Vec::new())),
            batch: self.batch,
            context,
            metrics,
            extra,
        };
        let stream = futures::stream::once(run.execute(input)).try_flatten();
        Ok(work.batches(self.schema(), stream))
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
    /// Distinct (group keys…, value) pairs of the `count(DISTINCT …)` aggregates at the end.
    distinct_pairs: Count,
    /// Batches whose accumulators went through per-block shared-memory tables.
    shared_memory_batches: Count,
    /// Batches whose accumulators were updated in the global table.
    global_table_batches: Count,
    /// Batches whose program fed the accumulators from its registers in one kernel.
    fused_batches: Count,
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
            distinct_pairs: builder().counter("distinct_pairs", partition),
            shared_memory_batches: builder().counter("shared_memory_batches", partition),
            global_table_batches: builder().counter("global_table_batches", partition),
            fused_batches: builder().counter("fused_batches", partition),
            cpu_fallback: builder().counter("cpu_fallback", partition),
            spill_count: MetricBuilder::new(set).spill_count(partition),
        }
    }
}

/// One partition's run.
struct Run {
    work: Arc<AggregateWork>,
    device: Device,
    partition: usize,
    /// Merging partial states: the chunks already added to the device table, so that the
    /// groups can be merged again on the CPU should the device be lost with them (partial
    /// states are few next to raw rows; raw input is read again instead).
    retained: Option<std::sync::Mutex<Vec<Chunk>>>,
    batch: BatchLimit,
    context: Arc<TaskContext>,
    metrics: GpuMetrics,
    extra: ExtraMetrics,
}

/// A partition's device batches going into its table.
struct Adding<'a> {
    run: &'a Run,
    tables: &'a mut Tables,
}

impl Adding<'_> {
    /// Keeps a piece added for a CPU merge after the device's loss, where the aggregate
    /// merges partial states.
    fn added(&self, piece: &Chunk) {
        if let Some(retained) = &self.run.retained {
            lock(retained).push(piece.clone());
        }
    }
}

impl PieceWork for Adding<'_> {
    type Out = ();
    /// The groups are on the device: after a failure the rest goes to the CPU as a whole.
    const ON_FAILURE: Option<&'static str> = None;

    fn metrics(&self) -> &GpuMetrics {
        &self.run.metrics
    }

    fn run_on_device(&mut self, piece: &Chunk) -> Result<OnDevice<()>, PieceError> {
        let run = self.run;
        if !run
            .work
            .update(self.tables, &run.device, piece, &run.metrics)?
        {
            return Ok(OnDevice::ByRule);
        }
        self.added(piece);
        Ok(OnDevice::Out(()))
    }

    fn run_on_cpu(&mut self, piece: &Chunk, _: BatchOn) -> Result<(), PieceError> {
        let run = self.run;
        run.work
            .update_on_cpu(self.tables, &run.device, piece, &run.metrics)?;
        self.added(piece);
        Ok(())
    }
}

impl Run {
    async fn execute(self, mut input: ChunkStream) -> Result<SendableRecordBatchStream> {
        let schema = self.work.schema.clone();
        // The device table comes with the first rows: a partition without input costs the
        // device nothing (unless the aggregate has no GROUP BY, whose one row it computes).
        let mut table: Option<Tables> = None;
        // Host batches wait here to make up a device batch (see `device_loop.rs`); a device
        // chunk (from a GPU child) goes alone.
        let mut batches = DeviceBatches::new(self.batch);
        while let Some(items) = batches.next_from(&mut input, |chunk| chunk).await? {
            match self.add(&mut table, items) {
                Ok(()) => {}
                Err(Stopped::Query(e)) => return Err(e),
                Err(Stopped::Device { error, mut rest }) => {
                    self.metrics
                        .recover(&error, "the aggregation continues on the CPU")?;
                    rest.extend(batches.drain());
                    return self.fallback(table, rest, input);
                }
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
            None => match self.work.new_tables(&self.device) {
                Ok(t) => t,
                Err(e) => {
                    self.metrics.recover(&e, "aggregating on the CPU")?;
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
                // Downloading failed: the state is still on the device, intact, unless
                // the device is gone.
                let Some(device_error) = device_error(&e) else {
                    return Err(e);
                };
                if device_error.device_gone() {
                    self.metrics
                        .recover(device_error, "computing the groups on the CPU")?;
                    let lost = device_error.to_string();
                    drop(table);
                    return self.recompute(&lost, Vec::new(), input);
                }
                self.metrics
                    .recover(device_error, "retrying the download of an aggregation")?;
                match self.work.output(&table, &self.metrics) {
                    Ok(out) => out,
                    Err(e) => match super::gpu_stream::device_error(&e) {
                        Some(lost) if lost.device_gone() => {
                            let lost = lost.to_string();
                            drop(table);
                            return self.recompute(&lost, Vec::new(), input);
                        }
                        _ => return Err(e),
                    },
                }
            }
        };
        self.extra.groups.add(table.groups());
        self.extra
            .distinct_pairs
            .add(table.distinct.iter().map(GroupTable::groups).sum());
        self.extra
            .shared_memory_batches
            .add(table.groups.shared_updates as usize);
        self.extra
            .global_table_batches
            .add(table.groups.global_updates as usize);
        self.extra
            .fused_batches
            .add(table.groups.fused_updates as usize);
        drop(table);
        let batch_size = self.context.session_config().batch_size().max(1);
        let mut batches = Vec::new();
        let mut at = 0;
        while at < out.num_rows() {
            let len = batch_size.min(out.num_rows() - at);
            batches.push(Ok(out.slice(at, len)));
            at += len;
        }
        // Rows and bytes of the whole output, and the batches it is cut into.
        if !batches.is_empty() {
            self.metrics.record_batch(&out);
            self.metrics
                .baseline
                .output_batches()
                .add(batches.len() - 1);
        }
        self.metrics.baseline.done();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            schema,
            futures::stream::iter(batches),
        )))
    }

    /// Adds one device batch's items to the table (made with the first rows), through the
    /// loop every GPU operator shares (`device_loop.rs`): in halves when the device runs out
    /// of memory for it; at another device failure it stops with what was not added (whose
    /// accumulators the table does not hold: at most it holds groups for a failed piece's
    /// first keys, with empty states, and those rows are in what was not added).
    fn add(&self, table: &mut Option<Tables>, items: Vec<Chunk>) -> Result<(), Stopped> {
        let tables = match table {
            Some(tables) => tables,
            None => match self.work.new_tables(&self.device) {
                Ok(tables) => table.insert(tables),
                Err(error) => return Err(Stopped::Device { error, rest: items }),
            },
        };
        let chunk = one_chunk(items).map_err(Stopped::Query)?;
        let elapsed = self.metrics.baseline.elapsed_compute().clone();
        let _timer = elapsed.timer();
        run_pieces(&mut Adding { run: self, tables }, chunk)?;
        Ok(())
    }

    /// The device was lost with this partition's groups. Merging partial states, the CPU
    /// merges again what the device had been given (retained), then the rest; over raw
    /// input, DataFusion's AggregateExec computes the partition again from its input,
    /// executed anew (GPU operators in it find the device quarantined and run on the CPU),
    /// where that input can be read a second time. Otherwise the query fails with an error
    /// that says so: never a wrong answer.
    fn recompute(
        mut self,
        lost: &str,
        rest: Vec<Chunk>,
        input: ChunkStream,
    ) -> Result<SendableRecordBatchStream> {
        log::warn!(
            "{}: the aggregation's groups were lost with the device ({lost}); partition {} \
             is computed on the CPU",
            self.device,
            self.partition
        );
        if let Some(retained) = self.retained.take() {
            let mut again = retained.into_inner().unwrap_or_else(|p| p.into_inner());
            again.extend(rest);
            return self.fallback(None, again, input);
        }
        drop((rest, input));
        if !super::re_executable(self.work.cpu.input()) {
            return exec_err!(
                "{}: the device was lost with this aggregation's groups ({lost}), and its input \
                 cannot be read a second time; the device is quarantined, so the query runs on \
                 the CPU when it is run again",
                self.device
            );
        }
        self.extra.cpu_fallback.add(1);
        count_batch(&self.metrics, BatchOn::Fallback);
        let cpu: Arc<dyn ExecutionPlan> = Arc::clone(&self.work.cpu) as _;
        cpu.execute(self.partition, Arc::clone(&self.context))
    }

    /// Finishes on the CPU with DataFusion's AggregateExec: the device's groups so far (as
    /// partial states), the batches not yet added, and the rest of the input.
    fn fallback(
        self,
        table: Option<Tables>,
        rest: Vec<Chunk>,
        input: ChunkStream,
    ) -> Result<SendableRecordBatchStream> {
        if table.is_some()
            && let Some(reason) = self.device.quarantined()
        {
            // The groups went with the device.
            drop(table);
            return self.recompute(&reason, rest, input);
        }
        let cpu = Arc::clone(&self.work.cpu);
        let input_schema = cpu.input().schema();
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
        // The device's groups, as partial states of the schema the CPU merges them in.
        let state_schema = match mode.input_mode() {
            AggregateInputMode::Partial => Arc::clone(&input_schema),
            AggregateInputMode::Raw => aggregate(
                AggregateMode::Partial,
                cpu.group_expr().clone(),
                cpu.filter_expr().to_vec(),
                Arc::new(EmptyExec::new(Arc::clone(&input_schema))),
            )?
            .schema(),
        };
        let saved = match table
            .as_ref()
            .map(|t| self.download_states(t, &state_schema))
        {
            None => Vec::new(),
            Some(Ok(Ok(batch))) => vec![batch],
            Some(Ok(Err(lost))) => {
                drop(table);
                return self.recompute(&lost, rest, input);
            }
            Some(Err(e)) => return Err(e),
        };
        drop(table);
        self.extra.cpu_fallback.add(1);
        for _ in 0..rest.len().max(1) {
            count_batch(&self.metrics, BatchOn::Fallback);
        }
        // What is left of the input, on the host (device chunks come down).
        let metrics = self.metrics.clone();
        let work = Arc::clone(&self.work);
        let to_host = move |chunk: Result<Chunk>| {
            chunk
                .and_then(|c| c.host_for_cpu(&metrics))
                .and_then(|b| work.cpu_rows(b))
        };
        let remaining: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&input_schema),
            futures::stream::iter(rest.into_iter().map(Ok))
                .chain(input)
                .map(to_host),
        ));
        let ctx = Arc::clone(&self.context);
        let plan: Arc<dyn ExecutionPlan> = match mode.input_mode() {
            AggregateInputMode::Partial => {
                // The states merge with the input's, which has their schema.
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
        plan.execute(0, ctx)
    }

    /// The device's groups as a batch of partial states in `schema`: `Ok(Err(why))` when
    /// the device is gone with them. Another download error is retried once (the groups
    /// are still on the device), then is the query's.
    fn download_states(
        &self,
        table: &Tables,
        schema: &SchemaRef,
    ) -> Result<std::result::Result<RecordBatch, String>> {
        let first = match self.work.state_batch(table, schema, &self.metrics) {
            Ok(batch) => return Ok(Ok(batch)),
            Err(e) => e,
        };
        let Some(error) = device_error(&first) else {
            return Err(first);
        };
        self.metrics
            .recover(error, "retrying the download of the groups")?;
        if error.device_gone() {
            return Ok(Err(error.to_string()));
        }
        match self.work.state_batch(table, schema, &self.metrics) {
            Ok(batch) => Ok(Ok(batch)),
            Err(e) => match device_error(&e) {
                Some(error) if error.device_gone() => Ok(Err(error.to_string())),
                _ => Err(e),
            },
        }
    }
}
