//! Joins: random equi-joins of every supported type over random data with NULL keys and
//! skew (a hot key, all keys distinct, an empty side), with and without a residual filter,
//! in one partition and in three (the GPU's answer equals DataFusion's and the device
//! matched the batches); the probe side's dynamic filter.

use std::sync::Arc;

use datafusion::arrow::array::{Int32Array, Int64Array, RecordBatch, StringArray};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::prelude::SessionConfig;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::{answer, cpu_config, devices_of, gpu_config, run};
use crate::FulmenContext;

type Row = (Option<i32>, Option<String>, Option<i64>);

/// The devices of the random joins, which no other test uses.
const JOIN_DEVICES: &str = "emulated:1/joins";

fn key() -> BoxedStrategy<Option<i32>> {
    prop_oneof![
        proptest::option::weighted(0.85, 0i32..8),
        prop_oneof![8 => Just(Some(3)), 2 => proptest::option::of(0i32..50)],
        proptest::option::weighted(0.95, any::<i32>()),
    ]
    .boxed()
}

fn side(max: usize) -> impl Strategy<Value = Vec<Row>> {
    proptest::collection::vec(
        (
            key(),
            proptest::option::weighted(0.9, "[ab]{0,1}"),
            proptest::option::weighted(0.9, -50i64..50),
        ),
        0..max,
    )
}

fn batch(rows: &[Row], names: [&str; 3]) -> RecordBatch {
    RecordBatch::try_from_iter(vec![
        (
            names[0],
            Arc::new(Int32Array::from_iter(rows.iter().map(|r| r.0))) as _,
        ),
        (
            names[1],
            Arc::new(StringArray::from_iter(rows.iter().map(|r| r.1.clone()))) as _,
        ),
        (
            names[2],
            Arc::new(Int64Array::from_iter(rows.iter().map(|r| r.2))) as _,
        ),
    ])
    .unwrap()
}

/// With several partitions, both sides are hash-partitioned (Partitioned mode) rather
/// than the small build side collected (CollectLeft, which one partition gives).
fn context(gpu: bool, partitions: usize) -> FulmenContext {
    let session = SessionConfig::new()
        .with_target_partitions(partitions)
        .set_usize(
            "datafusion.optimizer.hash_join_single_partition_threshold",
            if partitions > 1 { 0 } else { 1 << 20 },
        )
        .set_usize(
            "datafusion.optimizer.hash_join_single_partition_threshold_rows",
            if partitions > 1 { 0 } else { 1 << 20 },
        );
    let config = if gpu {
        gpu_config(JOIN_DEVICES)
    } else {
        cpu_config()
    };
    FulmenContext::with_session_config(session, config)
}

fn register(ctx: &FulmenContext, name: &str, data: &RecordBatch, partitions: usize) {
    let n = data.num_rows();
    let parts: Vec<Vec<RecordBatch>> = (0..partitions)
        .map(|p| {
            let (from, to) = (n * p / partitions, n * (p + 1) / partitions);
            vec![data.slice(from, to - from)]
        })
        .collect();
    let table = datafusion::datasource::MemTable::try_new(data.schema(), parts).unwrap();
    ctx.session_context()
        .register_table(name, Arc::new(table))
        .unwrap();
}

