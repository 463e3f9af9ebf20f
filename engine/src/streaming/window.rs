//! Event-time windows as table functions, as RisingWave and Flink SQL write them:
//!
//! ```sql
//! SELECT card, window_start, window_end, count(*)
//! FROM TUMBLE(transactions, ts, INTERVAL '1 minute')
//! GROUP BY card, window_start, window_end;
//! ```
//!
//! - `TUMBLE(t, time_col, size)`: each row falls in the one window `[k·size, (k+1)·size)`.
//! - `HOP(t, time_col, slide, size)`: windows of `size` starting every `slide`; a row falls in
//!   every window that holds it (so a row appears `size / slide` times).
//! - `SESSION(t, time_col, gap [, key_col])`: rows (of one key, when a key column is given)
//!   closer than `gap` to the previous one form a session; `window_end` is the last row's
//!   time plus `gap`.
//!
//! Each adds `window_start` and `window_end` (of the time column's type) to `t`'s columns.
//! Rows whose time is NULL belong to no window. Windows are aligned to the Unix epoch.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::catalog::{Session, TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::common::{ScalarValue, internal_datafusion_err, plan_datafusion_err, plan_err};
use datafusion::datasource::TableType;
use datafusion::error::Result;
use datafusion::execution::SessionState;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use futures::FutureExt;

use super::StreamScope;

mod exec;

use exec::WindowExec;
pub use exec::{fixed_window_columns, fixed_window_over, hop_panes, session_key};

/// A window function's shape, with its lengths in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowKind {
    /// `TUMBLE(t, time_col, size)`.
    Tumble {
        /// Window length.
        size: i64,
    },
    /// `HOP(t, time_col, slide, size)`.
    Hop {
        /// Distance between window starts.
        slide: i64,
        /// Window length.
        size: i64,
    },
    /// `SESSION(t, time_col, gap [, key])`.
    Session {
        /// Largest gap between two rows of one session.
        gap: i64,
    },
}

impl WindowKind {
    /// How far before a window's end its earliest row can lie, if bounded (sessions are not).
    pub fn span(&self) -> Option<i64> {
        match *self {
            WindowKind::Tumble { size } | WindowKind::Hop { size, .. } => Some(size),
            WindowKind::Session { .. } => None,
        }
    }

    fn in_unit(&self, per: i64) -> Self {
        match *self {
            WindowKind::Tumble { size } => WindowKind::Tumble { size: size / per },
            WindowKind::Hop { slide, size } => WindowKind::Hop {
                slide: slide / per,
                size: size / per,
            },
            WindowKind::Session { gap } => WindowKind::Session { gap: gap / per },
        }
    }

    fn lengths(&self) -> Vec<i64> {
        match *self {
            WindowKind::Tumble { size } => vec![size],
            WindowKind::Hop { slide, size } => vec![slide, size],
            WindowKind::Session { gap } => vec![gap],
        }
    }
}

/// Registers `TUMBLE`, `HOP` and `SESSION` with a session.
pub fn register_window_functions(ctx: &SessionContext) {
    // DataFusion looks table functions up by the name as written, so the usual spellings
    // are registered.
    for name in ["tumble", "hop", "session"] {
        let function = Arc::new(WindowFunction { name });
        let capitalised = format!("{}{}", name[..1].to_ascii_uppercase(), &name[1..]);
        for spelling in [name.to_owned(), name.to_ascii_uppercase(), capitalised] {
            ctx.register_udtf(
                &spelling,
                Arc::clone(&function) as Arc<dyn TableFunctionImpl>,
            );
        }
    }
}

#[derive(Debug)]
struct WindowFunction {
    name: &'static str,
}

impl WindowFunction {
    fn usage(&self) -> &'static str {
        match self.name {
            "tumble" => "TUMBLE(table, time_column, size)",
            "hop" => "HOP(table, time_column, slide, size)",
            _ => "SESSION(table, time_column, gap [, key_column])",
        }
    }
}

