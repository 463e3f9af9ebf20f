//! Live tables: a Kafka topic ingested in the background into Arrow batches that every
//! query reads as a consistent snapshot.
//!
//! ```text
//!  Kafka partitions ──poll (≤4096 messages)──▶ Decoder ──good rows──▶ late? ──no──▶ State
//!                                               │ bad                  │ yes        (batches,
//!                                               ▼                      ▼            offsets,
//!                                        malformed count,        late count,        watermark)
//!                                        dead-letter topic       dead-letter topic     │
//!                                                                                      ▼
//!                                                  scan: snapshot of the batches ◀── SELECT
//! ```
//!
//! One thread per table polls a consumer that is *assigned* every partition of the topic
//! (no group membership, so no rebalances and no group-leave on shutdown); `group.id`, when
//! given, is only where sinks commit the offsets they have finished with. The event-time
//! watermark is the smallest, over partitions that are not idle, of the largest event time
//! seen, minus the allowed lateness; it never goes back. A row older than the watermark
//! when it arrives is late: counted, dead-lettered when a dead-letter topic is configured,
//! and not added (every window it could belong to may already have been emitted).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, BooleanArray, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMillisecondArray,
};
use datafusion::arrow::compute::{cast, filter, filter_record_batch};
use datafusion::arrow::datatypes::{
    DataType, Int32Type, Int64Type, Schema, SchemaRef, TimeUnit, TimestampNanosecondType,
};
use datafusion::catalog::{Session, TableProvider, TableProviderFactory};
use datafusion::common::{plan_datafusion_err, plan_err};
use datafusion::datasource::TableType;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{CreateExternalTable, Expr};
use datafusion::physical_plan::ExecutionPlan;
use rdkafka::Message;
use rdkafka::Offset;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Header, OwnedHeaders};

use crate::format::Decoder;
use crate::options::{KafkaOptions, Start};
use crate::producer::{Producer, kafka_error};
use crate::streams::Streams;

/// The metadata columns a table may declare, and their types.
const METADATA: &[(&str, &str)] = &[
    ("_partition", "INT"),
    ("_offset", "BIGINT"),
    ("_timestamp", "TIMESTAMP"),
    ("_key", "VARCHAR or BYTEA"),
];

/// Where a table column's values come from.
#[derive(Debug, Clone, Copy)]
enum Source {
    Payload(usize),
    Partition,
    Offset,
    Timestamp,
    Key,
}

/// The most messages decoded as one chunk.
const CHUNK: usize = 4096;
/// How long an idle poll waits.
const POLL: Duration = Duration::from_millis(50);
/// librdkafka's pause before fetching again into a full queue (see `LiveTable::start`).
const FETCH_QUEUE_BACKOFF_MS: &str = "10";
/// How often the consumer lag is asked for.
const LAG_EVERY: Duration = Duration::from_secs(1);

/// The `STORED AS KAFKA` table factory.
#[derive(Debug)]
pub struct KafkaTableFactory {
    streams: Arc<Streams>,
}

impl KafkaTableFactory {
    /// A factory that registers the tables it makes with `streams`.
    pub fn new(streams: Arc<Streams>) -> Self {
        Self { streams }
    }
}

#[async_trait::async_trait]
impl TableProviderFactory for KafkaTableFactory {
    async fn create(
        &self,
        _state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>> {
        let [topic] = cmd.locations.as_slice() else {
            return plan_err!("a Kafka table reads one topic (its LOCATION)");
        };
        let options = KafkaOptions::parse(topic, &cmd.options)?;
        let schema = Arc::new(cmd.schema.as_arrow().clone());
        let name = cmd.name.to_string();
        let table = tokio::task::spawn_blocking(move || LiveTable::start(name, options, schema))
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))??;
        self.streams.add_table(&table.shared);
        Ok(Arc::new(table))
    }
}

/// A live table (see the module documentation). Ingestion stops when the last handle to the
/// table is dropped (`DROP TABLE`, and no sink reading it).
pub struct LiveTable {
    shared: Arc<Shared>,
}

impl fmt::Debug for LiveTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LiveTable({})", self.shared.name)
    }
}

impl Drop for LiveTable {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
    }
}

