//! Fulmen's engine: the DataFusion side of Fulmen.
//!
//! It owns the session a user talks to ([`FulmenContext`]), Fulmen's settings
//! ([`FulmenConfig`], the `fulmen.*` namespace of `SET` / `SHOW ALL`), object stores for
//! remote URLs, the built-in TPC-H sample data, the GPU operators (`physical_plan`) and the
//! rule that places them (`gpu::GpuOverrides`; see DESIGN.md §2 and §5).

pub mod cache;
pub mod cluster;
pub mod config;
pub mod context;
pub mod display;
pub mod error;
pub mod gpu;
pub mod object_store;
pub mod physical_plan;
pub mod streaming;
pub mod tpch;

pub use config::{FulmenConfig, GpuMode, OnError};
pub use context::{FulmenContext, StatementHandler, TableFormat};
pub use error::EngineError;
pub use fulmen_kernels::DeviceSelection;

/// Re-exported so that users of the library need not pin DataFusion themselves.
pub use datafusion;
