//! Putting work on GPUs: the expression compiler, the devices of this process, and the
//! `GpuOverrides` rule that swaps supported operators for their GPU twins.

pub mod compile;
pub mod devices;
pub mod fuse;
pub mod listing;
mod one_stage;
pub mod overrides;

pub use overrides::{GpuOverrides, SupportLevel, placement_report, stage_placement_report};

#[cfg(test)]
mod tests;
