//! Fused join stages (`gpu/fuse.rs`, `physical_plan/gpu_hash_join/fused.rs`): a join that
//! takes in the filter on its probe side gives DataFusion's answers, its output gathered on
//! the device (an inner join) or assembled on the host (a residual filter; left, semi and
//! anti joins), with the device work per batch counted and every device fault survived.

use super::fused::{fused_session, work_per_batch_of};
use super::{answer, devices_of, fail_each_in_turn, plan_has, run, tpch_contexts};

/// The tables of the fused joins' tests, on `ctx`: a build side `b` of 4 rows (a NULL key,
/// a key twice) and a probe side `p` of 400 rows (NULL keys, NULL and zero values, strings).
async fn join_tables(ctx: &crate::FulmenContext) {
    for sql in [
        "CREATE TABLE b AS VALUES (1, 'one'), (3, 'three'), (NULL, 'none'), (3, 'drei')",
        "CREATE TABLE p AS SELECT \
           CASE WHEN value % 11 = 0 THEN NULL ELSE value % 7 END AS k, \
           CASE WHEN value % 13 = 0 THEN NULL ELSE value % 5 END AS v, \
           concat('row', value) AS s FROM generate_series(1, 400)",
    ] {
        ctx.sql(sql).await.unwrap().collect().await.unwrap();
    }
}

/// `sql` on `gpu` and on `cpu` (DataFusion): the same answer (or error), from a fused join
/// (`shown` and `fused_filter=` in the plan, no filter operator) with nothing fallen back,
/// whose batches ran on the device (or, `by_rule`, one went to the CPU by rule).
async fn fused_answer(
    gpu: &crate::FulmenContext,
    cpu: &crate::FulmenContext,
    sql: &str,
    shown: &str,
    by_rule: bool,
) -> Result<String, String> {
    let (got, plan_text, work) = answer(gpu, sql).await;
    let (want, _, _) = answer(cpu, sql).await;
    assert_eq!(got, want, "{sql}");
    assert!(!plan_text.contains("GpuFilterExec"), "{plan_text}");
    assert!(plan_text.contains(shown), "{sql}: {plan_text}");
    assert!(plan_text.contains("fused_filter="), "{plan_text}");
    assert!(work.nothing_fell_back(), "{sql}: {work:?}");
    match by_rule {
        true => assert!(work.cpu_rule_batches >= 1, "{sql}: {work:?}"),
        false => assert!(
            work.gpu_batches >= 1 && work.cpu_rule_batches == 0,
            "{sql}: {work:?}"
        ),
    }
    got
}

