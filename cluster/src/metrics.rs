//! Operator metrics of a stage that ran on GPUs, reported in the shape of the CPU plan the
//! scheduler planned.
//!
//! Ballista's scheduler adds up each task's metrics operator by operator, in the pre-order
//! of the stage plan's operators that have metrics, and refuses a task whose list has
//! another length; EXPLAIN ANALYZE on a cluster shows them beside that CPU plan. Where an
//! executor placed operators on a device, the plan that ran has other operators (a
//! `GpuFilterExec` for a `FilterExec`, one `GpuAggregateExec` for a fused filter and
//! aggregate, one `GpuHashJoinExec` for an inner join and the filter on its probe side), so
//! its metrics are mapped back: each operator's to its CPU twin, the
//! operators a fused stage took in get none, and an operator with no twin adds its
//! metrics to the operator before it.

use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::{MetricValue, MetricsSet};

/// The names of a plan's operators that have metrics, in pre-order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsShape(Vec<String>);

impl MetricsShape {
    /// `plan`'s shape, walked as Ballista walks it.
    pub fn of(plan: &dyn ExecutionPlan) -> Self {
        fn walk(plan: &dyn ExecutionPlan, names: &mut Vec<String>) {
            if plan.metrics().is_some() {
                names.push(plan.name().to_string());
            }
            for child in plan.children() {
                walk(child.as_ref(), names);
            }
        }
        let mut names = Vec::new();
        walk(plan, &mut names);
        Self(names)
    }

    /// The names of its GPU operators.
    pub fn gpu_operators(&self) -> Vec<&str> {
        self.0
            .iter()
            .filter(|n| n.starts_with("Gpu"))
            .map(String::as_str)
            .collect()
    }
}

/// The CPU operator a GPU operator stands for: `GpuFilterExec` for `FilterExec`.
fn twin(name: &str) -> &str {
    name.strip_prefix("Gpu").unwrap_or(name)
}

/// `sets` (one per operator of `ran`) in the shape of `planned`, always one set per
/// operator of `planned` (the scheduler needs every task of a stage to send as many).
/// Metrics Ballista cannot send (custom ones) are left out. When `sets` does not match
/// `ran`, every set is empty rather than misplaced.
pub fn align(planned: &MetricsShape, ran: &MetricsShape, sets: Vec<MetricsSet>) -> Vec<MetricsSet> {
    let mut out: Vec<MetricsSet> = planned.0.iter().map(|_| MetricsSet::new()).collect();
    if sets.len() != ran.0.len() {
        log::warn!(
            "a stage reported metrics for {} operators but has {}: they are not sent",
            sets.len(),
            ran.0.len()
        );
        return out;
    }
    let mut next = 0;
    let mut last: Option<usize> = None;
    for (name, set) in ran.0.iter().zip(sets) {
        let target = planned.0[next..]
            .iter()
            .position(|p| p == twin(name) || p == name)
            .map(|offset| next + offset);
        let slot = match target {
            Some(slot) => {
                next = slot + 1;
                last = Some(slot);
                slot
            }
            None => match last {
                Some(slot) => slot,
                None => continue,
            },
        };
        for metric in set.iter() {
            if !matches!(metric.value(), MetricValue::Custom { .. }) {
                out[slot].push(std::sync::Arc::clone(metric));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_plan::metrics::{Count, Metric};
    use std::sync::Arc;

    fn shape(names: &[&str]) -> MetricsShape {
        MetricsShape(names.iter().map(|n| n.to_string()).collect())
    }

    fn counted(name: &'static str, n: usize) -> MetricsSet {
        let mut set = MetricsSet::new();
        let count = Count::new();
        count.add(n);
        set.push(Arc::new(Metric::new(
            MetricValue::Count {
                name: name.into(),
                count,
            },
            Some(0),
        )));
        set
    }

    fn counts(sets: &[MetricsSet], name: &str) -> Vec<usize> {
        sets.iter()
            .map(|s| s.sum_by_name(name).map(|v| v.as_usize()).unwrap_or(0))
            .collect()
    }

    #[test]
    fn gpu_operators_report_on_their_cpu_twins_and_fused_ones_report_nothing() {
        let planned = shape(&[
            "ShuffleWriterExec",
            "AggregateExec",
            "FilterExec",
            "DataSourceExec",
        ]);
        // The filter was fused into the aggregate.
        let ran = shape(&["ShuffleWriterExec", "GpuAggregateExec", "DataSourceExec"]);
        let sets = vec![counted("a", 1), counted("gpu_batches", 7), counted("b", 3)];
        let out = align(&planned, &ran, sets);
        assert_eq!(out.len(), 4);
        assert_eq!(counts(&out, "gpu_batches"), [0, 7, 0, 0]);
        assert_eq!(counts(&out, "b"), [0, 0, 0, 3]);
    }

    #[test]
    fn an_operator_without_a_twin_adds_to_the_one_before_it() {
        let planned = shape(&["ShuffleWriterExec", "ProjectionExec", "DataSourceExec"]);
        let ran = shape(&[
            "ShuffleWriterExec",
            "GpuProjectionExec",
            "OnceExec",
            "DataSourceExec",
        ]);
        let sets = vec![
            counted("a", 1),
            counted("gpu_batches", 2),
            counted("gpu_batches", 5),
            counted("b", 1),
        ];
        let out = align(&planned, &ran, sets);
        assert_eq!(counts(&out, "gpu_batches"), [0, 7, 0]);
    }

    #[test]
    fn a_mismatch_reports_nothing_rather_than_misplaced_metrics() {
        let planned = shape(&["ShuffleWriterExec"]);
        let ran = shape(&["ShuffleWriterExec", "FilterExec"]);
        let out = align(&planned, &ran, vec![counted("a", 1)]);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].iter().count(), 0);
    }
}
