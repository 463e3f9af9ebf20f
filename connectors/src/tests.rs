//! Kafka tests against librdkafka's in-process mock cluster, started by each test.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{AsArray, RecordBatch};
use datafusion::arrow::datatypes::Int64Type;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use fulmen_engine::FulmenContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use crate::Streams;
use crate::sink::SinkStatus;

mod incremental;
mod restart;

fn cluster(topics: &[(&str, i32)]) -> MockCluster<'static, DefaultProducerContext> {
    let cluster = MockCluster::new(1).expect("mock cluster");
    for (topic, partitions) in topics {
        cluster.create_topic(topic, *partitions, 1).expect("topic");
    }
    cluster
}

fn session() -> (FulmenContext, Arc<Streams>) {
    let ctx = FulmenContext::new().expect("context");
    let streams = crate::install(&ctx);
    (ctx, streams)
}

/// Produces `(partition, key, value)` messages and waits until all are acknowledged.
fn produce(servers: &str, topic: &str, messages: &[(i32, Option<String>, Vec<u8>)]) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    for (partition, key, value) in messages {
        let mut record = BaseRecord::<String, Vec<u8>>::to(topic)
            .partition(*partition)
            .payload(value);
        if let Some(key) = key {
            record = record.key(key);
        }
        let mut record = Some(record);
        while let Some(r) = record.take() {
            if let Err((_, back)) = producer.send(r) {
                producer.poll(Duration::from_millis(10));
                record = Some(back);
            }
        }
    }
    producer.flush(Duration::from_secs(30)).expect("flush");
}

/// Every message of `topic` (read committed), with its `fulmen.error` header if any.
fn read_topic(servers: &str, topic: &str, at_least: usize) -> Vec<(Vec<u8>, Option<String>)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("group.id", "test-reader")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
        .expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(5))
        .expect("metadata");
    let mut tpl = TopicPartitionList::new();
    for p in metadata.topics()[0].partitions() {
        tpl.add_partition_offset(topic, p.id(), Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut quiet_since = Instant::now();
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                let error = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == "fulmen.error")
                        .and_then(|h| h.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                });
                out.push((m.payload().unwrap_or_default().to_vec(), error));
                quiet_since = Instant::now();
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            None if out.len() >= at_least && quiet_since.elapsed() > Duration::from_millis(500) => {
                break;
            }
            None => {}
        }
    }
    out
}

