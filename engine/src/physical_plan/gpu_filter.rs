//! `GpuFilterExec`: DataFusion's `FilterExec` on a GPU. The predicate runs as one
//! expression program, the selection is compacted into row indices on the device, and the
//! kept rows are gathered there. The host waits once per batch for the program's error
//! word, the selection's count and the byte totals of the string columns it gathers
//! together (those gathers' lengths are queued over the selection before its count is
//! known), and, when its output goes to the host, once for the download of all its
//! columns. A batch from the host whose output goes back to the host takes its rows there
//! instead: only the predicate's inputs go up, and the predicate comes down, a bit a row,
//! with the program's error word in one wait; the kept rows are never copied to the device
//! and back. So a filter whose output has a column of a type the device cannot hold (a
//! list, a struct) still runs its predicate there: its output then stays on the host, for
//! a GPU parent too.
//!
//! The plan node is the shared [`GpuBatchExec`] and the stream the shared
//! [`GpuStream`](super::gpu_stream::GpuStream); this file holds the filter's work.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{BooleanArray, RecordBatch, RecordBatchOptions};
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::error::Result;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::filter::{FilterExec, batch_filter};
use fulmen_kernels::ops::{Word, compact, expr, gather, read_status_words, status_bytes};
use fulmen_kernels::{Device, DeviceColumn, KernelError};

use super::gpu_batch_exec::GpuBatchExec;
use super::gpu_stream::{BatchWork, Chunk, Col, GpuMetrics, OperatorKind, Output};
use crate::gpu::compile::{CompiledExprs, Reason, compile};

/// A filter whose predicate runs on a GPU.
pub type GpuFilterExec = GpuBatchExec<FilterWork>;

/// What a `GpuFilterExec` does with each batch.
#[derive(Debug)]
pub struct FilterWork {
    predicate: Arc<dyn PhysicalExpr>,
    program: CompiledExprs,
    /// Input columns the filter outputs.
    outputs: Vec<usize>,
    projection: Option<Vec<usize>>,
    /// Why the output cannot go to the device (a column of a type it cannot hold): the
    /// filter then takes its rows on the host whoever reads them.
    host_only: Option<Reason>,
}

impl FilterWork {
    /// The predicate.
    pub(crate) fn predicate(&self) -> &Arc<dyn PhysicalExpr> {
        &self.predicate
    }

    /// The predicate's device program (its one output the predicate, a bitmap).
    pub(crate) fn program(&self) -> &CompiledExprs {
        &self.program
    }

    /// The input columns the filter outputs, in order.
    pub(crate) fn outputs(&self) -> &[usize] {
        &self.outputs
    }

    /// Why its output cannot go to the device, if it cannot: a column of a type the
    /// device cannot hold (what a stage fusing the filter refuses).
    pub(crate) fn host_only(&self) -> Option<&Reason> {
        self.host_only.as_ref()
    }
}

impl BatchWork for FilterWork {
    const NAME: &'static str = "GpuFilterExec";
    const KIND: OperatorKind = OperatorKind::Filter;

    fn plan(filter: &Arc<dyn ExecutionPlan>) -> Result<Self, Reason> {
        let Some(cpu) = filter.downcast_ref::<FilterExec>() else {
            return Err("not a FilterExec".into());
        };
        let input_schema = cpu.input().schema();
        let program = compile(std::slice::from_ref(cpu.predicate()), &input_schema)?;
        let projection: Option<Vec<usize>> = cpu.projection().as_ref().map(|p| p.to_vec());
        let outputs: Vec<usize> = projection
            .clone()
            .unwrap_or_else(|| (0..input_schema.fields().len()).collect());
        let host_only = (outputs.iter())
            .map(|&c| input_schema.field(c))
            .find(|f| fulmen_kernels::column::device_type(f.data_type(), 0).is_err())
            .map(|f| {
                format!(
                    "column {} of type {} is not supported on GPU",
                    f.name(),
                    f.data_type()
                )
            });
        Ok(Self {
            predicate: Arc::clone(cpu.predicate()),
            program,
            outputs,
            projection,
            host_only,
        })
    }

