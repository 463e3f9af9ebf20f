//! A partition's run: the build side collected (once, for CollectLeft), its table built
//! on the device, each coalesced probe batch matched there (or on the host), and the build
//! rows the join type emits at the end. An inner join whose output stays on the device
//! probes and gathers there (`device_probing.rs`).

use super::*;

/// The build side shared by the partitions of a CollectLeft join, and the build rows they
/// matched; the last partition to finish emits the build rows the join type keeps.
#[derive(Debug, Default)]
pub(super) struct SharedBuild {
    pub(super) batch: tokio::sync::OnceCell<Result<RecordBatch, Arc<DataFusionError>>>,
    pub(super) state: Mutex<(Vec<bool>, usize)>,
    /// For a join whose output stays on the device: the tables built per device.
    pub(super) device: SharedDeviceBuild,
}

#[derive(Debug, Clone)]
pub(super) struct JoinMetrics {
    pub(super) build_rows: Count,
    /// 1 when the build side did not fit on the device and the partition matched on the
    /// host.
    pub(super) cpu_fallback: Count,
    /// Tables built over build rows already on the device (none uploaded).
    pub(super) device_builds: Count,
    /// Batches of output for the host taken there from the device's pairs and probe rows
    /// instead of gathered on the device (see `DeviceProbing::gather_pays`).
    pub(super) host_takes: Count,
    /// Probe batches from the host whose matched rows were taken there and uploaded, for
    /// output that stays on the device, instead of their columns uploaded whole (see
    /// `DeviceProbing::take_pays`).
    pub(super) probe_takes: Count,
    /// Reads of a left semi or anti join's device marks (see `marks.rs`): one a partition,
    /// more where the probe rows it kept to match again grew past their bound.
    pub(super) mark_reads: Count,
}

pub(super) struct JoinRun {
    pub(super) work: Arc<JoinWork>,
    /// The devices the join's partitions run on.
    pub(super) devices: Arc<Vec<Device>>,
    pub(super) device: Device,
    pub(super) batch: BatchLimit,
    pub(super) metrics: GpuMetrics,
    pub(super) extra: JoinMetrics,
    pub(super) shared: Option<(Arc<SharedBuild>, usize)>,
    pub(super) probe_filter: Option<Arc<ProbeFilter>>,
    /// A fused stage's filter: probe chunks are of its input (see `fused.rs`).
    pub(super) fused: Option<Arc<FusedFilter>>,
    pub(super) left: Arc<dyn ExecutionPlan>,
    pub(super) partition: usize,
    pub(super) context: Arc<TaskContext>,
}

/// Reports a build side to the probe filter; a failure only costs the pruning.
pub(super) fn fill_probe_filter(
    filter: Option<&ProbeFilter>,
    partition: usize,
    build: &RecordBatch,
    keys: &[usize],
) {
    if let Some(filter) = filter
        && let Err(e) = filter.report(partition, build, keys)
    {
        log::warn!("the probe side's dynamic filter stays empty: {e}");
    }
}

pub(super) type BatchStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<RecordBatch>> + Send>>;

pub(super) async fn collect_side(
    plan: &Arc<dyn ExecutionPlan>,
    partition: usize,
    context: Arc<TaskContext>,
) -> Result<RecordBatch> {
    let mut stream = plan.execute(partition, context)?;
    let mut batches = Vec::new();
    while let Some(b) = stream.next().await {
        batches.push(b?);
    }
    concat_batches(&plan.schema(), &batches).map_err(arrow_err)
}

/// A partition's state while it probes.
pub(super) struct Probing {
    pub(super) run: JoinRun,
    pub(super) build: RecordBatch,
    pub(super) table: Option<Arc<JoinTable>>,
    pub(super) host: Option<HostIndex>,
    pub(super) visited: Vec<bool>,
    /// The probe child's batches: the join's right side, or a fused filter's input.
    pub(super) probe: SendableRecordBatchStream,
    /// The probe batches' columns that go to the device: the keys (and a fused filter's
    /// program inputs).
    pub(super) uploaded: Vec<usize>,
    /// Probe batches waiting to make up device batches, sized by the columns that go to
    /// the device.
    pub(super) batches: DeviceBatches<PartlyUploaded>,
    /// A left semi or anti join's matches marked on the device and not read yet (see
    /// `marks.rs`; other joins bring their pairs down).
    pub(super) marks: ProbeMarks,
    pub(super) done: bool,
}

