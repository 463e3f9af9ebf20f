//! Cached tables (`CACHE TABLE`, see `cache/mod.rs`): TPC-H over tables in device memory
//! answers as DataFusion does with no column uploaded; a cache that does not fit, chunks and
//! replicas, concurrent queries, and the statements' errors. (Changes, the listing, freeing
//! and lost devices: `cache_lifecycle.rs`.)

use std::sync::Arc;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::ExecutionPlan;

use super::{
    Work, cpu_config, devices_of, gpu_config, metric_sum, needs_emulator, plan_has, plan_of,
    rows_of, run, session, tpch_contexts,
};
use crate::FulmenContext;
use crate::config::OnError;

/// More bytes than an operator's programs, descriptor tables and counts take per batch,
/// and fewer than any column of the tests' tables: an upload this large moved data.
pub(super) const CONTROL_BYTES: usize = 4096;

pub(super) const TPCH_TABLES: [&str; 8] = [
    "lineitem", "orders", "customer", "part", "partsupp", "supplier", "nation", "region",
];

/// A statement's rows as text (it must succeed).
pub(super) async fn text(ctx: &FulmenContext, sql: &str) -> String {
    let batches = ctx
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    pretty_format_batches(&batches).unwrap().to_string()
}

/// A statement's error (it must fail).
async fn error(ctx: &FulmenContext, sql: &str) -> String {
    let result = match ctx.sql(sql).await {
        Ok(frame) => frame.collect().await.map(|_| ()),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => panic!("{sql}: expected an error"),
        Err(e) => e.to_string(),
    }
}

