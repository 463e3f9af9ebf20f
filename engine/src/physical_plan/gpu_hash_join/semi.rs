//! A left semi or anti join without a residual filter over a build side from a GPU child on
//! the same devices (`DeviceSemi`): it emits build rows only, so its build side stays
//! where it lies (its keys are never uploaded again, its rows never come down whole). Each
//! probe chunk (from the host, or from a GPU child where it lies, under a fused filter's
//! row mask when the join takes one in) is probed there by a kernel that marks the build
//! rows it matches in a bitmap on the device (`JoinTable::mark`): no pairs, no counts, no
//! host wait. The host reads the bitmap, with the fused programs' error words, once per
//! partition, or sooner once the probe rows it keeps to match again grow past
//! [`RETAIN_BATCHES`] device batches; once the probe side has ended (for CollectLeft, in the last partition
//! to finish) the rows the join emits, matched (semi) or never matched (anti), are
//! gathered on the device, for a GPU parent to read where they lie or brought down.
//!
//! ```text
//!   build child ─▶ chunks where they lie ─▶ JoinTable (keys as they lie)
//!   probe chunk ─▶ (fused filter's mask) ─▶ mark ─▶ (end, or RETAIN_BATCHES kept) read ─▶ visited
//!   probe ends ─▶ emitted rows up ─▶ gather build columns ─▶ chunk (down for a CPU parent)
//!   device error ─▶ that batch matched on the host; the end taken from host rows
//!   lost marks, or a fused program's error word ─▶ the chunks since the last read
//!                                                   matched again on the host
//! ```

use super::*;
use crate::physical_plan::gpu_metrics::count_batch;
use fulmen_kernels::ops::join::JoinMarks;

/// How many device batches' bytes (`fulmen.gpu.batch_bytes`, so 256 MiB by default) of
/// probe rows marked on the device a partition keeps on the host (their lineage: the host
/// batch, or what a device chunk is made again from) before it reads the marks: the price of
/// reading them once, not once per batch. Device chunks count at their device bytes (the
/// host data their lineage holds is the producer's, of a size not known here).
pub(super) const RETAIN_BATCHES: usize = 4;

