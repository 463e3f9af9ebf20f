//! A device-output join's build side: where its rows are (host, or a device chunk left
//! where it lies), the hash table built over them, and, for a CollectLeft join, the one
//! table each device builds for all the partitions it runs.
//!
//! A CollectLeft join's build side is the whole of its child. When the child is a GPU
//! operator on the same devices (under DataFusion's `CoalescePartitionsExec`, or a single
//! partition), its chunks are gathered once, left on their devices, and each device that
//! runs a probe partition concatenates them into one batch of its own and builds one table
//! there, shared by its partitions. When more than one device builds, each chunk comes down
//! once (counted) and goes up to the devices it is not on: there is no peer-to-peer copy
//! yet. A child made from a replicated cached table (under GPU filters and projections) is
//! made whole by the first device to get to it from its own copy; each other device makes
//! it again from its copy, nothing crossing devices, or takes the first one's through the
//! host, whichever the cost model finds cheaper. Otherwise (a CPU child, or a join whose output goes to the host) the rows are
//! collected on the host once and their keys go up once per device.
//!
//! ```text
//!   child partitions ─▶ chunks (where they lie) ──▶ per device: concat ─▶ JoinTable
//!                        └─ keys down once, for the probe side's dynamic filter
//! ```

use super::*;
use crate::physical_plan::gpu_scan::GpuScanExec;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use fulmen_kernels::ops::concat::concat_columns;
use tokio::sync::OnceCell;

type Shared<T> = Result<Arc<T>, Arc<DataFusionError>>;

/// A CollectLeft join's build side per device: for a join whose output stays on the
/// device, its rows gathered once and the table each device built from them; for one
/// whose output goes to the host, the table each device built over the host rows.
#[derive(Default)]
pub(super) struct SharedDeviceBuild {
    /// Set once the chunks are gathered (or, from a replicated table, once the first
    /// device has made them).
    gathered: OnceCell<Result<(), Arc<DataFusionError>>>,
    /// The gathered chunks, until every device that needs them has built its table.
    chunks: Mutex<Option<Arc<Gathered>>>,
    /// Devices (by index) built so far.
    built: Mutex<usize>,
    /// For a build side made from a replicated table: what the first device made, until
    /// every device that needs it has built.
    leader: Mutex<Option<Arc<Leader>>>,
    per_device: Mutex<HashMap<usize, Arc<OnceCell<Shared<DeviceBuild>>>>>,
    /// For a join whose output goes to the host: the table each device built over the
    /// host rows (`None`: the device failed, its partitions match on the host).
    host_tables: Mutex<HashMap<usize, Arc<OnceCell<HostTable>>>>,
}

type HostTable = Result<Option<Arc<JoinTable>>, Arc<DataFusionError>>;

/// A build side's output columns on the device, by column.
pub(super) type BuildColumns = HashMap<usize, DeviceColumn>;

impl fmt::Debug for SharedDeviceBuild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedDeviceBuild")
            .field("gathered", &self.gathered.initialized())
            .finish_non_exhaustive()
    }
}

/// A CollectLeft build side's chunks, and, when more than one device builds from them,
/// each chunk's rows on the host (downloaded once, for the devices it is not on).
pub(super) struct Gathered {
    chunks: Vec<Chunk>,
    host: Vec<Option<RecordBatch>>,
}

/// A build side made from a replicated table by the first device to get to it.
pub(super) struct Leader {
    /// The device's index among the join's.
    device: usize,
    /// The chunks it made, on it.
    chunks: Vec<Chunk>,
    /// Their rows on the host, once another device takes them from there.
    host: Mutex<Option<Vec<Option<RecordBatch>>>>,
    /// Whether the other devices make the build side again from their own copies.
    remake: bool,
}

impl Leader {
    /// The chunks' rows on the host: downloaded once (counted), for every other device.
    fn host_rows(&self, metrics: &GpuMetrics) -> Result<Vec<Option<RecordBatch>>> {
        let mut held = self.host.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rows) = &*held {
            return Ok(rows.clone());
        }
        let rows = (self.chunks.iter())
            .map(|c| c.host_for_cpu(metrics).map(Some))
            .collect::<Result<Vec<_>>>()?;
        *held = Some(rows.clone());
        Ok(rows)
    }
}