impl JoinRun {
    pub(super) async fn start(self, probe: SendableRecordBatchStream) -> Result<BatchStream> {
        let build = self.build_side().await?;
        // An empty build side matches nothing: no device work.
        let table = match &self.shared {
            _ if build.num_rows() == 0 => None,
            Some((shared, _)) => self.shared_host_table(shared, &build).await?,
            None => self.host_table(&build)?,
        };
        let visited = vec![false; build.num_rows()];
        let batches = DeviceBatches::new(self.batch);
        let uploaded = match &self.fused {
            Some(fused) => fused.uploaded(&self.work.right_keys),
            None => self.work.right_keys.clone(),
        };
        let state = Probing {
            run: self,
            build,
            table,
            host: None,
            visited,
            probe,
            uploaded,
            batches,
            marks: ProbeMarks::default(),
            done: false,
        };
        Ok(Box::pin(futures::stream::try_unfold(
            state,
            |mut state| async move {
                loop {
                    if state.done {
                        return Ok(None);
                    }
                    if let Some(batch) = state.step().await? {
                        return Ok(Some((batch, state)));
                    }
                }
            },
        )))
    }

    /// The build side, collected once (shared by the partitions of a CollectLeft join).
    pub(super) async fn build_side(&self) -> Result<RecordBatch> {
        let build = match &self.shared {
            Some((shared, _)) => {
                let left = Arc::clone(&self.left);
                let context = Arc::clone(&self.context);
                let filter = self.probe_filter.clone();
                let keys = self.work.left_keys.clone();
                shared
                    .batch
                    .get_or_init(|| async move {
                        let build = collect_side(&left, 0, context).await.map_err(Arc::new)?;
                        fill_probe_filter(filter.as_deref(), 0, &build, &keys);
                        Ok(build)
                    })
                    .await
                    .clone()
                    .map_err(DataFusionError::Shared)?
            }
            None => {
                let build =
                    collect_side(&self.left, self.partition, Arc::clone(&self.context)).await?;
                let filter = self.probe_filter.as_deref();
                fill_probe_filter(filter, self.partition, &build, &self.work.left_keys);
                build
            }
        };
        self.extra.build_rows.add(build.num_rows());
        Ok(build)
    }

    /// The build side of a partition whose output stays on the device. A partitioned join
    /// whose build child is a GPU operator on the same devices takes the child's chunks and
    /// concatenates them on this device (one chunk here is kept as it lies; see
    /// `build_side.rs`): its key columns alone come down, for the probe side's dynamic
    /// filter when there is one. Other build sides are collected as
    /// [`build_side`](Self::build_side) does.
    async fn device_build_side(&self) -> Result<BuildSide> {
        let resident = super::super::resident_on(&self.left, &self.devices).is_some();
        if self.shared.is_some() || !resident {
            return Ok(BuildSide::on_host(self.build_side().await?));
        }
        let context = Arc::clone(&self.context);
        let mut stream = input_chunks(&self.left, self.partition, context, &self.devices)?;
        let mut chunks = Vec::new();
        while let Some(chunk) = stream.next().await {
            chunks.push(chunk?);
        }
        let rows: usize = chunks.iter().map(Chunk::num_rows).sum();
        if rows > 0 && chunks.iter().any(|c| matches!(c, Chunk::Device(..))) {
            match self.concat_here(&chunks, &[]) {
                Ok(chunk) => {
                    self.report_chunk_keys(self.partition, std::slice::from_ref(&chunk));
                    self.extra.build_rows.add(rows);
                    return Ok(BuildSide::on_device(chunk));
                }
                Err(e) => self
                    .metrics
                    .recover(&e, "collecting the build side on the host")?,
            }
        }
        let build = host_rows(&self.left.schema(), &chunks, &self.metrics)?;
        let filter = self.probe_filter.as_deref();
        fill_probe_filter(filter, self.partition, &build, &self.work.left_keys);
        self.extra.build_rows.add(build.num_rows());
        Ok(BuildSide::on_host(build))
    }

