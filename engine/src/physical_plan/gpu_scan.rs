//! `GpuScanExec`: the scan of a cached table (see `cache/mod.rs`). Its partition p reads
//! the chunks of device p mod n, which is where GPU operators run partition p, so a GPU
//! parent on the same devices takes the chunks as they lie; a host parent gets them
//! downloaded (counted). A chunk whose device is out of service is read from the source.
//! A sharded table's partition p is its hash part p, and the scan says so (`Hash([k], P)`)
//! where DataFusion would deal rows the same way, so that it adds no repartition on `k`.
//! A replicated table's partitions read each chunk once, from alternating devices; a
//! CollectLeft join asks instead for a device's whole copy (`execute_replica`).

use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::common::Statistics;
use datafusion::common::stats::Precision;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{
    ExecutionPlanMetricsSet, Label, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties, StatisticsArgs,
    StatisticsContext,
};
use fulmen_kernels::{Device, DeviceBatch};
use futures::StreamExt;

use super::gpu_stream::{
    BatchOn, Chunk, ChunkStream, DeviceResident, GpuMetrics, Redo, count_batch,
};
use crate::cache::{CachedData, Reread, Sharding};

/// The scan of a cached table's device chunks.
#[derive(Debug)]
pub struct GpuScanExec {
    data: Arc<CachedData>,
    projection: Option<Vec<usize>>,
    /// What a chunk whose device is gone is read from: the source's scan of the same
    /// columns (for a sharded table, with its key appended when not among them), the key's
    /// place there, and the columns kept of the rows read.
    source: Arc<dyn ExecutionPlan>,
    source_sharding: Option<Sharding>,
    source_keep: Option<Vec<usize>>,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    statistics: Arc<Statistics>,
    metrics: ExecutionPlanMetricsSet,
    /// The source's rows on the host, once a chunk whose device is gone needs them: one
    /// read for the partitions that run together, dropped when the last of them (and the
    /// chunks it sent on) is done.
    reread: Mutex<Weak<Reread>>,
}

impl GpuScanExec {
    /// A scan of `data`'s columns `projection` (all when `None`). `source` is the source's
    /// scan of the same columns (its statistics are the scan's), read for chunks whose
    /// device is gone; for a sharded table whose key is not among the columns, `keyed` is
    /// the same scan with the key appended, read instead. A table dealt in turn gets at
    /// least `target_partitions` partitions (a multiple of the devices); a sharded one a
    /// partition per part, hash-partitioned on its key when the parts are
    /// `target_partitions` and the key is read.
    pub fn try_new(
        data: Arc<CachedData>,
        projection: Option<Vec<usize>>,
        source: Arc<dyn ExecutionPlan>,
        keyed: Option<Arc<dyn ExecutionPlan>>,
        target_partitions: usize,
    ) -> Result<Self> {
        let schema = match &projection {
            Some(p) => Arc::new(data.schema().project(p)?),
            None => Arc::clone(data.schema()),
        };
        let other_columns = || {
            DataFusionError::Internal(format!(
                "GpuScanExec: the source scan of {} gives other columns than the cache",
                data.name()
            ))
        };
        if schema.fields() != source.schema().fields() {
            return Err(other_columns());
        }
        // The key's place among the columns read, when it is one of them.
        let key_at = data.sharding().and_then(|s| match &projection {
            None => Some(s.column),
            Some(p) => p.iter().position(|&c| c == s.column),
        });
        let statistics = StatisticsContext::new()
            .compute(source.as_ref(), &StatisticsArgs::new())
            .unwrap_or_else(|_| Arc::new(Statistics::new_unknown(&schema)));
        let (source, source_sharding, source_keep) = match (data.sharding(), key_at) {
            (None, _) => (source, None, None),
            (Some(s), Some(at)) => (
                source,
                Some(Sharding {
                    column: at,
                    ..s.clone()
                }),
                None,
            ),
            (Some(s), None) => {
                let keyed = keyed.ok_or_else(other_columns)?;
                let width = schema.fields().len();
                let fields = keyed.schema().fields().clone();
                if fields.len() != width + 1
                    || fields[..width] != schema.fields()[..]
                    || fields[width].name() != &s.key
                {
                    return Err(other_columns());
                }
                let sharding = Sharding {
                    column: width,
                    ..s.clone()
                };
                (keyed, Some(sharding), Some((0..width).collect()))
            }
        };
        let n = data.devices().len().max(1);
        let partitioning = match (data.sharding(), key_at) {
            (None, _) => {
                Partitioning::UnknownPartitioning(target_partitions.max(1).div_ceil(n) * n)
            }
            (Some(s), Some(at)) if s.parts == target_partitions => {
                let key: Arc<dyn PhysicalExpr> = Arc::new(Column::new(&s.key, at));
                Partitioning::Hash(vec![key], s.parts)
            }
            (Some(s), _) => Partitioning::UnknownPartitioning(s.parts),
        };
        let properties = PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            partitioning,
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Ok(Self {
            data,
            projection,
            source,
            source_sharding,
            source_keep,
            schema,
            properties: Arc::new(properties),
            statistics,
            metrics: ExecutionPlanMetricsSet::new(),
            reread: Mutex::new(Weak::new()),
        })
    }

