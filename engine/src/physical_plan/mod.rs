//! Fulmen's GPU operators: DataFusion's operators with a `Gpu` prefix, each keeping the
//! CPU operator it replaces so that any batch can be redone on the CPU.

/// The `ExecutionPlan` methods a GPU operator takes from the CPU operator it wraps (its
/// `inner` field): plan properties, distribution and ordering, children, expressions and
/// statistics; and `with_new_children`, which plans the GPU twin again (`Self::try_new(cpu,
/// devices, batch)`) over the CPU operator with the new children.
macro_rules! delegate_to_cpu_operator {
    ($name:expr) => {
        delegate_to_cpu_operator!(@properties);

        fn statistics_from_inputs(
            &self,
            input_stats: &[std::sync::Arc<datafusion::physical_plan::Statistics>],
            args: &datafusion::physical_plan::StatisticsArgs,
        ) -> datafusion::error::Result<std::sync::Arc<datafusion::physical_plan::Statistics>> {
            self.inner.statistics_from_inputs(input_stats, args)
        }

        fn children(&self) -> Vec<&std::sync::Arc<dyn ExecutionPlan>> {
            self.inner.children()
        }

        fn with_new_children(
            self: std::sync::Arc<Self>,
            children: Vec<std::sync::Arc<dyn ExecutionPlan>>,
        ) -> datafusion::error::Result<std::sync::Arc<dyn ExecutionPlan>> {
            use datafusion::physical_plan::execution_plan::{
                ChildrenPropertiesMode, ReplaceChildrenOptions,
            };
            let recompute = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
            let inner = std::sync::Arc::clone(&self.inner).replace_children(children, recompute)?;
            let gpu = Self::try_new(inner, std::sync::Arc::clone(&self.devices), self.batch)
                .map_err(|reason| {
                datafusion::common::internal_datafusion_err!("{}: {reason}", $name)
            })?;
            Ok(std::sync::Arc::new(gpu))
        }
    };
    // Everything but the children and the statistics drawn from them: for an operator whose
    // children are not its CPU twin's.
    (@properties) => {
        fn properties(&self) -> &std::sync::Arc<datafusion::physical_plan::PlanProperties> {
            self.inner.properties()
        }

        fn input_distribution_requirements(
            &self,
        ) -> datafusion::physical_plan::distribution_requirements::InputDistributionRequirements {
            self.inner.input_distribution_requirements()
        }

        fn maintains_input_order(&self) -> Vec<bool> {
            self.inner.maintains_input_order()
        }

        fn benefits_from_input_partitioning(&self) -> Vec<bool> {
            self.inner.benefits_from_input_partitioning()
        }

        fn apply_expressions(
            &self,
            f: &mut dyn FnMut(
                &std::sync::Arc<dyn datafusion::physical_expr::PhysicalExpr>,
            ) -> datafusion::error::Result<
                datafusion::common::tree_node::TreeNodeRecursion,
            >,
        ) -> datafusion::error::Result<datafusion::common::tree_node::TreeNodeRecursion> {
            self.inner.apply_expressions(f)
        }

        fn child_stats_requests(
            &self,
            partition: Option<usize>,
        ) -> Vec<datafusion::physical_plan::ChildStats> {
            self.inner.child_stats_requests(partition)
        }

        fn cardinality_effect(
            &self,
        ) -> datafusion::physical_plan::execution_plan::CardinalityEffect {
            self.inner.cardinality_effect()
        }
    };
}

/// How a GPU operator shows itself: `GpuXExec: device=…, <the CPU operator's line>`, and
/// in tree renderings the CPU operator's lines under the GPU name.
pub(crate) fn fmt_gpu_operator(
    name: &str,
    inner: &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
    devices: &[fulmen_kernels::Device],
    t: datafusion::physical_plan::DisplayFormatType,
    f: &mut std::fmt::Formatter,
) -> std::fmt::Result {
    use datafusion::physical_plan::DisplayFormatType;
    use datafusion::physical_plan::display::DisplayableExecutionPlan;
    match t {
        DisplayFormatType::TreeRender => inner.fmt_as(t, f),
        _ => {
            let cpu = DisplayableExecutionPlan::new(inner.as_ref())
                .one_line()
                .to_string();
            let prefix = format!("{}: ", inner.name());
            let rest = cpu.trim_end();
            let rest = rest.strip_prefix(&prefix).unwrap_or(rest);
            write!(
                f,
                "{name}: device={}, {rest}",
                crate::gpu::devices::describe(devices)
            )
        }
    }
}

