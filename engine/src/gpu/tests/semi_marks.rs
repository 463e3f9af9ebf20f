//! Left semi and anti joins without a residual filter (`gpu_hash_join/marks.rs`), over build
//! rows on the device (`semi.rs`) and over a build side from the host (`Probing`): each
//! probe batch marks the build rows it matches in a bitmap on the device, with no host
//! wait; the host reads the marks once per partition (or once its kept probe rows reach
//! four device batches' bytes), and matches a round's batches again on the host when a
//! fused program left a row to the CPU or the device was lost.

use super::build_sides::metric;
use super::fused::{fused_session, work_per_batch_of};
use super::{Work, plan_of, rows_of, run};
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;

/// Left semi and anti joins of parts probed by lineitem, plain and under a fused filter:
/// over a build side from a GPU filter (its rows stay on the device, `semi.rs`) and over
/// one from the host (`Probing`). Each: the join type, whether its build rows are on the
/// device, the query.
fn queries() -> Vec<(&'static str, bool, String)> {
    let mut all = Vec::new();
    for (on_device, parts) in [(true, " WHERE p_size < 30 AND"), (false, " WHERE")] {
        for filter in ["", " AND l_quantity < 10"] {
            for (join_type, not) in [("LeftSemi", ""), ("LeftAnti", "NOT ")] {
                all.push((
                    join_type,
                    on_device,
                    format!(
                        "SELECT count(*), sum(p_retailprice), max(p_size) FROM part{parts} \
                         {not}EXISTS (SELECT 1 FROM lineitem WHERE l_partkey = p_partkey{filter})"
                    ),
                ));
            }
        }
    }
    all
}

