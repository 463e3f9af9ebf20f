//! Device-resident chains: adjacent GPU operators hand device batches to each other, so a
//! chain moves only its inputs up and its groups down.

use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::ExecutionPlan;

use super::{Work, devices_of, plan_of, rows_of, run, tpch_contexts, tpch_run};

/// Each node of an executed plan with the bytes it copied up (host → device) and down.
fn bytes_moved(plan: &Arc<dyn ExecutionPlan>) -> Vec<(String, usize, usize)> {
    let mut seen = Vec::new();
    let _ = plan.apply(|node| {
        if let Some(m) = node.metrics() {
            let get = |name: &str| m.sum_by_name(name).map_or(0, |v| v.as_usize());
            seen.push((node.name().to_string(), get("h2d_bytes"), get("d2h_bytes")));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    seen
}

/// A metric summed over every node of an executed plan.
fn plan_total(plan: &Arc<dyn ExecutionPlan>, name: &str) -> u64 {
    let mut total = 0;
    let _ = plan.apply(|node| {
        if let Some(m) = node.metrics() {
            total += m.sum_by_name(name).map_or(0, |v| v.as_usize()) as u64;
        }
        Ok(TreeNodeRecursion::Continue)
    });
    total
}

/// Every device call a query makes is counted for the operator that made it: the
/// operators' `launches`, `syncs`, `h2d_bytes`, `d2h_bytes` and `device_bytes` add up to
/// what the device itself counted over the query.
#[tokio::test]
async fn each_operator_counts_its_own_device_work_and_nothing_is_left_out() {
    if super::on_cuda() {
        // Every test shares the GPUs there, so a device's counts mix theirs; CI checks the
        // counts through CUDA against the stand-in driver's in a process of their own.
        println!("each_operator_counts_its_own_device_work…: not on shared CUDA devices");
        return;
    }
    for (q, set) in [(1, "emulated:1/metered-q1"), (3, "emulated:2/metered-q3")] {
        let (gpu, cpu) = tpch_contexts(set, 2, None);
        let devices = devices_of(set);
        let before: Vec<_> = devices.iter().map(|d| d.counts()).collect();
        let (got, plan) = tpch_run(&gpu, q).await;
        let (_, want) = run(&cpu, crate::tpch::QUERIES[q - 1]).await;
        assert_eq!(got, want, "Q{q}");
        let work = Work::of(&plan);
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back(),
            "Q{q}: {work:?}"
        );
        let mut spent = fulmen_kernels::DeviceCounts::default();
        for (d, b) in devices.iter().zip(&before) {
            spent += &d.counts().since(b);
        }
        assert!(spent.launches > 0, "Q{q}: {spent:?}");
        let metered = [
            ("launches", spent.launches),
            ("syncs", spent.syncs),
            ("h2d_bytes", spent.h2d_bytes),
            ("d2h_bytes", spent.d2h_bytes),
            ("device_bytes", spent.device_bytes),
        ];
        for (name, by_device) in metered {
            assert_eq!(plan_total(&plan, name), by_device, "Q{q}: {name}");
        }
    }
}

/// More bytes than an operator's programs, descriptor tables and row counts take, and fewer
/// than any column of the tests' tables: a copy this large moved data.
const CONTROL_BYTES: usize = 4096;

/// The first node called `name` among `seen`.
fn moved_by<'a>(seen: &'a [(String, usize, usize)], name: &str) -> &'a (String, usize, usize) {
    seen.iter()
        .find(|(n, ..)| n == name)
        .unwrap_or_else(|| panic!("no {name} in {seen:?}"))
}