    /// An inner join whose output stays on the device: the build side's keys and output
    /// columns go up once (or are used where they lie, see
    /// [`device_build_side`](Self::device_build_side)), each probe chunk's matches are
    /// gathered there.
    ///
    /// With `to_host` (its parent is a CPU operator) each batch's output comes down, and a
    /// batch whose pairs and probe rows cost less to bring down than its gathered output
    /// (see [`DeviceProbing::gather_pays`]) is taken on the host instead.
    pub(super) async fn start_device(
        self,
        probe: ChunkStream,
        to_host: bool,
    ) -> Result<ChunkStream> {
        if self.work.build_rows_on_device() {
            return self.start_semi(probe, to_host).await;
        }
        let (build, table, build_columns) = self.device_build().await?;
        let batches = DeviceBatches::new(self.batch);
        let state = DeviceProbing {
            run: self,
            build,
            table,
            build_columns,
            host: None,
            probe,
            batches,
            to_host,
            ready: std::collections::VecDeque::new(),
        };
        Ok(Box::pin(futures::stream::try_unfold(
            state,
            |mut state| async move {
                loop {
                    if let Some(out) = state.ready.pop_front() {
                        return Ok(Some((out, state)));
                    }
                    let Some(chunk) = state.next_batch().await? else {
                        break;
                    };
                    let out = state.step(chunk)?;
                    state.ready.extend(out);
                }
                state.run.metrics.baseline.done();
                Ok(None)
            },
        )))
    }

    /// The build side of a partition that probes chunks: shared by the device's partitions
    /// (CollectLeft) or its own, where its rows lie (see
    /// [`device_build_side`](Self::device_build_side)); its table on this device, and its
    /// output columns there.
    pub(super) async fn device_build(
        &self,
    ) -> Result<(Arc<BuildSide>, Option<Arc<JoinTable>>, BuildColumns)> {
        match &self.shared {
            Some((shared, partitions)) => {
                let built = self.shared_device_build(shared, *partitions).await?;
                Ok((
                    Arc::clone(&built.side),
                    built.table.clone(),
                    built.columns.clone(),
                ))
            }
            None => {
                let side = self.device_build_side().await?;
                let (table, columns) = self.table_for(&side)?;
                Ok((Arc::new(side), table, columns))
            }
        }
    }

    /// The build rows every partition matched, once this one has probed everything: its
    /// own `visited` (Partitioned), or, for CollectLeft, everyone's merged, from the last
    /// partition to finish (`None` for the others).
    pub(super) fn all_visited(&self, visited: &mut Vec<bool>) -> Option<Vec<bool>> {
        let Some((shared, partitions)) = &self.shared else {
            return Some(std::mem::take(visited));
        };
        let mut state = shared.state.lock().unwrap_or_else(|p| p.into_inner());
        let (seen, finished) = &mut *state;
        if seen.len() < visited.len() {
            seen.resize(visited.len(), false);
        }
        for (s, v) in seen.iter_mut().zip(visited.iter()) {
            *s |= *v;
        }
        *finished += 1;
        (*finished >= *partitions).then(|| std::mem::take(seen))
    }

    /// Uploads the `keys` columns of `batch`, and the bitmap of the rows whose keys can
    /// match (none when all can).
    fn upload_keys(
        &self,
        batch: &RecordBatch,
        keys: &[usize],
    ) -> Result<(Vec<DeviceColumn>, Option<DeviceBuffer>), KernelError> {
        let arrays: Vec<ArrayRef> = keys.iter().map(|&c| Arc::clone(batch.column(c))).collect();
        let valid = key_validity(&arrays, self.work.null_equals_null);
        let columns = arrays
            .iter()
            .map(|k| self.metrics.upload(&self.device, k.as_ref()))
            .collect::<Result<Vec<DeviceColumn>, _>>()?;
        Ok((columns, upload_validity(&self.device, &valid)?))
    }

