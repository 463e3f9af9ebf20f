//! Device-resident chains: adjacent GPU operators hand device batches to each other, so a
//! chain moves only its inputs up and its groups down.

use std::sync::Arc;

use datafusion::common::cast::{as_string_array, as_uint64_array};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::{ExecutionPlan, displayable};

use super::{Work, devices_of, metric_sum, plan_of, rows_of, run, tpch_contexts, tpch_run};

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
        // Each partition queued its work on a stream of its own (`device_for`): stream 0 is
        // the device's own, then one for each of the 2 partitions the device runs — on one
        // device, Q1's one partition: its aggregation takes in both partitions' rows and
        // its filter, in one stage (`gpu::one_stage`).
        for d in devices.iter() {
            let partitions = match devices.len() {
                1 => 1,
                n => 2usize.div_ceil(n),
            };
            assert_eq!(d.streams(), 1 + partitions, "Q{q}: streams of {d}");
        }
        let metered = [
            ("launches", spent.launches),
            ("syncs", spent.syncs),
            ("h2d_bytes", spent.h2d_bytes),
            ("d2h_bytes", spent.d2h_bytes),
            ("device_bytes", spent.device_bytes),
        ];
        for (name, by_device) in metered {
            assert_eq!(metric_sum(&plan, name) as u64, by_device, "Q{q}: {name}");
        }
        // fulmen_kernels() breaks each device's launches and device bytes down by kernel:
        // the rows add up to the device's own totals (taken first: the listing's own scan
        // may run on the device).
        let totals: Vec<_> = devices.iter().map(|d| d.counts()).collect();
        let listing = gpu
            .sql("SELECT device, kernel, launches, device_bytes FROM fulmen_kernels()")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let mut by_kernel = vec![(0u64, 0u64); devices.len()];
        let mut kernels = std::collections::HashSet::new();
        for batch in &listing {
            let text = |c: usize| as_string_array(batch.column(c)).unwrap();
            let count = |c: usize| as_uint64_array(batch.column(c)).unwrap();
            for row in 0..batch.num_rows() {
                let at = devices
                    .iter()
                    .position(|d| d.to_string() == text(0).value(row))
                    .unwrap_or_else(|| panic!("Q{q}: a row for {}", text(0).value(row)));
                assert!(
                    fulmen_kernels::Kernel::by_name(text(1).value(row)).is_some()
                        && count(2).value(row) > 0,
                    "Q{q}: {} launched {} times",
                    text(1).value(row),
                    count(2).value(row)
                );
                kernels.insert(text(1).value(row).to_string());
                by_kernel[at].0 += count(2).value(row);
                by_kernel[at].1 += count(3).value(row);
            }
        }
        for ((d, total), (launches, bytes)) in devices.iter().zip(&totals).zip(by_kernel) {
            assert_eq!(
                (launches, bytes),
                (total.launches, total.device_bytes),
                "Q{q} on {d}"
            );
        }
        assert!(kernels.len() > 1, "Q{q}: {kernels:?}");
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

/// A filter → projection → partial aggregate chain the aggregate cannot take in (TPC-H
/// Q1's with a `count(DISTINCT …)`, see `gpu/fuse.rs`) runs as one device-resident stage:
/// the filter uploads the scanned columns, its output stays on the device for the
/// projection, whose output stays there for the aggregation; only the groups come down.
#[tokio::test]
async fn adjacent_gpu_operators_pass_device_batches() {
    let (gpu, cpu) = tpch_contexts("emulated:1/resident-q1", 1, None);
    let sql = "SELECT l_returnflag, l_linestatus, sum(l_quantity) AS q, \
               sum(l_extendedprice * (1 - l_discount)) AS a, \
               sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) AS b, \
               count(DISTINCT l_linenumber) AS d FROM lineitem \
               WHERE l_shipdate <= DATE '1998-09-02' GROUP BY 1, 2 ORDER BY 1, 2";
    let plan = plan_of(&gpu, sql).await;
    let got = rows_of(&gpu, &plan).await;
    let (_, want) = run(&cpu, sql).await;
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
    // crosses inside the chain: the smallest (a flag per row of 60 000 rows) is 60 KB. The
    // filter's upload is the scanned columns: about 50 bytes a row (four decimals of 8
    // bytes on the device, a date, two one-character strings and a line number).
    assert!(*filter_up > 2 << 20, "{seen:?}");
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
/// down: the join takes the filter on its probe side in (a fused stage, see `gpu/fuse.rs`)
/// and uploads the probe columns itself, the join's output reaches the aggregation on the
/// device.
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
    assert!(seen.iter().all(|(n, ..)| n != "GpuFilterExec"), "{seen:?}");
    let (_, join_up, join_down) = find("GpuHashJoinExec");
    let (_, aggregate_up, aggregate_down) = find("GpuAggregateExec");
    // The probe's columns (a key, a quantity and two dates: about 24 bytes a row of 60 000)
    // and the build side's.
    assert!(*join_up > 1 << 20, "{seen:?}");
    for (what, bytes) in [
        ("the join's download", join_down),
        ("the aggregation's upload", aggregate_up),
    ] {
        assert!(*bytes < CONTROL_BYTES, "{what}: {bytes} bytes ({seen:?})");
    }
    assert!(*aggregate_down > 0 && *aggregate_down < 4096, "{seen:?}");
}

