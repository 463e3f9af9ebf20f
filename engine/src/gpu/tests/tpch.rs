//! The 22 TPC-H queries (SF 0.01) with the GPU forced: on one device and on four (each
//! with every operator counted by kind), under device memory pressure (over cached tables
//! too), with every device
//! fault of Q3, Q9 and Q18 in turn; and with the GPU off, DataFusion's own plans.

use super::{
    Work, cpu_config, devices_of, fail_each_in_turn, plan_has, run, session, tpch_contexts,
    tpch_run,
};

/// How many operators of each kind a set of plans ran on a device, and the reasons the
/// others stayed on the CPU.
#[derive(Debug, Default)]
struct Placement {
    filters: usize,
    projections: usize,
    aggregates: usize,
    joins: usize,
    /// Filters a fused aggregate or join took in (each ran on the device in its stage).
    fused: usize,
    on_cpu: Vec<String>,
}

impl Placement {
    fn add(&mut self, query: usize, lines: Vec<String>) {
        for line in lines {
            if line.contains(" fused in") && line.contains(" runs on ") {
                self.fused += 1;
            }
            if line.starts_with("GpuFilterExec runs") {
                self.filters += 1;
            } else if line.starts_with("GpuProjectionExec runs") {
                self.projections += 1;
            } else if line.starts_with("GpuAggregateExec") && line.contains(" runs on ") {
                self.aggregates += 1;
            } else if line.starts_with("GpuHashJoinExec") && line.contains(" runs on ") {
                self.joins += 1;
            } else {
                self.on_cpu.push(format!("Q{query}: {line}"));
            }
        }
    }
}

/// The 22 TPC-H queries (SF 0.01) answer as DataFusion does with the GPU forced on
/// `devices`; every filter, projection and aggregation of the plans runs on a device (the
/// counts must not drop), no batch falls back to the CPU, and with several devices every
/// device receives work.
async fn check_tpch_on(devices: &str, partitions: usize) {
    let (gpu, cpu) = tpch_contexts(devices, partitions, None);
    let options = gpu.session_context().state().config().options().clone();
    let opened = devices_of(devices);
    let before: Vec<u64> = opened.iter().map(|d| d.counters().1).collect();
    let mut placement = Placement::default();
    for q in 1..=22 {
        let (got, plan) = tpch_run(&gpu, q).await;
        placement.add(q, crate::gpu::placement_report(&plan, &options));
        let work = Work::of(&plan);
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back(),
            "Q{q} on {devices}: {work:?}"
        );
        let (_, want) = run(&cpu, crate::tpch::QUERIES[q - 1]).await;
        assert_eq!(got, want, "Q{q} on {devices}");
    }
    println!(
        "{devices}: {} filters (and {} taken into fused stages), {} projections, {} \
         aggregates, {} hash joins of the TPC-H plans ran on the GPU; on the CPU:\n{}",
        placement.filters,
        placement.fused,
        placement.projections,
        placement.aggregates,
        placement.joins,
        placement.on_cpu.join("\n")
    );
    // The floors are what the plans had when aggregation came to the GPU: a drop means an
    // operator went back to the CPU. Every aggregation runs on the device. (Fewer filters
    // and a projection fewer since aggregates take them in, gpu/fuse.rs: Q6's keyless one,
    // which leaves no trace in the placement, Q1's filter and projection, and the filters
    // under three more grouped aggregates; 14 filters fewer since joins take in those on
    // their probe sides. A filter taken into a grouped aggregate or a join counts as
    // `fused`, so a filter gone back to the CPU shows as a drop in the sum. On one device
    // each aggregation is one operator, where it was a partial and a final one, nested
    // ones and those over one partition included (`gpu::one_stage`: 30), and Q22's keyless subquery, in one stage, takes its filter in as
    // Q6's does: one filter fewer.)
    assert!(
        placement.filters + placement.fused >= 43
            && placement.projections >= 10
            && placement.aggregates >= 30
            && placement.joins >= 62,
        "{placement:?}"
    );
    let heavy_on_cpu: Vec<_> = placement
        .on_cpu
        .iter()
        .filter(|l| l.contains("AggregateExec") || l.contains("HashJoinExec"))
        .collect();
    assert!(heavy_on_cpu.is_empty(), "{heavy_on_cpu:?}");
    for (device, launches) in opened.iter().zip(before) {
        assert!(device.counters().1 > launches, "{device} ran nothing");
    }
}

#[tokio::test]
async fn tpch_answers_are_unchanged_with_the_gpu_forced_on_one_device() {
    check_tpch_on("emulated:1/tpch", 2).await;
}

#[tokio::test]
async fn tpch_answers_are_unchanged_with_the_gpu_forced_on_four_devices() {
    check_tpch_on("emulated:4/tpch", 4).await;
}

