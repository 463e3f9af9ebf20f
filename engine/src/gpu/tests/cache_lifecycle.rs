//! Cached tables over their life (see `cache/mod.rs`): a source that changes after CACHE,
//! the devices' listing, UNCACHE and DROP TABLE freeing device memory, and a device lost
//! while its chunks are read.

use std::sync::Arc;

use super::cache::text;
use super::{
    Work, cpu_config, devices_of, gpu_config, metric_sum, needs_emulator, plan_has, plan_of,
    rows_of, run, session, tpch_contexts,
};

/// A source written after caching (an INSERT; a file added to a table's folder, rewritten
/// or removed) is read instead of the stale snapshot until REFRESH CACHE takes a new one;
/// DROP TABLE of a table of files uncaches it.
#[tokio::test]
async fn a_changed_source_is_read_until_the_cache_is_refreshed() {
    let set = "emulated:1/cache-changes";
    let gpu = session(gpu_config(set), 2);
    let cpu = session(cpu_config(), 2);
    let sql = "SELECT count(*), sum(a), min(b) FROM t WHERE a % 3 <> 0";
    for ctx in [&gpu, &cpu] {
        text(
            ctx,
            "CREATE TABLE t AS SELECT value AS a, value * 2 AS b FROM range(5000)",
        )
        .await;
    }
    text(&gpu, "CACHE TABLE t").await;
    let plan = plan_of(&gpu, sql).await;
    assert!(plan_has(&plan, "GpuScanExec"));
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
    for ctx in [&gpu, &cpu] {
        text(ctx, "INSERT INTO t VALUES (7001, -5), (7002, -6)").await;
    }
    let plan = plan_of(&gpu, sql).await;
    assert!(!plan_has(&plan, "GpuScanExec"), "a stale snapshot was read");
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
    text(&gpu, "REFRESH CACHE t").await;
    let plan = plan_of(&gpu, sql).await;
    assert!(plan_has(&plan, "GpuScanExec"));
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);

    // A table of files: a file added to its folder.
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("f");
    std::fs::create_dir(&folder).unwrap();
    let path = folder.to_str().unwrap();
    let copy = |n: u32| {
        format!("COPY (SELECT value AS a, value * 2 AS b FROM range({n})) TO '{path}/p{n}.parquet'")
    };
    text(&cpu, &copy(3000)).await;
    let create = format!("CREATE EXTERNAL TABLE f STORED AS PARQUET LOCATION '{path}/'");
    for ctx in [&gpu, &cpu] {
        text(ctx, &create).await;
    }
    let sql = "SELECT count(*), sum(a) FROM f WHERE b > 10";
    // The query's rows, equal to DataFusion's, and whether it read the cache. The plan
    // goes with it: a plan holds the snapshot it reads.
    let answer = || {
        let (gpu, cpu) = (&gpu, &cpu);
        async move {
            let plan = plan_of(gpu, sql).await;
            let got = rows_of(gpu, &plan).await;
            assert_eq!(got, run(cpu, sql).await.1);
            (got, plan_has(&plan, "GpuScanExec"))
        }
    };
    text(&gpu, "CACHE TABLE f").await;
    assert!(answer().await.1, "not read from the cache");
    text(&cpu, &copy(4000)).await;
    let (got, cached) = answer().await;
    assert!(!cached, "a stale snapshot was read");
    assert!(got.contains("6988"), "both files are read: {got}");

    // A file rewritten in place (other rows, the same name), then a file removed: each
    // time the source is read until REFRESH CACHE, which then caches what is there.
    let refresh = |why: &'static str| {
        let (gpu, answer) = (&gpu, &answer);
        async move {
            text(gpu, "REFRESH CACHE f").await;
            assert!(answer().await.1, "{why}: not cached again");
        }
    };
    refresh("after the added file").await;
    text(
        &cpu,
        &format!(
            "COPY (SELECT value + 1 AS a, value AS b FROM range(3000)) TO '{path}/p3000.parquet'"
        ),
    )
    .await;
    assert!(!answer().await.1, "a rewritten file's old rows were read");
    refresh("after the rewritten file").await;
    std::fs::remove_file(folder.join("p4000.parquet")).unwrap();
    let (got, cached) = answer().await;
    assert!(!cached, "a removed file's rows were read");
    assert!(
        got.contains("2989"),
        "only the rewritten file is read: {got}"
    );
    refresh("after the removed file").await;

    // DROP TABLE of a cached table of files uncaches it and frees its device memory; a
    // table made again under the name reads its files.
    text(&gpu, "DROP TABLE f").await;
    let listed = text(&gpu, "SHOW DEVICES").await;
    assert!(!listed.contains("f ("), "{listed}");
    text(&gpu, &create).await;
    assert!(!answer().await.1, "the dropped cache was read");
}

