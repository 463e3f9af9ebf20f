//! Fulmen's connectors: Kafka live tables, continuous queries writing to Kafka sinks, and
//! their message formats (DESIGN.md §7; the user's view is docs/streaming.md).
//!
//! [`install`] adds them to a [`fulmen_engine::FulmenContext`]: `CREATE EXTERNAL TABLE …
//! STORED AS KAFKA` then makes a [`live::LiveTable`], and `SHOW STREAMS`, `CREATE SINK`,
//! `SHOW SINKS` and `DROP SINK` are understood by `FulmenContext::sql`. The event-time window
//! functions (`TUMBLE`, `HOP`, `SESSION`) live in `fulmen_engine::streaming`, since they work
//! on any table.

pub mod avro;
pub mod format;
mod incremental;
pub mod live;
pub mod metrics;
pub mod options;
pub mod producer;
pub mod sink;
pub mod streams;

pub use streams::{Streams, install};

#[cfg(test)]
mod tests;
