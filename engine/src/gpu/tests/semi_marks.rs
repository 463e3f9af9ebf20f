//! Left semi and anti joins over build rows on the device (`gpu_hash_join/semi.rs`): each
//! probe batch marks the build rows it matches in a bitmap on the device, with no host
//! wait; the host reads the marks once per partition (or once its kept probe rows reach
//! four device batches' bytes), and matches a round's batches again on the host when a
//! fused program left a row to the CPU.

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

/// With device batches of 16 KiB the kept probe rows pass four batches' bytes: the join
/// reads its marks more than once a partition (more waits than with the default 64 MiB,
/// where each partition reads once), and the answers stay DataFusion's.
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
            seen.push((metric(&join, "gpu_batches"), metric(&join, "syncs")));
        }
        let [(b1, s1), (b2, s2)] = seen[..] else {
            unreachable!()
        };
        assert!(
            b2 > b1 && s2 > s1 && s2 < s1 + b2,
            "{sql}: (batches, syncs) {seen:?}"
        );
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
