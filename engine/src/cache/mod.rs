//! GPU-resident tables: `CACHE TABLE t` copies a table's rows into device memory once, so
//! that later queries read them where the kernels run instead of uploading them again.
//!
//! - **Placement.** Where the source tells its rows, they are cut into device chunks of at
//!   most `fulmen.gpu.batch_rows` rows and `fulmen.cache.chunk_bytes` bytes (every column;
//!   512 MiB by default, larger than a device batch from the host, as a query reads some
//!   of a chunk's columns and pays its fixed costs per chunk), as few as that allows but
//!   as many on every device, of equal rows (down to 65 536; a sharded table's part: as
//!   few, the last one smaller); else into chunks of a device batch's size
//!   (`fulmen.gpu.batch_bytes`). The chunks are dealt over the session's devices in turn,
//!   from the device the cache holds least of. A scan of the table ([`GpuScanExec`]) has a
//!   partition per device (or a multiple of that, to reach `target_partitions`), and
//!   partition p reads chunks of device p mod n, which is the device every GPU operator
//!   runs partition p on: a filter, projection, aggregation or join probe over a cached
//!   table takes its chunks on the device that holds them, with nothing uploaded.
//! - **Replication.** A table of at most `fulmen.cache.replicate_below` bytes (64 MiB by
//!   default), not sharded, goes whole to every device when there are several (each
//!   device's copy counts against its cache room; one that would not fit everywhere is
//!   dealt instead). A scan still reads each row once, chunk j from device (j + t) mod n,
//!   replicated tables taking turns at t; but a CollectLeft join whose build side is such
//!   a scan (under GPU filters and projections) can make its build side on each device
//!   from that device's own copy, so that a dimension table joined to a table spread or
//!   sharded over the devices need not cross between devices (it does where the cost
//!   model finds moving the made rows cheaper than making them again).
//! - **Sharding.** `CACHE TABLE t OPTIONS ('shard_key' 'k')` deals the rows by the hash of
//!   `k` instead: into `target_partitions` parts with DataFusion's own hash repartitioning
//!   (the same hash and seed as its `RepartitionExec`), part p on device p mod n. A scan
//!   of the table then says it is hash-partitioned on `k` (while `target_partitions` is
//!   unchanged and `k` is read), so DataFusion puts no repartition between it and a join
//!   or GROUP BY on `k`: co-sharded tables join part by part, each on its device, and an
//!   ordinary table joined to one is repartitioned to match it.
//! - **Encoding.** A string column with few distinct values (`fulmen.cache.dictionary_limit`)
//!   is held as 32-bit codes into one dictionary per device, shared by its chunks
//!   ([`dictionary`]): programs read it through the dictionary, gathers and downloads move
//!   only the codes.
//! - **Memory.** Cached chunks are ordinary device buffers, counted apart as the cache:
//!   together the cached tables hold at most `fulmen.cache.memory_limit` of each device
//!   (half the device by default). A CACHE that would pass it, or that meets a full device,
//!   fails with the sizes and caches nothing. Queries use the rest, and split their
//!   batches or finish on the CPU when it runs short, as they always do.
//! - **Consistency.** A cached table is a snapshot of its source, which the cache watches:
//!   a table of files (their paths, sizes and modification times) or of memory (its
//!   batches). A scan whose source no longer matches the snapshot, or that was written
//!   through SQL (INSERT, UPDATE, DELETE) since, reads the source instead, so no query sees
//!   stale rows; `REFRESH CACHE t` takes a new snapshot. `DROP TABLE t` and replacing `t`
//!   drop the cached rows with the table. `CACHE TABLE t AS SELECT …` first stores the
//!   query's rows as an in-memory table `t` (which `UNCACHE TABLE t` keeps).
//! - **Faults.** A chunk whose device is quarantined is read from the source instead (its
//!   rows, by their place in the source); a device lost while a chunk is in flight makes the
//!   consumer redo it from the source the same way.
//!
//! [`GpuScanExec`]: crate::physical_plan::gpu_scan::GpuScanExec