pub mod coalesce;
pub mod device_loop;
pub mod gpu_aggregate;
pub mod gpu_batch_exec;
pub mod gpu_filter;
pub mod gpu_hash_join;
pub mod gpu_metrics;
pub mod gpu_projection;
pub mod gpu_scan;
pub mod gpu_stream;
pub mod once;

pub use gpu_aggregate::GpuAggregateExec;
pub use gpu_filter::GpuFilterExec;
pub use gpu_hash_join::GpuHashJoinExec;
pub use gpu_projection::GpuProjectionExec;
pub use gpu_scan::GpuScanExec;

use std::sync::Arc;

use datafusion::physical_plan::ExecutionPlan;

/// `plan` as a GPU operator whose output can stay on its device, if it is one.
pub fn resident(plan: &Arc<dyn ExecutionPlan>) -> Option<&dyn gpu_stream::DeviceResident> {
    use datafusion::physical_plan::coop::CooperativeExec;
    // DataFusion wraps a leaf its parent does not already yield for (a cached table's
    // scan, in a plan of one partition) in a `CooperativeExec`, which only adds yield
    // points to its stream: the chunks are taken from the scan beneath, where they lie.
    if let Some(c) = plan.downcast_ref::<CooperativeExec>() {
        return resident(c.input());
    }
    if let Some(p) = plan.downcast_ref::<GpuFilterExec>() {
        Some(p)
    } else if let Some(p) = plan.downcast_ref::<GpuProjectionExec>() {
        Some(p)
    } else if let Some(p) = plan.downcast_ref::<GpuHashJoinExec>() {
        Some(p)
    } else if let Some(p) = plan.downcast_ref::<GpuScanExec>() {
        Some(p)
    } else {
        None
    }
}

/// `plan` as a GPU operator whose partitions run on `devices` (so that a GPU parent on
/// them takes its chunks where they lie), if it is one.
pub fn resident_on<'a>(
    plan: &'a Arc<dyn ExecutionPlan>,
    devices: &[fulmen_kernels::Device],
) -> Option<&'a dyn gpu_stream::DeviceResident> {
    resident(plan).filter(|r| r.resident_devices().as_slice() == devices)
}

/// Whether executing a partition of `plan` a second time reads the same rows again, so a
/// partition whose device state was lost can be computed again from its input: scans of
/// files and memory (cached or not) under filters, projections (CPU or GPU) and coalesced
/// partitions. Not repartitions (each of
/// their output partitions can be taken once), joins (outer joins count their finished
/// partitions) or live tables (a second read sees other rows).
pub(crate) fn re_executable(plan: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::datasource::source::DataSourceExec;
    use datafusion::physical_plan::filter::FilterExec;
    use datafusion::physical_plan::projection::ProjectionExec;
    let passes = plan.is::<DataSourceExec>()
        || plan.is::<datafusion::physical_plan::coop::CooperativeExec>()
        || plan.is::<datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec>()
        || plan.is::<FilterExec>()
        || plan.is::<ProjectionExec>()
        || plan.is::<GpuFilterExec>()
        || plan.is::<GpuProjectionExec>()
        || plan.is::<GpuScanExec>();
    passes && plan.children().into_iter().all(re_executable)
}

/// Whether the device compares keys (group keys, join keys) of its type `t` as DataFusion
/// does: not booleans (bits) nor half floats (compared by their bits, -0.0 apart from 0.0).
pub(crate) fn keyable(t: &datafusion::arrow::datatypes::DataType) -> bool {
    use datafusion::arrow::datatypes::DataType;
    !matches!(t, DataType::Boolean | DataType::Float16)
}