/// Launches a GPU filter or projection is taken to cost per chunk when the cost model
/// weighs making a build side again against moving it ([`remake_pays`]): its program, the
/// count of the rows kept and their gather, about as the benchmarks count them.
const LAUNCHES_PER_STEP: usize = 4;

/// Whether a device should make a replicated build side of `bytes` again from its own copy
/// (`steps`: GPU operators times chunks, `waits`: the host waits that takes) rather than
/// take another device's through the host (down and up, one wait): by the cost model,
/// whichever is modelled cheaper.
pub(super) fn remake_pays(bytes: usize, steps: usize, waits: usize) -> bool {
    let model = fulmen_kernels::cost::H200;
    let moved = 2.0 * bytes as f64 / model.pcie_bytes_per_s + model.sync_s;
    let made = (steps * LAUNCHES_PER_STEP) as f64 * model.launch_s + waits as f64 * model.sync_s;
    moved > made
}

/// The GPU filters and projections between a replicated build side's child and its scan
/// times the chunks of the `index`-th device's copy, and the host waits that takes (a
/// filter waits once per chunk for the count of rows it keeps; a projection, or a scan
/// alone, does not).
fn replica_steps(child: &Arc<dyn ExecutionPlan>, index: usize) -> (usize, usize) {
    let mut node = Arc::clone(child);
    let (mut operators, mut filters) = (0, 0);
    loop {
        if let Some(scan) = node.downcast_ref::<GpuScanExec>() {
            let chunks = scan.data().shard(index).len();
            return (operators * chunks, filters * chunks);
        }
        filters += usize::from(node.name() == "GpuFilterExec");
        match node.children().first() {
            Some(next) => {
                // DataFusion's `CooperativeExec` over a scan does no device work.
                operators += usize::from(node.name() != "CooperativeExec");
                node = Arc::clone(*next);
            }
            None => return (operators, filters),
        }
    }
}

/// Bytes of a chunk's columns (on the host for rows on the host).
fn chunk_bytes(chunk: &Chunk) -> usize {
    match chunk {
        Chunk::Device(batch, ..) => batch.columns().iter().map(|c| c.device_bytes()).sum(),
        Chunk::Host(batch) => batch.get_array_memory_size(),
    }
}

/// One device's build side, table and build output columns.
pub(super) struct DeviceBuild {
    pub(super) side: Arc<BuildSide>,
    pub(super) table: Option<Arc<JoinTable>>,
    pub(super) columns: BuildColumns,
}

impl JoinRun {
    /// Runs `work` on its device's shared stream (0), where a build side that all the
    /// device's partitions read is made: their streams then find it done, not waiting for
    /// one another's work (see `device_for`).
    fn on_shared_stream<T>(&self, work: impl FnOnce(&Self) -> T) -> T {
        fulmen_kernels::device::in_stream(0, || work(self))
    }

    /// This partition's device's index among the join's devices.
    fn device_index(&self) -> Result<usize> {
        (self.devices.iter().position(|d| d == &self.device))
            .ok_or_else(|| internal_datafusion_err!("a join partition off its devices"))
    }

    /// The table over a CollectLeft join's host build rows on this partition's device:
    /// built (its keys uploaded) by the first of the device's partitions to get here,
    /// shared with the others.
    pub(super) async fn shared_host_table(
        &self,
        shared: &SharedBuild,
        build: &RecordBatch,
    ) -> Result<Option<Arc<JoinTable>>> {
        let index = self.device_index()?;
        let cell = Arc::clone(
            (shared
                .device
                .host_tables
                .lock()
                .unwrap_or_else(|p| p.into_inner()))
            .entry(index)
            .or_default(),
        );
        cell.get_or_init(|| async {
            (self.on_shared_stream(|run| run.host_table(build))).map_err(Arc::new)
        })
        .await
        .clone()
        .map_err(DataFusionError::Shared)
    }

