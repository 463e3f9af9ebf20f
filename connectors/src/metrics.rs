//! Prometheus metrics and a health check for a pipeline run as a service
//! (`fulmen run --metrics 127.0.0.1:9464`).
//!
//! - `GET /metrics`: OpenMetrics text, gathered at each scrape ([`PipelineCollector`], a
//!   `prometheus-client` collector): per live table (label `table`) messages, rows,
//!   malformed, late, dead-lettered, errors, rows held, lag and watermark; per sink (label
//!   `sink`) ticks, messages written, failed ticks, whether it is failing now, and the
//!   window-close-to-write latency histogram; per device (label `device`) every count of
//!   `fulmen_devices()` where the session uses devices.
//! - `GET /health`: `200 ok` while every sink's ticks succeed, `503` naming the sinks whose
//!   current ticks fail.
//!
//! The server is a few lines over a tokio listener: one request per connection, `GET`
//! only, the request head read with a size and time limit.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::array::AsArray;
use datafusion::arrow::datatypes::{DataType, UInt64Type};
use fulmen_engine::FulmenContext;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::sink::Latency;
use crate::streams::Streams;

/// Gathers the pipeline's figures at each scrape.
pub struct PipelineCollector {
    streams: Arc<Streams>,
    ctx: FulmenContext,
}

impl std::fmt::Debug for PipelineCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PipelineCollector")
    }
}