mod dictionary;
mod loader;
mod reread;
pub mod statements;
pub mod table;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::Time;
use datafusion::physical_plan::repartition::BatchPartitioner;
use fulmen_kernels::column::DeviceDictionary;
use fulmen_kernels::{Device, DeviceBatch};
use futures::StreamExt;

use crate::physical_plan::coalesce::{BatchLimit, Coalescer, host_bytes};

use loader::{Loader, Replicas, feed};
pub use reread::Reread;
pub use table::CachedTable;

/// A table's rows in device memory: its chunks, by the device that holds them.
#[derive(Debug)]
pub struct CachedData {
    name: String,
    schema: SchemaRef,
    devices: Arc<Vec<Device>>,
    /// `shards[d]`: the chunks on `devices[d]`, in the order of the source's rows.
    shards: Vec<Vec<CachedChunk>>,
    rows: usize,
    source: Fingerprint,
    sharding: Option<Sharding>,
    /// Whether every device holds all the rows (`shards[d]`: the same chunks on each).
    replicated: bool,
    /// The device the first chunk went to, or for a replicated table its turn: its scans
    /// read chunk j from device (j + first) mod n, so that small tables spread their reads.
    first: usize,
    /// `dictionaries[d]`: the dictionaries of the encoded columns on `devices[d]`, by
    /// column (see [`dictionary`]).
    dictionaries: Vec<Vec<(usize, Arc<DeviceDictionary>)>>,
}

/// How a table is to be cached (`CACHE TABLE t OPTIONS (…)`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheOptions {
    /// Deal the rows by the hash of this column rather than in turn.
    pub shard_key: Option<String>,
}

/// A table's rows dealt by the hash of a key, as DataFusion's hash repartitioning deals
/// them into `parts` partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    /// The key column's name.
    pub key: String,
    /// Its index among the source's columns.
    pub column: usize,
    /// Parts the rows are dealt into (part p on device p mod n).
    pub parts: usize,
}

impl Sharding {
    /// DataFusion's hash partitioner into the parts, over rows with the source's columns.
    fn partitioner(&self) -> Result<BatchPartitioner> {
        let key: Arc<dyn PhysicalExpr> = Arc::new(Column::new(&self.key, self.column));
        BatchPartitioner::new_hash_partitioner(vec![key], self.parts, Time::new())
    }
}

/// One device chunk of a cached table.
#[derive(Debug)]
pub struct CachedChunk {
    /// The rows, on their device (in device types: strings for string views).
    pub batch: DeviceBatch,
    /// The part it belongs to: its hash partition for a sharded table, else 0.
    pub part: usize,
    /// The place of its first row among its part's rows, the source read in order.
    pub first_row: usize,
}

impl CachedData {
    /// The table's name when it was cached.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host schema of the cached rows (the source's).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// The devices the chunks are dealt over, in order.
    pub fn devices(&self) -> &Arc<Vec<Device>> {
        &self.devices
    }

    /// The chunks on the `d`-th device.
    pub fn shard(&self, d: usize) -> &[CachedChunk] {
        self.shards.get(d).map_or(&[], Vec::as_slice)
    }

    /// Rows cached.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Devices holding some of the rows (each a whole copy when replicated).
    pub fn shards(&self) -> usize {
        self.shards.iter().filter(|s| !s.is_empty()).count()
    }

    /// Chunks cached, on every device (each replica's counted).
    pub fn chunks(&self) -> usize {
        self.shards.iter().map(Vec::len).sum()
    }

    /// Device bytes the table holds on `device` (size classes, as the device counts them).
    pub fn bytes_on(&self, device: &Device) -> usize {
        self.devices
            .iter()
            .zip(&self.shards)
            .filter(|(d, _)| *d == device)
            .flat_map(|(_, chunks)| chunks)
            .map(|c| batch_bytes(&c.batch))
            .sum::<usize>()
            + self
                .devices
                .iter()
                .zip(&self.dictionaries)
                .filter(|(d, _)| *d == device)
                .flat_map(|(_, dictionaries)| dictionaries)
                .map(|(_, d)| d.reserved_bytes())
                .sum::<usize>()
    }