/// The build rows marked on the device that the host has not read yet, and how to match
/// again on the host the probe rows that marked them.
struct Marked {
    marks: JoinMarks,
    /// The probe rows of each chunk marked since the last read, on the host.
    unread: Vec<Redo>,
    /// The status buffers of the fused programs whose masks those chunks were marked under.
    statuses: Vec<DeviceBuffer>,
    /// What `unread` holds (see [`RETAIN_BATCHES`]).
    unread_bytes: usize,
}

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
    /// The rows marked on the device, not read yet (`None`: none marked since the device
    /// marks were last lost, or never).
    marked: Option<Marked>,
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
            marked: None,
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
        if self
            .marked
            .as_ref()
            .is_some_and(|m| m.unread_bytes > RETAIN_BATCHES * self.run.batch.bytes)
        {
            self.read_marks()?;
        }
        Ok(())
    }

    /// Brings the rows marked on the device into `visited`, in one wait with the error
    /// words of the fused programs that masked the probes. Should the read fail (a lost
    /// device) or one of those programs have left a row to the CPU, the chunks marked since
    /// the last read are matched again on the host instead (each counted as a batch that fell
    /// back, or that went to the CPU by rule; matching one again changes nothing).
    fn read_marks(&mut self) -> Result<()> {
        let Some(marked) = self.marked.as_mut() else {
            return Ok(());
        };
        if marked.unread.is_empty() {
            return Ok(());
        }
        let unread = std::mem::take(&mut marked.unread);
        let statuses = std::mem::take(&mut marked.statuses);
        marked.unread_bytes = 0;
        let metrics = &self.run.metrics;
        let read = {
            let statuses: Vec<&DeviceBuffer> = statuses.iter().collect();
            metrics.kernel(|| marked.marks.read(&statuses))
        };
        let on = match read {
            Ok(Some(bits)) if bits.len() == self.visited.len() => {
                for (v, b) in self.visited.iter_mut().zip(bits) {
                    *v |= b;
                }
                return Ok(());
            }
            Ok(Some(bits)) => {
                return datafusion::common::internal_err!(
                    "{} join marks for {} build rows",
                    bits.len(),
                    self.visited.len()
                );
            }
            // The failed round's marks are void: cleared for the next (or, should that
            // fail, made again by the next chunk).
            Ok(None) => {
                if let Err(e) = marked.marks.clear() {
                    metrics.recover(&e, "clearing the join's marks")?;
                    self.marked = None;
                }
                BatchOn::Rule
            }
            Err(e) => {
                metrics.recover(&e, "matching the join's marked probe batches on the host")?;
                self.marked = None;
                BatchOn::Fallback
            }
        };
        let build = self.build.host(metrics)?;
        for lineage in unread {
            let probe = lineage.run()?;
            for b in host_matches(&mut self.host, &self.run.work, &build, &probe)?.build {
                self.visited[b as usize] = true;
            }
            count_batch(metrics, on);
        }
        Ok(())
    }

    /// Marks on the device the build rows a chunk matches, under a fused filter's row mask
    /// when the join takes one in: no wait (see [`Self::read_marks`]). The chunk's probe
    /// rows are kept on the host (its lineage) until the marks are read. `false`: a per-batch
    /// constant the fused program cannot hold leaves the chunk to the CPU.
    fn on_device(&mut self, table: &JoinTable, chunk: &Chunk) -> Result<bool, KernelError> {
        let run = &self.run;
        let (device, metrics) = (&run.device, &run.metrics);
        let n = chunk.num_rows();
        let mut columns = HashMap::new();
        let (keys, kept, lineage) = match &run.fused {
            Some(fused) => {
                let Some((kept, status)) = fused.select(chunk, device, metrics, 0, &mut columns)?
                else {
                    return Ok(false);
                };
                let keys = fused.input_keys(&run.work.right_keys)?;
                (keys, Some((kept, status)), fused.lineage(chunk))
            }
            None => (run.work.right_keys.clone(), None, chunk.lineage()),
        };
        for &c in &keys {
            if let std::collections::hash_map::Entry::Vacant(slot) = columns.entry(c) {
                slot.insert(chunk.device_column(c, device, metrics)?);
            }
        }
        let keys: Vec<&DeviceColumn> = keys.iter().map(|c| &columns[c]).collect();
        if self.marked.is_none() {
            self.marked = Some(Marked {
                marks: metrics.kernel(|| JoinMarks::new(table))?,
                unread: Vec::new(),
                statuses: Vec::new(),
                unread_bytes: 0,
            });
        }
        let Some(marked) = self.marked.as_mut() else {
            return Err(KernelError::InvalidData("join marks not made".into()));
        };
        // Kept before the marks are queued: a chunk whose marks are lost with the device
        // is matched again from it (should this chunk also go to the CPU now, matching it
        // twice changes nothing).
        marked.unread.push(lineage);
        marked.unread_bytes += match chunk {
            Chunk::Host(batch) => crate::physical_plan::coalesce::host_bytes(batch),
            Chunk::Device(batch, ..) => batch.columns().iter().map(|c| c.device_bytes()).sum(),
        };
        let valid = match kept {
            Some((kept, status)) => {
                marked.statuses.push(status);
                Some(kept)
            }
            None => None,
        };
        // NULL probe keys need no validity: the mark's key check rejects them (unless
        // NULLs match).
        let mask = valid.as_ref().map(DeviceColumn::values);
        metrics.kernel(|| table.mark(&keys, mask, n, &marked.marks))?;
        Ok(true)
    }

    /// The rows the join emits, once this partition (for CollectLeft, the last one) has
    /// probed everything: gathered from the build side's columns on the device when they
    /// are there (brought down for a CPU parent), else taken from its host rows.
    fn finish(&mut self) -> Result<Option<Chunk>> {
        self.read_marks()?;
        self.marked = None;
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
        match self.on_device(&table, piece)? {
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
