//! `CachedTable`: the catalog entry of a cached table. It stands in for the source table
//! (the same schema, statistics and writes) and scans the device chunks while the source
//! is unchanged, the source itself otherwise.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{Constraints, Statistics};
use datafusion::datasource::TableType;
use datafusion::error::Result;
use datafusion::logical_expr::dml::InsertOp;
use datafusion::logical_expr::{Expr, LogicalPlan};
use datafusion::physical_plan::ExecutionPlan;

use super::{CachedData, fingerprint};
use crate::config::{FulmenConfig, GpuMode};
use crate::physical_plan::gpu_scan::GpuScanExec;

/// A table whose rows are also in device memory.
#[derive(Debug)]
pub struct CachedTable {
    source: Arc<dyn TableProvider>,
    data: Arc<CachedData>,
    /// Why the snapshot no longer stands for the source, once something was written to the
    /// table through SQL.
    written: Mutex<Option<String>>,
}

impl CachedTable {
    /// `source`, with its rows cached as `data`.
    pub fn new(source: Arc<dyn TableProvider>, data: Arc<CachedData>) -> Self {
        Self {
            source,
            data,
            written: Mutex::new(None),
        }
    }

    /// The table it stands in for.
    pub fn source(&self) -> &Arc<dyn TableProvider> {
        &self.source
    }

    /// The cached rows.
    pub fn data(&self) -> &Arc<CachedData> {
        &self.data
    }

    /// Why a scan now would read the source rather than the device chunks, if it would
    /// (`source_scan`: the source's scan for this query).
    pub fn stale(&self, source_scan: &Arc<dyn ExecutionPlan>) -> Option<String> {
        if let Some(why) = self
            .written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Some(why);
        }
        match fingerprint(source_scan) {
            Some(now) if &now == self.data.fingerprint() => None,
            _ => Some("its source changed since it was cached".into()),
        }
    }

    fn written(&self, what: &str) {
        *self.written.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(format!("{what} since it was cached"));
    }
}

#[async_trait::async_trait]
impl TableProvider for CachedTable {
    fn schema(&self) -> SchemaRef {
        self.source.schema()
    }

    fn constraints(&self) -> Option<&Constraints> {
        self.source.constraints()
    }

    fn table_type(&self) -> TableType {
        self.source.table_type()
    }

    fn get_table_definition(&self) -> Option<&str> {
        self.source.get_table_definition()
    }

    fn get_logical_plan(&'_ self) -> Option<Cow<'_, LogicalPlan>> {
        self.source.get_logical_plan()
    }

    fn get_column_default(&self, column: &str) -> Option<&Expr> {
        self.source.get_column_default(column)
    }

    /// The device chunks of the columns asked for, while the source is as it was cached and
    /// the session uses GPUs; else the source's own scan (logged).
    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let source = self.source.scan(state, projection, &[], None).await?;
        let off = state
            .config_options()
            .extensions
            .get::<FulmenConfig>()
            .is_none_or(|c| c.gpu_mode == GpuMode::Off);
        let why = if off {
            Some("fulmen.gpu.mode is off".to_string())
        } else {
            self.stale(&source)
        };
        if let Some(why) = why {
            log::info!(
                "cached table {} is read from its source: {why}",
                self.data.name()
            );
            return Ok(source);
        }
        let partitions = state.config_options().execution.target_partitions;
        // A sharded table's rows are found again by dealing the rows by their key: read
        // with the columns asked for when the key is not one of them.
        let keyed = match (self.data.sharding(), projection) {
            (Some(s), Some(p)) if !p.contains(&s.column) => {
                let mut with_key = p.clone();
                with_key.push(s.column);
                Some(self.source.scan(state, Some(&with_key), &[], None).await?)
            }
            _ => None,
        };
        let scan = GpuScanExec::try_new(
            Arc::clone(&self.data),
            projection.cloned(),
            source,
            keyed,
            partitions,
        )?;
        Ok(Arc::new(scan))
    }

    fn statistics(&self) -> Option<Statistics> {
        self.source.statistics()
    }

    async fn insert_into(
        &self,
        state: &dyn Session,
        input: Arc<dyn ExecutionPlan>,
        insert_op: InsertOp,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.written("rows were inserted");
        self.source.insert_into(state, input, insert_op).await
    }

    async fn delete_from(
        &self,
        state: &dyn Session,
        filters: Vec<Expr>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.written("rows were deleted");
        self.source.delete_from(state, filters).await
    }

    async fn update(
        &self,
        state: &dyn Session,
        assignments: Vec<(String, Expr)>,
        filters: Vec<Expr>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.written("rows were updated");
        self.source.update(state, assignments, filters).await
    }

    async fn truncate(&self, state: &dyn Session) -> Result<Arc<dyn ExecutionPlan>> {
        self.written("the table was truncated");
        self.source.truncate(state).await
    }
}
