//! The built-in sample data: the eight TPC-H tables, generated in process by tpchgen.
//!
//! Generation is deterministic (TPC-H's dbgen sequence), so a scale factor always gives the
//! same rows: at SF 1, 6,001,215 lineitems and 1,500,000 orders. Each table is generated in
//! as many parts as the session has target partitions, one thread a part, and kept in memory.

use std::sync::Arc;
use std::thread;

use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::record_batch::{RecordBatch, RecordBatchReader};
use datafusion::datasource::MemTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::SessionContext;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    PartSuppGenerator, RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

use crate::EngineError;

/// The eight TPC-H tables, in the order the specification lists them.
pub const TABLES: [&str; 8] = [
    "part", "supplier", "partsupp", "customer", "orders", "lineitem", "nation", "region",
];

/// The 22 TPC-H queries with the specification's validation parameters (§2.4), Q1 first.
/// Q3, Q10, Q11 and Q18 add a final sort key on a unique column so that their answers are
/// fully ordered and can be compared row by row across engines.
pub const QUERIES: [&str; 22] = [
    include_str!("tpch_queries/q01.sql"),
    include_str!("tpch_queries/q02.sql"),
    include_str!("tpch_queries/q03.sql"),
    include_str!("tpch_queries/q04.sql"),
    include_str!("tpch_queries/q05.sql"),
    include_str!("tpch_queries/q06.sql"),
    include_str!("tpch_queries/q07.sql"),
    include_str!("tpch_queries/q08.sql"),
    include_str!("tpch_queries/q09.sql"),
    include_str!("tpch_queries/q10.sql"),
    include_str!("tpch_queries/q11.sql"),
    include_str!("tpch_queries/q12.sql"),
    include_str!("tpch_queries/q13.sql"),
    include_str!("tpch_queries/q14.sql"),
    include_str!("tpch_queries/q15.sql"),
    include_str!("tpch_queries/q16.sql"),
    include_str!("tpch_queries/q17.sql"),
    include_str!("tpch_queries/q18.sql"),
    include_str!("tpch_queries/q19.sql"),
    include_str!("tpch_queries/q20.sql"),
    include_str!("tpch_queries/q21.sql"),
    include_str!("tpch_queries/q22.sql"),
];

/// Rows generated per batch.
const BATCH_ROWS: usize = 8192;

/// Rows of each table at scale factor 1 (nation and region do not scale).
fn rows_at_sf1(table: &str) -> f64 {
    match table {
        "part" => 200_000.0,
        "supplier" => 10_000.0,
        "partsupp" => 800_000.0,
        "customer" => 150_000.0,
        "orders" => 1_500_000.0,
        "lineitem" => 6_000_000.0,
        _ => 0.0,
    }
}

/// Generates part `part` (1-based) of `parts` of one table.
fn generate_part(
    table: &str,
    sf: f64,
    part: i32,
    parts: i32,
) -> Result<Vec<RecordBatch>, ArrowError> {
    fn collect(reader: impl RecordBatchReader) -> Result<Vec<RecordBatch>, ArrowError> {
        reader.collect()
    }
    match table {
        "part" => {
            collect(PartArrow::new(PartGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS))
        }
        "supplier" => collect(
            SupplierArrow::new(SupplierGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS),
        ),
        "partsupp" => collect(
            PartSuppArrow::new(PartSuppGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS),
        ),
        "customer" => collect(
            CustomerArrow::new(CustomerGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS),
        ),
        "orders" => collect(
            OrderArrow::new(OrderGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS),
        ),
        "lineitem" => collect(
            LineItemArrow::new(LineItemGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS),
        ),
        "nation" => collect(
            NationArrow::new(NationGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS),
        ),
        "region" => collect(
            RegionArrow::new(RegionGenerator::new(sf, part, parts)).with_batch_size(BATCH_ROWS),
        ),
        other => Err(ArrowError::InvalidArgumentError(format!(
            "no TPC-H table named {other}"
        ))),
    }
}

fn schema_of(table: &str) -> SchemaRef {
    match table {
        "part" => PartArrow::schema_ref(),
        "supplier" => SupplierArrow::schema_ref(),
        "partsupp" => PartSuppArrow::schema_ref(),
        "customer" => CustomerArrow::schema_ref(),
        "orders" => OrderArrow::schema_ref(),
        "lineitem" => LineItemArrow::schema_ref(),
        "nation" => NationArrow::schema_ref(),
        _ => RegionArrow::schema_ref(),
    }
}

/// Generates one TPC-H table at scale factor `sf` in `parts` parts (one thread each); each
/// part is a list of record batches.
pub fn generate_batches(
    table: &str,
    sf: f64,
    parts: usize,
) -> Result<(SchemaRef, Vec<Vec<RecordBatch>>)> {
    if !TABLES.contains(&table) {
        return Err(DataFusionError::Plan(format!(
            "no TPC-H table named '{table}' (the tables are {})",
            TABLES.join(", ")
        )));
    }
    // Small tables are not worth splitting: a part should hold at least one batch.
    let rows = rows_at_sf1(table) * sf;
    let parts = parts.clamp(1, ((rows / BATCH_ROWS as f64).ceil() as usize).max(1)) as i32;
    let generated: Vec<Result<Vec<RecordBatch>, ArrowError>> = thread::scope(|scope| {
        let handles: Vec<_> = (1..=parts)
            .map(|part| scope.spawn(move || generate_part(table, sf, part, parts)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(ArrowError::ExternalError(
                        "TPC-H generator thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let partitions = generated
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| DataFusionError::ArrowError(Box::new(e), None))?;
    Ok((schema_of(table), partitions))
}

/// Generates one TPC-H table at scale factor `sf` as an in-memory table of `parts` partitions.
pub fn generate_table(table: &str, sf: f64, parts: usize) -> Result<MemTable> {
    let (schema, partitions) = generate_batches(table, sf, parts)?;
    MemTable::try_new(schema, partitions)
}

/// Checks a scale factor: above 0 and at most 1000.
pub fn check_scale_factor(sf: f64) -> Result<()> {
    if !(sf > 0.0 && sf <= 1000.0) {
        return Err(EngineError::InvalidScaleFactor(sf).into());
    }
    Ok(())
}

/// Generates all eight TPC-H tables at scale factor `sf` and registers them in `ctx`,
/// replacing tables of the same names.
pub fn register(ctx: &SessionContext, sf: f64) -> Result<()> {
    check_scale_factor(sf)?;
    let parts = ctx.copied_config().target_partitions();
    for table in TABLES {
        let provider = generate_table(table, sf, parts)?;
        ctx.deregister_table(table)?;
        ctx.register_table(table, Arc::new(provider))?;
    }
    Ok(())
}