    /// The build side of a CollectLeft join on this partition's device: built by the first
    /// of its partitions to get here, shared with the others.
    pub(super) async fn shared_device_build(
        &self,
        shared: &SharedBuild,
        partitions: usize,
    ) -> Result<Arc<DeviceBuild>> {
        let state = &shared.device;
        if let Some(child) = self.replicated_left() {
            return self.replica_build(state, &child, partitions).await;
        }
        state
            .gathered
            .get_or_init(|| async {
                let gathered = self.gather_left(partitions).await.map_err(Arc::new)?;
                *state.chunks.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(gathered));
                Ok(())
            })
            .await
            .clone()
            .map_err(DataFusionError::Shared)?;
        let index = self.device_index()?;
        let cell = Arc::clone(
            (state.per_device.lock().unwrap_or_else(|p| p.into_inner()))
                .entry(index)
                .or_default(),
        );
        let built = cell
            .get_or_init(|| async {
                let chunks = (state
                    .chunks
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone())
                .ok_or_else(|| {
                    Arc::new(internal_datafusion_err!("a build side released too early"))
                })?;
                let built = self
                    .on_shared_stream(|run| run.build_on_device(&chunks.chunks, &chunks.host))
                    .map(Arc::new)
                    .map_err(Arc::new);
                // The devices that run a partition: once each has built, the gathered
                // chunks go (each device keeps its own batch).
                let needed = partitions.min(self.devices.len());
                let mut done = state.built.lock().unwrap_or_else(|p| p.into_inner());
                *done += 1;
                if *done >= needed {
                    state
                        .chunks
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .take();
                }
                built
            })
            .await
            .clone()
            .map_err(DataFusionError::Shared)?;
        Ok(built)
    }

    /// The child under the join's `CoalescePartitionsExec` when it is a GPU operator on the
    /// same devices that every device can make whole from its own copy of a replicated
    /// table.
    fn replicated_left(&self) -> Option<Arc<dyn ExecutionPlan>> {
        self.coalesced_gpu_child()
            .filter(|child| super::super::resident(child).is_some_and(|r| r.replicated()))
    }

    /// The child under the join's `CoalescePartitionsExec` (without a limit), when it is
    /// a GPU operator on the same devices.
    fn coalesced_gpu_child(&self) -> Option<Arc<dyn ExecutionPlan>> {
        (self.left.downcast_ref::<CoalescePartitionsExec>())
            .filter(|c| c.fetch().is_none())
            .map(|c| Arc::clone(c.input()))
            .filter(|child| super::super::resident_on(child, &self.devices).is_some())
    }

    /// The build side on this partition's device when the child can be made whole on each
    /// device from its own copy of a replicated table, by the first of the device's
    /// partitions to get here, shared with the others. The first device to get here makes
    /// it from its copy (counting the rows and filling the probe side's dynamic filter);
    /// each other device either makes it again from its own copy, nothing crossing devices,
    /// or takes the first device's through the host, whichever the cost model finds cheaper
    /// ([`remake_pays`]).
    async fn replica_build(
        &self,
        state: &SharedDeviceBuild,
        child: &Arc<dyn ExecutionPlan>,
        partitions: usize,
    ) -> Result<Arc<DeviceBuild>> {
        let index = self.device_index()?;
        let cell = Arc::clone(
            (state.per_device.lock().unwrap_or_else(|p| p.into_inner()))
                .entry(index)
                .or_default(),
        );
        cell.get_or_init(|| async {
            let made = async {
                let leader = self.replica_leader(state, child, index, partitions).await?;
                if leader.device == index {
                    self.on_shared_stream(|run| run.build_on_device(&leader.chunks, &[]))
                } else if leader.remake {
                    let chunks = self.replica_chunks(child, index).await?;
                    self.on_shared_stream(|run| run.build_on_device(&chunks, &[]))
                } else {
                    let host = leader.host_rows(&self.metrics)?;
                    self.on_shared_stream(|run| run.build_on_device(&leader.chunks, &host))
                }
            };
            let built = made.await;
            // Once every device that runs a partition has built (or failed to), the first
            // device's chunks go.
            let mut done = state.built.lock().unwrap_or_else(|p| p.into_inner());
            *done += 1;
            if *done >= partitions.min(self.devices.len()) {
                state
                    .leader
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
            }
            built.map(Arc::new).map_err(Arc::new)
        })
        .await
        .clone()
        .map_err(DataFusionError::Shared)
    }

    /// The build side as the first device to get here made it from its copy.
    async fn replica_leader(
        &self,
        state: &SharedDeviceBuild,
        child: &Arc<dyn ExecutionPlan>,
        index: usize,
        partitions: usize,
    ) -> Result<Arc<Leader>> {
        state
            .gathered
            .get_or_init(|| async {
                let made = async {
                    let chunks = self.replica_chunks(child, index).await?;
                    self.extra
                        .build_rows
                        .add(chunks.iter().map(Chunk::num_rows).sum());
                    let bytes = chunks.iter().map(chunk_bytes).sum();
                    let (steps, waits) = replica_steps(child, index);
                    let remake = remake_pays(bytes, steps, waits);
                    let leader = Arc::new(Leader {
                        device: index,
                        chunks,
                        host: Mutex::new(None),
                        remake,
                    });
                    if self.probe_filter.is_some() {
                        // From the rows other devices take through the host, when they do.
                        match !remake && partitions.min(self.devices.len()) > 1 {
                            true => {
                                let keys = leader
                                    .host_rows(&self.metrics)
                                    .and_then(|rows| self.host_keys(&rows));
                                self.report_keys(0, keys);
                            }
                            false => self.report_chunk_keys(0, &leader.chunks),
                        }
                    }
                    *state.leader.lock().unwrap_or_else(|p| p.into_inner()) = Some(leader);
                    Ok(())
                };
                made.await.map_err(Arc::new)
            })
            .await
            .clone()
            .map_err(DataFusionError::Shared)?;
        (state
            .leader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone())
        .ok_or_else(|| internal_datafusion_err!("a build side released too early"))
    }

    /// The child's whole output made on the `index`-th device from its copy.
    async fn replica_chunks(
        &self,
        child: &Arc<dyn ExecutionPlan>,
        index: usize,
    ) -> Result<Vec<Chunk>> {
        let resident = super::super::resident(child)
            .ok_or_else(|| internal_datafusion_err!("a replica without a GPU child"))?;
        let mut stream = resident.execute_replica(index, Arc::clone(&self.context))?;
        let mut chunks = Vec::new();
        while let Some(chunk) = stream.next().await {
            chunks.push(chunk?);
        }
        Ok(chunks)
    }

    /// The child's rows as chunks: from every partition of a GPU child on the same devices
    /// (under a `CoalescePartitionsExec`, or alone), left where they lie; else its host
    /// batches. When the join's `probe_partitions` run on more than one device, every chunk is
    /// on a device some other needs it on: each comes down once (a wait per chunk, as
    /// collecting it on the host would), for those devices to upload. The probe side's
    /// dynamic filter is filled from their keys.
    async fn gather_left(&self, probe_partitions: usize) -> Result<Gathered> {
        let (source, partitions) = match self.coalesced_gpu_child() {
            Some(child) => {
                let n = child.output_partitioning().partition_count();
                (child, n)
            }
            None => (Arc::clone(&self.left), 1),
        };
        let collect = |partition: usize| {
            let context = Arc::clone(&self.context);
            let stream = input_chunks(&source, partition, context, &self.devices);
            async move {
                let mut chunks = Vec::new();
                let mut stream = stream?;
                while let Some(chunk) = stream.next().await {
                    chunks.push(chunk?);
                }
                Ok::<_, DataFusionError>(chunks)
            }
        };
        let parts = futures::future::try_join_all((0..partitions).map(collect)).await?;
        let chunks: Vec<Chunk> = parts.into_iter().flatten().collect();
        let rows: usize = chunks.iter().map(Chunk::num_rows).sum();
        self.extra.build_rows.add(rows);
        let host = match probe_partitions.min(self.devices.len()) > 1 {
            true => chunks
                .iter()
                .map(|c| c.host_for_cpu(&self.metrics).map(Some))
                .collect::<Result<Vec<_>>>()?,
            false => vec![None; chunks.len()],
        };
        if self.probe_filter.is_some() {
            match host.iter().all(Option::is_some) {
                true => self.report_keys(0, self.host_keys(&host)),
                false => self.report_chunk_keys(0, &chunks),
            }
        }
        Ok(Gathered { chunks, host })
    }

    /// The key columns of build rows already on the host, as one batch.
    fn host_keys(&self, host: &[Option<RecordBatch>]) -> Result<RecordBatch> {
        let batches: Vec<RecordBatch> = host.iter().flatten().cloned().collect();
        concat_batches(&self.left.schema(), &batches)
            .and_then(|b| b.project(&self.work.left_keys))
            .map_err(arrow_err)
    }

    /// Fills the probe side's dynamic filter with `partition`'s build keys (a batch of the
    /// key columns alone); failing to get them only costs the pruning.
    pub(super) fn report_keys(&self, partition: usize, keys: Result<RecordBatch>) {
        match keys {
            Ok(keys) => {
                let at: Vec<usize> = (0..keys.num_columns()).collect();
                fill_probe_filter(self.probe_filter.as_deref(), partition, &keys, &at);
            }
            Err(e) => log::warn!("the probe side's dynamic filter stays empty: {e}"),
        }
    }

    /// The key columns of every chunk, on the host: each device's chunks' keys downloaded
    /// in one wait (counted); a device that fails has its chunks' rows computed again.
    pub(super) fn keys_of(&self, chunks: &[Chunk]) -> Result<RecordBatch> {
        let schema = self.left.schema();
        let keys = &self.work.left_keys;
        let fields: Vec<_> = keys.iter().map(|&k| schema.field(k).clone()).collect();
        let keys_schema = Arc::new(datafusion::arrow::datatypes::Schema::new(fields));
        let mut found: Vec<Option<RecordBatch>> = vec![None; chunks.len()];
        // Device chunks by the device of their first key column.
        let mut by_device: Vec<(Device, Vec<usize>)> = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            match chunk {
                Chunk::Host(batch) => found[i] = Some(batch.project(keys).map_err(arrow_err)?),
                Chunk::Device(batch, ..) => {
                    let device = batch.columns()[keys[0]].device();
                    match by_device.iter_mut().find(|(d, _)| d == device) {
                        Some((_, at)) => at.push(i),
                        None => by_device.push((device.clone(), vec![i])),
                    }
                }
            }
        }
        for (_, at) in by_device {
            let wanted: Vec<(&DeviceColumn, &DataType)> = at
                .iter()
                .flat_map(|&i| match &chunks[i] {
                    Chunk::Device(batch, ..) => keys
                        .iter()
                        .map(|&k| (&batch.columns()[k], schema.field(k).data_type()))
                        .collect(),
                    Chunk::Host(_) => Vec::new(),
                })
                .collect();
            match self.metrics.download(&wanted) {
                Ok(arrays) => {
                    for (&i, arrays) in at.iter().zip(arrays.chunks(keys.len())) {
                        let batch = RecordBatch::try_new(Arc::clone(&keys_schema), arrays.to_vec())
                            .map_err(arrow_err)?;
                        found[i] = Some(batch);
                    }
                }
                Err(e) => {
                    self.metrics.recover(&e, "reading the build keys again")?;
                    for &i in &at {
                        let rows = chunks[i].host_for_cpu(&self.metrics)?;
                        found[i] = Some(rows.project(keys).map_err(arrow_err)?);
                    }
                }
            }
        }
        let batches: Vec<RecordBatch> = found.into_iter().flatten().collect();
        concat_batches(&keys_schema, &batches).map_err(arrow_err)
    }

    /// This device's build side from the gathered chunks: concatenated here when any lies
    /// on a device (one on this device is used as it is), else collected on the host; and
    /// its table.
    fn build_on_device(
        &self,
        chunks: &[Chunk],
        host: &[Option<RecordBatch>],
    ) -> Result<DeviceBuild> {
        let schema = self.left.schema();
        let rows: usize = chunks.iter().map(Chunk::num_rows).sum();
        let side = match rows > 0 && chunks.iter().any(|c| matches!(c, Chunk::Device(..))) {
            true => match self.concat_here(chunks, host) {
                Ok(chunk) => BuildSide::on_device(chunk),
                Err(e) => {
                    self.metrics
                        .recover(&e, "collecting the build side on the host")?;
                    BuildSide::on_host(host_rows(&schema, chunks, &self.metrics)?)
                }
            },
            false => BuildSide::on_host(host_rows(&schema, chunks, &self.metrics)?),
        };
        let (table, columns) = self.table_for(&side)?;
        Ok(DeviceBuild {
            side: Arc::new(side),
            table,
            columns,
        })
    }

    /// The chunks as one device chunk on this partition's device: each column's pieces
    /// (a chunk from the host or another device uploaded here: from its rows in `host`
    /// when they came down already, else downloaded in one wait; counted) concatenated
    /// here. Its redo concatenates the pieces' redos.
    pub(super) fn concat_here(
        &self,
        chunks: &[Chunk],
        host: &[Option<RecordBatch>],
    ) -> Result<Chunk, KernelError> {
        let schema = self.left.schema();
        let width = schema.fields().len();
        let mut pieces: Vec<Vec<DeviceColumn>> = vec![Vec::new(); width];
        for (i, chunk) in chunks.iter().enumerate().filter(|(_, c)| c.num_rows() > 0) {
            match chunk {
                Chunk::Device(batch, ..)
                    if batch.columns().iter().all(|c| c.device() == &self.device) =>
                {
                    for (c, column) in batch.columns().iter().enumerate() {
                        pieces[c].push(column.clone());
                    }
                }
                _ => {
                    let host = match host.get(i) {
                        Some(Some(rows)) => rows.clone(),
                        _ => chunk.to_host(&self.metrics)?,
                    };
                    for (c, array) in host.columns().iter().enumerate() {
                        pieces[c].push(self.metrics.upload(&self.device, array.as_ref())?);
                    }
                }
            }
        }
        let columns = pieces
            .iter()
            .map(|p| self.metrics.kernel(|| concat_columns(&self.device, p)))
            .collect::<Result<Vec<_>, _>>()?;
        let rows: usize = chunks.iter().map(Chunk::num_rows).sum();
        let fields: Vec<_> = (schema.fields().iter().zip(&columns))
            .map(|(f, c)| f.as_ref().clone().with_data_type(c.data_type().clone()))
            .collect();
        let device_schema = Arc::new(datafusion::arrow::datatypes::Schema::new(fields));
        let batch = fulmen_kernels::DeviceBatch::try_new(device_schema, columns, rows)?;
        let redos: Vec<Redo> = chunks.iter().map(Chunk::lineage).collect();
        let logical = Arc::clone(&schema);
        let redo = Redo::new(move || {
            let batches = redos.iter().map(Redo::run).collect::<Result<Vec<_>>>()?;
            concat_batches(&logical, &batches).map_err(arrow_err)
        });
        Ok(Chunk::Device(batch, schema, redo))
    }

    /// The table over a build side, and its output columns on the device: a device batch's
    /// own columns as they lie (NULL keys stay in the table; the probe's key check rejects
    /// them unless NULLs match), or the host rows' keys and output columns uploaded. A
    /// device error leaves no table: the partition matches on the host.
    pub(super) fn table_for(
        &self,
        build: &BuildSide,
    ) -> Result<(Option<Arc<JoinTable>>, BuildColumns)> {
        let mut columns = HashMap::new();
        if build.num_rows() == 0 {
            return Ok((None, columns));
        }
        let outputs = self.work.output_sources();
        let made = match build.device_batch() {
            Some(batch) => {
                let keys = (self.work.left_keys.iter())
                    .map(|&k| batch.columns()[k].clone())
                    .collect();
                for &(from_build, c) in &outputs {
                    if from_build {
                        columns.insert(c, batch.columns()[c].clone());
                    }
                }
                self.metrics.kernel(|| {
                    JoinTable::build(
                        &self.device,
                        keys,
                        None,
                        batch.num_rows(),
                        self.work.null_equals_null,
                    )
                })
            }
            None => {
                let host = build.host(&self.metrics)?;
                // A semi or anti join takes the few rows it emits from host rows there.
                let upload = !self.work.build_rows_on_device();
                self.build_table(&host).and_then(|t| {
                    for &(from_build, c) in outputs.iter().filter(|_| upload) {
                        if from_build && !columns.contains_key(&c) {
                            let column =
                                self.metrics.upload(&self.device, host.column(c).as_ref())?;
                            columns.insert(c, column);
                        }
                    }
                    Ok(t)
                })
            }
        };
        match made {
            Ok(t) => {
                if build.device_batch().is_some() {
                    self.extra.device_builds.add(1);
                }
                Ok((Some(Arc::new(t)), columns))
            }
            Err(e) => {
                self.metrics.recover(&e, "matching the join on the host")?;
                self.extra.cpu_fallback.add(1);
                Ok((None, HashMap::new()))
            }
        }
    }
}

