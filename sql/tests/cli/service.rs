//! `fulmen run` as a service against librdkafka's mock cluster (started here, on a port
//! it picks): SIGTERM flushes, commits and exits 0; a restart from the committed offsets
//! loses and repeats nothing; the metrics endpoint counts what was read and written; a
//! sink that keeps failing ends the process with status 2. Also piped input running
//! statement by statement as it arrives.

use std::io::{BufRead, BufReader, Read};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::*;

fn cluster(topics: &[(&str, i32)]) -> MockCluster<'static, DefaultProducerContext> {
    let cluster = MockCluster::new(1).expect("mock cluster");
    for (topic, partitions) in topics {
        cluster.create_topic(topic, *partitions, 1).expect("topic");
    }
    cluster
}

/// Produces `values` round-robin over `partitions` and waits for the acknowledgements.
fn produce(servers: &str, topic: &str, partitions: i32, values: &[String]) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .create()
        .expect("producer");
    for (i, value) in values.iter().enumerate() {
        let mut record = Some(
            BaseRecord::<(), String>::to(topic)
                .partition(i as i32 % partitions)
                .payload(value),
        );
        while let Some(r) = record.take() {
            if let Err((_, back)) = producer.send(r) {
                producer.poll(Duration::from_millis(10));
                record = Some(back);
            }
        }
    }
    producer.flush(Duration::from_secs(30)).expect("flush");
}

/// Every message of `topic` once at least `at_least` arrived and the topic went quiet.
fn read_topic(servers: &str, topic: &str, at_least: usize) -> Vec<String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("group.id", "test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    let (mut out, deadline, mut quiet) = (
        Vec::new(),
        Instant::now() + Duration::from_secs(60),
        Instant::now(),
    );
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                out.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
                quiet = Instant::now();
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            None if out.len() >= at_least && quiet.elapsed() > Duration::from_millis(700) => break,
            None => {}
        }
    }
    out
}

/// The committed offsets of group `group` on `topic`'s partitions.
fn committed(servers: &str, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let got = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    got.elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => o,
            other => panic!("partition {}: {other:?}", e.partition()),
        })
        .collect()
}

fn payments(from: usize, to: usize) -> Vec<String> {
    (from..to)
        .map(|i| format!(r#"{{"id":{i},"amount":{}}}"#, i % 300))
        .collect()
}

/// A running `fulmen run`, its stderr lines collected by a thread.
struct Service {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Service {
    fn start(script: &std::path::Path, extra: &[&str]) -> Self {
        let mut child = fulmen()
            .args(["run", "--devices", "none"])
            .args(extra)
            .arg(script)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fulmen run starts");
        let stderr = child.stderr.take().unwrap();
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = send.send(line);
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a stderr line containing `text`.
    fn wait_line(&mut self, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(text) {
                        return line;
                    }
                }
                Err(_) => break,
            }
        }
        panic!("no line with {text:?} in:\n{}", self.seen.join("\n"));
    }

    /// Sends `signal` and waits for the exit; the status code and the rest of stderr.
    fn stop(self, signal: &str) -> (Option<i32>, String) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args([signal, &pid])
                .status()
                .unwrap()
                .success()
        );
        self.wait()
    }

    fn wait(mut self) -> (Option<i32>, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "fulmen run did not exit:\n{}",
                self.seen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        self.seen.extend(self.lines.try_iter());
        std::thread::sleep(Duration::from_millis(100));
        self.seen.extend(self.lines.try_iter());
        (status.code(), self.seen.join("\n"))
    }
}

/// `GET path` from the metrics server: (status line, body).
fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut socket = std::net::TcpStream::connect(addr).expect("metrics server");
    write!(socket, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

/// The value of the sample `name{labels}` in a metrics text.
fn sample(metrics: &str, name_and_labels: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name_and_labels} in:\n{metrics}"))
}

/// Writes `sql` to pipeline.sql in `dir`.
fn write_script(dir: &tempfile::TempDir, sql: &str) -> std::path::PathBuf {
    let script = dir.path().join("pipeline.sql");
    std::fs::write(&script, sql).unwrap();
    script
}

