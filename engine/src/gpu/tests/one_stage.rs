//! One-stage aggregation on one device (`gpu::one_stage`): an aggregation over several
//! partitions that one device runs takes every partition's rows into one group table
//! (`mode=Single`), with DataFusion's answer, fewer launches and waits than its two
//! stages, and nothing of the partial states brought down; across devices, and with
//! `fulmen.gpu.single_stage_aggregation = false`, the two stages stay.

use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::ExecutionPlan;

use super::build_sides::metric;
use super::cache::{partition_every_join, shown, text};
use super::{Work, metric_sum, plan_of, rows_of, run, tpch_contexts};
use crate::physical_plan::GpuAggregateExec;

/// The modes of `plan`'s GPU aggregations, and whether a CPU aggregation is left.
fn modes(plan: &Arc<dyn ExecutionPlan>) -> (Vec<String>, bool) {
    let (mut gpu, mut cpu) = (Vec::new(), false);
    let _ = plan.apply(|node| {
        if let Some(agg) = node.downcast_ref::<GpuAggregateExec>() {
            gpu.push(format!("{:?}", agg.mode()));
        }
        cpu |= node.name() == "AggregateExec";
        Ok(TreeNodeRecursion::Continue)
    });
    (gpu, cpu)
}

const QUERIES: [&str; 6] = [
    // Q1's shape: a filter the aggregation takes in, two string keys, four groups.
    "SELECT l_returnflag, l_linestatus, sum(l_quantity), avg(l_extendedprice), count(*) \
     FROM lineitem WHERE l_shipdate <= DATE '1998-09-01' GROUP BY 1, 2 ORDER BY 1, 2",
    // Without keys (a final stage over coalesced states, before).
    "SELECT sum(l_extendedprice * l_discount), count(*) FROM lineitem \
     WHERE l_discount BETWEEN 0.05 AND 0.07 AND l_quantity < 24",
    // Over a device join, with count(DISTINCT).
    "SELECT o_orderpriority, count(DISTINCT o_custkey), count(*) FROM orders \
     JOIN lineitem ON o_orderkey = l_orderkey WHERE l_commitdate < l_receiptdate \
     GROUP BY 1 ORDER BY 1",
    // A group per order, most of them new in every batch, and a HAVING above.
    "SELECT l_orderkey, sum(l_quantity) FROM lineitem GROUP BY 1 \
     HAVING sum(l_quantity) > 250 ORDER BY 1",
    // count(DISTINCT) planned as a GROUP BY under a GROUP BY: one stage at each level.
    "SELECT l_returnflag, count(DISTINCT l_suppkey) FROM lineitem GROUP BY 1 ORDER BY 1",
    // A window over a keyless aggregate: its one partition meets the window's need for
    // partitions by key as it is (a repartition of it would not run).
    "SELECT sum(l_quantity) AS s, count(*) OVER (PARTITION BY sum(l_quantity)) FROM lineitem",
];

#[tokio::test]
async fn one_device_aggregates_every_partition_in_one_stage() {
    let set = "emulated:1/one-stage";
    let (gpu, cpu) = tpch_contexts(set, 3, None);
    for sql in QUERIES {
        let want = run(&cpu, sql).await.1;
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, want, "{sql}");
        let text_of_plan = shown(&plan);
        let (gpu_modes, cpu_left) = modes(&plan);
        assert!(
            !cpu_left && !gpu_modes.is_empty() && gpu_modes.iter().all(|m| m == "Single"),
            "{sql}: {gpu_modes:?}\n{text_of_plan}"
        );
        let work = Work::of(&plan);
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back(),
            "{sql}: {work:?}\n{text_of_plan}"
        );
        let (launches, syncs) = (metric_sum(&plan, "launches"), metric_sum(&plan, "syncs"));

        // The same query in DataFusion's two stages: the same answer, more device work.
        text(&gpu, "SET fulmen.gpu.single_stage_aggregation = false").await;
        let two = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &two).await, want, "{sql}");
        let (two_modes, _) = modes(&two);
        assert!(
            two_modes.iter().any(|m| m == "Partial"),
            "{sql}: {two_modes:?}\n{}",
            shown(&two)
        );
        let (two_launches, two_syncs) = (metric_sum(&two, "launches"), metric_sum(&two, "syncs"));
        assert!(
            launches < two_launches && syncs < two_syncs,
            "{sql}: one stage {launches} launches, {syncs} syncs; two stages {two_launches}, \
             {two_syncs}\n{text_of_plan}"
        );
        text(&gpu, "SET fulmen.gpu.single_stage_aggregation = true").await;
    }
}

