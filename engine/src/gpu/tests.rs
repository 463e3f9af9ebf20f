//! Placement and results of GPU filters and projections on the emulated device.

use std::sync::Arc;

use datafusion::arrow::util::pretty::{pretty_format_batches, pretty_format_batches_with_schema};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::displayable;

use crate::config::GpuMode;
use crate::{FulmenConfig, FulmenContext};

fn gpu_context(devices: &str) -> FulmenContext {
    FulmenContext::with_config(FulmenConfig {
        devices: devices.parse().unwrap(),
        gpu_mode: GpuMode::Force,
        ..FulmenConfig::default()
    })
}

async fn setup(ctx: &FulmenContext) {
    ctx.sql(
        "CREATE TABLE t AS VALUES (1, 2.5, 'apple', DATE '2024-03-05'), \
         (2, NULL, 'banana', DATE '1969-12-31'), (NULL, -1.0, NULL, NULL)",
    )
    .await
    .unwrap()
    .collect()
    .await
    .unwrap();
}

async fn run(ctx: &FulmenContext, sql: &str) -> (String, String) {
    let frame = ctx.sql(sql).await.unwrap();
    let plan = frame.clone().create_physical_plan().await.unwrap();
    let plan_text = displayable(plan.as_ref()).indent(true).to_string();
    let batches = frame.collect().await.unwrap();
    (
        plan_text,
        pretty_format_batches(&batches).unwrap().to_string(),
    )
}

