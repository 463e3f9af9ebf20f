//! A fused stage: an inner join that takes in the device filter on its probe side.
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
//! is the probe's row mask: a row the filter drops matches nothing, and an inner join emits
//! nothing for a row without a match. The probe's pairs then index the input's rows, and
//! the output columns are gathered from them: no selection indices, no compaction, no
//! gathered intermediate columns, and no host wait of the filter's own (the program's error
//! word comes up in the probe's one wait). A batch matched on the host (no room on the
//! device, a program that leaves a row to the CPU) is filtered there first, by the twin.
//!
//! Only inner joins without a residual filter (whose output may stay on the device), over
//! a filter without a row limit.

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
        if *join.join_type() != JoinType::Inner || join.filter().is_some() {
            return Err("a fused filter under a join that is not inner or has a filter".into());
        }
        let filter = Arc::clone(join.right());
        let Some(cpu) = filter.downcast_ref::<FilterExec>() else {
            return Err("a fused join whose probe side is not a FilterExec".into());
        };
        if cpu.fetch().is_some() {
            return Err("a fused filter with a row limit".into());
        }
        let work = FilterWork::plan(&filter)?;
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
            Chunk::Host(b) => {
                let columns = outputs.iter().map(|&c| Arc::clone(b.column(c))).collect();
                let options = RecordBatchOptions::new().with_row_count(Some(b.num_rows()));
                RecordBatch::try_new_with_options(Arc::clone(schema), columns, &options)
                    .map(Chunk::Host)
                    .map_err(|e| KernelError::InvalidData(e.to_string()))
            }
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
}
