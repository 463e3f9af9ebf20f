//! [`GpuExecutionEngine`]: an executor's way of running a stage — Ballista's own, after
//! Fulmen's GPU rule has placed the stage's operators on this executor's devices.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ballista_core::JobId;
use ballista_core::serde::protobuf::{
    RuntimeStatsReport, ShuffleWritePartition, TaskColumnStats, WindowStateReport,
};
use ballista_executor::execution_engine::{
    DefaultExecutionEngine, ExecutionEngine, QueryStageExecutor,
};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::MetricsSet;
use datafusion::prelude::SessionConfig;
use fulmen_engine::gpu::GpuOverrides;
use fulmen_engine::{DeviceSelection, FulmenConfig};

use crate::metrics::{MetricsShape, align};
use crate::pool::ConnectionPool;

/// Runs each stage through Fulmen's GPU rule, with this executor's devices, then as
/// Ballista does. The client's `fulmen.*` settings apply (mode, operators, batch sizes,
/// quotas, what a device error does), except `fulmen.devices`: the devices are this
/// process's.
pub struct GpuExecutionEngine {
    devices: DeviceSelection,
    inner: DefaultExecutionEngine,
}

impl GpuExecutionEngine {
    /// An engine placing stages on `devices`, keeping its connections to other executors
    /// for `connection_ttl` between uses.
    pub fn new(devices: DeviceSelection, connection_ttl: Duration) -> Self {
        let pool = Arc::new(ConnectionPool::new(connection_ttl));
        Self {
            devices,
            inner: DefaultExecutionEngine::with_client_pool(pool),
        }
    }
}

impl ExecutionEngine for GpuExecutionEngine {
    fn create_query_stage_exec(
        &self,
        job_id: JobId,
        stage_id: usize,
        task_id: usize,
        global_output_partition_ids: Vec<usize>,
        plan: Arc<dyn ExecutionPlan>,
        work_dir: &str,
        config: &SessionConfig,
    ) -> Result<Arc<dyn QueryStageExecutor>> {
        let cpu_shape = MetricsShape::of(plan.as_ref());
        let children = plan.children();
        let [input] = children.as_slice() else {
            return Err(DataFusionError::Internal(format!(
                "a stage's plan is a shuffle writer over one input, not {}",
                plan.name()
            )));
        };
        let mut options = config.options().as_ref().clone();
        let fulmen = options
            .extensions
            .get_mut::<FulmenConfig>()
            .ok_or_else(|| {
                DataFusionError::Internal("the executor's session has no fulmen settings".into())
            })?;
        fulmen.devices = self.devices.clone();
        let placed = GpuOverrides::new().optimize(Arc::clone(input), &options)?;
        let recompute = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        let plan = Arc::clone(&plan).replace_children(vec![placed], recompute)?;
        let gpu_shape = MetricsShape::of(plan.as_ref());
        let on_devices = gpu_shape.gpu_operators();
        log::info!(
            "job {job_id} stage {stage_id} task {task_id}: {} operators on devices {} ({})",
            on_devices.len(),
            self.devices,
            if on_devices.is_empty() {
                "none placed".to_string()
            } else {
                on_devices.join(", ")
            }
        );
        let inner = self.inner.create_query_stage_exec(
            job_id,
            stage_id,
            task_id,
            global_output_partition_ids,
            plan,
            work_dir,
            config,
        )?;
        Ok(Arc::new(GpuQueryStage {
            inner,
            cpu_shape,
            gpu_shape,
        }))
    }
}

/// A stage as Ballista runs it, reporting its operators' metrics in the shape of the CPU
/// plan the scheduler knows (see [`align`]).
struct GpuQueryStage {
    inner: Arc<dyn QueryStageExecutor>,
    /// The operators with metrics of the plan the scheduler sent, in Ballista's order.
    cpu_shape: MetricsShape,
    /// Those of the plan that runs.
    gpu_shape: MetricsShape,
}

impl fmt::Debug for GpuQueryStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

impl fmt::Display for GpuQueryStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner, f)
    }
}

#[async_trait::async_trait]
impl QueryStageExecutor for GpuQueryStage {
    async fn execute_query_stage(
        &self,
        task_id: usize,
        context: Arc<TaskContext>,
    ) -> Result<Vec<ShuffleWritePartition>> {
        self.inner.execute_query_stage(task_id, context).await
    }

    fn collect_plan_metrics(&self) -> Vec<MetricsSet> {
        align(
            &self.cpu_shape,
            &self.gpu_shape,
            self.inner.collect_plan_metrics(),
        )
    }

    fn collect_runtime_stats_reports(&self) -> Vec<RuntimeStatsReport> {
        self.inner.collect_runtime_stats_reports()
    }

    fn collect_window_state_reports(&self) -> Result<Vec<WindowStateReport>> {
        self.inner.collect_window_state_reports()
    }

    fn collect_column_stats(&self) -> Vec<TaskColumnStats> {
        self.inner.collect_column_stats()
    }
}
