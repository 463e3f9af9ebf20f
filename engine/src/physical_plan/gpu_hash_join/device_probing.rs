//! A partition of an inner join whose output stays on the device (`DeviceProbing`): each
//! probe chunk matched and its output gathered there, or, for output that goes to the
//! host, taken there when the cost model finds that cheaper.

use super::*;
use fulmen_kernels::column::{Layout, layout_of};

/// A partition of an inner join whose output stays on the device.
pub(super) struct DeviceProbing {
    pub(super) run: JoinRun,
    pub(super) build: Arc<BuildSide>,
    /// Shared by the partitions on this device (CollectLeft).
    pub(super) table: Option<Arc<JoinTable>>,
    /// Build-side output columns on the device.
    pub(super) build_columns: HashMap<usize, DeviceColumn>,
    pub(super) host: Option<HostIndex>,
    pub(super) probe: ChunkStream,
    /// Probe chunks waiting to make up device batches (a device chunk goes alone).
    pub(super) batches: DeviceBatches<Chunk>,
    /// The output goes to the host (the join's parent is a CPU operator).
    pub(super) to_host: bool,
    /// Output of a probe chunk that was split, not emitted yet.
    pub(super) ready: std::collections::VecDeque<Chunk>,
}

impl DeviceProbing {
    /// The next device batch of probe rows: host chunks coalesced (see `device_loop.rs`), a
    /// device chunk as it is; `None` once the probe side has ended.
    pub(super) async fn next_batch(&mut self) -> Result<Option<Chunk>> {
        match self.batches.next_from(&mut self.probe, |c| c).await? {
            Some(items) => one_chunk(items).map(Some),
            None => Ok(None),
        }
    }

    /// The output for one probe chunk, in order (empty: nothing matched). A host chunk the
    /// device has no memory for is probed in halves, each with
    /// output of its own; a piece the device cannot probe is probed on the host (the loop
    /// every GPU operator shares, `device_loop.rs`).
    pub(super) fn step(&mut self, chunk: Chunk) -> Result<Vec<Chunk>> {
        if self.build.num_rows() == 0 || chunk.num_rows() == 0 {
            return Ok(Vec::new());
        }
        let elapsed = self.run.metrics.baseline.elapsed_compute().clone();
        let _timer = elapsed.timer();
        let outputs = run_pieces(self, chunk)?;
        Ok(outputs.into_iter().flatten().collect())
    }

