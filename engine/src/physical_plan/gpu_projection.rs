//! `GpuProjectionExec`: DataFusion's `ProjectionExec` on a GPU. Every computed column of
//! the projection is an output of one expression program, evaluated in one pass; plain
//! column references and constants are filled in on the host without visiting the device.
//! For a parent on the host, the program's error word comes up with its outputs: one host
//! wait per batch.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::error::Result;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::projection::ProjectionExec;
use fulmen_kernels::ops::{STATUS_BYTES, expr};
use fulmen_kernels::{Device, DeviceColumn, KernelError};

use super::gpu_batch_exec::GpuBatchExec;
use super::gpu_stream::{BatchWork, Chunk, Col, GpuMetrics, OperatorKind, Output, make_batch};
use crate::gpu::compile::{CompiledExprs, Reason, compile};

/// A projection whose computed columns run on a GPU.
pub type GpuProjectionExec = GpuBatchExec<ProjectionWork>;

/// What a `GpuProjectionExec` does with each batch.
#[derive(Debug)]
pub struct ProjectionWork {
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    /// For each output column: the input column it passes through, or the program output
    /// that computes it.
    sources: Vec<Source>,
    program: CompiledExprs,
    schema: SchemaRef,
}

#[derive(Debug, Clone)]
enum Source {
    Input(usize),
    Constant(ScalarValue),
    Computed(usize),
}

impl ProjectionWork {
    /// The program bound to `input`'s per-batch constants and its input columns on
    /// `device`; `None` when a per-batch constant (a scalar subquery's value) is one the
    /// program cannot hold, which leaves the batch to the CPU, by rule.
    #[allow(clippy::type_complexity)]
    fn bound(
        &self,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<Option<(std::borrow::Cow<'_, expr::Program>, Vec<DeviceColumn>)>, KernelError> {
        let Ok(program) = self.program.bind(&input.host_view()) else {
            return Ok(None);
        };
        let inputs = (self.program.inputs.iter())
            .map(|&c| input.device_column(c, device, metrics))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some((program, inputs)))
    }
}

impl BatchWork for ProjectionWork {
    const NAME: &'static str = "GpuProjectionExec";
    const KIND: OperatorKind = OperatorKind::Projection;

    fn plan(projection: &Arc<dyn ExecutionPlan>) -> Result<Self, Reason> {
        let Some(cpu) = projection.downcast_ref::<ProjectionExec>() else {
            return Err("not a ProjectionExec".into());
        };
        let input_schema = cpu.input().schema();
        let exprs: Vec<Arc<dyn PhysicalExpr>> =
            cpu.expr().iter().map(|p| Arc::clone(&p.expr)).collect();
        let mut sources = Vec::with_capacity(exprs.len());
        let mut computed = Vec::new();
        for e in &exprs {
            if let Some(c) = e.downcast_ref::<Column>() {
                sources.push(Source::Input(c.index()));
            } else if let Some(l) = e.downcast_ref::<Literal>() {
                sources.push(Source::Constant(l.value().clone()));
            } else if e.data_type(&input_schema).ok() == Some(DataType::Null) {
                // NULL whatever the row: typed NULL has nothing to compute or fail.
                sources.push(Source::Constant(ScalarValue::Null));
            } else {
                sources.push(Source::Computed(computed.len()));
                computed.push(Arc::clone(e));
            }
        }
        if computed.is_empty() {
            return Err(
                "it only selects columns and constants: there is nothing to compute".into(),
            );
        }
        let program = compile(&computed, &input_schema)?;
        Ok(Self {
            exprs,
            sources,
            program,
            schema: projection.schema(),
        })
    }

    fn gpu(
        &self,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
    ) -> Result<Option<Output>, KernelError> {
        let n = input.num_rows();
        let Some((program, inputs)) = self.bound(device, input, metrics)? else {
            return Ok(None);
        };
        let inputs: Vec<&DeviceColumn> = inputs.iter().collect();
        let Some(computed) = metrics.kernel(|| expr::evaluate(device, &program, &inputs, n))?
        else {
            return Ok(None);
        };
        let columns = self
            .sources
            .iter()
            .map(|s| match s {
                // Passed through from wherever the input is.
                Source::Input(i) => Ok(match input {
                    Chunk::Host(batch) => Col::Host(Arc::clone(batch.column(*i))),
                    Chunk::Device(batch, ..) => Col::Device(batch.columns()[*i].clone()),
                }),
                Source::Constant(v) => v
                    .to_array_of_size(n)
                    .map(Col::Host)
                    .map_err(|e| KernelError::InvalidData(e.to_string())),
                Source::Computed(k) => Ok(Col::Device(computed[*k].clone())),
            })
            .collect::<Result<Vec<Col>, _>>()?;
        Ok(Some(Output { columns, rows: n }))
    }

    /// For a parent on the host the program is queued unchecked and its error word comes
    /// up with its outputs (and any column passed through from a device input): one host
    /// wait per batch, where [`Self::gpu`] and a download took two.
    fn gpu_to_host(
        &self,
        device: &Device,
        input: &Chunk,
        metrics: &GpuMetrics,
        schema: &SchemaRef,
    ) -> Result<Option<RecordBatch>, KernelError> {
        let n = input.num_rows();
        let Some((program, inputs)) = self.bound(device, input, metrics)? else {
            return Ok(None);
        };
        let inputs: Vec<&DeviceColumn> = inputs.iter().collect();
        let computed = metrics.kernel(|| {
            let status = device.upload(&[0; STATUS_BYTES])?;
            let outputs = expr::evaluate_unchecked(device, &program, &inputs, n, &status)?;
            Ok::<_, KernelError>((outputs, status))
        })?;
        let (outputs, status) = computed;
        // What comes down, in schema order: computed columns and device columns passed
        // through.
        let mut down: Vec<(&DeviceColumn, &DataType)> = Vec::new();
        for (source, field) in self.sources.iter().zip(schema.fields()) {
            match (source, input) {
                (Source::Computed(k), _) => down.push((&outputs[*k], field.data_type())),
                (Source::Input(i), Chunk::Device(batch, ..)) => {
                    down.push((&batch.columns()[*i], field.data_type()))
                }
                _ => {}
            }
        }
        let Some(arrays) = metrics.download_checked(device, &down, &status)? else {
            return Ok(None);
        };
        let mut arrays = arrays.into_iter();
        let columns = (self.sources.iter())
            .map(|source| match (source, input) {
                (Source::Input(i), Chunk::Host(batch)) => Ok(Arc::clone(batch.column(*i))),
                (Source::Constant(v), _) => v
                    .to_array_of_size(n)
                    .map_err(|e| KernelError::InvalidData(e.to_string())),
                _ => (arrays.next())
                    .ok_or_else(|| KernelError::InvalidData("a column did not come down".into())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        make_batch(schema, columns, n)
            .map(Some)
            .map_err(|e| KernelError::InvalidData(e.to_string()))
    }

    fn cpu(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let columns = self
            .exprs
            .iter()
            .map(|e| {
                e.evaluate(batch)
                    .and_then(|v| v.into_array(batch.num_rows()))
            })
            .collect::<Result<Vec<_>>>()?;
        make_batch(&self.schema, columns, batch.num_rows())
    }
}
