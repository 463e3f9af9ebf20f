//! `GpuOverrides`: the physical optimizer rule that moves operators onto GPUs.
//!
//! For each operator it decides [`SupportLevel`]: `Supported` swaps the operator for its
//! GPU twin; `Unsupported(reason)` leaves it on the CPU. Reasons are values, never errors,
//! and [`placement_report`] (what `EXPLAIN` shows as `gpu_placement`) recomputes them from
//! the final plan, so they are reported exactly as decided.
//!
//! Adding an operator is adding a case to [`decide`] (see docs/adding-an-operator.md).

use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, StatisticsArgs, StatisticsContext};
use fulmen_kernels::{Device, DeviceSelection};

use super::devices::{describe, devices, query_devices};
use crate::config::{FulmenConfig, GpuMode};
use crate::physical_plan::coalesce::BatchLimit;
use crate::physical_plan::{GpuAggregateExec, GpuFilterExec, GpuHashJoinExec, GpuProjectionExec};

/// Whether an operator can run on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SupportLevel {
    /// It can, and will.
    Supported,
    /// It stays on the CPU, for this reason.
    Unsupported(String),
}

/// The rule. `FulmenContext` registers it after DataFusion's own physical optimizer rules.
#[derive(Debug, Default)]
pub struct GpuOverrides;

impl GpuOverrides {
    /// The rule.
    pub fn new() -> Self {
        Self
    }
}

