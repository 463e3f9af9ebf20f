//! Volley's engine: the DataFusion side of Volley.
//!
//! It owns the session a user talks to ([`VolleyContext`]), Volley's settings
//! ([`VolleyConfig`], the `volley.*` namespace of `SET` / `SHOW ALL`), object stores for
//! remote URLs, the built-in TPC-H sample data, the GPU operators (`physical_plan`) and the
//! rule that places them (`gpu::GpuOverrides`; see DESIGN.md §2 and §5).

pub mod config;
pub mod context;
pub mod display;
pub mod error;
pub mod gpu;
pub mod object_store;
pub mod physical_plan;
pub mod streaming;
pub mod tpch;

pub use config::{GpuMode, VolleyConfig};
pub use context::{StatementHandler, TableFormat, VolleyContext};
pub use error::EngineError;
pub use volley_kernels::DeviceSelection;

/// Re-exported so that users of the library need not pin DataFusion themselves.
pub use datafusion;