/// TPC-H Q1's filter → projection → partial aggregate runs as one device-resident stage:
/// the filter uploads the scanned columns, its output stays on the device for the
/// projection, whose output stays there for the aggregation; only the groups come down.
#[tokio::test]
async fn adjacent_gpu_operators_pass_device_batches() {
    let (gpu, cpu) = tpch_contexts("emulated:1/resident-q1", 1, None);
    let (got, plan) = tpch_run(&gpu, 1).await;
    let (_, want) = run(&cpu, crate::tpch::QUERIES[0]).await;
    assert_eq!(got, want);
    let work = Work::of(&plan);
    assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
    let seen = bytes_moved(&plan);
    let find = |name: &str| moved_by(&seen, name);
    let (_, filter_up, filter_down) = find("GpuFilterExec");
    let (_, projection_up, projection_down) = find("GpuProjectionExec");
    let (_, aggregate_up, aggregate_down) = find("GpuAggregateExec");
    println!(
        "Q1 bytes (up, down): filter {filter_up}/{filter_down}, projection {projection_up}/{projection_down}, aggregate {aggregate_up}/{aggregate_down}"
    );
    // Byte counts are every copy an operator makes: besides columns, its programs and
    // descriptor tables go up and row counts come down — a few hundred bytes. No column
    // crosses inside the chain: the smallest (a flag per row of 60 000 rows) is 60 KB.
    assert!(*filter_up > 4 << 20, "{seen:?}");
    for (what, bytes) in [
        ("the filter's download", filter_down),
        ("the projection's upload", projection_up),
        ("the projection's download", projection_down),
        ("the aggregation's upload", aggregate_up),
    ] {
        assert!(*bytes < CONTROL_BYTES, "{what}: {bytes} bytes ({seen:?})");
    }
    assert!(*aggregate_down > 0 && *aggregate_down < 2048, "{seen:?}");
}

/// A filter → hash join → partial aggregate chain moves only its inputs up and its groups
/// down: the filtered probe rows reach the join on the device, the join's output reaches
/// the aggregation on the device.
#[tokio::test]
async fn a_filter_join_aggregate_chain_stays_on_the_device() {
    let (gpu, cpu) = tpch_contexts("emulated:1/resident-join", 1, None);
    let sql = "SELECT o_orderpriority, count(*) AS n, sum(l_quantity) AS q \
               FROM orders JOIN lineitem ON l_orderkey = o_orderkey \
               WHERE l_commitdate < l_receiptdate GROUP BY o_orderpriority ORDER BY 1";
    let plan = plan_of(&gpu, sql).await;
    let got = rows_of(&gpu, &plan).await;
    let (_, want) = run(&cpu, sql).await;
    assert_eq!(got, want);
    let work = Work::of(&plan);
    assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
    let seen = bytes_moved(&plan);
    println!("bytes (up, down) per node: {seen:?}");
    let find = |name: &str| moved_by(&seen, name);
    let (_, filter_up, filter_down) = find("GpuFilterExec");
    let (_, join_up, join_down) = find("GpuHashJoinExec");
    let (_, aggregate_up, aggregate_down) = find("GpuAggregateExec");
    assert!(*filter_up > 0 && *join_up > 0, "{seen:?}");
    for (what, bytes) in [
        ("the filter's download", filter_down),
        ("the join's download", join_down),
        ("the aggregation's upload", aggregate_up),
    ] {
        assert!(*bytes < CONTROL_BYTES, "{what}: {bytes} bytes ({seen:?})");
    }
    assert!(*aggregate_down > 0 && *aggregate_down < 4096, "{seen:?}");
}

/// A session forcing the GPU on `set` with device batches of `batch_rows`, TPC-H SF 0.01
/// registered.
fn fused_session(set: &str, batch_rows: usize) -> crate::FulmenContext {
    let ctx = super::session(
        crate::FulmenConfig {
            gpu_batch_rows: batch_rows,
            ..super::gpu_config(set)
        },
        1,
    );
    ctx.register_tpch(0.01).unwrap();
    ctx
}

