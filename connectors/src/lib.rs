//! Volley's connectors: Kafka sources and sinks and their message formats.
//!
//! Kafka live tables, continuous queries and sinks are planned in DESIGN.md §7 and are not
//! in this crate yet; object stores for remote files live in `volley-engine`, next to the
//! session that registers them.
