//! [`FulmenContext`]: the session a program or the shell talks to.
//!
//! It wraps a DataFusion `SessionContext` built with Fulmen's settings (`fulmen.*`), an
//! object-store registry that reaches `s3://`, `gs://`, `az://` and `http(s)://` locations,
//! `information_schema` (so `SHOW ALL` and `SHOW TABLES` work) and URL tables (so
//! `SELECT * FROM 'data/t.parquet'` works without registering anything).

use std::path::Path;
use std::sync::{Arc, RwLock};

use datafusion::arrow::array::{RecordBatch, StringArray};
use datafusion::arrow::datatypes::DataType;
use datafusion::dataframe::DataFrame;
use datafusion::datasource::MemTable;
use datafusion::datasource::file_format::options::ArrowReadOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::cache::cache_manager::CacheManagerConfig;
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::{SessionState, SessionStateBuilder};
use datafusion::logical_expr::{DdlStatement, LogicalPlan};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_planner::{DefaultPhysicalPlanner, PhysicalPlanner};
use datafusion::prelude::{
    CsvReadOptions, JsonReadOptions, ParquetReadOptions, SessionConfig, SessionContext,
};
use url::Url;

use crate::cache::CacheOptions;
use crate::cache::statements::CacheSummary;
use crate::gpu::{GpuOverrides, placement_report};
use crate::object_store::{FulmenObjectStoreRegistry, StoreKind, build_store, take_store_options};
use crate::streaming::register_window_functions;
use crate::{EngineError, FulmenConfig, tpch};

/// The file formats Fulmen registers by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// Apache Parquet (`.parquet`).
    Parquet,
    /// Comma-separated values with a header row (`.csv`).
    Csv,
    /// Tab-separated values with a header row (`.tsv`).
    Tsv,
    /// Newline-delimited JSON (`.json`, `.ndjson`, `.jsonl`).
    Json,
    /// Arrow IPC files (`.arrow`, `.ipc`, `.feather`).
    Arrow,
}

impl TableFormat {
    /// The format a file name's extension announces, if any.
    pub fn from_file_name(name: &str) -> Option<(Self, &'static str)> {
        let lower = name.to_ascii_lowercase();
        [
            (".parquet", Self::Parquet),
            (".csv", Self::Csv),
            (".tsv", Self::Tsv),
            (".ndjson", Self::Json),
            (".jsonl", Self::Json),
            (".json", Self::Json),
            (".arrow", Self::Arrow),
            (".ipc", Self::Arrow),
            (".feather", Self::Arrow),
        ]
        .into_iter()
        .find(|(ext, _)| lower.ends_with(ext))
        .map(|(ext, format)| (format, ext))
    }
}

/// A Fulmen session: DataFusion plans and runs the SQL, with Fulmen's settings, object
/// stores and sample data.
///
/// ```no_run
/// # async fn demo() -> datafusion::error::Result<()> {
/// let ctx = fulmen_engine::FulmenContext::new()?;
/// ctx.register_tpch(0.01)?;
/// let batches = ctx.sql("SELECT count(*) FROM lineitem").await?.collect().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct FulmenContext {
    ctx: SessionContext,
    handlers: Arc<RwLock<Vec<Arc<dyn StatementHandler>>>>,
    /// The scheduler's `host:port` when the session runs its queries on a Ballista
    /// cluster ([`FulmenContext::remote`]).
    cluster: Option<Arc<str>>,
}

/// Statements that a crate built on the engine answers itself, before DataFusion parses
/// them (`fulmen-connectors` answers `SHOW STREAMS`, `CREATE SINK` and the like).
#[async_trait::async_trait]
pub trait StatementHandler: Send + Sync {
    /// `Ok(Some(result))` when `sql` is one of this handler's statements, `Ok(None)` when it
    /// is not.
    async fn handle(&self, ctx: &FulmenContext, sql: &str) -> Result<Option<DataFrame>>;
}

impl std::fmt::Debug for FulmenContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FulmenContext")
            .field("session_id", &self.ctx.session_id())
            .finish()
    }
}

impl FulmenContext {
    /// A session with Fulmen's defaults, taking `FULMEN_DEVICES` from the environment.
    pub fn new() -> Result<Self> {
        Ok(Self::with_config(FulmenConfig::from_env()?))
    }

    /// A session with the given Fulmen settings and DataFusion's defaults otherwise.
    pub fn with_config(config: FulmenConfig) -> Self {
        Self::with_session_config(SessionConfig::new(), config)
    }