impl TableFunctionImpl for WindowFunction {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let exprs = args.exprs();
        let usage = self.usage();
        let (lengths, key) = match (self.name, exprs.len()) {
            ("tumble", 3) => (&exprs[2..3], None),
            ("hop", 4) => (&exprs[2..4], None),
            ("session", 3) => (&exprs[2..3], None),
            ("session", 4) => (&exprs[2..3], Some(&exprs[3])),
            _ => return plan_err!("{usage} takes {} arguments", usage.matches(',').count() + 1),
        };
        let table_name = column_name(&exprs[0])
            .ok_or_else(|| plan_datafusion_err!("{usage}: the first argument names a table"))?;
        let time_name = column_name(&exprs[1]).ok_or_else(|| {
            plan_datafusion_err!("{usage}: the second argument names a timestamp column")
        })?;
        let lengths = lengths
            .iter()
            .map(|e| interval_nanos(e, usage))
            .collect::<Result<Vec<_>>>()?;
        let kind = match (self.name, lengths.as_slice()) {
            ("tumble", [size]) => WindowKind::Tumble { size: *size },
            ("hop", [slide, size]) => {
                if size < slide {
                    return plan_err!("{usage}: the size must be at least the slide");
                }
                WindowKind::Hop {
                    slide: *slide,
                    size: *size,
                }
            }
            (_, [gap]) => WindowKind::Session { gap: *gap },
            _ => return Err(internal_datafusion_err!("window arguments mismatched")),
        };
        let input = lookup_table(args.session(), &table_name)?;
        let key = key
            .map(|k| {
                column_name(k).ok_or_else(|| {
                    plan_datafusion_err!("{usage}: the fourth argument names a key column")
                })
            })
            .transpose()?;
        if let Some(scope) = args.session().config().get_extension::<StreamScope>() {
            scope.note(kind);
        }
        Ok(Arc::new(WindowTable::try_new(
            input,
            &time_name,
            key.as_deref(),
            kind,
        )?))
    }
}

fn column_name(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Column(c) => Some(c.flat_name()),
        Expr::Literal(ScalarValue::Utf8(Some(s)), _) => Some(s.clone()),
        _ => None,
    }
}

fn interval_nanos(expr: &Expr, usage: &str) -> Result<i64> {
    let nanos = match expr {
        Expr::Literal(ScalarValue::IntervalMonthDayNano(Some(v)), _) if v.months == 0 => {
            i64::from(v.days) * 86_400_000_000_000 + v.nanoseconds
        }
        Expr::Literal(ScalarValue::IntervalDayTime(Some(v)), _) => {
            i64::from(v.days) * 86_400_000_000_000 + i64::from(v.milliseconds) * 1_000_000
        }
        Expr::Literal(ScalarValue::Utf8(Some(s)), _) => {
            let v =
                datafusion::arrow::compute::kernels::cast_utils::parse_interval_month_day_nano(s)?;
            if v.months != 0 {
                return plan_err!("{usage}: windows are a fixed length; '{s}' uses months");
            }
            i64::from(v.days) * 86_400_000_000_000 + v.nanoseconds
        }
        other => {
            return plan_err!(
                "{usage}: window lengths are intervals without months, such as \
                 INTERVAL '1 minute'; got {other}"
            );
        }
    };
    if nanos <= 0 {
        return plan_err!("{usage}: window lengths must be positive");
    }
    Ok(nanos)
}

fn lookup_table(session: &dyn Session, name: &str) -> Result<Arc<dyn TableProvider>> {
    let state = session
        .as_any()
        .downcast_ref::<SessionState>()
        .ok_or_else(|| internal_datafusion_err!("window functions need a SessionState"))?;
    let reference = datafusion::common::TableReference::from(name);
    let schema = state.schema_for_ref(reference.clone())?;
    if !schema.table_exist(reference.table()) {
        return plan_err!("table '{name}' not found");
    }
    // In-memory catalogs answer at once; a catalog that would have to wait is not supported.
    match schema.table(reference.table()).now_or_never() {
        Some(Ok(Some(table))) => Ok(table),
        Some(Ok(None)) => plan_err!("table '{name}' not found"),
        Some(Err(e)) => Err(e),
        None => plan_err!("table '{name}' lives in a catalog that window functions cannot read"),
    }
}

