//! What every batch-at-a-time GPU operator shares: its metrics, and the stream that
//! coalesces input into device batches, runs each on the partition's device, and redoes
//! a batch on the CPU when the device cannot (a fault, exhausted memory, or a row the
//! kernel leaves to the CPU such as an overflow).
//!
//! ```text
//!   Pull ─batch─▶ coalesce to fulmen.gpu.batch_rows ─full─▶ Process ─▶ Emit (up to fetch)
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
use datafusion::common::internal_err;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, Label, MetricBuilder, Time,
};
use fulmen_kernels::{Device, DeviceBatch, DeviceColumn, KernelError};
use futures::{Stream, StreamExt};

use crate::config::{FulmenConfig, OnError};
use crate::gpu::compile::Reason;

/// Metrics of one partition of a GPU operator, labelled with its device; EXPLAIN ANALYZE
/// shows them.
#[derive(Debug, Clone)]
pub struct GpuMetrics {
    /// Output rows and elapsed compute, as every DataFusion operator has.
    pub baseline: BaselineMetrics,
    /// Time in kernels (launch to completion).
    pub kernel_time: Time,
    /// Bytes copied host → device (columns, programs, descriptor tables: every copy).
    pub h2d_bytes: Count,
    /// Time copying columns host → device.
    pub h2d_time: Time,
    /// Bytes copied device → host (every copy: columns, counts, flags).
    pub d2h_bytes: Count,
    /// Time copying device → host.
    pub d2h_time: Time,
    /// Batches the device processed.
    pub gpu_batches: Count,
    /// Batches redone on the CPU because the device could not do them (exhausted memory,
    /// an injected fault, or a device error with `fulmen.gpu.on_error = fallback`).
    pub cpu_batches: Count,
    /// Batches a program handed to the CPU by rule: some row needs DataFusion's exact
    /// answer or error (an overflow, a division by zero), which the device leaves to it.
    pub cpu_rule_batches: Count,
    /// Device errors (not exhausted memory, not injected faults) after which work was
    /// redone on the CPU.
    pub device_errors: Count,
    /// Kernel launches.
    pub launches: Count,
    /// Times the host waited for the device.
    pub syncs: Count,
    /// The sizes of the buffers launches were given, summed: the device memory the
    /// operator's kernels may read and write.
    pub device_bytes: Count,
    device: Device,
    on_error: OnError,
}

impl GpuMetrics {
    /// Registers the metrics of `partition`, which runs on `device` under the settings of
    /// `context` (`fulmen.gpu.on_error`).
    pub fn new(
        set: &ExecutionPlanMetricsSet,
        partition: usize,
        device: &Device,
        context: &TaskContext,
    ) -> Self {
        let label = || Label::new("device", device.to_string());
        let builder = || MetricBuilder::new(set).with_label(label());
        let on_error = context
            .session_config()
            .options()
            .extensions
            .get::<FulmenConfig>()
            .map(|c| c.gpu_on_error)
            .unwrap_or_default();
        Self {
            baseline: BaselineMetrics::new(set, partition),
            kernel_time: builder().subset_time("kernel_time", partition),
            h2d_bytes: builder().counter("h2d_bytes", partition),
            h2d_time: builder().subset_time("h2d_time", partition),
            d2h_bytes: builder().counter("d2h_bytes", partition),
            d2h_time: builder().subset_time("d2h_time", partition),
            gpu_batches: builder().counter("gpu_batches", partition),
            cpu_batches: builder().counter("cpu_batches", partition),
            cpu_rule_batches: builder().counter("cpu_rule_batches", partition),
            device_errors: builder().counter("device_errors", partition),
            launches: builder().counter("launches", partition),
            syncs: builder().counter("syncs", partition),
            device_bytes: builder().counter("device_bytes", partition),
            device: device.clone(),
            on_error,
        }
    }