    /// A session with the given DataFusion and Fulmen settings.
    pub fn with_session_config(session: SessionConfig, config: FulmenConfig) -> Self {
        Self::from_state(session_state(session, config), None)
    }

    /// A session whose queries run on the Ballista cluster whose scheduler listens at `url`
    /// (`df://host:port`; see docs/cluster.md), with Fulmen's defaults and `FULMEN_DEVICES`
    /// from the environment for anything the client runs itself.
    ///
    /// The client plans each query and sends it to the scheduler; every executor runs its
    /// stages on its own devices, with this session's `fulmen.*` settings. Tables must be
    /// files or object stores every process can read; Kafka tables, in-memory tables and
    /// cached tables stay in this process, and a query that reads one fails with an error
    /// saying so. Fails within seconds when nothing answers at `url`.
    pub async fn remote(url: &str) -> Result<Self> {
        Self::remote_with_config(url, FulmenConfig::from_env()?).await
    }

    /// [`FulmenContext::remote`] with the given Fulmen settings.
    pub async fn remote_with_config(url: &str, config: FulmenConfig) -> Result<Self> {
        use ballista_core::extension::SessionStateExt;
        let scheduler = crate::cluster::scheduler_address(url)?;
        crate::cluster::probe(&scheduler).await?;
        let state = session_state(SessionConfig::new(), config)
            .upgrade_for_ballista(format!("http://{scheduler}"))?;
        Ok(Self::from_state(state, Some(Arc::from(scheduler.as_str()))))
    }

    fn from_state(state: SessionState, cluster: Option<Arc<str>>) -> Self {
        let ctx = SessionContext::new_with_state(state).enable_url_table();
        register_window_functions(&ctx);
        ctx.register_udtf(
            crate::gpu::listing::NAME,
            Arc::new(crate::gpu::listing::DevicesFunction),
        );
        ctx.register_udtf(
            crate::gpu::listing::KERNELS_NAME,
            Arc::new(crate::gpu::listing::KernelsFunction),
        );
        Self {
            ctx,
            handlers: Arc::default(),
            cluster,
        }
    }

    /// The scheduler's `host:port` when this session runs its queries on a cluster.
    pub fn cluster(&self) -> Option<&str> {
        self.cluster.as_deref()
    }

    /// A session that plans and runs its queries in this process, sharing this one's
    /// tables, settings and devices: on a cluster, for what stays in the client (Kafka
    /// live tables and sinks, rows already at hand); otherwise this session itself.
    pub fn local_session(&self) -> SessionContext {
        if self.cluster.is_none() {
            return self.ctx.clone();
        }
        let state = SessionStateBuilder::new_from_existing(self.ctx.state())
            .with_query_planner(Arc::new(LocalPlanner))
            .build();
        SessionContext::new_with_state(state)
    }

    /// Lets `handler` answer statements before DataFusion sees them (see
    /// [`StatementHandler`]); handlers are asked in the order they were added.
    pub fn add_statement_handler(&self, handler: Arc<dyn StatementHandler>) {
        self.handlers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(handler);
    }

    /// The DataFusion session underneath, for anything Fulmen does not wrap.
    pub fn session_context(&self) -> &SessionContext {
        &self.ctx
    }

    /// The session's current Fulmen settings (as changed by `SET fulmen.…`).
    pub fn fulmen_config(&self) -> FulmenConfig {
        self.ctx
            .state()
            .config()
            .options()
            .extensions
            .get::<FulmenConfig>()
            .cloned()
            .unwrap_or_default()
    }

