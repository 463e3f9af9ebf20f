//! The cache's statements, which `FulmenContext::sql` answers before DataFusion plans:
//!
//! ```sql
//! CACHE TABLE t;                      -- t's rows into device memory
//! CACHE TABLE t AS SELECT …;          -- the query's rows as table t, cached
//! UNCACHE TABLE [IF EXISTS] t;        -- t reads its source again; the device memory is freed
//! REFRESH CACHE t;                    -- a new snapshot of t's source
//! SHOW DEVICES;                       -- devices, their memory and the cached tables
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{RecordBatch, StringArray, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::catalog::TableProvider;
use datafusion::dataframe::DataFrame;
use datafusion::datasource::MemTable;
use datafusion::datasource::listing::ListingTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::sql::sqlparser::ast::Statement;
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::parser::Parser;

use super::{CachedData, CachedTable, size};
use crate::config::GpuMode;
use crate::context::FulmenContext;
use crate::physical_plan::coalesce::BatchLimit;

/// What one `CACHE TABLE` placed on the devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSummary {
    /// The table.
    pub table: String,
    /// Rows cached.
    pub rows: usize,
    /// Device chunks they make.
    pub chunks: usize,
    /// Device bytes they hold, on every device together.
    pub bytes: usize,
    /// The devices holding them (`emulated:0,emulated:1`).
    pub devices: String,
}

impl CacheSummary {
    fn of(data: &CachedData) -> Self {
        Self {
            table: data.name().to_string(),
            rows: data.rows(),
            chunks: data.chunks(),
            bytes: data.bytes(),
            devices: crate::gpu::devices::describe(data.devices()),
        }
    }

    fn frame(&self, ctx: &FulmenContext) -> Result<DataFrame> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("table", DataType::Utf8, false),
            Field::new("rows", DataType::UInt64, false),
            Field::new("chunks", DataType::UInt64, false),
            Field::new("device_bytes", DataType::UInt64, false),
            Field::new("devices", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from(vec![self.table.as_str()])),
                Arc::new(UInt64Array::from(vec![self.rows as u64])),
                Arc::new(UInt64Array::from(vec![self.chunks as u64])),
                Arc::new(UInt64Array::from(vec![self.bytes as u64])),
                Arc::new(StringArray::from(vec![self.devices.as_str()])),
            ],
        )?;
        ctx.session_context()
            .read_table(Arc::new(MemTable::try_new(schema, vec![vec![batch]])?))
    }
}

/// `sql` without its leading `--` comments and blank space.
fn statement_text(sql: &str) -> &str {
    let mut text = sql.trim_start();
    while let Some(rest) = text.strip_prefix("--") {
        text = rest.split_once('\n').map_or("", |(_, r)| r).trim_start();
    }
    text
}

/// The first `n` words of `sql`, as written (a trailing `;` aside).
fn words(sql: &str, n: usize) -> Vec<&str> {
    statement_text(sql)
        .split(|c: char| c.is_whitespace() || c == ';')
        .filter(|w| !w.is_empty())
        .take(n)
        .collect()
}