    /// What a device error means for the work at hand (`doing`, such as "redoing a batch
    /// on the CPU"): `Ok(())` when the work is to be redone on the CPU, `Err` when the
    /// query must fail instead. Exhausted memory and injected faults are ordinary outcomes
    /// and always fall back. Any other error is counted for the device and, with
    /// `fulmen.gpu.on_error = fallback`, logged with its kernel; with `fail` it is the
    /// query's error.
    pub fn recover(&self, error: &KernelError, doing: &str) -> Result<()> {
        if error.is_expected() {
            log::debug!("{}: {doing}: {error}", self.device);
            return Ok(());
        }
        self.device.count_error();
        self.device_errors.add(1);
        let kernel = error.kernel().unwrap_or("(no kernel)");
        match self.on_error {
            OnError::Fallback => {
                log::warn!(
                    "{}: device error in {kernel}, {doing}: {error}",
                    self.device
                );
                Ok(())
            }
            OnError::Fail => Err(DataFusionError::Execution(format!(
                "{}: device error in {kernel}: {error} (fulmen.gpu.on_error is fail; with \
                 fallback the work would be redone on the CPU)",
                self.device
            ))),
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
        if array.data_type() == data_type {
            Ok(array)
        } else {
            cast(&array, data_type).map_err(|e| KernelError::Unsupported(e.to_string()))
        }
    }

    /// Counts an output chunk as DataFusion's operators count a batch: its rows, one
    /// batch, and (for a host batch) its bytes; a device chunk's bytes are in no host
    /// memory, and `output_bytes` leaves them out.
    pub fn record_chunk(&self, chunk: &Chunk) {
        match chunk {
            Chunk::Host(b) => self.record_batch(b),
            Chunk::Device(b, ..) => {
                self.baseline.record_output(b.num_rows());
                self.baseline.output_batches().add(1);
            }
        }
    }

    /// Counts an output batch: its rows, one batch, and its bytes.
    pub fn record_batch(&self, batch: &RecordBatch) {
        use datafusion::physical_plan::metrics::RecordOutput;
        let _ = batch.record_output(&self.baseline);
    }

    /// The counters a [`Metered`] stream adds the operator's device work to.
    pub fn work(&self) -> DeviceWork {
        DeviceWork {
            launches: self.launches.clone(),
            syncs: self.syncs.clone(),
            h2d_bytes: self.h2d_bytes.clone(),
            d2h_bytes: self.d2h_bytes.clone(),
            device_bytes: self.device_bytes.clone(),
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
    /// Batches redone on the CPU because the device could not do them.
    pub cpu_batches: u64,
    /// Batches a program handed to the CPU by rule (overflow, division by zero).
    pub cpu_rule_batches: u64,
}

impl fmt::Display for RunCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} filters, {} projections, {} aggregates and {} hash joins ran on a device ({} \
             partitions), {} batches on the device, {} redone on the CPU after a device \
             failure, {} handed to the CPU by rule",
            self.filters,
            self.projections,
            self.aggregates,
            self.joins,
            self.partitions,
            self.gpu_batches,
            self.cpu_batches,
            self.cpu_rule_batches
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

/// The device error inside a query error, if it is one (device work reports its errors
/// as `DataFusionError::External(KernelError)`).
pub fn device_error(error: &DataFusionError) -> Option<&KernelError> {
    match error {
        DataFusionError::External(e) => e.downcast_ref::<KernelError>(),
        DataFusionError::Shared(e) => device_error(e),
        DataFusionError::Context(_, e) => device_error(e),
        _ => None,
    }
}

/// Where a batch of a GPU operator was done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchOn {
    /// On the device.
    Device,
    /// Redone on the CPU because the device could not do it.
    Fallback,
    /// On the CPU by rule: a program left some row to DataFusion.
    Rule,
}

/// Counts a batch in the process-wide totals and in `metrics`.
pub fn count_batch(metrics: &GpuMetrics, on: BatchOn) {
    let (total, metric) = match on {
        BatchOn::Device => (&GPU_BATCHES, &metrics.gpu_batches),
        BatchOn::Fallback => (&CPU_BATCHES, &metrics.cpu_batches),
        BatchOn::Rule => (&CPU_RULE_BATCHES, &metrics.cpu_rule_batches),
    };
    total.fetch_add(1, Ordering::Relaxed);
    metric.add(1);
}

/// Counts a partition of an operator that does not run through [`GpuStream`].
pub fn count_partition() {
    PARTITIONS.fetch_add(1, Ordering::Relaxed);
}
static GPU_BATCHES: AtomicU64 = AtomicU64::new(0);
static CPU_BATCHES: AtomicU64 = AtomicU64::new(0);
static CPU_RULE_BATCHES: AtomicU64 = AtomicU64::new(0);

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
        cpu_rule_batches: CPU_RULE_BATCHES.load(Ordering::Relaxed),
    }
}