    /// Plans one SQL statement and returns its result as a lazy DataFrame; DDL and `SET`
    /// take effect at once. `CREATE EXTERNAL TABLE` on a remote location sets up its object
    /// store from the environment and the statement's `aws.*` / `gcp.*` / `azure.*` /
    /// `http.*` options.
    pub async fn sql(&self, sql: &str) -> Result<DataFrame> {
        if let Some(frame) = crate::cache::statements::handle(self, sql).await? {
            return Ok(frame);
        }
        let handlers = self
            .handlers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for handler in handlers {
            if let Some(frame) = handler.handle(self, sql).await? {
                return Ok(frame);
            }
        }
        let mut plan = self.ctx.state().create_logical_plan(sql).await?;
        if let LogicalPlan::Ddl(DdlStatement::CreateExternalTable(cmd)) = &mut plan {
            let store_options = take_store_options(&mut cmd.options);
            if let (Some(scheduler), Some((key, _))) = (&self.cluster, store_options.first()) {
                return Err(DataFusionError::NotImplemented(format!(
                    "option '{key}' configures an object store in this process only, and the \
                     cluster's executors (scheduler at {scheduler}) would read the table \
                     without it: on a cluster, give each process its credentials in its \
                     environment (AWS_…, GOOGLE_…, AZURE_…) and leave them out of the \
                     statement; see docs/cluster.md"
                )));
            }
            let mut remote = false;
            for location in &cmd.locations {
                if let Ok(url) = Url::parse(location)
                    && StoreKind::for_scheme(url.scheme()).is_some()
                {
                    let store = build_store(&url, &store_options)?;
                    self.ctx.register_object_store(&url, store);
                    remote = true;
                }
            }
            if !remote && let Some((key, _)) = store_options.first() {
                return Err(DataFusionError::Configuration(format!(
                    "option '{key}' configures an object store, but '{}' is not an s3://, \
                     gs://, az:// or http(s):// location",
                    cmd.locations.join(", ")
                )));
            }
        }
        if self.cluster.is_some() {
            return self.sql_on_cluster(plan).await;
        }
        if let LogicalPlan::Explain(explain) = &plan {
            let state = self.ctx.state();
            let physical = state.create_physical_plan(&explain.plan).await?;
            let lines = placement_report(&physical, state.config().options());
            let frame = self.ctx.execute_logical_plan(plan).await?;
            return if lines.is_empty() {
                Ok(frame)
            } else {
                self.with_placement_row(frame, &lines).await
            };
        }
        self.ctx.execute_logical_plan(plan).await
    }

    /// Runs `plan` on the cluster: a query may read only tables every executor can read
    /// itself, and EXPLAIN says where GPU placement is decided.
    async fn sql_on_cluster(&self, plan: LogicalPlan) -> Result<DataFrame> {
        // `CREATE TABLE … AS SELECT` and `CREATE VIEW` are checked too: their queries
        // read tables on the cluster.
        if !matches!(plan, LogicalPlan::Statement(_)) {
            crate::cluster::check_tables_travel(&plan)?;
        }
        let stages = match &plan {
            LogicalPlan::Explain(explain) => Some(
                crate::cluster::stage_placement(&self.local_session().state(), &explain.plan)
                    .await
                    .unwrap_or_else(|e| vec![format!("the stages could not be placed here: {e}")]),
            ),
            _ => None,
        };
        let frame = self.ctx.execute_logical_plan(plan).await?;
        if let Some(stages) = stages {
            let mut lines = vec![
                "on a cluster, each executor places a stage's operators on its own devices \
                 when it runs a task of the stage (the plans above are the scheduler's CPU \
                 plans); per stage, the placement it makes:"
                    .to_string(),
            ];
            lines.extend(stages);
            lines.push(
                "EXPLAIN ANALYZE shows, per operator, gpu_batches and cpu_batches as the \
                 executors counted them"
                    .to_string(),
            );
            return self.with_placement_row(frame, &lines).await;
        }
        Ok(frame)
    }

