//! Filters and projections: random expressions over random typed columns with NULLs (the
//! GPU program's answer, or error, equals DataFusion's and the device did the batches),
//! every device fault of a filter + projection query in turn, and partitions spread over
//! four devices.

use std::sync::Arc;

use datafusion::arrow::array::{
    BooleanArray, Date32Array, Decimal128Array, Float64Array, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMicrosecondArray,
};
use fulmen_kernels::FaultPlan;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::{
    answer, cpu_config, described, devices_of, gpu_config, needs_emulator, run, session, setup,
};
use crate::FulmenContext;

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
        (float_expr(), cmp.clone(), float_expr()).prop_map(|(l, op, r)| format!("({l} {op} {r})")),
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
        (int_expr(), -3i64..0, 0i64..3).prop_map(|(x, l, h)| format!("({x} BETWEEN {l} AND {h})")),
        Just("(t < DATE '1990-01-01')".to_string()),
        Just("(date_trunc('month', ts) = date_trunc('month', CAST(t AS TIMESTAMP)))".to_string()),
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
        gpu_config("emulated:1/expressions")
    } else {
        cpu_config()
    };
    session(config, 1)
}

fn check(rows: &[Row], sql: &str, operator: &str) -> Result<(), TestCaseError> {
    super::block_on(async {
        let data = batch(rows);
        let (gpu, cpu) = (context(true), context(false));
        for ctx in [&gpu, &cpu] {
            ctx.session_context()
                .register_batch("r", data.clone())
                .unwrap();
        }
        let (gpu_rows, gpu_plan, work) = answer(&gpu, sql).await;
        let (cpu_rows, _, _) = answer(&cpu, sql).await;
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
        prop_assert!(
            work.nothing_fell_back(),
            "{}: {:?}\n{}",
            sql,
            work,
            gpu_plan
        );
        // A query that fails (a cast overflowing, in both engines) may fail before a
        // batch is done: the device leaves rows it cannot compute to DataFusion, which
        // raises. Otherwise the device did the batch, or handed it to the CPU by rule.
        if !rows.is_empty() && gpu_plan.contains(operator) && gpu_rows.is_ok() {
            prop_assert!(
                work.gpu_batches + work.cpu_rule_batches > 0,
                "no batch on the device for {}: {:?}",
                sql,
                work
            );
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
    if needs_emulator("device_faults_fall_back_to_the_cpu") {
        return;
    }
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
    let selection = "emulated:3/expression-faults";
    let gpu = session(gpu_config(selection), 1);
    let cpu = context(false);
    for ctx in [&gpu, &cpu] {
        ctx.session_context()
            .register_batch("r", batch(&rows))
            .unwrap();
    }
    let sql = "SELECT a * 2 + b AS x, substr(s, 2) = 'b' AS y, d * d AS z FROM r \
               WHERE s LIKE '%b%' AND a > -5";
    let (expected, _, _) = answer(&cpu, sql).await;
    let device = devices_of(selection)[0].clone();
    let (allocations, launches) = device.counters();
    let (clean, plan, work) = answer(&gpu, sql).await;
    assert!(
        plan.contains("GpuFilterExec") && plan.contains("GpuProjectionExec"),
        "{plan}"
    );
    assert_eq!(clean, expected);
    assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
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

#[tokio::test]
async fn filters_and_projections_run_on_the_emulated_gpu() {
    let selection = "emulated:1/first-steps";
    let gpu = session(gpu_config(selection), 1);
    let cpu = session(cpu_config(), 1);
    setup(&gpu).await;
    setup(&cpu).await;
    let sql = "SELECT column1 + 1 AS a, column2 * 2 AS b, date_part('year', column4) AS y \
               FROM t WHERE column3 LIKE '%an%' OR column1 IS NULL OR column1 = 1 ORDER BY a";
    let (gpu_rows, plan, work) = answer(&gpu, sql).await;
    let device = described(selection);
    assert!(
        plan.contains(&format!("GpuFilterExec: device={device}")),
        "{plan}"
    );
    assert!(
        plan.contains(&format!("GpuProjectionExec: device={device}")),
        "{plan}"
    );
    // One batch for the filter, one for the projection above it.
    assert!(
        work.gpu_batches >= 2 && work.nothing_fell_back(),
        "{work:?}"
    );
    let (cpu_plan, cpu_rows) = run(&cpu, sql).await;
    assert!(!cpu_plan.contains("Gpu"), "{cpu_plan}");
    assert_eq!(gpu_rows, Ok(cpu_rows));
}

/// With four devices, a plan's partitions are spread over all of them.
#[tokio::test]
async fn partitions_are_spread_over_the_devices() {
    let selection = "emulated:4/spread";
    let ctx = session(gpu_config(selection), 4);
    let devices = devices_of(selection);
    let before: Vec<u64> = devices.iter().map(|d| d.counters().1).collect();
    let (rows, plan, work) = answer(
        &ctx,
        "SELECT count(*) AS n FROM (SELECT v * 2 AS w FROM generate_series(1, 100000) AS t(v) \
         WHERE v % 3 = 0) WHERE w > 10",
    )
    .await;
    let rows = rows.unwrap();
    assert!(
        work.gpu_batches >= 4 && work.nothing_fell_back(),
        "{work:?}"
    );
    assert!(
        plan.contains(&format!("Exec: device={}", described(selection))),
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

/// A filter whose device batch does not fit in device memory splits it in halves, each
/// a device batch of its own (down to 4096 rows), as an aggregation does, rather than
/// redoing all of it on the CPU; the answer is DataFusion's. (Its output goes to the host,
/// so only the predicate's inputs go up: the predicate reads the comments.)
#[tokio::test]
async fn a_filter_splits_a_batch_the_device_has_no_memory_for() {
    let sql = "SELECT l_orderkey, l_linenumber, l_comment FROM lineitem \
               WHERE l_quantity > 10 AND l_comment <> 'none' ORDER BY l_orderkey, l_linenumber";
    let (gpu, cpu) = super::tpch_contexts("emulated:1/filter-split", 1, Some(1 << 20));
    let want = super::rows_of(&cpu, &super::plan_of(&cpu, sql).await).await;
    let plan = super::plan_of(&gpu, sql).await;
    assert!(super::plan_has(&plan, "GpuFilterExec"));
    let got = super::rows_of(&gpu, &plan).await;
    assert_eq!(got, want);
    let work = super::Work::of(&plan);
    assert!(
        work.split_batches > 0 && work.gpu_batches > work.split_batches,
        "{work:?}"
    );
}

/// A filter whose output has columns the device cannot hold (a list, a struct) still runs
/// its predicate on the device and takes its rows on the host: under a CPU parent, and
/// under a GPU join whose probe child it is, which reads its output from the host (the
/// filter is not fused into it, as a fused stage's output would have to be on the device;
/// with the filter's output left on the device, the join's batches fall back). Both equal
/// DataFusion's, and the device did the batches.
#[tokio::test]
async fn a_filter_whose_output_the_device_cannot_hold_takes_its_rows_on_the_host() {
    let selection = "emulated:1/filter-host-only";
    let gpu = session(gpu_config(selection), 2);
    let cpu = session(cpu_config(), 2);
    for ctx in [&gpu, &cpu] {
        for sql in [
            "CREATE TABLE nested AS SELECT value AS a, make_array(value, value * 2) AS l, \
             named_struct('x', value % 5, 'y', CAST(value AS VARCHAR)) AS st \
             FROM range(30000)",
            "CREATE TABLE other AS SELECT value * 7 AS a, value AS b FROM range(5000)",
            // The join's probe child is then the filter itself.
            "SET datafusion.optimizer.enable_join_dynamic_filter_pushdown = false",
        ] {
            ctx.sql(sql).await.unwrap().collect().await.unwrap();
        }
    }
    let device = described(selection);
    for (sql, join) in [
        (
            "SELECT a, l, st FROM nested WHERE a % 7 = 3 OR a > 29990 ORDER BY a",
            false,
        ),
        (
            "SELECT count(*), sum(o.b), sum(array_length(n.l)), max(n.st['y']) \
             FROM nested n JOIN other o ON n.a = o.a WHERE n.a % 3 = 1",
            true,
        ),
    ] {
        let (gpu_rows, plan, work) = answer(&gpu, sql).await;
        assert!(
            plan.contains(&format!("GpuFilterExec: device={device}")),
            "{sql}\n{plan}"
        );
        if join {
            assert!(plan.contains("GpuHashJoinExec"), "{sql}\n{plan}");
            assert!(!plan.contains("fused_filter"), "{sql}\n{plan}");
        }
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back(),
            "{sql}: {work:?}\n{plan}"
        );
        let (_, cpu_rows) = run(&cpu, sql).await;
        assert_eq!(gpu_rows, Ok(cpu_rows), "{sql}\n{plan}");
    }
}