/// A table with `window_start` and `window_end` added.
#[derive(Debug)]
struct WindowTable {
    input: Arc<dyn TableProvider>,
    time_index: usize,
    key_index: Option<usize>,
    /// Lengths in the time column's unit.
    kind: WindowKind,
    /// Nanoseconds per unit of the time column.
    per: i64,
    nanos_kind: WindowKind,
    schema: SchemaRef,
}

impl WindowTable {
    fn try_new(
        input: Arc<dyn TableProvider>,
        time: &str,
        key: Option<&str>,
        kind: WindowKind,
    ) -> Result<Self> {
        let input_schema = input.schema();
        let (time_index, field) = input_schema
            .column_with_name(time)
            .ok_or_else(|| plan_datafusion_err!("window time column '{time}' not found"))?;
        let DataType::Timestamp(unit, _) = field.data_type() else {
            return plan_err!(
                "window time column '{time}' is {}, not a timestamp",
                field.data_type()
            );
        };
        let per = match unit {
            TimeUnit::Second => 1_000_000_000,
            TimeUnit::Millisecond => 1_000_000,
            TimeUnit::Microsecond => 1_000,
            TimeUnit::Nanosecond => 1,
        };
        if kind.lengths().iter().any(|l| l % per != 0) {
            return plan_err!(
                "window lengths must be whole multiples of the column's unit ({unit})"
            );
        }
        let key_index = key
            .map(|k| {
                input_schema
                    .index_of(k)
                    .map_err(|_| plan_datafusion_err!("session key column '{k}' not found"))
            })
            .transpose()?;
        let mut fields: Vec<Field> = input_schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        for name in ["window_start", "window_end"] {
            if input_schema.column_with_name(name).is_some() {
                return plan_err!("the table already has a column named {name}");
            }
            fields.push(Field::new(name, field.data_type().clone(), false));
        }
        Ok(Self {
            input,
            time_index,
            key_index,
            kind: kind.in_unit(per),
            per,
            nanos_kind: kind,
            schema: Arc::new(Schema::new(fields)),
        })
    }
}

