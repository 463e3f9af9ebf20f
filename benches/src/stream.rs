//! `fulmen-bench stream`: Kafka ingest rate into a live table, and the time from a window's
//! close to its alert on the sink topic. Both run against librdkafka's in-process mock
//! cluster, so the broker shares the machine (and the process) with Fulmen.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use datafusion::arrow::compute::kernels::cast_utils::string_to_timestamp_nanos;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use fulmen_connectors::avro::{AvroSpec, Framing};
use fulmen_connectors::format::{Decoder, Encoder};
use fulmen_connectors::options::Format;
use fulmen_engine::FulmenContext;
use fulmen_fraud::rfc3339;

/// What the streaming benchmark measured.
#[derive(Debug)]
pub struct StreamReport {
    /// Events ingested (each format).
    pub events: usize,
    /// Average size of an event's JSON, bytes.
    pub event_bytes: usize,
    /// Average size of the same event as an Avro message (Confluent framing), bytes.
    pub avro_event_bytes: usize,
    /// The JSON topic's ingest.
    pub json: Ingest,
    /// The Avro topic's ingest.
    pub avro: Ingest,
    /// Windows measured for latency.
    pub windows: usize,
    /// Median milliseconds from a window's end to its result on the sink topic.
    pub close_to_alert_p50_ms: f64,
    /// 99th percentile of the same.
    pub close_to_alert_p99_ms: f64,
}

fn event(i: usize, ts: &str) -> String {
    format!(
        r#"{{"event_id":{i},"card":"4000-{:06}","merchant":"merchant-{:05}","amount":{}.{:02},"country":"US","channel":"online","device":"d-{:08x}","ts":"{ts}"}}"#,
        i % 100_000,
        i % 7919,
        i % 1000,
        i % 100,
        i.wrapping_mul(2_654_435_761) & 0xffff_ffff,
    )
}

const COLUMNS: &str = "event_id BIGINT, card VARCHAR, merchant VARCHAR, amount DOUBLE, \
                       country VARCHAR, channel VARCHAR, device VARCHAR, ts TIMESTAMP";

fn new_producer(servers: &str) -> Result<BaseProducer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .create()?)
}

fn send(producer: &BaseProducer, topic: &str, partition: i32, value: &[u8]) {
    let mut record = BaseRecord::<(), [u8]>::to(topic)
        .partition(partition)
        .payload(value);
    loop {
        match producer.send(record) {
            Ok(()) => return,
            Err((_, back)) => {
                record = back;
                producer.poll(Duration::from_millis(1));
            }
        }
    }
}

/// A consumer reading partition 0 of `topic` from its beginning.
fn reader(servers: &str, topic: &str) -> Result<BaseConsumer> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("group.id", "bench-reader")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)?;
    consumer.assign(&tpl)?;
    Ok(consumer)
}

/// utime + stime, in seconds, from a `/proc/…/stat` file's text.
fn stat_cpu_seconds(stat: &str) -> f64 {
    let ticks_per_second = 100.0; // USER_HZ on Linux
    // Fields after the ")" closing the name: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    (field(14).unwrap_or(0.0) + field(15).unwrap_or(0.0)) / ticks_per_second
}

/// CPU seconds used so far by the whole process (every thread, the mock broker's too).
fn process_cpu_seconds() -> f64 {
    stat_cpu_seconds(&std::fs::read_to_string("/proc/self/stat").unwrap_or_default())
}

/// CPU seconds used so far by each of this process's threads whose name starts with
/// `prefix`, by thread id.
fn thread_cpu_seconds(prefix: &str) -> HashMap<String, f64> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return HashMap::new();
    };
    let mut threads = HashMap::new();
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.trim().starts_with(prefix) {
            continue;
        }
        let cpu = stat_cpu_seconds(
            &std::fs::read_to_string(task.path().join("stat")).unwrap_or_default(),
        );
        threads.insert(task.file_name().to_string_lossy().into_owned(), cpu);
    }
    threads
}

