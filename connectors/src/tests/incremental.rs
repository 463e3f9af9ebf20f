//! Incremental windows: each row read once, open windows held as partial states, and a live
//! table's retention far shorter than the window.

use datafusion::arrow::array::{Float64Array, StringArray, TimestampNanosecondArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_windows_read_each_row_once_and_outlive_retention() {
    let cluster = cluster(&[("tx", 1), ("tx_out", 1)]);
    let servers = cluster.bootstrap_servers();
    let (ctx, streams) = session();
    // Rows leave the live table 2 seconds after they arrive; the window is an hour long.
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE tx (card VARCHAR, amount DOUBLE, ts TIMESTAMP) STORED AS \
             KAFKA LOCATION 'tx' OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest', \
             'event_time' 'ts', 'watermark' '1 second', 'retention' '2 seconds')"
        ),
    )
    .await;
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE tx_out (card VARCHAR, window_start TIMESTAMP, \
             window_end TIMESTAMP, n BIGINT, amounts BIGINT, total DOUBLE) STORED AS KAFKA \
             LOCATION 'tx_out' OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest')"
        ),
    )
    .await;
    let select = |from: &str| {
        format!(
            "SELECT card, window_start, window_end, count(*) AS n, \
             count(DISTINCT amount) AS amounts, sum(amount) AS total \
             FROM TUMBLE({from}, ts, INTERVAL '1 hour') GROUP BY card, window_start, window_end"
        )
    };
    query(
        &ctx,
        &format!("CREATE SINK hourly INTO tx_out AS {}", select("tx")),
    )
    .await;
    assert_eq!(status(&streams, "hourly").mode, "incremental");

    // 12 000 rows of four cards over the hour's first 20 minutes, in two bursts.
    let rows: Vec<(String, f64, i64)> = (0..12_000)
        .map(|i| (format!("c{}", i % 4), (i % 7) as f64, i * 100))
        .collect();
    let messages = |rows: &[(String, f64, i64)]| -> Vec<_> {
        rows.iter()
            .map(|(c, a, t)| (0, None, json(c, *a, *t)))
            .collect()
    };
    produce(&servers, "tx", &messages(&rows[..6_000]));
    wait_for_rows_read(&streams, "hourly", 6_000).await;
    // The first burst's states: a handful per card, not a row per row.
    let held = status(&streams, "hourly").state_rows;
    assert!((1..=100).contains(&held), "{held} state rows");
    // The second burst arrives once the first has outlived its retention: ingesting it drops
    // the first from the live table.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    produce(&servers, "tx", &messages(&rows[6_000..]));
    wait_for_rows_read(&streams, "hourly", 12_000).await;
    let table = streams
        .tables()
        .into_iter()
        .find(|t| t.name == "tx")
        .unwrap()
        .status();
    assert_eq!(
        table.rows_held, 6_000,
        "the first burst left the live table"
    );

    // A row two hours on closes the first hour.
    produce(&servers, "tx", &[(0, None, json("zz", 0.0, 7_200_000))]);
    wait_for_sinks(&streams, 3_600_000).await;
    wait_for(&ctx, "SELECT count(*) FROM tx_out", 4).await;

    // The same SQL over all 12 000 rows as a plain table.
    let schema = Arc::new(Schema::new(vec![
        Field::new("card", DataType::Utf8, false),
        Field::new("amount", DataType::Float64, false),
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), false),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.0))),
            Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.1))),
            Arc::new(TimestampNanosecondArray::from_iter_values(
                rows.iter().map(|r| r.2 * 1_000_000),
            )),
        ],
    )
    .unwrap();
    let plain = FulmenContext::new().unwrap();
    plain
        .session_context()
        .register_table(
            "tx",
            Arc::new(MemTable::try_new(schema, vec![vec![batch]]).unwrap()),
        )
        .unwrap();
    let expected = text(&plain, &format!("{} ORDER BY card", select("tx"))).await;
    let got = text(&ctx, "SELECT * FROM tx_out ORDER BY card").await;
    assert_eq!(got, expected);

    // Each row was read once; the closed window's states are gone, the sentinel's open
    // window holds one.
    let sink = status(&streams, "hourly");
    assert_eq!((sink.rows_read, sink.state_rows), (12_001, 1), "{sink:?}");
    streams.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_windows_merge_across_ticks_and_equal_the_batch_sql() {
    let cluster = cluster(&[("clicks", 1), ("sessions", 1)]);
    let servers = cluster.bootstrap_servers();
    let (ctx, streams) = session();
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE clicks (card VARCHAR, amount DOUBLE, ts TIMESTAMP) STORED \
             AS KAFKA LOCATION 'clicks' OPTIONS ('bootstrap.servers' '{servers}', \
             'start' 'earliest', 'event_time' 'ts', 'watermark' '10 seconds')"
        ),
    )
    .await;
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE sessions (card VARCHAR, window_start TIMESTAMP, \
             window_end TIMESTAMP, n BIGINT, amounts BIGINT, total DOUBLE) STORED AS KAFKA \
             LOCATION 'sessions' OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest')"
        ),
    )
    .await;
    let select = |from: &str| {
        format!(
            "SELECT card, window_start, window_end, count(*) AS n, \
             count(DISTINCT amount) AS amounts, sum(amount) AS total \
             FROM SESSION({from}, ts, INTERVAL '400 milliseconds', card) \
             GROUP BY card, window_start, window_end"
        )
    };
    query(
        &ctx,
        &format!(
            "CREATE SINK by_session INTO sessions AS {}",
            select("clicks")
        ),
    )
    .await;
    assert_eq!(status(&streams, "by_session").mode, "incremental");

    // Three cards, a row every 50 ms (each card's every 150 ms, up to 300 ms out of order),
    // with a 2-second pause every 700 rows: sessions run across the bursts of 500 rows the
    // sink takes in one after another, so their states meet and merge tick after tick.
    let mut rng = fulmen_fraud::Rng(11);
    let rows: Vec<(String, f64, i64)> = (0..3_000)
        .map(|i| {
            let t = i * 50 + (i / 700) * 2_000 - rng.below(300) as i64 + 300;
            (format!("c{}", i % 3), rng.below(5) as f64, t)
        })
        .collect();
    for (n, burst) in rows.chunks(500).enumerate() {
        let messages: Vec<_> = burst
            .iter()
            .map(|(c, a, t)| (0, None, json(c, *a, *t)))
            .collect();
        produce(&servers, "clicks", &messages);
        wait_for_rows_read(&streams, "by_session", 500 * (n as u64 + 1)).await;
    }
    produce(&servers, "clicks", &[(0, None, json("zz", 0.0, 3_600_000))]);
    wait_for_sinks(&streams, 3_000_000).await;

    let batch = query(
        &ctx,
        "SELECT card, amount, ts FROM clicks WHERE card <> 'zz'",
    )
    .await;
    let plain = FulmenContext::new().unwrap();
    plain
        .session_context()
        .register_table(
            "clicks",
            Arc::new(MemTable::try_new(batch[0].schema(), vec![batch]).unwrap()),
        )
        .unwrap();
    let order = "ORDER BY card, window_start";
    let expected = text(&plain, &format!("{} {order}", select("clicks"))).await;
    let sessions = count(
        &plain,
        &format!("SELECT count(*) FROM ({})", select("clicks")),
    )
    .await;
    assert!(
        sessions >= 9,
        "{sessions} sessions: the pauses should split them"
    );
    wait_for(&ctx, "SELECT count(*) FROM sessions", sessions).await;
    let got = text(&ctx, &format!("SELECT * FROM sessions {order}")).await;
    assert_eq!(got, expected);
    let sink = status(&streams, "by_session");
    assert_eq!((sink.rows_read, sink.state_rows), (3_001, 1), "{sink:?}");
    streams.shutdown();
}
