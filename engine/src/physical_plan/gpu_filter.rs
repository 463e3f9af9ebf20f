//! `GpuFilterExec`: DataFusion's `FilterExec` on a GPU. The predicate runs as one
//! expression program, the selection is compacted into row indices on the device, and the
//! kept rows are gathered there; only the filter's output comes back.
//!
//! One file rather than an `exec.rs` / `stream.rs` folder: the stream is the shared
//! [`GpuStream`](super::gpu_stream::GpuStream), and what is left is small.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::internal_datafusion_err;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::display::DisplayableExecutionPlan;
use datafusion::physical_plan::distribution_requirements::InputDistributionRequirements;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::{FilterExec, batch_filter};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::{
    ChildStats, DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, Statistics,
    StatisticsArgs,
};
use volley_kernels::ops::{compact, expr, gather};
use volley_kernels::{Device, DeviceColumn, KernelError};

use super::gpu_stream::{
    BatchWork, GpuMetrics, GpuStream, OperatorKind, count_operator, device_for, make_batch,
};
use crate::gpu::compile::{CompiledExprs, Reason, compile};
use crate::gpu::devices::describe;

/// A filter whose predicate runs on a GPU. Wraps the `FilterExec` it replaces, which
/// keeps its plan properties and statistics.
#[derive(Debug)]
pub struct GpuFilterExec {
    inner: Arc<dyn ExecutionPlan>,
    work: Arc<FilterWork>,
    devices: Arc<Vec<Device>>,
    batch_rows: usize,
    fetch: Option<usize>,
    metrics: ExecutionPlanMetricsSet,
    executed: AtomicBool,
}

#[derive(Debug)]
struct FilterWork {
    predicate: Arc<dyn PhysicalExpr>,
    program: CompiledExprs,
    /// Input columns the filter outputs.
    outputs: Vec<usize>,
    projection: Option<Vec<usize>>,
    schema: SchemaRef,
}

impl GpuFilterExec {
    /// The GPU twin of `filter` (a `FilterExec`), or why there is none.
    pub fn try_new(
        filter: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch_rows: usize,
    ) -> Result<Self, Reason> {
        let Some(cpu) = filter.downcast_ref::<FilterExec>() else {
            return Err("not a FilterExec".into());
        };
        if devices.is_empty() {
            return Err("no device".into());
        }
        let input_schema = cpu.input().schema();
        let program = compile(std::slice::from_ref(cpu.predicate()), &input_schema)?;
        let projection: Option<Vec<usize>> = cpu.projection().as_ref().map(|p| p.to_vec());
        let outputs: Vec<usize> = projection
            .clone()
            .unwrap_or_else(|| (0..input_schema.fields().len()).collect());
        for &c in &outputs {
            let field = input_schema.field(c);
            if volley_kernels::column::device_type(field.data_type(), 0).is_err() {
                return Err(format!(
                    "column {} of type {} is not supported on GPU",
                    field.name(),
                    field.data_type()
                ));
            }
        }
        let work = FilterWork {
            predicate: Arc::clone(cpu.predicate()),
            program,
            outputs,
            projection,
            schema: filter.schema(),
        };
        Ok(Self {
            fetch: filter.fetch(),
            inner: filter,
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

impl BatchWork for FilterWork {
    fn gpu(
        &self,
        device: &Device,
        batch: &RecordBatch,
        metrics: &GpuMetrics,
    ) -> Result<Option<RecordBatch>, KernelError> {
        let n = batch.num_rows();
        let mut on_device: HashMap<usize, DeviceColumn> = HashMap::new();
        for &c in self.program.inputs.iter().chain(&self.outputs) {
            if let std::collections::hash_map::Entry::Vacant(slot) = on_device.entry(c) {
                slot.insert(metrics.upload(device, batch.column(c).as_ref())?);
            }
        }
        let inputs: Vec<&DeviceColumn> =
            self.program.inputs.iter().map(|c| &on_device[c]).collect();
        let kept = metrics.kernel(|| -> Result<_, KernelError> {
            let Some(mut predicate) = expr::evaluate(device, &self.program.program, &inputs, n)?
            else {
                return Ok(None);
            };
            let predicate = predicate.remove(0);
            let indices =
                compact::selection_indices(device, predicate.values(), predicate.validity(), n)?;
            let columns = self
                .outputs
                .iter()
                .map(|c| gather::gather_column(&on_device[c], &indices))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Some((indices.len(), columns)))
        })?;
        let Some((rows, columns)) = kept else {
            return Ok(None);
        };
        let arrays = columns
            .iter()
            .zip(self.schema.fields())
            .map(|(c, f)| metrics.download(c, f.data_type()))
            .collect::<Result<Vec<_>, _>>()?;
        make_batch(&self.schema, arrays, rows)
            .map(Some)
            .map_err(|e| KernelError::InvalidData(e.to_string()))
    }

    fn cpu(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let filtered = batch_filter(batch, &self.predicate)?;
        match &self.projection {
            Some(p) => Ok(filtered.project(p)?),
            None => Ok(filtered),
        }
    }
}

impl DisplayAs for GpuFilterExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            // The tree's box is titled with name(); its lines are the CPU operator's.
            DisplayFormatType::TreeRender => self.inner.fmt_as(t, f),
            _ => {
                let cpu = DisplayableExecutionPlan::new(self.inner.as_ref())
                    .one_line()
                    .to_string();
                let rest = cpu.trim_end().trim_start_matches("FilterExec: ");
                write!(
                    f,
                    "GpuFilterExec: device={}, {rest}",
                    describe(&self.devices)
                )
            }
        }
    }
}

impl ExecutionPlan for GpuFilterExec {
    fn name(&self) -> &str {
        "GpuFilterExec"
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
            .map_err(|reason| internal_datafusion_err!("GpuFilterExec: {reason}"))?;
        Ok(Arc::new(gpu))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("GpuFilterExec without a device"))?;
        let output_rows = context.session_config().batch_size();
        let input = self.inner.children()[0].execute(partition, context)?;
        let metrics = GpuMetrics::new(&self.metrics, partition, &device);
        count_operator(&self.executed, OperatorKind::Filter);
        Ok(Box::pin(GpuStream::new(
            self.schema(),
            input,
            Arc::clone(&self.work),
            device,
            self.batch_rows,
            output_rows,
            self.fetch,
            metrics,
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

    fn cardinality_effect(&self) -> datafusion::physical_plan::execution_plan::CardinalityEffect {
        self.inner.cardinality_effect()
    }
}
