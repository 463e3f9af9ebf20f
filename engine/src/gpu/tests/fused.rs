//! Fused device stages (`gpu/fuse.rs`): an aggregate that takes in the filter (and the
//! projection) under it gives DataFusion's answers, with the device work per batch of
//! issue #15's targets, rows the filter drops kept out of its arguments and its groups,
//! and every device fault survived.

use super::{
    Work, alone_on_cuda, answer, devices_of, fail_each_in_turn, gpu_config, metric_sum, plan_has,
    plan_of, rows_of, run, session, tpch_contexts, tpch_run,
};

/// A session forcing the GPU on `set` with device batches of `batch_rows`, TPC-H SF 0.01
/// registered.
pub(super) fn fused_session(set: &str, batch_rows: usize) -> crate::FulmenContext {
    let ctx = session(
        crate::FulmenConfig {
            gpu_batch_rows: batch_rows,
            ..gpu_config(set)
        },
        1,
    );
    ctx.register_tpch(0.01).unwrap();
    ctx
}

/// TPC-H Q6's keyless aggregate takes its filter in: the plan has no filter operator, the
/// aggregate shows the predicate, the answer is DataFusion's, every device batch's program
/// fed the accumulators from its registers, and each costs 2 launches (the fused kernel
/// and the merge of its deltas) and 1 host sync (issue #15's Q6 target: 3 and 1).
#[tokio::test]
async fn a_keyless_aggregate_takes_its_filter_into_one_device_stage() {
    let (launches, syncs) = work_per_batch(
        6,
        [
            "emulated:1/fused-q6-cpu",
            "emulated:1/fused-q6-a",
            "emulated:1/fused-q6-b",
        ],
        |text, plan| {
            assert!(!plan_has(plan, "GpuFilterExec"), "{text}");
            assert!(text.contains("FILTER (WHERE l_shipdate@"), "{text}");
            every_batch_fed_from_registers(text, plan);
        },
    )
    .await;
    assert!(
        launches <= 2.0 && syncs <= 1.0,
        "{launches} launches, {syncs} syncs"
    );
}

/// Every device batch of every aggregate in `plan` was added by the fused kernel, its
/// program's registers feeding the accumulators (`fused_batches`).
fn every_batch_fed_from_registers(
    text: &str,
    plan: &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
) {
    let (fused, batches) = (
        metric_sum(plan, "fused_batches"),
        metric_sum(plan, "gpu_batches"),
    );
    assert!(
        fused > 0 && fused == batches,
        "{fused} of {batches}: {text}"
    );
}

/// As [`every_batch_fed_from_registers`], but for grouped aggregates: each one's first
/// batch goes the ordinary way (its keys inserted as it goes), since at SF 0.01 taking a
/// first batch's keys before a fused try does not pay (`first_keys_pay`), and every batch
/// after it was added by the fused kernel. One partition each.
fn every_batch_after_the_first_fed_from_registers(
    text: &str,
    plan: &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
) {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut firsts = 0;
    let _ = plan.apply(|node| {
        if node.name() == "GpuAggregateExec" && super::build_sides::metric(node, "gpu_batches") > 0
        {
            firsts += 1;
        }
        Ok(TreeNodeRecursion::Continue)
    });
    let (fused, batches) = (
        metric_sum(plan, "fused_batches"),
        metric_sum(plan, "gpu_batches"),
    );
    assert!(
        firsts > 0 && fused + firsts == batches,
        "{fused} of {batches} fused, {firsts} aggregates: {text}"
    );
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
        let (got, plan_text, work) = answer(&gpu, sql).await;
        let (want, _, _) = answer(&cpu, sql).await;
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

/// The work per device batch of TPC-H query `q` on fused sessions: what each batch adds
/// when the same rows come in batches of 4096 rows rather than one (the scan's batches of
/// 8192 rows then go to the device one by one), as (launches, host syncs); the plan of the
/// last run is checked by `check` and each answer against DataFusion's.
async fn work_per_batch(
    q: usize,
    sets: [&str; 3],
    check: impl Fn(&str, &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>),
) -> (f64, f64) {
    work_per_batch_of(&format!("Q{q}"), crate::tpch::QUERIES[q - 1], sets, check).await
}

/// [`work_per_batch`] of any query over TPC-H's tables (`label` names it in messages).
pub(super) async fn work_per_batch_of(
    label: &str,
    sql: &str,
    sets: [&str; 3],
    check: impl Fn(&str, &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>),
) -> (f64, f64) {
    // On CUDA both runs share the GPU: it is this test's alone, and a first run makes what
    // a stream makes once (its scans' look-back state), so that both runs find it made.
    alone_on_cuda(sets[1]);
    let (_, cpu) = tpch_contexts(sets[0], 1, None);
    let (_, want) = run(&cpu, sql).await;
    if super::on_cuda() {
        let gpu = fused_session(sets[1], 1 << 20);
        rows_of(&gpu, &plan_of(&gpu, sql).await).await;
    }
    let mut runs = Vec::new();
    for (set, rows) in [(sets[1], 1 << 20), (sets[2], 4096)] {
        super::settle_cuda(set);
        let gpu = fused_session(set, rows);
        let plan = plan_of(&gpu, sql).await;
        let got = rows_of(&gpu, &plan).await;
        assert_eq!(got, want, "{label}, batches of {rows} rows");
        let work = Work::of(&plan);
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back() && work.cpu_rule_batches == 0,
            "{work:?}"
        );
        let text = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        check(&text, &plan);
        runs.push((
            metric_sum(&plan, "gpu_batches"),
            metric_sum(&plan, "launches"),
            metric_sum(&plan, "syncs"),
        ));
    }
    let [(b1, l1, s1), (b2, l2, s2)] = runs[..] else {
        unreachable!()
    };
    assert!(b2 >= b1 + 5, "{runs:?}");
    let per_batch = (
        (l2 - l1) as f64 / (b2 - b1) as f64,
        (s2 - s1) as f64 / (b2 - b1) as f64,
    );
    println!(
        "{label}, per device batch: {} launches, {} host syncs ({runs:?})",
        per_batch.0, per_batch.1
    );
    per_batch
}

