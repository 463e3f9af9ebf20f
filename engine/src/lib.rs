//! Volley's engine: the DataFusion side of Volley.
//!
//! It owns the session a user talks to ([`VolleyContext`]), Volley's settings
//! ([`VolleyConfig`], the `volley.*` namespace of `SET` / `SHOW ALL`), object stores for
//! remote URLs, and the built-in TPC-H sample data. GPU operators and the planner rule that
//! places them join this crate as they land (see DESIGN.md §2 and §5).

pub mod config;
pub mod context;
pub mod display;
pub mod error;
pub mod object_store;
pub mod tpch;

pub use config::{GpuMode, VolleyConfig};
pub use context::{TableFormat, VolleyContext};
pub use error::EngineError;

/// Re-exported so that users of the library need not pin DataFusion themselves.
pub use datafusion;
