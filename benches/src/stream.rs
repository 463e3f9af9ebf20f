//! `volley-bench stream`: Kafka ingest rate into a live table, and the time from a window's
//! close to its alert on the sink topic. Both run against librdkafka's in-process mock
//! cluster, so the broker shares the machine (and the process) with Volley.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use datafusion::arrow::compute::kernels::cast_utils::string_to_timestamp_nanos;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use volley_engine::VolleyContext;
use volley_fraud::rfc3339;

/// What the streaming benchmark measured.
#[derive(Debug)]
pub struct StreamReport {
    /// Events ingested.
    pub events: usize,
    /// Average size of an event's JSON, bytes.
    pub event_bytes: usize,
    /// Seconds from `CREATE EXTERNAL TABLE` until every event was held.
    pub ingest_seconds: f64,
    /// Events per second of wall time.
    pub ingest_events_per_second: f64,
    /// CPU seconds the table's ingestion thread used.
    pub ingest_thread_cpu_seconds: f64,
    /// Events per CPU second of the ingestion thread (events/s per core).
    pub ingest_events_per_core_second: f64,
    /// CPU seconds of the whole process meanwhile (librdkafka's threads and the in-process
    /// mock broker included).
    pub ingest_process_cpu_seconds: f64,
    /// Events per CPU second of the whole process.
    pub ingest_events_per_process_cpu_second: f64,
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

fn send(producer: &BaseProducer, topic: &str, partition: i32, value: &str) {
    let mut record = BaseRecord::<(), str>::to(topic)
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

/// CPU seconds used so far by this process's threads whose name starts with `prefix`.
fn thread_cpu_seconds(prefix: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let mut total = 0.0;
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.trim().starts_with(prefix) {
            continue;
        }
        total += stat_cpu_seconds(
            &std::fs::read_to_string(task.path().join("stat")).unwrap_or_default(),
        );
    }
    total
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Runs both measurements.
pub async fn run(events: usize, latency_seconds: u64) -> Result<StreamReport> {
    let cluster = MockCluster::new(1)?;
    let servers = cluster.bootstrap_servers();
    // The mock cluster keeps at most 5 MB (and 100 000 message sets) per partition and
    // drops older messages, so the topic gets a partition per 4 MB of events.
    let partitions = (events * 200 / (4 << 20) + 1).max(4) as i32;
    cluster.create_topic("ingest", partitions, 1)?;
    cluster.create_topic("live", 2, 1)?;
    cluster.create_topic("counts", 1, 1)?;

    // 1. Ingest: the topic is filled first, then a live table reads it from the start.
    let producer = new_producer(&servers)?;
    let mut bytes = 0;
    for i in 0..events {
        let value = event(i, "2026-01-01T00:00:00.000Z");
        bytes += value.len();
        send(&producer, "ingest", i as i32 % partitions, &value);
    }
    producer.flush(Duration::from_secs(120))?;
    eprintln!("produced {events} events");
    let ctx = VolleyContext::new()?;
    let streams = volley_connectors::install(&ctx);
    let cpu_before = thread_cpu_seconds("volley-ingest");
    let process_before = process_cpu_seconds();
    let started = Instant::now();
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE ingest ({COLUMNS}) STORED AS KAFKA LOCATION 'ingest' \
         OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest')"
    ))
    .await?;
    let table = streams
        .tables()
        .into_iter()
        .find(|t| t.name == "ingest")
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
    let ingest_seconds = started.elapsed().as_secs_f64();
    let cpu = thread_cpu_seconds("volley-ingest") - cpu_before;
    let process_cpu = process_cpu_seconds() - process_before;
    table.stop();
    drop(table);

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
                send(&producer, "live", (i % 2) as i32, &value);
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

    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &servers)
        .set("group.id", "bench-reader")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset("counts", 0, Offset::Beginning)?;
    consumer.assign(&tpl)?;
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
    let percentile = |p: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    Ok(StreamReport {
        events,
        event_bytes: bytes / events.max(1),
        ingest_seconds,
        ingest_events_per_second: events as f64 / ingest_seconds,
        ingest_thread_cpu_seconds: cpu,
        ingest_events_per_core_second: events as f64 / cpu.max(0.01),
        ingest_process_cpu_seconds: process_cpu,
        ingest_events_per_process_cpu_second: events as f64 / process_cpu.max(0.01),
        windows: latencies.len(),
        close_to_alert_p50_ms: percentile(0.5),
        close_to_alert_p99_ms: percentile(0.99),
    })
}

impl StreamReport {
    /// The report as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "events": self.events,
            "event_bytes": self.event_bytes,
            "ingest_seconds": self.ingest_seconds,
            "ingest_events_per_second": self.ingest_events_per_second,
            "ingest_thread_cpu_seconds": self.ingest_thread_cpu_seconds,
            "ingest_events_per_core_second": self.ingest_events_per_core_second,
            "ingest_process_cpu_seconds": self.ingest_process_cpu_seconds,
            "ingest_events_per_process_cpu_second": self.ingest_events_per_process_cpu_second,
            "windows": self.windows,
            "close_to_alert_p50_ms": self.close_to_alert_p50_ms,
            "close_to_alert_p99_ms": self.close_to_alert_p99_ms,
        })
    }

    /// The report as a markdown table.
    pub fn markdown(&self) -> String {
        format!(
            "| measure | value |\n|---|---|\n\
             | events ingested (JSON, {} bytes each) | {} |\n\
             | ingest wall time | {:.2} s |\n\
             | ingest rate | {:.0} events/s |\n\
             | ingest thread CPU | {:.2} s |\n\
             | ingest per core (decoding thread) | {:.0} events/s (Flink Nexmark q0: 155 000) |\n\
             | ingest per CPU second of the process (librdkafka and mock broker included) | {:.0} events/s |\n\
             | window close → alert on the sink topic, p50 | {:.0} ms ({} windows) |\n\
             | window close → alert on the sink topic, p99 | {:.0} ms |\n",
            self.event_bytes,
            self.events,
            self.ingest_seconds,
            self.ingest_events_per_second,
            self.ingest_thread_cpu_seconds,
            self.ingest_events_per_core_second,
            self.ingest_events_per_process_cpu_second,
            self.close_to_alert_p50_ms,
            self.windows,
            self.close_to_alert_p99_ms,
        )
    }
}
