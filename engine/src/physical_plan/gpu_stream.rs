//! What every batch-at-a-time GPU operator shares: the stream that coalesces input into
//! device batches, runs each on the partition's device, and redoes a batch on the CPU when
//! the device cannot (a fault, exhausted memory, or a row the kernel leaves to the CPU such
//! as an overflow); the chunks that pass between GPU operators. Their metrics are in
//! `gpu_metrics.rs`.
//!
//! ```text
//!   Pull ─batch─▶ coalesce to fulmen.gpu.batch_bytes/_rows ─full─▶ Process ─▶ Emit (≤ fetch)
//!    └─input ends─▶ Flush (the last partial batch) ─▶ Process ─▶ Done
//!   Process = device work; on Err or "leave to the CPU" → the operator's CPU twin
//! ```
//!
//! Coalescing and Process are the loop every GPU operator shares (`device_loop.rs`).

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use datafusion::arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::internal_err;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use fulmen_kernels::{Device, DeviceBatch, DeviceColumn, KernelError};
use futures::{Stream, StreamExt};

use super::coalesce::BatchLimit;
use super::device_loop::{DeviceBatches, OnDevice, PieceError, PieceWork, one_chunk, run_pieces};
pub use super::gpu_metrics::*;
use crate::gpu::compile::Reason;

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

impl From<RecordBatch> for Chunk {
    fn from(batch: RecordBatch) -> Self {
        Chunk::Host(batch)
    }
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

