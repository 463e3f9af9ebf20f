//! The metrics of GPU operators: per partition (`GpuMetrics`, shown by EXPLAIN ANALYZE, with
//! the device work each operator's stream makes while polled) and per process (how many
//! operators, partitions and batches ran on a device, for test suites).

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use datafusion::arrow::array::{ArrayRef, RecordBatch};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, Label, MetricBuilder, Time,
};
use fulmen_kernels::{Device, DeviceColumn, KernelError};
use futures::{Stream, StreamExt};

use super::gpu_stream::{Chunk, ChunkStream};
use crate::config::{FulmenConfig, OnError};

/// Metrics of one partition of a GPU operator, labelled with its device; EXPLAIN ANALYZE
/// shows them.
#[derive(Debug, Clone)]
pub struct GpuMetrics {
    /// Output rows and elapsed compute, as every DataFusion operator has.
    pub baseline: BaselineMetrics,
    /// Time in the operator's device work: queuing its launches and uploads, and the waits
    /// within that work for values it reads (row counts, flags). Launches do not wait, so
    /// a kernel's own run time falls in whichever wait follows it, here or in `d2h_time`.
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
    /// Device batches split in halves because they did not fit in device memory (each
    /// half is then a batch of its own; see `coalesce::halves`).
    pub split_batches: Count,
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
    /// Times the partition's stream waited, on the device, for another stream's work.
    pub stream_waits: Count,
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
            split_batches: builder().counter("split_batches", partition),
            cpu_batches: builder().counter("cpu_batches", partition),
            cpu_rule_batches: builder().counter("cpu_rule_batches", partition),
            device_errors: builder().counter("device_errors", partition),
            launches: builder().counter("launches", partition),
            syncs: builder().counter("syncs", partition),
            stream_waits: builder().counter("stream_waits", partition),
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

    /// Downloads device columns (timed), all in one host wait, cast to the host types the
    /// schema expects (strings come back as Utf8 where the plan wants Utf8View).
    pub fn download(
        &self,
        columns: &[(&DeviceColumn, &datafusion::arrow::datatypes::DataType)],
    ) -> Result<Vec<ArrayRef>, KernelError> {
        Ok(self.download_with_indices(&[], columns)?.1)
    }

    /// [`Self::download`], and the index lists `lists` brought to the host in the same wait
    /// (a join's pairs with the probe rows they index).
    #[allow(clippy::type_complexity)]
    pub fn download_with_indices(
        &self,
        lists: &[&fulmen_kernels::ops::RowIndices],
        columns: &[(&DeviceColumn, &datafusion::arrow::datatypes::DataType)],
    ) -> Result<(Vec<Vec<u32>>, Vec<ArrayRef>), KernelError> {
        let start = Instant::now();
        let device: Vec<&DeviceColumn> = columns.iter().map(|(c, _)| *c).collect();
        let (lists, arrays) = fulmen_kernels::ops::RowIndices::all_to_host_with(lists, &device)?;
        self.d2h_time.add_duration(start.elapsed());
        Ok((lists, host_typed(arrays, columns)?))
    }

    /// [`Self::download`] with the two words of a status buffer a program wrote (see
    /// `fulmen_kernels::ops::download_checked`), all in one host wait: `None` when the
    /// program left the batch to the CPU. The wait, in which the queued program runs out,
    /// counts as `d2h_time` and as the device's work time (not as `kernel_time`).
    pub fn download_checked(
        &self,
        device: &Device,
        columns: &[(&DeviceColumn, &datafusion::arrow::datatypes::DataType)],
        status: &fulmen_kernels::DeviceBuffer,
    ) -> Result<Option<Vec<ArrayRef>>, KernelError> {
        let start = Instant::now();
        let device_columns: Vec<&DeviceColumn> = columns.iter().map(|(c, _)| *c).collect();
        let arrays = fulmen_kernels::ops::download_checked(device, &device_columns, status)?;
        self.d2h_time.add_duration(start.elapsed());
        self.device.add_work_time(start.elapsed());
        arrays.map(|a| host_typed(a, columns)).transpose()
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

    /// The counters a [`Metered`] stream adds the operator's device work to, and the
    /// stream of its device that work goes on (the partition's, see `device_for`).
    pub fn work(&self) -> DeviceWork {
        DeviceWork {
            stream: self.device.stream_index(),
            launches: self.launches.clone(),
            syncs: self.syncs.clone(),
            stream_waits: self.stream_waits.clone(),
            h2d_bytes: self.h2d_bytes.clone(),
            d2h_bytes: self.d2h_bytes.clone(),
            device_bytes: self.device_bytes.clone(),
        }
    }

    /// Runs device work, counting its time as kernel time.
    pub fn kernel<T>(&self, work: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = work();
        let elapsed = start.elapsed();
        self.kernel_time.add_duration(elapsed);
        self.device.add_work_time(elapsed);
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

/// The metrics one operator partition's device work goes to (see [`GpuMetrics::work`]).
#[derive(Debug, Clone)]
pub struct DeviceWork {
    /// The device stream the partition's work goes on.
    stream: usize,
    launches: Count,
    syncs: Count,
    stream_waits: Count,
    h2d_bytes: Count,
    d2h_bytes: Count,
    device_bytes: Count,
}

impl DeviceWork {
    fn add(&self, c: &fulmen_kernels::DeviceCounts) {
        self.launches.add(c.launches as usize);
        self.syncs.add(c.syncs as usize);
        self.stream_waits.add(c.stream_waits as usize);
        self.h2d_bytes.add(c.h2d_bytes as usize);
        self.d2h_bytes.add(c.d2h_bytes as usize);
        self.device_bytes.add(c.device_bytes as usize);
    }

    /// `stream`, with every device call made while it is polled counted for this operator
    /// partition (a child operator's work counts for the child: its stream is metered too)
    /// and queued on the partition's device stream (a child's on its own).
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

/// A stream whose polls count their device calls ([`fulmen_kernels::device::metered`]) and
/// queue them on the partition's device stream ([`fulmen_kernels::device::in_stream`]):
/// all of an operator's device work happens while its stream is polled.
struct Metered<S> {
    inner: S,
    work: DeviceWork,
}

impl<S: Stream + Unpin> Stream for Metered<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let (item, counts) = fulmen_kernels::device::in_stream(this.work.stream, || {
            fulmen_kernels::device::metered(|| this.inner.poll_next_unpin(cx))
        });
        this.work.add(&counts);
        item
    }
}

/// Downloaded arrays cast to the host types the plan expects (strings come back as Utf8
/// where it wants Utf8View).
fn host_typed(
    arrays: Vec<ArrayRef>,
    columns: &[(&DeviceColumn, &datafusion::arrow::datatypes::DataType)],
) -> Result<Vec<ArrayRef>, KernelError> {
    (arrays.into_iter().zip(columns))
        .map(
            |(array, (_, data_type))| match array.data_type() == *data_type {
                true => Ok(array),
                false => {
                    cast(&array, data_type).map_err(|e| KernelError::Unsupported(e.to_string()))
                }
            },
        )
        .collect()
}