    /// EXPLAIN's output with one more row, `gpu_placement`: where each GPU-capable
    /// operator runs, or why it stays on the CPU.
    async fn with_placement_row(&self, frame: DataFrame, lines: &[String]) -> Result<DataFrame> {
        let schema = Arc::new(frame.schema().as_arrow().clone());
        let mut batches = frame.collect().await?;
        let text_columns = schema.fields().len() == 2
            && schema
                .fields()
                .iter()
                .all(|f| f.data_type() == &DataType::Utf8);
        if text_columns {
            let row = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from(vec!["gpu_placement"])),
                    Arc::new(StringArray::from(vec![lines.join("\n")])),
                ],
            )?;
            batches.push(row);
        }
        let table = Arc::new(MemTable::try_new(schema, vec![batches])?);
        // Rows already here: on a cluster, read in this process, not sent to it.
        self.local_session().read_table(table)
    }

    /// Keeps table `name`'s rows in device memory (`CACHE TABLE name`; see
    /// `cache/mod.rs`): later queries read them where the kernels run.
    pub async fn cache_table(&self, name: &str) -> Result<CacheSummary> {
        self.cache_table_with(name, &CacheOptions::default()).await
    }

    /// Caches table `name` with `options` (`CACHE TABLE name OPTIONS (…)`): with a
    /// `shard_key`, its rows are dealt over the devices by the key's hash, as DataFusion
    /// repartitions on it.
    pub async fn cache_table_with(
        &self,
        name: &str,
        options: &CacheOptions,
    ) -> Result<CacheSummary> {
        crate::cache::statements::cache_table(self, name, None, options).await
    }

    /// Stores `query`'s rows as in-memory table `name` and caches it (`CACHE TABLE name AS
    /// query`).
    pub async fn cache_query(&self, name: &str, query: &str) -> Result<CacheSummary> {
        crate::cache::statements::cache_table(self, name, Some(query), &CacheOptions::default())
            .await
    }

    /// Puts table `name` back on its source and frees its device memory (`UNCACHE TABLE`).
    /// Whether it was cached.
    pub async fn uncache_table(&self, name: &str) -> Result<bool> {
        crate::cache::statements::uncache_table(self, name, true).await
    }

    /// Takes a new snapshot of cached table `name` (`REFRESH CACHE name`).
    pub async fn refresh_cache(&self, name: &str) -> Result<CacheSummary> {
        crate::cache::statements::refresh_cache(self, name).await
    }

    /// The session's devices, one row each, as `SHOW DEVICES` lists them.
    pub async fn devices(&self) -> Result<Vec<RecordBatch>> {
        crate::cache::statements::show_devices(self)
            .await?
            .collect()
            .await
    }

    /// Registers a file or a folder of files as table `name`, choosing the reader from the
    /// file extension (`.parquet`, `.csv`, `.tsv`, `.json`/`.ndjson`/`.jsonl`, `.arrow`).
    /// A folder must hold files of one format. Remote URLs work like local paths.
    pub async fn register_path(&self, name: &str, path: &str) -> Result<()> {
        let (format, extension) = detect_format(path)?;
        self.register_with_format(name, path, format, extension)
            .await
    }

    /// Registers `path` (a file or folder) as table `name`, read as `format`.
    pub async fn register_with_format(
        &self,
        name: &str,
        path: &str,
        format: TableFormat,
        extension: &str,
    ) -> Result<()> {
        match format {
            TableFormat::Parquet => {
                let options = ParquetReadOptions::default().file_extension(extension);
                self.ctx.register_parquet(name, path, options).await
            }
            TableFormat::Csv => {
                let options = CsvReadOptions::new().file_extension(extension);
                self.ctx.register_csv(name, path, options).await
            }
            TableFormat::Tsv => {
                let options = CsvReadOptions::new()
                    .delimiter(b'\t')
                    .file_extension(extension);
                self.ctx.register_csv(name, path, options).await
            }
            TableFormat::Json => {
                let options = JsonReadOptions {
                    file_extension: extension,
                    newline_delimited: !local_json_is_array(path, extension),
                    ..Default::default()
                };
                self.ctx.register_json(name, path, options).await
            }
            TableFormat::Arrow => {
                let options = ArrowReadOptions {
                    file_extension: extension,
                    ..Default::default()
                };
                self.ctx.register_arrow(name, path, options).await
            }
        }
    }

    /// Generates the eight TPC-H tables at `scale_factor` in memory and registers them
    /// (`lineitem`, `orders`, …): Fulmen's built-in sample data.
    pub fn register_tpch(&self, scale_factor: f64) -> Result<()> {
        tpch::register(&self.ctx, scale_factor)
    }

    /// The names of the tables in the current catalog and schema, sorted.
    pub fn table_names(&self) -> Vec<String> {
        let state = self.ctx.state();
        let options = state.config().options();
        let catalog = &options.catalog.default_catalog;
        let schema = &options.catalog.default_schema;
        let mut names = self
            .ctx
            .catalog(catalog)
            .and_then(|c| c.schema(schema))
            .map(|s| s.table_names())
            .unwrap_or_default();
        names.sort();
        names
    }
}

/// Whether a local JSON file (or the first such file in a folder) holds one JSON array
/// rather than one object per line.
fn local_json_is_array(path: &str, extension: &str) -> bool {
    use std::io::Read;
    let local = Path::new(path);
    let file = if local.is_dir() {
        std::fs::read_dir(local).ok().and_then(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .find(|p| p.is_file() && p.to_string_lossy().ends_with(extension))
        })
    } else {
        Some(local.to_path_buf())
    };
    let mut head = [0u8; 512];
    let Some(n) = file
        .and_then(|f| std::fs::File::open(f).ok())
        .and_then(|mut f| f.read(&mut head).ok())
    else {
        return false;
    };
    head[..n].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[')
}