    fn gpu(
        &self,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<Option<Output>, KernelError> {
        let n = input.num_rows();
        // A per-batch constant (a scalar subquery's value) the program cannot hold leaves
        // the batch to the CPU, by rule.
        let Ok(program) = self.program.bind(&input.host_view()) else {
            return Ok(None);
        };
        let mut on_device: HashMap<usize, DeviceColumn> = HashMap::new();
        for &c in self.program.inputs.iter().chain(&self.outputs) {
            if let std::collections::hash_map::Entry::Vacant(slot) = on_device.entry(c) {
                slot.insert(input.device_column(c, device, metrics)?);
            }
        }
        let inputs: Vec<&DeviceColumn> =
            self.program.inputs.iter().map(|c| &on_device[c]).collect();
        // One host wait per batch: the program's error word, the selection's count and
        // the byte totals of the string columns to gather come up together.
        let mut strings: Vec<usize> = Vec::new();
        for &c in &self.outputs {
            if on_device[&c].offsets().is_some() && !strings.contains(&c) {
                strings.push(c);
            }
        }
        let kept = metrics.kernel(|| -> Result<_, KernelError> {
            let status = device.upload(&vec![0; status_bytes(strings.len())])?;
            let mut predicate = expr::evaluate_unchecked(device, &program, &inputs, n, &status)?;
            let predicate = predicate.remove(0);
            let selection = compact::selection_indices_queued(
                device,
                predicate.values(),
                predicate.validity(),
                n,
                &status,
            )?;
            let mut starts: HashMap<usize, gather::QueuedStarts> = HashMap::new();
            if !strings.is_empty() {
                let columns: Vec<&DeviceColumn> = strings.iter().map(|c| &on_device[c]).collect();
                let pending = selection.pending(&status)?;
                let queued =
                    gather::queue_strings_starts(&columns, pending, Word::of(&status, 2)?)?;
                starts.extend(strings.iter().copied().zip(queued));
            }
            // Over no rows nothing was launched: nothing to wait for.
            let (count, totals) = match n {
                0 => (0, vec![0; strings.len()]),
                _ => match read_status_words(&status, strings.len())? {
                    Some(words) => words,
                    None => return Ok(None),
                },
            };
            let totals: HashMap<usize, u64> = strings.iter().copied().zip(totals).collect();
            let indices = selection.with_count(count)?;
            // Each input column is gathered once, whatever the times it is output: the
            // strings from their queued starts, the others together (gather_columns).
            let mut unique: Vec<usize> = Vec::with_capacity(self.outputs.len());
            for &c in &self.outputs {
                if !unique.contains(&c) {
                    unique.push(c);
                }
            }
            let sources: Vec<&DeviceColumn> = unique.iter().map(|c| &on_device[c]).collect();
            let started = (unique.iter())
                .map(|c| starts.remove(c).map(|queued| (queued, totals[c])))
                .collect();
            let gathered: HashMap<usize, DeviceColumn> = unique
                .iter()
                .copied()
                .zip(gather::gather_columns_started(&sources, &indices, started)?)
                .collect();
            let columns = self
                .outputs
                .iter()
                .map(|c| Col::Device(gathered[c].clone()))
                .collect();
            Ok(Some(Output {
                columns,
                rows: indices.len(),
            }))
        })?;
        Ok(kept)
    }

    /// A host batch's rows are taken on the host, by the predicate's bits brought down with
    /// the program's error word in one wait (NULL is not kept, as in DataFusion's filter); a
    /// device chunk's output is gathered there and comes down (`gpu`).
    fn gpu_to_host(
        &self,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
        schema: &SchemaRef,
    ) -> Result<Option<RecordBatch>, KernelError> {
        let Chunk::Host(batch) = input else {
            let out = self.gpu(device, input, metrics)?;
            return out.map(|out| out.to_host(schema, metrics)).transpose();
        };
        let n = batch.num_rows();
        if n == 0 {
            return Ok(Some(RecordBatch::new_empty(Arc::clone(schema))));
        }
        let Ok(program) = self.program.bind(batch) else {
            return Ok(None);
        };
        let inputs = (self.program.inputs.iter())
            .map(|&c| input.device_column(c, device, metrics))
            .collect::<Result<Vec<_>, _>>()?;
        let inputs: Vec<&DeviceColumn> = inputs.iter().collect();
        let (predicate, status) = metrics.kernel(|| -> Result<_, KernelError> {
            let status = device.upload(&vec![0; status_bytes(0)])?;
            let mut predicate = expr::evaluate_unchecked(device, &program, &inputs, n, &status)?;
            Ok((predicate.remove(0), status))
        })?;
        let down = [(&predicate, &DataType::Boolean)];
        let Some(mut mask) = metrics.download_checked(device, &down, &status)? else {
            return Ok(None);
        };
        let host =
            |e: datafusion::arrow::error::ArrowError| KernelError::InvalidData(e.to_string());
        let mask = mask
            .pop()
            .ok_or_else(|| KernelError::InvalidData("no predicate came down".into()))?;
        let mask = mask
            .as_any()
            .downcast_ref::<BooleanArray>()
            .ok_or_else(|| KernelError::InvalidData("a predicate that is not boolean".into()))?;
        let kept = filter_record_batch(&batch.project(&self.outputs).map_err(host)?, mask)
            .map_err(host)?;
        let rows = RecordBatchOptions::new().with_row_count(Some(kept.num_rows()));
        RecordBatch::try_new_with_options(Arc::clone(schema), kept.columns().to_vec(), &rows)
            .map(Some)
            .map_err(host)
    }

    fn output_on_host(&self) -> bool {
        self.host_only.is_some()
    }

    fn cpu(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let filtered = batch_filter(batch, &self.predicate)?;
        match &self.projection {
            Some(p) => Ok(filtered.project(p)?),
            None => Ok(filtered),
        }
    }
}