fn check(l: &[Row], r: &[Row], sql: &str, partitions: usize) -> Result<(), TestCaseError> {
    super::block_on(async {
        let (gpu, cpu) = (context(true, partitions), context(false, partitions));
        for ctx in [&gpu, &cpu] {
            register(ctx, "l", &batch(l, ["k", "s", "a"]), partitions);
            register(ctx, "r", &batch(r, ["k2", "s2", "b"]), partitions);
        }
        // The set is this test's own: no other test moves its counters.
        let device = devices_of(JOIN_DEVICES)[0].clone();
        let launches = device.counters().1;
        let (gpu_rows, gpu_plan, work) = answer(&gpu, sql).await;
        let (cpu_rows, cpu_plan, _) = answer(&cpu, sql).await;

        prop_assert_eq!(&gpu_rows, &cpu_rows, "{}\n{}", sql, gpu_plan);
        let mode = if partitions > 1 {
            "mode=Partitioned"
        } else {
            "mode=CollectLeft"
        };
        prop_assert!(cpu_plan.contains(mode), "{}\n{}", sql, cpu_plan);
        prop_assert!(work.nothing_fell_back(), "{}: {:?}", sql, work);
        if cpu_plan.contains("HashJoinExec") {
            prop_assert!(
                gpu_plan.contains("GpuHashJoinExec"),
                "{}\n{}",
                sql,
                gpu_plan
            );
            prop_assert!(
                !gpu_plan.contains("HashJoinExec stays on CPU"),
                "{}\n{}",
                sql,
                gpu_plan
            );
            if !l.is_empty() && !r.is_empty() {
                prop_assert!(device.counters().1 > launches, "no kernel ran for {}", sql);
            }
        }
        Ok(())
    })
}

