//! Fulmen's benchmark runner: TPC-H on Fulmen (GPU off and on), plain DataFusion and DuckDB,
//! side by side in one run, with every engine's answers checked against DataFusion's.
//!
//! ```text
//! data ── tpchgen → Parquet, cached per scale factor
//! engines ── each registers the Parquet files, runs every query N times (median kept)
//! compare ── every engine's rows against DataFusion's: a mismatch fails the run
//! report ── JSON, a markdown table (medians, ratios to DataFusion, geometric means), SVG
//! ```
//! `stream` measures Kafka ingest and window-close-to-alert latency (mock cluster).
//!
//! Benchmarks are not tests: they report ratios measured in one run (DESIGN.md §9).

pub mod cluster;
pub mod compare;
pub mod data;
pub mod engines;
pub mod report;
pub mod ssb;
pub mod stream;
