//! A left semi or anti join without a residual filter over a build side from a GPU child on
//! the same devices (`DeviceSemi`): it emits build rows only, so its build side stays
//! where it lies (its keys are never uploaded again, its rows never come down whole). Each
//! probe chunk (from the host, or from a GPU child where it lies, under a fused filter's
//! row mask when the join takes one in) marks the build rows it matches in a bitmap on the
//! device, with no host wait (`marks.rs`); once the probe side has ended (for CollectLeft,
//! in the last partition to finish) the rows the join emits, matched (semi) or never
//! matched (anti), are gathered on the device, for a GPU parent to read where they lie or
//! brought down.
//!
//! ```text
//!   build child ─▶ chunks where they lie ─▶ JoinTable (keys as they lie)
//!   probe chunk ─▶ (fused filter's mask) ─▶ marks on the device ─▶ (read) visited
//!   probe ends ─▶ emitted rows up ─▶ gather build columns ─▶ chunk (down for a CPU parent)
//!   device error ─▶ that batch matched on the host; the end taken from host rows
//! ```

use super::*;

/// A partition of a left semi or anti join whose build rows stay on the device.
pub(super) struct DeviceSemi {
    run: JoinRun,
    build: Arc<BuildSide>,
    /// Shared by the partitions on this device (CollectLeft); `None`: the build side is
    /// empty, or the device could not build it and every batch is matched on the host.
    table: Option<Arc<JoinTable>>,
    /// The build side's output columns on the device.
    build_columns: BuildColumns,
    host: Option<HostIndex>,
    probe: ChunkStream,
    batches: DeviceBatches<Chunk>,
    /// The build rows this partition matched, as far as the host has read them.
    visited: Vec<bool>,
    /// The rows marked on the device, not read yet.
    marks: ProbeMarks,
    /// The output goes to the host (the join's parent is a CPU operator).
    to_host: bool,
}

impl JoinRun {
    /// A left semi or anti join's partition over build rows kept where they lie: its one
    /// output chunk (none when no row is emitted, or for a CollectLeft partition that is not
    /// the last to finish) after the probe side has ended.
    pub(super) async fn start_semi(self, probe: ChunkStream, to_host: bool) -> Result<ChunkStream> {
        let (build, table, build_columns) = self.device_build().await?;
        let visited = vec![false; build.num_rows()];
        let mut state = DeviceSemi {
            batches: DeviceBatches::new(self.batch),
            run: self,
            build,
            table,
            build_columns,
            host: None,
            probe,
            visited,
            marks: ProbeMarks::default(),
            to_host,
        };
        let emitted = async move {
            while let Some(chunk) = state.next_batch().await? {
                state.step(chunk)?;
            }
            let elapsed = state.run.metrics.baseline.elapsed_compute().clone();
            let timer = elapsed.timer();
            let out = state.finish();
            timer.done();
            state.run.metrics.baseline.done();
            out
        };
        Ok(Box::pin(
            futures::stream::once(emitted).filter_map(|out| async move { out.transpose() }),
        ))
    }
}

impl DeviceSemi {
    /// The next device batch of probe rows: host chunks coalesced (see `device_loop.rs`), a
    /// device chunk as it is; `None` once the probe side has ended.
    async fn next_batch(&mut self) -> Result<Option<Chunk>> {
        match self.batches.next_from(&mut self.probe, |c| c).await? {
            Some(items) => one_chunk(items).map(Some),
            None => Ok(None),
        }
    }

    /// Marks the build rows a probe chunk matches: on the device (in halves when it has no
    /// memory for the chunk), or on the host (the loop every GPU operator shares).
    fn step(&mut self, chunk: Chunk) -> Result<()> {
        if self.build.num_rows() == 0 || chunk.num_rows() == 0 {
            return Ok(());
        }
        let elapsed = self.run.metrics.baseline.elapsed_compute().clone();
        let _timer = elapsed.timer();
        for matched in run_pieces(self, chunk)? {
            for b in matched {
                self.visited[b as usize] = true;
            }
        }
        if self.marks.full(&self.run) {
            self.read_marks()?;
        }
        Ok(())
    }