#[test]
fn run_serves_until_sigterm_then_resumes_from_the_committed_offsets() {
    let cluster = cluster(&[("pay", 2), ("big", 1)]);
    let servers = cluster.bootstrap_servers();
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        &dir,
        &format!(
            "CREATE EXTERNAL TABLE pay (id BIGINT, amount BIGINT) STORED AS KAFKA LOCATION 'pay' \
             OPTIONS ('bootstrap.servers' '{servers}', 'group.id' 'service', 'start' 'committed');\n\
             CREATE EXTERNAL TABLE big (id BIGINT, amount BIGINT) STORED AS KAFKA LOCATION 'big' \
             OPTIONS ('bootstrap.servers' '{servers}', 'format' 'csv');\n\
             CREATE SINK big_payments INTO big AS SELECT id, amount FROM pay WHERE amount >= 200;\n"
        ),
    );
    let expected = |n: usize| (0..n).filter(|i| i % 300 >= 200).count();

    produce(&servers, "pay", 2, &payments(0, 600));
    let mut service = Service::start(&script, &["--metrics", "127.0.0.1:0"]);
    let line = service.wait_line("metrics on http://");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap()
        .to_string();
    let first = read_topic(&servers, "big", expected(600));
    assert_eq!(first.len(), expected(600), "{first:?}");
    let (status, body) = http_get(&addr, "/health");
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    // The counters equal what was produced and written (a tick may still be finishing
    // its bookkeeping: wait for it).
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let (status, metrics) = http_get(&addr, "/metrics");
        assert_eq!(status, "HTTP/1.1 200 OK");
        let written = sample(
            &metrics,
            "fulmen_sink_rows_written_total{sink=\"big_payments\"}",
        );
        if written as usize == expected(600) || Instant::now() > deadline {
            break metrics;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        sample(&metrics, "fulmen_stream_messages_total{table=\"pay\"}"),
        600.0,
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "fulmen_stream_rows_total{table=\"pay\"}"),
        600.0
    );
    assert_eq!(
        sample(
            &metrics,
            "fulmen_sink_rows_written_total{sink=\"big_payments\"}"
        ),
        expected(600) as f64
    );
    assert_eq!(
        sample(&metrics, "fulmen_sink_failing{sink=\"big_payments\"}"),
        0.0
    );
    assert!(
        metrics.contains("fulmen_sink_window_latency_seconds_bucket{"),
        "{metrics}"
    );
    assert_eq!(http_get(&addr, "/nothing").0, "HTTP/1.1 404 Not Found");

    let (code, log) = service.stop("-TERM");
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("SIGTERM: stopping"), "{log}");
    assert!(
        log.contains(&format!(
            "sink 'big_payments' stopped: {} messages written",
            expected(600)
        )),
        "{log}"
    );
    // Everything read was committed before the exit.
    assert_eq!(committed(&servers, "service", "pay", 2), vec![300, 300]);

    // Restarted: it resumes at the committed offsets, so it writes only the new rows.
    produce(&servers, "pay", 2, &payments(600, 900));
    let service = Service::start(&script, &[]);
    let all = read_topic(&servers, "big", expected(900));
    let (code, log) = service.stop("-INT");
    assert_eq!(code, Some(0), "{log}");
    let mut ids: Vec<i64> = all
        .iter()
        .map(|m| m.split(',').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        ids.len(),
        expected(900),
        "nothing lost, nothing repeated: {all:?}"
    );
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), expected(900), "no message twice: {all:?}");
    assert_eq!(committed(&servers, "service", "pay", 2), vec![450, 450]);
}

#[test]
fn a_sink_that_keeps_failing_ends_the_service_with_status_2() {
    let cluster = cluster(&[("raw", 1), ("out", 1)]);
    let servers = cluster.bootstrap_servers();
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        &dir,
        &format!(
            "CREATE EXTERNAL TABLE raw (v VARCHAR) STORED AS KAFKA LOCATION 'raw' \
             OPTIONS ('bootstrap.servers' '{servers}', 'start' 'earliest');\n\
             CREATE EXTERNAL TABLE out (n INT) STORED AS KAFKA LOCATION 'out' \
             OPTIONS ('bootstrap.servers' '{servers}', 'format' 'csv');\n\
             CREATE SINK parse INTO out AS SELECT CAST(v AS INT) AS n FROM raw;\n"
        ),
    );
    produce(&servers, "raw", 1, &[r#"{"v":"not a number"}"#.to_string()]);
    let started = Instant::now();
    let service = Service::start(&script, &["--sink-failure-timeout", "1"]);
    let (code, log) = service.wait();
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("WARN") && log.contains("sink 'parse': tick failed (retrying)"),
        "{log}"
    );
    assert!(
        log.contains("Error: sink 'parse' failed every tick for"),
        "{log}"
    );
    assert!(log.contains("not a number"), "the error says why: {log}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn piped_statements_run_as_they_arrive() {
    let mut child = fulmen()
        .args(["--devices", "none", "-q", "--format", "csv"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("fulmen starts");
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    // The first statement's answer comes while the pipe is still open.
    writeln!(stdin, "SELECT 41 + 1 AS answer;").unwrap();
    let mut lines = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        lines.push(line.trim_end().to_string());
    }
    assert_eq!(lines, ["answer", "42"]);
    // A statement over several lines runs once its `;` arrives; the rest at the end.
    writeln!(stdin, "SELECT 'a;\nb' AS s").unwrap();
    writeln!(stdin, "  ; SELECT 7 AS seven").unwrap();
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(rest, "s\n\"a;\nb\"\nseven\n7\n");
}