    /// The cached table it reads.
    pub fn data(&self) -> &Arc<CachedData> {
        &self.data
    }

    fn partitions(&self) -> usize {
        self.properties.partitioning.partition_count()
    }

    /// The device of `partition` (its index among the table's devices) and the chunks it
    /// reads: a sharded table's chunks of the partition's part; a replicated table's chunk
    /// j when (j + the first chunk's device) mod partitions is the partition, so that each
    /// row is read once; else chunk j of that device when j mod (partitions per device) is
    /// the partition's slot.
    fn chunks_of(&self, partition: usize) -> (usize, Vec<usize>) {
        let n = self.data.devices().len().max(1);
        let d = partition % n;
        let shard = self.data.shard(d);
        let chunks = match self.data.sharding() {
            Some(_) => (0..shard.len())
                .filter(|&j| shard[j].part == partition)
                .collect(),
            None if self.data.replicated() => {
                let (first, all) = (self.data.first_device(), self.partitions().max(1));
                (0..shard.len())
                    .filter(|j| (j + first) % all == partition)
                    .collect()
            }
            None => {
                let (slot, per) = (partition / n, (self.partitions() / n).max(1));
                (0..shard.len()).filter(|j| j % per == slot).collect()
            }
        };
        (d, chunks)
    }

    /// The partition's chunks: on their device (the columns asked for, shared with the
    /// cache), or read from the source when the device is out of service. The stream is
    /// not metered yet (see [`GpuMetrics::work`]).
    fn chunks(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<(ChunkStream, GpuMetrics)> {
        let (d, chunks) = self.chunks_of(partition);
        self.chunks_from(d, chunks, partition, context)
    }

    /// Chunks `chunks` of the `d`-th device, metered as partition `partition`'s.
    fn chunks_from(
        &self,
        d: usize,
        chunks: Vec<usize>,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<(ChunkStream, GpuMetrics)> {
        let device: Device = self.data.devices()[d].clone();
        let metrics = GpuMetrics::new(&self.metrics, partition, &device, &context);
        // EXPLAIN ANALYZE's word that rows were read from the source, not the cache.
        let from_source = MetricBuilder::new(&self.metrics)
            .with_label(Label::new("device", device.to_string()))
            .counter("source_rows", partition);
        let reread = {
            let mut shared = self.reread.lock().unwrap_or_else(|p| p.into_inner());
            shared.upgrade().unwrap_or_else(|| {
                let fresh = Arc::new(Reread::new(
                    Arc::clone(&self.source),
                    context,
                    self.source_sharding.clone(),
                    self.source_keep.clone(),
                ));
                *shared = Arc::downgrade(&fresh);
                fresh
            })
        };
        let (data, projection) = (Arc::clone(&self.data), self.projection.clone());
        let host_schema = Arc::clone(&self.schema);
        let out = metrics.clone();
        let stream = futures::stream::iter(chunks.into_iter().enumerate()).then(move |(i, j)| {
            let cached = &data.shard(d)[j];
            let (part, first, len) = (cached.part, cached.first_row, cached.batch.num_rows());
            let read = Arc::clone(&reread);
            let (device, out, from_source) = (device.clone(), out.clone(), from_source.clone());
            let chunk = match device.quarantined() {
                Some(_) => None,
                None => Some(project(&cached.batch, projection.as_deref())),
            };
            let host_schema = Arc::clone(&host_schema);
            async move {
                // A yield before each chunk past the first: the chunks are ready at once, so
                // a GPU operator over them (which takes them from beneath DataFusion's
                // `CooperativeExec` in a plan of one partition) would otherwise do them all
                // in one poll, and a statement could not be cancelled until it ended.
                if i > 0 {
                    tokio::task::yield_now().await;
                }
                let Some(batch) = chunk else {
                    log::debug!("{device} is quarantined: reading cached rows from the source");
                    count_batch(&out, BatchOn::Fallback);
                    let batch = read.rows_async(part, first, len).await?;
                    from_source.add(batch.num_rows());
                    out.record_batch(&batch);
                    return Ok(Chunk::Host(batch));
                };
                // Not a batch of device work (`gpu_batches`): the chunk is only handed on.
                let redo = Redo::new(move || {
                    let batch = read.rows(part, first, len)?;
                    from_source.add(batch.num_rows());
                    Ok(batch)
                });
                let chunk = Chunk::Device(batch?, host_schema, redo);
                out.record_chunk(&chunk);
                Ok(chunk)
            }
        });
        Ok((Box::pin(stream), metrics))
    }
}

/// The columns `projection` of a device batch (all when `None`), sharing its buffers.
fn project(batch: &DeviceBatch, projection: Option<&[usize]>) -> Result<DeviceBatch> {
    let Some(p) = projection else {
        return Ok(batch.clone());
    };
    let schema: Schema = batch.schema().project(p)?;
    let columns = p.iter().map(|&i| batch.columns()[i].clone()).collect();
    DeviceBatch::try_new(Arc::new(schema), columns, batch.num_rows())
        .map_err(|e| DataFusionError::External(Box::new(e)))
}

impl DeviceResident for GpuScanExec {
    fn execute_chunks(&self, partition: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        let (chunks, metrics) = self.chunks(partition, context)?;
        Ok(metrics.work().chunks(chunks))
    }

    fn resident_devices(&self) -> &Arc<Vec<Device>> {
        self.data.devices()
    }

    fn replicated(&self) -> bool {
        self.data.replicated()
    }

    /// Every chunk of the copy on the `device`-th device (metered as its first partition).
    fn execute_replica(&self, device: usize, context: Arc<TaskContext>) -> Result<ChunkStream> {
        if !self.data.replicated() || device >= self.data.devices().len() {
            return Err(DataFusionError::Internal(format!(
                "GpuScanExec: {} has no copy on device {device}",
                self.data.name()
            )));
        }
        let all = (0..self.data.shard(device).len()).collect();
        let (chunks, metrics) = self.chunks_from(device, all, device, context)?;
        Ok(metrics.work().chunks(chunks))
    }
}

impl DisplayAs for GpuScanExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let columns: Vec<&str> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        match t {
            DisplayFormatType::TreeRender => {
                writeln!(f, "table={}", self.data.name())?;
                write!(f, "chunks={}", self.data.chunks())
            }
            _ => {
                let spread = match self.data.replicated() {
                    true => "replicas",
                    false => "shards",
                };
                write!(
                    f,
                    "GpuScanExec: table={}, device={}, {spread}={}, ",
                    self.data.name(),
                    crate::gpu::devices::describe(self.data.devices()),
                    self.data.shards(),
                )?;
                if let Some(s) = self.data.sharding() {
                    write!(f, "shard_key={}, parts={}, ", s.key, s.parts)?;
                }
                write!(
                    f,
                    "chunks={}, rows={}, projection=[{}]",
                    self.data.chunks(),
                    self.data.rows(),
                    columns.join(", ")
                )?;
                // The columns read that are held dictionary-encoded.
                let encoded = self.data.encoded_columns();
                let read: Vec<usize> = match &self.projection {
                    Some(p) => p.clone(),
                    None => (0..self.data.schema().fields().len()).collect(),
                };
                let names: Vec<&str> = read
                    .iter()
                    .filter(|c| encoded.contains(c))
                    .map(|&c| self.data.schema().field(c).name().as_str())
                    .collect();
                if !names.is_empty() {
                    write!(f, ", dictionary=[{}]", names.join(", "))?;
                }
                Ok(())
            }
        }
    }
}

