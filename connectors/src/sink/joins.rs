//! Joins in a sink's plans: the stream probes, the ordinary table builds, and rows are joined
//! before they are windowed.
//!
//! A sink joins its windowed stream with ordinary tables (the fraud pipeline's spend rule:
//! `HOP(transactions, …) JOIN profiles`). Two rewrites, run right after DataFusion's join
//! selection:
//!
//! 1. DataFusion builds a hash join's table on its left input unless statistics say the
//!    right one is smaller, and neither a window function's output nor a CSV file has row
//!    counts, so the windowed rows were hashed at every tick. A hash join whose left input
//!    reads the stream's window and whose right input does not swaps its inputs: the ordinary
//!    table (the same rows every tick) is hashed, the stream's rows probe it.
//! 2. A `HOP` window repeats each row `size / slide` times, and the join then probed each
//!    copy. An inner join (without a filter) of an ordinary table with a `TUMBLE` or `HOP`
//!    window's rows on columns of the stream moves below the window: the rows are joined
//!    once, then windowed. A row lies in the same windows whichever columns it carries, so
//!    the output is the same. Not below `SESSION`: a session depends on the other rows of its
//!    key, which the join may drop.

use std::sync::Arc;

use datafusion::common::JoinType;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::error::Result;
use datafusion::execution::SessionState;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use fulmen_engine::streaming::{fixed_window_columns, fixed_window_over};

use crate::incremental::is_window;

/// The rule (see the module notes).
#[derive(Debug)]
pub(crate) struct StreamProbes;