/// CPU seconds the threads named `prefix…` alive now used since `before` was read (a thread
/// that ended meanwhile, such as an earlier table's, is not counted).
fn thread_cpu_since(prefix: &str, before: &HashMap<String, f64>) -> f64 {
    thread_cpu_seconds(prefix)
        .iter()
        .map(|(tid, cpu)| cpu - before.get(tid).copied().unwrap_or(0.0))
        .sum()
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// One live table's ingest of a filled topic.
#[derive(Debug, Clone, Copy)]
pub struct Ingest {
    /// Seconds from `CREATE EXTERNAL TABLE` until every event was held.
    pub seconds: f64,
    /// CPU seconds the table's ingestion thread used.
    pub thread_cpu_seconds: f64,
    /// CPU seconds of the whole process meanwhile (librdkafka's threads and the in-process
    /// mock broker included).
    pub process_cpu_seconds: f64,
}

/// Creates a live table over `topic` (`options` are added to its OPTIONS) and waits until it
/// holds `events` rows.
async fn ingest(
    ctx: &FulmenContext,
    streams: &fulmen_connectors::Streams,
    servers: &str,
    (topic, columns): (&str, &str),
    options: &str,
    events: usize,
) -> Result<Ingest> {
    let cpu_before = thread_cpu_seconds("fulmen-ingest");
    let process_before = process_cpu_seconds();
    let started = Instant::now();
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE {topic} ({columns}) STORED AS KAFKA LOCATION '{topic}' \
         OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest'{options})"
    ))
    .await?;
    let table = streams
        .tables()
        .into_iter()
        .find(|t| t.name == topic)
        .context("the live table")?;
    loop {
        let status = table.status();
        if status.rows as usize >= events {
            break;
        }
        if started.elapsed() > Duration::from_secs(120) || status.malformed > 0 {
            bail!("ingest stalled: {status:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let thread_cpu_seconds = thread_cpu_since("fulmen-ingest", &cpu_before);
    let process_cpu_seconds = process_cpu_seconds() - process_before;
    table.stop();
    Ok(Ingest {
        seconds,
        thread_cpu_seconds,
        process_cpu_seconds,
    })
}

/// Runs both measurements.
pub async fn run(events: usize, latency_seconds: u64) -> Result<StreamReport> {
    let cluster = MockCluster::new(1)?;
    let servers = cluster.bootstrap_servers();
    // The mock cluster keeps at most 5 MB (and 100 000 message sets) per partition and
    // drops older messages, so the topic gets a partition per 4 MB of events.
    let partitions = (events * 200 / (4 << 20) + 1).max(4) as i32;
    cluster.create_topic("ingest", partitions, 1)?;
    cluster.create_topic("ingest_avro", partitions, 1)?;
    cluster.create_topic("warmup", 1, 1)?;
    cluster.create_topic("live", 2, 1)?;
    cluster.create_topic("counts", 1, 1)?;

    // 1. Ingest: a topic is filled first, then a live table reads it from the start; once
    //    with the events as JSON, once as Avro records (Confluent framing) of the same rows.
    let producer = new_producer(&servers)?;
    let json_format = Format::Json;
    let avro_format = Format::Avro(Arc::new(AvroSpec {
        schema: None,
        framing: Framing::Confluent(1),
    }));
    let payload = Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Int64, true),
        Field::new("card", DataType::Utf8, true),
        Field::new("merchant", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new("country", DataType::Utf8, true),
        Field::new("channel", DataType::Utf8, true),
        Field::new("device", DataType::Utf8, true),
        // TIMESTAMP in SQL: nanoseconds, so the derived Avro schemas of this payload and of
        // the table's columns are the same schema.
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), true),
    ]));
    let rows = Decoder::try_new(&json_format, Arc::clone(&payload))?;
    let to_avro = Encoder::try_new(&avro_format, Arc::clone(&payload))?;
    let (mut bytes, mut avro_bytes) = (0, 0);
    for first in (0..events).step_by(4096) {
        let chunk: Vec<String> = (first..(first + 4096).min(events))
            .map(|i| event(i, "2026-01-01T00:00:00.000Z"))
            .collect();
        let values: Vec<Option<&[u8]>> = chunk.iter().map(|v| Some(v.as_bytes())).collect();
        let decoded = rows.decode(&values);
        if !decoded.bad.is_empty() {
            bail!(
                "the benchmark's own events did not decode: {:?}",
                decoded.bad[0]
            );
        }
        for (n, (json, avro)) in chunk
            .iter()
            .zip(to_avro.encode(&decoded.batch)?)
            .enumerate()
        {
            let partition = (first + n) as i32 % partitions;
            bytes += json.len();
            avro_bytes += avro.len();
            send(&producer, "ingest", partition, json.as_bytes());
            send(&producer, "ingest_avro", partition, &avro);
        }
    }
    producer.flush(Duration::from_secs(120))?;
    eprintln!("produced {events} events, as JSON and as Avro");
    let ctx = FulmenContext::new()?;
    let streams = fulmen_connectors::install(&ctx);
    // A first live table waits a few seconds for its first fetch from the mock cluster
    // (once per process): a one-message warm-up table takes that wait out of the measures.
    send(
        &producer,
        "warmup",
        0,
        event(0, "2026-01-01T00:00:00.000Z").as_bytes(),
    );
    producer.flush(Duration::from_secs(10))?;
    let warmup = ingest(&ctx, &streams, &servers, ("warmup", COLUMNS), "", 1).await?;
    eprintln!("warm-up table: {:.2} s", warmup.seconds);
    let json = ingest(&ctx, &streams, &servers, ("ingest", COLUMNS), "", events).await?;
    let avro = ingest(
        &ctx,
        &streams,
        &servers,
        ("ingest_avro", COLUMNS),
        ", 'format' 'avro', 'avro.schema_id' '1'",
        events,
    )
    .await?;

    // 2. Latency: events stamped with the wall clock, 500 ms tumbling windows, no lateness.
    for sql in [
        format!(
            "CREATE EXTERNAL TABLE live ({COLUMNS}) STORED AS KAFKA LOCATION 'live' OPTIONS \
             ('bootstrap.servers' '{servers}', 'start' 'earliest', 'event_time' 'ts', \
             'watermark' '0', 'idle_timeout' '1 second', 'retention' '10 seconds', \
             'kafka.fetch.wait.max.ms' '10')"
        ),
        format!(
            "CREATE EXTERNAL TABLE counts (window_start TIMESTAMP, window_end TIMESTAMP, \
             n BIGINT) STORED AS KAFKA LOCATION 'counts' OPTIONS \
             ('bootstrap.servers' '{servers}')"
        ),
        "CREATE SINK per_window INTO counts AS SELECT window_start, window_end, count(*) AS n \
         FROM TUMBLE(live, ts, INTERVAL '500 milliseconds') GROUP BY window_start, window_end"
            .to_owned(),
    ] {
        ctx.sql(&sql).await?.collect().await?;
    }
    let producer_handle = {
        let servers = servers.clone();
        std::thread::spawn(move || -> Result<()> {
            let producer = new_producer(&servers)?;
            let until = Instant::now() + Duration::from_secs(latency_seconds);
            let mut i = 0;
            while Instant::now() < until {
                let value = event(i, &rfc3339(now_ms()));
                send(&producer, "live", (i % 2) as i32, value.as_bytes());
                producer.poll(Duration::ZERO);
                i += 1;
                std::thread::sleep(Duration::from_micros(500));
            }
            producer.flush(Duration::from_secs(30))?;
            Ok(())
        })
    };
    tokio::task::spawn_blocking(move || producer_handle.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the latency producer panicked"))??;
    tokio::time::sleep(Duration::from_secs(2)).await;
    streams.shutdown();

    let consumer = reader(&servers, "counts")?;
    let mut latencies = Vec::new();
    let mut quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(1) {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            let message = message?;
            let row: serde_json::Value =
                serde_json::from_slice(message.payload().unwrap_or(b"{}"))?;
            let end = row["window_end"].as_str().context("window_end")?;
            let end_ms = string_to_timestamp_nanos(end)? / 1_000_000;
            if let Some(written) = message.timestamp().to_millis() {
                latencies.push((written - end_ms) as f64);
            }
            quiet = Instant::now();
        }
    }
    // The first windows include the sink's start-up; the last may close only by idleness.
    latencies.sort_by(f64::total_cmp);
    Ok(StreamReport {
        events,
        event_bytes: bytes / events.max(1),
        avro_event_bytes: avro_bytes / events.max(1),
        json,
        avro,
        windows: latencies.len(),
        close_to_alert_p50_ms: percentile(&latencies, 0.5),
        close_to_alert_p99_ms: percentile(&latencies, 0.99),
    })
}

