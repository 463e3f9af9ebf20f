//! Incremental windows against the batch SQL over the same rows.

use datafusion::arrow::array::{StringArray, TimestampNanosecondArray};
use datafusion::arrow::datatypes::{Field, Schema};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use fulmen_engine::FulmenContext;

use super::*;
use crate::live::LiveScope;
use crate::sink::incremental_session;

const SECOND: i64 = 1_000_000_000;

/// `sql`'s plan in an incremental tick's session, over a table `t` of `rows` (card,
/// seconds).
async fn plan(
    sql: &str,
    kind: WindowKind,
    rows: &[(&str, i64)],
    emitted: Option<i64>,
) -> (Arc<dyn ExecutionPlan>, Arc<TaskContext>) {
    let ctx = FulmenContext::new().unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("card", DataType::Utf8, false),
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), false),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(TimestampNanosecondArray::from_iter_values(
                rows.iter().map(|r| r.1 * SECOND),
            )),
        ],
    )
    .unwrap();
    let table = MemTable::try_new(schema, vec![vec![batch]]).unwrap();
    ctx.session_context()
        .register_table("t", Arc::new(table))
        .unwrap();
    let session = incremental_session(
        &ctx.session_context().state(),
        Arc::new(tick_scope(kind, emitted)),
        Arc::new(LiveScope::default()),
    );
    session
        .sql("CREATE VIEW distinct_t AS SELECT DISTINCT card, ts FROM t")
        .await
        .unwrap();
    let frame = session.sql(sql).await.unwrap();
    (
        frame.create_physical_plan().await.unwrap(),
        session.task_ctx(),
    )
}

/// One tick of an incremental session sink over `rows`, as `Runner::incremental` runs
/// it: planned in the tick's scope, the lower plan's states added and merged.
async fn tick(states: &mut WindowStates, rows: &[(&str, i64)], emitted: Option<i64>) -> Split {
    let kind = WindowKind::Session { gap: 10 * SECOND };
    let sql = "SELECT card, window_start, window_end, count(*) AS n \
               FROM SESSION(t, ts, INTERVAL '10 seconds', card) \
               GROUP BY card, window_start, window_end";
    let (plan, task) = plan(sql, kind, rows, emitted).await;
    let split = split(plan, kind).unwrap_or_else(|why| panic!("not split: {why}"));
    split.check().unwrap();
    let new = collect(Arc::clone(&split.lower), Arc::clone(&task))
        .await
        .unwrap();
    states.add(new);
    states.merge_if_due(&split, task).await.unwrap();
    split
}

/// `sql` run incrementally as `Runner::incremental` runs it, over `ticks` (each: its new
/// rows, then the watermark it closes windows up to), after windows up to `emitted` were
/// emitted; against the same SQL over all the rows at once, for the windows ending in
/// `(emitted, last watermark]`. The pane length used, and the state rows held after the
/// first tick's rows came in.
async fn incremental_equals_batch(
    sql: &str,
    kind: WindowKind,
    ticks: &[(Vec<(String, i64)>, i64)],
    mut emitted: Option<i64>,
) -> (Option<i64>, usize) {
    let first_emitted = emitted;
    let mut states = WindowStates::default();
    let mut out = Vec::new();
    let mut pane = None;
    let mut first_tick_rows = None;
    for (rows, watermark) in ticks {
        let rows: Vec<(&str, i64)> = rows.iter().map(|(c, t)| (c.as_str(), *t)).collect();
        let (physical, task) = plan(sql, kind, &rows, emitted).await;
        let split = split(physical, kind).unwrap_or_else(|why| panic!("not split: {why}"));
        split.check().unwrap();
        pane = split.pane();
        let new = collect(Arc::clone(&split.lower), Arc::clone(&task))
            .await
            .unwrap();
        states.add(new);
        first_tick_rows.get_or_insert(states.rows());
        let (closing, mut left) = states.closing(&split, emitted, *watermark).unwrap();
        left.merge_if_due(&split, Arc::clone(&task)).await.unwrap();
        out.extend(
            collect(split.finished(closing).unwrap(), task)
                .await
                .unwrap(),
        );
        states = left;
        emitted = Some(*watermark);
    }
    let ctx = FulmenContext::new().unwrap();
    let got_schema = out[0].schema();
    let got = MemTable::try_new(got_schema, vec![out]).unwrap();
    ctx.session_context()
        .register_table("got", Arc::new(got))
        .unwrap();
    let all: Vec<(&str, i64)> = ticks
        .iter()
        .flat_map(|(rows, _)| rows.iter().map(|(c, t)| (c.as_str(), *t)))
        .collect();
    let (batch_plan, task) = plan(sql, kind, &all, None).await;
    let whole = collect(batch_plan, task).await.unwrap();
    let want = MemTable::try_new(whole[0].schema(), vec![whole]).unwrap();
    ctx.session_context()
        .register_table("want", Arc::new(want))
        .unwrap();
    let after = first_emitted.unwrap_or(i64::MIN);
    let last = emitted.unwrap();
    let sorted = async |table: &str| {
        let batches = ctx
            .sql(&format!(
                "SELECT * FROM {table} WHERE CAST(window_end AS BIGINT) > {after} \
                 AND CAST(window_end AS BIGINT) <= {last} ORDER BY 1, 2, 3"
            ))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        pretty_format_batches(&batches).unwrap().to_string()
    };
    let (got, want) = (sorted("got").await, sorted("want").await);
    assert_eq!(got, want, "{sql}");
    assert!(
        want.lines().count() > 10,
        "too few windows to compare: {want}"
    );
    (pane, first_tick_rows.unwrap_or_default())
}