/// Answers `sql` when it is one of the cache's statements.
pub async fn handle(ctx: &FulmenContext, sql: &str) -> Result<Option<DataFrame>> {
    let written = words(sql, 6);
    let lower: Vec<String> = written.iter().map(|w| w.to_ascii_lowercase()).collect();
    let first: Vec<&str> = lower.iter().map(String::as_str).collect();
    match first.as_slice() {
        ["show", "devices"] => show_devices(ctx).await.map(Some),
        ["refresh", "cache", _] => {
            // The name as written: quoted, exact; bare, folded to lower case as SQL does.
            let name = match written[2]
                .strip_prefix('"')
                .and_then(|w| w.strip_suffix('"'))
            {
                Some(exact) => exact.to_string(),
                None => written[2].to_ascii_lowercase(),
            };
            Ok(Some(refresh_cache(ctx, &name).await?.frame(ctx)?))
        }
        ["refresh", "cache", ..] => Err(DataFusionError::Plan("usage: REFRESH CACHE table".into())),
        ["cache", ..] | ["uncache", ..] => {
            let statement = match parse_one(sql) {
                Ok(statement) => statement,
                // `OPTIONS ('shard_key' 'col')`, as Spark writes options, is not SQL's
                // `name = value`: say what is missing rather than how it fails to parse.
                Err(_) if first[0] == "cache" && lower.iter().any(|w| w.starts_with("options")) => {
                    return Err(no_options());
                }
                Err(e) => return Err(e),
            };
            match statement {
                Statement::Cache {
                    table_flag,
                    table_name,
                    options,
                    query,
                    ..
                } => {
                    if let Some(flag) = table_flag {
                        return Err(DataFusionError::Plan(format!(
                            "CACHE {flag} TABLE: no such kind of cache (usage: CACHE TABLE t \
                             [AS query])"
                        )));
                    }
                    if !options.is_empty() {
                        return Err(no_options());
                    }
                    let name = table_name.to_string();
                    let query = query.map(|q| q.to_string());
                    let summary = cache_table(ctx, &name, query.as_deref()).await?;
                    Ok(Some(summary.frame(ctx)?))
                }
                Statement::UNCache {
                    table_name,
                    if_exists,
                } => {
                    uncache_table(ctx, &table_name.to_string(), if_exists).await?;
                    Ok(Some(ctx.session_context().read_empty()?))
                }
                _ => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

fn no_options() -> DataFusionError {
    DataFusionError::NotImplemented(
        "CACHE TABLE … OPTIONS: cached tables take no options yet (sharding on a key, \
         'shard_key', is not built); their rows are spread in chunks over every device"
            .into(),
    )
}

fn kind_of(t: datafusion::datasource::TableType) -> &'static str {
    match t {
        datafusion::datasource::TableType::Base => "table of another kind",
        datafusion::datasource::TableType::View => "view",
        datafusion::datasource::TableType::Temporary => "temporary table",
    }
}

fn parse_one(sql: &str) -> Result<Statement> {
    let mut statements = Parser::parse_sql(&GenericDialect {}, sql)
        .map_err(|e| DataFusionError::SQL(Box::new(e), None))?;
    match statements.len() {
        1 => Ok(statements.remove(0)),
        n => Err(DataFusionError::Plan(format!(
            "expected one statement, found {n}"
        ))),
    }
}

/// Caches table `name` (see `cache/mod.rs`), or with `query`, stores the query's rows as
/// an in-memory table `name` and caches that. Fails, caching nothing, when the table is
/// already cached, its rows do not fit, or the session uses no GPU.
pub async fn cache_table(
    ctx: &FulmenContext,
    name: &str,
    query: Option<&str>,
) -> Result<CacheSummary> {
    let session = ctx.session_context();
    let config = ctx.fulmen_config();
    if config.gpu_mode == GpuMode::Off {
        return Err(DataFusionError::Plan(format!(
            "CACHE TABLE {name}: fulmen.gpu.mode is off, so this session uses no device to \
             cache it on"
        )));
    }
    let source: Arc<dyn TableProvider> = match query {
        Some(query) => {
            if session.table_exist(name)? {
                return Err(DataFusionError::Plan(format!(
                    "CACHE TABLE {name} AS …: table {name} already exists"
                )));
            }
            // Boxed: `sql` answers CACHE TABLE itself.
            let frame = Box::pin(ctx.sql(query)).await?;
            let schema = Arc::new(frame.schema().as_arrow().clone());
            let batches = frame.collect().await?;
            Arc::new(MemTable::try_new(schema, vec![batches])?)
        }
        None => {
            let provider = session.table_provider(name).await?;
            if provider.is::<CachedTable>() {
                return Err(DataFusionError::Plan(format!(
                    "CACHE TABLE {name}: it is cached already (REFRESH CACHE {name} takes a new \
                     snapshot)"
                )));
            }
            // The cache must be able to tell when the source changes: files it can list
            // again, or memory batches it can compare (a live table or a view changes
            // without a trace it could see).
            if !(provider.is::<MemTable>() || provider.is::<ListingTable>()) {
                return Err(DataFusionError::Plan(format!(
                    "CACHE TABLE {name}: only tables of files or of memory can be cached by name \
                     (the cache watches them for changes; {name} is a {}); CACHE TABLE \
                     {name}_snapshot AS SELECT * FROM {name} caches a snapshot of its rows",
                    kind_of(provider.table_type())
                )));
            }
            provider
        }
    };
    let all = crate::gpu::devices::devices(&config.devices)
        .map_err(|e| DataFusionError::Plan(format!("CACHE TABLE {name}: fulmen.devices: {e}")))?;
    let devices: Vec<_> = all
        .iter()
        .filter(|d| d.quarantined().is_none())
        .cloned()
        .collect();
    let state = session.state();
    let scan = source.scan(&state, None, &[], None).await?;
    let data = super::cache(
        name,
        &scan,
        session.task_ctx(),
        Arc::new(devices),
        BatchLimit::of(&config),
        config.cache_memory_limit,
    )
    .await?;
    let summary = CacheSummary::of(&data);
    session.deregister_table(name)?;
    session.register_table(name, Arc::new(CachedTable::new(source, data)))?;
    Ok(summary)
}

/// Puts table `name` back on its source, freeing its device memory (once no running query
/// reads it). Without `if_exists`, a table that is not cached is an error.
pub async fn uncache_table(ctx: &FulmenContext, name: &str, if_exists: bool) -> Result<bool> {
    let session = ctx.session_context();
    let provider = match session.table_provider(name).await {
        Ok(p) => p,
        Err(_) if if_exists => return Ok(false),
        Err(e) => return Err(e),
    };
    let Some(cached) = provider.downcast_ref::<CachedTable>() else {
        return if if_exists {
            Ok(false)
        } else {
            Err(DataFusionError::Plan(format!(
                "UNCACHE TABLE {name}: it is not cached"
            )))
        };
    };
    let source = Arc::clone(cached.source());
    session.deregister_table(name)?;
    session.register_table(name, source)?;
    Ok(true)
}

/// Takes a new snapshot of cached table `name`'s source. The old rows are freed first; if
/// the new ones cannot be cached, the table reads its source and the error says so.
pub async fn refresh_cache(ctx: &FulmenContext, name: &str) -> Result<CacheSummary> {
    let provider = ctx.session_context().table_provider(name).await?;
    if !provider.is::<CachedTable>() {
        return Err(DataFusionError::Plan(format!(
            "REFRESH CACHE {name}: it is not cached (CACHE TABLE {name} caches it)"
        )));
    }
    drop(provider);
    uncache_table(ctx, name, false).await?;
    cache_table(ctx, name, None).await.map_err(|e| {
        DataFusionError::Execution(format!(
            "REFRESH CACHE {name}: {e}; {name} is no longer cached and reads its source"
        ))
    })
}

/// `SHOW DEVICES`: the session's devices with their memory (the cache's share apart) and
/// cached tables, what they have done, and whether they are in service.
pub async fn show_devices(ctx: &FulmenContext) -> Result<DataFrame> {
    ctx.session_context()
        .sql(
            "SELECT device, name, state, reason, memory_budget AS memory_total, \
             memory_cached, memory_working, cached_tables, launches, syncs, h2d_bytes, \
             d2h_bytes, device_errors FROM fulmen_devices()",
        )
        .await
}

/// How `SHOW DEVICES` lists the cached tables on `device`: `t (1.5 MiB in 2 chunks)`.
pub fn tables_on(device: &fulmen_kernels::Device) -> String {
    super::cached_tables()
        .iter()
        .filter_map(|t| {
            let d = t.devices().iter().position(|x| x == device)?;
            let chunks = t.shard(d).len();
            (chunks > 0).then(|| {
                format!(
                    "{} ({} in {chunks} chunk{})",
                    t.name(),
                    size(t.bytes_on(device)),
                    if chunks == 1 { "" } else { "s" }
                )
            })
        })
        .collect::<Vec<_>>()
        .join(", ")
}
