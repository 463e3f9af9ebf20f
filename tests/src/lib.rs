//! Fulmen's end-to-end test support: a sqllogictest database adapter over `FulmenContext`.
//!
//! Results are rendered the way our `.slt` files expect: NULL as `NULL`, an empty string as
//! `(empty)`, every other value as Arrow displays it. Column types are `I` (integers),
//! `R` (floats and decimals), `T` (strings) and `?` (anything else), and are checked.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::DataType;
use async_trait::async_trait;
use datafusion::error::DataFusionError;
use fulmen_engine::{DeviceSelection, FulmenConfig, FulmenContext, GpuMode, OnError};
use sqllogictest::{AsyncDB, DBOutput, DefaultColumnType};

/// The settings of forced-GPU test runs: `fulmen.gpu.mode = force` on `cuda:0` when
/// `FULMEN_TEST_DEVICE=cuda`, else on one emulated device of the set named `set` (a set of
/// the runner's own); a device error fails the statement (`fulmen.gpu.on_error = fail`)
/// instead of being redone on the CPU.
pub fn forced_gpu_config(set: &str) -> FulmenConfig {
    let devices = match std::env::var("FULMEN_TEST_DEVICE").as_deref() {
        Ok("cuda") => DeviceSelection::Cuda(vec![0]),
        _ => DeviceSelection::EmulatedSet(1, set.to_string()),
    };
    FulmenConfig {
        devices,
        gpu_mode: GpuMode::Force,
        gpu_on_error: OnError::Fail,
        ..FulmenConfig::default()
    }
}

/// Every `.slt` file below `dir`, recursively, appended to `out`.
pub fn slt_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            slt_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "slt") {
            out.push(path);
        }
    }
}

/// What a failing statement reports to the runner.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SltError(String);

impl From<DataFusionError> for SltError {
    fn from(e: DataFusionError) -> Self {
        Self(e.strip_backtrace())
    }
}

impl From<arrow::error::ArrowError> for SltError {
    fn from(e: arrow::error::ArrowError) -> Self {
        Self(e.to_string())
    }
}

/// A sqllogictest database: one Fulmen session.
pub struct FulmenDb {
    ctx: FulmenContext,
}

impl FulmenDb {
    /// Wraps a session.
    pub fn new(ctx: FulmenContext) -> Self {
        Self { ctx }
    }
}

fn column_type(data_type: &DataType) -> DefaultColumnType {
    use DataType::*;
    match data_type {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 => {
            DefaultColumnType::Integer
        }
        Float16 | Float32 | Float64 | Decimal32(..) | Decimal64(..) | Decimal128(..)
        | Decimal256(..) => DefaultColumnType::FloatingPoint,
        Utf8 | LargeUtf8 | Utf8View => DefaultColumnType::Text,
        Dictionary(_, value) => column_type(value),
        _ => DefaultColumnType::Any,
    }
}

/// Renders result batches as rows of strings: Arrow's display, `NULL` for nulls, and
/// `(empty)` for an empty string (a NULL is never empty text, so the two cannot mix).
pub fn render_rows(batches: &[RecordBatch]) -> Result<Vec<Vec<String>>, SltError> {
    let mut rows = fulmen_engine::display::rows_as_text(batches)?;
    for cell in rows.iter_mut().flatten() {
        // Plans end with a newline, which would end the record in an .slt file.
        if cell.contains('\n') {
            *cell = cell.trim_end_matches('\n').to_string();
        }
        if cell.is_empty() {
            *cell = "(empty)".to_string();
        }
    }
    // A multi-line last cell (a plan in EXPLAIN output) becomes one row per line, as
    // sqllogictest compares results line by line.
    let mut out = Vec::with_capacity(rows.len());
    for mut row in rows {
        match row.last().filter(|c| c.contains('\n')).cloned() {
            Some(text) => {
                let mut lines = text.lines().map(str::to_string);
                row.pop();
                row.extend(lines.next());
                out.push(row);
                out.extend(lines.map(|l| vec![l]));
            }
            None => out.push(row),
        }
    }
    Ok(out)
}

#[async_trait]
impl AsyncDB for FulmenDb {
    type Error = SltError;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<Self::ColumnType>, Self::Error> {
        let frame = self.ctx.sql(sql).await?;
        let schema = Arc::new(frame.schema().as_arrow().clone());
        let batches = frame.collect().await?;
        if schema.fields().is_empty() {
            return Ok(DBOutput::StatementComplete(0));
        }
        let types = schema
            .fields()
            .iter()
            .map(|f| column_type(f.data_type()))
            .collect();
        Ok(DBOutput::Rows {
            types,
            rows: render_rows(&batches)?,
        })
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "fulmen"
    }

    async fn sleep(dur: std::time::Duration) {
        tokio::time::sleep(dur).await;
    }
}