/// DataFusion's own physical planning, in this process (a cluster session's planner sends
/// queries to the scheduler instead).
#[derive(Debug)]
struct LocalPlanner;

#[async_trait::async_trait]
impl QueryPlanner for LocalPlanner {
    async fn create_physical_plan(
        &self,
        plan: &LogicalPlan,
        state: &dyn datafusion::catalog::Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        DefaultPhysicalPlanner::default()
            .create_physical_plan(plan, state)
            .await
    }
}

/// The session state of a Fulmen session: Fulmen's settings and GPU rule on DataFusion's
/// defaults, with `information_schema` and object stores for remote URLs.
pub(crate) fn session_state(session: SessionConfig, config: FulmenConfig) -> SessionState {
    let session = session
        .with_information_schema(true)
        .with_option_extension(config);
    SessionStateBuilder::new()
        .with_config(session)
        .with_runtime_env(runtime_env())
        .with_default_features()
        .with_physical_optimizer_rule(Arc::new(GpuOverrides::new()))
        .build()
}

/// The runtime of every Fulmen process (client, scheduler, executor): object stores for
/// s3://, gs://, az:// and http(s):// locations, and listings read again at each query.
pub fn runtime_env() -> Arc<RuntimeEnv> {
    // Tables of files see the files their location holds at each query: DataFusion's
    // own default keeps a location's listing for the life of the session, so that files
    // added later are never read, and a cached table could not tell that its source
    // changed. `SET datafusion.runtime.list_files_cache_limit = '1M'` brings it back.
    let listings = CacheManagerConfig::default().with_list_files_cache_limit(0);
    RuntimeEnvBuilder::new()
        .with_cache_manager(listings)
        .with_object_store_registry(Arc::new(FulmenObjectStoreRegistry::new()))
        .build_arc()
        // Building a runtime with the default memory pool and disk manager cannot fail
        // on a machine that can run the process at all; if it does, that is a bug.
        .expect("the default DataFusion runtime builds")
}

