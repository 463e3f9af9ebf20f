//! A session's live tables and sinks, and the statements that manage them:
//!
//! ```sql
//! SHOW STREAMS;                                   -- live tables: rate, lag, rows held, errors
//! CREATE SINK [IF NOT EXISTS] name INTO kafka_table AS SELECT …;
//! SHOW SINKS;
//! DROP SINK [IF EXISTS] name;
//! ```

use std::sync::{Arc, Mutex, Weak};

use datafusion::arrow::array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, TimestampNanosecondArray,
    UInt64Array,
};
use datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::common::plan_err;
use datafusion::dataframe::DataFrame;
use datafusion::error::Result;
use fulmen_engine::{FulmenContext, StatementHandler};

use crate::live::{KafkaTableFactory, Shared, live};
use crate::sink::{Sink, Sinks};

/// The live tables and sinks of one session.
#[derive(Default)]
pub struct Streams {
    tables: Mutex<Vec<Weak<Shared>>>,
    sinks: Sinks,
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Streams")
    }
}

impl Streams {
    pub(crate) fn add_table(&self, table: &Arc<Shared>) {
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.retain(|t| t.strong_count() > 0);
        tables.push(Arc::downgrade(table));
    }

    /// The live tables still ingesting.
    pub fn tables(&self) -> Vec<Arc<Shared>> {
        live(&self.tables.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The session's sinks.
    pub fn sinks(&self) -> &Sinks {
        &self.sinks
    }

    /// Stops every sink, then every live table's ingestion (for a clean shutdown).
    pub fn shutdown(&self) {
        self.sinks.stop_all();
        for table in self.tables() {
            table.stop();
        }
    }
}

/// Adds Kafka live tables (`STORED AS KAFKA`) and the streaming statements to a session.
pub fn install(ctx: &FulmenContext) -> Arc<Streams> {
    let streams = Arc::new(Streams::default());
    ctx.session_context()
        .state_ref()
        .write()
        .table_factories_mut()
        .insert(
            "KAFKA".into(),
            Arc::new(KafkaTableFactory::new(Arc::clone(&streams))),
        );
    ctx.add_statement_handler(Arc::new(Handler {
        streams: Arc::clone(&streams),
    }));
    streams
}

struct Handler {
    streams: Arc<Streams>,
}

/// `sql` without the whitespace, `-- …` lines and `/* … */` blocks it starts with.
fn without_leading_comments(mut sql: &str) -> &str {
    loop {
        sql = sql.trim_start();
        if let Some(rest) = sql.strip_prefix("--") {
            sql = rest.split_once('\n').map_or("", |(_, after)| after);
        } else if let Some(rest) = sql.strip_prefix("/*") {
            sql = rest.split_once("*/").map_or("", |(_, after)| after);
        } else {
            return sql;
        }
    }
}

/// Splits off the next word (letters, digits, `_`, `.`), case kept.
fn word(text: &str) -> Option<(&str, &str)> {
    let text = text.trim_start();
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.' || c == '"'))
        .unwrap_or(text.len());
    (end > 0).then(|| (&text[..end], &text[end..]))
}

fn keyword<'a>(text: &'a str, expected: &str) -> Option<&'a str> {
    word(text)
        .filter(|(w, _)| w.eq_ignore_ascii_case(expected))
        .map(|(_, rest)| rest)
}

fn name(text: &str) -> Option<(String, &str)> {
    word(text).map(|(w, rest)| (w.trim_matches('"').to_owned(), rest))
}

#[async_trait::async_trait]
impl StatementHandler for Handler {
    async fn handle(&self, ctx: &FulmenContext, sql: &str) -> Result<Option<DataFrame>> {
        let text = without_leading_comments(sql)
            .trim_end()
            .trim_end_matches(';')
            .trim_end();
        if let Some(rest) = keyword(text, "show") {
            if keyword(rest, "streams").is_some_and(|r| r.trim().is_empty()) {
                return Ok(Some(self.show_streams(ctx)?));
            }
            if keyword(rest, "sinks").is_some_and(|r| r.trim().is_empty()) {
                return Ok(Some(self.show_sinks(ctx)?));
            }
            return Ok(None);
        }
        if let Some(rest) = keyword(text, "drop").and_then(|r| keyword(r, "sink")) {
            let (if_exists, rest) = match keyword(rest, "if").and_then(|r| keyword(r, "exists")) {
                Some(r) => (true, r),
                None => (false, rest),
            };
            let Some((sink, _)) = name(rest).filter(|(_, t)| t.trim().is_empty()) else {
                return plan_err!("usage: DROP SINK [IF EXISTS] name");
            };
            match self.streams.sinks.remove(&sink) {
                Some(s) => {
                    tokio::task::spawn_blocking(move || s.stop())
                        .await
                        .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
                }
                None if if_exists => {}
                None => return plan_err!("sink '{sink}' does not exist"),
            }
            return Ok(Some(ctx.local_session().read_empty()?));
        }
        if let Some(rest) = keyword(text, "create").and_then(|r| keyword(r, "sink")) {
            let usage = "usage: CREATE SINK [IF NOT EXISTS] name INTO kafka_table AS SELECT …";
            let (if_not_exists, rest) = match keyword(rest, "if")
                .and_then(|r| keyword(r, "not"))
                .and_then(|r| keyword(r, "exists"))
            {
                Some(r) => (true, r),
                None => (false, rest),
            };
            let Some((sink, rest)) = name(rest) else {
                return plan_err!("{usage}");
            };
            let Some((target, rest)) = keyword(rest, "into").and_then(name) else {
                return plan_err!("{usage}");
            };
            let Some(query) = keyword(rest, "as").filter(|q| !q.trim().is_empty()) else {
                return plan_err!("{usage}");
            };
            if self.streams.sinks.contains(&sink) {
                if if_not_exists {
                    return Ok(Some(ctx.local_session().read_empty()?));
                }
                return plan_err!("sink '{sink}' already exists");
            }
            // A sink runs in this process, also on a cluster: its Kafka tables live here.
            let session = ctx.local_session();
            let started = Sink::start(&session, &sink, &target, query.trim()).await?;
            self.streams.sinks.add(started)?;
            return Ok(Some(ctx.local_session().read_empty()?));
        }
        Ok(None)
    }
}

