//! `GpuProjectionExec`: DataFusion's `ProjectionExec` on a GPU. Every computed column of
//! the projection is an output of one expression program, evaluated in one pass; plain
//! column references and constants are filled in on the host without visiting the device.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use datafusion::arrow::array::{ArrayRef, RecordBatch};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::common::internal_datafusion_err;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_plan::display::DisplayableExecutionPlan;
use datafusion::physical_plan::distribution_requirements::InputDistributionRequirements;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{
    ChildStats, DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, Statistics,
    StatisticsArgs,
};
use volley_kernels::ops::expr;
use volley_kernels::{Device, DeviceColumn, KernelError};

use super::gpu_stream::{
    BatchWork, GpuMetrics, GpuStream, OperatorKind, count_operator, device_for, make_batch,
};
use crate::gpu::compile::{CompiledExprs, Reason, compile};
use crate::gpu::devices::describe;

/// A projection whose computed columns run on a GPU. Wraps the `ProjectionExec` it
/// replaces, which keeps its plan properties and statistics.
#[derive(Debug)]
pub struct GpuProjectionExec {
    inner: Arc<dyn ExecutionPlan>,
    work: Arc<ProjectionWork>,
    devices: Arc<Vec<Device>>,
    batch_rows: usize,
    metrics: ExecutionPlanMetricsSet,
    executed: AtomicBool,
}

#[derive(Debug)]
struct ProjectionWork {
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    /// For each output column: the input column it passes through, or the program output
    /// that computes it.
    sources: Vec<Source>,
    program: CompiledExprs,
    schema: SchemaRef,
}

#[derive(Debug, Clone)]
enum Source {
    Input(usize),
    Constant(ScalarValue),
    Computed(usize),
}

impl GpuProjectionExec {
    /// The GPU twin of `projection` (a `ProjectionExec`), or why there is none.
    pub fn try_new(
        projection: Arc<dyn ExecutionPlan>,
        devices: Arc<Vec<Device>>,
        batch_rows: usize,
    ) -> Result<Self, Reason> {
        let Some(cpu) = projection.downcast_ref::<ProjectionExec>() else {
            return Err("not a ProjectionExec".into());
        };
        if devices.is_empty() {
            return Err("no device".into());
        }
        let input_schema = cpu.input().schema();
        let exprs: Vec<Arc<dyn PhysicalExpr>> =
            cpu.expr().iter().map(|p| Arc::clone(&p.expr)).collect();
        let mut sources = Vec::with_capacity(exprs.len());
        let mut computed = Vec::new();
        for e in &exprs {
            if let Some(c) = e.downcast_ref::<Column>() {
                sources.push(Source::Input(c.index()));
            } else if let Some(l) = e.downcast_ref::<Literal>() {
                sources.push(Source::Constant(l.value().clone()));
            } else if e.data_type(&input_schema).ok() == Some(DataType::Null) {
                // NULL whatever the row: typed NULL has nothing to compute or fail.
                sources.push(Source::Constant(ScalarValue::Null));
            } else {
                sources.push(Source::Computed(computed.len()));
                computed.push(Arc::clone(e));
            }
        }
        if computed.is_empty() {
            return Err(
                "it only selects columns and constants: there is nothing to compute".into(),
            );
        }
        let program = compile(&computed, &input_schema)?;
        let work = ProjectionWork {
            exprs,
            sources,
            program,
            schema: projection.schema(),
        };
        Ok(Self {
            inner: projection,
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

impl BatchWork for ProjectionWork {
    fn gpu(
        &self,
        device: &Device,
        batch: &RecordBatch,
        metrics: &GpuMetrics,
    ) -> Result<Option<RecordBatch>, KernelError> {
        let n = batch.num_rows();
        let inputs = self
            .program
            .inputs
            .iter()
            .map(|&c| metrics.upload(device, batch.column(c).as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let inputs: Vec<&DeviceColumn> = inputs.iter().collect();
        let Some(outputs) =
            metrics.kernel(|| expr::evaluate(device, &self.program.program, &inputs, n))?
        else {
            return Ok(None);
        };
        let computed = outputs
            .iter()
            .zip(self.program.program.output_types())
            .map(|(c, t)| metrics.download(c, t))
            .collect::<Result<Vec<_>, _>>()?;
        let columns = self
            .sources
            .iter()
            .map(|s| match s {
                Source::Input(i) => Ok(Arc::clone(batch.column(*i))),
                Source::Constant(v) => v
                    .to_array_of_size(n)
                    .map_err(|e| KernelError::InvalidData(e.to_string())),
                Source::Computed(k) => Ok(Arc::clone(&computed[*k])),
            })
            .collect::<Result<Vec<ArrayRef>, _>>()?;
        make_batch(&self.schema, columns, n)
            .map(Some)
            .map_err(|e| KernelError::InvalidData(e.to_string()))
    }

    fn cpu(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let columns = self
            .exprs
            .iter()
            .map(|e| {
                e.evaluate(batch)
                    .and_then(|v| v.into_array(batch.num_rows()))
            })
            .collect::<Result<Vec<_>>>()?;
        make_batch(&self.schema, columns, batch.num_rows())
    }
}

impl DisplayAs for GpuProjectionExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            // The tree's box is titled with name(); its lines are the CPU operator's.
            DisplayFormatType::TreeRender => self.inner.fmt_as(t, f),
            _ => {
                let cpu = DisplayableExecutionPlan::new(self.inner.as_ref())
                    .one_line()
                    .to_string();
                let rest = cpu.trim_end().trim_start_matches("ProjectionExec: ");
                write!(
                    f,
                    "GpuProjectionExec: device={}, {rest}",
                    describe(&self.devices)
                )
            }
        }
    }
}

impl ExecutionPlan for GpuProjectionExec {
    fn name(&self) -> &str {
        "GpuProjectionExec"
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
            .map_err(|reason| internal_datafusion_err!("GpuProjectionExec: {reason}"))?;
        Ok(Arc::new(gpu))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let device = device_for(&self.devices, partition)
            .ok_or_else(|| internal_datafusion_err!("GpuProjectionExec without a device"))?;
        let output_rows = context.session_config().batch_size();
        let input = self.inner.children()[0].execute(partition, context)?;
        let metrics = GpuMetrics::new(&self.metrics, partition, &device);
        count_operator(&self.executed, OperatorKind::Projection);
        Ok(Box::pin(GpuStream::new(
            self.schema(),
            input,
            Arc::clone(&self.work),
            device,
            self.batch_rows,
            output_rows,
            None,
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

    fn cardinality_effect(&self) -> datafusion::physical_plan::execution_plan::CardinalityEffect {
        self.inner.cardinality_effect()
    }
}