/// Chooses the format of a file, or of the files in a folder, from their extensions.
fn detect_format(path: &str) -> Result<(TableFormat, &'static str)> {
    let unknown = |reason: &str| {
        DataFusionError::from(EngineError::UnknownFormat {
            path: path.to_string(),
            reason: reason.to_string(),
        })
    };
    let is_remote = Url::parse(path)
        .ok()
        .is_some_and(|u| StoreKind::for_scheme(u.scheme()).is_some());
    if is_remote {
        return TableFormat::from_file_name(path.trim_end_matches('/'))
            .ok_or_else(|| unknown("the URL does not end in a known file extension"));
    }
    let local = Path::new(path);
    if local.is_file() {
        return TableFormat::from_file_name(path).ok_or_else(|| unknown("unknown file extension"));
    }
    if !local.is_dir() {
        return Err(EngineError::NotFound(path.to_string()).into());
    }
    let mut found: Option<(TableFormat, &'static str)> = None;
    let mut stack = vec![local.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| {
            DataFusionError::External(format!("cannot read '{}': {e}", dir.display()).into())
        })?;
        for entry in entries.flatten() {
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name.starts_with('_') {
                continue; // hidden files and markers such as _SUCCESS
            }
            if let Some(this) = TableFormat::from_file_name(&name) {
                match found {
                    None => found = Some(this),
                    Some(seen) if seen == this => {}
                    Some(seen) => {
                        return Err(unknown(&format!(
                            "the folder holds files of two formats ({} and {})",
                            seen.1, this.1
                        )));
                    }
                }
            }
        }
    }
    found.ok_or_else(|| unknown("the folder holds no file of a known format"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Array, Int64Array};

    async fn count(ctx: &FulmenContext, sql: &str) -> i64 {
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let column = batches[0].column(0);
        let counts = column.as_any().downcast_ref::<Int64Array>().unwrap();
        counts.value(0)
    }

    #[tokio::test]
    async fn registers_files_and_folders_of_every_format() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = FulmenContext::with_config(FulmenConfig::default());
        ctx.sql("CREATE TABLE src AS VALUES (1, 'a'), (2, 'b'), (3, NULL)")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        for (ext, stored_as) in [
            ("parquet", "PARQUET"),
            ("csv", "CSV"),
            ("json", "JSON"),
            ("arrow", "ARROW"),
        ] {
            let file = dir.path().join(format!("one.{ext}"));
            let folder = dir.path().join(format!("many_{ext}"));
            std::fs::create_dir(&folder).unwrap();
            for target in [
                file.clone(),
                folder.join(format!("a.{ext}")),
                folder.join(format!("b.{ext}")),
            ] {
                let sql = format!("COPY src TO '{}' STORED AS {stored_as}", target.display());
                ctx.sql(&sql).await.unwrap().collect().await.unwrap();
            }
            ctx.register_path(&format!("f_{ext}"), file.to_str().unwrap())
                .await
                .unwrap();
            ctx.register_path(&format!("d_{ext}"), folder.to_str().unwrap())
                .await
                .unwrap();
            assert_eq!(
                count(&ctx, &format!("SELECT count(*) FROM f_{ext}")).await,
                3,
                "{ext}"
            );
            assert_eq!(
                count(&ctx, &format!("SELECT count(*) FROM d_{ext}")).await,
                6,
                "{ext}"
            );
        }
        let names = ctx.table_names();
        assert!(names.contains(&"d_parquet".to_string()) && names.contains(&"src".to_string()));
    }

    #[tokio::test]
    async fn unknown_paths_and_formats_are_clear_errors() {
        let ctx = FulmenContext::with_config(FulmenConfig::default());
        let e = ctx
            .register_path("t", "/no/such/place")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no such file or folder: '/no/such/place'"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("notes.txt"), "hello").unwrap();
        let e = ctx
            .register_path("t", dir.path().to_str().unwrap())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("no file of a known format"), "{e}");
        std::fs::write(dir.path().join("a.csv"), "x\n1\n").unwrap();
        std::fs::write(dir.path().join("b.parquet"), "not really").unwrap();
        let e = ctx
            .register_path("t", dir.path().to_str().unwrap())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("two formats"), "{e}");
    }

    #[tokio::test]
    async fn store_options_on_local_tables_are_refused() {
        let ctx = FulmenContext::with_config(FulmenConfig::default());
        let e = ctx
            .sql("CREATE EXTERNAL TABLE t STORED AS CSV LOCATION '/tmp/x.csv' OPTIONS ('aws.region' 'x')")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'aws.region'") && e.contains("not an s3://"),
            "{e}"
        );
        let e = ctx
            .sql("CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION 's3://b/t.parquet' OPTIONS ('aws.regin' 'x')")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean 'aws.region'"), "{e}");
    }

    #[tokio::test]
    async fn settings_are_set_with_sql_and_listed() {
        let ctx = FulmenContext::with_config(FulmenConfig::default());
        ctx.sql("SET fulmen.gpu.mode = 'force'")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert_eq!(ctx.fulmen_config().gpu_mode, crate::GpuMode::Force);
        let shown = ctx
            .sql("SELECT value FROM information_schema.df_settings WHERE name = 'fulmen.gpu.mode'")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let text = arrow::util::pretty::pretty_format_batches(&shown)
            .unwrap()
            .to_string();
        assert!(text.contains("force"), "{text}");
        let e = ctx
            .sql("SET fulmen.gpu.mode = 'sideways'")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("off, auto or force"), "{e}");
    }

    #[tokio::test]
    async fn tpch_sample_data_has_the_specified_cardinalities() {
        let ctx = FulmenContext::with_config(FulmenConfig::default());
        ctx.register_tpch(0.01).unwrap();
        // TPC-H §4.2.5: rows per table scale with SF; lineitem's count is dbgen's.
        for (table, rows) in [
            ("part", 2_000),
            ("supplier", 100),
            ("partsupp", 8_000),
            ("customer", 1_500),
            ("orders", 15_000),
            ("lineitem", 60_175),
            ("nation", 25),
            ("region", 5),
        ] {
            assert_eq!(
                count(&ctx, &format!("SELECT count(*) FROM {table}")).await,
                rows,
                "{table}"
            );
        }
        assert!(ctx.register_tpch(0.0).is_err());
        assert!(ctx.register_tpch(f64::NAN).is_err());
        // Every TPC-H query plans and runs on the sample data; at SF 0.01 all but Q15's
        // tie (one supplier) and a few selective ones return several rows.
        for (i, query) in crate::tpch::QUERIES.iter().enumerate() {
            let batches = ctx.sql(query).await.unwrap().collect().await.unwrap();
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            assert!(rows > 0, "Q{} returned no rows", i + 1);
        }
    }
}