/// TPC-H Q1's grouped aggregate takes in its filter and the projection between them: the
/// plan has neither, the aggregate shows the predicate, the answer is DataFusion's, every
/// device batch after each aggregate's first fed the accumulators from its program's
/// registers (the first, of at most 60 000 rows here, goes the ordinary way), and a device
/// batch costs about 2 launches and 1 host sync (issue #15's Q1 target: 6 and 1).
#[tokio::test]
async fn a_grouped_aggregate_takes_its_filter_into_one_device_stage() {
    let (launches, syncs) = work_per_batch(
        1,
        [
            "emulated:1/fused-q1-cpu",
            "emulated:1/fused-q1-a",
            "emulated:1/fused-q1-b",
        ],
        |text, plan| {
            assert!(!plan_has(plan, "GpuFilterExec"), "{text}");
            assert!(!plan_has(plan, "GpuProjectionExec"), "{text}");
            assert!(text.contains("fused_filter=l_shipdate@"), "{text}");
            every_batch_after_the_first_fed_from_registers(text, plan);
        },
    )
    .await;
    assert!(
        launches <= 3.0 && syncs <= 1.0,
        "{launches} launches, {syncs} syncs"
    );
}

/// A filter over host batches whose output goes to the host takes its rows there: per
/// device batch one launch (the predicate's program) and one wait (its bits, with the
/// error word), with only the predicate's inputs uploaded and two bits a row downloaded.
/// (Until 2026-12-07 two waits, once for the count and once for the output, and three
/// launches: the program, the compaction and the gather of every output column, all of
/// them uploaded and the kept rows downloaded.)
#[tokio::test]
async fn a_filter_from_the_host_to_the_host_waits_once_for_its_predicate() {
    let sql = "SELECT l_orderkey, l_linenumber, l_extendedprice, l_comment, l_shipdate \
               FROM lineitem WHERE l_shipdate > DATE '1998-09-01' AND l_discount >= 0.05 \
               ORDER BY l_orderkey, l_linenumber";
    let (launches, syncs) = work_per_batch_of(
        "a filter to the host",
        sql,
        [
            "emulated:1/filter-waits-cpu",
            "emulated:1/filter-waits-a",
            "emulated:1/filter-waits-b",
        ],
        |text, plan| {
            assert!(plan_has(plan, "GpuFilterExec"), "{text}");
            assert!(!plan_has(plan, "GpuProjectionExec"), "{text}");
            let filter = the_node(plan, "GpuFilterExec");
            let (rows, up, down) = (
                metric_sum(&filter, "input_rows").max(60_000),
                metric_sum(&filter, "h2d_bytes"),
                metric_sum(&filter, "d2h_bytes"),
            );
            // Two columns up (a date and a decimal held as 8 bytes), not five; two bits a
            // row and the status words down.
            assert!(up <= rows * 12 + (1 << 16), "{up} bytes up\n{text}");
            assert!(down <= rows / 4 + (1 << 12), "{down} bytes down\n{text}");
        },
    )
    .await;
    assert!(
        launches <= 1.0 && syncs <= 1.0,
        "{launches} launches, {syncs} syncs"
    );
}