impl Ingest {
    fn json(&self, events: usize) -> serde_json::Value {
        serde_json::json!({
            "seconds": self.seconds,
            "events_per_second": events as f64 / self.seconds,
            "thread_cpu_seconds": self.thread_cpu_seconds,
            "events_per_core_second": self.per_core(events),
            "process_cpu_seconds": self.process_cpu_seconds,
            "events_per_process_cpu_second": events as f64 / self.process_cpu_seconds.max(0.01),
        })
    }

    /// Events per CPU second of the ingestion thread (events/s per core).
    pub fn per_core(&self, events: usize) -> f64 {
        events as f64 / self.thread_cpu_seconds.max(0.01)
    }
}

impl StreamReport {
    /// The report as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "events": self.events,
            "event_bytes": self.event_bytes,
            "avro_event_bytes": self.avro_event_bytes,
            "ingest_json": self.json.json(self.events),
            "ingest_avro": self.avro.json(self.events),
            "windows": self.windows,
            "close_to_alert_p50_ms": self.close_to_alert_p50_ms,
            "close_to_alert_p99_ms": self.close_to_alert_p99_ms,
        })
    }

    /// The report as a markdown table.
    pub fn markdown(&self) -> String {
        let n = self.events as f64;
        let (j, a) = (&self.json, &self.avro);
        format!(
            "| measure | JSON ({} bytes/event) | Avro ({} bytes/event) |\n|---|---|---|\n\
             | events ingested | {} | {} |\n\
             | ingest wall time | {:.2} s | {:.2} s |\n\
             | ingest rate | {:.0} events/s | {:.0} events/s |\n\
             | ingest thread CPU | {:.2} s | {:.2} s |\n\
             | ingest per core (decoding thread; Flink Nexmark q0: 155 000) | {:.0} events/s | {:.0} events/s |\n\
             | ingest per CPU second of the process (librdkafka and mock broker included) | {:.0} events/s | {:.0} events/s |\n\
             \n| measure | value |\n|---|---|\n\
             | window close → alert on the sink topic, p50 | {:.0} ms ({} windows) |\n\
             | window close → alert on the sink topic, p99 | {:.0} ms |\n",
            self.event_bytes,
            self.avro_event_bytes,
            self.events,
            self.events,
            j.seconds,
            a.seconds,
            n / j.seconds,
            n / a.seconds,
            j.thread_cpu_seconds,
            a.thread_cpu_seconds,
            j.per_core(self.events),
            a.per_core(self.events),
            n / j.process_cpu_seconds.max(0.01),
            n / a.process_cpu_seconds.max(0.01),
            self.close_to_alert_p50_ms,
            self.windows,
            self.close_to_alert_p99_ms,
        )
    }
}