/// The chunks' rows on the host, as one batch.
pub(super) fn host_rows(
    schema: &SchemaRef,
    chunks: &[Chunk],
    metrics: &GpuMetrics,
) -> Result<RecordBatch> {
    let batches = chunks
        .iter()
        .map(|c| c.host_for_cpu(metrics))
        .collect::<Result<Vec<_>>>()?;
    concat_batches(schema, &batches).map_err(arrow_err)
}

/// A partition's build side for a device-output join: its rows on the host, or the one
/// device chunk they arrived in, brought to the host only if the host needs them (a batch
/// matched there).
pub(super) struct BuildSide {
    rows: usize,
    host: Mutex<Option<RecordBatch>>,
    chunk: Option<Chunk>,
}

impl BuildSide {
    pub(super) fn on_host(batch: RecordBatch) -> Self {
        Self {
            rows: batch.num_rows(),
            host: Mutex::new(Some(batch)),
            chunk: None,
        }
    }

    pub(super) fn on_device(chunk: Chunk) -> Self {
        Self {
            rows: chunk.num_rows(),
            host: Mutex::new(None),
            chunk: Some(chunk),
        }
    }

    pub(super) fn num_rows(&self) -> usize {
        self.rows
    }

    /// The device chunk, when the build side is one.
    pub(super) fn device_batch(&self) -> Option<&fulmen_kernels::DeviceBatch> {
        match &self.chunk {
            Some(Chunk::Device(batch, ..)) => Some(batch),
            _ => None,
        }
    }