/// A query's rows (or error) and its plan with the GPU placement report.
async fn answer(ctx: &FulmenContext, sql: &str) -> (Result<String, String>, String) {
    let frame = match ctx.sql(sql).await {
        Ok(f) => f,
        Err(e) => return (Err(e.to_string()), String::new()),
    };
    let options = ctx.session_context().state().config().options().clone();
    let plan = match frame.clone().create_physical_plan().await {
        Ok(p) => format!(
            "{}{}",
            datafusion::physical_plan::displayable(p.as_ref()).indent(false),
            crate::gpu::placement_report(&p, &options).join("\n")
        ),
        Err(e) => return (Err(e.to_string()), String::new()),
    };
    let schema = Arc::new(frame.schema().as_arrow().clone());
    let rows = match frame.collect().await {
        Ok(b) => pretty_format_batches_with_schema(schema, &b)
            .map(|t| t.to_string())
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    (rows, plan)
}

#[tokio::test]
async fn filters_and_projections_run_on_the_emulated_gpu() {
    let gpu = gpu_context("emulated:1");
    let cpu = FulmenContext::with_config(FulmenConfig {
        gpu_mode: GpuMode::Off,
        ..FulmenConfig::default()
    });
    setup(&gpu).await;
    setup(&cpu).await;
    let sql = "SELECT column1 + 1 AS a, column2 * 2 AS b, date_part('year', column4) AS y \
               FROM t WHERE column3 LIKE '%an%' OR column1 IS NULL OR column1 = 1 ORDER BY a";
    let (plan, gpu_rows) = run(&gpu, sql).await;
    assert!(plan.contains("GpuFilterExec: device=emulated:0"), "{plan}");
    assert!(
        plan.contains("GpuProjectionExec: device=emulated:0"),
        "{plan}"
    );
    let (cpu_plan, cpu_rows) = run(&cpu, sql).await;
    assert!(!cpu_plan.contains("Gpu"), "{cpu_plan}");
    assert_eq!(gpu_rows, cpu_rows);
}

mod properties {
    //! Random expressions over random typed columns with NULLs: the GPU program's answer
    //! (or error) equals DataFusion's.

    use std::sync::Arc;

    use datafusion::arrow::array::{
        BooleanArray, Date32Array, Decimal128Array, Float64Array, Int32Array, Int64Array,
        RecordBatch, StringArray, TimestampMicrosecondArray,
    };
    use datafusion::prelude::SessionConfig;
    use fulmen_kernels::FaultPlan;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::answer;
    use crate::config::GpuMode;
    use crate::gpu::devices::devices;
    use crate::{FulmenConfig, FulmenContext};

    type Row = (
        Option<i32>,
        Option<i64>,
        Option<f64>,
        Option<i64>,
        Option<String>,
        Option<bool>,
        Option<i32>,
        Option<i64>,
    );

    fn row() -> impl Strategy<Value = Row> {
        (
            proptest::option::weighted(0.85, -50i32..50),
            proptest::option::weighted(
                0.85,
                prop_oneof![-1000i64..1000, Just(i64::MAX), Just(i64::MIN)],
            ),
            proptest::option::weighted(
                0.85,
                prop_oneof![
                    -100.0f64..100.0,
                    Just(f64::NAN),
                    Just(-0.0),
                    Just(f64::INFINITY)
                ],
            ),
            proptest::option::weighted(0.85, -100_000i64..100_000),
            proptest::option::weighted(0.85, "[a-c]{0,4}|é[ab]?|xyz"),
            proptest::option::weighted(0.85, any::<bool>()),
            proptest::option::weighted(0.85, -30_000i32..30_000),
            proptest::option::weighted(0.85, -4_000_000_000_000_000i64..4_000_000_000_000_000),
        )
    }

    fn batch(rows: &[Row]) -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            (
                "a",
                Arc::new(Int32Array::from_iter(rows.iter().map(|r| r.0))) as _,
            ),
            (
                "b",
                Arc::new(Int64Array::from_iter(rows.iter().map(|r| r.1))) as _,
            ),
            (
                "c",
                Arc::new(Float64Array::from_iter(rows.iter().map(|r| r.2))) as _,
            ),
            (
                "d",
                Arc::new(
                    Decimal128Array::from_iter(rows.iter().map(|r| r.3.map(i128::from)))
                        .with_precision_and_scale(12, 2)
                        .unwrap(),
                ) as _,
            ),
            (
                "s",
                Arc::new(StringArray::from_iter(rows.iter().map(|r| r.4.clone()))) as _,
            ),
            (
                "e",
                Arc::new(BooleanArray::from_iter(rows.iter().map(|r| r.5))) as _,
            ),
            (
                "t",
                Arc::new(Date32Array::from_iter(rows.iter().map(|r| r.6))) as _,
            ),
            (
                "ts",
                Arc::new(TimestampMicrosecondArray::from_iter(
                    rows.iter().map(|r| r.7),
                )) as _,
            ),
        ])
        .unwrap()
    }

    fn one_of(items: &'static [&'static str]) -> impl Strategy<Value = &'static str> + Clone {
        proptest::sample::select(items)
    }

    fn int_expr() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("a".to_string()),
            Just("b".to_string()),
            (-5i64..5).prop_map(|v| v.to_string()),
            Just("NULL".to_string()),
            Just("date_part('month', t)".to_string()),
            Just("date_part('dow', ts)".to_string()),
            Just("date_part('year', ts)".to_string()),
            Just("extract(doy FROM t)".to_string()),
        ];
        leaf.prop_recursive(3, 12, 2, |inner| {
            prop_oneof![
                (
                    inner.clone(),
                    one_of(&["+", "-", "*", "/", "%"]),
                    inner.clone()
                )
                    .prop_map(|(l, op, r)| format!("({l} {op} {r})")),
                inner.clone().prop_map(|x| format!("(-{x})")),
                inner.clone().prop_map(|x| format!("CAST({x} AS INT)")),
                (bool_leaf(), inner.clone(), inner.clone())
                    .prop_map(|(c, x, y)| format!("CASE WHEN {c} THEN {x} ELSE {y} END")),
                (inner.clone(), inner)
                    .prop_map(|(x, y)| format!("CASE {x} WHEN 1 THEN {y} WHEN 2 THEN 7 END")),
            ]
        })
    }

    fn float_expr() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("c".to_string()),
            (-3.0f64..3.0).prop_map(|v| format!("{v:.3}")),
            Just("CAST(a AS DOUBLE)".to_string()),
            Just("CAST(d AS DOUBLE)".to_string()),
            Just("CAST(CAST(c AS DECIMAL(12, 3)) AS DOUBLE)".to_string()),
        ];
        leaf.prop_recursive(2, 8, 2, |inner| {
            (inner.clone(), one_of(&["+", "-", "*", "/", "%"]), inner)
                .prop_map(|(l, op, r)| format!("({l} {op} {r})"))
        })
    }

    fn decimal_expr() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("d".to_string()),
            Just("(d + d)".to_string()),
            Just("(d - CAST(1.5 AS DECIMAL(12, 2)))".to_string()),
            Just("(d * d)".to_string()),
            Just("CAST(a AS DECIMAL(10, 3))".to_string()),
            Just("(-d)".to_string()),
            Just("(d / CAST(a AS DECIMAL(10, 3)))".to_string()),
            Just("(d / CAST(0.7 AS DECIMAL(3, 1)))".to_string()),
            Just("(d % CAST(a AS DECIMAL(10, 3)))".to_string()),
        ]
    }

    fn string_expr() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("s".to_string()),
            "[a-c]{0,2}".prop_map(|v| format!("'{v}'")),
            (-1i64..4, 0i64..3).prop_map(|(a, b)| format!("substr(s, {a}, {b})")),
            (0i64..4).prop_map(|a| format!("substr(s, {a})")),
        ]
    }

    fn bool_leaf() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("e".to_string()),
            Just("(a > 0)".to_string()),
            Just("(s IS NULL)".to_string()),
        ]
    }

    fn bool_expr() -> impl Strategy<Value = String> {
        let cmp = one_of(&[
            "=",
            "<>",
            "<",
            "<=",
            ">",
            ">=",
            "IS DISTINCT FROM",
            "IS NOT DISTINCT FROM",
        ]);
        let leaf = prop_oneof![
            bool_leaf(),
            (int_expr(), cmp.clone(), int_expr()).prop_map(|(l, op, r)| format!("({l} {op} {r})")),
            (float_expr(), cmp.clone(), float_expr())
                .prop_map(|(l, op, r)| format!("({l} {op} {r})")),
            (decimal_expr(), cmp.clone(), decimal_expr())
                .prop_map(|(l, op, r)| format!("({l} {op} {r})")),
            (string_expr(), cmp, string_expr()).prop_map(|(l, op, r)| format!("({l} {op} {r})")),
            (
                string_expr(),
                "%?[a-c]{0,2}(%[a-c]{0,2}){0,2}%?",
                any::<bool>()
            )
                .prop_map(|(s, p, n)| format!("({s} {}LIKE '{p}')", if n { "NOT " } else { "" })),
            (
                int_expr(),
                proptest::collection::vec(-3i64..3, 1..4),
                any::<bool>()
            )
                .prop_map(|(x, items, n)| {
                    let list: Vec<String> = items.iter().map(|v| v.to_string()).collect();
                    format!(
                        "({x} {}IN ({}, NULL))",
                        if n { "NOT " } else { "" },
                        list.join(", ")
                    )
                }),
            (int_expr(), -3i64..0, 0i64..3)
                .prop_map(|(x, l, h)| format!("({x} BETWEEN {l} AND {h})")),
            Just("(t < DATE '1990-01-01')".to_string()),
            Just(
                "(date_trunc('month', ts) = date_trunc('month', CAST(t AS TIMESTAMP)))".to_string()
            ),
            Just("starts_with(s, 'a')".to_string()),
            (int_expr()).prop_map(|x| format!("({x} IS NOT NULL)")),
        ];
        leaf.prop_recursive(2, 8, 2, |inner| {
            prop_oneof![
                (inner.clone(), one_of(&["AND", "OR"]), inner.clone())
                    .prop_map(|(l, op, r)| format!("({l} {op} {r})")),
                inner.prop_map(|x| format!("(NOT {x})")),
            ]
        })
    }

    fn context(gpu: bool) -> FulmenContext {
        let config = if gpu {
            FulmenConfig {
                devices: "emulated:1".parse().unwrap(),
                gpu_mode: GpuMode::Force,
                ..FulmenConfig::default()
            }
        } else {
            FulmenConfig {
                gpu_mode: GpuMode::Off,
                ..FulmenConfig::default()
            }
        };
        FulmenContext::with_session_config(SessionConfig::new().with_target_partitions(1), config)
    }

    fn check(rows: &[Row], sql: &str, operator: &str) -> Result<(), TestCaseError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let data = batch(rows);
            let (gpu, cpu) = (context(true), context(false));
            for ctx in [&gpu, &cpu] {
                ctx.session_context()
                    .register_batch("r", data.clone())
                    .unwrap();
            }
            let device = devices(&"emulated:1".parse().unwrap()).unwrap()[0].clone();
            let launches = device.counters().1;
            let (gpu_rows, gpu_plan) = answer(&gpu, sql).await;
            let (cpu_rows, _) = answer(&cpu, sql).await;
            prop_assert_eq!(&gpu_rows, &cpu_rows, "{}\n{}", sql, gpu_plan);
            // Every filter and projection runs on the GPU, except projections that only
            // rename columns (nothing to compute) or that compute strings (common
            // subexpressions such as substr(s, 1)), not supported yet (docs/supported.md).
            let on_cpu = gpu_plan.lines().any(|l| {
                l.contains("stays on CPU")
                    && !l.contains("results of type Utf8")
                    && !l.contains("nothing to compute")
            });
            prop_assert!(!on_cpu, "{} not on GPU:\n{}", sql, gpu_plan);
            // A query that fails (a cast overflowing, in both engines) may fail before a
            // launch: the device leaves rows it cannot compute to DataFusion, which raises.
            if !rows.is_empty() && gpu_plan.contains(operator) && gpu_rows.is_ok() {
                prop_assert!(device.counters().1 > launches, "no kernel ran for {}", sql);
            }
            Ok(())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        #[test]
        fn gpu_projections_equal_datafusion(
            rows in proptest::collection::vec(row(), 0..120),
            i in int_expr(), f in float_expr(), d in decimal_expr(), b in bool_expr(),
        ) {
            let sql = format!("SELECT {i} AS i, {f} AS f, {d} AS d, {b} AS b FROM r");
            check(&rows, &sql, "GpuProjectionExec")?;
        }

        #[test]
        fn gpu_filters_equal_datafusion(
            rows in proptest::collection::vec(row(), 0..120),
            b in bool_expr(),
        ) {
            let sql = format!("SELECT * FROM r WHERE {b}");
            check(&rows, &sql, "GpuFilterExec")?;
        }
    }

    /// Failing each allocation, then each launch, of a filter + projection query in turn
    /// still gives DataFusion's answer: the failed batch is redone on the CPU.
    #[tokio::test]
    async fn device_faults_fall_back_to_the_cpu() {
        let rows: Vec<Row> = (0..500)
            .map(|i| {
                (
                    Some(i % 17 - 8),
                    Some(i as i64 * 31),
                    Some(i as f64 / 7.0),
                    Some(i as i64 * 13),
                    (i % 5 != 0).then(|| ["ab", "b", "ca", "abc"][i as usize % 4].to_string()),
                    Some(i % 3 == 0),
                    Some(i * 40),
                    None,
                )
            })
            .collect();
        let selection = "emulated:3".parse().unwrap();
        let config = FulmenConfig {
            devices: "emulated:3".parse().unwrap(),
            gpu_mode: GpuMode::Force,
            ..FulmenConfig::default()
        };
        let gpu = FulmenContext::with_session_config(
            SessionConfig::new().with_target_partitions(1),
            config,
        );
        let cpu = context(false);
        for ctx in [&gpu, &cpu] {
            ctx.session_context()
                .register_batch("r", batch(&rows))
                .unwrap();
        }
        let sql = "SELECT a * 2 + b AS x, substr(s, 2) = 'b' AS y, d * d AS z FROM r \
                   WHERE s LIKE '%b%' AND a > -5";
        let (expected, _) = answer(&cpu, sql).await;
        let device = devices(&selection).unwrap()[0].clone();
        let (allocations, launches) = device.counters();
        let (clean, plan) = answer(&gpu, sql).await;
        assert!(
            plan.contains("GpuFilterExec") && plan.contains("GpuProjectionExec"),
            "{plan}"
        );
        assert_eq!(clean, expected);
        let (allocations, launches) = {
            let (a, l) = device.counters();
            (a - allocations, l - launches)
        };
        assert!(
            allocations > 4 && launches > 2,
            "{allocations} allocations, {launches} launches"
        );
        super::fail_each_in_turn(
            &device,
            (allocations, launches),
            &expected,
            sql,
            async || answer(&gpu, sql).await.0,
        )
        .await;
        device.inject_faults(FaultPlan::default()).unwrap();
    }
}