/// The fraud pipeline's end-to-end run (examples/fraud: three windowed rules, one joined
/// with a CSV table of profiles) over a backlog, beside the ingest alone of the same events.
#[derive(Debug)]
pub struct FraudReport {
    /// Transactions (and the three heartbeats that close the last windows).
    pub events: usize,
    /// Cards in the generated traffic.
    pub cards: usize,
    /// Minutes of event time.
    pub minutes: i64,
    /// A live table alone reading the same events.
    pub ingest: Ingest,
    /// Seconds from the pipeline's first statement until every sink emitted its last window.
    pub pipeline_seconds: f64,
    /// CPU seconds of the whole process meanwhile.
    pub pipeline_process_cpu_seconds: f64,
    /// `None`: every event was produced before the pipeline started (a backlog); else the
    /// events were produced as their event time came, sped up this many times.
    pub pace: Option<f64>,
    /// Window close → output committed, per tick that wrote alerts (the sinks' histogram;
    /// upper bounds of its buckets, in seconds): p50 and p99.
    pub close_to_commit: (f64, f64),
    /// Window close → alert on the sink topic, exactly, in ms, p50 and p99 over the alerts
    /// (NaN over a backlog). A window closes when the producer sends the first event at least
    /// the pipeline's watermark delay past its end; the alert's time is its Kafka timestamp.
    pub close_to_alert_ms: (f64, f64),
    /// Whether the sinks kept their open windows' partial states (`fulmen.stream.incremental`)
    /// or re-read their open windows at each tick that emitted.
    pub incremental: bool,
    /// Sink ticks that ran a query.
    pub ticks: u64,
    /// Rows the three sinks read from the live table, all ticks together.
    pub rows_read: u64,
    /// The most partial states the three sinks held at once (sampled every 20 ms).
    pub peak_state_rows: u64,
    /// Alerts written, and the alerts the generator planted (they must be equal).
    pub alerts: usize,
    /// See `alerts`.
    pub planted: usize,
}