/// `FulmenContext::devices()` and SHOW DEVICES list the session's devices alike: a GPU with
/// its compute capability (none on the emulator), the budget Fulmen uses within the
/// device's memory, and a cached table's bytes on the devices holding it.
#[tokio::test]
async fn the_library_and_show_devices_list_the_devices_alike() {
    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::datatypes::UInt64Type;
    let set = "emulated:2/cache-listing";
    let gpu = session(gpu_config(set), 2);
    text(
        &gpu,
        "CREATE TABLE listed AS SELECT value AS a FROM range(1000)",
    )
    .await;
    text(&gpu, "CACHE TABLE listed").await;
    let batches = gpu.devices().await.unwrap();
    let rows = datafusion::arrow::compute::concat_batches(&batches[0].schema(), &batches).unwrap();
    assert_eq!(rows.num_rows(), devices_of(set).len());
    let column = |name: &str| {
        let at = rows
            .schema()
            .index_of(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        Arc::clone(rows.column(at))
    };
    let capability = column("compute_capability");
    let capability = capability.as_string::<i32>();
    let total = column("memory_total");
    let budget = column("memory_budget");
    let cached = column("memory_cached");
    let tables = column("cached_tables");
    let mut holding = 0;
    for row in 0..rows.num_rows() {
        if super::on_cuda() {
            let cc = capability.value(row);
            let parts: Vec<&str> = cc.split('.').collect();
            assert!(
                parts.len() == 2 && parts.iter().all(|p| p.parse::<u32>().is_ok()),
                "compute capability '{cc}'"
            );
        } else {
            assert!(
                capability.is_null(row),
                "the emulator has no compute capability"
            );
        }
        let (total, budget) = (
            total.as_primitive::<UInt64Type>().value(row),
            budget.as_primitive::<UInt64Type>().value(row),
        );
        assert!(0 < budget && budget <= total, "budget {budget} of {total}");
        if tables.as_string::<i32>().value(row).contains("listed (") {
            holding += 1;
            assert!(cached.as_primitive::<UInt64Type>().value(row) > 0);
        }
    }
    assert!(holding > 0, "no device lists the cached table");
    let shown = text(&gpu, "SHOW DEVICES").await;
    for name in [
        "compute_capability",
        "memory_total",
        "memory_budget",
        "listed (",
    ] {
        assert!(shown.contains(name), "{name}:\n{shown}");
    }
    assert!(gpu.uncache_table("listed").await.unwrap());
}

/// UNCACHE TABLE and DROP TABLE free a cached table's device memory; SHOW DEVICES lists
/// what each device holds.
#[tokio::test]
async fn uncache_and_drop_free_the_device_memory() {
    if super::on_cuda() {
        println!("uncache_and_drop…: not on shared CUDA devices (it reads their memory)");
        return;
    }
    let set = "emulated:2/cache-free";
    let gpu = session(gpu_config(set), 2);
    let devices = devices_of(set);
    text(
        &gpu,
        "CREATE TABLE t AS SELECT value AS a FROM range(300000)",
    )
    .await;
    text(&gpu, "SET fulmen.gpu.batch_rows = 100000").await;
    let in_use = || -> Vec<usize> { devices.iter().map(|d| d.device_memory_usage().0).collect() };
    let before = in_use();
    let cached = text(&gpu, "CACHE TABLE t").await;
    assert!(
        cached.contains("| t ") && cached.contains("300000"),
        "{cached}"
    );
    let held: Vec<usize> = devices.iter().map(crate::cache::cached_bytes_on).collect();
    assert!(
        held.iter().all(|&b| b > 0),
        "every device holds chunks: {held:?}"
    );
    let listed = text(&gpu, "SHOW DEVICES").await;
    assert!(
        listed.contains("t (") && listed.contains("memory_cached"),
        "{listed}"
    );
    let held_now: Vec<usize> = in_use().iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(held_now, held, "the devices hold what the cache says");
    assert!(gpu.uncache_table("t").await.unwrap());
    assert!(
        devices
            .iter()
            .all(|d| crate::cache::cached_bytes_on(d) == 0)
    );
    assert_eq!(in_use(), before, "device memory left held");
    assert!(!text(&gpu, "SHOW DEVICES").await.contains("t ("));
    text(&gpu, "CACHE TABLE t").await;
    assert!(devices.iter().all(|d| crate::cache::cached_bytes_on(d) > 0));
    text(&gpu, "DROP TABLE t").await;
    assert!(
        devices
            .iter()
            .all(|d| crate::cache::cached_bytes_on(d) == 0)
    );
    assert_eq!(in_use(), before, "device memory left held");
    // CACHE … AS SELECT stores the rows as a table of their own; UNCACHE keeps it.
    let summary = gpu
        .cache_query("s", "SELECT value % 7 AS k, value AS v FROM range(1000)")
        .await
        .unwrap();
    assert_eq!(summary.rows, 1000);
    text(&gpu, "UNCACHE TABLE s").await;
    assert!(text(&gpu, "SELECT count(*) FROM s").await.contains("1000"));
}

/// A device lost while queries read its chunks: the chunks in flight are redone from the
/// source, the device is quarantined, and later queries read its rows from the source.
/// (lineitem is replicated here: a scan still reads half of its chunks from the lost
/// device's copy.)
#[tokio::test]
async fn a_device_lost_mid_query_has_its_chunks_read_from_the_source() {
    if needs_emulator("a_device_lost_mid_query…") {
        return;
    }
    let set = "emulated:2/cache-lost";
    let (gpu, cpu) = tpch_contexts(set, 2, None);
    text(&gpu, "SET fulmen.gpu.on_error = 'fallback'").await;
    text(&gpu, "SET fulmen.gpu.batch_rows = 8192").await;
    gpu.cache_table("lineitem").await.unwrap();
    let lost = devices_of(set)[1].clone();
    lost.inject_faults(fulmen_kernels::FaultPlan {
        lose_device_at_launch: Some(3),
        ..Default::default()
    })
    .unwrap();
    let mut redone = 0;
    for q in [1, 6] {
        let sql = crate::tpch::QUERIES[q - 1];
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "Q{q}");
        redone += Work::of(&plan).cpu_batches;
    }
    assert!(redone > 0, "no chunk in flight was redone from the source");
    assert!(lost.quarantined().is_some(), "the device was not lost");
    let listed = text(&gpu, "SHOW DEVICES").await;
    assert!(listed.contains("quarantined"), "{listed}");
    let sql = crate::tpch::QUERIES[0];
    let plan = plan_of(&gpu, sql).await;
    assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
    assert!(
        Work::of(&plan).cpu_batches > 0,
        "the lost chunks were not re-read"
    );
    // EXPLAIN ANALYZE says so: the scan's rows read from the source, on the lost device.
    let rows = metric_sum(&plan, "source_rows");
    assert!(
        rows > 0 && rows < 60_175,
        "{rows} rows read from the source"
    );
    let analyzed = text(&gpu, &format!("EXPLAIN ANALYZE {sql}")).await;
    let scan = analyzed
        .lines()
        .find(|l| l.contains("GpuScanExec"))
        .unwrap_or_else(|| panic!("{analyzed}"));
    assert!(
        scan.contains("source_rows=") && !scan.contains("source_rows=0,"),
        "{scan}"
    );
}