    /// The table over host build rows on this partition's device; `None` (the partition
    /// matches on the host) when the device failed.
    pub(super) fn host_table(&self, build: &RecordBatch) -> Result<Option<Arc<JoinTable>>> {
        match self.build_table(build) {
            Ok(t) => Ok(Some(Arc::new(t))),
            Err(e) => {
                self.metrics.recover(&e, "matching the join on the host")?;
                self.extra.cpu_fallback.add(1);
                Ok(None)
            }
        }
    }

    pub(super) fn build_table(&self, build: &RecordBatch) -> Result<JoinTable, KernelError> {
        let (columns, valid) = self.upload_keys(build, &self.work.left_keys)?;
        self.metrics.kernel(|| {
            JoinTable::build(
                &self.device,
                columns,
                valid.as_ref(),
                build.num_rows(),
                self.work.null_equals_null,
            )
        })
    }

    pub(super) fn device_matches(
        &self,
        table: &JoinTable,
        probe: &RecordBatch,
    ) -> Result<Matches, KernelError> {
        let (columns, valid) = self.upload_keys(probe, &self.work.right_keys)?;
        let refs: Vec<&DeviceColumn> = columns.iter().collect();
        let matches = self
            .metrics
            .kernel(|| table.probe(&refs, valid.as_ref(), probe.num_rows()))?;
        Ok(matches)
    }
}

impl Probing {
    /// One step: the output of the next device batch, or of the end (`None`: nothing to
    /// emit yet).
    pub(super) async fn step(&mut self) -> Result<Option<RecordBatch>> {
        let uploaded = &self.uploaded;
        let next = self
            .batches
            .next_from(&mut self.probe, |b| PartlyUploaded::new(b, uploaded))
            .await?;
        let Some(pending) = next else {
            self.done = true;
            return self.finish();
        };
        let pending: Vec<RecordBatch> = pending.into_iter().map(|p| p.batch).collect();
        let input = concat_batches(&self.probe.schema(), &pending).map_err(arrow_err)?;
        let elapsed = self.run.metrics.baseline.elapsed_compute().clone();
        let timer = elapsed.timer();
        let (probe, matches) = self.matches(&input)?;
        let matches = self.run.work.filter_pairs(&self.build, &probe, matches)?;
        let out = self
            .run
            .work
            .probe_output(&self.build, &probe, &matches, &mut self.visited);
        let read = match self.marks.full(&self.run) {
            true => self.read_marks(),
            false => Ok(()),
        };
        timer.done();
        let out = out?;
        read?;
        if let Some(b) = &out {
            self.run.metrics.record_batch(b);
        }
        Ok(out)
    }

    /// The probe rows of a batch of the probe child and the (build, probe) row pairs among
    /// them whose keys match. Under a fused filter, a piece matched on the device keeps
    /// every input row (its pairs only index rows the filter keeps), and one matched on
    /// the host is filtered there first by the filter's twin. A batch the device has no
    /// memory for is matched in halves; a piece the device cannot match is matched on the
    /// host (the loop every GPU operator shares, `device_loop.rs`).
    pub(super) fn matches(&mut self, input: &RecordBatch) -> Result<(RecordBatch, Matches)> {
        let mut all = Matches::default();
        let schema = Arc::clone(&self.run.work.right_schema);
        if self.build.num_rows() == 0 || input.num_rows() == 0 {
            // The join types that take a filter in emit no probe row without a match.
            let probe = match &self.run.fused {
                Some(_) => RecordBatch::new_empty(schema),
                None => input.clone(),
            };
            return Ok((probe, all));
        }
        // Pieces run in row order, so each starts where the last one ended.
        let mut probes = Vec::new();
        let mut at = 0u32;
        for (probe, m) in run_pieces(self, Chunk::Host(input.clone()))? {
            all.build.extend(m.build);
            all.probe.extend(m.probe.iter().map(|&p| p + at));
            at += probe.num_rows() as u32;
            probes.push(probe);
        }
        let probe = match probes.len() {
            1 => probes
                .pop()
                .unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(&schema))),
            _ => concat_batches(&schema, &probes).map_err(arrow_err)?,
        };
        Ok((probe, all))
    }

    /// A piece's matches on the device (`None`: a fused filter's program left a row to the
    /// CPU).
    fn device_matches(
        &self,
        table: &JoinTable,
        batch: &RecordBatch,
    ) -> Result<Option<Matches>, KernelError> {
        let run = &self.run;
        match &run.fused {
            Some(fused) => {
                let keys = &run.work.right_keys;
                let chunk = Chunk::Host(batch.clone());
                fused.matches(table, &chunk, keys, &run.device, &run.metrics)
            }
            None => run.device_matches(table, batch).map(Some),
        }
    }

    /// Brings the build rows marked on the device into `visited` (see
    /// [`ProbeMarks::read`]).
    fn read_marks(&mut self) -> Result<()> {
        let build = &self.build;
        let host_build = || Ok(build.clone());
        (self.marks).read(&self.run, &host_build, &mut self.host, &mut self.visited)
    }

    /// The build rows the join type emits once this partition (or, for CollectLeft, the
    /// last partition) has probed everything.
    pub(super) fn finish(&mut self) -> Result<Option<RecordBatch>> {
        self.read_marks()?;
        self.marks = ProbeMarks::default();
        let work = &self.run.work;
        if !work.emits_build_rows() {
            return Ok(None);
        }
        let Some(visited) = self.run.all_visited(&mut self.visited) else {
            return Ok(None);
        };
        let out = work.final_output(&self.build, &visited)?;
        if let Some(b) = &out {
            self.run.metrics.record_batch(b);
        }
        Ok(out)
    }
}