/// Runs the 22 TPC-H queries on `gpu` against `cpu`'s answers: (batches on the device,
/// split, redone on the CPU, aggregations finished on the CPU), printed as `what`.
async fn tpch_under_pressure(
    gpu: &crate::FulmenContext,
    cpu: &crate::FulmenContext,
    what: &str,
) -> (usize, usize, usize, usize) {
    let (mut split, mut redone, mut fallbacks, mut on_device) = (0, 0, 0, 0);
    for q in 1..=22 {
        let (got, plan) = tpch_run(gpu, q).await;
        let (_, want) = run(cpu, crate::tpch::QUERIES[q - 1]).await;
        assert_eq!(got, want, "Q{q} {what}");
        let work = Work::of(&plan);
        split += work.split_batches;
        redone += work.cpu_batches;
        fallbacks += work.cpu_fallback;
        on_device += work.gpu_batches;
    }
    println!(
        "{what}: {on_device} batches on the device, {split} split, {redone} redone on the \
         CPU, {fallbacks} aggregations finished on the CPU"
    );
    (on_device, split, redone, fallbacks)
}

/// With a device memory limit far below the queries' working set, every TPC-H query still
/// answers as DataFusion does: operators split batches that do not fit, redo them on the
/// CPU, or finish on the CPU, and the plans' metrics show which happened.
#[tokio::test]
async fn tpch_answers_are_right_under_device_memory_pressure() {
    let limit = 384 << 10;
    let (gpu, cpu) = tpch_contexts("emulated:1/tpch-memory", 2, Some(limit));
    let what = format!("with {limit} bytes of device memory");
    let (on_device, split, redone, fallbacks) = tpch_under_pressure(&gpu, &cpu, &what).await;
    assert!(split > 0 && on_device > 0 && redone + fallbacks > 0);
}

/// With every table cached (its low-cardinality strings dictionary-encoded) and a query
/// quota far below the queries' working set, every TPC-H query still answers as DataFusion
/// does: the cache's memory is apart from the quota, and operators split their batches,
/// redo cached chunks on the CPU (they are not split on the device) or finish on the CPU.
#[tokio::test]
async fn tpch_over_cached_tables_is_right_under_device_memory_pressure() {
    let limit = 384 << 10;
    let (gpu, cpu) = tpch_contexts("emulated:2/tpch-cached-memory", 2, Some(limit));
    for table in super::cache::TPCH_TABLES {
        gpu.cache_table(table).await.unwrap();
    }
    let what = format!("over cached tables with {limit} bytes per query and device");
    let (on_device, split, redone, fallbacks) = tpch_under_pressure(&gpu, &cpu, &what).await;
    assert!(on_device > 0 && redone + fallbacks + split > 0);
}

/// Failing each allocation, then each launch, of TPC-H Q3, Q9 and Q18 in turn still gives
/// DataFusion's answer.
#[tokio::test]
async fn tpch_q3_q9_q18_survive_every_device_fault() {
    if super::needs_emulator("tpch_q3_q9_q18_survive_every_device_fault") {
        return;
    }
    // A device set of its own, so that other tests do not move its counters.
    let (gpu, cpu) = tpch_contexts("emulated:1/tpch-faults", 1, None);
    let device = devices_of("emulated:1/tpch-faults")[0].clone();
    for q in [3, 9, 18] {
        let (_, want) = run(&cpu, crate::tpch::QUERIES[q - 1]).await;
        let (allocations, launches) = device.counters();
        let (clean, plan) = tpch_run(&gpu, q).await;
        assert_eq!(clean, want, "Q{q}");
        assert!(plan_has(&plan, "GpuAggregateExec"), "Q{q}");
        let (allocations, launches) = {
            let (a, l) = device.counters();
            (a - allocations, l - launches)
        };
        fail_each_in_turn(
            &device,
            (allocations, launches),
            &want,
            &format!("Q{q}"),
            async || tpch_run(&gpu, q).await.0,
        )
        .await;
    }
}

/// With the GPU off, Fulmen plans every TPC-H query exactly as plain DataFusion does (the
/// same physical plan, operator for operator): what `fulmen-bench` measures for `fulmen`
/// against `datafusion` is the same work, so a gap between the two is measurement noise or
/// session overhead outside the plan.
#[tokio::test]
async fn with_the_gpu_off_tpch_plans_are_datafusions() {
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::{SessionConfig, SessionContext};

    let fulmen = session(cpu_config(), 4);
    fulmen.register_tpch(0.01).unwrap();
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
    for table in crate::tpch::TABLES {
        let provider = fulmen
            .session_context()
            .table_provider(table)
            .await
            .unwrap();
        plain.register_table(table, provider).unwrap();
    }
    for (q, sql) in crate::tpch::QUERIES.iter().enumerate() {
        let fulmen_plan = super::plan_of(&fulmen, sql).await;
        let plain_frame = plain.sql(sql).await.unwrap();
        let plain_plan = plain_frame.create_physical_plan().await.unwrap();
        assert_eq!(
            displayable(fulmen_plan.as_ref()).indent(true).to_string(),
            displayable(plain_plan.as_ref()).indent(true).to_string(),
            "Q{}",
            q + 1
        );
    }
}

