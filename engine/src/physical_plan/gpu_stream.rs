//! What every batch-at-a-time GPU operator shares: its metrics, and the stream that
//! coalesces input into device batches, runs each on the partition's device, and redoes
//! a batch on the CPU when the device cannot (a fault, exhausted memory, or a row the
//! kernel leaves to the CPU such as an overflow).
//!
//! ```text
//!   Pull ─batch─▶ coalesce to volley.gpu.batch_rows ─full─▶ Process ─▶ Emit (up to fetch)
//!    └─input ends─▶ Flush (the last partial batch) ─▶ Process ─▶ Done
//!   Process = device work; on Err or "leave to the CPU" → the operator's CPU twin
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use datafusion::arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions};
use datafusion::arrow::compute::{cast, concat_batches};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, Label, MetricBuilder, Time,
};
use futures::{Stream, StreamExt};
use volley_kernels::{Device, DeviceColumn, KernelError};

use crate::gpu::compile::Reason;

/// Metrics of one partition of a GPU operator, labelled with its device; EXPLAIN ANALYZE
/// shows them.
#[derive(Debug, Clone)]
pub struct GpuMetrics {
    /// Output rows and elapsed compute, as every DataFusion operator has.
    pub baseline: BaselineMetrics,
    /// Time in kernels (launch to completion).
    pub kernel_time: Time,
    /// Bytes copied host → device.
    pub h2d_bytes: Count,
    /// Time copying host → device.
    pub h2d_time: Time,
    /// Bytes copied device → host.
    pub d2h_bytes: Count,
    /// Time copying device → host.
    pub d2h_time: Time,
    /// Batches the device processed.
    pub gpu_batches: Count,
    /// Batches redone on the CPU (device fault, memory, or rows left to the CPU).
    pub cpu_batches: Count,
}

impl GpuMetrics {
    /// Registers the metrics of `partition`, which runs on `device`.
    pub fn new(set: &ExecutionPlanMetricsSet, partition: usize, device: &Device) -> Self {
        let label = || Label::new("device", device.to_string());
        let builder = || MetricBuilder::new(set).with_label(label());
        Self {
            baseline: BaselineMetrics::new(set, partition),
            kernel_time: builder().subset_time("kernel_time", partition),
            h2d_bytes: builder().counter("h2d_bytes", partition),
            h2d_time: builder().subset_time("h2d_time", partition),
            d2h_bytes: builder().counter("d2h_bytes", partition),
            d2h_time: builder().subset_time("d2h_time", partition),
            gpu_batches: builder().counter("gpu_batches", partition),
            cpu_batches: builder().counter("cpu_batches", partition),
        }
    }

    /// Uploads an Arrow column, counting its bytes and time.
    pub fn upload(
        &self,
        device: &Device,
        array: &dyn datafusion::arrow::array::Array,
    ) -> Result<DeviceColumn, KernelError> {
        let start = Instant::now();
        let column = DeviceColumn::upload(device, array)?;
        self.h2d_time.add_duration(start.elapsed());
        self.h2d_bytes.add(column.device_bytes());
        Ok(column)
    }

    /// Downloads a column as an array of `data_type` (converting back what the device
    /// holds in another layout, such as string views), counting its bytes and time.
    pub fn download(
        &self,
        column: &DeviceColumn,
        data_type: &datafusion::arrow::datatypes::DataType,
    ) -> Result<ArrayRef, KernelError> {
        let start = Instant::now();
        let array = column.to_arrow()?;
        self.d2h_time.add_duration(start.elapsed());
        self.d2h_bytes.add(column.device_bytes());
        if array.data_type() == data_type {
            Ok(array)
        } else {
            cast(&array, data_type).map_err(|e| KernelError::Unsupported(e.to_string()))
        }
    }

    /// Runs device work, counting its time as kernel time.
    pub fn kernel<T>(&self, work: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = work();
        self.kernel_time.add_duration(start.elapsed());
        out
    }
}

/// What GPU operators have done in this process, for test suites that report how much of
/// their work ran on a GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunCounts {
    /// `GpuFilterExec` operators executed (each counted once, however many partitions).
    pub filters: u64,
    /// `GpuProjectionExec` operators executed.
    pub projections: u64,
    /// `GpuAggregateExec` operators executed.
    pub aggregates: u64,
    /// `GpuHashJoinExec` operators executed.
    pub joins: u64,
    /// Partitions of GPU operators executed.
    pub partitions: u64,
    /// Batches processed on a device.
    pub gpu_batches: u64,
    /// Batches redone on the CPU.
    pub cpu_batches: u64,
}