fn join() -> impl Strategy<Value = (&'static str, bool)> {
    (
        prop_oneof![
            Just("INNER"),
            Just("LEFT"),
            Just("RIGHT"),
            Just("FULL"),
            Just("LEFT SEMI"),
            Just("LEFT ANTI"),
            Just("RIGHT SEMI"),
            Just("RIGHT ANTI"),
        ],
        any::<bool>(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn gpu_joins_equal_datafusion(
        l in side(60),
        r in side(60),
        (kind, filtered) in join(),
        two_keys in any::<bool>(),
        partitions in prop_oneof![Just(1usize), Just(3)],
    ) {
        let mut on = "l.k = r.k2".to_string();
        if two_keys {
            on.push_str(" AND l.s = r.s2");
        }
        if filtered {
            on.push_str(" AND l.a < r.b");
        }
        let columns = match kind {
            "LEFT SEMI" | "LEFT ANTI" => "l.k, l.s, l.a",
            "RIGHT SEMI" | "RIGHT ANTI" => "r.k2, r.s2, r.b",
            _ => "l.k, l.s, l.a, r.k2, r.s2, r.b",
        };
        let order: Vec<String> =
            (1..=columns.split(',').count()).map(|i| i.to_string()).collect();
        let sql = format!(
            "SELECT {columns} FROM l {kind} JOIN r ON {on} ORDER BY {}",
            order.join(", ")
        );
        check(&l, &r, &sql, partitions)?;
        if kind == "INNER" {
            // Under a GPU parent the join's output stays on the device.
            let sql = format!(
                "SELECT l.s, count(*) AS n, sum(l.a * 2 + r.b) AS t \
                 FROM l JOIN r ON {on} GROUP BY l.s ORDER BY 1"
            );
            check(&l, &r, &sql, partitions)?;
        }
    }
}

/// A Parquet file `probe.parquet` in `dir` of 100 000 rows (`k` 0..100 000, `v` = k % 97)
/// in row groups of 10 000, for a join's dynamic filter to prune.
fn probe_parquet(dir: &std::path::Path) -> std::path::PathBuf {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    let path = dir.join("probe.parquet");
    let k: Vec<i64> = (0..100_000).collect();
    let probe = RecordBatch::try_from_iter(vec![
        ("k", Arc::new(Int64Array::from(k.clone())) as _),
        (
            "v",
            Arc::new(Int64Array::from_iter_values(k.iter().map(|k| k % 97))) as _,
        ),
    ])
    .unwrap();
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(10_000))
        .build();
    let file = std::fs::File::create(&path).unwrap();
    let mut writer = ArrowWriter::try_new(file, probe.schema(), Some(properties)).unwrap();
    writer.write(&probe).unwrap();
    writer.close().unwrap();
    path
}

/// A GPU join fills the dynamic filter DataFusion's planner gave its probe side's scan
/// with the build side's key range (as DataFusion's HashJoinExec does), in CollectLeft and
/// in Partitioned mode, and the Parquet scan prunes row groups with it.
#[tokio::test]
async fn gpu_joins_fill_the_probe_sides_dynamic_filter() {
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::ParquetReadOptions;

    let dir = tempfile::tempdir().unwrap();
    let path = probe_parquet(dir.path());
    let dim = RecordBatch::try_from_iter(vec![(
        "d",
        Arc::new(Int64Array::from_iter_values(20_000..20_010)) as _,
    )])
    .unwrap();
    let sql = "SELECT count(*) AS n, sum(p.v) AS s FROM dim JOIN probe p ON p.k = dim.d";
    for partitions in [1, 3] {
        let contexts = [true, false].map(|on_gpu| {
            let config = SessionConfig::new()
                .with_target_partitions(partitions)
                .set_usize(
                    "datafusion.optimizer.hash_join_single_partition_threshold",
                    0,
                )
                .set_usize(
                    "datafusion.optimizer.hash_join_single_partition_threshold_rows",
                    0,
                );
            let fulmen = if on_gpu {
                gpu_config("emulated:1/dynamic-filter")
            } else {
                cpu_config()
            };
            FulmenContext::with_session_config(config, fulmen)
        });
        for ctx in &contexts {
            ctx.session_context()
                .register_batch("dim", dim.clone())
                .unwrap();
            ctx.session_context()
                .register_parquet(
                    "probe",
                    path.to_str().unwrap(),
                    ParquetReadOptions::default(),
                )
                .await
                .unwrap();
        }
        let [gpu, cpu] = &contexts;
        let (_, want) = run(cpu, sql).await;
        let plan = super::plan_of(gpu, sql).await;
        assert_eq!(super::rows_of(gpu, &plan).await, want);
        let work = super::Work::of(&plan);
        assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
        let text = displayable(plan.as_ref()).indent(true).to_string();
        let mode = if partitions == 1 {
            "CollectLeft"
        } else {
            "Partitioned"
        };
        let device = super::described("emulated:1/dynamic-filter");
        assert!(
            text.contains(&format!("GpuHashJoinExec: device={device}, mode={mode}")),
            "{text}"
        );
        assert!(
            text.contains("DynamicFilter [ k@0 >= 20000 AND k@0 <= 20009 ]"),
            "{partitions} partitions:\n{text}"
        );
        // Nine of the ten row groups lie outside the range: the scan reads one.
        let mut scanned = 0;
        let _ = plan.apply(|node| {
            if node.name() == "DataSourceExec"
                && let Some(m) = node.metrics()
            {
                scanned += m.output_rows().unwrap_or(0);
            }
            Ok(TreeNodeRecursion::Continue)
        });
        assert!(
            scanned <= 10_000 + 10,
            "{partitions} partitions: {scanned} rows scanned"
        );
        // Run again after DataFusion's reset (as recursive queries do): the same answer.
        let again = datafusion::physical_plan::execution_plan::reset_plan_states(plan).unwrap();
        assert_eq!(super::rows_of(gpu, &again).await, want);
        // Every join type, and an empty build side (its filter is `false`): the same
        // answers as DataFusion's.
        let none = dim.slice(0, 0);
        for ctx in &contexts {
            ctx.session_context()
                .register_batch("none", none.clone())
                .unwrap();
        }
        for join in [
            "SELECT count(*), sum(p.v) FROM dim LEFT JOIN probe p ON p.k = dim.d",
            "SELECT count(*), sum(p.v) FROM dim RIGHT JOIN probe p ON p.k = dim.d",
            "SELECT count(*) FROM dim WHERE d IN (SELECT k FROM probe)",
            "SELECT count(*) FROM dim WHERE d NOT IN (SELECT k FROM probe WHERE v > 3)",
            "SELECT count(*), sum(v) FROM probe WHERE k IN (SELECT d FROM dim)",
            "SELECT count(*), sum(v) FROM probe WHERE NOT EXISTS \
             (SELECT 1 FROM dim WHERE d = k)",
            "SELECT count(*), sum(p.v) FROM none JOIN probe p ON p.k = none.d",
            "SELECT count(*), sum(p.v) FROM none RIGHT JOIN probe p ON p.k = none.d",
            "SELECT count(*), sum(v) FROM probe WHERE k IN (SELECT d FROM none)",
        ] {
            let (_, want) = run(cpu, join).await;
            let (got, plan, work) = answer(gpu, join).await;
            assert_eq!(got, Ok(want), "{join}\n{plan}");
            assert!(plan.contains("GpuHashJoinExec"), "{join}\n{plan}");
            assert!(work.nothing_fell_back(), "{join}: {work:?}");
        }
    }
}

/// A build side that lies on the device (a GPU filter over a cached table) fills the probe
/// side's dynamic filter from its key bounds reduced there: the join brings none of its
/// 99 900 keys down (800 KB, where it used to), the filter holds the range DataFusion's
/// would, and the Parquet scan prunes with it; every device fault in turn leaves the answer
/// DataFusion's.
#[tokio::test]
async fn a_device_build_side_fills_the_dynamic_filter_from_bounds_reduced_there() {
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::ParquetReadOptions;

    let dir = tempfile::tempdir().unwrap();
    let path = probe_parquet(dir.path());
    // 100 000 build keys in 20 000..=29 999, every 1 000th NULL.
    let dim = RecordBatch::try_from_iter(vec![(
        "d",
        Arc::new(Int64Array::from_iter((0..100_000i64).map(|i| {
            (i % 1_000 != 7).then_some(20_000 + (i * 7_919) % 10_000)
        }))) as _,
    )])
    .unwrap();
    let set = "emulated:1/dynamic-filter-bounds";
    // Under a GPU filter: a cached scan alone comes wrapped in DataFusion's
    // `CooperativeExec`, which the join collects on the host.
    let sql = "SELECT count(*) AS n, sum(p.v) AS s FROM dim JOIN probe p ON p.k = dim.d \
               WHERE dim.d <> 5";
    let contexts = [true, false].map(|on_gpu| {
        let config = SessionConfig::new().with_target_partitions(1);
        let fulmen = if on_gpu {
            gpu_config(set)
        } else {
            cpu_config()
        };
        FulmenContext::with_session_config(config, fulmen)
    });
    for ctx in &contexts {
        let session = ctx.session_context();
        session.register_batch("dim", dim.clone()).unwrap();
        let options = ParquetReadOptions::default();
        (session.register_parquet("probe", path.to_str().unwrap(), options))
            .await
            .unwrap();
    }
    let [gpu, cpu] = &contexts;
    gpu.cache_table("dim").await.unwrap();
    let (_, want) = run(cpu, sql).await;
    let device = devices_of(set)[0].clone();
    let (allocations, launches) = device.counters();
    let plan = super::plan_of(gpu, sql).await;
    assert_eq!(super::rows_of(gpu, &plan).await, want);
    let (a, l) = device.counters();
    let work = super::Work::of(&plan);
    assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
    let text = displayable(plan.as_ref()).indent(true).to_string();
    assert!(
        text.contains("DynamicFilter [ k@0 >= 20000 AND k@0 <= 29999 ]"),
        "{text}"
    );
    let mut join = None;
    let mut scanned = 0;
    let _ = plan.apply(|node| {
        match node.name() {
            "GpuHashJoinExec" => join = Some(Arc::clone(node)),
            "DataSourceExec" => {
                scanned += node.metrics().and_then(|m| m.output_rows()).unwrap_or(0)
            }
            _ => {}
        }
        Ok(TreeNodeRecursion::Continue)
    });
    let join = join.unwrap_or_else(|| panic!("no GPU join\n{text}"));
    use super::build_sides::metric;
    assert!(metric(&join, "device_builds") > 0, "{text}");
    let down = metric(&join, "d2h_bytes");
    assert!(down < 4096, "the join brought {down} bytes down\n{text}");
    // Nine of the ten row groups lie outside the range: the scan reads one.
    assert!(scanned <= 10_000, "{scanned} rows scanned");
    // Each allocation and then each launch failed in turn (the reduction's among them):
    // the answer is DataFusion's (the keys come down instead, or the filter stays empty).
    if !super::needs_emulator("the dynamic filter's bounds under device faults") {
        super::fail_each_in_turn(
            &device,
            (a - allocations, l - launches),
            &want,
            "a join filling its dynamic filter from device bounds",
            async || run(gpu, sql).await.1,
        )
        .await;
    }
}

/// A join whose probe batch does not fit in device memory probes it in halves, each a
/// device batch of its own (down to 4096 rows), as a filter or an aggregation does, rather
/// than redoing all of it on the CPU; the answer is DataFusion's, whether the join matches
/// on the device and takes its output on the host (its parent is a CPU operator) or keeps
/// its output on the device (an aggregate above it). 2 MiB holds orders' table but not a
/// whole lineitem batch's probe (1.5 and 2.5 MiB split it too; 3 MiB holds all since a
/// probe counts, scans and writes its pairs in one launch, without a count and an offset
/// per row);
/// with the aggregate's group table beside them, 4 MiB (at 3 MiB the aggregate, fed pieces
/// it cannot split, has no room for the first and runs on the CPU).
#[tokio::test]
async fn a_join_probes_a_batch_the_device_has_no_memory_for_in_halves() {
    for (k, (sql, limit)) in [
        (
            "SELECT l_orderkey, l_linenumber, o_orderdate FROM lineitem \
             JOIN orders ON l_orderkey = o_orderkey ORDER BY l_orderkey, l_linenumber",
            2 << 20,
        ),
        (
            "SELECT o_orderpriority, count(*), sum(l_quantity) FROM lineitem \
             JOIN orders ON l_orderkey = o_orderkey GROUP BY o_orderpriority ORDER BY 1",
            4 << 20,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let devices = format!("emulated:1/join-split-{k}");
        let (gpu, cpu) = super::tpch_contexts(&devices, 1, Some(limit));
        let want = super::rows_of(&cpu, &super::plan_of(&cpu, sql).await).await;
        let plan = super::plan_of(&gpu, sql).await;
        let got = super::rows_of(&gpu, &plan).await;
        assert_eq!(got, want, "{sql}");
        let mut join = None;
        let _ = plan.apply(|node| {
            if node.name() == "GpuHashJoinExec" {
                join = node.metrics();
            }
            Ok(TreeNodeRecursion::Continue)
        });
        let join = join.unwrap_or_else(|| panic!("{sql}: no GPU join in the plan"));
        let of = |name: &str| join.sum_by_name(name).map_or(0, |v| v.as_usize());
        let (split, on_device) = (of("split_batches"), of("gpu_batches"));
        assert!(
            split > 0 && on_device > split,
            "{sql}: {split} splits, {on_device} batches"
        );
        let work = super::Work::of(&plan);
        assert!(work.nothing_fell_back(), "{sql}: {work:?}");
    }
}

/// A selective inner join whose output stays on the device (an aggregate above it), over
/// probe rows from the host: its keys go up whole, and of the other probe columns it
/// outputs only the matched rows, taken on the host (`probe_takes`), where all of
/// lineitem's rows of four decimals went up to be gathered on the device. A join that keeps
/// every probe row uploads those columns whole and gathers them there, as before, and does
/// not read its matched probe rows in its probes' waits (at the last probe's rate, taking
/// them would not pay). The
/// answers are DataFusion's, on one partition and on two.
#[tokio::test]
async fn a_selective_join_uploads_only_the_probe_rows_it_matched() {
    use super::build_sides::{metric, output_rows};
    let selective = "SELECT p_brand, sum(l_extendedprice), sum(l_discount), sum(l_tax), \
                     sum(l_quantity), count(*) FROM part JOIN lineitem ON p_partkey = l_partkey \
                     WHERE p_size = 15 GROUP BY p_brand ORDER BY 1";
    let keeps_all = "SELECT o_orderpriority, sum(l_extendedprice), sum(l_discount), count(*) \
                     FROM orders JOIN lineitem ON o_orderkey = l_orderkey \
                     GROUP BY o_orderpriority ORDER BY 1";
    for partitions in [1, 2] {
        let devices = format!("emulated:1/probe-takes-{partitions}");
        let (gpu, cpu) = super::tpch_contexts(&devices, partitions, None);
        let lineitem: usize = super::cache::text(&cpu, "SELECT count(*) AS n FROM lineitem")
            .await
            .lines()
            .filter_map(|l| l.trim_matches(|c| c == '|' || c == ' ').parse().ok())
            .next()
            .expect("lineitem's row count");
        for (sql, takes) in [(selective, true), (keeps_all, false)] {
            let what = format!("{partitions} partitions: {sql}");
            // The join that keeps every row in batches of 8 Ki rows (lineitem has 60 175):
            // each probe after the first has the last one's rate to weigh reading its probe
            // rows by.
            let rows = if takes { 1 << 22 } else { 8192 };
            super::cache::text(&gpu, &format!("SET fulmen.gpu.batch_rows = {rows}")).await;
            let want = super::rows_of(&cpu, &super::plan_of(&cpu, sql).await).await;
            let plan = super::plan_of(&gpu, sql).await;
            assert_eq!(super::rows_of(&gpu, &plan).await, want, "{what}");
            let work = super::Work::of(&plan);
            assert!(
                work.gpu_batches > 0 && work.nothing_fell_back(),
                "{what}: {work:?}"
            );
            let mut join = None;
            let _ = plan.apply(|node| {
                if node.name() == "GpuHashJoinExec" {
                    join = Some(Arc::clone(node));
                }
                Ok(TreeNodeRecursion::Continue)
            });
            let shown = super::cache::shown(&plan);
            let join = join.unwrap_or_else(|| panic!("{what}: no GPU join\n{shown}"));
            assert!(shown.contains("GpuAggregateExec"), "{what}\n{shown}");
            let (up, down, rows, taken) = (
                metric(&join, "h2d_bytes"),
                metric(&join, "d2h_bytes"),
                output_rows(&join),
                metric(&join, "probe_takes"),
            );
            println!("{what}: {up} B up for {rows} of {lineitem} rows, {taken} batches taken");
            match takes {
                // The 8-byte keys whole, and less than one more 8-byte column's worth.
                true => {
                    assert!(rows > 0 && rows * 20 < lineitem, "{what}: {rows} rows");
                    assert!(taken > 0, "{what}: nothing taken on the host\n{shown}");
                    assert!(
                        up < lineitem * 16,
                        "{what}: {up} bytes up for {lineitem} probe rows\n{shown}"
                    );
                }
                // Nothing taken (keys and two decimals, 8 bytes each on the device, every
                // row, went up whole).
                false => {
                    assert_eq!(taken, 0, "{what}\n{shown}");
                    assert!(up >= lineitem * 24, "{what}: {up} bytes up\n{shown}");
                    // Status words, not 4 bytes a probe row.
                    assert!(down < lineitem, "{what}: {down} bytes down\n{shown}");
                }
            }
        }
    }
}

/// The selective join above survives every device fault: each of its allocations (the
/// taken rows' uploads among them) and then each of its launches failed in turn, the
/// answer is DataFusion's (a batch the device gives up is matched on the host).
#[tokio::test]
async fn a_selective_join_survives_every_device_fault() {
    if super::needs_emulator("a_selective_join_survives_every_device_fault") {
        return;
    }
    let sql = "SELECT p_brand, sum(l_extendedprice), sum(l_tax), count(*) FROM part \
               JOIN lineitem ON p_partkey = l_partkey WHERE p_size = 15 \
               GROUP BY p_brand ORDER BY 1";
    let set = "emulated:1/probe-takes-faults";
    let (gpu, cpu) = super::tpch_contexts(set, 1, None);
    let device = devices_of(set)[0].clone();
    let (_, want) = run(&cpu, sql).await;
    let (allocations, launches) = device.counters();
    let plan = super::plan_of(&gpu, sql).await;
    let clean = super::rows_of(&gpu, &plan).await;
    let (a, l) = device.counters();
    assert_eq!(
        clean,
        super::rows_of(&cpu, &super::plan_of(&cpu, sql).await).await
    );
    // The clean run took its matched rows on the host: the faults below meet that path.
    let (taken, work) = (
        super::metric_sum(&plan, "probe_takes"),
        super::Work::of(&plan),
    );
    assert!(taken > 0, "{}", super::cache::shown(&plan));
    assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
    super::fail_each_in_turn(
        &device,
        (a - allocations, l - launches),
        &want,
        "selective join",
        async || run(&gpu, sql).await.1,
    )
    .await;
}

/// A selective join whose output stays on the device (an aggregate above it), per device
/// batch of its probe side from the host (64 Ki rows of three 8-byte columns, so that taking
/// the matched rows on the host pays): the probe rows it takes come down in the probe's one
/// wait (read with its total, as many as the last batch's rate of matches predicts), where
/// they were read in a wait of their own (2 waits a batch until 2026-12-07). The answers
/// are DataFusion's.
#[tokio::test]
async fn a_selective_join_reads_the_probe_rows_it_takes_in_the_probes_wait() {
    use super::build_sides::metric;
    let tables = [
        "CREATE TABLE big AS SELECT v AS k, v * 1.5 AS a, v * 2.5 AS b, v * 3.5 AS c \
         FROM generate_series(1, 400000) AS t(v)",
        "CREATE TABLE few AS SELECT v * 97 AS k FROM generate_series(1, 4000) AS t(v)",
    ];
    let sql = "SELECT sum(a), sum(b), sum(c), count(*) FROM few JOIN big ON few.k = big.k";
    let (_, cpu) = super::tpch_contexts("emulated:1/probe-takes-waits-cpu", 1, None);
    for t in tables {
        run(&cpu, t).await;
    }
    let (_, want) = run(&cpu, sql).await;
    let mut runs = Vec::new();
    for (set, rows) in [
        ("emulated:1/probe-takes-waits-a", 1 << 20),
        ("emulated:1/probe-takes-waits-b", 1 << 16),
    ] {
        let gpu = super::fused::fused_session(set, rows);
        for t in tables {
            run(&gpu, t).await;
        }
        let plan = super::plan_of(&gpu, sql).await;
        assert_eq!(super::rows_of(&gpu, &plan).await, want, "batches of {rows}");
        let work = super::Work::of(&plan);
        assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
        let join = super::fused::the_node(&plan, "GpuHashJoinExec");
        let shown = super::cache::shown(&plan);
        assert!(shown.contains("GpuAggregateExec"), "{shown}");
        runs.push((
            metric(&join, "gpu_batches"),
            metric(&join, "syncs"),
            metric(&join, "probe_takes"),
        ));
    }
    let [(b1, s1, t1), (b2, s2, t2)] = runs[..] else {
        unreachable!()
    };
    assert!(
        b2 >= b1 + 5 && t2 >= t1 + 5,
        "(batches, syncs, takes) {runs:?}"
    );
    let per_batch = (s2 - s1) as f64 / (b2 - b1) as f64;
    assert!(per_batch <= 1.0, "{per_batch} waits a batch: {runs:?}");
}