/// An inner join's output for one probe batch, matched on the host.
pub(super) fn host_probe(
    host: &mut Option<HostIndex>,
    work: &JoinWork,
    build: &RecordBatch,
    probe: &RecordBatch,
) -> Result<Option<RecordBatch>> {
    let matches = host_matches(host, work, build, probe)?;
    let mut visited = vec![false; build.num_rows()];
    work.probe_output(build, probe, &matches, &mut visited)
}

/// A host-assembled join's probe pieces: matched on the device (under a fused filter, the
/// pairs index the input's rows, see `fused.rs`), or on the host (the fused filter's twin
/// first).
impl PieceWork for Probing {
    type Out = (RecordBatch, Matches);
    const ON_FAILURE: Option<&'static str> = Some("matching a batch on the host");

    fn metrics(&self) -> &GpuMetrics {
        &self.run.metrics
    }

    fn run_on_device(
        &mut self,
        piece: &Chunk,
    ) -> Result<OnDevice<(RecordBatch, Matches)>, PieceError> {
        let batch = host_piece(piece)?;
        let Some(table) = self.table.clone() else {
            return Ok(OnDevice::GivenUp);
        };
        // A left semi or anti join without a residual filter marks its matches on the
        // device, read later: the piece itself emits nothing.
        if self.run.work.marks_matches() {
            let schema = Arc::clone(&self.run.work.right_schema);
            return match self.marks.mark(&self.run, &table, piece)? {
                true => Ok(OnDevice::Out((
                    RecordBatch::new_empty(schema),
                    Matches::default(),
                ))),
                false => Ok(OnDevice::ByRule),
            };
        }
        // `None`: a fused filter's program left a row to the CPU.
        let Some(matches) = self.device_matches(&table, batch)? else {
            return Ok(OnDevice::ByRule);
        };
        let probe = match &self.run.fused {
            Some(fused) => fused.host_view(batch, &self.run.work.right_schema)?,
            None => batch.clone(),
        };
        Ok(OnDevice::Out((probe, matches)))
    }

    fn run_on_cpu(
        &mut self,
        piece: &Chunk,
        _: BatchOn,
    ) -> Result<(RecordBatch, Matches), PieceError> {
        let batch = host_piece(piece)?;
        let probe = match &self.run.fused {
            Some(fused) => fused.cpu(batch)?,
            None => batch.clone(),
        };
        let matches = host_matches(&mut self.host, &self.run.work, &self.build, &probe)?;
        Ok((probe, matches))
    }
}

fn host_piece(piece: &Chunk) -> Result<&RecordBatch> {
    match piece {
        Chunk::Host(batch) => Ok(batch),
        Chunk::Device(..) => Err(internal_datafusion_err!("a probe piece left the host")),
    }
}