    /// The rows on the host: downloaded once (counted), or computed again on the CPU when
    /// their device is gone.
    pub(super) fn host(&self, metrics: &GpuMetrics) -> Result<RecordBatch> {
        let mut held = self.host.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(batch) = &*held {
            return Ok(batch.clone());
        }
        let chunk = self.chunk.as_ref().ok_or_else(|| {
            internal_datafusion_err!("a join's build side has neither rows nor a chunk")
        })?;
        let batch = chunk.host_for_cpu(metrics)?;
        *held = Some(batch.clone());
        Ok(batch)
    }

    /// The bytes [`host`](Self::host) would bring down: none once the rows are on the host.
    pub(super) fn bytes_to_download(&self) -> usize {
        let held = self.host.lock().unwrap_or_else(|p| p.into_inner());
        match (&*held, self.device_batch()) {
            (None, Some(batch)) => batch.columns().iter().map(|c| c.device_bytes()).sum(),
            _ => 0,
        }
    }

    /// How to have the rows on the host without the device: host data only, so that a
    /// redo holding it keeps no device memory.
    pub(super) fn lineage(&self) -> Redo {
        let held = self.host.lock().unwrap_or_else(|p| p.into_inner());
        match (&*held, &self.chunk) {
            (Some(batch), _) => Chunk::Host(batch.clone()).lineage(),
            (None, Some(chunk)) => chunk.lineage(),
            (None, None) => Redo::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::remake_pays;

    /// By the H200 model (55 GB/s each way, 4 µs a launch, 10 µs a wait), 4 launches per
    /// step: moving 1 MB down and up (36 µs and a wait) costs more than 2 steps (32 µs)
    /// and less than 3 steps and a wait (58 µs); a few kilobytes made by a filter are
    /// moved; a scan alone (no step, no wait) is always read from the device's own copy.
    #[test]
    fn a_build_side_is_made_again_where_moving_it_costs_more() {
        assert!(remake_pays(1_000_000, 2, 0));
        assert!(!remake_pays(1_000_000, 3, 1));
        assert!(!remake_pays(4_096, 1, 1));
        assert!(remake_pays(64 << 20, 100, 10));
        assert!(remake_pays(100, 0, 0));
    }
}