/// What a live table's ingestion thread, its scans, its sinks and `SHOW STREAMS` share.
pub struct Shared {
    /// The table's name.
    pub name: String,
    /// Its options.
    pub options: KafkaOptions,
    /// Its columns.
    pub schema: SchemaRef,
    columns: Vec<Source>,
    /// The event-time column's position, if any.
    event_time: Option<usize>,
    decoder: Decoder,
    consumer: BaseConsumer,
    dead_letters: Option<Mutex<Producer>>,
    state: Mutex<State>,
    /// Notified whenever the watermark moves (see [`Shared::wait_for_watermark`]).
    moved: Condvar,
    stop: AtomicBool,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LiveTable({})", self.name)
    }
}

/// Rows held, with where each came from.
struct Stored {
    batch: RecordBatch,
    partitions: Int32Array,
    offsets: Int64Array,
    arrived: Instant,
}

struct PartitionState {
    /// The next offset to ingest (one past the last message seen).
    next: Option<i64>,
    max_event: Option<i64>,
    last_message: Instant,
    /// The partition's end offset, as last asked.
    high: Option<i64>,
}

#[derive(Default)]
struct Counters {
    messages: u64,
    rows: u64,
    bytes: u64,
    malformed: u64,
    late: u64,
    dead_lettered: u64,
    errors: u64,
    last_error: Option<String>,
}

struct State {
    batches: VecDeque<Stored>,
    rows_held: usize,
    partitions: BTreeMap<i32, PartitionState>,
    watermark: Option<i64>,
    /// When the watermark last moved (for the sinks' window-close-to-write latency).
    watermark_moved: Option<Instant>,
    counters: Counters,
    /// (when, rows ingested by then), one a second, for the ingest rate.
    samples: VecDeque<(Instant, u64)>,
}

/// One row of `SHOW STREAMS`.
#[derive(Debug, Clone)]
pub struct StreamStatus {
    /// Table name.
    pub name: String,
    /// Topic.
    pub topic: String,
    /// Messages read.
    pub messages: u64,
    /// Rows added.
    pub rows: u64,
    /// Rows held now (after retention).
    pub rows_held: usize,
    /// Rows per second over the last few seconds.
    pub rate: f64,
    /// Messages in the topic not read yet, when known.
    pub lag: Option<i64>,
    /// Undecodable messages.
    pub malformed: u64,
    /// Late rows.
    pub late: u64,
    /// Messages written to the dead-letter topic.
    pub dead_lettered: u64,
    /// The event-time watermark (nanoseconds since the epoch).
    pub watermark: Option<i64>,
    /// Errors from the broker or the dead-letter topic.
    pub errors: u64,
    /// The last of them.
    pub last_error: Option<String>,
}

