//! Continuous queries: `CREATE SINK name INTO kafka_table AS query` runs `query` on a tick
//! until `DROP SINK name`, writing what it produces to the Kafka table's topic.
//!
//! A query is run in one of three modes, chosen from its plan (the ticks are in
//! `sink/runner.rs`):
//!
//! - **Incremental** (windowed, and its plan splits at an aggregation over its window; see
//!   `incremental.rs`): each tick adds the rows that arrived since the previous one to the
//!   open windows' partial aggregate states, and finishes the windows the watermark passed.
//! - **Windowed** (it uses `TUMBLE`, `HOP` or `SESSION` otherwise): each tick reads the
//!   watermark `W` of its live sources (the smallest of them) and, when it moved past the
//!   last emitted `E`, runs the query over the live tables' snapshots with the window
//!   functions emitting only windows ending in `(E, W]`. A row older than the watermark is
//!   never added to a live table, so every window is emitted once, complete.
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

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use datafusion::arrow::datatypes::Schema;
use datafusion::common::plan_err;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::prelude::SessionContext;
use fulmen_engine::FulmenConfig;
use fulmen_engine::streaming::{StreamScope, WindowKind};

use crate::format::Encoder;
use crate::incremental::{self, WindowStates};
use crate::live::{Extent, LiveScope, LiveTable, Shared};
use crate::options::Delivery;
use crate::producer::Producer;

mod joins;
mod runner;
pub(crate) use runner::incremental_session;
use runner::scoped;

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
    /// `incremental` (windowed, keeping open windows' partial states), `windowed`
    /// (re-reading open windows each tick) or `append`.
    pub mode: &'static str,
    /// `at_least_once` or `exactly_once`.
    pub delivery: &'static str,
    /// Ticks that wrote output (or found nothing new to write).
    pub runs: u64,
    /// Messages written.
    pub rows_written: u64,
    /// Windows ending at or before this instant (nanoseconds) are emitted.
    pub emitted_up_to: Option<i64>,
    /// Rows the sink's ticks read from live tables (an incremental or append sink reads each
    /// row once; one that re-reads its open windows, each of them at every tick that emits).
    pub rows_read: u64,
    /// Incremental sinks: partial aggregate states held for open windows (rows: about one
    /// per group per open window).
    pub state_rows: u64,
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
    /// Windowed sinks that keep their open windows' partial states (see `incremental.rs`):
    /// the query's one window function.
    incremental: Option<WindowKind>,
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
        // A windowed query runs incrementally when its plan splits at an aggregation over
        // its one window of its one live table (read once).
        let allowed = state
            .config()
            .options()
            .extensions
            .get::<FulmenConfig>()
            .is_none_or(|f| f.stream_incremental);
        let incremental = match (windows.as_slice(), sources.len(), live_scope.scans()) {
            _ if !windowed => None,
            _ if !allowed => {
                log::info!(
                    "sink '{name}' re-reads its open windows each tick: \
                     fulmen.stream.incremental is off"
                );
                None
            }
            ([kind], 1, 1) => {
                let session = incremental_session(
                    &state,
                    Arc::new(StreamScope::new(Some(i64::MAX), Some(i64::MAX))),
                    Arc::new(LiveScope::default()),
                );
                let physical = session.sql(query).await?.create_physical_plan().await?;
                match incremental::split(physical, *kind).and_then(|s| s.check().map(|()| s)) {
                    Ok(split) => {
                        if let Some(pane) = split.pane() {
                            log::info!(
                                "sink '{name}' keeps its HOP windows' states per pane of {} ms \
                                 (each row is aggregated once, not once per window)",
                                pane / 1_000_000
                            );
                        }
                        Some(*kind)
                    }
                    Err(why) => {
                        log::info!("sink '{name}' re-reads its open windows each tick: {why}");
                        None
                    }
                }
            }
            _ => {
                log::info!(
                    "sink '{name}' re-reads its open windows each tick: it reads {} windows \
                     over {} scans of live tables (incremental windows take one of each)",
                    windows.len(),
                    live_scope.scans()
                );
                None
            }
        };
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
            incremental,
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
            mode: match (windowed, incremental) {
                (true, Some(_)) => "incremental",
                (true, None) => "windowed",
                (false, _) => "append",
            },
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
            states: WindowStates::default(),
            chunks: VecDeque::new(),
            next_close: None,
        };
        log::info!(
            "sink '{name}' started into '{target}' ({}, {})",
            match (windowed, incremental) {
                (true, Some(_)) => "windowed, incremental",
                (true, None) => "windowed, re-reading open windows",
                (false, _) => "append",
            },
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

/// What a sink's thread runs with (see `runner.rs`).
struct Runner {
    name: String,
    plan: Plan,
    producer: Producer,
    status: Arc<Mutex<SinkStatus>>,
    stop: Arc<AtomicBool>,
    emitted_up_to: Option<i64>,
    /// Append and incremental sinks: per partition, the first offset not yet processed.
    from: BTreeMap<i32, i64>,
    /// Incremental sinks: the open windows' states, and the rows each tick took in (a
    /// restart must read them again while a window they lie in is open).
    states: WindowStates,
    chunks: VecDeque<Extent>,
    /// Incremental sinks: the earliest end of an open window (nanoseconds), at the end of
    /// the last tick; the sink wakes when the watermark reaches it rather than a tick later.
    next_close: Option<i64>,
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