/// With four devices, a plan's partitions are spread over all of them.
#[tokio::test]
async fn partitions_are_spread_over_the_devices() {
    use datafusion::prelude::SessionConfig;

    let selection = "emulated:4".parse().unwrap();
    let ctx = FulmenContext::with_session_config(
        SessionConfig::new().with_target_partitions(4),
        FulmenConfig {
            devices: "emulated:4".parse().unwrap(),
            gpu_mode: GpuMode::Force,
            ..FulmenConfig::default()
        },
    );
    let devices = crate::gpu::devices::devices(&selection).unwrap();
    let before: Vec<u64> = devices.iter().map(|d| d.counters().1).collect();
    let (plan, rows) = run(
        &ctx,
        "SELECT count(*) AS n FROM (SELECT v * 2 AS w FROM generate_series(1, 100000) AS t(v) \
         WHERE v % 3 = 0) WHERE w > 10",
    )
    .await;
    assert!(
        plan.contains("GpuFilterExec: device=emulated:0,emulated:1,emulated:2,emulated:3"),
        "{plan}"
    );
    assert!(rows.contains("33332"), "{rows}");
    for (device, launches) in devices.iter().zip(before) {
        assert!(
            device.counters().1 > launches,
            "{device} ran nothing:\n{plan}"
        );
    }
}