/// An inner join whose output goes to the host (a sort above it, on a build column too so
/// that it stays above) and whose probe side is a
/// cached table's rows on the device probes them there: the scan downloads nothing and the
/// join uploads no key. Per batch it gathers its output and brings that alone down (many
/// narrow rows), or brings down the pairs and the probe chunk and takes the rows on the
/// host (a few rows of five strings out of a small filtered chunk — a filter the join
/// cannot take in, with a computed column between them: five gathers would cost more
/// launches and waits), as the cost model finds; the answers are DataFusion's
/// either way. A string among gathered output costs no wait of its own: its lengths are
/// queued with the probe, whose one wait brings its byte total up. On one device over a filtered build side built where it lies, and on two
/// devices over a replicated one.
#[tokio::test]
async fn a_join_whose_output_goes_to_the_host_probes_on_the_device() {
    use super::build_sides::{metric, output_rows};
    use super::cache::{CONTROL_BYTES, shown, text};
    let narrow = "SELECT l_orderkey, l_quantity, p_retailprice FROM lineitem \
                  JOIN part ON l_partkey = p_partkey WHERE p_size = 15 ORDER BY 3, 1, 2";
    let one_string = "SELECT l_orderkey, l_quantity, p_retailprice, l_comment FROM lineitem \
                      JOIN part ON l_partkey = p_partkey WHERE p_size = 15 ORDER BY 3, 1, 2, 4";
    let strings = "SELECT l_returnflag, l_linestatus, l_shipinstruct, l_shipmode, l_comment, \
                   p_retailprice, q FROM (SELECT l_partkey, l_returnflag, l_linestatus, \
                   l_shipinstruct, l_shipmode, l_comment, l_quantity + 1 AS q FROM lineitem \
                   WHERE l_quantity < 5) JOIN part ON l_partkey = p_partkey \
                   WHERE p_size = 15 ORDER BY 6, 1, 2, 3, 4, 5, 7";
    for set in ["emulated:1/host-output", "emulated:2/host-output"] {
        // Its host waits are compared between queries: on CUDA, the GPUs are its alone.
        super::alone_on_cuda(set);
        let (gpu, cpu) = tpch_contexts(set, 2, None);
        for table in ["lineitem", "part"] {
            gpu.cache_table(table).await.unwrap();
        }
        // The probe side's dynamic filter would bring the build keys down too.
        let off = "SET datafusion.optimizer.enable_join_dynamic_filter_pushdown = false";
        text(&gpu, off).await;
        let mut narrow_syncs = None;
        for (name, sql, gathered) in [
            ("narrow", narrow, true),
            ("one string", one_string, true),
            ("strings", strings, false),
        ] {
            let what = format!("{set}, {name}");
            super::settle_cuda(set);
            let plan = plan_of(&gpu, sql).await;
            let got = rows_of(&gpu, &plan).await;
            assert_eq!(got, run(&cpu, sql).await.1, "{what}");
            let work = Work::of(&plan);
            assert!(
                work.gpu_batches > 0 && work.nothing_fell_back(),
                "{what}: {work:?}"
            );
            let mut join = None;
            let mut scan_down = None;
            let _ = plan.apply(|node| {
                if node.name() == "GpuHashJoinExec" {
                    join = Some(Arc::clone(node));
                }
                let line = displayable(node.as_ref()).one_line().to_string();
                if node.name() == "GpuScanExec" && line.contains("table=lineitem") {
                    scan_down = Some(metric(node, "d2h_bytes"));
                }
                Ok(TreeNodeRecursion::Continue)
            });
            let shown = shown(&plan);
            let join = join.unwrap_or_else(|| panic!("{what}: no GPU join\n{shown}"));
            let (up, down, rows, takes, syncs) = (
                metric(&join, "h2d_bytes"),
                metric(&join, "d2h_bytes"),
                output_rows(&join),
                metric(&join, "host_takes"),
                metric(&join, "syncs"),
            );
            println!(
                "{what}: the join moved {up} B up, {down} B down, {rows} rows, {takes} taken on \
                 the host, {syncs} host syncs"
            );
            assert!(rows > 10, "{what}: {rows} rows\n{shown}");
            let scan_down =
                scan_down.unwrap_or_else(|| panic!("{what}: no lineitem scan\n{shown}"));
            assert!(
                scan_down < CONTROL_BYTES,
                "{what}: the probe rows came down\n{shown}"
            );
            assert!(
                up < CONTROL_BYTES,
                "{what}: the join uploaded {up} bytes\n{shown}"
            );
            if gathered {
                // Three 8-byte numbers a row (and a comment, at most 43 bytes), and nothing else.
                let width = if name == "narrow" { 24 } else { 24 + 4 + 43 };
                assert_eq!(takes, 0, "{what}\n{shown}");
                assert!(
                    down > 0 && down < width * rows + CONTROL_BYTES,
                    "{what}: the join downloaded {down} bytes for {rows} rows\n{shown}"
                );
                // The same batches as the narrow query's, and no more waits.
                match narrow_syncs {
                    None => narrow_syncs = Some(syncs),
                    Some(narrow) => assert_eq!(syncs, narrow, "{what}\n{shown}"),
                }
            } else {
                assert!(takes > 0, "{what}: every batch was gathered\n{shown}");
            }
        }
    }
}

