//! Continuous queries: `CREATE SINK name INTO kafka_table AS query` runs `query` on a tick
//! until `DROP SINK name`, writing what it produces to the Kafka table's topic.
//!
//! A query is run in one of two modes, chosen from its plan:
//!
//! - **Windowed** (it uses `TUMBLE`, `HOP` or `SESSION`): each tick reads the watermark `W`
//!   of its live sources (the smallest of them) and, when it moved past the last emitted
//!   `E`, runs the query over the live tables' snapshots with the window functions emitting
//!   only windows ending in `(E, W]`. A row older than the watermark is never added to a
//!   live table, so every window is emitted once, complete.
//! - **Append** (no windows): each tick runs the query over the rows of its one live source
//!   that arrived since the previous tick (offsets `[from, to)` per partition).
//!
//! ```text
//!  tick ──▶ watermark / new offsets ──▶ run query in scope ──▶ produce rows ──▶ flush
//!                                                                                │
//!       source offsets committed (with E in their metadata) only after flush ◀───┘
//! ```
//!
//! Delivery: at-least-once commits the source offsets after the sink topic acknowledged
//! every message; exactly-once writes the messages and the offsets in one Kafka
//! transaction. The committed offsets point at the oldest row an open window still needs,
//! and their metadata records `E`, so a restarted sink (`'start' 'committed'`) re-reads what
//! it needs and does not emit again what was already committed.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::{plan_datafusion_err, plan_err};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::prelude::SessionContext;
use fulmen_engine::streaming::StreamScope;
use rdkafka::consumer::Consumer;
use rdkafka::producer::Producer as _;

use crate::format::Encoder;
use crate::live::{LiveScope, LiveTable, OffsetRange, Shared};
use crate::options::Delivery;
use crate::producer::{Producer, kafka_error};

/// How often a sink looks for new input.
pub const TICK: Duration = Duration::from_millis(100);

/// A running continuous query.
pub struct Sink {
    /// Its name.
    pub name: String,
    /// The Kafka table it writes to.
    pub target: String,
    /// The query.
    pub query: String,
    status: Arc<Mutex<SinkStatus>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What `SHOW SINKS` tells of a sink.
#[derive(Debug, Clone, Default)]
pub struct SinkStatus {
    /// `windowed` or `append`.
    pub mode: &'static str,
    /// `at_least_once` or `exactly_once`.
    pub delivery: &'static str,
    /// Ticks that wrote output (or found nothing new to write).
    pub runs: u64,
    /// Messages written.
    pub rows_written: u64,
    /// Windows ending at or before this instant (nanoseconds) are emitted.
    pub emitted_up_to: Option<i64>,
    /// Ticks that failed (and were retried).
    pub failures: u64,
    /// The last failure.
    pub last_error: Option<String>,
    /// When the sink's current run of failed ticks began (`None` while its ticks succeed).
    pub failing_since: Option<Instant>,
    /// Windowed sinks: from the watermark moving past windows' end to their output being
    /// written and committed, per tick that emitted.
    pub latency: Latency,
}

/// A histogram of seconds with fixed buckets ([`Latency::BOUNDS`]).
#[derive(Debug, Clone, Default)]
pub struct Latency {
    /// Observations per bucket (the last one: above every bound).
    pub buckets: [u64; Latency::BOUNDS.len() + 1],
    /// Their sum, in seconds.
    pub sum: f64,
    /// How many.
    pub count: u64,
}

impl Latency {
    /// Upper bounds of the buckets, in seconds.
    pub const BOUNDS: [f64; 11] = [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];