/// An inner join takes in the filter on its probe side: the plan has no filter operator
/// and the join shows the predicate; rows the filter drops (false or NULL) match nothing,
/// whatever their keys; the output goes to the host or stays on the device for an
/// aggregate; a predicate that meets a row it leaves to the CPU (a division by zero) sends
/// the batch there by rule, which filters first, as DataFusion does; and the answers are
/// DataFusion's.
#[tokio::test]
async fn an_inner_join_takes_the_filter_on_its_probe_side_in() {
    let gpu = fused_session("emulated:1/fused-join", 1 << 20);
    let (_, cpu) = tpch_contexts("emulated:1/fused-join-cpu", 1, None);
    for ctx in [&gpu, &cpu] {
        join_tables(ctx).await;
    }
    for (sql, by_rule) in [
        (
            "SELECT b.column2 AS name, p.v, p.s FROM b JOIN p ON b.column1 = p.k \
             WHERE p.v > 2 ORDER BY p.s, name",
            false,
        ),
        (
            "SELECT b.column2 AS name, p.k, p.s FROM b JOIN p ON b.column1 = p.k \
             WHERE p.s LIKE '%1%' OR p.v IS NULL ORDER BY p.s, name",
            false,
        ),
        (
            "SELECT b.column2 AS name, sum(p.v) AS total, count(*) AS n FROM b \
             JOIN p ON b.column1 = p.k WHERE p.v >= 1 GROUP BY b.column2 ORDER BY name",
            false,
        ),
        (
            "SELECT b.column2 AS name, p.s FROM b JOIN p ON b.column1 = p.k \
             WHERE 10 / p.v > 3 ORDER BY p.s, name",
            true,
        ),
        (
            "SELECT p.s FROM b JOIN p ON b.column1 = p.k WHERE p.v > 100",
            false,
        ),
    ] {
        let _answer = fused_answer(&gpu, &cpu, sql, "GpuHashJoinExec", by_rule).await;
    }
    // Not folded: a right join (rows the filter drops would come out unmatched) and a
    // filter with a row limit.
    for sql in [
        "SELECT b.column2 AS name, p.s FROM b RIGHT JOIN p ON b.column1 = p.k \
         WHERE p.v > 2 ORDER BY p.s, name",
        "SELECT count(*) AS n FROM b JOIN (SELECT * FROM p WHERE p.v > 2 LIMIT 5) q \
         ON b.column1 = q.k",
    ] {
        let (got, plan_text, _) = answer(&gpu, sql).await;
        let (want, _, _) = answer(&cpu, sql).await;
        assert_eq!(got, want, "{sql}");
        assert!(!plan_text.contains("fused_filter="), "{plan_text}");
    }
}

/// A join that assembles its output on the host takes in the filter on its probe side too:
/// left, left semi, left anti and right semi joins, and an inner join with a residual
/// filter. The device probes under the predicate's mask and only the pairs come down,
/// indexing the input batch the host holds. A row the filter drops
/// (false or NULL: `row78`, key 1, has a NULL `v`) matches nothing and never comes out, so
/// a build row it alone would match comes out unmatched (left, anti) or not at all (semi);
/// a predicate that meets a row it leaves to the CPU (a division by zero in a CASE branch
/// DataFusion does not take) sends the batch there by rule; the answers are DataFusion's.
#[tokio::test]
async fn a_join_assembled_on_the_host_takes_the_filter_on_its_probe_side_in() {
    let gpu = fused_session("emulated:1/fused-host-join", 1 << 20);
    let (_, cpu) = tpch_contexts("emulated:1/fused-host-join-cpu", 1, None);
    for ctx in [&gpu, &cpu] {
        join_tables(ctx).await;
    }
    // Join reordering off: DataFusion would build on the filtered `p` (its estimate is
    // small) and probe `b`, leaving no filter on the probe side.
    let reorder = async |on: bool| {
        for ctx in [&gpu, &cpu] {
            let set = format!("SET datafusion.optimizer.join_reordering = {on}");
            ctx.sql(&set).await.unwrap().collect().await.unwrap();
        }
    };
    let only_row3 = "p.v > 0 AND p.s IN ('row3', 'row78')";
    for (sql, join_type, by_rule) in [
        (
            "SELECT b.column2 AS name, q.v, q.s FROM b \
             LEFT JOIN (SELECT * FROM p WHERE v > 2) q ON b.column1 = q.k ORDER BY q.s, name"
                .to_string(),
            "Left",
            false,
        ),
        (
            format!(
                "SELECT column2 AS name FROM b WHERE EXISTS \
                 (SELECT 1 FROM p WHERE p.k = b.column1 AND {only_row3}) ORDER BY name"
            ),
            "LeftSemi",
            false,
        ),
        (
            format!(
                "SELECT column2 AS name FROM b WHERE NOT EXISTS \
                 (SELECT 1 FROM p WHERE p.k = b.column1 AND {only_row3}) ORDER BY name"
            ),
            "LeftAnti",
            false,
        ),
        (
            "SELECT p.s, p.v FROM p WHERE EXISTS (SELECT 1 FROM b WHERE b.column1 = p.k) \
             AND p.v > 3"
                .to_string(),
            "RightSemi",
            false,
        ),
        (
            "SELECT b.column2 AS name, p.s FROM b JOIN p \
             ON b.column1 = p.k AND p.v > length(b.column2) - 3 \
             WHERE p.s LIKE '%7%' ORDER BY p.s, name"
                .to_string(),
            "Inner",
            false,
        ),
        (
            "SELECT column2 AS name FROM b WHERE EXISTS (SELECT 1 FROM p WHERE \
             p.k = b.column1 AND CASE WHEN p.v = 0 THEN 0 ELSE 10 / p.v END > 3) ORDER BY name"
                .to_string(),
            "LeftSemi",
            true,
        ),
    ] {
        // A right semi join is DataFusion's swap of `p`'s semi join over the small `b`.
        reorder(join_type == "RightSemi").await;
        let join = format!("join_type={join_type},");
        let got = fused_answer(&gpu, &cpu, &sql, &join, by_rule).await;
        assert!(got.is_ok(), "{sql}: {got:?}");
    }
    // The filter's rows decide the semi and anti joins: only key 3 is matched.
    reorder(false).await;
    let names = |sql: &str| {
        let gpu = &gpu;
        let sql = sql.to_string();
        async move { answer(gpu, &sql).await.0.unwrap() }
    };
    let semi = names(&format!(
        "SELECT column2 FROM b WHERE EXISTS \
         (SELECT 1 FROM p WHERE p.k = b.column1 AND {only_row3}) ORDER BY column2"
    ))
    .await;
    assert!(semi.contains("drei") && semi.contains("three"), "{semi}");
    assert!(!semi.contains("one"), "{semi}");
}