/// In a plan of one partition DataFusion wraps each cached table's scan in a
/// `CooperativeExec` (no repartition or coalesce above it yields for it); the GPU operator
/// over it still takes the chunks where they lie: no scan brings a row down, and the
/// queries upload almost nothing (before, each scan's columns came down whole and went up
/// again: 2.6 MB down for Q1's here). The answers are DataFusion's.
#[tokio::test]
async fn cached_scans_in_a_plan_of_one_partition_stay_on_the_device() {
    use super::cache::{TPCH_TABLES, shown};
    let (gpu, cpu) = tpch_contexts("emulated:1/one-partition", 1, None);
    for table in TPCH_TABLES {
        gpu.cache_table(table).await.unwrap();
    }
    for q in [1, 3, 6, 9, 14] {
        let (got, plan) = tpch_run(&gpu, q).await;
        assert_eq!(got, run(&cpu, crate::tpch::QUERIES[q - 1]).await.1, "Q{q}");
        let shown = shown(&plan);
        assert!(shown.contains("CooperativeExec"), "Q{q}\n{shown}");
        let work = Work::of(&plan);
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back(),
            "Q{q}: {work:?}"
        );
        let moved = bytes_moved(&plan);
        for (name, _, down) in &moved {
            assert!(
                name != "GpuScanExec" || *down == 0,
                "Q{q}: a cached scan brought {down} bytes down\n{shown}"
            );
        }
        let up: usize = moved.iter().map(|(_, up, _)| up).sum();
        assert!(up < 64 << 10, "Q{q}: {up} bytes uploaded\n{shown}");
    }
}

/// A statement over a cached table yields to the runtime between the table's chunks, so
/// that it can be cancelled (the shell's Ctrl-C drops it at its next yield). In a plan of
/// one partition the GPU aggregation takes the chunks from beneath DataFusion's
/// `CooperativeExec`, whose yields it skips; the chunks are ready at once, so before, all of
/// them were done in the first poll. Polled by hand here: the stream returns `Pending`
/// between its chunks, and its answer is DataFusion's.
#[tokio::test]
async fn a_statement_over_cached_chunks_yields_between_them() {
    use futures::StreamExt;
    let gpu = super::session(small_chunks_config("emulated:1/yields"), 1);
    let cpu = super::session(super::cpu_config(), 1);
    gpu.register_tpch(0.01).unwrap();
    cpu.register_tpch(0.01).unwrap();
    let summary = gpu.cache_table("lineitem").await.unwrap();
    assert!(summary.chunks >= 4, "{summary:?}");
    let sql = "SELECT l_returnflag, count(*) AS n, sum(l_quantity) AS q FROM lineitem \
               WHERE l_shipdate < DATE '1998-09-01' GROUP BY l_returnflag ORDER BY l_returnflag";
    let plan = plan_of(&gpu, sql).await;
    let mut stream = datafusion::physical_plan::execute_stream(
        Arc::clone(&plan),
        gpu.session_context().task_ctx(),
    )
    .unwrap();
    let (mut pending, mut batches) = (0, Vec::new());
    loop {
        match futures::poll!(stream.next()) {
            std::task::Poll::Pending => pending += 1,
            std::task::Poll::Ready(Some(batch)) => batches.push(batch.unwrap()),
            std::task::Poll::Ready(None) => break,
        }
    }
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(shown.contains("CooperativeExec"), "{shown}");
    let work = Work::of(&plan);
    assert!(
        work.gpu_batches > 0 && work.nothing_fell_back(),
        "{work:?}\n{shown}"
    );
    assert!(
        pending >= summary.chunks - 1,
        "{pending} yields over {} chunks\n{shown}",
        summary.chunks
    );
    let got = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string();
    assert_eq!(got, run(&cpu, sql).await.1);
}

/// The test devices' settings with cached chunks of at most 1 MiB (lineitem at SF 0.01
/// in several chunks).
fn small_chunks_config(devices: &str) -> crate::FulmenConfig {
    crate::FulmenConfig {
        cache_chunk_bytes: 1 << 20,
        ..super::gpu_config(devices)
    }
}