/// Rows of cards a, b and c: tick k holds times in [15k, 15k + 15) s, out of order, and
/// closes windows up to 15k + 12 s (no later row is behind it); the last tick closes all.
fn hop_ticks() -> Vec<(Vec<(String, i64)>, i64)> {
    let mut seed = 11u64;
    let mut next = move |n: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    (0..4)
        .map(|k| {
            let rows = (0..40)
                .map(|_| {
                    let card = ["a", "b", "c"][next(3) as usize].to_owned();
                    (card, 15 * k + next(15) as i64)
                })
                .collect();
            let watermark = if k == 3 { 1000 } else { 15 * k + 12 };
            (rows, watermark * SECOND)
        })
        .collect()
}

#[tokio::test]
async fn hop_windows_kept_as_panes_give_the_batch_answer() {
    let ticks = hop_ticks();
    let first: std::collections::HashSet<(String, i64)> = ticks[0]
        .0
        .iter()
        .map(|(c, t)| (c.clone(), t.div_euclid(2)))
        .collect();
    for (slide, size) in [(2, 6), (4, 6), (3, 10)] {
        let kind = WindowKind::Hop {
            slide: slide * SECOND,
            size: size * SECOND,
        };
        let hop = format!("HOP(t, ts, INTERVAL '{slide} seconds', INTERVAL '{size} seconds')");
        let sql = format!(
            "SELECT card, window_start, window_end, count(*) AS n, \
             count(DISTINCT ts) AS times, min(ts) AS first FROM {hop} \
             WHERE card <> 'x' GROUP BY card, window_start, window_end"
        );
        for emitted in [None, Some(24 * SECOND)] {
            let (pane, held) = incremental_equals_batch(&sql, kind, &ticks, emitted).await;
            let pane_seconds = [2, 2, 1][[(2, 6), (4, 6), (3, 10)]
                .iter()
                .position(|w| *w == (slide, size))
                .unwrap()];
            assert_eq!(pane, Some(pane_seconds * SECOND), "{sql}");
            if pane_seconds == 2 {
                // One state per card and pane, not one per card and window.
                assert_eq!(held, first.len(), "{sql}");
            }
        }
        // Only window_start grouped: the end is worked out from it.
        let by_start = format!(
            "SELECT card, window_start, sum(1) AS n FROM {hop} GROUP BY card, window_start"
        );
        let (physical, _) = plan(&by_start, kind, &[("a", 0)], None).await;
        assert!(split(physical, kind).unwrap().pane().is_some());
    }
}

