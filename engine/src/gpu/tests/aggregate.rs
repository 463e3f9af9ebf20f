//! Aggregations: random GROUP BY queries over random data with NULLs and skew (a hot key,
//! all keys distinct, no rows), in one partition (Single mode) and in three (one stage over
//! all three, or Partial then FinalPartitioned or Final), with and without count(DISTINCT
//! …): the GPU's answer equals
//! DataFusion's and the device did the batches; every device fault in turn; memory
//! pressure.

use std::sync::Arc;

use datafusion::arrow::array::{
    Date32Array, Decimal128Array, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::{answer, cpu_config, devices_of, gpu_config, session};
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

/// DataFusion's side of a comparison.
fn cpu_context(partitions: usize) -> FulmenContext {
    session(cpu_config(), partitions)
}

/// The partitions of a check's input, and whether the device takes them in one stage
/// (`gpu::one_stage`) or in DataFusion's two (a partial stage, then a final one).
type Shape = (usize, bool);

/// One partition (one stage anyway), three in one stage, three in two.
fn shapes() -> impl Strategy<Value = Shape> {
    prop_oneof![Just((1usize, true)), Just((3, true)), Just((3, false))]
}

fn check(rows: &[Row], sql: &str, (partitions, one_stage): Shape) -> Result<(), TestCaseError> {
    super::block_on(async {
        let gpu = session(
            FulmenConfig {
                gpu_single_stage_aggregation: one_stage,
                ..gpu_config("emulated:1/aggregates")
            },
            partitions,
        );
        let cpu = cpu_context(partitions);
        for ctx in [&gpu, &cpu] {
            register(ctx, rows, partitions);
        }
        let (gpu_rows, gpu_plan, work) = answer(&gpu, sql).await;
        let (cpu_rows, _, _) = answer(&cpu, sql).await;
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
        prop_assert!(work.nothing_fell_back(), "{}: {:?}", sql, work);
        if !rows.is_empty() {
            prop_assert!(
                work.gpu_batches > 0,
                "no batch on the device for {}: {:?}",
                sql,
                work
            );
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
        shape in shapes(),
    ) {
        // Sums of v wrap on overflow in both engines (i64::MAX and MIN are in the data).
        check(&rows, &grouped(keys, AGGREGATES), shape)?;
    }

    /// count(DISTINCT …) accumulators (two distinct arguments and a count keep
    /// DataFusion from rewriting them into GROUP BYs) on the device.
    #[test]
    fn gpu_distinct_counts_equal_datafusion(
        rows in rows(),
        keys in keys(),
        shape in shapes(),
    ) {
        check(&rows, &grouped(keys, DISTINCT), shape)?;
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
    if super::needs_emulator("distinct_counts_survive_every_device_fault") {
        return;
    }
    let rows = &fixed_rows()[..200];
    // A device of its own, so that other tests do not move its counters and both
    // partitions meet the faults.
    let selection = "emulated:1/distinct-faults";
    let device = devices_of(selection)[0].clone();
    let partitions = 2;
    let gpu = session(
        FulmenConfig {
            gpu_single_stage_aggregation: false,
            ..gpu_config(selection)
        },
        partitions,
    );
    let cpu = cpu_context(partitions);
    register(&gpu, rows, partitions);
    register(&cpu, rows, partitions);
    let (want, _, _) = answer(&cpu, DISTINCT_QUERY).await;
    let (allocations, launches) = device.counters();
    let (clean, plan, work) = answer(&gpu, DISTINCT_QUERY).await;
    assert_eq!(clean, want);
    assert!(work.gpu_batches > 0 && work.nothing_fell_back(), "{work:?}");
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
    let gpu = session(
        FulmenConfig {
            gpu_memory_limit: Some(160 << 10),
            ..gpu_config("emulated:1/distinct-memory")
        },
        1,
    );
    let cpu = cpu_context(1);
    register(&gpu, &rows, 1);
    register(&cpu, &rows, 1);
    let (want, _, _) = answer(&cpu, DISTINCT_QUERY).await;
    let (got, _, work) = answer(&gpu, DISTINCT_QUERY).await;
    assert_eq!(got, want);
    assert!(
        work.split_batches + work.cpu_fallback > 0,
        "neither split nor finished on the CPU: {work:?}"
    );
}