/// A device lost mid-query (as after a sticky CUDA error, which leaves its context
/// unusable) is quarantined: the query still gives DataFusion's answer, the device is not
/// tried again (no launch after the one that lost it; later queries plan on the CPU and
/// EXPLAIN says why), and the error is counted for the device. Q1 (filter → projection →
/// partial aggregate → final aggregate) and Q6 (the same in one stage) lose the device at
/// launches spread over the whole query: in the filter, in a partial or one-stage
/// aggregation (its groups are computed again from its input), in the final one (the
/// partial states it was given are merged again on the CPU).
#[tokio::test]
async fn a_device_lost_mid_query_is_quarantined_and_the_answer_stays_right() {
    use fulmen_kernels::FaultPlan;

    if super::needs_emulator("a_device_lost_mid_query_is_quarantined_and_the_answer_stays_right") {
        return;
    }
    let cpu = session(cpu_config(), 2);
    cpu.register_tpch(0.01).unwrap();
    // A device error redoes the work on the CPU here (production's default): the loss is
    // what is tested.
    // Q1 in DataFusion's two stages (which `gpu::one_stage` makes one on one device), so
    // that a loss in the final stage merges its partial states again; Q6 in one.
    let lossy = |set: &str, q: usize| {
        let ctx = session(
            crate::FulmenConfig {
                gpu_on_error: crate::config::OnError::Fallback,
                gpu_single_stage_aggregation: q != 1,
                ..super::gpu_config(set)
            },
            2,
        );
        ctx.register_tpch(0.01).unwrap();
        ctx
    };
    for q in [1, 6] {
        let (_, want) = run(&cpu, crate::tpch::QUERIES[q - 1]).await;
        let clean_set = format!("emulated:1/lost-q{q}");
        let launches = {
            let device = devices_of(&clean_set)[0].clone();
            let before = device.counters().1;
            let (got, _) = tpch_run(&lossy(&clean_set, q), q).await;
            assert_eq!(got, want, "Q{q}");
            device.counters().1 - before
        };
        assert!(launches >= 4, "Q{q}: {launches} launches");
        let mut losses = vec![1, launches / 3, 2 * launches / 3, launches];
        // (Each on a device set of its own: a quarantined device stays so.)
        losses.dedup();
        for k in losses {
            let set = format!("emulated:1/lost-q{q}-at-{k}");
            let device = devices_of(&set)[0].clone();
            let gpu = lossy(&set, q);
            device
                .inject_faults(FaultPlan {
                    lose_device_at_launch: Some(k),
                    ..FaultPlan::default()
                })
                .unwrap();
            let before = device.counters().1;
            let (got, _) = tpch_run(&gpu, q).await;
            assert_eq!(got, want, "Q{q} losing the device at launch {k}");
            let reason = device.quarantined();
            assert!(reason.is_some(), "Q{q}: not quarantined after launch {k}");
            assert!(device.errors() >= 1, "Q{q}: the loss was not counted");
            assert_eq!(
                device.counters().1 - before,
                k,
                "Q{q}: the device was tried again after it was lost at launch {k}"
            );
            // Later queries plan around it, saying why, and still answer right.
            let options = gpu.session_context().state().config().options().clone();
            let (again, plan) = tpch_run(&gpu, q).await;
            assert_eq!(again, want, "Q{q} after the loss");
            let placement = crate::gpu::placement_report(&plan, &options).join("\n");
            assert!(
                placement.contains("emulated:0 is quarantined")
                    && placement.contains("stays on CPU: every device is quarantined"),
                "{placement}"
            );
            assert_eq!(
                device.counters().1 - before,
                k,
                "Q{q}: launched on a lost device"
            );
            // The device listing says so too, with the reason and the launches made.
            let listed = gpu
                .session_context()
                .sql("SELECT device, state, reason, launches, device_errors FROM fulmen_devices()")
                .await
                .unwrap()
                .collect()
                .await
                .unwrap();
            let cells: Vec<String> = (0..5)
                .map(|c| {
                    datafusion::arrow::util::display::array_value_to_string(listed[0].column(c), 0)
                        .unwrap()
                })
                .collect();
            assert_eq!(listed[0].num_rows(), 1, "Q{q}: one device listed");
            assert_eq!(
                cells,
                [
                    "emulated:0".to_string(),
                    "quarantined".to_string(),
                    format!("injected sticky fault at launch {}", before + k),
                    device.counters().1.to_string(),
                    device.errors().to_string(),
                ],
                "Q{q}: the device listing"
            );
        }
    }
}