impl LiveTable {
    /// Connects, assigns every partition of the topic and starts ingesting. Blocks while it
    /// asks the brokers for the topic's partitions.
    pub fn start(name: String, options: KafkaOptions, schema: SchemaRef) -> Result<Self> {
        if schema.fields().is_empty() {
            return plan_err!(
                "a Kafka table needs its columns, e.g. (card VARCHAR, amount DOUBLE)"
            );
        }
        let mut columns = Vec::new();
        let mut payload_fields = Vec::new();
        for field in schema.fields() {
            let source = match field.name().as_str() {
                "_partition" => Source::Partition,
                "_offset" => Source::Offset,
                "_timestamp" => Source::Timestamp,
                "_key" => Source::Key,
                _ => {
                    payload_fields.push(field.as_ref().clone());
                    Source::Payload(payload_fields.len() - 1)
                }
            };
            let type_ok = match source {
                Source::Partition | Source::Offset => field.data_type().is_integer(),
                Source::Timestamp => matches!(field.data_type(), DataType::Timestamp(_, _)),
                Source::Key => is_text_or_bytes(field.data_type()),
                Source::Payload(_) => true,
            };
            if !type_ok {
                let expected = METADATA
                    .iter()
                    .find(|(m, _)| m == field.name())
                    .map(|(_, t)| *t)
                    .unwrap_or_default();
                return plan_err!(
                    "metadata column '{}' must be {expected}, not {}",
                    field.name(),
                    field.data_type()
                );
            }
            columns.push(source);
        }
        let payload = Arc::new(Schema::new(payload_fields));
        let decoder = Decoder::try_new(&options.format, Arc::clone(&payload))?;
        let event_time = match &options.event_time {
            Some(column) => {
                let (index, field) = schema.column_with_name(column).ok_or_else(|| {
                    plan_datafusion_err!(
                        "event_time column '{column}' is not a column of the table"
                    )
                })?;
                if !matches!(field.data_type(), DataType::Timestamp(_, _)) {
                    return plan_err!(
                        "event_time column '{column}' must be a TIMESTAMP, not {}",
                        field.data_type()
                    );
                }
                Some(index)
            }
            None => None,
        };

        let mut config = options.client_config();
        // librdkafka pauses a partition's fetching for `fetch.queue.backoff.ms` (1 s by
        // default) whenever the consumer's queue holds `queued.min.messages`: over a backlog
        // the fetcher runs ahead of decoding, fills the queue and then idles for most of each
        // second. A short pause keeps it fed; a user's own setting wins.
        if config.get("fetch.queue.backoff.ms").is_none() {
            config.set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS);
        }
        config
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .set(
                "group.id",
                options
                    .group_id
                    .clone()
                    .unwrap_or_else(|| format!("fulmen-{name}")),
            );
        let consumer: BaseConsumer = config.create().map_err(kafka_error)?;
        let metadata = consumer
            .fetch_metadata(Some(&options.topic), Duration::from_secs(10))
            .map_err(kafka_error)?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.name() == options.topic && t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        if partitions.is_empty() {
            return plan_err!(
                "topic '{}' does not exist on {} (or has no partitions)",
                options.topic,
                options.bootstrap_servers
            );
        }
        let mut assignment = TopicPartitionList::new();
        for p in &partitions {
            assignment
                .add_partition_offset(&options.topic, *p, Offset::Beginning)
                .map_err(kafka_error)?;
        }
        let start_offsets = match options.start {
            Start::Earliest => assignment,
            Start::Latest => {
                let mut tpl = TopicPartitionList::new();
                for p in &partitions {
                    tpl.add_partition_offset(&options.topic, *p, Offset::End)
                        .map_err(kafka_error)?;
                }
                tpl
            }
            Start::Committed => {
                let committed = consumer
                    .committed_offsets(assignment, Duration::from_secs(10))
                    .map_err(kafka_error)?;
                let mut tpl = TopicPartitionList::new();
                for e in committed.elements() {
                    let offset = match e.offset() {
                        Offset::Offset(o) => Offset::Offset(o),
                        _ => Offset::Beginning,
                    };
                    tpl.add_partition_offset(&options.topic, e.partition(), offset)
                        .map_err(kafka_error)?;
                }
                tpl
            }
        };
        consumer.assign(&start_offsets).map_err(kafka_error)?;
        let dead_letters = match &options.dead_letter {
            Some(_) => Some(Mutex::new(Producer::new(options.client_config(), None)?)),
            None => None,
        };
        let now = Instant::now();
        let state = State {
            batches: VecDeque::new(),
            rows_held: 0,
            partitions: partitions
                .iter()
                .map(|p| {
                    let state = PartitionState {
                        next: None,
                        max_event: None,
                        last_message: now,
                        high: None,
                    };
                    (*p, state)
                })
                .collect(),
            watermark: None,
            watermark_moved: None,
            counters: Counters::default(),
            samples: VecDeque::new(),
        };
        let shared = Arc::new(Shared {
            name,
            options,
            schema,
            columns,
            event_time,
            decoder,
            consumer,
            dead_letters,
            state: Mutex::new(state),
            moved: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        log::info!(
            "live table '{}' reads topic '{}' ({} partitions) on {}",
            shared.name,
            shared.options.topic,
            partitions.len(),
            shared.options.bootstrap_servers
        );
        let worker = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("fulmen-ingest-{}", shared.name))
            .spawn(move || worker.run())
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        Ok(Self { shared })
    }