    /// Adds one observation.
    pub fn observe(&mut self, seconds: f64) {
        let i = Self::BOUNDS
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(Self::BOUNDS.len());
        self.buckets[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }
}

struct Plan {
    state: SessionState,
    query: String,
    sources: Vec<Arc<Shared>>,
    windowed: bool,
    span: Option<i64>,
    target_topic: String,
    encoder: Encoder,
    delivery: Delivery,
}

impl Sink {
    /// Checks `query` against the Kafka table `target` and starts running it.
    pub async fn start(
        ctx: &SessionContext,
        name: &str,
        target: &str,
        query: &str,
    ) -> Result<Self> {
        let table = ctx.table_provider(target).await?;
        let Some(live) = table.downcast_ref::<LiveTable>() else {
            return plan_err!("a sink writes into a Kafka table; '{target}' is not one");
        };
        let target_shared = Arc::clone(live.shared());
        let state = ctx.state();

        // Plan once, emitting nothing, to learn the query's sources, windows and columns.
        let probe = Arc::new(StreamScope::new(Some(i64::MAX), Some(i64::MAX)));
        let live_scope = Arc::new(LiveScope::default());
        let session = scoped(&state, Arc::clone(&probe), Arc::clone(&live_scope));
        let frame = session.sql(query).await?;
        let output = frame.schema().as_arrow().clone();
        frame.create_physical_plan().await?;
        let windows = probe.windows_used();
        let sources = live_scope.touched();
        let windowed = !windows.is_empty();
        if sources.is_empty() {
            return plan_err!("a sink's query reads at least one Kafka table");
        }
        if windowed {
            if let Some(s) = sources.iter().find(|s| s.options.event_time.is_none()) {
                return plan_err!(
                    "windowed sink: Kafka table '{}' has no 'event_time' option, so it has no \
                     watermark",
                    s.name
                );
            }
        } else if sources.len() > 1 {
            return plan_err!(
                "a sink without windows reads one Kafka table (it sees each tick's new rows \
                 only); this query reads {}",
                sources.len()
            );
        }
        let span = windows
            .iter()
            .map(|w| w.span())
            .collect::<Option<Vec<_>>>()
            .and_then(|s| s.into_iter().max());
        let payload_fields: Vec<_> = target_shared
            .schema
            .fields()
            .iter()
            .filter(|f| !f.name().starts_with('_'))
            .map(|f| f.as_ref().clone())
            .collect();
        for field in &payload_fields {
            if output.column_with_name(field.name()).is_none() {
                return plan_err!(
                    "the query gives no column '{}' for Kafka table '{target}' (it gives {})",
                    field.name(),
                    output
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        let delivery = target_shared.options.delivery;
        if delivery == Delivery::ExactlyOnce
            && (sources.len() != 1 || sources[0].options.group_id.is_none())
        {
            return plan_err!(
                "delivery 'exactly_once' commits the offsets of one Kafka source with a \
                 'group.id' in the same transaction as the output"
            );
        }
        let mut emitted_up_to = None;
        if windowed {
            let marker = format!("fulmen.sink={name};emitted_up_to=");
            for source in &sources {
                if source.options.group_id.is_none() {
                    continue;
                }
                let shared = Arc::clone(source);
                let metadata = tokio::task::spawn_blocking(move || shared.committed_metadata())
                    .await
                    .map_err(|e| DataFusionError::External(Box::new(e)))??;
                for m in metadata {
                    if let Some(v) = m.strip_prefix(&marker).and_then(|v| v.parse::<i64>().ok()) {
                        emitted_up_to = Some(emitted_up_to.map_or(v, |e: i64| e.min(v)));
                    }
                }
            }
        }
        let plan = Plan {
            state,
            query: query.to_owned(),
            sources,
            windowed,
            span,
            target_topic: target_shared.options.topic.clone(),
            encoder: Encoder::try_new(
                &target_shared.options.format,
                Arc::new(Schema::new(payload_fields)),
            )?,
            delivery,
        };
        let producer = {
            let config = target_shared.options.client_config();
            let id = (delivery == Delivery::ExactlyOnce).then(|| format!("fulmen-sink-{name}"));
            tokio::task::spawn_blocking(move || Producer::new(config, id.as_deref()))
                .await
                .map_err(|e| DataFusionError::External(Box::new(e)))??
        };
        let status = Arc::new(Mutex::new(SinkStatus {
            mode: if windowed { "windowed" } else { "append" },
            delivery: match delivery {
                Delivery::AtLeastOnce => "at_least_once",
                Delivery::ExactlyOnce => "exactly_once",
            },
            emitted_up_to,
            ..SinkStatus::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let runner = Runner {
            name: name.to_owned(),
            plan,
            producer,
            status: Arc::clone(&status),
            stop: Arc::clone(&stop),
            emitted_up_to,
            from: BTreeMap::new(),
        };
        log::info!(
            "sink '{name}' started into '{target}' ({}, {})",
            if windowed { "windowed" } else { "append" },
            match delivery {
                Delivery::AtLeastOnce => "at least once",
                Delivery::ExactlyOnce => "exactly once",
            }
        );
        let thread = std::thread::Builder::new()
            .name(format!("fulmen-sink-{name}"))
            .spawn(move || runner.run())
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        Ok(Self {
            name: name.to_owned(),
            target: target.to_owned(),
            query: query.to_owned(),
            status,
            stop,
            thread: Some(thread),
        })
    }

    /// The sink's status now.
    pub fn status(&self) -> SinkStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops the sink and waits for its current tick to end: what that tick wrote is
    /// flushed and its offsets committed (a tick does both before it ends).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let status = self.status();
        log::info!(
            "sink '{}' stopped: {} messages written in {} ticks",
            self.name,
            status.rows_written,
            status.runs
        );
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn scoped(state: &SessionState, streams: Arc<StreamScope>, live: Arc<LiveScope>) -> SessionContext {
    let mut state = state.clone();
    state.config_mut().set_extension(streams);
    state.config_mut().set_extension(live);
    SessionContext::new_with_state(state)
}

struct Runner {
    name: String,
    plan: Plan,
    producer: Producer,
    status: Arc<Mutex<SinkStatus>>,
    stop: Arc<AtomicBool>,
    emitted_up_to: Option<i64>,
    /// Append mode: per partition, the first offset not yet processed.
    from: BTreeMap<i32, i64>,
}

impl Runner {
    fn run(mut self) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => return self.failed(&DataFusionError::External(Box::new(e))),
        };
        while !self.stop.load(Ordering::Acquire) {
            let started = Instant::now();
            match self.tick(&runtime) {
                Ok(()) => self.succeeded(),
                Err(e) => self.failed(&e),
            }
            if let Some(rest) = TICK.checked_sub(started.elapsed()) {
                std::thread::sleep(rest);
            }
        }
    }

    fn failed(&self, e: &DataFusionError) {
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        status.failures += 1;
        let message = e.to_string();
        // One warning per change of error, not one per tick (ten a second).
        if status.failing_since.is_none() || status.last_error.as_deref() != Some(&message) {
            log::warn!("sink '{}': tick failed (retrying): {message}", self.name);
        }
        status.failing_since.get_or_insert_with(Instant::now);
        status.last_error = Some(message);
    }

    fn succeeded(&self) {
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(since) = status.failing_since.take() {
            log::info!(
                "sink '{}': recovered after failing for {:.1} s",
                self.name,
                since.elapsed().as_secs_f64()
            );
        }
    }

    fn tick(&mut self, runtime: &tokio::runtime::Runtime) -> Result<()> {
        let plan = &self.plan;
        let mut closed_at = None;
        let (streams, ranges, watermark) = if plan.windowed {
            let watermarks = plan
                .sources
                .iter()
                .map(|s| s.watermark_and_when())
                .collect::<Option<Vec<_>>>();
            // The smallest watermark, and when it got there: windows up to it closed then.
            let Some((watermark, when)) = watermarks.and_then(|w| w.into_iter().min()) else {
                return Ok(());
            };
            closed_at = Some(when);
            if self.emitted_up_to.is_some_and(|e| watermark <= e) {
                return Ok(());
            }
            let scope = StreamScope::new(self.emitted_up_to, Some(watermark));
            (scope, HashMap::new(), Some(watermark))
        } else {
            let source = &plan.sources[0];
            let to = source.ingested();
            let range: OffsetRange = to
                .iter()
                .map(|(p, to)| (*p, (self.from.get(p).copied().unwrap_or(i64::MIN), *to)))
                .filter(|(_, (from, to))| from < to)
                .collect();
            if range.is_empty() {
                return Ok(());
            }
            let ranges = HashMap::from([(source.name.clone(), range)]);
            (StreamScope::new(None, None), ranges, None)
        };
        let live = Arc::new(LiveScope::new(ranges.clone()));
        let session = scoped(&plan.state, Arc::new(streams), live);
        let batches = runtime.block_on(async {
            let frame = session.sql(&plan.query).await?;
            frame.collect().await
        })?;

        // Offsets to commit once the output is safe.
        let mut commits: Vec<(Arc<Shared>, BTreeMap<i32, i64>, String)> = Vec::new();
        let metadata = match watermark {
            Some(w) => format!("fulmen.sink={};emitted_up_to={w}", self.name),
            None => format!("fulmen.sink={}", self.name),
        };
        for source in &plan.sources {
            if source.options.group_id.is_none() {
                continue;
            }
            let offsets = match watermark {
                Some(w) => source.needed_from(w, plan.span),
                None => ranges
                    .get(&source.name)
                    .map(|r| r.iter().map(|(p, (_, to))| (*p, *to)).collect())
                    .unwrap_or_default(),
            };
            commits.push((Arc::clone(source), offsets, metadata.clone()));
        }

        let transactional = plan.delivery == Delivery::ExactlyOnce;
        if transactional {
            self.producer
                .inner()
                .begin_transaction()
                .map_err(kafka_error)?;
        }
        let written = match write(&mut self.producer, plan, &batches) {
            Ok(n) => n,
            Err(e) => {
                if transactional {
                    let _ = self
                        .producer
                        .inner()
                        .abort_transaction(Duration::from_secs(30));
                }
                return Err(e);
            }
        };
        for source in &plan.sources {
            source.flush_dead_letters()?;
        }
        if transactional {
            let result = (|| {
                let (source, offsets, metadata) = commits
                    .first()
                    .ok_or_else(|| plan_datafusion_err!("no source to commit"))?;
                let tpl = source.offsets_list(offsets, metadata)?;
                let group = source
                    .consumer()
                    .group_metadata()
                    .ok_or_else(|| plan_datafusion_err!("the source has no consumer group"))?;
                self.producer
                    .inner()
                    .send_offsets_to_transaction(&tpl, &group, Duration::from_secs(30))
                    .map_err(kafka_error)?;
                self.producer
                    .inner()
                    .commit_transaction(Duration::from_secs(30))
                    .map_err(kafka_error)
            })();
            if let Err(e) = result {
                let _ = self
                    .producer
                    .inner()
                    .abort_transaction(Duration::from_secs(30));
                return Err(e);
            }
            // The broker stored the offsets with the transaction. They are committed once
            // more, directly: the same values, harmless on a broker, and what makes a
            // restart resume on librdkafka's mock cluster, which acknowledges
            // TxnOffsetCommit without storing it.
            for (source, offsets, metadata) in &commits {
                if let Err(e) = source.commit(offsets, metadata) {
                    log::warn!(
                        "sink {}: committing offsets again after the transaction: {e}",
                        self.name
                    );
                }
            }
        } else {
            self.producer.flush(Duration::from_secs(30))?;
            for (source, offsets, metadata) in &commits {
                if !offsets.is_empty() {
                    source.commit(offsets, metadata)?;
                }
            }
        }

        // The output is out and the offsets committed: move on.
        if let Some(w) = watermark {
            self.emitted_up_to = Some(w);
        }
        if let Some(range) = ranges.values().next() {
            for (p, (_, to)) in range {
                self.from.insert(*p, *to);
            }
        }
        if written > 0 {
            log::debug!("sink '{}': wrote {written} messages", self.name);
        }
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(when) = closed_at.filter(|_| written > 0) {
            status.latency.observe(when.elapsed().as_secs_f64());
        }
        status.runs += 1;
        status.rows_written += written;
        status.emitted_up_to = self.emitted_up_to;
        Ok(())
    }
}

/// Sends every row of `batches` to the sink's topic; the number of messages sent.
fn write(producer: &mut Producer, plan: &Plan, batches: &[RecordBatch]) -> Result<u64> {
    let mut written = 0;
    for batch in batches {
        if batch.num_rows() == 0 {
            continue;
        }
        let values = plan.encoder.encode(batch)?;
        let keys = batch.column_by_name("_key").map(|k| {
            datafusion::arrow::compute::cast(k, &DataType::Utf8)
                .map(|k| k.as_string::<i32>().clone())
        });
        let keys = keys.transpose()?;
        for (row, value) in values.iter().enumerate() {
            let key = keys
                .as_ref()
                .filter(|k| k.is_valid(row))
                .map(|k| k.value(row).as_bytes());
            producer.send(&plan.target_topic, key, value, None)?;
            written += 1;
        }
    }
    Ok(written)
}

/// The sinks of a session, by name.
#[derive(Default)]
pub struct Sinks {
    sinks: Mutex<BTreeMap<String, Sink>>,
}

impl Sinks {
    /// Adds a started sink; an error if the name is taken.
    pub fn add(&self, sink: Sink) -> Result<()> {
        let mut sinks = self.sinks.lock().unwrap_or_else(|p| p.into_inner());
        if sinks.contains_key(&sink.name) {
            let name = sink.name.clone();
            sink.stop();
            return plan_err!("sink '{name}' already exists");
        }
        sinks.insert(sink.name.clone(), sink);
        Ok(())
    }

    /// Whether a sink of that name runs.
    pub fn contains(&self, name: &str) -> bool {
        self.sinks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(name)
    }

    /// Removes a sink (to be stopped by the caller).
    pub fn remove(&self, name: &str) -> Option<Sink> {
        self.sinks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
    }

    /// (name, target, query, status) of every sink.
    pub fn list(&self) -> Vec<(String, String, String, SinkStatus)> {
        self.sinks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|s| {
                (
                    s.name.clone(),
                    s.target.clone(),
                    s.query.clone(),
                    s.status(),
                )
            })
            .collect()
    }

    /// The sinks whose ticks fail now: (name, for how long, the last error).
    pub fn failing(&self) -> Vec<(String, Duration, String)> {
        self.list()
            .into_iter()
            .filter_map(|(name, _, _, s)| {
                Some((
                    name,
                    s.failing_since?.elapsed(),
                    s.last_error.unwrap_or_default(),
                ))
            })
            .collect()
    }

    /// Stops every sink.
    pub fn stop_all(&self) {
        let sinks = std::mem::take(&mut *self.sinks.lock().unwrap_or_else(|p| p.into_inner()));
        for sink in sinks.into_values() {
            sink.stop();
        }
    }
}