/// A batch passed from one operator to the next: on the host, or still on a device (a
/// GPU operator's output that its GPU parent consumes without a trip through the host).
#[derive(Debug, Clone)]
pub enum Chunk {
    /// Host columns.
    Host(RecordBatch),
    /// Device columns (in their device types: strings for string views), the host schema
    /// they stand for, and how to compute the same batch on the CPU should the device be
    /// lost before the consumer has read it.
    Device(DeviceBatch, SchemaRef, Redo),
}

/// How to compute a device chunk's batch on the CPU instead: what the producing operator's
/// CPU twin makes of the producer's input (kept only while the chunk is in flight).
#[derive(Clone, Default)]
pub struct Redo(Option<Arc<dyn Fn() -> Result<RecordBatch> + Send + Sync>>);

impl Redo {
    /// A redo that runs `cpu`. It must hold host data only (a host batch, or another
    /// chunk's redo), never device buffers: it outlives what it stands for on the device.
    pub fn new(cpu: impl Fn() -> Result<RecordBatch> + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(cpu)))
    }

    /// Computes the batch on the CPU.
    pub fn run(&self) -> Result<RecordBatch> {
        match &self.0 {
            Some(cpu) => cpu(),
            None => internal_err!("a device chunk lost with its device has no CPU redo"),
        }
    }
}

impl fmt::Debug for Redo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Redo" } else { "NoRedo" })
    }
}

impl Chunk {
    /// Rows.
    pub fn num_rows(&self) -> usize {
        match self {
            Self::Host(b) => b.num_rows(),
            Self::Device(b, ..) => b.num_rows(),
        }
    }

    /// The host schema.
    pub fn schema(&self) -> SchemaRef {
        match self {
            Self::Host(b) => b.schema(),
            Self::Device(_, s, _) => Arc::clone(s),
        }
    }

    /// Column `i` on `device`: uploaded from the host (counted), or the device column
    /// itself (shared, not copied).
    pub fn device_column(
        &self,
        i: usize,
        device: &Device,
        metrics: &GpuMetrics,
    ) -> Result<DeviceColumn, KernelError> {
        match self {
            Self::Host(b) => metrics.upload(device, b.column(i).as_ref()),
            Self::Device(b, ..) if b.columns()[i].device() == device => Ok(b.columns()[i].clone()),
            Self::Device(b, schema, _) => {
                // Another device: through the host.
                let array = metrics.download(&b.columns()[i], schema.field(i).data_type())?;
                metrics.upload(device, array.as_ref())
            }
        }
    }

    /// The batch on the host for the CPU to work on: a device chunk is downloaded (and
    /// counted), or, when its device is gone, computed again on the CPU from its producer's
    /// input.
    pub fn host_for_cpu(&self, metrics: &GpuMetrics) -> Result<RecordBatch> {
        match (self.to_host(metrics), self) {
            (Ok(batch), _) => Ok(batch),
            (Err(e), Self::Device(_, _, redo)) => {
                metrics.recover(&e, "computing a device chunk again on the CPU")?;
                redo.run()
            }
            (Err(e), Self::Host(_)) => Err(DataFusionError::External(Box::new(e))),
        }
    }