/// Failing each allocation, then each launch, of a fused join in turn still gives
/// DataFusion's answer: a batch the device gives up is filtered and matched on the host.
#[tokio::test]
async fn a_fused_join_survives_every_device_fault() {
    if super::needs_emulator("a_fused_join_survives_every_device_fault") {
        return;
    }
    let sql = "SELECT b.column2 AS name, p.v, p.s FROM b JOIN p ON b.column1 = p.k \
               WHERE p.v > 2 ORDER BY p.s, name";
    let shown = ["fused_filter="];
    survives_every_fault(
        "emulated:1/fused-join-faults",
        &[],
        sql,
        &shown,
        "fused join",
    )
    .await;
}

/// Runs `sql` over the join tables on `set` (after `settings`, on both sides), clean and
/// then with each of its device allocations and launches failed in turn: DataFusion's
/// answer every time; the plan shows each of `shown`.
async fn survives_every_fault(
    set: &str,
    settings: &[&str],
    sql: &str,
    shown: &[&str],
    label: &str,
) {
    let gpu = fused_session(set, 1 << 20);
    let (_, cpu) = tpch_contexts(&format!("{set}-cpu"), 1, None);
    for ctx in [&gpu, &cpu] {
        join_tables(ctx).await;
        for setting in settings {
            ctx.sql(setting).await.unwrap().collect().await.unwrap();
        }
    }
    let device = devices_of(set)[0].clone();
    let (_, want) = run(&cpu, sql).await;
    let (allocations, launches) = device.counters();
    let (text, clean) = run(&gpu, sql).await;
    assert_eq!(clean, want);
    assert!(shown.iter().all(|s| text.contains(s)), "{text}");
    let (a, l) = device.counters();
    fail_each_in_turn(
        &device,
        (a - allocations, l - launches),
        &want,
        label,
        async || run(&gpu, sql).await.1,
    )
    .await;
}