impl ExecutionPlan for GpuScanExec {
    fn name(&self) -> &str {
        "GpuScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        Vec::new()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.is_empty() {
            Ok(self)
        } else {
            Err(DataFusionError::Internal(
                "GpuScanExec has no children".into(),
            ))
        }
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(
            &Arc<dyn datafusion::physical_expr::PhysicalExpr>,
        ) -> Result<datafusion::common::tree_node::TreeNodeRecursion>,
    ) -> Result<datafusion::common::tree_node::TreeNodeRecursion> {
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    }

    /// The chunks on the host: downloaded (counted), or redone from the source when their
    /// device is lost.
    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let (chunks, metrics) = self.chunks(partition, context)?;
        let work = metrics.work();
        let batches = chunks.map(move |chunk| chunk?.host_for_cpu(&metrics));
        Ok(work.batches(Arc::clone(&self.schema), batches))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn statistics_from_inputs(
        &self,
        _input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        match args.partition() {
            None => Ok(Arc::clone(&self.statistics)),
            Some(p) => {
                let (d, chunks) = self.chunks_of(p);
                let rows = chunks
                    .iter()
                    .map(|&j| self.data.shard(d)[j].batch.num_rows())
                    .sum();
                let mut stats = Statistics::new_unknown(&self.schema);
                stats.num_rows = Precision::Exact(rows);
                Ok(Arc::new(stats))
            }
        }
    }
}