impl PhysicalOptimizerRule for StreamProbes {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let swapped = plan
            .transform_up(|node| {
                let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                    return Ok(Transformed::no(node));
                };
                if *join.join_type() == JoinType::Inner
                    && reads_window(join.left())
                    && !reads_window(join.right())
                {
                    return Ok(Transformed::yes(join.swap_inputs(*join.partition_mode())?));
                }
                Ok(Transformed::no(node))
            })
            .data()?;
        swapped
            .transform_up(|node| {
                let moved = node
                    .downcast_ref::<HashJoinExec>()
                    .map(window_above)
                    .transpose()?
                    .flatten();
                Ok(match moved {
                    Some(moved) => Transformed::yes(moved),
                    None => Transformed::no(node),
                })
            })
            .data()
    }

    fn name(&self) -> &str {
        "fulmen_stream_probes"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `join` (of an ordinary table, left, with a `TUMBLE` or `HOP` window's rows, right) as the
/// join of the table with the window's input, windowed, projected to `join`'s columns; `None`
/// when it is not such a join, or it joins on a window bound, has a filter or a row limit.
fn window_above(join: &HashJoinExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let window = join.right();
    if *join.join_type() != JoinType::Inner
        || join.filter().is_some()
        || join.fetch().is_some()
        || reads_window(join.left())
    {
        return Ok(None);
    }
    let Some(sources) = fixed_window_columns(window) else {
        return Ok(None);
    };
    let stream = Arc::clone(window.children()[0]);
    let streamed = stream.schema().fields().len();
    // The keys on the stream's side, as columns of the window's input.
    let mut on = Vec::with_capacity(join.on().len());
    for (left, right) in join.on() {
        let mut on_bound = false;
        let right = Arc::clone(right)
            .transform(|e| {
                let Some(column) = e.downcast_ref::<Column>() else {
                    return Ok(Transformed::no(e));
                };
                match sources
                    .get(column.index())
                    .copied()
                    .filter(|&i| i < streamed)
                {
                    Some(i) => Ok(Transformed::yes(
                        Arc::new(Column::new(column.name(), i)) as Arc<dyn PhysicalExpr>
                    )),
                    None => {
                        on_bound = true;
                        Ok(Transformed::no(e))
                    }
                }
            })
            .data()?;
        if on_bound {
            return Ok(None);
        }
        on.push((Arc::clone(left), right));
    }
    let tables = join.left().schema().fields().len();
    let joined = join
        .builder()
        .with_new_children(vec![Arc::clone(join.left()), stream])?
        .with_on(on)
        .with_projection(None)
        .build_exec()?;
    let windowed = fixed_window_over(window, joined, tables)?;
    // `join`'s columns in `windowed`: the table's, then the stream's and the window's bounds
    // in the order the window gives them.
    let columns: Vec<usize> = match &join.projection {
        Some(p) => p.to_vec(),
        None => (0..tables + sources.len()).collect(),
    };
    let mut exprs = Vec::with_capacity(columns.len());
    for (&c, field) in columns.iter().zip(join.schema().fields()) {
        let at = match c.checked_sub(tables) {
            None => c,
            Some(w) => tables + sources[w],
        };
        exprs.push(ProjectionExpr {
            expr: Arc::new(Column::new(field.name(), at)),
            alias: field.name().clone(),
        });
    }
    Ok(Some(Arc::new(ProjectionExec::try_new(exprs, windowed)?)))
}

fn reads_window(plan: &Arc<dyn ExecutionPlan>) -> bool {
    is_window(plan) || plan.children().into_iter().any(reads_window)
}

/// `state` with [`StreamProbes`] run right after DataFusion's join selection (before any
/// rule builds a join's dynamic filter, which a swap must precede).
pub(crate) fn with_stream_probes(state: SessionState) -> SessionState {
    let mut rules = state.physical_optimizers().to_vec();
    if rules.iter().any(|r| r.name() == StreamProbes.name()) {
        return state;
    }
    let at = rules
        .iter()
        .position(|r| r.name() == "join_selection")
        .map_or(0, |i| i + 1);
    rules.insert(at, Arc::new(StreamProbes));
    SessionStateBuilder::new_from_existing(state)
        .with_physical_optimizer_rules(rules)
        .build()
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::RecordBatch;
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::physical_plan::{collect, displayable};
    use fulmen_engine::FulmenContext;
    use fulmen_engine::streaming::StreamScope;

    use super::*;
    use crate::live::LiveScope;
    use crate::sink::incremental_session;

    /// `sql` planned in a sink's session (the rules on) and in a plain one: the sink's plan,
    /// and both answers, sorted.
    async fn both(sql: &str) -> (Arc<dyn ExecutionPlan>, String, String) {
        let ctx = FulmenContext::new().unwrap();
        for table in [
            "CREATE TABLE t AS SELECT 'c' || (v % 5) AS card, v * 1.5 AS amount, \
             to_timestamp(v * 7) AS ts FROM generate_series(0, 400) AS g(v)",
            // c4 owns nothing (its rows drop out); c0 twice (its rows count twice).
            "CREATE TABLE owners AS SELECT column1 AS card, column2 AS bonus FROM \
             (VALUES ('c0', 1), ('c0', 2), ('c1', 3), ('c2', 4), ('c3', 5))",
            "CREATE TABLE bounds AS SELECT DISTINCT date_bin(INTERVAL '2 minutes', ts) AS ws \
             FROM t",
        ] {
            ctx.sql(table).await.unwrap().collect().await.unwrap();
        }
        let sink = incremental_session(
            &ctx.session_context().state(),
            Arc::new(StreamScope::new(None, None)),
            Arc::new(LiveScope::default()),
        );
        let plan = sink
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let answer = |batches: Vec<RecordBatch>| {
            let mut lines: Vec<String> = pretty_format_batches(&batches)
                .unwrap()
                .to_string()
                .lines()
                .map(str::to_owned)
                .collect();
            lines.sort();
            lines.join("\n")
        };
        let got = answer(collect(Arc::clone(&plan), sink.task_ctx()).await.unwrap());
        let plain = ctx.session_context().sql(sql).await.unwrap();
        let expected = answer(plain.collect().await.unwrap());
        (plan, got, expected)
    }

    /// The plan's hash join, and whether a window lies above it.
    fn join_of(plan: &Arc<dyn ExecutionPlan>, windowed: bool) -> Option<(&HashJoinExec, bool)> {
        if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
            return Some((join, windowed));
        }
        let windowed = windowed || is_window(plan);
        plan.children()
            .into_iter()
            .find_map(|c| join_of(c, windowed))
    }

    #[tokio::test]
    async fn a_hop_joins_its_rows_once_then_windows_them_with_the_same_answer() {
        let sql = "SELECT w.card, window_start, window_end, count(*) AS n, \
                   sum(w.amount + o.bonus) AS total \
                   FROM HOP(t, ts, INTERVAL '1 minute', INTERVAL '5 minutes') w \
                   JOIN owners o ON w.card = o.card \
                   GROUP BY w.card, window_start, window_end";
        let (plan, got, expected) = both(sql).await;
        assert_eq!(got, expected);
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        let (join, windowed) = join_of(&plan, false).expect("a hash join");
        assert!(windowed, "the window stayed below the join:\n{shown}");
        // The ordinary table builds (the join's first input), the stream probes.
        assert!(
            join.left().schema().column_with_name("bonus").is_some(),
            "{shown}"
        );
        assert!(
            join.right().schema().column_with_name("ts").is_some(),
            "{shown}"
        );
    }

    #[tokio::test]
    async fn joins_on_a_window_bound_and_sessions_keep_the_window_below() {
        for sql in [
            "SELECT w.card, window_start, window_end, count(*) AS n \
             FROM TUMBLE(t, ts, INTERVAL '1 minute') w \
             JOIN bounds b ON w.window_start = b.ws GROUP BY w.card, window_start, window_end",
            "SELECT w.card, window_start, window_end, count(*) AS n \
             FROM SESSION(t, ts, INTERVAL '10 seconds', card) w \
             JOIN owners o ON w.card = o.card GROUP BY w.card, window_start, window_end",
        ] {
            let (plan, got, expected) = both(sql).await;
            assert_eq!(got, expected, "{sql}");
            let shown = displayable(plan.as_ref()).indent(true).to_string();
            let (join, windowed) = join_of(&plan, false).expect("a hash join");
            assert!(!windowed, "{shown}");
            // Still the ordinary table builds.
            assert!(
                reads_window(join.right()) && !reads_window(join.left()),
                "{shown}"
            );
        }
    }
}