#[async_trait::async_trait]
impl TableProvider for WindowTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(vec![
            TableProviderFilterPushDown::Unsupported;
            filters.len()
        ])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = self.input.scan(state, None, &[], None).await?;
        let scope = state.config().get_extension::<StreamScope>();
        let range = scope.map(|s| {
            let to_unit = |ns: Option<i64>| ns.map(|v| v.div_euclid(self.per));
            (to_unit(s.emitted_up_to), to_unit(s.emit_up_to))
        });
        Ok(Arc::new(WindowExec::new(
            input,
            (self.time_index, self.key_index),
            (self.kind, self.nanos_kind),
            range.unwrap_or((None, None)),
            projection.cloned(),
            Arc::clone(&self.schema),
        )?))
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::util::pretty::pretty_format_batches;

    use crate::FulmenContext;

    async fn run(ctx: &FulmenContext, sql: &str) -> String {
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        pretty_format_batches(&batches).unwrap().to_string()
    }

    async fn context() -> FulmenContext {
        let ctx = FulmenContext::new().unwrap();
        ctx.sql(
            "CREATE TABLE t AS SELECT * FROM (VALUES \
             ('a', TIMESTAMP '2026-01-01 00:00:01'), ('a', TIMESTAMP '2026-01-01 00:00:04'), \
             ('b', TIMESTAMP '2026-01-01 00:00:05'), ('a', TIMESTAMP '2026-01-01 00:00:12'), \
             ('b', NULL)) AS v(k, ts)",
        )
        .await
        .unwrap();
        ctx
    }

    #[tokio::test]
    async fn tumble_hop_and_session_assign_the_windows_flink_would() {
        let ctx = context().await;
        let tumble = run(
            &ctx,
            "SELECT k, window_start, window_end, count(*) AS n \
             FROM TUMBLE(t, ts, INTERVAL '5 seconds') GROUP BY 1, 2, 3 ORDER BY 2, 1",
        )
        .await;
        assert_eq!(
            tumble,
            "+---+---------------------+---------------------+---+\n\
             | k | window_start        | window_end          | n |\n\
             +---+---------------------+---------------------+---+\n\
             | a | 2026-01-01T00:00:00 | 2026-01-01T00:00:05 | 2 |\n\
             | b | 2026-01-01T00:00:05 | 2026-01-01T00:00:10 | 1 |\n\
             | a | 2026-01-01T00:00:10 | 2026-01-01T00:00:15 | 1 |\n\
             +---+---------------------+---------------------+---+"
        );
        // Every row in size / slide = 2 windows.
        let hop = run(
            &ctx,
            "SELECT window_start, count(*) AS n \
             FROM HOP(t, ts, INTERVAL '5 seconds', INTERVAL '10 seconds') GROUP BY 1 ORDER BY 1",
        )
        .await;
        assert_eq!(
            hop,
            "+---------------------+---+\n\
             | window_start        | n |\n\
             +---------------------+---+\n\
             | 2025-12-31T23:59:55 | 2 |\n\
             | 2026-01-01T00:00:00 | 3 |\n\
             | 2026-01-01T00:00:05 | 2 |\n\
             | 2026-01-01T00:00:10 | 1 |\n\
             +---------------------+---+"
        );
        // Per key: a's rows 3 s apart join one session (gap 4 s), 8 s apart do not.
        let session = run(
            &ctx,
            "SELECT k, window_start, window_end, count(*) AS n \
             FROM SESSION(t, ts, INTERVAL '4 seconds', k) GROUP BY 1, 2, 3 ORDER BY 1, 2",
        )
        .await;
        assert_eq!(
            session,
            "+---+---------------------+---------------------+---+\n\
             | k | window_start        | window_end          | n |\n\
             +---+---------------------+---------------------+---+\n\
             | a | 2026-01-01T00:00:01 | 2026-01-01T00:00:08 | 2 |\n\
             | a | 2026-01-01T00:00:12 | 2026-01-01T00:00:16 | 1 |\n\
             | b | 2026-01-01T00:00:05 | 2026-01-01T00:00:09 | 1 |\n\
             +---+---------------------+---------------------+---+"
        );
        // Without a key, sessions span every key.
        let all = run(
            &ctx,
            "SELECT count(*) AS sessions FROM (SELECT DISTINCT window_start \
             FROM SESSION(t, ts, INTERVAL '4 seconds'))",
        )
        .await;
        assert!(all.contains("| 2        |"), "{all}");
    }

    #[tokio::test]
    async fn bad_window_arguments_are_explained() {
        let ctx = context().await;
        for (sql, expected) in [
            (
                "SELECT * FROM TUMBLE(t, ts)",
                "TUMBLE(table, time_column, size) takes 3 arguments",
            ),
            (
                "SELECT * FROM TUMBLE(t, k, INTERVAL '1 second')",
                "'k' is Utf8, not a timestamp",
            ),
            (
                "SELECT * FROM TUMBLE(t, ts, INTERVAL '1 month')",
                "without months",
            ),
            (
                "SELECT * FROM TUMBLE(nope, ts, INTERVAL '1 second')",
                "table 'nope' not found",
            ),
            (
                "SELECT * FROM HOP(t, ts, INTERVAL '10 seconds', INTERVAL '5 seconds')",
                "the size must be at least the slide",
            ),
        ] {
            let e = match ctx.sql(sql).await {
                Ok(frame) => frame.collect().await.unwrap_err().to_string(),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(expected), "{sql}: {e}");
        }
    }
}