type Labels = [(&'static str, String); 1];

/// One metric family: a descriptor, then a value per label set.
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    values: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let values: Vec<_> = values.into_iter().collect();
    if values.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in &values {
        value.encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: i64) -> ConstGauge<i64> {
    ConstGauge::new(v)
}

impl Collector for PipelineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let tables: Vec<_> = self.streams.tables().iter().map(|t| t.status()).collect();
        let e = &mut encoder;
        let (c, g) = (MetricType::Counter, MetricType::Gauge);
        type TableCount = fn(&crate::live::StreamStatus) -> u64;
        let table_counts: [(&str, &str, TableCount); 6] = [
            ("fulmen_stream_messages", "Kafka messages read", |t| {
                t.messages
            }),
            ("fulmen_stream_rows", "Rows added to the live table", |t| {
                t.rows
            }),
            (
                "fulmen_stream_malformed",
                "Messages that could not be decoded",
                |t| t.malformed,
            ),
            ("fulmen_stream_late", "Rows older than the watermark", |t| {
                t.late
            }),
            (
                "fulmen_stream_dead_lettered",
                "Messages written to the dead-letter topic",
                |t| t.dead_lettered,
            ),
            (
                "fulmen_stream_errors",
                "Errors from the brokers or the dead-letter topic",
                |t| t.errors,
            ),
        ];
        for (name, help, value) in table_counts {
            let rows = tables
                .iter()
                .map(|t| ([("table", t.name.clone())], counter(value(t))));
            family(e, name, help, c, rows)?;
        }
        family(
            e,
            "fulmen_stream_rows_held",
            "Rows the live table holds now",
            g,
            tables
                .iter()
                .map(|t| ([("table", t.name.clone())], gauge(t.rows_held as i64))),
        )?;
        family(
            e,
            "fulmen_stream_lag",
            "Messages in the topic not read yet",
            g,
            tables
                .iter()
                .filter_map(|t| Some(([("table", t.name.clone())], gauge(t.lag?)))),
        )?;
        family(
            e,
            "fulmen_stream_watermark_seconds",
            "Event-time watermark, seconds since the epoch",
            g,
            tables.iter().filter_map(|t| {
                let w = t.watermark? as f64 / 1e9;
                Some(([("table", t.name.clone())], ConstGauge::new(w)))
            }),
        )?;

        let sinks = self.streams.sinks().list();
        type SinkCount = fn(&crate::sink::SinkStatus) -> u64;
        let sink_counts: [(&str, &str, SinkCount); 4] = [
            ("fulmen_sink_ticks", "Ticks that completed", |s| s.runs),
            (
                "fulmen_sink_rows_written",
                "Messages written to the sink's topic",
                |s| s.rows_written,
            ),
            (
                "fulmen_sink_rows_read",
                "Rows the sink's ticks read from live tables",
                |s| s.rows_read,
            ),
            (
                "fulmen_sink_failures",
                "Ticks that failed (and were retried)",
                |s| s.failures,
            ),
        ];
        for (name, help, value) in sink_counts {
            let rows = sinks
                .iter()
                .map(|(n, _, _, s)| ([("sink", n.clone())], counter(value(s))));
            family(e, name, help, c, rows)?;
        }
        family(
            e,
            "fulmen_sink_state_rows",
            "Partial aggregate states an incremental sink holds for its open windows",
            g,
            sinks
                .iter()
                .map(|(name, _, _, s)| ([("sink", name.clone())], gauge(s.state_rows as i64))),
        )?;
        family(
            e,
            "fulmen_sink_failing",
            "1 while the sink's ticks fail",
            g,
            sinks.iter().map(|(name, _, _, s)| {
                (
                    [("sink", name.clone())],
                    gauge(i64::from(s.failing_since.is_some())),
                )
            }),
        )?;
        if !sinks.is_empty() {
            let mut metric = e.encode_descriptor(
                "fulmen_sink_window_latency_seconds",
                "From the watermark passing windows' end to their output written and committed",
                None,
                MetricType::Histogram,
            )?;
            for (name, _, _, s) in &sinks {
                let labels = [("sink", name.clone())];
                let buckets: Vec<(f64, u64)> = Latency::BOUNDS
                    .iter()
                    .copied()
                    .chain([f64::INFINITY])
                    .zip(s.latency.buckets)
                    .collect();
                metric
                    .encode_family(&labels)?
                    .encode_histogram::<NoLabelSet>(
                        s.latency.sum,
                        s.latency.count,
                        &buckets,
                        None,
                    )?;
            }
        }

        // Devices, when the session uses any: every count column of fulmen_devices().
        let config = self.ctx.fulmen_config();
        if config.devices != fulmen_engine::DeviceSelection::None
            && let Ok(listing) = fulmen_engine::gpu::listing::listing(&config)
            && listing.num_rows() > 0
        {
            let names = listing.column(0).as_string::<i32>();
            for (i, field) in listing.schema().fields().iter().enumerate() {
                if field.data_type() != &DataType::UInt64 {
                    continue;
                }
                let values = listing.column(i).as_primitive::<UInt64Type>();
                let memory = field.name().starts_with("memory_");
                let name = format!("fulmen_device_{}", field.name());
                let rows = (0..listing.num_rows())
                    .map(|r| ([("device", names.value(r).to_string())], values.value(r)));
                if memory {
                    let rows = rows.map(|(l, v)| (l, gauge(v as i64)));
                    family(e, &name, "Device memory, bytes (fulmen_devices())", g, rows)?;
                } else {
                    let rows = rows.map(|(l, v)| (l, counter(v)));
                    family(
                        e,
                        &name,
                        "Device work since the process opened it (fulmen_devices())",
                        c,
                        rows,
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// The metrics text now.
pub fn render(streams: &Arc<Streams>, ctx: &FulmenContext) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(PipelineCollector {
        streams: Arc::clone(streams),
        ctx: ctx.clone(),
    }));
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

/// The sinks whose current ticks fail, with their last error; empty when healthy.
pub fn unhealthy(streams: &Streams) -> Vec<String> {
    streams
        .sinks()
        .failing()
        .into_iter()
        .map(|(name, failing, error)| {
            format!(
                "sink '{name}' failing for {:.0} s: {error}",
                failing.as_secs_f64()
            )
        })
        .collect()
}

/// Serves `/metrics` and `/health` on `addr` until the returned task is aborted; the
/// address it listens on (port 0 picks a free one).
pub async fn serve(
    addr: SocketAddr,
    streams: Arc<Streams>,
    ctx: FulmenContext,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                continue;
            };
            let (streams, ctx) = (Arc::clone(&streams), ctx.clone());
            tokio::spawn(async move {
                if let Err(e) = answer(socket, &streams, &ctx).await {
                    log::debug!("metrics: {e}");
                }
            });
        }
    });
    Ok((local, task))
}

async fn answer(
    mut socket: tokio::net::TcpStream,
    streams: &Arc<Streams>,
    ctx: &FulmenContext,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
            let n = socket.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request head"))??;
    let head = String::from_utf8_lossy(&head);
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET", "/metrics") => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            render(streams, ctx),
        ),
        ("GET", "/health") => {
            let problems = unhealthy(streams);
            if problems.is_empty() {
                ("200 OK", "text/plain", "ok\n".to_string())
            } else {
                (
                    "503 Service Unavailable",
                    "text/plain",
                    problems.join("\n") + "\n",
                )
            }
        }
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "try /metrics or /health\n".into(),
        ),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    };
    let mut response = String::new();
    let _ = write!(
        response,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(response.as_bytes()).await?;
    socket.shutdown().await
}
