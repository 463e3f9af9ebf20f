//! Restarts and outages: a sink stopped mid-stream and started again in a new session from
//! its committed offsets (each delivery mode, tumbling and session windows), and an append
//! sink across a broker outage.

use super::*;

/// Runs the restart scenario for one delivery mode: a sink counting rows per window (20
/// windows of 50 rows) is stopped mid-stream and started again in a new session from its
/// committed offsets. `sessions`: session windows (rows in runs of 50, 1.1 s apart) instead
/// of 5-second tumbling ones.
async fn restart_loses_nothing(delivery: &str, sessions: bool) {
    let cluster = cluster(&[("pay", 2), ("counts", 1)]);
    let servers = cluster.bootstrap_servers();
    let pause = if sessions { 1_000 } else { 0 };
    let messages: Vec<_> = (0..1000)
        .map(|i| {
            let ts = i64::from(i) * 100 + i64::from(i / 50) * pause;
            (i % 2, None, json("c", 1.0, ts))
        })
        .collect();
    let windows = if sessions {
        "SESSION(pay, ts, INTERVAL '300 milliseconds') GROUP BY window_start, window_end"
    } else {
        "TUMBLE(pay, ts, INTERVAL '5 seconds') GROUP BY window_start"
    };
    let ddl = [
        format!(
            "CREATE EXTERNAL TABLE pay (card VARCHAR, amount DOUBLE, ts TIMESTAMP) STORED AS \
             KAFKA LOCATION 'pay' OPTIONS ('bootstrap.servers' '{servers}', 'group.id' 'pipe', \
             'start' 'committed', 'event_time' 'ts', 'watermark' '1 second', \
             'idle_timeout' '5 seconds')"
        ),
        format!(
            "CREATE EXTERNAL TABLE counts (window_start TIMESTAMP, n BIGINT) STORED AS KAFKA \
             LOCATION 'counts' OPTIONS ('bootstrap.servers' '{servers}', 'delivery' '{delivery}')"
        ),
        format!(
            "CREATE SINK per_window INTO counts AS SELECT window_start, count(*) AS n FROM {windows}"
        ),
    ];
    {
        let (ctx, streams) = session();
        for sql in &ddl {
            query(&ctx, sql).await;
        }
        // Taken in over three ticks at least, the last window's rows split between the
        // last two: the committed offsets must reach back into the second.
        for (from, to) in [(0, 450), (450, 475), (475, 500)] {
            produce(&servers, "pay", &messages[from..to]);
            wait_for_rows_read(&streams, "per_window", to as u64).await;
        }
        wait_for_sinks(&streams, 40_000).await;
        streams.shutdown();
    }
    let sentinel = [
        (0, None, json("c", 0.0, 3_600_000)),
        (1, None, json("c", 0.0, 3_600_000)),
    ];
    produce(&servers, "pay", &messages[500..]);
    produce(&servers, "pay", &sentinel);
    let (ctx, streams) = session();
    for sql in &ddl {
        query(&ctx, sql).await;
    }
    wait_for_sinks(&streams, 3_500_000).await;
    streams.shutdown();

    let mut per_window: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    let mut messages_read = 0;
    for (value, _) in read_topic(&servers, "counts", 20) {
        let row: serde_json::Value = serde_json::from_slice(&value).unwrap();
        let start = row["window_start"].as_str().unwrap().to_owned();
        per_window
            .entry(start)
            .or_default()
            .insert(row["n"].as_i64().unwrap());
        messages_read += 1;
    }
    assert_eq!(per_window.len(), 20, "{per_window:?}");
    assert!(
        per_window.values().all(|n| n.len() == 1 && n.contains(&50)),
        "{per_window:?}"
    );
    if delivery == "exactly_once" {
        assert_eq!(messages_read, 20, "exactly-once wrote a window twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sink_loses_no_input_at_least_once() {
    restart_loses_nothing("at_least_once", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_session_sink_loses_no_input_exactly_once() {
    restart_loses_nothing("exactly_once", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sink_loses_no_input_exactly_once() {
    restart_loses_nothing("exactly_once", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_sink_writes_each_new_row_once_and_survives_a_broker_outage() {
    let cluster = cluster(&[("payments", 1), ("big", 1)]);
    let servers = cluster.bootstrap_servers();
    let (ctx, streams) = session();
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE payments (card VARCHAR, amount DOUBLE, ts TIMESTAMP) \
             STORED AS KAFKA LOCATION 'payments' OPTIONS ('bootstrap.servers' '{servers}', \
             'start' 'earliest')"
        ),
    )
    .await;
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE big (card VARCHAR, amount DOUBLE) STORED AS KAFKA \
             LOCATION 'big' OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest', \
             'format' 'csv')"
        ),
    )
    .await;
    query(
        &ctx,
        "CREATE SINK big_payments INTO big AS SELECT card, amount FROM payments WHERE amount > 150",
    )
    .await;
    let batch = |from: i64| -> Vec<_> {
        (from..from + 100)
            .map(|i| (0, None, json(&format!("c{i}"), i as f64, i * 10)))
            .collect()
    };
    produce(&servers, "payments", &batch(0));
    wait_for(&ctx, "SELECT count(*) FROM payments", 100).await;
    cluster.broker_down(1).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.broker_up(1).unwrap();
    produce(&servers, "payments", &batch(100));
    wait_for(&ctx, "SELECT count(*) FROM payments", 200).await;
    wait_for(&ctx, "SELECT count(*) FROM big", 49).await;
    assert_eq!(
        count(&ctx, "SELECT count(DISTINCT card) FROM big").await,
        49
    );
    assert_eq!(
        count(&ctx, "SELECT sum(amount) FROM big").await,
        (151..200).sum::<i64>()
    );
    let sinks = text(&ctx, "SHOW SINKS").await;
    assert!(sinks.contains("append"), "{sinks}");
    streams.shutdown();
}
