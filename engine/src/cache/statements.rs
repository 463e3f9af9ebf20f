//! The cache's statements, which `FulmenContext::sql` answers before DataFusion plans:
//!
//! ```sql
//! CACHE TABLE t;                      -- t's rows into device memory
//! CACHE TABLE t OPTIONS ('shard_key' 'k');  -- dealt over the devices by the hash of k
//! CACHE TABLE t AS SELECT …;          -- the query's rows as table t, cached
//! UNCACHE TABLE [IF EXISTS] t;        -- t reads its source again; the device memory is freed
//! REFRESH CACHE t;                    -- a new snapshot of t's source
//! SHOW DEVICES;                       -- devices, their memory and the cached tables
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{BooleanArray, RecordBatch, StringArray, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::catalog::TableProvider;
use datafusion::dataframe::DataFrame;
use datafusion::datasource::MemTable;
use datafusion::datasource::listing::ListingTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::sql::sqlparser::ast::Statement;
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::parser::Parser;
use datafusion::sql::sqlparser::tokenizer::{Location, Token, Tokenizer};

use super::{CacheOptions, CachedData, CachedTable, Sharding, size};
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
    /// The column the rows are dealt by, when they are sharded.
    pub shard_key: Option<String>,
    /// Whether every device holds all the rows (`fulmen.cache.replicate_below`).
    pub replicated: bool,
}

impl CacheSummary {
    fn of(data: &CachedData) -> Self {
        Self {
            table: data.name().to_string(),
            rows: data.rows(),
            chunks: data.chunks(),
            bytes: data.bytes(),
            devices: crate::gpu::devices::describe(data.devices()),
            shard_key: data.sharding().map(|s| s.key.clone()),
            replicated: data.replicated(),
        }
    }