    /// The state shared with the ingestion thread.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

#[async_trait::async_trait]
impl TableProvider for LiveTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.shared.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let scope = state.config().get_extension::<LiveScope>();
        let range = scope.as_ref().and_then(|s| s.range(&self.shared.name));
        if let Some(scope) = &scope {
            scope.touch(&self.shared);
        }
        let (batches, extent) = self.shared.snapshot(range.as_ref());
        if let Some(scope) = &scope {
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            scope.rows.fetch_add(rows, Ordering::Relaxed);
            if range.is_some() {
                *scope.extent.lock().unwrap_or_else(|p| p.into_inner()) = Some(extent);
            }
        }
        let parts = state.config().target_partitions().max(1);
        let mut partitions: Vec<Vec<RecordBatch>> =
            vec![Vec::new(); parts.min(batches.len()).max(1)];
        let count = partitions.len();
        for (i, batch) in batches.into_iter().enumerate() {
            partitions[i % count].push(batch);
        }
        let exec = MemorySourceConfig::try_new_exec(
            &partitions,
            Arc::clone(&self.shared.schema),
            projection.cloned(),
        )?;
        Ok(exec)
    }
}

/// Offsets per partition: `[from, to)` of each.
pub type OffsetRange = BTreeMap<i32, (i64, i64)>;

/// What a read of an [`OffsetRange`] found: per partition the smallest offset, and the latest
/// event time (nanoseconds; `None` when no row had one).
#[derive(Debug, Clone, Default)]
pub struct Extent {
    /// See the type.
    pub first: BTreeMap<i32, i64>,
    /// See the type.
    pub latest: Option<i64>,
}

/// Put into a continuous query's session: which rows of each live table a tick reads, and
/// which live tables the query touched.
#[derive(Debug, Default)]
pub struct LiveScope {
    ranges: HashMap<String, OffsetRange>,
    touched: Mutex<Vec<Arc<Shared>>>,
    scans: AtomicUsize,
    rows: AtomicUsize,
    extent: Mutex<Option<Extent>>,
}

impl LiveScope {
    /// A scope reading, of each named table, only the given offset ranges (other tables
    /// whole).
    pub fn new(ranges: HashMap<String, OffsetRange>) -> Self {
        Self {
            ranges,
            touched: Mutex::new(Vec::new()),
            scans: AtomicUsize::new(0),
            rows: AtomicUsize::new(0),
            extent: Mutex::new(None),
        }
    }

    fn range(&self, table: &str) -> Option<OffsetRange> {
        self.ranges.get(table).cloned()
    }

    fn touch(&self, shared: &Arc<Shared>) {
        self.scans.fetch_add(1, Ordering::Relaxed);
        let mut touched = self.touched.lock().unwrap_or_else(|p| p.into_inner());
        if !touched.iter().any(|t| Arc::ptr_eq(t, shared)) {
            touched.push(Arc::clone(shared));
        }
    }