impl fmt::Display for RunCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} filters, {} projections, {} aggregates and {} hash joins ran on a device ({} \
             partitions), {} batches on the device, {} redone on the CPU",
            self.filters,
            self.projections,
            self.aggregates,
            self.joins,
            self.partitions,
            self.gpu_batches,
            self.cpu_batches
        )
    }
}

static FILTERS: AtomicU64 = AtomicU64::new(0);
static PROJECTIONS: AtomicU64 = AtomicU64::new(0);
static AGGREGATES: AtomicU64 = AtomicU64::new(0);
static JOINS: AtomicU64 = AtomicU64::new(0);
static PARTITIONS: AtomicU64 = AtomicU64::new(0);

/// Which kind of GPU operator started executing (for [`run_counts`]).
#[derive(Debug, Clone, Copy)]
pub enum OperatorKind {
    /// `GpuFilterExec`.
    Filter,
    /// `GpuProjectionExec`.
    Projection,
    /// `GpuAggregateExec`.
    Aggregate,
    /// `GpuHashJoinExec`.
    Join,
}

/// Counts an operator the first time one of its partitions executes.
pub fn count_operator(first: &std::sync::atomic::AtomicBool, kind: OperatorKind) {
    if !first.swap(true, Ordering::Relaxed) {
        match kind {
            OperatorKind::Filter => FILTERS.fetch_add(1, Ordering::Relaxed),
            OperatorKind::Projection => PROJECTIONS.fetch_add(1, Ordering::Relaxed),
            OperatorKind::Aggregate => AGGREGATES.fetch_add(1, Ordering::Relaxed),
            OperatorKind::Join => JOINS.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// Counts a batch processed on a device (`true`) or redone on the CPU, for operators that
/// do not run through [`GpuStream`].
pub fn count_batch(on_device: bool) {
    if on_device {
        GPU_BATCHES.fetch_add(1, Ordering::Relaxed);
    } else {
        CPU_BATCHES.fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts a partition of an operator that does not run through [`GpuStream`].
pub fn count_partition() {
    PARTITIONS.fetch_add(1, Ordering::Relaxed);
}
static GPU_BATCHES: AtomicU64 = AtomicU64::new(0);
static CPU_BATCHES: AtomicU64 = AtomicU64::new(0);

/// The process-wide totals so far.
pub fn run_counts() -> RunCounts {
    RunCounts {
        filters: FILTERS.load(Ordering::Relaxed),
        projections: PROJECTIONS.load(Ordering::Relaxed),
        aggregates: AGGREGATES.load(Ordering::Relaxed),
        joins: JOINS.load(Ordering::Relaxed),
        partitions: PARTITIONS.load(Ordering::Relaxed),
        gpu_batches: GPU_BATCHES.load(Ordering::Relaxed),
        cpu_batches: CPU_BATCHES.load(Ordering::Relaxed),
    }
}

/// One operator's work on a batch, on the device and on the CPU.
pub trait BatchWork: fmt::Debug + Send + Sync + Sized + 'static {
    /// The GPU operator's name (`GpuFilterExec`).
    const NAME: &'static str;
    /// Which operator it is, for [`run_counts`].
    const KIND: OperatorKind;

    /// The work of the CPU operator `cpu`, or why the GPU cannot do it.
    fn plan(cpu: &Arc<dyn ExecutionPlan>) -> Result<Self, Reason>;

    /// Runs on `device`. `Ok(None)` means "some row is left to the CPU".
    fn gpu(
        &self,
        device: &Device,
        batch: &RecordBatch,
        metrics: &GpuMetrics,
    ) -> Result<Option<RecordBatch>, KernelError>;

    /// The same work on the CPU, with DataFusion's own kernels: the fallback, and the
    /// source of DataFusion's exact errors.
    fn cpu(&self, batch: &RecordBatch) -> Result<RecordBatch>;
}

/// The stream of a GPU operator's partition (see the module diagram).
pub struct GpuStream<W: BatchWork> {
    schema: SchemaRef,
    input: SendableRecordBatchStream,
    input_done: bool,
    work: Arc<W>,
    device: Device,
    /// Input batches waiting to make up a device batch, and their rows.
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    batch_rows: usize,
    /// DataFusion's batch size: outputs are cut to it, as operators downstream (and their
    /// memory accounting) expect.
    output_rows: usize,
    ready: VecDeque<RecordBatch>,
    remaining: Option<usize>,
    metrics: GpuMetrics,
}

impl<W: BatchWork> GpuStream<W> {
    /// A stream over `input`, emitting batches of `schema` of at most `output_rows` rows,
    /// at most `fetch` rows in all.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        schema: SchemaRef,
        input: SendableRecordBatchStream,
        work: Arc<W>,
        device: Device,
        batch_rows: usize,
        output_rows: usize,
        fetch: Option<usize>,
        metrics: GpuMetrics,
    ) -> Self {
        PARTITIONS.fetch_add(1, Ordering::Relaxed);
        Self {
            schema,
            input,
            input_done: false,
            work,
            device,
            pending: Vec::new(),
            pending_rows: 0,
            batch_rows: batch_rows.max(1),
            output_rows: output_rows.max(1),
            ready: VecDeque::new(),
            remaining: fetch,
            metrics,
        }
    }

    fn process(&mut self, batch: RecordBatch) -> Result<()> {
        let timer = self.metrics.baseline.elapsed_compute().timer();
        let out = match self.work.gpu(&self.device, &batch, &self.metrics) {
            Ok(Some(out)) => {
                self.metrics.gpu_batches.add(1);
                GPU_BATCHES.fetch_add(1, Ordering::Relaxed);
                out
            }
            outcome => {
                if let Err(e) = outcome {
                    log::warn!("{}: redoing a batch on the CPU: {e}", self.device);
                }
                self.metrics.cpu_batches.add(1);
                CPU_BATCHES.fetch_add(1, Ordering::Relaxed);
                self.work.cpu(&batch)?
            }
        };
        timer.done();
        let mut at = 0;
        while at < out.num_rows() {
            let len = self.output_rows.min(out.num_rows() - at);
            self.ready.push_back(out.slice(at, len));
            at += len;
        }
        Ok(())
    }

    /// Adds an input batch; processes the pending batches as one once they reach
    /// `batch_rows`. A batch whose schema differs from the pending ones' (DataFusion's
    /// streams may vary in field metadata or nullability) starts a new device batch.
    fn push(&mut self, batch: RecordBatch) -> Result<()> {
        if self
            .pending
            .first()
            .is_some_and(|first| first.schema() != batch.schema())
        {
            self.flush()?;
        }
        self.pending_rows += batch.num_rows();
        self.pending.push(batch);
        if self.pending_rows >= self.batch_rows {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let mut pending = std::mem::take(&mut self.pending);
        self.pending_rows = 0;
        let batch = match pending.len() {
            0 => return Ok(()),
            1 => pending.remove(0),
            _ => concat_batches(&pending[0].schema(), &pending).map_err(arrow_err)?,
        };
        self.process(batch)
    }

    fn emit(&mut self, batch: RecordBatch) -> RecordBatch {
        match self.remaining.as_mut() {
            Some(left) => {
                let take = batch.num_rows().min(*left);
                *left -= take;
                batch.slice(0, take)
            }
            None => batch,
        }
    }
}

fn arrow_err(e: datafusion::arrow::error::ArrowError) -> DataFusionError {
    DataFusionError::ArrowError(Box::new(e), None)
}

impl<W: BatchWork> Stream for GpuStream<W> {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.remaining == Some(0) {
                return Poll::Ready(None);
            }
            if let Some(batch) = this.ready.pop_front() {
                let batch = this.emit(batch);
                return this
                    .metrics
                    .baseline
                    .record_poll(Poll::Ready(Some(Ok(batch))));
            }
            if this.input_done {
                return Poll::Ready(None);
            }
            match this.input.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(batch))) => {
                    if let Err(e) = this.push(batch) {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Poll::Ready(None) => {
                    this.input_done = true;
                    if let Err(e) = this.flush() {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
            }
        }
    }
}

impl<W: BatchWork> RecordBatchStream for GpuStream<W> {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}

/// A batch of `schema` from columns, allowing zero columns (`count(*)` inputs).
pub fn make_batch(schema: &SchemaRef, columns: Vec<ArrayRef>, rows: usize) -> Result<RecordBatch> {
    RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(rows)),
    )
    .map_err(arrow_err)
}

/// The device a partition runs on: partitions are spread round-robin over the devices.
pub fn device_for(devices: &[Device], partition: usize) -> Option<Device> {
    (!devices.is_empty()).then(|| devices[partition % devices.len()].clone())
}