    fn frame(&self, ctx: &FulmenContext) -> Result<DataFrame> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("table", DataType::Utf8, false),
            Field::new("rows", DataType::UInt64, false),
            Field::new("chunks", DataType::UInt64, false),
            Field::new("device_bytes", DataType::UInt64, false),
            Field::new("devices", DataType::Utf8, false),
            Field::new("shard_key", DataType::Utf8, true),
            Field::new("replicated", DataType::Boolean, false),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from(vec![self.table.as_str()])),
                Arc::new(UInt64Array::from(vec![self.rows as u64])),
                Arc::new(UInt64Array::from(vec![self.chunks as u64])),
                Arc::new(UInt64Array::from(vec![self.bytes as u64])),
                Arc::new(StringArray::from(vec![self.devices.as_str()])),
                Arc::new(StringArray::from(vec![self.shard_key.as_deref()])),
                Arc::new(BooleanArray::from(vec![self.replicated])),
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
    if let (
        Some(scheduler),
        ["show", "devices"] | ["refresh", "cache", ..] | ["cache", ..] | ["uncache", ..],
    ) = (ctx.cluster(), first.as_slice())
    {
        return Err(DataFusionError::NotImplemented(format!(
            "{} is not available on a cluster yet (this session runs its queries on the \
             scheduler at {scheduler}; devices and cached tables belong to each executor \
             process): see docs/cluster.md",
            first
                .iter()
                .take(2)
                .copied()
                .collect::<Vec<_>>()
                .join(" ")
                .to_ascii_uppercase()
        )));
    }
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
            // `OPTIONS ('shard_key' 'col')`, as Spark writes options, is not SQL's: taken
            // out before the statement is parsed.
            let (sql, options) = match first[0] {
                "cache" => take_options(sql)?,
                _ => (sql.to_string(), CacheOptions::default()),
            };
            match parse_one(&sql)? {
                Statement::Cache {
                    table_flag,
                    table_name,
                    options: parsed,
                    query,
                    ..
                } => {
                    if let Some(flag) = table_flag {
                        return Err(DataFusionError::Plan(format!(
                            "CACHE {flag} TABLE: no such kind of cache ({USAGE})"
                        )));
                    }
                    if !parsed.is_empty() {
                        return Err(DataFusionError::Plan(format!("CACHE TABLE: {USAGE}")));
                    }
                    let name = table_name.to_string();
                    let query = query.map(|q| q.to_string());
                    let summary = cache_table(ctx, &name, query.as_deref(), &options).await?;
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

const USAGE: &str = "usage: CACHE TABLE t [OPTIONS ('shard_key' 'column')] [AS query]";

/// `sql` (a CACHE statement) without its `OPTIONS (…)` clause, and the options it gave:
/// `('shard_key' 'k')` as Spark writes them, or `(shard_key = 'k')`.
fn take_options(sql: &str) -> Result<(String, CacheOptions)> {
    let bad =
        |why: String| DataFusionError::Plan(format!("CACHE TABLE … OPTIONS: {why} ({USAGE})"));
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .tokenize_with_location()
        .map_err(|e| bad(e.to_string()))?;
    let word = |t: &Token, w: &str| matches!(t, Token::Word(x) if x.quote_style.is_none() && x.value.eq_ignore_ascii_case(w));
    // Options come before the query, if any.
    let before_query = tokens
        .iter()
        .position(|t| word(&t.token, "as") || word(&t.token, "select") || word(&t.token, "with"))
        .unwrap_or(tokens.len());
    // The word OPTIONS followed by `(` (a table may be called `options`).
    let opens = |i: usize| {
        let next = tokens[i + 1..]
            .iter()
            .find(|t| !matches!(t.token, Token::Whitespace(_)));
        next.is_some_and(|t| t.token == Token::LParen)
    };
    let Some(start) = (0..before_query).find(|&i| word(&tokens[i].token, "options") && opens(i))
    else {
        return Ok((sql.to_string(), CacheOptions::default()));
    };
    let mut values = Vec::new();
    let mut opened = false;
    let mut end = None;
    for (i, t) in tokens.iter().enumerate().skip(start + 1) {
        match &t.token {
            Token::Whitespace(_) => {}
            Token::LParen if !opened => opened = true,
            _ if !opened => return Err(bad("expected ( after OPTIONS".into())),
            Token::RParen => {
                end = Some(i);
                break;
            }
            Token::Comma | Token::Eq => {}
            Token::SingleQuotedString(v) | Token::DoubleQuotedString(v) => values.push(v.clone()),
            Token::Word(w) => values.push(w.value.clone()),
            Token::Number(n, _) => values.push(n.clone()),
            other => return Err(bad(format!("unexpected {other}"))),
        }
    }
    let end = end.ok_or_else(|| bad("no ) closes OPTIONS (".into()))?;
    if values.len() % 2 != 0 {
        return Err(bad("options come in pairs of a name and a value".into()));
    }
    let mut options = CacheOptions::default();
    for pair in values.chunks(2) {
        match pair[0].to_ascii_lowercase().as_str() {
            "shard_key" => options.shard_key = Some(pair[1].clone()),
            other => return Err(bad(format!("no option '{other}' (there is 'shard_key')"))),
        }
    }
    let (from, to) = (
        byte_at(sql, tokens[start].span.start),
        byte_at(sql, tokens[end].span.end),
    );
    Ok((format!("{} {}", &sql[..from], &sql[to..]), options))
}

/// The byte offset in `sql` of a tokenizer's location (1-based line and character column).
fn byte_at(sql: &str, at: Location) -> usize {
    let mut offset = 0;
    for (n, line) in sql.split_inclusive('\n').enumerate() {
        if n + 1 == at.line as usize {
            let column = (at.column as usize).saturating_sub(1);
            return offset
                + line
                    .char_indices()
                    .nth(column)
                    .map_or(line.len(), |(b, _)| b);
        }
        offset += line.len();
    }
    sql.len()
}

/// How rows are dealt by `key`, a column of `schema`: into `parts` parts.
fn sharding(name: &str, schema: &Schema, key: &str, parts: usize) -> Result<Sharding> {
    let fields = schema.fields();
    let column = fields.iter().position(|f| f.name() == key).or_else(|| {
        let mut alike = fields
            .iter()
            .enumerate()
            .filter(|(_, f)| f.name().eq_ignore_ascii_case(key));
        match (alike.next(), alike.next()) {
            (Some((i, _)), None) => Some(i),
            _ => None,
        }
    });
    let Some(column) = column else {
        let names: Vec<&str> = fields.iter().map(|f| f.name().as_str()).collect();
        return Err(DataFusionError::Plan(format!(
            "CACHE TABLE {name} OPTIONS ('shard_key' '{key}'): {name} has no column {key} (its \
             columns: {})",
            names.join(", ")
        )));
    };
    Ok(Sharding {
        key: fields[column].name().clone(),
        column,
        parts: parts.max(1),
    })
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
/// an in-memory table `name` and caches that; sharded by `options.shard_key` when given.
/// Fails, caching nothing, when the table is already cached, its rows do not fit, the key
/// is not a column, or the session uses no GPU.
pub async fn cache_table(
    ctx: &FulmenContext,
    name: &str,
    query: Option<&str>,
    options: &CacheOptions,
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
    let sharding = match &options.shard_key {
        Some(key) => {
            let parts = state.config_options().execution.target_partitions;
            Some(sharding(name, &source.schema(), key, parts)?)
        }
        None => None,
    };
    let scan = source.scan(&state, None, &[], None).await?;
    let data = super::cache(
        name,
        &scan,
        session.task_ctx(),
        Arc::new(devices),
        BatchLimit::of(&config),
        config.cache_chunk_bytes,
        config.cache_dictionary_limit,
        config.cache_memory_limit,
        config.cache_replicate_below,
        sharding,
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

/// Takes a new snapshot of cached table `name`'s source, with the options it was cached
/// with. The old rows are freed first; if the new ones cannot be cached, the table reads its
/// source and the error says so.
pub async fn refresh_cache(ctx: &FulmenContext, name: &str) -> Result<CacheSummary> {
    let provider = ctx.session_context().table_provider(name).await?;
    let Some(cached) = provider.downcast_ref::<CachedTable>() else {
        return Err(DataFusionError::Plan(format!(
            "REFRESH CACHE {name}: it is not cached (CACHE TABLE {name} caches it)"
        )));
    };
    let options = cached.data().options();
    drop(provider);
    uncache_table(ctx, name, false).await?;
    cache_table(ctx, name, None, &options).await.map_err(|e| {
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
            "SELECT device, name, compute_capability, state, reason, memory_total, \
             memory_budget, memory_cached, memory_working, cached_tables, launches, kernel_time_us, syncs, \
             h2d_bytes, d2h_bytes, device_errors FROM fulmen_devices()",
        )
        .await
}

/// How `SHOW DEVICES` lists the cached tables on `device`: `t (1.5 MiB in 2 chunks)`, for
/// a sharded table `t (1.5 MiB in 2 chunks, sharded by k)`, for one every device holds
/// whole `t (1.5 MiB in 2 chunks, replicated)`.
pub fn tables_on(device: &fulmen_kernels::Device) -> String {
    super::cached_tables()
        .iter()
        .filter_map(|t| {
            let d = t.devices().iter().position(|x| x == device)?;
            let chunks = t.shard(d).len();
            (chunks > 0).then(|| {
                let by = match t.sharding() {
                    Some(s) => format!(", sharded by {}", s.key),
                    None if t.replicated() => ", replicated".to_string(),
                    None => String::new(),
                };
                format!(
                    "{} ({} in {chunks} chunk{}{by})",
                    t.name(),
                    size(t.bytes_on(device)),
                    if chunks == 1 { "" } else { "s" }
                )
            })
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// OPTIONS are taken out of the statement as written, the rest left byte for byte.
    #[test]
    fn options_are_taken_out_of_the_statement() {
        let (rest, options) =
            take_options("CACHE TABLE t\n  OPTIONS ('shard_key' 'k') AS SELECT 'it''s' AS k")
                .unwrap();
        assert_eq!(rest, "CACHE TABLE t\n    AS SELECT 'it''s' AS k");
        assert_eq!(options.shard_key.as_deref(), Some("k"));
        let (rest, options) = take_options("CACHE TABLE é OPTIONS (shard_key = \"K\");").unwrap();
        assert_eq!(rest, "CACHE TABLE é  ;");
        assert_eq!(options.shard_key.as_deref(), Some("K"));
        for plain in [
            "CACHE TABLE t AS SELECT options FROM o",
            "CACHE TABLE options",
            "CACHE TABLE s.options AS SELECT 1",
        ] {
            assert_eq!(take_options(plain).unwrap().0, plain);
        }
        let (rest, options) =
            take_options("CACHE TABLE options OPTIONS ('shard_key' 'a')").unwrap();
        assert_eq!(rest, "CACHE TABLE options  ");
        assert_eq!(options.shard_key.as_deref(), Some("a"));
    }
}