    /// How to have this chunk's rows on the host without its device: the host batch
    /// itself, or the device chunk's redo (host data only, so that holding it keeps no
    /// device memory).
    pub fn lineage(&self) -> Redo {
        match self {
            Self::Host(b) => {
                let batch = b.clone();
                Redo::new(move || Ok(batch.clone()))
            }
            Self::Device(_, _, redo) => redo.clone(),
        }
    }

    /// The batch on the host (a device chunk is downloaded, and counted).
    pub fn to_host(&self, metrics: &GpuMetrics) -> Result<RecordBatch, KernelError> {
        match self {
            Self::Host(b) => Ok(b.clone()),
            Self::Device(b, schema, _) => {
                let columns = b
                    .columns()
                    .iter()
                    .zip(schema.fields())
                    .map(|(c, f)| metrics.download(c, f.data_type()))
                    .collect::<Result<Vec<_>, _>>()?;
                make_batch(schema, columns, b.num_rows())
                    .map_err(|e| KernelError::InvalidData(e.to_string()))
            }
        }
    }

    /// A host batch to evaluate per-batch constants against (scalar subqueries do not
    /// read it): the batch itself, or an empty one of its schema.
    pub fn host_view(&self) -> RecordBatch {
        match self {
            Self::Host(b) => b.clone(),
            Self::Device(_, schema, _) => RecordBatch::new_empty(Arc::clone(schema)),
        }
    }
}

/// A stream of chunks.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<Chunk>> + Send>>;

/// One output column of a GPU operator's batch: where it already is.
#[derive(Debug, Clone)]
pub enum Col {
    /// On the host (a column passed through, a constant).
    Host(ArrayRef),
    /// On the device.
    Device(DeviceColumn),
}

/// A GPU operator's output for one batch, before it goes down to the host or on to a GPU
/// parent.
#[derive(Debug, Clone)]
pub struct Output {
    /// The columns, in the operator's schema order.
    pub columns: Vec<Col>,
    /// Rows.
    pub rows: usize,
}