impl PhysicalOptimizerRule for GpuOverrides {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let Some(fulmen) = config.extensions.get::<FulmenConfig>() else {
            return Ok(plan);
        };
        if fulmen.gpu_mode == GpuMode::Off {
            return Ok(plan);
        }
        // One set of handles per plan: `fulmen.gpu.memory_limit` is each query's quota.
        let available = query_devices(&fulmen.devices, fulmen.gpu_memory_limit);
        let plan = super::one_stage::one_stage_aggregations(plan, fulmen, &available)?;
        plan.transform_up(|node| {
            Ok(match decide(&node, fulmen, &available) {
                Decision::Gpu(gpu) => Transformed::yes(gpu),
                Decision::Cpu(..) | Decision::NotApplicable => Transformed::no(node),
            })
        })
        .data()
    }

    fn name(&self) -> &str {
        "fulmen_gpu_overrides"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// What the rule does with one operator.
pub enum Decision {
    /// Its GPU twin.
    Gpu(Arc<dyn ExecutionPlan>),
    /// It stays on the CPU: the operator's name and the reason.
    Cpu(&'static str, String),
    /// The rule has no GPU twin for this kind of operator.
    NotApplicable,
}

impl Decision {
    /// The decision as a support level.
    pub fn support_level(&self) -> Option<SupportLevel> {
        match self {
            Self::Gpu(_) => Some(SupportLevel::Supported),
            Self::Cpu(_, reason) => Some(SupportLevel::Unsupported(reason.clone())),
            Self::NotApplicable => None,
        }
    }
}

/// Decides where `node` runs under `fulmen`'s settings with these devices.
pub fn decide(
    node: &Arc<dyn ExecutionPlan>,
    fulmen: &FulmenConfig,
    available: &Result<Arc<Vec<Device>>, String>,
) -> Decision {
    let (name, enabled, flag) = if node.is::<FilterExec>() {
        ("FilterExec", fulmen.gpu_filter, "fulmen.gpu.filter")
    } else if node.is::<ProjectionExec>() {
        (
            "ProjectionExec",
            fulmen.gpu_projection,
            "fulmen.gpu.projection",
        )
    } else if node.is::<AggregateExec>() {
        (
            "AggregateExec",
            fulmen.gpu_aggregate,
            "fulmen.gpu.aggregate",
        )
    } else if node.is::<HashJoinExec>() {
        ("HashJoinExec", fulmen.gpu_join, "fulmen.gpu.join")
    } else {
        return Decision::NotApplicable;
    };
    let cpu = |reason: String| Decision::Cpu(name, reason);
    if fulmen.gpu_mode == GpuMode::Off {
        return cpu("fulmen.gpu.mode is off".into());
    }
    let devices = match available {
        Ok(d) if d.is_empty() => {
            return cpu(match fulmen.devices {
                DeviceSelection::None => "no device (fulmen.devices is none)".into(),
                _ => format!("no GPU found (fulmen.devices is {})", fulmen.devices),
            });
        }
        Ok(d) => match in_service(d) {
            Some(d) => d,
            None => {
                return cpu(format!(
                    "every device is quarantined ({})",
                    quarantine_notes(d).join("; ")
                ));
            }
        },
        Err(e) => return cpu(format!("no device: {e}")),
    };
    if !enabled {
        return cpu(format!("{flag} is false"));
    }
    if fulmen.gpu_mode == GpuMode::Auto
        && let Some(rows) = estimated_input_rows(node)
        && rows < fulmen.gpu_min_rows
    {
        return cpu(format!(
            "an estimated {rows} input rows, below fulmen.gpu.min_rows ({})",
            fulmen.gpu_min_rows
        ));
    }
    let node = Arc::clone(node);
    let batch = BatchLimit::of(fulmen);
    let gpu: Result<Arc<dyn ExecutionPlan>, String> = match name {
        "FilterExec" => GpuFilterExec::try_new(node, devices, batch)
            .map(|g| Arc::new(g) as Arc<dyn ExecutionPlan>),
        "ProjectionExec" => GpuProjectionExec::try_new(node, devices, batch)
            .map(|g| Arc::new(g) as Arc<dyn ExecutionPlan>),
        "AggregateExec" => super::fuse::fold_filter_into_aggregate(&node)
            .and_then(|folded| GpuAggregateExec::try_new(folded, Arc::clone(&devices), batch).ok())
            .or_else(|| {
                let folded = super::fuse::fold_filter_into_grouped_aggregate(&node)?;
                GpuAggregateExec::try_fused(folded, Arc::clone(&devices), batch).ok()
            })
            .map_or_else(|| GpuAggregateExec::try_new(node, devices, batch), Ok)
            .map(|g| Arc::new(g) as Arc<dyn ExecutionPlan>),
        _ => super::fuse::fold_filter_into_join(&node)
            .and_then(|folded| GpuHashJoinExec::try_fused(folded, Arc::clone(&devices), batch).ok())
            .map_or_else(|| GpuHashJoinExec::try_new(node, devices, batch), Ok)
            .map(|g| Arc::new(g) as Arc<dyn ExecutionPlan>),
    };
    match gpu {
        Ok(gpu) => Decision::Gpu(gpu),
        Err(reason) => cpu(reason),
    }
}

/// The devices not quarantined (the same list when none is), or `None` when every one is.
pub(super) fn in_service(devices: &Arc<Vec<Device>>) -> Option<Arc<Vec<Device>>> {
    if devices.iter().all(|d| d.quarantined().is_none()) {
        return Some(Arc::clone(devices));
    }
    let usable: Vec<Device> = devices
        .iter()
        .filter(|d| d.quarantined().is_none())
        .cloned()
        .collect();
    (!usable.is_empty()).then(|| Arc::new(usable))
}

/// `cuda:0 is quarantined: …` for each quarantined device.
fn quarantine_notes(devices: &[Device]) -> Vec<String> {
    devices
        .iter()
        .filter_map(|d| {
            d.quarantined()
                .map(|why| format!("{d} is quarantined: {why}"))
        })
        .collect()
}

fn estimated_input_rows(node: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    estimated_rows(node.children().into_iter().next()?)
}

/// The rows `plan`'s statistics say it makes, exactly or as an estimate.
pub(crate) fn estimated_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let stats = StatisticsContext::new()
        .compute(plan.as_ref(), &StatisticsArgs::new())
        .ok()?;
    match stats.num_rows {
        Precision::Exact(n) | Precision::Inexact(n) => Some(n),
        Precision::Absent => None,
    }
}

/// One line per filter, projection, aggregation and hash join of a final plan: where it
/// runs, or why it stays on the CPU, after a line per quarantined device of the session's
/// selection. Empty when `fulmen.gpu.mode` is off. `EXPLAIN` shows it as `gpu_placement`.
pub fn placement_report(plan: &Arc<dyn ExecutionPlan>, config: &ConfigOptions) -> Vec<String> {
    let Some(fulmen) = config.extensions.get::<FulmenConfig>() else {
        return Vec::new();
    };
    if fulmen.gpu_mode == GpuMode::Off {
        return Vec::new();
    }
    let available = devices(&fulmen.devices);
    let mut lines = match &available {
        Ok(devices) => quarantine_notes(devices),
        Err(_) => Vec::new(),
    };
    lines.extend(operator_lines(
        plan,
        fulmen,
        &available,
        &|d| describe(d),
        false,
    ));
    lines
}

/// The devices a cluster's client places a stage's operators on for EXPLAIN: one emulated
/// device, opened in the client only for this. An executor makes the same decisions with
/// its own devices, because the rule decides by the operators, the settings and the row
/// estimates, never by which device it is given; only a device's quarantine differs.
const STAGE_PLANNING_DEVICES: &str = "emulated:1/fulmen-explain";

/// EXPLAIN's `gpu_placement` lines for one stage of a query on a cluster (`stage` is
/// Ballista's stage id; `input` is the plan under the stage's shuffle writer): the placement
/// the GPU rule makes of its operators under `config`'s settings, as each executor makes
/// it with its own devices when it runs a task of the stage. In auto mode an operator over
/// an earlier stage's output is marked as decided when the stage runs, since only then are
/// that output's rows known.
pub fn stage_placement_report(
    stage: usize,
    input: &Arc<dyn ExecutionPlan>,
    config: &ConfigOptions,
) -> Result<Vec<String>> {
    let mut options = config.clone();
    let Some(planning) = options.extensions.get_mut::<FulmenConfig>() else {
        return Ok(Vec::new());
    };
    let sized_at_run = planning.gpu_mode == GpuMode::Auto;
    planning.devices = STAGE_PLANNING_DEVICES
        .parse()
        .map_err(|e| DataFusionError::Internal(format!("{STAGE_PLANNING_DEVICES}: {e}")))?;
    planning.gpu_memory_limit = None;
    let planning = planning.clone();
    let placed = GpuOverrides::new().optimize(Arc::clone(input), &options)?;
    let available = devices(&planning.devices);
    let mut lines = operator_lines(
        &placed,
        &planning,
        &available,
        &|_| "each executor's devices".to_string(),
        sized_at_run,
    );
    if lines.is_empty() {
        lines.push("no filter, projection, aggregation or hash join".to_string());
    }
    Ok(lines
        .into_iter()
        .map(|line| format!("stage {stage}: {line}"))
        .collect())
}

/// A line per GPU-capable operator of `plan`: the device twin it became and where it runs
/// (`on` names the devices), or why it stays on the CPU. With `sized_at_run`, a twin whose
/// input has no row estimate is marked as decided only when it runs (auto mode on a
/// cluster).
fn operator_lines(
    plan: &Arc<dyn ExecutionPlan>,
    fulmen: &FulmenConfig,
    available: &Result<Arc<Vec<Device>>, String>,
    on: &dyn Fn(&[Device]) -> String,
    sized_at_run: bool,
) -> Vec<String> {
    let mut lines = Vec::new();
    let _ = plan.apply(|node| {
        let placed = if let Some(gpu) = node.downcast_ref::<GpuFilterExec>() {
            Some(format!("GpuFilterExec runs on {}", on(gpu.devices())))
        } else if let Some(gpu) = node.downcast_ref::<GpuProjectionExec>() {
            Some(format!("GpuProjectionExec runs on {}", on(gpu.devices())))
        } else if let Some(gpu) = node.downcast_ref::<GpuAggregateExec>() {
            let fused = if gpu.fused_filter().is_some() {
                ", the filter under it fused in"
            } else {
                ""
            };
            Some(format!(
                "GpuAggregateExec ({:?}{fused}) runs on {}",
                gpu.mode(),
                on(gpu.devices())
            ))
        } else if let Some(gpu) = node.downcast_ref::<GpuHashJoinExec>() {
            let mut filter = String::new();
            if gpu.has_filter() {
                filter.push_str(", its filter on the CPU");
            }
            if gpu.fused_filter().is_some() {
                filter.push_str(", the filter on its probe side fused in");
            }
            Some(format!(
                "GpuHashJoinExec ({}{filter}) runs on {}",
                gpu.join_type(),
                on(gpu.devices())
            ))
        } else if let Some(scan) = node.downcast_ref::<crate::physical_plan::GpuScanExec>() {
            Some(format!(
                "GpuScanExec reads cached table {} on {}",
                scan.data().name(),
                on(scan.data().devices())
            ))
        } else {
            if let Decision::Cpu(name, reason) = decide(node, fulmen, available) {
                lines.push(format!("{name} stays on CPU: {reason}"));
            }
            None
        };
        if let Some(mut line) = placed {
            if sized_at_run && estimated_input_rows(node).is_none() {
                line.push_str(&format!(
                    " if its input, whose rows are known only when the stage runs, has at \
                     least fulmen.gpu.min_rows ({}) rows",
                    fulmen.gpu_min_rows
                ));
            }
            lines.push(line);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    lines
}