async fn query(ctx: &FulmenContext, sql: &str) -> Vec<RecordBatch> {
    ctx.sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

async fn text(ctx: &FulmenContext, sql: &str) -> String {
    pretty_format_batches(&query(ctx, sql).await)
        .unwrap()
        .to_string()
}

async fn count(ctx: &FulmenContext, sql: &str) -> i64 {
    let batches = query(ctx, sql).await;
    let column = batches[0].column(0);
    datafusion::arrow::compute::cast(column, &datafusion::arrow::datatypes::DataType::Int64)
        .unwrap()
        .as_any()
        .downcast_ref::<datafusion::arrow::array::Int64Array>()
        .unwrap()
        .value(0)
}

/// Waits until `sql` (one integer) reaches `target`.
async fn wait_for(ctx: &FulmenContext, sql: &str, target: i64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = count(ctx, sql).await;
        if n == target {
            return;
        }
        assert!(Instant::now() < deadline, "{sql}: {n}, waited for {target}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn json(card: &str, amount: f64, ts_ms: i64) -> Vec<u8> {
    format!(
        r#"{{"card":"{card}","amount":{amount},"ts":"{}"}}"#,
        fulmen_fraud::rfc3339(ts_ms)
    )
    .into_bytes()
}

/// A sink's status now.
fn status(streams: &Streams, sink: &str) -> SinkStatus {
    streams
        .sinks()
        .list()
        .into_iter()
        .find(|s| s.0 == sink)
        .unwrap_or_else(|| panic!("no sink {sink}"))
        .3
}

/// Waits until a sink has read `rows` rows from live tables.
async fn wait_for_rows_read(streams: &Streams, sink: &str, rows: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while status(streams, sink).rows_read < rows {
        assert!(
            Instant::now() < deadline,
            "sink {sink} read {:?}, waited for {rows}",
            status(streams, sink)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Each sink's mode, by name.
fn modes(streams: &Streams) -> BTreeMap<String, &'static str> {
    streams
        .sinks()
        .list()
        .into_iter()
        .map(|(name, _, _, status)| (name, status.mode))
        .collect()
}

/// Waits until every sink has emitted the windows ending at or before `up_to_ms`.
async fn wait_for_sinks(streams: &Streams, up_to_ms: i64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sinks = streams.sinks().list();
        if sinks
            .iter()
            .all(|(_, _, _, s)| s.emitted_up_to.is_some_and(|e| e >= up_to_ms * 1_000_000))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "sinks did not catch up: {:?}",
            sinks.iter().map(|s| (&s.0, &s.3)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_and_the_metadata_columns_are_ingested() {
    let cluster = cluster(&[("j", 2), ("c", 1), ("r", 1), ("a", 1), ("a_out", 1)]);
    let servers = cluster.bootstrap_servers();
    let (ctx, streams) = session();
    produce(
        &servers,
        "j",
        &[
            (0, Some("k1".into()), json("a", 1.5, 1_000)),
            (1, None, json("b", 2.0, 2_000)),
            (1, Some("k3".into()), json("a", 4.0, 3_000)),
        ],
    );
    produce(
        &servers,
        "c",
        &[(0, None, b"a;1.5".to_vec()), (0, None, b"b;2".to_vec())],
    );
    produce(&servers, "r", &[(0, None, "héllo".as_bytes().to_vec())]);
    use crate::format::tests::{TX_SCHEMA, confluent, tx_body};
    produce(
        &servers,
        "a",
        &[
            (
                0,
                None,
                confluent(9, &tx_body("a", "shop", Some(2.5), 1_000)),
            ),
            (0, None, confluent(8, &tx_body("x", "other", None, 0))),
            (0, None, confluent(9, &tx_body("b", "cafe", None, 2_000))),
        ],
    );
    for sql in [
        format!(
            "CREATE EXTERNAL TABLE j (card VARCHAR, amount DOUBLE, ts TIMESTAMP, _partition INT, \
             _offset BIGINT, _key VARCHAR, _timestamp TIMESTAMP) STORED AS KAFKA LOCATION 'j' \
             OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest')"
        ),
        format!(
            "CREATE EXTERNAL TABLE c (card VARCHAR, amount DOUBLE) STORED AS KAFKA LOCATION 'c' \
             OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest', 'format' 'csv', \
             'csv.delimiter' ';')"
        ),
        format!(
            "CREATE EXTERNAL TABLE r (line VARCHAR) STORED AS KAFKA LOCATION 'r' \
             OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest', 'format' 'raw')"
        ),
        // Avro with a registered writer schema (id 9); the table reads three of its fields.
        format!(
            "CREATE EXTERNAL TABLE a (ts TIMESTAMP, amount DOUBLE, card VARCHAR) STORED AS KAFKA \
             LOCATION 'a' OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest', \
             'format' 'avro', 'avro.schema_id' '9', 'avro.schema' '{TX_SCHEMA}')"
        ),
        // Avro written by a sink, with the schema derived from the columns.
        format!(
            "CREATE EXTERNAL TABLE a_out (card VARCHAR, amount DOUBLE, ts TIMESTAMP) \
             STORED AS KAFKA LOCATION 'a_out' OPTIONS ('bootstrap.servers' '{servers}', \
             'start' 'earliest', 'format' 'avro', 'avro.framing' 'single_object')"
        ),
        "CREATE SINK to_avro INTO a_out AS SELECT card, amount, ts FROM j".to_owned(),
    ] {
        query(&ctx, &sql).await;
    }
    wait_for(&ctx, "SELECT count(*) FROM j", 3).await;
    wait_for(&ctx, "SELECT count(*) FROM c", 2).await;
    wait_for(&ctx, "SELECT count(*) FROM r", 1).await;
    wait_for(&ctx, "SELECT count(*) FROM a", 2).await;
    wait_for(&ctx, "SELECT count(*) FROM a_out", 3).await;
    assert_eq!(
        text(
            &ctx,
            "SELECT card, amount, ts, _partition, _offset, _key, _timestamp IS NOT NULL AS stamped \
             FROM j ORDER BY ts"
        )
        .await,
        "+------+--------+---------------------+------------+---------+------+---------+\n\
         | card | amount | ts                  | _partition | _offset | _key | stamped |\n\
         +------+--------+---------------------+------------+---------+------+---------+\n\
         | a    | 1.5    | 1970-01-01T00:00:01 | 0          | 0       | k1   | true    |\n\
         | b    | 2.0    | 1970-01-01T00:00:02 | 1          | 0       |      | true    |\n\
         | a    | 4.0    | 1970-01-01T00:00:03 | 1          | 1       | k3   | true    |\n\
         +------+--------+---------------------+------------+---------+------+---------+"
    );
    assert_eq!(count(&ctx, "SELECT sum(amount) * 10 FROM c").await, 35);
    assert_eq!(
        count(&ctx, "SELECT count(*) FROM r WHERE line = 'héllo'").await,
        1
    );
    assert_eq!(
        text(&ctx, "SELECT * FROM a ORDER BY ts").await,
        "+---------------------+--------+------+\n\
         | ts                  | amount | card |\n\
         +---------------------+--------+------+\n\
         | 1970-01-01T00:00:01 | 2.5    | a    |\n\
         | 1970-01-01T00:00:02 |        | b    |\n\
         +---------------------+--------+------+"
    );
    assert_eq!(
        text(&ctx, "SELECT * FROM a_out ORDER BY ts").await,
        text(&ctx, "SELECT card, amount, ts FROM j ORDER BY ts").await
    );
    let streams_text = text(&ctx, "SHOW STREAMS").await;
    assert!(
        streams_text.contains("| j     | j     | 3"),
        "{streams_text}"
    );
    // The message framed with another schema id (8) is counted as malformed.
    let a = streams
        .tables()
        .into_iter()
        .find(|t| t.status().name == "a");
    let status = a.expect("table a streams").status();
    assert_eq!((status.messages, status.malformed), (3, 1), "{status:?}");
    streams.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_and_missing_topics_are_named() {
    let cluster = cluster(&[("t", 1)]);
    let servers = cluster.bootstrap_servers();
    let (ctx, _streams) = session();
    let err = |sql: String| {
        let ctx = ctx.clone();
        async move { ctx.sql(&sql).await.unwrap_err().to_string() }
    };
    let e = err(format!(
        "CREATE EXTERNAL TABLE t (a INT) STORED AS KAFKA LOCATION 't' \
         OPTIONS ('bootstrap.servers' '{servers}', 'grup.id' 'g')"
    ))
    .await;
    assert!(
        e.contains("unknown Kafka option 'grup.id' (did you mean 'group.id'?)"),
        "{e}"
    );
    let e = err(format!(
        "CREATE EXTERNAL TABLE t (a INT) STORED AS KAFKA LOCATION 'nope' \
         OPTIONS ('bootstrap.servers' '{servers}')"
    ))
    .await;
    assert!(e.contains("topic 'nope' does not exist"), "{e}");
    let e = err(format!(
        "CREATE EXTERNAL TABLE t (a INT, _offset VARCHAR) STORED AS KAFKA LOCATION 't' \
         OPTIONS ('bootstrap.servers' '{servers}')"
    ))
    .await;
    assert!(
        e.contains("metadata column '_offset' must be BIGINT"),
        "{e}"
    );
    let e = err(format!(
        "CREATE EXTERNAL TABLE t (a INT) STORED AS KAFKA LOCATION 't' \
         OPTIONS ('bootstrap.servers' '{servers}', 'event_time' 'a')"
    ))
    .await;
    assert!(e.contains("must be a TIMESTAMP"), "{e}");
    let e = err("DROP SINK nothing".into()).await;
    assert!(e.contains("sink 'nothing' does not exist"), "{e}");
    ctx.sql("DROP SINK IF EXISTS nothing").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_and_dead_lettered_and_retention_holds() {
    let cluster = cluster(&[("tx", 2), ("dlq", 1)]);
    let servers = cluster.bootstrap_servers();
    let (ctx, streams) = session();
    let messages: Vec<(i32, Option<String>, Vec<u8>)> = (0..2000)
        .map(|i| {
            let value = if i % 100 == 7 {
                format!("{{broken {i}").into_bytes()
            } else {
                json(&format!("c{}", i % 13), f64::from(i), 1_000 * i64::from(i))
            };
            (i % 2, None, value)
        })
        .collect();
    produce(&servers, "tx", &messages);
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE tx (card VARCHAR, amount DOUBLE, ts TIMESTAMP) STORED AS KAFKA \
             LOCATION 'tx' OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest', \
             'dead_letter' 'dlq')"
        ),
    )
    .await;
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE recent (card VARCHAR, amount DOUBLE, ts TIMESTAMP, \
             _offset BIGINT, _partition INT) STORED AS KAFKA LOCATION 'tx' OPTIONS \
             ('bootstrap.servers' '{servers}', 'start' 'earliest', 'retention' '100 rows')"
        ),
    )
    .await;
    wait_for(&ctx, "SELECT count(*) FROM tx", 1980).await;
    assert_eq!(
        count(&ctx, "SELECT sum(amount) FROM tx").await,
        (0..2000).filter(|i| i % 100 != 7).sum::<i64>()
    );
    let dead = read_topic(&servers, "dlq", 20);
    assert_eq!(dead.len(), 20);
    assert!(dead.iter().all(|(v, e)| v.starts_with(b"{broken")
        && e.as_deref().is_some_and(|e| e.starts_with("undecodable"))));
    // Retention keeps the newest rows of what has arrived.
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&ctx, "SELECT count(*) FROM recent").await != 100
        || streams
            .tables()
            .iter()
            .any(|t| t.name == "recent" && t.status().messages < 2000)
    {
        assert!(Instant::now() < deadline, "retention never settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = streams
        .tables()
        .into_iter()
        .find(|t| t.name == "tx")
        .unwrap()
        .status();
    assert_eq!(
        (status.rows, status.malformed, status.dead_lettered),
        (1980, 20, 20)
    );
    streams.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windowed_sinks_equal_the_same_batch_sql_and_late_rows_are_counted() {
    let cluster = cluster(&[
        ("events", 2),
        ("out_t", 1),
        ("out_h", 1),
        ("out_s", 1),
        ("out_r", 1),
    ]);
    let servers = cluster.bootstrap_servers();
    let (ctx, streams) = session();
    // 600 rows, 100 ms apart, each up to 1.5 s early (out of order within the 2 s watermark).
    let mut rng = fulmen_fraud::Rng(7);
    let rows: Vec<(String, f64, i64)> = (0..600)
        .map(|i| {
            let card = format!("c{}", rng.below(5));
            let amount = rng.below(100) as f64;
            (card, amount, i * 100 - rng.below(1500) as i64 + 1500)
        })
        .collect();
    let messages: Vec<_> = rows
        .iter()
        .enumerate()
        .map(|(i, (c, a, t))| ((i % 2) as i32, None, json(c, *a, *t)))
        .collect();
    produce(&servers, "events", &messages);
    query(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE events (card VARCHAR, amount DOUBLE, ts TIMESTAMP) \
             STORED AS KAFKA LOCATION 'events' OPTIONS ('bootstrap.servers' '{servers}', \
             'start' 'earliest', 'event_time' 'ts', 'watermark' '2 seconds', \
             'idle_timeout' '5 seconds')"
        ),
    )
    .await;
    let windows = [
        ("t", "TUMBLE(events, ts, INTERVAL '10 seconds')"),
        (
            "h",
            "HOP(events, ts, INTERVAL '5 seconds', INTERVAL '15 seconds')",
        ),
        (
            "s",
            "SESSION(events, ts, INTERVAL '700 milliseconds', card)",
        ),
        // Created with fulmen.stream.incremental off: re-read at each tick.
        ("r", "TUMBLE(events, ts, INTERVAL '10 seconds')"),
    ];
    let select = |from: &str| {
        format!(
            "SELECT card, window_start, window_end, count(*) AS n, sum(amount) AS total \
             FROM {from} GROUP BY card, window_start, window_end"
        )
    };
    for (suffix, from) in windows {
        if suffix == "r" {
            query(&ctx, "SET fulmen.stream.incremental = false").await;
        }
        query(
            &ctx,
            &format!(
                "CREATE EXTERNAL TABLE out_{suffix} (card VARCHAR, window_start TIMESTAMP, \
                 window_end TIMESTAMP, n BIGINT, total DOUBLE) STORED AS KAFKA \
                 LOCATION 'out_{suffix}' OPTIONS ('bootstrap.servers' '{servers}', \
                 'start' 'earliest')"
            ),
        )
        .await;
        query(
            &ctx,
            &format!(
                "CREATE SINK s_{suffix} INTO out_{suffix} AS {}",
                select(from)
            ),
        )
        .await;
    }
    wait_for(&ctx, "SELECT count(*) FROM events", 600).await;
    // Late rows (far behind the watermark), then one row per partition far ahead, which
    // closes every window of the 600.
    let late: Vec<_> = (0..5)
        .map(|i| (i % 2, None, json("late", 1.0, 1_000 + i as i64)))
        .collect();
    produce(&servers, "events", &late);
    let deadline = Instant::now() + Duration::from_secs(30);
    while streams
        .tables()
        .iter()
        .find(|t| t.name == "events")
        .unwrap()
        .status()
        .late
        < 5
    {
        assert!(Instant::now() < deadline, "late rows never counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    produce(
        &servers,
        "events",
        &[
            (0, None, json("zz", 0.0, 3_600_000)),
            (1, None, json("zz", 0.0, 3_600_000)),
        ],
    );
    wait_for_sinks(&streams, 3_500_000).await;

    // The same SQL over the same 600 rows as a plain table.
    let batch = query(
        &ctx,
        "SELECT card, amount, ts FROM events WHERE card <> 'zz'",
    )
    .await;
    let plain = FulmenContext::new().unwrap();
    let schema = batch[0].schema();
    plain
        .session_context()
        .register_table(
            "events",
            Arc::new(MemTable::try_new(schema, vec![batch]).unwrap()),
        )
        .unwrap();
    for (suffix, from) in windows {
        let order = "ORDER BY card, window_start, window_end";
        let expected = text(&plain, &format!("SELECT * FROM ({}) {order}", select(from))).await;
        let rows = count(&plain, &format!("SELECT count(*) FROM ({})", select(from))).await;
        wait_for(&ctx, &format!("SELECT count(*) FROM out_{suffix}"), rows).await;
        let got = text(&ctx, &format!("SELECT * FROM out_{suffix} {order}")).await;
        assert_eq!(got, expected, "{from}");
    }
    let sinks = text(&ctx, "SHOW SINKS").await;
    assert!(
        sinks.contains("incremental") && sinks.contains("windowed"),
        "{sinks}"
    );
    // Every window kind keeps its open windows' states, unless made with the setting off.
    assert_eq!(
        modes(&streams),
        [
            ("s_h", "incremental"),
            ("s_r", "windowed"),
            ("s_s", "incremental"),
            ("s_t", "incremental")
        ]
        .map(|(n, m)| (n.to_owned(), m))
        .into()
    );
    let status = streams
        .tables()
        .into_iter()
        .find(|t| t.name == "events")
        .unwrap()
        .status();
    assert_eq!((status.rows, status.late), (602, 5));
    ctx.sql("DROP SINK s_t").await.unwrap();
    assert!(!text(&ctx, "SHOW SINKS").await.contains("s_t"));
    streams.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fraud_pipeline_raises_exactly_the_planted_alerts() {
    let cluster = cluster(&[
        ("transactions", 3),
        ("alerts", 1),
        ("transactions-dead-letters", 1),
    ]);
    let servers = cluster.bootstrap_servers();
    let options = fulmen_fraud::Options::default();
    let generated = fulmen_fraud::generate(options);
    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("fraud-profiles.csv");
    std::fs::write(&profiles, fulmen_fraud::profiles_csv(&generated.profiles)).unwrap();
    let mut messages: Vec<_> = generated
        .transactions
        .iter()
        .map(|t| {
            let partition = t.card.bytes().map(i32::from).sum::<i32>() % 3;
            (partition, Some(t.card.clone()), t.to_json().into_bytes())
        })
        .collect();
    let end_ms = fulmen_fraud::START_MS + options.minutes * 60_000;
    let heartbeat = fulmen_fraud::heartbeat(options.minutes);
    messages.extend((0..3).map(|p| (p, None, heartbeat.to_json().into_bytes())));
    let (ctx, streams) = session();
    for statement in fulmen_fraud::pipeline_statements(&servers, profiles.to_str().unwrap()) {
        query(&ctx, &statement).await;
    }
    produce(&servers, "transactions", &messages);
    wait_for_sinks(&streams, end_ms + 3_600_000).await;
    wait_for(
        &ctx,
        "SELECT count(*) FROM alerts",
        generated.planted.len() as i64,
    )
    .await;
    let batches = query(
        &ctx,
        "SELECT rule, card, CAST(window_start AS BIGINT) / 1000000 AS start FROM alerts",
    )
    .await;
    let mut alerts = BTreeSet::new();
    for batch in &batches {
        let rule = batch.column(0).as_string_view();
        let card = batch.column(1).as_string_view();
        let start = batch.column(2).as_primitive::<Int64Type>();
        for row in 0..batch.num_rows() {
            alerts.insert((
                rule.value(row).to_owned(),
                card.value(row).to_owned(),
                start.value(row),
            ));
        }
    }
    assert_eq!(alerts, generated.planted);
    // All three rules, the profile join and count(DISTINCT …) included, run incrementally.
    assert_eq!(
        modes(&streams),
        [
            ("countries", "incremental"),
            ("spend", "incremental"),
            ("velocity", "incremental")
        ]
        .map(|(n, m)| (n.to_owned(), m))
        .into()
    );
    let status = streams
        .tables()
        .into_iter()
        .find(|t| t.name == "transactions")
        .unwrap()
        .status();
    assert_eq!((status.malformed, status.late), (0, 0));
    streams.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_partition_does_not_hold_the_watermark_back() {
    let cluster = cluster(&[("quiet", 2)]);
    let servers = cluster.bootstrap_servers();
    let (ctx, streams) = session();
    for (table, idle) in [("quiet", "300 milliseconds"), ("stalled", "none")] {
        query(
            &ctx,
            &format!(
                "CREATE EXTERNAL TABLE {table} (card VARCHAR, amount DOUBLE, ts TIMESTAMP) \
                 STORED AS KAFKA LOCATION 'quiet' OPTIONS ('bootstrap.servers' '{servers}', \
                 'start' 'earliest', 'event_time' 'ts', 'idle_timeout' '{idle}')"
            ),
        )
        .await;
    }
    // Only partition 0 receives rows; partition 1 stays empty.
    let messages: Vec<_> = (0..50)
        .map(|i| (0, None, json("c", 1.0, i * 1000)))
        .collect();
    produce(&servers, "quiet", &messages);
    wait_for(&ctx, "SELECT count(*) FROM quiet", 50).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let watermark = |name: &str| {
        streams
            .tables()
            .into_iter()
            .find(|t| t.name == name)
            .unwrap()
            .watermark()
    };
    while watermark("quiet") != Some(49_000_000_000) {
        assert!(
            Instant::now() < deadline,
            "watermark {:?}",
            watermark("quiet")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Waiting for every partition (no idle timeout), the empty one holds it back.
    assert_eq!(watermark("stalled"), None);
    streams.shutdown();
}

/// A session of a cluster's client keeps Kafka live tables and sinks in its own process:
/// a sink runs here and writes its windows; a query that would need a live table on the
/// executors is a clear error. Something accepting connections stands where the scheduler
/// would be (the client checks that it answers); none of this is sent to it, and a query
/// that were would get no answer, which the timeout turns into a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_client_kafka_tables_and_sinks_stay_in_the_client() {
    let scheduler = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = format!("df://{}", scheduler.local_addr().unwrap());
    let config = fulmen_engine::FulmenConfig::default();
    let ctx = FulmenContext::remote_with_config(&address, config)
        .await
        .unwrap();
    let streams = crate::install(&ctx);
    let cluster = cluster(&[("payments", 1), ("totals", 1)]);
    let servers = cluster.bootstrap_servers();
    let within = |sql: String| {
        let ctx = ctx.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(60), query(&ctx, &sql))
                .await
                .unwrap_or_else(|_| panic!("{sql}: no answer (sent to the cluster?)"))
        }
    };
    within(format!(
        "CREATE EXTERNAL TABLE payments (card VARCHAR, amount DOUBLE, ts TIMESTAMP) \
         STORED AS KAFKA LOCATION 'payments' OPTIONS ('bootstrap.servers' '{servers}', \
         'start' 'earliest', 'event_time' 'ts', 'watermark' '1 second')"
    ))
    .await;
    within(format!(
        "CREATE EXTERNAL TABLE totals (card VARCHAR, window_end TIMESTAMP, total DOUBLE) \
         STORED AS KAFKA LOCATION 'totals' OPTIONS ('bootstrap.servers' '{servers}')"
    ))
    .await;
    within(
        "CREATE SINK per_card INTO totals AS SELECT card, window_end, sum(amount) AS total \
         FROM TUMBLE(payments, ts, INTERVAL '10 seconds') GROUP BY card, window_end"
            .to_string(),
    )
    .await;
    let mut messages: Vec<_> = (0..20)
        .map(|i| (0, None, json(&format!("c{}", i % 2), i as f64, i * 100)))
        .collect();
    messages.push((0, None, json("zz", 0.0, 60_000)));
    produce(&servers, "payments", &messages);
    wait_for_sinks(&streams, 10_000).await;
    let mut written: Vec<String> = read_topic(&servers, "totals", 2)
        .into_iter()
        .map(|(m, _)| String::from_utf8(m).unwrap())
        .collect();
    written.sort();
    assert_eq!(written.len(), 2, "{written:?}");
    // c0 has 0 + 2 + … + 18 = 90, c1 has 1 + 3 + … + 19 = 100.
    assert!(
        written[0].contains(r#""card":"c0""#) && written[0].contains("90"),
        "{written:?}"
    );
    assert!(
        written[1].contains(r#""card":"c1""#) && written[1].contains("100"),
        "{written:?}"
    );
    let listed = pretty_format_batches(&within("SHOW SINKS".to_string()).await)
        .unwrap()
        .to_string();
    assert!(listed.contains("per_card"), "{listed}");

    let e = ctx
        .sql("SELECT count(*) FROM payments")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("table 'payments' is a table (a Kafka live table"),
        "{e}"
    );
    streams.shutdown();
}