    /// Device bytes the table holds on every device.
    pub fn bytes(&self) -> usize {
        self.shards
            .iter()
            .flatten()
            .map(|c| batch_bytes(&c.batch))
            .sum::<usize>()
            + self
                .dictionaries
                .iter()
                .flatten()
                .map(|(_, d)| d.reserved_bytes())
                .sum::<usize>()
    }

    /// The columns held dictionary-encoded (by index among the table's).
    pub fn encoded_columns(&self) -> BTreeSet<usize> {
        self.dictionaries
            .iter()
            .flatten()
            .map(|(c, _)| *c)
            .collect()
    }

    /// The source's identity when the rows were cached.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.source
    }

    /// How the rows are dealt by a key, when they are.
    pub fn sharding(&self) -> Option<&Sharding> {
        self.sharding.as_ref()
    }

    /// Whether every device holds all the rows, chunk for chunk (a table smaller than
    /// `fulmen.cache.replicate_below`).
    pub fn replicated(&self) -> bool {
        self.replicated
    }

    /// The device the first chunk went to (a replicated table's turn: see `first`).
    pub fn first_device(&self) -> usize {
        self.first
    }

    /// The options it was cached with.
    pub fn options(&self) -> CacheOptions {
        CacheOptions {
            shard_key: self.sharding.as_ref().map(|s| s.key.clone()),
        }
    }
}

fn batch_bytes(batch: &DeviceBatch) -> usize {
    batch.columns().iter().map(|c| c.reserved_bytes()).sum()
}

/// The cached tables alive in this process (dropped ones leave on their own).
fn registry() -> &'static Mutex<Vec<Weak<CachedData>>> {
    static REGISTRY: OnceLock<Mutex<Vec<Weak<CachedData>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Every cached table alive in this process, in the order they were cached.
pub fn cached_tables() -> Vec<Arc<CachedData>> {
    let mut all = registry().lock().unwrap_or_else(|p| p.into_inner());
    all.retain(|w| w.strong_count() > 0);
    all.iter().filter_map(Weak::upgrade).collect()
}

/// Device bytes the cached tables of this process hold on `device`.
pub fn cached_bytes_on(device: &Device) -> usize {
    cached_tables().iter().map(|t| t.bytes_on(device)).sum()
}

/// What a source was when its rows were cached: its files (path, size, modification time,
/// entity tag and version where the store has them) or its in-memory batches (the rows and
/// the arrays of each, by partition). Two equal fingerprints mean the
/// same rows in the same order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(BTreeSet<String>);

/// The fingerprint of a source scan: a single scan of files or of memory, else `None`
/// (the cache cannot tell when such a source changes).
pub fn fingerprint(plan: &Arc<dyn ExecutionPlan>) -> Option<Fingerprint> {
    let scan = plan.downcast_ref::<DataSourceExec>()?;
    let source = scan.data_source();
    let mut parts = BTreeSet::new();
    if let Some(files) = source.downcast_ref::<FileScanConfig>() {
        for file in files.file_groups.iter().flat_map(|g| g.iter()) {
            let meta = &file.object_meta;
            parts.insert(format!(
                "file {} {} {} {:?} {:?} {:?}",
                meta.location,
                meta.size,
                meta.last_modified.timestamp_nanos_opt().unwrap_or_default(),
                meta.e_tag,
                meta.version,
                file.partition_values
            ));
        }
    } else if let Some(memory) = source.downcast_ref::<MemorySourceConfig>() {
        // Each batch by its rows and its columns' arrays (shared by every scan of the same
        // batches; a write replaces them).
        for (p, batches) in memory.partitions().iter().enumerate() {
            for (i, batch) in batches.iter().enumerate() {
                let arrays: Vec<usize> = batch
                    .columns()
                    .iter()
                    .map(|c| Arc::as_ptr(c) as *const u8 as usize)
                    .collect();
                parts.insert(format!("memory {p} {i} {} {arrays:x?}", batch.num_rows()));
            }
        }
    } else {
        return None;
    }
    Some(Fingerprint(parts))
}