    /// Whether every column is already on `device` (a device chunk there).
    pub fn on(&self, device: &Device) -> bool {
        match self {
            Self::Host(_) => false,
            Self::Device(b, ..) => b.columns().iter().all(|c| c.device() == device),
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
                let field = schema.field(i);
                let array = metrics.download(&[(&b.columns()[i], field.data_type())])?;
                metrics.upload(device, array[0].as_ref())
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
                let wanted: Vec<_> = b
                    .columns()
                    .iter()
                    .zip(schema.fields())
                    .map(|(c, f)| (c, f.data_type()))
                    .collect();
                let columns = metrics.download(&wanted)?;
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
        // The device columns come down together, in one host wait.
        let wanted: Vec<_> = self
            .columns
            .iter()
            .zip(schema.fields())
            .filter_map(|(c, f)| match c {
                Col::Device(d) => Some((d, f.data_type())),
                Col::Host(_) => None,
            })
            .collect();
        let mut downloaded = metrics.download(&wanted)?.into_iter();
        let columns = self
            .columns
            .iter()
            .map(|c| match c {
                Col::Host(a) => Ok(Arc::clone(a)),
                Col::Device(_) => downloaded
                    .next()
                    .ok_or_else(|| KernelError::InvalidData("a column did not come down".into())),
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

    /// Whether its whole output can be made on any one of its devices from rows every
    /// device holds (a replicated cached table's scan, under row by row GPU operators).
    fn replicated(&self) -> bool {
        false
    }

    /// Its whole output (every partition's rows) made on `resident_devices()[device]` from
    /// that device's copy, when [`replicated`](Self::replicated).
    fn execute_replica(&self, device: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        let _ = (device, context);
        Err(datafusion::common::internal_datafusion_err!(
            "a plan without replicated rows was asked for a replica"
        ))
    }
}

/// The child of a GPU operator as chunks: straight from the child's device when it is a
/// GPU operator on the same devices (a device-resident stage), else its host batches.
pub fn input_chunks(
    child: &Arc<dyn ExecutionPlan>,
    partition: usize,
    context: Arc<TaskContext>,
    devices: &Arc<Vec<Device>>,
) -> Result<ChunkStream> {
    if let Some(resident) = super::resident_on(child, devices) {
        return resident.execute_chunks(partition, context);
    }
    // Every partition of GPU operators on this one device, coalesced (a one-stage
    // aggregation's input, `gpu::one_stage`): their chunks where they lie.
    use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
    if let Some(coalesce) = child.downcast_ref::<CoalescePartitionsExec>()
        && coalesce.fetch().is_none()
        && partition == 0
        && devices.len() == 1
        && let Some(resident) = super::resident_on(coalesce.input(), devices)
    {
        use datafusion::physical_plan::ExecutionPlanProperties;
        let partitions = coalesce.input().output_partitioning().partition_count();
        let streams = (0..partitions)
            .map(|p| resident.execute_chunks(p, Arc::clone(&context)))
            .collect::<Result<Vec<_>>>()?;
        return Ok(merged(streams));
    }
    Ok(Box::pin(
        child
            .execute(partition, context)?
            .map(|b| b.map(Chunk::Host)),
    ))
}

/// The chunks of `streams` as they come, each stream read by a task of its own (so that
/// the CPU work under each goes on in parallel, as under DataFusion's
/// `CoalescePartitionsExec`); a task that panics ends the stream with an error, not early.
fn merged(streams: Vec<ChunkStream>) -> ChunkStream {
    use datafusion::common::runtime::SpawnedTask;
    // Two chunks waiting, besides the one each task holds until there is room: device
    // memory for a few batches, not for every partition's run ahead of the consumer.
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let tasks: Vec<SpawnedTask<()>> = streams
        .into_iter()
        .map(|mut stream| {
            let tx = tx.clone();
            SpawnedTask::spawn(async move {
                while let Some(item) = stream.next().await {
                    let failed = item.is_err();
                    if tx.send(item).await.is_err() || failed {
                        break;
                    }
                }
            })
        })
        .collect();
    drop(tx);
    Box::pin(
        futures::stream::unfold((rx, Some(tasks)), |(mut rx, tasks)| async move {
            if let Some(item) = rx.recv().await {
                return Some((item, (rx, tasks)));
            }
            // Every sender is gone: each task ended, by its stream's end or a panic.
            for task in tasks? {
                if let Err(e) = task.join().await {
                    let e =
                        DataFusionError::Execution(format!("a coalesced partition failed: {e}"));
                    return Some((Err(e), (rx, None)));
                }
            }
            None
        })
        // Read again after its end by consumers that poll once more: still the end.
        .fuse(),
    )
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

    /// [`Self::gpu`] for a parent on the host: the output brought down (`schema`'s types).
    /// A work whose device check can come up in the download's own wait does both in one.
    fn gpu_to_host(
        &self,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
        schema: &SchemaRef,
    ) -> Result<Option<RecordBatch>, KernelError> {
        let out = self.gpu(device, input, metrics)?;
        out.map(|out| out.to_host(schema, metrics)).transpose()
    }

    /// Whether its output stays on the host even for a GPU parent (which then uploads
    /// what it reads of it): a column of it is of a type the device cannot hold.
    fn output_on_host(&self) -> bool {
        false
    }

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
    /// Input waiting to make up device batches.
    batches: DeviceBatches<Chunk>,
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
        batch: BatchLimit,
        output_rows: usize,
        fetch: Option<usize>,
        resident: bool,
        metrics: GpuMetrics,
    ) -> Self {
        count_partition();
        Self {
            schema,
            input,
            input_done: false,
            work,
            device,
            batches: DeviceBatches::new(batch),
            output_rows: output_rows.max(1),
            resident: resident && fetch.is_none(),
            ready: VecDeque::new(),
            remaining: fetch,
            metrics,
        }
    }

    /// Runs a device batch (see `device_loop.rs`) and queues its output, cut to DataFusion's
    /// batch size on the host.
    fn process(&mut self, chunk: Chunk) -> Result<()> {
        let elapsed = self.metrics.baseline.elapsed_compute().clone();
        let timer = elapsed.timer();
        let outputs = run_pieces(self, chunk);
        timer.done();
        for out in outputs? {
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
        }
        Ok(())
    }

    /// The work's output for one chunk, on the device when `resident` (and the work's
    /// output can be there), else on the host (`None`: the work left the chunk to the CPU
    /// by rule).
    fn on_device(&self, chunk: &Chunk) -> Result<Option<Chunk>, KernelError> {
        let (work, device, metrics) = (&self.work, &self.device, &self.metrics);
        if !self.resident || work.output_on_host() {
            let out = work.gpu_to_host(device, chunk, metrics, &self.schema)?;
            return Ok(out.map(Chunk::Host));
        }
        let Some(out) = work.gpu(device, chunk, metrics)? else {
            return Ok(None);
        };
        let (work, input) = (Arc::clone(work), chunk.lineage());
        let redo = Redo::new(move || work.cpu(&input.run()?));
        out.to_device(&self.schema, device, metrics, redo).map(Some)
    }

    /// Adds an input chunk, and runs the device batches it completes: host batches are
    /// coalesced (see `device_loop.rs`), a device chunk goes alone.
    fn push(&mut self, chunk: Chunk) -> Result<()> {
        self.batches.push(chunk);
        self.run_ready()
    }

    /// Runs the device batches made up so far.
    fn run_ready(&mut self) -> Result<()> {
        while let Some(items) = self.batches.pop() {
            self.process(one_chunk(items)?)?;
        }
        Ok(())
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

/// A batch operator's pieces: its device work, or its CPU twin for a piece the device
/// leaves (by rule, or after a failure).
impl<W: BatchWork> PieceWork for GpuStream<W> {
    type Out = Chunk;
    const ON_FAILURE: Option<&'static str> = Some("redoing a batch on the CPU");

    fn metrics(&self) -> &GpuMetrics {
        &self.metrics
    }

    fn run_on_device(&mut self, piece: &Chunk) -> Result<OnDevice<Chunk>, PieceError> {
        Ok(match self.on_device(piece)? {
            Some(out) => OnDevice::Out(out),
            None => OnDevice::ByRule,
        })
    }

    fn run_on_cpu(&mut self, piece: &Chunk, _: BatchOn) -> Result<Chunk, PieceError> {
        let batch = piece.host_for_cpu(&self.metrics)?;
        Ok(Chunk::Host(self.work.cpu(&batch)?))
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
                    this.batches.finish();
                    if let Err(e) = this.run_ready() {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
            }
        }
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

/// The device a partition runs on, and its stream there: partitions are spread
/// round-robin over the devices, and each partition queues its work on a stream of its
/// own (1, 2, … on each device; stream 0 is left to work that partitions share: cached
/// tables, a CollectLeft join's build side), so that its waits do not wait for the others'
/// work.
pub fn device_for(devices: &[Device], partition: usize) -> Option<Device> {
    let n = devices.len();
    (n > 0).then(|| devices[partition % n].on_stream(1 + partition / n))
}