/// How many operators of each kind a set of plans ran on a device, and the reasons the
/// others stayed on the CPU.
#[derive(Debug, Default)]
struct Placement {
    filters: usize,
    projections: usize,
    aggregates: usize,
    joins: usize,
    on_cpu: Vec<String>,
}

impl Placement {
    fn add(&mut self, query: usize, lines: Vec<String>) {
        for line in lines {
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

/// The sum of a metric over every node of a plan.
fn metric_sum(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>, name: &str) -> usize {
    let mut total = 0;
    let _ = plan.apply(|node| {
        if let Some(m) = node.metrics() {
            total += m.sum_by_name(name).map_or(0, |v| v.as_usize());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    total
}

fn tpch_contexts(
    devices: &str,
    partitions: usize,
    limit: Option<usize>,
) -> (FulmenContext, FulmenContext) {
    use datafusion::prelude::SessionConfig;

    let gpu = FulmenContext::with_session_config(
        SessionConfig::new().with_target_partitions(partitions),
        FulmenConfig {
            devices: devices.parse().unwrap(),
            gpu_mode: GpuMode::Force,
            gpu_memory_limit: limit,
            ..FulmenConfig::default()
        },
    );
    let cpu = FulmenContext::with_session_config(
        SessionConfig::new().with_target_partitions(partitions),
        FulmenConfig {
            gpu_mode: GpuMode::Off,
            ..FulmenConfig::default()
        },
    );
    gpu.register_tpch(0.01).unwrap();
    cpu.register_tpch(0.01).unwrap();
    (gpu, cpu)
}

/// Runs TPC-H query `q` (1-based) on `gpu`: its rows and the executed plan.
async fn tpch_run(
    gpu: &FulmenContext,
    q: usize,
) -> (String, Arc<dyn datafusion::physical_plan::ExecutionPlan>) {
    let frame = gpu.sql(crate::tpch::QUERIES[q - 1]).await.unwrap();
    let plan = frame.create_physical_plan().await.unwrap();
    let task = gpu.session_context().task_ctx();
    let batches = datafusion::physical_plan::collect(Arc::clone(&plan), task)
        .await
        .unwrap_or_else(|e| panic!("Q{q}: {e}"));
    (pretty_format_batches(&batches).unwrap().to_string(), plan)
}

/// The 22 TPC-H queries (SF 0.01) answer as DataFusion does with the GPU forced on
/// `devices`; every filter, projection and aggregation of the plans runs on a device (the
/// counts must not drop), no batch falls back to the CPU, and with several devices every
/// device receives work.
async fn check_tpch_on(devices: &str, partitions: usize) {
    let (gpu, cpu) = tpch_contexts(devices, partitions, None);
    let options = gpu.session_context().state().config().options().clone();
    let opened = crate::gpu::devices::devices(&devices.parse().unwrap()).unwrap();
    let before: Vec<u64> = opened.iter().map(|d| d.counters().1).collect();
    let mut placement = Placement::default();
    for q in 1..=22 {
        let (got, plan) = tpch_run(&gpu, q).await;
        placement.add(q, crate::gpu::placement_report(&plan, &options));
        assert_eq!(
            metric_sum(&plan, "cpu_batches"),
            0,
            "Q{q} redid batches on the CPU"
        );
        assert_eq!(
            metric_sum(&plan, "cpu_fallback"),
            0,
            "Q{q} fell back to the CPU"
        );
        let (_, want) = run(&cpu, crate::tpch::QUERIES[q - 1]).await;
        assert_eq!(got, want, "Q{q} on {devices}");
    }
    println!(
        "{devices}: {} filters, {} projections, {} aggregates, {} hash joins of the TPC-H \
         plans ran on the GPU; on the CPU:\n{}",
        placement.filters,
        placement.projections,
        placement.aggregates,
        placement.joins,
        placement.on_cpu.join("\n")
    );
    // The floors are what the plans had when aggregation came to the GPU: a drop means an
    // operator went back to the CPU. Every aggregation runs on the device.
    assert!(
        placement.filters >= 45
            && placement.projections >= 11
            && placement.aggregates >= 60
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
    check_tpch_on("emulated:1", 2).await;
}

#[tokio::test]
async fn tpch_answers_are_unchanged_with_the_gpu_forced_on_four_devices() {
    check_tpch_on("emulated:4", 4).await;
}

/// With a device memory limit far below the queries' working set, every TPC-H query still
/// answers as DataFusion does: operators split batches that do not fit, redo them on the
/// CPU, or finish on the CPU, and the plans' metrics show which happened.
#[tokio::test]
async fn tpch_answers_are_right_under_device_memory_pressure() {
    let limit = 384 << 10;
    let (gpu, cpu) = tpch_contexts("emulated:1", 2, Some(limit));
    let (mut split, mut redone, mut fallbacks, mut on_device) = (0, 0, 0, 0);
    for q in 1..=22 {
        let (got, plan) = tpch_run(&gpu, q).await;
        let (_, want) = run(&cpu, crate::tpch::QUERIES[q - 1]).await;
        assert_eq!(got, want, "Q{q} with {limit} bytes of device memory");
        split += metric_sum(&plan, "split_batches");
        redone += metric_sum(&plan, "cpu_batches");
        fallbacks += metric_sum(&plan, "cpu_fallback");
        on_device += metric_sum(&plan, "gpu_batches");
    }
    println!(
        "{limit} bytes per device: {on_device} batches on the device, {split} split, {redone} \
         redone on the CPU, {fallbacks} aggregations finished on the CPU"
    );
    assert!(split > 0 && on_device > 0 && redone + fallbacks > 0);
}

/// Failing each allocation, then each launch, of TPC-H Q3, Q9 and Q18 in turn still gives
/// DataFusion's answer.
#[tokio::test]
async fn tpch_q3_q9_q18_survive_every_device_fault() {
    // A device set of its own, so that other tests do not move its counters.
    let (gpu, cpu) = tpch_contexts("emulated:5", 1, None);
    let device = crate::gpu::devices::devices(&"emulated:5".parse().unwrap()).unwrap()[0].clone();
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

/// Fails each of `device`'s next `allocations` allocations in turn, then each of its next
/// `launches` launches, and checks that `run` still answers `want` every time.
async fn fail_each_in_turn<T: PartialEq + std::fmt::Debug>(
    device: &fulmen_kernels::Device,
    (allocations, launches): (u64, u64),
    want: &T,
    label: &str,
    mut run: impl AsyncFnMut() -> T,
) {
    use fulmen_kernels::FaultPlan;

    println!("{label}: {allocations} allocations and {launches} launches fail in turn");
    for (kind, count) in [("allocation", allocations), ("launch", launches)] {
        for k in 1..=count {
            let faults = FaultPlan {
                fail_allocation: (kind == "allocation").then_some(k),
                fail_launch: (kind == "launch").then_some(k),
            };
            device.inject_faults(faults).unwrap();
            let got = run().await;
            device.inject_faults(FaultPlan::default()).unwrap();
            assert_eq!(&got, want, "{label} with {kind} {k} failing");
        }
    }
}

fn plan_has(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>, name: &str) -> bool {
    let mut found = false;
    let _ = plan.apply(|node| {
        found |= node.name() == name;
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

mod aggregate_properties {
    //! Random GROUP BY queries over random data with NULLs and skew (a hot key, all keys
    //! distinct, no rows), in one partition (Single mode) and in three (Partial, then
    //! FinalPartitioned or Final): the GPU's answer equals DataFusion's.

    use std::sync::Arc;

    use datafusion::arrow::array::{
        Date32Array, Decimal128Array, Float64Array, Int32Array, Int64Array, RecordBatch,
        StringArray,
    };
    use datafusion::prelude::SessionConfig;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::answer;
    use crate::config::GpuMode;
    use crate::gpu::devices::devices;
    use crate::{FulmenConfig, FulmenContext};

    /// k (int key), s (string key), x (float key with -0.0 and NaN), v (int64), d
    /// (decimal), f (float in quarters, so that sums are exact in any order), t (date).
    type Row = (
        Option<i32>,
        Option<String>,
        Option<f64>,
        Option<i64>,
        Option<i64>,
        Option<f64>,
        Option<i32>,
    );

    fn rows() -> impl Strategy<Value = Vec<Row>> {
        let key = prop_oneof![
            // a few keys
            proptest::option::weighted(0.9, 0i32..6).boxed(),
            // one hot key
            prop_oneof![9 => Just(Some(7)), 1 => proptest::option::of(0i32..1000)].boxed(),
            // (almost) all distinct
            proptest::option::weighted(0.98, any::<i32>()).boxed(),
        ];
        (key, 0usize..200).prop_flat_map(|(_, n)| {
            proptest::collection::vec(
                (
                    prop_oneof![
                        proptest::option::weighted(0.9, 0i32..6),
                        prop_oneof![9 => Just(Some(7)), 1 => proptest::option::of(0i32..1000)],
                        proptest::option::weighted(0.98, any::<i32>()),
                    ],
                    proptest::option::weighted(0.9, "[ab]{0,2}|é"),
                    proptest::option::weighted(
                        0.9,
                        prop_oneof![Just(0.0), Just(-0.0), Just(f64::NAN), Just(1.5)],
                    ),
                    proptest::option::weighted(
                        0.85,
                        prop_oneof![-1000i64..1000, Just(i64::MAX), Just(i64::MIN)],
                    ),
                    proptest::option::weighted(0.85, -100_000i64..100_000),
                    proptest::option::weighted(0.85, (-400i32..400).prop_map(|q| q as f64 / 4.0)),
                    proptest::option::weighted(0.85, -30_000i32..30_000),
                ),
                n,
            )
        })
    }

    fn batch(rows: &[Row]) -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            (
                "k",
                Arc::new(Int32Array::from_iter(rows.iter().map(|r| r.0))) as _,
            ),
            (
                "s",
                Arc::new(StringArray::from_iter(rows.iter().map(|r| r.1.clone()))) as _,
            ),
            (
                "x",
                Arc::new(Float64Array::from_iter(rows.iter().map(|r| r.2))) as _,
            ),
            (
                "v",
                Arc::new(Int64Array::from_iter(rows.iter().map(|r| r.3))) as _,
            ),
            (
                "d",
                Arc::new(
                    Decimal128Array::from_iter(rows.iter().map(|r| r.4.map(i128::from)))
                        .with_precision_and_scale(12, 2)
                        .unwrap(),
                ) as _,
            ),
            (
                "f",
                Arc::new(Float64Array::from_iter(rows.iter().map(|r| r.5))) as _,
            ),
            (
                "t",
                Arc::new(Date32Array::from_iter(rows.iter().map(|r| r.6))) as _,
            ),
        ])
        .unwrap()
    }

    fn context(gpu: bool, partitions: usize) -> FulmenContext {
        let config = FulmenConfig {
            devices: "emulated:1".parse().unwrap(),
            gpu_mode: if gpu { GpuMode::Force } else { GpuMode::Off },
            ..FulmenConfig::default()
        };
        FulmenContext::with_session_config(
            SessionConfig::new().with_target_partitions(partitions),
            config,
        )
    }

    fn check(rows: &[Row], sql: &str, partitions: usize) -> Result<(), TestCaseError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (gpu, cpu) = (context(true, partitions), context(false, partitions));
            for ctx in [&gpu, &cpu] {
                register(ctx, rows, partitions);
            }
            let device = devices(&"emulated:1".parse().unwrap()).unwrap()[0].clone();
            let launches = device.counters().1;
            let (gpu_rows, gpu_plan) = answer(&gpu, sql).await;
            let (cpu_rows, _) = answer(&cpu, sql).await;
            prop_assert_eq!(&gpu_rows, &cpu_rows, "{}\n{}", sql, gpu_plan);
            prop_assert!(
                gpu_plan.contains("GpuAggregateExec"),
                "{}\n{}",
                sql,
                gpu_plan
            );
            let on_cpu = gpu_plan
                .lines()
                .any(|l| l.contains("AggregateExec stays on CPU"));
            prop_assert!(!on_cpu, "{} not on GPU:\n{}", sql, gpu_plan);
            if !rows.is_empty() {
                prop_assert!(device.counters().1 > launches, "no kernel ran for {}", sql);
            }
            Ok(())
        })
    }

    fn keys() -> impl Strategy<Value = &'static str> {
        prop_oneof![
            Just(""),
            Just("k"),
            Just("s"),
            Just("x"),
            Just("k, s"),
            Just("s, x, k"),
            Just("k % 3, s"),
            Just("t"),
            Just("d"),
        ]
    }

    const AGGREGATES: &str = "count(*) AS n, count(v) AS nv, sum(v) AS sv, min(v) AS lo, \
         max(v) AS hi, avg(d) AS ad, sum(d) AS sd, min(d) AS ld, max(d) AS hd, sum(f) AS sf, \
         avg(f) AS af, min(f) AS lf, max(f) AS hf, min(t) AS lt, max(t) AS ht, \
         count(*) FILTER (WHERE v > 0) AS np, sum(d) FILTER (WHERE s = 'a') AS sa";
    // Not min(x) or max(x): over NaN and ±0.0 DataFusion's grouped min and max depend on
    // the order rows arrive in (a NaN on either side replaces the current value), while
    // the device uses IEEE total order (docs/supported.md).

    /// `aggregates` over `r`, grouped by `keys` (none: one row) and ordered by them.
    fn grouped(keys: &str, aggregates: &str) -> String {
        if keys.is_empty() {
            return format!("SELECT {aggregates} FROM r");
        }
        let order: Vec<String> = (1..=keys.split(',').count())
            .map(|i| i.to_string())
            .collect();
        format!(
            "SELECT {keys}, {aggregates} FROM r GROUP BY {keys} ORDER BY {}",
            order.join(", ")
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

        #[test]
        fn gpu_aggregations_equal_datafusion(
            rows in rows(),
            keys in keys(),
            partitions in prop_oneof![Just(1usize), Just(3)],
        ) {
            // Sums of v wrap on overflow in both engines (i64::MAX and MIN are in the data).
            check(&rows, &grouped(keys, AGGREGATES), partitions)?;
        }

        /// count(DISTINCT …) accumulators (two distinct arguments and a count keep
        /// DataFusion from rewriting them into GROUP BYs) on the device.
        #[test]
        fn gpu_distinct_counts_equal_datafusion(
            rows in rows(),
            keys in keys(),
            partitions in prop_oneof![Just(1usize), Just(3)],
        ) {
            check(&rows, &grouped(keys, DISTINCT), partitions)?;
        }
    }

    const DISTINCT: &str = "count(DISTINCT v) AS dv, count(DISTINCT s) AS ds, \
         count(DISTINCT d) AS dd, count(DISTINCT t) AS dt, count(DISTINCT v % 5) AS dm, \
         count(DISTINCT k) FILTER (WHERE v > 0) AS dk, count(*) AS n, sum(v) AS sv";
    // Not count(DISTINCT x) or of f: DataFusion tells -0.0 from 0.0 there, and such
    // aggregates stay on the CPU (tests/slt/gpu/distinct.slt shows it).

    fn fixed_rows() -> Vec<Row> {
        (0..600i64)
            .map(|i| {
                (
                    (i % 13 != 0).then_some((i % 9) as i32),
                    (i % 7 != 0).then(|| ["a", "bb", "é", ""][i as usize % 4].to_string()),
                    Some([0.0, -0.0, 1.5][i as usize % 3]),
                    (i % 11 != 0).then_some(i % 37 - 18),
                    Some(i % 23 * 100),
                    Some(i as f64 / 4.0),
                    Some((i % 41) as i32 * 3),
                )
            })
            .collect()
    }

    const DISTINCT_QUERY: &str = "SELECT k, x, count(DISTINCT s) AS ds, \
         count(DISTINCT t) FILTER (WHERE v > 0) AS dt, count(*) AS n FROM r GROUP BY k, x \
         ORDER BY k, x";

    /// Registers `rows` as `r` in `partitions` partitions (several, so that partial
    /// aggregates see parts of a group).
    fn register(ctx: &FulmenContext, rows: &[Row], partitions: usize) {
        let data = batch(rows);
        let parts: Vec<Vec<RecordBatch>> = (0..partitions)
            .map(|p| {
                let n = data.num_rows();
                let (from, to) = (n * p / partitions, n * (p + 1) / partitions);
                vec![data.slice(from, to - from)]
            })
            .collect();
        let table = datafusion::datasource::MemTable::try_new(data.schema(), parts).unwrap();
        ctx.session_context()
            .register_table("r", Arc::new(table))
            .unwrap();
    }

    /// Failing each allocation, then each launch, of an aggregation with count(DISTINCT …)
    /// in turn (in two partitions: raw rows into partial list states, then those merged)
    /// still gives DataFusion's answer.
    #[tokio::test]
    async fn distinct_counts_survive_every_device_fault() {
        let rows = &fixed_rows()[..200];
        // One device of its own (devices opened with another memory limit are others), so
        // that other tests do not move its counters and both partitions meet the faults.
        let limit = Some(3 << 30);
        let selection = "emulated:1".parse().unwrap();
        let device = crate::gpu::devices::devices_with_limit(&selection, limit).unwrap()[0].clone();
        let partitions = 2;
        let gpu = FulmenContext::with_session_config(
            SessionConfig::new().with_target_partitions(partitions),
            FulmenConfig {
                devices: selection,
                gpu_mode: GpuMode::Force,
                gpu_memory_limit: limit,
                ..FulmenConfig::default()
            },
        );
        let cpu = context(false, partitions);
        register(&gpu, rows, partitions);
        register(&cpu, rows, partitions);
        let (want, _) = answer(&cpu, DISTINCT_QUERY).await;
        let (allocations, launches) = device.counters();
        let (clean, plan) = answer(&gpu, DISTINCT_QUERY).await;
        assert_eq!(clean, want);
        assert!(
            plan.contains("GpuAggregateExec") && !plan.contains("AggregateExec stays on CPU"),
            "{plan}"
        );
        let (allocations, launches) = {
            let (a, l) = device.counters();
            (a - allocations, l - launches)
        };
        assert!(allocations > 10 && launches > 10);
        let label = "count(DISTINCT …)";
        super::fail_each_in_turn(&device, (allocations, launches), &want, label, async || {
            answer(&gpu, DISTINCT_QUERY).await.0
        })
        .await;
    }

    /// With too little device memory for the pair tables, count(DISTINCT …) splits its
    /// batches or finishes on the CPU, and the answer is still DataFusion's.
    #[tokio::test]
    async fn distinct_counts_are_right_under_device_memory_pressure() {
        let rows: Vec<Row> = fixed_rows().into_iter().cycle().take(6000).collect();
        let gpu = FulmenContext::with_session_config(
            SessionConfig::new().with_target_partitions(1),
            FulmenConfig {
                devices: "emulated:1".parse().unwrap(),
                gpu_mode: GpuMode::Force,
                gpu_memory_limit: Some(160 << 10),
                ..FulmenConfig::default()
            },
        );
        let cpu = context(false, 1);
        register(&gpu, &rows, 1);
        register(&cpu, &rows, 1);
        let (want, _) = answer(&cpu, DISTINCT_QUERY).await;
        let frame = gpu.sql(DISTINCT_QUERY).await.unwrap();
        let plan = frame.create_physical_plan().await.unwrap();
        let batches =
            datafusion::physical_plan::collect(Arc::clone(&plan), gpu.session_context().task_ctx())
                .await
                .unwrap();
        let got = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string();
        assert_eq!(Ok(got), want);
        let (split, fallback) = (
            super::metric_sum(&plan, "split_batches"),
            super::metric_sum(&plan, "cpu_fallback"),
        );
        assert!(split + fallback > 0, "{split} split, {fallback} fell back");
    }
}

mod join_properties {
    //! Random equi-joins of every supported type over random data with NULL keys and skew
    //! (a hot key, all keys distinct, an empty side), with and without a residual filter,
    //! in one partition and in three: the GPU's answer equals DataFusion's.

    use std::sync::Arc;

    use datafusion::arrow::array::{Int32Array, Int64Array, RecordBatch, StringArray};
    use datafusion::prelude::SessionConfig;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::answer;
    use crate::config::GpuMode;
    use crate::gpu::devices::devices;
    use crate::{FulmenConfig, FulmenContext};

    type Row = (Option<i32>, Option<String>, Option<i64>);

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
        FulmenContext::with_session_config(
            session,
            FulmenConfig {
                devices: "emulated:1".parse().unwrap(),
                gpu_mode: if gpu { GpuMode::Force } else { GpuMode::Off },
                ..FulmenConfig::default()
            },
        )
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
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (gpu, cpu) = (context(true, partitions), context(false, partitions));
            for ctx in [&gpu, &cpu] {
                register(ctx, "l", &batch(l, ["k", "s", "a"]), partitions);
                register(ctx, "r", &batch(r, ["k2", "s2", "b"]), partitions);
            }
            let device = devices(&"emulated:1".parse().unwrap()).unwrap()[0].clone();
            let launches = device.counters().1;
            let (gpu_rows, gpu_plan) = answer(&gpu, sql).await;
            let (cpu_rows, cpu_plan) = answer(&cpu, sql).await;

            prop_assert_eq!(&gpu_rows, &cpu_rows, "{}\n{}", sql, gpu_plan);
            let mode = if partitions > 1 {
                "mode=Partitioned"
            } else {
                "mode=CollectLeft"
            };
            prop_assert!(cpu_plan.contains(mode), "{}\n{}", sql, cpu_plan);
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
}

/// TPC-H Q1's filter → projection → partial aggregate runs as one device-resident stage:
/// the filter uploads the scanned columns, its output stays on the device for the
/// projection, whose output stays there for the aggregation; only the groups come down.
#[tokio::test]
async fn adjacent_gpu_operators_pass_device_batches() {
    let (gpu, cpu) = tpch_contexts("emulated:1", 1, None);
    let (got, plan) = tpch_run(&gpu, 1).await;
    let (_, want) = run(&cpu, crate::tpch::QUERIES[0]).await;
    assert_eq!(got, want);
    let mut seen = Vec::new();
    let _ = plan.apply(|node| {
        if let Some(m) = node.metrics() {
            let get = |name: &str| m.sum_by_name(name).map_or(0, |v| v.as_usize());
            seen.push((node.name().to_string(), get("h2d_bytes"), get("d2h_bytes")));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    let find = |name: &str| {
        seen.iter()
            .find(|(n, ..)| n == name)
            .unwrap_or_else(|| panic!("no {name} in {seen:?}"))
    };
    let (_, filter_up, filter_down) = find("GpuFilterExec");
    let (_, projection_up, projection_down) = find("GpuProjectionExec");
    let (_, aggregate_up, aggregate_down) = find("GpuAggregateExec");
    println!(
        "Q1 bytes (up, down): filter {filter_up}/{filter_down}, projection {projection_up}/{projection_down}, aggregate {aggregate_up}/{aggregate_down}"
    );
    assert!(*filter_up > 0, "{seen:?}");
    assert_eq!(
        (
            *filter_down,
            *projection_up,
            *projection_down,
            *aggregate_up
        ),
        (0, 0, 0, 0),
        "{seen:?}"
    );
    assert!(*aggregate_down > 0 && *aggregate_down < 2048, "{seen:?}");
}

/// A filter → hash join → partial aggregate chain moves only its inputs up and its groups
/// down: the filtered probe rows reach the join on the device, the join's output reaches
/// the aggregation on the device.
#[tokio::test]
async fn a_filter_join_aggregate_chain_stays_on_the_device() {
    let (gpu, cpu) = tpch_contexts("emulated:1", 1, None);
    let sql = "SELECT o_orderpriority, count(*) AS n, sum(l_quantity) AS q \
               FROM orders JOIN lineitem ON l_orderkey = o_orderkey \
               WHERE l_commitdate < l_receiptdate GROUP BY o_orderpriority ORDER BY 1";
    let frame = gpu.sql(sql).await.unwrap();
    let plan = frame.create_physical_plan().await.unwrap();
    let task = gpu.session_context().task_ctx();
    let batches = datafusion::physical_plan::collect(Arc::clone(&plan), task)
        .await
        .unwrap();
    let got = pretty_format_batches(&batches).unwrap().to_string();
    let (_, want) = run(&cpu, sql).await;
    assert_eq!(got, want);
    let mut seen = Vec::new();
    let _ = plan.apply(|node| {
        if let Some(m) = node.metrics() {
            let get = |name: &str| m.sum_by_name(name).map_or(0, |v| v.as_usize());
            seen.push((node.name().to_string(), get("h2d_bytes"), get("d2h_bytes")));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    println!("bytes (up, down) per node: {seen:?}");
    let find = |name: &str| {
        seen.iter()
            .find(|(n, ..)| n == name)
            .unwrap_or_else(|| panic!("no {name} in {seen:?}"))
    };
    let (_, filter_up, filter_down) = find("GpuFilterExec");
    let (_, join_up, join_down) = find("GpuHashJoinExec");
    let (_, aggregate_up, aggregate_down) = find("GpuAggregateExec");
    assert!(*filter_up > 0 && *join_up > 0, "{seen:?}");
    assert_eq!(
        (*filter_down, *join_down, *aggregate_up),
        (0, 0, 0),
        "{seen:?}"
    );
    assert!(*aggregate_down > 0 && *aggregate_down < 4096, "{seen:?}");
}

/// A GPU join fills the dynamic filter DataFusion's planner gave its probe side's scan
/// with the build side's key range (as DataFusion's HashJoinExec does), in CollectLeft and
/// in Partitioned mode, and the Parquet scan prunes row groups with it.
#[tokio::test]
async fn gpu_joins_fill_the_probe_sides_dynamic_filter() {
    use datafusion::arrow::array::{Int64Array, RecordBatch};
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::{ParquetReadOptions, SessionConfig};

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("probe.parquet");
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
    let mut writer = ArrowWriter::try_new(
        std::fs::File::create(&path).unwrap(),
        probe.schema(),
        Some(properties),
    )
    .unwrap();
    writer.write(&probe).unwrap();
    writer.close().unwrap();
    let dim = RecordBatch::try_from_iter(vec![(
        "d",
        Arc::new(Int64Array::from_iter_values(20_000..20_010)) as _,
    )])
    .unwrap();
    let sql = "SELECT count(*) AS n, sum(p.v) AS s FROM dim JOIN probe p ON p.k = dim.d";
    for partitions in [1, 3] {
        let contexts = [GpuMode::Force, GpuMode::Off].map(|gpu_mode| {
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
            FulmenContext::with_session_config(
                config,
                FulmenConfig {
                    devices: "emulated:1".parse().unwrap(),
                    gpu_mode,
                    ..FulmenConfig::default()
                },
            )
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
        let plan = gpu
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let batches =
            datafusion::physical_plan::collect(Arc::clone(&plan), gpu.session_context().task_ctx())
                .await
                .unwrap();
        assert_eq!(pretty_format_batches(&batches).unwrap().to_string(), want);
        let text = displayable(plan.as_ref()).indent(true).to_string();
        let mode = if partitions == 1 {
            "CollectLeft"
        } else {
            "Partitioned"
        };
        assert!(
            text.contains(&format!("GpuHashJoinExec: device=emulated:0, mode={mode}")),
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
        let batches = datafusion::physical_plan::collect(again, gpu.session_context().task_ctx())
            .await
            .unwrap();
        assert_eq!(pretty_format_batches(&batches).unwrap().to_string(), want);
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
            let (plan, got) = run(gpu, join).await;
            assert_eq!(got, want, "{join}\n{plan}");
            assert!(plan.contains("GpuHashJoinExec"), "{join}\n{plan}");
        }
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

    let fulmen = FulmenContext::with_session_config(
        SessionConfig::new().with_target_partitions(4),
        FulmenConfig {
            gpu_mode: GpuMode::Off,
            ..FulmenConfig::default()
        },
    );
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
        let fulmen_plan = fulmen
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let plain_plan = plain
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        assert_eq!(
            displayable(fulmen_plan.as_ref()).indent(true).to_string(),
            displayable(plain_plan.as_ref()).indent(true).to_string(),
            "Q{}",
            q + 1
        );
    }
}