/// The fewest rows a chunk is cut to so that every device gets some of a table.
const MIN_SPREAD_ROWS: usize = 1 << 16;

/// The chunk size for a table (or a shard key's part of one) of about `rows` rows of about
/// `per_row` bytes dealt over `n` devices (1 for a shard key's `part`, which lies on one):
/// as few chunks as `limit` allows (in rows and in bytes), rounded up to a multiple of `n`
/// so that every device gets as many rows, and of equal rows (a part's: see below); but no
/// fewer rows than [`MIN_SPREAD_ROWS`], so that a device's share of a small table does not cost
/// more in fixed costs (launches, waits, a join's build per partition) than it saves. A
/// query runs a cached table chunk by chunk, each chunk costing launches and a wait per
/// operator, so fewer chunks cost less. `limit`'s bytes still bound each chunk (the rows
/// of later batches may be wider).
fn chunk_limit(limit: BatchLimit, rows: usize, per_row: usize, n: usize, part: bool) -> BatchLimit {
    let n = n.max(1);
    let by_rows = rows.div_ceil(limit.rows);
    // The first batch's width is a sample: a quarter more leaves room for wider rows
    // later, so that the bytes limit seldom cuts a chunk short of its share.
    let bytes = rows.saturating_mul(per_row.max(1)).saturating_mul(5) / 4;
    let by_bytes = bytes.div_ceil(limit.bytes);
    let chunks = by_rows.max(by_bytes).max(1).next_multiple_of(n);
    let share = rows.div_ceil(chunks);
    // A part's rows are an estimate (its hash deals it a few more or fewer): its chunks get
    // an eighth more room, so that a part a little larger than its share does not end in a
    // chunk of a few rows. Its last chunk is smaller instead, on the same device.
    let share = match part {
        true => share + share / 8,
        false => share,
    };
    BatchLimit::new(limit.rows.min(share.max(MIN_SPREAD_ROWS)), limit.bytes)
}

/// How much of each device the cache may hold: `limit`, or half the device.
fn cache_limit(device: &Device, limit: Option<usize>) -> usize {
    limit.unwrap_or(device.memory_budget() / 2)
}

