//! A fused stage: a join that takes in the device filter on its probe side.
//!
//! ```text
//!   GpuHashJoinExec(inner, on k)            GpuHashJoinExec(inner, on k,
//!     left                          ──▶         fused_filter=p)
//!     GpuFilterExec(p, projection)            left
//!       input                                 input
//! ```
//!
//! Its CPU twin is the join over a CPU `FilterExec` (the filter's own twin) of the
//! filter's input; its children are the build side and the filter's input. On the device
//! each probe batch of the input runs the predicate as one expression program, whose
//! boolean output (a bitmap, set where the predicate is true: NULL and false alike clear)
//! is the probe's row mask: a row the filter drops matches nothing. The program's error
//! word comes up in the probe's one wait (a semi or anti join's, with its marks, below),
//! and a batch whose program left a row to the CPU (or that the device cannot take) is
//! filtered on the host first, by the twin.
//!
//! - An inner join without a residual filter emits nothing for a row without a match: the
//!   probe's pairs index the input's rows, and the output columns are gathered from them
//!   on the device (`run.rs`, `DeviceProbing`): no selection indices, no compaction, no
//!   gathered intermediate columns, no host wait of the filter's own.
//! - A join that assembles its output on the host (a residual filter; left, left semi,
//!   left anti and right semi joins) brings down only the pairs, whose probe rows index
//!   the input batch it holds: these joins read probe rows only through the pairs (and a
//!   right semi join emits only the probe rows with a match), never a row without one, so
//!   the filter's dropped rows are never read and need not be taken out
//!   ([`FusedFilter::matches`]). The filter's compaction and gathers, its output's
//!   download, its waits and the keys' second upload are gone.
//! - A left semi or anti join without a residual filter brings down no pairs: the probe
//!   marks the build rows it matches on the device under the mask, and the program's error
//!   word comes up with the marks, once for many batches (`marks.rs`); a set word sends the
//!   batches marked since the last read to the twin.
//!
//! Not taken in: a filter under a right, full or right anti join (they emit the probe rows
//! that match nothing, so a batch against an empty build side would need the filter on its
//! own), a filter with a row limit, and, under a join assembled on the host, a filter whose
//! input lies on the device (a cached table's chunks: its own filter reads them there,
//! where the host path would bring them down whole).

use super::*;
use crate::physical_plan::gpu_filter::FilterWork;
use crate::physical_plan::gpu_stream::BatchWork;
use datafusion::physical_plan::filter::FilterExec;
use fulmen_kernels::ops::{expr, status_bytes};

/// The filter a fused join takes in.
#[derive(Debug)]
pub(super) struct FusedFilter {
    /// The CPU `FilterExec`: the join's twin's probe child.
    pub(super) filter: Arc<dyn ExecutionPlan>,
    pub(super) work: FilterWork,
}

impl FusedFilter {
    /// The filter under `join`'s probe side that a fused stage takes in, or why none.
    pub(super) fn plan(join: &HashJoinExec) -> Result<Self, Reason> {
        if !takes_in_probe_filter(*join.join_type()) {
            return Err(format!("a fused filter under a {} join", join.join_type()));
        }
        let filter = Arc::clone(join.right());
        let Some(cpu) = filter.downcast_ref::<FilterExec>() else {
            return Err("a fused join whose probe side is not a FilterExec".into());
        };
        if cpu.fetch().is_some() {
            return Err("a fused filter with a row limit".into());
        }
        let work = FilterWork::plan(&filter)?;
        if let Some(why) = work.host_only() {
            return Err(format!(
                "a fused filter whose output cannot be on the GPU: {why}"
            ));
        }
        Ok(Self { filter, work })
    }

    /// The filter's input: the fused join's probe child.
    pub(super) fn input(&self) -> &Arc<dyn ExecutionPlan> {
        self.filter.children()[0]
    }

    /// The filter's predicate (for EXPLAIN).
    pub(super) fn predicate(&self) -> &Arc<dyn PhysicalExpr> {
        self.work.predicate()
    }

    /// The probe rows of an input batch on the host: filtered and projected by the twin.
    pub(super) fn cpu(&self, input: &RecordBatch) -> Result<RecordBatch> {
        self.work.cpu(input)
    }

    /// The input chunk's columns the filter outputs, every row kept: what the probe reads
    /// (`schema`, the filter's output schema), its rows numbered as the input's.
    pub(super) fn view(&self, chunk: &Chunk, schema: &SchemaRef) -> Result<Chunk, KernelError> {
        let outputs = self.work.outputs();
        match chunk {
            Chunk::Host(b) => (self.host_view(b, schema))
                .map(Chunk::Host)
                .map_err(|e| KernelError::InvalidData(e.to_string())),
            Chunk::Device(b, _, redo) => {
                let device_schema = b
                    .schema()
                    .project(outputs)
                    .map_err(|e| KernelError::InvalidData(e.to_string()))?;
                let columns = outputs.iter().map(|&c| b.columns()[c].clone()).collect();
                let batch = fulmen_kernels::column::DeviceBatch::try_new(
                    Arc::new(device_schema),
                    columns,
                    b.num_rows(),
                )?;
                // The view's own redo: the input's, projected (every row; the join's redo
                // takes its filtered probe rows from `lineage`).
                let (input, outputs) = (redo.clone(), outputs.to_vec());
                let redo = Redo::new(move || Ok(input.run()?.project(&outputs)?));
                Ok(Chunk::Device(batch, Arc::clone(schema), redo))
            }
        }
    }

    /// How to have the filtered probe rows of an input chunk on the host without its device.
    pub(super) fn lineage(self: &Arc<Self>, chunk: &Chunk) -> Redo {
        let (input, fused) = (chunk.lineage(), Arc::clone(self));
        Redo::new(move || fused.cpu(&input.run()?))
    }

