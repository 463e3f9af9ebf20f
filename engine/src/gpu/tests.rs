//! Placement and results of GPU filters and projections on the emulated device.

use std::sync::Arc;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::displayable;

use crate::config::GpuMode;
use crate::{VolleyConfig, VolleyContext};

fn gpu_context(devices: &str) -> VolleyContext {
    VolleyContext::with_config(VolleyConfig {
        devices: devices.parse().unwrap(),
        gpu_mode: GpuMode::Force,
        ..VolleyConfig::default()
    })
}

async fn setup(ctx: &VolleyContext) {
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

async fn run(ctx: &VolleyContext, sql: &str) -> (String, String) {
    let frame = ctx.sql(sql).await.unwrap();
    let plan = frame.clone().create_physical_plan().await.unwrap();
    let plan_text = displayable(plan.as_ref()).indent(true).to_string();
    let batches = frame.collect().await.unwrap();
    (
        plan_text,
        pretty_format_batches(&batches).unwrap().to_string(),
    )
}

#[tokio::test]
async fn filters_and_projections_run_on_the_emulated_gpu() {
    let gpu = gpu_context("emulated:1");
    let cpu = VolleyContext::with_config(VolleyConfig {
        gpu_mode: GpuMode::Off,
        ..VolleyConfig::default()
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
    use datafusion::arrow::util::pretty::pretty_format_batches_with_schema;
    use datafusion::prelude::SessionConfig;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;
    use volley_kernels::FaultPlan;

    use crate::config::GpuMode;
    use crate::gpu::devices::devices;
    use crate::{VolleyConfig, VolleyContext};

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

    fn context(gpu: bool) -> VolleyContext {
        let config = if gpu {
            VolleyConfig {
                devices: "emulated:1".parse().unwrap(),
                gpu_mode: GpuMode::Force,
                ..VolleyConfig::default()
            }
        } else {
            VolleyConfig {
                gpu_mode: GpuMode::Off,
                ..VolleyConfig::default()
            }
        };
        VolleyContext::with_session_config(SessionConfig::new().with_target_partitions(1), config)
    }

    async fn answer(ctx: &VolleyContext, sql: &str) -> (Result<String, String>, String) {
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
            if !rows.is_empty() && gpu_plan.contains(operator) {
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
        let config = VolleyConfig {
            devices: "emulated:3".parse().unwrap(),
            gpu_mode: GpuMode::Force,
            ..VolleyConfig::default()
        };
        let gpu = VolleyContext::with_session_config(
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
        for k in 1..=allocations {
            device
                .inject_faults(FaultPlan {
                    fail_allocation: Some(k),
                    fail_launch: None,
                })
                .unwrap();
            assert_eq!(
                answer(&gpu, sql).await.0,
                expected,
                "allocation {k} failing"
            );
        }
        for k in 1..=launches {
            device
                .inject_faults(FaultPlan {
                    fail_allocation: None,
                    fail_launch: Some(k),
                })
                .unwrap();
            assert_eq!(answer(&gpu, sql).await.0, expected, "launch {k} failing");
        }
        device.inject_faults(FaultPlan::default()).unwrap();
    }
}

/// With four devices, a plan's partitions are spread over all of them.
#[tokio::test]
async fn partitions_are_spread_over_the_devices() {
    use datafusion::prelude::SessionConfig;

    let selection = "emulated:4".parse().unwrap();
    let ctx = VolleyContext::with_session_config(
        SessionConfig::new().with_target_partitions(4),
        VolleyConfig {
            devices: "emulated:4".parse().unwrap(),
            gpu_mode: GpuMode::Force,
            ..VolleyConfig::default()
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

/// The 22 TPC-H queries (SF 0.01) answer as DataFusion does with the GPU forced, and every
/// filter and projection the plans have either runs on the device or says why not.
#[tokio::test]
async fn tpch_answers_are_unchanged_with_filters_and_projections_on_the_gpu() {
    use datafusion::prelude::SessionConfig;

    let gpu = VolleyContext::with_session_config(
        SessionConfig::new().with_target_partitions(2),
        VolleyConfig {
            devices: "emulated:1".parse().unwrap(),
            gpu_mode: GpuMode::Force,
            ..VolleyConfig::default()
        },
    );
    let cpu = VolleyContext::with_session_config(
        SessionConfig::new().with_target_partitions(2),
        VolleyConfig {
            gpu_mode: GpuMode::Off,
            ..VolleyConfig::default()
        },
    );
    gpu.register_tpch(0.01).unwrap();
    cpu.register_tpch(0.01).unwrap();
    let options = gpu.session_context().state().config().options().clone();
    let (mut on_gpu, mut reasons) = (0, Vec::new());
    for (i, sql) in crate::tpch::QUERIES.iter().enumerate() {
        let frame = gpu.sql(sql).await.unwrap();
        let plan = frame.clone().create_physical_plan().await.unwrap();
        for line in crate::gpu::placement_report(&plan, &options) {
            if line.contains(" runs on ") {
                on_gpu += 1;
            } else {
                reasons.push(format!("Q{}: {line}", i + 1));
            }
        }
        let task = gpu.session_context().task_ctx();
        let batches = datafusion::physical_plan::collect(Arc::clone(&plan), task)
            .await
            .unwrap();
        let got = pretty_format_batches(&batches).unwrap().to_string();
        // No batch of any GPU operator fell back to the CPU.
        let mut fallbacks = 0;
        let _ = plan.apply(|node| {
            if let Some(m) = node.metrics() {
                fallbacks += m.sum_by_name("cpu_batches").map_or(0, |v| v.as_usize());
            }
            Ok(TreeNodeRecursion::Continue)
        });
        assert_eq!(fallbacks, 0, "Q{} redid batches on the CPU", i + 1);
        let (_, want) = run(&cpu, sql).await;
        assert_eq!(got, want, "Q{}", i + 1);
    }
    println!(
        "{on_gpu} TPC-H filters and projections on the GPU; on the CPU:\n{}",
        reasons.join("\n")
    );
    assert!(
        on_gpu >= 40,
        "only {on_gpu} filters and projections ran on the GPU:\n{}",
        reasons.join("\n")
    );
}