#[tokio::test]
async fn hop_windows_whose_bounds_are_used_are_not_cut_into_panes() {
    let kind = WindowKind::Hop {
        slide: 2 * SECOND,
        size: 6 * SECOND,
    };
    let hop = "HOP(t, ts, INTERVAL '2 seconds', INTERVAL '6 seconds')";
    let ticks = hop_ticks();
    for sql in [
        format!(
            "SELECT card, window_start, window_end, max(window_end - ts) AS left \
             FROM {hop} GROUP BY card, window_start, window_end"
        ),
        format!(
            "SELECT card, window_start, window_end, count(*) AS n FROM {hop} \
             WHERE ts > window_start + INTERVAL '1 second' \
             GROUP BY card, window_start, window_end"
        ),
        format!(
            "SELECT card, window_start, window_end, sum(d) AS d FROM (SELECT card, \
             window_start, window_end, date_part('second', window_end) * 10 AS d \
             FROM {hop}) GROUP BY card, window_start, window_end"
        ),
    ] {
        let (pane, _) = incremental_equals_batch(&sql, kind, &ticks, None).await;
        assert_eq!(pane, None, "{sql}");
    }
}

#[tokio::test]
async fn queries_whose_rows_do_not_go_through_one_by_one_are_not_split() {
    let minute = WindowKind::Tumble { size: 60 * SECOND };
    let why = async |sql: &str| {
        let (plan, _) = plan(sql, minute, &[("a", 0)], None).await;
        split(plan, minute)
            .and_then(|s| s.check())
            .err()
            .unwrap_or_default()
    };
    let tumble = "TUMBLE(t, ts, INTERVAL '1 minute')";
    assert_eq!(
        why(&format!(
            "SELECT card, window_start, count(*) FROM {tumble} GROUP BY card, window_start"
        ))
        .await,
        ""
    );
    for (sql, reason) in [
        (
            format!(
                "SELECT window_start, count(*) FROM (SELECT * FROM {tumble} \
                 WHERE card <> 'x' LIMIT 10) GROUP BY window_start"
            ),
            "limit",
        ),
        (
            "SELECT window_start, count(*) FROM TUMBLE(distinct_t, ts, INTERVAL '1 minute') \
             GROUP BY window_start"
                .to_owned(),
            "AggregateExec",
        ),
        (
            format!(
                "SELECT window_start, count(*) FROM (SELECT card, window_start - \
                 INTERVAL '1 hour' AS window_start FROM {tumble}) GROUP BY window_start"
            ),
            "another column window_start",
        ),
        (
            format!("SELECT card, count(*) FROM {tumble} GROUP BY card"),
            "window_end or window_start",
        ),
    ] {
        let got = why(&sql).await;
        assert!(got.contains(reason), "{sql}: {got:?}");
    }
}

#[tokio::test]
async fn a_session_replayed_over_ticks_after_a_restart_is_emitted_whole() {
    // Emitted up to 12 s before the restart; card a's session [0 s, 19 s) was open.
    // The replay brings its rows in two ticks: the first alone would form [0 s, 10 s),
    // which ends before 12 s but is a piece of the open session, not an emitted one.
    // Card b's session [1 s, 11 s) was emitted before the restart: replayed, it is
    // dropped, not emitted again.
    let emitted = Some(12 * SECOND);
    let mut states = WindowStates::default();
    tick(&mut states, &[("a", 0), ("b", 1)], emitted).await;
    let split = tick(&mut states, &[("a", 9), ("c", 30)], emitted).await;
    let (closing, left) = states.closing(&split, emitted, 25 * SECOND).unwrap();
    let ctx = FulmenContext::new().unwrap();
    let out = collect(
        split.finished(closing).unwrap(),
        ctx.session_context().task_ctx(),
    )
    .await
    .unwrap();
    assert_eq!(
        pretty_format_batches(&out).unwrap().to_string(),
        "+------+---------------------+---------------------+---+\n\
         | card | window_start        | window_end          | n |\n\
         +------+---------------------+---------------------+---+\n\
         | a    | 1970-01-01T00:00:00 | 1970-01-01T00:00:19 | 2 |\n\
         +------+---------------------+---------------------+---+"
    );
    // Card c's session [30 s, 40 s) stays open.
    assert_eq!(left.rows(), 1);
}