/// Reads `source` (a scan of the table's files or memory, every column) and copies its
/// rows to `devices` in chunks of at most `batch.rows` rows and `chunk_bytes` bytes, as
/// [`chunk_limit`] evens them out where the source tells its rows (else of at most
/// `batch`, a device batch's size, so that they still spread): dealt in turn, or with
/// `sharding`, by the hash of its key, part p to device p mod n. Nothing stays cached when
/// any of it fails: the error says why, with the sizes when the rows do not fit.
#[allow(clippy::too_many_arguments)]
pub async fn cache(
    name: &str,
    source: &Arc<dyn ExecutionPlan>,
    task: Arc<TaskContext>,
    devices: Arc<Vec<Device>>,
    batch: BatchLimit,
    chunk_bytes: usize,
    dictionary_limit: usize,
    limit: Option<usize>,
    replicate_below: usize,
    sharding: Option<Sharding>,
) -> Result<Arc<CachedData>> {
    let fingerprint = fingerprint(source).ok_or_else(|| {
        DataFusionError::Plan(format!(
            "CACHE TABLE {name}: only tables of files or of memory can be cached (the cache \
             watches them for changes); CACHE TABLE {name}_cached AS SELECT * FROM {name} \
             caches a snapshot of its rows"
        ))
    })?;
    if devices.is_empty() {
        return Err(DataFusionError::Plan(format!(
            "CACHE TABLE {name}: no device in service to cache it on"
        )));
    }
    let n = devices.len();
    // Where the source tells its rows, the chunk size is set by the first batch's bytes
    // per row (`chunk_limit`), so that the devices get equal shares. Where it does not,
    // chunks of a device batch's size spread the rows over the devices as they come.
    // A sharded table's parts each lie on one device: a part's chunks are evened out.
    let (ways, parts) = match &sharding {
        None => (n, 1),
        Some(s) => (1, s.parts.max(1)),
    };
    let estimated_rows = crate::gpu::overrides::estimated_rows(source)
        .filter(|&r| r > 0)
        .map(|r| r.div_ceil(parts));
    // One CACHE at a time: each counts the room the others left.
    static CACHING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one_at_a_time = CACHING.lock().await;
    // The first chunk goes to the device the cache holds least of, so that tables of one
    // chunk spread over the devices too.
    let first = (0..n)
        .min_by_key(|&d| cached_bytes_on(&devices[d]))
        .unwrap_or_default();
    // Columns that passed the dictionary limit in an earlier try, held plainly.
    let mut plain = BTreeSet::new();
    let (mut loader, replicated) = loop {
        let mut batch = batch;
        let mut sized = estimated_rows.is_none();
        let mut loader = Loader {
            name,
            first,
            room: devices
                .iter()
                .map(|d| cache_limit(d, limit).saturating_sub(cached_bytes_on(d)))
                .collect(),
            held: vec![0; n],
            shards: (0..n).map(|_| Vec::new()).collect(),
            devices: &devices,
            rows: 0,
            part_rows: vec![0; sharding.as_ref().map_or(1, |s| s.parts)],
            chunks: 0,
            full: None,
            needed: 0,
            sharded: sharding.is_some(),
            replicas: (n > 1 && sharding.is_none() && replicate_below > 0).then(|| Replicas {
                below: replicate_below,
                bytes: 0,
                held: Vec::new(),
            }),
            encoders: dictionary::Encoders::new(dictionary_limit, plain.clone()),
            overflow: None,
            dictionaries: (0..n).map(|_| Vec::new()).collect(),
        };
        let mut partitioner = sharding.as_ref().map(Sharding::partitioner).transpose()?;
        let mut pending: Vec<Coalescer<RecordBatch>> = (0..loader.part_rows.len())
            .map(|_| Coalescer::new(batch))
            .collect();
        'read: for partition in 0..source.properties().partitioning.partition_count() {
            let mut stream = source.execute(partition, Arc::clone(&task))?;
            while let Some(next) = stream.next().await {
                let next = next?;
                if !sized && next.num_rows() > 0 {
                    let per_row = host_bytes(&next).div_ceil(next.num_rows());
                    let limit = BatchLimit::new(batch.rows, chunk_bytes);
                    let part = sharding.is_some();
                    batch = chunk_limit(limit, estimated_rows.unwrap_or(0), per_row, ways, part);
                    // Nothing waits yet: the chunks are made up to the new size.
                    pending = (0..pending.len()).map(|_| Coalescer::new(batch)).collect();
                    sized = true;
                }
                deal(partitioner.as_mut(), next, |part, piece| {
                    feed(&mut loader, &mut pending[part], part, batch, piece)
                })?;
                if loader.overflow.is_some() {
                    break 'read;
                }
            }
        }
        for (part, pending) in pending.iter_mut().enumerate() {
            loader.place(part, pending.take())?;
        }
        if let Some(c) = loader.overflow {
            log::info!(
                "CACHE TABLE {name}: column {} has more than {dictionary_limit} distinct \
                 values; caching again with it held as strings",
                source.schema().field(c).name()
            );
            plain.insert(c);
            continue;
        }
        let replicated = loader.finish()?;
        loader.encode()?;
        break (loader, replicated);
    };
    let dictionaries = std::mem::take(&mut loader.dictionaries);
    let Loader {
        shards,
        rows,
        full,
        needed,
        first,
        ..
    } = loader;
    if let Some(why) = full {
        let limit_text = match limit {
            Some(l) => format!("fulmen.cache.memory_limit is {} per device", size(l)),
            None => "fulmen.cache.memory_limit is half of each device".to_string(),
        };
        let cached: usize = devices.iter().map(cached_bytes_on).sum();
        return Err(DataFusionError::ResourcesExhausted(format!(
            "CACHE TABLE {name}: its {rows} rows need about {} of device memory, more than \
             the cache has room for on {} ({} already held by other cached tables; \
             {limit_text}); {why}. Nothing was cached",
            size(needed),
            crate::gpu::devices::describe(&devices),
            size(cached)
        )));
    }
    let data = Arc::new(CachedData {
        name: name.to_string(),
        schema: source.schema(),
        devices,
        shards,
        rows,
        source: fingerprint,
        sharding,
        replicated,
        first,
        dictionaries,
    });
    registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Arc::downgrade(&data));
    Ok(data)
}