/// Each GPU filter, projection or aggregation that reads a cached table's scan directly:
/// its name, the bytes it uploaded, and the bytes its scan downloaded.
pub(super) fn reads_of_cached(plan: &Arc<dyn ExecutionPlan>) -> Vec<(String, usize, usize)> {
    let get = |node: &Arc<dyn ExecutionPlan>, name: &str| {
        node.metrics()
            .and_then(|m| m.sum_by_name(name))
            .map_or(0, |v| v.as_usize())
    };
    let mut reads = Vec::new();
    let _ = plan.apply(|node| {
        let gpu = matches!(
            node.name(),
            "GpuFilterExec" | "GpuProjectionExec" | "GpuAggregateExec"
        );
        for child in node.children() {
            if gpu && child.name() == "GpuScanExec" {
                let (up, down) = (get(node, "h2d_bytes"), get(child, "d2h_bytes"));
                reads.push((node.name().to_string(), up, down));
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    reads
}

/// The 22 TPC-H queries over the eight tables cached on four devices, spread (none
/// replicated), answer as DataFusion does. Every table is read from device memory (`GpuScanExec`); the filters, projections
/// and aggregations reading it take its chunks where they lie, uploading no column (only
/// their programs and counts) and downloading nothing from the scan; both devices work; and
/// the queries upload a fraction of what they do over the same tables uncached.
#[tokio::test]
async fn tpch_over_cached_tables_answers_as_datafusion_with_no_column_uploaded() {
    let set = "emulated:4/cache-tpch";
    let (gpu, cpu) = tpch_contexts(set, 4, None);
    let (plain, _) = tpch_contexts(set, 4, None);
    text(&gpu, "SET fulmen.cache.replicate_below = 0").await;
    for table in TPCH_TABLES {
        let summary = gpu.cache_table(table).await.unwrap();
        assert!(summary.rows > 0 && summary.bytes > 0, "{summary:?}");
    }
    let listed = text(&gpu, "SHOW DEVICES").await;
    assert!(listed.contains("lineitem ("), "{listed}");
    let devices = devices_of(set);
    let before: Vec<u64> = devices.iter().map(|d| d.counters().1).collect();
    let (mut cached_up, mut plain_up, mut direct) = (0usize, 0usize, 0usize);
    for q in 1..=22 {
        let sql = crate::tpch::QUERIES[q - 1];
        let plan = plan_of(&gpu, sql).await;
        let got = rows_of(&gpu, &plan).await;
        let (_, want) = run(&cpu, sql).await;
        assert_eq!(got, want, "Q{q}");
        assert!(plan_has(&plan, "GpuScanExec"), "Q{q} reads no cached table");
        let work = Work::of(&plan);
        assert!(work.nothing_fell_back(), "Q{q}: {work:?}");
        let reads = reads_of_cached(&plan);
        direct += reads.len();
        for (name, up, down) in reads {
            assert!(up < 4 * CONTROL_BYTES, "Q{q}: {name} uploaded {up} bytes");
            assert_eq!(down, 0, "Q{q}: the scan under {name} downloaded");
        }
        assert_eq!(metric_sum(&plan, "source_rows"), 0, "Q{q} read its source");
        cached_up += metric_sum(&plan, "h2d_bytes");
        let plain_plan = plan_of(&plain, sql).await;
        rows_of(&plain, &plain_plan).await;
        plain_up += metric_sum(&plain_plan, "h2d_bytes");
    }
    println!(
        "TPC-H SF 0.01, 22 queries on {set}: {cached_up} bytes uploaded over cached tables, \
         {plain_up} over the same tables uncached; {direct} GPU operators read a cached scan"
    );
    assert!(
        direct >= 22,
        "only {direct} GPU operators read a cached scan directly"
    );
    // What is still uploaded: the build sides of joins collected on the host (outer,
    // semi and anti joins, and joins fed from the host), and partial aggregates brought
    // back up after a repartition.
    assert!(
        cached_up * 3 < plain_up,
        "cached {cached_up} bytes up, uncached {plain_up}"
    );
    for (d, b) in devices.iter().zip(before) {
        assert!(d.counters().1 > b, "{d} did no work");
    }
}

/// The joins and aggregations over `plan`'s tables that DataFusion fed with no repartition
/// between them and the scans: (operator, whether a `RepartitionExec` lies below it).
fn repartitioned_below(plan: &Arc<dyn ExecutionPlan>, operator: &str) -> Vec<bool> {
    let mut found = Vec::new();
    let _ = plan.apply(|node| {
        if node.name() == operator {
            found.push(plan_has(node, "RepartitionExec"));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// The plan as EXPLAIN shows it.
/// Makes `ctx` plan every hash join partitioned on both sides: no side is small enough to
/// collect.
pub(super) async fn partition_every_join(ctx: &FulmenContext) {
    for setting in [
        "hash_join_single_partition_threshold",
        "hash_join_single_partition_threshold_rows",
    ] {
        text(ctx, &format!("SET datafusion.optimizer.{setting} = 0")).await;
    }
}

pub(super) fn shown(plan: &Arc<dyn ExecutionPlan>) -> String {
    datafusion::physical_plan::displayable(plan.as_ref())
        .indent(true)
        .to_string()
}

/// What the hash joins of `plan` uploaded, and what the cached scans right under them
/// downloaded.
fn build_traffic(plan: &Arc<dyn ExecutionPlan>) -> (usize, usize) {
    let get = |node: &Arc<dyn ExecutionPlan>, name: &str| {
        node.metrics()
            .and_then(|m| m.sum_by_name(name))
            .map_or(0, |v| v.as_usize())
    };
    let (mut up, mut down) = (0, 0);
    let _ = plan.apply(|node| {
        if node.name() == "GpuHashJoinExec" {
            up += get(node, "h2d_bytes");
            for child in node.children() {
                if child.name() == "GpuScanExec" {
                    down += get(child, "d2h_bytes");
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    (up, down)
}

/// TPC-H's 22 queries with its tables sharded by their keys on four devices (lineitem and
/// orders by order key, customer, part, partsupp and supplier by theirs) answer as
/// DataFusion does, with every device working and no column uploaded by the operators
/// reading a cached scan. A join of co-sharded tables, and a GROUP BY on the shard key,
/// get no repartition; orders sharded by customer instead joins customer part by part; and
/// once `target_partitions` no longer matches the parts, DataFusion repartitions again and
/// the answers stay right.
#[tokio::test]
async fn tpch_over_sharded_tables_joins_part_by_part() {
    let set = "emulated:4/cache-sharded";
    let (gpu, cpu) = tpch_contexts(set, 4, None);
    let keys = [
        ("lineitem", Some("l_orderkey")),
        ("orders", Some("o_orderkey")),
        ("customer", Some("c_custkey")),
        ("part", Some("p_partkey")),
        ("partsupp", Some("ps_partkey")),
        ("supplier", Some("s_suppkey")),
        ("nation", None),
        ("region", None),
    ];
    for (table, key) in keys {
        let options = crate::cache::CacheOptions {
            shard_key: key.map(str::to_string),
        };
        let summary = gpu.cache_table_with(table, &options).await.unwrap();
        assert_eq!(summary.shard_key.as_deref(), key, "{summary:?}");
    }
    let listed = text(&gpu, "SHOW DEVICES").await;
    assert!(listed.contains("sharded by l_orderkey"), "{listed}");
    let devices = devices_of(set);
    let before: Vec<u64> = devices.iter().map(|d| d.counters().1).collect();
    for q in 1..=22 {
        let sql = crate::tpch::QUERIES[q - 1];
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "Q{q}");
        assert!(Work::of(&plan).nothing_fell_back(), "Q{q}");
        // Programs and counts go up once per device.
        for (name, up, down) in reads_of_cached(&plan) {
            assert!(up < 4 * CONTROL_BYTES, "Q{q}: {name} uploaded {up} bytes");
            assert_eq!(down, 0, "Q{q}: the scan under {name} downloaded");
        }
    }
    for (d, b) in devices.iter().zip(before) {
        assert!(d.counters().1 > b, "{d} did no work");
    }
    // (Through the stand-in CUDA driver the selection has fewer devices: count the idle.)
    let idle = "SELECT count(*) AS idle FROM fulmen_devices() WHERE kernel_time_us = 0";
    let idle = text(&gpu, idle).await;
    assert!(idle.contains("| 0 "), "{idle}");

    // Joins partitioned on both sides (no side small enough to collect): co-sharded
    // tables meet part by part, with no repartition under the join.
    for ctx in [&gpu, &cpu] {
        partition_every_join(ctx).await;
    }
    let join = "SELECT o_orderpriority, count(*), sum(l_quantity) FROM orders JOIN lineitem \
                ON l_orderkey = o_orderkey WHERE l_shipdate > DATE '1995-01-01' \
                GROUP BY o_orderpriority ORDER BY o_orderpriority";
    let by_key = "SELECT l_orderkey, sum(l_extendedprice) AS s FROM lineitem \
                  GROUP BY l_orderkey ORDER BY s DESC, l_orderkey LIMIT 5";
    for sql in [join, by_key] {
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "{sql}");
        assert!(plan_has(&plan, "GpuScanExec"), "{sql}");
        let shown = shown(&plan);
        assert!(shown.contains("shard_key=l_orderkey, parts=4"), "{shown}");
        if sql == join {
            assert!(shown.contains("mode=Partitioned"), "{shown}");
            let joins = repartitioned_below(&plan, "GpuHashJoinExec");
            assert_eq!(joins, [false], "{shown}");
            // Each part's build side is used where it lies: no build column goes up, and
            // the scan under the join hands its chunks over without a download.
            let (up, down) = build_traffic(&plan);
            assert!(
                up < 4 * CONTROL_BYTES,
                "the join uploaded {up} bytes\n{shown}"
            );
            assert_eq!(down, 0, "the join's scans downloaded {down} bytes\n{shown}");
        } else {
            assert!(!plan_has(&plan, "RepartitionExec"), "{shown}");
        }
    }
    // orders sharded by customer: customer and orders meet part by part; the 22 queries
    // (every join partitioned now) still give DataFusion's answers.
    text(&gpu, "UNCACHE TABLE orders").await;
    text(&gpu, "CACHE TABLE orders OPTIONS ('shard_key' 'o_custkey')").await;
    let by_customer = "SELECT c_mktsegment, count(*), sum(o_totalprice) FROM customer JOIN \
                       orders ON c_custkey = o_custkey GROUP BY c_mktsegment \
                       ORDER BY c_mktsegment";
    for sql in std::iter::once(by_customer).chain(crate::tpch::QUERIES) {
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "{sql}");
        if sql == by_customer {
            let shown = shown(&plan);
            assert_eq!(
                repartitioned_below(&plan, "GpuHashJoinExec"),
                [false],
                "{shown}"
            );
        }
    }
    // A device lost while the co-sharded join runs: the build and probe chunks of its parts
    // are redone from the source, and the answer does not change.
    if !needs_emulator("tpch_over_sharded_tables…: a device lost") {
        text(&gpu, "SET fulmen.gpu.on_error = 'fallback'").await;
        text(&gpu, "UNCACHE TABLE orders").await;
        text(
            &gpu,
            "CACHE TABLE orders OPTIONS ('shard_key' 'o_orderkey')",
        )
        .await;
        devices[3]
            .inject_faults(fulmen_kernels::FaultPlan {
                lose_device_at_launch: Some(2),
                ..Default::default()
            })
            .unwrap();
        let plan = plan_of(&gpu, join).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, join).await.1);
        assert!(
            devices[3].quarantined().is_some(),
            "the device was not lost"
        );
        assert!(Work::of(&plan).cpu_batches > 0, "nothing was redone");
    }
    // Other partition counts than the parts: the scans say nothing of their partitioning,
    // DataFusion repartitions, and the answers stay DataFusion's.
    for ctx in [&gpu, &cpu] {
        text(ctx, "SET datafusion.execution.target_partitions = 3").await;
    }
    let plan = plan_of(&gpu, join).await;
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, join).await.1);
    let shown = shown(&plan);
    assert_eq!(
        repartitioned_below(&plan, "GpuHashJoinExec"),
        [true],
        "{shown}"
    );
}

/// A CACHE TABLE larger than the cache's room fails, saying the sizes, and leaves nothing
/// on the device; the table still answers from its source.
#[tokio::test]
async fn a_cache_that_does_not_fit_fails_with_its_sizes_and_caches_nothing() {
    if super::on_cuda() {
        println!("a_cache_that_does_not_fit…: not on shared CUDA devices (it reads their memory)");
        return;
    }
    let set = "emulated:1/cache-full";
    let (gpu, cpu) = tpch_contexts(set, 2, None);
    let device = devices_of(set)[0].clone();
    let held = device.device_memory_usage().0;
    text(&gpu, "SET fulmen.cache.memory_limit = '256K'").await;
    let e = error(&gpu, "CACHE TABLE lineitem").await;
    assert!(
        e.contains("need about") && e.contains("256.0 KiB") && e.contains("Nothing was cached"),
        "{e}"
    );
    assert_eq!(device.device_memory_usage().0, held, "memory left held");
    assert!(crate::cache::cached_bytes_on(&device) == 0);
    let sql = "SELECT count(*), sum(l_quantity) FROM lineitem";
    let plan = plan_of(&gpu, sql).await;
    assert!(!plan_has(&plan, "GpuScanExec"));
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
    // A limit the table fits in caches it.
    text(&gpu, "SET fulmen.cache.memory_limit = '64M'").await;
    let summary = gpu.cache_table("lineitem").await.unwrap();
    assert_eq!(crate::cache::cached_bytes_on(&device), summary.bytes);
    assert!(summary.bytes <= 64 << 20);
}

/// A cached table is cut into as few chunks as `fulmen.gpu.batch_rows` and
/// `fulmen.cache.chunk_bytes` allow, as many on each device and of equal rows; the scan's
/// answers are DataFusion's, with nothing uploaded and no batch on the CPU.
#[tokio::test]
async fn cached_chunks_are_as_few_as_the_limits_allow_and_even() {
    if super::on_cuda() {
        println!("cached_chunks…: not on shared CUDA devices (it reads their memory)");
        return;
    }
    let set = "emulated:2/cache-chunks";
    let (gpu, cpu) = (session(gpu_config(set), 2), session(cpu_config(), 2));
    let devices = devices_of(set);
    // 300 000 rows of about 120 to 132 bytes (a 100-byte string): 36 to 40 MB.
    let create = "CREATE TABLE t AS SELECT value AS a, value % 7 AS b, \
                  concat(repeat('x', 97), CAST(value % 1000 AS VARCHAR)) AS s \
                  FROM range(300000)";
    text(&gpu, create).await;
    text(&cpu, create).await;
    text(&gpu, "SET fulmen.cache.replicate_below = 0").await;
    let even = |what: &str| {
        let held: Vec<usize> = devices.iter().map(crate::cache::cached_bytes_on).collect();
        assert!(held[0] > 0 && held[0] == held[1], "{what}: {held:?}");
    };
    // By rows: 3 chunks of 100 000 would leave one device two of them; 4 of 75 000 instead.
    text(&gpu, "SET fulmen.gpu.batch_rows = 100000").await;
    let summary = gpu.cache_table("t").await.unwrap();
    assert_eq!((summary.rows, summary.chunks), (300_000, 4), "{summary:?}");
    even("by rows");
    // By bytes: 16 MiB chunks make 3, rounded up to 4 for two devices.
    text(&gpu, "SET fulmen.gpu.batch_rows = 4194304").await;
    text(&gpu, "SET fulmen.cache.chunk_bytes = '16M'").await;
    let summary = gpu.refresh_cache("t").await.unwrap();
    assert_eq!(summary.chunks, 4, "{summary:?}");
    even("by bytes");
    // The default: one chunk per device.
    text(&gpu, "SET fulmen.cache.chunk_bytes = '512M'").await;
    let summary = gpu.refresh_cache("t").await.unwrap();
    assert_eq!(summary.chunks, 2, "{summary:?}");
    even("one each");
    let sql = "SELECT b, count(*), sum(a), max(s) FROM t WHERE a % 3 = 1 GROUP BY b ORDER BY b";
    let plan = plan_of(&gpu, sql).await;
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
    let work = Work::of(&plan);
    assert!(work.nothing_fell_back() && work.gpu_batches > 0, "{work:?}");
    for (name, h2d, _) in reads_of_cached(&plan) {
        assert!(h2d < CONTROL_BYTES, "{name} uploaded {h2d} bytes");
    }
}

/// A table no larger than `fulmen.cache.replicate_below` goes whole to each of two
/// devices, and a scan of it still reads each row once; a larger one, or one whose copy
/// would not fit in a device's cache room (while its share does; by its host bytes, or
/// only once uploaded), is dealt instead.
#[tokio::test]
async fn small_tables_are_replicated_and_read_once() {
    if super::on_cuda() {
        println!(
            "small_tables_are_replicated…: not on shared CUDA devices (it reads their memory)"
        );
        return;
    }
    let set = "emulated:2/cache-replicate";
    let gpu = session(gpu_config(set), 2);
    let devices = devices_of(set);
    text(
        &gpu,
        "CREATE TABLE t AS SELECT value AS a, value % 7 AS b FROM range(200000)",
    )
    .await;
    text(&gpu, "SET fulmen.gpu.batch_rows = 50000").await;
    let sql = "SELECT b, count(*), sum(a) FROM t WHERE a % 3 = 1 GROUP BY b ORDER BY b";
    let want = text(&gpu, sql).await;
    let cached = text(&gpu, "CACHE TABLE t").await;
    assert!(
        cached.contains("replicated") && cached.contains("true"),
        "{cached}"
    );
    let summary = gpu.refresh_cache("t").await.unwrap();
    assert!(summary.replicated, "{summary:?}");
    let held: Vec<usize> = devices.iter().map(crate::cache::cached_bytes_on).collect();
    assert!(
        held[0] > 0 && held[0] == held[1],
        "a whole copy on each: {held:?}"
    );
    assert_eq!(summary.bytes, held[0] + held[1]);
    let plan = plan_of(&gpu, sql).await;
    assert!(shown(&plan).contains("replicas=2"), "{}", shown(&plan));
    assert_eq!(text(&gpu, sql).await, want, "each row read once");
    let before: Vec<u64> = devices.iter().map(|d| d.counters().1).collect();
    rows_of(&gpu, &plan).await;
    assert!(Work::of(&plan).nothing_fell_back());
    for (d, b) in devices.iter().zip(before) {
        assert!(d.counters().1 > b, "{d} read none of the table");
    }
    drop(plan); // it holds the cached rows
    // Larger than the setting: dealt.
    text(&gpu, "SET fulmen.cache.replicate_below = '1M'").await;
    let summary = gpu.refresh_cache("t").await.unwrap();
    assert!(!summary.replicated, "{summary:?}");
    assert_eq!(text(&gpu, sql).await, want);
    // Small enough, and its host bytes (3.2 MB) fit a device's cache room, but not once
    // uploaded (four chunks of two 512 KiB size classes): dealt.
    text(&gpu, "SET fulmen.cache.replicate_below = '64M'").await;
    text(&gpu, "SET fulmen.cache.memory_limit = '3500K'").await;
    let summary = gpu.refresh_cache("t").await.unwrap();
    assert!(!summary.replicated, "{summary:?}");
    assert_eq!(text(&gpu, sql).await, want);
    // Its host bytes do not fit: dealt.
    text(&gpu, "SET fulmen.cache.memory_limit = '3M'").await;
    let summary = gpu.refresh_cache("t").await.unwrap();
    assert!(!summary.replicated, "{summary:?}");
    let held: Vec<usize> = devices.iter().map(crate::cache::cached_bytes_on).collect();
    assert!(held.iter().all(|&b| b > 0), "dealt over both: {held:?}");
    assert_eq!(text(&gpu, sql).await, want);
}

/// Several queries at once over the same cached tables answer as DataFusion does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_queries_over_cached_tables() {
    let set = "emulated:2/cache-concurrent";
    let (gpu, cpu) = tpch_contexts(set, 2, None);
    for table in ["lineitem", "orders"] {
        gpu.cache_table(table).await.unwrap();
    }
    let queries = [1, 3, 4, 6, 12];
    let runs = queries.map(|q| {
        let gpu = gpu.clone();
        tokio::spawn(async move {
            let plan = plan_of(&gpu, crate::tpch::QUERIES[q - 1]).await;
            rows_of(&gpu, &plan).await
        })
    });
    for (q, handle) in queries.into_iter().zip(runs) {
        let got = handle.await.unwrap();
        assert_eq!(got, run(&cpu, crate::tpch::QUERIES[q - 1]).await.1, "Q{q}");
    }
}

/// The statements' mistakes are clear errors that change nothing.
#[tokio::test]
async fn the_cache_statements_errors_are_clear() {
    let gpu = session(
        crate::FulmenConfig {
            gpu_on_error: OnError::Fail,
            ..gpu_config("emulated:1/cache-errors")
        },
        2,
    );
    text(&gpu, "CREATE TABLE t AS VALUES (1), (2)").await;
    text(&gpu, "CACHE TABLE t").await;
    let e = error(&gpu, "CACHE TABLE t").await;
    assert!(e.contains("cached already"), "{e}");
    let e = error(&gpu, "CACHE TABLE t AS SELECT 1").await;
    assert!(e.contains("already exists"), "{e}");
    let e = error(&gpu, "CACHE TABLE nope").await;
    assert!(e.contains("nope"), "{e}");
    let e = error(&gpu, "UNCACHE TABLE nope").await;
    assert!(e.contains("nope"), "{e}");
    text(&gpu, "UNCACHE TABLE IF EXISTS nope").await;
    let e = error(
        &gpu,
        "CACHE TABLE u OPTIONS ('shard_key' 'b') AS SELECT 1 AS a",
    )
    .await;
    assert!(
        e.contains("no column b") && e.contains("its columns: a"),
        "{e}"
    );
    let e = error(
        &gpu,
        "CACHE TABLE u OPTIONS ('replicas' '2') AS SELECT 1 AS a",
    )
    .await;
    assert!(e.contains("no option 'replicas'"), "{e}");
    let e = error(&gpu, "CACHE TABLE u OPTIONS ('shard_key') AS SELECT 1 AS a").await;
    assert!(e.contains("pairs"), "{e}");
    let e = error(
        &gpu,
        "CACHE TABLE u OPTIONS ('shard_key' 'a' AS SELECT 1 AS a",
    )
    .await;
    assert!(e.contains("OPTIONS"), "{e}");
    assert!(!gpu.session_context().table_exist("u").unwrap());
    // Both ways of writing options; the key is kept by REFRESH CACHE.
    let shown = text(
        &gpu,
        "CACHE TABLE u OPTIONS (shard_key = 'A') AS SELECT 1 AS a",
    )
    .await;
    assert!(shown.contains("| a "), "{shown}");
    text(&gpu, "UNCACHE TABLE u").await;
    text(&gpu, "CACHE TABLE u OPTIONS ('shard_key' 'a')").await;
    let shown = text(&gpu, "REFRESH CACHE u").await;
    assert!(shown.contains("| a "), "{shown}");
    let listed = text(&gpu, "SHOW DEVICES").await;
    assert!(listed.contains("sharded by a"), "{listed}");
    assert!(text(&gpu, "SELECT sum(a) FROM u").await.contains("| 1 "));
    let e = error(&gpu, "REFRESH CACHE nope").await;
    assert!(e.contains("nope"), "{e}");
    text(&gpu, "UNCACHE TABLE t").await;
    let e = error(&gpu, "REFRESH CACHE t").await;
    assert!(e.contains("not cached"), "{e}");
    let e = error(&gpu, "UNCACHE TABLE t").await;
    assert!(e.contains("not cached"), "{e}");
    text(&gpu, "CREATE VIEW v AS SELECT * FROM t").await;
    let e = error(&gpu, "CACHE TABLE v").await;
    assert!(e.contains("v is a view") && e.contains("AS SELECT"), "{e}");
    // Other devices, or none, read a cached table too: its chunks come down to the host, or
    // its source is read.
    text(&gpu, "CACHE TABLE t").await;
    let sql = "SELECT sum(column1) FROM t";
    text(&gpu, "SET fulmen.devices = 'emulated:1/cache-errors-other'").await;
    let plan = plan_of(&gpu, sql).await;
    assert!(plan_has(&plan, "GpuScanExec"));
    assert!(rows_of(&gpu, &plan).await.contains("| 3 "));
    text(&gpu, "SET fulmen.gpu.mode = 'off'").await;
    let plan = plan_of(&gpu, sql).await;
    assert!(!plan_has(&plan, "GpuScanExec"));
    assert!(rows_of(&gpu, &plan).await.contains("| 3 "));
    text(&gpu, "UNCACHE TABLE t").await;
    let e = error(&gpu, "CACHE TABLE t").await;
    assert!(e.contains("fulmen.gpu.mode is off"), "{e}");
    assert!(text(&gpu, "SELECT count(*) FROM t").await.contains('2'));
}