/// A join whose output goes to the host (a sort above it), with and without a filter on
/// its probe side taken in: per device batch 1 launch, or 2 under the filter (the
/// predicate's program, then the probe, which hashes the probe's keys, counts the matches,
/// scans their offsets and writes them in one pass; this output, a build-side string
/// beside two probe columns, is taken on the host from the pairs), and 1 host wait: the
/// probe's, which brings the program's error word and the pairs up too. No compaction and
/// no gathered filter output. It took 5 launches until the probe's count, scan and emit
/// became one, and 2 waits until the pairs came down in the probe's wait (2026-12-07).
#[tokio::test]
async fn a_join_whose_output_goes_to_the_host_probes_each_batch_with_one_wait() {
    for (k, filter) in [" WHERE l_quantity < 10", ""].into_iter().enumerate() {
        let sql = format!(
            "SELECT p_name, l_quantity, l_shipdate FROM part JOIN lineitem \
             ON p_partkey = l_partkey{filter} ORDER BY l_shipdate, p_name, l_quantity"
        );
        let sets = [
            format!("emulated:1/fused-join-waits-cpu-{k}"),
            format!("emulated:1/fused-join-waits-a-{k}"),
            format!("emulated:1/fused-join-waits-b-{k}"),
        ];
        let fused = !filter.is_empty();
        let (launches, syncs) = work_per_batch_of(
            "a join",
            &sql,
            [&sets[0], &sets[1], &sets[2]],
            |text, plan| {
                assert!(!plan_has(plan, "GpuFilterExec"), "{text}");
                assert_eq!(text.contains("fused_filter=l_quantity@"), fused, "{text}");
                assert!(text.contains("GpuHashJoinExec"), "{text}");
            },
        )
        .await;
        let most = if fused { 2.0 } else { 1.0 };
        assert!(
            launches <= most && syncs <= 1.0,
            "fused {fused}: {launches} launches, {syncs} syncs"
        );
    }
}

/// A fused join assembled on the host survives every device fault: a left anti join with a
/// residual filter, each allocation and then each launch failed in turn, gives DataFusion's
/// answer (a batch the device gives up is filtered by the twin and matched on the host).
#[tokio::test]
async fn a_fused_join_assembled_on_the_host_survives_every_device_fault() {
    if super::needs_emulator("a_fused_join_assembled_on_the_host_survives_every_device_fault") {
        return;
    }
    // So that `b` is the build side (see above).
    let settings = ["SET datafusion.optimizer.join_reordering = false"];
    let sql = "SELECT column2 AS name FROM b WHERE NOT EXISTS (SELECT 1 FROM p WHERE \
               p.k = b.column1 AND p.v <> length(b.column2) AND p.s LIKE '%3%') ORDER BY name";
    let shown = ["join_type=LeftAnti", "fused_filter="];
    let set = "emulated:1/fused-host-join-faults";
    let label = "fused join assembled on the host";
    survives_every_fault(set, &settings, sql, &shown, label).await;
}

/// A fused join assembled on the host (a right semi join probed by lineitem under a
/// filter): per device batch 2 launches (the predicate's program, then the probe: keys
/// hashed, matches counted, their offsets scanned and the matches written) and 1 host wait
/// (the probe's, which brings the program's error word and the pairs up too; 2 until the
/// pairs came down in it, 2026-12-07). No compaction, no gathered filter output, no second
/// upload of the keys.
#[tokio::test]
async fn a_fused_semi_join_probes_each_batch_with_one_wait() {
    let sql = "SELECT l_orderkey, l_linenumber, l_quantity FROM lineitem \
               WHERE l_quantity < 10 AND EXISTS (SELECT 1 FROM part WHERE p_partkey = l_partkey)";
    let (launches, syncs) = work_per_batch_of(
        "a fused semi join",
        sql,
        [
            "emulated:1/fused-semi-waits-cpu",
            "emulated:1/fused-semi-waits-a",
            "emulated:1/fused-semi-waits-b",
        ],
        |text, plan| {
            assert!(!plan_has(plan, "GpuFilterExec"), "{text}");
            assert!(
                text.contains("Semi") && text.contains("fused_filter="),
                "{text}"
            );
        },
    )
    .await;
    assert!(
        launches <= 2.0 && syncs <= 1.0,
        "{launches} launches, {syncs} syncs"
    );
}