/// Deals `batch`'s rows into parts as the cache does, handing each part's rows to `to`:
/// all to part 0 when not sharded, else by the key's hash (`partitioner`). Caching and the
/// re-read of a lost device's rows both deal through here, so that they agree.
fn deal(
    partitioner: Option<&mut BatchPartitioner>,
    batch: RecordBatch,
    mut to: impl FnMut(usize, RecordBatch) -> Result<()>,
) -> Result<()> {
    match partitioner {
        None => to(0, batch),
        Some(partitioner) => partitioner.partition(batch, to),
    }
}

/// `12.3 MiB`.
pub fn size(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{ArrayRef, Int64Array};
    use datafusion::catalog::TableProvider;
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;

    use super::*;

    #[test]
    fn chunks_are_as_few_as_the_limits_allow_and_as_many_on_every_device() {
        let limit = BatchLimit::new(4 << 20, 512 << 20);
        // TPC-H SF 1's lineitem (6 M rows of about 175 bytes) on 2 devices: 1.3 GB with the
        // margin makes 3 chunks by bytes, 4 to deal evenly, of 1.5 M rows each.
        let l = chunk_limit(limit, 6_000_000, 175, 2, false);
        assert_eq!((l.rows, l.bytes), (1_500_000, 512 << 20));
        // Narrow rows: bounded by the rows a chunk may hold, then evened out.
        assert_eq!(chunk_limit(limit, 9_000_000, 8, 2, false).rows, 2_250_000);
        // A small table: one chunk per device, but not under 65 536 rows.
        assert_eq!(chunk_limit(limit, 300_000, 100, 4, false).rows, 75_000);
        assert_eq!(
            chunk_limit(limit, 100_000, 100, 4, false).rows,
            MIN_SPREAD_ROWS
        );
        assert_eq!(chunk_limit(limit, 1, 1, 1, false).rows, MIN_SPREAD_ROWS);
        // A shard key's part of about 300 000 rows: room for an eighth more in one chunk.
        assert_eq!(chunk_limit(limit, 300_000, 175, 1, true).rows, 337_500);
    }

    /// Two in-memory sources with the same row counts but other arrays differ: a write that
    /// keeps every row count is still seen.
    #[tokio::test]
    async fn a_memory_source_rewritten_with_the_same_row_counts_is_seen() {
        let table = |v: i64| {
            let column: ArrayRef = Arc::new(Int64Array::from(vec![v; 3]));
            let batch = RecordBatch::try_from_iter([("a", column)]).unwrap();
            MemTable::try_new(batch.schema(), vec![vec![batch]]).unwrap()
        };
        let state = SessionContext::new().state();
        let (one, other) = (table(1), table(2));
        let first = fingerprint(&one.scan(&state, None, &[], None).await.unwrap()).unwrap();
        let again = fingerprint(&one.scan(&state, Some(&vec![0]), &[], None).await.unwrap());
        assert_eq!(Some(first.clone()), again, "the same batches");
        let other = fingerprint(&other.scan(&state, None, &[], None).await.unwrap());
        assert_ne!(Some(first), other);
    }
}
