//! Dictionary-encoded string columns of cached tables (`fulmen.cache.dictionary_limit`):
//! which columns are encoded, what they save, and filters, gathers, GROUP BY and join keys
//! over them answering as DataFusion does, on the device, with nothing uploaded.

use super::cache::{CONTROL_BYTES, reads_of_cached, text};
use super::{Work, cpu_config, devices_of, gpu_config, plan_of, rows_of, run, session};

/// Shown plan text.
fn shown(plan: &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> String {
    datafusion::physical_plan::displayable(plan.as_ref())
        .indent(true)
        .to_string()
}

#[tokio::test]
async fn low_cardinality_strings_are_cached_as_codes_and_answer_as_strings() {
    // On CUDA devices (shared by every test) the memory each holds is not this test's.
    let own_memory = !super::on_cuda();
    let set = "emulated:2/dictionary";
    let (gpu, cpu) = (session(gpu_config(set), 2), session(cpu_config(), 2));
    let devices = devices_of(set);
    // m: four values of 7 to 10 bytes and NULLs; u: as many values as rows; late: one
    // value in the first 150 000 rows, then 50 more.
    let create = "CREATE TABLE t AS SELECT value AS a, \
                  CASE value % 5 WHEN 0 THEN NULL \
                  ELSE concat('mode-', repeat('x', CAST(value % 5 AS INT)), CAST(value % 5 AS VARCHAR)) END AS m, \
                  concat('n', CAST(value AS VARCHAR)) AS u, \
                  CASE WHEN value < 150000 THEN 'early' \
                  ELSE concat('late', CAST(value % 50 AS VARCHAR)) END AS late \
                  FROM range(200000)";
    let dims = "CREATE TABLE d (k VARCHAR, name VARCHAR) AS VALUES ('mode-x1', 'one'), \
                ('mode-xx2', 'two'), ('mode-xxx3', 'three'), ('mode-xxxx4', 'four'), ('other', 'none')";
    for ctx in [&gpu, &cpu] {
        text(ctx, create).await;
        text(ctx, dims).await;
    }
    text(&gpu, "SET fulmen.gpu.batch_rows = 50000").await;
    text(&gpu, "SET fulmen.cache.replicate_below = 0").await;
    // Plain strings first, for their size.
    text(&gpu, "SET fulmen.cache.dictionary_limit = 0").await;
    let plain = gpu.cache_table("t").await.unwrap();
    let scan = shown(&plan_of(&gpu, "SELECT * FROM t").await);
    assert!(!scan.contains("dictionary="), "{scan}");
    // With a limit of 10: m is encoded; u has too many values in the first chunk; late
    // passes the limit in a later chunk, so the table is read again with it plain.
    text(&gpu, "SET fulmen.cache.dictionary_limit = 10").await;
    let encoded = gpu.refresh_cache("t").await.unwrap();
    assert_eq!(encoded.rows, 200_000);
    let scan = shown(&plan_of(&gpu, "SELECT * FROM t").await);
    assert!(scan.contains("dictionary=[m]"), "{scan}");
    // m held as 4-byte codes instead of 4-byte offsets and 160 000 strings of 7 to 10
    // bytes (the cache counts whole size classes, so about that much or more).
    let saved = plain.bytes.saturating_sub(encoded.bytes);
    assert!(
        saved > 1_000_000,
        "{} -> {} bytes",
        plain.bytes,
        encoded.bytes
    );
    if own_memory {
        let held: Vec<usize> = devices.iter().map(crate::cache::cached_bytes_on).collect();
        assert_eq!(
            held.iter().sum::<usize>(),
            encoded.bytes,
            "dictionaries counted"
        );
    }
    text(&gpu, "CACHE TABLE d").await;
    // m's values first seen in another order (another dictionary's codes for them), cached
    // on every device (replicated); and t's rows sharded by m.
    let t2 = "CREATE TABLE t2 AS SELECT value AS a, concat('mode-', \
              repeat('x', CAST(4 - value % 4 AS INT)), CAST(4 - value % 4 AS VARCHAR)) AS m \
              FROM range(1000)";
    text(&gpu, t2).await;
    text(&cpu, t2).await;
    text(&gpu, "SET fulmen.cache.replicate_below = '64M'").await;
    let replicated = gpu.cache_table("t2").await.unwrap();
    assert!(replicated.replicated, "{replicated:?}");
    text(
        &gpu,
        "CACHE TABLE s OPTIONS ('shard_key' 'm') AS SELECT * FROM t",
    )
    .await;
    text(&cpu, "CREATE TABLE s AS SELECT * FROM t").await;
    for table in ["t2", "s"] {
        let scan = shown(&plan_of(&gpu, &format!("SELECT * FROM {table}")).await);
        assert!(scan.contains("dictionary=[m"), "{scan}");
    }
    let queries = [
        // A filter reading m through its dictionary, GROUP BY m (keys by their strings).
        "SELECT m, count(*), sum(a) FROM t WHERE m <> 'mode-xx2' GROUP BY m ORDER BY m",
        // m gathered as codes and downloaded, beside plain strings.
        "SELECT a, m, u, late FROM t WHERE m LIKE '%xx%' AND a % 997 = 5 ORDER BY a",
        "SELECT a, m FROM t WHERE m IS NULL AND a < 40 ORDER BY a",
        // Join keys: m (encoded) against d.k (plain).
        "SELECT d.name, count(*), min(t.a) FROM t JOIN d ON t.m = d.k \
         WHERE t.a % 2 = 0 GROUP BY d.name ORDER BY d.name",
        "SELECT count(DISTINCT m), count(m), count(*) FROM t WHERE a > 10",
        // Both sides encoded, by one encoder and by another (other codes for the values).
        "SELECT count(*) FROM t AS x JOIN t AS y ON x.m = y.m AND x.a = y.a + 1",
        "SELECT t2.m, count(*), max(t.a) FROM t JOIN t2 ON t.m = t2.m AND t.a % 1000 = t2.a \
         GROUP BY t2.m ORDER BY t2.m",
        "SELECT s.m, count(*) FROM s JOIN t2 ON s.m = t2.m WHERE s.a < 5000 \
         GROUP BY s.m ORDER BY s.m",
        // Sharded by m: GROUP BY m within each shard.
        "SELECT m, count(*), sum(a) FROM s GROUP BY m ORDER BY m",
    ];
    for sql in queries {
        let plan = plan_of(&gpu, sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, sql).await.1, "{sql}");
        let work = Work::of(&plan);
        assert!(
            work.nothing_fell_back() && work.gpu_batches > 0,
            "{sql}: {work:?}"
        );
        for (name, h2d, _) in reads_of_cached(&plan) {
            assert!(h2d < CONTROL_BYTES, "{sql}: {name} uploaded {h2d} bytes");
        }
    }
}
