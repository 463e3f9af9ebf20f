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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::{plan_datafusion_err, plan_err};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::physical_plan::collect;
use datafusion::prelude::SessionContext;
use fulmen_engine::streaming::{StreamScope, WindowKind};
use fulmen_engine::{FulmenConfig, GpuMode};
use rdkafka::consumer::Consumer;
use rdkafka::producer::Producer as _;

use crate::format::Encoder;
use crate::incremental::{self, WindowStates};
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
                match incremental::split(physical, *kind) {
                    Ok(_) => Some(*kind),
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

fn scoped(state: &SessionState, streams: Arc<StreamScope>, live: Arc<LiveScope>) -> SessionContext {
    let mut state = state.clone();
    state.config_mut().set_extension(streams);
    state.config_mut().set_extension(live);
    SessionContext::new_with_state(state)
}

/// The session an incremental sink plans its ticks in: one partition (a tick's rows are
/// few, and its plan splits most simply without exchanges), on the CPU (a tick's new rows
/// and closing windows are far too few to repay a trip to a device; see `incremental.rs`).
fn incremental_session(
    state: &SessionState,
    streams: Arc<StreamScope>,
    live: Arc<LiveScope>,
) -> SessionContext {
    let mut state = state.clone();
    let config = state.config_mut();
    config.options_mut().execution.target_partitions = 1;
    if let Some(fulmen) = config.options_mut().extensions.get_mut::<FulmenConfig>() {
        fulmen.gpu_mode = GpuMode::Off;
    }
    config.set_extension(streams);
    config.set_extension(live);
    SessionContext::new_with_state(state)
}

struct Runner {
    name: String,
    plan: Plan,
    producer: Producer,
    status: Arc<Mutex<SinkStatus>>,
    stop: Arc<AtomicBool>,
    emitted_up_to: Option<i64>,
    /// Append and incremental sinks: per partition, the first offset not yet processed.
    from: BTreeMap<i32, i64>,
    /// Incremental sinks: the open windows' states, and the rows they hold, by tick.
    states: WindowStates,
    chunks: VecDeque<Chunk>,
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
        let output = if self.plan.incremental.is_some() {
            self.incremental(runtime)
        } else {
            self.rerun(runtime)
        };
        let state_rows = self.states.rows();
        self.status_mut().state_rows = state_rows as u64;
        let Some(output) = output? else {
            return Ok(());
        };
        let written = self.deliver(&output)?;

        // The output is out and the offsets committed: move on.
        if let Some(w) = output.watermark {
            self.emitted_up_to = Some(w);
        }
        if let Some((left, cutoff)) = output.left {
            self.states = left;
            self.chunks
                .retain(|c| c.latest.is_some_and(|t| t >= cutoff));
        }
        if let Some(range) = output.ranges.values().next() {
            for (p, (_, to)) in range {
                self.from.insert(*p, *to);
            }
        }
        if written > 0 {
            log::debug!("sink '{}': wrote {written} messages", self.name);
        }
        let state_rows = self.states.rows() as u64;
        let emitted_up_to = self.emitted_up_to;
        let mut status = self.status_mut();
        if let Some(when) = output.closed_at.filter(|_| written > 0) {
            status.latency.observe(when.elapsed().as_secs_f64());
        }
        status.runs += 1;
        status.rows_written += written;
        status.emitted_up_to = emitted_up_to;
        status.state_rows = state_rows;
        Ok(())
    }

    fn status_mut(&self) -> std::sync::MutexGuard<'_, SinkStatus> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Windowed sinks that re-read their open windows, and append sinks: the query over the
    /// live tables' snapshots (windowed: emitting the windows that closed since the previous
    /// tick) or over the rows that arrived since it (append).
    fn rerun(&mut self, runtime: &tokio::runtime::Runtime) -> Result<Option<Output>> {
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
                return Ok(None);
            };
            closed_at = Some(when);
            if self.emitted_up_to.is_some_and(|e| watermark <= e) {
                return Ok(None);
            }
            let scope = StreamScope::new(self.emitted_up_to, Some(watermark));
            (scope, HashMap::new(), Some(watermark))
        } else {
            let source = &plan.sources[0];
            let range = self.new_rows(source);
            if !range.values().any(|(from, to)| from < to) {
                return Ok(None);
            }
            let ranges = HashMap::from([(source.name.clone(), range)]);
            (StreamScope::new(None, None), ranges, None)
        };
        let live = Arc::new(LiveScope::new(ranges.clone()));
        let session = scoped(&plan.state, Arc::new(streams), Arc::clone(&live));
        let batches = runtime.block_on(async {
            let frame = session.sql(&plan.query).await?;
            frame.collect().await
        })?;
        self.status_mut().rows_read += live.rows() as u64;
        let commits = self.commits(watermark, |source| match watermark {
            Some(w) => source.needed_from(w, plan.span),
            None => ranges
                .get(&source.name)
                .map(|r| r.iter().map(|(p, (_, to))| (*p, *to)).collect())
                .unwrap_or_default(),
        });
        Ok(Some(Output {
            batches,
            commits,
            ranges,
            watermark,
            closed_at,
            left: None,
        }))
    }

    /// Incremental windowed sinks (see `incremental.rs`): the rows that arrived since the
    /// previous tick go into the open windows' states; the windows the watermark passed are
    /// finished from theirs.
    fn incremental(&mut self, runtime: &tokio::runtime::Runtime) -> Result<Option<Output>> {
        let plan = &self.plan;
        let kind = plan.incremental.expect("an incremental sink");
        let source = &plan.sources[0];
        // The watermark first: every row it was computed after is then among those ingested,
        // so the windows it closes are complete in the states.
        let watermark = source
            .watermark_and_when()
            .filter(|(w, _)| self.emitted_up_to.is_none_or(|e| *w > e));
        let range = self.new_rows(source);
        let fresh = range.values().any(|(from, to)| from < to);
        if !fresh && watermark.is_none() {
            return Ok(None);
        }
        // New rows go to every window ending after the last one emitted.
        let scope = StreamScope::new(self.emitted_up_to, None);
        let rows = if fresh {
            range.clone()
        } else {
            OffsetRange::new()
        };
        let live = Arc::new(LiveScope::new(HashMap::from([(source.name.clone(), rows)])));
        let session = incremental_session(&plan.state, Arc::new(scope), Arc::clone(&live));
        let split = runtime.block_on(async {
            let physical = session
                .sql(&plan.query)
                .await?
                .create_physical_plan()
                .await?;
            incremental::split(physical, kind).map_err(|why| {
                plan_datafusion_err!("the sink's query can no longer run incrementally: {why}")
            })
        })?;
        if fresh {
            let states = runtime.block_on(collect(Arc::clone(&split.lower), session.task_ctx()))?;
            // Taken in: the rows are not read again, whatever happens to the rest of the tick.
            self.states.add(states);
            self.status_mut().rows_read += live.rows() as u64;
            let (first, latest) = source.range_extent(&range);
            self.chunks.push_back(Chunk { first, latest });
            for (p, (_, to)) in &range {
                self.from.insert(*p, *to);
            }
            runtime.block_on(self.states.merge_if_due(&split, session.task_ctx()))?;
        }
        let Some((watermark, closed_at)) = watermark else {
            return Ok(None);
        };
        let (closing, left) = self.states.closing(&split, self.emitted_up_to, watermark)?;
        let batches = runtime.block_on(collect(split.finished(closing)?, session.task_ctx()))?;
        // Rows are needed again on a restart while a window they lie in is open: one that
        // reaches `span` back from its end, or a session starting at the earliest start held.
        let cutoff = match plan.span {
            Some(span) => watermark.saturating_sub(span),
            None => left.earliest_start(&split)?.unwrap_or(watermark),
        };
        let mut needed = self.from.clone();
        for chunk in &self.chunks {
            if chunk.latest.is_some_and(|t| t >= cutoff) {
                for (p, o) in &chunk.first {
                    needed
                        .entry(*p)
                        .and_modify(|n| *n = (*n).min(*o))
                        .or_insert(*o);
                }
            }
        }
        let commits = self.commits(Some(watermark), |_| needed.clone());
        Ok(Some(Output {
            batches,
            commits,
            ranges: HashMap::new(),
            watermark: Some(watermark),
            closed_at: Some(closed_at),
            left: Some((left, cutoff)),
        }))
    }

    /// Per partition of `source`, the offsets `[from, to)` of the rows ingested since the
    /// previous tick (every partition ingested so far, those with nothing new included).
    fn new_rows(&self, source: &Shared) -> OffsetRange {
        source
            .ingested()
            .iter()
            .map(|(p, to)| (*p, (self.from.get(p).copied().unwrap_or(i64::MIN), *to)))
            .collect()
    }

    /// The offsets to commit for each source with a consumer group, once the output is out.
    fn commits(
        &self,
        watermark: Option<i64>,
        offsets: impl Fn(&Shared) -> BTreeMap<i32, i64>,
    ) -> Vec<Commit> {
        let metadata = match watermark {
            Some(w) => format!("fulmen.sink={};emitted_up_to={w}", self.name),
            None => format!("fulmen.sink={}", self.name),
        };
        self.plan
            .sources
            .iter()
            .filter(|s| s.options.group_id.is_some())
            .map(|s| (Arc::clone(s), offsets(s), metadata.clone()))
            .collect()
    }

    /// Writes a tick's output and commits its offsets: in one transaction (exactly once), or
    /// flushed and then committed (at least once). The number of messages written.
    fn deliver(&mut self, output: &Output) -> Result<u64> {
        let plan = &self.plan;
        let commits = &output.commits;
        let transactional = plan.delivery == Delivery::ExactlyOnce;
        if transactional {
            self.producer
                .inner()
                .begin_transaction()
                .map_err(kafka_error)?;
        }
        let written = match write(&mut self.producer, plan, &output.batches) {
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
            for (source, offsets, metadata) in commits {
                if let Err(e) = source.commit(offsets, metadata) {
                    log::warn!(
                        "sink {}: committing offsets again after the transaction: {e}",
                        self.name
                    );
                }
            }
        } else {
            self.producer.flush(Duration::from_secs(30))?;
            for (source, offsets, metadata) in commits {
                if !offsets.is_empty() {
                    source.commit(offsets, metadata)?;
                }
            }
        }
        Ok(written)
    }
}

/// Offsets to commit for a source, with their metadata.
type Commit = (Arc<Shared>, BTreeMap<i32, i64>, String);

/// What a tick produced.
struct Output {
    batches: Vec<RecordBatch>,
    /// Offsets to commit once the output is safe.
    commits: Vec<Commit>,
    /// Append sinks: the offsets read, per source.
    ranges: HashMap<String, OffsetRange>,
    /// Windowed sinks: windows ending at or before this are now emitted …
    watermark: Option<i64>,
    /// … since the watermark reached it then.
    closed_at: Option<Instant>,
    /// Incremental sinks: the states of the windows still open, and the event time before
    /// which no row lies in one of them.
    left: Option<(WindowStates, i64)>,
}

/// Rows an incremental sink took in one tick: per partition the first offset, and the
/// latest event time (a restart must read them again while a window they lie in is open).
struct Chunk {
    first: BTreeMap<i32, i64>,
    latest: Option<i64>,
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
