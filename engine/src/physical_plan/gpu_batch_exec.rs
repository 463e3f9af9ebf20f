//! The plan node every batch-at-a-time GPU operator shares: it wraps the CPU operator it
//! replaces (whose plan properties, statistics and display it keeps) and runs the
//! operator's [`BatchWork`] through a [`GpuStream`] on the partition's device.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use datafusion::common::internal_datafusion_err;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::display::DisplayableExecutionPlan;
use datafusion::physical_plan::distribution_requirements::InputDistributionRequirements;
use datafusion::physical_plan::execution_plan::{
    CardinalityEffect, ChildrenPropertiesMode, ReplaceChildrenOptions,
};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildStats, DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, Statistics,
    StatisticsArgs,
};
use futures::StreamExt;
use volley_kernels::Device;

use super::gpu_stream::{
    BatchWork, Chunk, ChunkStream, DeviceResident, GpuMetrics, GpuStream, count_operator,
    device_for, input_chunks,
};
use crate::gpu::compile::Reason;
use crate::gpu::devices::describe;

/// A GPU operator: the CPU operator `inner` with its work done by `W` on a device.
#[derive(Debug)]
pub struct GpuBatchExec<W: BatchWork> {
    inner: Arc<dyn ExecutionPlan>,
    work: Arc<W>,
    devices: Arc<Vec<Device>>,
    batch_rows: usize,
    fetch: Option<usize>,
    metrics: ExecutionPlanMetricsSet,
    executed: AtomicBool,
}

impl<W: BatchWork> GpuBatchExec<W> {
    /// The GPU twin of `cpu`, or why there is none.
    pub fn try_new(
        cpu: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch_rows: usize,
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
            batch_rows,
            metrics: ExecutionPlanMetricsSet::new(),
            executed: AtomicBool::new(false),
        })
    }

    /// The devices its partitions run on.
    pub fn devices(&self) -> &[Device] {
        &self.devices
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
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("{} without a device", W::NAME))?;
        let child = self
            .inner
            .children()
            .first()
            .map(|c| Arc::clone(*c))
            .ok_or_else(|| internal_datafusion_err!("{} without an input", W::NAME))?;
        let input = input_chunks(&child, partition, Arc::clone(&context), &self.devices)?;
        let metrics = GpuMetrics::new(&self.metrics, partition, &device);
        count_operator(&self.executed, W::KIND);
        Ok(Box::pin(GpuStream::new(
            self.schema(),
            input,
            Arc::clone(&self.work),
            device,
            self.batch_rows,
            context.session_config().batch_size(),
            self.fetch,
            resident,
            metrics,
        )))
    }
}

impl<W: BatchWork> DeviceResident for GpuBatchExec<W> {
    fn execute_chunks(&self, partition: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        self.stream(partition, context, self.fetch.is_none())
    }

    fn resident_devices(&self) -> &Arc<Vec<Device>> {
        &self.devices
    }
}

impl<W: BatchWork> DisplayAs for GpuBatchExec<W> {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            // The tree's box is titled with name(); its lines are the CPU operator's.
            DisplayFormatType::TreeRender => self.inner.fmt_as(t, f),
            _ => {
                let cpu = DisplayableExecutionPlan::new(self.inner.as_ref())
                    .one_line()
                    .to_string();
                let prefix = format!("{}: ", self.inner.name());
                let rest = cpu.trim_end();
                let rest = rest.strip_prefix(&prefix).unwrap_or(rest);
                write!(f, "{}: device={}, {rest}", W::NAME, describe(&self.devices))
            }
        }
    }
}

impl<W: BatchWork> ExecutionPlan for GpuBatchExec<W> {
    fn name(&self) -> &str {
        W::NAME
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.inner.properties()
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        self.inner.input_distribution_requirements()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        self.inner.maintains_input_order()
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        self.inner.benefits_from_input_partitioning()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.inner.children()
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.inner.apply_expressions(f)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let recompute = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        let inner = Arc::clone(&self.inner).replace_children(children, recompute)?;
        let gpu = Self::try_new(inner, Arc::clone(&self.devices), self.batch_rows)
            .map_err(|reason| internal_datafusion_err!("{}: {reason}", W::NAME))?;
        Ok(Arc::new(gpu))
    }

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

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        self.inner.statistics_from_inputs(input_stats, args)
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        self.inner.child_stats_requests(partition)
    }

    fn fetch(&self) -> Option<usize> {
        self.fetch
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        self.inner.cardinality_effect()
    }
}
