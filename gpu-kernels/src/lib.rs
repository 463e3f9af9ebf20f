//! Fulmen's device layer: GPUs through CUDA, an emulated CUDA device for machines without a
//! GPU, device memory, Arrow columns on the device, and the columnar kernels.
//!
//! This crate knows Arrow and CUDA but never DataFusion, so kernels can be tested and
//! benchmarked alone. See `docs/kernels.md` for the device model and how to add a kernel.
//!
//! ```text
//! Device ─┬─ Emulated: kernels compiled by the host C++ compiler (emu/), fibers per thread
//!         └─ Cuda:     the driver API, kernels built ahead (images.rs) or by NVRTC
//! DeviceBuffer ── bytes in a device's memory pool (budgeted)
//! DeviceColumn / DeviceBatch ── Arrow layout on the device
//! ops::{scan, compact, gather, hash, hash_table} ── launches of cuda/*.cu kernels
//! ```

pub mod column;
pub mod cost;
mod counts;
pub mod cuda;
mod cuda_backend;
pub mod device;
#[doc(hidden)]
pub mod emu;
mod emu_queue;
pub mod error;
pub mod images;
pub mod kernels;
pub mod memory;
pub mod nvrtc;
mod nvrtc_flags;
pub mod ops;
pub mod selection;

pub use column::{DeviceBatch, DeviceColumn};
pub use device::{
    Device, DeviceCounts, DeviceKind, EmulatorOptions, FaultPlan, KernelCounts, LaunchConfig,
    open_devices,
};
pub use error::{KernelError, Result};
pub use kernels::Kernel;
pub use memory::DeviceBuffer;
pub use selection::DeviceSelection;