/// Where the aggregation's parent needs its rows partitioned by the keys (a partitioned
/// join of two aggregations), a repartition goes over the one stage: the answer is
/// DataFusion's.
#[tokio::test]
async fn a_one_stage_aggregation_under_a_partitioned_join_is_repartitioned() {
    let set = "emulated:1/one-stage-join";
    let (gpu, cpu) = tpch_contexts(set, 2, None);
    let sql = "SELECT count(*), sum(q), sum(n) FROM \
               (SELECT l_orderkey AS k, sum(l_quantity) AS q FROM lineitem GROUP BY 1) a \
               JOIN (SELECT o_orderkey AS k, count(*) AS n FROM orders \
                     WHERE o_totalprice > 1000 GROUP BY 1) b ON a.k = b.k";
    for ctx in [&gpu, &cpu] {
        partition_every_join(ctx).await;
    }
    let plan = plan_of(&gpu, sql).await;
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
    let shown = shown(&plan);
    let (gpu_modes, cpu_left) = modes(&plan);
    let singles = gpu_modes.iter().filter(|m| *m == "Single").count();
    assert!(!cpu_left && singles >= 2, "{gpu_modes:?}\n{shown}");
    // Each one-stage aggregation under the join is repartitioned by its keys.
    let mut repartitioned = 0;
    let _ = plan.apply(|node| {
        if node.name() == "RepartitionExec"
            && let Some(agg) = node.children()[0].downcast_ref::<GpuAggregateExec>()
        {
            assert_eq!(format!("{:?}", agg.mode()), "Single", "{shown}");
            repartitioned += 1;
        }
        Ok(TreeNodeRecursion::Continue)
    });
    assert_eq!(repartitioned, 2, "{shown}");
    let work = Work::of(&plan);
    assert!(
        work.gpu_batches > 0 && work.nothing_fell_back(),
        "{work:?}\n{shown}"
    );
}

/// An interleave of aggregations (a UNION ALL of GROUP BYs by the same keys, which
/// DataFusion reads side by side, partition by partition) needs its children partitioned
/// alike by those keys: each one-stage aggregation under it is repartitioned by them.
#[tokio::test]
async fn one_stage_aggregations_under_an_interleave_are_repartitioned() {
    let set = "emulated:1/one-stage-interleave";
    let (gpu, cpu) = tpch_contexts(set, 3, None);
    let queries = [
        "SELECT * FROM (SELECT 0 AS m, l_returnflag AS k FROM lineitem GROUP BY 1, 2) \
         UNION ALL SELECT * FROM (SELECT 1 AS m, l_linestatus AS k FROM lineitem GROUP BY 1, 2) \
         ORDER BY 1, 2",
        "SELECT c, k, sum(t) FROM ( \
           SELECT 'o' AS c, l_returnflag AS k, sum(l_quantity) AS t FROM lineitem \
           WHERE l_linestatus = 'O' GROUP BY l_returnflag \
           UNION ALL \
           SELECT 'f' AS c, l_returnflag AS k, sum(l_quantity) AS t FROM lineitem \
           WHERE l_linestatus = 'F' GROUP BY l_returnflag) \
         GROUP BY ROLLUP(c, k) ORDER BY c NULLS FIRST, k NULLS FIRST",
    ];
    for sql in queries {
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "{sql}");
        let shown = shown(&plan);
        let mut interleaved = 0;
        let _ = plan.apply(|node| {
            if node.name() == "InterleaveExec" {
                for child in node.children() {
                    let mut singles = 0;
                    let _ = child.apply(|n| {
                        if n.name() == "RepartitionExec"
                            && let Some(agg) = n.children()[0].downcast_ref::<GpuAggregateExec>()
                        {
                            assert_eq!(format!("{:?}", agg.mode()), "Single", "{shown}");
                            singles += 1;
                            return Ok(TreeNodeRecursion::Jump);
                        }
                        Ok(TreeNodeRecursion::Continue)
                    });
                    assert_eq!(singles, 1, "{sql}\n{shown}");
                    interleaved += 1;
                }
            }
            Ok(TreeNodeRecursion::Continue)
        });
        assert_eq!(interleaved, 2, "{sql}\n{shown}");
        let work = Work::of(&plan);
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back(),
            "{work:?}\n{shown}"
        );
    }
}

