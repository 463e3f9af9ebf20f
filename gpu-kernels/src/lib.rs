//! Volley's device layer: which GPUs exist and how a user selects them.
//!
//! This crate knows Arrow and CUDA but never DataFusion, so that kernels can be tested and
//! benchmarked alone. Today it owns device selection (`VOLLEY_DEVICES` / `volley.devices`)
//! and a panic-free probe of the CUDA devices on this machine; device memory, the emulated
//! device and the kernels build on these (see `docs/kernels.md` once they land).

pub mod cuda;
pub mod error;
pub mod selection;

pub use error::{KernelError, Result};
pub use selection::DeviceSelection;
