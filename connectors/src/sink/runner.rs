//! A sink's ticks: the thread that runs its query each tick (re-reading open windows, over
//! an append sink's new rows, or incrementally), writes the output to the target topic and
//! commits the source offsets (see the module notes of `sink.rs`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::plan_datafusion_err;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::physical_plan::collect;
use datafusion::prelude::SessionContext;
use fulmen_engine::streaming::{StreamScope, WindowKind};
use fulmen_engine::{FulmenConfig, GpuMode};
use rdkafka::consumer::Consumer;
use rdkafka::producer::Producer as _;

use super::joins::with_stream_probes;
use super::{Plan, Runner, SinkStatus, TICK};
use crate::incremental::{self, WindowStates};
use crate::live::{LiveScope, OffsetRange, Shared};
use crate::options::Delivery;
use crate::producer::{Producer, kafka_error};

pub(super) fn scoped(
    state: &SessionState,
    streams: Arc<StreamScope>,
    live: Arc<LiveScope>,
) -> SessionContext {
    let mut state = with_stream_probes(state.clone());
    state.config_mut().set_extension(streams);
    state.config_mut().set_extension(live);
    SessionContext::new_with_state(state)
}

/// The session an incremental sink plans its ticks in: one partition (a tick's rows are
/// few, and its plan splits most simply without exchanges), on the CPU (a tick's new rows
/// and closing windows are far too few to repay a trip to a device; see `incremental.rs`).
pub(crate) fn incremental_session(
    state: &SessionState,
    streams: Arc<StreamScope>,
    live: Arc<LiveScope>,
) -> SessionContext {
    let mut state = with_stream_probes(state.clone());
    let config = state.config_mut();
    config.options_mut().execution.target_partitions = 1;
    if let Some(fulmen) = config.options_mut().extensions.get_mut::<FulmenConfig>() {
        fulmen.gpu_mode = GpuMode::Off;
    }
    config.set_extension(streams);
    config.set_extension(live);
    SessionContext::new_with_state(state)
}

impl Runner {
    pub(super) fn run(mut self) {
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
                self.pause(rest);
            }
        }
    }

    /// Sleeps until the next tick, or, for an incremental sink, until the watermark reaches
    /// the end of its earliest open window, if that comes sooner: the window then closes at
    /// once rather than up to a tick later.
    fn pause(&self, rest: Duration) {
        let source = self.plan.sources.first();
        match (self.next_close, source) {
            (Some(at), Some(source))
                if self.states.rows() > 0 && source.watermark().is_none_or(|w| w < at) =>
            {
                source.wait_for_watermark(at, rest)
            }
            _ => std::thread::sleep(rest),
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
        let output = if let Some(kind) = self.plan.incremental {
            self.incremental(kind, runtime)
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
    fn incremental(
        &mut self,
        kind: WindowKind,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<Option<Output>> {
        let plan = &self.plan;
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
        let scope = incremental::tick_scope(kind, self.emitted_up_to);
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
            if let Some(end) = incremental::earliest_end(&states, &split, self.emitted_up_to)? {
                self.next_close = Some(self.next_close.map_or(end, |n| n.min(end)));
            }
            // Taken in: the rows are not read again, whatever happens to the rest of the tick.
            // The status shows them read and their states held together (a reader between
            // the two saw rows read and none of their states).
            self.states.add(states);
            let held = self.states.rows() as u64;
            let mut status = self.status_mut();
            status.rows_read += live.rows() as u64;
            status.state_rows = held;
            drop(status);
            // What the scan read, as it read it (rows dropped by retention since are not
            // counted on).
            self.chunks.push_back(live.extent().unwrap_or_default());
            for (p, (_, to)) in &range {
                self.from.insert(*p, *to);
            }
        }
        // Before any window is closed: sessions that meet must have been merged. The states
        // of closing TUMBLE and HOP windows are merged by the final aggregate anyway, so
        // theirs are merged after closing, among the windows left open.
        let merge_first = split.merges_before_closing();
        if merge_first || watermark.is_none() {
            runtime.block_on(self.states.merge_if_due(&split, session.task_ctx()))?;
        }
        let Some((watermark, closed_at)) = watermark else {
            return Ok(None);
        };
        let (closing, mut left) = self.states.closing(&split, self.emitted_up_to, watermark)?;
        if !merge_first {
            runtime.block_on(left.merge_if_due(&split, session.task_ctx()))?;
        }
        self.next_close = left.earliest_end(&split, Some(watermark))?;
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