    pub(super) fn on_device(&self, table: &JoinTable, input: &Chunk) -> Result<Probe, KernelError> {
        let run = &self.run;
        let (device, metrics) = (&run.device, &run.metrics);
        let n = input.num_rows();
        let sources = run.work.output_sources();
        // A fused stage probes the input's rows under its filter's row mask, through a view
        // of the columns the filter outputs (rows numbered as the input's); the program's
        // error word is word 1 of the probe's totals, read in its one wait.
        let mut selected = None;
        let mut probe_columns: HashMap<usize, DeviceColumn> = HashMap::new();
        let view;
        let (chunk, probe_lineage) = match &run.fused {
            None => (input, input.lineage()),
            Some(fused) => {
                // Room for a byte total per output column after the error word (the
                // string columns among them are known below).
                let mut inputs = HashMap::new();
                let Some(kept) =
                    fused.select(input, device, metrics, sources.len(), &mut inputs)?
                else {
                    return Ok(Probe::ToCpu);
                };
                selected = Some(kept);
                // The input columns the program uploaded serve the probe too.
                for (c, &i) in fused.work.outputs().iter().enumerate() {
                    if let Some(column) = inputs.get(&i) {
                        probe_columns.entry(c).or_insert_with(|| column.clone());
                    }
                }
                view = fused.view(input, &run.work.right_schema)?;
                (&view, fused.lineage(input))
            }
        };
        let lead = usize::from(selected.is_some());
        // The probe's keys, and the string columns it outputs, go up before the probe: the
        // strings' lengths are queued over the pending matches, so that their byte totals
        // come up in the probe's one wait. Other probe columns go up once something matched.
        // Output that goes to the host is gathered on the device only out of a chunk already
        // there (see `gather_pays`): only then are its strings' lengths queued (a launch
        // each, wasted if the host takes the batch after all).
        let schema = chunk.schema();
        let queue_strings = !self.to_host || chunk.on(device);
        let probe_strings = sources
            .iter()
            .filter(|&&(from_build, c)| !from_build && held_as_bytes(schema.field(c).data_type()))
            .map(|&(_, c)| c)
            .filter(|_| queue_strings);
        for c in run.work.right_keys.iter().copied().chain(probe_strings) {
            if let std::collections::hash_map::Entry::Vacant(slot) = probe_columns.entry(c) {
                slot.insert(chunk.device_column(c, device, metrics)?);
            }
        }
        let source_of = |from_build: bool, c: usize| -> Option<&DeviceColumn> {
            match from_build {
                true => self.build_columns.get(&c),
                false => probe_columns.get(&c),
            }
        };
        // Each string output (by position in `sources`), the build side's first, and its
        // word among the probe's.
        let mut strings: Vec<usize> = (0..sources.len())
            .filter(|_| queue_strings)
            .filter(|&i| {
                let (from_build, c) = sources[i];
                source_of(from_build, c).is_some_and(|col| col.offsets().is_some())
            })
            .collect();
        strings.sort_by_key(|&i| !sources[i].0);
        let keys: Vec<&DeviceColumn> = run
            .work
            .right_keys
            .iter()
            .map(|c| &probe_columns[c])
            .collect();
        // NULL probe keys need no validity here: the probe's key check rejects them. A
        // fused filter's rows are its program's boolean output, true where kept.
        // `None` out of the closure: a fused filter's program left a row to the CPU.
        let (kept, totals) = selected.unzip();
        let valid = kept.as_ref().map(DeviceColumn::values);
        // Output of a host chunk that goes to the host is taken there (`gather_pays`): its
        // pairs come down in the probe's wait.
        let pairs_to_host = self.to_host && matches!(chunk, Chunk::Host(_));
        // The probe columns the output wants that are not up yet. Out of a host chunk, for
        // output that stays on the device, the matched rows may be taken on the host and
        // only they uploaded (`take_pays`): their probe rows come down in the probe's wait
        // where taking as many as the last probe's rate predicts would pay.
        let mut missing: Vec<usize> = (sources.iter())
            .filter(|&&(from_build, c)| !from_build && !probe_columns.contains_key(&c))
            .map(|&(_, c)| c)
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let may_take = match chunk {
            Chunk::Host(batch) if !self.to_host => Some(batch).filter(|_| !missing.is_empty()),
            _ => None,
        };
        let probed = metrics.kernel(|| -> Result<_, KernelError> {
            let extra = lead + strings.len();
            let Some(mut queued) = table.probe_queued_into(&keys, valid, n, extra, totals)? else {
                return Ok(Some(Found::OnDevice(None)));
            };
            if let Some(batch) = may_take
                && self.take_pays(batch, &missing, queued.expected_matches())
            {
                queued.read_probe_rows_too();
            }
            if pairs_to_host {
                let matches = match lead {
                    0 => Some(queued.pairs_to_host()?),
                    _ => queued.pairs_to_host_unless_failed()?,
                };
                return Ok(matches.map(Found::OnHost));
            }
            // The build side's strings, then the probe side's (`strings` is in that order),
            // each side's queued together.
            let mut starts = Vec::with_capacity(strings.len());
            let build_strings = strings.iter().filter(|&&i| sources[i].0).count();
            for (from_build, these) in [
                (true, &strings[..build_strings]),
                (false, &strings[build_strings..]),
            ] {
                if these.is_empty() {
                    continue;
                }
                let pending = match from_build {
                    true => queued.pending_build(),
                    false => queued.pending_probe(),
                };
                let columns = these
                    .iter()
                    .map(|&i| {
                        let c = sources[i].1;
                        source_of(from_build, c).ok_or_else(|| {
                            KernelError::InvalidData(format!(
                                "string column {c} is not on the device"
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let first = queued.extra_word(lead + starts.len())?;
                starts.extend(gather::queue_strings_starts(&columns, pending, first)?);
            }
            // A fused filter's failed program: its mask is not to be used (nor rerun over).
            let probed = match lead {
                0 => queued.finish()?,
                _ => match queued.finish_unless_failed()? {
                    Some(probed) => probed,
                    None => return Ok(None),
                },
            };
            // After a probe that ran again with exact sizes the queued starts are void.
            let started: Started = match probed.words {
                Some(totals) => strings
                    .iter()
                    .copied()
                    .zip(starts.into_iter().zip(totals.into_iter().skip(lead)))
                    .collect(),
                None => HashMap::new(),
            };
            let rows = probed.probe_rows;
            Ok(Some(Found::OnDevice(
                probed.pairs.map(|pairs| (pairs, started, rows)),
            )))
        })?;
        drop(keys);
        let probed = match probed {
            None => return Ok(Probe::ToCpu),
            Some(Found::OnDevice(probed)) => probed,
            Some(Found::OnHost(matches)) => {
                let Chunk::Host(batch) = chunk else {
                    return Err(KernelError::InvalidData(
                        "pairs of a device chunk brought to the host".into(),
                    ));
                };
                if matches.probe.is_empty() {
                    return Ok(Probe::Out(None));
                }
                let probe = (run.work.probe_outputs().iter())
                    .map(|&c| (c, Arc::clone(batch.column(c))))
                    .collect();
                let (build_rows, probe_rows) = (matches.build.into(), matches.probe.into());
                let out = self.take_on_host(&probe, &build_rows, &probe_rows)?;
                run.extra.host_takes.add(1);
                return Ok(Probe::Out(Some(out)));
            }
        };
        let Some(((build_rows, probe_rows), mut started, probe_rows_read)) = probed else {
            return Ok(Probe::Out(None));
        };
        let rows = build_rows.len();
        if self.to_host && !self.gather_pays(chunk, rows, &started) {
            let out = self.pairs_to_host(chunk, &build_rows, &probe_rows)?;
            run.extra.host_takes.add(1);
            return Ok(Probe::Out(Some(out)));
        }
        // The missing probe columns: out of a host chunk, the matched rows taken there and
        // only they uploaded, when that costs less than half as much as uploading the
        // columns whole and gathering them on the device (`take_pays`), as for a selective
        // join over a wide probe side; else uploaded whole.
        let mut taken: HashMap<usize, DeviceColumn> = HashMap::new();
        if let Chunk::Host(batch) = chunk
            && self.take_pays(batch, &missing, rows)
        {
            let indices = match probe_rows_read {
                Some(rows) => UInt32Array::from(rows),
                None => UInt32Array::from(metrics.kernel(|| probe_rows.to_host())?),
            };
            for &c in &missing {
                let column = take(batch.column(c).as_ref(), &indices, None)
                    .map_err(|e| KernelError::InvalidData(e.to_string()))?;
                taken.insert(c, metrics.upload(device, column.as_ref())?);
            }
            log::debug!(
                "a join probe takes {rows} of {n} host rows of {} columns; {} probe string \
                 columns went up whole before the probe",
                missing.len(),
                strings.iter().filter(|&&i| !sources[i].0).count()
            );
        }
        for &(from_build, c) in &sources {
            if !from_build
                && !taken.contains_key(&c)
                && let std::collections::hash_map::Entry::Vacant(slot) = probe_columns.entry(c)
            {
                slot.insert(chunk.device_column(c, device, metrics)?);
            }
        }
        let source = |i: usize| -> Result<&DeviceColumn, KernelError> {
            let (from_build, c) = sources[i];
            match from_build {
                true => self.build_columns.get(&c),
                false => probe_columns.get(&c),
            }
            .ok_or_else(|| {
                KernelError::InvalidData(format!("output column {c} is not on the device"))
            })
        };
        // The output: strings from the starts queued with the probe, the other columns of
        // both sides together (gather_columns_started_by: six fixed-width columns to a
        // launch, whichever side each is of). Probe rows taken on the host are in output
        // order already.
        let mut gathered: Vec<Option<DeviceColumn>> = (sources.iter())
            .map(|&(from_build, c)| taken.get(&c).filter(|_| !from_build).cloned())
            .collect();
        let these: Vec<usize> = (0..sources.len())
            .filter(|&i| gathered[i].is_none())
            .collect();
        let columns = these
            .iter()
            .map(|&i| source(i))
            .collect::<Result<Vec<_>, _>>()?;
        let sides: Vec<usize> = these.iter().map(|&i| usize::from(!sources[i].0)).collect();
        let queued = these.iter().map(|i| started.remove(i)).collect();
        let columns = metrics.kernel(|| {
            gather::gather_columns_started_by(&columns, &[&build_rows, &probe_rows], &sides, queued)
        })?;
        for (i, column) in these.into_iter().zip(columns) {
            gathered[i] = Some(column);
        }
        let columns = gathered
            .into_iter()
            .map(|c| {
                c.map(Col::Device).ok_or_else(|| {
                    KernelError::InvalidData("an output column was not gathered".into())
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (work, build, probe) = (Arc::clone(&run.work), self.build.lineage(), probe_lineage);
        let redo = Redo::new(move || {
            let (build, probe) = (build.run()?, probe.run()?);
            let out = host_probe(&mut None, &work, &build, &probe)?;
            Ok(out.unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(&work.schema))))
        });
        let out = Output { columns, rows }.to_device(&run.work.schema, device, metrics, redo)?;
        // Counted once the batch's output is made (a piece split after a failure takes again).
        if !taken.is_empty() {
            run.extra.probe_takes.add(1);
        }
        Ok(Probe::Out(Some(out)))
    }
}

/// What a probe found: pairs left on the device (`None`: nothing matched), with the string
/// gathers queued over them, or pairs brought to the host.
enum Found {
    OnDevice(Option<(Pairs, Started, Option<Vec<u32>>)>),
    OnHost(fulmen_kernels::ops::join::Matches),
}

/// The string gathers queued over a probe's pending pairs, by output column, with their
/// byte totals.
type Started = HashMap<usize, (gather::QueuedStarts, u64)>;

/// A probe's (build, probe) row pairs on the device.
type Pairs = (
    fulmen_kernels::ops::RowIndices,
    fulmen_kernels::ops::RowIndices,
);

/// What became of a probe batch on the device.
pub(super) enum Probe {
    /// Its output (`None`: nothing matched).
    Out(Option<Chunk>),
    /// A fused filter's program left a row to the CPU: the batch is matched on the host.
    ToCpu,
}

impl DeviceProbing {
    /// For output that goes to the host: whether gathering a batch's `rows` output rows on
    /// the device and bringing them down costs less in the H200 model (a launch per column,
    /// and one per validity bitmap; for a string, its lengths, their scan and a wait for
    /// the byte total too; the bytes of the rows) than bringing down the matched
    /// pairs and the probe chunk, and the build side once if it is not on the host yet,
    /// and taking the rows there (one more wait). Many narrow rows out of a chunk are
    /// gathered; a few rows of many columns, strings among them, are taken on the host.
    pub(super) fn gather_pays(
        &self,
        chunk: &Chunk,
        rows: usize,
        started: &HashMap<usize, (gather::QueuedStarts, u64)>,
    ) -> bool {
        let Chunk::Device(batch, ..) = chunk else {
            return false;
        };
        let model = fulmen_kernels::cost::H200;
        let (mut launches, mut waits, mut gathered) = (0, 0, 0);
        for (i, (from_build, c)) in self.run.work.output_sources().into_iter().enumerate() {
            let column = match from_build {
                true => self.build_columns.get(&c),
                false => batch.columns().get(c),
            };
            let Some(column) = column else {
                continue;
            };
            let validity = column.validity().is_some();
            launches += 1 + usize::from(validity);
            gathered += match column.layout() {
                Layout::Fixed(width) => rows * width,
                Layout::Bits => rows.div_ceil(8),
                // The codes move; the dictionary stays.
                Layout::Dict => rows * 4,
                Layout::Var(offset) => {
                    let text = match started.get(&i) {
                        Some((_, total)) => *total as usize,
                        None => {
                            // Not started: lengths, their scan, a wait for the total. The
                            // bytes at the column's mean length.
                            (launches, waits) = (launches + 2, waits + 1);
                            column.values().len() * rows / column.len().max(1)
                        }
                    };
                    rows * offset + text
                }
            };
            if validity {
                gathered += rows.div_ceil(8);
            }
        }
        let probe: usize = (self.run.work.probe_outputs().into_iter())
            .filter_map(|c| batch.columns().get(c))
            .map(|c| c.device_bytes())
            .sum();
        let taken = 8 * rows + probe + self.build.bytes_to_download();
        let gather = launches as f64 * model.launch_s
            + waits as f64 * model.sync_s
            + gathered as f64 / model.pcie_bytes_per_s;
        let take = model.sync_s + taken as f64 / model.pcie_bytes_per_s;
        gather <= take
    }

    /// For output that stays on the device, out of a host chunk: whether taking the `rows`
    /// matched probe rows of the columns `missing` on the host and uploading only them
    /// costs less than half as much in the H200 model (one more wait, the probe's row indices
    /// down, the taken rows up) as uploading those columns whole for the device to gather
    /// (their gather launches, six columns to a launch, saved too). The wait is charged even
    /// where the probe's own wait brought the indices: with the margin, it stands for what
    /// the model leaves out, the host's own pass over the taken rows, so that a join that
    /// keeps most of its probe rows (TPC-H Q21's `l1`, 63 %), or a small batch, gathers on
    /// the device. A judgement, not measured on a GPU.
    fn take_pays(&self, batch: &RecordBatch, missing: &[usize], rows: usize) -> bool {
        if missing.is_empty() {
            return false;
        }
        let model = fulmen_kernels::cost::H200;
        let width: usize = (missing.iter())
            .map(|&c| row_bytes(batch.schema().field(c).data_type()))
            .sum();
        let whole = (batch.num_rows() * width) as f64 / model.pcie_bytes_per_s
            + missing.len().div_ceil(6) as f64 * model.launch_s;
        let taken = model.sync_s + (rows * (4 + width)) as f64 / model.pcie_bytes_per_s;
        2.0 * taken < whole
    }

    /// A device chunk's output taken on the host: the matched pairs and the chunk's output
    /// columns come down in one wait (the build side too, once, if it is not on the host
    /// yet). A host chunk's pairs came down in the probe's wait (`Found::OnHost`).
    fn pairs_to_host(
        &self,
        chunk: &Chunk,
        build_rows: &fulmen_kernels::ops::RowIndices,
        probe_rows: &fulmen_kernels::ops::RowIndices,
    ) -> Result<Chunk, KernelError> {
        let Chunk::Device(batch, schema, _) = chunk else {
            return Err(KernelError::InvalidData(
                "a host chunk's pairs left on the device".into(),
            ));
        };
        let wanted = self.run.work.probe_outputs();
        let columns = (wanted.iter())
            .map(|&c| {
                let column = batch.columns().get(c).ok_or_else(|| {
                    KernelError::InvalidData(format!("probe column {c} is missing"))
                })?;
                Ok((column, schema.field(c).data_type()))
            })
            .collect::<Result<Vec<_>, KernelError>>()?;
        let lists = [build_rows, probe_rows];
        let (pairs, arrays) = (self.run.metrics).download_with_indices(&lists, &columns)?;
        let probe: HashMap<usize, ArrayRef> = wanted.iter().copied().zip(arrays).collect();
        let mut pairs = pairs.into_iter().map(UInt32Array::from);
        let (Some(build_rows), Some(probe_rows)) = (pairs.next(), pairs.next()) else {
            return Err(KernelError::InvalidData("a probe without pairs".into()));
        };
        self.take_on_host(&probe, &build_rows, &probe_rows)
    }

    /// The output of the matched pairs `build_rows` and `probe_rows` taken on the host, from
    /// the probe chunk's output columns `probe` and the build side (brought to the host
    /// once, if it is not there yet).
    fn take_on_host(
        &self,
        probe: &HashMap<usize, ArrayRef>,
        build_rows: &UInt32Array,
        probe_rows: &UInt32Array,
    ) -> Result<Chunk, KernelError> {
        let metrics = &self.run.metrics;
        let host = |e: DataFusionError| KernelError::InvalidData(e.to_string());
        let build = self.build.host(metrics).map_err(host)?;
        let column = |from_build: bool, c: usize| match from_build {
            true => Some(Arc::clone(build.column(c))),
            false => probe.get(&c).cloned(),
        };
        let out = (self.run.work)
            .inner_output(column, build_rows, probe_rows)
            .map_err(host)?;
        Ok(Chunk::Host(out))
    }
}

/// Whether a column of this type is held on the device as offsets and bytes (a string or
/// binary column, after any conversion on upload).
fn held_as_bytes(data_type: &DataType) -> bool {
    fulmen_kernels::column::device_type(data_type, 0)
        .is_ok_and(|t| matches!(layout_of(&t), Some(Layout::Var(_))))
}

/// A device-assembled join's probe pieces: probed on the device, output gathered there (or
/// taken on the host, see `DeviceProbing::gather_pays`), or probed on the host.
impl PieceWork for DeviceProbing {
    type Out = Option<Chunk>;
    const ON_FAILURE: Option<&'static str> = Some("matching a batch on the host");

    fn metrics(&self) -> &GpuMetrics {
        &self.run.metrics
    }

    fn run_on_device(&mut self, piece: &Chunk) -> Result<OnDevice<Option<Chunk>>, PieceError> {
        let Some(table) = self.table.clone() else {
            return Ok(OnDevice::GivenUp);
        };
        match self.on_device(&table, piece)? {
            Probe::Out(out) => {
                if let Some(out) = &out {
                    self.run.metrics.record_chunk(out);
                }
                Ok(OnDevice::Out(out))
            }
            // A fused filter's program left a row to the CPU.
            Probe::ToCpu => Ok(OnDevice::ByRule),
        }
    }

    fn run_on_cpu(&mut self, piece: &Chunk, _: BatchOn) -> Result<Option<Chunk>, PieceError> {
        let run = &self.run;
        let mut probe = piece.host_for_cpu(&run.metrics)?;
        if let Some(fused) = &run.fused {
            probe = fused.cpu(&probe)?;
        }
        let build = self.build.host(&run.metrics)?;
        let out = host_probe(&mut self.host, &run.work, &build, &probe)?;
        if let Some(out) = &out {
            run.metrics.record_batch(out);
        }
        Ok(out.map(Chunk::Host))
    }
}