/// The value at quantile `q` of sorted `values` (NaN when there are none).
fn percentile(values: &[f64], q: f64) -> f64 {
    values
        .get(((values.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// An alert's window close → write time, in ms: `sent` holds (event time, wall clock) of
/// each paced send in event-time order, and a window closed when the first event at least
/// the watermark delay past its end was sent. `None` without paced sends.
fn close_to_alert_ms(
    sent: &[(i64, i64)],
    message: &rdkafka::message::BorrowedMessage<'_>,
) -> Result<Option<f64>> {
    if sent.is_empty() {
        return Ok(None);
    }
    let row: serde_json::Value = serde_json::from_slice(message.payload().unwrap_or(b"{}"))?;
    let end = row["window_end"]
        .as_str()
        .context("an alert's window_end")?;
    let closes_at = string_to_timestamp_nanos(end)? / 1_000_000 + fulmen_fraud::WATERMARK_MS;
    let first = sent.partition_point(|(ts, _)| *ts < closes_at);
    let closed = sent.get(first).context("no event closed the window")?.1;
    let written = message
        .timestamp()
        .to_millis()
        .context("an alert's timestamp")?;
    Ok(Some((written - closed) as f64))
}

/// A card's partition: by card (as a keyed producer would), spread evenly, since the mock
/// cluster drops what overflows a partition.
fn card_partition(card: &str, partitions: i32) -> i32 {
    let hash = card
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    (hash % partitions as u32) as i32
}

/// Runs the fraud pipeline over `cards` cards and `minutes` of event time (about 1.3
/// transactions per card and 10 minutes), all produced before the pipeline starts, with
/// incremental windows or re-reading open windows. With `pace`, the pipeline's events are
/// produced instead as their event time comes, sped up `pace` times (so the watermark moves
/// at every tick, as in a live service).
pub async fn fraud(
    cards: usize,
    minutes: i64,
    incremental: bool,
    pace: Option<f64>,
) -> Result<FraudReport> {
    let options = fulmen_fraud::Options {
        cards,
        minutes,
        ..fulmen_fraud::Options::default()
    };
    let generated = fulmen_fraud::generate(options);
    let end_ms = fulmen_fraud::START_MS + minutes * 60_000;
    let heartbeat = fulmen_fraud::heartbeat(minutes);
    let cluster = MockCluster::new(1)?;
    let servers = cluster.bootstrap_servers();
    // The mock cluster keeps at most 5 MB per partition and drops older messages: a
    // partition per 2 MB of events (about 130 bytes each, and as much again of overhead).
    let partitions = (generated.transactions.len() * 260 / (4 << 20) + 1).max(3) as i32;
    for topic in ["transactions", "fraud_ingest"] {
        cluster.create_topic(topic, partitions, 1)?;
    }
    cluster.create_topic("alerts", 1, 1)?;
    cluster.create_topic("transactions-dead-letters", 1, 1)?;
    let producer = new_producer(&servers)?;
    for t in &generated.transactions {
        let partition = card_partition(&t.card, partitions);
        let value = t.to_json();
        if pace.is_none() {
            send(&producer, "transactions", partition, value.as_bytes());
        }
        send(&producer, "fraud_ingest", partition, value.as_bytes());
    }
    let heartbeat = heartbeat.to_json();
    for p in 0..partitions {
        for topic in ["transactions", "fraud_ingest"] {
            if topic == "fraud_ingest" || pace.is_none() {
                send(&producer, topic, p, heartbeat.as_bytes());
            }
        }
    }
    producer.flush(Duration::from_secs(300))?;
    let events = generated.transactions.len() + partitions as usize;
    eprintln!("fraud: produced {events} transactions of {cards} cards over {minutes} minutes");

    let ctx = FulmenContext::new()?;
    let streams = fulmen_connectors::install(&ctx);
    // Run after `run` in the same process, whose warm-up table took the mock cluster's
    // first-fetch wait out of the measures.
    let ingest_only = ingest(
        &ctx,
        &streams,
        &servers,
        (
            "fraud_ingest",
            "card VARCHAR, customer VARCHAR, amount DOUBLE, country VARCHAR, ts TIMESTAMP",
        ),
        "",
        events,
    )
    .await?;
    eprintln!("fraud: ingest alone {:.2} s", ingest_only.seconds);

    let dir = std::env::temp_dir().join(format!("fulmen-bench-fraud-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let profiles = dir.join("fraud-profiles.csv");
    std::fs::write(&profiles, fulmen_fraud::profiles_csv(&generated.profiles))?;
    ctx.sql(&format!("SET fulmen.stream.incremental = {incremental}"))
        .await?
        .collect()
        .await?;
    let process_before = process_cpu_seconds();
    let started = Instant::now();
    let mut peak_state_rows = 0;
    for statement in fulmen_fraud::pipeline_statements(&servers, &profiles.to_string_lossy()) {
        // The mock broker answers a fetch that finds nothing only after its whole wait (500 ms
        // by default), where a real broker answers as soon as a message arrives: a short
        // wait keeps the paced runs' latency the pipeline's, not the mock's.
        let statement = statement.replacen(
            "'start' 'earliest',",
            "'start' 'earliest', 'kafka.fetch.wait.max.ms' '10',",
            1,
        );
        ctx.sql(&statement).await?.collect().await?;
    }
    let paced = pace.map(|speedup| {
        let servers = servers.clone();
        let transactions = generated.transactions.clone();
        let heartbeat = heartbeat.clone();
        std::thread::spawn(move || -> Result<Vec<(i64, i64)>> {
            let producer = new_producer(&servers)?;
            let started = Instant::now();
            // (event time, wall clock when sent), in ms: when each window closed.
            let mut sent = Vec::with_capacity(transactions.len() + 1);
            for t in &transactions {
                let due = (t.ts_ms - fulmen_fraud::START_MS) as f64 / speedup;
                let wait = due - started.elapsed().as_secs_f64() * 1000.0;
                if wait > 1.0 {
                    std::thread::sleep(Duration::from_secs_f64(wait / 1000.0));
                }
                let partition = card_partition(&t.card, partitions);
                send(&producer, "transactions", partition, t.to_json().as_bytes());
                sent.push((t.ts_ms, now_ms()));
                producer.poll(Duration::ZERO);
            }
            for p in 0..partitions {
                send(&producer, "transactions", p, heartbeat.as_bytes());
            }
            sent.push((i64::MAX, now_ms()));
            producer.flush(Duration::from_secs(60))?;
            Ok(sent)
        })
    });
    // Every window closes once the heartbeats' watermark passes the last hour's end.
    let last = (end_ms + 3_600_000) * 1_000_000;
    let mut reported = Instant::now();
    loop {
        let sinks = streams.sinks().list();
        peak_state_rows = peak_state_rows.max(sinks.iter().map(|s| s.3.state_rows).sum());
        if sinks.len() == 3
            && sinks
                .iter()
                .all(|(_, _, _, s)| s.emitted_up_to.is_some_and(|e| e >= last))
        {
            break;
        }
        if let Some((name, _, _, s)) = sinks.iter().find(|(_, _, _, s)| s.failing_since.is_some()) {
            bail!("sink {name} fails: {:?}", s.last_error);
        }
        if started.elapsed() > Duration::from_secs(1800) {
            bail!("the pipeline did not finish in 30 minutes");
        }
        if reported.elapsed() > Duration::from_secs(30) {
            reported = Instant::now();
            eprintln!(
                "fraud: {:.0} s, emitted up to {:?}",
                started.elapsed().as_secs_f64(),
                sinks
                    .iter()
                    .map(|(n, _, _, s)| (
                        n.clone(),
                        s.emitted_up_to
                            .map(|e| (e / 1_000_000 - fulmen_fraud::START_MS) / 60_000)
                    ))
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pipeline_seconds = started.elapsed().as_secs_f64();
    let pipeline_process_cpu_seconds = process_cpu_seconds() - process_before;
    let sent = match paced {
        Some(producer) => producer
            .join()
            .map_err(|_| anyhow::anyhow!("the fraud producer panicked"))??,
        None => Vec::new(),
    };
    let sinks = streams.sinks().list();
    let ticks = sinks.iter().map(|(_, _, _, s)| s.runs).sum();
    let mut buckets = [0u64; fulmen_connectors::sink::Latency::BOUNDS.len() + 1];
    for (_, _, _, s) in &sinks {
        for (total, n) in buckets.iter_mut().zip(s.latency.buckets) {
            *total += n;
        }
    }
    let bound = |q: f64| {
        let count: u64 = buckets.iter().sum();
        let mut seen = 0;
        for (i, n) in buckets.iter().enumerate() {
            seen += n;
            if count > 0 && seen as f64 >= q * count as f64 {
                return fulmen_connectors::sink::Latency::BOUNDS
                    .get(i)
                    .copied()
                    .unwrap_or(f64::INFINITY);
            }
        }
        f64::NAN
    };
    let close_to_commit = (bound(0.5), bound(0.99));
    let rows_read = sinks.iter().map(|(_, _, _, s)| s.rows_read).sum();
    let modes: Vec<_> = sinks.iter().map(|(_, _, _, s)| s.mode).collect();
    let expected = if incremental {
        "incremental"
    } else {
        "windowed"
    };
    if modes.iter().any(|m| *m != expected) {
        bail!("the fraud sinks run as {modes:?}, not {expected}");
    }
    streams.shutdown();
    let _ = std::fs::remove_dir_all(&dir);

    let consumer = reader(&servers, "alerts")?;
    let (mut alerts, mut quiet) = (0, Instant::now());
    let mut latencies = Vec::new();
    while quiet.elapsed() < Duration::from_secs(1) {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            let message = message?;
            alerts += 1;
            quiet = Instant::now();
            if let Some(ms) = close_to_alert_ms(&sent, &message)? {
                latencies.push(ms);
            }
        }
    }
    latencies.sort_by(f64::total_cmp);
    Ok(FraudReport {
        events,
        cards,
        minutes,
        ingest: ingest_only,
        pipeline_seconds,
        pipeline_process_cpu_seconds,
        pace,
        close_to_commit,
        close_to_alert_ms: (percentile(&latencies, 0.5), percentile(&latencies, 0.99)),
        incremental,
        ticks,
        rows_read,
        peak_state_rows,
        alerts,
        planted: generated.planted.len(),
    })
}

impl FraudReport {
    /// The report as JSON.
    pub fn json(&self) -> serde_json::Value {
        let n = self.events as f64;
        serde_json::json!({
            "events": self.events,
            "cards": self.cards,
            "minutes": self.minutes,
            "ingest_only": self.ingest.json(self.events),
            "pipeline_seconds": self.pipeline_seconds,
            "pipeline_events_per_second": n / self.pipeline_seconds,
            "pipeline_process_cpu_seconds": self.pipeline_process_cpu_seconds,
            "pipeline_events_per_process_cpu_second": n / self.pipeline_process_cpu_seconds.max(0.01),
            "pipeline_over_ingest": self.pipeline_seconds / self.ingest.seconds,
            "pace": self.pace,
            "close_to_commit_p50_seconds_at_most": self.close_to_commit.0,
            "close_to_commit_p99_seconds_at_most": self.close_to_commit.1,
            "close_to_alert_p50_ms": self.close_to_alert_ms.0,
            "close_to_alert_p99_ms": self.close_to_alert_ms.1,
            "incremental": self.incremental,
            "sink_ticks": self.ticks,
            "sink_rows_read": self.rows_read,
            "peak_state_rows": self.peak_state_rows,
            "alerts": self.alerts,
            "planted": self.planted,
        })
    }

    /// The report as a markdown table.
    pub fn markdown(&self) -> String {
        let n = self.events as f64;
        format!(
            "| fraud pipeline ({} events, {} cards, {} minutes of event time), {} | value |\n|---|---|\n\
             | ingest alone | {:.2} s, {:.0} events/s |\n\
             | the three rules, end to end ({}) | {:.2} s, {:.0} events/s ({:.1}× the ingest time) |\n\
             | end to end per CPU second of the process | {:.0} events/s |\n\
             | window close → alerts committed (sinks' histogram), p50 / p99 | ≤ {:.0} ms / ≤ {:.0} ms |\n\
             | window close → alert on the topic, p50 / p99 (paced runs) | {:.0} ms / {:.0} ms |\n\
             | sink ticks | {} |\n\
             | rows the sinks read / partial states held at most | {} / {} |\n\
             | alerts written / planted | {} / {} |\n",
            self.events,
            self.cards,
            self.minutes,
            if self.incremental {
                "incremental windows"
            } else {
                "open windows re-read"
            },
            self.ingest.seconds,
            n / self.ingest.seconds,
            match self.pace {
                None => "backlog".to_owned(),
                Some(p) => format!("produced as event time came, {p}× sped up"),
            },
            self.pipeline_seconds,
            n / self.pipeline_seconds,
            self.pipeline_seconds / self.ingest.seconds,
            n / self.pipeline_process_cpu_seconds.max(0.01),
            self.close_to_commit.0 * 1000.0,
            self.close_to_commit.1 * 1000.0,
            self.close_to_alert_ms.0,
            self.close_to_alert_ms.1,
            self.ticks,
            self.rows_read,
            self.peak_state_rows,
            self.alerts,
            self.planted,
        )
    }
}