    /// The live tables the query read.
    pub fn touched(&self) -> Vec<Arc<Shared>> {
        self.touched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many scans of live tables the query's plan has (a table read twice counts twice).
    pub fn scans(&self) -> usize {
        self.scans.load(Ordering::Relaxed)
    }

    /// The rows those scans read.
    pub fn rows(&self) -> usize {
        self.rows.load(Ordering::Relaxed)
    }

    /// What the last scan of a range read (see [`Extent`]).
    pub fn extent(&self) -> Option<Extent> {
        self.extent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the watermark reaches `at` (nanoseconds) or `timeout` passes, whichever
    /// comes first: a sink sleeping between ticks wakes as soon as a window can close.
    pub fn wait_for_watermark(&self, at: i64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        while state.watermark.is_none_or(|w| w < at) {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            state = match self.moved.wait_timeout(state, left) {
                Ok((state, _)) => state,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// Whether ingestion has been asked to stop.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Stops ingestion (the thread ends after its current poll).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// The rows held now, or only those in `range` with their [`Extent`] (taken together,
    /// so that what the extent tells is what was read).
    pub fn snapshot(&self, range: Option<&OffsetRange>) -> (Vec<RecordBatch>, Extent) {
        let state = self.lock();
        let mut extent = Extent::default();
        let Some(range) = range else {
            let all = state.batches.iter().map(|s| s.batch.clone()).collect();
            return (all, extent);
        };
        let mut out = Vec::new();
        for stored in Self::newest_in(&state, range) {
            let keep: BooleanArray = stored
                .partitions
                .values()
                .iter()
                .zip(stored.offsets.values())
                .map(|(p, o)| Some(range.get(p).is_some_and(|(from, to)| o >= from && o < to)))
                .collect();
            if keep.true_count() == 0 {
                continue;
            }
            let times = self.event_nanos(&stored.batch);
            for row in (0..stored.batch.num_rows()).filter(|&r| keep.value(r)) {
                let (p, o) = (stored.partitions.value(row), stored.offsets.value(row));
                extent
                    .first
                    .entry(p)
                    .and_modify(|f| *f = (*f).min(o))
                    .or_insert(o);
                if let Some(t) = times.as_ref().filter(|t| t.is_valid(row)) {
                    let t = t.value(row);
                    extent.latest = Some(extent.latest.map_or(t, |l| l.max(t)));
                }
            }
            if keep.true_count() == stored.batch.num_rows() {
                out.push(stored.batch.clone());
            } else if let Ok(batch) = filter_record_batch(&stored.batch, &keep) {
                out.push(batch);
            }
        }
        out.reverse();
        (out, extent)
    }

    /// The stored batches that may hold rows of `range`, newest first. Each partition is
    /// ingested in offset order, so once every row of a batch lies before the start of its
    /// partition's range, so does every row of every older batch (given a range that names
    /// every partition ingested before it was made, as a tick's does).
    fn newest_in<'a>(state: &'a State, range: &'a OffsetRange) -> impl Iterator<Item = &'a Stored> {
        state.batches.iter().rev().take_while(move |stored| {
            !stored
                .partitions
                .values()
                .iter()
                .zip(stored.offsets.values())
                .all(|(p, o)| range.get(p).is_some_and(|(from, _)| o < from))
        })
    }

    /// The next offset to ingest, per partition (where anything was ingested).
    pub fn ingested(&self) -> BTreeMap<i32, i64> {
        self.lock()
            .partitions
            .iter()
            .filter_map(|(p, s)| s.next.map(|n| (*p, n)))
            .collect()
    }

    /// The event-time watermark, in nanoseconds since the epoch.
    pub fn watermark(&self) -> Option<i64> {
        self.lock().watermark
    }

    /// The watermark and when it reached that value.
    pub fn watermark_and_when(&self) -> Option<(i64, Instant)> {
        let state = self.lock();
        Some((state.watermark?, state.watermark_moved?))
    }

    /// Per partition, the offset from which rows are still needed when every window ending
    /// at or before `watermark` has been emitted and windows reach `span` back from their
    /// end (`None`: unbounded, so everything held is still needed).
    pub fn needed_from(&self, watermark: i64, span: Option<i64>) -> BTreeMap<i32, i64> {
        let state = self.lock();
        let mut needed: BTreeMap<i32, i64> = state
            .partitions
            .iter()
            .filter_map(|(p, s)| s.next.map(|n| (*p, n)))
            .collect();
        let cutoff = span.map(|s| watermark.saturating_sub(s));
        for stored in &state.batches {
            let times = self.event_nanos(&stored.batch);
            for row in 0..stored.batch.num_rows() {
                let still_needed = match (cutoff, times.as_ref()) {
                    (Some(cutoff), Some(times)) => {
                        times.is_valid(row) && times.value(row) >= cutoff
                    }
                    _ => true,
                };
                if still_needed {
                    let p = stored.partitions.value(row);
                    let o = stored.offsets.value(row);
                    needed
                        .entry(p)
                        .and_modify(|n| *n = (*n).min(o))
                        .or_insert(o);
                }
            }
        }
        needed
    }

    /// Commits `offsets` (with `metadata`) for the table's consumer group.
    pub fn commit(&self, offsets: &BTreeMap<i32, i64>, metadata: &str) -> Result<()> {
        let tpl = self.offsets_list(offsets, metadata)?;
        self.consumer
            .commit(&tpl, rdkafka::consumer::CommitMode::Sync)
            .map_err(kafka_error)
    }

    /// `offsets` as a partition list, each with `metadata`.
    pub fn offsets_list(
        &self,
        offsets: &BTreeMap<i32, i64>,
        metadata: &str,
    ) -> Result<TopicPartitionList> {
        let mut tpl = TopicPartitionList::new();
        for (p, o) in offsets {
            let mut e = tpl.add_partition(&self.options.topic, *p);
            e.set_offset(Offset::Offset(*o)).map_err(kafka_error)?;
            e.set_metadata(metadata);
        }
        Ok(tpl)
    }

    /// The committed offsets' metadata, per partition (empty where nothing is committed).
    pub fn committed_metadata(&self) -> Result<Vec<String>> {
        let mut tpl = TopicPartitionList::new();
        for p in self.lock().partitions.keys() {
            tpl.add_partition(&self.options.topic, *p);
        }
        let committed = self
            .consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .map_err(kafka_error)?;
        Ok(committed
            .elements()
            .iter()
            .map(|e| e.metadata().to_owned())
            .collect())
    }

    /// The consumer (for a transactional sink's offsets).
    pub fn consumer(&self) -> &BaseConsumer {
        &self.consumer
    }

    /// Waits until every dead-lettered message is delivered.
    pub fn flush_dead_letters(&self) -> Result<()> {
        match &self.dead_letters {
            Some(p) => p
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .flush(Duration::from_secs(30)),
            None => Ok(()),
        }
    }

    /// This table's line of `SHOW STREAMS`.
    pub fn status(&self) -> StreamStatus {
        let state = self.lock();
        let c = &state.counters;
        let rate = match (state.samples.front(), state.samples.back()) {
            (Some((t0, r0)), Some((t1, r1))) if t1 > t0 => {
                (r1 - r0) as f64 / t1.duration_since(*t0).as_secs_f64()
            }
            _ => 0.0,
        };
        let lag = state
            .partitions
            .values()
            .map(|p| match (p.high, p.next) {
                (Some(high), Some(next)) => Some((high - next).max(0)),
                (Some(high), None) => Some(high),
                _ => None,
            })
            .sum::<Option<i64>>();
        StreamStatus {
            name: self.name.clone(),
            topic: self.options.topic.clone(),
            messages: c.messages,
            rows: c.rows,
            rows_held: state.rows_held,
            rate,
            lag,
            malformed: c.malformed,
            late: c.late,
            dead_lettered: c.dead_lettered,
            watermark: state.watermark,
            errors: c.errors,
            last_error: c.last_error.clone(),
        }
    }

    fn event_nanos(&self, batch: &RecordBatch) -> Option<Int64Array> {
        let column = batch.column(self.event_time?);
        let nanos = cast(column, &DataType::Timestamp(TimeUnit::Nanosecond, None)).ok()?;
        Some(
            nanos
                .as_primitive::<TimestampNanosecondType>()
                .reinterpret_cast(),
        )
    }

    /// The ingestion loop.
    fn run(self: Arc<Self>) {
        let mut last_lag = Instant::now() - LAG_EVERY;
        while !self.stopped() {
            let mut messages: Vec<BorrowedMessage<'_>> = Vec::new();
            let mut wait = POLL;
            while messages.len() < CHUNK {
                match self.consumer.poll(wait) {
                    None => break,
                    Some(Ok(m)) => messages.push(m),
                    Some(Err(e)) => {
                        self.note_error(e.to_string());
                        break;
                    }
                }
                wait = Duration::ZERO;
            }
            if !messages.is_empty() {
                self.ingest(&messages);
            }
            drop(messages);
            self.advance_watermark();
            if last_lag.elapsed() >= LAG_EVERY {
                last_lag = Instant::now();
                self.refresh_lag();
            }
        }
    }

    fn note_error(&self, error: String) {
        let mut state = self.lock();
        state.counters.errors += 1;
        // Logged when it changes, not at every poll that repeats it.
        if state.counters.last_error.as_deref() != Some(&error) {
            log::warn!("live table '{}': {error}", self.name);
        }
        state.counters.last_error = Some(error);
    }

    fn refresh_lag(&self) {
        let partitions: Vec<i32> = self.lock().partitions.keys().copied().collect();
        for p in partitions {
            match self
                .consumer
                .fetch_watermarks(&self.options.topic, p, Duration::from_millis(500))
            {
                Ok((_, high)) => {
                    if let Some(state) = self.lock().partitions.get_mut(&p) {
                        state.high = Some(high);
                    }
                }
                Err(e) => {
                    self.note_error(e.to_string());
                    return;
                }
            }
        }
        let mut state = self.lock();
        let rows = state.counters.rows;
        state.samples.push_back((Instant::now(), rows));
        while state.samples.len() > 5 {
            state.samples.pop_front();
        }
    }

    fn ingest(&self, messages: &[BorrowedMessage<'_>]) {
        let values: Vec<Option<&[u8]>> = messages.iter().map(|m| m.payload()).collect();
        let decoded = self.decoder.decode(&values);
        for (i, error) in &decoded.bad {
            self.dead_letter(&messages[*i], &format!("undecodable: {error}"));
        }
        let kept: Vec<&BorrowedMessage<'_>> = decoded.good.iter().map(|i| &messages[*i]).collect();
        let batch = match self.assemble(&decoded.batch, &kept) {
            Ok(batch) => batch,
            Err(e) => {
                self.note_error(format!("building rows: {e}"));
                return;
            }
        };
        let mut partitions = Int32Array::from_iter_values(kept.iter().map(|m| m.partition()));
        let mut offsets = Int64Array::from_iter_values(kept.iter().map(|m| m.offset()));
        let mut batch = batch;
        let mut times = self.event_nanos(&batch);
        let mut late_count = 0;
        if let (Some(event_times), Some(watermark)) = (&times, self.watermark()) {
            let on_time: BooleanArray = event_times
                .iter()
                .map(|t| Some(t.is_none_or(|t| t >= watermark)))
                .collect();
            late_count = batch.num_rows() - on_time.true_count();
            if late_count > 0 {
                for (row, ok) in on_time.iter().enumerate() {
                    if ok == Some(false) {
                        self.dead_letter(kept[row], "late: older than the watermark");
                    }
                }
                let kept_rows = (|| -> Result<_> {
                    Ok((
                        filter_record_batch(&batch, &on_time)?,
                        filter(&partitions, &on_time)?
                            .as_primitive::<Int32Type>()
                            .clone(),
                        filter(&offsets, &on_time)?
                            .as_primitive::<Int64Type>()
                            .clone(),
                        filter(event_times, &on_time)?
                            .as_primitive::<Int64Type>()
                            .clone(),
                    ))
                })();
                match kept_rows {
                    Ok((b, p, o, t)) => (batch, partitions, offsets, times) = (b, p, o, Some(t)),
                    Err(e) => {
                        self.note_error(format!("setting late rows aside: {e}"));
                        return;
                    }
                }
            }
        }
        let now = Instant::now();
        let mut state = self.lock();
        state.counters.messages += messages.len() as u64;
        state.counters.bytes += values
            .iter()
            .map(|v| v.map_or(0, <[u8]>::len) as u64)
            .sum::<u64>();
        state.counters.malformed += decoded.bad.len() as u64;
        state.counters.late += late_count as u64;
        for m in messages {
            if let Some(p) = state.partitions.get_mut(&m.partition()) {
                p.next = Some(p.next.map_or(m.offset() + 1, |n| n.max(m.offset() + 1)));
                p.last_message = now;
            }
        }
        if let Some(times) = &times {
            for row in 0..batch.num_rows() {
                if times.is_valid(row)
                    && let Some(p) = state.partitions.get_mut(&partitions.value(row))
                {
                    let t = times.value(row);
                    p.max_event = Some(p.max_event.map_or(t, |m| m.max(t)));
                }
            }
        }
        if batch.num_rows() > 0 {
            state.counters.rows += batch.num_rows() as u64;
            state.rows_held += batch.num_rows();
            state.batches.push_back(Stored {
                batch,
                partitions,
                offsets,
                arrived: now,
            });
        }
        self.retain(&mut state);
        drop(state);
        self.advance_watermark();
    }

    /// Builds the table's rows: decoded payload columns and metadata columns.
    fn assemble(
        &self,
        payload: &RecordBatch,
        kept: &[&BorrowedMessage<'_>],
    ) -> Result<RecordBatch> {
        let columns = self
            .columns
            .iter()
            .zip(self.schema.fields())
            .map(|(source, field)| {
                let array: ArrayRef = match source {
                    Source::Payload(i) => return Ok(Arc::clone(payload.column(*i))),
                    Source::Partition => Arc::new(Int32Array::from_iter_values(
                        kept.iter().map(|m| m.partition()),
                    )),
                    Source::Offset => Arc::new(Int64Array::from_iter_values(
                        kept.iter().map(|m| m.offset()),
                    )),
                    Source::Timestamp => Arc::new(TimestampMillisecondArray::from_iter(
                        kept.iter().map(|m| m.timestamp().to_millis()),
                    )),
                    Source::Key => {
                        if matches!(field.data_type(), DataType::Binary | DataType::BinaryView) {
                            Arc::new(BinaryArray::from_iter(kept.iter().map(|m| m.key())))
                        } else {
                            Arc::new(StringArray::from_iter(
                                kept.iter().map(|m| m.key().map(String::from_utf8_lossy)),
                            ))
                        }
                    }
                };
                Ok(cast(&array, field.data_type())?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), columns)?)
    }

    fn dead_letter(&self, message: &BorrowedMessage<'_>, error: &str) {
        let (Some(topic), Some(producer)) = (&self.options.dead_letter, &self.dead_letters) else {
            return;
        };
        let partition = message.partition().to_string();
        let offset = message.offset().to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "fulmen.error",
                value: Some(error),
            })
            .insert(Header {
                key: "fulmen.topic",
                value: Some(self.options.topic.as_str()),
            })
            .insert(Header {
                key: "fulmen.partition",
                value: Some(partition.as_str()),
            })
            .insert(Header {
                key: "fulmen.offset",
                value: Some(offset.as_str()),
            });
        let sent = producer.lock().unwrap_or_else(|p| p.into_inner()).send(
            topic,
            message.key(),
            message.payload().unwrap_or_default(),
            Some(headers),
        );
        match sent {
            Ok(()) => self.lock().counters.dead_lettered += 1,
            Err(e) => self.note_error(format!("dead-letter topic '{topic}': {e}")),
        }
    }

    fn retain(&self, state: &mut State) {
        let retention = self.options.retention;
        if let Some(max_age) = retention.time {
            while let Some(front) = state.batches.front() {
                if front.arrived.elapsed() <= max_age {
                    break;
                }
                state.rows_held -= front.batch.num_rows();
                state.batches.pop_front();
            }
        }
        if let Some(max_rows) = retention.rows {
            while state.rows_held > max_rows {
                let Some(front) = state.batches.front_mut() else {
                    break;
                };
                let excess = state.rows_held - max_rows;
                let rows = front.batch.num_rows();
                if excess >= rows {
                    state.rows_held -= rows;
                    state.batches.pop_front();
                } else {
                    front.batch = front.batch.slice(excess, rows - excess);
                    front.partitions = front.partitions.slice(excess, rows - excess);
                    front.offsets = front.offsets.slice(excess, rows - excess);
                    state.rows_held -= excess;
                }
            }
        }
    }

    /// Recomputes the watermark (after new rows, and on idle rounds, when partitions may
    /// have become idle).
    fn advance_watermark(&self) {
        if self.event_time.is_none() {
            return;
        }
        let lateness = i64::try_from(self.options.lateness.as_nanos()).unwrap_or(i64::MAX);
        let mut state = self.lock();
        let idle_after = self.options.idle_timeout;
        let active: Vec<&PartitionState> = state
            .partitions
            .values()
            .filter(|p| idle_after.is_none_or(|limit| p.last_message.elapsed() < limit))
            .collect();
        let candidate = if active.is_empty() {
            // Every partition is idle: what has arrived is all there is for now.
            state.partitions.values().filter_map(|p| p.max_event).max()
        } else {
            active
                .iter()
                .map(|p| p.max_event)
                .collect::<Option<Vec<i64>>>()
                .and_then(|m| m.into_iter().min())
        };
        if let Some(candidate) = candidate {
            let next = candidate.saturating_sub(lateness);
            if state.watermark.is_none_or(|w| next > w) {
                state.watermark = Some(next);
                state.watermark_moved = Some(Instant::now());
                self.moved.notify_all();
            }
        }
    }
}

/// Whether a column can hold a message key or a raw value.
pub(crate) fn is_text_or_bytes(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8
            | DataType::Utf8View
            | DataType::LargeUtf8
            | DataType::Binary
            | DataType::BinaryView
    )
}

/// Weak handles to the live tables of a session, for `SHOW STREAMS`.
pub(crate) fn live(tables: &[Weak<Shared>]) -> Vec<Arc<Shared>> {
    tables
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|t| !t.stopped())
        .collect()
}