impl Output {
    /// The output on the host: device columns downloaded (counted).
    pub fn to_host(
        &self,
        schema: &SchemaRef,
        metrics: &GpuMetrics,
    ) -> Result<RecordBatch, KernelError> {
        let columns = self
            .columns
            .iter()
            .zip(schema.fields())
            .map(|(c, f)| match c {
                Col::Host(a) => Ok(Arc::clone(a)),
                Col::Device(d) => metrics.download(d, f.data_type()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        make_batch(schema, columns, self.rows).map_err(|e| KernelError::InvalidData(e.to_string()))
    }

    /// The output on `device`: host columns uploaded (counted); `redo` computes it on the
    /// CPU should the device be lost before the consumer reads it.
    pub fn to_device(
        &self,
        schema: &SchemaRef,
        device: &Device,
        metrics: &GpuMetrics,
        redo: Redo,
    ) -> Result<Chunk, KernelError> {
        let columns = self
            .columns
            .iter()
            .map(|c| match c {
                Col::Host(a) => metrics.upload(device, a.as_ref()),
                Col::Device(d) => Ok(d.clone()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fields: Vec<_> = schema
            .fields()
            .iter()
            .zip(&columns)
            .map(|(f, c)| f.as_ref().clone().with_data_type(c.data_type().clone()))
            .collect();
        let device_schema = Arc::new(datafusion::arrow::datatypes::Schema::new(fields));
        let batch = DeviceBatch::try_new(device_schema, columns, self.rows)?;
        Ok(Chunk::Device(batch, Arc::clone(schema), redo))
    }
}

/// GPU operators whose output can stay on the device for a GPU parent.
pub trait DeviceResident {
    /// The partition's output as chunks, left on the partition's device where they are
    /// (a batch redone on the CPU comes as a host chunk).
    fn execute_chunks(&self, partition: usize, context: Arc<TaskContext>) -> Result<ChunkStream>;

    /// The devices its partitions run on.
    fn resident_devices(&self) -> &Arc<Vec<Device>>;
}

/// The child of a GPU operator as chunks: straight from the child's device when it is a
/// GPU operator on the same devices (a device-resident stage), else its host batches.
pub fn input_chunks(
    child: &Arc<dyn ExecutionPlan>,
    partition: usize,
    context: Arc<TaskContext>,
    devices: &Arc<Vec<Device>>,
) -> Result<ChunkStream> {
    if let Some(resident) = super::resident(child)
        && resident.resident_devices().as_slice() == devices.as_slice()
    {
        return resident.execute_chunks(partition, context);
    }
    Ok(Box::pin(
        child
            .execute(partition, context)?
            .map(|b| b.map(Chunk::Host)),
    ))
}

/// One operator's work on a batch, on the device and on the CPU.
pub trait BatchWork: fmt::Debug + Send + Sync + Sized + 'static {
    /// The GPU operator's name (`GpuFilterExec`).
    const NAME: &'static str;
    /// Which operator it is, for [`run_counts`].
    const KIND: OperatorKind;

    /// The work of the CPU operator `cpu`, or why the GPU cannot do it.
    fn plan(cpu: &Arc<dyn ExecutionPlan>) -> Result<Self, Reason>;

    /// Runs on `device` over a host or device chunk. `Ok(None)` means "some row is left
    /// to the CPU".
    fn gpu(
        &self,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<Option<Output>, KernelError>;

    /// The same work on the CPU, with DataFusion's own kernels: the fallback, and the
    /// source of DataFusion's exact errors.
    fn cpu(&self, batch: &RecordBatch) -> Result<RecordBatch>;
}

/// The stream of a GPU operator's partition (see the module diagram). Its output stays on
/// the device when `resident` (a GPU parent consumes it), else comes to the host, cut to
/// DataFusion's batch size.
pub struct GpuStream<W: BatchWork> {
    schema: SchemaRef,
    input: ChunkStream,
    input_done: bool,
    work: Arc<W>,
    device: Device,
    /// Host batches waiting to make up a device batch, and their rows.
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    batch_rows: usize,
    /// DataFusion's batch size: outputs are cut to it, as operators downstream (and their
    /// memory accounting) expect.
    output_rows: usize,
    resident: bool,
    ready: VecDeque<Chunk>,
    remaining: Option<usize>,
    metrics: GpuMetrics,
}

impl<W: BatchWork> GpuStream<W> {
    /// A stream over `input`, emitting batches of `schema` of at most `output_rows` rows,
    /// at most `fetch` rows in all (`resident`: device chunks, and no `fetch`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        schema: SchemaRef,
        input: ChunkStream,
        work: Arc<W>,
        device: Device,
        batch_rows: usize,
        output_rows: usize,
        fetch: Option<usize>,
        resident: bool,
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
            resident: resident && fetch.is_none(),
            ready: VecDeque::new(),
            remaining: fetch,
            metrics,
        }
    }

    fn process(&mut self, chunk: Chunk) -> Result<()> {
        let timer = self.metrics.baseline.elapsed_compute().timer();
        let done = self
            .work
            .gpu(&self.device, &chunk, &self.metrics)
            .and_then(|out| match out {
                None => Ok(None),
                Some(out) if self.resident => {
                    let (work, input) = (Arc::clone(&self.work), chunk.lineage());
                    let redo = Redo::new(move || work.cpu(&input.run()?));
                    out.to_device(&self.schema, &self.device, &self.metrics, redo)
                        .map(Some)
                }
                Some(out) => out
                    .to_host(&self.schema, &self.metrics)
                    .map(|b| Some(Chunk::Host(b))),
            });
        let out = match done {
            Ok(Some(out)) => {
                count_batch(&self.metrics, BatchOn::Device);
                out
            }
            outcome => {
                match outcome {
                    Err(e) => {
                        self.metrics.recover(&e, "redoing a batch on the CPU")?;
                        count_batch(&self.metrics, BatchOn::Fallback);
                    }
                    _ => count_batch(&self.metrics, BatchOn::Rule),
                }
                let batch = chunk.host_for_cpu(&self.metrics)?;
                Chunk::Host(self.work.cpu(&batch)?)
            }
        };
        timer.done();
        match out {
            Chunk::Host(out) => {
                let mut at = 0;
                while at < out.num_rows() {
                    let len = self.output_rows.min(out.num_rows() - at);
                    self.ready.push_back(Chunk::Host(out.slice(at, len)));
                    at += len;
                }
            }
            device => self.ready.push_back(device),
        }
        Ok(())
    }

    /// Adds an input chunk. Host batches are coalesced until they reach `batch_rows` (a
    /// batch whose schema differs from the pending ones' starts a new device batch:
    /// DataFusion's streams may vary in field metadata or nullability); a device chunk is
    /// processed as it is.
    fn push(&mut self, chunk: Chunk) -> Result<()> {
        let batch = match chunk {
            Chunk::Host(b) => b,
            device => {
                self.flush()?;
                return self.process(device);
            }
        };
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
        self.process(Chunk::Host(batch))
    }

    fn emit(&mut self, chunk: Chunk) -> Chunk {
        match (self.remaining.as_mut(), chunk) {
            (Some(left), Chunk::Host(batch)) => {
                let take = batch.num_rows().min(*left);
                *left -= take;
                Chunk::Host(batch.slice(0, take))
            }
            (_, chunk) => chunk,
        }
    }
}

fn arrow_err(e: datafusion::arrow::error::ArrowError) -> DataFusionError {
    DataFusionError::ArrowError(Box::new(e), None)
}

impl<W: BatchWork> Stream for GpuStream<W> {
    type Item = Result<Chunk>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.remaining == Some(0) {
                return Poll::Ready(None);
            }
            if let Some(chunk) = this.ready.pop_front() {
                let chunk = this.emit(chunk);
                this.metrics.record_chunk(&chunk);
                return Poll::Ready(Some(Ok(chunk)));
            }
            if this.input_done {
                this.metrics.baseline.done();
                return Poll::Ready(None);
            }
            match this.input.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(chunk))) => {
                    if let Err(e) = this.push(chunk) {
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

/// The metrics one operator partition's device work goes to (see [`GpuMetrics::work`]).
#[derive(Debug, Clone)]
pub struct DeviceWork {
    launches: Count,
    syncs: Count,
    h2d_bytes: Count,
    d2h_bytes: Count,
    device_bytes: Count,
}

impl DeviceWork {
    fn add(&self, c: &fulmen_kernels::DeviceCounts) {
        self.launches.add(c.launches as usize);
        self.syncs.add(c.syncs as usize);
        self.h2d_bytes.add(c.h2d_bytes as usize);
        self.d2h_bytes.add(c.d2h_bytes as usize);
        self.device_bytes.add(c.device_bytes as usize);
    }

    /// `stream`, with every device call made while it is polled counted for this operator
    /// partition (a child operator's work counts for the child: its stream is metered too).
    pub fn chunks(self, stream: ChunkStream) -> ChunkStream {
        Box::pin(Metered {
            inner: stream,
            work: self,
        })
    }

    /// As [`DeviceWork::chunks`], for a stream of host batches.
    pub fn batches(
        self,
        schema: SchemaRef,
        stream: impl Stream<Item = Result<RecordBatch>> + Send + 'static,
    ) -> datafusion::execution::SendableRecordBatchStream {
        Box::pin(
            datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
                schema,
                Metered {
                    inner: Box::pin(stream),
                    work: self,
                },
            ),
        )
    }
}

/// A stream whose polls count their device calls ([`fulmen_kernels::device::metered`]):
/// all of an operator's device work happens while its stream is polled.
struct Metered<S> {
    inner: S,
    work: DeviceWork,
}

impl<S: Stream + Unpin> Stream for Metered<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let (item, counts) = fulmen_kernels::device::metered(|| this.inner.poll_next_unpin(cx));
        this.work.add(&counts);
        item
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