    /// Queues the predicate over the input chunk: the rows it keeps as a bitmap (the
    /// program's boolean output), and the status buffer whose word 1 the program sets when
    /// a row needs the CPU, with room for `extra` more words after it: the probe's totals
    /// (see `JoinTable::probe_queued_into`: word 0 its matches, the error word its first of
    /// the caller's). `None`: a per-batch constant the program cannot
    /// hold leaves the batch to the CPU. `columns` keeps each input column it uploaded.
    pub(super) fn select(
        &self,
        chunk: &Chunk,
        device: &Device,
        metrics: &GpuMetrics,
        extra: usize,
        columns: &mut HashMap<usize, DeviceColumn>,
    ) -> Result<Option<(DeviceColumn, DeviceBuffer)>, KernelError> {
        let compiled = self.work.program();
        let Ok(program) = compiled.bind(&chunk.host_view()) else {
            return Ok(None);
        };
        for &c in &compiled.inputs {
            if let std::collections::hash_map::Entry::Vacant(slot) = columns.entry(c) {
                slot.insert(chunk.device_column(c, device, metrics)?);
            }
        }
        let inputs: Vec<&DeviceColumn> = compiled.inputs.iter().map(|c| &columns[c]).collect();
        let n = chunk.num_rows();
        metrics.kernel(|| {
            // Word 0 the probe's matches, word 1 the program's error, then the caller's.
            let status = device.upload(&vec![0; status_bytes(extra)])?;
            let mut kept = expr::evaluate_unchecked(device, &program, &inputs, n, &status)?;
            Ok(Some((kept.remove(0), status)))
        })
    }

    /// The input columns a host batch of the filter's input uploads when it is matched
    /// on the device (the program's inputs and the probe keys `right_keys`, numbered in
    /// the filter's output): what sizes its device batches.
    pub(super) fn uploaded(&self, right_keys: &[usize]) -> Vec<usize> {
        let outputs = self.work.outputs();
        let mut columns: Vec<usize> = (self.work.program().inputs.iter().copied())
            .chain(right_keys.iter().filter_map(|&c| outputs.get(c).copied()))
            .collect();
        columns.sort_unstable();
        columns.dedup();
        columns
    }

    /// Matches a chunk of the filter's input on the device, for a join that assembles its
    /// output on the host: the predicate's program and the probe under its row mask, with
    /// one wait, most often, for the probe's total, the program's error word and the pairs
    /// together (`QueuedProbe::pairs_to_host`). The pairs' probe rows are the input's: a
    /// row the filter drops matched nothing, and the join types that take a filter in emit
    /// no probe row without a match, so the join reads the input through
    /// [`host_view`](Self::host_view) as it would read the filter's output. `None`: the
    /// program left a row to the CPU.
    pub(super) fn matches(
        &self,
        table: &JoinTable,
        chunk: &Chunk,
        right_keys: &[usize],
        device: &Device,
        metrics: &GpuMetrics,
    ) -> Result<Option<Matches>, KernelError> {
        let n = chunk.num_rows();
        if n == 0 || table.rows() == 0 {
            // Nothing can match, and no probe row comes out without a match.
            return Ok(Some(Matches::default()));
        }
        let mut columns = HashMap::new();
        // Word 0 the probe's matches, word 1 the program's error.
        let Some((kept, status)) = self.select(chunk, device, metrics, 0, &mut columns)? else {
            return Ok(None);
        };
        let keys = self.input_keys(right_keys)?;
        for &i in &keys {
            if let std::collections::hash_map::Entry::Vacant(slot) = columns.entry(i) {
                slot.insert(chunk.device_column(i, device, metrics)?);
            }
        }
        let keys: Vec<&DeviceColumn> = keys.iter().map(|i| &columns[i]).collect();
        // `None` out of the closure: the program left a row to the CPU.
        metrics.kernel(|| {
            let valid = Some(kept.values());
            match table.probe_queued_into(&keys, valid, n, 1, Some(status))? {
                Some(queued) => queued.pairs_to_host_unless_failed(),
                None => Err(KernelError::InvalidData(
                    "a probe with rows not queued".into(),
                )),
            }
        })
    }

    /// The probe keys `right_keys` (columns of the filter's output) as columns of its input.
    pub(super) fn input_keys(&self, right_keys: &[usize]) -> Result<Vec<usize>, KernelError> {
        let outputs = self.work.outputs();
        (right_keys.iter())
            .map(|&c| {
                outputs.get(c).copied().ok_or_else(|| {
                    KernelError::InvalidData(format!("probe key {c} past the filter's output"))
                })
            })
            .collect()
    }

    /// A host batch of the filter's input as the join reads it after
    /// [`matches`](Self::matches): the columns the filter outputs (`schema`), every row.
    pub(super) fn host_view(&self, input: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
        let outputs = self.work.outputs();
        let columns = outputs
            .iter()
            .map(|&c| Arc::clone(input.column(c)))
            .collect();
        let options = RecordBatchOptions::new().with_row_count(Some(input.num_rows()));
        Ok(RecordBatch::try_new_with_options(
            Arc::clone(schema),
            columns,
            &options,
        )?)
    }
}

/// Whether a join of this type may take in the filter on its probe side: one that never
/// emits a probe row without a match (whose rows the filter must drop even where no build
/// row is there to probe against).
pub(super) fn takes_in_probe_filter(join_type: JoinType) -> bool {
    matches!(
        join_type,
        JoinType::Inner
            | JoinType::Left
            | JoinType::LeftSemi
            | JoinType::LeftAnti
            | JoinType::RightSemi
    )
}
