//! Volley's GPU operators: DataFusion's operators with a `Gpu` prefix, each keeping the
//! CPU operator it replaces so that any batch can be redone on the CPU.

pub mod gpu_aggregate;
pub mod gpu_batch_exec;
pub mod gpu_filter;
pub mod gpu_hash_join;
pub mod gpu_projection;
pub mod gpu_stream;
pub mod once;

pub use gpu_aggregate::GpuAggregateExec;
pub use gpu_filter::GpuFilterExec;
pub use gpu_hash_join::GpuHashJoinExec;
pub use gpu_projection::GpuProjectionExec;

use std::sync::Arc;

use datafusion::physical_plan::ExecutionPlan;

/// `plan` as a GPU operator whose output can stay on its device, if it is one.
pub fn resident(plan: &Arc<dyn ExecutionPlan>) -> Option<&dyn gpu_stream::DeviceResident> {
    if let Some(p) = plan.downcast_ref::<GpuFilterExec>() {
        Some(p)
    } else if let Some(p) = plan.downcast_ref::<GpuProjectionExec>() {
        Some(p)
    } else if let Some(p) = plan.downcast_ref::<GpuHashJoinExec>() {
        Some(p)
    } else {
        None
    }
}