/// A final stage whose output is ordered (partial stages over sorted partitions, their
/// states repartitioned preserving that order) lets the plan above merge its partitions
/// without sorting again: one stage over coalesced rows would not keep that order, so the
/// two stages stay, and the answer comes in DataFusion's order.
#[tokio::test]
async fn an_ordered_final_stage_keeps_both_stages() {
    let set = "emulated:1/one-stage-ordered";
    let (gpu, cpu) = tpch_contexts(set, 3, None);
    let sorted = "SELECT l_orderkey, l_quantity FROM lineitem ORDER BY l_orderkey";
    let batches = cpu.sql(sorted).await.unwrap().collect().await.unwrap();
    let batch = datafusion::arrow::compute::concat_batches(&batches[0].schema(), &batches).unwrap();
    // Three partitions, each a sorted run of the keys.
    let third = batch.num_rows().div_ceil(3);
    let partitions: Vec<_> = (0..3)
        .map(|k| {
            let at = (k * third).min(batch.num_rows());
            vec![batch.slice(at, third.min(batch.num_rows() - at))]
        })
        .collect();
    let order = vec![vec![
        datafusion::logical_expr::col("l_orderkey").sort(true, false),
    ]];
    for ctx in [&gpu, &cpu] {
        let table = datafusion::datasource::MemTable::try_new(batch.schema(), partitions.clone())
            .unwrap()
            .with_sort_order(order.clone());
        ctx.session_context()
            .register_table("sorted_lineitem", Arc::new(table))
            .unwrap();
        text(ctx, "SET datafusion.optimizer.prefer_existing_sort = true").await;
    }
    let sql = "SELECT l_orderkey, sum(l_quantity) FROM sorted_lineitem GROUP BY l_orderkey \
               ORDER BY l_orderkey";
    let plan = plan_of(&gpu, sql).await;
    let shown = shown(&plan);
    assert_eq!(
        rows_of(&gpu, &plan).await,
        run(&cpu, sql).await.1,
        "{shown}"
    );
    // The final stage's order is what the plan's merge relies on: no sort above it.
    let (modes, _) = modes(&plan);
    assert!(
        !modes.iter().any(|m| m == "Single") && !shown.contains("SortExec"),
        "{modes:?}\n{shown}"
    );
    let mut ordered_final = false;
    let _ = plan.apply(|node| {
        ordered_final |= node
            .downcast_ref::<GpuAggregateExec>()
            .is_some_and(|agg| format!("{:?}", agg.mode()) == "FinalPartitioned")
            && node.properties().output_ordering().is_some();
        Ok(TreeNodeRecursion::Continue)
    });
    assert!(ordered_final, "{shown}");
    let work = Work::of(&plan);
    assert!(
        work.gpu_batches > 0 && work.nothing_fell_back(),
        "{work:?}\n{shown}"
    );
}

/// Across devices the partial states meet through the host: the two stages stay, and the
/// partial stage on each device brings its states down.
#[tokio::test]
async fn two_devices_keep_both_stages() {
    let set = "emulated:2/one-stage-two-devices";
    let (gpu, cpu) = tpch_contexts(set, 2, None);
    let sql = QUERIES[0];
    let plan = plan_of(&gpu, sql).await;
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
    let shown = shown(&plan);
    let (gpu_modes, _) = modes(&plan);
    assert!(
        gpu_modes.iter().any(|m| m == "Partial") && !gpu_modes.iter().any(|m| m == "Single"),
        "{gpu_modes:?}\n{shown}"
    );
    let mut partial_down = 0;
    let _ = plan.apply(|node| {
        if let Some(agg) = node.downcast_ref::<GpuAggregateExec>()
            && format!("{:?}", agg.mode()) == "Partial"
        {
            partial_down += metric(node, "d2h_bytes");
        }
        Ok(TreeNodeRecursion::Continue)
    });
    assert!(partial_down > 0, "{shown}");
    let work = Work::of(&plan);
    assert!(
        work.gpu_batches > 0 && work.nothing_fell_back(),
        "{work:?}\n{shown}"
    );
}