impl Handler {
    fn show_streams(&self, ctx: &FulmenContext) -> Result<DataFrame> {
        let tables = self.streams.tables();
        let status: Vec<_> = tables.iter().map(|t| t.status()).collect();
        let ns = DataType::Timestamp(TimeUnit::Nanosecond, None);
        let schema = Arc::new(Schema::new(vec![
            Field::new("name", DataType::Utf8, false),
            Field::new("topic", DataType::Utf8, false),
            Field::new("rows", DataType::UInt64, false),
            Field::new("rows_held", DataType::UInt64, false),
            Field::new("rows_per_second", DataType::Float64, false),
            Field::new("lag", DataType::Int64, true),
            Field::new("malformed", DataType::UInt64, false),
            Field::new("late", DataType::UInt64, false),
            Field::new("dead_lettered", DataType::UInt64, false),
            Field::new("watermark", ns, true),
            Field::new("errors", DataType::UInt64, false),
            Field::new("last_error", DataType::Utf8, true),
        ]));
        let columns: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from_iter_values(
                status.iter().map(|s| &s.name),
            )),
            Arc::new(StringArray::from_iter_values(
                status.iter().map(|s| &s.topic),
            )),
            Arc::new(UInt64Array::from_iter_values(status.iter().map(|s| s.rows))),
            Arc::new(UInt64Array::from_iter_values(
                status.iter().map(|s| s.rows_held as u64),
            )),
            Arc::new(Float64Array::from_iter_values(
                status.iter().map(|s| s.rate),
            )),
            Arc::new(Int64Array::from_iter(status.iter().map(|s| s.lag))),
            Arc::new(UInt64Array::from_iter_values(
                status.iter().map(|s| s.malformed),
            )),
            Arc::new(UInt64Array::from_iter_values(status.iter().map(|s| s.late))),
            Arc::new(UInt64Array::from_iter_values(
                status.iter().map(|s| s.dead_lettered),
            )),
            Arc::new(TimestampNanosecondArray::from_iter(
                status.iter().map(|s| s.watermark),
            )),
            Arc::new(UInt64Array::from_iter_values(
                status.iter().map(|s| s.errors),
            )),
            Arc::new(StringArray::from_iter(
                status.iter().map(|s| s.last_error.clone()),
            )),
        ];
        ctx.local_session()
            .read_batch(RecordBatch::try_new(schema, columns)?)
    }

    fn show_sinks(&self, ctx: &FulmenContext) -> Result<DataFrame> {
        let sinks = self.streams.sinks.list();
        let ns = DataType::Timestamp(TimeUnit::Nanosecond, None);
        let schema = Arc::new(Schema::new(vec![
            Field::new("name", DataType::Utf8, false),
            Field::new("into", DataType::Utf8, false),
            Field::new("mode", DataType::Utf8, false),
            Field::new("delivery", DataType::Utf8, false),
            Field::new("runs", DataType::UInt64, false),
            Field::new("rows_written", DataType::UInt64, false),
            Field::new("rows_read", DataType::UInt64, false),
            Field::new("state_rows", DataType::UInt64, false),
            Field::new("emitted_up_to", ns, true),
            Field::new("failures", DataType::UInt64, false),
            Field::new("last_error", DataType::Utf8, true),
            Field::new("query", DataType::Utf8, false),
        ]));
        let columns: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from_iter_values(sinks.iter().map(|s| &s.0))),
            Arc::new(StringArray::from_iter_values(sinks.iter().map(|s| &s.1))),
            Arc::new(StringArray::from_iter_values(
                sinks.iter().map(|s| s.3.mode),
            )),
            Arc::new(StringArray::from_iter_values(
                sinks.iter().map(|s| s.3.delivery),
            )),
            Arc::new(UInt64Array::from_iter_values(
                sinks.iter().map(|s| s.3.runs),
            )),
            Arc::new(UInt64Array::from_iter_values(
                sinks.iter().map(|s| s.3.rows_written),
            )),
            Arc::new(UInt64Array::from_iter_values(
                sinks.iter().map(|s| s.3.rows_read),
            )),
            Arc::new(UInt64Array::from_iter_values(
                sinks.iter().map(|s| s.3.state_rows),
            )),
            Arc::new(TimestampNanosecondArray::from_iter(
                sinks.iter().map(|s| s.3.emitted_up_to),
            )),
            Arc::new(UInt64Array::from_iter_values(
                sinks.iter().map(|s| s.3.failures),
            )),
            Arc::new(StringArray::from_iter(
                sinks.iter().map(|s| s.3.last_error.clone()),
            )),
            Arc::new(StringArray::from_iter_values(sinks.iter().map(|s| &s.2))),
        ];
        ctx.local_session()
            .read_batch(RecordBatch::try_new(schema, columns)?)
    }
}
