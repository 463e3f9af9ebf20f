//! Placement and results of GPU filters and projections on the emulated device.

use datafusion::arrow::util::pretty::pretty_format_batches;
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
