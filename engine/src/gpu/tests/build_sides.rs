//! CollectLeft build sides built where their rows lie (see
//! `physical_plan/gpu_hash_join/build_side.rs`): a join whose build child is a GPU operator
//! on the same devices gathers the child's chunks from all its partitions, concatenates
//! them on each device, and builds one table per device, shared by the device's
//! partitions. TPC-H over cached tables answers as DataFusion does while its CollectLeft
//! build sides neither come down nor go up again.

use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::{ExecutionPlan, displayable};

use super::cache::{CONTROL_BYTES, TPCH_TABLES, shown, text};
use super::{Work, devices_of, needs_emulator, plan_of, rows_of, run, tpch_contexts};

fn metric(node: &Arc<dyn ExecutionPlan>, name: &str) -> usize {
    node.metrics()
        .and_then(|m| m.sum_by_name(name))
        .map_or(0, |v| v.as_usize())
}

/// Each CollectLeft join of `plan` that built a table over device rows: what it uploaded,
/// and what the GPU operator feeding its build side downloaded.
fn collect_left_device_builds(plan: &Arc<dyn ExecutionPlan>) -> Vec<(usize, usize)> {
    let mut joins = Vec::new();
    let _ = plan.apply(|node| {
        let line = displayable(node.as_ref()).one_line().to_string();
        if node.name() == "GpuHashJoinExec"
            && line.contains("mode=CollectLeft")
            && metric(node, "device_builds") > 0
        {
            let mut build = Arc::clone(node.children()[0]);
            if build.name() == "CoalescePartitionsExec" {
                build = Arc::clone(build.children()[0]);
            }
            joins.push((metric(node, "h2d_bytes"), metric(&build, "d2h_bytes")));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    joins
}

/// One device running two partitions (as a one-GPU machine runs many): TPC-H's 22
/// queries over cached tables answer as DataFusion does, and every CollectLeft join fed
/// by a GPU operator builds one table on the device from the rows where they lie: the
/// operator under it downloads nothing and the join uploads no column. Q9's chain of four
/// such joins (each built over the last one's output) is among them. (Dynamic filters are
/// off: a join fills its probe side's filter with its build keys, which come down by
/// design, and a join feeding another's build side would count them.)
#[tokio::test]
async fn collect_left_build_sides_stay_on_the_device() {
    let set = "emulated:1/collect-left";
    let (gpu, cpu) = tpch_contexts(set, 2, None);
    for table in TPCH_TABLES {
        gpu.cache_table(table).await.unwrap();
    }
    let off = "SET datafusion.optimizer.enable_join_dynamic_filter_pushdown = false";
    text(&gpu, off).await;
    let mut built = 0;
    for q in 1..=22 {
        let sql = crate::tpch::QUERIES[q - 1];
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "Q{q}");
        assert!(Work::of(&plan).nothing_fell_back(), "Q{q}");
        let joins = collect_left_device_builds(&plan);
        for &(up, down) in &joins {
            let shown = shown(&plan);
            assert!(
                up < CONTROL_BYTES,
                "Q{q}: a join uploaded {up} bytes\n{shown}"
            );
            assert!(
                down < CONTROL_BYTES,
                "Q{q}: a build side came down ({down} bytes)\n{shown}"
            );
        }
        if q == 9 {
            assert!(joins.len() >= 4, "Q9: {joins:?}\n{}", shown(&plan));
        }
        built += joins.len();
    }
    println!("{built} CollectLeft joins built on the device");
    assert!(built >= 15, "{built} CollectLeft joins built on the device");
}

/// Two devices: each concatenates the chunks of both (the other's through the host) and
/// builds its own table; the answers stay DataFusion's. A device lost while the queries
/// probe sends its work through the host, with the same answers.
#[tokio::test]
async fn collect_left_build_sides_on_two_devices() {
    let set = "emulated:2/collect-left";
    let (gpu, cpu) = tpch_contexts(set, 2, None);
    for table in TPCH_TABLES {
        gpu.cache_table(table).await.unwrap();
    }
    let mut built = 0;
    for q in [3, 5, 7, 8, 9, 10, 18, 21] {
        let sql = crate::tpch::QUERIES[q - 1];
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "Q{q}");
        assert!(Work::of(&plan).nothing_fell_back(), "Q{q}");
        built += collect_left_device_builds(&plan).len();
    }
    assert!(built >= 8, "{built} CollectLeft joins built on the device");
    if needs_emulator("collect_left_build_sides_on_two_devices: a device lost") {
        return;
    }
    text(&gpu, "SET fulmen.gpu.on_error = 'fallback'").await;
    let devices = devices_of(set);
    devices[1]
        .inject_faults(fulmen_kernels::FaultPlan {
            lose_device_at_launch: Some(40),
            ..Default::default()
        })
        .unwrap();
    let sql = crate::tpch::QUERIES[8];
    let plan = plan_of(&gpu, sql).await;
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "Q9");
    assert!(
        devices[1].quarantined().is_some(),
        "the device was not lost"
    );
}