/// The one node named `name` in `plan`, which must be there.
pub(super) fn the_node(
    plan: &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
    name: &str,
) -> std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut found = Vec::new();
    let _ = plan.apply(|node| {
        if node.name() == name {
            found.push(std::sync::Arc::clone(node));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    assert_eq!(found.len(), 1, "{name}");
    found.remove(0)
}

/// A projection whose output goes to the host waits once per device batch: its program is
/// queued unchecked and its error word comes up with its outputs, in their download's wait
/// (two waits until 2026-12-07: the error word, then the outputs). One launch: the program.
#[tokio::test]
async fn a_projection_to_the_host_waits_once_for_its_outputs_and_error_word() {
    let sql = "SELECT l_orderkey, l_linenumber, l_extendedprice * (1 - l_discount) AS r, \
               l_quantity + 1 AS q FROM lineitem ORDER BY l_orderkey, l_linenumber";
    let (launches, syncs) = work_per_batch_of(
        "a projection",
        sql,
        [
            "emulated:1/projection-waits-cpu",
            "emulated:1/projection-waits-a",
            "emulated:1/projection-waits-b",
        ],
        |text, plan| {
            assert!(plan_has(plan, "GpuProjectionExec"), "{text}");
            assert!(!plan_has(plan, "GpuFilterExec"), "{text}");
        },
    )
    .await;
    assert!(
        launches <= 1.0 && syncs <= 1.0,
        "{launches} launches, {syncs} syncs"
    );
}

/// A projection over a device filter, to the host: columns passed through from the device
/// (a string among them), a constant and computed columns come down in schema order with
/// the program's error word; where the program leaves a row to the CPU (a division by zero
/// in a CASE branch the row does not take, which DataFusion never evaluates) the word sends
/// the batch to the CPU, by rule, and the answer is DataFusion's.
#[tokio::test]
async fn a_projection_to_the_host_over_device_rows_keeps_its_columns_and_leaves_by_rule() {
    let (gpu, cpu) = tpch_contexts("emulated:1/projection-mixed", 1, None);
    let computed = "SELECT l_orderkey, l_linenumber, 7 AS seven, l_quantity * l_extendedprice AS v, \
               l_shipmode, l_discount + 1 AS d FROM lineitem WHERE l_discount > 0.05 \
               ORDER BY l_orderkey, l_linenumber";
    let guarded = "SELECT l_orderkey, l_linenumber, 7 AS seven, l_shipmode, \
               CASE WHEN l_linenumber = 1 THEN 0 ELSE 100 / (l_linenumber - 1) END AS q \
               FROM lineitem WHERE l_discount > 0.05 ORDER BY l_orderkey, l_linenumber";
    for (sql, by_rule) in [(computed, false), (guarded, true)] {
        let plan = plan_of(&gpu, sql).await;
        let got = rows_of(&gpu, &plan).await;
        let text = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        assert_eq!(got, run(&cpu, sql).await.1, "{text}");
        assert!(
            plan_has(&plan, "GpuProjectionExec") && plan_has(&plan, "GpuFilterExec"),
            "{text}"
        );
        let work = Work::of(&plan);
        assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
        assert_eq!(work.cpu_rule_batches > 0, by_rule, "{work:?}\n{text}");
    }
}

/// A filter over device rows (a cached table's chunks) whose output, string columns among
/// it, goes to the host waits twice a device batch: once for its count, the program's error
/// word and the byte totals of the strings it gathers (their lengths queued over its
/// selection before the count is known; before, each string column added a wait of its
/// own), once for the download of its output. Its launches: the program, the compaction
/// (one pass), the fixed-width columns' gather, the string columns' lengths and offsets (one
/// launch for all) and their bytes' copy (one launch), and a launch for each dictionary's
/// codes (the cache holds `l_shipmode` and `l_returnflag` as dictionaries): 8 (23 for the
/// same output before gathers took several columns a launch and scans went to one pass).
/// It uploads no column.
#[tokio::test]
async fn a_filter_over_device_rows_waits_once_for_its_count_and_their_bytes() {
    let sql = "SELECT l_orderkey, l_linenumber, l_shipmode, l_comment, l_returnflag FROM lineitem \
               WHERE l_shipdate > DATE '1998-09-01' AND l_discount >= 0.05 \
               ORDER BY l_orderkey, l_linenumber";
    let (gpu, cpu) = tpch_contexts("emulated:1/filter-strings", 1, None);
    gpu.cache_table("lineitem").await.unwrap();
    let (_, want) = run(&cpu, sql).await;
    let plan = plan_of(&gpu, sql).await;
    assert_eq!(rows_of(&gpu, &plan).await, want);
    let work = Work::of(&plan);
    assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
    let filter = the_node(&plan, "GpuFilterExec");
    let batches = metric_sum(&filter, "gpu_batches");
    let (launches, syncs) = (
        metric_sum(&filter, "launches"),
        metric_sum(&filter, "syncs"),
    );
    assert!(
        batches > 0 && launches <= 8 * batches && syncs <= 2 * batches,
        "{batches} batches: {launches} launches, {syncs} syncs"
    );
    assert!(metric_sum(&filter, "h2d_bytes") < 4 * super::cache::CONTROL_BYTES);
}

/// Rows a fused filter drops make no group, whatever the keys (computed, strings, NULL)
/// and aggregates (with their own FILTER too); rows it drops cannot fail an argument (the
/// batch goes to the CPU by rule, which filters first, as DataFusion does); with no row
/// passing there is no group; and `count(DISTINCT …)`s of two columns (which DataFusion
/// cannot rewrite into a grouping) keep their filter operator.
#[tokio::test]
async fn a_fused_filter_makes_no_group_of_the_rows_it_drops() {
    let gpu = fused_session("emulated:1/fused-groups", 1 << 20);
    let (_, cpu) = tpch_contexts("emulated:1/fused-groups-cpu", 1, None);
    let table = "CREATE TABLE g AS VALUES (1, 0, 'a'), (1, 5, 'b'), (2, 0, 'c'), (3, 10, 'd'), \
                 (NULL, 4, 'e'), (3, NULL, 'f'), (4, -3, 'g'), (2, 1, 'c')";
    for ctx in [&gpu, &cpu] {
        ctx.sql(table).await.unwrap().collect().await.unwrap();
    }
    for (sql, by_rule) in [
        (
            "SELECT column1 AS k, count(*) AS n, sum(100 / column2) AS s FROM g \
             WHERE column2 <> 0 GROUP BY column1 ORDER BY k",
            true,
        ),
        (
            "SELECT column1 + 1 AS k, count(*) AS n, sum(column2) AS s, avg(column2) AS a, \
             min(column2) AS lo, max(column2) AS hi FROM g WHERE column2 > 3 \
             GROUP BY column1 + 1 ORDER BY k",
            false,
        ),
        (
            "SELECT column3 AS k, sum(column2) AS s, count(column2) AS c FROM g \
             WHERE column1 = 3 OR column2 < 0 GROUP BY column3 ORDER BY k",
            false,
        ),
        (
            "SELECT column1 AS k, count(*) FILTER (WHERE column2 > 4) AS big, count(*) AS n \
             FROM g WHERE column2 IS NOT NULL GROUP BY column1 ORDER BY k",
            false,
        ),
        (
            "SELECT column1 AS k, count(*) AS n FROM g WHERE column2 > 100 GROUP BY column1",
            false,
        ),
    ] {
        let (got, plan_text, work) = answer(&gpu, sql).await;
        let (want, _, _) = answer(&cpu, sql).await;
        assert_eq!(got, want, "{sql}");
        assert!(!plan_text.contains("GpuFilterExec"), "{plan_text}");
        assert!(plan_text.contains("fused_filter="), "{plan_text}");
        assert!(work.nothing_fell_back(), "{sql}: {work:?}");
        if by_rule {
            assert!(work.cpu_rule_batches >= 1, "{sql}: {work:?}");
        } else {
            assert!(work.cpu_rule_batches == 0, "{sql}: {work:?}");
        }
    }
    let distinct = "SELECT column1 AS k, count(DISTINCT column2) AS d, \
                    count(DISTINCT column3) AS e FROM g WHERE column2 > 0 \
                    GROUP BY column1 ORDER BY k";
    let (got, plan_text, _) = answer(&gpu, distinct).await;
    let (want, _, _) = answer(&cpu, distinct).await;
    assert_eq!(got, want);
    assert!(plan_text.contains("GpuFilterExec"), "{plan_text}");
    assert!(!plan_text.contains("fused_filter="), "{plan_text}");
}

/// Failing each allocation, then each launch, of TPC-H Q1's fused stage in turn still gives
/// DataFusion's answer: where the device gives up, the CPU finishes with the filter applied
/// to the rows the device had not taken.
#[tokio::test]
async fn the_fused_q1_stage_survives_every_device_fault() {
    if super::needs_emulator("the_fused_q1_stage_survives_every_device_fault") {
        return;
    }
    let gpu = fused_session("emulated:1/fused-q1-faults", 16384);
    let (_, cpu) = tpch_contexts("emulated:1/fused-q1-faults-cpu", 1, None);
    let device = devices_of("emulated:1/fused-q1-faults")[0].clone();
    let (_, want) = run(&cpu, crate::tpch::QUERIES[0]).await;
    let (allocations, launches) = device.counters();
    let (clean, plan) = tpch_run(&gpu, 1).await;
    assert_eq!(clean, want);
    let text = datafusion::physical_plan::displayable(plan.as_ref())
        .indent(false)
        .to_string();
    assert!(text.contains("fused_filter="), "{text}");
    let (a, l) = device.counters();
    fail_each_in_turn(
        &device,
        (a - allocations, l - launches),
        &want,
        "fused Q1",
        async || tpch_run(&gpu, 1).await.0,
    )
    .await;
}