/// A cached table of files on two devices, one of which is lost in the middle of a query
/// (on a current-thread runtime, where a chunk's redo blocks the only thread): the chunks
/// in flight are read again from the files, then the quarantined device's chunks are; the
/// answers do not change. The same for the table sharded by a column the query does not
/// read (the files are read whole and dealt by it again).
#[tokio::test]
async fn a_lost_devices_chunks_are_read_from_the_files() {
    if needs_emulator("a_lost_devices_chunks…") {
        return;
    }
    lost_device_over_files("emulated:2/cache-files-lost", "").await;
    lost_device_over_files(
        "emulated:2/cache-files-lost-sharded",
        " OPTIONS ('shard_key' 'c')",
    )
    .await;
}

async fn lost_device_over_files(set: &str, options: &str) {
    let gpu = session(gpu_config(set), 2);
    let cpu = session(cpu_config(), 2);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    text(
        &cpu,
        &format!(
            "COPY (SELECT value AS a, value % 7 AS b, value * 2 AS c FROM range(20000)) \
             TO '{path}/t.parquet'"
        ),
    )
    .await;
    let create = format!("CREATE EXTERNAL TABLE f STORED AS PARQUET LOCATION '{path}/t.parquet'");
    for ctx in [&gpu, &cpu] {
        text(ctx, &create).await;
    }
    text(&gpu, "SET fulmen.gpu.on_error = 'fallback'").await;
    text(&gpu, "SET fulmen.gpu.batch_rows = 4096").await;
    text(&gpu, "SET fulmen.cache.replicate_below = 0").await;
    text(&gpu, &format!("CACHE TABLE f{options}")).await;
    let lost = devices_of(set)[1].clone();
    lost.inject_faults(fulmen_kernels::FaultPlan {
        lose_device_at_launch: Some(2),
        ..Default::default()
    })
    .unwrap();
    let sql = "SELECT b, count(*), sum(a) FROM f WHERE a % 3 = 1 GROUP BY b ORDER BY b";
    let mut redone = Vec::new();
    for _ in 0..2 {
        let plan = plan_of(&gpu, sql).await;
        assert!(plan_has(&plan, "GpuScanExec"));
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1);
        redone.push(Work::of(&plan).cpu_batches);
    }
    assert!(lost.quarantined().is_some(), "the device was not lost");
    assert!(redone.iter().all(|&n| n > 0), "batches redone: {redone:?}");
    let plan = plan_of(&gpu, sql).await;
    rows_of(&gpu, &plan).await;
    assert!(
        metric_sum(&plan, "source_rows") > 0,
        "no row read from the files"
    );
}