/// TPC-H Q6's keyless aggregate takes its filter in (`gpu/fuse.rs`): the plan has no
/// filter operator, the aggregate shows the predicate, the answer is DataFusion's, and each
/// device batch costs at most 3 launches and 1 host sync (issue #15's Q6 target), counted
/// as what each batch adds when the same rows come in batches of 4096 rows rather than one
/// (the scan's batches of 8192 rows then go to the device one by one).
#[tokio::test]
async fn a_keyless_aggregate_takes_its_filter_into_one_device_stage() {
    let (_, cpu) = tpch_contexts("emulated:1/fused-q6-cpu", 1, None);
    let (_, want) = run(&cpu, crate::tpch::QUERIES[5]).await;
    let mut runs = Vec::new();
    for (set, rows) in [
        ("emulated:1/fused-q6-a", 1 << 20),
        ("emulated:1/fused-q6-b", 4096),
    ] {
        let gpu = fused_session(set, rows);
        let (got, plan) = tpch_run(&gpu, 6).await;
        assert_eq!(got, want, "batches of {rows} rows");
        let work = Work::of(&plan);
        assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
        assert!(!super::plan_has(&plan, "GpuFilterExec"));
        let text = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        assert!(text.contains("FILTER (WHERE l_shipdate@"), "{text}");
        let batches = plan_total(&plan, "gpu_batches");
        runs.push((
            batches,
            plan_total(&plan, "launches"),
            plan_total(&plan, "syncs"),
        ));
    }
    let [(b1, l1, s1), (b2, l2, s2)] = runs[..] else {
        unreachable!()
    };
    assert!(b2 >= b1 + 5, "{runs:?}");
    let (launches, syncs) = (
        (l2 - l1) as f64 / (b2 - b1) as f64,
        (s2 - s1) as f64 / (b2 - b1) as f64,
    );
    println!("Q6 fused, per device batch: {launches} launches, {syncs} host syncs ({runs:?})");
    assert!(launches <= 3.0 && syncs <= 1.0, "{runs:?}");
}

/// The folded predicate guards each argument: rows it drops cannot fail an argument (a
/// division by zero sends the batch to the CPU, which evaluates the guard first, as
/// DataFusion does), with no row passing the aggregates give what they give over no rows,
/// and a filter with a row limit is not folded.
#[tokio::test]
async fn a_folded_filter_keeps_its_rows_out_of_the_arguments() {
    let gpu = fused_session("emulated:1/fused-guard", 1 << 20);
    let (_, cpu) = tpch_contexts("emulated:1/fused-guard-cpu", 1, None);
    let table = "CREATE TABLE d AS VALUES (0, 1), (5, 2), (0, 3), (10, 4), (NULL, 5)";
    for ctx in [&gpu, &cpu] {
        ctx.sql(table).await.unwrap().collect().await.unwrap();
    }
    // The first query's batch has rows that divide by zero: the device hands it to the CPU
    // by rule; the second runs on the device.
    for (sql, by_rule) in [
        (
            "SELECT sum(100 / column1) AS s, count(*) AS n, avg(column2) AS a, \
             min(column2) AS lo, max(column2) AS hi, count(DISTINCT column2) AS k \
             FROM d WHERE column1 <> 0",
            true,
        ),
        (
            "SELECT sum(column2) AS s, count(*) AS n, count(column2) AS c, avg(column2) AS a, \
             min(column2) AS lo FROM d WHERE column1 > 100",
            false,
        ),
    ] {
        let (got, plan_text, work) = super::answer(&gpu, sql).await;
        let (want, _, _) = super::answer(&cpu, sql).await;
        assert_eq!(got, want, "{sql}");
        assert!(!plan_text.contains("GpuFilterExec"), "{plan_text}");
        assert!(plan_text.contains("GpuAggregateExec"), "{plan_text}");
        assert!(work.nothing_fell_back(), "{sql}: {work:?}");
        if by_rule {
            assert!(work.cpu_rule_batches >= 1, "{sql}: {work:?}");
        } else {
            assert!(
                work.gpu_batches >= 1 && work.cpu_rule_batches == 0,
                "{sql}: {work:?}"
            );
        }
    }
    // A row limit pushed into the filter keeps it: the aggregate counts at most 2 rows.
    let limited = "SELECT count(*) AS n FROM (SELECT * FROM d WHERE column2 > 1 LIMIT 2)";
    let (_, got) = run(&gpu, limited).await;
    let (_, want) = run(&cpu, limited).await;
    assert_eq!(got, want);
    assert!(got.contains("| 2 |"), "{got}");
}