/// The one GPU join of `join_type` in `plan`, which must be there.
fn the_join(plan: &Arc<dyn ExecutionPlan>, join_type: &str) -> Arc<dyn ExecutionPlan> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut found = Vec::new();
    let _ = plan.apply(|node| {
        let line = datafusion::physical_plan::displayable(node.as_ref())
            .one_line()
            .to_string();
        if node.name() == "GpuHashJoinExec" && line.contains(&format!("join_type={join_type},")) {
            found.push(Arc::clone(node));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    assert_eq!(found.len(), 1, "{join_type}");
    found.remove(0)
}

/// Each probe batch costs no host wait: at most 1 launch (the mark) and, under a fused
/// filter, 2 (its program, then the mark), over build rows on the device and from the
/// host alike; they waited twice a batch before (the probe's total, then its matched build
/// rows). The answers are DataFusion's.
#[tokio::test]
async fn a_semi_join_over_device_build_rows_marks_each_batch_without_a_wait() {
    for (k, (join_type, on_device, sql)) in queries().into_iter().enumerate() {
        let fused = sql.contains("l_quantity");
        let sets = [
            format!("emulated:1/semi-marks-cpu-{k}"),
            format!("emulated:1/semi-marks-a-{k}"),
            format!("emulated:1/semi-marks-b-{k}"),
        ];
        let (launches, syncs) = work_per_batch_of(
            join_type,
            &sql,
            [&sets[0], &sets[1], &sets[2]],
            |text, plan| {
                let join = the_join(plan, join_type);
                assert_eq!(metric(&join, "device_builds") > 0, on_device, "{text}");
                assert_eq!(text.contains("fused_filter="), fused, "{text}");
            },
        )
        .await;
        let most = if fused { 2.0 } else { 1.0 };
        assert!(
            launches <= most && syncs == 0.0,
            "{join_type}, fused {fused}: {launches} launches, {syncs} syncs a batch"
        );
    }
}

/// A partition reads its marks once; with device batches of 16 KiB the kept probe rows
/// pass four batches' bytes, and it reads them more often, yet (without a fused filter,
/// whose kept rows are wider) less than once a batch. The answers stay DataFusion's.
#[tokio::test]
async fn a_semi_join_reads_its_marks_once_its_kept_probe_rows_grow() {
    let gpu = fused_session("emulated:1/semi-marks-reads", 1 << 20);
    let (_, cpu) = super::tpch_contexts("emulated:1/semi-marks-reads-cpu", 1, None);
    for (join_type, _, sql) in queries() {
        let want = run(&cpu, &sql).await.1;
        let mut seen = Vec::new();
        for bytes in ["64MiB", "16KiB"] {
            super::cache::text(&gpu, &format!("SET fulmen.gpu.batch_bytes = '{bytes}'")).await;
            let plan = plan_of(&gpu, &sql).await;
            assert_eq!(rows_of(&gpu, &plan).await, want, "{sql}");
            let work = Work::of(&plan);
            assert!(
                work.gpu_batches > 0 && work.nothing_fell_back() && work.cpu_rule_batches == 0,
                "{sql}: {work:?}"
            );
            let join = the_join(&plan, join_type);
            seen.push((metric(&join, "gpu_batches"), metric(&join, "mark_reads")));
        }
        let [(_, once), (batches, reads)] = seen[..] else {
            unreachable!()
        };
        assert!(once == 1 && reads > 1, "{sql}: (batches, reads) {seen:?}");
        if !sql.contains("l_quantity") {
            assert!(reads < batches, "{sql}: (batches, reads) {seen:?}");
        }
    }
}

/// The device lost at each launch of a semi or anti join's query in turn (marks queued
/// and not read among them; over build rows on the device and from the host): the chunks
/// whose marks were lost are matched again on the host, and the rows are DataFusion's.
#[tokio::test]
async fn a_device_lost_with_marks_unread_leaves_the_answer_right() {
    use fulmen_kernels::FaultPlan;
    if super::needs_emulator("a_device_lost_with_marks_unread_leaves_the_answer_right") {
        return;
    }
    let (_, cpu) = super::tpch_contexts("emulated:1/semi-marks-lost-cpu", 1, None);
    let lossy = |set: &str| {
        let ctx = super::session(
            crate::FulmenConfig {
                gpu_on_error: crate::config::OnError::Fallback,
                gpu_batch_rows: 4096,
                ..super::gpu_config(set)
            },
            1,
        );
        ctx.register_tpch(0.01).unwrap();
        ctx
    };
    for (k, (join_type, _, sql)) in queries().into_iter().enumerate() {
        if sql.contains("l_quantity") {
            continue;
        }
        // Rows, not an aggregate: a GPU aggregation over a join whose device is lost with
        // its groups cannot read its input again (it fails the query, saying so).
        let sql = sql.replace(
            "SELECT count(*), sum(p_retailprice), max(p_size)",
            "SELECT p_partkey, p_size",
        ) + " ORDER BY p_partkey";
        let want = run(&cpu, &sql).await.1;
        let clean = format!("emulated:1/semi-marks-lost-{k}");
        let device = super::devices_of(&clean)[0].clone();
        let before = device.counters().1;
        let ctx = lossy(&clean);
        let plan = plan_of(&ctx, &sql).await;
        assert_eq!(rows_of(&ctx, &plan).await, want, "{sql}");
        let marked = metric(&the_join(&plan, join_type), "gpu_batches");
        let launches = device.counters().1 - before;
        assert!(
            marked > 1 && launches > marked as u64,
            "{sql}: {launches} launches"
        );
        for at in 1..=launches {
            let set = format!("emulated:1/semi-marks-lost-{k}-at-{at}");
            let device = super::devices_of(&set)[0].clone();
            let ctx = lossy(&set);
            device
                .inject_faults(FaultPlan {
                    lose_device_at_launch: Some(at),
                    ..FaultPlan::default()
                })
                .unwrap();
            assert_eq!(run(&ctx, &sql).await.1, want, "{sql}: lost at launch {at}");
            assert!(device.quarantined().is_some(), "{sql}: lost at launch {at}");
        }
    }
}

/// A fused program that leaves a row to the CPU (a division by zero in a CASE branch the
/// row does not take, which DataFusion never evaluates) voids the marks of its round, over
/// build rows on the device and from the host: the round's batches are filtered and
/// matched again on the host, by rule, and the answers are DataFusion's.
#[tokio::test]
async fn a_fused_program_left_to_the_cpu_voids_its_rounds_marks() {
    let gpu = fused_session("emulated:1/semi-marks-rule", 4096);
    let (_, cpu) = super::tpch_contexts("emulated:1/semi-marks-rule-cpu", 1, None);
    let guarded = "CASE WHEN l_linenumber = 1 THEN 0 ELSE 100 / (l_linenumber - 1) END > 30";
    let cases = [("LeftSemi", ""), ("LeftAnti", "NOT")]
        .into_iter()
        .flat_map(|(join_type, not)| {
            [" WHERE p_size < 30 AND", " WHERE"].map(|parts| (join_type, not, parts))
        });
    for (join_type, not, parts) in cases {
        let sql = format!(
            "SELECT count(*), sum(p_retailprice), max(p_size) FROM part{parts} \
             {not} EXISTS (SELECT 1 FROM lineitem WHERE l_partkey = p_partkey AND {guarded})"
        );
        let plan = plan_of(&gpu, &sql).await;
        assert_eq!(rows_of(&gpu, &plan).await, run(&cpu, &sql).await.1, "{sql}");
        let join = the_join(&plan, join_type);
        let text = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        assert!(text.contains("fused_filter="), "{text}");
        let work = Work::of(&plan);
        assert!(
            work.gpu_batches > 0 && work.nothing_fell_back(),
            "{sql}: {work:?}"
        );
        assert!(metric(&join, "cpu_rule_batches") > 0, "{sql}: {work:?}");
    }
}
