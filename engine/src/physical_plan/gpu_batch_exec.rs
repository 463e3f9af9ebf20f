//! The plan node every batch-at-a-time GPU operator shares: it wraps the CPU operator it
//! replaces (whose plan properties, statistics and display it keeps) and runs the
//! operator's [`BatchWork`] through a [`GpuStream`] on the partition's device.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use datafusion::common::internal_datafusion_err;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan};
use fulmen_kernels::Device;
use futures::StreamExt;

use super::coalesce::BatchLimit;
use super::gpu_stream::{
    BatchWork, Chunk, ChunkStream, DeviceResident, GpuMetrics, GpuStream, count_operator,
    device_for, input_chunks,
};
use crate::gpu::compile::Reason;

/// A GPU operator: the CPU operator `inner` with its work done by `W` on a device.
#[derive(Debug)]
pub struct GpuBatchExec<W: BatchWork> {
    inner: Arc<dyn ExecutionPlan>,
    work: Arc<W>,
    devices: Arc<Vec<Device>>,
    batch: BatchLimit,
    fetch: Option<usize>,
    metrics: ExecutionPlanMetricsSet,
    executed: AtomicBool,
}

impl<W: BatchWork> GpuBatchExec<W> {
    /// The GPU twin of `cpu`, or why there is none.
    pub fn try_new(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch: BatchLimit,
    ) -> Result<Self, Reason> {
        if devices.is_empty() {
            return Err("no device".into());
        }
        let work = W::plan(&cpu)?;
        Ok(Self {
            fetch: cpu.fetch(),
            inner: cpu,
            work: Arc::new(work),
            devices,
            batch,
            metrics: ExecutionPlanMetricsSet::new(),
            executed: AtomicBool::new(false),
        })
    }

    /// The devices its partitions run on.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The CPU operator it stands for.
    pub fn cpu(&self) -> &Arc<dyn ExecutionPlan> {
        &self.inner
    }
}

impl<W: BatchWork> GpuBatchExec<W> {
    /// The partition's stream: its input straight from a GPU child on the same devices
    /// (or from the host), its output left on the device when `resident`.
    fn stream(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
        resident: bool,
    ) -> Result<ChunkStream> {
        let input = input_chunks(
            &self.child()?,
            partition,
            Arc::clone(&context),
            &self.devices,
        )?;
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("{} without a device", W::NAME))?;
        self.stream_over(input, device, partition, context, resident)
    }

    fn child(&self) -> Result<Arc<dyn ExecutionPlan>> {
        (self.inner.children().first().map(|c| Arc::clone(*c)))
            .ok_or_else(|| internal_datafusion_err!("{} without an input", W::NAME))
    }

    /// The child on the same devices, when it is a GPU operator there.
    fn resident_child(&self) -> Option<Arc<dyn ExecutionPlan>> {
        (self.child().ok()).filter(|c| super::resident_on(c, &self.devices).is_some())
    }

    /// The child, when this operator has no limit and the child can make its whole output
    /// on any one device (see [`DeviceResident::replicated`]).
    fn replica_child(&self) -> Option<Arc<dyn ExecutionPlan>> {
        (self.resident_child().filter(|_| self.fetch.is_none()))
            .filter(|c| super::resident(c).is_some_and(|r| r.replicated()))
    }

    /// The stream of `input` on `device` (and its stream), metered as `partition`'s.
    fn stream_over(
        &self,
        input: ChunkStream,
        device: Device,
        partition: usize,
        context: Arc<TaskContext>,
        resident: bool,
    ) -> Result<ChunkStream> {
        let metrics = GpuMetrics::new(&self.metrics, partition, &device, &context);
        count_operator(&self.executed, W::KIND);
        Ok(metrics.work().chunks(Box::pin(GpuStream::new(
            self.schema(),
            input,
            Arc::clone(&self.work),
            device,
            self.batch,
            context.session_config().batch_size(),
            self.fetch,
            resident,
            metrics,
        ))))
    }
}

impl<W: BatchWork> DeviceResident for GpuBatchExec<W> {
    fn execute_chunks(&self, partition: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        self.stream(partition, context, self.fetch.is_none())
    }

    fn resident_devices(&self) -> &Arc<Vec<Device>> {
        &self.devices
    }

    /// Row by row operators (no limit) over a replicated table's scan.
    fn replicated(&self) -> bool {
        self.replica_child().is_some()
    }

    fn execute_replica(&self, device: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        let child = (self.replica_child())
            .ok_or_else(|| internal_datafusion_err!("{} is not over a replica", W::NAME))?;
        let input = (super::resident(&child)
            .map(|r| r.execute_replica(device, Arc::clone(&context))))
        .ok_or_else(|| internal_datafusion_err!("{} is not over a replica", W::NAME))??;
        // On the device's shared stream: a replica feeds a build side that every partition
        // of the device reads.
        let on = (self.devices.get(device).map(|d| d.on_stream(0)))
            .ok_or_else(|| internal_datafusion_err!("{} has no device {device}", W::NAME))?;
        self.stream_over(input, on, device, context, true)
    }
}

impl<W: BatchWork> DisplayAs for GpuBatchExec<W> {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        super::fmt_gpu_operator(W::NAME, &self.inner, &self.devices, t, f)
    }
}

impl<W: BatchWork> ExecutionPlan for GpuBatchExec<W> {
    fn name(&self) -> &str {
        W::NAME
    }

    delegate_to_cpu_operator!(W::NAME);

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let chunks = self.stream(partition, context, false)?;
        let batches = chunks.map(|chunk| match chunk? {
            Chunk::Host(batch) => Ok(batch),
            Chunk::Device(..) => Err(internal_datafusion_err!(
                "{} gave a device chunk to a host consumer",
                W::NAME
            )),
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            batches,
        )))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn fetch(&self) -> Option<usize> {
        self.fetch
    }
}