    /// Brings the rows marked on the device into `visited` (see [`ProbeMarks::read`]).
    fn read_marks(&mut self) -> Result<()> {
        let (run, build) = (&self.run, &self.build);
        let host_build = || build.host(&run.metrics);
        (self.marks).read(run, &host_build, &mut self.host, &mut self.visited)
    }

    /// The rows the join emits, once this partition (for CollectLeft, the last one) has
    /// probed everything: gathered from the build side's columns on the device when they
    /// are there (brought down for a CPU parent), else taken from its host rows.
    fn finish(&mut self) -> Result<Option<Chunk>> {
        self.read_marks()?;
        self.marks = ProbeMarks::default();
        let Some(visited) = self.run.all_visited(&mut self.visited) else {
            return Ok(None);
        };
        let want = self.run.work.join_type == JoinType::LeftSemi;
        let rows: Vec<u32> = (0..visited.len() as u32)
            .filter(|&i| visited[i as usize] == want)
            .collect();
        if rows.is_empty() {
            return Ok(None);
        }
        let metrics = &self.run.metrics;
        if self.table.is_some() && self.build.device_batch().is_some() {
            match self.gather(&rows, &visited) {
                Ok(chunk) => {
                    let out = match self.to_host {
                        true => Chunk::Host(chunk.host_for_cpu(metrics)?),
                        false => chunk,
                    };
                    metrics.record_chunk(&out);
                    return Ok(Some(out));
                }
                Err(e) => metrics.recover(&e, "taking the join's build rows on the host")?,
            }
        }
        let build = self.build.host(metrics)?;
        let out = self.run.work.final_output(&build, &visited)?;
        if let Some(b) = &out {
            metrics.record_batch(b);
        }
        Ok(out.map(Chunk::Host))
    }

    /// The emitted build `rows` gathered on the device (their numbers uploaded); made again
    /// on the CPU from the build side's lineage should the device be lost before the parent
    /// reads them.
    fn gather(&self, rows: &[u32], visited: &[bool]) -> Result<Chunk, KernelError> {
        let run = &self.run;
        let (device, metrics) = (&run.device, &run.metrics);
        let sources = run.work.output_sources();
        let columns = (sources.iter())
            .map(|&(_, c)| {
                self.build_columns.get(&c).ok_or_else(|| {
                    KernelError::InvalidData(format!("build column {c} is not on the device"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let gathered = metrics.kernel(|| {
            let indices = RowIndices::upload(device, rows, self.build.num_rows())?;
            gather::gather_columns(&columns, &indices)
        })?;
        let (work, build, visited) = (
            Arc::clone(&run.work),
            self.build.lineage(),
            visited.to_vec(),
        );
        let redo = Redo::new(move || {
            let out = work.final_output(&build.run()?, &visited)?;
            Ok(out.unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(&work.schema))))
        });
        let output = Output {
            columns: gathered.into_iter().map(Col::Device).collect(),
            rows: rows.len(),
        };
        output.to_device(&run.work.schema, device, metrics, redo)
    }
}

/// A semi or anti join's probe pieces: the build rows each matched, on the device or on the
/// host (a fused filter's twin first).
impl PieceWork for DeviceSemi {
    type Out = Vec<u32>;
    const ON_FAILURE: Option<&'static str> = Some("matching a batch on the host");

    fn metrics(&self) -> &GpuMetrics {
        &self.run.metrics
    }

    fn run_on_device(&mut self, piece: &Chunk) -> Result<OnDevice<Vec<u32>>, PieceError> {
        let Some(table) = self.table.clone() else {
            return Ok(OnDevice::GivenUp);
        };
        match self.marks.mark(&self.run, &table, piece)? {
            // Marked on the device: read later.
            true => Ok(OnDevice::Out(Vec::new())),
            // A per-batch constant the fused program cannot hold.
            false => Ok(OnDevice::ByRule),
        }
    }

    fn run_on_cpu(&mut self, piece: &Chunk, _: BatchOn) -> Result<Vec<u32>, PieceError> {
        let run = &self.run;
        let mut probe = piece.host_for_cpu(&run.metrics)?;
        if let Some(fused) = &run.fused {
            probe = fused.cpu(&probe)?;
        }
        let build = self.build.host(&run.metrics)?;
        Ok(host_matches(&mut self.host, &run.work, &build, &probe)?.build)
    }
}
